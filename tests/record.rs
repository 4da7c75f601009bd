//! The record recipe's elements through the real binary, on the tiny model of `common::tiny`
//! with every `[model]` element on: the depth-recurrence switch mid-run with its log line,
//! exact resume across the switch (Ctrl-C after it, `--resume`, the rest: bit for bit the
//! uninterrupted run), and a checkpoint refused by a config of another architecture, with the
//! differing key named; and the parts of scripts/compare-record.py that need no torch.

mod common;

use std::path::Path;
use std::time::Duration;

use common::tiny::*;
use common::{assert_fails, bin, report, text, wait_or_kill};

/// Every model element of the record on the tiny model (3 blocks, head dim 16): blocks 1..=1
/// run twice once looped ([0, 1, 1, 2]), looping on at half of training.
const RECORD_MODEL: [&str; 12] = [
    "model.num_layers=3",
    "model.mlp_activation=\"leaky_relu2\"",
    "model.ln_scale=true",
    "model.parallel_residual_start=2",
    "model.skip_gates=true",
    "model.rope_dims=8",
    "model.xsa_last_n=3",
    "model.loop_start=1",
    "model.loop_end=1",
    "model.num_loops=1",
    "model.enable_looping_at=0.5",
    "model.qk_gain_init=5.25",
];

/// `steps.tsv` without its time columns (the training time, then the phases').
fn step_rows(out: &Path) -> Vec<String> {
    let t = std::fs::read_to_string(out.join("steps.tsv")).unwrap();
    t.lines()
        .skip(1)
        .map(|l| l.split('\t').enumerate().filter(|(i, _)| *i != 3 && *i < 5).map(|(_, c)| c).collect::<Vec<_>>().join("\t"))
        .collect()
}

fn log_of(out: &Path) -> String {
    std::fs::read_to_string(out.join("train.log")).unwrap_or_default()
}

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = Vec::new();
    for s in RECORD_MODEL.iter().chain(extra) {
        v.push("--set");
        v.push(s);
    }
    v
}

#[test]
fn looping_switches_mid_run_and_resume_across_it_is_exact() {
    let c = corpus("record");
    let n = 40;
    let iters = format!("train.iterations={n}");
    let sets: Vec<&str> = RECORD_MODEL.iter().copied().chain([iters.as_str(), "train.val_every=0", "train.log_every=1"]).collect();
    let cfg = config_plus(&c, "record", &after_training_sliding());
    let whole = c.dir.join("whole");
    let o = run_limited(&cfg, &whole, &sets);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let log = log_of(&whole);
    let switch = "layer_loop:enabled step:20 frac:0.500 encoder:[0, 1] decoder:[1, 2]";
    assert_eq!(log.matches("layer_loop:enabled").count(), 1, "{log}");
    assert!(log.contains(switch), "{log}");
    assert!(
        log.contains("model_elements: mlp:leaky_relu2(0.5) rope_dims:8/16 ln_scale xsa_last_n:3 skip_gates parallel_residual_start:2"),
        "{log}"
    );
    assert!(log.contains("layer_loop:blocks 1..=1 x2 from training fraction 0.5 unlooped encoder:[0] decoder:[1, 2]"), "{log}");

    // Interrupted after the switch, then resumed.
    let split = c.dir.join("split");
    let mut cmd = common::bin();
    cmd.arg("run").arg(&cfg).arg("--out").arg(&split).arg("-q");
    for s in &sets {
        cmd.arg("--set").arg(s);
    }
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    wait_for_line(&mut child, &split, |l| l.starts_with("step:26/"));
    sigint(&child);
    let status = wait_or_kill(&mut child, Duration::from_secs(60), "interrupted run");
    assert_eq!(status.code(), Some(130), "{}", log_of(&split));
    let stopped = report(&split).train["steps"].as_u64().unwrap();
    assert!(stopped > 20 && stopped < n, "Ctrl-C landed at step {stopped}: the test needs one after the switch at 20");
    let o = run_args(
        &cfg,
        &[&["--resume", split.to_str().unwrap()][..], &args(&[iters.as_str(), "train.val_every=0", "train.log_every=1"])].concat(),
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let log = log_of(&split);
    assert!(log.contains("layer_loop:enabled (the checkpoint's layout) encoder:[0, 1] decoder:[1, 2]"), "{log}");
    assert_eq!(step_rows(&whole), step_rows(&split), "steps.tsv must match step for step across the switch");
    let bytes = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap();
    assert!(bytes(&whole, "final_model.safetensors") == bytes(&split, "final_model.safetensors"), "final weights differ");
    let art = "final_model.int8.zlib.pgqz";
    assert!(bytes(&whole, art) == bytes(&split, art), "the artifacts differ");

    // A config of another architecture is refused, the key named, even where shapes agree.
    for (key, set) in [("model.xsa_last_n", "model.xsa_last_n=1"), ("model.enable_looping_at", "model.enable_looping_at=0.25")] {
        let o = run_args(&cfg, &[&["--resume", split.to_str().unwrap()][..], &args(&["train.iterations=60", set])].concat());
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert_fails(&o, &[key, "the architecture must not change on resume"]);
    }
}

/// scripts/compare-record.py's own checks of what needs no torch (unpacking the record's packed
/// script, the Python 3.12 f-strings rewritten for 3.11, a patch that does not apply stopping
/// it with code 2); skipped, said so, where there is no python3.
#[test]
fn the_comparison_script_checks_itself() {
    let script = common::root().join("scripts/compare-record.py");
    let Ok(o) = std::process::Command::new("python3").arg(&script).arg("--self-test").output() else {
        eprintln!("the_comparison_script_checks_itself: skipped: no python3");
        return;
    };
    assert!(o.status.success(), "{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("self-test: ok"));
}

/// The 04-27 keys' bad values are refused by `pipeline validate` (exit 2, no panic), each
/// naming its key: a gate window outside the width, a lane start past the layers or inside the
/// loop, both forms of parallel blocks at once, a `bos_id` the tokenizer does not start
/// documents with, and Polar Express past its five steps.
#[test]
fn the_04_27_keys_refuse_bad_values_by_name() {
    let c = corpus("record0427-bad");
    let cfg = config(&c);
    let cases: [(&[&str], &[&str]); 7] = [
        (&["model.smear_gate=true", "model.smear_gate_window=4096"], &["`model.smear_gate_window` (4096)"]),
        (&["model.attn_gate=true", "model.attn_gate_window=0"], &["`model.attn_gate_window` (0)"]),
        (&["model.num_layers=3", "model.parallel_decoder_start=3"], &["`model.parallel_decoder_start` (3)"]),
        (
            &["model.num_layers=3", "model.num_loops=1", "model.loop_start=1", "model.loop_end=1", "model.parallel_decoder_start=1"],
            &["`model.parallel_decoder_start` (1) must come after the loop range"],
        ),
        (
            &["model.num_layers=3", "model.parallel_residual_start=1", "model.parallel_decoder_start=2"],
            &["`model.parallel_residual_start`"],
        ),
        (&["model.document_attention=true", "model.bos_id=2"], &["`model.bos_id` = 2", "starts documents with 1"]),
        (&["train.muon_ns=\"polar_express\"", "train.muon_backend_steps=6"], &["`train.muon_backend_steps` = 6"]),
    ];
    for (sets, fragments) in cases {
        let mut cmd = bin();
        cmd.arg("validate").arg(&cfg);
        for s in sets {
            cmd.arg("--set").arg(s);
        }
        let o = cmd.output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{sets:?}: {}", text(&o));
        assert_fails(&o, fragments);
    }
}
