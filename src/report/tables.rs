//! The report's per-stage and per-channel tables (`stages.NAME`, `channels."FROM->TO"` of
//! `report.json`): what the verdict reads and the text table prints.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::runtime::metrics::Summary;

/// `stages.NAME`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StageReport {
    /// Stage kind.
    pub kind: String,
    /// Implementation.
    #[serde(rename = "impl")]
    pub imp: String,
    /// "source", "transform" or "sink".
    pub role: String,
    /// Stages feeding it.
    pub inputs: Vec<String>,
    /// Items handled: produced by a source, received by a sink, the larger of the two for a
    /// transform.
    pub items: u64,
    /// Items received.
    pub items_in: u64,
    /// Items produced.
    pub items_out: u64,
    /// Items received and dropped unprocessed ([`crate::runtime::stage::Ctx::discard`]): not
    /// in the service times.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub items_dropped: u64,
    /// Share of steady wall time spent in the stage's own code.
    pub busy_fraction: f64,
    /// Service time per item.
    pub service_us: Summary,
    /// Steady items per second.
    pub throughput_per_s: f64,
    /// Steady window length (s): from this stage's warm-up end to the end of the run.
    pub steady_s: f64,
    /// "finished", "failed", "panicked" or "hung".
    pub state: String,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Stage-specific histograms (e.g. `write_us` of a checkpointer).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra_us: BTreeMap<String, Summary>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `channels."FROM->TO"`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChannelReport {
    /// Producer.
    pub from: String,
    /// Consumer.
    pub to: String,
    /// Capacity of the consumer's channel (`queue`).
    pub capacity: usize,
    /// Items that went through this edge.
    pub items: u64,
    /// Per item, time the producer was blocked on a full channel.
    pub send_blocked_us: Summary,
    /// Share of the producer's steady time spent blocked sending on this edge.
    pub send_blocked_fraction: f64,
    /// Per item, time the consumer waited for input (its whole channel).
    pub recv_blocked_us: Summary,
    /// Share of the consumer's steady time spent waiting for input.
    pub recv_blocked_fraction: f64,
    /// Per item, time from send to receive.
    pub residence_us: Summary,
    /// Mean sampled length of the consumer's channel.
    pub mean_occupancy: f64,
    /// Share of samples that found the channel empty (consumer starved).
    pub empty_fraction: f64,
    /// Share of samples that found it full (producer held back).
    pub full_fraction: f64,
    /// Throughput x mean residence: should be close to `mean_occupancy` (Little's law).
    pub littles_law_occupancy: f64,
    /// The sampled length over the run: `[seconds from the run's start, mean length]`, at most
    /// 256 points (each the mean of equally many samples).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub occupancy_timeline: Vec<[f64; 2]>,
}
