//! `pipeline report RUN_DIR`: a finished run's report again, as the table or as JSON, or its
//! `report.html` written again (`--html`, also for an ablation directory).

use std::path::PathBuf;

use crate::report::document::Report;

/// Prints the report of `run_dir`, or with `html` writes its `report.html` (an ablation
/// directory's too) and prints the path; exit 1 when it cannot be read or written.
pub fn command(run_dir: PathBuf, json: bool, html: bool) -> i32 {
    if html {
        return write_html(&run_dir);
    }
    match Report::load(&run_dir) {
        Ok(r) if json => super::print_json(&r),
        Ok(r) => {
            out_raw!("{}", r.render());
            0
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

/// `--html` in the lean record build, which has no HTML report: an error saying where it is.
#[cfg(not(feature = "tools"))]
fn write_html(dir: &std::path::Path) -> i32 {
    err!("error: the lean record build has no HTML report; write {}'s with the full build (`pipeline report --html`)", dir.display());
    2
}

/// `--html`: a run directory's page from its report.json (and steps.tsv), or an ablation
/// directory's from its ablation.json and its runs' directories.
#[cfg(feature = "tools")]
fn write_html(dir: &std::path::Path) -> i32 {
    let written = if !dir.join("report.json").exists() && dir.join("ablation.json").is_file() {
        super::ablate::rewrite_html(dir)
    } else {
        Report::load(dir).and_then(|r| crate::report::html::write_run(dir, &r))
    };
    match written {
        Ok(path) => {
            out!("{}", path.display());
            0
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}
