//! The scaled residual add: for `base`, `x` `(N, C)` and a per-channel `s` `(C,)` (the
//! attention and MLP output scales, the U-Net skip weights),
//!
//! ```text
//! y[n, c] = base[n, c] + x[n, c] * s[c]
//! dbase = g;   dx[n, c] = g[n, c] * s[c];   ds[c] = sum_n g[n, c] * x[n, c]
//! ```
//!
//! `x` may be the narrower dtype of a mixed pair (a bf16 product added to the f32 stream).
//!
//! - reference: `base + x.broadcast_mul(s)` (the fallback off the CPU and GPU paths);
//! - CPU kernel: [`forward_rows`] and [`backward_rows`], [`ROWS`] rows per rayon task, `ds`
//!   summed in f64 per task and the tasks' sums added in order; [`ScaleAdd`] (the model's op)
//!   and the engine's `CpuBackend` both call them;
//! - GPU: `scale_add` of `kernels/fused.cu`; backward [`super::scale_cols`] and `column_dot`.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

#[cfg(feature = "candle")]
use super::scale_cols::{ScaleCols, column_dot};
#[cfg(feature = "candle")]
use super::{check_float, last_dim, mixed_pair, same_dtypes};
#[cfg(feature = "candle")]
use crate::model::host::convert::{float_dispatch, narrowed, widened, wrap};
#[cfg(feature = "candle")]
use crate::model::host::rows::{Held, elems, elems_as, tensor_from_f64};
use crate::model::host::rows::{ROWS, add_partials};
use crate::model::host::simd::{Real, multiversion};

/// `base + x * s` for `base` and `x` of the same shape `(.., C)` and a per-channel `s` of shape
/// `(C,)`: `base + x.broadcast_mul(s)`, in `base`'s dtype.
///
/// `x` may be of the narrower dtype of a mixed-precision pair (a bf16 product added to the f32
/// residual stream): on the GPU path one kernel reads it as it is and the backward pass writes
/// its gradient in that dtype, the values of `cast` then `scale_add` without either cast pass.
#[cfg(feature = "candle")]
pub fn scale_add(base: &Tensor, x: &Tensor, s: &Tensor) -> Result<Tensor> {
    let on_gpu = crate::model::gpu_path(base);
    if x.dtype() != base.dtype() && !(on_gpu && mixed_pair(base.dtype(), x.dtype())) {
        return scale_add(base, &super::cast::cast(x, base.dtype())?, s);
    }
    if !base.device().is_cpu() && !on_gpu {
        return base + x.broadcast_mul(s)?;
    }
    if !on_gpu {
        check_float("scale_add", base.dtype())?;
    }
    same_dtypes("scale_add", &[base, s])?;
    let c = last_dim(base)?;
    if x.dims() != base.dims() || s.dims() != [c] {
        bail!("scale_add: base {:?}, x {:?} and scale {:?} do not fit (.., C), (.., C), (C,)", base.shape(), x.shape(), s.shape());
    }
    base.contiguous()?.apply_op3(&x.contiguous()?, &s.contiguous()?, ScaleAdd)
}

/// The GPU backward pass of [`ScaleAdd`]: `(dbase, dx, ds)`, `dx` in `x`'s dtype (narrower
/// under mixed precision: written so by the kernel).
#[cfg(feature = "candle")]
fn scale_add_bwd_gpu(x: &Tensor, s: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let dx = grad.apply_op2_no_bwd(s, &ScaleCols(x.dtype()))?;
    let ds = column_dot(&grad, x)?;
    Ok((grad, dx, ds))
}

#[cfg(feature = "candle")]
struct ScaleAdd;

/// `out += x * s` on rows: `out` holds `base` and receives `base + x * s`.
#[inline(always)]
fn scale_add_kernel<T: Real>(x: &[T], s: &[T], out: &mut [T]) {
    let c = s.len();
    for (o, x) in out.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
        for ((o, &x), &s) in o.iter_mut().zip(x).zip(s) {
            *o += x * s;
        }
    }
}

multiversion! {
    /// Rows of `base + x * s`, in place.
    fn scale_add_rows = scale_add_kernel(x: &[T], s: &[T], out: &mut [T]);
}

/// `dx = g * s` into `dx`; adds `g * x` to the per-channel sums `ds`.
#[inline(always)]
fn scale_add_bwd_kernel<T: Real>(g: &[T], x: &[T], s: &[T], dx: &mut [T], ds: &mut [f64]) {
    let c = s.len();
    for ((dx, g), x) in dx.chunks_exact_mut(c).zip(g.chunks_exact(c)).zip(x.chunks_exact(c)) {
        for ((((dx, &g), &x), &s), ds) in dx.iter_mut().zip(g).zip(x).zip(s).zip(ds.iter_mut()) {
            *dx = g * s;
            *ds += (g * x).to_f64();
        }
    }
}

multiversion! {
    /// Gradient rows of `scale_add`.
    fn scale_add_bwd_rows = scale_add_bwd_kernel(g: &[T], x: &[T], s: &[T], dx: &mut [T], ds: &mut [f64]);
}

/// The forward pass on the CPU, for the model's op and the engine's backend: `out += x * s`
/// per channel (`out` holds `base`), [`ROWS`] rows per rayon task.
pub(crate) fn forward_rows<T: Real>(x: &[T], s: &[T], out: &mut [T]) {
    let c = s.len();
    out.par_chunks_mut(ROWS * c).zip(x.par_chunks(ROWS * c)).for_each(|(o, x)| scale_add_rows(x, s, o));
}

/// The backward pass on the CPU, for the model's op and the engine's backend: `dx = g * s`
/// written; returns `ds` in f64, summed per block of [`ROWS`] rows and the blocks added in order.
pub(crate) fn backward_rows<T: Real>(g: &[T], x: &[T], s: &[T], dx: &mut [T]) -> Vec<f64> {
    let c = s.len();
    let parts: Vec<Vec<f64>> = dx
        .par_chunks_mut(ROWS * c)
        .zip(g.par_chunks(ROWS * c))
        .zip(x.par_chunks(ROWS * c))
        .map(|((dx, g), x)| {
            let mut ds = vec![0.0; c];
            scale_add_bwd_rows(g, x, s, dx, &mut ds);
            ds
        })
        .collect();
    add_partials(parts, c)
}

#[cfg(feature = "candle")]
fn scale_add_fwd<T: Real>(base: &[T], x: &[T], s: &[T]) -> Vec<T> {
    let mut out = base.to_vec();
    forward_rows(x, s, &mut out);
    out
}

#[cfg(feature = "candle")]
fn scale_add_bwd<T: Real>(x: &Tensor, s: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let (xh, sh, gh) = (Held::new(x), Held::new(s), Held::new(&grad));
    let (xv, sv, gv) = (xh.slice::<T>("x")?, sh.slice::<T>("scale")?, gh.slice::<T>("grad")?);
    let mut dx = vec![T::from_f64(0.0); xv.len()];
    let sums = backward_rows(gv, xv, sv, &mut dx);
    let ds = tensor_from_f64::<T>(&sums, sv.len())?;
    Ok((Tensor::from_vec(dx, x.shape(), &Device::Cpu)?, ds))
}

#[cfg(feature = "candle")]
impl CustomOp3 for ScaleAdd {
    fn name(&self) -> &'static str {
        "fused-scale-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if s1.dtype() == DType::BF16 {
            return narrowed(self.cpu_fwd(&widened(s1), l1, &widened(s2), l2, &widened(s3), l3)?);
        }
        // `x` may be narrower (a mixed pair, checked by `scale_add`): it widens exactly.
        let out =
            float_dispatch!(s1.dtype(), "scale_add", |T| wrap(scale_add_fwd::<T>(elems(s1, l1)?, &elems_as(s2, l2)?, elems(s3, l3)?)));
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let c = l3.shape().elem_count();
        let out = crate::model::cuda::fused::rows_op_mixed("scale_add", &[(s1, l1), (s2, l2)], &[(s3, l3)], s1.dtype(), c, 0.0, &[])?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _base: &Tensor,
        x: &Tensor,
        s: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if crate::model::gpu_path(x) {
            let (dbase, dx, ds) = scale_add_bwd_gpu(x, s, grad)?;
            return Ok((Some(dbase), Some(dx), Some(ds)));
        }
        // Off the GPU path `scale_add` cast x to base's dtype, so all three share it here.
        let (dx, ds) = float_dispatch!(x.dtype(), "scale_add", |T| scale_add_bwd::<T>(x, s, grad)?);
        Ok((Some(grad.clone()), Some(dx), Some(ds)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Result, Tensor};

    use super::*;
    use crate::model::ops::testing::{Loss, assert_close, check_finite_differences, check_grads, grads, rand};

    fn scale_add_ref(x: &[Tensor]) -> Result<Tensor> {
        &x[0] + x[1].broadcast_mul(&x[2])?
    }

    #[test]
    fn scale_add_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(21);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
            // 150 rows: two full blocks of rows and a partial one.
            let (base, x) = (rand(&mut rng, &[150, 12], 2.0, dtype), rand(&mut rng, &[150, 12], 2.0, dtype));
            let s = rand(&mut rng, &[12], 1.5, dtype);
            let ins = [base.clone(), x.clone(), s.clone()];
            assert_close(&scale_add(&base, &x, &s).unwrap(), &scale_add_ref(&ins).unwrap(), tol, "scale_add");
        }
    }

    #[test]
    fn scale_add_gradients_match_the_reference_and_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(22);
        let (base, x) = (rand(&mut rng, &[2, 75, 6], 2.0, DType::F64), rand(&mut rng, &[2, 75, 6], 2.0, DType::F64));
        let s = rand(&mut rng, &[6], 1.5, DType::F64);
        let fused = |x: &[Tensor]| scale_add(&x[0], &x[1], &x[2]);
        check_grads(&fused, &scale_add_ref, &[base, x, s], "scale_add");
        let (base, x) = (rand(&mut rng, &[3, 4], 2.0, DType::F64), rand(&mut rng, &[3, 4], 2.0, DType::F64));
        let s = rand(&mut rng, &[4], 1.5, DType::F64);
        check_finite_differences(&|x| scale_add(&x[0], &x[1], &x[2]), &[base, x, s], "scale_add");
    }

    /// A narrow product added to a wide stream gives exactly what a cast and the one-dtype op
    /// give, forward and backward, and the gradients come back in each input's dtype. Run on
    /// the GPU path with f64 playing f32's part and f32 bf16's, so that the CPU implementation
    /// the GPU kernel is checked against (`pipeline parity`) is the one running here.
    #[test]
    fn mixed_precision_equals_a_cast_then_the_op() {
        let mut rng = fastrand::Rng::with_seed(29);
        let (wide, narrow) = (DType::F64, DType::F32);
        let base = rand(&mut rng, &[70, 24], 2.0, wide);
        let x = rand(&mut rng, &[70, 24], 2.0, narrow);
        let s = rand(&mut rng, &[24], 2.0, wide);
        let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        crate::model::with_gpu_formulation(|| {
            let fused = |t: &[Tensor]| scale_add(&t[0], &t[1], &t[2]);
            let composite = |t: &[Tensor]| scale_add(&t[0], &t[1].to_dtype(wide)?, &t[2]);
            let inputs = [base.clone(), x.clone(), s.clone()];
            assert_eq!(fused(&inputs).unwrap().dtype(), wide);
            assert_eq!(bits(&fused(&inputs).unwrap()), bits(&composite(&inputs).unwrap()), "scale_add forward");
            let (gf, gc) = (grads(&fused, &inputs, Loss::Weighted), grads(&composite, &inputs, Loss::Weighted));
            for (i, (a, b)) in gf.iter().zip(&gc).enumerate() {
                assert_eq!(a.dtype(), inputs[i].dtype(), "scale_add gradient {i} dtype");
                assert_eq!(bits(a), bits(b), "scale_add gradient {i}");
            }
        });
        // Off the GPU path the same call takes the composite: equal values, no error.
        let off = scale_add(&base, &x, &s).unwrap();
        assert_eq!(bits(&off), bits(&scale_add(&base, &x.to_dtype(wide).unwrap(), &s).unwrap()));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(28);
        let x = rand(&mut rng, &[4, 6], 1.0, DType::F32);
        assert!(scale_add(&x, &x, &rand(&mut rng, &[5], 1.0, DType::F32)).is_err());
    }
}
