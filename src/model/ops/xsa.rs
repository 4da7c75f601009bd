//! Exclusive self-attention (XSA, the 04-09 record's attention on its last `xsa_last_n`
//! blocks): each query head's output loses its component along the normalised value vector of
//! its own token, in its key/value group. For token `t`, query head `h` of `H`, KV group
//! `g = h / (H / K)` of `K`:
//!
//! ```text
//! v^ = v[t, g] / max(|v[t, g]|_2, 1e-12)          (F.normalize)
//! y'[t, h] = y[t, h] - (y[t, h] . v^) v^
//! ```
//!
//! so what a head passes on is what attention gathered from the *other* tokens, not a copy of
//! the token's own value. Composed from candle ops on every device (reshapes, a sum, broadcast
//! products), whose backward passes give the gradients of `y` and `v`; the reference it is
//! tested against is the scalar formula.

use candle_core::{D, Result, Tensor, bail};

/// XSA of the attention output `y` `(N, H * D)` given the values `v` `(N, K * D)` of the same
/// `N` token rows (heads side by side in the columns, `H` a multiple of `K`).
pub fn xsa(y: &Tensor, v: &Tensor, heads: usize, kv_heads: usize) -> Result<Tensor> {
    let (n, width) = y.dims2()?;
    let (nv, kv_width) = v.dims2()?;
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) || !width.is_multiple_of(heads) || n != nv {
        bail!("xsa: y {:?} with {heads} heads does not fit v {:?} with {kv_heads}", y.shape(), v.shape());
    }
    let d = width / heads;
    if kv_width != kv_heads * d {
        bail!("xsa: v {:?} is not {kv_heads} heads of {d}", v.shape());
    }
    let group = heads / kv_heads;
    let yr = y.reshape((n, kv_heads, group, d))?;
    let vr = v.reshape((n, kv_heads, 1, d))?;
    let norm = vr.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?.maximum(1e-12)?;
    let unit = vr.broadcast_div(&norm)?;
    let along = yr.broadcast_mul(&unit)?.sum_keepdim(D::Minus1)?;
    (yr - along.broadcast_mul(&unit)?)?.reshape((n, width))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::model::ops::testing::{check_finite_differences, flat, seeded};

    /// The scalar formula, in f64.
    fn reference(y: &[f64], v: &[f64], n: usize, heads: usize, kv: usize, d: usize) -> Vec<f64> {
        let mut out = y.to_vec();
        for t in 0..n {
            for h in 0..heads {
                let g = h / (heads / kv);
                let vv = &v[(t * kv + g) * d..][..d];
                let norm = vv.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
                let yy = &mut out[(t * heads + h) * d..][..d];
                let dot: f64 = yy.iter().zip(vv).map(|(a, b)| a * b / norm).sum();
                for (o, b) in yy.iter_mut().zip(vv) {
                    *o -= dot * b / norm;
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_formula_and_leaves_no_component_along_the_value() {
        for (n, heads, kv, d) in [(5usize, 4usize, 2usize, 3usize), (3, 2, 2, 4), (4, 6, 1, 2)] {
            let y = seeded(&[n, heads * d], 1);
            let v = seeded(&[n, kv * d], 2);
            let got = flat(&xsa(&y, &v, heads, kv).unwrap());
            let want = reference(&flat(&y), &flat(&v), n, heads, kv, d);
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() < 1e-12, "{:?}: {a} vs {b}", (n, heads, kv, d));
            }
            let vv = flat(&v);
            for t in 0..n {
                for h in 0..heads {
                    let g = h / (heads / kv);
                    let dot: f64 = (0..d).map(|i| got[(t * heads + h) * d + i] * vv[(t * kv + g) * d + i]).sum();
                    assert!(dot.abs() < 1e-12, "head {h} of token {t} keeps {dot} along its value");
                }
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let y = seeded(&[3, 8], 3);
        let v = seeded(&[3, 4], 4);
        check_finite_differences(&|x| xsa(&x[0], &x[1], 4, 2), &[y, v], "xsa");
        // The op is differentiable through `Var`s as the model uses it.
        let y = Var::from_tensor(&seeded(&[2, 4], 5)).unwrap();
        let v = Var::from_tensor(&seeded(&[2, 4], 6)).unwrap();
        let out = xsa(y.as_tensor(), v.as_tensor(), 1, 1).unwrap().sum_all().unwrap();
        let g = out.backward().unwrap();
        assert!(g.get(y.as_tensor()).is_some() && g.get(v.as_tensor()).is_some());
    }

    #[test]
    fn bad_shapes_are_errors() {
        let y = Tensor::zeros((2, 8), DType::F64, &Device::Cpu).unwrap();
        assert!(xsa(&y, &Tensor::zeros((2, 6), DType::F64, &Device::Cpu).unwrap(), 4, 2).is_err(), "v is 2 heads of 3, y's are of 2");
        assert!(xsa(&y, &Tensor::zeros((3, 4), DType::F64, &Device::Cpu).unwrap(), 4, 2).is_err(), "rows differ");
        assert!(xsa(&y, &Tensor::zeros((2, 6), DType::F64, &Device::Cpu).unwrap(), 4, 3).is_err(), "4 heads in 3 groups");
    }
}
