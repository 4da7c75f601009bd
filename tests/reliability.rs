//! The reliability cases of a new user's fault sweep, through the real binary on the tiny model
//! of `common::tiny`: a resume of a finished run trains nothing (and changes nothing when the
//! run is complete), SIGTERM and SIGHUP stop a run as Ctrl-C does with their own exit codes, a
//! FIFO is refused instead of blocking, a model too big for memory is refused before it is
//! allocated, a report that cannot be written is printed whole, and the smaller config cases.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::tiny::*;
use common::{assert_fails, bin, report, text, wait_or_kill};

const ARTIFACT: &str = "final_model.int8.zlib.pgqz";
const WEIGHTS: &str = "final_model.safetensors";

/// Every file under `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.insert(p.strip_prefix(dir).unwrap().to_path_buf(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn resume(cfg: &Path, from: &Path, sets: &[&str]) -> Output {
    let mut args = vec!["--resume", from.to_str().unwrap()];
    for s in sets {
        args.extend(["--set", s]);
    }
    run_args(cfg, &args)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn checkpoint_steps(run: &Path) -> Vec<u64> {
    pipeline::train::checkpoint::list(&run.join("checkpoints")).unwrap().iter().map(|c| c.0).collect()
}

/// The repro: a completed run resumed trains no step 11/10 and changes no file, however
/// often; a run whose work after training was cut short (its report says interrupted, its
/// artifact is gone) is finished without a step: the same weights, the artifact rebuilt byte
/// for byte, and then it too is complete. Resumed into a new directory, the work after
/// training is redone there, from the same weights.
#[test]
fn resuming_a_finished_run_trains_nothing() {
    let (c, cfg, out) = finished_run("finished");
    let sets = TEN;
    assert_eq!(checkpoint_steps(&out), [5, 10]);
    let done = files(&out);

    // Asked before anything is estimated: a machine with less memory still finds it complete.
    for extra in ["run.seed=1337", "run.max_memory_gb=0.0001"] {
        let o = resume(&cfg, &out, &[sets[0], sets[1], extra]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert!(stdout(&o).contains("is complete: training ended at step 10/10 (train.iterations)"), "{}", text(&o));
        assert!(files(&out) == done, "a resume of a completed run changed files");
    }

    // Interrupted during the work after training: report says so, the artifact is missing.
    mark_interrupted(&out);
    std::fs::remove_file(out.join(ARTIFACT)).unwrap();
    let o = resume(&cfg, &out, &sets);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let log = std::fs::read_to_string(out.join("train.log")).unwrap();
    assert!(log.contains("resume: training ended at step 10/10 (train.iterations): no step is trained"), "{log}");
    assert!(!log.contains("step:11/"), "{log}");
    assert_eq!(checkpoint_steps(&out), [5, 10], "no checkpoint past the last step");
    let now = files(&out);
    assert!(now[Path::new(WEIGHTS)] == done[Path::new(WEIGHTS)], "the final weights changed");
    assert!(now[Path::new(ARTIFACT)] == done[Path::new(ARTIFACT)], "the rebuilt artifact differs from the uninterrupted run's");
    let rep = report(&out);
    assert_eq!((rep.run.status.as_str(), rep.train["steps"].as_u64()), ("completed", Some(10)));
    let before: serde_json::Value = serde_json::from_slice(&done[Path::new("report.json")]).unwrap();
    assert_eq!(rep.sections["eval"]["sliding"]["val_bpb"], before["eval"]["sliding"]["val_bpb"]);
    let o = resume(&cfg, &out, &sets);
    assert!(o.status.success() && stdout(&o).contains("is complete"), "{}", text(&o));

    // Into a new directory: the work after training is done there, from the same weights.
    let other = c.dir.join("other");
    let o = run_args(&cfg, &["--resume", out.to_str().unwrap(), "--out", other.to_str().unwrap(), "--set", sets[0], "--set", sets[1]]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(std::fs::read(other.join(ARTIFACT)).unwrap() == done[Path::new(ARTIFACT)]);
    assert!(std::fs::read(other.join(WEIGHTS)).unwrap() == done[Path::new(WEIGHTS)]);
}

fn signal(child: &std::process::Child, sig: &str) {
    let ok = Command::new("kill").args([&format!("-{sig}"), &child.id().to_string()]).status().unwrap();
    assert!(ok.success());
}

/// SIGTERM (what schedulers and `docker stop` send) and SIGHUP stop a run as Ctrl-C does: the
/// weights and a checkpoint of the last finished step, the report, and exit 128 + the signal;
/// the run then resumes.
#[test]
fn sigterm_and_sighup_stop_as_ctrl_c_does() {
    let c = corpus("signals");
    let cfg = config_plus(&c, "signals", &after_training_sliding());
    for (sig, code) in [("TERM", 143), ("HUP", 129)] {
        let out = c.dir.join(sig);
        let mut cmd = bin();
        cmd.arg("run").arg(&cfg).arg("--out").arg(&out).arg("-q").args(["--set", "train.iterations=100000", "--set", "train.val_every=0"]);
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        wait_for_line(&mut child, &out, |l| l.starts_with("step:20/"));
        signal(&child, sig);
        let status = wait_or_kill(&mut child, Duration::from_secs(60), "signalled run");
        assert_eq!(status.code(), Some(code), "SIG{sig}");
        let r = report(&out);
        assert_eq!((r.run.status.as_str(), r.run.exit_code), ("interrupted", code));
        assert_eq!(r.run.signal.as_deref(), Some(format!("SIG{sig}").as_str()));
        let steps = r.train["steps"].as_u64().unwrap();
        assert_eq!(checkpoint_steps(&out).last(), Some(&steps), "a checkpoint of the last finished step");
        assert!(out.join(WEIGHTS).is_file());
        let o = resume(&cfg, &out, &[&format!("train.iterations={}", steps + 3), "train.val_every=0"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        assert_eq!(report(&out).train["steps"].as_u64(), Some(steps + 3));
    }
}

/// Runs `pipeline ARGS` with `env` added, killed (failing the test) if it blocks.
fn limited(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = bin();
    cmd.args(args).envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
    finish(cmd.spawn().unwrap(), Path::new(args.get(1).copied().unwrap_or("")))
}

fn mkfifo(p: &Path) {
    assert!(Command::new("mkfifo").arg(p).status().unwrap().success());
}

/// A FIFO as the config or among the shards is refused, naming it, instead of blocking the
/// first read forever: `validate`, and `run` (which said "completed" with 0 batches).
#[test]
fn fifos_are_refused_not_read() {
    let c = corpus("fifo");
    let cfg = config(&c);
    let pipe = c.dir.join("pipe.toml");
    mkfifo(&pipe);
    let o = limited(&["validate", pipe.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["pipe.toml", "must be a regular file", "FIFO"]);

    let fifo_shard = c.dir.join("shards/fineweb_train_999999.bin");
    mkfifo(&fifo_shard);
    let o = limited(&["validate", cfg.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &[&format!("{}: is a FIFO (named pipe), not a shard file", fifo_shard.display())]);
    let out = c.dir.join("run");
    let o = limited(&["run", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "-q", "--set", "run.max_seconds=5"], &[]);
    assert_fails(&o, &["FIFO"]);
    assert_ne!(o.status.code(), Some(0), "{}", text(&o));
}

/// `--set model.model_dim=1000000`: `validate` prints the estimate and refuses it, naming the
/// `--set` and the keys; `run` refuses it before allocating (it aborted in the allocator) and
/// leaves no run directory. A budget (`run.max_memory_gb`) below a small model's estimate
/// refuses that too; the estimate of a run that fits is printed and passes.
#[test]
fn a_model_too_big_for_memory_is_refused() {
    let c = corpus("memory");
    let cfg = config(&c);
    let big = "model.model_dim=1000000";
    let o = limited(&["validate", cfg.to_str().unwrap(), "--set", big], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["error: --set model.model_dim=1000000: `model.model_dim`: the run needs an estimated", "`model.model_dim`"]);
    assert!(stdout(&o).contains("memory estimate (host): "), "{}", text(&o));
    let out = c.dir.join("big");
    let o = limited(&["run", cfg.to_str().unwrap(), "--out", out.to_str().unwrap(), "--set", big], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["memory", "`model.model_dim`"]);
    assert!(!String::from_utf8_lossy(&o.stderr).contains("memory allocation"), "{}", text(&o));
    assert!(!out.exists(), "a refused run left its directory");

    // A huge queue of snapshots: the `--set` that made it is blamed, not the model's width
    // that sizes each snapshot.
    let ema = config_plus(&c, "memory-ema", &ema_and_checkpoints(5, 2));
    let queue = "stages.ema.queue=1000000000000";
    for cmd in ["validate", "run"] {
        let o = limited(&[cmd, ema.to_str().unwrap(), "--set", queue], &[]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert_fails(&o, &["error: --set stages.ema.queue=1000000000000: `stages.ema.queue`: the run needs an estimated"]);
    }

    let o = limited(&["validate", cfg.to_str().unwrap(), "--set", "run.max_memory_gb=0.0001"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["(run.max_memory_gb)"]);
    let o = limited(&["validate", cfg.to_str().unwrap(), "--set", "run.max_memory_gb=4"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(stdout(&o).contains("of 4.00 GiB (run.max_memory_gb)"), "{}", text(&o));
}

/// A report.json that cannot be written (here: files over 8 KiB are refused, as on a full
/// disk, without needing root for a small filesystem): the whole report and every failed
/// stage's error still reach the terminal, and the exit code says something failed.
#[test]
fn a_report_that_cannot_be_written_is_printed() {
    let c = corpus("fullreport");
    let cfg = config_plus(&c, "full", &after_training_sliding());
    let out = c.dir.join("run");
    // SIGXFSZ ignored (as the shell leaves it through exec), so a write past the limit fails
    // with EFBIG instead of killing the process.
    let script = format!(
        "trap '' XFSZ; ulimit -f 8; exec \"$0\" run {} --out {} -q --set train.iterations=10 --set train.val_every=0",
        cfg.display(),
        out.display()
    );
    let mut cmd = Command::new("bash");
    cmd.args(["-c", &script, env!("CARGO_BIN_EXE_pipeline")]);
    for (k, _) in std::env::vars() {
        if k.starts_with("PIPELINE_") {
            cmd.env_remove(k);
        }
    }
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let o = finish(child, &cfg);
    assert_fails(&o, &["stage `ckpt` failed: checkpoint of step 5 failed", "report.json", "is its only copy"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let so = stdout(&o);
    assert!(so.contains("run `train-test`: failed") && so.lines().any(|l| l.starts_with("stage ")), "{}", text(&o));
    assert!(so.contains("ckpt") && so.contains("verdict:"), "{}", text(&o));
    assert!(!out.join("report.json").exists());
}

/// `PIPELINE_*` variables with an empty key part were ignored; now each is named.
#[test]
fn environment_overrides_with_an_empty_key_part_are_refused() {
    let c = corpus("envkey");
    let cfg = config(&c);
    for var in ["PIPELINE_STAGES____QUEUE", "PIPELINE_STAGES__TRAIN__"] {
        let o = limited(&["validate", cfg.to_str().unwrap()], &[(var, "1")]);
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert_fails(&o, &[&format!("environment variable {var}: `{var}` has an empty key part")]);
    }
}

/// `validate` catches a validation split shorter than one sequence (only `run` did); an error
/// about a value set with `--set` names the `--set`, not the TOML file. `train.seq_len = 0` is
/// refused by `run` as by `validate`, with every stage after training configured (it panicked
/// dividing by it in the TTT stage's memory estimate).
#[test]
fn validate_catches_a_short_split_and_names_the_set() {
    let c = corpus("shortval");
    let cfg = config(&c);
    let after = config_plus(&c, "zero", &after_training());
    let out = c.dir.join("zero");
    for args in [&["validate", after.to_str().unwrap()][..], &["run", after.to_str().unwrap(), "--out", out.to_str().unwrap()]] {
        let o = limited(&[args, &["--set", "train.seq_len=0"]].concat(), &[]);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert_fails(&o, &["--set train.seq_len=0", "`train.seq_len` must be at least 1"]);
    }
    assert!(!out.exists());
    let o = limited(&["validate", cfg.to_str().unwrap(), "--set", "train.seq_len=65536", "--set", "train.batch_tokens=65536"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["--set train.seq_len=65536", "fewer than one sequence of `train.seq_len` = 65536"]);
    let o = limited(&["validate", cfg.to_str().unwrap(), "--set", "train.iterations=0"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("error: --set train.iterations=0: "), "{}", text(&o));
}

/// Resume refusals by class: what `--resume` names is bad input (exit 2) whether it is missing,
/// not a checkpoint or a corrupt one, as a checkpoint that does not fit the config is.
#[test]
fn resume_refusals_exit_2() {
    let c = corpus("resumecodes");
    let cfg = config_plus(&c, "codes", &after_training_sliding());
    let o = resume(&cfg, &c.dir.join("nothing-here"), &["train.iterations=10"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["no such checkpoint file or run directory"]);
    let notck = c.dir.join("notes.txt");
    std::fs::write(&notck, "not a checkpoint").unwrap();
    let o = resume(&cfg, &notck, &["train.iterations=10"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    let out = c.dir.join("run");
    train_ok(&cfg, &out, &["train.iterations=10", "train.val_every=0"]);
    let newest = pipeline::train::checkpoint::list(&out.join("checkpoints")).unwrap().last().unwrap().1.clone();
    let len = std::fs::metadata(&newest).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&newest).unwrap();
    f.set_len(len / 2).unwrap();
    let o = resume(&cfg, &out, &["train.iterations=20"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["previous good checkpoint"]);
    let o = resume(&cfg, &out, &["train.iterations=20", "model.model_dim=64", "model.num_heads=4"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}

/// The settings of [`finished_run`]: 10 steps, validated only at the end.
const TEN: [&str; 2] = ["train.iterations=10", "train.val_every=0"];

/// A completed run of [`TEN`] with every stage after training (checkpoints at 5 and 10), in the
/// corpus `name`: the corpus (its folder lives as long as it), the config, the run directory.
fn finished_run(name: &str) -> (Corpus, PathBuf, PathBuf) {
    let c = corpus(name);
    let cfg = config_plus(&c, name, &after_training_sliding());
    let out = c.dir.join("run");
    train_ok(&cfg, &out, &TEN);
    (c, cfg, out)
}

/// Marks a completed run's report as interrupted, as a Ctrl-C after training leaves it.
fn mark_interrupted(run: &Path) {
    let mut r: serde_json::Value = serde_json::from_slice(&std::fs::read(run.join("report.json")).unwrap()).unwrap();
    r["run"]["status"] = "interrupted".into();
    r["run"]["exit_code"] = 130.into();
    std::fs::write(run.join("report.json"), serde_json::to_vec(&r).unwrap()).unwrap();
}

/// A last step that is not a checkpoint step: the newest checkpoint is the final snapshot's
/// (its history holds the final validation). Finishing such a run keeps the final score in the
/// report; with `at_end = false` the newest checkpoint is older than the end, and a completed
/// run is still complete, not trained again.
#[test]
fn a_finished_run_is_recognised_whichever_checkpoint_is_newest() {
    let c = corpus("finalck");
    let cfg = config_plus(&c, "finalck", &after_training_sliding());
    let sets = ["train.iterations=12", "train.val_every=0"];
    let out = c.dir.join("final");
    let (before, _) = train_ok(&cfg, &out, &sets);
    assert_eq!(checkpoint_steps(&out), [10, 12], "the final snapshot's checkpoint");
    mark_interrupted(&out);
    let o = resume(&cfg, &out, &sets);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let after = report(&out).train;
    assert!(after["val_bpb"].is_f64(), "the finished run's report lost its final score: {after:?}");
    assert_eq!((&after["val_bpb"], &after["val_loss"]), (&before["val_bpb"], &before["val_loss"]));
    assert_eq!(after["validations"].as_array().map(Vec::len), before["validations"].as_array().map(Vec::len));

    let no_end = c.dir.join("no-end");
    let (_, _) = train_ok(&cfg, &no_end, &[sets[0], sets[1], "stages.ckpt.at_end=false"]);
    assert_eq!(checkpoint_steps(&no_end), [5, 10], "no checkpoint of the last step");
    let done = files(&no_end);
    let o = resume(&cfg, &no_end, &[sets[0], sets[1], "stages.ckpt.at_end=false"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(stdout(&o).contains("is complete: training ended at step 12/12"), "{}", text(&o));
    assert!(files(&no_end) == done, "a completed run was trained again from an older checkpoint");
    // More iterations than the run had are more training, not a complete run.
    let o = resume(&cfg, &no_end, &["train.iterations=14", sets[1], "stages.ckpt.at_end=false"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(report(&no_end).train["steps"].as_u64(), Some(14));
}

/// A run that completes but whose report.json cannot be written (a directory stands in its
/// way) exits 1, not 0, and prints the report's JSON too.
#[test]
fn a_completed_run_whose_report_is_lost_exits_1() {
    let (_c, cfg, out) = finished_run("lostreport");
    let sets = TEN;
    mark_interrupted(&out);
    std::fs::remove_file(out.join("report.json")).unwrap();
    std::fs::create_dir_all(out.join("report.json/blocker")).unwrap();
    let o = resume(&cfg, &out, &sets);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert_fails(&o, &["cannot write", "report.json", "is its only copy"]);
    let so = stdout(&o);
    assert!(so.contains("run `train-test`: completed") && so.contains("report.json (not saved):\n{"), "{}", text(&o));
    assert!(so.contains("\"sliding\""), "the JSON holds the sections the table leaves out\n{}", text(&o));
}

/// A run directory belongs to one run: two runs started together with the same `--out` (other
/// seeds) leave one run's files, the other refused with exit 2 naming the directory; a resume
/// of a run still going is refused the same way; once the run has ended its lock keeps nobody
/// out, and its files keep a fresh run out ("not empty").
#[test]
fn a_run_directory_belongs_to_one_run() {
    let c = corpus("claim");
    let cfg = config(&c);
    let out = c.dir.join("same");
    let start = |seed: &str| {
        let mut cmd = bin();
        cmd.arg("run").arg(&cfg).arg("--out").arg(&out).arg("-q");
        for s in ["train.iterations=6", "train.val_every=0", seed] {
            cmd.args(["--set", s]);
        }
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    };
    let (a, b) = (start("run.seed=7"), start("run.seed=1337"));
    let (a, b) = (common::tiny::finish(a, &cfg), common::tiny::finish(b, &cfg));
    let mut codes = [a.status.code(), b.status.code()];
    codes.sort();
    assert_eq!(codes, [Some(0), Some(2)], "one runs, one is refused:\n{}\n{}", text(&a), text(&b));
    let refused = if a.status.code() == Some(2) { &a } else { &b };
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(said.contains(&out.display().to_string()) && (said.contains("in use by another run") || said.contains("not empty")), "{said}");
    let seed = if a.status.code() == Some(0) { 7 } else { 1337 };
    let config_toml = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(config_toml.contains(&format!("seed = {seed}")), "config.toml is the run's that ran:\n{config_toml}");
    let log = std::fs::read_to_string(out.join("train.log")).unwrap();
    assert_eq!(log.matches("\nseed:").count(), 1, "one run's log:\n{log}");
    assert!(log.contains(&format!("\nseed:{seed}\n")), "{log}");

    // A resume of a run that is still going, and a second run into it.
    let long = c.dir.join("long");
    let ckpt = config_plus(&c, "claim-ck", &ema_and_checkpoints(1, 2));
    let mut cmd = bin();
    cmd.arg("run").arg(&ckpt).arg("--out").arg(&long).arg("-q").args(["--set", "train.iterations=100000", "--set", "train.val_every=0"]);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    wait_for_line(&mut child, &long, |l| l.starts_with("step:2/"));
    let o = resume(&ckpt, &long, &["train.iterations=100000", "train.val_every=0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["is in use by another run", ".lock"]);
    let o = run_limited(&cfg, &long, &["train.iterations=3"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    sigint(&child);
    assert_eq!(wait_or_kill(&mut child, Duration::from_secs(120), "interrupted run").code(), Some(130));
    // Ended: its lock file is there and holds nothing; a resume goes on.
    assert!(long.join(".lock").is_file());
    let steps = report(&long).train["steps"].as_u64().unwrap();
    let o = resume(&ckpt, &long, &[&format!("train.iterations={}", steps + 2), "train.val_every=0"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let o = run_limited(&cfg, &long, &["train.iterations=3"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["not empty"]);
}

/// A bad flag exits 2 and names the flag the user typed: `--device` of the device checks (not
/// the config key `run.device` their parser also serves), and `ablate --out` naming a file.
#[test]
fn bad_flags_exit_2_naming_the_flag() {
    for args in [
        &["engine-check", "--device", "tpu:9"][..],
        &["parity", "--device", "tpu:9"],
        &["attention-trial", "--kernels", "flash_mma", "--device", "tpu:9"],
    ] {
        let o = bin().args(args).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert_fails(&o, &["--device \"tpu:9\" is not a device"]);
        assert!(!String::from_utf8_lossy(&o.stderr).contains("run.device"), "{}", text(&o));
    }
    let c = corpus("flags");
    let file = c.dir.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let o = bin().arg("ablate").arg(config(&c)).args(["--vary", "stages.pin.queue=1,2", "--out"]).arg(&file).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["is a file, not a directory"]);
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

/// A resume that changes what the checkpoint was: a changed `[model]` is refused even when the
/// run is complete (it used to say "complete, nothing to do"), a `train.iterations` below the
/// checkpoint's step is refused (it used to log `step 10/5` and train nothing), both exit 2
/// with every file as it was; a larger one trains on and says in the log that the schedule
/// changed.
#[test]
fn a_resume_that_changes_the_run_is_refused_or_said() {
    let (_c, cfg, out) = finished_run("changed");
    let done = files(&out);
    let o = resume(&cfg, &out, &[TEN[0], TEN[1], "model.model_dim=64", "model.num_heads=4"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["cannot resume from", "`model.model_dim`", "the architecture must not change on resume"]);
    let o = resume(&cfg, &out, &["train.iterations=5", TEN[1]]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert_fails(&o, &["it is at step 10, past `train.iterations` = 5"]);
    assert!(files(&out) == done, "a refused resume changed files");

    let o = resume(&cfg, &out, &["train.iterations=12", TEN[1]]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let log = std::fs::read_to_string(out.join("train.log")).unwrap();
    assert!(log.contains("resume: train.iterations is 12, the run had 10: from step 10 on the schedule"), "{log}");
    assert_eq!(report(&out).train["steps"].as_u64(), Some(12));
}
