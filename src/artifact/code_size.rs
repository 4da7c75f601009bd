//! The code bytes the challenge counts against its 16,000,000-byte cap (spec section 0: code
//! bytes + compressed model bytes). The records count their one training script, shipped as an
//! LZMA + base85 self-extracting wrapper (16,630 bytes for the 04-09 record). Our code is this
//! crate, so we count what a submission would have to ship to rebuild the binary that trained
//! and scores the model: [`SOURCES`] (the manifest and lock file, the build script, `src/`,
//! `stages/` and the CUDA `kernels/`, tests inside `src/` included), packed as one archive and
//! compressed with Brotli at quality 11 (a self-extracting wrapper would add its few hundred
//! bytes of unpacking code). Configs, docs, scripts, benches and integration tests are not
//! counted: the run's TOML plays the part of the records' command-line settings, which the
//! challenge does not count either.
//!
//! The archive, in path order: for each file, its path relative to the crate root (UTF-8), a
//! zero byte, its length as u64 little-endian, its bytes. The same tree gives the same count
//! on every machine.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The parts of the crate counted as code (files, or folders taken whole).
pub const SOURCES: [&str; 6] = ["Cargo.toml", "Cargo.lock", "build.rs", "src", "stages", "kernels"];

/// The Brotli quality of the count.
const QUALITY: i32 = 11;

/// What [`measure`] found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CodeSize {
    /// The crate root measured.
    pub root: PathBuf,
    /// Files counted.
    pub files: usize,
    /// Their bytes.
    pub raw_bytes: u64,
    /// The archive's bytes after Brotli-11: the count against the cap.
    pub compressed_bytes: u64,
}

/// The crate root this binary was built from when it is still there, else the current
/// directory when it is this crate's root (a copy of the tree on another machine); `None`
/// when neither holds this crate.
pub fn locate() -> Option<PathBuf> {
    let is_ours = |dir: &Path| {
        std::fs::read_to_string(dir.join("Cargo.toml"))
            .map(|t| t.lines().any(|l| l.trim() == concat!("name = \"", env!("CARGO_PKG_NAME"), "\"")))
            .unwrap_or(false)
    };
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if is_ours(&built) {
        return Some(built);
    }
    std::env::current_dir().ok().filter(|d| is_ours(d))
}

/// Packs and compresses [`SOURCES`] under `root` (a missing entry is skipped: `kernels/` or
/// `build.rs` in a trimmed copy).
pub fn measure(root: &Path) -> Result<CodeSize> {
    let mut files = Vec::new();
    for part in SOURCES {
        collect(root, &root.join(part), &mut files)?;
    }
    files.sort();
    let mut archive = Vec::new();
    for rel in &files {
        let bytes = std::fs::read(root.join(rel)).with_context(|| format!("cannot read {}", root.join(rel).display()))?;
        archive.extend_from_slice(rel.as_bytes());
        archive.push(0);
        archive.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        archive.extend_from_slice(&bytes);
    }
    let raw_bytes = files.iter().map(|f| std::fs::metadata(root.join(f)).map(|m| m.len()).unwrap_or(0)).sum();
    let params = brotli::enc::BrotliEncoderParams { quality: QUALITY, lgwin: 24, ..Default::default() };
    let mut packed = Vec::new();
    brotli::BrotliCompress(&mut &archive[..], &mut packed, &params).context("brotli compression of the sources failed")?;
    Ok(CodeSize { root: root.to_path_buf(), files: files.len(), raw_bytes, compressed_bytes: packed.len() as u64 })
}

/// Adds the files at `path` (a file, or a folder walked whole) as `/`-separated paths relative
/// to `root`.
fn collect(root: &Path, path: &Path, out: &mut Vec<String>) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    if meta.is_dir() {
        for entry in std::fs::read_dir(path).with_context(|| format!("cannot list {}", path.display()))? {
            collect(root, &entry?.path(), out)?;
        }
    } else if meta.is_file() {
        let rel = path.strip_prefix(root).expect("under the root");
        out.push(rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_the_sources_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("pipeline-code-size-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("src/a")).unwrap();
        std::fs::create_dir_all(dir.join("docs")).unwrap();
        std::fs::write(dir.join("Cargo.toml"), "[package]\nname = \"x\"\n").unwrap();
        std::fs::write(dir.join("src/lib.rs"), "pub fn f() {}\n".repeat(200)).unwrap();
        std::fs::write(dir.join("src/a/b.rs"), "// b\n").unwrap();
        std::fs::write(dir.join("docs/big.md"), "x".repeat(100_000)).unwrap();
        let a = measure(&dir).unwrap();
        assert_eq!(a.files, 3);
        assert_eq!(a.raw_bytes, 21 + 14 * 200 + 5);
        assert!(a.compressed_bytes > 0 && a.compressed_bytes < a.raw_bytes, "{a:?}");
        // Deterministic, and docs do not count.
        std::fs::write(dir.join("docs/big.md"), "y").unwrap();
        assert_eq!(measure(&dir).unwrap(), a);
        // A source change changes the count.
        std::fs::write(dir.join("src/a/b.rs"), "// b, with more words in it than before\n").unwrap();
        assert!(measure(&dir).unwrap().compressed_bytes > a.compressed_bytes);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// This crate's own tree is found (tests run from it) and counts as hundreds of kilobytes.
    #[test]
    fn this_crate_is_found() {
        let root = locate().expect("the crate root");
        assert!(root.join("src/artifact/code_size.rs").is_file());
    }
}
