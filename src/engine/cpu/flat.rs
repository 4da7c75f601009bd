//! The engine's flat loops on the CPU: fills, scales and reductions over arena regions, and the
//! optimizers' elementwise updates (Adam/AdamW, Muon's momentum and row normalisation, the
//! Newton-Schulz helpers), each the formula of the candle optimizer it replaces
//! ([`crate::optim`]) as one pass over a region.

use rayon::prelude::*;

use crate::engine::backend::AdamStep;
use crate::model::host::simd::{Real, dot_f64, multiversion, sum_f64};

/// Elements per rayon task.
const CHUNK: usize = 1 << 15;

pub(super) fn fill<T: Real>(d: &mut [T], v: T) {
    d.par_chunks_mut(CHUNK).for_each(|c| c.fill(v));
}

pub(super) fn scale<T: Real>(d: &mut [T], a: T) {
    d.par_chunks_mut(CHUNK).for_each(|c| c.iter_mut().for_each(|x| *x *= a));
}

pub(super) fn sum<T: Real>(s: &[T]) -> f64 {
    s.chunks(CHUNK).map(sum_f64).sum()
}

pub(super) fn sum_sq<T: Real>(s: &[T]) -> f64 {
    s.chunks(CHUNK).map(|c| dot_f64(c, c)).sum()
}

/// `torch.optim.Adam(W)`: `p *= 1 - lr wd`; `m = b1 m + (1 - b1) g`; `v = b2 v + (1 - b2) g^2`;
/// `p -= (lr / bias1) m / (sqrt(v) / bias2_sqrt + eps)`.
#[inline(always)]
fn adam_kernel<T: Real>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], s: AdamStep) {
    let (b1, b2) = (T::from_f64(s.beta1), T::from_f64(s.beta2));
    let (c1, c2) = (T::from_f64(1.0 - s.beta1), T::from_f64(1.0 - s.beta2));
    let (inv_b2, eps, step) = (T::from_f64(1.0 / s.bias2_sqrt), T::from_f64(s.eps), T::from_f64(s.lr / s.bias1));
    let decay = T::from_f64(1.0 - s.lr * s.weight_decay);
    let decays = s.weight_decay != 0.0;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *m = b1 * *m + c1 * g;
        *v = b2 * *v + c2 * (g * g);
        let denom = v.sqrt() * inv_b2 + eps;
        let q = if decays { *p * decay } else { *p };
        *p = q - *m / denom * step;
    }
}

multiversion! {
    fn adam_block = adam_kernel(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], s: AdamStep);
}

pub(super) fn adam<T: Real>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], s: AdamStep) {
    p.par_chunks_mut(CHUNK).zip(m.par_chunks_mut(CHUNK)).zip(v.par_chunks_mut(CHUNK)).enumerate().for_each(|(i, ((p, m), v))| {
        adam_block(p, &g[i * CHUNK..i * CHUNK + p.len()], m, v, s);
    });
}

pub(super) fn momentum<T: Real>(g: &[T], buf: &mut [T], u: &mut [T], mu: T, nesterov: bool) {
    buf.par_chunks_mut(CHUNK).zip(u.par_chunks_mut(CHUNK)).enumerate().for_each(|(i, (b, u))| {
        for ((b, u), &g) in b.iter_mut().zip(u.iter_mut()).zip(&g[i * CHUNK..]) {
            *b = *b * mu + g;
            *u = if nesterov { g + *b * mu } else { *b };
        }
    });
}

pub(super) fn axpby<T: Real>(a: T, x: &[T], b: T, y: &mut [T]) {
    y.par_chunks_mut(CHUNK).enumerate().for_each(|(i, y)| {
        for (y, &x) in y.iter_mut().zip(&x[i * CHUNK..]) {
            *y = a * x + b * *y;
        }
    });
}

pub(super) fn row_normalize<T: Real>(x: &mut [T], cols: usize, eps: f64) {
    x.par_chunks_mut(cols).for_each(|r| {
        let inv = T::from_f64(1.0 / dot_f64(r, r).sqrt().max(eps));
        r.iter_mut().for_each(|x| *x *= inv);
    });
}

pub(super) fn normalize_each<T: Real>(x: &mut [T], count: usize, eps: f64) {
    let len = x.len() / count.max(1);
    x.par_chunks_mut(len.max(1)).for_each(|m| {
        let inv = T::from_f64(1.0 / (sum_sq(m).sqrt() + eps));
        m.iter_mut().for_each(|x| *x *= inv);
    });
}

pub(super) fn transpose_each<T: Real>(src: &[T], dst: &mut [T], count: usize, rows: usize, cols: usize) {
    let len = rows * cols;
    dst.par_chunks_mut(len).zip(src.par_chunks(len)).take(count).for_each(|(d, s)| {
        for r in 0..rows {
            for c in 0..cols {
                d[c * rows + r] = s[r * cols + c];
            }
        }
    });
}
