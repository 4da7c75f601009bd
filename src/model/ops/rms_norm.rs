//! RMS norm over the last dimension, without a weight: for a row `x` of `d` values,
//!
//! ```text
//! r  = sqrt(sum(x^2) / d + eps)          (eps: the dtype's machine epsilon, `rms_eps`)
//! y  = x / r
//! dx = g / r - x * sum(g * x) / (d * r^3)
//! ```
//!
//! - reference: [`rms_norm_reference`] / [`rms_norm_eps`], candle composites;
//! - CPU kernel: [`RmsNorm`] and [`RmsNormBwd`] on any layout whose rows are contiguous,
//!   [`RMS_ROWS`] rows per rayon task (bf16 rows run in f32 and are rounded once);
//! - GPU: `rms_norm_fwd` / `_bwd` of `kernels/fused.cu`;
//! - [`rms_norm_to`]: the norm with its output in the narrower dtype of a mixed-precision pair
//!   ([`RmsNormTo`]), one kernel each way on the GPU path instead of a norm and a cast.

use candle_core::DType;
#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp1, CustomOp2, D, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

#[cfg(feature = "candle")]
use super::{check_float, mixed_pair, same_or_narrower};
#[cfg(feature = "candle")]
use crate::model::host::convert::{self, to_storage, values_as};
use crate::model::host::rows::Rows;
#[cfg(feature = "candle")]
use crate::model::host::rows::{row_offsets, unit_last};
use crate::model::host::simd::{Real, dot_f64, multiversion};

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
#[cfg(feature = "candle")]
pub fn rms_norm_reference(x: &Tensor) -> Result<Tensor> {
    rms_norm_eps(x, rms_eps(x.dtype()))
}

/// [`rms_norm_reference`] with the given `eps`.
#[cfg(feature = "candle")]
pub fn rms_norm_eps(x: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)
}

/// RMS norm over the last dimension, no weight: `x / sqrt(mean(x^2) + eps)` with
/// `eps = rms_eps(dtype)`, as [`ops::rms_norm`]. Any layout whose last dimension is
/// contiguous (such as `(B, T, H, D)` transposed to `(B, H, T, D)`) is read without a copy.
#[cfg(feature = "candle")]
pub fn rms_norm(x: &Tensor) -> Result<Tensor> {
    if crate::model::gpu_path(x) && x.rank() > 0 {
        // The GPU kernel reads contiguous rows.
        return x.contiguous()?.apply_op1(RmsNorm);
    }
    if !x.device().is_cpu() {
        return rms_norm_reference(x);
    }
    check_float("rms_norm", x.dtype())?;
    if x.rank() == 0 {
        bail!("rms_norm: needs at least one dimension");
    }
    unit_last(x)?.apply_op1(RmsNorm)
}

/// [`rms_norm`] with its output in `dtype`: `cast(&rms_norm(x)?, dtype)`, as one op on the
/// GPU path when `dtype` is the narrower of a mixed-precision pair (f32 -> bf16 on a GPU, f64 ->
/// f32 for the formulation's checks on the CPU): the kernel writes the narrow rows and its
/// backward pass reads the narrow gradient, so neither direction runs a separate cast pass. The
/// values are those of the composite (norm in `x`'s dtype, then one rounding).
#[cfg(feature = "candle")]
pub fn rms_norm_to(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return rms_norm(x);
    }
    if crate::model::gpu_path(x) && x.rank() > 0 && mixed_pair(x.dtype(), dtype) {
        return x.contiguous()?.apply_op1(RmsNormTo(dtype));
    }
    super::cast::cast(&rms_norm(x)?, dtype)
}

#[cfg(feature = "candle")]
struct RmsNorm;

/// Rows per rayon task.
const RMS_ROWS: usize = 64;

/// Forward rows: `y = x / r`, then `y * scale` when `scale != 1` (the engine's pre-norm scale;
/// the model passes 1, which skips the product); `1 / r` into `rstd` when given (the engine saves
/// it for the backward pass).
#[inline(always)]
fn rms_fwd_kernel<T: Real>(x: Rows<'_, T>, eps: f64, scale: f64, out: &mut [T], mut rstd: Option<&mut [T]>) {
    let d = x.len;
    let s = T::from_f64(scale);
    for (r, y) in out.chunks_exact_mut(d).enumerate() {
        let row = x.row(r);
        let rms = (dot_f64(row, row) / d as f64 + eps).sqrt();
        if let Some(rstd) = rstd.as_deref_mut() {
            rstd[r] = T::from_f64(1.0 / rms);
        }
        let rms = T::from_f64(rms);
        for (y, &x) in y.iter_mut().zip(row) {
            *y = x / rms;
        }
        if scale != 1.0 {
            for y in y.iter_mut() {
                *y *= s;
            }
        }
    }
}

multiversion! {
    /// RMS norm of the rows of `x`.
    fn rms_fwd_rows = rms_fwd_kernel(x: Rows<'_, T>, eps: f64, scale: f64, out: &mut [T], rstd: Option<&mut [T]>);
}

/// `dx (+)= scale (g / r - x sum(g x) / (d r^3))`, that is `scale (g - y mean(g y)) / r` with
/// `y = x / r`; `r` recomputed from `x` (the model) or `1 / rstd` as the forward pass saved it
/// (the engine). With `scale = 1` the products by it are exact: the model's arithmetic.
#[inline(always)]
fn rms_bwd_kernel<T: Real>(x: Rows<'_, T>, g: Rows<'_, T>, rstd: Option<&[T]>, eps: f64, scale: f64, acc: bool, out: &mut [T]) {
    let d = x.len;
    for (r, dx) in out.chunks_exact_mut(d).enumerate() {
        let (xr, gr) = (x.row(r), g.row(r));
        let rms = match rstd {
            Some(rstd) => 1.0 / rstd[r].to_f64(),
            None => (dot_f64(xr, xr) / d as f64 + eps).sqrt(),
        };
        let a = T::from_f64(scale / rms);
        let c = T::from_f64(scale * dot_f64(xr, gr) / (d as f64 * rms * rms * rms));
        if acc {
            for ((dx, &x), &g) in dx.iter_mut().zip(xr).zip(gr) {
                *dx += g * a - x * c;
            }
        } else {
            for ((dx, &x), &g) in dx.iter_mut().zip(xr).zip(gr) {
                *dx = g * a - x * c;
            }
        }
    }
}

multiversion! {
    /// RMS norm gradient rows.
    fn rms_bwd_rows = rms_bwd_kernel(x: Rows<'_, T>, g: Rows<'_, T>, rstd: Option<&[T]>, eps: f64, scale: f64, acc: bool, out: &mut [T]);
}

/// The forward pass on the CPU, for the model's op and the engine's backend: the rows of `x`
/// normed (then scaled by `scale`) into `out` (`x.count()` rows of `x.len`), `1 / r` of each row
/// into `rstd` when given. [`RMS_ROWS`] rows per rayon task.
pub(crate) fn forward_rows<T: Real>(x: Rows<'_, T>, out: &mut [T], rstd: Option<&mut [T]>, scale: f64, eps: f64) {
    let d = x.len;
    if d == 0 {
        return;
    }
    match rstd {
        Some(rstd) => out.par_chunks_mut(RMS_ROWS * d).zip(rstd.par_chunks_mut(RMS_ROWS)).enumerate().for_each(|(c, (out, r))| {
            rms_fwd_rows(x.sub(c * RMS_ROWS..c * RMS_ROWS + out.len() / d), eps, scale, out, Some(r));
        }),
        None => out.par_chunks_mut(RMS_ROWS * d).enumerate().for_each(|(c, out)| {
            rms_fwd_rows(x.sub(c * RMS_ROWS..c * RMS_ROWS + out.len() / d), eps, scale, out, None);
        }),
    }
}

/// The backward pass on the CPU, for the model's op and the engine's backend: `dx` of the rows
/// of `x` given their gradient rows `g`, written (`acc` false) or added (`acc` true) into `out`;
/// `r` from `rstd` (`1 / r` per row) when given, else recomputed with `eps`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_rows<T: Real>(x: Rows<'_, T>, g: Rows<'_, T>, rstd: Option<&[T]>, out: &mut [T], scale: f64, eps: f64, acc: bool) {
    let d = x.len;
    if d == 0 {
        return;
    }
    out.par_chunks_mut(RMS_ROWS * d).enumerate().for_each(|(c, out)| {
        let rows = c * RMS_ROWS..c * RMS_ROWS + out.len() / d;
        let r = rstd.map(|r| &r[rows.clone()]);
        rms_bwd_rows(x.sub(rows.clone()), g.sub(rows), r, eps, scale, acc, out);
    });
}

/// RMS norm rows with `eps`: the epsilon of the input's dtype ([`ops::rms_eps`]), which for bf16
/// rows computed in f32 is bf16's.
#[cfg(feature = "candle")]
fn rms_fwd<T: Real>(x: &[T], rows: &[usize], d: usize, eps: f64) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); rows.len() * d];
    forward_rows(Rows { data: x, offsets: rows, len: d }, &mut out, None, 1.0, eps);
    out
}

/// Gradient rows of RMS norm: `x` and `g` rows at the given offsets, `d` wide.
#[cfg(feature = "candle")]
fn rms_bwd<T: Real>(x: &[T], xrows: &[usize], g: &[T], grows: &[usize], d: usize, eps: f64) -> Vec<T> {
    let (xr, gr) = (Rows { data: x, offsets: xrows, len: d }, Rows { data: g, offsets: grows, len: d });
    let mut out = vec![T::from_f64(0.0); xrows.len() * d];
    backward_rows(xr, gr, None, &mut out, 1.0, eps, false);
    out
}

#[cfg(feature = "candle")]
impl CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let rows = row_offsets(l)?;
        let d = l.dims().last().copied().unwrap_or(0);
        // The epsilon of the dtype held, as the kernel's: bf16 rows run in f32 with bf16's, and
        // their output is rounded once.
        let eps = rms_eps(s.dtype());
        let out = match &*convert::widened(s) {
            CpuStorage::F32(x) => CpuStorage::F32(rms_fwd(x, &rows, d, eps)),
            CpuStorage::F64(x) => CpuStorage::F64(rms_fwd(x, &rows, d, eps)),
            s => bail!("rms_norm: unsupported dtype {:?}", s.dtype()),
        };
        let out = (out, l.shape().clone());
        if s.dtype() == DType::BF16 { convert::narrowed(out) } else { Ok(out) }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = l.dims().last().copied().unwrap_or(0);
        let out = crate::model::cuda::fused::rows_op("rms_norm_fwd", &[(s, l)], d, rms_eps(s.dtype()) as f32)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The GPU kernel reads contiguous rows (`x` is: the forward pass made it so); the CPU
        // reads any layout whose last dimension is contiguous.
        let grad = if crate::model::gpu_path(x) { grad.contiguous()? } else { unit_last(grad)? };
        Ok(Some(x.apply_op2_no_bwd(&grad, &RmsNormBwd)?))
    }
}

/// RMS norm with its output in the dtype held: [`rms_norm_to`]'s op. The CPU implementation
/// (norm in the input's dtype, then one rounding) is the mixed kernel's reference.
#[cfg(feature = "candle")]
struct RmsNormTo(DType);

#[cfg(feature = "candle")]
impl CustomOp1 for RmsNormTo {
    fn name(&self) -> &'static str {
        "fused-rms-norm-to"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let rows = row_offsets(l)?;
        let d = l.dims().last().copied().unwrap_or(0);
        let out = match s {
            CpuStorage::F32(x) => to_storage(&rms_fwd(x, &rows, d, rms_eps(DType::F32)), self.0)?,
            CpuStorage::F64(x) => to_storage(&rms_fwd(x, &rows, d, rms_eps(DType::F64)), self.0)?,
            s => bail!("rms_norm_to: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        if !mixed_pair(s.dtype(), self.0) {
            bail!("rms_norm_to: no GPU kernel from {:?} to {:?}", s.dtype(), self.0);
        }
        let d = l.dims().last().copied().unwrap_or(0);
        let out = crate::model::cuda::fused::rows_op_mixed("rms_norm_fwd", &[(s, l)], &[], self.0, d, rms_eps(s.dtype()) as f32, &[])?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The gradient arrives in the narrow dtype; dx is in x's.
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &RmsNormBwd)?))
    }
}

/// `(x, grad) -> dx`: [`RmsNorm`]'s backward pass, on the CPU (the GPU kernel's reference) or
/// the GPU. `grad` may be of the narrower dtype of a mixed pair ([`RmsNormTo`]'s); `dx` is in
/// `x`'s.
#[cfg(feature = "candle")]
struct RmsNormBwd;

#[cfg(feature = "candle")]
impl CustomOp2 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "fused-rms-norm-bwd"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        if xl.dims() != gl.dims() {
            bail!("rms_norm backward: gradient {:?} for input {:?}", gl.shape(), xl.shape());
        }
        let (xrows, grows) = (row_offsets(xl)?, row_offsets(gl)?);
        let d = xl.dims().last().copied().unwrap_or(0);
        if !same_or_narrower(xs.dtype(), gs.dtype()) {
            bail!("rms_norm backward: unsupported dtypes {:?}, {:?}", xs.dtype(), gs.dtype());
        }
        // As the forward pass: the epsilon of x's dtype, bf16 in f32 and rounded once.
        let eps = rms_eps(xs.dtype());
        let out = match &*convert::widened(xs) {
            CpuStorage::F32(x) => CpuStorage::F32(rms_bwd(x, &xrows, &values_as::<f32>(gs)?, &grows, d, eps)),
            CpuStorage::F64(x) => CpuStorage::F64(rms_bwd(x, &xrows, &values_as::<f64>(gs)?, &grows, d, eps)),
            _ => bail!("rms_norm backward: unsupported dtypes {:?}, {:?}", xs.dtype(), gs.dtype()),
        };
        let out = (out, xl.shape().clone());
        if xs.dtype() == DType::BF16 { convert::narrowed(out) } else { Ok(out) }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = xl.dims().last().copied().unwrap_or(0);
        if !same_or_narrower(xs.dtype(), gs.dtype()) {
            bail!("rms_norm backward: no GPU kernel for x {:?} with gradient {:?}", xs.dtype(), gs.dtype());
        }
        let eps = rms_eps(xs.dtype()) as f32;
        let out = crate::model::cuda::fused::rows_op_mixed("rms_norm_bwd", &[(xs, xl), (gs, gl)], &[], xs.dtype(), d, eps, &[])?;
        Ok((out, xl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::model::ops::testing::{Loss, assert_close, assert_near, check_finite_differences, check_grads, flat, grads, rand};

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn rms_norm_matches_hand_values() {
        // Row [3, 4]: mean square 12.5, so [3, 4] / sqrt(12.5).
        let y = rms_norm_reference(&t(&[3.0, 4.0, 0.0, 0.0], &[2, 2])).unwrap().to_vec2::<f64>().unwrap();
        assert!((y[0][0] - 3.0 / 12.5f64.sqrt()).abs() < 1e-12 && (y[0][1] - 4.0 / 12.5f64.sqrt()).abs() < 1e-12);
        assert_eq!(y[1], vec![0.0, 0.0]);
    }

    #[test]
    fn rms_norm_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(4);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let x = rand(&mut rng, &[3, 5, 7], 3.0, dtype);
            assert_close(&rms_norm(&x).unwrap(), &rms_norm_reference(&x).unwrap(), tol, &format!("{dtype:?} contiguous"));
            // Heads transposed as in the model: the last dimension stays contiguous.
            let x = rand(&mut rng, &[2, 7, 3, 8], 3.0, dtype).transpose(1, 2).unwrap();
            assert_close(&rms_norm(&x).unwrap(), &rms_norm_reference(&x).unwrap(), tol, &format!("{dtype:?} transposed"));
            // A last dimension with stride != 1 is copied first.
            let x = rand(&mut rng, &[4, 6], 3.0, dtype).t().unwrap();
            assert_close(&rms_norm(&x).unwrap(), &rms_norm_reference(&x).unwrap(), tol, &format!("{dtype:?} strided rows"));
        }
        let zeros = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(flat(&rms_norm(&zeros).unwrap()), vec![0.0; 6]);
    }

    #[test]
    fn rms_norm_gradients_match_the_reference() {
        let mut rng = fastrand::Rng::with_seed(5);
        let x = rand(&mut rng, &[2, 7, 3, 8], 2.0, DType::F64);
        let fused = |x: &[Tensor]| rms_norm(&x[0].transpose(1, 2)?);
        let reference = |x: &[Tensor]| rms_norm_reference(&x[0].transpose(1, 2)?);
        check_grads(&fused, &reference, &[x], "rms_norm");
    }

    /// The backward op a GPU forward pass hands its gradient to (its CPU implementation is the
    /// GPU kernel's reference) gives the CPU backward pass's gradient.
    #[test]
    fn rms_norm_backward_op_matches_autograd() {
        let mut rng = fastrand::Rng::with_seed(9);
        for dtype in [DType::F64, DType::F32] {
            let x = candle_core::Var::from_tensor(&rand(&mut rng, &[5, 3, 9], 2.0, dtype)).unwrap();
            let g = rand(&mut rng, &[5, 3, 9], 1.0, dtype);
            let want = (rms_norm(x.as_tensor()).unwrap() * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let got = x.as_tensor().apply_op2_no_bwd(&g, &RmsNormBwd).unwrap();
            for (a, b) in flat(&got).iter().zip(flat(want.get(x.as_tensor()).unwrap())) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{dtype:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn rms_norm_gradients_match_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(6);
        let x = rand(&mut rng, &[3, 5], 2.0, DType::F64);
        check_finite_differences(&|x| rms_norm(&x[0]), &[x], "rms_norm");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(10);
        assert!(rms_norm(&rand(&mut rng, &[2, 3], 1.0, DType::F16)).is_err());
    }

    /// The norm into a narrower dtype gives exactly what the norm then a cast give, forward
    /// and backward, its gradient in the input's dtype. Run on the GPU path with f64 playing
    /// f32's part and f32 bf16's, so that the CPU implementation the GPU kernel is checked
    /// against (`pipeline parity`) is the one running here.
    #[test]
    fn rms_norm_to_equals_the_norm_then_a_cast() {
        let mut rng = fastrand::Rng::with_seed(29);
        let (wide, narrow) = (DType::F64, DType::F32);
        let base = rand(&mut rng, &[70, 24], 2.0, wide);
        let bits = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        crate::model::with_gpu_formulation(|| {
            let fused = |t: &[Tensor]| rms_norm_to(&t[0], narrow);
            let composite = |t: &[Tensor]| rms_norm(&t[0])?.to_dtype(narrow);
            let inputs = [base.clone()];
            assert_eq!(fused(&inputs).unwrap().dtype(), narrow);
            assert_eq!(bits(&fused(&inputs).unwrap()), bits(&composite(&inputs).unwrap()), "rms_norm_to forward");
            let (gf, gc) = (grads(&fused, &inputs, Loss::Weighted), grads(&composite, &inputs, Loss::Weighted));
            assert_eq!(gf[0].dtype(), wide);
            assert_eq!(bits(&gf[0]), bits(&gc[0]), "rms_norm_to gradient");
        });
        // Off the GPU path the same call takes the composite: equal values, no error.
        let off = rms_norm_to(&base, narrow).unwrap();
        assert_eq!((off.dtype(), bits(&off)), (narrow, bits(&rms_norm(&base).unwrap().to_dtype(narrow).unwrap())));
    }

    /// The kernels as compiled for the baseline target give the dispatched ones' results.
    #[test]
    fn baseline_kernels_match_the_dispatched_ones() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (rows, v) = (6usize, 37usize);
        let data: Vec<f32> = (0..rows * v).map(|_| rng.f32() * 40.0 - 20.0).collect();
        let offsets: Vec<usize> = (0..rows).map(|r| r * v).collect();
        let x = Rows { data: &data, offsets: &offsets, len: v };
        let (mut a, mut b) = (vec![0.0f32; rows * v], vec![0.0f32; rows * v]);
        rms_fwd_kernel(x, rms_eps(DType::F32), 1.0, &mut a, None);
        rms_fwd_rows(x, rms_eps(DType::F32), 1.0, &mut b, None);
        assert_near(&a, &b, "rms forward");
        let (mut a, mut b) = (vec![0.0f32; rows * v], vec![0.0f32; rows * v]);
        rms_bwd_kernel(x, x, None, rms_eps(DType::F32), 1.0, false, &mut a);
        rms_bwd_rows(x, x, None, rms_eps(DType::F32), 1.0, false, &mut b);
        assert_near(&a, &b, "rms backward");
    }
}
