//! `ttt_eval/phased`: phased TTT, the evaluation of the records since PR #1626 (spec §5): the
//! validation stream cut into documents at BOS, each scored chunk by chunk with its own LoRA
//! adapters trained on its chunks already scored, and after prefixes of documents the base
//! model trained with SGD on the documents scored so far ([`crate::eval::phased`]).
//!
//! Logs a `ttp:` line per batch of documents and a `ttpp:` line per phase, then the score as
//! `<label>_ttt_phased val_loss:… val_bpb:… eval_time:…ms`. The report's `eval.ttt` holds the
//! score (the ablation table's `ttt_bpb`), its time split into scoring, adaptation and global
//! SGD, and one entry per phase. Histograms: `doc_batch` (per batch of documents) and
//! `global_sgd` (per phase).

use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{Evaluator, ScoreFirstParams, config, eval_memory, sliding_cfg};
use crate::eval::executor::EvalExecutor;
use crate::eval::phased::{PhasedConfig, PhasedEvent, phased_ttt};
use crate::eval::ttt::SlidingConfig;
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Sink};
use crate::train::snapshot::TrainSnapshot;

/// Parameters of `ttt_eval/phased`. The defaults are PR #1626's (spec §5.7).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PhasedParams {
    /// LoRA rank of every adapter: q, k, v, o and MLP per slot of the layer sequence, and the
    /// output head (96).
    pub lora_rank: usize,
    /// AdamW learning rate of the adapters (1e-4, constant).
    pub lora_lr: f64,
    /// AdamW betas of the adapters ([0, 0.999]: no first moment).
    pub lora_betas: [f64; 2],
    /// AdamW epsilon (1e-10).
    pub lora_eps: f64,
    /// AdamW decoupled weight decay of the adapters (0.5).
    pub lora_weight_decay: f64,
    /// LoRA alpha: adapter outputs scaled by `alpha / lora_rank` (`TTT_LORA_ALPHA`, 144 in the
    /// 04-27 record); unset: not scaled (PR #1626).
    pub lora_alpha: Option<f64>,
    /// Warm start of A (`TTT_WARM_START_A`, on in the 04-27 record): each full batch starts from
    /// the previous full batch's A with B zeroed and a fresh optimizer; a phase's global SGD
    /// draws fresh adapters. False (PR #1626): a fresh A for every batch.
    pub lora_warm_start_a: bool,
    /// Targets per chunk of a document (48): scored, then one update.
    pub chunk: usize,
    /// Most tokens of context a chunk's window holds, all of its own document (2048).
    pub context: usize,
    /// Documents per batch, sorted by length, longest batch first (64).
    pub batch_docs: usize,
    /// Documents scored before the last phase's pause (2000); the pauses fall at
    /// `prefix_docs * k / phases`.
    pub prefix_docs: usize,
    /// Phases of global SGD on the base model (3); 0: per-document LoRA TTT only.
    pub phases: usize,
    /// Tokens per chunk of a phase's training stream (32768); its last chunk is not trained on.
    pub global_chunk_tokens: usize,
    /// Sequence length of the global SGD (0: `train.seq_len`; 2048 in the record), attention
    /// kept inside documents.
    pub global_seq_len: usize,
    /// Peak learning rate of the global SGD, cosine-decayed over a phase's chunks (0.001).
    pub global_lr: f64,
    /// SGD momentum of the global SGD (0.9; a fresh optimizer each phase, no weight decay).
    pub global_momentum: f64,
    /// Passes over each global chunk (1).
    pub global_epochs: usize,
    /// Sequences per global SGD step (32).
    pub global_batch_seqs: usize,
    /// Global gradient-norm clip of the global SGD (1.0; 0 turns it off).
    pub global_grad_clip: f64,
    /// Also log the sliding-window score first (the record does not: false).
    pub sliding_first: bool,
    /// Window length of that sliding score (0: `train.seq_len`).
    pub seq_len: usize,
    /// Stride of that sliding score (64).
    pub stride: usize,
    /// Windows per forward pass of that sliding score (32).
    pub batch_windows: usize,
    /// What runs the evaluation (the LoRA passes, the global SGD and the sliding score):
    /// "engine" (the explicit engine: f32 on the CPU, bf16 activations on a GPU; one arena holds
    /// the adapters and AdamW's moments) or "candle".
    pub executor: EvalExecutor,
}

impl Default for PhasedParams {
    fn default() -> Self {
        let c = PhasedConfig::default();
        let s = ScoreFirstParams::default();
        Self {
            lora_rank: c.lora_rank,
            lora_lr: c.lora_lr,
            lora_betas: [c.lora_betas.0, c.lora_betas.1],
            lora_eps: c.lora_eps,
            lora_weight_decay: c.lora_weight_decay,
            lora_alpha: c.lora_alpha,
            lora_warm_start_a: c.lora_warm_start_a,
            chunk: c.chunk,
            context: c.context,
            batch_docs: c.batch_docs,
            prefix_docs: c.prefix_docs,
            phases: c.phases,
            global_chunk_tokens: c.global_chunk_tokens,
            global_seq_len: 0,
            global_lr: c.global_lr,
            global_momentum: c.global_momentum,
            global_epochs: c.global_epochs,
            global_batch_seqs: c.global_batch_seqs,
            global_grad_clip: c.global_grad_clip,
            sliding_first: false,
            seq_len: s.seq_len,
            stride: s.stride,
            batch_windows: s.batch_windows,
            executor: s.executor,
        }
    }
}

impl PhasedParams {
    /// The loop's settings, with `train.seq_len` where a length is 0.
    pub(super) fn config(&self, train_seq_len: usize) -> PhasedConfig {
        PhasedConfig {
            lora_rank: self.lora_rank,
            lora_lr: self.lora_lr,
            lora_betas: (self.lora_betas[0], self.lora_betas[1]),
            lora_eps: self.lora_eps,
            lora_weight_decay: self.lora_weight_decay,
            lora_alpha: self.lora_alpha,
            lora_warm_start_a: self.lora_warm_start_a,
            chunk: self.chunk,
            context: self.context,
            batch_docs: self.batch_docs,
            prefix_docs: self.prefix_docs,
            phases: self.phases,
            global_chunk_tokens: self.global_chunk_tokens,
            global_seq_len: if self.global_seq_len == 0 { train_seq_len } else { self.global_seq_len },
            global_lr: self.global_lr,
            global_momentum: self.global_momentum,
            global_epochs: self.global_epochs,
            global_batch_seqs: self.global_batch_seqs,
            global_grad_clip: self.global_grad_clip,
        }
    }

    fn sliding(&self, train_seq_len: usize) -> SlidingConfig {
        sliding_cfg(self.seq_len, self.stride, self.batch_windows, train_seq_len)
    }
}

/// `ttt_eval/phased`.
pub struct Phased {
    p: PhasedParams,
    cfg: PhasedConfig,
    bos: u32,
    /// Draws the adapters (the stage's seed, from `run.seed`).
    seed: u64,
    ev: Evaluator,
}

impl Sink for Phased {
    const KIND: &'static str = "ttt_eval";
    const IMPL: &'static str = "phased";
    const DOC: &'static str = "Phased TTT on the final weights: per-document LoRA trained chunk by chunk after scoring, and global SGD of the base at phase pauses.";
    type Params = PhasedParams;
    type In = TrainSnapshot;

    /// The final weights only.
    fn demand(_p: &PhasedParams) -> Demand {
        Demand::LAST
    }

    fn check(p: &PhasedParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        let seq_len = config(ctx)?.train.seq_len;
        p.config(seq_len).check()?;
        p.sliding(seq_len).check()?;
        super::check_executor(p.executor, ctx, p.config(seq_len).global_seq_len)?;
        if p.sliding_first {
            super::check_executor(p.executor, ctx, p.sliding(seq_len).seq_len)?;
        }
        Ok(())
    }

    fn memory(p: &PhasedParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        let seq_len = config(ctx)?.train.seq_len;
        let cfg = p.config(seq_len);
        // The larger of: a scoring batch (documents x context) and a global SGD batch.
        let rows = p.batch_docs.max(cfg.global_batch_seqs);
        let key = if p.batch_docs >= cfg.global_batch_seqs { "batch_docs" } else { "global_batch_seqs" };
        let mut needs = match p.executor {
            EvalExecutor::Candle => {
                let sliding = SlidingConfig { seq_len: cfg.context.max(cfg.global_seq_len), stride: 1, batch_windows: rows };
                eval_memory(ctx, &sliding, Some((rows, key)), p.executor)?
            }
            EvalExecutor::Engine => {
                // One arena: the global SGD's micro-batches (a rank's share of
                // `global_batch_seqs`), the LoRA passes' documents x context, and the adapters
                // with their gradients, AdamW's moments and kept products.
                let c = config(ctx)?;
                let (m, world) = (&c.model, c.run.world_size.max(1));
                m.check()?;
                let (rows, key) = cfg.global_rows_per_rank(world);
                let gpu = crate::device::runs_on_gpu(&c.run.device);
                let sizing =
                    crate::train::engine_eval::phased_sizing((rows, cfg.global_seq_len), (p.batch_docs, cfg.context, p.lora_rank), gpu);
                let arena = crate::train::engine_eval::EngineModel::arena_bytes_sized(m, sizing, &c.run.device);
                // The candle model of the weights the arena is filled from (dropped then), and the
                // kept adapters' values set aside while a short batch's fresh ones are in the arena.
                let kept = crate::model::lora::Lora::count(m, m.recurrent(), (p.batch_docs, p.lora_rank)) as u64 * 4;
                let mirror = crate::model::memory::ParamCounts::of(m).total.saturating_mul(4).saturating_add(kept);
                let mut keys: Vec<String> =
                    ["batch_docs", "context", "lora_rank", key].iter().map(|k| format!("stages.{}.{k}", ctx.stage)).collect();
                keys.extend(crate::model::memory::MODEL_KEYS.iter().map(|k| k.to_string()));
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let what = "evaluation engine's arena (global SGD, LoRA passes, adapters and AdamW), the candle model it is built from and the kept adapters set aside";
                return Ok(vec![
                    crate::model::memory::snapshots_need(m, ctx.stage, ctx.queue),
                    crate::runtime::memory::Need::device(what, arena.saturating_add(mirror), &keys).transient(),
                ]);
            }
        };
        // The adapters of one batch with their gradients and AdamW's two moments, in f32.
        let m = &config(ctx)?.model;
        let lora = crate::model::lora::Lora::count(m, m.recurrent(), (p.batch_docs, p.lora_rank)) as u64 * 16;
        let keys = [format!("stages.{}.batch_docs", ctx.stage), format!("stages.{}.lora_rank", ctx.stage)];
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        needs.push(crate::runtime::memory::Need::device("LoRA adapters, gradients and AdamW moments", lora, &keys).transient());
        Ok(needs)
    }

    fn build(p: PhasedParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        let c = config(ctx)?;
        let tokenizer = c
            .data
            .tokenizer
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("`data.tokenizer` is not set: phased TTT finds documents at its BOS"))?;
        let bos = crate::data::tokenizer::bos_id(tokenizer)?;
        Ok(Self { cfg: p.config(c.train.seq_len), bos, seed: ctx.seed(), ev: Evaluator::new(ctx, p.executor)?, p })
    }

    fn consume(&mut self, snap: TrainSnapshot, ctx: &mut Ctx) -> anyhow::Result<()> {
        let (cfg, bos, seed, p) = (self.cfg.clone(), self.bos, self.seed, self.p.clone());
        self.ev.on_final(snap, ctx, |ev, snap, ctx| {
            let seq_len = ev.config.train.seq_len;
            let sliding = if p.sliding_first { ev.sliding(snap, &p.sliding(seq_len), ctx)? } else { None };
            let ttt = ev.phased(snap, (&cfg, bos, seed), ctx)?;
            let gain = match (&sliding, &ttt) {
                (Some(s), Some(t)) => Some(s["val_bpb"].as_f64().unwrap_or(f64::NAN) - t["val_bpb"].as_f64().unwrap_or(f64::NAN)),
                _ => None,
            };
            Ok(serde_json::json!({ "sliding": sliding, "ttt": ttt, "ttt_gain_bpb": gain }))
        })
    }
}

impl Evaluator {
    /// Phased TTT; logs and returns its section.
    fn phased(
        &mut self,
        snap: &TrainSnapshot,
        (cfg, bos, seed): (&PhasedConfig, u32, u64),
        ctx: &mut Ctx,
    ) -> anyhow::Result<Option<serde_json::Value>> {
        let (label, weights) = snap.eval_weights();
        // Building the model from the weights is part of the evaluation (and its time).
        let t0 = Instant::now();
        // The global SGD's steps (a rank's share of a step's sequences) and the LoRA passes.
        let rows = cfg.global_rows_per_rank(self.ranks.world()).0;
        let gpu = crate::device::runs_on_gpu(&self.config.run.device);
        let sizing =
            crate::train::engine_eval::phased_sizing((rows, cfg.global_seq_len), (cfg.batch_docs, cfg.context, cfg.lora_rank), gpu);
        let mut model = self.model_sized(weights, sizing)?;
        let tables = self.validator.tables().clone();
        let mut times: Vec<(&'static str, Duration)> = Vec::new();
        let mut last = Instant::now();
        let log = &self.log;
        let aborted = || ctx.aborted();
        let outcome = phased_ttt(
            model.as_mut(),
            self.validator.tokens(),
            tables,
            (cfg, bos, seed),
            self.ranks.as_ref(),
            |e| match e {
                PhasedEvent::Batch { line } => {
                    log.line(line);
                    times.push(("doc_batch", last.elapsed()));
                    last = Instant::now();
                }
                PhasedEvent::PhaseStart { phase, docs } => {
                    log.line(&format!(
                        "ttpp: phase {phase}/{} pause at {:.1}s: global SGD on {} documents",
                        cfg.phases,
                        t0.elapsed().as_secs_f64(),
                        docs.len()
                    ));
                }
                _ => {}
            },
            || !aborted(),
        )?;
        for (k, d) in times {
            ctx.record(k, d.as_nanos() as u64);
        }
        let Some(o) = outcome else { return Ok(None) };
        for ph in &o.phases {
            ctx.record("global_sgd", (ph.stats.seconds * 1e9) as u64);
            self.log.line(&format!(
                "ttpp: phase {}/{} done: {} documents, {} tokens, {} of {} chunks trained, {} steps, {:.1}s",
                ph.phase, cfg.phases, ph.docs, ph.stats.tokens, ph.stats.trained_chunks, ph.stats.chunks, ph.stats.steps, ph.stats.seconds
            ));
        }
        if o.phases.len() < o.boundaries.len() {
            self.log.line(&format!(
                "ttpp: only {} of {} phases ran: the split has {} documents, the boundaries are {:?} (lower `prefix_docs` or raise `train.val_max_tokens`)",
                o.phases.len(),
                o.boundaries.len(),
                o.docs,
                o.boundaries
            ));
        }
        let mut section = self.scored(&format!("{label}_ttt_phased"), &o.acc, t0);
        section["kind"] = serde_json::json!("phased");
        section["documents"] = serde_json::json!(o.docs);
        section["batches"] = serde_json::json!(o.batches);
        section["boundaries"] = serde_json::json!(o.boundaries);
        section["score_ms"] = serde_json::json!(o.times.score.as_secs_f64() * 1e3);
        section["adapt_ms"] = serde_json::json!(o.times.adapt.as_secs_f64() * 1e3);
        section["global_ms"] = serde_json::json!(o.times.global.as_secs_f64() * 1e3);
        section["phases"] = o
            .phases
            .iter()
            .map(|ph| {
                serde_json::json!({
                    "phase": ph.phase,
                    "documents": ph.docs,
                    "scored_at_pause": ph.scored_at_pause,
                    "after_batch": ph.after_batch,
                    "paused_at_ms": ph.paused_at.as_secs_f64() * 1e3,
                    "tokens": ph.stats.tokens,
                    "chunks": ph.stats.chunks,
                    "trained_chunks": ph.stats.trained_chunks,
                    "steps": ph.stats.steps,
                    "eval_ms": ph.stats.seconds * 1e3,
                })
            })
            .collect();
        section["lora_rank"] = serde_json::json!(cfg.lora_rank);
        section["lora_alpha"] = serde_json::json!(cfg.lora_alpha);
        section["lora_warm_start_a"] = serde_json::json!(cfg.lora_warm_start_a);
        section["chunk"] = serde_json::json!(cfg.chunk);
        Ok(Some(section))
    }
}
