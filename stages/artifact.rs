//! Kind `artifact`: the challenge's post-training step inside the graph (spec 3.10).
//!
//! - `quantize`: when training ends normally, takes the weights to evaluate (the average when
//!   an `ema_swa` stage provides one, else the last step's), quantizes them (per-row int8 with
//!   fp16 scales, or int6), compresses them (zlib, zstd or brotli), writes
//!   `RUN_DIR/<file>` atomically, reports its bytes against the 16,000,000-byte cap, reads the
//!   file back and dequantizes it. With `eval = true` it scores the weights before and after the
//!   round trip (the script's `final_int8_zlib_roundtrip` lines) over the validation split as
//!   training scored it (`train.val_max_tokens`). The restored weights go on, labelled
//!   `quantized`, to the evaluation stage. Steps and Ctrl-C pass through untouched.
//!
//! Histograms: `quantize` (quantize + compress), `write`, `restore` (read back + dequantize),
//! `eval` (each scoring pass).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::config;
use crate::artifact::quant::{ARTIFACT_CAP_BYTES, Codec, QuantConfig};
use crate::artifact::roundtrip::{size_lines, write_and_restore};
use crate::eval::bpb::BpbAccumulator;
use crate::eval::validation::Validator;
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};
use crate::train::log::StageLog;
use crate::train::snapshot::{EvalWeights, TrainSnapshot};

/// Parameters of `artifact/quantize`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizeParams {
    /// Bits per quantized weight: 8 (the baseline's per-row int8) or 6.
    pub bits: u8,
    /// Compression: "zlib" (the baseline's), "zstd" or "brotli".
    pub codec: Codec,
    /// Compression level (the codec's default when absent).
    pub level: Option<i32>,
    /// File name inside the run directory (default `final_model.int<bits>.<codec>.pgqz`).
    pub file: Option<String>,
    /// Score the weights before and after the round trip.
    pub eval: bool,
}

impl Default for QuantizeParams {
    fn default() -> Self {
        Self { bits: 8, codec: Codec::Zlib, level: None, file: None, eval: true }
    }
}

impl QuantizeParams {
    fn quant(&self) -> QuantConfig {
        QuantConfig { bits: self.bits, codec: self.codec, level: self.level }
    }
}

/// `artifact/quantize`.
pub struct Quantize {
    p: QuantizeParams,
    path: Option<PathBuf>,
    validator: Option<Validator>,
    config: crate::train::config::Config,
    log: StageLog,
}

impl Transform for Quantize {
    const KIND: &'static str = "artifact";
    const IMPL: &'static str = "quantize";
    const DOC: &'static str =
        "Quantizes and compresses the final weights into the challenge artifact, checks the 16 MB cap, scores the round trip.";
    type Params = QuantizeParams;
    type In = TrainSnapshot;
    type Out = TrainSnapshot;
    const OUTPUT_OPTIONAL: bool = true;

    fn check(p: &QuantizeParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        p.quant().check()?;
        if let Some(f) = &p.file {
            anyhow::ensure!(!f.is_empty() && !f.contains('/'), "`file` must be a plain file name inside the run directory; found {f:?}");
        }
        if p.eval {
            anyhow::ensure!(config(ctx)?.data.val.is_some(), "`eval = true` scores the round trip on `data.val`, which is not set");
        }
        Ok(())
    }

    fn memory(p: &QuantizeParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
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
        if p.eval {
            let shape = c.batch_shape()?;
            let tokens = crate::eval::validation::tokens_per_pass(&c.validation(), shape.micro_steps);
            let mut keys = vec!["train.val_batch_tokens"];
            keys.extend(MODEL_KEYS);
            needs.push(
                crate::runtime::memory::Need::device(
                    "scoring model and activations",
                    total.saturating_mul(4).saturating_add(forward_bytes(&c.model, tokens, shape.seq_len, true, 4)),
                    &keys,
                )
                .transient(),
            );
        }
        Ok(needs)
    }

    fn build(p: QuantizeParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        let file = p.file.clone().unwrap_or_else(|| format!("final_model.int{}.{}.pgqz", p.bits, p.codec));
        let validator = if p.eval {
            let shape = config(ctx)?.batch_shape()?;
            Some(Validator::load(&config(ctx)?.validation(), shape.micro_steps)?)
        } else {
            None
        };
        Ok(Self { path: ctx.run_dir.map(|d| d.join(file)), p, validator, config: config(ctx)?.clone(), log: StageLog::new(ctx.run_dir) })
    }

    fn process(&mut self, mut snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        if snap.is_final_for_eval()
            && let Some(path) = self.path.clone()
        {
            let restored = ctx.finishing(|ctx| self.make(&snap, &path, ctx))?;
            if let Some(r) = restored {
                snap.eval = Some(EvalWeights { label: "quantized".into(), tensors: Arc::new(r) });
            }
        }
        out.emit(snap)?;
        Ok(())
    }
}

impl Quantize {
    /// Writes the artifact of `snap`'s evaluation weights; returns the restored weights
    /// (`None` when an abort cut the scoring short).
    fn make(
        &mut self,
        snap: &TrainSnapshot,
        path: &std::path::Path,
        ctx: &mut Ctx,
    ) -> anyhow::Result<Option<Vec<(String, candle_core::Tensor)>>> {
        let q = self.p.quant();
        let (label, weights) = snap.eval_weights();
        let label = label.to_string();
        let w = write_and_restore(weights, &q, path).with_context(|| format!("the artifact of the {label} weights"))?;
        ctx.record("quantize", w.quantize.as_nanos() as u64);
        ctx.record("write", w.write.as_nanos() as u64);
        ctx.record("restore", w.restore.as_nanos() as u64);
        for l in size_lines(&q, path, &w) {
            self.log.line(&l);
        }
        let mut section = serde_json::json!({
            "path": path.display().to_string(),
            "weights": label,
            "bits": q.bits,
            "codec": q.codec.name(),
            "bytes": w.stats.compressed_bytes,
            "payload_bytes": w.stats.payload_bytes,
            "raw_bytes": w.raw_bytes,
            "cap_bytes": ARTIFACT_CAP_BYTES,
            "fits_cap": w.stats.compressed_bytes <= ARTIFACT_CAP_BYTES,
        });
        if let Some(v) = &self.validator {
            let before = self.score(v, weights, ctx)?;
            let t0 = Instant::now();
            let after = self.score(v, &w.restored, ctx)?;
            let eval_ms = t0.elapsed().as_secs_f64() * 1e3;
            let (Some(before), Some(after)) = (before, after) else { return Ok(None) };
            let tag = format!("final_int{}_{}_roundtrip", q.bits, q.codec);
            self.log.line(&format!("pre-quantization post-{label} val_loss:{:.4} val_bpb:{:.4}", before.val_loss(), before.val_bpb()));
            self.log.line(&format!("{tag} val_loss:{:.4} val_bpb:{:.4} eval_time:{eval_ms:.0}ms", after.val_loss(), after.val_bpb()));
            self.log.line(&format!("{tag}_exact val_loss:{:.8} val_bpb:{:.8}", after.val_loss(), after.val_bpb()));
            section["before"] = serde_json::json!({"val_loss": before.val_loss(), "val_bpb": before.val_bpb()});
            section["after"] = serde_json::json!({"val_loss": after.val_loss(), "val_bpb": after.val_bpb(), "eval_ms": eval_ms});
            section["val_tokens"] = serde_json::json!(after.tokens());
        }
        ctx.publish("artifact", section);
        Ok(Some(w.restored))
    }

    /// Scores `weights` with a model of `[model]` on the run's device.
    fn score(&self, v: &Validator, weights: &[(String, candle_core::Tensor)], ctx: &mut Ctx) -> anyhow::Result<Option<BpbAccumulator>> {
        let t0 = Instant::now();
        let model = crate::artifact::roundtrip::model_from(&self.config, weights)?;
        let acc = v.run(&model, || !ctx.aborted())?;
        ctx.record("eval", t0.elapsed().as_nanos() as u64);
        Ok(acc)
    }
}
