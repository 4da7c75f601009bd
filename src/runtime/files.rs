//! Files a user names (the config, shards, the tokenizer, checkpoints, weights): only regular
//! files are opened. Opening a FIFO for reading blocks until something writes to it, forever if
//! nothing does, and a device can stream without end; both are refused before any open, naming
//! the path and what it is. Also the SHA-256 of a file (what a run records of the files it
//! writes, and what the checks of a run directory compare).

use std::fs::FileType;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;

/// What a file that is not a regular file is, in words (`a directory`, `a FIFO (named pipe)`,
/// ...); `None` for a regular file.
pub fn not_regular(t: &FileType) -> Option<&'static str> {
    if t.is_file() {
        None
    } else if t.is_dir() {
        Some("a directory")
    } else if t.is_fifo() {
        Some("a FIFO (named pipe)")
    } else if t.is_socket() {
        Some("a socket")
    } else if t.is_char_device() {
        Some("a character device")
    } else if t.is_block_device() {
        Some("a block device")
    } else {
        Some("not a regular file")
    }
}

/// A path that names something other than a regular file (links followed).
#[derive(Debug, thiserror::Error)]
#[error("{}: is {what}, not a regular file", path.display())]
pub struct NotRegular {
    /// The path.
    pub path: std::path::PathBuf,
    /// What it is.
    pub what: &'static str,
}

/// Checks that `path` is a regular file (following links): the error names the path and what
/// it is instead; a path that cannot be read gives the system's error (with the path).
pub fn ensure_regular(path: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let meta = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    match not_regular(&meta.file_type()) {
        None => Ok(()),
        Some(what) => Err(NotRegular { path: path.to_path_buf(), what }.into()),
    }
}

/// Whether `e` comes from the system failing to read or write a file that exists and is what
/// it should be (a permission, a failing or full disk): an I/O error in its chain other than
/// "not found" or bad data. Such an error exits 1; bad input (a missing file, a corrupt one, a
/// FIFO) exits 2.
pub fn is_system_error(e: &anyhow::Error) -> bool {
    use std::io::ErrorKind;
    e.chain()
        .filter_map(|c| c.downcast_ref::<std::io::Error>())
        .any(|io| !matches!(io.kind(), ErrorKind::NotFound | ErrorKind::InvalidData | ErrorKind::UnexpectedEof | ErrorKind::InvalidInput))
}

/// Reads the whole of `path`, a regular file ([`ensure_regular`]).
pub fn read(path: &Path) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context;
    ensure_regular(path)?;
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> anyhow::Result<String> {
    use anyhow::Context;
    use std::io::Read;
    ensure_regular(path)?;
    let mut f = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut h = <sha2::Sha256 as sha2::Digest>::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        sha2::Digest::update(&mut h, &buf[..n]);
    }
    Ok(hex(&sha2::Digest::finalize(h)))
}

/// The file of run directory `dir` that its report names as `recorded`: a path relative to
/// `dir` (what runs record), or, in reports written before they did, an absolute path whose
/// file name is taken in `dir`. A check reads only the folder it is given: never the absolute
/// path, and a relative path that leaves `dir` (`..`, a root) is refused.
#[cfg(feature = "tools")]
pub fn in_run_dir(dir: &Path, recorded: &str) -> anyhow::Result<std::path::PathBuf> {
    use std::path::Component;
    let p = Path::new(recorded);
    if p.is_absolute() {
        let name = p.file_name().ok_or_else(|| anyhow::anyhow!("{}: report.json names {recorded:?}, which is no file", dir.display()))?;
        return Ok(dir.join(name));
    }
    if p.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir)) || recorded.is_empty() {
        anyhow::bail!(
            "{}: report.json names {recorded:?}, outside the run directory: a check reads only the folder it is given",
            dir.display()
        );
    }
    Ok(dir.join(p))
}

/// The files of a run directory whose SHA-256 its report records (besides the artifact and the
/// source bundle, which their own sections record): what `audit-eval` and `submission` read.
pub const RECORDED: [&str; 2] = ["config.toml", "final_model.safetensors"];

/// The SHA-256 of each of [`RECORDED`] that `dir` holds (none for a run that wrote no
/// directory).
pub fn recorded(dir: &Path) -> std::collections::BTreeMap<String, String> {
    if dir.as_os_str().is_empty() {
        return Default::default();
    }
    RECORDED.iter().filter_map(|name| sha256_file(&dir.join(name)).ok().map(|sha| (name.to_string(), sha))).collect()
}

/// What a run directory's report (as JSON) records of its files: `run.files` (see [`recorded`]),
/// empty for a report of an older version.
#[cfg(feature = "tools")]
pub fn recorded_of(report: &serde_json::Value) -> std::collections::BTreeMap<String, String> {
    serde_json::from_value(report["run"]["files"].clone()).unwrap_or_default()
}

/// The artifact a run directory's report (as JSON) names, judged in `dir`: its `artifact.path`
/// resolved there ([`in_run_dir`]), the file present, of the recorded `artifact.bytes` and with
/// the recorded `artifact.sha256` (a report that recorded none cannot be checked: an error).
/// `None` when the report names no artifact.
#[cfg(feature = "tools")]
pub fn recorded_artifact(dir: &Path, report: &serde_json::Value) -> anyhow::Result<Option<std::path::PathBuf>> {
    let Some(recorded) = report["artifact"]["path"].as_str() else { return Ok(None) };
    let file = in_run_dir(dir, recorded)?;
    let meta = std::fs::metadata(&file).map_err(|_| anyhow::anyhow!("{}: the artifact is not in the run directory", file.display()))?;
    if let Some(bytes) = report["artifact"]["bytes"].as_u64() {
        anyhow::ensure!(
            meta.len() == bytes,
            "{}: {} bytes, the run recorded {bytes}: it is not the file the run wrote",
            file.display(),
            meta.len()
        );
    }
    match report["artifact"]["sha256"].as_str() {
        Some(sha) => check_sha256(&file, sha)?,
        None => anyhow::bail!("{}: the run recorded no SHA-256 of it (a report of an older version): it cannot be checked", file.display()),
    }
    Ok(Some(file))
}

/// Checks `dir/name` against the SHA-256 `files` recorded for it, when it was recorded (reports
/// of older versions record none).
#[cfg(feature = "tools")]
pub fn check_recorded(dir: &Path, name: &str, files: &std::collections::BTreeMap<String, String>) -> anyhow::Result<()> {
    match files.get(name) {
        Some(sha) => check_sha256(&dir.join(name), sha),
        None => Ok(()),
    }
}

/// Checks that `path`'s SHA-256 is `recorded` (hex): the file is the one the run wrote.
#[cfg(feature = "tools")]
pub fn check_sha256(path: &Path, recorded: &str) -> anyhow::Result<()> {
    let now = sha256_file(path)?;
    anyhow::ensure!(
        now.eq_ignore_ascii_case(recorded),
        "{}: its SHA-256 is {now}, the run recorded {recorded}: it is not the file the run wrote",
        path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifos_directories_and_devices_are_named_not_opened() {
        let d = std::env::temp_dir().join(format!("pipeline-files-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let fifo = d.join("pipe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
        assert!(made.success());
        // Were it opened, this read would block forever: no writer ever comes.
        let e = read(&fifo).unwrap_err().to_string();
        assert!(e.contains("pipe: is a FIFO (named pipe), not a regular file"), "{e}");
        let e = ensure_regular(&d).unwrap_err().to_string();
        assert!(e.contains("is a directory"), "{e}");
        let e = ensure_regular(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("/dev/zero: is a character device"), "{e}");
        let f = d.join("plain");
        std::fs::write(&f, b"x").unwrap();
        assert_eq!(read(&f).unwrap(), b"x");
        let e = read(&d.join("missing")).unwrap_err();
        assert!(e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some()), "{e:#}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
