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
//! - `engine`: the same session on the explicit engine ([`crate::engine`]): forward and
//!   hand-written backward over one arena, CPU backends in f32 (`dtype = "f32"`) and f64
//!   (checks); the same log lines, snapshots, checkpoints (either executor resumes the
//!   other's) and report fields, plus the arena's size. `poison = true` fills every dead
//!   buffer with NaN around each pass (a check for aliasing; slower).
//!
//! Resuming (`pipeline run --resume`): the weights, optimizer state, step, training time and
//! validation history come from the checkpoint ([`crate::train::resume`]); the batch geometry
//! and the training data must be those the checkpoint was made with.

use super::{config, previous, resumed};
use crate::data::batch::DeviceBatch;
use crate::runtime::memory::Need;
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};
use crate::train::engine_trainer::EngineOptions;
use crate::train::executor::ExecutorKind;
use crate::train::params::{Precision, SessionParams};
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
        crate::eval::executor::require_candle("stage `step_executor`, impl = \"candle\"")?;
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
        Ok(Self(Session::new(p, config(ctx)?, resumed(ctx), ctx.run_dir, (ctx.consumers > 0).then_some(ctx.demand), ExecutorKind::Candle)?))
    }

    fn process(&mut self, b: DeviceBatch, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.process(b, out, ctx)
    }

    fn flush(&mut self, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.close(out, ctx)
    }
}

/// The parameters of `step_executor/engine`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EngineParams {
    /// The arithmetic: on the CPU the arena's type, "f32" (the fast backend) or "f64" (the
    /// check backend); on a GPU "bf16" (f32 arena, GEMMs on the bf16 tensor cores) or "f32"
    /// (full f32 GEMMs, for parity checks).
    pub dtype: Precision,
    /// Where the activations and their gradients are stored: "bf16" (a GPU with `dtype =
    /// "bf16"`: PyTorch's autocast, half the activation memory and bytes moved, GEMMs on bf16
    /// operands natively, f32 master weights, gradients, optimizer state and per-row norm
    /// statistics), "f32" (an f32 arena; on a GPU its GEMMs round their operands to bf16), or
    /// "auto" (bf16 where it applies, a GPU with `dtype = "bf16"`; f32 otherwise).
    pub activations: Activations,
    /// Show a progress bar when stdout is a terminal (log lines print above it).
    pub progress: bool,
    /// Fill every buffer that is dead (activations between micro-batches, scratch between
    /// passes) with NaN: a read of a value its pass did not write then shows as a NaN loss.
    pub poison: bool,
    /// On a GPU: capture the forward pass, the backward pass and the optimizer step once each
    /// as CUDA graphs and replay them every micro-batch and step (false: launch every kernel
    /// as it comes, to compare or to debug). The CPU backends ignore it.
    pub cuda_graph: bool,
    /// Several ranks: send each bucket of gradients to be averaged over the ranks as soon as
    /// the backward pass of the step's last micro-batch has finished it, while the pass goes on
    /// (false: every bucket after the pass, to measure what the overlap saves).
    pub overlap_allreduce: bool,
    /// Several ranks: the size of a gradient bucket in MiB (DDP's `bucket_cap_mb`, 25).
    pub bucket_mib: f64,
    /// Several ranks: the size of the first gradient bucket in MiB (DDP's 1: the head's and
    /// the last blocks' gradients leave early in the backward pass).
    pub first_bucket_mib: f64,
    /// Write `RUN_DIR/step_trace/` for a step-by-step comparison, as `candle`'s key of that name.
    pub step_trace: bool,
    /// With `step_trace`: also save the weights after these steps, as `candle`'s key.
    pub step_trace_weights_at: Vec<u64>,
}

impl Default for EngineParams {
    fn default() -> Self {
        let o = EngineOptions::default();
        Self {
            dtype: Precision::F32,
            activations: Activations::Auto,
            progress: true,
            poison: false,
            cuda_graph: true,
            overlap_allreduce: o.overlap,
            bucket_mib: o.bucket_mib,
            first_bucket_mib: o.first_bucket_mib,
            step_trace: false,
            step_trace_weights_at: Vec::new(),
        }
    }
}

impl EngineParams {
    /// The session's parameters (attention and phase timing are the GPU's; the CPU has one
    /// of each).
    fn session(&self) -> SessionParams {
        SessionParams {
            dtype: self.dtype,
            progress: self.progress,
            step_trace: self.step_trace,
            step_trace_weights_at: self.step_trace_weights_at.clone(),
            ..SessionParams::default()
        }
    }

    /// Whether the activations are bf16 on `device` (`activations`, "auto" resolved).
    fn bf16_activations(&self, device: &str) -> bool {
        match self.activations {
            Activations::Bf16 => true,
            Activations::F32 => false,
            Activations::Auto => device != "cpu" && self.dtype == Precision::Bf16,
        }
    }

    /// Refuses what the backend of `run.device` cannot run, naming the key.
    fn check_backend(&self, ctx: &BuildCtx) -> anyhow::Result<()> {
        for (key, v) in [("bucket_mib", self.bucket_mib), ("first_bucket_mib", self.first_bucket_mib)] {
            anyhow::ensure!(v > 0.0 && v.is_finite(), "key `{key}` = {v} must be a positive number of MiB");
        }
        let c = config(ctx)?;
        // What of the model the engine implements (a refused element names its key), and the
        // shapes its GPU attention takes; either refusal says how to ask for candle.
        let candle = || format!("set `stages.{}.impl = \"candle\"` to train it on the candle executor", ctx.stage);
        crate::engine::support::check(&c.model).map_err(|e| anyhow::anyhow!("the engine cannot run this model: {e:#}; {}", candle()))?;
        let device = &c.run.device;
        anyhow::ensure!(
            self.activations != Activations::Bf16 || (device != "cpu" && self.dtype == Precision::Bf16),
            "key `activations` = \"bf16\" is the GPU backend's with key `dtype` = \"bf16\" (here `run.device` = {device:?}, `dtype` = {:?})",
            self.dtype
        );
        if device == "cpu" {
            anyhow::ensure!(
                self.dtype != Precision::Bf16,
                "key `dtype` = \"bf16\": the engine's CPU backends run in \"f32\" or \"f64\" (bf16 GEMMs are the GPU backend's, `run.device = \"cuda:N\"`)"
            );
        } else {
            anyhow::ensure!(
                crate::device::CUDA_BUILD,
                "`run.device` = {device:?}: this binary is built without the `cuda` feature (build it with scripts/build-cuda.sh)"
            );
            anyhow::ensure!(
                self.dtype != Precision::F64,
                "key `dtype` = \"f64\" is the CPU check backend's; on a GPU the engine runs \"bf16\" (tensor-core GEMMs) or \"f32\""
            );
            crate::engine::step::kernel_capacity(&c.model, 1, c.train.seq_len)
                .map_err(|e| anyhow::anyhow!("the engine cannot run this model on a GPU: {e:#}; {}", candle()))?;
        }
        Ok(())
    }
}

/// Where the engine stores its activations (key `activations`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// bf16 on a GPU with `dtype = "bf16"`, f32 otherwise.
    Auto,
    /// An f32 arena.
    F32,
    /// bf16 activations and gradients of activations (GPU, `dtype = "bf16"`).
    Bf16,
}

/// `step_executor/engine`.
pub struct Engine(Session);

impl Transform for Engine {
    const KIND: &'static str = "step_executor";
    const IMPL: &'static str = "engine";
    const DOC: &'static str = "Trains the GPT on the explicit engine (forward and hand-written backward over one arena; CPU f32/f64, GPU bf16/f32); same logs, snapshots and checkpoints as `candle`.";
    type Params = EngineParams;
    type In = DeviceBatch;
    type Out = TrainSnapshot;
    const OUTPUT_OPTIONAL: bool = true;

    fn check(p: &EngineParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        p.check_backend(ctx)?;
        requirements::check(&p.session(), config(ctx)?)
    }

    fn memory(p: &EngineParams, ctx: &BuildCtx) -> anyhow::Result<Vec<Need>> {
        let c = config(ctx)?;
        requirements::engine_memory(&p.session(), c, p.bf16_activations(&c.run.device))
    }

    fn nothing_left(_p: &EngineParams, ctx: &BuildCtx) -> Option<String> {
        resume::complete(config(ctx).ok()?, resumed(ctx), previous(ctx), ctx.run_dir)
    }

    fn build(p: EngineParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        p.check_backend(ctx)?;
        let kind = ExecutorKind::Engine(EngineOptions {
            poison: p.poison,
            cuda_graph: p.cuda_graph,
            bf16_activations: p.bf16_activations(&config(ctx)?.run.device),
            overlap: p.overlap_allreduce,
            bucket_mib: p.bucket_mib,
            first_bucket_mib: p.first_bucket_mib,
        });
        Ok(Self(Session::new(p.session(), config(ctx)?, resumed(ctx), ctx.run_dir, (ctx.consumers > 0).then_some(ctx.demand), kind)?))
    }

    fn process(&mut self, b: DeviceBatch, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.process(b, out, ctx)
    }

    fn flush(&mut self, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.close(out, ctx)
    }
}
