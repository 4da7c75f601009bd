//! `attention = "auto"` on a GPU: the step executor's choice between the flash
//! implementations. Each one's trial ([`crate::train::attention_trial::check_flash`]) runs in
//! a child process of this binary (`pipeline attention-trial`), with a time limit: a kernel
//! that faults the GPU leaves a CUDA context that cannot recover, and one that hangs never
//! returns, so none may run in the training process before it has been seen to work. The
//! first of the list is the incumbent (the candle path: the WMMA kernels, `flash`, measured on
//! an H100; the engine: its flash_mma kernels); a challenger (`flash_mma`, cuDNN's `cudnn`,
//! left out with the reason where cuDNN cannot run) takes over when it agrees with the
//! reference and is more than [`MARGIN`] faster, or when the incumbent is left out. Where the
//! trial cannot run at all, the incumbent is taken as it was before the trial existed; so in the
//! lean record build, which has no trial command, and says so.

#[cfg(feature = "tools")]
use std::io::Read;
use std::path::{Path, PathBuf};
#[cfg(feature = "tools")]
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;
#[cfg(feature = "tools")]
use std::time::Instant;

use crate::model::flash_attn::FlashKernels;
#[cfg(feature = "tools")]
use crate::train::attention_trial::choose;
use crate::train::attention_trial::{AttentionShape, Outcome, TrialSettings, summary};

/// How much faster a challenger must be to replace the incumbent (a fraction of its time).
#[cfg(feature = "tools")]
pub const MARGIN: f64 = 0.05;
/// How long one implementation's trial process may take (device start-up included).
pub const TIMEOUT: Duration = Duration::from_secs(180);

/// What `attention = "auto"` chose, and why: the step executor logs `line` and publishes the
/// rest in the report's `train.attention_auto`.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Choice {
    /// The implementation taken.
    #[serde(serialize_with = "kernels_name")]
    pub kernels: FlashKernels,
    /// Each implementation's trial, in [`FlashKernels::ALL`]'s order; one whose trial could
    /// not run is left out with the reason.
    pub outcomes: Vec<Outcome>,
    /// Whether `kernels` was taken without a trial: the trials could not run, or a resumed run
    /// kept its checkpoint's (`resumed_from`).
    pub untried: bool,
    /// The checkpoint whose kernels a resumed run kept, without a trial (see [`kept`]).
    pub resumed_from: Option<PathBuf>,
    /// The train log's account of the trials.
    pub line: String,
    /// Wall time of the trials, ms: before the training loop's timer, so `pipeline submission`
    /// adds it to the training time (a warm-up on the run's hardware).
    pub wall_ms: f64,
}

fn kernels_name<S: serde::Serializer>(k: &FlashKernels, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(k.name())
}

/// The flash kernels `attention = "auto"` trains with on `device` ("cuda:N") for micro-batches
/// of `shape`, each implementation tried by `exe attention-trial` (this binary), with the
/// trials' account, trying `kinds` (the first the incumbent). Where the trial itself cannot
/// run (no process, or one that fails before judging a kernel: the GPU held exclusively by
/// this process, say), the incumbent, as without a trial, and the account says so. An error,
/// naming every reason, where the trials ran and no implementation passed.
pub fn choose_flash(exe: &Path, device: &str, shape: AttentionShape, timeout: Duration, kinds: &[FlashKernels]) -> anyhow::Result<Choice> {
    anyhow::ensure!(!kinds.is_empty(), "no attention implementation to try");
    // The lean record build has no `attention-trial` command (the trial runs the candle flash
    // ops): the incumbent, said so, and none of the trial processes' code compiled.
    #[cfg(not(feature = "tools"))]
    {
        let _ = (exe, device, timeout);
        Ok(untried(kinds, shape, "this build has no attention trial (`pipeline attention-trial` is the full build's)"))
    }
    #[cfg(feature = "tools")]
    trials(exe, device, shape, timeout, kinds)
}

/// [`choose_flash`] in a build with the trial command: each implementation's trial process.
#[cfg(feature = "tools")]
fn trials(exe: &Path, device: &str, shape: AttentionShape, timeout: Duration, kinds: &[FlashKernels]) -> anyhow::Result<Choice> {
    let started = Instant::now();
    let results: Vec<TrialResult> =
        kinds.iter().map(|&k| outcome_of(k.name(), run(&mut trial_command(exe, device, k, shape), timeout))).collect();
    let outcomes: Vec<Outcome> = kinds
        .iter()
        .zip(&results)
        .map(|(k, r)| match r {
            TrialResult::Ran(o) => o.clone(),
            TrialResult::NotRun(why) => Outcome::left_out(k.name(), format!("trial could not run: {why}")),
        })
        .collect();
    let line = summary(&outcomes, shape, TrialSettings::flash());
    if matches!(results[0], TrialResult::NotRun(_)) {
        let line = format!("{line}; {} taken without a trial", kinds[0].name());
        let wall_ms = started.elapsed().as_secs_f64() * 1e3;
        return Ok(Choice { kernels: kinds[0], outcomes, untried: true, resumed_from: None, line, wall_ms });
    }
    let best = choose(&outcomes, MARGIN).ok_or_else(|| {
        anyhow::anyhow!(
            "no flash kernel runs correctly on {device} ({line}); set attention = \"materialized\", or \"flash\" / \"flash_mma\" to skip the trial"
        )
    })?;
    let chosen = kinds.iter().zip(&outcomes).find(|(_, o)| std::ptr::eq(*o, best)).map(|(k, _)| *k);
    let wall_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(Choice { kernels: chosen.unwrap_or(kinds[0]), outcomes, untried: false, resumed_from: None, line, wall_ms })
}

/// The incumbent (`kinds[0]`) without a trial, every implementation left out for `why`.
#[cfg(any(test, not(feature = "tools")))]
fn untried(kinds: &[FlashKernels], shape: AttentionShape, why: &str) -> Choice {
    let outcomes: Vec<Outcome> = kinds.iter().map(|k| Outcome::left_out(k.name(), why.to_string())).collect();
    let line = format!("{}; {} taken without a trial", summary(&outcomes, shape, TrialSettings::flash()), kinds[0].name());
    Choice { kernels: kinds[0], outcomes, untried: true, resumed_from: None, line, wall_ms: 0.0 }
}

/// What `attention = "auto"` takes when resuming from `checkpoint`, which trained with the
/// attention named `trained` (its step-executor state's `attention`): the same flash kernels,
/// without a trial, so that the resumed run computes what the uninterrupted one would have
/// (a new trial could pick the other implementation, whose bits differ). `None` where the
/// checkpoint did not train with flash kernels (a CPU run, or an older checkpoint): the trials
/// run as for a fresh start.
pub fn kept(trained: Option<&str>, checkpoint: &Path) -> Option<Choice> {
    let kernels = FlashKernels::ALL.into_iter().find(|k| Some(k.name()) == trained)?;
    let line = format!("{} kept from {} (the kernels it trained with; no trial)", kernels.name(), checkpoint.display());
    Some(Choice { kernels, outcomes: Vec::new(), untried: true, resumed_from: Some(checkpoint.to_path_buf()), line, wall_ms: 0.0 })
}

/// The binary the trials run: this process's own, even if its file was replaced since it
/// started (`/proc/self/exe`), else the path it was started from.
pub fn this_binary() -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    let proc = Path::new("/proc/self/exe");
    if proc.exists() {
        return Ok(proc.to_path_buf());
    }
    std::env::current_exe().context("the path of this binary, which runs the attention trials")
}

/// `exe attention-trial ...` for one implementation at `shape`, printing its outcome as JSON.
#[cfg(feature = "tools")]
fn trial_command(exe: &Path, device: &str, kernels: FlashKernels, shape: AttentionShape) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("attention-trial").args(["--device", device, "--kernels", kernels.name(), "--json"]);
    for (flag, value) in [
        ("--batch", shape.batch),
        ("--seq-len", shape.t),
        ("--heads", shape.heads),
        ("--kv-heads", shape.kv_heads),
        ("--head-dim", shape.head_dim),
    ] {
        cmd.arg(flag).arg(value.to_string());
    }
    cmd
}

/// A child process's end: how it exited and what it printed.
#[cfg(feature = "tools")]
#[derive(Debug)]
pub struct Finished {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

/// Runs `cmd` to its end or for `timeout` (then kills it). `Err` says why there is no end: it
/// could not start, or ran out of time.
#[cfg(feature = "tools")]
pub fn run(cmd: &mut Command, timeout: Duration) -> Result<Finished, String> {
    let mut child =
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(|e| format!("could not start: {e}"))?;
    // Read both pipes while waiting: a child that fills one would otherwise block forever.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let start = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("timed out after {:.0} s (a kernel that never returns?)", timeout.as_secs_f64()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("could not be waited for: {e}"));
            }
        }
    };
    Ok(Finished { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() })
}

/// What one trial process gave.
#[cfg(feature = "tools")]
#[derive(Clone, Debug, PartialEq)]
pub enum TrialResult {
    /// The trial judged the implementation: its outcome, a rejection included (a disagreement,
    /// a kernel error, a process killed by a signal or a panic, a hang).
    Ran(Outcome),
    /// The trial could not judge it, and why: the process did not start, or failed on its own
    /// (exit 1 or 2: no device, bad arguments, the reference failed), or printed no outcome.
    NotRun(String),
}

/// What a trial process of implementation `name` gave: its printed outcome (the last line of
/// its output), or why it has none, with the telling line of its standard error.
#[cfg(feature = "tools")]
pub fn outcome_of(name: &str, run: Result<Finished, String>) -> TrialResult {
    let f = match run {
        Ok(f) => f,
        // A hang is the kernel's doing; a process that did not start, the trial's.
        Err(why) if why.starts_with("timed out") => return TrialResult::Ran(Outcome::left_out(name, format!("trial process {why}"))),
        Err(why) => return TrialResult::NotRun(format!("trial process {why}")),
    };
    if !f.status.success() {
        use std::os::unix::process::ExitStatusExt;
        let said = telling_line(&f.stderr);
        let said = if said.is_empty() { String::new() } else { format!(": {said}") };
        return match (f.status.code(), f.status.signal()) {
            (Some(code @ (1 | 2)), _) => TrialResult::NotRun(format!("trial process exited with status {code}{said}")),
            (Some(code), _) => TrialResult::Ran(Outcome::left_out(name, format!("trial process exited with status {code}{said}"))),
            (_, Some(sig)) => TrialResult::Ran(Outcome::left_out(name, format!("trial process killed by signal {sig}{said}"))),
            _ => TrialResult::Ran(Outcome::left_out(name, format!("trial process ended abnormally{said}"))),
        };
    }
    let last = f.stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
    match serde_json::from_str::<Outcome>(last) {
        Ok(o) if o.name == name => TrialResult::Ran(o),
        Ok(o) => TrialResult::NotRun(format!("trial process reported `{}`", o.name)),
        Err(e) => TrialResult::NotRun(format!("trial process printed no outcome ({e})")),
    }
}

/// The line of a child's standard error that says what went wrong: its last `error:` line, a
/// panic's location and message, or else its last line that is not a `note:`.
#[cfg(feature = "tools")]
fn telling_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    if let Some(e) = lines.iter().rev().find(|l| l.starts_with("error:")) {
        return e.to_string();
    }
    if let Some(i) = lines.iter().position(|l| l.contains("panicked at")) {
        return lines[i..].iter().take(2).copied().collect::<Vec<_>>().join(" ");
    }
    lines.iter().rev().find(|l| !l.starts_with("note:")).map(|l| l.to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lean build's choice: the incumbent, every implementation left out with the reason,
    /// and the log line says it was taken without a trial.
    #[test]
    fn without_a_trial_the_incumbent_is_taken_and_said() {
        let shape = AttentionShape { batch: 2, t: 128, heads: 8, kv_heads: 4, head_dim: 64 };
        let c = untried(&[FlashKernels::Mma, FlashKernels::Cudnn], shape, "no trial here");
        assert_eq!((c.kernels, c.untried, c.outcomes.len()), (FlashKernels::Mma, true, 2));
        assert!(c.outcomes.iter().all(|o| o.rejected.as_deref() == Some("no trial here")), "{:?}", c.outcomes);
        assert!(c.line.ends_with("flash_mma taken without a trial"), "{}", c.line);
    }

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    fn rejected(r: &TrialResult) -> &str {
        match r {
            TrialResult::Ran(o) => o.rejected.as_deref().unwrap_or(""),
            TrialResult::NotRun(_) => panic!("expected a judged outcome: {r:?}"),
        }
    }

    /// A trial process's outcome is taken as printed (its last line); one that hangs, faults
    /// or panics leaves its implementation out, saying how, and never stalls the caller; one
    /// that fails on its own or prints something else did not judge the kernel.
    #[test]
    fn trial_processes_that_hang_fault_or_fail_are_told_apart() {
        let ok = r#"{"name":"flash_mma","rel_err":0.004,"ms":3.5,"rejected":null}"#;
        let o = outcome_of("flash_mma", run(&mut sh(&format!("echo 'loading'; echo '{ok}'")), TIMEOUT));
        assert_eq!(o, TrialResult::Ran(Outcome { name: "flash_mma".into(), rel_err: Some(0.004), ms: Some(3.5), rejected: None }));

        let start = Instant::now();
        let o = outcome_of("flash_mma", run(&mut sh("sleep 30"), Duration::from_millis(300)));
        assert!(start.elapsed() < Duration::from_secs(10), "the caller waited {:?}", start.elapsed());
        assert!(rejected(&o).starts_with("trial process timed out after"), "{o:?}");

        let o = outcome_of("flash_mma", run(&mut sh("echo 'CUDA_ERROR_ILLEGAL_ADDRESS' >&2; kill -KILL $$"), TIMEOUT));
        assert_eq!(rejected(&o), "trial process killed by signal 9: CUDA_ERROR_ILLEGAL_ADDRESS");

        let panic = "printf \"thread 'main' panicked at src/x.rs:1:1:\\nDriverError(CUDA_ERROR_LAUNCH_FAILED)\\nnote: run with RUST_BACKTRACE=1\\n\" >&2; exit 101";
        let o = outcome_of("flash_mma", run(&mut sh(panic), TIMEOUT));
        assert_eq!(
            rejected(&o),
            "trial process exited with status 101: thread 'main' panicked at src/x.rs:1:1: DriverError(CUDA_ERROR_LAUNCH_FAILED)"
        );

        let o = outcome_of("flash", run(&mut sh("echo 'error: cannot open the GPU' >&2; echo '  at 0' >&2; exit 1"), TIMEOUT));
        assert_eq!(o, TrialResult::NotRun("trial process exited with status 1: error: cannot open the GPU".into()));
        let o = outcome_of("flash", run(&mut sh(&format!("echo '{ok}'")), TIMEOUT));
        assert!(matches!(&o, TrialResult::NotRun(w) if w.contains("reported `flash_mma`")), "{o:?}");
        let o = outcome_of("flash", run(&mut sh("echo hello"), TIMEOUT));
        assert!(matches!(&o, TrialResult::NotRun(w) if w.contains("printed no outcome")), "{o:?}");
        let o = outcome_of("flash", run(&mut Command::new("/nonexistent/pipeline"), TIMEOUT));
        assert!(matches!(&o, TrialResult::NotRun(w) if w.contains("could not start")), "{o:?}");

        // A child that writes more than a pipe holds to stderr before printing its outcome.
        let noisy = format!("head -c 300000 /dev/zero | tr '\\0' x >&2; echo '{ok}'");
        assert!(matches!(outcome_of("flash_mma", run(&mut sh(&noisy), TIMEOUT)), TrialResult::Ran(o) if o.ms == Some(3.5)));
    }

    /// Where the trial cannot run at all (here: a binary that is not `pipeline`), `auto` keeps
    /// the incumbent, as without a trial, and says so: the WMMA kernels on the candle path,
    /// flash_mma in the engine.
    #[test]
    fn a_trial_that_cannot_run_keeps_the_incumbent() {
        let shape = AttentionShape { batch: 2, t: 128, heads: 2, kv_heads: 1, head_dim: 64 };
        let exe = Path::new("/nonexistent/pipeline");
        let choice = choose_flash(exe, "cuda:0", shape, TIMEOUT, &FlashKernels::ALL).unwrap();
        assert_eq!(choice.kernels, FlashKernels::Wmma);
        assert!(choice.untried && choice.outcomes.len() == 3, "{choice:?}");
        let json = serde_json::to_value(&choice).unwrap();
        assert_eq!(json["kernels"], "flash");
        for k in 0..3 {
            assert!(json["outcomes"][k]["rejected"].as_str().unwrap().contains("trial could not run"), "{json}");
        }
        let line = choice.line;
        assert!(
            line.contains("flash left out (trial could not run: trial process could not start")
                && line.contains("cudnn left out (trial could not run")
                && line.ends_with("; flash taken without a trial"),
            "{line}"
        );
        let engine = choose_flash(exe, "cuda:0", shape, TIMEOUT, &[FlashKernels::Mma, FlashKernels::Cudnn]).unwrap();
        assert_eq!((engine.kernels, engine.untried, engine.outcomes.len()), (FlashKernels::Mma, true, 2));
        assert!(engine.line.ends_with("; flash_mma taken without a trial"), "{}", engine.line);
        assert!(choose_flash(exe, "cuda:0", shape, TIMEOUT, &[]).is_err());
    }

    /// A resumed run keeps the flash kernels its checkpoint trained with, untried; anything
    /// else (the materialised attention, a CPU run, an older checkpoint) leaves the trials to run.
    #[test]
    fn a_resumed_run_keeps_its_checkpoints_flash_kernels() {
        let ck = Path::new("runs/r/checkpoints/step_00000200.safetensors");
        for k in FlashKernels::ALL {
            let c = kept(Some(k.name()), ck).expect("flash kernels are kept");
            assert_eq!((c.kernels, c.untried, c.outcomes.len()), (k, true, 0));
            assert_eq!(c.resumed_from.as_deref(), Some(ck));
            assert!(c.line.starts_with(k.name()) && c.line.contains("step_00000200") && c.line.contains("no trial"), "{}", c.line);
            let json = serde_json::to_value(&c).unwrap();
            assert_eq!(json["kernels"], k.name());
            assert_eq!(json["resumed_from"], ck.to_str().unwrap());
        }
        for trained in [Some("materialized"), Some("flash2"), None] {
            assert!(kept(trained, ck).is_none(), "{trained:?}");
        }
    }
}
