//! Rotary position embedding (RoPE), the reference formulation: the tables and the rotation
//! that [`super::qk_norm_rope`] fuses with the per-head norm. For position `p` and the pair
//! `(x1[i], x2[i]) = (x[i], x[i + D/2])` of a head of width `D`,
//!
//! ```text
//! theta[p, i] = p * base^(-2i / D)        (inv_freq in f32, as PyTorch computes it)
//! y1[i] = x1[i] cos(theta) + x2[i] sin(theta)
//! y2[i] = x2[i] cos(theta) - x1[i] sin(theta)
//! ```
//!
//! No kernel of its own: on the model's path RoPE is part of [`super::qk_norm_rope`].

#[cfg(feature = "candle")]
use candle_core::D;
use candle_core::{DType, Device, Result, Tensor};

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
#[cfg(feature = "candle")]
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let a = (x1.broadcast_mul(cos)? + x2.broadcast_mul(sin)?)?;
    let b = (x2.broadcast_mul(cos)? - x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[&a, &b], D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
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
}
