//! The 04-27 record's SmearGate: each token's embedding takes in a gated share of the previous
//! token's, before the embedding's norm. For row positions `t >= 1`, with `e` the embedding
//! rows, `w` the gate `(1, W)` and `lambda` its gain `(1,)`:
//!
//! ```text
//! g_t  = lambda * sigmoid(w . e_t[:W])          (W = model.smear_gate_window)
//! e'_t = e_t + g_t * e_{t-1} * [x_t != bos]     (the BOS fix: no smear onto a document's start)
//! e'_0 = e_0
//! ```
//!
//! `w` and `lambda` start at zero, so `e' = e` at init. Without the BOS fix, a packed row's
//! next document would start from its predecessor's last token.
//!
//! Composed from candle ops on every device (the product, `exp`, `recip`, broadcasts), whose
//! backward passes give the gradients of `e`, `w` and `lambda`; the reference it is tested
//! against is the scalar formula. The engine's CPU backend runs the row kernels below
//! ([`smear_rows_fwd`], [`smear_rows_bwd`]), tested against the composite; its GPU kernels
//! (`eng_smear_*` in kernels/engine.cu) are checked against those.
//!
//! The backward pass, with `s_t = sigmoid(w . e_t[:W])`, `k_t = [x_t != bos]` (0 at a row's
//! first position) and `G` the output's gradient:
//!
//! ```text
//! dg_t     = G_t . e_{t-1}
//! dz_t     = dg_t lambda k_t s_t (1 - s_t)
//! de_t     = G_t + g_{t+1} G_{t+1} + [c < W] dz_t w
//! dw      += sum_t dz_t e_t[:W]
//! dlambda += sum_t dg_t k_t s_t
//! ```

#[cfg(feature = "candle")]
use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::model::host::rows::column_sums;
use crate::model::host::simd::Real;

/// SmearGate over the `(B*T, D)` embedding rows `e` of input ids `ids` `(B, T)` (u32): gate
/// `w` `(1, W)`, gain `lambda` `(1,)`, no smear onto tokens equal to `bos`.
#[cfg(feature = "candle")]
pub fn smear_gate(e: &Tensor, ids: &Tensor, w: &Tensor, lambda: &Tensor, bos: u32) -> Result<Tensor> {
    let (b, t) = ids.dims2()?;
    let d = e.dim(1)?;
    let win = w.dim(1)?;
    if t < 2 {
        return Ok(e.clone());
    }
    let e3 = e.reshape((b, t, d))?;
    let cur = e3.narrow(1, 1, t - 1)?;
    let prev = e3.narrow(1, 0, t - 1)?;
    // g = lambda * sigmoid(e_t[:W] . w), (B, T-1, 1).
    let z = cur.narrow(2, 0, win)?.broadcast_mul(&w.reshape((1, 1, win))?)?.sum_keepdim(2)?;
    let g = (z.neg()?.exp()? + 1.0)?.recip()?.broadcast_mul(&lambda.reshape((1, 1, 1))?)?;
    // 1 where the current token is not BOS.
    let keep = ids.narrow(1, 1, t - 1)?.ne(bos)?.to_dtype(e.dtype())?.unsqueeze(2)?;
    let smeared = (&cur + prev.broadcast_mul(&(g * keep)?)?)?;
    Tensor::cat(&[&e3.narrow(1, 0, 1)?, &smeared], 1)?.reshape((b * t, d))
}

/// The geometry of the row kernels: `cols`-wide rows, sequences of `t`, no smear onto `bos`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SmearRows {
    /// Row width (the model's).
    pub(crate) cols: usize,
    /// Positions per sequence.
    pub(crate) t: usize,
    /// The BOS id.
    pub(crate) bos: u32,
}

/// `(g_r, s_r)` of row `r`: the gate (0 at a sequence's start and at a BOS) and its sigmoid.
fn gate_of<T: Real>(e: &[T], ids: &[u32], w: &[T], lambda: T, r: usize, g: SmearRows) -> (T, T) {
    let zero = T::from_f64(0.0);
    if r.is_multiple_of(g.t) || ids[r] == g.bos {
        return (zero, zero);
    }
    let row = &e[r * g.cols..];
    let z = w.iter().zip(row).fold(zero, |a, (&w, &x)| a + w * x);
    let s = T::from_f64(1.0) / (T::from_f64(1.0) + (zero - z).exp());
    (lambda * s, s)
}

/// [`smear_gate`] on the engine's rows: `out_r = e_r + g_r e_{r-1}` for the `rows x cols`
/// embedding rows `e` of input ids `ids`, gate `w` (`W` values), gain `lambda`.
pub(crate) fn smear_rows_fwd<T: Real>(e: &[T], ids: &[u32], w: &[T], lambda: T, out: &mut [T], g: SmearRows) {
    let cols = g.cols;
    out.par_chunks_mut(cols).enumerate().for_each(|(r, o)| {
        let (gate, _) = gate_of(e, ids, w, lambda, r, g);
        let cur = &e[r * cols..(r + 1) * cols];
        if r.is_multiple_of(g.t) {
            o.copy_from_slice(cur);
            return;
        }
        let prev = &e[(r - 1) * cols..r * cols];
        for ((o, &c), &p) in o.iter_mut().zip(cur).zip(prev) {
            *o = c + p * gate;
        }
    });
}

/// The gradients of [`smear_rows_fwd`] (the module doc's formulas): `de` written, `dw` and
/// `dlambda` (one value) added to (sums in f64 over fixed row blocks, added in order).
#[allow(clippy::too_many_arguments)]
pub(crate) fn smear_rows_bwd<T: Real>(
    dout: &[T],
    e: &[T],
    ids: &[u32],
    w: &[T],
    lambda: T,
    de: &mut [T],
    dw: &mut [T],
    dlambda: &mut [T],
    g: SmearRows,
) {
    let (cols, win) = (g.cols, w.len());
    let rows = e.len() / cols;
    let one = T::from_f64(1.0);
    // Per row: (g_r, dz_r, dg_r k_r s_r), all 0 where the gate is off.
    let zero = T::from_f64(0.0);
    let per_row: Vec<(T, T, T)> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let (gate, s) = gate_of(e, ids, w, lambda, r, g);
            if r.is_multiple_of(g.t) || ids[r] == g.bos {
                return (zero, zero, zero);
            }
            let (gr, prev) = (&dout[r * cols..(r + 1) * cols], &e[(r - 1) * cols..r * cols]);
            let dg = gr.iter().zip(prev).fold(zero, |a, (&x, &y)| a + x * y);
            (gate, dg * lambda * s * (one - s), dg * s)
        })
        .collect();
    de.par_chunks_mut(cols).enumerate().for_each(|(r, d)| {
        d.copy_from_slice(&dout[r * cols..(r + 1) * cols]);
        if !(r + 1).is_multiple_of(g.t) && r + 1 < rows {
            let next = per_row[r + 1].0;
            for (d, &x) in d.iter_mut().zip(&dout[(r + 1) * cols..(r + 2) * cols]) {
                *d += next * x;
            }
        }
        let dz = per_row[r].1;
        for (d, &wc) in d.iter_mut().zip(w) {
            *d += dz * wc;
        }
    });
    let mut sums = vec![T::from_f64(0.0); win + 1];
    column_sums(rows, win + 1, &mut sums, |r, acc| {
        let (_, dz, dl) = per_row[r];
        for (c, a) in acc[..win].iter_mut().enumerate() {
            *a += (dz * e[r * cols + c]).to_f64();
        }
        acc[win] += dl.to_f64();
    });
    for (d, &s) in dw.iter_mut().zip(&sums) {
        *d += s;
    }
    dlambda[0] += sums[win];
}

/// 1 where a token of `ids` is not `bos`, row-major (tests).
#[cfg(test)]
fn keep_of(ids: &Tensor, bos: u32) -> Vec<f64> {
    ids.flatten_all().unwrap().to_vec1::<u32>().unwrap().iter().map(|&x| if x == bos { 0.0 } else { 1.0 }).collect()
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::model::ops::testing::{flat, seeded};

    /// Output and every gradient against the scalar formula in f64, with a BOS in the middle of
    /// a row (and one at a row's start, where nothing smears anyway).
    #[test]
    fn matches_the_formula_and_its_gradients() {
        let (b, t, d, win, bos) = (2, 5, 7, 3, 1u32);
        let ids = Tensor::from_vec(vec![4u32, 2, 1, 3, 5, 1, 6, 1, 2, 2], (b, t), &Device::Cpu).unwrap();
        let e = Var::from_tensor(&seeded(&[b * t, d], 1)).unwrap();
        let w = Var::from_tensor(&seeded(&[1, win], 2)).unwrap();
        let lambda = Var::from_tensor(&seeded(&[1], 3)).unwrap();
        let y = smear_gate(e.as_tensor(), &ids, w.as_tensor(), lambda.as_tensor(), bos).unwrap();
        let up = seeded(&[b * t, d], 4);
        let grads = (&y * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (ev, wv, lv, yv, uv) = (flat(e.as_tensor()), flat(w.as_tensor()), flat(lambda.as_tensor())[0], flat(&y), flat(&up));
        let keep = keep_of(&ids, bos);
        let (mut de, mut dw, mut dl) = (uv.clone(), vec![0.0; win], 0.0);
        for r in 0..b {
            for p in 0..t {
                let row = r * t + p;
                let at = |k: usize, c: usize| ev[k * d + c];
                if p == 0 {
                    for c in 0..d {
                        assert!((yv[row * d + c] - at(row, c)).abs() < 1e-14);
                    }
                    continue;
                }
                let z: f64 = (0..win).map(|c| at(row, c) * wv[c]).sum();
                let s = 1.0 / (1.0 + (-z).exp());
                let g = lv * s * keep[row];
                // dL/dg = sum_c up * e_{t-1}; then through lambda, the sigmoid and w . e_t.
                let mut dg = 0.0;
                for c in 0..d {
                    let want = at(row, c) + g * at(row - 1, c);
                    assert!((yv[row * d + c] - want).abs() < 1e-12, "y[{row},{c}]");
                    de[(row - 1) * d + c] += g * uv[row * d + c];
                    dg += uv[row * d + c] * at(row - 1, c);
                }
                dl += dg * s * keep[row];
                let dz = dg * lv * keep[row] * s * (1.0 - s);
                for c in 0..win {
                    dw[c] += dz * at(row, c);
                    de[row * d + c] += dz * wv[c];
                }
            }
        }
        let close = |a: &[f64], b: &[f64], what: &str| {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() < 1e-10, "{what}[{i}]: {x} vs {y}");
            }
        };
        close(&flat(grads.get(e.as_tensor()).unwrap()), &de, "de");
        close(&flat(grads.get(w.as_tensor()).unwrap()), &dw, "dw");
        close(&flat(grads.get(lambda.as_tensor()).unwrap()), &[dl], "dlambda");
        // The BOS fix bites: the BOS at row 0, position 2 keeps its own embedding.
        for c in 0..d {
            assert_eq!(yv[2 * d + c], ev[2 * d + c]);
        }
    }

    /// Zero gate and gain (the init): the embedding unchanged.
    #[test]
    fn at_init_it_changes_nothing() {
        let ids = Tensor::from_vec(vec![3u32, 4, 5, 6], (1, 4), &Device::Cpu).unwrap();
        let e = seeded(&[4, 6], 5);
        let w = Tensor::zeros((1, 2), DType::F64, &Device::Cpu).unwrap();
        let l = Tensor::zeros(1, DType::F64, &Device::Cpu).unwrap();
        assert_eq!(flat(&smear_gate(&e, &ids, &w, &l, 1).unwrap()), flat(&e));
    }
}
