//! The `lrzip` program, run with its ZPAQ back end: the compressor of the `pergroup` codec's
//! weight groups ([`super::pergroup`]), as the 04-27 record runs it (`lrzip -z -L 9`).
//!
//! `lrzip` is a system program, not a library: Debian/Ubuntu `apt-get install lrzip`. It is
//! looked up on the `PATH`, or taken from [`LRZIP_ENV`] (`LRZIP_BIN=/path/to/lrzip`) when
//! that is set; [`Lrzip::locate`] refuses, naming what to install, when neither gives a working
//! program. Each call runs the program on files in its own temporary directory (under the
//! system's temporary directory, `TMPDIR`), removed afterwards, also on error.
//!
//! How it is run: `LRZIP=NOCONFIG` (no `lrzip.conf` changes the output), `-Q` (silent), `-N 0`
//! (lrzip lowers its own priority to nice 19 by default; its decompression counts against the
//! evaluation time), `-z -T -L LEVEL` to compress (`-T`: no LZ4 pre-test, which stores
//! int6-like data, with few repeats for LZ4 to find, uncompressed), `-d` to decompress.
//!
//! An lrzip file (version 0.6) starts with `LRZI`, two version bytes, then the expanded size,
//! u64 little-endian (bytes 6 to 14): [`Lrzip::decompress`] checks both before running the
//! program, and the size of what it wrote after.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result, bail, ensure};

/// The environment variable naming the `lrzip` program to run (unset: `lrzip` on the `PATH`).
/// Not `PIPELINE_...`: those set config keys ([`crate::runtime::config::ENV_PREFIX`]).
pub const LRZIP_ENV: &str = "LRZIP_BIN";

/// What to install when `lrzip` is missing.
pub const INSTALL_HINT: &str = "install it (Debian/Ubuntu: apt-get install lrzip) or set LRZIP_BIN to its path";

/// The first bytes of an lrzip file.
const LRZIP_MAGIC: [u8; 4] = *b"LRZI";

/// A located, working `lrzip` program.
#[derive(Clone, Debug)]
pub struct Lrzip {
    path: PathBuf,
}

impl Lrzip {
    /// The program [`LRZIP_ENV`] names, or `lrzip` on the `PATH`; checked by running
    /// `lrzip -V`. The error says what to install.
    pub fn locate() -> Result<Self> {
        Self::locate_in(std::env::var_os(LRZIP_ENV), std::env::var_os("PATH"))
    }

    /// [`Lrzip::locate`] with the override and the search path given (tests).
    pub(crate) fn locate_in(over: Option<OsString>, search: Option<OsString>) -> Result<Self> {
        let path = match over.filter(|o| !o.is_empty()) {
            Some(o) => {
                let p = PathBuf::from(&o);
                ensure!(
                    p.is_file(),
                    "{LRZIP_ENV} = {} names no file: the `pergroup` codec needs the lrzip program; {INSTALL_HINT}",
                    p.display()
                );
                p
            }
            None => search
                .iter()
                .flat_map(std::env::split_paths)
                .map(|dir| dir.join("lrzip"))
                .find(|p| is_executable(p))
                .with_context(|| format!("the `pergroup` codec needs the lrzip program, which is not on the PATH: {INSTALL_HINT}"))?,
        };
        let out = Command::new(&path)
            .arg("-V")
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("cannot run {} (the `pergroup` codec's lrzip): {INSTALL_HINT}", path.display()))?;
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        ensure!(
            out.status.success() && said.contains("lrzip"),
            "{} -V does not answer as lrzip does ({}; it said {:?}): {INSTALL_HINT}",
            path.display(),
            out.status,
            said.trim()
        );
        Ok(Self { path })
    }

    /// The program's path.
    #[cfg(feature = "tools")]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `data` compressed with `lrzip -z -L level` (ZPAQ; `level` 1..=9). `label` names the
    /// data in errors.
    pub fn compress(&self, data: &[u8], level: i32, label: &str) -> Result<Vec<u8>> {
        ensure!((1..=9).contains(&level), "lrzip level {level} is outside 1..=9");
        let dir = TempDir::new()?;
        let (inp, out) = (dir.0.join("in.bin"), dir.0.join("out.lrz"));
        std::fs::write(&inp, data).with_context(|| format!("cannot write {}", inp.display()))?;
        self.run(&dir, &["-z", "-T", "-L", &level.to_string()], &inp, &out).with_context(|| format!("lrzip could not compress {label}"))?;
        std::fs::read(&out).with_context(|| format!("lrzip wrote no {} for {label}", out.display()))
    }

    /// `data` (an lrzip file) decompressed; it must give exactly `len` bytes. `label` names
    /// the data in errors.
    pub fn decompress(&self, data: &[u8], len: usize, label: &str) -> Result<Vec<u8>> {
        ensure!(
            data.len() >= 14 && data[..4] == LRZIP_MAGIC,
            "{label} is not an lrzip stream (it is {} bytes and does not start with `LRZI`)",
            data.len()
        );
        let said = u64::from_le_bytes(data[6..14].try_into().expect("8 bytes"));
        ensure!(said == len as u64, "{label}: the lrzip stream says it expands to {said} bytes, the table says {len}");
        let dir = TempDir::new()?;
        let (inp, out) = (dir.0.join("in.lrz"), dir.0.join("out.bin"));
        std::fs::write(&inp, data).with_context(|| format!("cannot write {}", inp.display()))?;
        self.run(&dir, &["-d"], &inp, &out).with_context(|| format!("lrzip could not decompress {label}"))?;
        let got = std::fs::metadata(&out).with_context(|| format!("lrzip wrote no output for {label}"))?.len();
        ensure!(got == len as u64, "{label} decompresses to {got} bytes, the table says {len}");
        std::fs::read(&out).with_context(|| format!("cannot read {}", out.display()))
    }

    fn run(&self, dir: &TempDir, args: &[&str], inp: &Path, out: &Path) -> Result<()> {
        let o = Command::new(&self.path)
            .args(args)
            .args(["-Q", "-f", "-N", "0", "-o"])
            .arg(out)
            .arg(inp)
            .env("LRZIP", "NOCONFIG")
            .env("TMPDIR", &dir.0)
            .env("TMP", &dir.0)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("cannot run {}", self.path.display()))?;
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            let tail: String = err.trim().chars().rev().take(400).collect::<Vec<_>>().into_iter().rev().collect();
            bail!("{} {} exited with {}: {tail}", self.path.display(), args.join(" "), o.status);
        }
        Ok(())
    }
}

#[cfg(unix)]
fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(not(unix))]
fn is_executable(p: &Path) -> bool {
    p.is_file()
}

/// A fresh directory under the system's temporary directory, removed with what it holds when
/// dropped (also when an error unwinds past it).
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let base = std::env::temp_dir();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        for _ in 0..100 {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let p = base.join(format!("pipeline-lrzip-{}-{n}-{nanos}", std::process::id()));
            match std::fs::create_dir(&p) {
                Ok(()) => return Ok(Self(p)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e).with_context(|| format!("cannot create a temporary directory {}", p.display())),
            }
        }
        bail!("cannot create a fresh temporary directory under {}", base.display())
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The installed lrzip, or `None` after saying that `test` is skipped (tests that need lrzip;
/// CI installs it).
#[cfg(test)]
pub(crate) fn installed_or_skip(test: &str) -> Option<Lrzip> {
    match Lrzip::locate() {
        Ok(l) => Some(l),
        Err(e) => {
            eprintln!("{test}: skipped: {e:#}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_temporary_directory_goes_with_what_it_holds() {
        let d = TempDir::new().unwrap();
        let p = d.0.clone();
        std::fs::write(p.join("f"), b"x").unwrap();
        assert_ne!(TempDir::new().unwrap().0, p);
        drop(d);
        assert!(!p.exists());
        // Also when lrzip fails: `false` answers nothing and exits 1.
        if Path::new("/bin/false").is_file() {
            let lz = Lrzip { path: "/bin/false".into() };
            let err = format!("{:#}", lz.compress(b"abc", 9, "group `g`").unwrap_err());
            assert!(err.contains("group `g`") && err.contains("exited with"), "{err}");
        }
    }

    #[test]
    fn a_missing_lrzip_is_refused_naming_what_to_install() {
        let err = format!("{:#}", Lrzip::locate_in(Some("/nonexistent/lrzip".into()), None).unwrap_err());
        assert!(err.contains("LRZIP_BIN") && err.contains("apt-get install lrzip"), "{err}");
        assert!(!LRZIP_ENV.to_ascii_uppercase().starts_with(crate::runtime::config::ENV_PREFIX), "the config would read it as a key");
        let empty = TempDir::new().unwrap();
        let err = format!("{:#}", Lrzip::locate_in(None, Some(empty.0.clone().into_os_string())).unwrap_err());
        assert!(err.contains("not on the PATH") && err.contains("apt-get install lrzip"), "{err}");
        let err = format!("{:#}", Lrzip::locate_in(None, None).unwrap_err());
        assert!(err.contains("apt-get install lrzip"), "{err}");
        // A program that is not lrzip.
        if Path::new("/bin/true").is_file() {
            let err = format!("{:#}", Lrzip::locate_in(Some("/bin/true".into()), None).unwrap_err());
            assert!(err.contains("does not answer as lrzip"), "{err}");
        }
    }

    #[test]
    fn round_trips_and_checks_the_size_and_cleans_up() {
        let Some(lz) = installed_or_skip("round_trips_and_checks_the_size_and_cleans_up") else { return };
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 7 + i / 1000) as u8).collect();
        let packed = lz.compress(&data, 9, "the test data").unwrap();
        assert!(packed.len() < data.len() / 10 && packed.starts_with(b"LRZI"), "{}", packed.len());
        assert_eq!(lz.decompress(&packed, data.len(), "it").unwrap(), data);
        let err = format!("{:#}", lz.decompress(&packed, data.len() + 1, "group `x`").unwrap_err());
        assert!(err.contains("group `x`") && err.contains("expands to"), "{err}");
        let err = format!("{:#}", lz.decompress(b"not an lrzip file", 3, "group `y`").unwrap_err());
        assert!(err.contains("group `y`") && err.contains("LRZI"), "{err}");
        let mut bad = packed.clone();
        let n = bad.len();
        bad[n / 2] ^= 0x55;
        bad[n / 2 + 1] ^= 0xaa;
        if let Ok(back) = lz.decompress(&bad, data.len(), "group `z`") {
            // lrzip's own MD5 check usually catches it; the caller's checksum does otherwise.
            eprintln!("a corrupted lrzip stream decompressed (equal: {})", back == data);
        }
    }
}
