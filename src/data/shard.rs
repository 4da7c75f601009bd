//! The challenge's token shard format: reading, checking, writing.
//!
//! A shard is a 1024-byte header of 256 little-endian int32 (`[20240520, 1, num_tokens, 0...]`)
//! followed by `num_tokens` little-endian uint16 token ids; the file size must be exactly
//! `1024 + 2 * num_tokens`. [`ShardFile::open`] checks all of that and names the file and the
//! problem when anything is off. Tokens are then read either through a memory map
//! ([`Access::Mmap`]) or with positioned reads ([`Access::Pread`]); neither loads a whole shard.

use std::fs::File;
use std::io::Read;
#[cfg(feature = "tools")]
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::data::guarded_map::GuardedMap;

/// Magic number in the first header word.
pub const MAGIC: i32 = 20240520;
/// The only version there is.
pub const VERSION: i32 = 1;
/// Header size in bytes (256 int32).
pub const HEADER_BYTES: u64 = 1024;

/// With memory maps, the pages a set of shards may keep resident in the process: each shard
/// drops its pages (from the process, not from the page cache) after reading its share of this
/// budget, so sampling a large glob never makes the dataset resident.
pub const MMAP_RESIDENT_BUDGET: u64 = 64 << 20;

/// Smallest per-shard share of the budget (bounds the `madvise` rate with many shards).
const MIN_RELEASE_BYTES: u64 = 1 << 20;

/// What is wrong with a shard (or with reading one).
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// The file could not be opened or read.
    #[error("{}: cannot read: {error}", path.display())]
    Io {
        /// The shard.
        path: PathBuf,
        /// The I/O error.
        error: std::io::Error,
    },
    /// A symbolic link whose target does not exist.
    #[error("{}: is a symbolic link to {}, which does not exist", path.display(), target.display())]
    DanglingLink {
        /// The link.
        path: PathBuf,
        /// Where it points.
        target: PathBuf,
    },
    /// A directory, FIFO, socket or device where a shard file was expected (a FIFO would block
    /// the first read forever).
    #[error("{}: is {what}, not a shard file", path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is instead.
        what: &'static str,
    },
    /// The file is shorter than the header.
    #[error("{}: truncated: {len} bytes, shorter than the 1024-byte shard header", path.display())]
    ShortHeader {
        /// The shard.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// The magic number is wrong.
    #[error("{}: not a challenge-format shard: magic number {found}, expected {MAGIC}", path.display())]
    Magic {
        /// The shard.
        path: PathBuf,
        /// What the header holds.
        found: i32,
    },
    /// The version is not 1.
    #[error("{}: unsupported shard version {found}; this reader knows version {VERSION}", path.display())]
    Version {
        /// The shard.
        path: PathBuf,
        /// What the header holds.
        found: i32,
    },
    /// The header's token count is negative.
    #[error("{}: damaged header: negative token count {found}", path.display())]
    NegativeCount {
        /// The shard.
        path: PathBuf,
        /// What the header holds.
        found: i32,
    },
    /// The file size does not match the header's token count.
    #[error("{}: header says {tokens} tokens ({expected} bytes with the header) but the file has {actual} bytes ({})", path.display(), if actual < expected { "truncated" } else { "trailing bytes" })]
    SizeMismatch {
        /// The shard.
        path: PathBuf,
        /// Tokens the header claims.
        tokens: u64,
        /// Bytes that implies.
        expected: u64,
        /// Bytes the file has.
        actual: u64,
    },
    /// The shard holds no tokens.
    #[error("{}: holds 0 tokens", path.display())]
    Empty {
        /// The shard.
        path: PathBuf,
    },
    /// A token id is not below the tokenizer's vocabulary size.
    #[error("{}: token id {id} at token {position} is not below the tokenizer's vocabulary size {vocab} (shard and tokenizer do not match)", path.display())]
    TokenOutOfRange {
        /// The shard.
        path: PathBuf,
        /// Offending id.
        id: u16,
        /// Its position in the shard.
        position: u64,
        /// Vocabulary size.
        vocab: usize,
    },
    /// A read past the end of the shard (a bug in the caller).
    #[error("{}: read of {len} tokens at {start} past the end ({tokens} tokens)", path.display())]
    OutOfBounds {
        /// The shard.
        path: PathBuf,
        /// First token asked for.
        start: u64,
        /// Tokens asked for.
        len: u64,
        /// Tokens in the shard.
        tokens: u64,
    },
    /// A memory-mapped shard that shrank while the run read it (its pages past the new end
    /// read as zeros: see [`crate::data::guarded_map`]).
    #[error("{}: the file shrank while the run read it (now {now} bytes, {expected} when it was opened): shards must not change under a running job", path.display())]
    Shrunk {
        /// The shard.
        path: PathBuf,
        /// Its size now.
        now: u64,
        /// Its size when it was opened and checked.
        expected: u64,
    },
}

/// How a shard's tokens are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AccessMode {
    /// Memory-mapped (memmap2); reads are page faults in the reading thread.
    #[default]
    Mmap,
    /// Positioned reads (`pread`) into the caller's buffer; nothing is mapped.
    Pread,
}

enum Access {
    Mmap(GuardedMap),
    Pread(File),
}

/// An opened, checked shard.
pub struct ShardFile {
    /// Position of the shard in the sorted glob.
    pub index: usize,
    /// Its path.
    pub path: PathBuf,
    /// Number of tokens.
    pub tokens: u64,
    access: Access,
    touched: AtomicU64,
    release_bytes: u64,
}

impl std::fmt::Debug for ShardFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardFile").field("index", &self.index).field("path", &self.path).field("tokens", &self.tokens).finish()
    }
}

/// Reads and checks the header of `path`; returns the token count.
pub fn read_header(path: &Path) -> Result<(File, u64), ShardError> {
    let io = |source| ShardError::Io { path: path.to_path_buf(), error: source };
    let meta = std::fs::metadata(path).map_err(io)?;
    if let Some(what) = crate::runtime::files::not_regular(&meta.file_type()) {
        return Err(ShardError::NotAFile { path: path.to_path_buf(), what });
    }
    let mut file = File::open(path).map_err(io)?;
    let len = meta.len();
    if len < HEADER_BYTES {
        return Err(ShardError::ShortHeader { path: path.to_path_buf(), len });
    }
    let mut header = [0u8; HEADER_BYTES as usize];
    file.read_exact(&mut header).map_err(io)?;
    let word = |i: usize| i32::from_le_bytes([header[4 * i], header[4 * i + 1], header[4 * i + 2], header[4 * i + 3]]);
    if word(0) != MAGIC {
        return Err(ShardError::Magic { path: path.to_path_buf(), found: word(0) });
    }
    if word(1) != VERSION {
        return Err(ShardError::Version { path: path.to_path_buf(), found: word(1) });
    }
    if word(2) < 0 {
        return Err(ShardError::NegativeCount { path: path.to_path_buf(), found: word(2) });
    }
    let tokens = word(2) as u64;
    let expected = HEADER_BYTES + 2 * tokens;
    if len != expected {
        return Err(ShardError::SizeMismatch { path: path.to_path_buf(), tokens, expected, actual: len });
    }
    if tokens == 0 {
        return Err(ShardError::Empty { path: path.to_path_buf() });
    }
    Ok((file, tokens))
}

impl ShardFile {
    /// Opens and checks a shard.
    pub fn open(path: &Path, index: usize, mode: AccessMode) -> Result<Self, ShardError> {
        let (file, tokens) = read_header(path)?;
        let access = match mode {
            AccessMode::Pread => Access::Pread(file),
            AccessMode::Mmap => {
                // A shard rewritten under a running job shows wrong tokens (as with any reader);
                // one truncated under it reads zeros past its end, which `damaged` reports.
                let map = GuardedMap::map(&file).map_err(|source| ShardError::Io { path: path.to_path_buf(), error: source })?;
                let _ = map.inner().advise(memmap2::Advice::Random);
                Access::Mmap(map)
            }
        };
        Ok(Self { index, path: path.to_path_buf(), tokens, access, touched: AtomicU64::new(0), release_bytes: MMAP_RESIDENT_BUDGET })
    }

    /// Opens `paths` (indices 0..) as one set sharing [`MMAP_RESIDENT_BUDGET`].
    pub fn open_all(paths: &[PathBuf], mode: AccessMode) -> Result<Vec<std::sync::Arc<ShardFile>>, ShardError> {
        let indexed: Vec<(usize, &Path)> = paths.iter().enumerate().map(|(i, p)| (i, p.as_path())).collect();
        Self::open_set(&indexed, mode)
    }

    /// Every value of the shards `paths`, concatenated in order (the validation split, its
    /// byte sidecars), read with `pread`.
    pub fn read_concatenated(paths: &[PathBuf]) -> Result<Vec<u16>, ShardError> {
        let shards = Self::open_all(paths, AccessMode::Pread)?;
        let mut all: Vec<u16> = Vec::with_capacity(shards.iter().map(|s| s.tokens as usize).sum());
        for s in &shards {
            let start = all.len();
            all.resize(start + s.tokens as usize, 0);
            s.read(0, &mut all[start..])?;
        }
        Ok(all)
    }

    /// Opens `(index, path)` pairs as one set sharing [`MMAP_RESIDENT_BUDGET`].
    pub fn open_set(files: &[(usize, &Path)], mode: AccessMode) -> Result<Vec<std::sync::Arc<ShardFile>>, ShardError> {
        files
            .iter()
            .map(|&(i, p)| {
                let mut f = Self::open(p, i, mode)?;
                f.share_budget_with(files.len());
                Ok(std::sync::Arc::new(f))
            })
            .collect()
    }

    /// Makes this shard one of `set_size` shards sharing [`MMAP_RESIDENT_BUDGET`]: it drops its
    /// pages after reading its share (at least 1 MiB, which bounds the `madvise` rate).
    pub fn share_budget_with(&mut self, set_size: usize) {
        self.release_bytes = (MMAP_RESIDENT_BUDGET / set_size.max(1) as u64).max(MIN_RELEASE_BYTES);
    }

    fn check_range(&self, start: u64, len: usize) -> Result<(), ShardError> {
        if start.checked_add(len as u64).is_none_or(|end| end > self.tokens) {
            return Err(ShardError::OutOfBounds { path: self.path.clone(), start, len: len as u64, tokens: self.tokens });
        }
        Ok(())
    }

    /// Calls `f` with tokens `[start, start + len)`: a view of the map, or `scratch` filled by a
    /// positioned read. `scratch` must hold at least `len` tokens.
    pub fn with_tokens<R>(&self, start: u64, len: usize, scratch: &mut [u16], f: impl FnOnce(&[u16]) -> R) -> Result<R, ShardError> {
        self.check_range(start, len)?;
        match &self.access {
            Access::Mmap(map) => {
                let off = (HEADER_BYTES + 2 * start) as usize;
                let bytes = &map[off..off + 2 * len];
                // The map is page-aligned and the header is 1024 bytes, so the payload is u16-aligned.
                let (pre, toks, post) = unsafe { bytes.align_to::<u16>() };
                debug_assert!(pre.is_empty() && post.is_empty());
                let r = if cfg!(target_endian = "little") {
                    f(toks)
                } else {
                    for (d, s) in scratch[..len].iter_mut().zip(toks) {
                        *d = u16::from_le(*s);
                    }
                    f(&scratch[..len])
                };
                if map.damaged() {
                    return Err(self.shrunk());
                }
                self.note_touched(map.inner(), 2 * len as u64);
                Ok(r)
            }
            Access::Pread(file) => {
                let buf = &mut scratch[..len];
                read_at(file, HEADER_BYTES + 2 * start, buf).map_err(|source| ShardError::Io { path: self.path.clone(), error: source })?;
                Ok(f(buf))
            }
        }
    }

    /// Copies tokens `[start, start + out.len())` into `out`.
    pub fn read(&self, start: u64, out: &mut [u16]) -> Result<(), ShardError> {
        let len = out.len();
        self.check_range(start, len)?;
        match &self.access {
            Access::Pread(file) => {
                read_at(file, HEADER_BYTES + 2 * start, out).map_err(|source| ShardError::Io { path: self.path.clone(), error: source })
            }
            Access::Mmap(_) => {
                let mut tmp = Vec::new();
                if cfg!(target_endian = "big") {
                    tmp.resize(len, 0);
                }
                self.with_tokens(start, len, &mut tmp, |t| out.copy_from_slice(t))
            }
        }
    }

    /// The error for a map that read past its file's end: the file shrank under the run.
    fn shrunk(&self) -> ShardError {
        let now = std::fs::metadata(&self.path).map(|m| m.len()).unwrap_or(0);
        ShardError::Shrunk { path: self.path.clone(), now, expected: HEADER_BYTES + 2 * self.tokens }
    }

    fn note_touched(&self, map: &memmap2::Mmap, bytes: u64) {
        let before = self.touched.fetch_add(bytes, Ordering::Relaxed);
        if before + bytes >= self.release_bytes && before < self.release_bytes {
            self.touched.store(0, Ordering::Relaxed);
            // SAFETY: a read-only shared file mapping: dropping its pages only makes the next
            // access fault them in again from the page cache; no data can be lost.
            let _ = unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) };
        }
    }
}

fn read_at(file: &File, offset: u64, out: &mut [u16]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    // SAFETY: u16 has no invalid bit patterns; the byte view covers exactly `out`.
    let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, out.len() * 2) };
    file.read_exact_at(bytes, offset)?;
    if cfg!(target_endian = "big") {
        for t in out.iter_mut() {
            *t = u16::from_le(*t);
        }
    }
    Ok(())
}

/// Writes a shard atomically (temporary name, fsync, rename).
#[cfg(feature = "tools")]
pub fn write_shard(path: &Path, tokens: &[u16]) -> anyhow::Result<()> {
    anyhow::ensure!(
        tokens.len() < (1usize << 31),
        "{}: {} tokens do not fit a shard header (at most 2^31 - 1)",
        path.display(),
        tokens.len()
    );
    let mut bytes = Vec::with_capacity(HEADER_BYTES as usize + 2 * tokens.len());
    let mut header = [0i32; 256];
    header[0] = MAGIC;
    header[1] = VERSION;
    header[2] = tokens.len() as i32;
    for w in header {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    crate::runtime::rundir::write_atomic(path, &bytes)
}

/// Writes `tokens` as a shard without the atomic dance (tests that build damaged files).
#[cfg(feature = "tools")]
pub fn write_raw(path: &Path, header: &[i32], tokens: &[u16]) -> std::io::Result<()> {
    let mut f = File::create(path)?;
    let mut h = [0i32; 256];
    h[..header.len()].copy_from_slice(header);
    for w in h {
        f.write_all(&w.to_le_bytes())?;
    }
    for t in tokens {
        f.write_all(&t.to_le_bytes())?;
    }
    Ok(())
}

/// The sorted list of files matching `pattern`; an error naming the pattern if none match.
pub fn glob_sorted(pattern: &str) -> anyhow::Result<Vec<PathBuf>> {
    let paths = glob::glob(pattern).map_err(|e| anyhow::anyhow!("bad shard glob `{pattern}`: {e}"))?;
    let mut out = Vec::new();
    for p in paths {
        out.push(p.map_err(|e| anyhow::anyhow!("{}: cannot read: {}", e.path().display(), e.error()))?);
    }
    out.sort();
    anyhow::ensure!(!out.is_empty(), "no shard matches `{pattern}`");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("pipeline-shard-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn round_trip_both_modes() {
        let d = dir("rt");
        let p = d.join("s.bin");
        let toks: Vec<u16> = (0..5000u32).map(|i| (i * 7 % 65536) as u16).collect();
        write_shard(&p, &toks).unwrap();
        for mode in [AccessMode::Mmap, AccessMode::Pread] {
            let s = ShardFile::open(&p, 0, mode).unwrap();
            assert_eq!(s.tokens, 5000);
            let mut out = vec![0u16; 100];
            s.read(1234, &mut out).unwrap();
            assert_eq!(out, toks[1234..1334]);
            let mut scratch = vec![0u16; 10];
            let sum = s.with_tokens(4990, 10, &mut scratch, |t| t.iter().map(|&x| x as u64).sum::<u64>()).unwrap();
            assert_eq!(sum, toks[4990..].iter().map(|&x| x as u64).sum::<u64>());
            assert!(matches!(s.read(4999, &mut out), Err(ShardError::OutOfBounds { .. })));
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn every_damage_is_named() {
        let d = dir("bad");
        type Make = Box<dyn Fn(&Path)>;
        let cases: Vec<(&str, Make, &str)> = vec![
            ("magic", Box::new(|p| write_raw(p, &[123, 1, 2], &[1, 2]).unwrap()), "magic number 123"),
            ("version", Box::new(|p| write_raw(p, &[MAGIC, 2, 2], &[1, 2]).unwrap()), "version 2"),
            ("count", Box::new(|p| write_raw(p, &[MAGIC, 1, 10], &[1, 2]).unwrap()), "truncated"),
            ("trailing", Box::new(|p| write_raw(p, &[MAGIC, 1, 1], &[1, 2]).unwrap()), "trailing bytes"),
            ("empty", Box::new(|p| write_raw(p, &[MAGIC, 1, 0], &[]).unwrap()), "0 tokens"),
            ("negative", Box::new(|p| write_raw(p, &[MAGIC, 1, -5], &[]).unwrap()), "negative token count"),
            ("short", Box::new(|p| std::fs::write(p, [0u8; 100]).unwrap()), "shorter than the 1024-byte"),
            ("dir", Box::new(|p| std::fs::create_dir(p).unwrap()), "is a directory"),
        ];
        for (name, make, want) in cases {
            let p = d.join(format!("{name}.bin"));
            make(&p);
            let e = ShardFile::open(&p, 0, AccessMode::Mmap).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains(&format!("{name}.bin")), "{name}: {e}");
        }
        let e = ShardFile::open(&d.join("missing.bin"), 0, AccessMode::Pread).unwrap_err().to_string();
        assert!(e.contains("missing.bin") && e.contains("cannot read"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A shard truncated while it is read: both readers stop with an error naming it (the
    /// map's reads past the new end used to kill the process with SIGBUS).
    #[test]
    fn a_shard_truncated_under_a_reader_is_named_by_both_modes() {
        let d = dir("shrink");
        let toks: Vec<u16> = (0..20_000u32).map(|i| (i % 1000) as u16).collect();
        for mode in [AccessMode::Mmap, AccessMode::Pread] {
            let p = d.join(format!("{mode:?}.bin"));
            write_shard(&p, &toks).unwrap();
            let s = ShardFile::open(&p, 0, mode).unwrap();
            let mut out = vec![0u16; 1000];
            s.read(18_000, &mut out).unwrap();
            std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(HEADER_BYTES + 2 * 100).unwrap();
            s.read(0, &mut out[..100]).unwrap();
            let e = s.read(18_000, &mut out).unwrap_err().to_string();
            assert!(e.contains(&format!("{mode:?}.bin")), "{mode:?}: {e}");
            if mode == AccessMode::Mmap {
                assert!(e.contains("shrank while the run read it") && e.contains("now 1224 bytes"), "{e}");
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn empty_glob_names_the_pattern() {
        let e = glob_sorted("/nonexistent-dir-xyz/*.bin").unwrap_err().to_string();
        assert!(e.contains("no shard matches `/nonexistent-dir-xyz/*.bin`"), "{e}");
    }
}
