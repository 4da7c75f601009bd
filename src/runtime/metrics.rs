//! Latency histograms and their summaries.
//!
//! [`Hist`] records durations into an `hdrhistogram` (3 significant digits) in a unit of its
//! own: nanoseconds, or raw clock ticks on the hot path, where converting each value would cost
//! more than recording it; the unit is scaled away when the histogram is summarised. Zero-length
//! events (an item that was already waiting, a send that did not block) are the common case on
//! the hot path, so they are only counted, and folded into the histogram when it is summarised.
//! [`Summary`] is what reports carry: microseconds.

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// Highest trackable value in units (2^44: over an hour in ticks of a 4 GHz clock). Larger
/// values are clamped.
const MAX_UNITS: u64 = 1 << 44;

/// A duration histogram with an exact running sum.
#[derive(Clone, Debug)]
pub struct Hist {
    hist: Histogram<u64>,
    zeros: u64,
    sum: u128,
    ns_per_unit: f64,
}

impl Default for Hist {
    fn default() -> Self {
        Self::new()
    }
}

impl Hist {
    /// An empty histogram of nanoseconds.
    pub fn new() -> Self {
        Self::in_units(1.0)
    }

    /// An empty histogram of a unit worth `ns_per_unit` nanoseconds (clock ticks on the hot path).
    pub fn in_units(ns_per_unit: f64) -> Self {
        let hist = Histogram::new_with_bounds(1, MAX_UNITS, 3).expect("static histogram bounds are valid");
        Self { hist, zeros: 0, sum: 0, ns_per_unit }
    }

    /// Records one duration, in the histogram's unit.
    #[inline]
    pub fn record(&mut self, units: u64) {
        if units == 0 {
            self.zeros += 1;
        } else {
            self.hist.saturating_record(units.min(MAX_UNITS));
            self.sum += units as u128;
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

    /// Sum of the recorded durations in nanoseconds.
    pub fn sum_ns(&self) -> f64 {
        self.sum as f64 * self.ns_per_unit
    }

    /// Adds another histogram's events to this one.
    #[cfg(feature = "tools")]
    pub fn merge(&mut self, other: &Hist) {
        // Both histograms have the same fixed bounds, so `add` cannot fail.
        debug_assert_eq!(self.ns_per_unit, other.ns_per_unit, "merging histograms of different units");
        let _ = self.hist.add(&other.hist);
        self.zeros += other.zeros;
        self.sum += other.sum;
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
        let us = |units: u64| units as f64 * self.ns_per_unit / 1e3;
        Summary {
            count,
            mean: self.sum_ns() / count as f64 / 1e3,
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            max: us(h.max()),
            total_ms: self.sum_ns() / 1e6,
            quantiles: (0..QUANTILES).map(|k| us(h.value_at_quantile((k as f64 + 0.5) / QUANTILES as f64))).collect(),
        }
    }
}

/// Points of [`Summary::quantiles`]: the distribution at 1% resolution.
pub const QUANTILES: usize = 100;

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
    /// The distribution itself: the value (µs) at quantile `(k + 0.5) / 100` for `k` in
    /// `0..100` (empty without events), for percentile plots and for drawing service times in
    /// a simulation (`pipeline advise`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quantiles: Vec<f64>,
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

    #[test]
    fn units_are_scaled_in_summaries() {
        let mut h = Hist::in_units(0.5); // e.g. a 2 GHz clock's ticks
        h.record(2000); // 1 µs
        h.record(4000); // 2 µs
        let s = h.summary();
        assert!((s.mean - 1.5).abs() < 1e-9 && (s.max - 2.0).abs() < 0.01, "{s:?}");
        assert!((h.sum_ns() - 3000.0).abs() < 1e-9);
    }
}
