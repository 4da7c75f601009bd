//! The residual mix at the start of each block: for the stream `h`, the embedding stream `x0`
//! (both `(N, C)`) and `mix` `(2, C)`,
//!
//! ```text
//! y[n, c] = h[n, c] * mix[0, c] + x0[n, c] * mix[1, c]
//! dh = g * mix[0];   dx0 = g * mix[1];   dmix[0, c] = sum_n g h;   dmix[1, c] = sum_n g x0
//! ```
//!
//! - reference: the broadcasting composite (the fallback off the CPU and GPU paths);
//! - CPU kernel: [`forward_rows`] and [`backward_rows`], [`ROWS`] rows per rayon task, `dmix`
//!   summed in f64 per task and the tasks' sums added in order; [`ResidMix`] (the model's op)
//!   and the engine's `CpuBackend` both call them;
//! - GPU: `resid_mix` of `kernels/fused.cu`; backward [`super::scale_cols`] and `column_dot`.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

#[cfg(feature = "candle")]
use super::scale_cols::{ScaleCols, column_dot};
#[cfg(feature = "candle")]
use super::{check_float, last_dim, same_dtypes};
#[cfg(feature = "candle")]
use crate::model::host::convert::{float_dispatch, narrowed, widened, wrap};
#[cfg(feature = "candle")]
use crate::model::host::rows::{Held, elems, tensor_from_f64};
use crate::model::host::rows::{ROWS, add_partials};
use crate::model::host::simd::{Real, multiversion};

/// The residual mix `h * mix[0] + x0 * mix[1]` for `h` and `x0` of the same shape `(.., C)` and
/// `mix` of shape `(2, C)`.
#[cfg(feature = "candle")]
pub fn resid_mix(h: &Tensor, x0: &Tensor, mix: &Tensor) -> Result<Tensor> {
    let on_gpu = crate::model::gpu_path(h);
    if !h.device().is_cpu() && !on_gpu {
        return h.broadcast_mul(&mix.get(0)?)? + x0.broadcast_mul(&mix.get(1)?)?;
    }
    if !on_gpu {
        check_float("resid_mix", h.dtype())?;
    }
    same_dtypes("resid_mix", &[h, x0, mix])?;
    let c = last_dim(h)?;
    if x0.dims() != h.dims() || mix.dims() != [2, c] {
        bail!("resid_mix: h {:?}, x0 {:?} and mix {:?} do not fit (.., C), (.., C), (2, C)", h.shape(), x0.shape(), mix.shape());
    }
    h.contiguous()?.apply_op3(&x0.contiguous()?, &mix.contiguous()?, ResidMix)
}

/// The GPU backward pass of [`ResidMix`]: `(dh, dx0, dmix)`.
#[cfg(feature = "candle")]
fn resid_mix_bwd_gpu(h: &Tensor, x0: &Tensor, mix: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let dh = grad.apply_op2_no_bwd(&mix.get(0)?, &ScaleCols(h.dtype()))?;
    let dx0 = grad.apply_op2_no_bwd(&mix.get(1)?, &ScaleCols(x0.dtype()))?;
    let dmix = Tensor::stack(&[column_dot(&grad, h)?, column_dot(&grad, x0)?], 0)?;
    Ok((dh, dx0, dmix))
}

#[cfg(feature = "candle")]
struct ResidMix;

#[inline(always)]
fn mix_kernel<T: Real>(h: &[T], x0: &[T], m0: &[T], m1: &[T], out: &mut [T]) {
    let c = m0.len();
    for ((o, h), x0) in out.chunks_exact_mut(c).zip(h.chunks_exact(c)).zip(x0.chunks_exact(c)) {
        for ((((o, &h), &x0), &a), &b) in o.iter_mut().zip(h).zip(x0).zip(m0).zip(m1) {
            *o = h * a + x0 * b;
        }
    }
}

multiversion! {
    /// Rows of the residual mix.
    fn mix_rows = mix_kernel(h: &[T], x0: &[T], m0: &[T], m1: &[T], out: &mut [T]);
}

/// `dh = g * m0`, `dx0 = g * m1` (`dx0 += g * m1` with `acc_dx0`: the engine's first block,
/// whose `x0` is also the stream) for `mix = [m0, m1]`; adds `g * h` and `g * x0` to the sums
/// `dm = [dm0, dm1]`.
#[inline(always)]
fn mix_bwd_kernel<T: Real>(g: &[T], h: &[T], x0: &[T], mix: &[T], dh: &mut [T], (dx0, acc_dx0): (&mut [T], bool), dm: &mut [f64]) {
    let c = mix.len() / 2;
    let (m0, m1) = mix.split_at(c);
    let (dm0, dm1) = dm.split_at_mut(c);
    let rows = dh.chunks_exact_mut(c).zip(dx0.chunks_exact_mut(c)).zip(g.chunks_exact(c)).zip(h.chunks_exact(c)).zip(x0.chunks_exact(c));
    for ((((dh, dx0), g), h), x0) in rows {
        for i in 0..c {
            let gi = g[i];
            dh[i] = gi * m0[i];
            if acc_dx0 {
                dx0[i] += gi * m1[i];
            } else {
                dx0[i] = gi * m1[i];
            }
            dm0[i] += (gi * h[i]).to_f64();
            dm1[i] += (gi * x0[i]).to_f64();
        }
    }
}

multiversion! {
    /// Gradient rows of the residual mix.
    fn mix_bwd_rows = mix_bwd_kernel(g: &[T], h: &[T], x0: &[T], mix: &[T], dh: &mut [T], dx0: (&mut [T], bool), dm: &mut [f64]);
}

/// The forward pass on the CPU, for the model's op and the engine's backend: `out` of the
/// `(rows, C)` matrices `h` and `x0`, `mix` `(2, C)`; [`ROWS`] rows per rayon task.
pub(crate) fn forward_rows<T: Real>(h: &[T], x0: &[T], mix: &[T], out: &mut [T]) {
    let c = mix.len() / 2;
    let (m0, m1) = mix.split_at(c);
    out.par_chunks_mut(ROWS * c).zip(h.par_chunks(ROWS * c)).zip(x0.par_chunks(ROWS * c)).for_each(|((o, h), x0)| {
        mix_rows(h, x0, m0, m1, o);
    });
}

/// The backward pass on the CPU, for the model's op and the engine's backend: `dh` written,
/// `dx0` written (or added to, `acc_dx0`); returns `dmix` `(2, C)` row-major in f64, summed per
/// block of [`ROWS`] rows and the blocks added in order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_rows<T: Real>(g: &[T], h: &[T], x0: &[T], mix: &[T], dh: &mut [T], dx0: &mut [T], acc_dx0: bool) -> Vec<f64> {
    let c = mix.len() / 2;
    let parts: Vec<Vec<f64>> = dh
        .par_chunks_mut(ROWS * c)
        .zip(dx0.par_chunks_mut(ROWS * c))
        .zip(g.par_chunks(ROWS * c))
        .zip(h.par_chunks(ROWS * c))
        .zip(x0.par_chunks(ROWS * c))
        .map(|((((dh, dx0), g), h), x0)| {
            let mut dm = vec![0.0; 2 * c];
            mix_bwd_rows(g, h, x0, mix, dh, (dx0, acc_dx0), &mut dm);
            dm
        })
        .collect();
    add_partials(parts, 2 * c)
}

#[cfg(feature = "candle")]
fn mix_fwd<T: Real>(h: &[T], x0: &[T], mix: &[T]) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); h.len()];
    forward_rows(h, x0, mix, &mut out);
    out
}

#[cfg(feature = "candle")]
fn mix_bwd<T: Real>(h: &Tensor, x0: &Tensor, mix: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let (hh, xh, mh, gh) = (Held::new(h), Held::new(x0), Held::new(mix), Held::new(&grad));
    let (hv, xv, mv, gv) = (hh.slice::<T>("h")?, xh.slice::<T>("x0")?, mh.slice::<T>("mix")?, gh.slice::<T>("grad")?);
    let c = mv.len() / 2;
    let zero = T::from_f64(0.0);
    let (mut dh, mut dx0) = (vec![zero; hv.len()], vec![zero; hv.len()]);
    let sums = backward_rows(gv, hv, xv, mv, &mut dh, &mut dx0, false);
    let dm = tensor_from_f64::<T>(&sums, (2, c))?;
    Ok((Tensor::from_vec(dh, h.shape(), &Device::Cpu)?, Tensor::from_vec(dx0, h.shape(), &Device::Cpu)?, dm))
}

#[cfg(feature = "candle")]
impl CustomOp3 for ResidMix {
    fn name(&self) -> &'static str {
        "fused-resid-mix"
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
        let out = float_dispatch!(s1.dtype(), "resid_mix", |T| wrap(mix_fwd::<T>(elems(s1, l1)?, elems(s2, l2)?, elems(s3, l3)?)));
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
        let c = l3.shape().elem_count() / 2;
        Ok((crate::model::cuda::fused::rows_op_with("resid_mix", &[(s1, l1), (s2, l2)], &[(s3, l3)], c, 0.0, &[])?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        h: &Tensor,
        x0: &Tensor,
        mix: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if crate::model::gpu_path(h) {
            let (dh, dx0, dm) = resid_mix_bwd_gpu(h, x0, mix, grad)?;
            return Ok((Some(dh), Some(dx0), Some(dm)));
        }
        let (dh, dx0, dm) = float_dispatch!(h.dtype(), "resid_mix", |T| mix_bwd::<T>(h, x0, mix, grad)?);
        Ok((Some(dh), Some(dx0), Some(dm)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Result, Tensor};

    use super::*;
    use crate::model::ops::testing::{assert_close, check_finite_differences, check_grads, rand};

    fn mix_ref(x: &[Tensor]) -> Result<Tensor> {
        x[0].broadcast_mul(&x[2].get(0)?)? + x[1].broadcast_mul(&x[2].get(1)?)?
    }

    #[test]
    fn resid_mix_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(21);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
            // 150 rows: two full blocks of rows and a partial one.
            let (base, x) = (rand(&mut rng, &[150, 12], 2.0, dtype), rand(&mut rng, &[150, 12], 2.0, dtype));
            let mix = rand(&mut rng, &[2, 12], 1.5, dtype);
            let ins = [base.clone(), x.clone(), mix.clone()];
            assert_close(&resid_mix(&base, &x, &mix).unwrap(), &mix_ref(&ins).unwrap(), tol, "resid_mix");
        }
    }

    #[test]
    fn resid_mix_gradients_match_the_reference_and_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(22);
        let (base, x) = (rand(&mut rng, &[2, 75, 6], 2.0, DType::F64), rand(&mut rng, &[2, 75, 6], 2.0, DType::F64));
        let mix = rand(&mut rng, &[2, 6], 1.5, DType::F64);
        let fused = |x: &[Tensor]| resid_mix(&x[0], &x[1], &x[2]);
        check_grads(&fused, &mix_ref, &[base.clone(), x.clone(), mix.clone()], "resid_mix");
        // The model's first block mixes the stream with itself.
        let fused = |x: &[Tensor]| resid_mix(&x[0], &x[0], &x[1]);
        let reference = |x: &[Tensor]| mix_ref(&[x[0].clone(), x[0].clone(), x[1].clone()]);
        check_grads(&fused, &reference, &[base, mix], "resid_mix of one stream");
        let (base, x) = (rand(&mut rng, &[3, 4], 2.0, DType::F64), rand(&mut rng, &[3, 4], 2.0, DType::F64));
        let mix = rand(&mut rng, &[2, 4], 1.5, DType::F64);
        check_finite_differences(&|x| resid_mix(&x[0], &x[1], &x[2]), &[base, x, mix], "resid_mix");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(28);
        let x = rand(&mut rng, &[4, 6], 1.0, DType::F32);
        assert!(resid_mix(&x, &x, &rand(&mut rng, &[6], 1.0, DType::F32)).is_err());
    }
}
