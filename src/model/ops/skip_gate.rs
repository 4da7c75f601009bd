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
//! scalar formula.

use candle_core::{Result, Tensor};

/// `sigmoid(z) * h + (1 - sigmoid(z)) * (w * s)` for the `(N, C)` stream `h`, the encoder output
/// `s` `(N, C)` and the per-channel rows `w`, `z` `(C,)`.
pub fn gated_skip(h: &Tensor, s: &Tensor, w: &Tensor, z: &Tensor) -> Result<Tensor> {
    let k = s.broadcast_mul(w)?;
    // sigmoid(z) = 1 / (1 + exp(-z)).
    let g = (z.neg()?.exp()? + 1.0)?.recip()?;
    k.broadcast_add(&(h - &k)?.broadcast_mul(&g)?)
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
}
