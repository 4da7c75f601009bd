//! Run-wide stop and abort flags.
//!
//! A run is `running` until something asks it to stop:
//! - a graceful stop (Ctrl-C, `[run] max_seconds`, or a stage calling [`Ctx::request_stop`]):
//!   sources stop producing, in-flight items drain through the graph, every stage flushes;
//! - an abort (a stage failed or panicked, the drain timed out, or a second Ctrl-C): every stage
//!   leaves its loop at the next item or within [`POLL`] if it is blocked on a channel, then
//!   flushes.
//!
//! [`Ctx::request_stop`]: crate::stage::Ctx::request_stop

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
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
    /// Ctrl-C (SIGINT).
    Interrupted,
    /// A stage failed or panicked.
    Failed,
}

/// Shared flags every stage thread reads; cheap relaxed loads on the hot path.
#[derive(Debug, Default)]
pub struct Control {
    state: AtomicU8,
    interrupted: AtomicBool,
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

    /// What a Ctrl-C does: the first one stops gracefully, a second one aborts.
    pub fn interrupt(&self) {
        // Already stopping (a first Ctrl-C, max_seconds, a stage's request): stop at once.
        let already = self.stopping();
        if self.interrupted.swap(true, Ordering::SeqCst) || already {
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

    /// The reason the run is ending (or would end now).
    pub fn reason(&self) -> StopReason {
        if self.failed.load(Ordering::SeqCst) {
            StopReason::Failed
        } else if self.interrupted.load(Ordering::SeqCst) {
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
    fn failure_wins_over_interrupt() {
        let c = Control::new();
        c.interrupt();
        c.fail();
        assert_eq!(c.reason(), StopReason::Failed);
        assert!(c.aborting());
    }
}
