//! Data parallelism on CPU ranks (MPI): two ranks with half the micro-batches each train the
//! same weights as one rank with all of them; one rank killed mid-run stops the job, named, no
//! hang; the report merges both ranks' stage tables. Needs MPI: skipped, saying so, in a binary
//! built without the `mpi` feature or where `mpirun` is not installed (`scripts/test.sh` turns
//! the feature on where MPI is; `.ci/run` installs it).

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use common::tiny::{self, Corpus};
use common::{bin, report, scratch, text, wait_or_kill};

/// Each test's ranks take every core: the tests that start them run one at a time (the guard
/// of [`with_mpi`]), so that none is starved into its hang detector by another's ranks.
static RANKS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The guard that lets this test's ranks run alone; `None`, saying why, when these tests cannot
/// run here.
fn with_mpi() -> Option<std::sync::MutexGuard<'static, ()>> {
    if !cfg!(feature = "mpi") {
        eprintln!("skipped: the binary is built without the `mpi` feature (scripts/test.sh turns it on where MPI is installed)");
        return None;
    }
    if std::process::Command::new("mpirun").arg("--version").output().is_err() {
        eprintln!("skipped: `mpirun` is not installed (Debian: apt-get install openmpi-bin libopenmpi-dev)");
        return None;
    }
    Some(RANKS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// The stages after training: the artifact (rounded to nearest: the same file whatever the
/// world size) scored before and after, then the sliding score and score-first TTT, whose
/// 8-sequence chunks train in steps of 3, 3 and 2 sequences (shares of 1 and 2 on two ranks).
const AFTER_TRAINING: &str = r#"
[stages.artifact]
kind = "artifact"
impl = "quantize"
inputs = ["train"]
code_bytes = 1

[stages.eval]
kind = "ttt_eval"
impl = "score_first"
inputs = ["artifact"]
stride = 8
batch_windows = 5
chunk_tokens = 256
epochs = 2
batch_seqs = 3
"#;

/// The training test config with the demo's model (4 layers, 128 wide, 4 heads, 2 KV heads),
/// the sequential sampler (the same windows whatever the world size), 8 rows a step, the first
/// 2,048 validation tokens, and the stages after training ([`AFTER_TRAINING`]).
fn config(c: &Corpus) -> std::path::PathBuf {
    let base = std::fs::read_to_string(tiny_sequential(c, "candle")).unwrap();
    let toml = base
        .replace(
            "num_layers = 2\nmodel_dim = 32\nnum_heads = 2\nnum_kv_heads = 1",
            "num_layers = 4\nmodel_dim = 128\nnum_heads = 4\nnum_kv_heads = 2",
        )
        .replace("val_batch_tokens = 1024", "val_batch_tokens = 1024\nval_max_tokens = 2048");
    assert!(toml.contains("model_dim = 128") && toml.contains("val_max_tokens"), "the tiny config changed: {toml}");
    let path = c.dir.join("dp.toml");
    std::fs::write(&path, toml + AFTER_TRAINING).unwrap();
    path
}

fn launch(config: &Path, out: &Path, nproc: usize, sets: &[&str]) -> std::process::Child {
    let mut cmd = bin();
    cmd.arg("launch").arg("--nproc").arg(nproc.to_string()).arg(config).arg("--out").arg(out).arg("-q");
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

fn weights(run: &Path) -> Vec<(String, Vec<f32>)> {
    let t = pipeline::model::weights::load(&run.join("final_model.safetensors"), None).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = t
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// 2 ranks x 1 micro-batch of 4 rows give the weights of 1 rank x 2 micro-batches of 4 rows,
/// to float summation order: the gradient of the step is the same mean over the same 8 rows,
/// summed as (a + b) / 2 across ranks instead of a/2 + b/2 within one. Tolerance: 2e-5 absolute
/// on every weight after 4 steps. Measured: 0, bit for bit (halving is exact in binary floating
/// point, and the sharded Muon adds only zeros); summing instead of averaging the ranks'
/// gradients moves the embedding by 8e-3. The validation score is the same to 1e-5, the two
/// ranks each scoring half the split.
///
/// After training, the ranks share the artifact's scores, the sliding windows and the TTT
/// steps: every score matches one rank's to 1e-5 bits per byte over the same number of
/// targets. Measured: the scores before TTT to the last digit, TTT's to 4e-10 (its gradients
/// are summed in another order). Leaving the ranks' sliding sums un-added moves that score by
/// 3e-2; leaving their TTT gradients unsummed moves TTT's by 7e-2.
#[test]
fn two_ranks_train_the_weights_of_one() {
    let Some(_alone) = with_mpi() else { return };
    let c = tiny::corpus("dp-equal");
    let cfg = config(&c);
    let one = scratch("dp-one");
    let (t1, _) = tiny::train_ok(&cfg, &one, &["train.grad_accum_steps=2"]);
    let two = scratch("dp-two");
    let mut child = launch(&cfg, &two, 2, &["train.grad_accum_steps=1"]);
    let status = wait_or_kill(&mut child, Duration::from_secs(300), "pipeline launch --nproc 2");
    let o = child.wait_with_output().unwrap();
    assert!(status.success(), "{}", text(&o));
    let r = report(&two);
    assert_eq!(r.run.status, "completed");
    let log = std::fs::read_to_string(two.join("train.log")).unwrap();
    assert!(log.contains("world_size:2 grad_accum_steps:1"), "{log}");
    let (a, b) = (weights(&one), weights(&two));
    assert_eq!(a.len(), b.len());
    let mut worst = (0f32, String::new());
    for ((na, wa), (nb, wb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        for (x, y) in wa.iter().zip(wb) {
            if (x - y).abs() > worst.0 {
                worst = ((x - y).abs(), na.clone());
            }
        }
    }
    eprintln!("largest weight difference, 2 ranks against 1: {} ({})", worst.0, worst.1);
    assert!(worst.0 <= 2e-5, "weights differ by {} in {}", worst.0, worst.1);
    let bpb = |t: &serde_json::Map<String, serde_json::Value>| tiny::f(t, "val_bpb");
    assert!((bpb(&t1) - bpb(&r.train)).abs() < 1e-5, "{} vs {}", bpb(&t1), bpb(&r.train));
    assert_eq!(tiny::u(&t1, "val_tokens"), tiny::u(&r.train, "val_tokens"), "the ranks scored the whole split between them");
    assert_eq!(tiny::u(&r.train, "world_size"), 2);
    assert!(tiny::f(&r.train, "comm_ms_per_step") > 0.0);
    // The merged report: both ranks side by side, and the step's all-reduce as its own
    // histogram.
    let ranks = &r.sections["ranks"];
    assert_eq!(ranks["world"], 2);
    assert_eq!(ranks["backend"], "mpi");
    assert_eq!(ranks["stages"]["train"]["items"].as_array().unwrap().len(), 2);
    assert!(r.stages["train"].extra_us.get("allreduce").is_some_and(|h| h.count == 4), "{:?}", r.stages["train"].extra_us.keys());
    // The stages after training, shared by the ranks, score as one rank does.
    let r1 = report(&one);
    let scores = |r: &pipeline::report::document::Report| {
        let (a, e) = (&r.sections["artifact"], &r.sections["eval"]);
        let tokens = |s: &serde_json::Value| s["val_tokens"].as_u64().unwrap();
        [(&a["before"], tokens(a)), (&a["after"], tokens(a)), (&e["sliding"], tokens(&e["sliding"])), (&e["ttt"], tokens(&e["ttt"]))]
            .map(|(s, n)| (s["val_bpb"].as_f64().unwrap(), n))
    };
    let (s1, s2) = (scores(&r1), scores(&r));
    eprintln!("after training, 1 rank: {s1:?}\n             2 ranks: {s2:?}");
    for (name, (a, b)) in ["pre-quantization", "quantized", "sliding", "ttt"].iter().zip(s1.iter().zip(&s2)) {
        assert!((a.0 - b.0).abs() < 1e-5, "{name}: {} (1 rank) vs {} (2 ranks)", a.0, b.0);
        assert_eq!(a.1, b.1, "{name}: the ranks scored every target between them");
    }
    assert_eq!(r.sections["eval"]["ttt"]["chunks"], r1.sections["eval"]["ttt"]["chunks"]);
    assert_eq!(
        std::fs::read(one.join("final_model.int8.zlib.pgqz")).unwrap(),
        std::fs::read(two.join("final_model.int8.zlib.pgqz")).unwrap()
    );
}

/// The tiny config (2 layers, 32 wide) on `executor`, with the sequential sampler (the same
/// windows whatever the world size), 4 steps, no validation during training.
/// A launch whose output goes to a file (as `pipeline launch ... > log`), as torchrun's reads:
/// rank 0's training and stage lines once each, no progress bar's escape codes (under mpirun a
/// rank's stdout is a pseudo-terminal even then); `--all-ranks` gives every rank's, tagged
/// `[r] `; `-q` the same log without the `pipeline:` lines.
#[test]
fn a_redirected_launch_reads_like_one_run() {
    let Some(_alone) = with_mpi() else { return };
    let c = tiny::corpus("dp-console");
    let cfg = config(&c);
    // (stdout, stderr, run directory)
    let run = |name: &str, flags: &[&str]| -> (String, String, std::path::PathBuf) {
        let out = scratch(name);
        let log = out.with_extension("log");
        let mut cmd = bin();
        cmd.arg("launch").arg("--nproc").arg("2").args(flags).arg(&cfg).arg("--out").arg(&out);
        cmd.stdout(std::fs::File::create(&log).unwrap()).stderr(std::fs::File::create(out.with_extension("err")).unwrap());
        let status = wait_or_kill(&mut cmd.spawn().unwrap(), Duration::from_secs(240), name);
        let (text, errors) = (std::fs::read_to_string(&log).unwrap(), std::fs::read_to_string(out.with_extension("err")).unwrap());
        assert!(status.success(), "{name}: {text}{errors}");
        assert!(!text.contains('\x1b') && !errors.contains('\x1b'), "{name}: escape codes in a redirected log:\n{text}{errors}");
        (text, errors, out)
    };
    let steps = |t: &str, prefix: &str| t.lines().filter(|l| l.strip_prefix(prefix).is_some_and(|l| l.starts_with("step:"))).count();
    let (plain, plain_errors, dir) = run("dp-console-plain", &[]);
    let train_log = std::fs::read_to_string(dir.join("train.log")).unwrap();
    // Rank 0's lines, each once: the training log's step lines as train.log has them.
    assert!(steps(&plain, "") > 0 && steps(&plain, "") == steps(&train_log, ""), "{plain}");
    assert!(!plain.contains("[1] ") && plain.contains("quantized val_loss"), "{plain}");
    assert_eq!(plain.matches("quantized val_loss").count(), train_log.matches("quantized val_loss").count(), "{plain}");
    let (all, _, _) = run("dp-console-all", &["--all-ranks"]);
    assert!(steps(&all, "[0] ") == steps(&plain, "") && steps(&all, "[1] ") == steps(&plain, ""), "{all}");
    assert_eq!(steps(&all, ""), 0, "{all}");
    let (quiet, quiet_errors, _) = run("dp-console-quiet", &["-q"]);
    assert!(steps(&quiet, "") == steps(&plain, "") && steps(&quiet, "[1] ") == 0, "{quiet}");
    assert!(plain_errors.contains("pipeline: run directory") && !quiet_errors.contains("pipeline: run directory"), "{quiet_errors}");
    assert!(quiet.contains("completed"), "the report is printed under -q: {quiet}");
}

fn tiny_sequential(c: &Corpus, executor: &str) -> std::path::PathBuf {
    let toml = std::fs::read_to_string(tiny::config(c)).unwrap();
    let toml = toml
        .replace("impl = \"shuffled\"", "impl = \"sequential\"")
        .replace("iterations = 50", "iterations = 4")
        .replace("val_every = 25", "val_every = 0")
        .replace("impl = \"candle\"", &format!("impl = \"{executor}\""));
    assert!(toml.contains("\"sequential\"") && toml.contains("iterations = 4"), "the tiny config changed: {toml}");
    let path = c.dir.join(format!("{executor}.toml"));
    std::fs::write(&path, toml).unwrap();
    path
}

/// `pipeline launch --nproc 1` trains through the transport (MPI with one rank), as `torchrun
/// --nproc 1` does, so that the collectives' cost against a plain run can be measured (on a GPU
/// the target is under 1% of the step): the weights are the plain run's bit for bit, the
/// report times an all-reduce every step, and the rank finalises MPI at its end (exit 0).
#[test]
fn a_launched_world_of_one_runs_its_collectives() {
    let Some(_alone) = with_mpi() else { return };
    let c = tiny::corpus("dp-one");
    let path = tiny_sequential(&c, "candle");
    let plain = scratch("dp-one-plain");
    tiny::train_ok(&path, &plain, &[]);
    let launched = scratch("dp-one-launched");
    launch_ok(&path, &launched, 1, &[], None);
    let (a, b) = (weights(&plain), weights(&launched));
    assert!(a == b, "a launched world of one trains other weights than a plain run");
    let (r1, r2) = (report(&plain), report(&launched));
    assert_eq!(tiny::u(&r2.train, "world_size"), 1);
    assert_eq!(tiny::f(&r1.train, "comm_ms_per_step"), 0.0);
    assert!(tiny::f(&r2.train, "comm_ms_per_step") > 0.0, "{:?}", r2.train.get("comm_ms_per_step"));
    assert!(r2.stages["train"].extra_us.get("allreduce").is_some_and(|h| h.count == 4));
    assert!(!r1.stages["train"].extra_us.contains_key("allreduce"));
}

/// The explicit engine on two ranks trains the weights of one rank with both micro-batches,
/// with its gradient all-reduce overlapped with the backward pass and without. The tiny model
/// (2 layers, 25,028 parameters) in buckets of 2.5 Ki elements (the first 512) makes about ten
/// buckets leave, the first ones while the backward pass is still in the last block.
/// Tolerance: 2e-5 as for the candle executor; measured: 4e-6, with the demo's model too (the
/// engine's single rank adds its two micro-batches' terms inside the weight GEMMs, the ranks
/// add the two halves after: another rounding). The report says how much of the exchange ran
/// under the backward pass (none without overlap). Summing the buckets instead of averaging
/// them moves the weights by 2e-3, which fails it.
#[test]
fn two_engine_ranks_train_the_weights_of_one() {
    let Some(_alone) = with_mpi() else { return };
    let c = tiny::corpus("dp-engine");
    let path = tiny_sequential(&c, "engine");
    let one = scratch("dp-engine-one");
    tiny::train_ok(&path, &one, &["train.grad_accum_steps=2"]);
    let small = ["stages.train.bucket_mib=0.01", "stages.train.first_bucket_mib=0.002"];
    for overlap in [true, false] {
        let two = scratch(&format!("dp-engine-two-{overlap}"));
        let o = format!("stages.train.overlap_allreduce={overlap}");
        launch_ok(&path, &two, 2, &["train.grad_accum_steps=1", small[0], small[1], &o], None);
        let (a, b) = (weights(&one), weights(&two));
        let worst = a.iter().zip(&b).flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(p, q)| (p - q).abs())).fold(0f32, f32::max);
        eprintln!("engine, overlap {overlap}: largest weight difference, 2 ranks against 1: {worst}");
        assert!(worst <= 2e-5, "overlap {overlap}: weights differ by {worst}");
        let r = report(&two);
        assert_eq!(tiny::u(&r.train, "world_size"), 2);
        assert!(r.stages["train"].extra_us.get("allreduce").is_some_and(|h| h.count == 4));
        let hidden = tiny::f(&r.train, "comm_overlapped_ms_per_step");
        assert_eq!(hidden > 0.0, overlap, "overlap {overlap}: {hidden} ms per step of the exchange under the backward pass");
    }
}

/// Phased TTT on two ranks: the work queue's batches (one document each here) dealt in rounds
/// of two, the ranks pausing together for each phase and splitting its global SGD steps. With
/// the phases' boundaries (2 and 4 documents) on round ends, the pauses fall where one rank's
/// do, so two ranks give one rank's score, over the same targets, to float summation order
/// (the global SGD's gradients summed over the ranks; measured: 1e-9 bpb or less). Rank 0 logs
/// every batch's `ttp:` line and both phases.
#[test]
fn two_ranks_share_phased_ttt() {
    let Some(_alone) = with_mpi() else { return };
    let c = tiny::corpus("dp-phased");
    let path = tiny::config_plus(&c, "dp-phased", &tiny::after_training_phased().replace("batch_docs = 3", "batch_docs = 1"));
    let toml = std::fs::read_to_string(&path).unwrap();
    assert!(toml.contains("impl = \"shuffled\"") && toml.contains("batch_docs = 1"), "the tiny config changed: {toml}");
    std::fs::write(&path, toml.replace("impl = \"shuffled\"", "impl = \"sequential\"")).unwrap();
    let one = scratch("dp-phased-one");
    // The first 2,048 tokens of the split: a few documents, a hundred-odd chunks.
    let split = "train.val_max_tokens=2048";
    tiny::train_ok(&path, &one, &["train.iterations=6", "train.grad_accum_steps=2", split]);
    let two = scratch("dp-phased-two");
    launch_ok(&path, &two, 2, &["train.iterations=6", "train.grad_accum_steps=1", split], None);
    let (r1, r2) = (report(&one), report(&two));
    let (a, b) = (&r1.sections["eval"]["ttt"], &r2.sections["eval"]["ttt"]);
    eprintln!("phased TTT, 1 rank: {} bpb, 2 ranks: {} bpb", a["val_bpb"], b["val_bpb"]);
    assert_eq!(a["val_tokens"], b["val_tokens"], "every target once, between the ranks");
    assert_eq!(a["batches"], b["batches"]);
    let (pa, pb) = (a["phases"].as_array().unwrap(), b["phases"].as_array().unwrap());
    assert_eq!(pa.len(), 2, "{a}");
    for (x, y) in pa.iter().zip(pb) {
        for k in ["documents", "after_batch", "tokens", "trained_chunks", "steps"] {
            assert_eq!(x[k], y[k], "phase {}: {k}", x["phase"]);
        }
    }
    let d = (a["val_bpb"].as_f64().unwrap() - b["val_bpb"].as_f64().unwrap()).abs();
    assert!(d < 1e-6, "phased TTT: 2 ranks differ from 1 by {d} bpb");
    let log = std::fs::read_to_string(two.join("train.log")).unwrap();
    let batches = b["batches"].as_u64().unwrap();
    assert_eq!(log.lines().filter(|l| l.starts_with("ttp: b")).count() as u64, batches, "{log}");
    assert!(log.lines().any(|l| l.starts_with("ttpp: phase 2/2 done: 4 documents")), "{log}");
}

/// A rank killed mid-run ends the whole job: a non-zero exit, the killed rank named by MPI,
/// every process gone, well before the run would have ended.
#[test]
fn a_killed_rank_stops_every_rank() {
    let Some(_alone) = with_mpi() else { return };
    let c = tiny::corpus("dp-kill");
    let cfg = config(&c);
    let out = scratch("dp-kill");
    let mut child = launch(&cfg, &out, 2, &["train.iterations=100000", "train.grad_accum_steps=1"]);
    // Rank 1: the process whose environment says so, once training is under way.
    let t0 = std::time::Instant::now();
    let rank1 = loop {
        assert!(t0.elapsed() < Duration::from_secs(120), "training never started");
        assert!(child.try_wait().unwrap().is_none(), "the job ended on its own");
        let started = std::fs::read_to_string(out.join("train.log")).is_ok_and(|l| l.contains("step:2/"));
        if let Some(pid) = started.then(|| rank_pid(1)).flatten() {
            break pid;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    std::process::Command::new("kill").args(["-KILL", &rank1.to_string()]).status().unwrap();
    let status = wait_or_kill(&mut child, Duration::from_secs(60), "the job after rank 1 was killed");
    let o = child.wait_with_output().unwrap();
    assert!(!status.success(), "{}", text(&o));
    let all = text(&o);
    assert!(all.contains("rank 1"), "the killed rank is not named: {all}");
    assert!(rank_pid(0).is_none() && rank_pid(1).is_none(), "a rank outlived the job");
}

/// The pid of the live `pipeline` process that is rank `r` of a job started by this test
/// process's `mpirun` (Open MPI's environment).
fn rank_pid(r: usize) -> Option<u32> {
    let exe = env!("CARGO_BIN_EXE_pipeline");
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else { continue };
        if !cmd.starts_with(exe.as_bytes()) {
            continue;
        }
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        let state = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        if state.split_whitespace().nth(2) == Some("Z") {
            continue;
        }
        if env.split(|&b| b == 0).any(|v| v == format!("OMPI_COMM_WORLD_RANK={r}").as_bytes()) {
            return Some(pid);
        }
    }
    None
}

/// Bad rank settings are refused before anything runs, exit 2, each naming what is wrong; none
/// of these needs MPI.
#[test]
fn bad_rank_settings_are_refused() {
    // Not alongside another test's ranks (their processes are looked for by environment).
    let _alone = RANKS.lock().unwrap_or_else(|e| e.into_inner());
    let c = tiny::corpus("dp-bad");
    let cfg = config(&c);
    let run = |env: &[(&str, &str)], args: &[&str]| {
        let mut cmd = bin();
        cmd.args(args).arg(&cfg).arg("--out").arg(scratch("dp-bad-run"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    // A config asking for 2 ranks, started alone.
    let o = run(&[], &["run", "--set", "run.world_size=2"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("was started alone") && text(&o).contains("pipeline launch --nproc 2"), "{}", text(&o));
    // A rank past the world size in the launcher's environment.
    let o = run(&[("RANK", "2"), ("WORLD_SIZE", "2")], &["run"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("RANK=2") && text(&o).contains("WORLD_SIZE=2"), "{}", text(&o));
    // --nproc against the config's world size, and --nproc 0.
    let o = run(&[], &["launch", "--nproc", "3", "--set", "run.world_size=2"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("`run.world_size` = 2") && text(&o).contains("--nproc is 3"), "{}", text(&o));
    let o = run(&[], &["launch", "--nproc", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("--nproc must be at least 1"), "{}", text(&o));
    // The engine's gradient buckets must hold something.
    let o = run(&[], &["run", "--set", "stages.train.impl=engine", "--set", "stages.train.first_bucket_mib=0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("key `first_bucket_mib` = 0 must be a positive number of MiB"), "{}", text(&o));
    // An ablation started as one of several ranks.
    let o = run(&[("RANK", "0"), ("WORLD_SIZE", "2")], &["ablate", "--vary", "train.iterations=1,2"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("`pipeline ablate` runs on one rank"), "{}", text(&o));
}

/// The test config of [`resume_across_ranks`]: [`config`]'s model and steps, without the
/// stages after training, with `sampler` and a checkpoint after every step.
fn resume_config(c: &Corpus, sampler: &str) -> std::path::PathBuf {
    let dp = std::fs::read_to_string(config(c)).unwrap();
    let base = dp.split("\n[stages.artifact]").next().unwrap();
    let toml = base.replace("impl = \"sequential\"", &format!("impl = \"{sampler}\""))
        + "\n[stages.ckpt]\nkind = \"checkpoint\"\nimpl = \"atomic\"\ninputs = [\"train\"]\nevery = 1\n";
    let path = c.dir.join(format!("resume-{sampler}.toml"));
    std::fs::write(&path, toml).unwrap();
    path
}

/// Runs `launch` to the end; panics with its output unless it succeeds.
fn launch_ok(config: &Path, out: &Path, nproc: usize, sets: &[&str], resume: Option<&Path>) {
    let mut cmd = bin();
    cmd.arg("launch").arg("--nproc").arg(nproc.to_string()).arg(config).arg("--out").arg(out).arg("-q");
    if let Some(r) = resume {
        cmd.arg("--resume").arg(r);
    }
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let status = wait_or_kill(&mut child, Duration::from_secs(300), "pipeline launch");
    let o = child.wait_with_output().unwrap();
    assert!(status.success(), "{}", text(&o));
}

/// Checkpoints of several ranks resume exactly, and with another world size where the data
/// order allows it:
///
/// - the sequential stream does not depend on the world size (`W · A` fixed): 2 steps on one
///   rank x 2 micro-batches, resumed on 2 ranks x 1 for 2 more (`train.iterations` 2, then 4:
///   the tiny config's schedule has no warm-down), end with the weights of 4 steps on one
///   rank, bit for bit;
/// - the shuffled sampler's state differs by rank, and the checkpoint holds every rank's:
///   2 + 2 steps on 2 ranks end with the weights of 4 uninterrupted steps, bit for bit; the same
///   checkpoint on one rank is refused, exit 2, saying which world size it needs.
#[test]
fn resume_across_ranks() {
    let Some(_alone) = with_mpi() else { return };
    let c = tiny::corpus("dp-resume");
    let same = |a: &Path, b: &Path| {
        let (wa, wb) = (weights(a), weights(b));
        assert_eq!(wa.len(), wb.len());
        for ((na, xa), (_, xb)) in wa.iter().zip(&wb) {
            assert!(xa == xb, "{na} differs between {} and {}", a.display(), b.display());
        }
    };
    let seq = resume_config(&c, "sequential");
    let full = scratch("dp-resume-full");
    tiny::train_ok(&seq, &full, &["train.grad_accum_steps=2"]);
    let half = scratch("dp-resume-half");
    tiny::train_ok(&seq, &half, &["train.grad_accum_steps=2", "train.iterations=2"]);
    let two = scratch("dp-resume-two");
    launch_ok(&seq, &two, 2, &["train.grad_accum_steps=1"], Some(&half));
    assert_eq!(tiny::u(&report(&two).train, "steps"), 4);
    same(&full, &two);

    // The shuffled sampler deals the shards by rank: two of them.
    let tokens = tiny::shard_tokens(&c.dir.join("shards/fineweb_train_000000.bin"));
    let (a, b) = tokens.split_at(tokens.len() / 2);
    pipeline::data::shard::write_shard(&c.dir.join("shards/fineweb_train_000000.bin"), a).unwrap();
    pipeline::data::shard::write_shard(&c.dir.join("shards/fineweb_train_000001.bin"), b).unwrap();
    let shuf = resume_config(&c, "shuffled");
    let sets = ["train.grad_accum_steps=1"];
    let full = scratch("dp-resume-sfull");
    launch_ok(&shuf, &full, 2, &sets, None);
    let half = scratch("dp-resume-shalf");
    launch_ok(&shuf, &half, 2, &[sets[0], "train.iterations=2"], None);
    let two = scratch("dp-resume-stwo");
    launch_ok(&shuf, &two, 2, &sets, Some(&half));
    same(&full, &two);
    let o = bin()
        .args(["run", "-q", "--set", "train.grad_accum_steps=2", "--resume"])
        .arg(&half)
        .arg(&shuf)
        .arg("--out")
        .arg(scratch("dp-resume-one"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("with the shuffled sampler") && text(&o).contains("`run.world_size` = 2"), "{}", text(&o));
}
