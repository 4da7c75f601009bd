//! `step_executor` impl "engine" through the real binary on the tiny model of `common::tiny`:
//! its validation loss after 20 steps within 2e-3 of the candle executor's, the same with
//! poisoned dead buffers bit for bit, exact resume from its own checkpoint and from the
//! candle executor's, the arena in the log and the report, and clear refusals of what the CPU
//! backends cannot run.

mod common;

use std::path::Path;

use common::text;
use common::tiny::*;

const STEPS: &[&str] = &["train.iterations=20", "train.val_every=0"];

fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    [STEPS, extra].concat()
}

fn bytes(d: &Path, f: &str) -> Vec<u8> {
    std::fs::read(d.join(f)).unwrap_or_else(|e| panic!("{}: {e}", d.join(f).display()))
}

/// The check: 20 steps of the same data, seed and schedule, f32 engine against the
/// candle executor: final validation losses within 2e-3 (and not bit-equal: another
/// implementation really ran); the engine's arena is logged and reported.
#[test]
fn engine_val_loss_is_the_candle_executors_after_20_steps() {
    let c = corpus("engine-20");
    let cfg = config(&c);
    let (candle, _) = train_ok(&cfg, &c.dir.join("candle"), &sets(&[]));
    let (engine, _) = train_ok(&cfg, &c.dir.join("engine"), &sets(&["stages.train.impl=engine"]));
    let (a, b) = (f(&candle, "val_loss"), f(&engine, "val_loss"));
    assert!((a - b).abs() < 2e-3, "val_loss candle {a} engine {b}");
    assert_ne!(a, b, "the engine must be another computation than candle's");
    assert!(candle["engine"].is_null());
    let arena = &engine["engine"];
    assert_eq!(arena["backend"], "cpu-f32");
    assert!(arena["arena_bytes"].as_u64().unwrap() > 0 && arena["regions"]["activations"].as_u64().unwrap() > 0, "{arena}");
    let log = std::fs::read_to_string(c.dir.join("engine/train.log")).unwrap();
    assert!(log.lines().any(|l| l.starts_with("engine: cpu f32 arena ")), "{log}");
}

/// Poison fills every dead buffer with NaN around each pass: a run with it is the run
/// without it, bit for bit (no op reads what its pass did not write).
#[test]
fn poisoned_engine_trains_bit_for_bit_the_same() {
    let c = corpus("engine-poison");
    let cfg = config(&c);
    let plain = c.dir.join("plain");
    let poisoned = c.dir.join("poisoned");
    train_ok(&cfg, &plain, &sets(&["stages.train.impl=engine"]));
    train_ok(&cfg, &poisoned, &sets(&["stages.train.impl=engine", "stages.train.poison=true"]));
    assert!(bytes(&plain, "final_model.safetensors") == bytes(&poisoned, "final_model.safetensors"));
}

/// Resume from the checkpoint at step 10 (the engine's own, then the candle executor's) and
/// train to 20: the engine's run continues bit for bit; from candle's checkpoint it takes the
/// same weights and optimizer state (the names are shared) and lands within 2e-3 of it.
#[test]
fn engine_resumes_exactly_from_its_own_checkpoint_and_from_candles() {
    let c = corpus("engine-resume");
    let cfg = config_plus(&c, "resume", &ema_and_checkpoints(10, 4));
    let whole = c.dir.join("whole");
    let (full, _) = train_ok(&cfg, &whole, &sets(&["stages.train.impl=engine"]));
    let at_10 = |run: &Path| {
        let list = pipeline::train::checkpoint::list(&run.join("checkpoints")).unwrap();
        list.into_iter().find(|(s, _)| *s == 10).unwrap_or_else(|| panic!("no checkpoint at step 10 in {}", run.display())).1
    };
    let resumed = c.dir.join("resumed");
    let ck = at_10(&whole);
    let mut args = vec!["--resume", ck.to_str().unwrap(), "--out", resumed.to_str().unwrap()];
    let all = sets(&["stages.train.impl=engine"]);
    for s in &all {
        args.extend(["--set", s]);
    }
    let o = run_args(&cfg, &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(common::report(&resumed).train["resumed_from_step"], 10, "{}", text(&o));
    assert!(bytes(&whole, "final_model.safetensors") == bytes(&resumed, "final_model.safetensors"), "resumed weights differ");

    let by_candle = c.dir.join("candle");
    train_ok(&cfg, &by_candle, &sets(&[]));
    let crossed = c.dir.join("crossed");
    let ck = at_10(&by_candle);
    let mut args = vec!["--resume", ck.to_str().unwrap(), "--out", crossed.to_str().unwrap()];
    for s in &all {
        args.extend(["--set", s]);
    }
    let o = run_args(&cfg, &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = common::report(&crossed);
    assert_eq!(r.train["resumed_from_step"], 10);
    assert!((f(&r.train, "val_loss") - f(&full, "val_loss")).abs() < 2e-3);
}

/// The document-packing sampler (`packed_docs`: one row of the micro-batch's tokens, two
/// micro-batches a step, documents cut every 32) resumes where it stood: from the checkpoint at
/// step 10, the run ends bit for bit as the uninterrupted one, on the same batches after the
/// resume (the data fingerprints of steps 11-20).
#[test]
fn a_packed_run_resumes_exactly() {
    let c = corpus("packed-resume");
    let cfg = config_plus(&c, "resume", &ema_and_checkpoints(10, 4));
    let all = sets(&[
        "stages.train.impl=engine",
        "stages.sampler.impl=packed_docs",
        "model.document_attention=true",
        "model.document_max_len=32",
        "train.grad_accum_steps=2",
    ]);
    let whole = c.dir.join("whole");
    train_ok(&cfg, &whole, &all);
    let list = pipeline::train::checkpoint::list(&whole.join("checkpoints")).unwrap();
    let ck = list.into_iter().find(|(s, _)| *s == 10).expect("a checkpoint at step 10").1;
    let resumed = c.dir.join("resumed");
    let mut args = vec!["--resume", ck.to_str().unwrap(), "--out", resumed.to_str().unwrap()];
    for s in &all {
        args.extend(["--set", s]);
    }
    let o = run_args(&cfg, &args);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(common::report(&resumed).train["resumed_from_step"], 10, "{}", text(&o));
    let fingerprints = |d: &Path| -> Vec<String> {
        let t = String::from_utf8(bytes(d, "steps.tsv")).unwrap();
        t.lines().skip(1).map(|l| l.split('\t').nth(4).unwrap().to_string()).collect()
    };
    let (a, b) = (fingerprints(&whole), fingerprints(&resumed));
    assert_eq!(a[10..], b[b.len() - 10..], "the batches after the resume");
    assert!(bytes(&whole, "final_model.safetensors") == bytes(&resumed, "final_model.safetensors"), "resumed weights differ");
}

/// What the CPU backends cannot run is refused before training, naming the key.
#[test]
fn engine_refuses_bf16_naming_the_key() {
    let c = corpus("engine-bf16");
    let o = run_limited(&config(&c), &c.dir.join("out"), &sets(&["stages.train.impl=engine", "stages.train.dtype=bf16"]));
    assert_ne!(o.status.code(), Some(0));
    let t = text(&o);
    assert!(t.contains("`dtype`") && t.contains("bf16"), "{t}");
    // bf16 activations are the GPU backend's: refused on the CPU, naming the key; a typo in
    // its value names the key too.
    for (value, want) in [("bf16", "`activations`"), ("bf17", "activations")] {
        let set = format!("stages.train.activations=\"{value}\"");
        let o = run_limited(&config(&c), &c.dir.join(format!("out-{value}")), &sets(&["stages.train.impl=engine", &set]));
        assert_ne!(o.status.code(), Some(0));
        let t = text(&o);
        assert!(t.contains(want) && !t.contains("panicked"), "{value}: {t}");
    }
}

/// A GPU device for the engine in a binary built without CUDA is refused before training,
/// naming `run.device` and how to get a GPU build, without a panic.
#[cfg(not(feature = "cuda"))]
#[test]
fn engine_on_a_gpu_without_a_cuda_build_is_refused_naming_the_key() {
    let c = corpus("engine-gpu");
    let o = run_limited(&config(&c), &c.dir.join("out"), &sets(&["stages.train.impl=engine", "run.device=\"cuda:0\""]));
    assert_ne!(o.status.code(), Some(0));
    let t = text(&o);
    assert!(t.contains("`run.device`") && t.contains("cuda"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
}

/// `pipeline engine-check --device cpu`: every op case on one line within its bound, the whole
/// engine's f32 CPU backend against f64, and per-op timings (the small shape), exit 0; its
/// JSON has the same verdict and one entry per case.
#[test]
fn engine_check_on_the_cpu_passes_and_times_every_op() {
    let o = common::bin().args(["engine-check", "--device", "cpu"]).output().unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for line in ["ops against the CPU in f64", "rms_norm_bwd (write, then accumulate)", "embedding_bwd (the ids' CSR)", "cpu f32: loss"] {
        assert!(out.contains(line), "`{line}` missing:\n{out}");
    }
    assert!(out.contains("micro-batch, op by op") && out.contains("attention_bwd") && out.contains("as the trainer runs it"), "{out}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.lines().last().unwrap().contains("engine-check: ok"), "{out}");
    let o = common::bin().args(["engine-check", "--device", "cpu", "--timing", "none", "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["ok"], true);
    let ops = r["ops"].as_array().unwrap();
    assert!(ops.len() >= 40 && ops.iter().all(|l| l["ok"] == true), "{r}");
    assert_eq!(r["models"][0]["maths"], "cpu f32");
    assert!(r["timings"].is_null() && r["graphs"].is_null());
}

/// Bad arguments exit 2 naming the flag; a GPU in a CPU build exits 1 naming the build script.
#[test]
fn engine_check_refuses_bad_arguments() {
    for (args, want) in [
        (&["--device", "cpu", "--dtype", "fp8"][..], "--dtype"),
        (&["--device", "cpu", "--dtype", "bf16"], "GPU backend's"),
        (&["--device", "cpu", "--timing", "huge"], "--timing"),
        (&["--device", "cpu", "--rows", "0"], "--rows"),
        (&["--device", "cpu", "--activations", "bf16"], "--activations"),
        (&["--device", "cpu", "--activations", "fp8"], "--activations"),
        (&["--device", "cpu", "--attention", "cudnn"], "--attention cudnn is the GPU backend's"),
        (&["--device", "cpu", "--attention", "flash3"], "--attention \"flash3\": use flash_mma or cudnn"),
    ] {
        let o = common::bin().arg("engine-check").args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}\n{}", text(&o));
        common::assert_fails(&o, &[want]);
    }
    // The refusal of a timing shape lists the ones there are.
    let o = common::bin().args(["engine-check", "--device", "cpu", "--timing", "huge"]).output().unwrap();
    common::assert_fails(&o, &["baseline", "record-0427", "small", "none"]);
    if !pipeline::device::CUDA_BUILD {
        let o = common::bin().args(["engine-check", "--device", "cuda:0"]).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        common::assert_fails(&o, &["scripts/build-cuda.sh"]);
    }
}

/// A typo in the evaluations' `executor` key (the artifact's and the evaluation's) is refused
/// before anything runs: exit 2, the key and the values it takes, no panic.
#[test]
fn a_wrong_evaluation_executor_is_refused_naming_the_key() {
    let c = corpus("engine-executor");
    let cfg = config_plus(&c, "executor", &after_training());
    for key in ["stages.eval.executor", "stages.artifact.executor"] {
        let set = format!("{key}=\"engin\"");
        let o = common::bin().arg("validate").arg(&cfg).args(["--set", &set]).output().unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{t}");
        assert!(t.contains(key) && t.contains("expected one of: engine, candle") && !t.contains("panicked"), "{t}");
    }
}
