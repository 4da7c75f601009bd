//! The run's time source.
//!
//! Every timestamp the runtime takes on the hot path goes through [`Clock`]: a thin wrapper over
//! `quanta`, which reads the CPU's time-stamp counter (about 10 ns a read on the development
//! machine, against about 25 ns for `std::time::Instant`). Timestamps are raw ticks (`u64`); they
//! are only turned into nanoseconds when a duration is recorded.

/// A cheap monotonic clock shared (by cloning) between the stage threads of one run.
#[derive(Clone, Debug)]
pub struct Clock {
    inner: quanta::Clock,
    ns_per_tick: f64,
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock {
    /// Creates a calibrated clock. Calibration happens once per process inside `quanta`.
    pub fn new() -> Self {
        let inner = quanta::Clock::new();
        let ns_per_tick = inner.delta_as_nanos(0, 1 << 40) as f64 / (1u64 << 40) as f64;
        Self { inner, ns_per_tick }
    }

    /// Reads the clock: an opaque tick count, comparable only with ticks of a clone of this clock.
    #[inline]
    pub fn now(&self) -> u64 {
        self.inner.raw()
    }

    /// Nanoseconds from `start` to `end`; zero when `end` is not after `start`.
    #[inline]
    pub fn nanos(&self, start: u64, end: u64) -> u64 {
        if end <= start { 0 } else { self.inner.delta_as_nanos(start, end) }
    }

    /// Nanoseconds per tick: histograms record raw tick counts and scale them when summarised.
    pub fn ns_per_tick(&self) -> f64 {
        self.ns_per_tick
    }

    /// Seconds from `start` to `end` as a float (zero when `end` is not after `start`).
    pub fn seconds(&self, start: u64, end: u64) -> f64 {
        self.nanos(start, end) as f64 * 1e-9
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_a_sleep_within_reason() {
        let clock = Clock::new();
        let a = clock.now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let b = clock.now();
        let ns = clock.nanos(a, b);
        assert!(ns >= 19_000_000, "20 ms sleep measured as {ns} ns");
        assert_eq!(clock.nanos(b, a), 0, "reversed interval must be zero, not wrap");
        let scaled = (b - a) as f64 * clock.ns_per_tick();
        assert!((scaled - ns as f64).abs() < 0.01 * ns as f64, "tick scale {scaled} vs {ns}");
    }
}
