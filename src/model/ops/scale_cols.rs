//! The per-channel scale and its gradient, the GPU backward passes' building blocks: for `x`
//! `(N, C)` and `s` `(C,)`,
//!
//! ```text
//! scale_cols(x, s)[n, c] = x[n, c] * s[c]
//! column_dot(a, b)[c]    = sum_n a[n, c] * b[n, c]      (ds of scale_cols, in a fixed order)
//! ```
//!
//! - reference: the CPU implementations ([`ScaleCols`], [`ColumnDot`], f64 sums in row
//!   order); candle's broadcasting multiply is what they are compared with;
//! - GPU: `scale_cols` and `column_dot_partial` / `_sum` of `kernels/fused.cu` (partial sums of
//!   64 rows in f32, then the partials in order), where candle's own reduction of a broadcast's
//!   gradient runs on a few blocks only and sums bf16 in bf16.
//!
//! CPU training does not use them: [`super::scale_add`] and [`super::resid_mix`] have fused CPU
//! backward passes.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};

#[cfg(feature = "candle")]
use super::last_dim;
#[cfg(feature = "candle")]
use crate::model::host::convert::{self, float_dispatch, narrowed, widened, wrap};
#[cfg(feature = "candle")]
use crate::model::host::rows::{elems, elems_as};
#[cfg(feature = "candle")]
use crate::model::host::simd::Real;

/// `x * s` for `x` `(.., C)` and `s` `(C,)` (one dtype), written in the dtype held (`x`'s, or
/// the narrower of a mixed pair): the per-channel scale of a gradient in the GPU backward passes
/// of [`ScaleAdd`] and [`ResidMix`]. The CPU implementation is the kernel's reference.
#[cfg(feature = "candle")]
pub(crate) struct ScaleCols(pub(crate) DType);

#[cfg(feature = "candle")]
impl CustomOp2 for ScaleCols {
    fn name(&self) -> &'static str {
        "scale-cols"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ss: &CpuStorage, sl: &Layout) -> Result<(CpuStorage, Shape)> {
        if !super::same_or_narrower(xs.dtype(), self.0) {
            bail!("scale_cols: cannot write {:?} from {:?}", self.0, xs.dtype());
        }
        if xs.dtype() == DType::BF16 {
            // bf16 writes bf16 (checked above): the f32 code's output, rounded once.
            return narrowed(ScaleCols(DType::F32).cpu_fwd(&widened(xs), xl, &widened(ss), sl)?);
        }
        let out = float_dispatch!(xs.dtype(), "scale_cols", |T| {
            let (x, sc) = (elems::<T>(xs, xl)?, elems::<T>(ss, sl)?);
            let c = sc.len().max(1);
            convert::to_storage(&x.chunks(c).flat_map(|row| row.iter().zip(sc).map(|(&a, &b)| a * b)).collect::<Vec<T>>(), self.0)?
        });
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ss: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = sl.shape().elem_count();
        if xs.dtype() != ss.dtype() || !super::same_or_narrower(xs.dtype(), self.0) {
            bail!("scale_cols: no GPU kernel for x {:?}, scale {:?} to {:?}", xs.dtype(), ss.dtype(), self.0);
        }
        let out = crate::model::cuda::fused::rows_op_mixed("scale_cols", &[(xs, xl)], &[(ss, sl)], self.0, c, 0.0, &[])?;
        Ok((out, xl.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, s: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Differentiable only as `scale_cols` applies it: in x's dtype.
        let grad = grad.contiguous()?;
        Ok((Some(grad.apply_op2_no_bwd(s, &ScaleCols(x.dtype()))?), Some(column_dot(&grad, x)?)))
    }
}

/// `x * s` for `x` `(.., C)` and `s` `(C,)`, differentiable in both: one kernel each way on a
/// GPU, where candle's broadcasting multiply reduces the gradient of `s` with a few blocks only.
#[cfg(feature = "candle")]
pub fn scale_cols(x: &Tensor, s: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&s.contiguous()?, ScaleCols(x.dtype()))
}

/// `sum over rows of (a * b)` for `a`, `b` `(.., C)` of one dtype, or `b` of the narrower of a
/// mixed pair: the per-channel gradient of the GPU formulation, `(C,)` in `a`'s dtype.
/// Accumulated in f32 at least (candle's own sums accumulate in the tensor's dtype: 65,536 rows
/// summed in bf16 keep about two digits), in a fixed order: a kernel pair on a GPU (partial sums
/// of 64 rows, then the partials in order), f64 in row order on the CPU (the reference).
#[cfg(feature = "candle")]
pub(crate) fn column_dot(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let c = last_dim(a)?;
    if a.dims() != b.dims() {
        bail!("column_dot: shapes {:?} and {:?} differ", a.shape(), b.shape());
    }
    if !super::same_or_narrower(a.dtype(), b.dtype()) {
        bail!("column_dot: dtypes {:?} and {:?} are not a mixed pair", a.dtype(), b.dtype());
    }
    a.contiguous()?.reshape(((), c))?.apply_op2_no_bwd(&b.contiguous()?.reshape(((), c))?, &ColumnDot)
}

#[cfg(feature = "candle")]
struct ColumnDot;

#[cfg(feature = "candle")]
fn column_dot_cpu<T: Real>(a: &[T], b: &[T], c: usize) -> Vec<T> {
    let mut acc = vec![0f64; c];
    for (ra, rb) in a.chunks_exact(c).zip(b.chunks_exact(c)) {
        for ((s, x), y) in acc.iter_mut().zip(ra).zip(rb) {
            *s += x.to_f64() * y.to_f64();
        }
    }
    acc.into_iter().map(T::from_f64).collect()
}

#[cfg(feature = "candle")]
impl CustomOp2 for ColumnDot {
    fn name(&self) -> &'static str {
        "column-dot"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, c) = l1.shape().dims2()?;
        // `column_dot` checked the dtypes: `b`, when narrower, widens exactly.
        if s1.dtype() == DType::BF16 {
            return narrowed(self.cpu_fwd(&widened(s1), l1, &widened(s2), l2)?);
        }
        let out = float_dispatch!(s1.dtype(), "column_dot", |T| wrap(column_dot_cpu::<T>(elems(s1, l1)?, &elems_as(s2, l2)?, c)));
        Ok((out, Shape::from(c)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = l1.shape().dims2()?.1;
        Ok((crate::model::cuda::fused::column_dot((s1, l1), (s2, l2))?, Shape::from(c)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};

    use super::*;
    use crate::model::ops::testing::{assert_close, check_grads, rand};

    /// In bf16 (the GPU formulation on the CPU) each op's result is its f32 reference on the
    /// inputs widened, rounded once to bf16, bit for bit.
    #[test]
    fn bf16_references_are_the_f32_ones_rounded_once() {
        let mut rng = fastrand::Rng::with_seed(17);
        let (x, g, sc) = (
            rand(&mut rng, &[37, 24], 2.0, DType::BF16),
            rand(&mut rng, &[37, 24], 1.0, DType::BF16),
            rand(&mut rng, &[24], 1.5, DType::BF16),
        );
        let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let bits = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        crate::model::with_gpu_formulation(|| {
            let cases: [(&str, Tensor, Tensor); 2] = [
                ("scale_cols", scale_cols(&x, &sc).unwrap(), scale_cols(&wide(&x), &wide(&sc)).unwrap()),
                ("column_dot", column_dot(&g, &x).unwrap(), column_dot(&wide(&g), &wide(&x)).unwrap()),
            ];
            for (name, got, want) in cases {
                assert_eq!(got.dtype(), DType::BF16, "{name}");
                assert_eq!(bits(&got), bits(&want), "{name}");
            }
        });
    }

    /// Pairs that are not a mixed-precision pair are refused by the ops themselves.
    #[test]
    fn other_dtype_pairs_are_refused() {
        let mut rng = fastrand::Rng::with_seed(29);
        let base = rand(&mut rng, &[70, 24], 2.0, DType::F64);
        let s = rand(&mut rng, &[24], 2.0, DType::F64);
        crate::model::with_gpu_formulation(|| {
            let g16 = rand(&mut rng, &[70, 24], 1.0, DType::F16);
            assert!(column_dot(&base, &g16).is_err());
            assert!(base.apply_op2_no_bwd(&s, &ScaleCols(DType::F16)).is_err());
        });
    }

    #[test]
    fn scale_cols_matches_a_broadcast_multiply_forward_and_backward() {
        let mut rng = fastrand::Rng::with_seed(30);
        let (x, s) = (rand(&mut rng, &[130, 12], 2.0, DType::F64), rand(&mut rng, &[12], 1.5, DType::F64));
        let fused = |t: &[Tensor]| scale_cols(&t[0], &t[1]);
        let reference = |t: &[Tensor]| t[0].broadcast_mul(&t[1]);
        assert_close(&fused(&[x.clone(), s.clone()]).unwrap(), &reference(&[x.clone(), s.clone()]).unwrap(), 1e-12, "scale_cols");
        check_grads(&fused, &reference, &[x, s], "scale_cols");
    }
}
