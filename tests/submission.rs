//! `pipeline submission` through the binary on tiny runs of the record's graph (EMA,
//! checkpoints, the quantized artifact, score-first TTT): three seeds against a baseline's
//! three seeds of a tenth of the training pass every check, and the records folder holds the
//! runs' own figures; the baseline against them is not a record (the folder written for the
//! non-record track, exit 1); a missing seed is refused with the figure and no folder; an
//! unreadable run directory is bad input.

mod common;

use std::path::{Path, PathBuf};

use common::text;
use common::tiny::*;
use serde_json::Value;

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn seeds(cfg: &Path, root: &Path, tag: &str, iterations: u64) -> Vec<PathBuf> {
    [42u64, 0, 1234]
        .iter()
        .map(|s| {
            let out = root.join(format!("{tag}{s}"));
            let (seed, iters) = (format!("run.seed={s}"), format!("train.iterations={iterations}"));
            train_ok(cfg, &out, &[&seed, &iters, "train.val_every=0"]);
            out
        })
        .collect()
}

fn submission(runs: &[PathBuf], against: &[PathBuf], out: &Path) -> std::process::Output {
    let mut c = common::bin();
    c.arg("submission").args(runs).arg("--out").arg(out).args(["--audit-tokens", "1024", "--name", "Tiny test entry"]);
    if !against.is_empty() {
        c.arg("--against").args(against);
    }
    c.output().unwrap()
}

#[test]
fn three_seeds_against_their_baseline_make_the_records_folder() {
    let c = corpus("submission");
    let cfg = config_plus(&c, "sub", &after_training());
    let ours = seeds(&cfg, &c.dir, "seed", 40);
    let base = seeds(&cfg, &c.dir, "base", 4);
    let out = c.dir.join("records/2026-11-27_Tiny");

    // Two seeds are one short: refused with the figure, and no folder.
    let o = submission(&ours[..2], &base, &out);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("FAIL seeds: 2 distinct seed(s): 0, 42: 1 missing"), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no folder written") && !out.exists(), "{}", text(&o));

    let o = submission(&ours, &base, &out);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    for name in [
        "runs finished",
        "seeds",
        "one config",
        "size seed 42",
        "train time seed 0",
        "eval time seed 1234",
        "val split",
        "val bytes",
        "legality",
        "significance",
    ] {
        assert!(stdout.lines().any(|l| l.starts_with(&format!("PASS {name}:"))), "no PASS {name}:\n{}", text(&o));
    }

    // The folder holds each run's own figures.
    let readme = std::fs::read_to_string(out.join("README.md")).unwrap();
    let sub = json(&out.join("submission.json"));
    let mut bpbs = Vec::new();
    for (dir, seed) in ours.iter().zip([42, 0, 1234]) {
        let r = json(&dir.join("report.json"));
        let ttt = r["eval"]["ttt"]["val_bpb"].as_f64().unwrap();
        let (model, code) = (r["artifact"]["bytes"].as_u64().unwrap(), r["artifact"]["code_bytes"].as_u64().unwrap());
        bpbs.push(ttt);
        let row = format!(
            "| {seed} | 40 | {:.1} | {:.5} | {:.5} | **{ttt:.5}** |",
            r["train"]["step_avg_ms"].as_f64().unwrap(),
            r["artifact"]["before"]["val_bpb"].as_f64().unwrap(),
            r["artifact"]["after"]["val_bpb"].as_f64().unwrap()
        );
        assert!(readme.contains(&row), "no row {row} in\n{readme}");
        let s = &sub["seed_results"][seed.to_string()];
        assert_eq!(s["artifact_bytes"].as_u64(), Some(model + code));
        assert_eq!(s["val_bpb"].as_f64(), Some(ttt));
        for f in [format!("train_seed{seed}.log"), format!("config_seed{seed}.toml"), format!("report_seed{seed}.html")] {
            assert!(out.join(&f).is_file(), "{f}");
        }
        assert_eq!(std::fs::read(out.join(format!("train_seed{seed}.log"))).unwrap(), std::fs::read(dir.join("train.log")).unwrap());
    }
    let mean = bpbs.iter().sum::<f64>() / 3.0;
    assert!((sub["val_bpb"].as_f64().unwrap() - mean).abs() < 1e-12, "{sub}");
    assert_eq!(sub["seeds"], serde_json::json!([42, 0, 1234]));
    assert!(sub["p_value"].as_f64().unwrap() < 0.01 && sub["delta_vs_leaderboard_nats"].as_f64().unwrap() < -0.005, "{sub}");
    assert!(
        !out.join("src").exists() && std::fs::read_dir(&out).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().ends_with(".rs"))
    );

    // The other way round the baseline is not beaten: every other rule holds, so the folder is
    // written for the non-record track, and the exit code says it is no record.
    let other = c.dir.join("records/not-a-record");
    let o = submission(&base, &ours, &other);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).lines().any(|l| l.starts_with("FAIL significance:")), "{}", text(&o));
    let sub = json(&other.join("submission.json"));
    assert_eq!(
        (sub["track"].as_str(), sub["record"].as_bool(), sub["passed"].as_bool()),
        (Some("non_record_16mb"), Some(false), Some(false))
    );
    assert!(std::fs::read_to_string(other.join("README.md")).unwrap().contains("**Not a record:**"));

    // Bad input: an --out that is not empty (refused before any check), an --against that is
    // neither a bpb nor a run directory, and a folder that is no run.
    let o = submission(&ours, &[], &out);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("already exists and is not empty") && o.stdout.is_empty(), "{}", text(&o));
    let o = submission(&ours, &[c.dir.join("1.0x")], &c.dir.join("other"));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("neither a val_bpb nor a run directory"), "{}", text(&o));
    // A folder that is no run.
    let o = submission(&[c.dir.join("nowhere")], &[], &c.dir.join("other"));
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a finished run directory"), "{}", text(&o));
}
