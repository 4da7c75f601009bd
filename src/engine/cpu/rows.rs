//! The engine's row ops on the CPU that the model has no kernel for (it composes them from
//! candle ops): the sigmoid-gated skip ([`crate::model::ops::skip_gate`]), XSA
//! ([`crate::model::ops::xsa`]) and the embedding lookup and its gradient. Each a loop over
//! `cols`-wide rows, [`ROWS`] rows per rayon task, the per-channel sums of a backward pass summed
//! in f64 per task and the tasks' sums added in task order (so a gradient does not depend on the
//! thread schedule). The ops the model runs fused kernels for are those kernels, in
//! [`crate::model::ops`].

use rayon::prelude::*;

use crate::engine::backend::AttnShape;
use crate::model::cpu::rows::{ROWS, split_rows};
use crate::model::cpu::simd::{Real, dot_f64};

/// Per-channel f64 sums over row blocks, added in block order into `acc` (`+=`).
fn column_sums<T: Real>(rows: usize, cols: usize, acc: &mut [T], per_row: impl Fn(usize, &mut [f64]) + Sync) {
    let parts: Vec<Vec<f64>> = (0..rows.div_ceil(ROWS))
        .into_par_iter()
        .map(|blk| {
            let mut s = vec![0.0; cols];
            for r in blk * ROWS..((blk + 1) * ROWS).min(rows) {
                per_row(r, &mut s);
            }
            s
        })
        .collect();
    let mut total = vec![0.0f64; cols];
    for p in parts {
        for (t, x) in total.iter_mut().zip(p) {
            *t += x;
        }
    }
    for (a, t) in acc.iter_mut().zip(total) {
        *a += T::from_f64(t);
    }
}

pub(super) fn embedding_fwd<T: Real>(table: &[T], ids: &[u32], out: &mut [T], dim: usize) {
    out.par_chunks_mut(dim).zip(ids.par_iter()).for_each(|(o, &id)| {
        let id = id as usize;
        o.copy_from_slice(&table[id * dim..(id + 1) * dim]);
    });
}

pub(super) fn embedding_bwd<T: Real>(dout: &[T], ids: &[u32], dtable: &mut [T], dim: usize) {
    // Rows of the table split among tasks, each scanning every id: no two tasks write a row,
    // and each row's sum runs in token order.
    let per = (dtable.len() / dim).div_ceil(rayon::current_num_threads().max(1)).max(1);
    dtable.par_chunks_mut(per * dim).enumerate().for_each(|(c, block)| {
        let lo = c * per;
        for (n, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= lo && id < lo + block.len() / dim {
                for (d, &g) in block[(id - lo) * dim..(id - lo + 1) * dim].iter_mut().zip(&dout[n * dim..(n + 1) * dim]) {
                    *d += g;
                }
            }
        }
    });
}

/// `sigmoid(z)` as candle's composite computes it: `1 / (1 + exp(-z))`.
fn sigmoid<T: Real>(z: T) -> T {
    T::from_f64(1.0) / (T::from_f64(1.0) + (T::from_f64(0.0) - z).exp())
}

pub(super) fn skip_fwd<T: Real>(h: &[T], s: &[T], w: &[T], z: Option<&[T]>, out: &mut [T]) {
    let cols = w.len();
    let gate: Option<Vec<T>> = z.map(|z| z.iter().map(|&z| sigmoid(z)).collect());
    out.par_chunks_mut(ROWS * cols).enumerate().for_each(|(c, o)| {
        let base = c * ROWS * cols;
        for (i, o) in o.iter_mut().enumerate() {
            let (j, col) = (base + i, i % cols);
            let k = s[j] * w[col];
            *o = match &gate {
                Some(g) => k + (h[j] - k) * g[col],
                None => h[j] + k,
            };
        }
    });
}

#[allow(clippy::too_many_arguments)]
pub(super) fn skip_bwd<T: Real>(
    dy: &[T],
    h: &[T],
    s: &[T],
    w: &[T],
    z: Option<(&[T], &mut [T])>,
    dh: &mut [T],
    ds: &mut [T],
    dw: &mut [T],
) {
    let cols = w.len();
    let rows = dy.len() / cols;
    let one = T::from_f64(1.0);
    let gate: Option<Vec<T>> = z.as_ref().map(|(z, _)| z.iter().map(|&z| sigmoid(z)).collect());
    // The stream's and the skip's shares of the output's gradient: (g, 1 - g), or (1, 1).
    let shares = |col: usize| gate.as_ref().map_or((one, one), |g| (g[col], one - g[col]));
    dh.par_chunks_mut(ROWS * cols).zip(ds.par_chunks_mut(ROWS * cols)).enumerate().for_each(|(c, (dh, ds))| {
        let base = c * ROWS * cols;
        for (i, (a, b)) in dh.iter_mut().zip(ds.iter_mut()).enumerate() {
            let (j, col) = (base + i, i % cols);
            let (gh, gk) = shares(col);
            *a = dy[j] * gh;
            *b = dy[j] * gk * w[col];
        }
    });
    column_sums(rows, cols, dw, |r, acc| {
        for (col, a) in acc.iter_mut().enumerate() {
            let j = r * cols + col;
            *a += (dy[j] * shares(col).1).to_f64() * s[j].to_f64();
        }
    });
    if let (Some((_, dz)), Some(g)) = (z, &gate) {
        let mut raw = vec![T::from_f64(0.0); cols];
        column_sums(rows, cols, &mut raw, |r, acc| {
            for (col, a) in acc.iter_mut().enumerate() {
                let j = r * cols + col;
                *a += dy[j].to_f64() * (h[j] - s[j] * w[col]).to_f64();
            }
        });
        for ((d, r), &g) in dz.iter_mut().zip(raw).zip(g) {
            *d += r * g * (one - g);
        }
    }
}

/// The unit value vector of KV head `g` of row `n`, and its norm before the floor.
#[inline(always)]
fn unit_value<T: Real>(v: &[T], ld: usize, n: usize, g: usize, d: usize, unit: &mut [T]) -> f64 {
    let vr = &v[n * ld + g * d..][..d];
    let norm = dot_f64(vr, vr).sqrt();
    let inv = T::from_f64(1.0 / norm.max(1e-12));
    for (u, &x) in unit.iter_mut().zip(vr) {
        *u = x * inv;
    }
    norm
}

pub(super) fn xsa_fwd<T: Real>(y: &[T], (v, ld): (&[T], usize), out: &mut [T], s: AttnShape) {
    let (w, group) = (s.heads * s.d, s.heads / s.kv_heads);
    out.par_chunks_mut(w).enumerate().for_each(|(n, o)| {
        let mut unit = vec![T::from_f64(0.0); s.d];
        for g in 0..s.kv_heads {
            unit_value(v, ld, n, g, s.d, &mut unit);
            for h in g * group..(g + 1) * group {
                let yr = &y[n * w + h * s.d..][..s.d];
                let a = T::from_f64(dot_f64(yr, &unit));
                for ((o, &y), &u) in o[h * s.d..(h + 1) * s.d].iter_mut().zip(yr).zip(&unit) {
                    *o = y - a * u;
                }
            }
        }
    });
}

/// `out = y - (y . u) u`: `dy = g - (g . u) u`, `du = -((y . u) g + (g . u) y)` summed over the
/// group's heads, and `dv = (du - u (du . u)) / |v|` (`du / 1e-12` below the floor); `dv` written.
pub(super) fn xsa_bwd<T: Real>(dout: &[T], y: &[T], (v, ld): (&[T], usize), dy: &mut [T], (dv, ldv): (&mut [T], usize), s: AttnShape) {
    let (w, group, d) = (s.heads * s.d, s.heads / s.kv_heads, s.d);
    let kvw = s.kv_heads * d;
    let blocks = split_rows(dv, ldv, kvw, dout.len() / w);
    let dy_blocks: Vec<&mut [T]> = dy.chunks_mut(ROWS * w).collect();
    blocks.into_par_iter().zip(dy_blocks).for_each(|((r0, dvb), dyb)| {
        let mut unit = vec![T::from_f64(0.0); d];
        let mut du = vec![0.0f64; d];
        for r in 0..dyb.len() / w {
            let n = r0 + r;
            for g in 0..s.kv_heads {
                let norm = unit_value(v, ld, n, g, d, &mut unit);
                du.fill(0.0);
                for h in g * group..(g + 1) * group {
                    let (gr, yr) = (&dout[n * w + h * d..][..d], &y[n * w + h * d..][..d]);
                    let (a, b) = (dot_f64(yr, &unit), dot_f64(gr, &unit));
                    let bt = T::from_f64(b);
                    for ((o, &g), &u) in dyb[r * w + h * d..][..d].iter_mut().zip(gr).zip(&unit) {
                        *o = g - bt * u;
                    }
                    for ((du, &g), &y) in du.iter_mut().zip(gr).zip(yr) {
                        *du -= a * g.to_f64() + b * y.to_f64();
                    }
                }
                let out = &mut dvb[r * ldv + g * d..][..d];
                if norm > 1e-12 {
                    let along: f64 = du.iter().zip(&unit).map(|(a, u)| a * u.to_f64()).sum();
                    for ((o, &du), &u) in out.iter_mut().zip(&du).zip(&unit) {
                        *o = T::from_f64((du - u.to_f64() * along) / norm);
                    }
                } else {
                    for (o, &du) in out.iter_mut().zip(&du) {
                        *o = T::from_f64(du / 1e-12);
                    }
                }
            }
        }
    });
}
