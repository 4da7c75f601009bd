//! `pipeline project`: the N-rank step predicted from a tiny real one-rank CPU run (the
//! engine executor), its JSON and text, and the runs it refuses with the file named. No
//! assertion here depends on how fast the machine is: the prediction's error against a measured
//! two-rank run is `scripts/projection-check.sh`'s to measure (docs/ranks.md).

mod common;

use std::path::Path;

use common::{bin, scratch, text, tiny};
use serde_json::Value;

fn project(run: &Path, args: &[&str]) -> std::process::Output {
    bin().arg("project").arg(run).args(args).output().expect("the binary runs")
}

/// A run directory without report.json, and one whose report.json another tool wrote, are
/// refused with exit 1 and the file named.
#[test]
fn a_missing_or_foreign_report_is_refused() {
    let d = scratch("project-refused");
    let o = project(&d, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("report.json"), "{}", text(&o));
    std::fs::write(d.join("report.json"), r#"{"tool": "something else", "steps": 3}"#).unwrap();
    let o = project(&d, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains(&d.join("report.json").display().to_string()) && e.contains("not a report written by"), "{e}");
}

/// A tiny one-rank engine run projected onto 2 and 1 ranks: the JSON holds the measured
/// figures, the buckets (every gradient byte once, ready within the pass), the prediction and
/// the records; on one rank the prediction is the measured step again with no communication;
/// the text says it is a prediction; a report of several ranks is refused.
#[test]
fn a_tiny_cpu_run_is_projected() {
    let c = tiny::corpus("project");
    let run = scratch("project-run");
    let cfg = tiny::config(&c);
    tiny::train_ok(&cfg, &run, &["stages.train.impl=\"engine\"", "train.iterations=4", "train.val_every=0", "train.grad_accum_steps=2"]);

    let o = project(&run, &["--nproc", "2", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    let (m, p) = (&j["measured"], &j["projection"]);
    assert_eq!(j["executor"], "engine");
    assert_eq!(m["micro_steps"], 2);
    assert_eq!(p["nproc"], 2);
    assert_eq!(p["micro_steps"], 1, "the global batch: 2 micro-batches over 2 ranks");
    let buckets = m["buckets"].as_array().unwrap();
    assert!(!buckets.is_empty());
    let bytes: f64 = buckets.iter().map(|b| b["bytes"].as_f64().unwrap()).sum();
    // Every parameter of the tiny model has a gradient: 4 bytes each.
    let params = tiny::f(&common::report(&run).train, "model_params");
    assert_eq!(bytes, 4.0 * params, "{buckets:?}");
    assert!(buckets.iter().all(|b| (0.0..=1.0).contains(&b["ready"].as_f64().unwrap())));
    let f = |v: &Value| v.as_f64().unwrap();
    assert!(f(&p["step_ms"]) > 0.0 && f(&p["exposed_ms"]) >= 0.0 && f(&p["exposed_ms"]) <= f(&p["comm_ms"]) + 1e-9);
    assert!((f(&p["step_ms"]) - f(&p["compute_ms"]) - f(&p["exposed_ms"])).abs() < 1e-9);
    assert_eq!(p["steps_in_budget"].as_u64().unwrap(), (600_000.0 / f(&p["step_ms"])).floor() as u64);
    assert_eq!(j["records"].as_array().unwrap().len(), 2);
    assert_eq!(j["records"][1]["name"], "04-27");

    // One rank: the measured step (less any part of it below the phases' sum), nothing exchanged.
    let o = project(&run, &["--nproc", "1", "--json", "--ns-share", "0.5"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let one: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(one["projection"]["comm_ms"], 0.0);
    assert_eq!(one["ns_share_from"], "--ns-share");
    assert!(f(&one["projection"]["step_ms"]) >= f(&one["measured"]["step_ms"]) - 1e-6, "{one}");

    let o = project(&run, &["--nproc", "8", "--link-gbs", "100", "--budget-s", "60"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    for want in ["PREDICTION", "8 ranks", "100 GB/s", "steps in 60 s", "04-09", "04-27", "assumptions:", "do not divide among 8 ranks"] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    assert_eq!(project(&run, &["--link-gbs", "0"]).status.code(), Some(1));
    for nproc in ["0", "1000000"] {
        let o = project(&run, &["--nproc", nproc]);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        assert!(String::from_utf8_lossy(&o.stderr).contains("--nproc must be between 1 and 65,536"), "{}", text(&o));
    }

    // A report of two ranks is no one-rank run.
    let path = run.join("report.json");
    let mut r: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    r["train"]["world_size"] = 2.into();
    std::fs::write(&path, serde_json::to_vec(&r).unwrap()).unwrap();
    let o = project(&run, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("a run on 2 ranks"), "{}", text(&o));
}
