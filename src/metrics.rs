//! Latency histograms and their summaries.
//!
//! [`Hist`] records durations in nanoseconds into an `hdrhistogram` (1 ns to 1 hour, 3
//! significant digits). Zero-length events (an item that was already waiting, a send that did
//! not block) are the common case on the hot path, so they are only counted, and folded into
//! the histogram when it is summarised. [`Summary`] is what reports carry: microseconds.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Highest trackable value: one hour in nanoseconds. Larger values are clamped.
const MAX_NS: u64 = 3_600_000_000_000;

/// A duration histogram in nanoseconds with an exact running sum.
#[derive(Clone, Debug)]
pub struct Hist {
    hist: Histogram<u64>,
    zeros: u64,
    sum_ns: u128,
}

impl Default for Hist {
    fn default() -> Self {
        Self::new()
    }
}

impl Hist {
    /// An empty histogram.
    pub fn new() -> Self {
        let hist = Histogram::new_with_bounds(1, MAX_NS, 3).expect("static histogram bounds are valid");
        Self { hist, zeros: 0, sum_ns: 0 }
    }

    /// Records one duration.
    #[inline]
    pub fn record(&mut self, ns: u64) {
        if ns == 0 {
            self.zeros += 1;
        } else {
            self.hist.saturating_record(ns.min(MAX_NS));
            self.sum_ns += ns as u128;
        }
    }

    /// Records one zero-length event (cheaper than `record(0)`: a counter increment).
    #[inline]
    pub fn record_zero(&mut self) {
        self.zeros += 1;
    }

    /// Number of recorded events, zeros included.
    pub fn count(&self) -> u64 {
        self.hist.len() + self.zeros
    }

    /// Exact sum of the recorded durations in nanoseconds.
    pub fn sum_ns(&self) -> u128 {
        self.sum_ns
    }

    /// Adds another histogram's events to this one.
    pub fn merge(&mut self, other: &Hist) {
        // Both histograms have the same fixed bounds, so `add` cannot fail.
        let _ = self.hist.add(&other.hist);
        self.zeros += other.zeros;
        self.sum_ns += other.sum_ns;
    }

    /// Percentiles, mean, max and total in microseconds.
    pub fn summary(&self) -> Summary {
        let count = self.count();
        if count == 0 {
            return Summary::default();
        }
        let mut h = self.hist.clone();
        if self.zeros > 0 {
            let _ = h.record_n(0, self.zeros);
        }
        let us = |ns: u64| ns as f64 / 1e3;
        Summary {
            count,
            mean: self.sum_ns as f64 / count as f64 / 1e3,
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            max: us(h.max()),
            total_ms: self.sum_ns as f64 / 1e6,
        }
    }
}

/// A latency distribution as reports show it. All durations are in microseconds except
/// `total_ms`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Number of events.
    pub count: u64,
    /// Mean duration (µs), from the exact sum.
    pub mean: f64,
    /// Median (µs).
    pub p50: f64,
    /// 90th percentile (µs).
    pub p90: f64,
    /// 99th percentile (µs).
    pub p99: f64,
    /// Largest event (µs).
    pub max: f64,
    /// Sum of all events (ms).
    pub total_ms: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_known_values() {
        let mut h = Hist::new();
        for ns in 1..=100u64 {
            h.record(ns * 1000); // 1 µs .. 100 µs
        }
        let s = h.summary();
        assert_eq!(s.count, 100);
        assert!((s.mean - 50.5).abs() < 1e-9, "mean {}", s.mean);
        assert!((s.p50 - 50.0).abs() < 0.1, "p50 {}", s.p50);
        assert!((s.p99 - 99.0).abs() < 0.1, "p99 {}", s.p99);
        assert!((s.max - 100.0).abs() < 0.1, "max {}", s.max);
        assert!((s.total_ms - 5.05).abs() < 1e-9);
    }

    #[test]
    fn zeros_count_in_percentiles() {
        let mut h = Hist::new();
        for _ in 0..90 {
            h.record_zero();
        }
        for _ in 0..10 {
            h.record(1_000_000);
        }
        let s = h.summary();
        assert_eq!(s.count, 100);
        assert_eq!(s.p50, 0.0);
        assert!((s.p99 - 1000.0).abs() < 1.0, "p99 {}", s.p99);
        assert!((s.mean - 100.0).abs() < 1e-9);
    }

    #[test]
    fn merge_and_empty() {
        assert_eq!(Hist::new().summary(), Summary::default());
        let mut a = Hist::new();
        a.record(10);
        let mut b = Hist::new();
        b.record(0);
        b.record(u64::MAX); // clamped, never panics
        a.merge(&b);
        assert_eq!(a.count(), 3);
    }
}
