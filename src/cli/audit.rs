//! `pipeline audit-eval RUN_DIR|CONFIG`: the legality audit of the run's configured evaluation
//! ([`crate::stages::ttt_eval::audit`]): causality and, where the model claims it, document
//! masking, on a prefix of the validation split.

use std::path::PathBuf;

use crate::stages::ttt_eval::audit::{AuditOptions, audit_run};

/// Audits the evaluation of the run directory or config at `path`, prints the report's lines
/// (or, with `json`, the report): exit 0 when it passes, 1 when a check fails, 2 on an error
/// (no config, no `ttt_eval` stage, unreadable weights, a prefix too short).
pub fn command(path: PathBuf, opts: AuditOptions, json: bool) -> i32 {
    match audit_run(&path, &opts) {
        Ok(report) => {
            let code = if report.passed() { 0 } else { 1 };
            if json {
                let printed = super::print_json(&report);
                return if printed == 0 { code } else { 2 };
            }
            for line in report.lines() {
                out!("{line}");
            }
            code
        }
        Err(e) => {
            err!("error: {}: {e:#}", path.display());
            2
        }
    }
}
