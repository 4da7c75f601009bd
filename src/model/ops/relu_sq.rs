//! The MLP's activation, squared ReLU, elementwise, and on the CPU its leaky form (slope `a`
//! in [0, 1], [`super::leaky_relu_sq`]):
//!
//! ```text
//! l(x) = x (x > 0), a x (x <= 0; exactly 0 for a = 0)
//! y = l(x)^2;   dx = 2 l(x) l'(x) g      (a = 0: y = relu(x)^2, dx = 2 relu(x) g)
//! ```
//!
//! - reference: `x.relu()?.sqr()` (the fallback off the CPU and GPU paths);
//! - CPU kernel: [`forward_elems`] and [`backward_elems`], [`ELEMS`] elements per rayon task,
//!   called by [`ReluSq`] and [`ReluSqBwd`] (the model's ops, `a = 0`) and by the engine's
//!   `CpuBackend` (either activation);
//! - GPU: `relu_sq_fwd` / `_bwd` of `kernels/fused.cu`.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

#[cfg(feature = "candle")]
use super::check_float;
#[cfg(feature = "candle")]
use crate::model::host::convert::{float_dispatch, narrowed, widened, wrap};
#[cfg(feature = "candle")]
use crate::model::host::rows::elems;
use crate::model::host::simd::{Real, multiversion};

/// `relu(x)^2`, elementwise: `x.relu().sqr()`.
#[cfg(feature = "candle")]
pub fn relu_sq(x: &Tensor) -> Result<Tensor> {
    if crate::model::gpu_path(x) && x.rank() > 0 {
        return x.contiguous()?.apply_op1(ReluSq);
    }
    if !x.device().is_cpu() {
        return x.relu()?.sqr();
    }
    check_float("relu_sq", x.dtype())?;
    x.contiguous()?.apply_op1(ReluSq)
}

#[cfg(feature = "candle")]
struct ReluSq;

/// Elements per rayon task.
const ELEMS: usize = 1 << 14;

/// `l(x)`: `x` for `x > 0`, else `slope x` (`Some(slope)`: the engine's, whose relu² is slope
/// 0, so that a NaN passes as on the GPU and a poisoned read shows); `None`: relu, exactly 0
/// (the candle op's, a NaN included).
#[inline(always)]
fn leak<T: Real>(x: T, slope: Option<T>) -> T {
    if x > T::from_f64(0.0) {
        x
    } else {
        match slope {
            None => T::from_f64(0.0),
            Some(s) => x * s,
        }
    }
}

/// `y = l(x)^2`.
#[inline(always)]
fn relu_sq_kernel<T: Real>(x: &[T], out: &mut [T], slope: Option<T>) {
    for (o, &x) in out.iter_mut().zip(x) {
        let r = leak(x, slope);
        *o = r * r;
    }
}

multiversion! {
    /// `l(x)^2` of a block.
    fn relu_sq_block = relu_sq_kernel(x: &[T], out: &mut [T], slope: Option<T>);
}

/// `dx = 2 l(x) l'(x) g`: `g (l + l)` for `x > 0`, else `g ((l + l) slope)`.
#[inline(always)]
fn relu_sq_bwd_kernel<T: Real>(x: &[T], g: &[T], out: &mut [T], slope: Option<T>) {
    let zero = T::from_f64(0.0);
    for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
        let r = leak(x, slope);
        let d = if x > zero { r + r } else { (r + r) * slope.unwrap_or(zero) };
        *o = g * d;
    }
}

multiversion! {
    /// Gradient of `l(x)^2` on a block.
    fn relu_sq_bwd_block = relu_sq_bwd_kernel(x: &[T], g: &[T], out: &mut [T], slope: Option<T>);
}

/// The forward pass on the CPU, for the model's op (`slope` `None`) and the engine's backend
/// (`Some`: relu² at 0 or the leaky relu² of [`super::leaky_relu_sq`]): `out = l(x)^2`,
/// [`ELEMS`] elements per rayon task.
pub(crate) fn forward_elems<T: Real>(x: &[T], out: &mut [T], slope: Option<T>) {
    out.par_chunks_mut(ELEMS).zip(x.par_chunks(ELEMS)).for_each(|(o, x)| relu_sq_block(x, o, slope));
}

/// The backward pass on the CPU, for the model's op and the engine's backend: `out = 2 l(x)
/// l'(x) g`.
pub(crate) fn backward_elems<T: Real>(x: &[T], g: &[T], out: &mut [T], slope: Option<T>) {
    out.par_chunks_mut(ELEMS).zip(x.par_chunks(ELEMS)).zip(g.par_chunks(ELEMS)).for_each(|((o, x), g)| relu_sq_bwd_block(x, g, o, slope));
}

#[cfg(feature = "candle")]
fn relu_sq_fwd<T: Real>(x: &[T]) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); x.len()];
    forward_elems(x, &mut out, None);
    out
}

#[cfg(feature = "candle")]
impl CustomOp1 for ReluSq {
    fn name(&self) -> &'static str {
        "fused-relu-sq"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if s.dtype() == DType::BF16 {
            return narrowed(self.cpu_fwd(&widened(s), l)?);
        }
        let out = float_dispatch!(s.dtype(), "relu_sq", |T| wrap(relu_sq_fwd::<T>(elems(s, l)?)));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = l.dims().last().copied().unwrap_or(1);
        Ok((crate::model::cuda::fused::rows_op("relu_sq_fwd", &[(s, l)], d, 0.0)?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &ReluSqBwd)?))
    }
}

/// `(x, grad) -> 2 relu(x) grad`: [`ReluSq`]'s backward pass, on the CPU (the GPU kernel's
/// reference) or the GPU.
#[cfg(feature = "candle")]
pub(crate) struct ReluSqBwd;

#[cfg(feature = "candle")]
impl CustomOp2 for ReluSqBwd {
    fn name(&self) -> &'static str {
        "fused-relu-sq-bwd"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<(CpuStorage, Shape)> {
        if xl.dims() != gl.dims() || xs.dtype() != gs.dtype() {
            bail!("relu_sq backward: gradient {:?} for x {:?}", gl.shape(), xl.shape());
        }
        if xs.dtype() == DType::BF16 {
            return narrowed(self.cpu_fwd(&widened(xs), xl, &widened(gs), gl)?);
        }
        let out = float_dispatch!(xs.dtype(), "relu_sq", |T| {
            let (x, g) = (elems::<T>(xs, xl)?, elems::<T>(gs, gl)?);
            let zero = <T as candle_core::WithDType>::from_f64(0.0);
            let mut out = vec![zero; x.len()];
            backward_elems(x, g, &mut out, None);
            wrap(out)
        });
        Ok((out, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = xl.dims().last().copied().unwrap_or(1);
        Ok((crate::model::cuda::fused::rows_op("relu_sq_bwd", &[(xs, xl), (gs, gl)], d, 0.0)?, xl.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};

    use super::*;

    /// The candle op's relu maps a NaN to 0, as its GPU kernel (`fmaxf`); the engine's slope 0
    /// lets it through, as the engine's GPU kernel does, so that a read of a poisoned buffer
    /// shows.
    #[test]
    fn nan_is_zero_for_the_op_and_passes_for_the_engine() {
        let x = [f64::NAN, -1.0, 2.0];
        let (mut op, mut engine) = ([0.0; 3], [0.0; 3]);
        forward_elems(&x, &mut op, None);
        forward_elems(&x, &mut engine, Some(0.0));
        assert_eq!(op, [0.0, 0.0, 4.0]);
        assert!(engine[0].is_nan() && engine[1] == 0.0 && engine[2] == 4.0);
        let (mut dop, mut dengine) = ([0.0; 3], [0.0; 3]);
        backward_elems(&x, &[1.0; 3], &mut dop, None);
        backward_elems(&x, &[1.0; 3], &mut dengine, Some(0.0));
        assert_eq!(dop, [0.0, 0.0, 4.0]);
        assert!(dengine[0].is_nan() && dengine[2] == 4.0);
    }
    use crate::model::ops::testing::{assert_close, check_finite_differences, check_grads, flat, rand};

    /// Likewise for relu²'s backward op.
    #[test]
    fn relu_sq_backward_op_matches_autograd() {
        let mut rng = fastrand::Rng::with_seed(10);
        for dtype in [DType::F64, DType::F32] {
            let x = candle_core::Var::from_tensor(&rand(&mut rng, &[4, 33], 2.0, dtype)).unwrap();
            let g = rand(&mut rng, &[4, 33], 1.0, dtype);
            let want = (relu_sq(x.as_tensor()).unwrap() * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let got = x.as_tensor().apply_op2_no_bwd(&g, &ReluSqBwd).unwrap();
            assert_eq!(flat(&got), flat(want.get(x.as_tensor()).unwrap()), "{dtype:?}");
        }
    }

    #[test]
    fn relu_sq_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(21);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
            let r = rand(&mut rng, &[3, 7, 11], 2.0, dtype);
            assert_close(&relu_sq(&r).unwrap(), &r.relu().unwrap().sqr().unwrap(), tol, "relu_sq");
        }
    }

    #[test]
    fn relu_sq_gradients_match_the_reference_and_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(22);
        let x = rand(&mut rng, &[2, 75, 6], 2.0, DType::F64);
        let fused = |x: &[Tensor]| relu_sq(&x[0]);
        let reference = |x: &[Tensor]| x[0].relu()?.sqr();
        check_grads(&fused, &reference, std::slice::from_ref(&x), "relu_sq");
        let x = rand(&mut rng, &[3, 4], 2.0, DType::F64);
        check_finite_differences(&|x| relu_sq(&x[0]), &[x], "relu_sq");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(28);
        assert!(relu_sq(&rand(&mut rng, &[4], 1.0, DType::F16)).is_err());
    }

    /// In bf16 (the GPU formulation on the CPU) the op and its backward op give their f32
    /// reference on the inputs widened, rounded once to bf16, bit for bit.
    #[test]
    fn bf16_references_are_the_f32_ones_rounded_once() {
        let mut rng = fastrand::Rng::with_seed(17);
        let (x, g) = (rand(&mut rng, &[37, 24], 2.0, DType::BF16), rand(&mut rng, &[37, 24], 1.0, DType::BF16));
        let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let bits = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        crate::model::with_gpu_formulation(|| {
            let cases: [(&str, Tensor, Tensor); 2] = [
                ("relu_sq", relu_sq(&x).unwrap(), relu_sq(&wide(&x)).unwrap()),
                (
                    "relu_sq backward",
                    x.apply_op2_no_bwd(&g, &ReluSqBwd).unwrap(),
                    wide(&x).apply_op2_no_bwd(&wide(&g), &ReluSqBwd).unwrap(),
                ),
            ];
            for (name, got, want) in cases {
                assert_eq!(got.dtype(), DType::BF16, "{name}");
                assert_eq!(bits(&got), bits(&want), "{name}");
            }
        });
    }
}
