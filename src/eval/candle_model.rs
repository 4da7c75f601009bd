//! The candle model as an evaluation's model ([`EvalModel`], `executor = "candle"`; feature
//! `candle`): its forward pass for the losses, candle's autograd and [`Sgd`] for the steps,
//! LoRA adapters through autograd for phased TTT. The reference the engine's evaluation is
//! tested against (`src/train/engine_eval_tests.rs`).

use std::borrow::Borrow;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::executor::{EvalModel, LoraModel, SgdStep};
use super::lora::{LoraSpec, LoraStep};
use crate::dist::{Collective, ReduceOp};
use crate::model::lora::Lora;
use crate::model::observe::InputObserver;
use crate::model::ops::{DocRule, DocumentMask};
use crate::model::{Gpt, ModelConfig, PassExtras};
use crate::optim::Adam;
use crate::optim::Sgd;

/// The candle model as an [`EvalModel`]: [`Gpt::eval_token_losses`] for the losses, autograd
/// and [`Sgd`] for the steps. It owns the model (`M = Gpt`) or borrows it (`&Gpt`: the
/// parameters are variables, trained in place either way).
pub struct CandleModel<M: Borrow<Gpt> = Gpt> {
    model: M,
    sgd: Option<Sgd>,
    /// Phased TTT's adapters ([`super::lora`]).
    lora: CandleLora,
}

impl<M: Borrow<Gpt>> CandleModel<M> {
    /// `model`, trained in place by the SGD steps.
    pub fn new(model: M) -> Self {
        Self { model, sgd: None, lora: Default::default() }
    }

    /// The model.
    pub fn model(&self) -> &Gpt {
        self.model.borrow()
    }
}

impl<M: Borrow<Gpt>> EvalModel for CandleModel<M> {
    fn config(&self) -> &ModelConfig {
        self.model().config()
    }

    fn describe(&self) -> String {
        let m = self.model();
        let place = if m.device().is_cpu() { "cpu" } else { "cuda" };
        format!("candle ({place} {:?})", m.matmul_dtype()).to_lowercase()
    }

    fn token_losses(&mut self, x: &[u32], y: &[u32], t: usize) -> anyhow::Result<Vec<f32>> {
        anyhow::ensure!(t > 0 && x.len() == y.len() && x.len().is_multiple_of(t), "{} ids and {} targets in rows of {t}", x.len(), y.len());
        let (rows, m) = (x.len() / t, self.model());
        let xt = Tensor::from_slice(x, (rows, t), m.device())?;
        let yt = Tensor::from_slice(y, (rows, t), m.device())?;
        Ok(m.eval_token_losses(&xt, &yt)?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }

    fn reset_sgd(&mut self, momentum: f64) -> anyhow::Result<()> {
        let params: Vec<(String, Var)> = self.model().params().iter().map(|(name, var, _)| (name.clone(), var.clone())).collect();
        self.sgd = Some(Sgd::new(params, momentum)?);
        Ok(())
    }

    fn sgd_step(&mut self, s: &SgdStep<'_>, ranks: &dyn Collective) -> anyhow::Result<()> {
        let model = self.model.borrow();
        let mut grads = GradStore::default();
        if !s.x.is_empty() {
            let local = s.x.len() / s.t;
            let x = Tensor::from_slice(s.x, (local, s.t), model.device())?;
            let y = Tensor::from_slice(s.y, (local, s.t), model.device())?;
            let mask = s.doc_bos.map(|bos| DocumentMask::at_token(s.x, s.t, DocRule { bos, ..model.config().doc_rule() })).transpose()?;
            let mut loss = model.token_losses_with(&x, &y, PassExtras { lora: None, docs: mask.as_ref() })?.mean_all()?;
            let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            anyhow::ensure!(value.is_finite(), "the TTT training loss is {value} on the sequences from target {}", s.from);
            if local != s.rows {
                loss = (loss * (local as f64 / s.rows as f64))?;
            }
            let mut store = loss.backward()?;
            // Only the parameters' gradients are kept; the activations' go with `store`.
            for (_, var, _) in model.params() {
                if let Some(g) = store.remove(var.as_tensor()) {
                    grads.insert(var.as_tensor(), g);
                }
            }
        }
        if !ranks.is_identity() {
            grads = sum_over_ranks(model, grads, ranks)?;
        }
        if s.grad_clip > 0.0 {
            clip_grad_norm(model, &mut grads, s.grad_clip)?;
        }
        let sgd = self.sgd.as_mut().ok_or_else(|| anyhow::anyhow!("internal: an SGD step before `reset_sgd`"))?;
        sgd.step(&grads, s.lr)?;
        Ok(())
    }

    fn observe_inputs(&mut self, x: &[u32], t: usize, observer: &mut dyn InputObserver) -> anyhow::Result<()> {
        let m = self.model();
        let xt = Tensor::from_slice(x, (x.len() / t, t), m.device())?;
        Ok(m.observe_inputs(&xt, observer)?)
    }
}

/// Every parameter's gradient summed over the ranks (a parameter without one here counts as
/// zeros), in buckets ([`crate::dist::bucket`]).
fn sum_over_ranks(model: &Gpt, mut grads: GradStore, ranks: &dyn Collective) -> anyhow::Result<GradStore> {
    let vars: Vec<Var> = model.params().iter().map(|(_, v, _)| v.clone()).collect();
    let mine: Vec<Tensor> = vars
        .iter()
        .map(|v| match grads.remove(v.as_tensor()) {
            Some(g) => Ok(g),
            None => v.as_tensor().zeros_like(),
        })
        .collect::<candle_core::Result<_>>()?;
    let (summed, _) = crate::dist::bucket::all_reduce_tensors(ranks, &mine, ReduceOp::Sum, crate::dist::bucket::DEFAULT_BUCKET_ELEMS)?;
    let mut out = GradStore::default();
    for (v, g) in vars.iter().zip(summed) {
        out.insert(v.as_tensor(), g);
    }
    Ok(out)
}

/// `torch.nn.utils.clip_grad_norm_`: the global L2 norm of all gradients (summed in `f64`);
/// every gradient is scaled by `max / (norm + 1e-6)` when that is below 1. Returns the norm
/// before clipping.
fn clip_grad_norm(model: &Gpt, grads: &mut GradStore, max: f64) -> anyhow::Result<f64> {
    let mut sq = 0.0f64;
    for (_, var, _) in model.params() {
        if let Some(g) = grads.get(var.as_tensor()) {
            sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
        }
    }
    let norm = sq.sqrt();
    let coef = max / (norm + 1e-6);
    if coef < 1.0 {
        for (_, var, _) in model.params() {
            if let Some(g) = grads.remove(var.as_tensor()) {
                grads.insert(var.as_tensor(), (g * coef)?);
            }
        }
    }
    Ok(norm)
}

/// The candle model's adapters: the live set, its optimizer and the pending loss, and the set
/// kept for the warm start.
#[derive(Default)]
struct CandleLora {
    live: Option<(Lora, Adam, LoraSpec)>,
    pending: Option<Tensor>,
    kept: Option<Lora>,
}

/// Phased TTT's adapters on the candle model ([`super::lora`]): the old loop's code.
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
