//! The post-training quantized model artifact: the challenge baseline's int8 + zlib round trip
//! (`shared/research/record_spec.md`, section 3.10) and the records' int6/int8 GPTQ with SD-clip
//! scales, byte shuffle and Brotli (section 4.5), with the choices as [`QuantConfig`] keys.
//!
//! [`quantize`] turns a state dict (`Gpt::state_dict()`: name, f32/bf16 tensor) into a
//! [`Quantized`] container, tensor by tensor, in the order given:
//! - non-float tensors are stored as they are ([`Entry::Raw`]);
//! - float tensors with at most [`PASSTHROUGH_MAX_NUMEL`] elements stay float
//!   ([`Entry::Passthrough`]): under `control_fp32` (the baseline) fp32 when the name contains a
//!   [`CONTROL_PATTERNS`] entry, fp16 for other fp32/bf16 tensors, their own dtype otherwise;
//!   without it (the records) every fp32/bf16 one as fp16; the original dtype is recorded;
//! - larger 2-D float tensors get per-row symmetric integers ([`Scales::PerRow`]) of
//!   `bits` (`embed_bits` for the embedding, [`is_embedding`]), `Q = 2^(bits-1) - 1`, with the row
//!   scale of [`Clip`]:
//!   - `quantile` (the baseline): `c_r` is the [`CLIP_QUANTILE`] quantile of `|W_r|` (linear
//!     interpolation, [`quantile_linear`]), `W_r` is clipped to `±c_r`, `s_r = max(c_r / Q, 1 / Q)`,
//!     `q = clamp(round_half_even(W / s_r), -Q, Q)`; the scales are stored as fp16, the rounding
//!     uses the fp32 scale;
//!   - `sd_clip` (the records): `s_r = k * std(W_r) / Q` rounded to fp16 and used as rounded
//!     ([`super::gptq::sd_clip_scales`]), `k` = `clip_sigmas` (`embed_clip_sigmas` for the
//!     embedding), no floor: values beyond `Q s_r` are clamped;
//! - and are rounded by the [`Rounding`] asked for: to nearest, or by GPTQ with the matrix's
//!   Hessian ([`super::gptq`]; a matrix without a Hessian is rounded to nearest, which is what
//!   GPTQ does with `H = I`);
//! - larger float tensors of other ranks get one fp32 scale `c / Q` (1 when `c = 0`) with the
//!   quantile ([`Scales::PerTensor`]).
//!
//! Values are stored one per byte whatever the width: fewer bits help the compressor, which sees
//! 63 symbols for int6 instead of 255.
//!
//! [`Quantized::dequantize`] gives `W = q * s` (the stored fp16 scale widened to f32, per row),
//! cast back to the original dtype; passthrough tensors are cast back to theirs.
//!
//! Numerics follow the PyTorch scripts: the quantile is computed in f32 like `torch.quantile`
//! (rank `q * (n - 1)` in f32, `lerp` between the two neighbours with one rounding, as the CUDA
//! and vectorised CPU kernels do), divisions in f32, rounding half to even like `torch.round`.
//!
//! The artifact's bytes (header, container, manifest) are [`super::format`]'s.
//!
//! Sizes: [`PayloadStats::payload_bytes`] counts the bytes as the challenge script does (integer
//! values + scales + passthrough and raw tensors, no container overhead); [`ArtifactStats`] adds the
//! compressed size, to compare with [`ARTIFACT_CAP_BYTES`] (which also has to hold the code).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub mod lqer;

use self::lqer::{Lqer, LqerConfig};
pub use super::codec::Codec;
use super::gptq::{GptqConfig, quantize_matrix, round_to_nearest, sd_clip_scales};

/// The challenge's size limit for code + compressed model, in bytes (decimal, spec section 0).
pub const ARTIFACT_CAP_BYTES: u64 = 16_000_000;

/// Float tensors with at most this many elements are kept in float (spec 3.10).
pub const PASSTHROUGH_MAX_NUMEL: usize = 65_536;

/// The quantile of `|W|` used as the clip value (percentile 99.99984, spec 3.10).
pub const CLIP_QUANTILE: f32 = 0.999_998_4;

/// Sizes of the attention gates `gate_int8` quantizes (the record's dense gate is 8 x 512, its
/// sparse one 8 x 12).
pub const GATE_NUMEL: std::ops::RangeInclusive<usize> = 32..=8192;

/// Name fragments of control tensors, which stay fp32 when passed through (spec 3.5, 3.10).
pub const CONTROL_PATTERNS: [&str; 5] = ["attn_scale", "mlp_scale", "resid_mix", "q_gain", "skip_weight"];

/// How a quantized matrix's row scales are chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Clip {
    /// The baseline's: the 99.99984th percentile of `|W_r|` over `Q`, floored at `1/Q`
    /// (spec 3.10).
    #[default]
    Quantile,
    /// The records' SD-clip: `k * std(W_r) / Q` rounded to fp16 (spec 4.5).
    SdClip,
}

/// Quantization settings (defaults: the challenge baseline's int8 + zlib level 9; the record's
/// are `bits = 6, embed_bits = 8, clip = "sd_clip", clip_sigmas = 12.85, embed_clip_sigmas =
/// 20, control_fp32 = false, codec = "brotli", byte_shuffle = 2`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QuantConfig {
    /// Bits per quantized value of the matrices: 8 (int8, levels -127..=127, the baseline) or 6
    /// (int6, levels -31..=31, the record); any of 2..=8 works (levels ±(2^(bits-1) - 1)). Also
    /// the embedding's unless `embed_bits` is set. Values are stored one per byte whatever the
    /// width: fewer bits only help the compressor.
    pub bits: u8,
    /// Bits of the embedding (`tok_emb.weight`, and `lm_head.weight` when untied); unset:
    /// `bits`. The record: 8.
    pub embed_bits: Option<u8>,
    /// Row scales: "quantile" (the baseline's clip at the 99.99984th percentile, scale floor
    /// 1/Q) or "sd_clip" (the records': `k * std(row) / Q`, k from `clip_sigmas`).
    pub clip: Clip,
    /// SD-clip's `k` for the matrices (12.85 in the record for int6).
    pub clip_sigmas: f64,
    /// SD-clip's `k` for the embedding (20 in the record for int8).
    pub embed_clip_sigmas: f64,
    /// Keep passed-through control tensors (`attn_scale`, `mlp_scale`, `resid_mix`, `q_gain`,
    /// `skip_weights`) in fp32 as the baseline does; false stores every small float tensor as
    /// fp16, as the records do.
    pub control_fp32: bool,
    /// Compressor for the artifact: `zlib` (the baseline's), `zstd`, `brotli` (the records') or
    /// `pergroup` (the 04-27 record's per-group lrzip/ZPAQ; needs the `lrzip` program, checked
    /// before training: Debian/Ubuntu `apt-get install lrzip`).
    pub codec: Codec,
    /// Compression level; unset means the codec's strongest (zlib 9, zstd 22, brotli 11,
    /// pergroup 9: lrzip's `-L`).
    pub level: Option<i32>,
    /// Byte shuffle stride applied to the container before compression: 0 for none (the
    /// baseline), 2 as the records (fp16 scales' low and high bytes apart).
    pub byte_shuffle: u8,
    /// SD-clip's `k` for the MLP matrices (names with `.mlp.`); unset: `clip_sigmas`. The 04-27
    /// record: 11.5 (`MLP_CLIP_SIGMAS`).
    pub mlp_clip_sigmas: Option<f64>,
    /// SD-clip's `k` for the attention matrices (names with `.attn.`); unset: `clip_sigmas`.
    /// The 04-27 record: 13 (`ATTN_CLIP_SIGMAS`).
    pub attn_clip_sigmas: Option<f64>,
    /// Quantize the attention gates (`*.attn_gate_w`, 2-D, 32 to 8,192 values) to int8 per row
    /// with the scale `max|row| / 127`, instead of keeping them fp16 (`GATED_ATTN_QUANT_GATE`,
    /// on in the 04-27 record).
    pub gate_int8: bool,
    /// LQER: a low-rank correction of the quantization error of the `lqer_top_k` matrices
    /// with the largest error, stored in 2 to 4 bits ([`lqer`]; `LQER_ENABLED`, on in the 04-27
    /// record).
    pub lqer: bool,
    /// LQER's rank (`LQER_RANK`, 4).
    pub lqer_rank: usize,
    /// Matrices LQER corrects (`LQER_TOP_K`, 3).
    pub lqer_top_k: usize,
    /// Bits of LQER's factors in its symmetric form (`LQER_FACTOR_BITS`, 4).
    pub lqer_factor_bits: u8,
    /// LQER's asymmetric form: A in int2 with one scale, B in int4 per group of `lqer_group`
    /// (`LQER_ASYM_ENABLED`, on in the record); false: both factors per row in
    /// `lqer_factor_bits`.
    pub lqer_asymmetric: bool,
    /// Values per scale of B in LQER's asymmetric form (`LQER_ASYM_GROUP`, 64).
    pub lqer_group: usize,
    /// With GPTQ's Hessians, keep an LQER correction only when it lowers the matrix's
    /// H-weighted error `tr(E H Eᵀ)`, and try the next candidate otherwise (the record keeps
    /// every one: false). The factors' own rounding, in 2 and 4 bits, can add more error in the
    /// directions GPTQ protected than the correction removes.
    pub lqer_hessian_guard: bool,
}

impl Default for QuantConfig {
    fn default() -> Self {
        let l = LqerConfig::default();
        Self {
            bits: 8,
            embed_bits: None,
            clip: Clip::Quantile,
            clip_sigmas: 12.85,
            embed_clip_sigmas: 20.0,
            control_fp32: true,
            codec: Codec::Zlib,
            level: None,
            byte_shuffle: 0,
            mlp_clip_sigmas: None,
            attn_clip_sigmas: None,
            gate_int8: false,
            lqer: false,
            lqer_rank: l.rank,
            lqer_top_k: l.top_k,
            lqer_factor_bits: l.factor_bits,
            lqer_asymmetric: l.asymmetric,
            lqer_group: l.group,
            lqer_hessian_guard: true,
        }
    }
}

impl QuantConfig {
    /// The record's settings (spec 4.5): GPTQ-ready int6 matrices and int8 embedding with
    /// SD-clip scales, small tensors fp16, byte shuffle 2, Brotli 11.
    #[cfg(feature = "tools")]
    pub fn record() -> Self {
        Self {
            bits: 6,
            embed_bits: Some(8),
            clip: Clip::SdClip,
            control_fp32: false,
            codec: Codec::Brotli,
            byte_shuffle: 2,
            ..Self::default()
        }
    }

    /// Checks the bit widths, the clip multipliers, the level and the shuffle; errors name the key.
    pub fn check(&self) -> Result<()> {
        qmax(self.bits).context("`bits`")?;
        if let Some(b) = self.embed_bits {
            qmax(b).context("`embed_bits`")?;
        }
        let groups = [("mlp_clip_sigmas", self.mlp_clip_sigmas), ("attn_clip_sigmas", self.attn_clip_sigmas)];
        let set = groups.iter().filter_map(|&(key, k)| k.map(|k| (key, k)));
        for (key, k) in [("clip_sigmas", self.clip_sigmas), ("embed_clip_sigmas", self.embed_clip_sigmas)].into_iter().chain(set) {
            ensure!(k.is_finite() && k > 0.0, "`{key}` = {k} must be a positive number");
        }
        if let Some(l) = self.lqer_config() {
            l.check()?;
        }
        ensure!(self.byte_shuffle != 1, "`byte_shuffle` = 1 shuffles nothing: use 0 for none, 2 as the records");
        self.codec.resolve_level(self.level).context("`level`")?;
        Ok(())
    }

    /// The width of tensor `name`.
    pub fn bits_of(&self, name: &str) -> u8 {
        if is_embedding(name) { self.embed_bits.unwrap_or(self.bits) } else { self.bits }
    }

    /// SD-clip's `k` for tensor `name`: the embedding's, the MLP's (`.mlp.`), the attention's
    /// (`.attn.`), else `clip_sigmas` (the 04-27 record's groups).
    pub fn clip_sigmas_of(&self, name: &str) -> f64 {
        if is_embedding(name) {
            self.embed_clip_sigmas
        } else if name.contains(".mlp.") {
            self.mlp_clip_sigmas.unwrap_or(self.clip_sigmas)
        } else if name.contains(".attn.") {
            self.attn_clip_sigmas.unwrap_or(self.clip_sigmas)
        } else {
            self.clip_sigmas
        }
    }

    /// LQER's settings, when it is on.
    pub fn lqer_config(&self) -> Option<LqerConfig> {
        self.lqer.then_some(LqerConfig {
            rank: self.lqer_rank,
            top_k: self.lqer_top_k,
            factor_bits: self.lqer_factor_bits,
            asymmetric: self.lqer_asymmetric,
            group: self.lqer_group,
        })
    }

    /// Whether `name` (of `numel` values in `rank` dimensions) is an attention gate quantized
    /// to int8 per row (`gate_int8`).
    pub fn is_int8_gate(&self, name: &str, rank: usize, numel: usize) -> bool {
        self.gate_int8 && rank == 2 && name.ends_with(".attn_gate_w") && (GATE_NUMEL).contains(&numel)
    }

    /// `int6` or `int6/int8` (matrices/embedding) for file names and log lines.
    pub fn width_name(&self) -> String {
        match self.embed_bits {
            Some(e) if e != self.bits => format!("int{}", self.bits) + &format!("/int{e}"),
            _ => format!("int{}", self.bits),
        }
    }
}

/// Whether `name` is the embedding (the token embedding, or an untied output head).
pub fn is_embedding(name: &str) -> bool {
    name == "tok_emb.weight" || name == "lm_head.weight"
}

/// How quantized matrices are rounded.
#[derive(Clone, Copy)]
pub enum Rounding<'a> {
    /// Each value to the nearest level (the baseline).
    Nearest,
    /// GPTQ (spec 4.5) with each matrix's Hessian, by name; a matrix without one is rounded to
    /// nearest.
    Gptq(&'a GptqConfig, &'a HashMap<String, Arc<Vec<f32>>>),
}

/// The largest level for `bits` (127 for 8, 31 for 6).
pub(super) fn qmax(bits: u8) -> Result<i8> {
    ensure!((2..=8).contains(&bits), "bits = {bits} is not supported (2..=8; 8 is int8, 6 is int6)");
    Ok(((1u16 << (bits - 1)) - 1) as i8)
}

/// Scales of a quantized tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum Scales {
    /// One fp16 scale per row of a 2-D tensor.
    PerRow(Vec<f16>),
    /// One fp32 scale for the whole tensor (ranks other than 2).
    PerTensor(f32),
}

/// A quantized float tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantTensor {
    /// Shape of the original tensor (and of `q`).
    pub shape: Vec<usize>,
    /// Dtype of the original tensor, restored by dequantization.
    pub dtype: DType,
    /// Bits of the values (`Q = 2^(bits-1) - 1`).
    pub bits: u8,
    /// Integer values, row-major, in `-Q..=Q`.
    pub q: Vec<i8>,
    /// The scales.
    pub scales: Scales,
    /// LQER's correction of this matrix's quantization error, if it was among the corrected.
    pub lqer: Option<Lqer>,
}

impl QuantTensor {
    /// `q * s` (per row or per tensor), row-major, without the LQER correction.
    pub fn levels_times_scales(&self) -> Vec<f32> {
        match &self.scales {
            Scales::PerRow(s) => {
                let cols = self.q.len() / s.len().max(1);
                self.q.chunks(cols.max(1)).zip(s).flat_map(|(row, s)| row.iter().map(move |&v| v as f32 * s.to_f32())).collect()
            }
            Scales::PerTensor(s) => self.q.iter().map(|&v| v as f32 * s).collect(),
        }
    }
}

/// A tensor kept as bytes (little-endian, row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct RawTensor {
    /// Dtype of the bytes.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// The values.
    pub bytes: Vec<u8>,
}

/// One state-dict tensor in the container.
#[derive(Clone, Debug, PartialEq)]
pub enum Entry {
    /// A large float tensor, quantized.
    Quant(QuantTensor),
    /// A small float tensor kept in float: `stored` (fp32, fp16 or its own dtype), restored to `dtype`.
    Passthrough {
        /// The stored values.
        stored: RawTensor,
        /// Dtype of the original tensor.
        dtype: DType,
    },
    /// A non-float tensor, stored as it is.
    Raw(RawTensor),
}

impl Entry {
    /// Shape of the original tensor.
    pub fn shape(&self) -> &[usize] {
        match self {
            Entry::Quant(t) => &t.shape,
            Entry::Passthrough { stored, .. } => &stored.shape,
            Entry::Raw(t) => &t.shape,
        }
    }

    /// Dtype of the original tensor.
    pub fn dtype(&self) -> DType {
        match self {
            Entry::Quant(t) => t.dtype,
            Entry::Passthrough { dtype, .. } => *dtype,
            Entry::Raw(t) => t.dtype,
        }
    }
}

/// Byte counts of a [`Quantized`] container, as the challenge script counts its payload.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PayloadStats {
    /// Tensors in the container.
    pub tensors: usize,
    /// Quantized tensors.
    pub quantized: usize,
    /// Float tensors kept in float.
    pub passthrough: usize,
    /// Non-float tensors.
    pub raw: usize,
    /// Elements of the quantized tensors (one byte each).
    pub int_bytes: u64,
    /// Bytes of their scales (2 per row, or 4 per tensor).
    pub scale_bytes: u64,
    /// Bytes of the passthrough tensors as stored.
    pub passthrough_bytes: u64,
    /// Bytes of the non-float tensors.
    pub raw_bytes: u64,
    /// Matrices with an LQER correction.
    pub lqer: usize,
    /// Bytes of their corrections (values and scales of both factors).
    pub lqer_bytes: u64,
    /// Sum of the five: the spec's "payload".
    pub payload_bytes: u64,
}

/// Sizes of one compressed artifact.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ArtifactStats {
    /// The codec.
    pub codec: Codec,
    /// The level used.
    pub level: i32,
    /// The payload (see [`PayloadStats::payload_bytes`]).
    pub payload_bytes: u64,
    /// The serialized container before compression (payload + safetensors header and manifest).
    pub serialized_bytes: u64,
    /// The artifact: header + compressed body.
    pub compressed_bytes: u64,
}

impl ArtifactStats {
    /// Whether this artifact plus `code_bytes` of code fits [`ARTIFACT_CAP_BYTES`].
    #[cfg(feature = "tools")]
    pub fn fits_cap(&self, code_bytes: u64) -> bool {
        self.compressed_bytes + code_bytes <= ARTIFACT_CAP_BYTES
    }
}

/// A compressed artifact and its sizes.
#[derive(Clone, Debug)]
pub struct Artifact {
    /// The bytes to write ([`super::format::from_bytes`] reads them back).
    pub bytes: Vec<u8>,
    /// The sizes.
    pub stats: ArtifactStats,
}

/// A quantized state dict (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub(super) bits: u8,
    pub(super) entries: Vec<(String, Entry)>,
    /// The writer's notes (the manifest's `info`): not needed to dequantize.
    pub(super) info: Option<serde_json::Value>,
}

/// Quantizes a state dict (spec 3.10; see the module documentation). Tensors may be on any
/// device; the container lives on the host. Errors name the tensor.
pub fn quantize(state: &[(String, Tensor)], cfg: &QuantConfig, rounding: Rounding<'_>) -> Result<Quantized> {
    cfg.check()?;
    let mut seen = HashSet::new();
    let mut entries = Vec::with_capacity(state.len());
    for (name, t) in state {
        ensure!(seen.insert(name.as_str()), "tensor `{name}` appears twice in the state dict");
        let entry = quantize_tensor(name, t, cfg, rounding).with_context(|| format!("cannot quantize tensor `{name}`"))?;
        entries.push((name.clone(), entry));
    }
    if let Some(l) = cfg.lqer_config() {
        // The candidates: every matrix with per-row scales but the int8 gates (the record's
        // GPTQ'd matrices).
        let candidates: Vec<usize> = (0..entries.len())
            .filter(|&i| {
                let (name, e) = &entries[i];
                matches!(e, Entry::Quant(t) if matches!(t.scales, Scales::PerRow(_)) && !cfg.is_int8_gate(name, 2, t.q.len()))
            })
            .collect();
        let hessians = match rounding {
            Rounding::Gptq(_, hs) if cfg.lqer_hessian_guard => Some(hs),
            _ => None,
        };
        let dropped = lqer::correct(state, &mut entries, &candidates, &l, hessians)?;
        if !dropped.is_empty() {
            return Ok(Quantized { bits: cfg.bits, entries, info: Some(serde_json::json!({ "lqer_dropped": dropped })) });
        }
    }
    Ok(Quantized { bits: cfg.bits, entries, info: None })
}

/// Whether `name` is a control tensor (kept fp32 when passed through).
pub fn is_control(name: &str) -> bool {
    CONTROL_PATTERNS.iter().any(|p| name.contains(p))
}

fn quantize_tensor(name: &str, t: &Tensor, cfg: &QuantConfig, rounding: Rounding<'_>) -> Result<Entry> {
    let dtype = t.dtype();
    if !dtype.is_float() {
        return Ok(Entry::Raw(raw_tensor(t)?));
    }
    if cfg.is_int8_gate(name, t.rank(), t.elem_count()) {
        let data = finite_values(t)?;
        let (q, s) = gate_rows(&data, t.dims()[1]);
        return Ok(Entry::Quant(QuantTensor { shape: t.dims().to_vec(), dtype, bits: 8, q, scales: Scales::PerRow(s), lqer: None }));
    }
    if t.elem_count() <= PASSTHROUGH_MAX_NUMEL {
        let store = if cfg.control_fp32 && is_control(name) {
            DType::F32
        } else if matches!(dtype, DType::F32 | DType::BF16) {
            DType::F16
        } else {
            dtype
        };
        return Ok(Entry::Passthrough { stored: raw_tensor(&t.to_dtype(store)?)?, dtype });
    }
    let shape = t.dims().to_vec();
    let data = finite_values(t)?;
    let bits = cfg.bits_of(name);
    let qmax = qmax(bits)?;
    let (q, scales) = if let [rows, cols] = shape[..] {
        let hessian = match rounding {
            Rounding::Gptq(g, hs) => hs.get(name).map(|h| (g, h)),
            Rounding::Nearest => None,
        };
        match (cfg.clip, hessian) {
            // The baseline, bit for bit: clip at the quantile, round with the f32 scale.
            (Clip::Quantile, None) => {
                let (q, s) = quantize_rows(&data, cols, qmax);
                (q, Scales::PerRow(s))
            }
            (clip, hessian) => {
                let s16 = match clip {
                    Clip::Quantile => quantile_row_scales(&data, cols, qmax),
                    Clip::SdClip => sd_clip_scales(&data, rows, cols, qmax, cfg.clip_sigmas_of(name)),
                };
                let s: Vec<f32> = s16.iter().map(|v| v.to_f32()).collect();
                let q = match hessian {
                    Some((g, h)) => quantize_matrix(&data, rows, cols, h, &s, qmax, g)?.q,
                    None => round_to_nearest(&data, cols, &s, qmax),
                };
                (q, Scales::PerRow(s16))
            }
        }
    } else {
        let (q, s) = quantize_whole(&data, qmax);
        (q, Scales::PerTensor(s))
    };
    Ok(Entry::Quant(QuantTensor { shape, dtype, bits, q, scales, lqer: None }))
}

/// The tensor's values in f32, row-major; an error names the first one that is not finite.
pub(super) fn finite_values(t: &Tensor) -> Result<Vec<f32>> {
    let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        bail!("element {i} is {}: only finite values can be quantized", data[i]);
    }
    Ok(data)
}

/// An attention gate's int8 rows (`gate_int8`, the 04-27 record): per row `s = fp16(max(|W_r|max,
/// 1e-10) / 127)`, `q = clamp(round_half_even(W / s), -127, 127)` with the fp16 scale widened:
/// LQER's grouped rounding ([`lqer::Factor::quantize`]) with a row a group.
fn gate_rows(data: &[f32], cols: usize) -> (Vec<i8>, Vec<f16>) {
    let f = lqer::Factor::quantize(data, [data.len() / cols.max(1), cols], cols.max(1), (-127, 127), 127.0);
    (f.q, f.scales)
}

/// `torch.quantile(values, q)` with linear interpolation, in f32 as PyTorch computes it: rank
/// `r = q * (n - 1)` (f32), `lo = values[floor(r)]`, `hi = values[ceil(r)]` in sorted order,
/// result `lerp(lo, hi, r - floor(r))` rounded once. NaN when `values` is empty, holds a NaN, or
/// `q` is outside `[0, 1]`. Reorders `values`.
pub fn quantile_linear(values: &mut [f32], q: f32) -> f32 {
    if values.is_empty() || !(0.0..=1.0).contains(&q) || values.iter().any(|v| v.is_nan()) {
        return f32::NAN;
    }
    let last = values.len() - 1;
    let rank = q * last as f32;
    let below = (rank as usize).min(last);
    let above = (rank.ceil() as usize).min(last);
    let weight = rank - below as f32;
    let (left, &mut hi, _) = values.select_nth_unstable_by(above, f32::total_cmp);
    let lo = if below == above { hi } else { left.iter().copied().fold(f32::NEG_INFINITY, f32::max) };
    lerp(lo, hi, weight)
}

/// PyTorch's `lerp` (`weight < 0.5`: from the start, else from the end), with one rounding.
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    let diff = end - start;
    if weight.abs() < 0.5 { weight.mul_add(diff, start) } else { (weight - 1.0).mul_add(diff, end) }
}

/// The per-row scale for clip value `c`: `max(c / Q, 1 / Q)` in f32 (the floor as PyTorch casts
/// the double `1.0 / Q`).
pub fn row_scale(c: f32, qmax: i8) -> f32 {
    (c / qmax as f32).max((1.0 / qmax as f64) as f32)
}

/// `clamp(round_half_even(clamp(w, -c, c) / s), -Q, Q)` for every element.
fn quantize_values(w: &[f32], c: f32, s: f32, qmax: i8, out: &mut [i8]) {
    let qm = qmax as f32;
    for (o, &x) in out.iter_mut().zip(w) {
        *o = (x.clamp(-c, c) / s).round_ties_even().clamp(-qm, qm) as i8;
    }
}

/// Per-row quantization of a row-major matrix with `cols` columns: values and fp16 scales.
fn quantize_rows(data: &[f32], cols: usize, qmax: i8) -> (Vec<i8>, Vec<f16>) {
    let rows = data.len() / cols;
    let mut q = vec![0i8; data.len()];
    let mut scales = vec![f16::ZERO; rows];
    q.par_chunks_mut(cols).zip(scales.par_iter_mut()).zip(data.par_chunks(cols)).for_each_init(
        || Vec::with_capacity(cols),
        |buf, ((q_row, scale), w_row)| {
            buf.clear();
            buf.extend(w_row.iter().map(|v| v.abs()));
            let c = quantile_linear(buf, CLIP_QUANTILE);
            let s = row_scale(c, qmax);
            quantize_values(w_row, c, s, qmax, q_row);
            *scale = f16::from_f32(s);
        },
    );
    (q, scales)
}

/// The quantile rule's per-row scales rounded to fp16 (for GPTQ, which rounds with the stored
/// scale).
fn quantile_row_scales(data: &[f32], cols: usize, qmax: i8) -> Vec<f16> {
    data.par_chunks(cols)
        .map(|row| {
            let mut abs: Vec<f32> = row.iter().map(|v| v.abs()).collect();
            f16::from_f32(row_scale(quantile_linear(&mut abs, CLIP_QUANTILE), qmax))
        })
        .collect()
}

/// Per-tensor quantization: values and the fp32 scale `c / Q` (1 when `c = 0`).
fn quantize_whole(data: &[f32], qmax: i8) -> (Vec<i8>, f32) {
    let mut abs: Vec<f32> = data.iter().map(|v| v.abs()).collect();
    let c = quantile_linear(&mut abs, CLIP_QUANTILE);
    let s = if c > 0.0 { (c as f64 / qmax as f64) as f32 } else { 1.0 };
    let mut q = vec![0i8; data.len()];
    quantize_values(data, c, s, qmax, &mut q);
    (q, s)
}

/// The tensor's values as little-endian bytes.
fn raw_tensor(t: &Tensor) -> Result<RawTensor> {
    fn le<T, const N: usize>(v: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        v.into_iter().flat_map(f).collect()
    }
    let flat = t.flatten_all()?;
    let bytes = match t.dtype() {
        DType::U8 => flat.to_vec1::<u8>()?,
        DType::U32 => le(flat.to_vec1::<u32>()?, u32::to_le_bytes),
        DType::I16 => le(flat.to_vec1::<i16>()?, i16::to_le_bytes),
        DType::I32 => le(flat.to_vec1::<i32>()?, i32::to_le_bytes),
        DType::I64 => le(flat.to_vec1::<i64>()?, i64::to_le_bytes),
        DType::BF16 => le(flat.to_vec1::<half::bf16>()?, half::bf16::to_le_bytes),
        DType::F16 => le(flat.to_vec1::<f16>()?, f16::to_le_bytes),
        DType::F32 => le(flat.to_vec1::<f32>()?, f32::to_le_bytes),
        DType::F64 => le(flat.to_vec1::<f64>()?, f64::to_le_bytes),
        other => bail!("dtype {} is not supported", other.as_str()),
    };
    Ok(RawTensor { dtype: t.dtype(), shape: t.dims().to_vec(), bytes })
}

impl Quantized {
    /// Bits per value of the matrices (8 or 6 in the challenge; each [`QuantTensor`] has its own).
    #[cfg(feature = "tools")]
    pub fn bits(&self) -> u8 {
        self.bits
    }

    /// The writer's notes stored in the manifest (`info`), if any.
    pub fn info(&self) -> Option<&serde_json::Value> {
        self.info.as_ref()
    }

    /// Attaches notes to store in the manifest (the quantizer's settings, the model's config),
    /// keeping the quantizer's own (`lqer_dropped`) when both are objects.
    pub fn with_info(mut self, info: serde_json::Value) -> Self {
        self.info = Some(match (self.info.take(), info) {
            (Some(serde_json::Value::Object(mut mine)), serde_json::Value::Object(theirs)) => {
                mine.extend(theirs);
                serde_json::Value::Object(mine)
            }
            (_, info) => info,
        });
        self
    }

    /// The entries, in state-dict order.
    #[cfg(feature = "tools")]
    pub fn entries(&self) -> &[(String, Entry)] {
        &self.entries
    }

    /// The entry called `name`.
    #[cfg(feature = "tools")]
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, e)| e)
    }

    /// Byte counts (the spec's payload accounting).
    pub fn stats(&self) -> PayloadStats {
        let mut s = PayloadStats { tensors: self.entries.len(), ..Default::default() };
        for (_, e) in &self.entries {
            match e {
                Entry::Quant(t) => {
                    s.quantized += 1;
                    s.int_bytes += t.q.len() as u64;
                    if let Some(l) = &t.lqer {
                        s.lqer += 1;
                        s.lqer_bytes += l.bytes();
                    }
                    s.scale_bytes += match &t.scales {
                        Scales::PerRow(v) => 2 * v.len() as u64,
                        Scales::PerTensor(_) => 4,
                    };
                }
                Entry::Passthrough { stored, .. } => {
                    s.passthrough += 1;
                    s.passthrough_bytes += stored.bytes.len() as u64;
                }
                Entry::Raw(t) => {
                    s.raw += 1;
                    s.raw_bytes += t.bytes.len() as u64;
                }
            }
        }
        s.payload_bytes = s.int_bytes + s.scale_bytes + s.passthrough_bytes + s.raw_bytes + s.lqer_bytes;
        s
    }

    /// What became of each tensor, one line per kind (as the 04-27 record logs its
    /// `Quantized weights:`): `per_row int6: blocks.attn.c_k.weight, ...` with layer numbers
    /// folded, LQER's corrections named in full (`lqer rank 4: blocks.3.mlp.fc.weight, ...`).
    pub fn kind_lines(&self) -> Vec<String> {
        let mut kinds: std::collections::BTreeMap<String, Vec<String>> = Default::default();
        let mut corrected = Vec::new();
        for (name, e) in &self.entries {
            let kind = match e {
                Entry::Quant(t) => {
                    if let Some(l) = &t.lqer {
                        corrected.push(format!("{name} ({} bytes, rank {})", l.bytes(), l.rank()));
                    }
                    let per = if matches!(t.scales, Scales::PerRow(_)) { "per_row" } else { "per_tensor" };
                    format!("{per} int{}", t.bits)
                }
                Entry::Passthrough { stored, .. } => format!("passthrough {}", stored.dtype.as_str()),
                Entry::Raw(t) => format!("raw {}", t.dtype.as_str()),
            };
            let folded = name.split('.').map(|p| if p.parse::<usize>().is_ok() { "N" } else { p }).collect::<Vec<_>>().join(".");
            let names = kinds.entry(kind).or_default();
            if !names.contains(&folded) {
                names.push(folded);
            }
        }
        let mut lines: Vec<String> = kinds.into_iter().map(|(k, names)| format!("{k}: {}", names.join(", "))).collect();
        if !corrected.is_empty() {
            lines.push(format!("lqer: {}", corrected.join(", ")));
        }
        if let Some(serde_json::Value::Array(dropped)) = self.info.as_ref().and_then(|i| i.get("lqer_dropped")) {
            lines.extend(dropped.iter().filter_map(|d| d.as_str()).map(|d| format!("lqer dropped: {d}")));
        }
        lines
    }

    /// The payload in bytes: integer values + scales + passthrough and raw tensors.
    pub fn payload_bytes(&self) -> u64 {
        self.stats().payload_bytes
    }

    /// The tensors back, in state-dict order, on `device`: `q * scale` for quantized tensors,
    /// the stored values for the others. Float tensors get their original dtype, or `dtype` when
    /// given; non-float tensors keep theirs.
    pub fn dequantize(&self, dtype: Option<DType>, device: &Device) -> Result<Vec<(String, Tensor)>> {
        self.entries
            .iter()
            .map(|(name, e)| {
                let t = dequantize_entry(e, dtype, device).with_context(|| format!("cannot restore tensor `{name}`"))?;
                Ok((name.clone(), t))
            })
            .collect()
    }
}

fn dequantize_entry(e: &Entry, dtype: Option<DType>, device: &Device) -> Result<Tensor> {
    Ok(match e {
        Entry::Quant(t) => {
            let mut values = t.levels_times_scales();
            if let Some(l) = &t.lqer {
                for (v, c) in values.iter_mut().zip(l.correction()) {
                    *v += c;
                }
            }
            Tensor::from_vec(values, t.shape.as_slice(), device)?.to_dtype(dtype.unwrap_or(t.dtype))?
        }
        Entry::Passthrough { stored, dtype: orig } => {
            Tensor::from_raw_buffer(&stored.bytes, stored.dtype, &stored.shape, device)?.to_dtype(dtype.unwrap_or(*orig))?
        }
        Entry::Raw(t) => Tensor::from_raw_buffer(&t.bytes, t.dtype, &t.shape, device)?,
    })
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_0427;
