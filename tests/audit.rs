//! `pipeline audit-eval` through the binary on the tiny corpus of `common::tiny`: a config's
//! score-first and phased evaluations (weights initialised from the seed) pass, with the
//! settings scaled to the prefix said in the report; the JSON report; exit 2 with the reason for
//! a missing path, a config without an evaluation and a corrupt artifact.

mod common;

use common::text;
use common::tiny::*;

fn audit(path: &std::path::Path, args: &[&str]) -> std::process::Output {
    common::bin().arg("audit-eval").arg(path).args(args).output().unwrap()
}

#[test]
fn audit_eval_passes_the_real_evaluations_and_refuses_bad_input() {
    let c = corpus("audit-eval");
    // Score-first TTT as the after-training tests configure it: its 512-token chunks become
    // 128 to give 3 chunks in 384 targets.
    let cfg = config_plus(&c, "score-first", &after_training());
    let o = audit(&cfg, &["--tokens", "384"]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("stage `eval` (ttt_eval/score_first) on the first 384 validation targets"), "{out}");
    assert!(out.contains("weights: initialised from run.seed = 1337"), "{out}");
    assert!(out.contains("adjusted: chunk_tokens 512 -> 128"), "{out}");
    assert!(out.contains("causality: PASS") && out.contains("documents: not applicable"), "{out}");
    assert!(String::from_utf8_lossy(&o.stdout).trim_end().ends_with("verdict: PASS"), "{out}");

    // Phased TTT with document attention claimed: both audits run; the JSON report.
    let cfg = config_plus(&c, "phased", &after_training_phased());
    let o = audit(&cfg, &["--tokens", "512", "--set", "model.document_attention=true", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!((r["implementation"].as_str(), r["tokens"].as_u64()), (Some("phased"), Some(512)), "{r}");
    assert_eq!(r["causality"]["passed"], true, "{r}");
    assert_eq!((r["documents"]["status"].as_str(), &r["documents"]["passed"]), (Some("checked"), &serde_json::json!(true)), "{r}");

    // Errors: exit 2, saying why.
    let missing = c.dir.join("no-such-run");
    let o = audit(&missing, &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("no-such-run: not found"), "{}", text(&o));
    let o = audit(&config(&c), &[]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("no `ttt_eval` stage"), "{}", text(&o));
    // A run directory whose report names a corrupt artifact.
    let run = c.dir.join("corrupt-run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::copy(c.dir.join("score-first.toml"), run.join("config.toml")).unwrap();
    let artifact = run.join("final_model.int8.zlib.pgqz");
    std::fs::write(&artifact, b"not an artifact").unwrap();
    let sha = pipeline::runtime::files::sha256_file(&artifact).unwrap();
    let report = |path: &str, sha: &str| serde_json::json!({ "artifact": { "path": path, "sha256": sha } }).to_string();
    std::fs::write(run.join("report.json"), report("final_model.int8.zlib.pgqz", &sha)).unwrap();
    let o = audit(&run, &["--tokens", "384"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("final_model.int8.zlib.pgqz: the artifact"), "{}", text(&o));
    // The folder given is judged, not the one the report was written in: a file that is not
    // the one the run recorded is refused, and so is a path that leaves the directory.
    std::fs::write(run.join("report.json"), report("final_model.int8.zlib.pgqz", &"0".repeat(64))).unwrap();
    let o = audit(&run, &["--tokens", "384"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("not the file the run wrote"), "{}", text(&o));
    let changed_config = serde_json::json!({ "run": { "files": { "config.toml": "0".repeat(64) } } }).to_string();
    std::fs::write(run.join("report.json"), changed_config).unwrap();
    let o = audit(&run, &["--tokens", "384"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("config.toml: its SHA-256 is") && text(&o).contains("not the file the run wrote"), "{}", text(&o));
    std::fs::write(run.join("report.json"), report("../score-first.toml", &sha)).unwrap();
    let o = audit(&run, &["--tokens", "384"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("outside the run directory"), "{}", text(&o));
}
