//! Helpers shared by the integration tests: run the real binary in a scratch directory.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use pipeline::report::Report;

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
