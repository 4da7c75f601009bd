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
//! `compress` (serialize, shuffle, compress), `write`, `restore` (read back + check +
//! dequantize), `eval` (each scoring pass). The reserve counts the Hessians and the
//! quantization, as the record's does.

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::Context;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::config;
use crate::artifact::gptq::GptqConfig;
use crate::artifact::quant::{ARTIFACT_CAP_BYTES, Clip, Codec, QuantConfig};
use crate::artifact::roundtrip::{
    CodeBytes, Method, baseline_lines, calibrate, calibration_line, model_from, size_lines, write_and_restore,
};
use crate::eval::bpb::BpbAccumulator;
use crate::eval::validation::Validator;
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Emitter, Transform};
use crate::train::log::StageLog;
use crate::train::snapshot::{EvalWeights, TrainSnapshot};

/// Parameters of `artifact/quantize` and `artifact/gptq` (the same keys, so that switching
/// `impl` changes the rounding and nothing else).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ArtifactParams {
    /// Bits per quantized value of the matrices: 8 (the baseline's int8) or 6 (the record's
    /// int6); 2..=8. Also the embedding's unless `embed_bits` is set.
    pub bits: u8,
    /// Bits of the embedding (`tok_emb.weight`, or an untied `lm_head.weight`); unset: `bits`.
    /// The record: 8.
    pub embed_bits: Option<u8>,
    /// Row scales: "quantile" (the baseline's clip at the 99.99984th percentile, scale floor
    /// 1/Q) or "sd_clip" (the records': `k * std(row) / Q` in fp16).
    pub clip: Clip,
    /// SD-clip's `k` for the matrices (12.85 in the record).
    pub clip_sigmas: f64,
    /// SD-clip's `k` for the embedding (20 in the record).
    pub embed_clip_sigmas: f64,
    /// Keep small control tensors fp32 as the baseline; false stores every small float tensor
    /// as fp16, as the records.
    pub control_fp32: bool,
    /// Compression: "zlib" (the baseline's), "zstd" or "brotli" (the records').
    pub codec: Codec,
    /// Compression level (the codec's strongest when absent: zlib 9, zstd 22, brotli 11).
    pub level: Option<i32>,
    /// Byte shuffle stride before compression: 0 none (the baseline), 2 as the records.
    pub byte_shuffle: u8,
    /// `gptq` only: calibration micro-batches of the training shape (64 in the record).
    pub calibration_batches: usize,
    /// `gptq` only: damping, as a fraction of the Hessian's mean diagonal (0.01).
    pub damping: f64,
    /// `gptq` only: columns per block of the error propagation (128).
    pub block_size: usize,
    /// `gptq` only: quantize columns in order of decreasing Hessian diagonal (act-order).
    pub act_order: bool,
    /// Code bytes counted against the cap with the artifact; unset: measured from this
    /// binary's source tree (Brotli-11 of Cargo.toml, Cargo.lock, build.rs, src/, stages/,
    /// kernels/; see the README), not counted when the tree is not found.
    pub code_bytes: Option<u64>,
    /// File name inside the run directory (default `final_model.int<bits>.<codec>.pgqz`).
    pub file: Option<String>,
    /// Score the weights before and after the round trip.
    pub eval: bool,
}

impl Default for ArtifactParams {
    fn default() -> Self {
        let q = QuantConfig::default();
        let g = GptqConfig::default();
        Self {
            bits: q.bits,
            embed_bits: q.embed_bits,
            clip: q.clip,
            clip_sigmas: q.clip_sigmas,
            embed_clip_sigmas: q.embed_clip_sigmas,
            control_fp32: q.control_fp32,
            codec: q.codec,
            level: q.level,
            byte_shuffle: q.byte_shuffle,
            calibration_batches: 64,
            damping: g.damping,
            block_size: g.block_size,
            act_order: g.act_order,
            code_bytes: None,
            file: None,
            eval: true,
        }
    }
}

impl ArtifactParams {
    /// The quantization scheme.
    pub fn quant(&self) -> QuantConfig {
        QuantConfig {
            bits: self.bits,
            embed_bits: self.embed_bits,
            clip: self.clip,
            clip_sigmas: self.clip_sigmas,
            embed_clip_sigmas: self.embed_clip_sigmas,
            control_fp32: self.control_fp32,
            codec: self.codec,
            level: self.level,
            byte_shuffle: self.byte_shuffle,
        }
    }

    /// The rounding of implementation `gptq` (true) or `quantize`.
    pub fn method(&self, gptq: bool) -> Method {
        if gptq {
            Method::Gptq {
                gptq: GptqConfig { damping: self.damping, block_size: self.block_size, act_order: self.act_order },
                calibration_batches: self.calibration_batches,
            }
        } else {
            Method::Nearest
        }
    }

    /// Checks every key; errors name it.
    pub fn check(&self) -> anyhow::Result<()> {
        self.quant().check()?;
        anyhow::ensure!(self.calibration_batches >= 1, "`calibration_batches` must be at least 1");
        anyhow::ensure!(
            self.damping.is_finite() && self.damping >= 0.0,
            "`damping` = {} must be a non-negative number (0.01 in the record)",
            self.damping
        );
        anyhow::ensure!(self.block_size >= 1, "`block_size` must be at least 1 (128 in the record)");
        if let Some(f) = &self.file {
            anyhow::ensure!(!f.is_empty() && !f.contains('/'), "`file` must be a plain file name inside the run directory; found {f:?}");
        }
        Ok(())
    }

    /// The artifact's file name.
    fn file_name(&self) -> String {
        self.file.clone().unwrap_or_else(|| format!("final_model.int{}.{}.pgqz", self.bits, self.codec))
    }
}

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
        let c = config(ctx)?;
        if p.eval {
            anyhow::ensure!(c.data.val.is_some(), "`eval = true` scores the round trip on `data.val`, which is not set");
        }
        if gptq {
            anyhow::ensure!(c.data.train.is_some(), "`gptq` calibrates on training data (`data.train`), which is not set");
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
        if p.eval || gptq {
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
            // No file to write here (a rank other than 0): nothing to count.
            None if ctx.run_dir.is_none() => std::thread::spawn(|| CodeBytes::Unknown),
            None => std::thread::Builder::new().name("code-size".into()).spawn(CodeBytes::measure)?,
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
        let shown = path.as_ref().map_or_else(|| "rank 0's artifact".to_string(), |p| p.display().to_string());
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
            for l in baseline_lines(&self.p.quant(), &after, ms) {
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
        let q = self.p.quant();
        let mut calibration_ms = 0.0;
        let hessians = match &self.method {
            Method::Gptq { calibration_batches, .. } => {
                let found = calibrate(&self.config, weights, *calibration_batches, || !ctx.aborted())
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
        self.log.line(&format!("artifact:{} {took}{against}; compression {:.1}s", self.method.name(), w.compress.as_secs_f64()));
        let code = self.code.take().map(|h| h.join().unwrap_or(CodeBytes::Unknown)).unwrap_or(CodeBytes::Unknown);
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
            "bytes": w.stats.compressed_bytes,
            "payload_bytes": w.stats.payload_bytes,
            "raw_bytes": w.raw_bytes,
            "code_bytes": code.bytes(),
            "code": code,
            "total_bytes": total,
            "cap_bytes": ARTIFACT_CAP_BYTES,
            "fits_cap": total <= ARTIFACT_CAP_BYTES,
            "calibration_ms": calibration_ms,
            "quantize_ms": quantize_ms,
            "compress_ms": w.compress.as_secs_f64() * 1e3,
            "reserve_ms": reserve_ms,
            "reserve_seconds": reserve,
        });
        for (k, v) in more.as_object().expect("an object") {
            section[k] = v.clone();
        }
        Ok(Some(w.restored))
    }

    /// Scores `weights` with a model of `[model]` on the run's device.
    fn score(&self, v: &Validator, weights: &[(String, candle_core::Tensor)], ctx: &mut Ctx) -> anyhow::Result<Option<BpbAccumulator>> {
        let t0 = Instant::now();
        let model = model_from(&self.config, weights)?;
        let acc = v.run(&model, || !ctx.aborted())?;
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
