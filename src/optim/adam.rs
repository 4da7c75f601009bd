//! Adam (§3.6), as `torch.optim.Adam` without weight decay, and as `torch.optim.AdamW` with
//! decoupled weight decay (the 04-09 record, §4.4); see the module doc of [`crate::optim`] for
//! the update.

#[cfg(feature = "candle")]
use std::collections::{HashMap, HashSet};

#[cfg(feature = "candle")]
use candle_core::backprop::GradStore;
#[cfg(feature = "candle")]
use candle_core::{DType, Device, Result, Tensor, Var, bail};

#[cfg(feature = "candle")]
use super::state::{reject_unexpected, state_name, take_state};

/// `torch.optim.Adam` (§3.6) over a list of named parameters of any shape, without weight decay;
/// `torch.optim.AdamW` with [`Adam::with_weight_decay`].
///
/// State: `exp_avg` (`m`) and `exp_avg_sq` (`v`) per parameter (zeros at the start) and one step
/// count shared by the group (torch counts per parameter; the two agree as long as every
/// parameter gets a gradient every step, which holds for the record's groups).
#[derive(Debug)]
#[cfg(feature = "candle")]
pub struct Adam {
    params: Vec<(String, Var)>,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    step: u64,
    base_lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    /// Decoupled (AdamW) weight decay: `p ← p·(1 − lr·wd)` before the update; 0: none.
    weight_decay: f64,
    prefix: String,
}

#[cfg(feature = "candle")]
impl Adam {
    /// Builds the optimizer with the group's `base_lr`, `betas = (β1, β2)` and `eps` (the record:
    /// betas (0.9, 0.95), eps 1e-8; base LR 0.05 for the tied embedding, 0.04 for scalars). The
    /// state prefix is `adam`.
    ///
    /// # Errors
    ///
    /// When two parameters share a name, or on a candle error.
    pub fn new(params: Vec<(String, Var)>, base_lr: f64, betas: (f64, f64), eps: f64) -> Result<Self> {
        let mut seen = HashSet::new();
        let mut exp_avg = Vec::with_capacity(params.len());
        let mut exp_avg_sq = Vec::with_capacity(params.len());
        for (name, var) in &params {
            if !seen.insert(name.as_str()) {
                bail!("Adam parameter name {name} appears twice");
            }
            exp_avg.push(var.zeros_like()?.detach());
            exp_avg_sq.push(var.zeros_like()?.detach());
        }
        Ok(Self {
            params,
            exp_avg,
            exp_avg_sq,
            step: 0,
            base_lr,
            beta1: betas.0,
            beta2: betas.1,
            eps,
            weight_decay: 0.0,
            prefix: "adam".to_string(),
        })
    }

    /// Decoupled weight decay `wd`, `torch.optim.AdamW`'s: each step first scales every
    /// parameter that has a gradient by `1 − lr·wd` at that step's `lr`, then takes the Adam
    /// update. A gradient that is present but zero still decays its parameter (as torch does: the
    /// record's unused skip rows shrink before looping starts); a missing one does not. 0 (the
    /// default) is plain Adam, the multiplication skipped altogether.
    pub fn with_weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }

    /// Replaces the state-name prefix (default `adam`); two Adam groups saved into one checkpoint
    /// need distinct prefixes.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The named parameters, in construction order.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The group's base learning rate.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// The decoupled weight decay (0: none).
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay
    }

    /// The number of steps taken (`t` of the last step; 0 before the first).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// One Adam step at learning rate `lr` (already multiplied by the schedule). The step count
    /// `t` is incremented first, then for every parameter with a gradient: with weight decay
    /// `p ← p·(1 − lr·wd)`; `m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²;
    /// p ← p − (lr/(1−β1^t)) · m / (sqrt(v)/sqrt(1−β2^t) + eps)`.
    ///
    /// A parameter whose gradient is missing from `grads` is skipped (parameter and moments
    /// unchanged), but the shared step count still advances.
    ///
    /// # Errors
    ///
    /// On a candle error (for instance a gradient whose shape differs from its parameter's).
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let t = self.step as f64;
        let bias_correction1 = 1.0 - self.beta1.powf(t);
        let bias_correction2_sqrt = (1.0 - self.beta2.powf(t)).sqrt();
        let step_size = lr / bias_correction1;
        for (((name, var), m), v) in self.params.iter().zip(self.exp_avg.iter_mut()).zip(self.exp_avg_sq.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            if g.dims() != var.dims() {
                bail!("Adam: gradient of {name} has shape {:?}, parameter has {:?}", g.dims(), var.dims());
            }
            let g = g.detach().to_dtype(var.dtype())?;
            let new_m = (m.affine(self.beta1, 0.0)? + g.affine(1.0 - self.beta1, 0.0)?)?;
            let new_v = (v.affine(self.beta2, 0.0)? + g.sqr()?.affine(1.0 - self.beta2, 0.0)?)?;
            let denom = new_v.sqrt()?.affine(1.0 / bias_correction2_sqrt, self.eps)?;
            let update = new_m.div(&denom)?.affine(step_size, 0.0)?;
            let p = var.as_detached_tensor();
            let p = if self.weight_decay == 0.0 { p } else { p.affine(1.0 - lr * self.weight_decay, 0.0)? };
            let updated = (p - update)?;
            var.set(&updated)?;
            *m = new_m;
            *v = new_v;
        }
        Ok(())
    }

    /// The optimizer state as named tensors: `{prefix}.{param}.exp_avg` and
    /// `{prefix}.{param}.exp_avg_sq` per parameter, and `{prefix}.step`, the step count as a
    /// 1-element i64 tensor on the CPU (weight decay keeps no state).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len() + 1);
        for (((name, _), m), v) in self.params.iter().zip(&self.exp_avg).zip(&self.exp_avg_sq) {
            out.push((state_name(&self.prefix, name, "exp_avg"), m.clone()));
            out.push((state_name(&self.prefix, name, "exp_avg_sq"), v.clone()));
        }
        let step = Tensor::new(&[self.step as i64], &Device::Cpu).expect("a 1-element CPU tensor can always be built");
        out.push((format!("{}.step", self.prefix), step));
        out
    }

    /// Loads the state written by [`Adam::state_tensors`]. Every moment must be present with the
    /// parameter's shape (converted to its dtype and device); `{prefix}.step` must have shape `[1]`
    /// and hold a non-negative integer (any dtype). Tensors under other prefixes are ignored; an
    /// unknown tensor under this prefix is an error. Nothing is changed on error.
    ///
    /// # Errors
    ///
    /// Naming the tensor: missing, wrong shape, unexpected, or a bad step value.
    pub fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        let mut expected = HashSet::new();
        let mut ms = Vec::with_capacity(self.params.len());
        let mut vs = Vec::with_capacity(self.params.len());
        for (((name, _), m), v) in self.params.iter().zip(&self.exp_avg).zip(&self.exp_avg_sq) {
            let key_m = state_name(&self.prefix, name, "exp_avg");
            let key_v = state_name(&self.prefix, name, "exp_avg_sq");
            ms.push(take_state(tensors, &key_m, m)?);
            vs.push(take_state(tensors, &key_v, v)?);
            expected.insert(key_m);
            expected.insert(key_v);
        }
        let key_step = format!("{}.step", self.prefix);
        let step_tensor = tensors.get(&key_step).ok_or_else(|| anyhow::anyhow!("optimizer state tensor {key_step} is missing"))?;
        if step_tensor.dims() != [1] {
            anyhow::bail!("optimizer state tensor {key_step} has shape {:?}, expected [1]", step_tensor.dims());
        }
        let step_value = step_tensor.to_device(&Device::Cpu)?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
        if !(step_value.is_finite() && step_value >= 0.0 && step_value.fract() == 0.0) {
            anyhow::bail!("optimizer state tensor {key_step} holds {step_value}, not a non-negative integer");
        }
        expected.insert(key_step);
        reject_unexpected(tensors, &self.prefix, &expected)?;
        self.exp_avg = ms;
        self.exp_avg_sq = vs;
        self.step = step_value as u64;
        Ok(())
    }
}
