//! `pipeline run` as a library call: plan, find a resumed run complete, estimate memory, make
//! the run directory, build every stage, write the resolved config, run, write the report
//! (`report.json`, and `report.html` beside it).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::report::document::{self, Report, ReportMeta};
use crate::runtime::config::Loaded;
use crate::runtime::control::Control;
use crate::runtime::error::ConfigErrors;
use crate::runtime::exec::{self, BuildError};
use crate::runtime::graph::{self, Plan};
use crate::runtime::memory::Estimate;
use crate::runtime::rundir;
use crate::stages::REGISTRY;
use crate::train::config::Config;

/// Why a run could not produce a report.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The config is wrong (exit code 2).
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    /// A stage could not be built for a reason of the system's, e.g. a file it restores from
    /// could not be read (exit code 1; bad input is a [`RunError::Config`]).
    #[error("{0}")]
    Build(#[from] BuildError),
    /// The run directory or its files could not be written, or a checkpoint could not be
    /// read (exit code 1).
    #[error("{0:#}")]
    Io(#[from] anyhow::Error),
    /// `--resume` names no checkpoint, or one that is not a checkpoint or is corrupt (exit code
    /// 2: bad input, like a config error).
    #[error("{0:#}")]
    Resume(anyhow::Error),
    /// The run directory is held by another run, or holds another run's files (exit code 2:
    /// choose another `--out`).
    #[error("{0:#}")]
    Taken(anyhow::Error),
    /// A resumed run found nothing left to do: the run it continues is complete (exit code 0;
    /// no file was touched).
    #[error("{0}")]
    Complete(String),
}

impl RunError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Complete(_) => 0,
            RunError::Config(_) | RunError::Resume(_) | RunError::Taken(_) => 2,
            RunError::Build(_) | RunError::Io(_) => 1,
        }
    }

    /// A `--resume` refusal: bad input (exit 2), unless the checkpoint could not be read for a
    /// reason of the system's (permissions, a failing disk: exit 1).
    fn resume(e: anyhow::Error) -> Self {
        if crate::runtime::files::is_system_error(&e) { RunError::Io(e) } else { RunError::Resume(e) }
    }
}

/// A finished run.
pub struct RunOutcome {
    /// Its report (also in `run_dir/report.json`).
    pub report: Report,
    /// Its run directory.
    pub run_dir: PathBuf,
    /// Why `report.json` could not be written (a full disk, say): then the printed report is
    /// its only copy, and the exit code is at least 1.
    pub report_error: Option<String>,
}

impl RunOutcome {
    /// The process exit code: the run's, or 1 when it completed but its report was not saved.
    pub fn exit_code(&self) -> i32 {
        match (self.report.run.exit_code, &self.report_error) {
            (0, Some(_)) => 1,
            (code, _) => code,
        }
    }
}

/// The run's name: `[run] name`, else the config file's stem.
pub fn run_name(loaded: &Loaded<Config>) -> String {
    let n = &loaded.config.run.name;
    if !n.is_empty() {
        return n.clone();
    }
    loaded.path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "run".into())
}

/// Checks `[run]`: the device names something this binary can run on, and times are sane.
pub fn check_run_table(loaded: &Loaded<Config>) -> Result<(), ConfigErrors> {
    let dev = loaded.config.run.device.as_str();
    let mut errors = ConfigErrors::default();
    let max = loaded.config.run.max_seconds;
    if !max.is_finite() || !(0.0..=1e9).contains(&max) {
        errors.push(
            loaded.origin_of("run.max_seconds"),
            Some("run.max_seconds".into()),
            format!("must be a number of seconds from 0 (no limit) to 1e9; found {max}"),
        );
    }
    let cuda_ok = crate::device::CUDA_BUILD && matches!(crate::device::parse(dev), Ok(crate::device::DeviceName::Cuda(_)));
    let mem = loaded.config.run.max_memory_gb;
    if !mem.is_finite() || mem < 0.0 {
        errors.push(
            loaded.origin_of("run.max_memory_gb"),
            Some("run.max_memory_gb".into()),
            format!("must be a number of GiB, or 0 for what the machine has; found {mem}"),
        );
    }
    if dev != "cpu" && !cuda_ok {
        let msg = if dev.starts_with("cuda") {
            format!(
                "device `{dev}` needs a binary built with the `cuda` feature (see scripts/build-cuda.sh); this one runs on \"cpu\" only. \
                 To run this config on the CPU anyway (slow at a GPU recipe's size), add `--set run.device=cpu`; `pipeline validate` \
                 then names the GPU-only stage settings to change (`pin`, `upload`, `dtype`). CPU-sized configs: \
                 pipelines/demo.toml, and pipelines/record-mini.toml for the record recipe"
            )
        } else {
            format!("unknown device `{dev}`; expected \"cpu\" or \"cuda:N\"")
        };
        errors.push(loaded.origin_of("run.device"), Some("run.device".into()), msg);
    }
    errors.into_result()
}

/// Runs `loaded` to the end. `on_start` is called with the run directory once it exists and
/// every stage is built, and the memory estimate.
///
/// With `resume` (a run directory or a checkpoint file), the stages restore their state from
/// the checkpoint and the run continues in the checkpoint's run directory, or in `out`.
pub fn run(
    loaded: &Loaded<Config>,
    out: Option<&Path>,
    resume: Option<&Path>,
    control: Arc<Control>,
    on_start: impl FnOnce(&Path, &Estimate),
) -> Result<RunOutcome, RunError> {
    let plan: Plan = graph::plan(loaded, &REGISTRY)?;
    check_run_table(loaded)?;
    let name = run_name(loaded);
    let checkpoint = resume.map(crate::train::checkpoint::resolve).transpose().map_err(RunError::resume)?;
    let continued = match (&checkpoint, out) {
        (Some(c), None) => Some(run_dir_of(&c.path).map_err(RunError::resume)?),
        _ => None,
    };
    // `--resume RUN_DIR` continues the run where it stopped: its stages may find it complete,
    // before anything is estimated, allocated or written. A checkpoint named by its file is a
    // deliberate point to go on from, and is taken as one.
    let previous = continued.as_deref().filter(|_| resume.is_some_and(Path::is_dir)).and_then(|d| previous_report(d, &plan));
    // A checkpoint that cannot go on under this config is refused before the run it continues
    // is judged complete: a changed `[model]` must not read "complete, nothing to do".
    if let Some(c) = &checkpoint {
        crate::train::resume::fits(c, &loaded.config).map_err(RunError::Resume)?;
    }
    let mut ext = loaded.config.extensions();
    if let Some(c) = checkpoint {
        ext.insert(c);
    }
    if let Some(p) = previous {
        ext.insert(p);
        if let Some(message) = graph::nothing_left(&plan, loaded, &ext, continued.as_deref())? {
            return Err(RunError::Complete(message));
        }
        // The previous report is for `nothing_left` only.
        ext.remove::<Report>();
    }
    // Before anything is allocated: a model too big for memory is refused here, not aborted
    // by the allocator halfway through building it.
    let memory = graph::memory(&plan, loaded, &ext, gpu_free(&loaded.config.run));
    graph::check_memory(&memory, loaded)?;
    // Several ranks: rank 0 makes the run directory and writes every file; the others build
    // their stages without one (they write nothing) and learn its name for their messages.
    let ranks = crate::dist::world();
    let writer = ranks.rank() == 0;
    // The run directory is this run's alone until it ends (rundir::Claim): a second run given
    // the same --out, or a resume of a run still going, is refused.
    let taken = |e: anyhow::Error| if e.downcast_ref::<rundir::Taken>().is_some() { RunError::Taken(e) } else { RunError::Io(e) };
    let (run_dir, fresh, claim) = match continued {
        Some(d) if writer => {
            let claim = rundir::claim(&d).map_err(taken)?;
            (d, false, Some(claim))
        }
        Some(d) => (d, false, None),
        None if writer => {
            let (d, claim) = rundir::create(out, &loaded.config.run.out_dir, &name).map_err(taken)?;
            (d, true, Some(claim))
        }
        None => (PathBuf::new(), false, None),
    };
    if let Some(w) = claim.as_ref().and_then(|c| c.unlocked.as_deref()) {
        err!("warning: {w}");
    }
    let run_dir = if ranks.world() > 1 {
        let all = ranks.all_gather_bytes(run_dir.to_string_lossy().as_bytes())?;
        PathBuf::from(String::from_utf8_lossy(&all[0]).into_owned())
    } else {
        run_dir
    };
    // Build every stage before anything is written: a stage that cannot be built leaves the
    // run directory as it was.
    let built = match exec::build(&plan, &loaded.config.run, &ext, writer.then_some(run_dir.as_path())) {
        Ok(b) => b,
        Err(e) => {
            // Nothing ran: leave no new run directory behind.
            if fresh {
                let _ = std::fs::remove_dir_all(&run_dir);
            }
            if e.system {
                return Err(RunError::Build(e));
            }
            // A config problem, or a checkpoint that does not fit this config: bad input.
            let mut errors = ConfigErrors::default();
            let key = format!("stages.{}", e.stage);
            let message = format!("stage `{}` ({}/{}) could not be built: {}", e.stage, e.kind, e.imp, e.message);
            errors.push(loaded.origin_in(&key, &message), Some(key), message);
            return Err(RunError::Config(errors));
        }
    };
    if writer {
        write_resolved_config(loaded, &plan, &run_dir)?;
        on_start(&run_dir, &memory);
    }
    let started = rundir::now_rfc3339();
    let mut result = exec::run(&plan, &loaded.config.run, built, control);
    result.notes.extend(plan.stages.iter().filter_map(|s| s.set_aside_note()));
    if let Some(trace) = result.trace.take().filter(|_| writer)
        && let Err(e) = crate::runtime::trace::write(&trace, &run_dir.join("trace.json"))
    {
        // The run's measurements are in the report whatever becomes of its trace.
        result.notes.push(format!("trace.json was not written: {e:#}"));
    }
    let meta = ReportMeta {
        name: &name,
        config_path: &loaded.path,
        run_dir: &run_dir,
        started,
        warmup_items: loaded.config.run.warmup_items,
        instrument: loaded.config.run.instrument,
        hardware: crate::device::describe(&loaded.config.run),
    };
    let mut report = document::build(&plan, &result, &meta);
    if ranks.world() > 1 {
        if report.run.error.is_some() {
            // This rank failed: its peers may wait in a collective it will never enter. Its
            // caller ends every rank (`ranks::leave`), naming it.
            return Ok(RunOutcome { report, run_dir, report_error: None });
        }
        merge_ranks(&mut report, ranks.as_ref())?;
    }
    if !writer {
        ranks.barrier()?;
        super::ranks::mark_clean();
        return Ok(RunOutcome { report, run_dir, report_error: None });
    }
    // The run happened: whatever becomes of report.json, the caller gets the report to show.
    let report_error = serde_json::to_vec_pretty(&report)
        .map_err(anyhow::Error::from)
        .and_then(|json| rundir::write_atomic(&run_dir.join("report.json"), &json))
        .err()
        .map(|e| format!("{e:#}"));
    // The page beside it is a view of report.json: failing to write it fails nothing.
    if report_error.is_none() {
        write_html(&run_dir, &report);
    }
    if !ranks.is_identity() {
        // The other ranks leave once rank 0's files are written (a launcher's world of one:
        // MPI_Finalize, not an abort, at its end).
        ranks.barrier()?;
        super::ranks::mark_clean();
    }
    Ok(RunOutcome { report, run_dir, report_error })
}

/// Every rank's stage tables gathered, and merged into rank 0's report (the `ranks` section).
fn merge_ranks(report: &mut Report, ranks: &dyn crate::dist::Collective) -> anyhow::Result<()> {
    let mine = serde_json::to_vec(&report.stages)?;
    let all = ranks.all_gather_bytes(&mine)?;
    if ranks.rank() == 0 {
        let tables = all.iter().map(|b| serde_json::from_slice(b)).collect::<Result<Vec<_>, _>>()?;
        crate::report::ranks::add_to(report, &tables, ranks.backend());
    }
    Ok(())
}

/// Writes `RUN_DIR/report.html` from `report`; a failure is a warning naming the file, never
/// the run's failure (report.json has everything the page shows). The lean record build has no
/// HTML report: the full build writes it later (`pipeline report --html RUN_DIR`).
pub fn write_html(run_dir: &Path, report: &Report) {
    #[cfg(feature = "tools")]
    if let Err(e) = crate::report::html::write_run(run_dir, report) {
        err!("warning: {} not written: {e:#}", run_dir.join(crate::report::html::FILE).display());
    }
    #[cfg(not(feature = "tools"))]
    let _ = (run_dir, report);
}

/// The report of the process that last ran in `run_dir`, if it ran the same stages (names,
/// kinds and implementations) as `plan`: what a resumed run's stages may read to find that
/// nothing is left to do. A missing or unreadable report is none.
fn previous_report(run_dir: &Path, plan: &Plan) -> Option<Report> {
    let r = Report::load(run_dir).ok()?;
    let same = r.run.stage_order.len() == plan.stages.len()
        && plan.stages.iter().zip(&r.run.stage_order).all(|(s, name)| {
            &s.name == name && r.stages.get(name).is_some_and(|st| st.kind == s.factory.kind() && st.imp == s.factory.name())
        });
    same.then_some(r)
}

/// The run directory a checkpoint file belongs to (`RUN_DIR/checkpoints/step_N.safetensors`).
fn run_dir_of(checkpoint: &Path) -> anyhow::Result<PathBuf> {
    let dir = checkpoint.parent().filter(|d| d.file_name().is_some_and(|n| n == crate::train::checkpoint::DIR));
    match dir.and_then(Path::parent) {
        Some(run_dir) if run_dir.is_dir() => Ok(run_dir.to_path_buf()),
        _ => anyhow::bail!(
            "{} is not in a run directory's `{}/` folder: name the run directory to continue in with --out",
            checkpoint.display(),
            crate::train::checkpoint::DIR
        ),
    }
}

/// Writes `RUN_DIR/config.toml`: every layer merged and every default filled in, so the run can
/// be repeated with `pipeline run RUN_DIR/config.toml`.
fn write_resolved_config(loaded: &Loaded<Config>, plan: &Plan, run_dir: &Path) -> anyhow::Result<()> {
    let mut cfg = loaded.config.clone();
    if cfg.run.name.is_empty() {
        cfg.run.name = run_name(loaded);
    }
    let mut table = toml::Table::try_from(&cfg)?;
    table.insert("stages".into(), toml::Value::Table(plan.stage_tables()));
    let text = format!(
        "# Resolved config of this run: file, environment and --set merged, defaults filled in.\n# Repeat the run with: pipeline run {}\n\n{}",
        run_dir.join("config.toml").display(),
        toml::to_string_pretty(&table)?
    );
    rundir::write_atomic(&run_dir.join("config.toml"), text.as_bytes())
}

/// The free memory of the GPU `[run] device` names, the memory estimate's budget when
/// `max_memory_gb` is 0 (`None` on "cpu", or where it cannot be read).
pub fn gpu_free(run: &crate::runtime::config::RunConfig) -> Option<u64> {
    (run.device != "cpu" && run.max_memory_gb <= 0.0).then(|| crate::device::gpu_free_memory(&run.device)).flatten()
}

/// `pipeline run`: installs the signal handler, loads the config, runs, prints the report and
/// every failure; returns the exit code.
pub fn command(path: PathBuf, out: Option<PathBuf>, sets: Vec<String>, quiet: bool, resume: Option<PathBuf>) -> i32 {
    // Install the handler first, so a signal at any moment still ends in a written report.
    let control = Arc::new(Control::new());
    if let Err(e) = handle_stop_signals(control.clone()) {
        err!("error: cannot install the handler of SIGINT, SIGTERM and SIGHUP: {e}");
        return 1;
    }
    let mut loaded = match crate::runtime::config::load::<Config>(&path, &sets) {
        Ok(l) => l,
        Err(e) => {
            err!("error: {e}");
            return 2;
        }
    };
    let placement = match super::ranks::join(&mut loaded) {
        Ok(p) => p,
        Err(e) => {
            err!("error: {e:#}");
            return 2;
        }
    };
    // The training log's lines: rank 0's, or every rank's when the launcher asks (tagged).
    crate::runtime::console::set(crate::runtime::console::Console::from_env(quiet, placement.rank));
    // Rank 0 speaks for the job; the others print only their errors, named.
    let (quiet, who) = match placement.rank {
        0 => (quiet, String::new()),
        r => (true, format!("rank {r}: ")),
    };
    let result = run(&loaded, out.as_deref(), resume.as_deref(), control, |dir, memory| {
        if !quiet {
            err!("pipeline: run directory {}", dir.display());
            err!("pipeline: {}", memory.summary().replace('\n', "\npipeline: "));
        }
    });
    match result {
        Ok(outcome) if placement.rank > 0 => {
            if let Some(e) = &outcome.report.run.error {
                err!("{who}error: {e}");
            }
            outcome.exit_code()
        }
        Ok(outcome) => {
            out!("{}", outcome.report.render());
            let trace = outcome.run_dir.join("trace.json");
            if loaded.config.run.trace && trace.is_file() {
                out!("trace: {} (open it in https://ui.perfetto.dev or chrome://tracing)", trace.display());
            }
            if let Some(e) = &outcome.report.run.error {
                err!("error: {e}");
            }
            // Every other stage that failed, too: the first failure is often not the only one
            // (a full disk fails the checkpoint and then the weights).
            for (name, st) in &outcome.report.stages {
                if let Some(e) = &st.error
                    && outcome.report.run.error.as_deref() != Some(&format!("stage `{name}` failed: {e}"))
                {
                    err!("error: stage `{name}` {}: {e}", st.state);
                }
            }
            if let Some(e) = &outcome.report_error {
                // The table leaves out the sections and histograms: print what report.json
                // would have held, so nothing the run measured is lost.
                if let Ok(json) = serde_json::to_string_pretty(&outcome.report) {
                    out!("report.json (not saved):\n{json}");
                }
                err!("error: {e}: the report above (table and report.json) is its only copy");
            }
            outcome.exit_code()
        }
        Err(RunError::Complete(message)) => {
            out!("{message}");
            0
        }
        Err(e) => {
            err!("{who}error: {e}");
            e.exit_code()
        }
    }
}

/// SIGINT, SIGTERM and SIGHUP all stop a run as Ctrl-C does (the first drains and flushes, a
/// second stops every stage where it stands); the first one's number sets the exit code. A
/// thread of its own takes them (signal-hook's self-pipe), so nothing runs in the handler.
fn handle_stop_signals(control: Arc<Control>) -> std::io::Result<()> {
    use crate::runtime::control::StopSignal;
    let numbers: Vec<i32> = StopSignal::ALL.iter().map(|s| s.number()).collect();
    let mut signals = signal_hook::iterator::Signals::new(&numbers)?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for n in signals.forever() {
            let Some(signal) = StopSignal::from_number(n) else { continue };
            let again = control.stopping();
            control.interrupt_by(signal);
            let name = signal.name();
            if again {
                err!("pipeline: {name} while stopping: stopping every stage now");
            } else {
                err!(
                    "pipeline: {name}: draining in-flight items, then flushing and writing the report (again to stop at once; exit {})",
                    signal.exit_code()
                );
            }
        }
    })?;
    Ok(())
}
