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
//! against is the scalar formula.

use candle_core::{Result, Tensor};

/// SmearGate over the `(B*T, D)` embedding rows `e` of input ids `ids` `(B, T)` (u32): gate
/// `w` `(1, W)`, gain `lambda` `(1,)`, no smear onto tokens equal to `bos`.
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
