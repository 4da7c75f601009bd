//! Kind `drain`: sinks that consume items.
//!
//! - `count`: counts items, optionally taking a service time per item (to play a slow
//!   consumer) and optionally asking the graph to stop after N items (as a step executor does
//!   at its last step).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::inject::{FailMode, Fault, Pace};
use crate::message::Blob;
use crate::stage::{BuildCtx, Ctx, Sink};

/// Parameters of `drain/count`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CountParams {
    /// Service time per item in µs (sleeping), to play a slow consumer.
    pub delay_us: f64,
    /// Uniform jitter in µs either side of `delay_us`.
    pub jitter_us: f64,
    /// Ask the whole graph to stop after this many items; 0 never asks.
    pub stop_after: u64,
    /// Fail when consuming this item (1-based); 0 never fails.
    pub fail_at: u64,
    /// How the injected failure shows: "error" or "panic".
    pub fail_mode: FailMode,
}

/// `drain/count`.
pub struct Count {
    items: u64,
    stop_after: u64,
    pace: Pace,
    fault: Fault,
}

impl Sink for Count {
    const KIND: &'static str = "drain";
    const IMPL: &'static str = "count";
    const DOC: &'static str = "Consumes and counts items; can play a slow consumer or stop the graph after N items.";
    type Params = CountParams;
    type In = Blob;

    fn check(p: &CountParams, _ctx: &BuildCtx) -> anyhow::Result<()> {
        Pace::check(p.delay_us, p.jitter_us)
    }
    fn build(p: CountParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Ok(Self { items: 0, stop_after: p.stop_after, pace: Pace::new(p.delay_us, p.jitter_us, false, ctx.seed())?, fault: Fault::new(p.fail_at, p.fail_mode) })
    }
    fn consume(&mut self, _item: Blob, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.fault.tick()?;
        self.pace.wait(ctx);
        self.items += 1;
        if self.stop_after > 0 && self.items == self.stop_after {
            ctx.request_stop();
        }
        Ok(())
    }
}
