//! `pipeline ablate CONFIG --vary KEY=V1,V2 [...]`: the base config and each variant run one
//! after another (same seed, same data order), each in its own run directory under one
//! ablation directory, then compared side by side ([`crate::report::ablation`]): the table
//! printed, `ablation.json`, `ablation.txt` and `report.html` written (after every run, so a
//! stopped ablation keeps what it measured).
//!
//! Every variant's config is loaded and planned before anything runs, so a typo in a key fails
//! at once. Ctrl-C (or SIGTERM, SIGHUP) lets the current run finish and starts no other; a
//! second one stops the current run as `pipeline run` stops (drain, flush, report); a third
//! stops every stage where it stands. Rerun the same command with the same `--out` to go on: a
//! run that completed with the same settings is kept, any other is run again from the start.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::run::{self, RunError};
use crate::report::ablation::figures::Figures;
use crate::report::ablation::plan::{self, Variant, Vary};
use crate::report::ablation::summary;
use crate::report::html;
use crate::runtime::config::{self, Loaded};
use crate::runtime::control::{Control, StopSignal};
use crate::runtime::{graph, rundir};
use crate::stages::REGISTRY;
use crate::train::config::Config;

/// The flags of `pipeline ablate`.
pub struct Options {
    /// `--vary KEY=V1,V2,...` (replaces the config's `[ablation.vary]` when given).
    pub varies: Vec<String>,
    /// `--grid`: every combination instead of one key at a time.
    pub grid: bool,
    /// `--seeds N`: runs per variant.
    pub seeds: Option<u32>,
    /// `--out DIR`: the ablation directory (default `<run.out_dir>/ablation-<name>-<UTC>`).
    pub out: Option<PathBuf>,
    /// `--set KEY=VALUE` for every run.
    pub sets: Vec<String>,
    /// Print only errors, each run's one-line outcome and the comparison.
    pub quiet: bool,
}

/// The file in the ablation directory that marks it as one, and holds the comparison.
const SUMMARY: &str = "ablation.json";
/// Beside each run's report: the settings it was run with (a rerun keeps it only if they match).
const VARIANT: &str = "variant.json";

/// Runs the ablation; returns the exit code (0: every run completed; 1: a run failed or a file
/// could not be written; 2: bad config or flags; the signal's code when stopped).
pub fn command(path: PathBuf, o: Options) -> i32 {
    // Every rank would run the whole ablation on its own: refuse instead.
    if let Ok(p) = crate::dist::Placement::from_env()
        && p.world > 1
    {
        err!(
            "error: `pipeline ablate` runs on one rank; this process is rank {} of {} ({}): run it without mpirun or srun",
            p.rank,
            p.world,
            p.source
        );
        return 2;
    }
    let stop = Arc::new(Stop::default());
    if let Err(e) = handle_signals(stop.clone()) {
        err!("error: cannot install the handler of SIGINT, SIGTERM and SIGHUP: {e}");
        return 1;
    }
    let (dir, variants, loaded) = match prepare(&path, &o) {
        Ok(p) => p,
        Err((code, message)) => {
            err!("error: {message}");
            return code;
        }
    };
    if !o.quiet {
        err!("ablate: {} runs in {}", variants.len(), dir.display());
    }
    let mut runs: Vec<(Variant, Option<Figures>)> = variants.iter().map(|v| (v.clone(), kept(&dir, v))).collect();
    let mut failed = false;
    for k in 0..runs.len() {
        let v = runs[k].0.clone();
        if stop.after_current.load(Ordering::SeqCst) {
            break;
        }
        let label = format!("[{}/{}] {}", k + 1, variants.len(), v.dir);
        if runs[k].1.is_some() {
            out!("ablate: {label}: complete already, kept");
            continue;
        }
        let control = Arc::new(Control::new());
        *stop.current.lock().expect("the current run's control") = Some(control.clone());
        let outcome = run_variant(&dir, &v, &loaded[k], control, o.quiet);
        *stop.current.lock().expect("the current run's control") = None;
        let figures = match outcome {
            Ok(f) => f,
            Err(e) => {
                err!("error: {label}: {e}");
                failed = true;
                None
            }
        };
        match &figures {
            Some(f) => out!("ablate: {label}: {} in {:.1} s", f.status, f.wall_s),
            None => out!("ablate: {label}: no report"),
        }
        failed |= !figures.as_ref().is_some_and(Figures::complete) && !stop.after_current.load(Ordering::SeqCst);
        runs[k].1 = figures;
        if let Err(e) = write_summary(&dir, &path, &runs) {
            err!("error: {e:#}");
            failed = true;
        }
    }
    let lines = summary::compare(&runs);
    out!("\nablation {} ({}):\n{}", path.display(), dir.display(), summary::render(&lines));
    if let Err(e) = write_summary(&dir, &path, &runs) {
        err!("error: {e:#}");
        return 1;
    }
    match stop.signal() {
        Some(s) => {
            err!("ablate: stopped by {}; rerun with --out {} to go on", s.name(), dir.display());
            s.exit_code()
        }
        None => i32::from(failed),
    }
}

/// An ablation ready to run: its directory, its runs and each run's loaded config.
type Prepared = (PathBuf, Vec<Variant>, Vec<Loaded<Config>>);

/// Loads the base config, makes the plan and the ablation directory, and loads and plans
/// every variant's config (so a bad key fails before anything runs). Errors: `(exit code,
/// message)`.
fn prepare(path: &Path, o: &Options) -> Result<Prepared, (i32, String)> {
    let bad = |m: String| (2, m);
    let base = config::load::<Config>(path, &o.sets).map_err(|e| bad(e.to_string()))?;
    let table = &base.config.ablation;
    let varies: Vec<Vary> = if o.varies.is_empty() {
        table.vary.iter().map(|(k, v)| Vary::from_table(k, v)).collect()
    } else {
        o.varies.iter().map(|r| Vary::parse(r)).collect::<Result<_, _>>().map_err(bad)?
    };
    if varies.is_empty() {
        return Err(bad("nothing to vary: give --vary KEY=V1,V2 or an [ablation.vary] table in the config".into()));
    }
    let seeds = o.seeds.unwrap_or(table.seeds).max(1);
    let variants = plan::plan(&varies, o.grid || table.grid, seeds, base.config.run.seed).map_err(bad)?;
    let mut loaded = Vec::new();
    for v in &variants {
        let sets: Vec<String> = o.sets.iter().chain(&v.sets).cloned().collect();
        let l = config::load::<Config>(path, &sets)
            .map_err(RunError::from)
            .and_then(|l| {
                graph::plan(&l, &REGISTRY)?;
                run::check_run_table(&l)?;
                Ok(l)
            })
            .map_err(|e| bad(format!("variant `{}`: {e}", v.name)))?;
        loaded.push(l);
    }
    // The ablation directory is claimed as a run directory is (rundir::Claim): two ablations
    // given the same --out do not write into one another.
    let claimed = |e: anyhow::Error| (if e.downcast_ref::<rundir::Taken>().is_some() { 2 } else { 1 }, format!("{e:#}"));
    let (dir, claim) = match &o.out {
        Some(d) => {
            if d.exists() && !d.is_dir() {
                return Err((
                    2,
                    format!("--out {}: is a file, not a directory; give a new or empty directory, or an ablation's", d.display()),
                ));
            }
            let used = d.is_dir()
                && std::fs::read_dir(d).map(|mut r| r.any(|e| e.map_or(true, |e| e.file_name() != rundir::LOCK))).unwrap_or(true);
            if used && !d.join(SUMMARY).is_file() {
                return Err((
                    2,
                    format!("{} is not empty and holds no {SUMMARY}: not an ablation directory; choose another --out", d.display()),
                ));
            }
            std::fs::create_dir_all(d).map_err(|e| (1, format!("cannot create {}: {e}", d.display())))?;
            (d.clone(), rundir::claim(d).map_err(claimed)?)
        }
        None => rundir::create(None, &base.config.run.out_dir, &format!("ablation-{}", run::run_name(&base))).map_err(claimed)?,
    };
    if let Some(w) = &claim.unlocked {
        err!("warning: {w}");
    }
    let runs: Vec<(Variant, Option<Figures>)> = variants.iter().map(|v| (v.clone(), None)).collect();
    if !dir.join(SUMMARY).is_file() {
        write_summary(&dir, path, &runs).map_err(|e| (1, format!("{e:#}")))?;
    }
    Ok((dir, variants, loaded))
}

/// The figures of `v`'s run in `dir` if it completed with `v`'s settings (kept by a rerun).
fn kept(dir: &Path, v: &Variant) -> Option<Figures> {
    let run_dir = dir.join(&v.dir);
    let recorded: Variant = serde_json::from_slice(&std::fs::read(run_dir.join(VARIANT)).ok()?).ok()?;
    if recorded != *v {
        return None;
    }
    Figures::read(&run_dir).ok().filter(Figures::complete)
}

/// Runs `v` in its directory under `dir` (a leftover of an earlier attempt removed first) and
/// reads its figures; `None` when the run wrote no report.
fn run_variant(dir: &Path, v: &Variant, loaded: &Loaded<Config>, control: Arc<Control>, quiet: bool) -> anyhow::Result<Option<Figures>> {
    use anyhow::Context;
    let run_dir = dir.join(&v.dir);
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).with_context(|| format!("cannot remove the earlier attempt {}", run_dir.display()))?;
    }
    let result = run::run(loaded, Some(&run_dir), None, control, |d, _| {
        if !quiet {
            err!("ablate: {}: run directory {}", v.name, d.display());
        }
    });
    match result {
        Ok(outcome) => {
            if let Some(e) = &outcome.report.run.error {
                err!("error: {}: {e}", v.name);
            }
            rundir::write_atomic(&run_dir.join(VARIANT), &serde_json::to_vec_pretty(v)?)?;
            Ok(Figures::read(&run_dir).ok())
        }
        Err(RunError::Complete(m)) => anyhow::bail!("{m}"),
        Err(e) => Err(anyhow::anyhow!("{e}")),
    }
}

/// Writes `ablation.json` (every run's settings and figures, and the comparison),
/// `ablation.txt` (the table) and `report.html` (the table and every run's plots overlaid; a
/// failure to write it is a warning).
fn write_summary(dir: &Path, config: &Path, runs: &[(Variant, Option<Figures>)]) -> anyhow::Result<()> {
    let lines = summary::compare(runs);
    let json = serde_json::json!({
        "config": config.display().to_string(),
        "runs": runs.iter().map(|(v, f)| serde_json::json!({ "variant": v, "figures": f })).collect::<Vec<_>>(),
        "comparison": lines,
        "significance_bar": { "nats": summary::BAR_NATS, "p": summary::BAR_P },
    });
    rundir::write_atomic(&dir.join(SUMMARY), &serde_json::to_vec_pretty(&json)?)?;
    rundir::write_atomic(&dir.join("ablation.txt"), summary::render(&lines).as_bytes())?;
    // The page is a view of the runs' reports: failing to write it fails nothing.
    if let Err(e) = html::write_ablation(dir, config, runs, &lines) {
        err!("warning: {} not written: {e:#}", dir.join(html::FILE).display());
    }
    Ok(())
}

/// Writes `ABL_DIR/report.html` again from `ablation.json` and the runs' directories (for
/// `pipeline report ABL_DIR --html`); returns its path.
pub fn rewrite_html(dir: &Path) -> anyhow::Result<PathBuf> {
    use anyhow::Context;
    let path = dir.join(SUMMARY);
    let json: serde_json::Value =
        serde_json::from_slice(&crate::runtime::files::read(&path)?).with_context(|| format!("{} is not JSON", path.display()))?;
    let config = json["config"].as_str().unwrap_or("-");
    let variants: Vec<Variant> = json["runs"]
        .as_array()
        .map(|rs| rs.iter().filter_map(|r| serde_json::from_value(r["variant"].clone()).ok()).collect())
        .unwrap_or_default();
    if variants.is_empty() {
        anyhow::bail!("{} lists no runs", path.display());
    }
    let runs: Vec<(Variant, Option<Figures>)> = variants
        .into_iter()
        .map(|v| {
            let figures = Figures::read(&dir.join(&v.dir)).ok();
            (v, figures)
        })
        .collect();
    html::write_ablation(dir, Path::new(config), &runs, &summary::compare(&runs))
}

/// What the signal thread tells the loop.
#[derive(Default)]
struct Stop {
    /// Start no other run.
    after_current: AtomicBool,
    /// The first signal's number.
    first: Mutex<Option<StopSignal>>,
    /// The control of the run in progress.
    current: Mutex<Option<Arc<Control>>>,
}

impl Stop {
    fn signal(&self) -> Option<StopSignal> {
        *self.first.lock().expect("the first signal")
    }
}

/// SIGINT, SIGTERM, SIGHUP: the first lets the current run finish and starts no other, the
/// next ones reach the current run's control as `pipeline run`'s handler would.
fn handle_signals(stop: Arc<Stop>) -> std::io::Result<()> {
    let numbers: Vec<i32> = StopSignal::ALL.iter().map(|s| s.number()).collect();
    let mut signals = signal_hook::iterator::Signals::new(&numbers)?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for n in signals.forever() {
            let Some(signal) = StopSignal::from_number(n) else { continue };
            let first = !stop.after_current.swap(true, Ordering::SeqCst);
            if first {
                *stop.first.lock().expect("the first signal") = Some(signal);
                err!("ablate: {}: finishing the current run, then stopping (again to stop the current run now)", signal.name());
                continue;
            }
            if let Some(c) = stop.current.lock().expect("the current run's control").as_ref() {
                let again = c.stopping();
                c.interrupt_by(signal);
                err!(
                    "ablate: {}: {}",
                    signal.name(),
                    if again { "stopping every stage now" } else { "stopping the current run (drain, flush, report)" }
                );
            }
        }
    })?;
    Ok(())
}
