//! The model an evaluation after training runs on: what sliding windows, score-first TTT and
//! phased TTT's global SGD ask of it, behind one trait ([`EvalModel`]) with two executors, as
//! training has two:
//!
//! - the explicit engine (`executor = "engine"`, the default:
//!   [`crate::train::engine_eval::EngineModel`], a floor up since it joins the engine and this
//!   trait): forward passes and SGD on its arena, f32/f64 on the CPU, bf16 activations on a GPU;
//! - `CandleModel` ([`super::candle_model`], feature `candle`): the candle model and its
//!   autograd (`executor = "candle"`): the reference the tests compare the engine with, and the
//!   executor of an element the engine lacks.
//!
//! Both score the same positions from the same weights; the tests hold them to each other
//! (`src/train/engine_eval_tests.rs`).

use serde::{Deserialize, Serialize};

pub use super::lora::LoraModel;
use crate::dist::Collective;
use crate::model::ModelConfig;
use crate::model::observe::InputObserver;

/// Which executor an evaluation runs on (the `ttt_eval` stages' key `executor`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EvalExecutor {
    /// The explicit engine ([`crate::engine`]): the default.
    #[default]
    Engine,
    /// The candle model and its autograd.
    Candle,
}

/// Whether this build has the candle executor (the feature `candle`, which the full build's
/// `tools` brings); without it, an error naming `what` asked for it and saying how to get it.
pub fn require_candle(what: &str) -> anyhow::Result<()> {
    if cfg!(feature = "candle") { Ok(()) } else { Err(candle_missing(what)) }
}

/// The error of a build without the candle executor asked for it by `what`.
pub fn candle_missing(what: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: the candle executor is not in this build (the lean record build leaves it out); use the engine, or build with `--features candle` (the full build has it)"
    )
}

impl EvalExecutor {
    /// The key's value as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            EvalExecutor::Engine => "engine",
            EvalExecutor::Candle => "candle",
        }
    }
}

/// One SGD step of test-time training: this rank's rows of one batch, and how to step.
#[derive(Clone, Copy, Debug)]
pub struct SgdStep<'a> {
    /// This rank's inputs, `rows_here x t` (empty when this rank has no rows of the batch).
    pub x: &'a [u32],
    /// Their targets.
    pub y: &'a [u32],
    /// Inputs per row.
    pub t: usize,
    /// Rows of the whole batch over every rank: the loss is the mean over their `rows x t`
    /// positions, so each rank's share of the gradient is summed, not averaged.
    pub rows: usize,
    /// `Some(bos)`: attention inside the documents each BOS starts; `None`: the model's rule.
    pub doc_bos: Option<u32>,
    /// Learning rate.
    pub lr: f64,
    /// Global gradient-norm clip (torch's `clip_grad_norm_`); 0: none.
    pub grad_clip: f64,
    /// The first target of the batch, for errors.
    pub from: usize,
}

/// What the evaluations after training need of a model (see the module doc), phased TTT's
/// adapters included ([`LoraModel`]).
pub trait EvalModel: LoraModel {
    /// The model's configuration (vocabulary, BOS, shapes).
    fn config(&self) -> &ModelConfig;

    /// The executor and where it runs, for the log (`engine (cpu f32)`, `candle (cuda bf16)`).
    fn describe(&self) -> String;

    /// The loss (nats) of every position of the rows of `t` inputs `x` and targets `y`
    /// (`x.len()` a multiple of `t`), by forward passes alone; the model's own attention rule.
    fn token_losses(&mut self, x: &[u32], y: &[u32], t: usize) -> anyhow::Result<Vec<f32>>;

    /// A fresh SGD optimizer with momentum `momentum` over every parameter (its buffers start
    /// from the first gradient, as torch's).
    fn reset_sgd(&mut self, momentum: f64) -> anyhow::Result<()>;

    /// One SGD step ([`SgdStep`]) of the optimizer [`EvalModel::reset_sgd`] made: the mean
    /// cross-entropy of the batch's rows (this rank's share of them, summed over `ranks`),
    /// clipped, one step. Every rank calls it for every step, with or without rows.
    fn sgd_step(&mut self, step: &SgdStep<'_>, ranks: &dyn Collective) -> anyhow::Result<()>;

    /// Hands the input of every matrix product of forward passes over the rows of `t` ids `x`
    /// to `observer` (GPTQ's calibration: [`crate::model::observe`]), the model's own
    /// attention rule, looped as the model is.
    fn observe_inputs(&mut self, x: &[u32], t: usize, observer: &mut dyn InputObserver) -> anyhow::Result<()>;
}
