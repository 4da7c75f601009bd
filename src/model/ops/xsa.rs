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
//! tested against is the scalar formula. The engine's CPU backend runs the row kernels
//! [`xsa_rows_fwd`] and [`xsa_rows_bwd`], checked here against the composite.

#[cfg(feature = "candle")]
use candle_core::{D, Result, Tensor, bail};
use rayon::prelude::*;

use crate::model::host::rows::{ROWS, split_rows};
use crate::model::host::simd::{Real, dot_f64};

/// XSA of the attention output `y` `(N, H * D)` given the values `v` `(N, K * D)` of the same
/// `N` token rows (heads side by side in the columns, `H` a multiple of `K`).
#[cfg(feature = "candle")]
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

/// The head geometry of [`xsa_rows_fwd`] and [`xsa_rows_bwd`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadsShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Head width.
    pub d: usize,
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

/// XSA on token rows (the engine's CPU kernel): `y` `(N, H * d)`, `v` `(N, K * d)` with row
/// stride `ld`, `out` like `y`.
pub(crate) fn xsa_rows_fwd<T: Real>(y: &[T], (v, ld): (&[T], usize), out: &mut [T], s: HeadsShape) {
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

/// XSA's gradients (the engine's CPU kernel): with `out = y - (y . u) u`, `dy = g - (g . u) u`, `du = -((y . u) g + (g . u) y)` summed over the
/// group's heads, and `dv = (du - u (du . u)) / |v|` (`du / 1e-12` below the floor); `dv` written.
pub(crate) fn xsa_rows_bwd<T: Real>(
    dout: &[T],
    y: &[T],
    (v, ld): (&[T], usize),
    dy: &mut [T],
    (dv, ldv): (&mut [T], usize),
    s: HeadsShape,
) {
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

    /// The engine's row kernels give the composite's output and gradients (f64), on a strided
    /// `v` (a column block of a wider matrix, as the engine's fused qkv) and across row blocks.
    #[test]
    fn row_kernels_match_the_composite() {
        for (n, heads, kv, d) in [(70usize, 4usize, 2usize, 3usize), (5, 6, 1, 2)] {
            let y = Var::from_tensor(&seeded(&[n, heads * d], 21)).unwrap();
            let v = Var::from_tensor(&seeded(&[n, kv * d], 22)).unwrap();
            let out = xsa(y.as_tensor(), v.as_tensor(), heads, kv).unwrap();
            let up = seeded(&[n, heads * d], 23);
            let grads = (&out * &up).unwrap().sum_all().unwrap().backward().unwrap();
            let (yv, vv, uv) = (flat(y.as_tensor()), flat(v.as_tensor()), flat(&up));
            // v inside rows of width kv * d + 5, starting at column 2.
            let ld = kv * d + 5;
            let mut wide = vec![0.0; n * ld];
            for r in 0..n {
                wide[r * ld + 2..r * ld + 2 + kv * d].copy_from_slice(&vv[r * kv * d..(r + 1) * kv * d]);
            }
            let shape = HeadsShape { heads, kv_heads: kv, d };
            let mut got = vec![0.0; n * heads * d];
            xsa_rows_fwd(&yv, (&wide[2..], ld), &mut got, shape);
            let (mut dy, mut dv_wide) = (vec![0.0; n * heads * d], vec![7.0; n * ld]);
            xsa_rows_bwd(&uv, &yv, (&wide[2..], ld), &mut dy, (&mut dv_wide[2..], ld), shape);
            let dv: Vec<f64> = (0..n).flat_map(|r| dv_wide[r * ld + 2..r * ld + 2 + kv * d].to_vec()).collect();
            let close = |a: &[f64], b: &[f64], what: &str| {
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() < 1e-12, "{:?}: {what}: {x} vs {y}", (n, heads, kv, d));
                }
            };
            close(&got, &flat(&out), "out");
            close(&dy, &flat(grads.get(y.as_tensor()).unwrap()), "dy");
            close(&dv, &flat(grads.get(v.as_tensor()).unwrap()), "dv");
            assert!((0..n).all(|r| dv_wide[r * ld..r * ld + 2].iter().all(|&x| x == 7.0)), "writes stay in the view");
        }
    }
}
