//! The bundle's bytes: a tar archive (ustar, so that `tar` anywhere unpacks it) of the stripped
//! files in path order, every header fixed (mode 0644, owner 0, time 0) so that the same files
//! give the same bytes on every machine, compressed with xz (preset 9, extreme) or Brotli
//! (quality 11, 16 MiB window), whichever is smaller: `source.tar.xz` or `source.tar.br`.

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{Context, Result};

/// How the archive is compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// xz, preset 9 extreme (`tar xJf`).
    Xz,
    /// Brotli quality 11 (`brotli -d`, then `tar xf`).
    Brotli,
}

impl Codec {
    /// The bundle's file name with this codec.
    pub fn file_name(self) -> &'static str {
        match self {
            Codec::Xz => "source.tar.xz",
            Codec::Brotli => "source.tar.br",
        }
    }

    /// The codec a bundle's file name says.
    pub fn of_file(name: &str) -> Option<Codec> {
        [Codec::Xz, Codec::Brotli].into_iter().find(|c| c.file_name() == name)
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

/// `data` compressed both ways; the smaller, with its codec.
pub fn compress(data: &[u8]) -> Result<(Codec, Vec<u8>)> {
    let mut xz = Vec::new();
    {
        let mut w = liblzma::write::XzEncoder::new(&mut xz, 9 | liblzma::stream::PRESET_EXTREME);
        w.write_all(data)?;
        w.finish()?;
    }
    let params = brotli::enc::BrotliEncoderParams { quality: 11, lgwin: 24, ..Default::default() };
    let mut br = Vec::new();
    brotli::BrotliCompress(&mut &data[..], &mut br, &params).context("brotli compression of the sources failed")?;
    Ok(if xz.len() <= br.len() { (Codec::Xz, xz) } else { (Codec::Brotli, br) })
}

/// The archive inside a compressed bundle.
pub fn decompress(codec: Codec, bytes: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    match codec {
        Codec::Xz => liblzma::read::XzDecoder::new(bytes).read_to_end(&mut out).map(drop),
        Codec::Brotli => brotli::Decompressor::new(bytes, 1 << 16).read_to_end(&mut out).map(drop),
    }
    .with_context(|| format!("not a {} stream", codec.file_name()))?;
    Ok(out)
}

/// The files of an archive: paths and bytes, in order. A path that leaves the folder (absolute,
/// or with `..`) or an entry that is not a regular file is refused.
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
