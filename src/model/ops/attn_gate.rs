//! The 04-27 record's sparse attention-output gate: each head's attention output is scaled by a
//! sigmoid of the first `W` channels of the block's normed attention input. With `y` the
//! attention output `(N, H*hd)` (heads side by side), `x` that input `(N, D)`, `w` the gate
//! `(H, W)` and `s` `model.attn_gate_scale`:
//!
//! ```text
//! g[n, h]    = sigmoid(s * w[h] . x[n, :W])
//! y'[n, h, :] = g[n, h] * y[n, h, :]
//! ```
//!
//! before the output projection. `w` starts at zero (`model.attn_gate_init_std = 0`), every
//! gate at 0.5.
//!
//! Composed from candle ops on every device (a product with `w^T`, `exp`, `recip`, a broadcast
//! over each head's width), whose backward passes give the gradients of `y`, `x` and `w`; the
//! reference it is tested against is the scalar formula. The engine's CPU backend runs the row
//! kernels below ([`attn_gate_rows_fwd`], [`attn_gate_rows_bwd`]); its GPU kernels
//! (`eng_attn_gate_*` in kernels/engine.cu) are checked against those. Backward, with `G` the
//! output's gradient:
//!
//! ```text
//! dy[n, h, :] = g[n, h] G[n, h, :]
//! dz[n, h]    = s g (1 - g) (G[n, h, :] . y[n, h, :])
//! dw         += dz^T x[:, :W]          dx[:, :W] += dz w      (two GEMMs in the engine)
//! ```

#[cfg(feature = "candle")]
use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::model::host::simd::Real;

/// `y` `(N, H*hd)` with head `h` of row `n` scaled by `sigmoid(scale * w[h] . x[n, :W])`, `w`
/// `(H, W)`, `x` `(N, D)`.
#[cfg(feature = "candle")]
pub fn attn_gate(y: &Tensor, x: &Tensor, w: &Tensor, scale: f64) -> Result<Tensor> {
    let (n, width) = y.dims2()?;
    let (heads, win) = w.dims2()?;
    // Contiguous: a narrowed left operand has a row stride cuBLAS's product refuses (candle's
    // CPU backend takes any).
    let z = x.narrow(1, 0, win)?.contiguous()?.matmul(&w.t()?)?.affine(scale, 0.0)?;
    let g = (z.neg()?.exp()? + 1.0)?.recip()?;
    y.reshape((n, heads, width / heads))?.broadcast_mul(&g.unsqueeze(2)?)?.reshape((n, width))
}

/// `g[n, h]` for row `n` of the `(N, W)` view `(x, ldx)`, `w` `(H, W)`.
fn gates<'a, T: Real>((x, ldx): (&'a [T], usize), w: &'a [T], n: usize, heads: usize, scale: T) -> impl Iterator<Item = T> + 'a {
    let win = w.len() / heads;
    let zero = T::from_f64(0.0);
    (0..heads).map(move |h| {
        let z = w[h * win..(h + 1) * win].iter().zip(&x[n * ldx..n * ldx + win]).fold(zero, |a, (&w, &x)| a + x * w) * scale;
        T::from_f64(1.0) / (T::from_f64(1.0) + (zero - z).exp())
    })
}

/// [`attn_gate`] on the engine's rows: `y` and `out` contiguous `(N, H hd)` (`heads`, `hd`), `x`
/// the gate input's `(N, W)` view (slice from its first element, row stride), `w` `(H, W)`.
pub(crate) fn attn_gate_rows_fwd<T: Real>(y: &[T], x: (&[T], usize), w: &[T], out: &mut [T], (heads, hd): (usize, usize), scale: f64) {
    let (width, scale) = (heads * hd, T::from_f64(scale));
    out.par_chunks_mut(width).enumerate().for_each(|(n, o)| {
        for (h, g) in gates(x, w, n, heads, scale).enumerate() {
            for k in h * hd..(h + 1) * hd {
                o[k] = g * y[n * width + k];
            }
        }
    });
}

/// The gradients of [`attn_gate_rows_fwd`] (the module doc's formulas): `dy` `(N, H hd)` and
/// `dz` `(N, H)` written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attn_gate_rows_bwd<T: Real>(
    dout: &[T],
    y: &[T],
    x: (&[T], usize),
    w: &[T],
    dy: &mut [T],
    dz: &mut [T],
    (heads, hd): (usize, usize),
    scale: f64,
) {
    let (width, scale) = (heads * hd, T::from_f64(scale));
    let one = T::from_f64(1.0);
    dy.par_chunks_mut(width).zip(dz.par_chunks_mut(heads)).enumerate().for_each(|(n, (d, z))| {
        for (h, g) in gates(x, w, n, heads, scale).enumerate() {
            let mut dg = T::from_f64(0.0);
            for k in h * hd..(h + 1) * hd {
                d[k] = g * dout[n * width + k];
                dg += dout[n * width + k] * y[n * width + k];
            }
            z[h] = scale * g * (one - g) * dg;
        }
    });
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;
    use crate::model::ops::testing::{flat, seeded};

    #[test]
    fn matches_the_formula_and_its_gradients() {
        let (n, heads, hd, d, win, scale) = (5, 3, 4, 10, 6, 0.5);
        let y = Var::from_tensor(&seeded(&[n, heads * hd], 1)).unwrap();
        let x = Var::from_tensor(&seeded(&[n, d], 2)).unwrap();
        let w = Var::from_tensor(&seeded(&[heads, win], 3)).unwrap();
        let out = attn_gate(y.as_tensor(), x.as_tensor(), w.as_tensor(), scale).unwrap();
        let up = seeded(&[n, heads * hd], 4);
        let grads = (&out * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let (yv, xv, wv, ov, uv) = (flat(y.as_tensor()), flat(x.as_tensor()), flat(w.as_tensor()), flat(&out), flat(&up));
        let (mut dy, mut dx, mut dw) = (vec![0.0; n * heads * hd], vec![0.0; n * d], vec![0.0; heads * win]);
        for r in 0..n {
            for h in 0..heads {
                let z: f64 = scale * (0..win).map(|c| wv[h * win + c] * xv[r * d + c]).sum::<f64>();
                let g = 1.0 / (1.0 + (-z).exp());
                let mut dg = 0.0;
                for k in 0..hd {
                    let i = r * heads * hd + h * hd + k;
                    assert!((ov[i] - g * yv[i]).abs() < 1e-12, "y'[{i}]");
                    dy[i] = g * uv[i];
                    dg += uv[i] * yv[i];
                }
                let dz = dg * g * (1.0 - g) * scale;
                for c in 0..win {
                    dw[h * win + c] += dz * xv[r * d + c];
                    dx[r * d + c] += dz * wv[h * win + c];
                }
            }
        }
        let close = |a: &[f64], b: &[f64], what: &str| {
            for (i, (p, q)) in a.iter().zip(b).enumerate() {
                assert!((p - q).abs() < 1e-10, "{what}[{i}]: {p} vs {q}");
            }
        };
        close(&flat(grads.get(y.as_tensor()).unwrap()), &dy, "dy");
        close(&flat(grads.get(x.as_tensor()).unwrap()), &dx, "dx");
        close(&flat(grads.get(w.as_tensor()).unwrap()), &dw, "dw");
    }
}
