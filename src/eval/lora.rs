//! Phased TTT's per-document LoRA adapters (spec 5.4) behind the evaluation's executor: what
//! a batch of documents asks of the model ([`LoraModel`], a part of every evaluation model,
//! `EvalModel`). The candle model's way of doing it (autograd through [`crate::model::lora`],
//! `Adam` over the batched tensors) is beside the candle model in `executor.rs`; the engine's
//! is [`crate::train::engine_lora`].
//!
//! A batch's life: [`LoraModel::lora_begin`] (fresh adapters drawn from a seed, or the kept
//! set's A with B zeroed: the warm start of A), then per chunk [`LoraModel::lora_score`] (the
//! forward pass: every row's losses) and, when a row trains, [`LoraModel::lora_adapt`] (the
//! backward pass into the adapters and one AdamW step), then [`LoraModel::lora_end`] (keep the
//! set for the next full batch, or drop it). The loss a step descends is, over the rows that
//! train, the mean NLL of each row's scored positions, summed over the rows:
//!
//! ```text
//! L = Σ_b∈train (1 / |S_b|) Σ_i∈S_b nll_b,i        S_b: row b's scored positions this chunk
//! ```

use std::ops::Range;

/// The adapters and their optimizer (phased TTT's `lora_*` keys).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoraSpec {
    /// Rank.
    pub rank: usize,
    /// Outputs scaled by `alpha / rank` (`None`: by 1).
    pub alpha: Option<f64>,
    /// AdamW's learning rate.
    pub lr: f64,
    /// AdamW's `(β1, β2)`.
    pub betas: (f64, f64),
    /// AdamW's `ε`.
    pub eps: f64,
    /// AdamW's decoupled weight decay.
    pub weight_decay: f64,
}

impl LoraSpec {
    /// The adapters' output scale.
    pub fn scale(&self) -> f64 {
        self.alpha.map_or(1.0, |a| a / self.rank as f64)
    }
}

/// One chunk's pass over a batch: a row per document of the batch, `width` positions each.
#[derive(Clone, Copy, Debug)]
pub struct LoraStep<'a> {
    /// Inputs, `docs x width` (a row's positions past its window: anything).
    pub x: &'a [u32],
    /// Targets, as `x`.
    pub y: &'a [u32],
    /// Positions per row.
    pub width: usize,
    /// Per row: it has a chunk in this pass (the others are not run where that saves work).
    pub active: &'a [bool],
    /// Per row: the positions (of the row) whose losses are scored.
    pub scored: &'a [Range<usize>],
    /// Per row: its scored positions are also what the adapters train on (an active row's).
    pub train: &'a [bool],
}

impl LoraStep<'_> {
    /// Rows (documents of the batch).
    pub fn rows(&self) -> usize {
        self.active.len()
    }
}

/// What phased TTT's adapters ask of a model (see the module doc).
pub trait LoraModel {
    /// Adapters for a batch of `docs` documents and a fresh AdamW: under `warm`, the kept set's
    /// A with every B zeroed when a set is kept ([`LoraModel::lora_end`]); else fresh ones, A
    /// drawn from `seed` ([`crate::model::lora::Lora::new`]), B zero (a kept set stays kept).
    fn lora_begin(&mut self, spec: &LoraSpec, docs: usize, seed: u64, warm: bool) -> anyhow::Result<()>;

    /// The forward pass of a chunk through the batch's adapters on the frozen base: the losses
    /// `docs x width`, meaningful at each active row's scored positions (the rest are whatever
    /// the executor computes: the engine ignores those targets and gives 0).
    fn lora_score(&mut self, step: &LoraStep<'_>) -> anyhow::Result<Vec<f32>>;

    /// The backward pass of the last [`LoraModel::lora_score`] (one with a training row) into
    /// the adapters, and one AdamW step.
    fn lora_adapt(&mut self) -> anyhow::Result<()>;

    /// The batch is done: its adapters are kept for the next warm start (`keep`) or dropped.
    fn lora_end(&mut self, keep: bool) -> anyhow::Result<()>;

    /// Drops a kept set (the base changed: the warm start begins again).
    fn lora_forget(&mut self);

    /// The kept set's first A (`lora.0.q.a`), flattened (checks of the warm start).
    fn lora_kept_a(&mut self) -> anyhow::Result<Option<Vec<f64>>>;
}
