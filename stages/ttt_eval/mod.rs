//! Kind `ttt_eval`: the records' final evaluation (spec 2.5, 4.6, 4.7), after training, on the
//! weights the stages before it hand on (quantized and restored after an `artifact` stage,
//! averaged after an `ema_swa` stage, else the last step's).
//!
//! - `sliding`: sliding-window evaluation: windows of `seq_len` tokens every `stride` tokens,
//!   each target scored once, only a window's new targets, each with at least
//!   `seq_len - stride` tokens of context.
//! - `score_first`: the sliding-window score, then legal score-first test-time training: the
//!   validation stream is cut into chunks of `chunk_tokens`; each chunk is scored completely
//!   (final scores) before SGD trains on it, so no target is ever scored by weights that saw
//!   it ([`crate::eval::ttt`] has the rules and the tests that prove them).
//!
//! - `phased`: phased TTT (spec §5), in [`phased`].
//!
//! [`audit`] audits each implementation's legality on a run's settings (`pipeline audit-eval`).
//!
//! Several ranks (data parallel) share `sliding` and `score_first` as the records do: each
//! scores a contiguous share of the windows (of each chunk), and each TTT step's sequences are
//! split among them with the gradient summed, so that the weights stay the same on every rank
//! and the score does not depend on the number of ranks. `phased` deals its work queue's
//! batches of documents to the ranks in rounds and pauses them together for each phase, whose
//! global SGD steps they split ([`crate::eval::phased::run`]).
//!
//! All score the validation split as training scored it (`train.val_max_tokens`) and log in
//! the records' format, `<label>_sliding_window val_loss:… val_bpb:… eval_time:…ms` and
//! `<label>_ttt …`. Histograms: `sliding` (the whole pass), `chunk_score` and `chunk_train`
//! (per TTT chunk). Snapshots of steps, and a run ended by Ctrl-C, are not evaluated.

#[cfg(feature = "tools")]
pub mod audit;
#[cfg(feature = "tools")]
mod audit_report;
mod phased;

use std::time::{Duration, Instant};

use anyhow::Context;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::config;
use crate::eval::bpb::BpbAccumulator;
use crate::eval::executor::{EvalExecutor, EvalModel};
use crate::eval::ttt::{SlidingConfig, TttConfig, TttEvent, score_first_ttt_shared, sliding_eval_shared};
use crate::eval::validation::Validator;
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Sink};
use crate::train::log::StageLog;
use crate::train::snapshot::TrainSnapshot;
pub use phased::{Phased, PhasedParams};

/// Parameters of `ttt_eval/sliding`: the window geometry ([`SlidingConfig`]'s keys) and the
/// executor.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct SlidingParams {
    /// The windows ([`SlidingConfig`]'s keys).
    #[serde(flatten)]
    pub sliding: SlidingConfig,
    /// What runs the passes: "engine" (the explicit engine: f32 on the CPU, bf16 activations
    /// on a GPU) or "candle" (the candle model, f32).
    pub executor: EvalExecutor,
}

impl Default for SlidingParams {
    fn default() -> Self {
        Self { sliding: stage_windows(), executor: EvalExecutor::default() }
    }
}

/// The records' windows with the stages' `seq_len` default: 0, the run's `train.seq_len`.
fn stage_windows() -> SlidingConfig {
    SlidingConfig { seq_len: 0, ..SlidingConfig::default() }
}

/// Parameters of `ttt_eval/score_first`: the TTT loop's settings ([`TttConfig`]'s keys, the
/// windows' among them), the sliding score first or not, and the executor.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ScoreFirstParams {
    /// The loop ([`TttConfig`]'s keys).
    #[serde(flatten)]
    pub ttt: TttConfig,
    /// Also log the sliding-window score before TTT (the records' `quantized_sliding_window`).
    pub sliding_first: bool,
    /// What runs the passes: "engine" (the explicit engine: f32 on the CPU, bf16 activations
    /// on a GPU) or "candle" (the candle model and its autograd, f32).
    pub executor: EvalExecutor,
}

impl Default for ScoreFirstParams {
    fn default() -> Self {
        Self { ttt: TttConfig { sliding: stage_windows(), ..TttConfig::default() }, sliding_first: true, executor: EvalExecutor::default() }
    }
}

impl ScoreFirstParams {
    fn ttt(&self, train_seq_len: usize) -> TttConfig {
        TttConfig { sliding: self.ttt.sliding.at(train_seq_len), ..self.ttt.clone() }
    }
}

/// What the implementations share: the validation stream, the log, the config, the ranks, the
/// executor.
struct Evaluator {
    /// The stage's name (errors name its keys).
    stage: String,
    /// What runs the passes.
    executor: EvalExecutor,
    validator: Validator,
    /// The ranks of a data-parallel run (a world of one otherwise): they share the sliding
    /// windows and the TTT batches, every rank holding the same weights.
    ranks: std::sync::Arc<dyn crate::dist::Collective>,
    config: crate::train::config::Config,
    log: StageLog,
    done: bool,
}

impl Evaluator {
    fn new(ctx: &BuildCtx, executor: EvalExecutor) -> anyhow::Result<Self> {
        anyhow::ensure!(config(ctx)?.data.val.is_some(), "`data.val` is not set: this stage scores the validation shards");
        let shape = config(ctx)?.batch_shape()?;
        Ok(Self {
            stage: ctx.stage.to_string(),
            executor,
            validator: Validator::load(&config(ctx)?.validation(), shape.micro_steps)?,
            ranks: crate::dist::world(),
            config: config(ctx)?.clone(),
            log: StageLog::new(ctx.run_dir),
            done: false,
        })
    }

    /// The model of a pass from `weights` on the stage's executor (the engine on micro-batches
    /// of `rows x t`), logged with where it runs.
    fn model(&self, weights: &[(String, candle_core::Tensor)], rows: usize, t: usize) -> anyhow::Result<Box<dyn EvalModel>> {
        self.model_sized(weights, crate::engine::layout::Sizing::fixed(rows, t))
    }

    /// [`Evaluator::model`] with the engine's arena sized by `sizing` (phased TTT's).
    fn model_sized(
        &self,
        weights: &[(String, candle_core::Tensor)],
        sizing: crate::engine::layout::Sizing,
    ) -> anyhow::Result<Box<dyn EvalModel>> {
        let model = crate::artifact::roundtrip::model_from(&self.config, weights)?;
        // What the engine cannot run was refused before training (`check_executor`).
        let m = crate::train::engine_eval::open_sized(model, self.executor, sizing)
            .with_context(|| format!("stage `{}`: building the evaluation's {} model", self.stage, self.executor.name()))?;
        let (rows, t) = (sizing.rows, sizing.t);
        let lora = match sizing.lora {
            Some(l) if self.executor == EvalExecutor::Engine => {
                format!(", LoRA passes of up to {} documents x {} tokens at rank {}", l.docs, sizing.max_t, l.rank)
            }
            _ => String::new(),
        };
        self.log.line(&format!("{}: {} on {rows} x {t} tokens a pass{lora}", self.stage, m.describe()));
        Ok(m)
    }

    /// The sliding-window pass; logs and returns its section.
    fn sliding(&mut self, snap: &TrainSnapshot, cfg: &SlidingConfig, ctx: &mut Ctx) -> anyhow::Result<Option<serde_json::Value>> {
        let (label, weights) = snap.eval_weights();
        // Building the model from the weights is part of the evaluation (and its time).
        let t0 = Instant::now();
        let mut model = self.model(weights, cfg.batch_windows, cfg.seq_len)?;
        let tables = self.validator.tables().clone();
        let tokens = self.validator.tokens();
        let Some(acc) = sliding_eval_shared(model.as_mut(), tokens, tables, cfg, self.ranks.as_ref(), || !ctx.aborted())? else {
            return Ok(None);
        };
        ctx.record("sliding", t0.elapsed().as_nanos() as u64);
        let mut section = self.scored(&format!("{label}_sliding_window"), &acc, t0);
        section["seq_len"] = serde_json::json!(cfg.seq_len);
        section["stride"] = serde_json::json!(cfg.stride);
        Ok(Some(section))
    }

    /// Logs a score in the records' format (`<name> val_loss:%.8f val_bpb:%.8f
    /// eval_time:%.0fms`, timed from `t0`) and returns it as a report section.
    fn scored(&self, name: &str, acc: &BpbAccumulator, t0: Instant) -> serde_json::Value {
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        self.log.line(&acc.score_line(name, ms));
        serde_json::json!({
            "val_loss": acc.val_loss(),
            "val_bpb": acc.val_bpb(),
            "val_tokens": acc.tokens(),
            "val_bytes": acc.bytes(),
            "eval_ms": ms,
        })
    }

    /// Score-first TTT; logs and returns its section.
    fn ttt(&mut self, snap: &TrainSnapshot, cfg: &TttConfig, ctx: &mut Ctx) -> anyhow::Result<Option<serde_json::Value>> {
        let (label, weights) = snap.eval_weights();
        // Building the model from the weights is part of the evaluation (and its time).
        let t0 = Instant::now();
        let mut model = self.model(weights, cfg.rows_per_rank(self.ranks.world()).0, cfg.sliding.seq_len)?;
        let tables = self.validator.tables().clone();
        let mut times: Vec<(&'static str, Duration)> = Vec::new();
        let aborted = || ctx.aborted();
        let outcome = score_first_ttt_shared(
            model.as_mut(),
            self.validator.tokens(),
            tables,
            cfg,
            self.ranks.as_ref(),
            |e| match e {
                TttEvent::Scored { elapsed, .. } => times.push(("chunk_score", *elapsed)),
                TttEvent::Trained { elapsed, .. } => times.push(("chunk_train", *elapsed)),
            },
            || !aborted(),
        )?;
        for (k, d) in times {
            ctx.record(k, d.as_nanos() as u64);
        }
        let Some(o) = outcome else { return Ok(None) };
        let mut section = self.scored(&format!("{label}_ttt"), &o.acc, t0);
        section["chunks"] = serde_json::json!(o.chunks);
        section["chunk_tokens"] = serde_json::json!(cfg.chunk_tokens);
        section["lr"] = serde_json::json!(cfg.lr);
        section["epochs"] = serde_json::json!(cfg.epochs);
        Ok(Some(section))
    }

    /// Runs `f` on the final snapshot of a run that ended normally, once.
    fn on_final(
        &mut self,
        snap: TrainSnapshot,
        ctx: &mut Ctx,
        f: impl FnOnce(&mut Self, &TrainSnapshot, &mut Ctx) -> anyhow::Result<serde_json::Value>,
    ) -> anyhow::Result<()> {
        if self.done || !snap.is_final_for_eval() {
            return Ok(());
        }
        self.done = true;
        let mut section = ctx.finishing(|ctx| f(self, &snap, ctx))?;
        section["weights"] = serde_json::json!(snap.eval_weights().0);
        section["step"] = serde_json::json!(snap.step);
        ctx.publish("eval", section);
        Ok(())
    }
}

/// Whether `executor` can run the run's model on rows of `t` tokens on the run's device (the
/// engine's refusal names the element and how to ask for candle).
fn check_executor(executor: EvalExecutor, ctx: &BuildCtx, t: usize) -> anyhow::Result<()> {
    let c = config(ctx)?;
    let gpu = crate::device::runs_on_gpu(&c.run.device);
    crate::train::engine_eval::check(executor, &c.model, t, gpu, ctx.stage)
}

/// An evaluator's memory: its snapshots, a model, and what its passes hold. On candle: the
/// larger of a sliding batch's forward pass and (with TTT) a training batch with its gradients
/// and momentum. On the engine: its arena on the larger of the two micro-batches (the sliding
/// pass's `batch_windows` rows and TTT's rows; the passes build their engines one after the
/// other) and the candle model it is built from (dropped once the weights are in the arena). `ttt_batch`: the rows one rank trains on at once, and
/// the key that sets them.
fn eval_memory(
    ctx: &BuildCtx,
    sliding: &SlidingConfig,
    ttt_batch: Option<(usize, &str)>,
    executor: EvalExecutor,
) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
    use crate::model::memory::{MODEL_KEYS, ParamCounts, forward_bytes, snapshots_need, training_bytes};
    let m = &config(ctx)?.model;
    m.check()?;
    let total = ParamCounts::of(m).total;
    let t = sliding.seq_len;
    let mut needs = vec![snapshots_need(m, ctx.stage, ctx.queue)];
    let mut keys: Vec<String> = vec![format!("stages.{}.batch_windows", ctx.stage)];
    let (what, bytes) = match executor {
        EvalExecutor::Engine => {
            let arena = |rows: usize| crate::train::engine_eval::EngineModel::arena_bytes(m, rows, t, &ctx.run.device);
            let mut bytes = arena(sliding.batch_windows);
            if let Some((rows, key)) = ttt_batch
                && arena(rows) >= bytes
            {
                keys[0] = format!("stages.{}.{key}", ctx.stage);
                bytes = arena(rows);
            }
            ("evaluation engine's arena and the candle model it is built from", total.saturating_mul(4).saturating_add(bytes))
        }
        EvalExecutor::Candle => {
            let score = forward_bytes(m, sliding.batch_windows * t, t, true, 4);
            match ttt_batch {
                Some((rows, key)) if training_bytes(m, rows * t, t, true, 4).saturating_add(total.saturating_mul(8)) > score => {
                    keys[0] = format!("stages.{}.{key}", ctx.stage);
                    (
                        "TTT model, gradients, momentum and activations",
                        total.saturating_mul(12).saturating_add(training_bytes(m, rows * t, t, true, 4)),
                    )
                }
                _ => ("scoring model and activations", total.saturating_mul(4).saturating_add(score)),
            }
        }
    };
    keys.extend(MODEL_KEYS.iter().map(|k| k.to_string()));
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    needs.push(crate::runtime::memory::Need::device(what, bytes, &keys).transient());
    Ok(needs)
}

/// `ttt_eval/sliding`.
pub struct Sliding {
    cfg: SlidingConfig,
    ev: Evaluator,
}

impl Sink for Sliding {
    const KIND: &'static str = "ttt_eval";
    const IMPL: &'static str = "sliding";
    const DOC: &'static str = "Sliding-window evaluation of the final weights (window seq_len, stride; each target scored once).";
    type Params = SlidingParams;
    type In = TrainSnapshot;

    /// The final weights only.
    fn demand(_p: &SlidingParams) -> Demand {
        Demand::LAST
    }

    fn check(p: &SlidingParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        let cfg = p.sliding.at(config(ctx)?.train.seq_len);
        TttConfig { sliding: cfg, ..ScoreFirstParams::default().ttt(config(ctx)?.train.seq_len) }.check()?;
        check_executor(p.executor, ctx, cfg.seq_len)
    }

    fn memory(p: &SlidingParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        let cfg = p.sliding.at(config(ctx)?.train.seq_len);
        eval_memory(ctx, &cfg, None, p.executor)
    }

    fn build(p: SlidingParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        let cfg = p.sliding.at(config(ctx)?.train.seq_len);
        Ok(Self { cfg, ev: Evaluator::new(ctx, p.executor)? })
    }

    fn consume(&mut self, snap: TrainSnapshot, ctx: &mut Ctx) -> anyhow::Result<()> {
        let cfg = self.cfg;
        self.ev.on_final(snap, ctx, |ev, snap, ctx| {
            let sliding = ev.sliding(snap, &cfg, ctx)?;
            Ok(serde_json::json!({ "sliding": sliding }))
        })
    }
}

/// `ttt_eval/score_first`.
pub struct ScoreFirst {
    p: ScoreFirstParams,
    cfg: TttConfig,
    ev: Evaluator,
}

impl Sink for ScoreFirst {
    const KIND: &'static str = "ttt_eval";
    const IMPL: &'static str = "score_first";
    const DOC: &'static str =
        "Legal score-first TTT on the final weights: each validation chunk scored before SGD trains on it; sliding-window score too.";
    type Params = ScoreFirstParams;
    type In = TrainSnapshot;

    /// The final weights only.
    fn demand(_p: &ScoreFirstParams) -> Demand {
        Demand::LAST
    }

    fn check(p: &ScoreFirstParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        let cfg = p.ttt(config(ctx)?.train.seq_len);
        cfg.check()?;
        check_executor(p.executor, ctx, cfg.sliding.seq_len)
    }

    fn memory(p: &ScoreFirstParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        let c = config(ctx)?;
        let cfg = p.ttt(c.train.seq_len);
        eval_memory(ctx, &cfg.sliding, Some(cfg.rows_per_rank(c.run.world_size)), p.executor)
    }

    fn build(p: ScoreFirstParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        Ok(Self { cfg: p.ttt(config(ctx)?.train.seq_len), ev: Evaluator::new(ctx, p.executor)?, p })
    }

    fn consume(&mut self, snap: TrainSnapshot, ctx: &mut Ctx) -> anyhow::Result<()> {
        let (cfg, sliding_first) = (self.cfg.clone(), self.p.sliding_first);
        self.ev.on_final(snap, ctx, |ev, snap, ctx| {
            let sliding = if sliding_first { ev.sliding(snap, &cfg.sliding, ctx)? } else { None };
            let ttt = ev.ttt(snap, &cfg, ctx)?;
            let gain = match (&sliding, &ttt) {
                (Some(s), Some(t)) => Some(s["val_bpb"].as_f64().unwrap_or(f64::NAN) - t["val_bpb"].as_f64().unwrap_or(f64::NAN)),
                _ => None,
            };
            Ok(serde_json::json!({ "sliding": sliding, "ttt": ttt, "ttt_gain_bpb": gain }))
        })
    }
}
