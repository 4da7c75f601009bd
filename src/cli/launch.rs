//! `pipeline launch --nproc N CONFIG`: starts N ranks of `pipeline run CONFIG` on this machine,
//! as `torchrun --standalone` does, and stops them all when one fails.
//!
//! - CPU ranks (`run.device = "cpu"`) talk over MPI, which must start them itself: the launcher
//!   runs `mpirun -n N` (Open MPI: with `--oversubscribe`, `--bind-to none`, and as root
//!   `--allow-run-as-root`; MPICH's `mpiexec` as it is). MPI ends the whole job when a rank
//!   exits with an error or is killed, and names it.
//! - GPU ranks talk over NCCL: the launcher makes NCCL's unique id, starts the N processes with
//!   `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and the id in the environment, and watches them: the
//!   first that fails is named, and the others get SIGTERM (then SIGKILL after 10 s).
//!
//! Output reads like torchrun's: rank 0's training log only (`--all-ranks`: every rank's, each
//! line tagged `[r] `), errors from every rank, `-q` honoured by all, and a progress bar only
//! when the launcher's own stdout is a terminal ([`crate::runtime::console`]: under `mpirun` a
//! rank's stdout is a pseudo-terminal even when the job's output goes to a file).
//!
//! Each rank gets `RAYON_NUM_THREADS` = cores / N unless it is set, so N ranks do not run N
//! times as many threads as the machine has cores, and `LAUNCH_COLLECTIVE=1`: even `--nproc 1`
//! trains through the transport (its collectives against a plain `pipeline run`'s none, as
//! `torchrun --nproc 1` does). Ctrl-C reaches every rank (one process
//! group); the launcher waits for them and returns the job's exit code.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::train::config::Config;

/// What `pipeline launch` starts.
pub struct Options {
    /// Ranks to start.
    pub nproc: usize,
    /// `--set` overrides, passed on to every rank.
    pub sets: Vec<String>,
    /// `--out`, passed on.
    pub out: Option<PathBuf>,
    /// `--resume`, passed on.
    pub resume: Option<PathBuf>,
    /// `--quiet`, passed on.
    pub quiet: bool,
    /// Every rank's training log on stdout, each line tagged `[r] ` (else rank 0's only).
    pub all_ranks: bool,
}

/// Starts the ranks and waits for them; returns the job's exit code.
pub fn command(config: PathBuf, o: Options) -> i32 {
    match launch(&config, &o) {
        Ok(code) => code,
        Err(e) => {
            err!("error: {e:#}");
            2
        }
    }
}

fn launch(config: &Path, o: &Options) -> anyhow::Result<i32> {
    anyhow::ensure!(o.nproc >= 1, "--nproc must be at least 1");
    let loaded = crate::runtime::config::load::<Config>(config, &o.sets).map_err(|e| anyhow::anyhow!("{e}"))?;
    let asked = loaded.config.run.world_size;
    anyhow::ensure!(
        asked <= 1 || asked == o.nproc,
        "`run.world_size` = {asked} in {}, but --nproc is {}: leave `run.world_size` out, or make them agree",
        config.display(),
        o.nproc
    );
    let exe = std::env::current_exe()?;
    let mut args: Vec<String> = vec!["run".into(), config.display().to_string()];
    for s in &o.sets {
        args.extend(["--set".into(), s.clone()]);
    }
    if let Some(out) = &o.out {
        args.extend(["--out".into(), out.display().to_string()]);
    }
    if let Some(r) = &o.resume {
        args.extend(["--resume".into(), r.display().to_string()]);
    }
    if o.quiet {
        args.push("--quiet".into());
    }
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / o.nproc).max(1).to_string()
    });
    // The launcher outlives every rank: a signal is for the ranks (they share its process
    // group), which stop and report; the launcher then returns their exit code.
    let signals =
        signal_hook::iterator::Signals::new([signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP])?;
    // What the ranks print: rank 0's lines (or every rank's, tagged), and a progress bar only
    // when this launcher's own output is a terminal (mpirun gives ranks a pty regardless).
    use std::io::IsTerminal;
    let console = [
        (crate::runtime::console::OUTPUT_VAR, if o.all_ranks { "all" } else { "rank0" }),
        (crate::runtime::console::TERMINAL_VAR, if std::io::stdout().is_terminal() { "1" } else { "0" }),
    ];
    let code = if loaded.config.run.device == "cpu" {
        over_mpi(&exe, &args, o.nproc, &threads, &console)
    } else {
        own_ranks(&exe, &args, o.nproc, &threads, &loaded.config.run.device, &console)
    };
    drop(signals);
    code
}

/// `mpirun -n N` (Open MPI) or `mpiexec -n N` (MPICH) running `exe args`.
fn over_mpi(exe: &Path, args: &[String], n: usize, threads: &str, console: &[(&str, &str)]) -> anyhow::Result<i32> {
    anyhow::ensure!(cfg!(feature = "mpi"), "{}", crate::dist::NO_MPI);
    let version = Command::new("mpirun")
        .arg("--version")
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run `mpirun` ({e}): install MPI (Debian: apt-get install openmpi-bin libopenmpi-dev)"))?;
    let open_mpi = String::from_utf8_lossy(&version.stdout).contains("Open MPI");
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string()]);
    if open_mpi {
        // More ranks than cores is the user's choice here (2 ranks on a 2-core CI machine);
        // rank threads are sized by RAYON_NUM_THREADS, not by core binding.
        cmd.args(["--oversubscribe", "--bind-to", "none"]);
        if is_root() {
            cmd.arg("--allow-run-as-root");
        }
    }
    // The collective even for --nproc 1 (its cost against a plain run is then measurable).
    cmd.arg(exe).args(args).env("RAYON_NUM_THREADS", threads).env(crate::dist::COLLECTIVE_VAR, "1").envs(console.iter().copied());
    let status = cmd.status().map_err(|e| anyhow::anyhow!("cannot start mpirun: {e}"))?;
    Ok(exit_code(status))
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe extern "C" {
        fn geteuid() -> u32;
    }
    unsafe { geteuid() == 0 }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// N processes started here (GPU ranks), watched until all end or one fails.
fn own_ranks(exe: &Path, args: &[String], n: usize, threads: &str, device: &str, console: &[(&str, &str)]) -> anyhow::Result<i32> {
    let id = Some(crate::dist::new_nccl_id(device)?);
    let mut children: Vec<Option<Child>> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut cmd = Command::new(exe);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("RAYON_NUM_THREADS", threads)
            .env(crate::dist::COLLECTIVE_VAR, "1")
            .envs(console.iter().copied());
        if let Some(id) = &id {
            cmd.env(crate::dist::NCCL_ID_VAR, id);
        }
        match cmd.spawn() {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                stop_all(&mut children, STOP_GRACE);
                anyhow::bail!("cannot start rank {rank} ({}): {e}", exe.display());
            }
        }
    }
    Ok(watch(&mut children, STOP_GRACE).0)
}

/// How long a rank asked to stop (SIGTERM) has before it is killed: a rank stuck in a
/// collective with a lost peer (NCCL waits for ever) never gets to its signal handler's stop.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Watches the ranks' processes (in rank order) until all have ended or one fails: then that
/// rank is named and the others are stopped ([`stop_all`]), so the job ends within `grace` of
/// a lost rank. The job's exit code and the rank that failed first.
fn watch(children: &mut [Option<Child>], grace: Duration) -> (i32, Option<usize>) {
    let (mut code, mut first) = (0, None);
    while children.iter().any(Option::is_some) {
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            // A child that cannot be waited for is as lost as one that died.
            let status = match child.try_wait() {
                Ok(s) => s.map(exit_code),
                Err(_) => Some(1),
            };
            if let Some(c) = status {
                *slot = None;
                if c != 0 && code == 0 {
                    (code, first) = (c, Some(rank));
                    err!("pipeline launch: rank {rank} exited with code {c}: stopping the other ranks");
                }
            }
        }
        if code != 0 {
            stop_all(children, grace);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    (code, first)
}

/// SIGTERM to every rank still running, SIGKILL to those alive `grace` later.
fn stop_all(children: &mut [Option<Child>], grace: Duration) {
    for c in children.iter().flatten() {
        // SAFETY: kill with a child's pid and a valid signal number.
        unsafe extern "C" {
            fn kill(pid: i32, sig: i32) -> i32;
        }
        unsafe { kill(c.id() as i32, signal_hook::consts::SIGTERM) };
    }
    let deadline = Instant::now() + grace;
    for c in children.iter_mut().flatten() {
        while Instant::now() < deadline && c.try_wait().ok().flatten().is_none() {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank lost mid-job (killed) ends the job within the grace period, named, even when the
    /// rank left behind ignores SIGTERM (as one stuck in a collective does): it is killed.
    #[test]
    fn a_lost_rank_ends_the_job_within_the_grace_naming_it() {
        let sh = |script: &str| Some(Command::new("sh").args(["-c", script]).spawn().unwrap());
        let mut children = vec![sh("trap '' TERM; sleep 60"), sh("sleep 0.3; kill -9 $$"), sh("sleep 60")];
        let t0 = Instant::now();
        let (code, first) = watch(&mut children, Duration::from_millis(500));
        assert_eq!((code, first), (137, Some(1)));
        assert!(t0.elapsed() < Duration::from_secs(10), "the job took {:?}", t0.elapsed());
        // Every child is gone (waited for): nothing keeps running.
        let (code, first) = watch(&mut [sh("exit 0"), sh("exit 0")], Duration::from_millis(500));
        assert_eq!((code, first), (0, None));
    }
}
