//! The `artifact` stage's keys ([`ArtifactParams`]): the quantization scheme
//! ([`QuantConfig`]'s keys, flat, so that a TOML table reads as the record's environment
//! variables), GPTQ's settings, and the stage's own (code bytes, file name, scoring); their
//! defaults and checks.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::artifact::gptq::GptqConfig;
use crate::artifact::quant::{Clip, Codec, QuantConfig};
use crate::artifact::roundtrip::Method;

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
    /// Compression: "zlib" (the baseline's), "zstd" or "brotli" (the records'), or "pergroup"
    /// (the 04-27 record's per-group lrzip/ZPAQ; needs the `lrzip` program, checked before
    /// training: Debian/Ubuntu `apt-get install lrzip`).
    pub codec: Codec,
    /// Compression level (the codec's strongest when absent: zlib 9, zstd 22, brotli 11,
    /// pergroup 9, lrzip's `-L`).
    pub level: Option<i32>,
    /// Byte shuffle stride before compression: 0 none (the baseline), 2 as the records.
    pub byte_shuffle: u8,
    /// SD-clip's `k` for the MLP matrices; unset: `clip_sigmas` (the 04-27 record: 11.5).
    pub mlp_clip_sigmas: Option<f64>,
    /// SD-clip's `k` for the attention matrices; unset: `clip_sigmas` (the 04-27 record: 13).
    pub attn_clip_sigmas: Option<f64>,
    /// Quantize the attention gates (`*.attn_gate_w`) to int8 per row instead of fp16 (the
    /// 04-27 record: true).
    pub gate_int8: bool,
    /// LQER: a low-rank correction, in 2 to 4 bits, of the quantization error of the
    /// `lqer_top_k` matrices with the largest error (the 04-27 record: true).
    pub lqer: bool,
    /// LQER's rank (4).
    pub lqer_rank: usize,
    /// Matrices LQER corrects (3).
    pub lqer_top_k: usize,
    /// Bits of LQER's factors in its symmetric form (4).
    pub lqer_factor_bits: u8,
    /// LQER's asymmetric form: A int2 with one scale, B int4 per `lqer_group` values (true).
    pub lqer_asymmetric: bool,
    /// Values per scale of LQER's B in the asymmetric form (64).
    pub lqer_group: usize,
    /// `gptq` only: keep an LQER correction only when it lowers the matrix's Hessian-weighted
    /// error, else try the next candidate (true; the record keeps every one: false).
    pub lqer_hessian_guard: bool,
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
    /// What scores them: "engine" (the explicit engine on the training micro-batch's rows: f32
    /// on the CPU, bf16 activations on a GPU) or "candle" (the candle model, f32).
    pub executor: crate::eval::executor::EvalExecutor,
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
            mlp_clip_sigmas: q.mlp_clip_sigmas,
            attn_clip_sigmas: q.attn_clip_sigmas,
            gate_int8: q.gate_int8,
            lqer: q.lqer,
            lqer_rank: q.lqer_rank,
            lqer_top_k: q.lqer_top_k,
            lqer_factor_bits: q.lqer_factor_bits,
            lqer_asymmetric: q.lqer_asymmetric,
            lqer_group: q.lqer_group,
            lqer_hessian_guard: q.lqer_hessian_guard,
            calibration_batches: 64,
            damping: g.damping,
            block_size: g.block_size,
            act_order: g.act_order,
            code_bytes: None,
            file: None,
            eval: true,
            executor: Default::default(),
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
            mlp_clip_sigmas: self.mlp_clip_sigmas,
            attn_clip_sigmas: self.attn_clip_sigmas,
            gate_int8: self.gate_int8,
            lqer: self.lqer,
            lqer_rank: self.lqer_rank,
            lqer_top_k: self.lqer_top_k,
            lqer_factor_bits: self.lqer_factor_bits,
            lqer_asymmetric: self.lqer_asymmetric,
            lqer_group: self.lqer_group,
            lqer_hessian_guard: self.lqer_hessian_guard,
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
    pub(super) fn file_name(&self) -> String {
        self.file.clone().unwrap_or_else(|| format!("final_model.int{}.{}.pgqz", self.bits, self.codec))
    }
}
