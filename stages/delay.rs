//! Kind `delay`: passes items through after adding a service time: slowdown injection, to check
//! that the report names the stage that was slowed.
//!
//! - `sleep`: waits off-CPU (like a stage waiting on I/O);
//! - `spin`: busy-waits on-CPU (like a stage doing real work; competes for cores).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::runtime::inject::{FailMode, Fault, Pace};
use crate::runtime::message::Blob;
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};

/// Parameters of `delay/sleep` and `delay/spin`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DelayParams {
    /// Service time added per item, in µs.
    pub delay_us: f64,
    /// Uniform jitter in µs either side of `delay_us`.
    pub jitter_us: f64,
    /// Fail when handling this item (1-based); 0 never fails.
    pub fail_at: u64,
    /// How the injected failure shows: "error" or "panic".
    pub fail_mode: FailMode,
}

impl Default for DelayParams {
    fn default() -> Self {
        Self { delay_us: 1000.0, jitter_us: 0.0, fail_at: 0, fail_mode: FailMode::Error }
    }
}

/// Shared body of both implementations.
struct Delay {
    pace: Pace,
    fault: Fault,
}

impl Delay {
    fn new(p: DelayParams, spin: bool, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Ok(Self { pace: Pace::new(p.delay_us, p.jitter_us, spin, ctx.seed())?, fault: Fault::new(p.fail_at, p.fail_mode) })
    }

    fn pass(&mut self, item: Blob, out: &mut Emitter<'_, Blob>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.fault.tick()?;
        if self.pace.wait(ctx) {
            out.emit(item)?;
        }
        Ok(())
    }
}

macro_rules! delay_impl {
    ($ty:ident, $name:literal, $spin:expr, $doc:literal) => {
        #[doc = $doc]
        pub struct $ty(Delay);

        impl Transform for $ty {
            const KIND: &'static str = "delay";
            const IMPL: &'static str = $name;
            const DOC: &'static str = $doc;
            type Params = DelayParams;
            type In = Blob;
            type Out = Blob;

            fn check(p: &DelayParams, _ctx: &BuildCtx) -> anyhow::Result<()> {
                Pace::check(p.delay_us, p.jitter_us)
            }
            fn build(p: DelayParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
                Ok(Self(Delay::new(p, $spin, ctx)?))
            }
            fn process(&mut self, item: Blob, out: &mut Emitter<'_, Blob>, ctx: &mut Ctx) -> anyhow::Result<()> {
                self.0.pass(item, out, ctx)
            }
        }
    };
}

delay_impl!(Sleep, "sleep", false, "Passes items on after sleeping delay_us (+/- jitter_us) each: off-CPU slowdown.");
delay_impl!(Spin, "spin", true, "Passes items on after busy-waiting delay_us (+/- jitter_us) each: on-CPU slowdown.");
