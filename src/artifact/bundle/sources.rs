//! Which files a source bundle holds: exactly the crate's sources that the build of this binary
//! read, as the build itself lists them, checked byte for byte against what was compiled.
//!
//! - **The list** is cargo's dep-info beside the binary (`target/<profile>/pipeline.d`, which
//!   cargo writes for every build: the Rust files rustc read for the library and the binary,
//!   and what build.rs declared as its inputs, the CUDA and C++ files of a `cuda` build), plus
//!   `Cargo.toml`. `$SOURCE_DEPINFO` names another file (a binary copied away from its
//!   target folder: copy its `.d` with it). Entries that are not source files of the crate
//!   (build outputs, the folders build.rs watches) are left out.
//! - **The check**: build.rs embeds the SHA-256 of every source file of the tree it compiled
//!   (`$OUT_DIR/source_digests.txt`); a listed file whose bytes differ now (an edit after the
//!   build) is refused, so a bundle never claims code the binary was not built from.
//! - `Cargo.lock` travels beside the bundle, uncounted (the records' requirements.txt); it is
//!   not checked against the build (scripts/build-cuda.sh patches it for its build and puts it
//!   back), but its digest is recorded with the bundle's.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sha2::Digest;

/// `HEX  PATH` for every source file of the tree this binary was compiled from (build.rs).
const BUILT: &str = include_str!(concat!(env!("OUT_DIR"), "/source_digests.txt"));

/// The crate root this binary was compiled in.
const BUILT_ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The lock file: beside the bundle, not in it.
pub const LOCK: &str = "Cargo.lock";

/// The files a bundle holds, found under `root`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sources {
    /// The crate root the files are read from.
    pub root: PathBuf,
    /// Paths relative to `root`, `/`-separated, sorted.
    pub files: Vec<String>,
    /// The dep-info file they were listed from.
    pub depinfo: PathBuf,
}

/// The digests build.rs embedded: relative path -> SHA-256 hex.
pub fn built_digests() -> BTreeMap<&'static str, &'static str> {
    parse_digests(BUILT)
}

fn parse_digests(text: &str) -> BTreeMap<&str, &str> {
    text.lines().filter_map(|l| l.split_once("  ")).map(|(hex, path)| (path, hex)).collect()
}

/// The SHA-256 of `bytes`, as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    crate::runtime::files::hex(&sha2::Sha256::digest(bytes))
}

/// The crate root this binary's sources are under (see [`of_this_binary`]), without reading
/// or checking them.
#[cfg(feature = "tools")]
pub fn root() -> Option<PathBuf> {
    locate(&built_digests())
}

/// The sources of this binary's build: its dep-info's list, read under the crate root (where
/// it was compiled, else the current directory when that holds the same crate), each file
/// checked against its build-time digest.
pub fn of_this_binary() -> Result<Sources> {
    let depinfo = match std::env::var_os("SOURCE_DEPINFO") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe().context("cannot find this binary's path")?.with_extension("d"),
    };
    let text = std::fs::read_to_string(&depinfo).with_context(|| {
        format!(
            "cannot read {} (cargo's list of the files this binary was built from, which `cargo build` writes and `cargo test` does not; keep it beside the binary, or name it with SOURCE_DEPINFO)",
            depinfo.display()
        )
    })?;
    let digests = built_digests();
    let root = locate(&digests)
        .with_context(|| format!("the sources this binary was built from are neither under {BUILT_ROOT} nor in the current directory"))?;
    let files = from_depinfo(&text, Path::new(BUILT_ROOT), &digests)
        .with_context(|| format!("{}: not a dep-info file of this crate", depinfo.display()))?;
    same_features(&files, &crate::runtime::build_info::BuildInfo::this().features)
        .with_context(|| format!("{} is not this binary's dep-info", depinfo.display()))?;
    check(&root, &files, &digests)?;
    Ok(Sources { root, files, depinfo })
}

/// The crate root: where this binary was compiled, else the current directory, whichever holds
/// a `Cargo.toml` with the build's bytes.
fn locate(digests: &BTreeMap<&str, &str>) -> Option<PathBuf> {
    let manifest = digests.get("Cargo.toml")?;
    [Some(PathBuf::from(BUILT_ROOT)), std::env::current_dir().ok()]
        .into_iter()
        .flatten()
        .find(|d| std::fs::read(d.join("Cargo.toml")).is_ok_and(|b| sha256_hex(&b) == *manifest))
}

/// The source files a dep-info file lists (Makefile syntax: `TARGET: DEP DEP ...`, spaces in a
/// path escaped with `\`), relative to `built_root`, kept when they are sources of the crate
/// (`digests` knows them), with `Cargo.toml`; sorted.
pub fn from_depinfo(text: &str, built_root: &Path, digests: &BTreeMap<&str, &str>) -> Result<Vec<String>> {
    let first = text.lines().find(|l| !l.trim().is_empty()).context("empty")?;
    let (_, deps) = first.split_once(": ").or_else(|| first.strip_suffix(':').map(|t| (t, ""))).context("no `TARGET: ...` line")?;
    let mut files = vec!["Cargo.toml".to_string()];
    for raw in split_escaped(deps) {
        let path = Path::new(&raw);
        let rel = if path.is_absolute() {
            match path.strip_prefix(built_root) {
                Ok(r) => r.to_path_buf(),
                Err(_) => continue,
            }
        } else {
            path.to_path_buf()
        };
        // `src/../stages/mod.rs` (a `#[path]`) is `stages/mod.rs`.
        let mut parts: Vec<String> = Vec::new();
        for c in rel.components() {
            match c {
                std::path::Component::ParentDir => {
                    parts.pop();
                }
                std::path::Component::Normal(n) => parts.push(n.to_string_lossy().into_owned()),
                _ => {}
            }
        }
        let rel = parts.join("/");
        if digests.contains_key(rel.as_str()) && rel != LOCK {
            files.push(rel);
        }
    }
    files.sort();
    files.dedup();
    anyhow::ensure!(files.iter().any(|f| f.ends_with(".rs")), "it lists no Rust source of the crate");
    Ok(files)
}

/// A file each feature alone compiles: a dep-info that lists it, or lacks it, belongs to a
/// build with, or without, that feature.
const MARKERS: [(&str, &str); 4] =
    [("tools", "src/cli/verify.rs"), ("candle", "src/model/forward.rs"), ("mpi", "src/dist/mpi.rs"), ("cuda", "src/engine/gpu/cuda.rs")];

/// Whether the listed files are those of a build with `features`. Cargo rewrites the dep-info
/// beside a binary only when it compiles it: after a build with other features, switching
/// back to a build that is still fresh relinks the binary and leaves the other build's list.
fn same_features(files: &[String], features: &[String]) -> Result<()> {
    for (feature, marker) in MARKERS {
        let listed = files.iter().any(|f| f == marker);
        let on = features.iter().any(|f| f == feature);
        anyhow::ensure!(
            listed == on,
            "it {} {marker}, which only a build {} the feature `{feature}` compiles: the list of another build (cargo leaves it when it relinks a fresh binary; `touch src/main.rs` and build again)",
            if listed { "lists" } else { "lacks" },
            if on { "with" } else { "without" }
        );
    }
    Ok(())
}

/// Splits a Makefile dependency list at unescaped spaces.
fn split_escaped(deps: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = deps.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&' ') => {
                cur.push(' ');
                chars.next();
            }
            ' ' | '\t' => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            _ => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Every file's bytes under `root` against its build-time digest.
pub fn check(root: &Path, files: &[String], digests: &BTreeMap<&str, &str>) -> Result<()> {
    let mut changed = Vec::new();
    for f in files.iter().map(String::as_str) {
        let path = root.join(f);
        let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        if digests.get(f).is_none_or(|d| *d != sha256_hex(&bytes)) {
            changed.push(f);
        }
    }
    anyhow::ensure!(
        changed.is_empty(),
        "{} source file(s) under {} differ from the ones this binary was compiled from ({}): rebuild the binary, or run the one built from this tree",
        changed.len(),
        root.display(),
        changed.iter().take(5).copied().collect::<Vec<_>>().join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digests() -> BTreeMap<&'static str, &'static str> {
        parse_digests("aa  Cargo.toml\nbb  Cargo.lock\ncc  build.rs\ndd  src/lib.rs\nee  src/a b.rs\nff  kernels/x.cu\n")
    }

    #[test]
    fn the_depinfo_gives_the_crates_sources_and_nothing_else() {
        let text = "/r/target/debug/pipeline: /r/build.rs /r/kernels /r/src/lib.rs /r/src/a\\ b.rs /r/target/debug/build/p-1/out/source_digests.txt /elsewhere/x.rs /r/Cargo.lock\n\n/r/src/lib.rs:\n";
        let files = from_depinfo(text, Path::new("/r"), &digests()).unwrap();
        assert_eq!(files, ["Cargo.toml", "build.rs", "src/a b.rs", "src/lib.rs"]);
        // rustc's own dep-info names files relative to the crate root.
        let files = from_depinfo("deps/p-1: src/lib.rs src/../build.rs\n", Path::new("/r"), &digests()).unwrap();
        assert_eq!(files, ["Cargo.toml", "build.rs", "src/lib.rs"]);
        assert!(from_depinfo("", Path::new("/r"), &digests()).is_err());
        assert!(from_depinfo("x: /r/kernels/x.cu\n", Path::new("/r"), &digests()).unwrap_err().to_string().contains("no Rust"));
    }

    /// This test binary's own dep-info lists this file, and its bytes are the compiled ones.
    #[test]
    fn this_binary_knows_its_sources() {
        let s = of_this_binary().unwrap();
        assert!(s.files.iter().any(|f| f == "src/artifact/bundle/sources.rs"), "{:?}", s.files);
        assert!(s.files.iter().all(|f| s.root.join(f).is_file()));
        assert!(!s.files.iter().any(|f| f.starts_with("tests/") || f == LOCK));
    }

    #[test]
    fn another_builds_list_is_refused() {
        let full: Vec<String> = ["src/lib.rs", "src/cli/verify.rs"].map(String::from).to_vec();
        let lean: Vec<String> = vec!["src/lib.rs".into()];
        let tools = vec!["tools".to_string()];
        same_features(&full, &tools).unwrap();
        same_features(&lean, &[]).unwrap();
        let e = same_features(&lean, &tools).unwrap_err().to_string();
        assert!(e.contains("lacks src/cli/verify.rs") && e.contains("with the feature `tools`"), "{e}");
        let e = same_features(&full, &[]).unwrap_err().to_string();
        assert!(e.contains("lists src/cli/verify.rs") && e.contains("without the feature `tools`"), "{e}");
    }

    #[test]
    fn a_changed_file_is_refused() {
        let dir = std::env::temp_dir().join(format!("pipeline-sources-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::write(dir.join("src/lib.rs"), "fn a() {}").unwrap();
        let text = format!("{}  src/lib.rs\n", sha256_hex(b"fn a() {}"));
        let d = parse_digests(&text);
        check(&dir, &["src/lib.rs".into()], &d).unwrap();
        std::fs::write(dir.join("src/lib.rs"), "fn b() {}").unwrap();
        let e = check(&dir, &["src/lib.rs".into()], &d).unwrap_err().to_string();
        assert!(e.contains("src/lib.rs") && e.contains("differ"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
