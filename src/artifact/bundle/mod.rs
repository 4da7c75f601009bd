//! The source bundle: the code a submission ships and the challenge counts against its cap
//! (code bytes + compressed model bytes <= 16,000,000). The records ship their one training
//! script, minified and compressed; ours is the crate, so a run packs exactly the source files
//! its binary was compiled from ([`sources`]: cargo's dep-info, checked against build-time
//! digests), each stripped to what the compiler reads ([`strip`]: a parser for Rust, a lexer
//! for C, C++ and CUDA), archived and compressed ([`pack`]). The count is the compressed
//! file's size; `Cargo.lock` travels beside it uncounted, as the records' requirements.txt.
//!
//! A run writes its bundle into its run directory (`source.tar.xz` or `source.tar.br`, with
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
    for rel in &s.files {
        let path = s.root.join(rel);
        let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let kept = strip::file(rel, &bytes)?;
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

/// This binary's bundle, packed from its own sources.
pub fn of_this_binary() -> Result<(Bundle, Vec<u8>, Sources)> {
    let s = sources::of_this_binary()?;
    let (b, bytes) = make(&s)?;
    Ok((b, bytes, s))
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
