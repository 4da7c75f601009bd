//! Run directories and atomic file writes.
//!
//! A run directory is `<[run] out_dir>/<name>-<UTC time>` (or exactly `--out DIR`). Files in it
//! are written to a temporary name in the same directory, synced, then renamed over the final
//! name, so a reader (or a killed process) never sees half a file.
//!
//! A run directory belongs to one run at a time ([`Claim`]): an exclusive lock on `DIR/.lock`
//! (`flock`), taken before the directory is judged empty and held until the run ends. The
//! kernel drops it when the process ends, however it ends, so a crashed run leaves nothing that
//! keeps the next one out.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::Context;

/// The lock file that claims a run directory (see [`Claim`]).
pub const LOCK: &str = ".lock";

/// A run directory that another run holds, or that holds another run's files: bad input (the
/// user chooses another `--out`), told apart from the system's errors by its type.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Taken(pub String);

/// A run directory claimed by this process: the exclusive lock on its [`LOCK`] file, held while
/// this value lives (and dropped by the kernel if the process dies).
#[derive(Debug)]
pub struct Claim {
    _lock: Option<File>,
    /// Why the directory could not be locked, when its filesystem has no locks (NFS without
    /// its lock service): the run goes on unprotected against a second run, and says so.
    pub unlocked: Option<String>,
}

/// Claims `dir` (which must exist) for this run, or says which run holds it.
pub fn claim(dir: &Path) -> anyhow::Result<Claim> {
    let path = dir.join(LOCK);
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot claim run directory {}: cannot open {}", dir.display(), path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(Claim { _lock: Some(file), unlocked: None }),
        Err(fs::TryLockError::WouldBlock) => Err(Taken(format!(
            "run directory {} is in use by another run (it holds {}): wait for that run to end, or choose another --out",
            dir.display(),
            path.display()
        ))
        .into()),
        Err(fs::TryLockError::Error(e)) => lock_failed(dir, &path, e),
    }
}

/// A lock that failed for a reason other than another run holding it: a filesystem without
/// locks lets the run go on unclaimed (said in [`Claim::unlocked`]); any other error stops it.
fn lock_failed(dir: &Path, path: &Path, e: std::io::Error) -> anyhow::Result<Claim> {
    const ENOLCK: i32 = 37;
    if e.kind() == std::io::ErrorKind::Unsupported || e.raw_os_error() == Some(ENOLCK) {
        return Ok(Claim {
            _lock: None,
            unlocked: Some(format!(
                "run directory {} cannot be locked ({}: {e}): nothing keeps a second run given the same directory out",
                dir.display(),
                path.display()
            )),
        });
    }
    Err(e).with_context(|| format!("cannot claim run directory {}: cannot lock {}", dir.display(), path.display()))
}

/// Whether `dir` holds anything but its lock file.
fn has_files(dir: &Path) -> anyhow::Result<bool> {
    let entries = fs::read_dir(dir).with_context(|| format!("cannot read run directory {}", dir.display()))?;
    Ok(entries.filter_map(Result::ok).any(|e| e.file_name() != LOCK))
}

/// Makes a fresh run directory and claims it. With `out`, uses exactly that path (it may exist
/// if empty; judged after the claim, so of two runs given the same `--out` at once, one runs
/// and the other is refused); otherwise `<out_dir>/<name>-<YYYYMMDDTHHMMSSZ>`, adding `-2`,
/// `-3`, ... if taken.
pub fn create(out: Option<&Path>, out_dir: &Path, name: &str) -> anyhow::Result<(PathBuf, Claim)> {
    if let Some(dir) = out {
        let not_empty = || Taken(format!("run directory {} already exists and is not empty; choose another --out", dir.display()));
        // Judged once before the claim too, so that a full folder gets no lock file of ours.
        if dir.exists() && has_files(dir)? {
            return Err(not_empty().into());
        }
        fs::create_dir_all(dir).with_context(|| format!("cannot create run directory {}", dir.display()))?;
        let claim = claim(dir)?;
        if has_files(dir)? {
            return Err(not_empty().into());
        }
        return Ok((dir.to_path_buf(), claim));
    }
    let stamp = humantime::format_rfc3339_seconds(SystemTime::now()).to_string().replace(['-', ':'], "");
    fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    for n in 1u32.. {
        let leaf = if n == 1 { format!("{name}-{stamp}") } else { format!("{name}-{stamp}-{n}") };
        let dir = out_dir.join(leaf);
        match fs::create_dir(&dir) {
            Ok(()) => {
                let claim = claim(&dir)?;
                return Ok((dir, claim));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("cannot create run directory {}", dir.display())),
        }
    }
    unreachable!("u32 run-directory suffixes exhausted")
}

/// Writes `bytes` to `path` atomically: temporary file, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    Ok(())
}

/// As [`write_atomic`], unless `path` already holds exactly `bytes`: then nothing is written
/// (not even the file's time), and it returns false. A run that finishes what an earlier
/// process left (a resume) so leaves the files that process completed as they were.
pub fn write_atomic_if_changed(path: &Path, bytes: &[u8]) -> anyhow::Result<bool> {
    let same =
        fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == bytes.len() as u64) && fs::read(path).is_ok_and(|old| old == bytes);
    if same {
        return Ok(false);
    }
    write_atomic(path, bytes)?;
    Ok(true)
}

/// The current time as RFC 3339 UTC, to the second.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let d = std::env::temp_dir().join(format!("pipeline-rundir-{}", std::process::id()));
        fs::create_dir_all(&d).unwrap();
        let p = d.join("r.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let leftovers: Vec<_> =
            fs::read_dir(&d).unwrap().filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().contains(".tmp-")).collect();
        assert!(leftovers.is_empty());
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn two_runs_in_one_second_get_two_directories() {
        let d = std::env::temp_dir().join(format!("pipeline-rundirs-{}", std::process::id()));
        let a = create(None, &d, "x").unwrap().0;
        let b = create(None, &d, "x").unwrap().0;
        assert_ne!(a, b);
        let out = d.join("fixed");
        assert_eq!(create(Some(&out), &d, "x").unwrap().0, out);
        fs::write(out.join("f"), b"").unwrap();
        let e = create(Some(&out), &d, "x").unwrap_err();
        assert!(e.downcast_ref::<Taken>().is_some_and(|t| t.0.contains("not empty")), "non-empty --out must be refused: {e:#}");
        fs::remove_dir_all(&d).unwrap();
    }

    /// One run per directory: a second claim (another process, or another file handle of this
    /// one) is refused naming the holder's lock, until the first claim ends; a lock file left
    /// by an ended run does not keep a new run out.
    #[test]
    fn a_run_directory_is_claimed_by_one_run() {
        let d = std::env::temp_dir().join(format!("pipeline-claim-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        let (dir, first) = create(Some(&d.join("run")), &d, "x").unwrap();
        let e = create(Some(&dir), &d, "x").unwrap_err();
        let taken = e.downcast_ref::<Taken>().unwrap_or_else(|| panic!("{e:#}"));
        assert!(taken.0.contains("in use by another run") && taken.0.contains(".lock"), "{}", taken.0);
        assert!(claim(&dir).is_err(), "a resume of a running run must be refused too");
        drop(first);
        let again = claim(&dir).expect("the ended run's lock file does not hold the directory");
        drop(again);
        // A filesystem without locks: the run goes on, saying so; another error stops it.
        let unsupported = lock_failed(&dir, &dir.join(LOCK), std::io::Error::from(std::io::ErrorKind::Unsupported)).unwrap();
        assert!(unsupported.unlocked.as_deref().is_some_and(|w| w.contains("cannot be locked")), "{unsupported:?}");
        assert!(lock_failed(&dir, &dir.join(LOCK), std::io::Error::from(std::io::ErrorKind::PermissionDenied)).is_err());
        // An empty directory with a stale lock file is still a fresh --out.
        assert_eq!(create(Some(&dir), &d, "x").unwrap().0, dir);
        fs::remove_dir_all(&d).unwrap();
    }
}
