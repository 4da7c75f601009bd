//! SGD with momentum: what score-first test-time training updates the model with.

#[cfg(feature = "candle")]
use std::collections::{HashMap, HashSet};

#[cfg(feature = "candle")]
use candle_core::backprop::GradStore;
#[cfg(feature = "candle")]
use candle_core::{Result, Tensor, Var, bail};

#[cfg(feature = "candle")]
use super::state::{reject_unexpected, state_name, take_state};

/// `torch.optim.SGD` with momentum, no dampening, no Nesterov and no weight decay: the optimizer
/// of score-first test-time training (spec §4.7, `TTT_MOMENTUM = 0.9`).
///
/// For every parameter with gradient `g`, at learning rate `lr` and momentum `μ`:
///
/// ```text
/// buf ← g                 (first step of this parameter: torch clones the gradient)
/// buf ← μ·buf + g         (later steps)
/// p   ← p − lr·buf        (with μ = 0 no buffer is kept: p ← p − lr·g)
/// ```
///
/// The buffers live as long as the optimizer, so one `Sgd` created once carries its momentum
/// from step to step (across TTT chunks). Computed in the parameter's dtype.
#[derive(Debug)]
#[cfg(feature = "candle")]
pub struct Sgd {
    params: Vec<(String, Var)>,
    /// `None` until the parameter's first step (torch creates the buffer lazily).
    buffers: Vec<Option<Tensor>>,
    momentum: f64,
    prefix: String,
}

#[cfg(feature = "candle")]
impl Sgd {
    /// Builds the optimizer over named parameters of any shape with momentum `μ` (the record:
    /// 0.9). The state prefix is `sgd`.
    ///
    /// # Errors
    ///
    /// When two parameters share a name, or `momentum` is not a finite number `≥ 0`.
    pub fn new(params: Vec<(String, Var)>, momentum: f64) -> Result<Self> {
        if !(momentum.is_finite() && momentum >= 0.0) {
            bail!("SGD momentum must be a finite number >= 0, got {momentum}");
        }
        let mut seen = HashSet::new();
        for (name, _) in &params {
            if !seen.insert(name.as_str()) {
                bail!("SGD parameter name {name} appears twice");
            }
        }
        let buffers = vec![None; params.len()];
        Ok(Self { params, buffers, momentum, prefix: "sgd".to_string() })
    }

    /// Replaces the state-name prefix (default `sgd`).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The named parameters, in construction order.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The momentum `μ`.
    pub fn momentum(&self) -> f64 {
        self.momentum
    }

    /// One step at learning rate `lr`: `buf ← μ·buf + g` (`buf ← g` at a parameter's first step),
    /// `p ← p − lr·buf`.
    ///
    /// A parameter whose gradient is missing from `grads` is skipped: neither it nor its buffer
    /// changes, as torch skips `p.grad is None`.
    ///
    /// # Errors
    ///
    /// On a candle error (for instance a gradient whose shape differs from its parameter's).
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        for ((name, var), buf) in self.params.iter().zip(self.buffers.iter_mut()) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            if g.dims() != var.dims() {
                bail!("SGD: gradient of {name} has shape {:?}, parameter has {:?}", g.dims(), var.dims());
            }
            let g = g.detach().to_dtype(var.dtype())?;
            let direction = if self.momentum == 0.0 {
                g
            } else {
                let new_buf = match buf.take() {
                    Some(b) => (b.affine(self.momentum, 0.0)? + &g)?,
                    None => g,
                };
                *buf = Some(new_buf.clone());
                new_buf
            };
            var.set(&(var.as_detached_tensor() - direction.affine(lr, 0.0)?)?)?;
        }
        Ok(())
    }

    /// The optimizer state as named tensors: `{prefix}.{param}.momentum_buffer` for every
    /// parameter that has a buffer (as torch's state holds none before a parameter's first step).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .zip(&self.buffers)
            .filter_map(|((name, _), buf)| buf.as_ref().map(|b| (state_name(&self.prefix, name, "momentum_buffer"), b.clone())))
            .collect()
    }

    /// Loads the state written by [`Sgd::state_tensors`]. A missing buffer means the parameter
    /// has not been stepped yet (its buffer starts from the next gradient); a present one must
    /// have the parameter's shape and is converted to its dtype and device. Tensors under other
    /// prefixes are ignored; an unknown tensor under this prefix is an error. Nothing is changed
    /// on error.
    ///
    /// # Errors
    ///
    /// Naming the tensor: wrong shape or unexpected.
    pub fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        let mut expected = HashSet::new();
        let mut loaded = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            let key = state_name(&self.prefix, name, "momentum_buffer");
            loaded.push(if tensors.contains_key(&key) { Some(take_state(tensors, &key, var.as_tensor())?) } else { None });
            expected.insert(key);
        }
        reject_unexpected(tensors, &self.prefix, &expected)?;
        self.buffers = loaded;
        Ok(())
    }
}
