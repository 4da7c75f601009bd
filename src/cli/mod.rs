//! The commands of the `pipeline` binary as library calls: `src/main.rs` parses arguments and
//! calls one `command` here, which prints and returns the exit code.
//!
//! - [`run`]: `pipeline run` (plan, resume, memory, build, run, report) and the stop signals;
//! - [`launch`], [`ranks`]: `pipeline launch --nproc N`, and a run process among several ranks;
//! - [`ablate`]: `pipeline ablate`, runs that vary settings, compared side by side;
//! - [`advise`]: `pipeline advise`, channel depths predicted from a run's service times;
//! - [`project`]: `pipeline project`, the step on N ranks predicted from a one-rank run;
//! - [`submission`]: `pipeline submission`, runs checked against the challenge's rules and the
//!   records folder; [`verify`]: `--verify`, a records folder's code rebuilt and rerun;
//! - [`validate`], [`report`], [`stages`]: check a config, print a report, list the stages;
//! - [`data`], [`artifact`]: prepare shards, build and score an artifact;
//! - [`check`]: `pipeline parity` and `pipeline attention-trial`;
//! - [`audit`]: `pipeline audit-eval`, the legality audit of a run's evaluation.
//!
//! Printing goes through the macros `out!`, `out_raw!` and `err!` below (in scope in every
//! module declared after them): a closed stdout or stderr (a pipe to
//! `head`, a terminal gone after SIGHUP) is nothing to print to, never a panic.

/// `println!` that takes a closed stdout (a pipe to `head`, a terminal gone after SIGHUP) as
/// nothing to print to, instead of panicking: the run directory has everything.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// `print!`, likewise.
macro_rules! out_raw {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = write!(std::io::stdout().lock(), $($t)*);
    }};
}

/// `eprintln!`, likewise.
macro_rules! err {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

/// Prints `value` as pretty JSON: exit code 0, or 1 (the error printed) when it cannot be
/// serialised. What every `--json` flag prints through.
fn print_json(value: &impl serde::Serialize) -> i32 {
    match serde_json::to_string_pretty(value) {
        Ok(s) => {
            out!("{s}");
            0
        }
        Err(e) => {
            err!("error: {e}");
            1
        }
    }
}

#[cfg(feature = "tools")]
pub mod ablate;
#[cfg(feature = "tools")]
pub mod advise;
#[cfg(feature = "tools")]
pub mod artifact;
#[cfg(feature = "tools")]
pub mod audit;
#[cfg(feature = "tools")]
pub mod check;
#[cfg(feature = "tools")]
pub mod data;
pub mod launch;
#[cfg(feature = "tools")]
pub mod project;
pub mod ranks;
pub mod report;
pub mod run;
pub mod stages;
#[cfg(feature = "tools")]
pub mod submission;
pub mod validate;
#[cfg(feature = "tools")]
pub mod verify;
