//! Kind `step_executor`: trains the GPT on the micro-batches it receives.
//!
//! - `candle`: the challenge's baseline model and optimizers ([`crate::model`],
//!   [`crate::train::trainer`]) on candle-core (CPU here; CUDA in a `cuda` build), as a
//!   [`Session`] of [`crate::train::session`]: validation at step 0, every `train.val_every`
//!   steps and after the last; the end at `train.iterations` or the
//!   `train.max_wallclock_seconds` cap; the challenge script's log lines; the report's `train`
//!   section; `RUN_DIR/final_model.safetensors`. The stage hands it each micro-batch, and its
//!   snapshots (before the first step, after every step, at the end) to the stages after
//!   training.
//!
//! Resuming (`pipeline run --resume`): the weights, optimizer state, step, training time and
//! validation history come from the checkpoint ([`crate::train::resume`]); the batch geometry
//! and the training data must be those the checkpoint was made with.

use super::{config, previous, resumed};
use crate::data::batch::DeviceBatch;
use crate::runtime::memory::Need;
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};
use crate::train::params::SessionParams;
use crate::train::session::Session;
use crate::train::snapshot::TrainSnapshot;
use crate::train::{requirements, resume};

/// `step_executor/candle`.
pub struct Candle(Session);

impl Transform for Candle {
    const KIND: &'static str = "step_executor";
    const IMPL: &'static str = "candle";
    const DOC: &'static str =
        "Trains the challenge's baseline GPT (Muon + Adam) on device micro-batches; validates, logs, saves weights; emits snapshots.";
    type Params = SessionParams;
    type In = DeviceBatch;
    type Out = TrainSnapshot;
    const OUTPUT_OPTIONAL: bool = true;

    fn check(p: &SessionParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        requirements::check(p, config(ctx)?)
    }

    fn memory(p: &SessionParams, ctx: &BuildCtx) -> anyhow::Result<Vec<Need>> {
        requirements::memory(p, config(ctx)?)
    }

    /// The process this run continues completed it: see [`resume::complete`].
    fn nothing_left(_p: &SessionParams, ctx: &BuildCtx) -> Option<String> {
        resume::complete(config(ctx).ok()?, resumed(ctx), previous(ctx), ctx.run_dir)
    }

    fn build(p: SessionParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Ok(Self(Session::new(p, config(ctx)?, resumed(ctx), ctx.run_dir, ctx.consumers > 0)?))
    }

    fn process(&mut self, b: DeviceBatch, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.process(b, out, ctx)
    }

    fn flush(&mut self, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.close(out, ctx)
    }
}
