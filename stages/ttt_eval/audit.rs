//! The legality audit of a run's configured evaluation (`pipeline audit-eval`): every
//! `ttt_eval` implementation, built from the run's `Config` and its stage's parameters as that
//! stage parses them, run through [`crate::eval::audit`]'s causality and documents audits on a
//! prefix of the validation split.
//!
//! [`AUDITED`] is the one registry of audited implementations: a builder per implementation
//! name, which turns the run's settings (scaled where the short prefix needs it, and saying so)
//! into a scorer that calls the unchanged evaluation and reads each target's loss from its
//! recording accumulators. A `ttt_eval` implementation without an entry fails the tests.
//! [`audit_run`] audits a finished run directory (the weights its evaluation scored: the
//! artifact read back when the report names one, else `final_model.safetensors`) or a config
//! file (weights initialised from `run.seed`).
//!
//! The audit runs on the CPU in one process, whatever the run's device and ranks: its
//! comparisons are bit for bit, which a device's non-deterministic sums would spoil.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use serde::de::DeserializeOwned;

pub use super::audit_report::{Adjustment, AuditReport, DocumentsAudit};
use super::{PhasedParams, ScoreFirstParams, SlidingParams};
use crate::artifact::roundtrip::model_from;
use crate::dist::single::Single;
use crate::eval::audit::{Order, PositionRules, Records, RowFn, bos_audit, causality, choose_position, masked_row_losses, replacement};
use crate::eval::bpb::ByteTables;
use crate::eval::executor::{EvalExecutor, EvalModel};
use crate::eval::phased::docs::{phase_boundaries, segment, work_queue};
use crate::eval::phased::phased_ttt;
use crate::eval::ttt::{score_first_ttt, sliding_eval};
use crate::train::config::Config;

/// What an audited implementation is built from.
#[derive(Clone)]
pub struct Setup<'a> {
    /// The run's config (device CPU, one rank).
    pub config: &'a Config,
    /// The stage's parameters (its table without `kind`, `impl`, `inputs`, `queue`).
    pub params: &'a toml::Table,
    /// The stage's seed (`BuildCtx::seed`: phased TTT draws its adapters from it).
    pub seed: u64,
    /// The weights the evaluation scores.
    pub weights: &'a [(String, Tensor)],
    /// The validation split's byte tables, recording ([`ByteTables::recording`]).
    pub tables: Arc<ByteTables>,
    /// The prefix audited: `N + 1` tokens.
    pub tokens: &'a [u32],
    /// The tokenizer's BOS, which starts documents.
    pub bos: u32,
}

/// Tokens to every target's loss, as the evaluation took them.
pub type Scorer<'a> = Box<dyn Fn(&[u32]) -> anyhow::Result<Records> + 'a>;

/// One row's inputs and targets to their losses.
pub type RowScorer<'a> = Box<RowFn<'a>>;

/// An implementation ready to audit.
pub struct Built<'a> {
    /// The evaluation as a scorer.
    pub scorer: Scorer<'a>,
    /// The model's scoring pass of one packed row (for the documents audit).
    pub rows: RowScorer<'a>,
    /// Rows of at most this many inputs: the evaluation's packed rows.
    pub row_len: usize,
    /// Settings changed to fit the prefix, with the reason.
    pub adjusted: Vec<Adjustment>,
    /// Where the changed position may sit.
    pub rules: PositionRules,
    /// The order the evaluation takes its targets in.
    pub order: Order,
}

/// A builder of one implementation.
pub type Build = for<'a> fn(&Setup<'a>) -> anyhow::Result<Built<'a>>;

/// An audited `ttt_eval` implementation.
pub struct Audited {
    /// Its implementation name (`impl`).
    pub name: &'static str,
    /// Its builder.
    pub build: Build,
}

/// Every audited `ttt_eval` implementation.
pub static AUDITED: &[Audited] = &[
    Audited { name: "sliding", build: sliding },
    Audited { name: "score_first", build: score_first },
    Audited { name: "phased", build: phased },
];

/// The stage's parameters as its implementation parses them.
fn params<T: DeserializeOwned>(s: &Setup) -> anyhow::Result<T> {
    toml::Value::Table(s.params.clone()).try_into().map_err(|e| anyhow::anyhow!("the stage's parameters: {e}"))
}

/// The model's masked scoring pass of a row, on a fresh model of the weights.
pub fn masked_rows<'a>(s: &Setup<'a>) -> RowScorer<'a> {
    let (config, weights) = (s.config, s.weights);
    Box::new(move |x, y| masked_row_losses(&model_from(config, weights)?, config.model.bos_id, x, y))
}

/// A fresh model of the weights on the stage's executor (the engine on `rows x t` passes).
fn eval_model(
    config: &Config,
    weights: &[(String, Tensor)],
    executor: EvalExecutor,
    rows: usize,
    t: usize,
) -> anyhow::Result<Box<dyn EvalModel>> {
    crate::train::engine_eval::open(model_from(config, weights)?, executor, rows, t)
}

/// [`eval_model`] for phased TTT (the engine's arena also holds its LoRA passes and adapters).
fn phased_model(
    config: &Config,
    weights: &[(String, Tensor)],
    executor: EvalExecutor,
    c: &crate::eval::phased::PhasedConfig,
) -> anyhow::Result<Box<dyn EvalModel>> {
    let gpu = crate::device::runs_on_gpu(&config.run.device);
    let sizing = crate::train::engine_eval::phased_sizing(
        (c.global_rows_per_rank(1).0, c.global_seq_len),
        (c.batch_docs, c.context, c.lora_rank),
        gpu,
    );
    crate::train::engine_eval::open_sized(model_from(config, weights)?, executor, sizing)
}

/// Rows of the evaluation's `window`, at most the model's RoPE training length (past it the
/// rotary base depends on the row's length, and a document alone would not compare).
fn row_len(config: &Config, window: usize) -> usize {
    window.min(config.model.rope_train_seq_len.unwrap_or(usize::MAX))
}

fn sliding<'a>(s: &Setup<'a>) -> anyhow::Result<Built<'a>> {
    let p: SlidingParams = params(s)?;
    let cfg = p.sliding.at(s.config.train.seq_len);
    cfg.check()?;
    let (config, weights, tables) = (s.config, s.weights, s.tables.clone());
    let scorer: Scorer<'a> = Box::new(move |tokens| {
        let mut model = eval_model(config, weights, p.executor, cfg.batch_windows, cfg.seq_len)?;
        let acc = sliding_eval(model.as_mut(), tokens, tables.clone(), &cfg, || true)?.context("the sliding evaluation stopped")?;
        Ok(acc.recorded()?.to_vec())
    });
    let rules = PositionRules { bos: Some(s.bos), ..PositionRules::default() };
    Ok(Built { scorer, rows: masked_rows(s), row_len: row_len(s.config, cfg.seq_len), adjusted: Vec::new(), rules, order: Order::Stream })
}

fn score_first<'a>(s: &Setup<'a>) -> anyhow::Result<Built<'a>> {
    let p: ScoreFirstParams = params(s)?;
    let mut cfg = p.ttt(s.config.train.seq_len);
    cfg.check()?;
    let n = s.tokens.len().saturating_sub(1);
    let t = cfg.sliding.seq_len;
    let mut adjusted = Vec::new();
    if n.div_ceil(cfg.chunk_tokens) < 3 {
        let chunk = n / 3 / t * t;
        anyhow::ensure!(
            chunk >= t,
            "a prefix of {n} targets cannot hold 3 TTT chunks of at least `seq_len` ({t}) targets: audit at least {} tokens",
            3 * t
        );
        adjusted.push(Adjustment::new(
            "chunk_tokens",
            cfg.chunk_tokens,
            chunk,
            format!(
                "the prefix's {n} targets hold {} chunk(s) of {}: at least 3 are needed so that the model trains before the changed chunk is scored",
                n.div_ceil(cfg.chunk_tokens),
                cfg.chunk_tokens
            ),
        ));
        cfg.chunk_tokens = chunk;
    }
    let (config, weights, tables, c) = (s.config, s.weights, s.tables.clone(), cfg.clone());
    let scorer: Scorer<'a> = Box::new(move |tokens| {
        let mut model = eval_model(config, weights, p.executor, c.rows_per_rank(1).0, c.sliding.seq_len)?;
        let o = score_first_ttt(model.as_mut(), tokens, tables.clone(), &c, |_| {}, || true)?.context("score-first TTT stopped")?;
        Ok(o.acc.recorded()?.to_vec())
    });
    let rules = PositionRules { bos: Some(s.bos), stream_chunk: Some(cfg.chunk_tokens), doc_chunk: None };
    let row_len = row_len(s.config, cfg.sliding.seq_len);
    Ok(Built { scorer, rows: masked_rows(s), row_len, adjusted, rules, order: Order::Stream })
}

fn phased<'a>(s: &Setup<'a>) -> anyhow::Result<Built<'a>> {
    let p: PhasedParams = params(s)?;
    let mut cfg = p.config(s.config.train.seq_len);
    cfg.check()?;
    let docs = segment(s.tokens, s.bos);
    let d = docs.len();
    anyhow::ensure!(
        d >= 3,
        "a prefix of {} tokens holds {d} document(s): phased TTT's audit needs at least 3 (audit more tokens)",
        s.tokens.len()
    );
    let mut adjusted = Vec::new();
    if cfg.batch_docs * 3 > d {
        let to = (d / 3).max(1);
        let why = format!(
            "the prefix holds {d} documents, {} batch(es) of {}: at least 3 batches are needed",
            d.div_ceil(cfg.batch_docs),
            cfg.batch_docs
        );
        adjusted.push(Adjustment::new("batch_docs", cfg.batch_docs, to, why));
        cfg.batch_docs = to;
    }
    if cfg.phases > 0 && phase_boundaries(cfg.prefix_docs, cfg.phases)[0] + cfg.batch_docs > d {
        let to = (d * 2 / 3).max(cfg.phases);
        anyhow::ensure!(
            phase_boundaries(to, cfg.phases)[0] + cfg.batch_docs <= d,
            "a prefix of {d} documents leaves no batch after the first of {} phase pauses: audit more tokens",
            cfg.phases
        );
        let why = format!(
            "the first phase pause falls after {} documents, the prefix holds {d}: a pause must come before its last batch",
            phase_boundaries(cfg.prefix_docs, cfg.phases)[0]
        );
        adjusted.push(Adjustment::new("prefix_docs", cfg.prefix_docs, to, why));
        cfg.prefix_docs = to;
    }
    let order =
        Order::Groups(work_queue(&docs, cfg.batch_docs).iter().map(|b| b.docs.iter().map(|&k| docs[k].targets()).collect()).collect());
    let (config, weights, tables, c, bos, seed) = (s.config, s.weights, s.tables.clone(), cfg.clone(), s.bos, s.seed);
    let scorer: Scorer<'a> = Box::new(move |tokens| {
        let mut model = phased_model(config, weights, p.executor, &c)?;
        let o =
            phased_ttt(model.as_mut(), tokens, tables.clone(), (&c, bos, seed), &Single, |_| {}, || true)?.context("phased TTT stopped")?;
        Ok(o.acc.recorded()?.to_vec())
    });
    let rules = PositionRules { bos: Some(s.bos), stream_chunk: None, doc_chunk: Some(cfg.chunk) };
    Ok(Built { scorer, rows: masked_rows(s), row_len: row_len(s.config, cfg.global_seq_len), adjusted, rules, order })
}

/// Audits the implementation `entry` of the stage `stage` with `setup` (`weights` says where
/// its weights came from, for the report).
pub fn audit_stage(entry: &Audited, stage: &str, setup: &Setup, weights: &str) -> anyhow::Result<AuditReport> {
    let at = || format!("stage `{stage}` (ttt_eval/{})", entry.name);
    let built = (entry.build)(setup).with_context(at)?;
    let tokens = setup.tokens;
    let vocab = setup.config.model.vocab_size.min(setup.tables.len());
    let p = choose_position(tokens, &built.rules).with_context(at)?;
    let to = replacement(tokens[p], vocab, Some(setup.bos));
    let causality = causality(&built.scorer, tokens, p, to, &built.order).with_context(at)?;
    let m = &setup.config.model;
    let documents = if m.document_attention {
        DocumentsAudit::Checked(bos_audit(&built.rows, tokens, m.bos_id, built.row_len, vocab).with_context(at)?)
    } else {
        DocumentsAudit::NotApplicable {
            reason: format!(
                "`model.document_attention` is false: the model does not claim to keep attention inside documents (smear_gate {})",
                if m.smear_gate { "on, with its BOS fix" } else { "off" }
            ),
        }
    };
    Ok(AuditReport {
        stage: stage.to_string(),
        implementation: entry.name.to_string(),
        weights: weights.to_string(),
        tokens: tokens.len() - 1,
        adjusted: built.adjusted,
        causality,
        documents,
    })
}

/// How much of the validation split [`audit_run`] scores, and the config's overrides.
#[derive(Clone, Debug)]
pub struct AuditOptions {
    /// Targets of the validation prefix scored (8192): the first `tokens + 1` tokens.
    pub tokens: usize,
    /// `--set KEY=VALUE` overrides, as `pipeline run` takes them.
    pub sets: Vec<String>,
}

impl Default for AuditOptions {
    fn default() -> Self {
        Self { tokens: 8192, sets: Vec::new() }
    }
}

/// Audits the `ttt_eval` stage (the first, if several) of the run directory or config file at
/// `path` (see the module doc). Errors name the file or the key.
pub fn audit_run(path: &Path, opts: &AuditOptions) -> anyhow::Result<AuditReport> {
    let run_dir = path.is_dir().then_some(path);
    let file = match run_dir {
        Some(d) => d.join("config.toml"),
        None => path.to_path_buf(),
    };
    match run_dir {
        Some(_) => anyhow::ensure!(file.is_file(), "config.toml: not found in the run directory (is it a finished run?)"),
        None => anyhow::ensure!(file.is_file(), "not found (give a finished run directory or a config file)"),
    }
    // The run's report (none for a config file, or a directory without one), read once: the
    // files of the directory given are judged against what it records.
    let report = match run_dir {
        Some(d) => read_report(d)?,
        None => None,
    };
    if let (Some(d), Some(r)) = (run_dir, &report) {
        crate::runtime::files::check_recorded(d, "config.toml", &crate::runtime::files::recorded_of(r))?;
    }
    // A finished run is audited as it ran: its resolved config, no `PIPELINE_*` variables.
    let loaded =
        crate::runtime::config::load_with_env::<Config>(&file, &opts.sets, run_dir.is_none()).map_err(|e| anyhow::anyhow!("{e}"))?;
    let plan = crate::runtime::graph::plan(&loaded, &crate::stages::REGISTRY).map_err(|e| anyhow::anyhow!("{e}"))?;
    let stage = plan
        .stages
        .iter()
        .find(|s| s.factory.kind() == "ttt_eval")
        .ok_or_else(|| anyhow::anyhow!("{}: no `ttt_eval` stage: there is no evaluation to audit", file.display()))?;
    let entry = AUDITED
        .iter()
        .find(|a| a.name == stage.factory.name())
        .ok_or_else(|| anyhow::anyhow!("`stages.{}.impl`: `{}` has no audit", stage.name, stage.factory.name()))?;
    let mut config = loaded.config.clone();
    (config.run.device, config.run.world_size, config.run.rank) = ("cpu".into(), 1, 0);
    let seed = stage.check_ctx(&config.run, &config.extensions()).seed();
    let (weights, label) = match run_dir {
        Some(d) => run_weights(d, &config, report.as_ref())?,
        None => {
            let m = crate::model::Gpt::new(&config.model, config.run.seed, DType::F32, &Device::Cpu)?;
            (m.state_dict(), format!("initialised from run.seed = {} (a config file)", config.run.seed))
        }
    };
    let validator = crate::eval::validation::Validator::load(&config.validation(), config.batch_shape()?.micro_steps)?;
    let all = validator.tokens();
    anyhow::ensure!(
        all.len() > opts.tokens,
        "the validation split (`data.val`, `train.val_max_tokens`) holds {} targets, fewer than the {} to audit (--tokens)",
        all.len().saturating_sub(1),
        opts.tokens
    );
    let tokenizer = config.data.tokenizer.as_deref().context("`data.tokenizer` is not set: documents start at its BOS")?;
    let setup = Setup {
        config: &config,
        params: &stage.params,
        seed,
        weights: &weights,
        tables: Arc::new(validator.tables().as_ref().clone().recording()),
        tokens: &all[..opts.tokens + 1],
        bos: crate::data::tokenizer::bos_id(tokenizer)?,
    };
    audit_stage(entry, &stage.name, &setup, &label)
}

/// `dir/report.json` as JSON; `None` when there is none.
fn read_report(dir: &Path) -> anyhow::Result<Option<serde_json::Value>> {
    let path = dir.join("report.json");
    let Ok(bytes) = std::fs::read(&path) else { return Ok(None) };
    Ok(Some(serde_json::from_slice(&bytes).with_context(|| format!("{}: not JSON", path.display()))?))
}

/// The weights a run's evaluation scored, read from the run directory given (a copy of a run
/// is audited on its own files): the artifact `report` names, read back (checked against
/// `[model]`) once [`crate::runtime::files::recorded_artifact`] has found it there as the run
/// recorded it; else `final_model.safetensors`, against its recorded SHA-256. A named artifact
/// that is not there is an error, not a quiet fall back to unquantized weights.
fn run_weights(dir: &Path, config: &Config, report: Option<&serde_json::Value>) -> anyhow::Result<(Vec<(String, Tensor)>, String)> {
    let artifact = match report {
        Some(r) => crate::runtime::files::recorded_artifact(dir, r)?,
        None => None,
    };
    if let Some(a) = artifact {
        let w = crate::artifact::roundtrip::restore(&a, &config.model).with_context(|| format!("{}: the artifact", a.display()))?;
        return Ok((w, format!("the artifact {} read back", a.display())));
    }
    let f = dir.join("final_model.safetensors");
    anyhow::ensure!(f.is_file(), "{}: no artifact in report.json and no final_model.safetensors: no weights to audit", dir.display());
    if let Some(r) = report {
        crate::runtime::files::check_recorded(dir, "final_model.safetensors", &crate::runtime::files::recorded_of(r))?;
    }
    let w: HashMap<String, Tensor> = crate::model::weights::load(&f, Some(DType::F32))?;
    Ok((w.into_iter().collect(), f.display().to_string()))
}

#[cfg(test)]
#[path = "audit_tests.rs"]
mod tests;
