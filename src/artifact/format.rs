//! The artifact's format: the bytes [`Quantized::to_bytes`] writes and [`from_bytes`] reads
//! back, checked field by field. What the tensors hold (the quantization scheme) is
//! [`super::quant`]'s.
//!
//! # Format (version [`FORMAT_VERSION`]; versions 1 and 2 are read too)
//!
//! [`Quantized::to_bytes`] writes a 34-byte header followed by the compressed body:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic [`MAGIC`] (`PGQZ`) |
//! | 4 | 1 | format version ([`FORMAT_VERSION`]) |
//! | 5 | 1 | codec: 1 zlib, 2 zstd, 3 brotli, 4 pergroup ([`super::pergroup`]) |
//! | 6 | 4 | compression level, i32 little-endian (informational) |
//! | 10 | 8 | body length before compression, u64 LE |
//! | 18 | 8 | body length after compression, u64 LE (the bytes after the header) |
//! | 26 | 8 | first 8 bytes of the SHA-256 of the uncompressed body |
//!
//! The uncompressed body is the container, or, with a byte shuffle, `BSHF`, the stride byte and
//! the shuffled container ([`super::codec::shuffle`]); with `pergroup`, always the container
//! (the codec shuffles what it sends to Brotli itself). The container is a safetensors file
//! (readable by Python's `safetensors`), little-endian tensors:
//! - `NAME.q` (`I8`, the tensor's shape) and `NAME.scale` (`F16 [rows]` per row, `F32 []` per
//!   tensor) for quantized tensors;
//! - `NAME.passthrough` (stored dtype, the tensor's shape) for kept float tensors;
//! - `NAME.raw` (own dtype and shape) for non-float tensors;
//! - with an LQER correction ([`super::quant::lqer`]), also `NAME.lqer_a` (`I8 [rows, r]`),
//!   `NAME.lqer_a_scale` (`F16 [groups]`), `NAME.lqer_b` (`I8 [r, cols]`) and
//!   `NAME.lqer_b_scale` (`F16 [groups]`);
//! - `__metadata__` has one key, `pipeline.quant`, a JSON manifest:
//!   `{"format": "pipeline-quant", "version": 3, "bits": 6, "tensors": [{"name", "kind"
//!   ("per_row" | "per_tensor" | "passthrough" | "raw"), "dtype" (original, candle's name such
//!   as "bf16"), "shape", "bits" (quantized tensors), "lqer" (corrected matrices: `{"a_group",
//!   "a_levels": [lo, hi], "b_group", "b_levels"}`, values per fp16 scale and the levels of each
//!   factor)}, ...], "info": {...}}` in state-dict order; `info` is the writer's (the
//!   quantizer's settings, the model's `[model]` table), not needed to dequantize. Version 1 had
//!   no per-tensor `bits` and no `info`; version 2 no `lqer`.
//!
//! [`from_bytes`] checks every field (magic, version, codec, lengths, checksum, manifest, names,
//! dtypes, shapes, value range) and fails with an error that says what is wrong and where (the
//! tensor, or the byte offset).
//!

use std::collections::{HashMap, HashSet};
use std::str::FromStr;

use anyhow::{Context, Result, bail, ensure};
use candle_core::DType;
use half::f16;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::codec::{Codec, shuffle, unshuffle};
use super::quant::lqer::{Factor, Lqer};
use super::quant::*;

/// First four bytes of every artifact.
pub const MAGIC: [u8; 4] = *b"PGQZ";

/// Version of the artifact format (header and manifest).
pub const FORMAT_VERSION: u8 = 3;

/// Bytes before the compressed body.
pub const HEADER_LEN: usize = 34;

const MANIFEST_KEY: &str = "pipeline.quant";
const MANIFEST_FORMAT: &str = "pipeline-quant";

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
    #[serde(default, skip_serializing_if = "Option::is_none")]
    info: Option<serde_json::Value>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ManifestEntry {
    name: String,
    kind: Kind,
    dtype: String,
    shape: Vec<usize>,
    /// Quantized tensors' width (version 2; version 1: the manifest's `bits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bits: Option<u8>,
    /// The LQER correction's layout (version 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    lqer: Option<LqerLayout>,
}

/// How an LQER correction's two factors are stored: values per fp16 scale, and the levels.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LqerLayout {
    a_group: usize,
    a_levels: [i8; 2],
    b_group: usize,
    b_levels: [i8; 2],
}

fn checksum(body: &[u8]) -> [u8; 8] {
    let digest = Sha256::digest(body);
    let mut out = [0u8; 8];
    out.copy_from_slice(&digest[..8]);
    out
}

impl Quantized {
    /// The uncompressed body: a safetensors file with the manifest (module documentation).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let mut blobs: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::with_capacity(2 * self.entries.len());
        let mut manifest = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: FORMAT_VERSION.into(),
            bits: self.bits,
            tensors: Vec::new(),
            info: self.info.clone(),
        };
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
            let bits = match e {
                Entry::Quant(t) => Some(t.bits),
                _ => None,
            };
            let lqer = match e {
                Entry::Quant(QuantTensor { lqer: Some(l), .. }) => {
                    for (suffix, f) in [("lqer_a", &l.a), ("lqer_b", &l.b)] {
                        blobs.push((format!("{name}.{suffix}"), StDtype::I8, f.shape.to_vec(), f.q.iter().map(|&v| v as u8).collect()));
                        let bytes = f.scales.iter().flat_map(|v| v.to_le_bytes()).collect();
                        blobs.push((format!("{name}.{suffix}_scale"), StDtype::F16, vec![f.scales.len()], bytes));
                    }
                    Some(LqerLayout { a_group: l.a.group, a_levels: [l.a.lo, l.a.hi], b_group: l.b.group, b_levels: [l.b.lo, l.b.hi] })
                }
                _ => None,
            };
            manifest.tensors.push(ManifestEntry {
                name: name.clone(),
                kind,
                dtype: e.dtype().as_str().into(),
                shape: e.shape().to_vec(),
                bits,
                lqer,
            });
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

    /// Serializes, byte-shuffles with stride `shuffle_stride` (0: no shuffle) and compresses
    /// with `codec` at `level` (default: the codec's strongest).
    pub fn compress(&self, codec: Codec, level: Option<i32>, shuffle_stride: u8) -> Result<Artifact> {
        let level = codec.resolve_level(level)?;
        let container = self.serialize()?;
        let serialized_bytes = container.len() as u64;
        // `pergroup` takes the container as it is and shuffles its own remainder with the stride.
        let body = if shuffle_stride == 0 || codec == Codec::Pergroup { container } else { shuffle(&container, shuffle_stride)? };
        let packed = match codec {
            Codec::Pergroup => super::pergroup::pack(&body, shuffle_stride, level),
            _ => codec.compress(&body, level),
        }
        .with_context(|| format!("{codec} compression failed"))?;
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
        let stats =
            ArtifactStats { codec, level, payload_bytes: self.payload_bytes(), serialized_bytes, compressed_bytes: bytes.len() as u64 };
        Ok(Artifact { bytes, stats })
    }

    /// The compressed artifact ([`Quantized::compress`] without the sizes).
    #[cfg(feature = "tools")]
    pub fn to_bytes(&self, codec: Codec, level: Option<i32>, shuffle_stride: u8) -> Result<Vec<u8>> {
        Ok(self.compress(codec, level, shuffle_stride)?.bytes)
    }
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
    ensure!(
        (1..=FORMAT_VERSION).contains(&version),
        "artifact format version {version} (byte 4) is not supported (this build reads 1 to {FORMAT_VERSION})"
    );
    let codec = Codec::from_id(bytes[5]).ok_or_else(|| anyhow::anyhow!("unknown codec id {} in the artifact header (byte 5)", bytes[5]))?;
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let (body_len, packed_len) = (u64_at(10), u64_at(18));
    let packed = &bytes[HEADER_LEN..];
    ensure!(
        packed.len() as u64 == packed_len,
        "the artifact has {} bytes after its header, the header says {packed_len} (truncated or extended)",
        packed.len()
    );
    let body_len = usize::try_from(body_len).context("the body length in the header is too large")?;
    let body = codec
        .decompress(packed, body_len)
        .with_context(|| format!("cannot decompress the {codec} body (bytes {HEADER_LEN} to {})", bytes.len()))?;
    ensure!(checksum(&body) == bytes[26..34], "the body's checksum (header bytes 26 to 34) does not match the body (corrupted artifact)");
    let body = unshuffle(body).context("the body's byte shuffle is malformed")?;
    parse_body(&body).context("the artifact's container is malformed")
}

pub(super) fn parse_body(body: &[u8]) -> Result<Quantized> {
    let (_, meta) = SafeTensors::read_metadata(body)?;
    let manifest =
        meta.metadata().as_ref().and_then(|m| m.get(MANIFEST_KEY)).ok_or_else(|| anyhow::anyhow!("no `{MANIFEST_KEY}` manifest"))?;
    let manifest: Manifest = serde_json::from_str(manifest).context("the manifest is not valid")?;
    ensure!(manifest.format == MANIFEST_FORMAT, "the manifest's format is `{}`, expected `{MANIFEST_FORMAT}`", manifest.format);
    ensure!((1..=FORMAT_VERSION as u32).contains(&manifest.version), "manifest version {} is not supported", manifest.version);
    qmax(manifest.bits)?;
    let st = SafeTensors::deserialize(body)?;
    let mut used = 0usize;
    let mut seen = HashSet::new();
    let mut entries = Vec::with_capacity(manifest.tensors.len());
    for m in manifest.tensors {
        ensure!(seen.insert(m.name.clone()), "tensor `{}` is listed twice", m.name);
        let name = m.name.clone();
        let (entry, n) = parse_entry(&st, m, manifest.bits).with_context(|| format!("tensor `{name}`"))?;
        used += n;
        entries.push((name, entry));
    }
    if used != st.len() {
        // Name what the manifest does not account for: the stored tensors of no listed name.
        let mut extra: Vec<&str> =
            st.names().into_iter().filter(|n| n.rsplit_once('.').is_none_or(|(base, _)| !seen.contains(base))).collect();
        extra.sort_unstable();
        bail!("the container holds {} tensors, its manifest accounts for {used} (not listed: {})", st.len(), extra.join(", "));
    }
    Ok(Quantized { bits: manifest.bits, entries, info: manifest.info })
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

/// The two factors of an LQER correction of a `rows x cols` matrix, read and checked.
fn lqer_factors<'a>(get: &dyn Fn(&str) -> Result<TensorView<'a>>, layout: &LqerLayout, rows: usize, cols: usize) -> Result<Lqer> {
    let factor = |suffix: &str, group: usize, [lo, hi]: [i8; 2]| -> Result<Factor> {
        let v = get(suffix)?;
        ensure!(
            v.dtype() == StDtype::I8 && v.shape().len() == 2,
            "`{suffix}` has dtype {:?} and shape {:?}, expected a 2-D I8",
            v.dtype(),
            v.shape()
        );
        let s = get(&format!("{suffix}_scale"))?;
        ensure!(
            s.dtype() == StDtype::F16 && s.shape().len() == 1,
            "`{suffix}_scale` has dtype {:?} and shape {:?}, expected a 1-D F16",
            s.dtype(),
            s.shape()
        );
        Ok(Factor {
            shape: [v.shape()[0], v.shape()[1]],
            group,
            lo,
            hi,
            q: v.data().iter().map(|&b| b as i8).collect(),
            scales: s.data().chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect(),
        })
    };
    let l = Lqer { a: factor("lqer_a", layout.a_group, layout.a_levels)?, b: factor("lqer_b", layout.b_group, layout.b_levels)? };
    l.check(rows, cols)?;
    Ok(l)
}

/// One manifest entry: the entry and how many stored tensors it used.
fn parse_entry(st: &SafeTensors<'_>, m: ManifestEntry, default_bits: u8) -> Result<(Entry, usize)> {
    let dtype = DType::from_str(&m.dtype).map_err(|e| anyhow::anyhow!("{e}"))?;
    let get = |suffix: &str| stored_view(st, &m.name, suffix);
    Ok(match m.kind {
        Kind::PerRow | Kind::PerTensor => {
            ensure!(dtype.is_float(), "a quantized tensor must come from a float dtype, not {}", m.dtype);
            let bits = m.bits.unwrap_or(default_bits);
            let qmax = qmax(bits)?;
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
            let lqer = match &m.lqer {
                Some(layout) => {
                    let [rows, cols] = m.shape[..] else { bail!("an LQER correction needs a 2-D tensor, the shape is {:?}", m.shape) };
                    Some(lqer_factors(&get, layout, rows, cols).context("its LQER correction")?)
                }
                None => None,
            };
            let stored = if lqer.is_some() { 6 } else { 2 };
            (Entry::Quant(QuantTensor { shape: m.shape, dtype, bits, q, scales, lqer }), stored)
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
