//! The 04-09 record's sigmoid-gated U-Net skip: at decoder position `j`, with `s` the encoder
//! output popped from the stack, per channel `c`:
//!
//! ```text
//! k = w[c] s            (w: the row skip_weights[j])
//! g = sigmoid(z[c])     (z: the row skip_gates[j]; 0.5 at init)
//! h' = g h + (1 - g) k  = k + g (h - k)
//! ```
//!
//! Composed from candle ops on every device (`exp`, `recip`, broadcast products), whose backward
//! passes give the gradients of `h`, `s`, `w` and `z`; the reference it is tested against is the
//! scalar formula. The engine's CPU backend runs the row kernels [`skip_rows_fwd`] and
//! [`skip_rows_bwd`], checked here against the composite.

#[cfg(feature = "candle")]
use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::model::host::rows::{ROWS, column_sums};
use crate::model::host::simd::Real;

/// `sigmoid(z) * h + (1 - sigmoid(z)) * (w * s)` for the `(N, C)` stream `h`, the encoder output
/// `s` `(N, C)` and the per-channel rows `w`, `z` `(C,)`.
#[cfg(feature = "candle")]
pub fn gated_skip(h: &Tensor, s: &Tensor, w: &Tensor, z: &Tensor) -> Result<Tensor> {
    let k = s.broadcast_mul(w)?;
    // sigmoid(z) = 1 / (1 + exp(-z)).
    let g = (z.neg()?.exp()? + 1.0)?.recip()?;
    k.broadcast_add(&(h - &k)?.broadcast_mul(&g)?)
}

/// `sigmoid(z)` as candle's composite computes it: `1 / (1 + exp(-z))`.
fn sigmoid<T: Real>(z: T) -> T {
    T::from_f64(1.0) / (T::from_f64(1.0) + (T::from_f64(0.0) - z).exp())
}

/// The skip on `w.len()`-wide rows (the engine's CPU kernel): `out = k + g (h - k)` with
/// `k = w s`, `g = sigmoid(z)`; without `z` the baseline's `out = h + k`.
pub(crate) fn skip_rows_fwd<T: Real>(h: &[T], s: &[T], w: &[T], z: Option<&[T]>, out: &mut [T]) {
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

/// The skip's gradients: `dh = g dy`, `ds = (1 - g) w dy` (written), `dw += sum_rows (1 - g) dy s`
/// and `dz += g (1 - g) sum_rows dy (h - k)` (per-channel sums in f64 over fixed row blocks,
/// added in order); without `z`, `g = 1` for `dh` and the skip's share is 1.
#[allow(clippy::too_many_arguments)]
pub(crate) fn skip_rows_bwd<T: Real>(
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

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;
    use crate::model::ops::testing::{flat, seeded};

    #[test]
    fn matches_the_formula_and_its_gradients() {
        let (n, c) = (6, 11);
        let h = Var::from_tensor(&seeded(&[n, c], 1)).unwrap();
        let s = Var::from_tensor(&seeded(&[n, c], 2)).unwrap();
        let w = Var::from_tensor(&seeded(&[c], 3)).unwrap();
        let z = Var::from_tensor(&seeded(&[c], 4)).unwrap();
        let y = gated_skip(h.as_tensor(), s.as_tensor(), w.as_tensor(), z.as_tensor()).unwrap();
        let up = seeded(&[n, c], 5);
        let grads = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (hv, sv, wv, zv, yv, uv) =
            (flat(h.as_tensor()), flat(s.as_tensor()), flat(w.as_tensor()), flat(z.as_tensor()), flat(&y), flat(&up));
        let (dh, ds) = (flat(grads.get(h.as_tensor()).unwrap()), flat(grads.get(s.as_tensor()).unwrap()));
        let (dw, dz) = (flat(grads.get(w.as_tensor()).unwrap()), flat(grads.get(z.as_tensor()).unwrap()));
        let (mut want_dw, mut want_dz) = (vec![0.0; c], vec![0.0; c]);
        for r in 0..n {
            for ch in 0..c {
                let i = r * c + ch;
                let g = 1.0 / (1.0 + (-zv[ch]).exp());
                let k = wv[ch] * sv[i];
                let want = g * hv[i] + (1.0 - g) * k;
                assert!((yv[i] - want).abs() < 1e-12, "y[{i}]: {} vs {want}", yv[i]);
                assert!((dh[i] - g * uv[i]).abs() < 1e-12, "dh[{i}]");
                assert!((ds[i] - (1.0 - g) * wv[ch] * uv[i]).abs() < 1e-12, "ds[{i}]");
                want_dw[ch] += (1.0 - g) * sv[i] * uv[i];
                want_dz[ch] += g * (1.0 - g) * (hv[i] - k) * uv[i];
            }
        }
        for ch in 0..c {
            assert!((dw[ch] - want_dw[ch]).abs() < 1e-10, "dw[{ch}]: {} vs {}", dw[ch], want_dw[ch]);
            assert!((dz[ch] - want_dz[ch]).abs() < 1e-10, "dz[{ch}]: {} vs {}", dz[ch], want_dz[ch]);
        }
    }

    #[test]
    fn at_init_the_gate_is_the_mean_of_stream_and_skip() {
        let (h, s) = (seeded(&[3, 4], 6), seeded(&[3, 4], 7));
        let ones = Tensor::ones(4, h.dtype(), h.device()).unwrap();
        let zeros = Tensor::zeros(4, h.dtype(), h.device()).unwrap();
        let y = flat(&gated_skip(&h, &s, &ones, &zeros).unwrap());
        for ((y, h), s) in y.iter().zip(flat(&h)).zip(flat(&s)) {
            assert!((y - 0.5 * (h + s)).abs() < 1e-15);
        }
    }

    /// The engine's row kernels give the composite's output and gradients (f64), gated and not.
    #[test]
    fn row_kernels_match_the_composite() {
        let (n, c) = (70, 9);
        for gated in [true, false] {
            let h = Var::from_tensor(&seeded(&[n, c], 11)).unwrap();
            let s = Var::from_tensor(&seeded(&[n, c], 12)).unwrap();
            let w = Var::from_tensor(&seeded(&[c], 13)).unwrap();
            let z = Var::from_tensor(&seeded(&[c], 14)).unwrap();
            let y = if gated {
                gated_skip(h.as_tensor(), s.as_tensor(), w.as_tensor(), z.as_tensor()).unwrap()
            } else {
                (h.as_tensor() + s.as_tensor().broadcast_mul(w.as_tensor()).unwrap()).unwrap()
            };
            let up = seeded(&[n, c], 15);
            let grads = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let (hv, sv, wv, zv, uv) = (flat(h.as_tensor()), flat(s.as_tensor()), flat(w.as_tensor()), flat(z.as_tensor()), flat(&up));
            let mut out = vec![0.0; n * c];
            skip_rows_fwd(&hv, &sv, &wv, gated.then_some(zv.as_slice()), &mut out);
            let (mut dh, mut ds, mut dw, mut dz) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
            skip_rows_bwd(&uv, &hv, &sv, &wv, gated.then_some((zv.as_slice(), dz.as_mut_slice())), &mut dh, &mut ds, &mut dw);
            let close = |a: &[f64], b: &[f64], what: &str| {
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() < 1e-12, "gated {gated}: {what}: {x} vs {y}");
                }
            };
            close(&out, &flat(&y), "y");
            close(&dh, &flat(grads.get(h.as_tensor()).unwrap()), "dh");
            close(&ds, &flat(grads.get(s.as_tensor()).unwrap()), "ds");
            close(&dw, &flat(grads.get(w.as_tensor()).unwrap()), "dw");
            if gated {
                close(&dz, &flat(grads.get(z.as_tensor()).unwrap()), "dz");
            }
        }
    }
}
