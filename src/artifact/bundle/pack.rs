//! The bundle's bytes: a tar archive (ustar, so that `tar` anywhere unpacks it) of the stripped
//! files in path order, every header fixed (mode 0644, owner 0, time 0) so that the same files
//! give the same bytes on every machine, compressed with xz (preset 9, extreme), Brotli
//! (quality 11, 16 MiB window) and, where the `lrzip` program is installed, lrzip's ZPAQ back end
//! at level 9 (the 04-27 record's own compressor, which its artifact needs anyway): the smallest
//! is kept, `source.tar.xz`, `source.tar.br` or `source.tar.lrz`. On source text ZPAQ's context
//! mixing wins by about a sixth (the lean bundle: 174 KB against Brotli's 209 KB).

#[cfg(feature = "tools")]
use std::io::Read;
use std::io::Write;
#[cfg(feature = "tools")]
use std::path::Path;

use anyhow::{Context, Result};

/// How the archive is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// xz, preset 9 extreme (`tar xJf`).
    Xz,
    /// Brotli quality 11 (`brotli -d`, then `tar xf`).
    Brotli,
    /// lrzip's ZPAQ back end, level 9 (`lrzip -d`, then `tar xf`).
    Lrzip,
}

impl Codec {
    /// The bundle's file name with this codec.
    pub fn file_name(self) -> &'static str {
        match self {
            Codec::Xz => "source.tar.xz",
            Codec::Brotli => "source.tar.br",
            Codec::Lrzip => "source.tar.lrz",
        }
    }

    /// The codec a bundle's file name says.
    #[cfg(feature = "tools")]
    pub fn of_file(name: &str) -> Option<Codec> {
        [Codec::Xz, Codec::Brotli, Codec::Lrzip].into_iter().find(|c| c.file_name() == name)
    }
}

/// `files` (relative path, bytes), in the order given, as a deterministic tar archive.
pub fn archive(files: &[(String, Vec<u8>)]) -> Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, bytes) in files {
        let mut h = tar::Header::new_ustar();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o644);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(tar::EntryType::Regular);
        b.append_data(&mut h, path, &bytes[..]).with_context(|| format!("cannot archive {path}"))?;
    }
    Ok(b.into_inner()?)
}

/// The most an archive may expand to (a bundle is about a megabyte): a damaged lrzip header
/// that claims more is refused before anything is allocated.
#[cfg(feature = "tools")]
const MAX_ARCHIVE: u64 = 1 << 30;

/// `data` compressed every way; the smallest, with its codec. lrzip is tried where it is
/// installed ([`crate::artifact::lrzip::Lrzip::locate`]); without it, xz or Brotli.
pub fn compress(data: &[u8]) -> Result<(Codec, Vec<u8>)> {
    let lrz = match crate::artifact::lrzip::Lrzip::locate() {
        Ok(l) => Some(l.compress(data, 9, "the source archive")?),
        Err(_) => None,
    };
    smallest(data, lrz)
}

/// The smallest of xz's, Brotli's and (when given) lrzip's compression of `data`; ties go to
/// the codec `tar` reads without another program (xz, then Brotli).
fn smallest(data: &[u8], lrz: Option<Vec<u8>>) -> Result<(Codec, Vec<u8>)> {
    let mut xz = Vec::new();
    {
        let mut w = liblzma::write::XzEncoder::new(&mut xz, 9 | liblzma::stream::PRESET_EXTREME);
        w.write_all(data)?;
        w.finish()?;
    }
    let params = brotli::enc::BrotliEncoderParams { quality: 11, lgwin: 24, ..Default::default() };
    let mut br = Vec::new();
    brotli::BrotliCompress(&mut &data[..], &mut br, &params).context("brotli compression of the sources failed")?;
    let mut best = if xz.len() <= br.len() { (Codec::Xz, xz) } else { (Codec::Brotli, br) };
    if let Some(l) = lrz.filter(|l| l.len() < best.1.len()) {
        best = (Codec::Lrzip, l);
    }
    Ok(best)
}

/// The archive inside a compressed bundle.
#[cfg(feature = "tools")]
pub fn decompress(codec: Codec, bytes: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    match codec {
        Codec::Xz => liblzma::read::XzDecoder::new(bytes).read_to_end(&mut out).map(drop),
        Codec::Brotli => brotli::Decompressor::new(bytes, 1 << 16).read_to_end(&mut out).map(drop),
        Codec::Lrzip => return lrzip_archive(bytes),
    }
    .with_context(|| format!("not a {} stream", codec.file_name()))?;
    Ok(out)
}

/// The archive inside an lrzip bundle: the size its header states (bytes 6 to 14), at most
/// [`MAX_ARCHIVE`], is the size lrzip must give back.
#[cfg(feature = "tools")]
fn lrzip_archive(bytes: &[u8]) -> Result<Vec<u8>> {
    let name = Codec::Lrzip.file_name();
    let said = bytes.get(6..14).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let len = said.filter(|&n| n <= MAX_ARCHIVE).with_context(|| format!("not a {name} stream (no lrzip header of a sane size)"))?;
    let l = crate::artifact::lrzip::Lrzip::locate().with_context(|| format!("{name} needs the lrzip program to unpack"))?;
    l.decompress(bytes, len as usize, name)
}

/// The files of an archive: paths and bytes, in order. A path that leaves the folder (absolute,
/// or with `..`) or an entry that is not a regular file is refused.
#[cfg(feature = "tools")]
pub fn entries(archive: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let mut a = tar::Archive::new(archive);
    let mut out = Vec::new();
    for e in a.entries().context("not a tar archive")? {
        let mut e = e.context("a damaged tar entry")?;
        let path = e.path().context("an entry without a path")?.into_owned();
        anyhow::ensure!(
            path.components().all(|c| matches!(c, std::path::Component::Normal(_))),
            "the entry {} leaves the folder",
            path.display()
        );
        anyhow::ensure!(e.header().entry_type() == tar::EntryType::Regular, "the entry {} is not a file", path.display());
        let mut bytes = Vec::new();
        e.read_to_end(&mut bytes).with_context(|| format!("cannot read the entry {}", path.display()))?;
        out.push((path.to_string_lossy().into_owned(), bytes));
    }
    Ok(out)
}

/// Writes an archive's files under `dir` (which must be empty or missing).
#[cfg(feature = "tools")]
pub fn unpack(archive: &[u8], dir: &Path) -> Result<usize> {
    if dir.exists() {
        anyhow::ensure!(std::fs::read_dir(dir)?.next().is_none(), "{} is not empty", dir.display());
    }
    let files = entries(archive)?;
    for (rel, bytes) in &files {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        }
        std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(files.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_archive_round_trips_and_is_the_same_every_time() {
        let files = vec![("Cargo.toml".to_string(), b"[package]\n".to_vec()), ("src/lib.rs".to_string(), b"fn f() {}\n".repeat(300))];
        let a = archive(&files).unwrap();
        assert_eq!(archive(&files).unwrap(), a);
        let (codec, packed) = compress(&a).unwrap();
        assert!(packed.len() < a.len() / 4, "{} of {}", packed.len(), a.len());
        assert_eq!(entries(&decompress(codec, &packed).unwrap()).unwrap(), files);
        let dir = std::env::temp_dir().join(format!("pipeline-pack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(unpack(&a, &dir).unwrap(), 2);
        assert_eq!(std::fs::read(dir.join("src/lib.rs")).unwrap(), files[1].1);
        assert!(unpack(&a, &dir).unwrap_err().to_string().contains("not empty"));
        std::fs::remove_dir_all(&dir).unwrap();
        // Damaged bytes are an error, not a panic.
        assert!(decompress(codec, &packed[..packed.len() / 2]).is_err());
        assert!(entries(&a[..700]).is_err());
    }

    /// The smallest stream is kept (a tie goes to the codec `tar` reads alone), and an lrzip
    /// bundle unpacks, or is an error when damaged, never a huge allocation.
    #[test]
    fn the_smallest_codec_is_kept_and_an_lrzip_bundle_unpacks() {
        let files = vec![("src/lib.rs".to_string(), b"pub fn f(x: u32) -> u32 { x + 1 }\n".repeat(400))];
        let a = archive(&files).unwrap();
        let (c, p) = smallest(&a, None).unwrap();
        assert_ne!(c, Codec::Lrzip);
        assert_eq!(smallest(&a, Some(vec![0; p.len()])).unwrap(), (c, p.clone()));
        assert_eq!(smallest(&a, Some(vec![7; 3])).unwrap(), (Codec::Lrzip, vec![7; 3]));
        assert_eq!(Codec::of_file("source.tar.lrz"), Some(Codec::Lrzip));
        assert!(decompress(Codec::Lrzip, b"LRZI").unwrap_err().to_string().contains("sane size"));
        let Ok(l) = crate::artifact::lrzip::Lrzip::locate() else {
            eprintln!("skipped the lrzip round trip: no lrzip program (CI installs it)");
            return;
        };
        let lrz = l.compress(&a, 9, "the test archive").unwrap();
        assert_eq!(entries(&decompress(Codec::Lrzip, &lrz).unwrap()).unwrap(), files);
        let mut huge = lrz.clone();
        huge[6..14].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(decompress(Codec::Lrzip, &huge).unwrap_err().to_string().contains("sane size"));
        assert!(decompress(Codec::Lrzip, &lrz[..lrz.len() / 2]).is_err());
    }

    #[test]
    fn an_entry_that_leaves_the_folder_is_refused() {
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_entry_type(tar::EntryType::Regular);
        let name = b"../evil";
        h.as_old_mut().name[..name.len()].copy_from_slice(name);
        h.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&h, &b"x"[..]).unwrap();
        let a = b.into_inner().unwrap();
        assert!(entries(&a).unwrap_err().to_string().contains("leaves the folder"));
    }
}
