//! `attention = "auto"` on a GPU: the step executor's choice between the two flash
//! implementations. Each one's trial ([`crate::model::attention_trial::check_flash`]) runs in
//! a child process of this binary (`pipeline attention-trial`), with a time limit: a kernel
//! that faults the GPU leaves a CUDA context that cannot recover, and one that hangs never
//! returns, so neither may run in the training process before it has been seen to work. The
//! WMMA kernels (`flash`, measured on an H100) are the incumbent; the register-fragment ones
//! (`flash_mma`) take over only when they agree with the reference and are more than
//! [`MARGIN`] faster.

use std::io::Read;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::model::attention_trial::{AttentionShape, Outcome, TrialSettings, choose, summary};
use crate::model::flash_attn::FlashKernels;

/// How much faster a challenger must be to replace the incumbent (a fraction of its time).
pub const MARGIN: f64 = 0.05;
/// How long one implementation's trial process may take (device start-up included).
pub const TIMEOUT: Duration = Duration::from_secs(180);

/// The flash kernels `attention = "auto"` trains with on `device` ("cuda:N") for micro-batches
/// of `shape`, each implementation tried by `exe attention-trial` (this binary), and the train
/// log's account of the trials. An error, naming every reason, where neither runs correctly.
pub fn choose_flash(exe: &Path, device: &str, shape: AttentionShape, timeout: Duration) -> anyhow::Result<(FlashKernels, String)> {
    let kinds = [FlashKernels::Wmma, FlashKernels::Mma];
    let outcomes: Vec<Outcome> =
        kinds.iter().map(|&k| outcome_of(k.name(), run(&mut trial_command(exe, device, k, shape), timeout))).collect();
    let line = summary(&outcomes, shape, TrialSettings::flash());
    let best = choose(&outcomes, MARGIN).ok_or_else(|| {
        anyhow::anyhow!(
            "no flash kernel runs correctly on {device} ({line}); set attention = \"materialized\", or \"flash\" / \"flash_mma\" to skip the trial"
        )
    })?;
    let chosen = kinds.into_iter().zip(&outcomes).find(|(_, o)| std::ptr::eq(*o, best)).map(|(k, _)| k);
    Ok((chosen.unwrap_or(FlashKernels::Wmma), line))
}

/// `exe attention-trial ...` for one implementation at `shape`, printing its outcome as JSON.
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
            Err(e) => return Err(format!("could not be waited for: {e}")),
        }
    };
    Ok(Finished { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() })
}

/// The outcome a trial process of implementation `name` reports, or one that leaves it out
/// with what went wrong: no end, a failed exit (a signal is named: a fault that killed the
/// process), or output that is not an outcome.
pub fn outcome_of(name: &str, run: Result<Finished, String>) -> Outcome {
    let f = match run {
        Ok(f) => f,
        Err(why) => return Outcome::left_out(name, format!("trial process {why}")),
    };
    let last_err = f.stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_string();
    if !f.status.success() {
        use std::os::unix::process::ExitStatusExt;
        let how = match (f.status.code(), f.status.signal()) {
            (_, Some(sig)) => format!("killed by signal {sig}"),
            (Some(code), _) => format!("exited with status {code}"),
            _ => "ended abnormally".to_string(),
        };
        return Outcome::left_out(
            name,
            if last_err.is_empty() { format!("trial process {how}") } else { format!("trial process {how}: {last_err}") },
        );
    }
    match serde_json::from_str::<Outcome>(f.stdout.trim()) {
        Ok(o) if o.name == name => o,
        Ok(o) => Outcome::left_out(name, format!("trial process reported `{}`", o.name)),
        Err(e) => Outcome::left_out(name, format!("trial process printed no outcome ({e})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", script]);
        c
    }

    /// A trial process's outcome is taken as printed; one that hangs, faults, fails or prints
    /// something else leaves its implementation out, saying how, and never stalls the caller.
    #[test]
    fn trial_processes_that_hang_fault_or_fail_are_left_out() {
        let ok = r#"{"name":"flash_mma","rel_err":0.004,"ms":3.5,"rejected":null}"#;
        let o = outcome_of("flash_mma", run(&mut sh(&format!("echo '{ok}'")), TIMEOUT));
        assert_eq!(o, Outcome { name: "flash_mma".into(), rel_err: Some(0.004), ms: Some(3.5), rejected: None });

        let start = Instant::now();
        let o = outcome_of("flash_mma", run(&mut sh("sleep 30"), Duration::from_millis(300)));
        assert!(start.elapsed() < Duration::from_secs(10), "the caller waited {:?}", start.elapsed());
        assert!(o.rejected.as_deref().is_some_and(|w| w.contains("timed out after")), "{o:?}");

        let o = outcome_of("flash_mma", run(&mut sh("echo 'CUDA_ERROR_ILLEGAL_ADDRESS' >&2; kill -SEGV $$"), TIMEOUT));
        assert!(
            o.rejected.as_deref().is_some_and(|w| w.contains("killed by signal 11") && w.contains("CUDA_ERROR_ILLEGAL_ADDRESS")),
            "{o:?}"
        );

        let o = outcome_of("flash", run(&mut sh("echo 'error: no GPU' >&2; exit 1"), TIMEOUT));
        assert_eq!(o.rejected.as_deref(), Some("trial process exited with status 1: error: no GPU"));

        let o = outcome_of("flash", run(&mut sh(&format!("echo '{ok}'")), TIMEOUT));
        assert!(o.rejected.as_deref().is_some_and(|w| w.contains("reported `flash_mma`")), "{o:?}");
        let o = outcome_of("flash", run(&mut sh("echo hello"), TIMEOUT));
        assert!(o.rejected.as_deref().is_some_and(|w| w.contains("printed no outcome")), "{o:?}");
        let o = outcome_of("flash", run(&mut Command::new("/nonexistent/pipeline"), TIMEOUT));
        assert!(o.rejected.as_deref().is_some_and(|w| w.contains("could not start")), "{o:?}");

        // A child that writes more than a pipe holds to stderr before printing its outcome.
        let noisy = format!("head -c 300000 /dev/zero | tr '\\0' x >&2; echo '{ok}'");
        assert_eq!(outcome_of("flash_mma", run(&mut sh(&noisy), TIMEOUT)).ms, Some(3.5));
    }
}
