//! What a training session trains with: [`Executor`], the one interface the session, resume
//! and the checkpoints use, implemented by the candle executor ([`crate::train::trainer::Trainer`],
//! autograd) and the explicit engine ([`crate::train::engine_trainer::EngineTrainer`]). Both
//! give the model's weights as of the last finished step as a [`Gpt`]
//! ([`Executor::synced_model`]: validation, snapshots and the saved weights read it) and name
//! their optimizer state alike, so a checkpoint of either continues in either.

use std::collections::HashMap;

use std::time::Duration;

use candle_core::Tensor;

use crate::device::phase_clock::PhaseTimes;
use crate::model::Gpt;

/// What one micro-batch cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct MicroTimes {
    /// Forward pass (loss included).
    pub forward: Duration,
    /// Backward pass and gradient accumulation.
    pub backward: Duration,
}

/// The outcome of an optimizer step.
#[derive(Clone, Copy, Debug)]
pub struct StepOutcome {
    /// Mean of the micro-batches' losses (what the script logs as `train_loss`).
    pub train_loss: f64,
    /// The LR multiplier used.
    pub lr_mul: f64,
    /// The training fraction at the step's start ([`TrainConfig::training_frac`]), which the
    /// `warmdown_frac` schedule used (reported whichever schedule is on).
    pub frac: f64,
    /// Muon momentum used.
    pub momentum: f64,
    /// Global gradient norm before clipping (computed only when clipping is on).
    pub grad_norm: Option<f64>,
    /// The phase times to account for this step. Timed by the host (CPU, or `sync_phases`):
    /// this step's forward and backward passes and its update (clipping included). Timed on the
    /// device ([`crate::train::trainer::Trainer::device_timed`]: CUDA without `sync_phases`): the event spans that have
    /// ended since the previous step, i.e. this step's micro-batches and usually the previous
    /// step's update; the host's times would only be the time to queue the work.
    pub phases: PhaseTimes,
    /// Wall time the step waited for its collectives on several ranks (the gradient
    /// all-reduce and the sharded Muon's update exchange); zero on one rank. Without overlap
    /// that is all of their time.
    pub comm: Duration,
    /// Time of the gradient all-reduce that ran while the backward pass went on (the engine
    /// sends buckets as the pass finishes them): collective time the step did not wait for.
    pub overlapped: Duration,
}

/// Which executor a `step_executor` stage trains with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExecutorKind {
    /// candle's autograd (`impl = "candle"`).
    Candle,
    /// The explicit engine (`impl = "engine"`) and how it runs.
    Engine(EngineOptions),
}

/// How the engine runs, beside the model's own settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineOptions {
    /// NaN in every dead buffer around each pass (a check for arena aliasing).
    pub poison: bool,
    /// On a GPU: capture each pass and the optimizer step once as CUDA graphs and replay them
    /// (off: every op launched as it comes).
    pub cuda_graph: bool,
    /// On a GPU with bf16 matmuls: store the activations and their gradients in bf16 and run
    /// the GEMMs on bf16 operands natively (off: an f32 arena, GEMMs on bf16 tensor cores;
    /// the stage's key `activations` decides, "auto" turning it on there).
    pub bf16_activations: bool,
    /// Several ranks: send each bucket of gradients to be averaged as soon as the backward pass
    /// has finished it (false: all of them after the pass).
    pub overlap: bool,
    /// Several ranks: the size of a gradient bucket, MiB (DDP's 25).
    pub bucket_mib: f64,
    /// Several ranks: the size of the first bucket, MiB (DDP's 1: the exchange starts early).
    pub first_bucket_mib: f64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            poison: false,
            cuda_graph: true,
            bf16_activations: false,
            overlap: true,
            bucket_mib: crate::engine::exchange::DEFAULT_BUCKET_MIB,
            first_bucket_mib: crate::engine::exchange::DEFAULT_FIRST_BUCKET_MIB,
        }
    }
}

/// One optimizer step at a time, fed micro-batch by micro-batch.
pub trait Executor: Send {
    /// The model: its config, layout, looping switch and parameter names. Its weights are
    /// those of the last finished step only for the candle executor; read weights through
    /// [`Executor::synced_model`].
    fn model(&self) -> &Gpt;

    /// The model with the weights of the last finished step (or the initial ones): what
    /// validation, snapshots and the saved weights read. The engine copies them from its arena
    /// here, when a step has changed them since the last call, rather than after every step.
    fn synced_model(&mut self) -> anyhow::Result<&Gpt> {
        Ok(self.model())
    }

    /// The summed loss (nats) of `rows` sequences of targets `y` after inputs `x` (row-major
    /// u32 ids), with the weights of the last finished step: what validation scores, each
    /// executor with its own forward pass. Between steps only.
    fn score(&mut self, x: &[u32], y: &[u32], rows: usize) -> anyhow::Result<f64>;

    /// Sequences [`Executor::score`] runs at once (validation batches are made a multiple of
    /// it): 1 for a model of any batch; the engine's micro-batch rows.
    fn score_rows(&self) -> usize {
        1
    }

    /// Switches depth recurrence on or off for the steps that follow.
    fn set_looping(&mut self, on: bool);

    /// Replaces every weight (a resume); errors name the tensor that does not fit.
    fn load_weights(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()>;

    /// Forward and backward of one micro-batch (`x`, `y`: `(rows, seq_len)` u32), adding its
    /// share of the step's gradient.
    fn micro_step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<MicroTimes>;

    /// Ends the step once all its micro-batches are in (see [`crate::train::trainer::Trainer::finish_step`]).
    fn finish_step(&mut self, elapsed_ms: f64) -> anyhow::Result<StepOutcome>;

    /// Drops the micro-batches of an unfinished step; returns how many there were.
    fn discard_partial_step(&mut self) -> usize;

    /// Optimizer steps taken.
    fn step(&self) -> u64;

    /// Micro-batches of the current step taken so far.
    fn micro_done(&self) -> usize;

    /// Micro-batches per step.
    fn micro_steps(&self) -> usize;

    /// The optimizer state as named tensors (`muon.*`, `adam_*.*`).
    fn optimizer_state(&self) -> anyhow::Result<Vec<(String, Tensor)>>;

    /// Continues from a checkpoint: `step` steps taken, optimizer state from `optimizer`.
    fn restore(&mut self, step: u64, optimizer: &HashMap<String, Tensor>) -> anyhow::Result<()>;

    /// Phase times not yet returned by a step (device spans still running).
    fn flush_phase_times(&mut self) -> anyhow::Result<PhaseTimes>;

    /// Lines for the start of the training log (the engine's arena), if any.
    fn startup_lines(&self) -> Vec<String> {
        Vec::new()
    }

    /// Fields for the report's `train` section (the engine's arena), if any.
    fn report(&self) -> Option<serde_json::Value> {
        None
    }
}

/// The checks before a micro-batch, the same for every executor: the step in progress still
/// wants one, and it is not a step past `train.iterations`.
pub(crate) fn check_micro_batch(micro_done: usize, micro_steps: usize, step: u64, iterations: u64) -> anyhow::Result<()> {
    anyhow::ensure!(micro_done < micro_steps, "micro-batch {micro_done} of a {micro_steps}-micro-batch step");
    anyhow::ensure!(
        step < iterations,
        "refusing to train step {}: `train.iterations` is {iterations} and no step past it is ever trained",
        step + 1
    );
    Ok(())
}
