//! Helpers shared by the integration tests: run the real binary in a scratch directory.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pipeline::report::document::Report;

pub mod tiny;

/// The `pipeline` binary under test.
pub fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipeline"));
    for (k, _) in std::env::vars() {
        if k.starts_with("PIPELINE_") {
            c.env_remove(k);
        }
    }
    c
}

/// The repository's root.
pub fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, recursively, sorted by path.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for p in std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()) {
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, &mut out);
    out.sort();
    out
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pipeline-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The repository's synthetic pipeline config.
pub fn synthetic_toml() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("pipelines/synthetic.toml")
}

/// Runs `pipeline run CONFIG --out OUT -q --set ...` and returns the output.
pub fn run(config: &Path, out: &Path, sets: &[&str]) -> Output {
    let mut c = bin();
    c.arg("run").arg(config).arg("--out").arg(out).arg("-q");
    for s in sets {
        c.arg("--set").arg(s);
    }
    c.output().expect("the binary runs")
}

/// Reads RUN_DIR/report.json.
pub fn report(out: &Path) -> Report {
    Report::load(out).unwrap_or_else(|e| panic!("report in {}: {e:#}", out.display()))
}

/// stdout and stderr as text, for assertion messages.
pub fn text(o: &Output) -> String {
    format!("--- stdout\n{}\n--- stderr\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A scratch directory, removed when the test passes, kept for a look when it fails.
pub struct Dir(pub PathBuf);

impl std::ops::Deref for Dir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Waits for `child` to exit, killing it (and failing) if it takes longer than `limit`.
pub fn wait_or_kill(child: &mut std::process::Child, limit: std::time::Duration, what: &str) -> std::process::ExitStatus {
    let t = std::time::Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {limit:?}: hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Non-zero exit, no panic, and stderr holds every fragment.
pub fn assert_fails(o: &Output, fragments: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "expected a failure\n{}", text(o));
    assert!(!err.contains("panicked"), "panic\n{}", text(o));
    for f in fragments {
        assert!(err.contains(f), "`{f}` not in stderr\n{}", text(o));
    }
}

/// Reads a `report.html` and checks that it is one self-contained, well-formed page: a whole
/// document, every `<svg>`, `<div>` and `<table>` closed, no script, and no address but the SVG
/// namespace's (nothing fetched). Returns its text.
pub fn html_page(path: &Path) -> String {
    let page = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(page.starts_with("<!DOCTYPE html>") && page.trim_end().ends_with("</html>"), "{}: not a whole page", path.display());
    for tag in ["svg", "div", "table", "figure", "section"] {
        let (open, close) = (page.matches(&format!("<{tag}")).count(), page.matches(&format!("</{tag}>")).count());
        assert_eq!(open, close, "{}: {open} <{tag}> but {close} </{tag}>", path.display());
    }
    assert!(!page.to_lowercase().contains("<script"), "{}: holds a script", path.display());
    let outside = page.replace("http://www.w3.org/2000/svg", "");
    assert!(!outside.contains("http://") && !outside.contains("https://"), "{}: refers to the network", path.display());
    page
}
