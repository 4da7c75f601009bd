//! Muon (§3.6): momentum, Nesterov, NS5 orthogonalization, the tall-matrix scale; and the 04-09
//! record's MuonEq-R row normalisation and decoupled weight decay (§4.4), both off by default;
//! see the module doc of [`crate::optim`] for the update.

#[cfg(feature = "candle")]
use std::collections::{HashMap, HashSet};

#[cfg(feature = "candle")]
use candle_core::backprop::GradStore;
#[cfg(feature = "candle")]
use candle_core::{DType, Result, Tensor, Var, bail};

#[cfg(feature = "candle")]
use super::newton_schulz::{NewtonSchulz, newton_schulz5_stack};
#[cfg(feature = "candle")]
use super::state::{reject_unexpected, state_name, take_state};

/// Muon (§3.6) over a list of named 2-D parameters, Nesterov on by default.
///
/// One momentum buffer per parameter (zeros at the start, as torch's lazily created buffer would
/// be). The learning rate and momentum are passed to every [`Muon::step`]; the struct keeps the
/// group's base LR (for `lr = base_lr · lr_multiplier`) and the momentum last used.
#[derive(Debug)]
#[cfg(feature = "candle")]
pub struct Muon {
    params: Vec<(String, Var)>,
    buffers: Vec<Tensor>,
    base_lr: f64,
    momentum: f64,
    nesterov: bool,
    backend_steps: usize,
    /// Each Newton-Schulz iteration's coefficients.
    coeffs: NewtonSchulz,
    /// Newton-Schulz runs in this dtype when set (the record: bf16 on the GPU).
    ns_dtype: Option<DType>,
    /// MuonEq-R: each row of `U` divided by its L2 norm before Newton-Schulz.
    row_norm: bool,
    /// Decoupled weight decay: `P ← P·(1 − lr·wd)` before the update; 0: none.
    weight_decay: f64,
    prefix: String,
    /// Several ranks: each orthogonalises its share, the updates are summed over them.
    shard: Option<std::sync::Arc<dyn crate::dist::Collective>>,
    /// Wall time of the last step's update exchange (zero unsharded).
    last_comm: std::time::Duration,
}

/// The floor on a row's L2 norm in MuonEq-R ([`Muon::with_row_norm`]), as the record's
/// `clamp_min(1e-7)`: a zero row stays zero.
pub const ROW_NORM_EPS: f64 = 1e-7;

#[cfg(feature = "candle")]
impl Muon {
    /// Builds the optimizer: `base_lr` (the record: `MATRIX_LR = 0.04`), the initial `momentum`
    /// (overwritten by every step), `backend_steps` Newton–Schulz iterations (the record: 5).
    /// Nesterov is on; the state prefix is `muon`.
    ///
    /// # Errors
    ///
    /// When a parameter is not 2-D, or two parameters share a name.
    pub fn new(params: Vec<(String, Var)>, base_lr: f64, momentum: f64, backend_steps: usize) -> Result<Self> {
        let mut seen = HashSet::new();
        let mut buffers = Vec::with_capacity(params.len());
        for (name, var) in &params {
            if var.dims().len() != 2 {
                bail!("Muon parameter {name} must be 2-D, got shape {:?}", var.dims());
            }
            if !seen.insert(name.as_str()) {
                bail!("Muon parameter name {name} appears twice");
            }
            buffers.push(var.zeros_like()?.detach());
        }
        Ok(Self {
            params,
            buffers,
            base_lr,
            momentum,
            nesterov: true,
            backend_steps,
            coeffs: NewtonSchulz::Quintic,
            ns_dtype: None,
            row_norm: false,
            weight_decay: 0.0,
            prefix: "muon".to_string(),
            shard: None,
            last_comm: std::time::Duration::ZERO,
        })
    }

    /// Newton-Schulz coefficients per iteration (the 04-27 record: Polar Express; default the
    /// fixed quintic).
    pub fn with_coefficients(mut self, coeffs: NewtonSchulz) -> Self {
        self.coeffs = coeffs;
        self
    }

    /// MuonEq-R (the 04-09 record): when `on`, each row of `U = G + μ·buf` is divided by its L2
    /// norm (computed in f32, or f64 for f64 parameters; floored at [`ROW_NORM_EPS`]) before
    /// Newton-Schulz. Off by default (the baseline).
    pub fn with_row_norm(mut self, on: bool) -> Self {
        self.row_norm = on;
        self
    }

    /// Decoupled weight decay `wd` (the 04-09 record: 0.095): every step first scales every
    /// parameter of the group by `1 − lr·wd` at that step's `lr`, then subtracts `lr·O`. 0 (the
    /// default) skips the multiplication altogether.
    pub fn with_weight_decay(mut self, wd: f64) -> Self {
        self.weight_decay = wd;
        self
    }

    /// Runs the Newton-Schulz iteration in `dtype` (the record casts to bf16 first on the GPU);
    /// the update is cast back to each parameter's dtype.
    pub fn with_ns_dtype(mut self, dtype: DType) -> Self {
        self.ns_dtype = Some(dtype);
        self
    }

    /// Shards the orthogonalisation over the ranks of `ranks` (the records' distributed Muon):
    /// parameter `i` is orthogonalised by rank `i mod W`, and one all-reduce (sum) of the
    /// updates gives every rank all of them. Momentum buffers stay whole on every rank (their
    /// gradients are the averaged ones), so every rank's state is the same.
    pub fn set_shard(&mut self, ranks: std::sync::Arc<dyn crate::dist::Collective>) {
        self.shard = Some(ranks);
    }

    /// Wall time of the last step's update exchange between ranks (zero unsharded).
    pub fn last_comm(&self) -> std::time::Duration {
        self.last_comm
    }

    /// Replaces the state-name prefix (default `muon`).
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Turns Nesterov momentum on (the record) or off (`U = buf`).
    pub fn set_nesterov(&mut self, nesterov: bool) {
        self.nesterov = nesterov;
    }

    /// The named parameters, in construction order.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// The group's base learning rate.
    pub fn base_lr(&self) -> f64 {
        self.base_lr
    }

    /// The momentum last used (the constructor's value before the first step).
    pub fn momentum(&self) -> f64 {
        self.momentum
    }

    /// Whether Nesterov momentum is on.
    pub fn nesterov(&self) -> bool {
        self.nesterov
    }

    /// The number of Newton–Schulz iterations per step.
    pub fn backend_steps(&self) -> usize {
        self.backend_steps
    }

    /// Whether MuonEq-R row normalisation is on.
    pub fn row_norm(&self) -> bool {
        self.row_norm
    }

    /// The decoupled weight decay (0: none).
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay
    }

    /// One Muon step at learning rate `lr` (already multiplied by the schedule) and momentum
    /// `momentum` (see [`momentum_at`]): `buf ← μ·buf + G; U = G + μ·buf`; with row
    /// normalisation `U ← U / max(‖row‖, 1e-7)` row by row; `O = NS5(U);
    /// O ← O·sqrt(max(1, rows/cols))`; with weight decay `P ← P·(1 − lr·wd)`; `P ← P − lr·O`.
    ///
    /// A parameter whose gradient is missing from `grads` (it did not take part in the loss) gets
    /// no update and keeps its momentum buffer, as torch skips `p.grad is None`; with weight
    /// decay it still decays, as the record's Muon decays every parameter of its group.
    ///
    /// # Errors
    ///
    /// On a candle error (for instance a gradient whose shape differs from its parameter's).
    pub fn step(&mut self, grads: &GradStore, lr: f64, momentum: f64) -> Result<()> {
        self.momentum = momentum;
        // Momentum and Nesterov per parameter; then the orthogonalization and the update per
        // group of same-shaped parameters, as one stack (far fewer, larger candle ops).
        // (shape, [(parameter index, U, new momentum buffer)]).
        type Group = (Vec<usize>, Vec<(usize, Tensor, Tensor)>);
        let mut groups: Vec<Group> = Vec::new();
        let mut stepped = vec![false; self.params.len()];
        for (i, ((name, var), buf)) in self.params.iter().zip(&self.buffers).enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            if g.dims() != var.dims() {
                bail!("Muon: gradient of {name} has shape {:?}, parameter has {:?}", g.dims(), var.dims());
            }
            let g = g.detach().to_dtype(var.dtype())?;
            let new_buf = (buf.affine(momentum, 0.0)? + &g)?;
            let u = if self.nesterov { (&g + new_buf.affine(momentum, 0.0)?)? } else { new_buf.clone() };
            match groups.iter_mut().find(|(dims, _)| dims == var.dims()) {
                Some((_, members)) => members.push((i, u, new_buf)),
                None => groups.push((var.dims().to_vec(), vec![(i, u, new_buf)])),
            }
        }
        // Sharded (several ranks): parameter `i` is orthogonalised by rank `i mod W` only; the
        // others hold zeros in its place, and one sum over the ranks gives every rank every
        // update (adding zeros is exact, so the result is the unsharded one bit for bit).
        let (rank, world) = self.shard.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
        let mut planned = Vec::with_capacity(groups.len());
        for (dims, members) in groups {
            let owned: Vec<usize> = (0..members.len()).filter(|&j| members[j].0 % world == rank).collect();
            let scale = (dims[0] as f64 / dims[1] as f64).max(1.0).sqrt();
            let mine = if owned.is_empty() {
                None
            } else {
                let us: Vec<&Tensor> = owned.iter().map(|&j| &members[j].1).collect();
                let mut stack = Tensor::stack(&us, 0)?;
                if self.row_norm {
                    stack = row_normalize(&stack)?;
                }
                let o = match self.ns_dtype {
                    Some(d) if d != stack.dtype() => {
                        newton_schulz5_stack(&stack.to_dtype(d)?, self.backend_steps, self.coeffs)?.to_dtype(stack.dtype())?
                    }
                    _ => newton_schulz5_stack(&stack, self.backend_steps, self.coeffs)?,
                };
                Some(o.affine(scale, 0.0)?.affine(lr, 0.0)?)
            };
            let step = match mine {
                Some(m) if owned.len() == members.len() => m,
                mine => {
                    let zeros = members[0].1.zeros_like()?;
                    let rows: Vec<Tensor> = (0..members.len())
                        .map(|j| match (&mine, owned.iter().position(|&o| o == j)) {
                            (Some(m), Some(k)) => m.get(k),
                            _ => Ok(zeros.clone()),
                        })
                        .collect::<Result<_>>()?;
                    Tensor::stack(&rows, 0)?
                }
            };
            planned.push((members, step));
        }
        if let Some(c) = self.shard.as_ref().filter(|c| !c.is_identity()) {
            let steps: Vec<Tensor> = planned.iter().map(|(_, s)| s.clone()).collect();
            let (summed, stats) = crate::dist::bucket::all_reduce_tensors(c.as_ref(), &steps, crate::dist::ReduceOp::Sum, usize::MAX)
                .map_err(|e| candle_core::Error::Msg(format!("sharded Muon: {e:#}")))?;
            self.last_comm = stats.comm;
            for ((_, s), r) in planned.iter_mut().zip(summed) {
                *s = r;
            }
        }
        for (members, step) in planned {
            for (j, (i, _, new_buf)) in members.into_iter().enumerate() {
                let var = &self.params[i].1;
                var.set(&(self.decayed(var, lr)? - step.get(j)?)?)?;
                self.buffers[i] = new_buf;
                stepped[i] = true;
            }
        }
        if self.weight_decay != 0.0 {
            for (var, _) in self.params.iter().map(|(_, v)| v).zip(&stepped).filter(|(_, s)| !**s) {
                var.set(&self.decayed(var, lr)?)?;
            }
        }
        Ok(())
    }

    /// `P·(1 − lr·wd)`, or `P` itself without weight decay (no op, so the baseline's update is
    /// unchanged bit for bit).
    fn decayed(&self, var: &Var, lr: f64) -> Result<Tensor> {
        let p = var.as_detached_tensor();
        if self.weight_decay == 0.0 { Ok(p) } else { p.affine(1.0 - lr * self.weight_decay, 0.0) }
    }

    /// The optimizer state as named tensors: `{prefix}.{param}.momentum_buffer` per parameter
    /// (row normalisation and weight decay keep no state).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .zip(&self.buffers)
            .map(|((name, _), buf)| (state_name(&self.prefix, name, "momentum_buffer"), buf.clone()))
            .collect()
    }

    /// Loads the state written by [`Muon::state_tensors`]. Every buffer must be present with the
    /// parameter's shape; tensors are converted to the parameter's dtype and device. Tensors under
    /// other prefixes are ignored; an unknown tensor under this prefix is an error. Nothing is
    /// changed on error.
    ///
    /// # Errors
    ///
    /// Naming the tensor: missing, wrong shape, or unexpected.
    pub fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        let mut expected = HashSet::new();
        let mut loaded = Vec::with_capacity(self.buffers.len());
        for ((name, _), buf) in self.params.iter().zip(&self.buffers) {
            let key = state_name(&self.prefix, name, "momentum_buffer");
            loaded.push(take_state(tensors, &key, buf)?);
            expected.insert(key);
        }
        reject_unexpected(tensors, &self.prefix, &expected)?;
        self.buffers = loaded;
        Ok(())
    }
}

/// MuonEq-R on a `(K, rows, cols)` stack: each row divided by its L2 norm floored at
/// [`ROW_NORM_EPS`], computed in f32 (f64 stays f64), the result in the stack's dtype.
#[cfg(feature = "candle")]
fn row_normalize(u: &Tensor) -> Result<Tensor> {
    let wide = if matches!(u.dtype(), DType::F32 | DType::F64) { u.clone() } else { u.to_dtype(DType::F32)? };
    let norm = wide.sqr()?.sum_keepdim(2)?.sqrt()?.maximum(ROW_NORM_EPS)?;
    wide.broadcast_div(&norm)?.to_dtype(u.dtype())
}
