//! `pipeline report RUN_DIR`: a finished run's report again, as the table or as JSON.

use std::path::PathBuf;

use crate::report::document::Report;

/// Prints the report of `run_dir`; exit 1 when it cannot be read.
pub fn command(run_dir: PathBuf, json: bool) -> i32 {
    match Report::load(&run_dir) {
        Ok(r) if json => match serde_json::to_string_pretty(&r) {
            Ok(s) => {
                out!("{s}");
                0
            }
            Err(e) => {
                err!("error: {e}");
                1
            }
        },
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
