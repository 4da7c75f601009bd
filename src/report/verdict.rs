//! The bottleneck verdict.
//!
//! - **Bottleneck**: among the stages connected to the focus stage (by default the sink), the one
//!   with the highest busy fraction (steady service time / steady wall time).
//! - **Input-bound fraction**: the focus stage's time blocked waiting for input / the time it
//!   spent in its loop (its own work, waiting for input, blocked sending: [`loop_time`]), i.e.
//!   the share of a step spent waiting for data, classed as the TensorFlow profiler's
//!   input-pipeline analyzer does: under 5% "not input-bound", 5 to 20% "moderately
//!   input-bound", 20% and over "highly input-bound".
//! - **What if**: operational analysis (as Plumber does): each stage's demand is its mean
//!   service time times its visit ratio (its items per focus item). Throughput cannot exceed
//!   1 / the largest demand; with the bottleneck free, the next largest bounds it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::report::tables::{ChannelReport, StageReport};
use crate::runtime::graph::Plan;

/// Below this busy fraction no stage counts as saturated.
const SATURATED: f64 = 0.5;

/// `verdict` in the report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Verdict {
    /// The stage with the highest busy fraction.
    pub bottleneck: Option<String>,
    /// Its busy fraction.
    pub bottleneck_busy_fraction: f64,
    /// The stage whose input wait is judged.
    pub focus: String,
    /// The focus stage's time blocked on receive / its time in its loop ([`loop_time`]).
    pub input_bound_fraction: f64,
    /// "not input-bound", "moderately input-bound" or "highly input-bound".
    pub class: String,
    /// The verdict in words.
    pub explanation: String,
    /// The stage that would bind if the bottleneck were free.
    pub next_bottleneck: Option<String>,
    /// Steady items/s at the focus stage.
    pub throughput_per_s: f64,
    /// Upper bound on the focus stage's items/s if the bottleneck took no time.
    pub predicted_throughput_per_s: Option<f64>,
    /// Per stage, ms of its work per focus item (mean service x visit ratio).
    pub demand_ms: BTreeMap<String, f64>,
}

/// The TensorFlow profiler's classes of input-bound fraction.
pub fn classify(fraction: f64) -> &'static str {
    if fraction < 0.05 {
        "not input-bound"
    } else if fraction < 0.20 {
        "moderately input-bound"
    } else {
        "highly input-bound"
    }
}

/// What a stage did over the time it spent in its item loop, from its steady items on: its
/// own work, waiting for input and blocked sending (s), and the waiting part. Not its steady
/// window, which runs on to the end of the run: a step executor's ends long after its last
/// step when an evaluation follows training.
pub struct LoopTime {
    /// Work + input wait + blocked sends (s).
    pub total_s: f64,
    /// Input wait (s).
    pub wait_s: f64,
    /// Items worked on.
    pub items: u64,
}

impl LoopTime {
    /// Input wait / loop time (0 without time).
    pub fn wait_fraction(&self) -> f64 {
        if self.total_s > 0.0 { self.wait_s / self.total_s } else { 0.0 }
    }

    /// Items per second of loop time (0 without time).
    #[cfg(feature = "tools")]
    pub fn items_per_s(&self) -> f64 {
        if self.total_s > 0.0 { self.items as f64 / self.total_s } else { 0.0 }
    }
}

/// [`LoopTime`] of stage `name`.
pub fn loop_time(name: &str, stage: &StageReport, channels: &BTreeMap<String, ChannelReport>) -> LoopTime {
    // The consumer's wait covers its whole channel: every edge into it carries the same figure.
    let wait_ms = channels.values().filter(|c| c.to == name).map(|c| c.recv_blocked_us.total_ms).fold(0.0, f64::max);
    let send_ms: f64 = channels.values().filter(|c| c.from == name).map(|c| c.send_blocked_us.total_ms).sum();
    LoopTime { total_s: (stage.service_us.total_ms + wait_ms + send_ms) / 1e3, wait_s: wait_ms / 1e3, items: stage.service_us.count }
}

/// Judges a run from its stage and channel reports.
pub fn judge(plan: &Plan, stages: &BTreeMap<String, StageReport>, channels: &BTreeMap<String, ChannelReport>) -> Verdict {
    let focus = &plan.stages[plan.focus].name;
    let Some(fs) = stages.get(focus) else { return Verdict { focus: focus.clone(), ..Default::default() } };
    let input_bound = loop_time(focus, fs, channels).wait_fraction();
    let class = classify(input_bound).to_string();

    // Among the stages of the focus stage's graph (connected to it either way).
    let connected = plan.reachable(plan.focus, true);
    let mut ranked: Vec<(&String, &StageReport)> =
        (0..plan.stages.len()).filter(|&i| connected[i]).map(|i| &plan.stages[i].name).filter_map(|n| stages.get_key_value(n)).collect();
    ranked.sort_by(|a, b| b.1.busy_fraction.total_cmp(&a.1.busy_fraction).then(a.0.cmp(b.0)));

    let focus_items = fs.items.max(1) as f64;
    let demand: BTreeMap<String, f64> =
        ranked.iter().map(|(n, s)| ((*n).clone(), s.service_us.mean * 1e-3 * s.items as f64 / focus_items)).collect();
    let throughput = fs.throughput_per_s;
    let Some(&(bn, bs)) = ranked.first() else {
        return Verdict { focus: focus.clone(), input_bound_fraction: input_bound, class, ..Default::default() };
    };
    let next = ranked.get(1).map(|(n, _)| (*n).clone());
    let predicted = next.as_ref().and_then(|n| demand.get(n)).filter(|&&d| d > 0.0).map(|d| 1e3 / d);

    let pct = |f: f64| format!("{:.1}%", f * 100.0);
    let mut text = if bs.busy_fraction < SATURATED {
        format!(
            "No stage is saturated (the busiest, `{bn}`, is busy {}): stages spend their time blocked on channels, sleeping or waiting for the OS; read the send/recv-blocked columns.",
            pct(bs.busy_fraction)
        )
    } else if bn == focus {
        format!(
            "`{bn}` ({}/{}) is itself the bottleneck: busy {} at {:.1} µs per item and waiting for input {} of its time; deeper queues or faster upstream stages will not speed it up.",
            bs.kind,
            bs.imp,
            pct(bs.busy_fraction),
            bs.service_us.mean,
            pct(input_bound)
        )
    } else {
        format!(
            "`{bn}` ({}/{}) is busy {} at {:.1} µs per item, which holds `{focus}` to {:.1} items/s.",
            bs.kind,
            bs.imp,
            pct(bs.busy_fraction),
            bs.service_us.mean,
            throughput
        )
    };
    if bs.busy_fraction >= SATURATED
        && let (Some(n), Some(p)) = (&next, predicted)
    {
        let gain = if throughput > 0.0 { format!(" ({:.1}x)", p / throughput) } else { String::new() };
        text.push_str(&format!(" If `{bn}` took no time, `{n}` would bind next at about {p:.1} items/s{gain}."));
    }
    if input_bound >= 0.05 && bs.busy_fraction < 0.8 {
        text.push_str(&format!(
            " No upstream stage is saturated, so `{focus}`'s waits come from jitter: a deeper queue in front of it can absorb them."
        ));
    }
    Verdict {
        bottleneck: Some(bn.clone()),
        bottleneck_busy_fraction: bs.busy_fraction,
        focus: focus.clone(),
        input_bound_fraction: input_bound,
        class,
        explanation: text,
        next_bottleneck: next,
        throughput_per_s: throughput,
        predicted_throughput_per_s: predicted,
        demand_ms: demand,
    }
}

#[cfg(test)]
mod tests {
    use super::classify;

    #[test]
    fn tensorflow_profiler_thresholds() {
        assert_eq!(classify(0.0), "not input-bound");
        assert_eq!(classify(0.0499), "not input-bound");
        assert_eq!(classify(0.05), "moderately input-bound");
        assert_eq!(classify(0.1999), "moderately input-bound");
        assert_eq!(classify(0.20), "highly input-bound");
        assert_eq!(classify(1.0), "highly input-bound");
    }
}
