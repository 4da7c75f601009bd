//! The post-training round trip (spec 3.10, 4.5, 4.6) on a weights file or a run's final
//! weights: (for GPTQ) collect the Hessians on training data, quantize, compress, write the
//! artifact atomically, report its size and the code's against the 16,000,000-byte cap, then read
//! it back, check it was made for this `[model]`, dequantize, and score the validation split
//! again: the round-trip val_bpb is the challenge's score.
//!
//! Log lines follow the scripts': the record's labels
//! `pre-quantization post-ema val_loss:X val_bpb:Y eval_time:Tms` and `quantized val_loss:X
//! val_bpb:Y eval_time:Tms` (8 decimals), the baseline's `final_int8_zlib_roundtrip val_loss:X
//! val_bpb:Y eval_time:Tms` and `final_int8_zlib_roundtrip_exact val_loss:X val_bpb:Y`, and the
//! sizes: `Serialized model int6/int8+brotli: N bytes (payload:P raw:R payload_ratio:X.XXx)`,
//! `Code size: C bytes ...`, `Total submission size ...: N + C = T bytes ... of the cap`.

use std::path::Path;
#[cfg(feature = "tools")]
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use super::bundle::Bundle;
use super::format::from_bytes;
use super::gptq::GptqConfig;
use super::hessian::{Hessians, collect_from_training_data, targets};
use super::quant::{ARTIFACT_CAP_BYTES, ArtifactStats, QuantConfig, Rounding, quantize};
use crate::eval::bpb::BpbAccumulator;
use crate::eval::executor::EvalExecutor;
#[cfg(feature = "tools")]
use crate::eval::validation::Validator;
use crate::eval::validation::tokens_per_pass;
use crate::model::{Gpt, ModelConfig};
use crate::report::size_advice::{SizeFacts, advice};
use crate::train::config::Config;

/// How an artifact's matrices are rounded: the `artifact` stage's two implementations.
#[derive(Clone, Debug)]
pub enum Method {
    /// Each value to its nearest level (the baseline's round trip).
    Nearest,
    /// GPTQ with Hessians from `calibration_batches` training micro-batches (spec 4.5).
    Gptq {
        /// The algorithm's settings.
        gptq: GptqConfig,
        /// Calibration micro-batches (64 in the record).
        calibration_batches: usize,
    },
}

impl Method {
    /// `round_to_nearest` or `gptq`, as logs and reports name it.
    pub fn name(&self) -> &'static str {
        match self {
            Method::Nearest => "round_to_nearest",
            Method::Gptq { .. } => "gptq",
        }
    }
}

/// The code bytes counted against the cap with the model's.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CodeBytes {
    /// Measured: the run's source bundle ([`super::bundle`]), written into its run directory.
    Measured(Bundle),
    /// Given in the config (`code_bytes`): a figure for experiments, which `pipeline
    /// submission` refuses.
    Given(u64),
    /// Not counted, and why (no dep-info beside the binary, sources changed since the build).
    Unmeasured(String),
}

impl CodeBytes {
    /// Packs this binary's sources into `run_dir` ([`super::bundle`]); [`CodeBytes::Unmeasured`]
    /// with the reason when that cannot be done (it takes a few seconds: start it early, on its
    /// own thread).
    pub fn measure(run_dir: &std::path::Path) -> Self {
        let made = super::bundle::of_this_binary().and_then(|(b, bytes, s)| super::bundle::write(run_dir, &b, &bytes, &s.root).map(|()| b));
        match made {
            Ok(b) => CodeBytes::Measured(b),
            Err(e) => CodeBytes::Unmeasured(format!("{e:#}")),
        }
    }

    /// The bytes counted (0 when not measured).
    pub fn bytes(&self) -> u64 {
        match self {
            CodeBytes::Measured(b) => b.bytes,
            CodeBytes::Given(n) => *n,
            CodeBytes::Unmeasured(_) => 0,
        }
    }

    /// The log line.
    pub fn line(&self) -> String {
        match self {
            CodeBytes::Measured(b) => format!(
                "Code size: {} bytes ({}: {} source files of the {}, {} bytes, {} stripped)",
                b.bytes,
                b.file,
                b.files,
                b.build.line(),
                b.raw_bytes,
                b.stripped_bytes
            ),
            CodeBytes::Given(n) => {
                format!("Code size: {n} bytes (as given by `code_bytes`: not measured, refused by `pipeline submission`)")
            }
            CodeBytes::Unmeasured(why) => format!("Code size: not measured ({why})"),
        }
    }
}

/// What a calibration took, for logs and reports.
#[derive(Clone, Debug, Serialize)]
pub struct CalibrationStats {
    /// Matrices with a Hessian (67 for the record).
    pub hessians: usize,
    /// Distinct inputs summed (q, k and v share one).
    pub distinct: usize,
    /// Calibration micro-batches.
    pub batches: usize,
    /// Their tokens.
    pub tokens: u64,
    /// Wall time, ms.
    pub ms: f64,
}

impl CalibrationStats {
    fn of(h: &Hessians, took: Duration) -> Self {
        Self { hessians: h.by_weight.len(), distinct: h.distinct, batches: h.batches, tokens: h.tokens, ms: took.as_secs_f64() * 1e3 }
    }
}

/// An artifact written and read back.
pub struct Written {
    /// Its sizes.
    pub stats: ArtifactStats,
    /// The payload's byte counts (quantized values, LQER's corrections, ...).
    pub payload: super::quant::PayloadStats,
    /// What became of each tensor ([`super::quant::Quantized::kind_lines`]).
    pub kinds: Vec<String>,
    /// Bytes of the weights as float tensors.
    pub raw_bytes: u64,
    /// The weights dequantized from the file as read back (f32, CPU).
    pub restored: Vec<(String, Tensor)>,
    /// Quantizing (GPTQ or rounding).
    pub quantize: Duration,
    /// Serializing and compressing.
    pub compress: Duration,
    /// Writing the file (atomically).
    pub write: Duration,
    /// Reading it back, decompressing, checking it and dequantizing: what a scoring run does
    /// before it evaluates, so it counts against the evaluation time (seconds with `pergroup`,
    /// whose ZPAQ decompresses about as slowly as it compresses).
    pub restore: Duration,
}

/// The Hessians GPTQ needs for `state` (weights of the `[model]` in `config`): a model of them
/// on the run's device and `executor`, looped, through [`collect_from_training_data`], forward
/// passes as large as a validation pass (candle) or the training micro-batch (the engine). `None` when `keep_going` stopped it.
pub fn calibrate(
    config: &Config,
    state: &[(String, Tensor)],
    batches: usize,
    executor: EvalExecutor,
    keep_going: impl FnMut() -> bool,
) -> anyhow::Result<Option<(Hessians, CalibrationStats)>> {
    let t0 = Instant::now();
    let shape = config.batch_shape()?;
    let rows_per_pass = match executor {
        // Candle: passes as large as a validation pass.
        EvalExecutor::Candle => tokens_per_pass(&config.validation(), config.run.world_size, shape.micro_steps) / shape.seq_len,
        // The engine: its micro-batches of the training rows.
        EvalExecutor::Engine => shape.rows,
    };
    let mut model = crate::train::engine_eval::open(model_from(config, state)?, executor, rows_per_pass, shape.seq_len)?;
    let h = collect_from_training_data(model.as_mut(), config, batches, rows_per_pass, targets(state), keep_going)
        .context("collecting GPTQ's Hessians")?;
    Ok(h.map(|h| {
        let stats = CalibrationStats::of(&h, t0.elapsed());
        (h, stats)
    }))
}

/// Quantizes `state` (weights of `model`) as `q` and `method` say (with `hessians` for GPTQ),
/// compresses it, writes the artifact atomically to `out` with the settings and `model` in its
/// manifest, then reads the file back and restores it as [`restore`] does.
pub fn write_and_restore(
    state: &[(String, Tensor)],
    model: &ModelConfig,
    q: &QuantConfig,
    method: &Method,
    hessians: Option<&Hessians>,
    out: &Path,
) -> anyhow::Result<Written> {
    q.check()?;
    q.codec.check_available().context("`codec`")?;
    let raw_bytes: u64 = state.iter().map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum();
    let t0 = Instant::now();
    let empty = std::collections::HashMap::new();
    let rounding = match method {
        Method::Nearest => Rounding::Nearest,
        Method::Gptq { gptq, .. } => Rounding::Gptq(gptq, hessians.map_or(&empty, |h| &h.by_weight)),
    };
    let info = serde_json::json!({
        "method": method.name(),
        "quant": q,
        "gptq": match method { Method::Gptq { gptq, calibration_batches } => serde_json::json!({
            "damping": gptq.damping, "block_size": gptq.block_size, "act_order": gptq.act_order,
            "calibration_batches": calibration_batches,
            "hessians": hessians.map(|h| h.by_weight.len()),
        }), Method::Nearest => serde_json::Value::Null },
        "model": model,
    });
    let quantized = quantize(state, q, rounding)?.with_info(info);
    let quantize_time = t0.elapsed();
    let kinds = quantized.kind_lines();
    let payload = quantized.stats();
    let t0 = Instant::now();
    let artifact = quantized.compress(q.codec, q.level, q.byte_shuffle)?;
    let compress = t0.elapsed();
    let t1 = Instant::now();
    crate::runtime::rundir::write_atomic_if_changed(out, &artifact.bytes)?;
    let write = t1.elapsed();
    let t2 = Instant::now();
    let restored = restore(out, model)?;
    Ok(Written {
        stats: artifact.stats,
        payload,
        kinds,
        raw_bytes,
        restored,
        quantize: quantize_time,
        compress,
        write,
        restore: t2.elapsed(),
    })
}

/// Reads the artifact at `path`, refuses it when its manifest names another `[model]` than
/// `model` (the first differing key), and dequantizes it to f32 on the CPU.
pub fn restore(path: &Path, model: &ModelConfig) -> anyhow::Result<Vec<(String, Tensor)>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read the artifact {}", path.display()))?;
    restore_bytes(&bytes, model, &path.display().to_string())
}

/// [`restore`] of an artifact's bytes (`name` says where they came from, for errors): what
/// the other ranks of a data-parallel run restore from rank 0's file, sent to them.
pub fn restore_bytes(bytes: &[u8], model: &ModelConfig, name: &str) -> anyhow::Result<Vec<(String, Tensor)>> {
    let qz = from_bytes(bytes).with_context(|| format!("cannot read the artifact {name}"))?;
    if let Some(saved) = qz.info().and_then(|i| i.get("model")) {
        let then: ModelConfig = serde_json::from_value(saved.clone())
            .with_context(|| format!("the artifact {name} names a `[model]` this version does not read"))?;
        if let Some((key, x, y)) = then.differences(model).into_iter().next() {
            anyhow::bail!("the artifact {name} was made for `model.{key}` = {x}; the config gives {y}");
        }
    }
    qz.dequantize(Some(DType::F32), &Device::Cpu).with_context(|| format!("cannot restore the artifact {name}"))
}

/// What the size advice needs of an artifact `over` bytes over the cap.
pub fn size_facts(q: &QuantConfig, w: &Written, over: u64) -> SizeFacts {
    SizeFacts {
        over,
        model_bytes: w.stats.compressed_bytes,
        values: w.payload.int_bytes,
        bits: q.bits,
        clip_sigmas: (q.clip == super::quant::Clip::SdClip).then_some(q.clip_sigmas),
        lqer_bytes: w.payload.lqer_bytes,
    }
}

/// The size lines of the log: the script's `Serialized model ...` line, the code's, and the
/// total against the cap.
pub fn size_lines(q: &QuantConfig, w: &Written, code: &CodeBytes) -> [String; 3] {
    let s = &w.stats;
    let width = format!("{}+{}", q.width_name(), q.codec);
    let total = s.compressed_bytes + code.bytes();
    let verdict = if total <= ARTIFACT_CAP_BYTES {
        format!("fits, {} bytes to spare", ARTIFACT_CAP_BYTES - total)
    } else {
        format!("OVER THE CAP by {} bytes: {}", total - ARTIFACT_CAP_BYTES, advice(&size_facts(q, w, total - ARTIFACT_CAP_BYTES)))
    };
    [
        format!(
            "Serialized model {width}: {} bytes (payload:{} raw:{} payload_ratio:{:.2}x)",
            s.compressed_bytes,
            s.payload_bytes,
            w.raw_bytes,
            w.raw_bytes as f64 / s.payload_bytes.max(1) as f64
        ),
        code.line(),
        format!(
            "Total submission size {width}: {total} bytes (model {} + code {}) of the {ARTIFACT_CAP_BYTES}-byte cap: {verdict}",
            s.compressed_bytes,
            code.bytes()
        ),
    ]
}

/// The baseline's round-trip lines (`final_int8_zlib_roundtrip` and its `_exact` twin).
pub fn baseline_lines(q: &QuantConfig, acc: &BpbAccumulator, ms: f64) -> [String; 2] {
    let tag = format!("final_int{}_{}_roundtrip", q.bits, q.codec);
    [
        format!("{tag} val_loss:{:.4} val_bpb:{:.4} eval_time:{ms:.0}ms", acc.val_loss(), acc.val_bpb()),
        format!("{tag}_exact val_loss:{:.8} val_bpb:{:.8}", acc.val_loss(), acc.val_bpb()),
    ]
}

/// What `pipeline artifact` measured.
#[derive(Clone, Debug, Serialize)]
#[cfg(feature = "tools")]
pub struct ArtifactReport {
    /// The artifact file.
    pub path: PathBuf,
    /// `round_to_nearest` or `gptq`.
    pub method: &'static str,
    /// Its sizes.
    pub stats: ArtifactStats,
    /// What became of each tensor ([`super::quant::Quantized::kind_lines`]).
    pub kinds: Vec<String>,
    /// The code counted with it.
    pub code: CodeBytes,
    /// Bytes of the weights as float tensors.
    pub raw_bytes: u64,
    /// Whether the artifact and the code fit the cap.
    pub fits_cap: bool,
    /// The calibration, for GPTQ.
    pub calibration: Option<CalibrationStats>,
    /// Quantizing (GPTQ or rounding), ms.
    pub quantize_ms: f64,
    /// Serializing and compressing, ms.
    pub compress_ms: f64,
    /// Reading the artifact back, decompressing and dequantizing, ms (counts against evaluation).
    pub restore_ms: f64,
    /// val_loss / val_bpb of the weights before quantization.
    pub before: (f64, f64),
    /// val_loss / val_bpb after the round trip.
    pub after: (f64, f64),
    /// Scored validation tokens.
    pub val_tokens: u64,
    /// Round-trip evaluation time, ms.
    pub eval_ms: f64,
}

/// The default artifact path: beside the weights, `<stem>.int<bits>.<codec>.pgqz`.
#[cfg(feature = "tools")]
pub fn default_path(weights: &Path, q: &QuantConfig) -> PathBuf {
    let stem = weights.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    weights.with_file_name(format!("{stem}.int{}.{}.pgqz", q.bits, q.codec))
}

/// Quantizes `weights` (a safetensors file of the `[model]` in `config`) into `out` with
/// `method`, then scores the round trip on one process over the whole validation split, or its
/// first `val_max_tokens` targets when that is not 0 (said in the log); `log` receives the lines.
/// `pipeline artifact`'s round trip, on the candle model (a tool: the full build).
#[cfg(feature = "tools")]
#[allow(clippy::too_many_arguments)]
pub fn build(
    config: &Config,
    weights: &Path,
    q: &QuantConfig,
    method: &Method,
    out: &Path,
    val_max_tokens: usize,
    code: CodeBytes,
    mut log: impl FnMut(&str),
) -> anyhow::Result<ArtifactReport> {
    q.check()?;
    q.codec.check_available().context("`codec`")?;
    // The score is the whole split's, on this one process, whatever the training run capped.
    let mut config = config.clone();
    config.train.val_max_tokens = val_max_tokens;
    config.run.world_size = 1;
    config.run.rank = 0;
    let config = &config;
    let shape = config.batch_shape()?;
    let validator = Validator::load(&config.validation(), shape.micro_steps)?;
    if validator.targets() < validator.split_targets() {
        log(&format!(
            "note: scoring the first {} of the {} validation targets (--val-max-tokens); the challenge scores them all",
            validator.targets(),
            validator.split_targets()
        ));
    }
    let mut model = Gpt::new(&config.model, config.run.seed, DType::F32, &Device::Cpu)?;
    let tensors = crate::model::weights::load(weights, Some(DType::F32))?;
    model.load_state(&tensors).with_context(|| format!("{} does not fit `[model]`", weights.display()))?;
    let score = |m: &Gpt| -> anyhow::Result<(BpbAccumulator, f64)> {
        let t0 = Instant::now();
        let acc = validator.run(m, || true)?.context("validation did not finish")?;
        Ok((acc, t0.elapsed().as_secs_f64() * 1e3))
    };
    let (before, before_ms) = score(&model)?;
    log(&before.score_line("pre-quantization", before_ms));
    let state = model.state_dict();
    let calibration = match method {
        Method::Gptq { calibration_batches, .. } => {
            let (h, stats) =
                calibrate(config, &state, *calibration_batches, EvalExecutor::Candle, || true)?.context("calibration stopped")?;
            log(&calibration_line(&stats));
            Some((h, stats))
        }
        Method::Nearest => None,
    };
    let written = write_and_restore(&state, &config.model, q, method, calibration.as_ref().map(|(h, _)| h), out)?;
    log(&format!(
        "artifact {}: {} {:.1}s, compression {:.1}s, restore {:.1}s (read back, decompress, dequantize: counts against evaluation)",
        out.display(),
        method.name(),
        written.quantize.as_secs_f64(),
        written.compress.as_secs_f64(),
        written.restore.as_secs_f64()
    ));
    for l in &written.kinds {
        log(&format!("  {l}"));
    }
    for l in size_lines(q, &written, &code) {
        log(&l);
    }
    let (s, raw_bytes, kinds) = (written.stats, written.raw_bytes, written.kinds);
    let fits = s.compressed_bytes + code.bytes() <= ARTIFACT_CAP_BYTES;
    let (quantize_ms, compress_ms) = (written.quantize.as_secs_f64() * 1e3, written.compress.as_secs_f64() * 1e3);
    let restore_ms = written.restore.as_secs_f64() * 1e3;
    let state: std::collections::HashMap<_, _> = written.restored.into_iter().collect();
    model.load_state(&state)?;
    let (after, eval_ms) = score(&model)?;
    log(&after.score_line("quantized", eval_ms));
    for l in baseline_lines(q, &after, eval_ms) {
        log(&l);
    }
    Ok(ArtifactReport {
        path: out.to_path_buf(),
        method: method.name(),
        stats: s,
        kinds,
        code,
        raw_bytes,
        fits_cap: fits,
        calibration: calibration.map(|(_, s)| s),
        quantize_ms,
        compress_ms,
        restore_ms,
        before: (before.val_loss(), before.val_bpb()),
        after: (after.val_loss(), after.val_bpb()),
        val_tokens: after.tokens(),
        eval_ms,
    })
}

/// The calibration's log line.
pub fn calibration_line(c: &CalibrationStats) -> String {
    format!(
        "gptq:collected {} Hessians ({} distinct inputs) from {} calibration batches ({} tokens) in {:.1}s",
        c.hessians,
        c.distinct,
        c.batches,
        c.tokens,
        c.ms / 1e3
    )
}

/// A model of `[model]` on the run's device holding `weights` (f32), looped when the model has
/// depth recurrence (as every evaluation after training runs).
pub fn model_from(config: &Config, weights: &[(String, Tensor)]) -> anyhow::Result<Gpt> {
    let device = crate::device::open(&config.run)?;
    let mut model = Gpt::new(&config.model, config.run.seed, DType::F32, &device)?;
    let state: std::collections::HashMap<_, _> = weights.iter().cloned().collect();
    model.load_state(&state).context("the weights do not fit `[model]`")?;
    debug_assert_eq!(model.looping(), config.model.recurrent());
    Ok(model)
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;
    use crate::artifact::hessian::collect;
    use crate::artifact::quant::Clip;

    /// Two blocks of width 160 with MLP x4: `fc` and `mlp.proj` (102,400 elements) and the
    /// 512 x 160 embedding are quantized; the rest stays float.
    fn cfg() -> ModelConfig {
        ModelConfig { vocab_size: 512, num_layers: 2, model_dim: 160, num_heads: 4, num_kv_heads: 2, mlp_mult: 4, ..ModelConfig::default() }
    }

    /// A model of `cfg()` with every weight perturbed, and Hessians from three random batches.
    fn trained_like() -> (Gpt, Hessians) {
        let mut m = Gpt::new(&cfg(), 2, DType::F32, &Device::Cpu).unwrap();
        let mut rng = fastrand::Rng::with_seed(6);
        let state: HashMap<String, Tensor> = m
            .state_dict()
            .into_iter()
            .map(|(n, t)| {
                let noise: Vec<f32> = (0..t.elem_count()).map(|_| 0.05 * (rng.f32() * 2.0 - 1.0)).collect();
                let noise = Tensor::from_vec(noise, t.dims(), &Device::Cpu).unwrap();
                (n, (t + noise).unwrap())
            })
            .collect();
        m.load_state(&state).unwrap();
        let wanted: HashSet<String> = targets(&m.state_dict());
        assert_eq!(wanted.len(), 5);
        let h = collect(
            &mut crate::eval::candle_model::CandleModel::new(&m),
            (4, 32),
            3,
            2,
            wanted,
            |buf| {
                buf.iter_mut().for_each(|v| *v = rng.u32(..512));
                Ok(())
            },
            || true,
        )
        .unwrap()
        .unwrap();
        (m, h)
    }

    fn loss(m: &Gpt) -> f64 {
        let x = Tensor::from_vec((0..64u32).map(|i| (i * 37 + 5) % 512).collect::<Vec<_>>(), (2, 32), &Device::Cpu).unwrap();
        let y = Tensor::from_vec((0..64u32).map(|i| (i * 11 + 3) % 512).collect::<Vec<_>>(), (2, 32), &Device::Cpu).unwrap();
        m.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap() as f64
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pipeline-roundtrip-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The file's weights are the quantized ones: a model restored from the artifact has the
    /// loss of the dequantized container, and GPTQ's weights differ from rounding's.
    #[test]
    fn the_restored_model_is_the_dequantized_one() {
        let (m, h) = trained_like();
        let state = m.state_dict();
        let q = QuantConfig { bits: 4, embed_bits: Some(6), clip: Clip::SdClip, ..QuantConfig::record() };
        let d = dir("restored");
        let gptq = Method::Gptq { gptq: GptqConfig::default(), calibration_batches: 3 };
        let w = write_and_restore(&state, &cfg(), &q, &gptq, Some(&h), &d.join("a.pgqz")).unwrap();
        let rounding = Rounding::Gptq(&GptqConfig::default(), &h.by_weight);
        let in_memory = quantize(&state, &q, rounding).unwrap().dequantize(Some(DType::F32), &Device::Cpu).unwrap();
        let with = |tensors: &[(String, Tensor)]| {
            let mut model = Gpt::new(&cfg(), 0, DType::F32, &Device::Cpu).unwrap();
            model.load_state(&tensors.iter().cloned().collect()).unwrap();
            loss(&model)
        };
        let (restored, dequantized, original) = (with(&w.restored), with(&in_memory), loss(&m));
        assert_eq!(restored.to_bits(), dequantized.to_bits());
        assert_ne!(restored, original);
        let near = write_and_restore(&state, &cfg(), &q, &Method::Nearest, None, &d.join("b.pgqz")).unwrap();
        let fc = |t: &[(String, Tensor)]| {
            t.iter().find(|(n, _)| n == "blocks.0.mlp.fc.weight").unwrap().1.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        assert_ne!(fc(&near.restored), fc(&w.restored));
        // The manifest says how the file was made.
        let qz = from_bytes(&std::fs::read(d.join("a.pgqz")).unwrap()).unwrap();
        let info = qz.info().unwrap();
        assert_eq!(info["method"], "gptq");
        assert_eq!(info["gptq"]["hessians"], 5);
        assert_eq!(info["quant"]["bits"], 4);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// An artifact restored under another `[model]` is refused, naming the key, even where every
    /// shape agrees; a corrupt file is refused naming the file.
    #[test]
    fn restore_refuses_another_architecture_and_a_corrupt_file() {
        let m = Gpt::new(&cfg(), 1, DType::F32, &Device::Cpu).unwrap();
        let d = dir("arch");
        let path = d.join("a.pgqz");
        write_and_restore(&m.state_dict(), &cfg(), &QuantConfig::record(), &Method::Nearest, None, &path).unwrap();
        restore(&path, &cfg()).unwrap();
        let other = ModelConfig { xsa_last_n: 1, ..cfg() };
        let err = format!("{:#}", restore(&path, &other).unwrap_err());
        assert!(err.contains("model.xsa_last_n") && err.contains("a.pgqz"), "{err}");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 7]).unwrap();
        let err = format!("{:#}", restore(&path, &cfg()).unwrap_err());
        assert!(err.contains("a.pgqz") && err.contains("truncated"), "{err}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn size_lines_count_the_code() {
        let m = Gpt::new(&cfg(), 1, DType::F32, &Device::Cpu).unwrap();
        let d = dir("lines");
        let q = QuantConfig::record();
        let w = write_and_restore(&m.state_dict(), &cfg(), &q, &Method::Nearest, None, &d.join("a.pgqz")).unwrap();
        let n = w.stats.compressed_bytes;
        let [a, b, c] = size_lines(&q, &w, &CodeBytes::Given(1000));
        assert!(a.starts_with(&format!("Serialized model int6/int8+brotli: {n} bytes")), "{a}");
        assert!(b.contains("1000 bytes"), "{b}");
        assert!(c.contains(&format!("{} bytes (model {n} + code 1000)", n + 1000)) && c.contains("fits"), "{c}");
        let [_, _, c] = size_lines(&q, &w, &CodeBytes::Given(ARTIFACT_CAP_BYTES));
        assert!(c.contains(&format!("OVER THE CAP by {n} bytes")), "{c}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// The record model's calibration and GPTQ on this machine: Hessians from 4 batches of
    /// 2 x 2048 random tokens through the looped model, then GPTQ of its 67 matrices
    /// (`cargo test --release --lib roundtrip::tests::record_size_gptq_time -- --ignored --nocapture`).
    #[test]
    #[ignore = "slow: the 36 M-parameter record model on the CPU"]
    fn record_size_gptq_time() {
        let cfg = ModelConfig::record();
        let t0 = Instant::now();
        let m = Gpt::new(&cfg, 42, DType::F32, &Device::Cpu).unwrap();
        let mut rng = fastrand::Rng::with_seed(1);
        let state: HashMap<String, Tensor> = m
            .state_dict()
            .into_iter()
            .map(|(n, t)| {
                let v: Vec<f32> = (0..t.elem_count()).map(|_| 0.02 * (rng.f32() * 2.0 - 1.0) * 1.7).collect();
                (n.clone(), Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap())
            })
            .collect();
        let mut m = m;
        m.load_state(&state).unwrap();
        println!("record model built in {:?}", t0.elapsed());
        let t0 = Instant::now();
        let h = collect(
            &mut crate::eval::candle_model::CandleModel::new(&m),
            (2, 2048),
            4,
            1,
            targets(&m.state_dict()),
            |buf| {
                buf.iter_mut().for_each(|v| *v = rng.u32(..8192));
                Ok(())
            },
            || true,
        )
        .unwrap()
        .unwrap();
        let calib = t0.elapsed();
        assert_eq!((h.by_weight.len(), h.distinct), (67, 45));
        let t0 = Instant::now();
        let g = GptqConfig::default();
        let qz = quantize(&m.state_dict(), &QuantConfig::record(), Rounding::Gptq(&g, &h.by_weight)).unwrap();
        let gptq = t0.elapsed();
        assert_eq!(qz.stats().quantized, 67);
        println!(
            "record model, {} threads: Hessians ({} matrices, {} distinct, 4 batches of 2 x 2048) {calib:?}, GPTQ of 67 matrices {gptq:?}",
            rayon::current_num_threads(),
            h.by_weight.len(),
            h.distinct
        );
    }
}
