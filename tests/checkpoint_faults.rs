//! `checkpoint/atomic` and `pipeline run --resume` under faults, through the real binary on the
//! tiny model of `common::tiny`: a resume with another model shape, a corrupt newest checkpoint,
//! a full disk (a file size limit) during a write, Ctrl-C and SIGKILL while checkpoints are
//! written, a run directory without checkpoints, and other training data. Each fault must end
//! with a clear error (non-zero exit, no panic, the file or key at fault named) or be survived,
//! and must leave every checkpoint under its final name whole.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use common::tiny::*;
use common::{assert_fails, bin, report, text, wait_or_kill};
use pipeline::data::shard::write_shard;
use serde_json::Value;

/// Settings of every run here: no periodic validation, a short final one (debug builds are
/// slow), a train line per step.
const QUICK: [&str; 3] = ["train.val_every=0", "train.val_max_tokens=64", "train.log_every=1"];

fn ckpt_dir(run: &Path) -> PathBuf {
    run.join(pipeline::train::checkpoint::DIR)
}

/// Every entry of RUN_DIR/checkpoints (names sorted) with its bytes.
fn snapshot(run: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(ckpt_dir(run))
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap())
        })
        .collect();
    v.sort();
    v
}

/// The steps of the checkpoint files in RUN_DIR/checkpoints.
fn steps(run: &Path) -> Vec<u64> {
    pipeline::train::checkpoint::list(&ckpt_dir(run)).unwrap().into_iter().map(|(s, _)| s).collect()
}

/// Temporary files (`.step_*.tmp-PID`) in RUN_DIR/checkpoints.
fn temps(run: &Path) -> Vec<String> {
    std::fs::read_dir(ckpt_dir(run))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".step_") && n.contains(".tmp-"))
        .collect()
}

/// Loads every checkpoint file of RUN_DIR (failing the test on one that does not load) and
/// checks that each holds its own step, the weights and the EMA; returns the steps, ascending.
fn load_all(run: &Path) -> Vec<u64> {
    let files = pipeline::train::checkpoint::list(&ckpt_dir(run)).unwrap();
    for (step, path) in &files {
        let ck = pipeline::train::checkpoint::load(path).unwrap_or_else(|e| panic!("{} does not load: {e:#}", path.display()));
        assert_eq!(ck.meta.step, *step, "{}", path.display());
        let has = |prefix: &str| ck.tensors.keys().any(|n| n.starts_with(prefix));
        assert!(has("model.") && has("optim.") && has("avg."), "{}: {:?}", path.display(), ck.tensors.keys());
    }
    files.into_iter().map(|(s, _)| s).collect()
}

/// [`QUICK`] and `extra` as `--set` arguments.
fn sets<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    QUICK.iter().chain(extra).flat_map(|x| ["--set", x]).collect()
}

/// `pipeline run CFG -q --resume FROM` with [`QUICK`] and `extra` set.
fn resume(cfg: &Path, from: &Path, extra: &[&str]) -> Output {
    run_args(cfg, &[&["--resume", from.to_str().unwrap()][..], &sets(extra)].concat())
}

/// A finished run of `iters` steps with checkpoints into `out`; returns its config.
fn checkpointed_run(c: &Corpus, name: &str, out: &Path, iters: u64) -> PathBuf {
    let cfg = config_plus(c, name, &ema_and_checkpoints(2, 3));
    let it = format!("train.iterations={iters}");
    let (t, _) = train_ok(&cfg, out, &[&QUICK[..], &[it.as_str()]].concat());
    assert_eq!(u(&t, "steps"), iters);
    cfg
}

/// `--resume RUN_DIR` with another `[model]`: refused before anything is written, naming the
/// checkpoint, the first `[model]` key that differs and both values; the checkpoints stay byte
/// for byte.
#[test]
fn resume_with_another_model_shape_names_the_key() {
    let c = corpus("ck-shape");
    let out = c.dir.join("run");
    let cfg = checkpointed_run(&c, "shape", &out, 6);
    assert_eq!(steps(&out), [2, 4, 6]);
    let before = snapshot(&out);
    let o = resume(&cfg, &out, &["train.iterations=10", "model.model_dim=64", "model.num_heads=4"]);
    let newest = ckpt_dir(&out).join("step_00000006.safetensors");
    assert_fails(&o, &[&newest.display().to_string(), "`model.model_dim` = 32", "the config now gives 64"]);
    assert_eq!(snapshot(&out), before, "a refused resume changed the checkpoints");
    assert_eq!(report(&out).train["steps"], Value::from(6), "a refused resume rewrote the report");
}

/// The newest checkpoint truncated, or with one byte in its middle flipped: `--resume RUN_DIR`
/// names it and what is wrong, and offers the previous good one with the `--resume` to use;
/// resuming from the offered file works and ends at `train.iterations`.
#[test]
fn corrupt_latest_checkpoint_offers_the_previous_one() {
    let c = corpus("ck-corrupt");
    let out = c.dir.join("run");
    let cfg = checkpointed_run(&c, "corrupt", &out, 6);
    assert_eq!(steps(&out), [2, 4, 6]);
    let dir = ckpt_dir(&out);
    let (newest, previous) = (dir.join("step_00000006.safetensors"), dir.join("step_00000004.safetensors"));
    let good = std::fs::read(&newest).unwrap();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x10;
    let offer = format!("`--resume {}`", previous.display());
    let mut offered = String::new();
    for (case, bytes, why) in [("truncated", &good[..good.len() / 2], "truncated"), ("flipped", &flipped[..], "crc mismatch")] {
        std::fs::write(&newest, bytes).unwrap();
        let o = resume(&cfg, &out, &["train.iterations=6"]);
        assert_fails(&o, &[&newest.display().to_string(), why, &previous.display().to_string(), &offer]);
        assert_eq!(std::fs::read(&newest).unwrap(), bytes, "{case}: a refused resume touched the file");
        // The path as the message gives it, to be used as is.
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        offered = err.split("`--resume ").nth(1).and_then(|s| s.split('`').next()).unwrap().to_string();
    }
    let o = resume(&cfg, Path::new(&offered), &["train.iterations=6"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&out);
    assert_eq!(r.run.status, "completed");
    assert_eq!(u(&r.train, "steps"), 6, "training ends at train.iterations");
    assert_eq!(r.train["resumed_from_step"], Value::from(4));
    let log = std::fs::read_to_string(out.join("train.log")).unwrap();
    assert!(log.contains(&format!("resume: {} step:4 ", previous.display())), "{log}");
    assert_eq!(load_all(&out), [2, 4, 6], "step 6 written again, whole");
    assert!(temps(&out).is_empty(), "{:?}", temps(&out));
}

/// `pipeline run CFG --resume RUN_DIR -q --set ...` with files limited to `blocks` KiB
/// (`ulimit -f`) and SIGXFSZ ignored, so that a write past the limit fails with EFBIG ("File
/// too large") as on a full disk, instead of killing the process.
fn resume_limited(cfg: &Path, run: &Path, blocks: u64, extra: &[&str]) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg("-c").arg(format!("trap '' XFSZ; ulimit -f {blocks}; exec \"$0\" \"$@\""));
    cmd.arg(env!("CARGO_BIN_EXE_pipeline")).arg("run").arg(cfg).arg("--resume").arg(run).arg("-q").args(sets(extra));
    for (k, _) in std::env::vars() {
        if k.starts_with("PIPELINE_") {
            cmd.env_remove(k);
        }
    }
    finish(cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("bash runs"), cfg)
}

/// A write that fails (a file size limit below a checkpoint's size, above every other file's):
/// with `on_error = "stop"` the run stops, naming the checkpoint and the OS error; with
/// `"continue"` it trains to the end and reports the failures. Either way the earlier
/// checkpoints are untouched and load, and no temporary file is left.
#[test]
fn full_disk_during_a_write_keeps_the_previous_checkpoint() {
    let c = corpus("ck-full");
    let out = c.dir.join("run");
    let cfg = checkpointed_run(&c, "full", &out, 4);
    assert_eq!(steps(&out), [2, 4]);
    let before = snapshot(&out);
    // Room for the other files of the run directory (the log and the step table grow on
    // resume), none for a checkpoint.
    let size = |f: &str| std::fs::metadata(out.join(f)).unwrap_or_else(|e| panic!("{f}: {e}")).len();
    let others =
        [size("final_model.safetensors"), 2 * size("report.json"), 2 * size("config.toml"), 4 * size("train.log"), 4 * size("steps.tsv")];
    let (low, high) = (others.into_iter().max().unwrap(), before.iter().map(|(_, b)| b.len() as u64).min().unwrap());
    let blocks = (low + high) / 2 / 1024;
    assert!(low < blocks * 1024 && blocks * 1024 < high, "no file size limit between {low} and {high} bytes: {blocks} KiB");

    let o = resume_limited(&cfg, &out, blocks, &["train.iterations=8"]);
    assert_fails(&o, &["checkpoint", "step_00000006.safetensors", "File too large"]);
    assert_eq!(snapshot(&out), before, "the earlier checkpoints changed, or a temporary file remains");
    assert_eq!(load_all(&out), [2, 4]);
    assert!(temps(&out).is_empty(), "{:?}", temps(&out));

    let o = resume_limited(&cfg, &out, blocks, &["train.iterations=8", "stages.ckpt.on_error=\"continue\""]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let r = report(&out);
    assert_eq!(r.run.status, "completed");
    assert_eq!(u(&r.train, "steps"), 8, "training reaches train.iterations");
    let failures = r.sections["checkpoint"]["failures"].as_array().expect("checkpoint.failures").clone();
    assert!(!failures.is_empty() && failures.iter().all(|f| f.as_str().is_some_and(|f| f.contains("File too large"))), "{failures:?}");
    assert_eq!(r.sections["checkpoint"]["written"], Value::Array(vec![]), "a write under the limit?");
    assert_eq!(snapshot(&out), before, "the earlier checkpoints changed, or a temporary file remains");
    assert_eq!(load_all(&out), [2, 4]);
}

/// A larger model (a checkpoint write takes a while), the newest 2 checkpoints kept, and more
/// steps than these runs take.
const LARGER: [&str; 5] =
    ["model.model_dim=64", "model.num_heads=4", "model.num_kv_heads=2", "stages.ckpt.keep=2", "train.iterations=1000"];

fn spawn(cfg: &Path, out: &Path, extra: &[&str]) -> Child {
    let mut cmd = bin();
    cmd.arg("run").arg(cfg).arg("--out").arg(out).arg("-q").args(sets(extra));
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
}

/// Waits (polling every millisecond) for the train line of `step` in RUN_DIR/train.log: the
/// snapshot of that step has just gone to the EMA and the checkpoint writer.
fn wait_for_step(child: &mut Child, out: &Path, step: u64) {
    let prefix = format!("step:{step}/");
    wait_for_line_every(child, out, Duration::from_millis(1), |l| l.starts_with(&prefix));
}

/// Ctrl-C at different moments of runs that save a checkpoint every step (right after a step,
/// while its checkpoint is serialised or written): exit 130, every checkpoint file loads, the
/// newest is the last step taken (the save on Ctrl-C), and no temporary file remains. Then
/// SIGKILL mid-run: the files under checkpoint names still load, and resuming that directory
/// works and clears the temporary files that killed processes left.
#[test]
fn ctrl_c_during_checkpoint_writes_leaves_only_whole_files() {
    let c = corpus("ck-ctrlc");
    let cfg = config_plus(&c, "ctrlc", &ema_and_checkpoints(2, 3));
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    // (the train line to wait for, checkpoint every): with `every` 3 the last step is saved only
    // because of Ctrl-C.
    for (i, (after, every)) in [(1u64, 1u64), (3, 1), (5, 1), (4, 3)].into_iter().enumerate() {
        let out = c.dir.join(format!("int-{i}"));
        let every_n = format!("stages.ckpt.every={every}");
        let mut child = spawn(&cfg, &out, &[&LARGER[..], &[every_n.as_str()]].concat());
        wait_for_step(&mut child, &out, after);
        let extra = Duration::from_micros(rng.u64(0..=12_000));
        std::thread::sleep(extra);
        sigint(&child);
        let status = wait_or_kill(&mut child, Duration::from_secs(60), "interrupted run");
        let log = std::fs::read_to_string(out.join("train.log")).unwrap_or_default();
        let what = format!("Ctrl-C {extra:?} after the step-{after} line, every {every} (seed {seed})\n{log}");
        assert_eq!(status.code(), Some(130), "{what}");
        let r = report(&out);
        assert_eq!(r.run.status, "interrupted", "{what}");
        let taken = u(&r.train, "steps");
        assert!(taken >= after, "{what}");
        let saved = load_all(&out);
        assert!(!saved.is_empty() && saved.len() <= 2, "keep = 2: {saved:?}\n{what}");
        assert_eq!(saved.last(), Some(&taken), "the newest checkpoint is not the last step taken\n{what}");
        assert!(temps(&out).is_empty(), "{:?}\n{what}", temps(&out));
    }

    // SIGKILL: no handler runs; whatever is under a checkpoint's name must be whole.
    let out = c.dir.join("killed");
    let every_step = [&LARGER[..], &["stages.ckpt.every=1"]].concat();
    let mut child = spawn(&cfg, &out, &every_step);
    wait_for_step(&mut child, &out, 3);
    std::thread::sleep(Duration::from_micros(rng.u64(0..=12_000)));
    child.kill().unwrap();
    child.wait().unwrap();
    let saved = load_all(&out);
    let newest = *saved.last().expect("no checkpoint after 3 steps");
    let left = temps(&out);
    // Plus one as a process killed mid-write leaves it (a pid no live process has).
    std::fs::write(ckpt_dir(&out).join(".step_00000099.safetensors.tmp-4000000000"), b"half a checkpoint").unwrap();
    let until = format!("train.iterations={}", newest + 2);
    let o = resume(&cfg, &out, &[&every_step[..], &[until.as_str()]].concat());
    assert_eq!(o.status.code(), Some(0), "temporary files before: {left:?}\n{}", text(&o));
    assert_eq!(u(&report(&out).train, "steps"), newest + 2);
    assert_eq!(load_all(&out), [newest + 1, newest + 2]);
    assert!(temps(&out).is_empty(), "stale temporary files survive the resumed run's writes: {:?} (before: {left:?})", temps(&out));
}

/// `--resume` on the run directory of a run without a checkpoint stage: an error naming the
/// directory, and nothing in it changed.
#[test]
fn resume_from_a_directory_without_checkpoints_is_a_clear_error() {
    let c = corpus("ck-none");
    let cfg = config_with(&c, "none", true);
    let out = c.dir.join("run");
    train_ok(&cfg, &out, &[&QUICK[..], &["train.iterations=1"]].concat());
    let report_before = std::fs::read(out.join("report.json")).unwrap();
    let o = resume(&cfg, &out, &["train.iterations=2"]);
    assert_fails(&o, &[&out.display().to_string(), "no checkpoints"]);
    assert!(!ckpt_dir(&out).exists());
    assert_eq!(std::fs::read(out.join("report.json")).unwrap(), report_before);
}

/// `data.train` pointing at other shards (same file name, more tokens) on resume: refused,
/// naming the key and the data fingerprint.
#[test]
fn resume_with_other_training_data_is_refused() {
    let c = corpus("ck-data");
    let out = c.dir.join("run");
    let cfg = checkpointed_run(&c, "data", &out, 2);
    assert_eq!(steps(&out), [2]);
    let before = snapshot(&out);
    let other = c.dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let mut tokens = shard_tokens(&c.dir.join("shards/fineweb_train_000000.bin"));
    tokens.extend_from_within(..512);
    write_shard(&other.join("fineweb_train_000000.bin"), &tokens).unwrap();
    let glob = format!("data.train={}", lit(other.join("fineweb_train_*.bin").display().to_string()));
    let o = resume(&cfg, &out, &["train.iterations=4", &glob]);
    assert_fails(&o, &["data.train", "data fingerprint", "step_00000002.safetensors"]);
    assert_eq!(snapshot(&out), before);
}

/// A trace starts at step 0: `--resume` with `step_trace = true` is refused, naming the key, and the
/// run's directory gets no trace.
#[test]
fn a_resumed_run_is_refused_a_trace() {
    let c = corpus("trace-resume");
    let run = c.dir.join("run");
    let cfg = checkpointed_run(&c, "trace-resume", &run, 3);
    let o = resume(&cfg, &run, &["train.iterations=5", "stages.train.step_trace=true"]);
    assert_fails(&o, &["key `step_trace`", "resumes a checkpoint"]);
    assert!(!run.join("step_trace").exists(), "{}", text(&o));
}
