//! The post-training quantized model artifact: the challenge's int8 + zlib round trip
//! (`shared/research/record_spec.md`, section 3.10), with an int6 variant and a choice of
//! compressor (zlib, zstd, brotli).
//!
//! [`quantize`] turns a state dict (`Gpt::state_dict()`: name, f32/bf16 tensor) into a
//! [`Quantized`] container, tensor by tensor, in the order given:
//! - non-float tensors are stored as they are ([`Entry::Raw`]);
//! - float tensors with at most [`PASSTHROUGH_MAX_NUMEL`] elements stay float
//!   ([`Entry::Passthrough`]): fp32 when the name contains a [`CONTROL_PATTERNS`] entry, fp16 for
//!   other fp32/bf16 tensors, their own dtype otherwise; the original dtype is recorded;
//! - larger 2-D float tensors get per-row symmetric integers ([`Scales::PerRow`]): `c_r` is the
//!   [`CLIP_QUANTILE`] quantile of `|W_r|` (linear interpolation, [`quantile_linear`]), `W_r` is
//!   clipped to `±c_r`, `s_r = max(c_r / Q, 1 / Q)`, `q = clamp(round_half_even(W / s_r), -Q, Q)`;
//!   the scales are stored as fp16, the rounding uses the fp32 scale;
//! - larger float tensors of other ranks get one fp32 scale `c / Q` (1 when `c = 0`) with the same
//!   quantile ([`Scales::PerTensor`]).
//!
//! `Q = 2^(bits-1) - 1`: 127 for int8 (the challenge baseline), 31 for int6. Int6 is the same
//! scheme with 31 in place of 127 everywhere, the scale floor included (`1/31`); its values are
//! still stored one per byte, so the container is no smaller: the gain comes from the compressor,
//! which sees 63 symbols instead of 255. (The later records' int6 uses GPTQ with std-based clip
//! scales and no floor, spec 4.5; that is not implemented here.)
//!
//! [`Quantized::dequantize`] gives `W = q * s` (the stored fp16 scale widened to f32, per row),
//! cast back to the original dtype; passthrough tensors are cast back to theirs.
//!
//! Numerics follow the PyTorch script: the quantile is computed in f32 like `torch.quantile`
//! (rank `q * (n - 1)` in f32, `lerp` between the two neighbours with one rounding, as the CUDA
//! and vectorised CPU kernels do), divisions in f32, rounding half to even like `torch.round`.
//!
//! # Artifact format (version [`FORMAT_VERSION`])
//!
//! [`Quantized::to_bytes`] writes a 34-byte header followed by the compressed body:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic [`MAGIC`] (`PGQZ`) |
//! | 4 | 1 | format version ([`FORMAT_VERSION`]) |
//! | 5 | 1 | codec: 1 zlib, 2 zstd, 3 brotli |
//! | 6 | 4 | compression level, i32 little-endian (informational) |
//! | 10 | 8 | body length before compression, u64 LE |
//! | 18 | 8 | body length after compression, u64 LE (the bytes after the header) |
//! | 26 | 8 | first 8 bytes of the SHA-256 of the uncompressed body |
//!
//! The body is a safetensors file (readable by Python's `safetensors`), little-endian tensors:
//! - `NAME.q` (`I8`, the tensor's shape) and `NAME.scale` (`F16 [rows]` per row, `F32 []` per
//!   tensor) for quantized tensors;
//! - `NAME.passthrough` (stored dtype, the tensor's shape) for kept float tensors;
//! - `NAME.raw` (own dtype and shape) for non-float tensors;
//! - `__metadata__` has one key, `pipeline.quant`, a JSON manifest:
//!   `{"format": "pipeline-quant", "version": 1, "bits": 8, "tensors": [{"name", "kind"
//!   ("per_row" | "per_tensor" | "passthrough" | "raw"), "dtype" (original, candle's name such
//!   as "bf16"), "shape"}, ...]}` in state-dict order.
//!
//! [`from_bytes`] checks every field (magic, version, codec, lengths, checksum, manifest, names,
//! dtypes, shapes, value range) and fails with an error that says what is wrong.
//!
//! Sizes: [`PayloadStats::payload_bytes`] counts the bytes as the challenge script does (integer
//! values + scales + passthrough and raw tensors, no container overhead); [`ArtifactStats`] adds the
//! compressed size, to compare with [`ARTIFACT_CAP_BYTES`] (which also has to hold the code).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::{Read, Write};
use std::ops::RangeInclusive;
use std::str::FromStr;

use anyhow::{Context, Result, bail, ensure};
use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The challenge's size limit for code + compressed model, in bytes (decimal, spec section 0).
pub const ARTIFACT_CAP_BYTES: u64 = 16_000_000;

/// Float tensors with at most this many elements are kept in float (spec 3.10).
pub const PASSTHROUGH_MAX_NUMEL: usize = 65_536;

/// The quantile of `|W|` used as the clip value (percentile 99.99984, spec 3.10).
pub const CLIP_QUANTILE: f32 = 0.999_998_4;

/// Name fragments of control tensors, which stay fp32 when passed through (spec 3.5, 3.10).
pub const CONTROL_PATTERNS: [&str; 5] = ["attn_scale", "mlp_scale", "resid_mix", "q_gain", "skip_weight"];

/// First four bytes of every artifact.
pub const MAGIC: [u8; 4] = *b"PGQZ";

/// Version of the artifact format (header and manifest).
pub const FORMAT_VERSION: u8 = 1;

/// Bytes before the compressed body.
pub const HEADER_LEN: usize = 34;

const MANIFEST_KEY: &str = "pipeline.quant";
const MANIFEST_FORMAT: &str = "pipeline-quant";

/// The compressor applied to the serialized container.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    /// zlib (DEFLATE, pure-Rust miniz_oxide), as the challenge baseline: levels 0..=9, default 9.
    #[default]
    Zlib,
    /// Zstandard: levels 1..=22 (negative: fast modes), default 22.
    Zstd,
    /// Brotli, as the later records: quality 0..=11, default 11, window 2^22 (Python's default).
    Brotli,
}

impl Codec {
    /// Every codec.
    pub const ALL: [Codec; 3] = [Codec::Zlib, Codec::Zstd, Codec::Brotli];

    /// Lower-case name, as in configs.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Zlib => "zlib",
            Codec::Zstd => "zstd",
            Codec::Brotli => "brotli",
        }
    }

    /// The strongest level: what `level = None` means.
    pub fn default_level(self) -> i32 {
        match self {
            Codec::Zlib => 9,
            Codec::Zstd => 22,
            Codec::Brotli => 11,
        }
    }

    /// The levels this codec accepts.
    pub fn levels(self) -> RangeInclusive<i32> {
        match self {
            Codec::Zlib => 0..=9,
            Codec::Zstd => zstd::compression_level_range(),
            Codec::Brotli => 0..=11,
        }
    }

    /// `level`, or the default one; errors when the codec does not accept it.
    pub fn resolve_level(self, level: Option<i32>) -> Result<i32> {
        let level = level.unwrap_or(self.default_level());
        let range = self.levels();
        ensure!(range.contains(&level), "{self} level {level} is outside {}..={}", range.start(), range.end());
        Ok(level)
    }

    fn id(self) -> u8 {
        match self {
            Codec::Zlib => 1,
            Codec::Zstd => 2,
            Codec::Brotli => 3,
        }
    }

    fn from_id(id: u8) -> Option<Self> {
        Codec::ALL.into_iter().find(|c| c.id() == id)
    }

    /// Compresses `data` at `level` (already checked by [`Codec::resolve_level`]).
    fn compress(self, data: &[u8], level: i32) -> Result<Vec<u8>> {
        let out = match self {
            Codec::Zlib => {
                let mut enc = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(level as u32));
                enc.write_all(data)?;
                enc.finish()?
            }
            Codec::Zstd => zstd::bulk::compress(data, level)?,
            Codec::Brotli => {
                let params = brotli::enc::BrotliEncoderParams { quality: level, lgwin: 22, ..Default::default() };
                let mut out = Vec::new();
                brotli::BrotliCompress(&mut &data[..], &mut out, &params)?;
                out
            }
        };
        Ok(out)
    }

    /// Decompresses `data`, which must give exactly `len` bytes.
    fn decompress(self, data: &[u8], len: usize) -> Result<Vec<u8>> {
        // Read one byte more than expected, so that a longer body shows without reading it all.
        let limit = (len as u64).saturating_add(1);
        let mut out = Vec::new();
        match self {
            Codec::Zlib => {
                flate2::read::ZlibDecoder::new(data).take(limit).read_to_end(&mut out)?;
            }
            Codec::Zstd => {
                zstd::stream::read::Decoder::with_buffer(data)?.take(limit).read_to_end(&mut out)?;
            }
            Codec::Brotli => {
                brotli::Decompressor::new(data, 4096).take(limit).read_to_end(&mut out)?;
            }
        }
        ensure!(out.len() == len, "the body decompresses to {} bytes, the header says {len}", out.len());
        Ok(out)
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Codec {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Codec::ALL.into_iter().find(|c| c.name() == s).ok_or_else(|| anyhow::anyhow!("unknown codec `{s}` (zlib, zstd, brotli)"))
    }
}

/// Quantization settings (defaults: the challenge baseline's int8 + zlib level 9).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QuantConfig {
    /// Bits per quantized value: 8 (int8, levels -127..=127, the baseline) or 6 (int6, levels
    /// -31..=31, scale floor 1/31); any of 2..=8 works (levels ±(2^(bits-1) - 1)). Values are
    /// stored one per byte whatever the width: fewer bits only help the compressor.
    pub bits: u8,
    /// Compressor for the artifact: `zlib`, `zstd` or `brotli`.
    pub codec: Codec,
    /// Compression level; unset means the codec's strongest (zlib 9, zstd 22, brotli 11).
    pub level: Option<i32>,
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self { bits: 8, codec: Codec::Zlib, level: None }
    }
}

impl QuantConfig {
    /// Checks the bit width and the level.
    pub fn check(&self) -> Result<()> {
        qmax(self.bits)?;
        self.codec.resolve_level(self.level)?;
        Ok(())
    }
}

/// The largest level for `bits` (127 for 8, 31 for 6).
fn qmax(bits: u8) -> Result<i8> {
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
    /// Integer values, row-major, in `-Q..=Q`.
    pub q: Vec<i8>,
    /// The scales.
    pub scales: Scales,
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
    /// Sum of the four: the spec's "payload".
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
    pub fn fits_cap(&self, code_bytes: u64) -> bool {
        self.compressed_bytes + code_bytes <= ARTIFACT_CAP_BYTES
    }
}

/// A compressed artifact and its sizes.
#[derive(Clone, Debug)]
pub struct Artifact {
    /// The bytes to write ([`from_bytes`] reads them back).
    pub bytes: Vec<u8>,
    /// The sizes.
    pub stats: ArtifactStats,
}

/// A quantized state dict (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    bits: u8,
    entries: Vec<(String, Entry)>,
}

/// Quantizes a state dict (spec 3.10; see the module documentation). Tensors may be on any
/// device; the container lives on the host. Errors name the tensor.
pub fn quantize(state: &[(String, Tensor)], cfg: &QuantConfig) -> Result<Quantized> {
    cfg.check()?;
    let qmax = qmax(cfg.bits)?;
    let mut seen = HashSet::new();
    let mut entries = Vec::with_capacity(state.len());
    for (name, t) in state {
        ensure!(seen.insert(name.as_str()), "tensor `{name}` appears twice in the state dict");
        let entry = quantize_tensor(name, t, qmax).with_context(|| format!("cannot quantize tensor `{name}`"))?;
        entries.push((name.clone(), entry));
    }
    Ok(Quantized { bits: cfg.bits, entries })
}

/// Whether `name` is a control tensor (kept fp32 when passed through).
pub fn is_control(name: &str) -> bool {
    CONTROL_PATTERNS.iter().any(|p| name.contains(p))
}

fn quantize_tensor(name: &str, t: &Tensor, qmax: i8) -> Result<Entry> {
    let dtype = t.dtype();
    if !dtype.is_float() {
        return Ok(Entry::Raw(raw_tensor(t)?));
    }
    if t.elem_count() <= PASSTHROUGH_MAX_NUMEL {
        let store = if is_control(name) {
            DType::F32
        } else if matches!(dtype, DType::F32 | DType::BF16) {
            DType::F16
        } else {
            dtype
        };
        return Ok(Entry::Passthrough { stored: raw_tensor(&t.to_dtype(store)?)?, dtype });
    }
    let shape = t.dims().to_vec();
    let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        bail!("element {i} is {}: only finite values can be quantized", data[i]);
    }
    let (q, scales) = if shape.len() == 2 {
        let (q, s) = quantize_rows(&data, shape[1], qmax);
        (q, Scales::PerRow(s))
    } else {
        let (q, s) = quantize_whole(&data, qmax);
        (q, Scales::PerTensor(s))
    };
    Ok(Entry::Quant(QuantTensor { shape, dtype, q, scales }))
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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Kind {
    PerRow,
    PerTensor,
    Passthrough,
    Raw,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    format: String,
    version: u32,
    bits: u8,
    tensors: Vec<ManifestEntry>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestEntry {
    name: String,
    kind: Kind,
    dtype: String,
    shape: Vec<usize>,
}

fn checksum(body: &[u8]) -> [u8; 8] {
    let digest = Sha256::digest(body);
    let mut out = [0u8; 8];
    out.copy_from_slice(&digest[..8]);
    out
}

impl Quantized {
    /// Bits per value (8 or 6 in the challenge).
    pub fn bits(&self) -> u8 {
        self.bits
    }

    /// The entries, in state-dict order.
    pub fn entries(&self) -> &[(String, Entry)] {
        &self.entries
    }

    /// The entry called `name`.
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
        s.payload_bytes = s.int_bytes + s.scale_bytes + s.passthrough_bytes + s.raw_bytes;
        s
    }

    /// The payload in bytes: integer values + scales + passthrough and raw tensors.
    pub fn payload_bytes(&self) -> u64 {
        self.stats().payload_bytes
    }

    /// The uncompressed body: a safetensors file with the manifest (module documentation).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let mut blobs: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(2 * self.entries.len());
        let mut manifest =
            Manifest { format: MANIFEST_FORMAT.into(), version: FORMAT_VERSION.into(), bits: self.bits, tensors: Vec::new() };
        for (name, e) in &self.entries {
            let kind = match e {
                Entry::Quant(t) => {
                    blobs.push((format!("{name}.q"), StDtype::I8, t.shape.clone(), t.q.iter().map(|&v| v as u8).collect()));
                    match &t.scales {
                        Scales::PerRow(s) => {
                            let bytes = s.iter().flat_map(|v| v.to_le_bytes()).collect();
                            blobs.push((format!("{name}.scale"), StDtype::F16, vec![s.len()], bytes));
                            Kind::PerRow
                        }
                        Scales::PerTensor(s) => {
                            blobs.push((format!("{name}.scale"), StDtype::F32, vec![], s.to_le_bytes().to_vec()));
                            Kind::PerTensor
                        }
                    }
                }
                Entry::Passthrough { stored, .. } => {
                    blobs.push((format!("{name}.passthrough"), stored.dtype.into(), stored.shape.clone(), stored.bytes.clone()));
                    Kind::Passthrough
                }
                Entry::Raw(t) => {
                    blobs.push((format!("{name}.raw"), t.dtype.into(), t.shape.clone(), t.bytes.clone()));
                    Kind::Raw
                }
            };
            manifest.tensors.push(ManifestEntry { name: name.clone(), kind, dtype: e.dtype().as_str().into(), shape: e.shape().to_vec() });
        }
        let mut views = Vec::with_capacity(blobs.len());
        for (name, dtype, shape, bytes) in &blobs {
            let view =
                TensorView::new(*dtype, shape.clone(), bytes).with_context(|| format!("tensor `{name}` has an inconsistent size"))?;
            views.push((name.as_str(), view));
        }
        let meta = HashMap::from([(MANIFEST_KEY.to_string(), serde_json::to_string(&manifest)?)]);
        Ok(safetensors::serialize(views, Some(meta))?)
    }

    /// Serializes and compresses with `codec` at `level` (default: the codec's strongest).
    pub fn compress(&self, codec: Codec, level: Option<i32>) -> Result<Artifact> {
        let level = codec.resolve_level(level)?;
        let body = self.serialize()?;
        let packed = codec.compress(&body, level).with_context(|| format!("{codec} compression failed"))?;
        let mut bytes = Vec::with_capacity(HEADER_LEN + packed.len());
        bytes.extend_from_slice(&MAGIC);
        bytes.push(FORMAT_VERSION);
        bytes.push(codec.id());
        bytes.extend_from_slice(&level.to_le_bytes());
        bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&(packed.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&checksum(&body));
        debug_assert_eq!(bytes.len(), HEADER_LEN);
        bytes.extend_from_slice(&packed);
        let stats = ArtifactStats {
            codec,
            level,
            payload_bytes: self.payload_bytes(),
            serialized_bytes: body.len() as u64,
            compressed_bytes: bytes.len() as u64,
        };
        Ok(Artifact { bytes, stats })
    }

    /// The compressed artifact ([`Quantized::compress`] without the sizes).
    pub fn to_bytes(&self, codec: Codec, level: Option<i32>) -> Result<Vec<u8>> {
        Ok(self.compress(codec, level)?.bytes)
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
            let values: Vec<f32> = match &t.scales {
                Scales::PerRow(s) => {
                    let cols = t.q.len() / s.len().max(1);
                    t.q.chunks(cols.max(1)).zip(s).flat_map(|(row, s)| row.iter().map(move |&v| v as f32 * s.to_f32())).collect()
                }
                Scales::PerTensor(s) => t.q.iter().map(|&v| v as f32 * s).collect(),
            };
            Tensor::from_vec(values, t.shape.as_slice(), device)?.to_dtype(dtype.unwrap_or(t.dtype))?
        }
        Entry::Passthrough { stored, dtype: orig } => {
            Tensor::from_raw_buffer(&stored.bytes, stored.dtype, &stored.shape, device)?.to_dtype(dtype.unwrap_or(*orig))?
        }
        Entry::Raw(t) => Tensor::from_raw_buffer(&t.bytes, t.dtype, &t.shape, device)?,
    })
}

/// Reads an artifact written by [`Quantized::to_bytes`] (any codec; the header names it).
/// Truncated, corrupted or foreign bytes give an error saying what is wrong.
pub fn from_bytes(bytes: &[u8]) -> Result<Quantized> {
    ensure!(
        bytes.len() >= HEADER_LEN,
        "the artifact is {} bytes, shorter than its {HEADER_LEN}-byte header (truncated, or not a quantized artifact)",
        bytes.len()
    );
    ensure!(bytes[..4] == MAGIC, "not a quantized model artifact (the first bytes are {:?}, expected {:?})", &bytes[..4], MAGIC);
    let version = bytes[4];
    ensure!(version == FORMAT_VERSION, "artifact format version {version} is not supported (this build reads {FORMAT_VERSION})");
    let codec = Codec::from_id(bytes[5]).ok_or_else(|| anyhow::anyhow!("unknown codec id {} in the artifact header", bytes[5]))?;
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let (body_len, packed_len) = (u64_at(10), u64_at(18));
    let packed = &bytes[HEADER_LEN..];
    ensure!(
        packed.len() as u64 == packed_len,
        "the artifact has {} bytes after its header, the header says {packed_len} (truncated or extended)",
        packed.len()
    );
    let body_len = usize::try_from(body_len).context("the body length in the header is too large")?;
    let body = codec.decompress(packed, body_len).with_context(|| format!("cannot decompress the {codec} body"))?;
    ensure!(checksum(&body) == bytes[26..34], "the body's checksum does not match the header (corrupted artifact)");
    parse_body(&body).context("the artifact's container is malformed")
}

fn parse_body(body: &[u8]) -> Result<Quantized> {
    let (_, meta) = SafeTensors::read_metadata(body)?;
    let manifest =
        meta.metadata().as_ref().and_then(|m| m.get(MANIFEST_KEY)).ok_or_else(|| anyhow::anyhow!("no `{MANIFEST_KEY}` manifest"))?;
    let manifest: Manifest = serde_json::from_str(manifest).context("the manifest is not valid")?;
    ensure!(manifest.format == MANIFEST_FORMAT, "the manifest's format is `{}`, expected `{MANIFEST_FORMAT}`", manifest.format);
    ensure!(manifest.version == FORMAT_VERSION as u32, "manifest version {} is not supported", manifest.version);
    let qmax = qmax(manifest.bits)?;
    let st = SafeTensors::deserialize(body)?;
    let mut used = 0usize;
    let mut seen = HashSet::new();
    let mut entries = Vec::with_capacity(manifest.tensors.len());
    for m in manifest.tensors {
        ensure!(seen.insert(m.name.clone()), "tensor `{}` is listed twice", m.name);
        let name = m.name.clone();
        let (entry, n) = parse_entry(&st, m, qmax).with_context(|| format!("tensor `{name}`"))?;
        used += n;
        entries.push((name, entry));
    }
    ensure!(used == st.len(), "the container holds {} tensors, its manifest accounts for {used}", st.len());
    Ok(Quantized { bits: manifest.bits, entries })
}

/// The stored tensor `NAME.SUFFIX`.
fn stored_view<'a>(st: &SafeTensors<'a>, name: &str, suffix: &str) -> Result<TensorView<'a>> {
    let key = format!("{name}.{suffix}");
    st.tensor(&key).map_err(|e| anyhow::anyhow!("stored tensor `{key}`: {e}"))
}

/// Checks the dtype and shape of a stored tensor.
fn expect(view: &TensorView<'_>, what: &str, dtype: StDtype, shape: &[usize]) -> Result<()> {
    ensure!(view.dtype() == dtype, "{what} has dtype {:?}, expected {dtype:?}", view.dtype());
    ensure!(view.shape() == shape, "{what} has shape {:?}, expected {shape:?}", view.shape());
    Ok(())
}

/// One manifest entry: the entry and how many stored tensors it used.
fn parse_entry(st: &SafeTensors<'_>, m: ManifestEntry, qmax: i8) -> Result<(Entry, usize)> {
    let dtype = DType::from_str(&m.dtype).map_err(|e| anyhow::anyhow!("{e}"))?;
    let get = |suffix: &str| stored_view(st, &m.name, suffix);
    Ok(match m.kind {
        Kind::PerRow | Kind::PerTensor => {
            ensure!(dtype.is_float(), "a quantized tensor must come from a float dtype, not {}", m.dtype);
            let qv = get("q")?;
            expect(&qv, "the values", StDtype::I8, &m.shape)?;
            let q: Vec<i8> = qv.data().iter().map(|&b| b as i8).collect();
            if let Some(v) = q.iter().find(|v| v.unsigned_abs() > qmax as u8) {
                bail!("value {v} is outside ±{qmax}");
            }
            let sv = get("scale")?;
            let scales = if m.kind == Kind::PerRow {
                ensure!(m.shape.len() == 2, "per-row scales need a 2-D tensor, the shape is {:?}", m.shape);
                expect(&sv, "the scales", StDtype::F16, &m.shape[..1])?;
                Scales::PerRow(sv.data().chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect())
            } else {
                expect(&sv, "the scale", StDtype::F32, &[])?;
                Scales::PerTensor(f32::from_le_bytes(sv.data().try_into()?))
            };
            (Entry::Quant(QuantTensor { shape: m.shape, dtype, q, scales }), 2)
        }
        Kind::Passthrough => {
            ensure!(dtype.is_float(), "a passthrough tensor must come from a float dtype, not {}", m.dtype);
            let v = get("passthrough")?;
            let stored_dtype = DType::try_from(v.dtype())?;
            ensure!(stored_dtype.is_float(), "stored dtype {} is not a float dtype", stored_dtype.as_str());
            expect(&v, "the stored values", v.dtype(), &m.shape)?;
            (Entry::Passthrough { stored: RawTensor { dtype: stored_dtype, shape: m.shape, bytes: v.data().to_vec() }, dtype }, 1)
        }
        Kind::Raw => {
            let v = get("raw")?;
            expect(&v, "the values", dtype.into(), &m.shape)?;
            (Entry::Raw(RawTensor { dtype, shape: m.shape, bytes: v.data().to_vec() }), 1)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Gpt, ModelConfig};

    fn cfg(bits: u8) -> QuantConfig {
        QuantConfig { bits, ..Default::default() }
    }

    fn f32_values(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// A state dict with every kind of entry.
    fn mixed_state() -> Vec<(String, Tensor)> {
        let dev = Device::Cpu;
        let mut rng = fastrand::Rng::with_seed(7);
        let mut normal = |n: usize, std: f32| -> Vec<f32> { (0..n).map(|_| (rng.f32() * 2.0 - 1.0) * std * 1.7).collect() };
        vec![
            ("blocks.0.mlp.fc.weight".into(), Tensor::from_vec(normal(300 * 256, 0.05), (300, 256), &dev).unwrap()),
            ("big.weight".into(), Tensor::from_vec(normal(260 * 256, 2.0), (260, 256), &dev).unwrap().to_dtype(DType::BF16).unwrap()),
            ("stack".into(), Tensor::from_vec(normal(3 * 100 * 256, 0.3), (3, 100, 256), &dev).unwrap()),
            ("blocks.0.attn_scale".into(), Tensor::from_vec(normal(512, 1.0), 512, &dev).unwrap()),
            ("blocks.0.resid_mix".into(), Tensor::from_vec(normal(1024, 1.0), (2, 512), &dev).unwrap().to_dtype(DType::BF16).unwrap()),
            ("norm.small".into(), Tensor::from_vec(normal(64, 1.0), (8, 8), &dev).unwrap()),
            ("half".into(), Tensor::from_vec(normal(10, 1.0), 10, &dev).unwrap().to_dtype(DType::F16).unwrap()),
            ("wide".into(), Tensor::from_vec(normal(10, 1.0).into_iter().map(f64::from).collect::<Vec<f64>>(), 10, &dev).unwrap()),
            ("steps".into(), Tensor::from_vec(vec![3u32, 1, 4, 1, 5], 5, &dev).unwrap()),
            ("ids".into(), Tensor::from_vec(vec![-3i64, 1 << 40], 2, &dev).unwrap()),
        ]
    }

    #[test]
    fn quantile_matches_torch_linear() {
        // torch.quantile(torch.tensor([1., 2., 3., 4.]), 0.5) == 2.5.
        assert_eq!(quantile_linear(&mut [4.0, 1.0, 3.0, 2.0], 0.5), 2.5);
        // Rank 0.25 * 4 = 1 exactly: the second value.
        assert_eq!(quantile_linear(&mut [5.0, 4.0, 3.0, 2.0, 1.0], 0.25), 2.0);
        // Rank 0.3 * 4 = 1.2: 2 + 0.2 * (3 - 2).
        assert!((quantile_linear(&mut [5.0, 4.0, 3.0, 2.0, 1.0], 0.3) - 2.2).abs() < 1e-6);
        // Ends.
        assert_eq!(quantile_linear(&mut [5.0, -4.0, 3.0], 0.0), -4.0);
        assert_eq!(quantile_linear(&mut [5.0, -4.0, 3.0], 1.0), 5.0);
        // One element: any q gives it.
        assert_eq!(quantile_linear(&mut [0.37], CLIP_QUANTILE), 0.37);
        assert_eq!(quantile_linear(&mut [0.37], 0.2), 0.37);
        // All equal: the value, exactly.
        assert_eq!(quantile_linear(&mut [0.1; 513], CLIP_QUANTILE), 0.1);
        // [0, 1] at the clip quantile: 1 - (1 - w) = w, the f32 quantile itself.
        assert_eq!(quantile_linear(&mut [1.0, 0.0], CLIP_QUANTILE), 0.999_998_4_f32);
        // 0..=511 (a 512-wide row): rank 0.9999984 * 511 = 510.99918 in f32.
        let mut row: Vec<f32> = (0..512).rev().map(|v| v as f32).collect();
        let v = quantile_linear(&mut row, CLIP_QUANTILE);
        assert!((v - 510.999_18).abs() < 2e-5, "{v}");
        // Between the two largest, near the largest, for a row with one outlier.
        let mut row: Vec<f32> = (0..1024).map(|i| if i == 17 { 9.0 } else { (i % 7) as f32 * 0.01 }).collect();
        let v = quantile_linear(&mut row, CLIP_QUANTILE);
        let rank = CLIP_QUANTILE * 1023.0;
        assert!((v - (0.06 + (rank - 1022.0) * (9.0 - 0.06))).abs() < 1e-4, "{v}");
        // Undefined cases.
        assert!(quantile_linear(&mut [], 0.5).is_nan());
        assert!(quantile_linear(&mut [1.0, f32::NAN], 0.5).is_nan());
    }

    #[test]
    fn per_row_int8_of_a_hand_made_matrix() {
        // Row 0: clip value about 0.5 < 1, so the scale is the floor 1/127 (f16 0x2008).
        // Row 1: clip value c about 3 (between 2 and 3 at w = 0.9999952): s = c / 127.
        // Row 2: |values| equal at 127, so c = 127 and s = 1 exactly; ties round to even.
        let c1 = quantile_linear(&mut [2.0, 1.0, 0.5, 3.0], CLIP_QUANTILE);
        assert!(c1 < 3.0 && c1 > 2.9999);
        let s1 = c1 / 127.0;
        // 84.498 units of the f32 scale round to 84; with the (smaller) fp16 scale they would give 85.
        let tricky = 84.498 * s1;
        assert_eq!((tricky / f16::from_f32(s1).to_f32()).round(), 85.0);
        #[rustfmt::skip]
        let m = [
            0.5, -0.25, 0.1, 0.0,
            -2.0, 1.0, tricky, 3.0,
            127.0, -2.5, 1.5, -127.0,
        ];
        let (q, s) = quantize_rows(&m, 4, 127);
        assert_eq!(q, [63, -32, 13, 0, -85, 42, 84, 127, 127, -2, 2, -127]);
        assert_eq!(s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), [0x2008, 0x260C, 0x3C00]);
        // The same through `quantize`, in a matrix large enough to be quantized.
        let big: Vec<f32> = m.iter().copied().cycle().take(3 * 4 * 6000).collect();
        let t = Tensor::from_vec(big, (3 * 6000, 4), &Device::Cpu).unwrap();
        let qz = quantize(&[("w".into(), t)], &cfg(8)).unwrap();
        let Some(Entry::Quant(qt)) = qz.get("w") else { panic!("not quantized") };
        assert_eq!(qt.q[..12], q[..]);
        assert_eq!(qt.scales, Scales::PerRow(s.iter().copied().cycle().take(18000).collect()));
    }

    #[test]
    fn scale_floor_and_round_half_even() {
        // The floor: rows with a small clip value use s = 1/127 (1/31 for int6).
        assert_eq!(row_scale(0.2, 127), (1.0f64 / 127.0) as f32);
        assert_eq!(row_scale(0.0, 127), (1.0f64 / 127.0) as f32);
        assert_eq!(row_scale(0.9, 31), (1.0f64 / 31.0) as f32);
        assert_eq!(row_scale(2.54, 127), 2.54f32 / 127.0);
        let (q, s) = quantize_rows(&[0.01, -0.02, 0.0, 0.004], 4, 127);
        assert_eq!(s[0], f16::from_f32(1.0 / 127.0));
        assert_eq!(q, [1, -3, 0, 1]); // 1.27, -2.54, 0, 0.508
        // Half to even with s = 1: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 3.5 -> 4, and their negatives.
        let row = [127.0, 0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, -127.0];
        let (q, s) = quantize_rows(&row, row.len(), 127);
        assert_eq!(s[0].to_f32(), 1.0);
        assert_eq!(q, [127, 0, 2, 2, 4, 0, -2, -2, -4, -127]);
    }

    #[test]
    fn per_tensor_scale_for_other_ranks() {
        let n = 2 * 2 * 20_000;
        let data: Vec<f32> = (0..n).map(|i| ((i * 37 % 1001) as f32 - 500.0) * 0.004).collect();
        let t = Tensor::from_vec(data.clone(), (2, 2, 20_000), &Device::Cpu).unwrap();
        let z = Tensor::zeros(70_000, DType::F32, &Device::Cpu).unwrap();
        let qz = quantize(&[("t".into(), t), ("z".into(), z)], &cfg(8)).unwrap();
        let Some(Entry::Quant(qt)) = qz.get("t") else { panic!() };
        let c = quantile_linear(&mut data.iter().map(|v| v.abs()).collect::<Vec<_>>(), CLIP_QUANTILE);
        assert_eq!(qt.scales, Scales::PerTensor((c as f64 / 127.0) as f32));
        assert_eq!(*qt.q.iter().max().unwrap(), 127);
        let Some(Entry::Quant(qz0)) = qz.get("z") else { panic!() };
        assert_eq!(qz0.scales, Scales::PerTensor(1.0));
        assert!(qz0.q.iter().all(|&v| v == 0));
        assert_eq!(qz.stats().scale_bytes, 8);
    }

    #[test]
    fn passthrough_rules() {
        let st = mixed_state();
        let qz = quantize(&st, &cfg(8)).unwrap();
        let kinds: Vec<_> = qz
            .entries()
            .iter()
            .map(|(n, e)| {
                let k = match e {
                    Entry::Quant(_) => "q".to_string(),
                    Entry::Passthrough { stored, .. } => format!("p:{}", stored.dtype.as_str()),
                    Entry::Raw(r) => format!("r:{}", r.dtype.as_str()),
                };
                (n.as_str(), k)
            })
            .collect();
        let want = [
            ("blocks.0.mlp.fc.weight", "q"),
            ("big.weight", "q"),
            ("stack", "q"),
            ("blocks.0.attn_scale", "p:f32"),
            ("blocks.0.resid_mix", "p:f32"),
            ("norm.small", "p:f16"),
            ("half", "p:f16"),
            ("wide", "p:f64"),
            ("steps", "r:u32"),
            ("ids", "r:i64"),
        ];
        assert_eq!(kinds, want.map(|(n, k)| (n, k.to_string())));
        let out = qz.dequantize(None, &Device::Cpu).unwrap();
        for ((name, orig), (name2, back)) in st.iter().zip(&out) {
            assert_eq!(name, name2);
            assert_eq!(orig.dtype(), back.dtype(), "{name}");
            assert_eq!(orig.dims(), back.dims(), "{name}");
        }
        // Control tensors bit-exact (f32, and bf16 through f32); f16 and f64 kept as they are.
        for i in [3, 4, 6, 7] {
            let (a, b) = (raw_tensor(&st[i].1).unwrap().bytes, raw_tensor(&out[i].1).unwrap().bytes);
            assert_eq!(a, b, "{}", st[i].0);
        }
        // Small others: f32 -> f16 -> f32.
        let want: Vec<f32> = f32_values(&st[5].1).iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(f32_values(&out[5].1), want);
        assert_ne!(f32_values(&st[5].1), want, "f16 rounding is visible");
        // Non-float tensors unchanged.
        assert_eq!(out[8].1.to_vec1::<u32>().unwrap(), [3, 1, 4, 1, 5]);
        assert_eq!(out[9].1.to_vec1::<i64>().unwrap(), [-3, 1 << 40]);
        // The size threshold: 65,536 elements stay float, 65,537 are quantized.
        let at = Tensor::ones(65_536, DType::F32, &Device::Cpu).unwrap();
        let over = Tensor::ones(65_537, DType::F32, &Device::Cpu).unwrap();
        let qz = quantize(&[("at".into(), at), ("over".into(), over)], &cfg(8)).unwrap();
        assert!(matches!(qz.get("at"), Some(Entry::Passthrough { stored, .. }) if stored.dtype == DType::F16));
        assert!(matches!(qz.get("over"), Some(Entry::Quant(_))));
        // Dtype override.
        let out = quantize(&st, &cfg(8)).unwrap().dequantize(Some(DType::F32), &Device::Cpu).unwrap();
        assert!(out.iter().all(|(_, t)| t.dtype() == DType::F32 || !t.dtype().is_float()));
        assert_eq!(out[8].1.dtype(), DType::U32);
    }

    #[test]
    fn dequantization_error_is_half_a_step() {
        let mut rng = fastrand::Rng::with_seed(3);
        let (rows, cols) = (96, 1024);
        // Rows of very different magnitudes (floor and no floor), a few outliers that get clipped.
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| {
                let r = i / cols;
                let mag = [0.02, 0.3, 4.0, 60.0][r % 4];
                let v = (rng.f32() * 2.0 - 1.0) * mag;
                if rng.u32(..5000) == 0 { v * 40.0 } else { v }
            })
            .collect();
        let t = Tensor::from_vec(data.clone(), (rows, cols), &Device::Cpu).unwrap();
        for bits in [8u8, 6] {
            let qmax = qmax(bits).unwrap();
            let qz = quantize(&[("w".into(), t.clone())], &cfg(bits)).unwrap();
            let back = f32_values(&qz.dequantize(None, &Device::Cpu).unwrap()[0].1);
            let Some(Entry::Quant(qt)) = qz.get("w") else { panic!() };
            let Scales::PerRow(s16) = &qt.scales else { panic!() };
            let (mut checked, mut clipped) = (0, 0);
            for r in 0..rows {
                let row = &data[r * cols..(r + 1) * cols];
                let c = quantile_linear(&mut row.iter().map(|v| v.abs()).collect::<Vec<_>>(), CLIP_QUANTILE);
                let s32 = row_scale(c, qmax);
                let s = s16[r].to_f32();
                for (j, &w) in row.iter().enumerate() {
                    let k = r * cols + j;
                    if w.abs() > c || w.abs() > s32 * qmax as f32 {
                        clipped += 1;
                        continue;
                    }
                    // Half a step of the f32 scale used for rounding, plus the fp16 rounding of
                    // the stored scale (|q| * |s16 - s32|), plus f32 rounding.
                    let bound = s32 / 2.0 + (qt.q[k] as f32).abs() * (s - s32).abs() + 1e-6 * w.abs().max(s);
                    let err = (back[k] - w).abs();
                    assert!(err <= bound, "bits {bits} row {r} col {j}: w {w} back {} err {err} > {bound}", back[k]);
                    checked += 1;
                }
            }
            assert!(checked > rows * cols * 9 / 10 && clipped > 0, "{checked} {clipped}");
        }
    }

    #[test]
    fn byte_round_trip_for_each_codec() {
        let st = mixed_state();
        for bits in [8, 6] {
            let qz = quantize(&st, &cfg(bits)).unwrap();
            let want = qz.dequantize(None, &Device::Cpu).unwrap();
            for codec in Codec::ALL {
                let level = if codec == Codec::Zstd { Some(3) } else { None };
                let art = qz.compress(codec, level).unwrap();
                assert_eq!(art.stats.compressed_bytes, art.bytes.len() as u64);
                assert_eq!(art.stats.level, codec.resolve_level(level).unwrap());
                assert_eq!(art.bytes[5], codec.id());
                let back = from_bytes(&art.bytes).unwrap();
                assert_eq!(back, qz, "{codec}");
                let got = back.dequantize(None, &Device::Cpu).unwrap();
                for ((n, a), (m, b)) in want.iter().zip(&got) {
                    assert_eq!(n, m);
                    assert_eq!((a.dtype(), a.dims()), (b.dtype(), b.dims()), "{codec} {n}");
                    assert_eq!(raw_tensor(a).unwrap().bytes, raw_tensor(b).unwrap().bytes, "{codec} {n}");
                }
                // Deterministic.
                assert_eq!(qz.to_bytes(codec, level).unwrap(), art.bytes);
            }
        }
    }

    #[test]
    fn bad_bytes_are_errors() {
        let qz = quantize(&mixed_state(), &cfg(8)).unwrap();
        let mut rng = fastrand::Rng::with_seed(11);
        for codec in Codec::ALL {
            let good = qz.to_bytes(codec, Some(1)).unwrap();
            let n = good.len();
            for cut in [0, 3, 4, HEADER_LEN - 1, HEADER_LEN, HEADER_LEN + 1, n / 2, n - 1] {
                let err = from_bytes(&good[..cut]).unwrap_err();
                assert!(format!("{err:#}").contains("truncated"), "{codec} cut {cut}: {err:#}");
            }
            let mut longer = good.clone();
            longer.push(0);
            assert!(from_bytes(&longer).is_err());
            // A corrupted body: decompression fails or the checksum does not match, unless the
            // flipped bit is one the decoder ignores (padding), and then the container is intact.
            for _ in 0..20 {
                let mut bad = good.clone();
                let at = rng.usize(HEADER_LEN..n);
                bad[at] ^= 1 << rng.u32(..8);
                if let Ok(back) = from_bytes(&bad) {
                    assert_eq!(back, qz, "{codec} flip at {at}");
                }
            }
            // A flipped bit in the stored checksum.
            let mut bad = good.clone();
            bad[30] ^= 4;
            assert!(format!("{:#}", from_bytes(&bad).unwrap_err()).contains("checksum"));
            // A valid header on a random body.
            let mut bad = good[..HEADER_LEN].to_vec();
            bad.extend((0..n - HEADER_LEN).map(|_| rng.u8(..)));
            assert!(from_bytes(&bad).is_err());
        }
        // Random bytes, other formats, other versions, unknown codecs.
        for len in [0, 1, 33, 34, 100, 5000] {
            let junk: Vec<u8> = (0..len).map(|_| rng.u8(..)).collect();
            assert!(from_bytes(&junk).is_err());
        }
        let good = qz.to_bytes(Codec::Zlib, None).unwrap();
        let e = |mut b: Vec<u8>, at: usize, v: u8| {
            b[at] = v;
            format!("{:#}", from_bytes(&b).unwrap_err())
        };
        assert!(e(good.clone(), 0, b'X').contains("not a quantized model artifact"));
        assert!(e(good.clone(), 4, 2).contains("version 2"));
        assert!(e(good.clone(), 5, 9).contains("unknown codec id 9"));
        assert!(from_bytes(&qz.serialize().unwrap()).is_err());
        // Containers that do not match their manifest: a tensor missing, a tensor too many.
        let mut first = qz.clone();
        first.entries.truncate(1);
        let (small, full) = (first.serialize().unwrap(), qz.serialize().unwrap());
        assert!(parse_body(&small).is_ok());
        let forge = |tensors_of: &[u8], manifest_of: &[u8]| {
            let (_, meta) = SafeTensors::read_metadata(manifest_of).unwrap();
            let st = SafeTensors::deserialize(tensors_of).unwrap();
            let body = safetensors::serialize(st.tensors(), meta.metadata().clone()).unwrap();
            format!("{:#}", parse_body(&body).unwrap_err())
        };
        let err = forge(&small, &full);
        assert!(err.contains("big.weight") && err.contains("not found"), "{err}");
        let err = forge(&full, &small);
        assert!(err.contains("holds 13 tensors, its manifest accounts for 2"), "{err}");
    }

    #[test]
    fn quantize_errors_name_the_tensor() {
        let dev = Device::Cpu;
        let mut v = vec![0.5f32; 70_000];
        v[123] = f32::INFINITY;
        let t = Tensor::from_vec(v, (700, 100), &dev).unwrap();
        let err = format!("{:#}", quantize(&[("blocks.3.attn.c_q.weight".into(), t)], &cfg(8)).unwrap_err());
        assert!(err.contains("blocks.3.attn.c_q.weight") && err.contains("element 123"), "{err}");
        let t = Tensor::ones(3, DType::F32, &dev).unwrap();
        let err = quantize(&[("a".into(), t.clone()), ("a".into(), t.clone())], &cfg(8)).unwrap_err();
        assert!(err.to_string().contains("`a` appears twice"));
        assert!(quantize(&[], &cfg(9)).is_err());
        assert!(quantize(&[], &QuantConfig { level: Some(12), ..Default::default() }).is_err());
    }

    #[test]
    fn baseline_payload_follows_the_spec() {
        let model = Gpt::new(&ModelConfig::default(), 1337, DType::F32, &Device::Cpu).unwrap();
        let st = model.state_dict();
        let qz = quantize(&st, &QuantConfig::default()).unwrap();
        let mut want = 0u64;
        for (name, t) in &st {
            let dims = t.dims();
            let n = t.elem_count() as u64;
            want += if t.elem_count() > PASSTHROUGH_MAX_NUMEL {
                assert_eq!(dims.len(), 2, "{name}");
                n + 2 * dims[0] as u64 // int8 values + fp16 row scales
            } else if is_control(name) {
                4 * n // fp32 passthrough
            } else {
                2 * n // fp16 passthrough
            };
        }
        let s = qz.stats();
        assert_eq!(s.payload_bytes, want);
        // Spec 3.10: 17,178,912 bytes for the baseline; embedding + 54 block matrices quantized.
        assert_eq!(s.payload_bytes, 17_178_912);
        assert_eq!(s.quantized, 1 + 9 * 6);
        assert_eq!(s.passthrough, st.len() - 55);
        assert_eq!(s.raw, 0);
        // The stored payload is what the container holds.
        let body = qz.serialize().unwrap();
        assert!(body.len() as u64 > s.payload_bytes && (body.len() as u64) < s.payload_bytes + 64 * 1024);
    }

    #[test]
    fn int6_values_stay_in_range() {
        let st = mixed_state();
        let qz = quantize(&st, &cfg(6)).unwrap();
        assert_eq!(qz.bits(), 6);
        let mut hit = false;
        for (_, e) in qz.entries() {
            if let Entry::Quant(t) = e {
                assert!(t.q.iter().all(|v| (-31..=31).contains(v)));
                hit |= t.q.iter().any(|&v| v.abs() == 31);
                if let Scales::PerRow(s) = &t.scales {
                    assert!(s.iter().all(|v| v.to_f32() >= f16::from_f32(1.0 / 31.0).to_f32()));
                }
            }
        }
        assert!(hit);
        // A stored int6 artifact with a value out of range is rejected.
        let mut bad = qz.clone();
        if let Entry::Quant(t) = &mut bad.entries[0].1 {
            t.q[5] = 40;
        }
        let err = format!("{:#}", from_bytes(&bad.to_bytes(Codec::Zlib, Some(1)).unwrap()).unwrap_err());
        assert!(err.contains("outside ±31") && err.contains("blocks.0.mlp.fc.weight"), "{err}");
    }

    #[test]
    fn config_serde() {
        let c: QuantConfig = toml::from_str("bits = 6\ncodec = \"brotli\"").unwrap();
        assert_eq!(c, QuantConfig { bits: 6, codec: Codec::Brotli, level: None });
        let c: QuantConfig = toml::from_str("").unwrap();
        assert_eq!(c, QuantConfig::default());
        assert!(toml::from_str::<QuantConfig>("codec = \"Zstd\"").is_err());
        assert!(toml::from_str::<QuantConfig>("bitz = 6").is_err());
        assert_eq!(serde_json::to_string(&Codec::Zstd).unwrap(), "\"zstd\"");
        assert_eq!("brotli".parse::<Codec>().unwrap(), Codec::Brotli);
    }

    /// Sizes of the baseline model at initialisation, per codec and width:
    /// `cargo test --release --lib quant::tests::baseline_sizes -- --ignored --nocapture`.
    #[test]
    #[ignore = "slow: compresses 17 MB with every codec at its strongest level"]
    fn baseline_sizes() {
        let model = Gpt::new(&ModelConfig::default(), 1337, DType::F32, &Device::Cpu).unwrap();
        let st = model.state_dict();
        for bits in [8, 6] {
            let t0 = std::time::Instant::now();
            let qz = quantize(&st, &cfg(bits)).unwrap();
            println!("bits {bits}: quantized in {:?}, payload {} bytes", t0.elapsed(), qz.payload_bytes());
            for codec in Codec::ALL {
                let t0 = std::time::Instant::now();
                let art = qz.compress(codec, None).unwrap();
                let packed = t0.elapsed();
                let t0 = std::time::Instant::now();
                let back = from_bytes(&art.bytes).unwrap();
                let unpacked = t0.elapsed();
                assert_eq!(back, qz);
                let s = art.stats;
                println!(
                    "  {codec:<6} level {:>2}: {:>10} bytes (serialized {}, fits cap with 50 kB code: {}), compress {packed:?}, read {unpacked:?}",
                    s.level,
                    s.compressed_bytes,
                    s.serialized_bytes,
                    s.fits_cap(50_000)
                );
            }
        }
    }
}
