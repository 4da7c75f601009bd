//! What this process prints to its console, decided once per process: a run alone prints its
//! training log; among the ranks `pipeline launch` started, only rank 0 does, unless the
//! launcher asked for every rank's lines (each then tagged `[r] `), as `torchrun` does; `-q`
//! drops the progress bar. A progress bar is drawn only on a real terminal: the launcher says whether its own
//! output is one ([`TERMINAL_VAR`]), because under `mpirun` a rank's stdout is a pseudo-terminal
//! even when the job's output goes to a file (Open MPI), and a bar's escape codes would land in
//! that file.

use std::io::IsTerminal;
use std::sync::OnceLock;

/// Set by `pipeline launch` for its ranks: `all` (every rank's lines, tagged) or `rank0`.
pub const OUTPUT_VAR: &str = "LAUNCH_OUTPUT";
/// Set by `pipeline launch` for its ranks: `1` when the launcher's stdout is a terminal.
pub const TERMINAL_VAR: &str = "LAUNCH_TERMINAL";

/// The console's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Console {
    /// `-q`: no progress bar.
    pub quiet: bool,
    /// This process's rank (0 alone).
    pub rank: usize,
    /// Every rank prints its lines, tagged with its rank.
    pub all_ranks: bool,
    /// The output the user sees is a terminal.
    pub terminal: bool,
}

impl Console {
    /// The settings of a process of `rank` (`-q` if `quiet`), from the launcher's variables
    /// when it was launched, else from its own stdout.
    pub fn from_env(quiet: bool, rank: usize) -> Console {
        Console::from_vars(quiet, rank, std::env::var(OUTPUT_VAR).ok().as_deref(), std::env::var(TERMINAL_VAR).ok().as_deref())
    }

    /// [`Console::from_env`] with the variables' values given.
    pub fn from_vars(quiet: bool, rank: usize, output: Option<&str>, terminal: Option<&str>) -> Console {
        let terminal = match terminal {
            Some(v) => v == "1",
            None => std::io::stdout().is_terminal(),
        };
        Console { quiet, rank, all_ranks: output == Some("all"), terminal }
    }

    /// Whether the training log's lines go to stdout.
    pub fn prints_lines(&self) -> bool {
        self.rank == 0 || self.all_ranks
    }

    /// What each printed line starts with (`[r] ` when every rank prints); `None` where the
    /// log's lines do not go to stdout.
    pub fn line_prefix(&self) -> Option<String> {
        self.prints_lines().then(|| if self.all_ranks { format!("[{}] ", self.rank) } else { String::new() })
    }

    /// Whether a progress bar may be drawn: one process's, on a terminal, not under `-q`.
    pub fn bar(&self) -> bool {
        self.terminal && !self.quiet && self.prints_lines() && !self.all_ranks
    }
}

static CONSOLE: OnceLock<Console> = OnceLock::new();

/// Sets the process's console (the first call wins; `pipeline run` sets it once it knows its
/// rank).
pub fn set(c: Console) {
    let _ = CONSOLE.set(c);
}

/// The process's console: as set, else a run alone, not quiet.
pub fn get() -> Console {
    CONSOLE.get().cloned().unwrap_or_else(|| Console::from_env(false, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_zero_speaks_unless_every_rank_is_asked_for() {
        let c = |quiet, rank, output| Console::from_vars(quiet, rank, output, Some("0"));
        assert!(c(false, 0, None).prints_lines() && c(false, 0, Some("rank0")).prints_lines());
        assert!(!c(false, 1, Some("rank0")).prints_lines());
        assert!(c(false, 1, Some("all")).prints_lines());
        assert_eq!((c(false, 1, Some("all")).line_prefix(), c(false, 0, None).line_prefix()), (Some("[1] ".into()), Some(String::new())));
        assert_eq!(c(false, 1, Some("rank0")).line_prefix(), None);
        // `-q` drops the bar, not the log.
        assert!(c(true, 0, None).prints_lines() && !c(true, 1, Some("rank0")).prints_lines());
    }

    #[test]
    fn a_bar_needs_the_launchers_terminal_and_one_speaker() {
        // Under mpirun a rank's stdout is a pty: the launcher's variable decides.
        assert!(!Console::from_vars(false, 0, Some("rank0"), Some("0")).bar());
        assert!(Console::from_vars(false, 0, Some("rank0"), Some("1")).bar());
        assert!(!Console::from_vars(false, 1, Some("rank0"), Some("1")).bar());
        assert!(!Console::from_vars(false, 0, Some("all"), Some("1")).bar());
        assert!(!Console::from_vars(true, 0, None, Some("1")).bar());
    }
}
