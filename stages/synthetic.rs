//! Kind `synthetic`: sources of made-up items, to exercise the runtime before real data exists.
//!
//! - `blob`: numbered byte blobs of a set size, at a set rate or as fast as possible.

use std::sync::Arc;
use std::time::{Duration, Instant};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::runtime::inject::{FailMode, Fault, Pace};
use crate::runtime::message::Blob;
use crate::runtime::stage::{BuildCtx, Ctx, Source};

/// Parameters of `synthetic/blob`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct BlobsParams {
    /// Items to produce; 0 produces until the graph is stopped.
    pub count: u64,
    /// Payload size in bytes (one buffer shared by all items, so size costs no copying).
    pub size_bytes: usize,
    /// Items per second; 0 produces as fast as the graph takes them.
    pub rate_per_s: f64,
    /// Extra service time per item in µs (sleeping), as a slow reader would have.
    pub delay_us: f64,
    /// Uniform jitter in µs either side of `delay_us`.
    pub jitter_us: f64,
    /// Fail when producing this item (1-based); 0 never fails.
    pub fail_at: u64,
    /// How the injected failure shows: "error" or "panic".
    pub fail_mode: FailMode,
}

impl Default for BlobsParams {
    fn default() -> Self {
        Self { count: 1000, size_bytes: 64, rate_per_s: 0.0, delay_us: 0.0, jitter_us: 0.0, fail_at: 0, fail_mode: FailMode::Error }
    }
}

/// `synthetic/blob`.
pub struct Blobs {
    count: u64,
    next_seq: u64,
    data: Arc<[u8]>,
    period: Option<Duration>,
    due: Option<Instant>,
    pace: Pace,
    fault: Fault,
}

impl Source for Blobs {
    const KIND: &'static str = "synthetic";
    const IMPL: &'static str = "blob";
    const DOC: &'static str = "Numbered byte blobs of a set size, at a set rate or as fast as possible.";
    type Params = BlobsParams;
    type Out = Blob;

    fn check(p: &BlobsParams, _ctx: &BuildCtx) -> anyhow::Result<()> {
        Pace::check(p.delay_us, p.jitter_us)?;
        if !p.rate_per_s.is_finite() || p.rate_per_s < 0.0 || (p.rate_per_s > 0.0 && p.rate_per_s < 1e-6) {
            anyhow::bail!("`rate_per_s` must be 0 (as fast as possible) or at least 0.000001 items per second; found {}", p.rate_per_s);
        }
        Ok(())
    }

    fn build(p: BlobsParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        Ok(Self {
            count: p.count,
            next_seq: 0,
            data: vec![0xA5u8; p.size_bytes].into(),
            period: (p.rate_per_s > 0.0).then(|| Duration::from_secs_f64(1.0 / p.rate_per_s)),
            due: None,
            pace: Pace::new(p.delay_us, p.jitter_us, false, ctx.seed())?,
            fault: Fault::new(p.fail_at, p.fail_mode),
        })
    }

    fn next(&mut self, ctx: &mut Ctx) -> anyhow::Result<Option<Blob>> {
        if self.count > 0 && self.next_seq >= self.count {
            return Ok(None);
        }
        if let Some(period) = self.period {
            let due = *self.due.get_or_insert_with(Instant::now);
            let now = Instant::now();
            if due > now && !ctx.sleep_unless_stopping(due - now) {
                return Ok(None);
            }
            self.due = Some(due + period);
        }
        if !self.pace.wait_unless_stopping(ctx) {
            return Ok(None);
        }
        self.fault.tick()?;
        let item = Blob { seq: self.next_seq, data: self.data.clone() };
        self.next_seq += 1;
        Ok(Some(item))
    }
}
