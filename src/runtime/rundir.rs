//! Run directories and atomic file writes.
//!
//! A run directory is `<[run] out_dir>/<name>-<UTC time>` (or exactly `--out DIR`). Files in it
//! are written to a temporary name in the same directory, synced, then renamed over the final
//! name, so a reader (or a killed process) never sees half a file.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::Context;

/// Makes a fresh run directory. With `out`, uses exactly that path (it may exist if empty);
/// otherwise `<out_dir>/<name>-<YYYYMMDDTHHMMSSZ>`, adding `-2`, `-3`, ... if taken.
pub fn create(out: Option<&Path>, out_dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    if let Some(dir) = out {
        if dir.exists() && fs::read_dir(dir).with_context(|| format!("cannot read run directory {}", dir.display()))?.next().is_some() {
            anyhow::bail!("run directory {} already exists and is not empty; choose another --out", dir.display());
        }
        fs::create_dir_all(dir).with_context(|| format!("cannot create run directory {}", dir.display()))?;
        return Ok(dir.to_path_buf());
    }
    let stamp = humantime::format_rfc3339_seconds(SystemTime::now()).to_string().replace(['-', ':'], "");
    fs::create_dir_all(out_dir).with_context(|| format!("cannot create {}", out_dir.display()))?;
    for n in 1u32.. {
        let leaf = if n == 1 { format!("{name}-{stamp}") } else { format!("{name}-{stamp}-{n}") };
        let dir = out_dir.join(leaf);
        match fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
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
        let a = create(None, &d, "x").unwrap();
        let b = create(None, &d, "x").unwrap();
        assert_ne!(a, b);
        let out = d.join("fixed");
        assert_eq!(create(Some(&out), &d, "x").unwrap(), out);
        fs::write(out.join("f"), b"").unwrap();
        assert!(create(Some(&out), &d, "x").is_err(), "non-empty --out must be refused");
        fs::remove_dir_all(&d).unwrap();
    }
}
