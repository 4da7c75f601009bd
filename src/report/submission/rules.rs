//! The challenge's rules as checks over a set of runs (one per seed): each a named line with
//! the figure and the rule, passed or failed, or skipped where there is nothing to check
//! (no `--against`). The rules that need more than the reports (the legality audit, the
//! tokenizer's byte table) are checked by the caller and handed in as [`Check`]s.

use std::collections::BTreeSet;

use serde::Serialize;

use super::figures::RunFigures;
use super::significance::{MARGIN_NATS, P_LIMIT, Significance};
use crate::report::size_advice::{SizeFacts, advice};

/// The cap on artifact plus code bytes (decimal).
pub const CAP_BYTES: u64 = 16_000_000;

/// The training budget and the evaluation budget, s (each on 8xH100 SXM).
pub const TRAIN_LIMIT_S: f64 = 600.0;
pub const EVAL_LIMIT_S: f64 = 600.0;

/// The hardware the rules time on.
pub const RULE_HARDWARE: &str = "8xH100 SXM";

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The rule holds.
    Pass,
    /// It does not: the submission is refused.
    Fail,
    /// Nothing to check (said why in the figure).
    Skip,
}

/// One rule checked.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Check {
    /// Its name (`size seed 42`, `train time seed 42`, `legality`, ...).
    pub name: String,
    /// What was measured, with where it came from.
    pub figure: String,
    /// The rule.
    pub rule: String,
    /// The outcome.
    pub outcome: Outcome,
}

impl Check {
    /// A check that passes when `ok`.
    pub fn new(name: impl Into<String>, ok: bool, figure: impl Into<String>, rule: impl Into<String>) -> Self {
        Self { name: name.into(), figure: figure.into(), rule: rule.into(), outcome: if ok { Outcome::Pass } else { Outcome::Fail } }
    }

    /// The printed line: `PASS name: figure (rule)`.
    pub fn line(&self) -> String {
        let tag = match self.outcome {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "SKIP",
        };
        format!("{tag} {}: {} [rule: {}]", self.name, self.figure, self.rule)
    }
}

/// `1234567` as `1,234,567`.
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The checks on the runs themselves: finished, enough distinct seeds, one config.
pub fn set_checks(runs: &[RunFigures], min_seeds: usize) -> Vec<Check> {
    let mut out = Vec::new();
    let unfinished: Vec<String> =
        runs.iter().filter(|r| r.status != "completed").map(|r| format!("{} ({})", r.dir.display(), r.status)).collect();
    out.push(Check::new(
        "runs finished",
        unfinished.is_empty(),
        if unfinished.is_empty() {
            format!("{} run(s), all completed", runs.len())
        } else {
            format!("not completed: {}", unfinished.join(", "))
        },
        "every seed's run completed",
    ));
    let mut seen = BTreeSet::new();
    let dups: Vec<u64> = runs.iter().filter(|r| !seen.insert(r.seed)).map(|r| r.seed).collect();
    let seeds: Vec<String> = seen.iter().map(u64::to_string).collect();
    let figure = if dups.is_empty() {
        format!("{} distinct seed(s): {}", seen.len(), seeds.join(", "))
    } else {
        format!("seed(s) {} given twice; distinct: {}", dups.iter().map(u64::to_string).collect::<Vec<_>>().join(", "), seeds.join(", "))
    };
    out.push(Check::new(
        "seeds",
        dups.is_empty() && seen.len() >= min_seeds,
        if seen.len() < min_seeds && dups.is_empty() { format!("{figure}: {} missing", min_seeds - seen.len()) } else { figure },
        format!("at least {min_seeds} runs of distinct seeds"),
    ));
    let mut mixed = None;
    if let Some(first) = runs.first() {
        let a = first.fixed_config();
        'runs: for r in &runs[1..] {
            let b = r.fixed_config();
            for k in a.keys().chain(b.keys()).collect::<BTreeSet<_>>() {
                let (va, vb) = (a.get(k), b.get(k));
                if va != vb {
                    mixed = Some(format!(
                        "`{k}` is {} in {} but {} in {}",
                        va.copied().unwrap_or("unset"),
                        first.dir.display(),
                        vb.copied().unwrap_or("unset"),
                        r.dir.display()
                    ));
                    break 'runs;
                }
            }
        }
    }
    let digest = |r: &RunFigures| r.bundle.as_ref().map(|b| b.sha256.clone());
    let code = runs.first().map(digest);
    let other = runs.iter().find(|r| Some(digest(r)) != code);
    out.push(Check::new(
        "one code",
        other.is_none() && code.as_ref().is_some_and(Option::is_some),
        match (other, runs.first()) {
            (Some(o), Some(f)) => format!(
                "seed {} was trained by the source bundle {} but seed {} by {}: different code",
                o.seed,
                digest(o).unwrap_or_else(|| "(none)".into()),
                f.seed,
                digest(f).unwrap_or_else(|| "(none)".into())
            ),
            (None, Some(f)) if f.bundle.is_none() => format!("no seed has a source bundle ({})", f.code_how),
            _ => format!(
                "every seed was trained by the same {} ({} bytes, SHA-256 {})",
                runs.first().and_then(|r| r.bundle.as_ref()).map_or("", |b| b.file.as_str()),
                grouped(runs.first().map_or(0, |r| r.code_bytes)),
                code.flatten().map_or(String::new(), |d| d.chars().take(12).collect())
            ),
        },
        "every seed trained by the same code (the same source bundle, digest for digest)",
    ));
    out.push(Check::new(
        "one config",
        mixed.is_none(),
        mixed.unwrap_or_else(|| format!("{} settings agree", runs.first().map_or(0, |r| r.fixed_config().len()))),
        "the seeds' resolved configs are the same but for `run.seed` and what only names, places or measures a run",
    ));
    out
}

/// Size, training time and evaluation time of one run.
pub fn run_checks(r: &RunFigures) -> Vec<Check> {
    let mut out = Vec::new();
    let name = |what: &str| format!("{what} seed {}", r.seed);
    out.push(match r.artifact_bytes {
        Some(model) => {
            let total = model + r.code_bytes;
            let figure = match r.measured_bundle() {
                Err(why) => format!("{why}; model {} bytes", grouped(model)),
                Ok(_) => format!(
                    "{} bytes = model {} + code {} ({}){}",
                    grouped(total),
                    grouped(model),
                    grouped(r.code_bytes),
                    r.code_how,
                    if total <= CAP_BYTES {
                        format!(", {} to spare", grouped(CAP_BYTES - total))
                    } else {
                        let over = total - CAP_BYTES;
                        format!(", {} over: {}", grouped(over), advice(&SizeFacts { over, ..r.size.clone() }))
                    }
                ),
            };
            Check::new(
                name("size"),
                r.bundle.is_some() && total <= CAP_BYTES,
                figure,
                format!("artifact + counted code <= {} bytes (decimal), the code counted", grouped(CAP_BYTES)),
            )
        }
        None => Check::new(
            name("size"),
            false,
            "the run wrote no artifact (no `artifact` section)",
            format!("artifact + code <= {}", grouped(CAP_BYTES)),
        ),
    });
    out.push(Check::new(
        name("files"),
        r.files_problem.is_none(),
        r.files_problem.clone().unwrap_or_else(|| "the artifact and config.toml in the run directory, as the run recorded them".into()),
        "what is judged is the run directory given, each file byte for byte the one the run wrote (size and SHA-256)",
    ));
    let parts = |ps: &[super::figures::Part]| ps.iter().map(|p| format!("{} {:.1} s", p.what, p.ms / 1e3)).collect::<Vec<_>>().join(" + ");
    // The rules time on their hardware: figures from other hardware are shown as measured.
    let on = if rules_hardware(&r.hardware) {
        r.hardware.clone()
    } else {
        format!("{} (not the rules' hardware: the time does not carry over)", r.hardware)
    };
    let train = r.train_s();
    out.push(Check::new(
        name("train time"),
        train <= TRAIN_LIMIT_S,
        format!("{train:.1} s on {on} = {}", parts(&r.train_parts)),
        format!("<= {TRAIN_LIMIT_S:.0} s on {RULE_HARDWARE}, GPTQ calibration and every compile or warm-up included"),
    ));
    let eval = r.eval_s();
    out.push(Check::new(
        name("eval time"),
        eval <= EVAL_LIMIT_S,
        format!("{eval:.1} s on {on} = {}", parts(&r.eval_parts)),
        format!("<= {EVAL_LIMIT_S:.0} s on {RULE_HARDWARE}, decompression and every warm-up included"),
    ));
    out
}

/// Whether a run's `hardware` is the rules' 8xH100 SXM: eight ranks of an H100 that is not
/// the PCIe or NVL card (the driver names the SXM one `NVIDIA H100 80GB HBM3`).
pub fn rules_hardware(hardware: &str) -> bool {
    hardware.starts_with("8 x ") && hardware.contains("H100") && !hardware.contains("PCIe") && !hardware.contains("NVL")
}

/// Every seed scored the same validation targets and bytes.
pub fn val_check(runs: &[RunFigures]) -> Check {
    let first = runs.first().map(|r| (r.score.val_tokens, r.score.val_bytes));
    let odd = runs.iter().find(|r| Some((r.score.val_tokens, r.score.val_bytes)) != first);
    let (tokens, bytes) = first.unwrap_or((0, 0));
    Check::new(
        "val split",
        odd.is_none() && tokens > 0,
        match odd {
            None => format!(
                "every seed scored {} targets, {} bytes ({:.4} bytes a token)",
                grouped(tokens),
                grouped(bytes),
                bytes as f64 / tokens.max(1) as f64
            ),
            Some(r) => format!(
                "{} scored {} targets, {} bytes; {} scored {} targets, {} bytes",
                runs[0].dir.display(),
                grouped(tokens),
                grouped(bytes),
                r.dir.display(),
                grouped(r.score.val_tokens),
                grouped(r.score.val_bytes)
            ),
        },
        "every seed scores the same validation targets",
    )
}

/// The significance line.
pub fn significance_check(s: Option<&Significance>, against: &str) -> Check {
    let rule = format!("beats the record by >= {MARGIN_NATS} nats at one-sided p < {P_LIMIT}");
    let Some(s) = s else {
        return Check { name: "significance".into(), figure: "not tested: no --against".into(), rule, outcome: Outcome::Skip };
    };
    let figure = match &s.untestable {
        Some(why) => format!("mean {:.5} nats vs {:.5} ({against}): {why}", s.mean_nats, s.baseline_mean_nats),
        None => format!(
            "mean {:.5} ± {:.5} nats over {} seeds vs {:.5}{} ({against}): {:+.5} nats, {} t {:.2}, df {:.1}, one-sided p {:.2e}",
            s.mean_nats,
            s.std_nats,
            s.n,
            s.baseline_mean_nats,
            if s.baseline_n > 0 { format!(" ± {:.5} over {} runs", s.baseline_std_nats, s.baseline_n) } else { String::new() },
            s.diff_nats,
            if s.baseline_n > 0 { "Welch" } else { "one-sample" },
            s.t,
            s.df,
            s.p
        ),
    };
    Check::new("significance", s.clears, figure, rule)
}
