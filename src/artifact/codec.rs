//! The compressors of the artifact (zlib, zstd, Brotli) and the byte shuffle the records apply
//! before Brotli (spec 4.5).
//!
//! Byte shuffle with stride `s`: the bytes at offsets `0, s, 2s, ...`, then those at `1, s + 1,
//! ...`, up to `s - 1`, prefixed with the tag [`SHUFFLE_TAG`] (`BSHF`) and one stride byte. With
//! stride 2 the low and the high bytes of every fp16 value end up in two separate runs, which the
//! compressor models better. [`unshuffle`] reverses it; a body without the tag is returned as it
//! is, so one reader takes both.

use std::fmt;
use std::io::{Read, Write};
use std::ops::RangeInclusive;
use std::str::FromStr;

use anyhow::{Result, ensure};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The tag in front of a shuffled body (then one byte: the stride).
pub const SHUFFLE_TAG: [u8; 4] = *b"BSHF";

/// `data` byte-shuffled with `stride` (2..=255), tag and stride byte first.
pub fn shuffle(data: &[u8], stride: u8) -> Result<Vec<u8>> {
    ensure!(stride >= 2, "byte shuffle stride {stride} must be at least 2 (0 or 1: no shuffle)");
    let s = stride as usize;
    let mut out = Vec::with_capacity(data.len() + SHUFFLE_TAG.len() + 1);
    out.extend_from_slice(&SHUFFLE_TAG);
    out.push(stride);
    for lane in 0..s {
        out.extend(data.iter().skip(lane).step_by(s));
    }
    Ok(out)
}

/// Reverses [`shuffle`] when `data` starts with [`SHUFFLE_TAG`]; otherwise gives `data` back.
pub fn unshuffle(data: Vec<u8>) -> Result<Vec<u8>> {
    if !data.starts_with(&SHUFFLE_TAG) {
        return Ok(data);
    }
    let at = SHUFFLE_TAG.len();
    ensure!(data.len() > at, "a shuffled body ends after its `BSHF` tag, before the stride byte");
    let s = data[at] as usize;
    ensure!(s >= 2, "a shuffled body gives stride {s} (at byte {at}); strides start at 2");
    let body = &data[at + 1..];
    let n = body.len();
    let mut out = vec![0u8; n];
    let mut src = body.iter();
    for lane in 0..s {
        for o in out.iter_mut().skip(lane).step_by(s) {
            *o = *src.next().expect("the lanes hold n bytes in all");
        }
    }
    Ok(out)
}

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

    pub(super) fn id(self) -> u8 {
        match self {
            Codec::Zlib => 1,
            Codec::Zstd => 2,
            Codec::Brotli => 3,
        }
    }

    pub(super) fn from_id(id: u8) -> Option<Self> {
        Codec::ALL.into_iter().find(|c| c.id() == id)
    }

    /// Compresses `data` at `level` (already checked by [`Codec::resolve_level`]).
    pub fn compress(self, data: &[u8], level: i32) -> Result<Vec<u8>> {
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
    pub fn decompress(self, data: &[u8], len: usize) -> Result<Vec<u8>> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_groups_lanes_and_round_trips() {
        let data = [1u8, 2, 3, 4, 5, 6, 7];
        let s = shuffle(&data, 2).unwrap();
        assert_eq!(&s[..5], b"BSHF\x02");
        assert_eq!(&s[5..], [1, 3, 5, 7, 2, 4, 6]);
        assert_eq!(shuffle(&data, 3).unwrap()[5..], [1, 4, 7, 2, 5, 3, 6]);
        let mut rng = fastrand::Rng::with_seed(5);
        for n in [0usize, 1, 2, 3, 17, 1000, 4097] {
            let data: Vec<u8> = (0..n).map(|_| rng.u8(..)).collect();
            for stride in [2u8, 3, 4, 7, 255] {
                assert_eq!(unshuffle(shuffle(&data, stride).unwrap()).unwrap(), data, "n {n} stride {stride}");
            }
        }
        // Without the tag, the body is left as it is.
        assert_eq!(unshuffle(vec![9, 8, 7]).unwrap(), [9, 8, 7]);
        assert!(shuffle(&data, 1).is_err() && shuffle(&data, 0).is_err());
        let err = unshuffle(b"BSHF".to_vec()).unwrap_err().to_string();
        assert!(err.contains("stride byte"), "{err}");
        let err = unshuffle(b"BSHF\x01abc".to_vec()).unwrap_err().to_string();
        assert!(err.contains("byte 4"), "{err}");
    }

    /// The shuffle helps the compressor on fp16 data, which it is there for.
    #[test]
    fn shuffle_helps_brotli_on_fp16() {
        let mut rng = fastrand::Rng::with_seed(9);
        let data: Vec<u8> = (0..20_000).flat_map(|_| half::f16::from_f32((rng.f32() - 0.5) * 0.05).to_le_bytes()).collect();
        let plain = Codec::Brotli.compress(&data, 9).unwrap().len();
        let shuffled = Codec::Brotli.compress(&shuffle(&data, 2).unwrap(), 9).unwrap().len();
        assert!(shuffled < plain, "shuffled {shuffled} >= plain {plain}");
    }

    #[test]
    fn every_codec_round_trips_and_refuses_a_wrong_length() {
        let mut rng = fastrand::Rng::with_seed(3);
        let data: Vec<u8> = (0..50_000).map(|i| if i % 3 == 0 { rng.u8(..16) } else { (i % 251) as u8 }).collect();
        for codec in Codec::ALL {
            let level = if codec == Codec::Zstd { 3 } else { codec.default_level() };
            let packed = codec.compress(&data, level).unwrap();
            assert!(packed.len() < data.len(), "{codec}");
            assert_eq!(codec.decompress(&packed, data.len()).unwrap(), data, "{codec}");
            assert!(codec.decompress(&packed, data.len() - 1).is_err(), "{codec}");
            assert!(codec.decompress(&packed, data.len() + 1).is_err(), "{codec}");
        }
    }
}
