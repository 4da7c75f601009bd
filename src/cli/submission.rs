//! `pipeline submission RUN_DIR... --out DIR [--against BPB | RUN_DIR...]`: finished runs, one
//! per seed, checked against the challenge's rules ([`crate::report::submission`]), with the
//! two checks that need more than the reports: the validation's byte count against its decoded
//! text ([`crate::eval::byte_check`]) and the legality audit of the evaluation the runs are
//! configured with ([`crate::stages::ttt_eval::audit`]). When every check passes it writes the
//! records folder; otherwise it writes nothing and exits 1. docs/submitting.md.

use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::report::submission::figures::RunFigures;
use crate::report::submission::folder;
pub use crate::report::submission::folder::Entry;
use crate::report::submission::rules::Check;
use crate::report::submission::{Against, Submission};
use crate::runtime::config;
use crate::train::config::Config;

/// The track of a valid submission that is not shown to beat its baseline.
pub const NON_RECORD_TRACK: &str = "non_record_16mb";

/// What `pipeline submission` takes beside the run directories.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The records folder to write.
    pub out: PathBuf,
    /// A record's val_bpb, or a baseline's run directories (empty: no significance test).
    pub against: Vec<String>,
    /// Distinct seeds required.
    pub seeds: usize,
    /// Validation tokens the legality audit scores (twice).
    pub audit_tokens: usize,
    /// The folder's entry: name, author, GitHub id, blurb, date (empty: defaults).
    pub entry: Entry,
    /// Print the checks as JSON.
    pub json: bool,
}

/// Runs the command: 0 when every check passed and the folder was written; 1 when a check
/// failed: no folder, except when only the significance failed (a valid submission that is
/// not a record: the folder is written for the non-record track); 2 on bad input (a run
/// directory that cannot be read, a bad --against, a non-empty --out).
pub fn command(runs: Vec<PathBuf>, o: Options) -> i32 {
    // A folder that would be refused is refused before the checks' minutes.
    if o.out.exists() && std::fs::read_dir(&o.out).map_or(true, |mut d| d.next().is_some()) {
        err!("error: {} already exists and is not empty; choose another --out", o.out.display());
        return 2;
    }
    let sub = match check(&runs, &o) {
        Ok(s) => s,
        Err(e) => {
            err!("error: {e:#}");
            return 2;
        }
    };
    if o.json {
        if super::print_json(&sub) != 0 {
            return 1;
        }
    } else {
        for c in &sub.checks {
            out!("{}", c.line());
        }
    }
    if !sub.valid() {
        let n = sub.failures().len();
        err!("submission refused: {n} check(s) failed; no folder written");
        return 1;
    }
    let mut entry = entry_for(&sub, &o.entry);
    if !sub.passed() && o.entry.track.is_empty() {
        // Valid, but not shown to beat what it was held against: not a record.
        entry.track = NON_RECORD_TRACK.into();
    }
    let code = match code_files(&sub) {
        Ok(c) => c,
        Err(e) => {
            err!("error: {e:#}");
            return 1;
        }
    };
    match folder::write(&sub, &entry, &code, &o.out) {
        Ok(files) => {
            if !o.json {
                out!(
                    "wrote {} ({} files): README.md, submission.json, and per seed train, config and report files",
                    o.out.display(),
                    files.len()
                );
            }
            if sub.passed() {
                0
            } else {
                err!("not a record: the significance check failed; the folder is written for the {NON_RECORD_TRACK} track");
                1
            }
        }
        Err(e) => {
            err!("error: {e:#}");
            2
        }
    }
}

/// Loads the runs and the baseline and makes every check.
pub fn check(dirs: &[PathBuf], o: &Options) -> anyhow::Result<Submission> {
    anyhow::ensure!(!dirs.is_empty(), "no run directory given: one per seed");
    let runs: Vec<RunFigures> = dirs.iter().map(|d| RunFigures::load(d)).collect::<anyhow::Result<_>>()?;
    let against = against(&o.against)?;
    let mut extra = Vec::new();
    // The byte count and the evaluation's legality depend on settings the seeds share (a
    // mixed set is refused by its own check): the first run's are checked.
    let first = &runs[0];
    extra.push(source_check(&runs));
    extra.push(bytes_check(first));
    extra.push(audit_check(&first.dir, o.audit_tokens));
    Ok(Submission::check(runs, o.seeds, &against, extra))
}

/// `--against`: one number (a bpb), or run directories.
fn against(values: &[String]) -> anyhow::Result<Against> {
    match values {
        [] => Ok(Against::Nothing),
        [one] if one.parse::<f64>().is_ok() => {
            let b: f64 = one.parse()?;
            anyhow::ensure!(b.is_finite() && b > 0.0, "--against {one}: a val_bpb must be a positive number");
            Ok(Against::Bpb(b))
        }
        dirs => Ok(Against::Runs(
            dirs.iter()
                .map(|d| RunFigures::load(Path::new(d)).with_context(|| format!("--against {d}: neither a val_bpb nor a run directory")))
                .collect::<anyhow::Result<_>>()?,
        )),
    }
}

/// The run's config, as resolved in its directory.
fn run_config(dir: &Path) -> anyhow::Result<Config> {
    let path = dir.join("config.toml");
    config::load_with_env::<Config>(&path, &[], false).map(|l| l.config).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Every run's source bundle and `Cargo.lock` in its run directory, byte for byte the ones
/// it recorded, as a check: a submission ships exactly the code that trained it.
fn source_check(runs: &[RunFigures]) -> Check {
    let rule = "each run's source bundle and Cargo.lock are in its directory, byte for byte as the run recorded them";
    let mut problems = Vec::new();
    for r in runs {
        match r.measured_bundle() {
            Err(why) => problems.push(format!("seed {}: {why}", r.seed)),
            Ok(b) => {
                if let Err(e) = crate::artifact::bundle::read(&r.dir, b) {
                    problems.push(format!("seed {}: {e:#}", r.seed));
                }
            }
        }
    }
    let figure = match (problems.first(), runs.first().and_then(|r| r.bundle.as_ref())) {
        (Some(_), _) | (None, None) => problems.join("; "),
        (None, Some(b)) => format!("{} intact in {} run(s): {} files of the {}", b.file, runs.len(), b.files, b.build.line()),
    };
    Check::new("source", problems.is_empty() && !runs.is_empty(), figure, rule)
}

/// The first run's source bundle and `Cargo.lock`, checked again, for the folder.
fn code_files(sub: &Submission) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let r = sub.runs.first().context("no run")?;
    let b = r.measured_bundle().map_err(|e| anyhow::anyhow!("{}: {e}", r.dir.display()))?;
    let (packed, lock) = crate::artifact::bundle::read(&r.dir, b)?;
    Ok(vec![(b.file.clone(), packed), (crate::artifact::bundle::sources::LOCK.to_string(), lock)])
}

/// The validation's bytes against its decoded text, as a check; the bytes and targets it
/// counted must be the ones the run's score divided by.
fn bytes_check(run: &RunFigures) -> Check {
    let rule = "the validation's bytes by the challenge's rule are the ones the score divided by, equal its decoded text's document by document, and the tokenizer has the bare `▁` piece";
    match run_config(&run.dir).and_then(|c| crate::eval::byte_check::check(&c.validation()).context("`data.val`, `data.tokenizer`")) {
        Ok(b) => {
            let (tokens, bytes) = (run.score.val_tokens, run.score.val_bytes);
            let same = b.targets == tokens && b.counted_bytes == bytes;
            let mut figure = b.figure();
            if !same {
                figure = format!("the score divided by {bytes} bytes over {tokens} targets, but the split counts {figure}");
            }
            Check::new("val bytes", same && b.passed(), figure, rule)
        }
        Err(e) => Check::new("val bytes", false, format!("cannot check: {e:#}"), rule),
    }
}

/// The legality audit of the run's evaluation, as a check.
fn audit_check(dir: &Path, tokens: usize) -> Check {
    let rule =
        "every score before a changed validation token is unchanged, bit for bit; no state crosses a BOS where the model masks documents";
    let opts = crate::stages::ttt_eval::audit::AuditOptions { tokens, ..Default::default() };
    match crate::stages::ttt_eval::audit::audit_run(dir, &opts) {
        Ok(a) => Check::new("legality", a.passed(), a.lines().join("; "), rule),
        Err(e) => Check::new("legality", false, format!("cannot audit: {e:#}"), rule),
    }
}

/// The entry with its defaults: the runs' name, today's date, the 10-minute track, this
/// binary's version and the commit of the source tree the code count measured.
fn entry_for(sub: &Submission, given: &Entry) -> Entry {
    let mut e = given.clone();
    if e.name.is_empty() {
        e.name = sub.runs.first().map_or_else(String::new, |r| r.name.clone());
    }
    if e.date.is_empty() {
        e.date = crate::runtime::rundir::now_rfc3339().chars().take(10).collect();
    }
    if e.track.is_empty() {
        e.track = "10min_16mb".into();
    }
    if e.software.is_empty() {
        let commit = crate::artifact::bundle::sources::root().and_then(|root| {
            let out = std::process::Command::new("git").arg("-C").arg(root).args(["rev-parse", "--short=12", "HEAD"]).output().ok()?;
            out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        });
        e.software = match commit {
            Some(c) => format!("`pipeline` {} (commit {c})", env!("CARGO_PKG_VERSION")),
            None => format!("`pipeline` {}", env!("CARGO_PKG_VERSION")),
        };
    }
    e
}
