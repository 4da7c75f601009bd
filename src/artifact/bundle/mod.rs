//! The source bundle: the code a submission ships and the challenge counts against its cap
//! (code bytes + compressed model bytes <= 16,000,000). The records ship their one training
//! script, minified and compressed; ours is the crate, so a run packs exactly the source files
//! its binary was compiled from ([`sources`]: cargo's dep-info, checked against build-time
//! digests), each stripped to what the compiler reads ([`strip`]: a parser for Rust, a lexer
//! for C, C++ and CUDA), archived and compressed ([`pack`]). The count is the compressed
//! file's size; `Cargo.lock` travels beside it uncounted, as the records' requirements.txt.
//!
//! A run writes its bundle into its run directory (`source.tar.xz`, `.br` or `.lrz`, with
//! `Cargo.lock`); `pipeline submission` copies both into the records folder after checking
//! their digests, and `pipeline submission --verify` unpacks, builds and reruns them
//! (docs/submitting.md).

pub mod pack;
pub mod sources;
pub mod strip;

use std::path::Path;

use anyhow::{Context, Result};

pub use pack::Codec;
pub use sources::Sources;

use crate::runtime::build_info::{BuildInfo, SourceBundle};

/// What a bundle holds and weighs (defined with the build's description, which the reports
/// read).
pub type Bundle = SourceBundle;

/// Packs `s`: the bundle's description and its bytes.
pub fn make(s: &Sources) -> Result<(Bundle, Vec<u8>)> {
    let mut files = Vec::with_capacity(s.files.len());
    let (mut raw, mut stripped) = (0u64, 0u64);
    let features = BuildInfo::this().features;
    for rel in &s.files {
        let path = s.root.join(rel);
        let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let kept = strip::file(rel, &bytes, &features)?;
        raw += bytes.len() as u64;
        stripped += kept.len() as u64;
        files.push((rel.clone(), kept));
    }
    let (codec, packed) = pack::compress(&pack::archive(&files)?)?;
    let lock =
        std::fs::read(s.root.join(sources::LOCK)).with_context(|| format!("cannot read {}", s.root.join(sources::LOCK).display()))?;
    let b = Bundle {
        file: codec.file_name().into(),
        files: files.len(),
        raw_bytes: raw,
        stripped_bytes: stripped,
        bytes: packed.len() as u64,
        sha256: sources::sha256_hex(&packed),
        lock_sha256: sources::sha256_hex(&lock),
        build: BuildInfo::this(),
    };
    Ok((b, packed))
}

/// This binary's bundle, packed from its own sources. Packing takes seconds (Brotli-11 and xz
/// over a megabyte), so the result is kept beside the dep-info (`pipeline.d.bundle`) under a key
/// that names the files, their build-time digests and the build, and reused while the key
/// holds: the sources are still checked against the digests on every call, so a reused bundle
/// is the one these sources make.
pub fn of_this_binary() -> Result<(Bundle, Vec<u8>, Sources)> {
    let s = sources::of_this_binary()?;
    let digests = sources::built_digests();
    let mut key = format!("{}\n", BuildInfo::this().line());
    for f in &s.files {
        key.push_str(&format!("{}  {f}\n", digests.get(f.as_str()).copied().unwrap_or("")));
    }
    let key = sources::sha256_hex(key.as_bytes());
    let cache = s.depinfo.with_extension("d.bundle");
    if let Some((b, bytes)) = cached(&cache, &key, &s.root) {
        return Ok((b, bytes, s));
    }
    let (b, bytes) = make(&s)?;
    // Best effort: a binary in a read-only folder packs every time.
    if let Ok(meta) = serde_json::to_string(&b) {
        let mut file = format!("{key}\n{meta}\n").into_bytes();
        file.extend_from_slice(&bytes);
        let _ = crate::runtime::rundir::write_atomic(&cache, &file);
    }
    Ok((b, bytes, s))
}

/// The bundle kept at `path` under `key`, when it is there, whole, and the lock file is unchanged.
fn cached(path: &Path, key: &str, root: &Path) -> Option<(Bundle, Vec<u8>)> {
    let file = std::fs::read(path).ok()?;
    let mut parts = file.splitn(3, |&c| c == b'\n');
    let (k, meta, bytes) = (parts.next()?, parts.next()?, parts.next()?);
    let b: Bundle = serde_json::from_slice(meta).ok()?;
    let lock = std::fs::read(root.join(sources::LOCK)).ok()?;
    let whole = k == key.as_bytes()
        && sources::sha256_hex(bytes) == b.sha256
        && sources::sha256_hex(&lock) == b.lock_sha256
        && b.build == BuildInfo::this();
    whole.then(|| (b, bytes.to_vec()))
}

/// Writes the bundle and `Cargo.lock` into `dir`, each atomically.
pub fn write(dir: &Path, b: &Bundle, bytes: &[u8], root: &Path) -> Result<()> {
    crate::runtime::rundir::write_atomic(&dir.join(&b.file), bytes)?;
    let lock = std::fs::read(root.join(sources::LOCK)).with_context(|| format!("cannot read {}", root.join(sources::LOCK).display()))?;
    anyhow::ensure!(
        sources::sha256_hex(&lock) == b.lock_sha256,
        "{} changed while the bundle was made",
        root.join(sources::LOCK).display()
    );
    crate::runtime::rundir::write_atomic(&dir.join(sources::LOCK), &lock)
}

/// The bundle's and `Cargo.lock`'s bytes in `dir`, each checked against `b`'s digests (a file
/// that is missing, changed or cut short is an error naming it).
#[cfg(feature = "tools")]
pub fn read(dir: &Path, b: &Bundle) -> Result<(Vec<u8>, Vec<u8>)> {
    let get = |name: &str, want: &str| -> Result<Vec<u8>> {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let got = sources::sha256_hex(&bytes);
        anyhow::ensure!(
            got == want,
            "{}: SHA-256 {got} is not the {want} the run recorded (the file changed after the run)",
            path.display()
        );
        Ok(bytes)
    };
    Ok((get(&b.file, &b.sha256)?, get(sources::LOCK, &b.lock_sha256)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The second call reuses the first's bundle (the same bytes, no packing), and a damaged
    /// cache is packed again rather than trusted.
    #[test]
    fn this_binarys_bundle_is_packed_once() {
        let (b, bytes, s) = of_this_binary().unwrap();
        assert_eq!(b.bytes as usize, bytes.len());
        assert_eq!(sources::sha256_hex(&bytes), b.sha256);
        let cache = s.depinfo.with_extension("d.bundle");
        let t = std::time::Instant::now();
        let (again, bytes_again, _) = of_this_binary().unwrap();
        assert_eq!((again, bytes_again), (b.clone(), bytes.clone()));
        assert!(t.elapsed().as_secs_f64() < 2.0, "not reused: {:?}", t.elapsed());
        let mut file = std::fs::read(&cache).unwrap();
        let last = file.len() - 1;
        file[last] ^= 1;
        std::fs::write(&cache, &file).unwrap();
        let (fresh, fresh_bytes, _) = of_this_binary().unwrap();
        // The files unpack to the stripped sources: this file among them, without its tests.
        let files = pack::entries(&pack::decompress(Codec::of_file(&b.file).unwrap(), &bytes).unwrap()).unwrap();
        assert_eq!((fresh, fresh_bytes), (b, bytes));
        let me = files.iter().find(|(p, _)| p == "src/artifact/bundle/mod.rs").expect("this file is packed");
        let text = String::from_utf8_lossy(&me.1);
        assert!(text.contains("fn of_this_binary") && !text.contains("this_binarys_bundle_is_packed_once"), "{text}");
    }
}
