//! `pipeline advise RUN_DIR`: channel depths from a finished run's recorded service times
//! ([`crate::report::advise`]).

use std::path::PathBuf;

use crate::report::advise;
use crate::report::document::Report;

/// Prints the advice (or its JSON); 0, or 1 when the run's report cannot be read or holds no
/// service-time distributions.
pub fn command(run_dir: PathBuf, json: bool) -> i32 {
    let advice = Report::load(&run_dir).and_then(|r| advise::advise(&r));
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
