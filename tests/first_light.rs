//! `scripts/gpu-first-light.sh` with `SMOKE=1`: every part of the GPU first-light run (the
//! engine check, the baseline on both executors, graph replay against op-by-op launches, the
//! 04-09 and 04-27 records on the engine, the loader settings, the results folder) on the CPU
//! with a tiny model, on shards and a tokenizer made from the repository's prose, so that the
//! one prepared GPU call is not spent on a broken script. It checks the plumbing, not the GPU.

mod common;

use std::path::Path;
use std::process::Command;

use common::text;
use common::tiny::corpus;

/// Lays out the script's input folder: both data folders and both tokenizer names hold the
/// tiny corpus (the smoke trains the record's layers on it at width 64).
fn input(dir: &Path, c: &common::tiny::Corpus) {
    for sub in ["sp1024", "sp8192"] {
        std::fs::create_dir_all(dir.join(sub)).unwrap();
        for f in ["fineweb_train_000000.bin", "fineweb_val_000000.bin"] {
            std::fs::copy(c.dir.join("shards").join(f), dir.join(sub).join(f)).unwrap();
        }
    }
    std::fs::create_dir_all(dir.join("tokenizers")).unwrap();
    for name in ["fineweb_1024_bpe.model", "fineweb_8192_bpe.model"] {
        std::fs::copy(&c.tokenizer, dir.join("tokenizers").join(name)).unwrap();
    }
}

fn script(input: &Path, out: &Path, vocab: usize) -> std::process::Output {
    Command::new("bash")
        .arg(common::root().join("scripts/gpu-first-light.sh"))
        .arg(input)
        .arg(out)
        .env("SMOKE", "1")
        .env("SMOKE_VOCAB", vocab.to_string())
        .env("BIN", env!("CARGO_BIN_EXE_pipeline"))
        .env_remove("OUT")
        .output()
        .unwrap()
}

/// The smoke passes every part, and its results are what a device call can bring back: at
/// most 8 files of at most 16 MiB, with the summary, the engine check (text and JSON), the
/// runs and the GPU notes.
#[test]
fn the_first_light_script_runs_every_part_on_the_cpu() {
    let c = corpus("first-light");
    let (dir, out) = (c.dir.join("in"), c.dir.join("out"));
    input(&dir, &c);
    let o = script(&dir, &out, c.vocab);
    let all = text(&o);
    assert!(o.status.success(), "{all}");
    let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
    for line in [
        "(a) pipeline engine-check",
        "engine-check: ok",
        "baseline engine: steady",
        "baseline candle: steady",
        "engine / candle throughput",
        "graph replay vs op by op: final weights bit-identical",
        "record on the engine: steady",
        "record-0427 on the engine: steady",
        "record-0427 step 2: forward",
        "loader pageable + cpu: steady",
        "loader pageable + sync: steady",
        "executor input wait",
        "first light: every check passed",
    ] {
        assert!(summary.contains(line), "`{line}` missing from summary.txt:\n{summary}");
    }
    // Only the final snapshot syncs the mirror in the baseline (no stage needs a step's).
    assert!(summary.contains("mirror syncs: 1"), "{summary}");
    let files: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap()).collect();
    assert!(files.len() <= 8, "{} files", files.len());
    for f in &files {
        let len = f.metadata().unwrap().len();
        assert!(f.file_type().unwrap().is_file() && len <= 16 << 20, "{:?}: {len} bytes", f.path());
    }
    for name in ["summary.txt", "engine-check.txt", "engine-check.json", "runs.tar.gz", "gpu.txt"] {
        assert!(out.join(name).is_file(), "{name} missing");
    }
    let check: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("engine-check.json")).unwrap()).unwrap();
    assert_eq!(check["ok"], true);
}

/// A missing input (no binary, no shards) stops the script at once, naming the file and the
/// script that prepares the folder.
#[test]
fn the_first_light_script_names_a_missing_input() {
    let dir = common::scratch("first-light-missing");
    let o = Command::new("bash")
        .arg(common::root().join("scripts/gpu-first-light.sh"))
        .arg(dir.join("in"))
        .arg(dir.join("out"))
        .env("BIN", env!("CARGO_BIN_EXE_pipeline"))
        .env_remove("SMOKE")
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("sp1024/fineweb_train_000000.bin") && err.contains("first-light-pack.sh"), "{err}");
}
