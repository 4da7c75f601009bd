//! The stages after the step executor, through the real binary on the tiny model of
//! `common::tiny`: exact resume (N steps = N/2 steps + Ctrl-C + `--resume` + the rest, bit for
//! bit, with the same data fingerprint at every step), EMA and SWA averaging, the artifact
//! stage's round trip, sliding-window and score-first TTT evaluation with the records' log
//! lines, and every one of these stages' histograms in the report.

mod common;

use std::path::Path;
use std::time::Duration;

use common::tiny::*;
use common::{report, text, wait_or_kill};
use serde_json::Value;

/// `steps.tsv` without its time columns: (step, train_loss, lr_mul, data fingerprint).
fn step_rows(out: &Path) -> Vec<(u64, String, String, String)> {
    let t = std::fs::read_to_string(out.join("steps.tsv")).unwrap();
    let mut lines = t.lines();
    assert_eq!(lines.next(), Some(pipeline::train::log::STEP_TABLE_HEADER));
    lines
        .map(|l| {
            let c: Vec<&str> = l.split('\t').collect();
            assert_eq!(c.len(), 8, "{l}");
            let phase = |i: usize| c[i].parse::<f64>().unwrap_or_else(|_| panic!("phase time {:?} in {l}", c[i]));
            assert!(phase(5) > 0.0 && phase(6) > 0.0 && phase(7) >= 0.0, "the step's forward, backward and optimizer ms: {l}");
            (c[0].parse().unwrap(), c[1].into(), c[2].into(), c[4].into())
        })
        .collect()
}

fn log_of(out: &Path) -> String {
    std::fs::read_to_string(out.join("train.log")).unwrap_or_default()
}

/// The issue's acceptance test: an uninterrupted run of N steps and a run interrupted by Ctrl-C
/// part-way, then resumed from its run directory, agree bit for bit: every step's loss and LR
/// multiplier, the data fingerprint at every step, the final weights, the EMA (through the
/// artifact made from it) and the final validation loss.
#[test]
fn ctrl_c_and_resume_equal_an_uninterrupted_run() {
    let c = corpus("resume");
    let n = 60;
    let iters = format!("train.iterations={n}");
    let sets = [iters.as_str(), "train.val_every=0", "train.log_every=1"];
    let cfg = config_plus(&c, "resume", &after_training_sliding());
    let whole = c.dir.join("whole");
    let o = run_limited(&cfg, &whole, &sets);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));

    let split = c.dir.join("split");
    let mut cmd = common::bin();
    cmd.arg("run").arg(&cfg).arg("--out").arg(&split).arg("-q");
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    let mut child = cmd.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap();
    wait_for_line(&mut child, &split, |l| l.starts_with(&format!("step:{}/", n / 4)));
    sigint(&child);
    let status = wait_or_kill(&mut child, Duration::from_secs(60), "interrupted run");
    assert_eq!(status.code(), Some(130), "{}", log_of(&split));
    let stopped = report(&split).train["steps"].as_u64().unwrap();
    assert!(stopped > 0 && stopped < n, "Ctrl-C landed at step {stopped} of {n}: the test needs a step in between");
    let newest = pipeline::train::checkpoint::list(&split.join("checkpoints")).unwrap().last().cloned().unwrap();
    assert_eq!(newest.0, stopped, "Ctrl-C saves a checkpoint of the last finished step");

    let o = run_args(&cfg, &["--resume", split.to_str().unwrap(), "--set", sets[0], "--set", sets[1], "--set", sets[2]]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let log = log_of(&split);
    assert!(log.contains(&format!("resume: {} step:{stopped} ", newest.1.display())), "{log}");

    let (a, b) = (step_rows(&whole), step_rows(&split));
    assert_eq!(a.len() as u64, n);
    assert_eq!(a, b, "steps.tsv (losses, LR multipliers, data fingerprints) must match step for step");
    let (ra, rb) = (report(&whole), report(&split));
    assert_eq!(ra.train["val_loss"], rb.train["val_loss"]);
    assert_eq!(ra.train["train_loss"], rb.train["train_loss"]);
    assert_eq!(rb.train["resumed_from_step"], Value::from(stopped));
    let bytes = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap_or_else(|e| panic!("{}: {e}", d.join(f).display()));
    assert!(bytes(&whole, "final_model.safetensors") == bytes(&split, "final_model.safetensors"), "final weights differ");
    let art = "final_model.int8.zlib.pgqz";
    assert!(bytes(&whole, art) == bytes(&split, art), "the artifacts (made from the EMA) differ: the EMA did not resume exactly");
    assert_eq!(ra.sections["eval"]["sliding"]["val_bpb"], rb.sections["eval"]["sliding"]["val_bpb"]);
}

/// Every stage after training shows up with its histograms, the log has the records' lines,
/// and the report has the sections: averaging, checkpoint, artifact, eval (sliding and TTT).
#[test]
fn stages_after_training_report_and_log() {
    let c = corpus("after");
    let cfg = config_plus(&c, "after", &after_training());
    let out = c.dir.join("out");
    let (_, o) = train_ok(&cfg, &out, &["train.iterations=30"]);
    let r = report(&out);
    let extra = |stage: &str, h: &str| {
        let s = &r.stages[stage];
        assert!(s.extra_us.get(h).is_some_and(|x| x.count > 0), "stage {stage} has no `{h}` histogram: {:?}", s.extra_us.keys());
    };
    extra("train", "snapshot");
    extra("ema", "update");
    extra("ckpt", "serialize");
    extra("ckpt", "write");
    extra("artifact", "quantize");
    extra("artifact", "eval");
    extra("eval", "sliding");
    extra("eval", "chunk_score");
    extra("eval", "chunk_train");
    // The steady phase ends with the executor (the verdict's focus): its window stops before
    // the artifact and the evaluation after training, whose windows run to the end of the run.
    assert_eq!(r.verdict.focus, "train");
    let after_s = ["sliding", "chunk_score", "chunk_train"].iter().map(|h| r.stages["eval"].extra_us[*h].total_ms).sum::<f64>() / 1e3;
    let (train_s, eval_s) = (r.stages["train"].steady_s, r.stages["eval"].steady_s);
    assert!(train_s + after_s / 2.0 < eval_s, "train's window {train_s} s, eval's {eval_s} s, evaluation after training {after_s} s");

    let avg = &r.sections["averaging"];
    assert_eq!(avg["kind"], "ema");
    assert_eq!(avg["snapshots"], 31, "the initial weights and 30 steps");
    let ck = &r.sections["checkpoint"];
    let steps: Vec<u64> = ck["written"].as_array().unwrap().iter().map(|w| w["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [5, 10, 15, 20, 25, 30]);
    let kept: Vec<u64> = pipeline::train::checkpoint::list(&out.join("checkpoints")).unwrap().iter().map(|x| x.0).collect();
    assert_eq!(kept, [25, 30], "keep = 2");
    let art = &r.sections["artifact"];
    assert_eq!(art["weights"], "ema");
    assert!(art["fits_cap"].as_bool().unwrap());
    assert_eq!(art["bytes"].as_u64().unwrap(), std::fs::metadata(out.join("final_model.int8.zlib.pgqz")).unwrap().len());
    let ev = &r.sections["eval"];
    assert_eq!(ev["weights"], "quantized");
    let (sl, tt) = (&ev["sliding"], &ev["ttt"]);
    assert_eq!(sl["val_tokens"], tt["val_tokens"], "TTT scores every target the sliding pass scores, once");
    assert_eq!(sl["val_tokens"].as_u64(), r.train["val_tokens"].as_u64(), "the same targets as validation");
    assert!(tt["chunks"].as_u64().unwrap() >= 2);
    assert_ne!(sl["val_bpb"], tt["val_bpb"], "TTT trained on nothing");

    let log = log_of(&out);
    for prefix in [
        "ema:applying EMA weights",
        "checkpoint: step:5 ",
        "checkpoint: step:30 ",
        "Serialized model int8+zlib: ",
        "pre-quantization post-ema val_loss:",
        "final_int8_zlib_roundtrip val_loss:",
        "final_int8_zlib_roundtrip_exact val_loss:",
        "quantized_sliding_window val_loss:",
        "quantized_ttt val_loss:",
    ] {
        assert!(log.lines().any(|l| l.starts_with(prefix)), "no `{prefix}` line in train.log\n{log}\n{}", text(&o));
    }
    // The records' format: `<label> val_loss:%.8f val_bpb:%.8f eval_time:%.0fms`.
    let l = log.lines().find(|l| l.starts_with("quantized_ttt ")).unwrap();
    let f: Vec<&str> = l.split(' ').collect();
    assert_eq!(f.len(), 4, "{l}");
    for (field, key) in f[1..3].iter().zip(["val_loss:", "val_bpb:"]) {
        let v = field.strip_prefix(key).unwrap_or_else(|| panic!("{l}"));
        assert_eq!(v.split('.').nth(1).map(str::len), Some(8), "{l}");
    }
    assert!(f[3].starts_with("eval_time:") && f[3].ends_with("ms"), "{l}");
    let bpb: f64 = f[2].strip_prefix("val_bpb:").unwrap().parse().unwrap();
    assert!((bpb - tt["val_bpb"].as_f64().unwrap()).abs() < 1e-7);
}

/// SWA folds in the weights of every `every`-th step once the LR multiplier is below
/// `start_lr_mul`; `none` averages nothing and evaluation falls back to the last weights.
#[test]
fn swa_and_none_average_as_configured() {
    let c = corpus("swa");
    let tail = r#"
[stages.avg]
kind = "ema_swa"
impl = "swa"
inputs = ["train"]
every = 4
start_lr_mul = 0.5

[stages.eval]
kind = "ttt_eval"
impl = "sliding"
inputs = ["avg"]
stride = 32
"#;
    let cfg = config_plus(&c, "swa", tail);
    let out = c.dir.join("swa");
    // 40 steps with a 20-step warm-down: the multiplier is below 0.5 from step 31 on
    // ((40 - s) / 20 < 0.5), so steps 32, 36 and 40 are averaged.
    train_ok(&cfg, &out, &["train.iterations=40", "train.warmdown_iters=20"]);
    let r = report(&out);
    assert_eq!(r.sections["averaging"]["snapshots"], 3, "{:?}", r.sections["averaging"]);
    assert_eq!(r.sections["averaging"]["last_step"], 40);
    assert_eq!(r.sections["eval"]["weights"], "swa");
    let sliding_swa = r.sections["eval"]["sliding"]["val_bpb"].as_f64().unwrap();

    let none = config_plus(&c, "none", &tail.replace("impl = \"swa\"", "impl = \"none\"").replace("every = 4\nstart_lr_mul = 0.5\n", ""));
    let out = c.dir.join("none");
    train_ok(&none, &out, &["train.iterations=40", "train.warmdown_iters=20"]);
    let r = report(&out);
    assert!(!r.sections.contains_key("averaging"));
    assert_eq!(r.sections["eval"]["weights"], "final");
    let sliding_final = r.sections["eval"]["sliding"]["val_bpb"].as_f64().unwrap();
    assert_ne!(sliding_swa, sliding_final, "the SWA weights must differ from the last step's");
    // Stride = seq_len: the sliding pass is the non-overlapping validation, target for target.
    let v = r.train["val_loss"].as_f64().unwrap();
    let s = r.sections["eval"]["sliding"]["val_loss"].as_f64().unwrap();
    assert!((v - s).abs() < 1e-5, "validation {v} vs sliding window with stride = seq_len {s}");
}
