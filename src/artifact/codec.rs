//! The compressors of the artifact (zlib, zstd, Brotli, and `pergroup`, the 04-27 record's
//! per-group lrzip/ZPAQ compression in [`super::pergroup`]) and the byte shuffle the records
//! apply before Brotli (spec 4.5).
//!
//! The shuffle itself is [`super::shuffle`]'s (re-exported here).

use std::fmt;
use std::io::{Read, Write};
use std::ops::RangeInclusive;
use std::str::FromStr;

use anyhow::{Result, ensure};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use super::shuffle::{SHUFFLE_TAG, shuffle, unshuffle};

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
    /// The 04-27 record's per-group compression ([`super::pergroup`]): the int8 values of the
    /// embedding and of each role of block matrix (`attn.c_q`, `mlp.fc`, ...) grouped across
    /// the layers, the hot groups' rows similarity-sorted, every matrix column-major, each
    /// group through the `lrzip` program's ZPAQ back end; the rest byte-shuffled (with the
    /// artifact's `byte_shuffle`) and Brotli (quality 11, window 2^24). Levels 1..=9 are
    /// lrzip's `-L`, default 9. Needs `lrzip` (Debian/Ubuntu: `apt-get install lrzip`, or
    /// `LRZIP_BIN=/path/to/lrzip`); about a minute to compress the record's model, and
    /// about as long to decompress (groups in parallel), which counts against evaluation.
    Pergroup,
}

impl Codec {
    /// The codecs built into this binary (pure Rust): what needs nothing installed.
    #[cfg(feature = "tools")]
    pub const ALL: [Codec; 3] = [Codec::Zlib, Codec::Zstd, Codec::Brotli];

    /// Every codec: [`Codec::ALL`] and [`Codec::Pergroup`] (which runs `lrzip`).
    pub const EVERY: [Codec; 4] = [Codec::Zlib, Codec::Zstd, Codec::Brotli, Codec::Pergroup];

    /// Lower-case name, as in configs.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Zlib => "zlib",
            Codec::Zstd => "zstd",
            Codec::Brotli => "brotli",
            Codec::Pergroup => "pergroup",
        }
    }

    /// The strongest level: what `level = None` means.
    pub fn default_level(self) -> i32 {
        match self {
            Codec::Zlib => 9,
            Codec::Zstd => 22,
            Codec::Brotli => 11,
            Codec::Pergroup => *super::pergroup::LEVELS.end(),
        }
    }

    /// The levels this codec accepts.
    pub fn levels(self) -> RangeInclusive<i32> {
        match self {
            Codec::Zlib => 0..=9,
            Codec::Zstd => zstd::compression_level_range(),
            Codec::Brotli => 0..=11,
            Codec::Pergroup => super::pergroup::LEVELS,
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
            Codec::Pergroup => 4,
        }
    }

    pub(super) fn from_id(id: u8) -> Option<Self> {
        Codec::EVERY.into_iter().find(|c| c.id() == id)
    }

    /// Fails, saying what to install, when this codec needs a program that is missing (`lrzip`
    /// for `pergroup`); what a run checks before it trains.
    pub fn check_available(self) -> Result<()> {
        match self {
            Codec::Pergroup => super::pergroup::check_available(),
            _ => Ok(()),
        }
    }

    /// Compresses `data` at `level` (already checked by [`Codec::resolve_level`]). `pergroup`
    /// takes a safetensors container (the artifact's, unshuffled) and shuffles nothing here:
    /// the artifact's writer calls [`super::pergroup::pack`] with the stride.
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
            Codec::Pergroup => super::pergroup::pack(data, 0, level)?,
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
            Codec::Pergroup => out = super::pergroup::unpack(data)?,
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
        Codec::EVERY
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| anyhow::anyhow!("unknown codec `{s}` (zlib, zstd, brotli, pergroup)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pergroup_is_named_numbered_and_levelled() {
        assert_eq!("pergroup".parse::<Codec>().unwrap(), Codec::Pergroup);
        assert_eq!(serde_json::to_string(&Codec::Pergroup).unwrap(), "\"pergroup\"");
        assert_eq!(Codec::from_id(4), Some(Codec::Pergroup));
        assert_eq!(Codec::from_id(5), None);
        assert_eq!(Codec::Pergroup.resolve_level(None).unwrap(), 9);
        assert!(Codec::Pergroup.resolve_level(Some(0)).is_err() && Codec::Pergroup.resolve_level(Some(10)).is_err());
        for c in Codec::EVERY {
            assert_eq!((Codec::from_id(c.id()), c.name().parse::<Codec>().unwrap()), (Some(c), c));
        }
        // The built-in codecs need nothing installed.
        assert!(Codec::ALL.iter().all(|c| c.check_available().is_ok()));
        let err = "lrzip".parse::<Codec>().unwrap_err().to_string();
        assert!(err.contains("pergroup"), "{err}");
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
