//! The optimizers as flat loops over the arena: Muon with Newton-Schulz batched per shape, and
//! Adam/AdamW per group, each the update of its candle twin in [`crate::optim`] (the formulas
//! are there), reading the gradient region and updating the parameter and state regions in
//! place. (Test-time training's SGD and the EMA of the weights run on the candle model, after
//! training: the engine has no ops for them.)

use std::collections::HashMap;
use std::time::Duration;

use super::backend::{AdamStep, Backend, Buf};
use super::layout::Layout;
use crate::dist::Collective;
use crate::engine::backend::BackendExt;
use crate::engine::op;
use crate::model::ParamGroup;
use crate::optim::{NS5_EPS, NewtonSchulz, ROW_NORM_EPS};

/// Muon's settings for one step.
#[derive(Clone, Copy, Debug)]
pub struct MuonStep {
    /// Learning rate (schedule applied).
    pub lr: f64,
    /// Momentum.
    pub momentum: f64,
    /// Nesterov momentum (the record: on).
    pub nesterov: bool,
    /// Newton-Schulz iterations.
    pub backend_steps: usize,
    /// Each iteration's coefficients.
    pub ns: NewtonSchulz,
    /// MuonEq-R row normalisation.
    pub row_norm: bool,
    /// Decoupled weight decay (0: none).
    pub weight_decay: f64,
}

/// One Muon step over every matrix: per shape, the updates `U` stacked, normalised, run
/// through the Newton-Schulz iteration (`s.ns`'s coefficients) as one batch, scaled by `sqrt(max(1, rows /
/// cols))` and subtracted.
///
/// Sharded over `ranks` (the records' sharded Muon): every rank updates every momentum buffer
/// (the gradients are the ranks' mean already), but orthogonalises only the matrices it owns
/// (matrix `i`, in `state_dict` order among the matrices, belongs to rank `i mod W`); then each
/// `O` is broadcast from its owner ([`super::exchange::broadcast_regions`]: one group of NCCL
/// broadcasts on a GPU, an all-gather whose pieces need not be contiguous), so every rank has
/// every `O`, one rank's bits. Each rank receives `(W-1)/W` of the updates, as an all-gather
/// does. Returns the host collectives' wall time (zero on one rank and on a GPU).
pub fn muon(be: &mut dyn Backend, l: &Layout, s: MuonStep, ranks: Option<&dyn Collective>) -> anyhow::Result<Duration> {
    let (rank, world) = ranks.map_or((0, 1), |c| (c.rank(), c.world()));
    let matrix_index: HashMap<usize, usize> =
        l.slots.iter().enumerate().filter(|(_, s)| s.group == ParamGroup::Matrix).enumerate().map(|(k, (i, _))| (i, k)).collect();
    for g in &l.muon {
        let (k, (r, cols)) = (g.members.len(), g.shape);
        let len = r * cols;
        let owned: Vec<bool> = g.members.iter().map(|m| matrix_index[m] % world == rank).collect();
        // buf = mu buf + G; U = G + mu buf (Nesterov) or buf.
        for (j, &m) in g.members.iter().enumerate() {
            let slot = &l.slots[m];
            be.op(op::Momentum { g: slot.grad, buf: slot.state0, u: g.u.sub(j * len, len), mu: s.momentum, nesterov: s.nesterov });
        }
        if !owned.iter().any(|&o| o) {
            // None of this shape is this rank's: the others send every O.
            continue;
        }
        if s.row_norm {
            be.op(op::RowNormalize { x: g.u, cols, eps: ROW_NORM_EPS });
        }
        // X = U / (|U|_F + eps), transposed when tall so that X X^T is the small Gram matrix.
        be.op(op::NormalizeEach { x: g.u, count: k, eps: NS5_EPS });
        let tall = r > cols;
        if tall {
            be.op(op::TransposeEach { src: g.u, dst: g.x, count: k, rows: r, cols });
        } else {
            be.op(op::CopyBuf { dst: g.x, src: g.u });
        }
        let (m, n) = if tall { (cols, r) } else { (r, cols) };
        let (mut x, mut x2) = (g.x, g.x2);
        for i in 0..s.backend_steps {
            let (a, b, c) = s.ns.at(i);
            for j in (0..k).filter(|&j| owned[j]) {
                let xj = x.sub(j * len, len).mat(m, n);
                let (aj, bj) = (g.a.sub(j * m * m, m * m).mat(m, m), g.b.sub(j * m * m, m * m).mat(m, m));
                // A = X X^T; B = A A (then b A + c B); X' = a X + B X.
                be.op(op::Gemm { c: aj, a: xj, b: xj.t(), alpha: 1.0, beta: 0.0 });
                be.op(op::Gemm { c: bj, a: aj, b: aj, alpha: 1.0, beta: 0.0 });
            }
            be.op(op::Axpby { a: b, x: g.a, b: c, y: g.b });
            for j in (0..k).filter(|&j| owned[j]) {
                let bj = g.b.sub(j * m * m, m * m).mat(m, m);
                be.op(op::Gemm { c: x2.sub(j * len, len).mat(m, n), a: bj, b: x.sub(j * len, len).mat(m, n), alpha: 1.0, beta: 0.0 });
            }
            be.op(op::Axpby { a, x, b: 1.0, y: x2 });
            std::mem::swap(&mut x, &mut x2);
        }
        // O back in the stored shape, in U.
        if tall {
            be.op(op::TransposeEach { src: x, dst: g.u, count: k, rows: m, cols: n });
        } else {
            be.op(op::CopyBuf { dst: g.u, src: x });
        }
        // Another rank's matrices: what this rank computed for them is not O; their owners'
        // broadcasts overwrite it.
    }
    let mut comm = Duration::ZERO;
    if let Some(c) = ranks.filter(|c| !c.is_identity()) {
        let pieces: Vec<(Buf, usize)> = l
            .muon
            .iter()
            .flat_map(|g| {
                let len = g.shape.0 * g.shape.1;
                g.members.iter().enumerate().map(move |(j, m)| (g.u.sub(j * len, len), m))
            })
            .map(|(b, m)| (b, matrix_index[m] % world))
            .collect();
        comm = super::exchange::broadcast_regions(be, &pieces, c).map_err(|e| e.context("sharded Muon's exchange of updates"))?;
    }
    for g in &l.muon {
        let (r, cols) = g.shape;
        let len = r * cols;
        let scale = (r as f64 / cols as f64).max(1.0).sqrt();
        for (j, &mi) in g.members.iter().enumerate() {
            // P = P (1 - lr wd) - lr scale O.
            be.op(op::Axpby { a: -s.lr * scale, x: g.u.sub(j * len, len), b: 1.0 - s.lr * s.weight_decay, y: l.slots[mi].value });
        }
    }
    Ok(comm)
}

/// One Adam step of the parameters in `group`, the `t`-th (counted from 1).
#[allow(clippy::too_many_arguments)]
pub fn adam(be: &mut dyn Backend, l: &Layout, group: ParamGroup, t: u64, lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) {
    let t = t as f64;
    let s = AdamStep {
        lr,
        beta1: betas.0,
        beta2: betas.1,
        eps,
        weight_decay,
        bias1: 1.0 - betas.0.powf(t),
        bias2_sqrt: (1.0 - betas.1.powf(t)).sqrt(),
    };
    for slot in l.slots.iter().filter(|s| s.group == group) {
        be.op(op::Adam { p: slot.value, g: slot.grad, m: slot.state0, v: slot.state1, s });
    }
}
