//! Phased TTT's per-document LoRA adapters (spec 5.4) behind the evaluation's executor: what
//! a batch of documents asks of the model ([`LoraModel`], a part of every
//! [`super::executor::EvalModel`]), and the candle model's way of doing it (autograd through
//! [`crate::model::lora`], [`Adam`] over the batched tensors). The engine's is
//! [`crate::train::engine_lora`].
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

use std::borrow::Borrow;
use std::ops::Range;

use candle_core::{DType, Tensor};

use super::executor::CandleModel;
use crate::model::lora::Lora;
use crate::model::{Gpt, PassExtras};
use crate::optim::Adam;

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
    /// drawn from `seed` ([`Lora::new`]), B zero (a kept set stays kept).
    fn lora_begin(&mut self, spec: &LoraSpec, docs: usize, seed: u64, warm: bool) -> anyhow::Result<()>;

    /// The forward pass of a chunk through the batch's adapters on the frozen base: the loss
    /// of every position, `docs x width` (0 where a row is not active).
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

/// The candle model's adapters: the live set, its optimizer and the pending loss, and the set
/// kept for the warm start.
#[derive(Default)]
pub struct CandleLora {
    live: Option<(Lora, Adam, LoraSpec)>,
    pending: Option<Tensor>,
    kept: Option<Lora>,
}

impl<M: Borrow<Gpt>> LoraModel for CandleModel<M> {
    fn lora_begin(&mut self, spec: &LoraSpec, docs: usize, seed: u64, warm: bool) -> anyhow::Result<()> {
        let m = self.model.borrow();
        let kept = if warm { self.lora.kept.take() } else { None };
        let lora = match kept {
            Some(l) => {
                anyhow::ensure!(l.rows() == docs, "internal: a kept set of {} documents for a batch of {docs}", l.rows());
                l.reset_b()?;
                l
            }
            None => Lora::new(m.config(), m.looping(), (docs, spec.rank), seed, m.dtype(), m.device())?.with_alpha(spec.alpha),
        };
        let adam = Adam::new(lora.vars(), spec.lr, spec.betas, spec.eps)?.with_weight_decay(spec.weight_decay).with_prefix("lora");
        self.lora.live = Some((lora, adam, *spec));
        self.lora.pending = None;
        Ok(())
    }

    fn lora_score(&mut self, s: &LoraStep<'_>) -> anyhow::Result<Vec<f32>> {
        let m = self.model.borrow();
        let (lora, ..) = self.lora.live.as_ref().ok_or_else(|| anyhow::anyhow!("internal: a LoRA pass before `lora_begin`"))?;
        let w = s.width;
        // The active rows only, gathered (and their adapters with them).
        let active: Vec<u32> = (0..s.rows()).filter(|&r| s.active[r]).map(|r| r as u32).collect();
        let (mut x, mut y) = (Vec::with_capacity(active.len() * w), Vec::with_capacity(active.len() * w));
        for &r in &active {
            x.extend_from_slice(&s.x[r as usize * w..][..w]);
            y.extend_from_slice(&s.y[r as usize * w..][..w]);
        }
        let shape = (active.len(), w);
        let (xt, yt) = (Tensor::from_slice(&x, shape, m.device())?, Tensor::from_slice(&y, shape, m.device())?);
        let pass = lora.pass(Some(&active))?;
        let nll_t = m.frozen_token_losses(&xt, &yt, PassExtras { lora: Some(&pass), docs: None })?;
        let nll = nll_t.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let mut weights = vec![0f32; active.len() * w];
        let mut out = vec![0f32; s.rows() * w];
        for (row, &r) in active.iter().enumerate() {
            let r = r as usize;
            out[r * w..][..w].copy_from_slice(&nll[row * w..][..w]);
            if s.train[r] {
                let sc = &s.scored[r];
                weights[row * w + sc.start..row * w + sc.end].fill(1.0 / sc.len() as f32);
            }
        }
        self.lora.pending = if active.iter().any(|&r| s.train[r as usize]) {
            let wt = Tensor::from_vec(weights, active.len() * w, m.device())?.to_dtype(nll_t.dtype())?;
            Some((nll_t * wt)?.sum_all()?)
        } else {
            None
        };
        Ok(out)
    }

    fn lora_adapt(&mut self) -> anyhow::Result<()> {
        let loss = self.lora.pending.take().ok_or_else(|| anyhow::anyhow!("internal: a LoRA step without a training pass"))?;
        let (_, adam, spec) = self.lora.live.as_mut().ok_or_else(|| anyhow::anyhow!("internal: a LoRA step before `lora_begin`"))?;
        let grads = loss.backward()?;
        adam.step(&grads, spec.lr)?;
        Ok(())
    }

    fn lora_end(&mut self, keep: bool) -> anyhow::Result<()> {
        let live = self.lora.live.take();
        self.lora.pending = None;
        if keep {
            self.lora.kept = live.map(|(l, ..)| l);
        }
        Ok(())
    }

    fn lora_forget(&mut self) {
        self.lora.kept = None;
    }

    fn lora_kept_a(&mut self) -> anyhow::Result<Option<Vec<f64>>> {
        let Some(l) = &self.lora.kept else { return Ok(None) };
        Ok(Some(l.vars()[0].1.flatten_all()?.to_dtype(DType::F64)?.to_vec1()?))
    }
}
