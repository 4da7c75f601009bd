//! One finished run's figures, as a submission needs them: read from its `report.json`
//! (sections `run`, `train`, `artifact`, `eval`) and its resolved `config.toml`. Every figure
//! a check or the records folder uses is here, with the key it came from, so that a missing
//! one is an error naming the file and the key rather than a silent zero.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;
use serde_json::Value;

use crate::report::size_advice::SizeFacts;
use crate::runtime::build_info::SourceBundle;

/// A timed piece of the training or the evaluation budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Part {
    /// What it is (`training loop`, `GPTQ calibration + quantization`, `quantized_ttt` ...).
    pub what: String,
    /// Milliseconds.
    pub ms: f64,
    /// The report key it was read from.
    pub key: String,
}

/// A score of the validation split.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Score {
    /// The log label (`quantized_ttt`, `quantized_sliding_window`, `quantized`).
    pub label: String,
    /// Mean loss per token, nats.
    pub val_loss: f64,
    /// Bits per byte.
    pub val_bpb: f64,
    /// Targets scored.
    pub val_tokens: u64,
    /// Their bytes by the challenge's rule.
    pub val_bytes: u64,
}

/// One run's figures.
#[derive(Clone, Debug, Serialize)]
pub struct RunFigures {
    /// The run directory.
    pub dir: PathBuf,
    /// `run.name`.
    pub name: String,
    /// `run.seed` of its config.
    pub seed: u64,
    /// `run.status` (`completed` for a run that can be submitted).
    pub status: String,
    /// Where it ran: `run.hardware` of the report, else `run.device` and `run.world_size` of
    /// the config.
    pub hardware: String,
    /// Optimizer steps.
    pub steps: u64,
    /// Mean step time, ms (validation excluded).
    pub step_avg_ms: f64,
    /// Validation bpb of the trained weights before quantization (`artifact.before`, else the
    /// last validation).
    pub pre_quant_bpb: Option<f64>,
    /// The round trip's bpb (`artifact.after`).
    pub post_quant_bpb: Option<f64>,
    /// The sliding-window bpb of the quantized weights (`eval.sliding`).
    pub sliding_bpb: Option<f64>,
    /// The TTT bpb (`eval.ttt`).
    pub post_ttt_bpb: Option<f64>,
    /// The score submitted: the last evaluation (TTT, else sliding, else the round trip).
    pub score: Score,
    /// Compressed model bytes (`artifact.bytes`).
    pub artifact_bytes: Option<u64>,
    /// Code bytes counted (`artifact.code_bytes`): the source bundle's size when measured.
    pub code_bytes: u64,
    /// How they were counted (`artifact.code`).
    pub code_how: String,
    /// The run's source bundle (`artifact.code.measured`); `None` when the code was stated by
    /// `code_bytes` or not measured, which a submission refuses.
    pub bundle: Option<SourceBundle>,
    /// What the size advice needs (`artifact.quantized_values`, `lqer_bytes`, `bits`, `clip`,
    /// `clip_sigmas`), `over` unset.
    pub size: SizeFacts,
    /// What is wrong with the files judged in the run directory given, if anything: the
    /// artifact not there, not the size or the SHA-256 the run recorded, or named outside the
    /// directory; `config.toml` not the one the run recorded (`run.files`). `None` when they
    /// are the files the run wrote.
    pub files_problem: Option<String>,
    /// What counts against the training budget.
    pub train_parts: Vec<Part>,
    /// What ran after training but counts against neither budget (shown, not added).
    pub uncounted: Vec<Part>,
    /// What counts against the evaluation budget.
    pub eval_parts: Vec<Part>,
    /// The resolved config, flattened to `table.key = value` (TOML text of each value).
    pub config: BTreeMap<String, String>,
}

/// Config keys that may differ between the seeds of one submission: the seed itself and what
/// only names, places or measures a run.
pub const FREE_KEYS: [&str; 10] = [
    "run.seed",
    "run.name",
    "run.out_dir",
    "run.trace",
    "run.trace_items",
    "run.instrument",
    "run.sample_interval_us",
    "run.drain_timeout_ms",
    "run.max_memory_gb",
    "ablation",
];

impl RunFigures {
    /// Reads `dir/report.json` and `dir/config.toml`.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let report_path = dir.join("report.json");
        let text = std::fs::read_to_string(&report_path)
            .with_context(|| format!("{}: not a finished run directory (cannot read report.json)", dir.display()))?;
        let r: Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", report_path.display()))?;
        let config_path = dir.join("config.toml");
        let config_text = std::fs::read_to_string(&config_path).with_context(|| format!("{}: cannot read", config_path.display()))?;
        let config_value: toml::Table =
            toml::from_str(&config_text).with_context(|| format!("{}: not a TOML table", config_path.display()))?;
        let mut config = BTreeMap::new();
        flatten("", &toml::Value::Table(config_value), &mut config);
        let file = report_path.display().to_string();
        let num = |path: &str| -> anyhow::Result<f64> {
            at(&r, path).and_then(Value::as_f64).with_context(|| format!("{file}: no number at `{path}`"))
        };
        let opt = |path: &str| at(&r, path).and_then(Value::as_f64);
        let seed = config
            .get("run.seed")
            .and_then(|s| s.parse::<u64>().ok())
            .with_context(|| format!("{}: no `run.seed`", config_path.display()))?;
        let status = at(&r, "run.status").and_then(Value::as_str).unwrap_or("unknown").to_string();
        let hardware = match at(&r, "run.hardware").and_then(Value::as_str) {
            Some(h) => h.to_string(),
            None => {
                let device = config.get("run.device").map(|d| d.trim_matches('"').to_string()).unwrap_or_else(|| "cpu".into());
                let world = config.get("run.world_size").cloned().unwrap_or_else(|| "1".into());
                format!("{world} x {device} (the report does not name the hardware)")
            }
        };

        // The last evaluation present is the score; once present, every figure of it must be
        // (a diverged TTT is an error, not a quiet fall back to the sliding score).
        let score_of = |path: &str, label: String| -> anyhow::Result<Option<Score>> {
            let Some(s) = at(&r, path) else { return Ok(None) };
            let get = |k: &str| s.get(k).filter(|v| !v.is_null());
            let need = |k: &str| get(k).and_then(Value::as_f64).with_context(|| format!("{file}: no number at `{path}.{k}`"));
            let count = |k: &str, fallback: &str| {
                get(k)
                    .and_then(Value::as_u64)
                    .or_else(|| at(&r, fallback)?.as_u64())
                    .with_context(|| format!("{file}: no count at `{path}.{k}`"))
            };
            Ok(Some(Score {
                label,
                val_loss: need("val_loss")?,
                val_bpb: need("val_bpb")?,
                val_tokens: count("val_tokens", "artifact.val_tokens")?,
                val_bytes: count("val_bytes", "train.val_bytes")?,
            }))
        };
        let eval_weights = at(&r, "eval.weights").and_then(Value::as_str).unwrap_or("quantized").to_string();
        let ttt_label = if at(&r, "eval.ttt.kind").and_then(Value::as_str) == Some("phased") { "ttt_phased" } else { "ttt" };
        let score = match score_of("eval.ttt", format!("{eval_weights}_{ttt_label}"))? {
            Some(s) => Some(s),
            None => match score_of("eval.sliding", format!("{eval_weights}_sliding_window"))? {
                Some(s) => Some(s),
                None => score_of("artifact.after", "quantized".into())?,
            },
        }
        .with_context(|| {
            format!("{file}: no score: neither `eval.ttt`, `eval.sliding` nor `artifact.after` (the run has no evaluation)")
        })?;

        let mut train_parts = vec![Part {
            what: "training loop (validation excluded)".into(),
            ms: num("train.train_time_ms")?,
            key: "train.train_time_ms".into(),
        }];
        let mut uncounted = Vec::new();
        let mut eval_parts = Vec::new();
        if let Some(ms) = opt("train.attention_auto.wall_ms").filter(|ms| *ms > 0.0) {
            // Kernel trials on the run's GPU before the loop's timer: a warm-up.
            train_parts.push(Part { what: "attention trials before the timer".into(), ms, key: "train.attention_auto.wall_ms".into() });
        }
        if at(&r, "artifact").is_some_and(|a| !a.is_null()) {
            let method = at(&r, "artifact.method").and_then(Value::as_str).unwrap_or("artifact");
            // GPTQ's calibration reads training data: inside the training budget (as the
            // records' gptq_reserve_seconds), with the quantization it feeds.
            let reserve = num("artifact.reserve_ms")?;
            train_parts.push(Part { what: format!("{method} calibration + quantization"), ms: reserve, key: "artifact.reserve_ms".into() });
            if let Some(ms) = opt("artifact.compress_ms") {
                uncounted.push(Part { what: "serializing and compressing the artifact".into(), ms, key: "artifact.compress_ms".into() });
            }
            if let Some(ms) = opt("artifact.before.eval_ms") {
                uncounted.push(Part { what: "pre-quantization validation (diagnostic)".into(), ms, key: "artifact.before.eval_ms".into() });
            }
            eval_parts.push(Part {
                what: "reading, decompressing and dequantizing the artifact".into(),
                ms: num("artifact.restore_ms")?,
                key: "artifact.restore_ms".into(),
            });
            if at(&r, "artifact.after").is_some() {
                let ms = num("artifact.after.eval_ms")?;
                eval_parts.push(Part { what: "quantized round-trip score".into(), ms, key: "artifact.after.eval_ms".into() });
            }
        }
        for (key, what) in [("eval.sliding", "sliding_window"), ("eval.ttt", "ttt")] {
            if at(&r, key).is_some() {
                let what = if key == "eval.ttt" { ttt_label } else { what };
                eval_parts.push(Part {
                    what: format!("{eval_weights}_{what}"),
                    ms: num(&format!("{key}.eval_ms"))?,
                    key: format!("{key}.eval_ms"),
                });
            }
        }
        let pre_quant_bpb = opt("artifact.before.val_bpb").or_else(|| opt("train.val_bpb"));
        let (bundle, code_how) = code_of(at(&r, "artifact.code"));
        Ok(Self {
            dir: dir.to_path_buf(),
            name: at(&r, "run.name").and_then(Value::as_str).unwrap_or("").to_string(),
            seed,
            status,
            hardware,
            steps: at(&r, "train.steps")
                .and_then(Value::as_u64)
                .with_context(|| format!("{file}: no `train.steps` (not a training run)"))?,
            step_avg_ms: num("train.step_avg_ms")?,
            pre_quant_bpb,
            post_quant_bpb: opt("artifact.after.val_bpb"),
            sliding_bpb: opt("eval.sliding.val_bpb"),
            post_ttt_bpb: opt("eval.ttt.val_bpb"),
            score,
            artifact_bytes: at(&r, "artifact.bytes").and_then(Value::as_u64),
            code_bytes: at(&r, "artifact.code_bytes").and_then(Value::as_u64).unwrap_or(0),
            code_how,
            bundle,
            size: SizeFacts {
                over: 0,
                model_bytes: at(&r, "artifact.bytes").and_then(Value::as_u64).unwrap_or(0),
                values: at(&r, "artifact.quantized_values").and_then(Value::as_u64).unwrap_or(0),
                bits: at(&r, "artifact.bits").and_then(Value::as_u64).map_or(0, |b| b as u8),
                clip_sigmas: (at(&r, "artifact.clip").and_then(Value::as_str) == Some("sd_clip"))
                    .then(|| at(&r, "artifact.clip_sigmas").and_then(Value::as_f64))
                    .flatten(),
                lqer_bytes: at(&r, "artifact.lqer_bytes").and_then(Value::as_u64).unwrap_or(0),
            },
            files_problem: files_problem(dir, &r),
            train_parts,
            uncounted,
            eval_parts,
            config,
        })
    }

    /// The source bundle, or why there is none.
    pub fn measured_bundle(&self) -> Result<&SourceBundle, String> {
        self.bundle.as_ref().ok_or_else(|| format!("code size not measured: {}", self.code_how))
    }

    /// Training time against the budget, s.
    pub fn train_s(&self) -> f64 {
        self.train_parts.iter().map(|p| p.ms).sum::<f64>() / 1e3
    }

    /// Evaluation time against the budget, s.
    pub fn eval_s(&self) -> f64 {
        self.eval_parts.iter().map(|p| p.ms).sum::<f64>() / 1e3
    }

    /// Artifact plus code bytes.
    pub fn total_bytes(&self) -> Option<u64> {
        self.artifact_bytes.map(|a| a + self.code_bytes)
    }

    /// The config's settings that must agree between seeds (all but [`FREE_KEYS`]).
    pub fn fixed_config(&self) -> BTreeMap<&str, &str> {
        self.config
            .iter()
            .filter(|(k, _)| !FREE_KEYS.iter().any(|f| *k == f || k.starts_with(&format!("{f}."))))
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
}

/// The artifact the report names and `config.toml` (what `one config` judges), judged in
/// `dir` (the folder given, not where the run was) against what the run recorded.
fn files_problem(dir: &Path, r: &Value) -> Option<String> {
    let files = crate::runtime::files::recorded_of(r);
    crate::runtime::files::recorded_artifact(dir, r)
        .and_then(|_| crate::runtime::files::check_recorded(dir, "config.toml", &files))
        .err()
        .map(|e| format!("{e:#}"))
}

/// `a.b.c` in a JSON document.
fn at<'a>(v: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(v, |v, k| v.get(k)).filter(|v| !v.is_null())
}

/// Flattens a TOML table into `a.b = <value as TOML>` (arrays whole).
fn flatten(prefix: &str, v: &toml::Value, out: &mut BTreeMap<String, String>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

/// `artifact.code` as the run wrote it: the bundle when measured, and how the code was counted
/// in words.
fn code_of(code: Option<&Value>) -> (Option<SourceBundle>, String) {
    let Some(Value::Object(m)) = code else { return (None, "the run counted no code".into()) };
    if let Some(b) = m.get("measured") {
        return match serde_json::from_value::<SourceBundle>(b.clone()) {
            Ok(b) => {
                let how = format!(
                    "{} of the {}: {} source files, {} bytes stripped to {}",
                    b.file,
                    b.build.line(),
                    b.files,
                    b.raw_bytes,
                    b.stripped_bytes
                );
                (Some(b), how)
            }
            Err(_) => (None, "counted by an older version over the whole tree, with no source bundle".into()),
        };
    }
    let how = match (m.get("given"), m.get("unmeasured")) {
        (Some(n), _) => format!("stated by the config (`code_bytes` = {n}), not measured"),
        (_, Some(Value::String(why))) => format!("not measured ({why})"),
        _ => "not counted".into(),
    };
    (None, how)
}
