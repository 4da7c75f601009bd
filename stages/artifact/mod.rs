//! Kind `artifact`: the challenge's post-training step inside the graph (spec 3.10, 4.5, 4.6).
//!
//! When training ends normally, the stage takes the weights to evaluate (the average when an
//! `ema_swa` stage provides one, else the last step's) and, with `eval = true`, first scores
//! them (`pre-quantization post-ema`); then quantizes them, compresses them, writes
//! `RUN_DIR/<file>` atomically, reports its bytes and the code's against the 16,000,000-byte
//! cap, reads the file back, checks it and dequantizes it, and scores the restored weights
//! (`quantized`, and the baseline's `final_int8_zlib_roundtrip(_exact)` lines). The restored
//! weights go on, labelled `quantized`, to the evaluation stage (`quantized_sliding_window`,
//! `quantized_ttt`). Steps and Ctrl-C pass through untouched.
//!
//! Two implementations with the same parameters, so that an ablation is one `impl =` line:
//!
//! - `quantize`: every matrix rounded to its nearest level (the baseline's round trip);
//! - `gptq`: GPTQ (spec 4.5): Hessians from `calibration_batches` micro-batches of a fresh
//!   shuffled sampler with the training seed, through the looped model, then each matrix's
//!   columns quantized in act-order with the error fed forward.
//!
//! The quantization scheme (bits per group, row scales, fp16 passthrough, byte shuffle, codec)
//! is the same keys for both; their defaults are the baseline's, and `pipelines/record.toml`
//! sets the record's. Hessians and GPTQ are what `train.gptq_reserve_seconds` is kept for: the
//! log and the report say how long they took against it.
//!
//! Several ranks (data parallel): they share the scoring passes; rank 0 alone calibrates,
//! quantizes and writes the file, then sends its bytes to the other ranks, which restore the
//! same weights from them (the record's ranks all read rank 0's file), so that every rank
//! hands the evaluation stage the same `quantized` weights.
//!
//! Histograms: `hessian_batch` (each calibration batch), `quantize` (GPTQ or rounding),
//! `compress` (serialize, shuffle, compress), `write`, `restore` (read back, decompress, check,
//! dequantize; logged beside the compression time, as it counts against evaluation), `eval`
//! (each scoring pass). The reserve counts the Hessians and the
//! quantization, as the record's does.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::Context;

mod params;

pub use self::params::ArtifactParams;
use super::config;
use crate::artifact::quant::ARTIFACT_CAP_BYTES;
use crate::artifact::roundtrip::{
    CodeBytes, Method, baseline_lines, calibrate, calibration_line, model_from, size_lines, write_and_restore,
};
use crate::eval::bpb::BpbAccumulator;
use crate::eval::executor::EvalExecutor;
use crate::eval::validation::Validator;
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Emitter, Transform};
use crate::train::log::StageLog;
use crate::train::snapshot::{EvalWeights, TrainSnapshot};

/// The stage body both implementations share.
pub struct ArtifactStage {
    p: ArtifactParams,
    method: Method,
    path: Option<PathBuf>,
    validator: Option<Validator>,
    /// The ranks of a data-parallel run (a world of one otherwise).
    ranks: Arc<dyn crate::dist::Collective>,
    config: crate::train::config::Config,
    log: StageLog,
    /// The code count, measured on its own thread from the start (a few seconds of Brotli).
    code: Option<JoinHandle<CodeBytes>>,
}

impl ArtifactStage {
    fn check(p: &ArtifactParams, ctx: &BuildCtx, gptq: bool) -> anyhow::Result<()> {
        p.check()?;
        // Before training, not after: `pergroup` runs lrzip.
        p.quant.codec.check_available().context("`codec`")?;
        let c = config(ctx)?;
        if p.eval {
            anyhow::ensure!(c.data.val.is_some(), "`eval = true` scores the round trip on `data.val`, which is not set");
        }
        if gptq {
            anyhow::ensure!(c.data.train.is_some(), "`gptq` calibrates on training data (`data.train`), which is not set");
        }
        if p.eval {
            let gpu = crate::device::runs_on_gpu(&c.run.device);
            crate::train::engine_eval::check(p.executor, &c.model, c.train.seq_len, gpu, ctx.stage)?;
        }
        Ok(())
    }

    fn memory(p: &ArtifactParams, ctx: &BuildCtx, gptq: bool) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        use crate::model::memory::{MODEL_KEYS, ParamCounts, forward_bytes, snapshots_need};
        let c = config(ctx)?;
        c.model.check()?;
        let total = ParamCounts::of(&c.model).total;
        // Quantized and compressed bytes (about one each per weight), the f32 copy restored
        // from the file, and the model the round trip is scored with.
        let mut needs = vec![
            snapshots_need(&c.model, ctx.stage, ctx.queue),
            crate::runtime::memory::Need::host("quantized, compressed and restored copies", total.saturating_mul(6), &MODEL_KEYS)
                .transient(),
        ];
        if gptq {
            // One f32 Hessian (in x in) per distinct input of a quantized matrix, on the device
            // while they are summed (q, k, v counted once each here: an upper bound).
            let bytes: u64 = c
                .model
                .param_shapes()
                .iter()
                .filter(|(_, s)| s.len() == 2 && s[0] * s[1] > crate::artifact::quant::PASSTHROUGH_MAX_NUMEL)
                .map(|(_, s)| (s[1] * s[1] * 4) as u64)
                .sum();
            needs.push(crate::runtime::memory::Need::device("GPTQ's Hessians", bytes, &MODEL_KEYS).transient());
        }
        if (p.eval || gptq) && p.executor == EvalExecutor::Engine {
            // The round trip's scores and GPTQ's calibration on an engine of the training
            // micro-batch's rows (one after the other); packed scores on one row of a
            // validation batch.
            let shape = c.batch_shape()?;
            let engine_bytes = |rows, t| crate::train::engine_eval::EngineModel::arena_bytes(&c.model, rows, t, &c.run.device);
            let mut arena = engine_bytes(shape.rows, shape.seq_len);
            let mut keys = vec!["train.batch_tokens"];
            if p.eval && c.train.val_packed {
                let pass = crate::eval::validation::tokens_per_pass(&c.validation(), c.run.world_size, shape.micro_steps);
                arena = arena.max(engine_bytes(1, pass));
                keys.extend(["train.val_batch_tokens", "train.val_packed"]);
            }
            keys.extend(MODEL_KEYS);
            needs.push(
                crate::runtime::memory::Need::device(
                    "scoring (or calibration) engine's arena and the candle model it is built from",
                    total.saturating_mul(4).saturating_add(arena),
                    &keys,
                )
                .transient(),
            );
        }
        if (p.eval || gptq) && p.executor == EvalExecutor::Candle {
            let shape = c.batch_shape()?;
            let tokens = crate::eval::validation::tokens_per_pass(&c.validation(), c.run.world_size, shape.micro_steps);
            let mut keys = vec!["train.val_batch_tokens"];
            keys.extend(MODEL_KEYS);
            needs.push(
                crate::runtime::memory::Need::device(
                    "scoring (or calibration) model and activations",
                    total.saturating_mul(4).saturating_add(forward_bytes(&c.model, tokens, shape.seq_len, true, 4)),
                    &keys,
                )
                .transient(),
            );
        }
        Ok(needs)
    }

    fn build(p: ArtifactParams, ctx: &BuildCtx, gptq: bool) -> anyhow::Result<Self> {
        Self::check(&p, ctx, gptq)?;
        let validator = if p.eval {
            let shape = config(ctx)?.batch_shape()?;
            Some(Validator::shared(&config(ctx)?.validation(), shape.micro_steps, crate::dist::world())?)
        } else {
            None
        };
        let code = match p.code_bytes {
            Some(n) => std::thread::spawn(move || CodeBytes::Given(n)),
            None => match ctx.run_dir.map(Path::to_path_buf) {
                Some(dir) => std::thread::Builder::new().name("code-size".into()).spawn(move || CodeBytes::measure(&dir))?,
                // No file to write here (a rank other than 0): nothing to count.
                None => std::thread::spawn(|| CodeBytes::Unmeasured("not rank 0".into())),
            },
        };
        Ok(Self {
            path: ctx.run_dir.map(|d| d.join(p.file_name())),
            method: p.method(gptq),
            p,
            validator,
            ranks: crate::dist::world(),
            config: config(ctx)?.clone(),
            log: StageLog::new(ctx.run_dir),
            code: Some(code),
        })
    }

    fn process(&mut self, mut snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        // Several ranks all take part (the scores are shared); rank 0 alone has the path.
        if snap.is_final_for_eval() && (self.path.is_some() || self.ranks.world() > 1) {
            let restored = ctx.finishing(|ctx| self.make(&snap, ctx))?;
            if let Some(r) = restored {
                snap.eval = Some(EvalWeights { label: "quantized".into(), tensors: Arc::new(r) });
            }
        }
        out.emit(snap)?;
        Ok(())
    }

    /// Writes the artifact of `snap`'s evaluation weights, in the record's order (spec 4.6);
    /// returns the restored weights (`None` when an abort cut it short). Several ranks: each
    /// scores its share of the validation; rank 0 alone calibrates, quantizes and writes the
    /// file (the record's ranks each compute Hessians, and all but rank 0's are dropped), then
    /// sends its bytes to the others, which restore the same weights from them.
    fn make(&mut self, snap: &TrainSnapshot, ctx: &mut Ctx) -> anyhow::Result<Option<Vec<(String, candle_core::Tensor)>>> {
        let (label, weights) = snap.eval_weights();
        let label = label.to_string();
        let path = self.path.clone();
        // Relative to the run directory: a copy of the directory names its own file.
        let shown = path.as_ref().map_or_else(
            || "rank 0's artifact".to_string(),
            |p| p.file_name().map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into_owned()),
        );
        let mut section = serde_json::json!({"path": shown, "weights": label, "method": self.method.name()});
        // 1. The weights as trained (the record's diagnostic `pre-quantization post-ema`).
        let before = match &self.validator {
            Some(v) => {
                let t0 = Instant::now();
                let Some(before) = self.score(v, weights, ctx)? else { return Ok(None) };
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                self.log.line(&before.score_line(&format!("pre-quantization post-{label}"), ms));
                section["before"] = serde_json::json!({"val_loss": before.val_loss(), "val_bpb": before.val_bpb(), "eval_ms": ms});
                Some(before)
            }
            None => None,
        };
        // 2. The file (rank 0), then every rank's restored copy of it.
        let written = match &path {
            Some(path) => self.produce(weights, &label, path, &mut section, ctx)?,
            None => None,
        };
        let restored = if self.ranks.world() == 1 {
            written
        } else {
            let bytes = match (&written, &path) {
                (Some(_), Some(p)) => std::fs::read(p).with_context(|| format!("cannot read the artifact {}", p.display()))?,
                _ => Vec::new(),
            };
            let sent = self.ranks.all_gather_bytes(&bytes).context("sending rank 0's artifact to the other ranks")?;
            match sent.first() {
                // Rank 0 was stopped (Ctrl-C) before writing it: no rank goes on.
                None => None,
                Some(b) if b.is_empty() => None,
                Some(_) if written.is_some() => written,
                Some(b) => Some(crate::artifact::roundtrip::restore_bytes(b, &self.config.model, &shown)?),
            }
        };
        let Some(restored) = restored else { return Ok(None) };
        // 3. The restored weights, looped as every evaluation after training (`quantized`).
        if let Some(v) = &self.validator {
            let t0 = Instant::now();
            let Some(after) = self.score(v, &restored, ctx)? else { return Ok(None) };
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            self.log.line(&after.score_line("quantized", ms));
            for l in baseline_lines(&self.p.quant, &after, ms) {
                self.log.line(&l);
            }
            section["after"] = serde_json::json!({"val_loss": after.val_loss(), "val_bpb": after.val_bpb(), "eval_ms": ms});
            section["val_tokens"] = serde_json::json!(after.tokens());
            if let Some(b) = before {
                section["bpb_loss"] = serde_json::json!(after.val_bpb() - b.val_bpb());
            }
        }
        ctx.publish("artifact", section);
        Ok(Some(restored))
    }

    /// Hessians (GPTQ) and quantization, what the reserve is for; then compression, the file
    /// at `path`, its sizes against the cap (logged, and added to `section`). Returns the
    /// weights restored from the file (`None` when an abort cut the Hessians short).
    fn produce(
        &mut self,
        weights: &[(String, candle_core::Tensor)],
        label: &str,
        path: &std::path::Path,
        section: &mut serde_json::Value,
        ctx: &mut Ctx,
    ) -> anyhow::Result<Option<Vec<(String, candle_core::Tensor)>>> {
        let q = self.p.quant.clone();
        let mut calibration_ms = 0.0;
        let hessians = match &self.method {
            Method::Gptq { calibration_batches, .. } => {
                let found = calibrate(&self.config, weights, *calibration_batches, self.p.executor, || !ctx.aborted())
                    .with_context(|| format!("the Hessians of the {label} weights"))?;
                let Some((h, stats)) = found else { return Ok(None) };
                for t in &h.batch_times {
                    ctx.record("hessian_batch", t.as_nanos() as u64);
                }
                self.log.line(&calibration_line(&stats));
                calibration_ms = stats.ms;
                section["calibration"] = serde_json::to_value(&stats)?;
                Some(h)
            }
            Method::Nearest => None,
        };
        let w = write_and_restore(weights, &self.config.model, &q, &self.method, hessians.as_ref(), path)
            .with_context(|| format!("the artifact of the {label} weights"))?;
        drop(hessians);
        let quantize_ms = w.quantize.as_secs_f64() * 1e3;
        let reserve_ms = calibration_ms + quantize_ms;
        ctx.record("quantize", w.quantize.as_nanos() as u64);
        ctx.record("compress", w.compress.as_nanos() as u64);
        ctx.record("write", w.write.as_nanos() as u64);
        ctx.record("restore", w.restore.as_nanos() as u64);
        let reserve = self.config.train.gptq_reserve_seconds;
        let against = if reserve > 0.0 {
            let verdict = if reserve_ms <= reserve * 1e3 { "within it" } else { "OVER IT" };
            format!(" of the {reserve:.0}s reserve (train.gptq_reserve_seconds): {verdict}")
        } else {
            String::new()
        };
        let took = match &self.method {
            Method::Gptq { .. } => {
                format!("hessians {:.1}s + quantize {:.1}s = {:.1}s", calibration_ms / 1e3, quantize_ms / 1e3, reserve_ms / 1e3)
            }
            Method::Nearest => format!("quantize {:.1}s", quantize_ms / 1e3),
        };
        let (m, c, r) = (self.method.name(), w.compress.as_secs_f64(), w.restore.as_secs_f64());
        self.log.line(&format!("artifact:{m} {took}{against}; compression {c:.1}s; restore {r:.1}s (counts against evaluation)"));
        for l in &w.kinds {
            self.log.line(&format!("  {l}"));
        }
        let panicked = || CodeBytes::Unmeasured("the measuring thread panicked".into());
        let code = self.code.take().map_or_else(panicked, |h| h.join().unwrap_or_else(|_| panicked()));
        for l in size_lines(&q, &w, &code) {
            self.log.line(&l);
        }
        let total = w.stats.compressed_bytes + code.bytes();
        let more = serde_json::json!({
            "bits": q.bits,
            "embed_bits": q.embed_bits.unwrap_or(q.bits),
            "clip": q.clip,
            "codec": q.codec.name(),
            "byte_shuffle": q.byte_shuffle,
            "gate_int8": q.gate_int8,
            "lqer": q.lqer,
            "kinds": w.kinds,
            "bytes": w.stats.compressed_bytes,
            "sha256": crate::runtime::files::sha256_file(path)?,
            "payload_bytes": w.stats.payload_bytes,
            "raw_bytes": w.raw_bytes,
            "quantized_values": w.payload.int_bytes,
            "lqer_bytes": w.payload.lqer_bytes,
            "clip_sigmas": q.clip_sigmas,
            "code_bytes": code.bytes(),
            "code": code,
            "total_bytes": total,
            "cap_bytes": ARTIFACT_CAP_BYTES,
            "fits_cap": total <= ARTIFACT_CAP_BYTES,
            "calibration_ms": calibration_ms,
            "quantize_ms": quantize_ms,
            "compress_ms": w.compress.as_secs_f64() * 1e3,
            "restore_ms": w.restore.as_secs_f64() * 1e3,
            "reserve_ms": reserve_ms,
            "reserve_seconds": reserve,
        });
        for (k, v) in more.as_object().expect("an object") {
            section[k] = v.clone();
        }
        Ok(Some(w.restored))
    }

    /// Scores `weights` with a model of `[model]` on the run's device, on the stage's executor
    /// (the engine on the training micro-batch's rows; under `train.val_packed` on one row of a
    /// validation batch's tokens).
    fn score(&self, v: &Validator, weights: &[(String, candle_core::Tensor)], ctx: &mut Ctx) -> anyhow::Result<Option<BpbAccumulator>> {
        let t0 = Instant::now();
        let (rows, t) = v.pass_shape(self.config.batch_shape()?.rows);
        let mut model = crate::train::engine_eval::open(model_from(&self.config, weights)?, self.p.executor, rows, t)
            .with_context(|| format!("stage `artifact`: building the round trip's {} model", self.p.executor.name()))?;
        let mut score = |x: &[u32], y: &[u32], rows: usize| -> anyhow::Result<f64> {
            Ok(model.token_losses(x, y, x.len() / rows.max(1))?.iter().map(|&l| f64::from(l)).sum())
        };
        let acc = v.run_with(&mut score, rows, || !ctx.aborted())?;
        ctx.record("eval", t0.elapsed().as_nanos() as u64);
        Ok(acc)
    }
}

macro_rules! artifact_impl {
    ($ty:ident, $name:literal, $gptq:expr, $doc:literal) => {
        #[doc = $doc]
        pub struct $ty(ArtifactStage);

        impl Transform for $ty {
            const KIND: &'static str = "artifact";
            const IMPL: &'static str = $name;
            const DOC: &'static str = $doc;
            type Params = ArtifactParams;
            type In = TrainSnapshot;
            type Out = TrainSnapshot;
            const OUTPUT_OPTIONAL: bool = true;

            /// The final weights only (what it quantizes and scores).
            fn demand(_p: &ArtifactParams) -> Demand {
                Demand::LAST
            }

            fn check(p: &ArtifactParams, ctx: &BuildCtx) -> anyhow::Result<()> {
                ArtifactStage::check(p, ctx, $gptq)
            }
            fn memory(p: &ArtifactParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
                ArtifactStage::memory(p, ctx, $gptq)
            }
            fn build(p: ArtifactParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
                Ok(Self(ArtifactStage::build(p, ctx, $gptq)?))
            }
            fn process(&mut self, snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
                self.0.process(snap, out, ctx)
            }
        }
    };
}

artifact_impl!(
    Quantize,
    "quantize",
    false,
    "Quantizes the final weights by rounding to nearest, compresses them into the challenge artifact, checks the 16 MB cap, scores the round trip."
);
artifact_impl!(
    Gptq,
    "gptq",
    true,
    "GPTQ-quantizes the final weights with Hessians from training batches through the looped model, compresses, checks the 16 MB cap, scores the round trip."
);
