//! The GPT's building blocks as candle ops (all differentiable with candle's autograd).
//!
//! Shapes use `B` batch rows, `T` positions, `H` query heads, `K` key/value heads, `D` head dim.

use candle_core::{D, DType, Device, Result, Tensor};

/// `eps` of PyTorch's `F.rms_norm(eps=None)`: the machine epsilon of the input's dtype.
pub fn rms_eps(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON,
        DType::F16 => 9.765625e-4,
        DType::BF16 => 7.8125e-3,
        _ => f32::EPSILON as f64,
    }
}

/// RMS norm over the last dimension, no weight: `x / sqrt(mean(x^2) + eps)`, `eps` the input
/// dtype's ([`rms_eps`]).
pub fn rms_norm(x: &Tensor) -> Result<Tensor> {
    rms_norm_eps(x, rms_eps(x.dtype()))
}

/// [`rms_norm`] with the given `eps`.
pub fn rms_norm_eps(x: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)
}

/// `cos` and `sin` tables of shape `(T, D/2)`: angle `pos * base^(-2i/D)`.
pub fn rope_tables(seq_len: usize, head_dim: usize, base: f64, dtype: DType, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(seq_len * half);
    let mut sin = Vec::with_capacity(seq_len * half);
    for pos in 0..seq_len {
        for i in 0..half {
            // As PyTorch computes it: inv_freq in float32, then pos * inv_freq.
            let inv = 1.0f32 / (base as f32).powf((2 * i) as f32 / head_dim as f32);
            let angle = (pos as f32 * inv) as f64;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (seq_len, half), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (seq_len, half), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// Rotary embedding on `(B, heads, T, D)` with non-interleaved halves:
/// `[x1 cos + x2 sin, -x1 sin + x2 cos]`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let a = (x1.broadcast_mul(cos)? + x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? - x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[&a, &b], D::Minus1)
}

/// Softmax over the last dimension (the shift by the row maximum is detached: softmax does not
/// depend on it).
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// A `(T, T)` additive causal mask: 0 on and below the diagonal, -inf above.
pub fn causal_mask(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Tensor::from_vec(v, (t, t), device)?.to_dtype(dtype)
}

/// Causal scaled-dot-product attention with grouped KV heads: `q` is `(B, H, T, D)`, `k` and
/// `v` are `(B, K, T, D)`; query head `h` uses KV head `h / (H / K)` (PyTorch's `enable_gqa`).
/// Returns `(B, H, T, D)`.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (_, h, _, d) = q.dims4()?;
    let (k, v) = (repeat_kv(k, h)?, repeat_kv(v, h)?);
    let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?;
    let probs = softmax_last(&scores.broadcast_add(mask)?)?;
    probs.matmul(&v.contiguous()?)
}

/// `(B, K, T, D)` key or value heads repeated to `(B, heads, T, D)`: query head `h` gets KV
/// head `h / (heads / K)`. `x` itself when `K == heads`.
pub fn repeat_kv(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, kv, t, d) = x.dims4()?;
    if kv == heads {
        return Ok(x.clone());
    }
    x.unsqueeze(2)?.broadcast_as((b, kv, heads / kv, t, d))?.reshape((b, heads, t, d))
}

/// `cap * tanh(z / cap)`.
pub fn softcap(z: &Tensor, cap: f64) -> Result<Tensor> {
    (z / cap)?.tanh()? * cap
}

/// Per-row cross-entropy: `logsumexp(logits) - logits[target]`; `logits` is `(N, V)`, `targets`
/// `(N,)` of u32. Returns `(N,)`.
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &max)?;
    let picked = logits.gather(&targets.unsqueeze(1)?, 1)?;
    (lse - picked)?.squeeze(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn rms_norm_matches_hand_values() {
        // Row [3, 4]: mean square 12.5, so [3, 4] / sqrt(12.5).
        let y = rms_norm(&t(&[3.0, 4.0, 0.0, 0.0], &[2, 2])).unwrap().to_vec2::<f64>().unwrap();
        assert!((y[0][0] - 3.0 / 12.5f64.sqrt()).abs() < 1e-12 && (y[0][1] - 4.0 / 12.5f64.sqrt()).abs() < 1e-12);
        assert_eq!(y[1], vec![0.0, 0.0]);
    }

    #[test]
    fn rope_rotates_pairs_by_position() {
        // One head of dim 4, positions 0 and 1: pairs (x0, x2) and (x1, x3) rotate by pos * inv_freq.
        let (cos, sin) = rope_tables(2, 4, 10_000.0, DType::F64, &Device::Cpu).unwrap();
        let x = t(&[1.0, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0], &[1, 1, 2, 4]);
        let y = rope(&x, &cos, &sin).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(&y[..4], &[1.0, 2.0, 3.0, 4.0], "position 0 is unrotated");
        let (a0, a1) = (1.0f64, 1.0f64 / 100.0); // inv_freq for i = 0, 1 with base 10000, D = 4
        let want = [
            1.0 * a0.cos() + 3.0 * a0.sin(),
            2.0 * a1.cos() + 4.0 * a1.sin(),
            3.0 * a0.cos() - 1.0 * a0.sin(),
            4.0 * a1.cos() - 2.0 * a1.sin(),
        ];
        for (g, w) in y[4..].iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
    }

    #[test]
    fn attention_matches_a_naive_reference_with_grouped_heads() {
        let (b, h, kv, tt, d) = (1usize, 4usize, 2usize, 3usize, 2usize);
        let mut rng = fastrand::Rng::with_seed(3);
        let mut r = |n: usize| (0..n).map(|_| rng.f64() * 2.0 - 1.0).collect::<Vec<f64>>();
        let (qv, kvv, vv) = (r(b * h * tt * d), r(b * kv * tt * d), r(b * kv * tt * d));
        let q = t(&qv, &[b, h, tt, d]);
        let k = t(&kvv, &[b, kv, tt, d]);
        let v = t(&vv, &[b, kv, tt, d]);
        let mask = causal_mask(tt, DType::F64, &Device::Cpu).unwrap();
        let got = causal_attention(&q, &k, &v, &mask).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for hh in 0..h {
            let g = hh / (h / kv);
            for i in 0..tt {
                let qi = &qv[(hh * tt + i) * d..(hh * tt + i + 1) * d];
                let s: Vec<f64> =
                    (0..=i).map(|j| (0..d).map(|c| qi[c] * kvv[(g * tt + j) * d + c]).sum::<f64>() / (d as f64).sqrt()).collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for c in 0..d {
                    let want: f64 = (0..=i).map(|j| (s[j] - m).exp() / z * vv[(g * tt + j) * d + c]).sum();
                    let gv = got[(hh * tt + i) * d + c];
                    assert!((gv - want).abs() < 1e-12, "head {hh} pos {i} dim {c}: {gv} vs {want}");
                }
            }
        }
    }

    #[test]
    fn cross_entropy_and_softcap_match_hand_values() {
        let logits = t(&[0.0, 0.0, 1.0, 3.0], &[2, 2]);
        let y = Tensor::from_vec(vec![0u32, 1], 2, &Device::Cpu).unwrap();
        let ce = cross_entropy_rows(&logits, &y).unwrap().to_vec1::<f64>().unwrap();
        assert!((ce[0] - 2f64.ln()).abs() < 1e-12);
        assert!((ce[1] - (1.0 + (-2f64).exp()).ln()).abs() < 1e-12);
        let c = softcap(&t(&[0.0, 30.0, -1e6], &[3]), 30.0).unwrap().to_vec1::<f64>().unwrap();
        assert!(c[0] == 0.0 && (c[1] - 30.0 * 1f64.tanh()).abs() < 1e-12 && (c[2] + 30.0).abs() < 1e-9);
    }
}
