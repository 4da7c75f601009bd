//! Run-wide stop and abort flags.
//!
//! A run is `running` until something asks it to stop:
//! - a graceful stop (Ctrl-C or SIGTERM or SIGHUP, `[run] max_seconds`, or a stage calling
//!   [`Ctx::request_stop`]):
//!   sources stop producing, in-flight items drain through the graph, every stage flushes;
//! - an abort (a stage failed or panicked, the drain timed out, or a second Ctrl-C): every stage
//!   leaves its loop at the next item or within [`POLL`] if it is blocked on a channel, then
//!   flushes.
//!
//! The first signal is kept ([`StopSignal`]): its exit code (128 + its number) is the run's.
//!
//! [`Ctx::request_stop`]: crate::runtime::stage::Ctx::request_stop

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, Ordering};
use std::time::Duration;

/// How often a stage blocked on a channel checks the abort flag.
pub const POLL: Duration = Duration::from_millis(20);

const RUNNING: u8 = 0;
const STOPPING: u8 = 1;
const ABORTING: u8 = 2;

/// Why a run is ending, as the report states it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// Sources ran out, or a stage asked the graph to stop.
    Completed,
    /// A signal: Ctrl-C (SIGINT), SIGTERM or SIGHUP ([`Control::signal`] says which).
    Interrupted,
    /// A stage failed or panicked.
    Failed,
}

/// A signal that stops a run as Ctrl-C does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    /// Ctrl-C.
    Int,
    /// What schedulers, `kill` and `docker stop` send.
    Term,
    /// The terminal went away.
    Hup,
}

impl StopSignal {
    /// Every one, in the order of [`StopSignal::number`].
    pub const ALL: [StopSignal; 3] = [StopSignal::Hup, StopSignal::Int, StopSignal::Term];

    /// Its POSIX number (Linux and macOS agree on these three).
    pub fn number(self) -> i32 {
        match self {
            StopSignal::Hup => 1,
            StopSignal::Int => 2,
            StopSignal::Term => 15,
        }
    }

    /// The signal with POSIX number `n`, if it is one of these.
    pub fn from_number(n: i32) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.number() == n)
    }

    /// `SIGINT`, `SIGTERM`, `SIGHUP`.
    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Hup => "SIGHUP",
            StopSignal::Int => "SIGINT",
            StopSignal::Term => "SIGTERM",
        }
    }

    /// The exit code of a run it stopped, as shells report a process it killed: 128 + number
    /// (SIGINT 130, SIGTERM 143, SIGHUP 129), so a scheduler sees the signal it sent.
    pub fn exit_code(self) -> i32 {
        128 + self.number()
    }
}

/// Shared flags every stage thread reads; cheap relaxed loads on the hot path.
#[derive(Debug, Default)]
pub struct Control {
    state: AtomicU8,
    /// The first stop signal's number (0: none): the run was interrupted.
    signal: AtomicI32,
    failed: AtomicBool,
    finishing: std::sync::atomic::AtomicUsize,
}

impl Control {
    /// A control in the running state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the graph to finish gracefully: sources stop, queued items drain.
    pub fn request_stop(&self) {
        let _ = self.state.compare_exchange(RUNNING, STOPPING, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// What a Ctrl-C does: [`Control::interrupt_by`] SIGINT.
    #[cfg(feature = "tools")]
    pub fn interrupt(&self) {
        self.interrupt_by(StopSignal::Int);
    }

    /// What a stop signal does: the first one stops gracefully, a second one (of any of them)
    /// aborts. The first is remembered for the exit code.
    pub fn interrupt_by(&self, signal: StopSignal) {
        // Already stopping (a first Ctrl-C, max_seconds, a stage's request): stop at once.
        let already = self.stopping();
        let again = self.signal.compare_exchange(0, signal.number(), Ordering::SeqCst, Ordering::SeqCst).is_err();
        if again || already {
            self.abort();
        } else {
            self.request_stop();
        }
    }

    /// Stops every stage where it stands (after its current item).
    pub fn abort(&self) {
        self.state.store(ABORTING, Ordering::SeqCst);
    }

    /// Marks the run failed and aborts it.
    pub fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.abort();
    }

    /// True once a graceful stop or an abort was asked for.
    #[inline]
    pub fn stopping(&self) -> bool {
        self.state.load(Ordering::Relaxed) != RUNNING
    }

    /// True once an abort was asked for.
    #[inline]
    pub fn aborting(&self) -> bool {
        self.state.load(Ordering::Relaxed) == ABORTING
    }

    /// Marks a stage as doing its closing work (a final validation, a last checkpoint): while
    /// any stage is, the drain timeout is held off. An abort (second Ctrl-C) still stops it.
    pub fn begin_finishing(&self) {
        self.finishing.fetch_add(1, Ordering::SeqCst);
    }

    /// Ends what [`Control::begin_finishing`] began.
    pub fn end_finishing(&self) {
        self.finishing.fetch_sub(1, Ordering::SeqCst);
    }

    /// True while some stage is doing its closing work.
    pub fn finishing(&self) -> bool {
        self.finishing.load(Ordering::SeqCst) > 0
    }

    /// The first stop signal received, if any.
    pub fn signal(&self) -> Option<StopSignal> {
        StopSignal::from_number(self.signal.load(Ordering::SeqCst))
    }

    /// The reason the run is ending (or would end now).
    pub fn reason(&self) -> StopReason {
        if self.failed.load(Ordering::SeqCst) {
            StopReason::Failed
        } else if self.signal().is_some() {
            StopReason::Interrupted
        } else {
            StopReason::Completed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_interrupt_stops_second_aborts() {
        let c = Control::new();
        assert!(!c.stopping());
        c.interrupt();
        assert!(c.stopping() && !c.aborting());
        assert_eq!(c.reason(), StopReason::Interrupted);
        c.interrupt();
        assert!(c.aborting());
    }

    #[test]
    fn interrupt_during_a_requested_stop_aborts() {
        let c = Control::new();
        c.request_stop();
        c.interrupt();
        assert!(c.aborting());
    }

    #[test]
    fn the_first_signal_is_kept_and_gives_the_exit_code() {
        let c = Control::new();
        assert_eq!(c.signal(), None);
        c.interrupt_by(StopSignal::Term);
        assert!(c.stopping() && !c.aborting());
        c.interrupt_by(StopSignal::Int);
        assert!(c.aborting(), "a second signal of another kind still aborts");
        assert_eq!(c.signal(), Some(StopSignal::Term));
        assert_eq!(c.reason(), StopReason::Interrupted);
        let codes: Vec<i32> = StopSignal::ALL.iter().map(|s| s.exit_code()).collect();
        assert_eq!(codes, [129, 130, 143]);
        for s in StopSignal::ALL {
            assert_eq!(StopSignal::from_number(s.number()), Some(s));
        }
    }

    #[test]
    fn failure_wins_over_interrupt() {
        let c = Control::new();
        c.interrupt();
        c.fail();
        assert_eq!(c.reason(), StopReason::Failed);
        assert!(c.aborting());
    }
}
