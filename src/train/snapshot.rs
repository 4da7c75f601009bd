//! What the step executor hands to the stages after it: one [`TrainSnapshot`] per optimizer
//! step (and one before the first), then a final one when training ends.
//!
//! The executor pays for one copy of the parameters per step (they are updated in place);
//! everything else in a snapshot is shared: optimizer state tensors are replaced, never
//! mutated, by every step, so holding them costs no copy. The stages downstream (weight
//! averaging, checkpoints, the artifact, evaluation) do their work on their own threads, and
//! a snapshot is all they need: none of them touches the live model.

use std::sync::Arc;

use candle_core::Tensor;
use serde::Serialize;

use crate::data::batch::LoaderState;
use crate::runtime::message::Message;

/// Named tensors, in the model's `state_dict` order.
pub type Tensors = Arc<Vec<(String, Tensor)>>;

/// Where in the run a snapshot was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Moment {
    /// Before the first step of this process (the initial or resumed weights).
    Start,
    /// After an optimizer step.
    Step,
    /// Training is over: the last step's weights, after the final validation.
    Final(Ending),
}

/// Why training ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ending {
    /// `train.iterations` steps were taken.
    Iterations,
    /// `train.max_wallclock_seconds` of training time passed.
    WallclockCap,
    /// The input ended (or `run.max_seconds` stopped the graph).
    InputEnded,
    /// Ctrl-C: save and leave; no evaluation.
    Interrupted,
    /// A stage failed.
    Failed,
}

/// Weights that evaluation should use instead of the raw ones (averaged, or quantized and
/// restored), with the label the logs give them.
#[derive(Clone)]
pub struct EvalWeights {
    /// `ema`, `swa`, `quantized`, ...
    pub label: String,
    /// The tensors, with the model's names.
    pub tensors: Tensors,
}

/// A weight averager's state, as a checkpoint saves it.
#[derive(Clone)]
pub struct AveragerState {
    /// `ema` or `swa`.
    pub kind: String,
    /// Snapshots folded in.
    pub count: u64,
    /// The averaged tensors (f32), with the model's names.
    pub tensors: Tensors,
}

/// Everything a checkpoint needs besides the weights, shared rather than copied.
#[derive(Clone)]
pub struct TrainerState {
    /// Optimizer state tensors (`muon.*`, `adam_*.*`).
    pub optimizer: Tensors,
    /// The sampler's state after the step's last micro-batch.
    pub loader: Option<Arc<LoaderState>>,
    /// Several ranks whose samplers' states differ (the shuffled sampler): every rank's, in
    /// rank order, so that a checkpoint resumes each; empty otherwise.
    pub rank_loaders: Arc<Vec<LoaderState>>,
    /// Rolling data-order fingerprint up to this step.
    pub rolling: u64,
    /// The executor's history (validations, ...), opaque to other stages.
    pub history: serde_json::Value,
    /// Fingerprint of the training data files.
    pub data: String,
}

/// One snapshot of training.
#[derive(Clone)]
pub struct TrainSnapshot {
    /// Optimizer steps taken.
    pub step: u64,
    /// When it was taken.
    pub moment: Moment,
    /// Training time so far, ms (validation excluded).
    pub train_ms: f64,
    /// The step's training loss (NaN before the first step).
    pub train_loss: f64,
    /// The LR multiplier of the step (1 before the first).
    pub lr_mul: f64,
    /// The parameters after the step (a copy the executor made).
    pub weights: Tensors,
    /// Optimizer and loader state.
    pub state: Arc<TrainerState>,
    /// Set by an averaging stage: its state (saved by checkpoints).
    pub averager: Option<AveragerState>,
    /// Set by stages after training: the weights evaluation should use.
    pub eval: Option<EvalWeights>,
}

impl TrainSnapshot {
    /// The weights to evaluate and their label: [`TrainSnapshot::eval`] when a stage set it,
    /// else the raw weights as `final`.
    pub fn eval_weights(&self) -> (&str, &Tensors) {
        match &self.eval {
            Some(e) => (&e.label, &e.tensors),
            None => ("final", &self.weights),
        }
    }

    /// True for the last snapshot of a run that ended normally (evaluation should run).
    pub fn is_final_for_eval(&self) -> bool {
        matches!(self.moment, Moment::Final(Ending::Iterations | Ending::WallclockCap | Ending::InputEnded))
    }
}

impl Message for TrainSnapshot {
    const NAME: &'static str = "TrainSnapshot";
}
