//! The causal softmax of materialised attention scores `s` `(.., T, T)` with scale `c`:
//!
//! ```text
//! p[i, j] = exp(c s[i, j]) / sum_{j' <= i} exp(c s[i, j'])   for j <= i, 0 above
//! ds[i, j] = c p[i, j] (g[i, j] - sum_j' p[i, j'] g[i, j'])
//! ```
//!
//! The causal softmax of attention scores as one op, for attention on a GPU: there the score
//! products run on cuBLAS (candle's `matmul`), and everything between them, the scale, the
//! causal mask, the softmax and its backward pass, is one kernel each way instead of a dozen
//! broadcasting passes over `(B, H, T, T)` (which took most of a step's time, measured with
//! Nsight Compute on an H100). The CPU implementation is the reference the GPU kernels are
//! checked against (`pipeline parity`); CPU training uses the fused attention of
//! [`super::attention`], which never materialises the scores.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};

/// `p[.., i, j] = softmax_{j <= i}(scale * scores[.., i, j])`, 0 above the diagonal: the
/// probabilities of causal attention for `scores` of shape `(.., T, T)` (`f32`, `bf16` or
/// `f64`; on a GPU `f32` or `bf16`). Differentiable with respect to `scores`.
#[cfg(feature = "candle")]
pub fn causal_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = scores.dims();
    if dims.len() < 2 || dims[dims.len() - 1] != dims[dims.len() - 2] {
        bail!("causal_softmax: scores must be (.., T, T), got {:?}", scores.shape());
    }
    scores.contiguous()?.apply_op1(CausalSoftmax { scale })
}

#[cfg(feature = "candle")]
struct CausalSoftmax {
    scale: f64,
}

/// `(probs, grad) -> grad of the scores`.
#[cfg(feature = "candle")]
struct CausalSoftmaxBwd {
    scale: f64,
}

#[cfg(feature = "candle")]
fn t_of(l: &Layout) -> usize {
    l.dims().last().copied().unwrap_or(0)
}

#[cfg(feature = "candle")]
fn to_f64(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    crate::model::host::convert::to_f64("causal_softmax", s, l)
}

#[cfg(feature = "candle")]
fn from_f64(v: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
    crate::model::host::convert::from_f64("causal_softmax", v, dtype)
}

/// The reference forward pass, row by row in f64 (row `r` is query position `r % T`).
#[cfg(feature = "candle")]
fn softmax_rows(s: &[f64], t: usize, scale: f64) -> Vec<f64> {
    let mut out = vec![0.0; s.len()];
    for (r, (row, o)) in s.chunks_exact(t).zip(out.chunks_exact_mut(t)).enumerate() {
        let i = r % t;
        let m = row[..=i].iter().map(|x| scale * x).fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row[..=i].iter().map(|x| (scale * x - m).exp()).sum();
        for (o, x) in o[..=i].iter_mut().zip(row) {
            *o = (scale * x - m).exp() / z;
        }
    }
    out
}

/// The reference backward pass: `scale * p * (g - sum(p * g))` per row.
#[cfg(feature = "candle")]
fn softmax_bwd_rows(p: &[f64], g: &[f64], t: usize, scale: f64) -> Vec<f64> {
    let mut out = vec![0.0; p.len()];
    for (r, ((pr, gr), o)) in p.chunks_exact(t).zip(g.chunks_exact(t)).zip(out.chunks_exact_mut(t)).enumerate() {
        let i = r % t;
        let dot: f64 = pr[..=i].iter().zip(&gr[..=i]).map(|(p, g)| p * g).sum();
        for ((o, p), g) in o[..=i].iter_mut().zip(pr).zip(gr) {
            *o = scale * p * (g - dot);
        }
    }
    out
}

#[cfg(feature = "candle")]
impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let t = t_of(l);
        let out = if t == 0 { Vec::new() } else { softmax_rows(&to_f64(s, l)?, t, self.scale) };
        Ok((from_f64(out, s.dtype())?, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::model::cuda::fused::rows_op("causal_softmax_fwd", &[(s, l)], t_of(l), self.scale as f32)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _scores: &Tensor, probs: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(probs.apply_op2_no_bwd(&grad.contiguous()?, &CausalSoftmaxBwd { scale: self.scale })?))
    }
}

#[cfg(feature = "candle")]
impl CustomOp2 for CausalSoftmaxBwd {
    fn name(&self) -> &'static str {
        "causal-softmax-bwd"
    }

    fn cpu_fwd(&self, p: &CpuStorage, pl: &Layout, g: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        if pl.dims() != gl.dims() || p.dtype() != g.dtype() {
            bail!("causal_softmax backward: gradient {:?} {:?} for probabilities {:?} {:?}", gl.shape(), g.dtype(), pl.shape(), p.dtype());
        }
        let t = t_of(pl);
        let out = if t == 0 { Vec::new() } else { softmax_bwd_rows(&to_f64(p, pl)?, &to_f64(g, gl)?, t, self.scale) };
        Ok((from_f64(out, p.dtype())?, pl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        pl: &Layout,
        g: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let out = crate::model::cuda::fused::rows_op("causal_softmax_bwd", &[(p, pl), (g, gl)], t_of(pl), self.scale as f32)?;
        Ok((out, pl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ops;
    use crate::model::ops::testing::{flat, seeded as rand};
    use candle_core::{Device, Var};

    /// The same probabilities and score gradients as the composite `softmax(scale * s + mask)`.
    #[test]
    fn matches_the_masked_softmax_composite_forward_and_backward() {
        for (shape, scale) in [(&[2usize, 3, 5, 5][..], 0.125), (&[1, 1, 1][..], 1.0), (&[4, 33, 33][..], 0.3)] {
            let s = Var::from_tensor(&rand(shape, 1)).unwrap();
            let g = rand(shape, 2);
            let t = shape[shape.len() - 1];
            let ours = causal_softmax(s.as_tensor(), scale).unwrap();
            let composite = ops::softmax_last(
                &(s.as_tensor() * scale).unwrap().broadcast_add(&ops::causal_mask(t, DType::F64, &Device::Cpu).unwrap()).unwrap(),
            )
            .unwrap();
            for (a, b) in flat(&ours).iter().zip(flat(&composite)) {
                assert!((a - b).abs() < 1e-12, "{shape:?}: {a} vs {b}");
            }
            let d_ours = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap().get(s.as_tensor()).unwrap().clone();
            let d_comp = (composite * &g).unwrap().sum_all().unwrap().backward().unwrap().get(s.as_tensor()).unwrap().clone();
            for (a, b) in flat(&d_ours).iter().zip(flat(&d_comp)) {
                assert!((a - b).abs() < 1e-12, "{shape:?} gradient: {a} vs {b}");
            }
        }
    }

    /// Future keys get exactly 0, each row sums to 1, and f32/bf16 storage round to the f64 values.
    #[test]
    fn rows_are_causal_distributions_in_every_dtype() {
        let s = rand(&[3, 7, 7], 5);
        let want = flat(&causal_softmax(&s, 0.5).unwrap());
        for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 1e-2)] {
            let got = flat(&causal_softmax(&s.to_dtype(dtype).unwrap(), 0.5).unwrap());
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= tol * b.abs().max(1e-3) + 1e-3 * tol, "{dtype:?}: {a} vs {b}");
            }
        }
        for (r, row) in want.chunks(7).enumerate() {
            let i = r % 7;
            assert!(row[i + 1..].iter().all(|&p| p == 0.0), "row {r}: {row:?}");
            assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
        assert!(causal_softmax(&rand(&[2, 3], 1), 1.0).is_err(), "scores must be square in the last two dims");
    }
}
