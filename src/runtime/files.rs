//! Files a user names (the config, shards, the tokenizer, checkpoints, weights): only regular
//! files are opened. Opening a FIFO for reading blocks until something writes to it, forever if
//! nothing does, and a device can stream without end; both are refused before any open, naming
//! the path and what it is.

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
