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

use super::{Evaluator, SlidingParams, config, eval_memory};
use crate::eval::executor::EvalExecutor;
use crate::eval::phased::{PhasedConfig, PhasedEvent, phased_ttt};
use crate::eval::ttt::SlidingConfig;
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Sink};
use crate::train::snapshot::TrainSnapshot;

/// Parameters of `ttt_eval/phased`: the loop's settings ([`PhasedConfig`]'s keys, PR #1626's
/// defaults, spec §5.7), the sliding score's windows ([`SlidingConfig`]'s keys) and whether it
/// runs, and the executor.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct PhasedParams {
    /// The loop ([`PhasedConfig`]'s keys).
    #[serde(flatten)]
    pub phased: PhasedConfig,
    /// The windows of the sliding score ([`SlidingConfig`]'s keys).
    #[serde(flatten)]
    pub sliding: SlidingConfig,
    /// Also log the sliding-window score first (the record does not: false).
    pub sliding_first: bool,
    /// What runs the evaluation (the LoRA passes, the global SGD and the sliding score):
    /// "engine" (the explicit engine: f32 on the CPU, bf16 activations on a GPU; one arena holds
    /// the adapters and AdamW's moments) or "candle".
    pub executor: EvalExecutor,
}

impl Default for PhasedParams {
    fn default() -> Self {
        let s = SlidingParams::default();
        Self {
            phased: PhasedConfig { global_seq_len: 0, ..PhasedConfig::default() },
            sliding: s.sliding,
            sliding_first: false,
            executor: s.executor,
        }
    }
}

impl PhasedParams {
    /// The loop's settings, with `train.seq_len` where a length is 0.
    pub(super) fn config(&self, train_seq_len: usize) -> PhasedConfig {
        let g = self.phased.global_seq_len;
        PhasedConfig { global_seq_len: if g == 0 { train_seq_len } else { g }, ..self.phased.clone() }
    }

    fn sliding(&self, train_seq_len: usize) -> SlidingConfig {
        self.sliding.at(train_seq_len)
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
        let rows = cfg.batch_docs.max(cfg.global_batch_seqs);
        let key = if cfg.batch_docs >= cfg.global_batch_seqs { "batch_docs" } else { "global_batch_seqs" };
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
                    crate::train::engine_eval::phased_sizing((rows, cfg.global_seq_len), (cfg.batch_docs, cfg.context, cfg.lora_rank), gpu);
                let arena = crate::train::engine_eval::EngineModel::arena_bytes_sized(m, sizing, &c.run.device);
                // The candle model of the weights the arena is filled from (dropped then), and the
                // kept adapters' values set aside while a short batch's fresh ones are in the arena.
                let kept = crate::model::lora::Lora::count(m, m.recurrent(), (p.phased.batch_docs, p.phased.lora_rank)) as u64 * 4;
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
        let lora = crate::model::lora::Lora::count(m, m.recurrent(), (p.phased.batch_docs, p.phased.lora_rank)) as u64 * 16;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::stage::parse_params as parse;

    /// The evaluation stages take the library's keys flat, with the stages' lengths following
    /// `train.seq_len` unless set, and refuse a misspelt key.
    #[test]
    fn the_loops_keys_are_the_stages_with_lengths_from_training() {
        let p: PhasedParams = parse("").unwrap();
        assert_eq!((p.config(1024).global_seq_len, p.sliding(1024).seq_len), (1024, 1024));
        assert_eq!(p.config(1024), PhasedConfig { global_seq_len: 1024, ..PhasedConfig::default() });
        let p: PhasedParams = parse("global_seq_len = 512\nlora_betas = [0.9, 0.99]\nstride = 16\nseq_len = 256").unwrap();
        assert_eq!(
            (p.config(1024).global_seq_len, p.phased.lora_betas, p.sliding(1024)),
            (512, (0.9, 0.99), SlidingConfig { seq_len: 256, stride: 16, batch_windows: 32 })
        );
        assert!(parse::<PhasedParams>("lora_rnak = 8").unwrap_err().to_string().contains("lora_rnak"));
        let s: super::super::ScoreFirstParams = parse("lr = 0.01").unwrap();
        assert_eq!(
            s.ttt(64),
            crate::eval::ttt::TttConfig {
                sliding: SlidingConfig { seq_len: 64, ..SlidingConfig::default() },
                lr: 0.01,
                ..Default::default()
            }
        );
        assert!(parse::<super::super::ScoreFirstParams>("chunk = 8").unwrap_err().to_string().contains("chunk"));
    }
}
