//! `pipeline advise RUN_DIR`: channel depths from a finished run's recorded service times
//! ([`crate::report::advise`]).

use std::path::PathBuf;

use crate::report::advise;
use crate::report::document::Report;

/// Prints the advice (or its JSON); 0, or 1 when the run's report cannot be read or holds no
/// service-time distributions.
pub fn command(run_dir: PathBuf, json: bool) -> i32 {
    let report = Report::load(&run_dir);
    let advice = report.as_ref().map_err(|e| anyhow::anyhow!("{e:#}")).and_then(advise::advise);
    // No advice from a run that did not complete: say that first, it is the likelier reason.
    let advice = advice.map_err(|e| match report.as_ref().ok().and_then(advise::caveat) {
        Some(c) => anyhow::anyhow!("{c}; and no advice: {e:#}"),
        None => e,
    });
    match advice {
        Ok(a) if json => super::print_json(&a),
        Ok(a) => {
            out_raw!("{}", advise::render(&a));
            0
        }
        Err(e) => {
            err!("error: {}: {e:#}", run_dir.display());
            1
        }
    }
}
