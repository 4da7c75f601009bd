//! Soft-capped cross-entropy, the loss of the output head: for logits `x` `(N, V)`, targets
//! `y` `(N,)` and the cap `c`,
//!
//! ```text
//! z[n, j]  = c * tanh(x[n, j] / c)                      (the logit soft-cap)
//! loss[n]  = logsumexp_j(z[n, j]) - z[n, y[n]]
//! dx[n, j] = (softmax(z[n])[j] - [j == y[n]]) * (1 - tanh^2(x[n, j] / c)) * dloss[n]
//! ```
//!
//! The backward pass recovers each row's logsumexp from its loss (`lse = loss + z[y]`), so
//! nothing but the losses is kept.
//!
//! - reference: [`softcap`] then [`cross_entropy_rows`], candle composites;
//! - CPU kernel: [`SoftcapCe`] and [`SoftcapCeBwd`], one pass per row, [`CE_ROWS`] rows per
//!   rayon task, compiled twice ([`multiversion!`]); the engine's `CpuBackend` runs the same two
//!   kernels through [`fused_rows`] (loss, then the gradient over the logits in place);
//! - GPU: `softcap_ce_fwd` / `_bwd` of `kernels/fused.cu` (launched by
//!   [`crate::model::cuda::fused`]), f32 losses, bf16 logits read as they are.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp2, CustomOp3, D, DType, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

#[cfg(feature = "candle")]
use super::check_float;
#[cfg(feature = "candle")]
use crate::model::host::convert;
use crate::model::host::rows::Rows;
#[cfg(feature = "candle")]
use crate::model::host::rows::{offsets_1d, row_offsets, unit_last};
use crate::model::host::simd::{Real, max_of, multiversion, sum_f64};
#[cfg(feature = "candle")]
use crate::model::ops;

/// `cap * tanh(z / cap)`.
#[cfg(feature = "candle")]
pub fn softcap(z: &Tensor, cap: f64) -> Result<Tensor> {
    (z / cap)?.tanh()? * cap
}

/// Per-row cross-entropy: `logsumexp(logits) - logits[target]`; `logits` is `(N, V)`, `targets`
/// `(N,)` of u32. Returns `(N,)`.
#[cfg(feature = "candle")]
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let lse = (logits.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &max)?;
    let picked = logits.gather(&targets.unsqueeze(1)?, 1)?;
    (lse - picked)?.squeeze(1)
}

/// Soft-capped per-row cross-entropy: `cross_entropy_rows(&softcap(logits, cap), targets)`,
/// that is `logsumexp(z) - z[target]` with `z = cap * tanh(logits / cap)`.
///
/// `logits` is `(N, V)` (`f32` or `f64`, before the soft-cap), `targets` `(N,)` of `u32`;
/// returns the `(N,)` losses. Differentiable with respect to `logits`. `cap` must be positive
/// and finite; a target outside `0..V` is an error.
///
/// On a GPU (f32 or bf16 logits) one kernel each way (`kernels/fused.cu`, this op's CPU
/// implementation their reference): f32 losses, bf16 logits read as they are and their gradient
/// written in bf16; there a target outside `0..V` gives a NaN loss instead of an error.
#[cfg(feature = "candle")]
pub fn softcap_cross_entropy(logits: &Tensor, targets: &Tensor, cap: f64) -> Result<Tensor> {
    let on_cuda = logits.device().is_cuda() && crate::model::gpu_path(logits);
    if !logits.device().is_cpu() && !on_cuda {
        return ops::cross_entropy_rows(&ops::softcap(logits, cap)?, targets);
    }
    // The GPU formulation on the CPU reads bf16 logits as the kernel does.
    let bf16_reference = crate::model::gpu_path(logits) && logits.dtype() == DType::BF16;
    if !on_cuda && !bf16_reference {
        check_float("softcap_cross_entropy", logits.dtype())?;
    }
    let (n, _) = logits.dims2()?;
    if targets.dims1()? != n || targets.dtype() != DType::U32 {
        bail!("softcap_cross_entropy: targets must be ({n},) u32, got {:?} {:?}", targets.shape(), targets.dtype());
    }
    if !(cap > 0.0 && cap.is_finite()) {
        bail!("softcap_cross_entropy: cap must be positive and finite, got {cap}");
    }
    if on_cuda {
        return logits.contiguous()?.apply_op2(&targets.contiguous()?, SoftcapCe { cap });
    }
    unit_last(logits)?.apply_op2(targets, SoftcapCe { cap })
}

#[cfg(feature = "candle")]
struct SoftcapCe {
    cap: f64,
}

/// Rows per rayon task.
const CE_ROWS: usize = 8;

/// Checks the targets and returns them as a vector.
#[cfg(feature = "candle")]
fn read_targets(s: &CpuStorage, l: &Layout, v: usize) -> Result<Vec<usize>> {
    let CpuStorage::U32(t) = s else { bail!("softcap_cross_entropy: targets must be u32") };
    let mut out = Vec::with_capacity(l.shape().dims1()?);
    for (row, off) in offsets_1d(l)?.into_iter().enumerate() {
        let y = t[off] as usize;
        if y >= v {
            bail!("softcap_cross_entropy: target {y} of row {row} is out of range for {v} classes");
        }
        out.push(y);
    }
    Ok(out)
}

#[inline(always)]
fn ce_fwd_kernel<T: Real>(x: Rows<'_, T>, targets: &[usize], cap: f64, out: &mut [T]) {
    let (cap, inv_cap) = (T::from_f64(cap), T::from_f64(1.0 / cap));
    let mut e = vec![T::from_f64(0.0); x.len];
    for (r, (loss, &y)) in out.iter_mut().zip(targets).enumerate() {
        let row = x.row(r);
        // tanh is increasing: the largest logit gives the largest capped logit.
        let zmax = cap * (max_of(row) * inv_cap).tanh();
        for (e, &l) in e.iter_mut().zip(row) {
            *e = (cap * (l * inv_cap).tanh() - zmax).exp();
        }
        let zy = cap * (row[y] * inv_cap).tanh();
        *loss = T::from_f64(sum_f64(&e).ln() + zmax.to_f64() - zy.to_f64());
    }
}

multiversion! {
    /// Losses of the rows of `x`.
    fn ce_fwd_rows = ce_fwd_kernel(x: Rows<'_, T>, targets: &[usize], cap: f64, out: &mut [T]);
}

#[cfg(feature = "candle")]
fn softcap_ce_fwd<T: Real>(logits: &[T], rows: &[usize], v: usize, targets: &[usize], cap: f64) -> Vec<T> {
    let x = Rows { data: logits, offsets: rows, len: v };
    let mut out = vec![T::from_f64(0.0); rows.len()];
    out.par_chunks_mut(CE_ROWS).enumerate().for_each(|(c, out)| {
        let rows = c * CE_ROWS..c * CE_ROWS + out.len();
        ce_fwd_rows(x.sub(rows.clone()), &targets[rows], cap, out);
    });
    out
}

/// Gradient rows `(softmax(z) - onehot) * (1 - tanh^2) * g`, with the row's logsumexp
/// recovered from its loss as `loss + z[target]`.
#[inline(always)]
fn ce_bwd_kernel<T: Real>(x: Rows<'_, T>, targets: &[usize], loss: &[T], g: &[T], cap: f64, out: &mut [T]) {
    let (cap, inv_cap, one) = (T::from_f64(cap), T::from_f64(1.0 / cap), T::from_f64(1.0));
    for (r, d) in out.chunks_exact_mut(x.len).enumerate() {
        let (row, y, g) = (x.row(r), targets[r], g[r]);
        let ty = (row[y] * inv_cap).tanh();
        let lse = loss[r] + cap * ty;
        for (d, &l) in d.iter_mut().zip(row) {
            let t = (l * inv_cap).tanh();
            *d = (cap * t - lse).exp() * (one - t * t) * g;
        }
        d[y] -= (one - ty * ty) * g;
    }
}

multiversion! {
    /// Gradient rows of the rows of `x`.
    fn ce_bwd_rows = ce_bwd_kernel(x: Rows<'_, T>, targets: &[usize], loss: &[T], g: &[T], cap: f64, out: &mut [T]);
}

/// The gradient rows of `(N, V)` logits (rows at `rows`) from the targets and `lg` = the `N`
/// losses then their `N` gradients.
#[cfg(feature = "candle")]
fn softcap_ce_bwd<T: Real>(logits: &[T], rows: &[usize], v: usize, targets: &[usize], lg: &[T], cap: f64) -> Vec<T> {
    let n = rows.len();
    let (loss, g) = lg.split_at(n);
    let x = Rows { data: logits, offsets: rows, len: v };
    let mut out = vec![T::from_f64(0.0); n * v];
    if v > 0 {
        out.par_chunks_mut(CE_ROWS * v).enumerate().for_each(|(c, out)| {
            let rows = c * CE_ROWS..c * CE_ROWS + out.len() / v;
            ce_bwd_rows(x.sub(rows.clone()), &targets[rows.clone()], &loss[rows.clone()], &g[rows], cap, out);
        });
    }
    out
}

/// The loss and its gradient in one call on the CPU, for the engine's backend (llm.c's fused
/// classifier): the losses of the `(N, vocab)` rows of `logits` into `losses`, then the logits
/// overwritten with their gradient for `dloss = scale` per row (`1 / (N A)`: the mean over the
/// micro-batch's `N` tokens and its share of an `A`-micro-batch step). Each block of [`CE_ROWS`]
/// rows runs the model's two kernels on a copy of its logits, so the arithmetic is the model's
/// forward pass then its backward pass. The targets must be below `vocab`, or
/// [`IGNORED_TARGET`]: that row's loss and gradient are zero (PyTorch's `ignore_index`).
pub(crate) fn fused_rows<T: Real>(logits: &mut [T], targets: &[u32], losses: &mut [T], vocab: usize, cap: f64, scale: f64) {
    if vocab == 0 {
        return;
    }
    logits.par_chunks_mut(CE_ROWS * vocab).zip(losses.par_chunks_mut(CE_ROWS)).enumerate().for_each(|(c, (l, loss))| {
        let n = loss.len();
        let x = l.to_vec();
        let offsets = crate::model::host::rows::dense_offsets(n, vocab);
        let x = Rows { data: &x, offsets: &offsets, len: vocab };
        let ys = &targets[c * CE_ROWS..c * CE_ROWS + n];
        // An ignored row runs the kernels on target 0, then is zeroed.
        let targets: Vec<usize> = ys.iter().map(|&y| if y == IGNORED_TARGET { 0 } else { y as usize }).collect();
        ce_fwd_rows(x, &targets, cap, loss);
        ce_bwd_rows(x, &targets, loss, &vec![T::from_f64(scale); n], cap, l);
        for (r, _) in ys.iter().enumerate().filter(|(_, y)| **y == IGNORED_TARGET) {
            loss[r] = T::from_f64(0.0);
            l[r * vocab..(r + 1) * vocab].fill(T::from_f64(0.0));
        }
    });
}

/// The target id of a position that neither counts in the loss nor sends a gradient (the
/// engine's fused loss only: PyTorch's `ignore_index`): the padding of a partial batch of rows,
/// or of a row shorter than the batch's. `kernels/ops/softcap_ce.cuh`'s `IGNORED_TARGET`.
pub const IGNORED_TARGET: u32 = u32::MAX;

#[cfg(feature = "candle")]
impl CustomOp2 for SoftcapCe {
    fn name(&self) -> &'static str {
        "fused-softcap-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l1.shape().dims2()?;
        let targets = read_targets(s2, l2, v)?;
        if targets.len() != n {
            bail!("softcap_cross_entropy: {} targets for {n} rows", targets.len());
        }
        let rows = row_offsets(l1)?;
        let out = match s1 {
            // The kernel's: bf16 logits read into f32, f32 losses.
            CpuStorage::BF16(_) => return self.cpu_fwd(&convert::widened(s1), l1, s2, l2),
            CpuStorage::F32(x) => CpuStorage::F32(softcap_ce_fwd(x, &rows, v, &targets, self.cap)),
            CpuStorage::F64(x) => CpuStorage::F64(softcap_ce_fwd(x, &rows, v, &targets, self.cap)),
            s => bail!("softcap_cross_entropy: unsupported dtype {:?}", s.dtype()),
        };
        Ok((out, Shape::from(n)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let n = l1.shape().dims2()?.0;
        Ok((crate::model::cuda::fused::softcap_ce_fwd((s1, l1), (s2, l2), self.cap as f32)?, Shape::from(n)))
    }

    fn bwd(&self, logits: &Tensor, targets: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The losses and their gradients (often a broadcast of the mean's 1/N) side by side.
        let lg = Tensor::stack(&[res, grad], 0)?;
        Ok((Some(logits.apply_op3_no_bwd(targets, &lg, &SoftcapCeBwd { cap: self.cap })?), None))
    }
}

/// `(logits, targets, [losses; gradients]) -> dlogits` in the logits' dtype: [`SoftcapCe`]'s
/// backward pass, the row's logsumexp recovered from its loss. The CPU implementation is the GPU
/// kernel's reference.
#[cfg(feature = "candle")]
struct SoftcapCeBwd {
    cap: f64,
}

#[cfg(feature = "candle")]
impl CustomOp3 for SoftcapCeBwd {
    fn name(&self) -> &'static str {
        "fused-softcap-cross-entropy-bwd"
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
        let (n, v) = l1.shape().dims2()?;
        let targets = read_targets(s2, l2, v)?;
        let Some((a, b)) = l3.contiguous_offsets().filter(|_| l3.dims() == [2, n] && targets.len() == n) else {
            bail!("softcap_cross_entropy backward: {} targets, losses and gradients {l3:?} for {n} rows", targets.len());
        };
        if s1.dtype() == DType::BF16 {
            // The kernel's: bf16 logits read into f32 (with f32 losses), their gradient in bf16.
            return convert::narrowed(self.cpu_fwd(&convert::widened(s1), l1, s2, l2, s3, l3)?);
        }
        let rows = row_offsets(l1)?;
        let out = match (s1, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(lg)) => CpuStorage::F32(softcap_ce_bwd(x, &rows, v, &targets, &lg[a..b], self.cap)),
            (CpuStorage::F64(x), CpuStorage::F64(lg)) => CpuStorage::F64(softcap_ce_bwd(x, &rows, v, &targets, &lg[a..b], self.cap)),
            _ => bail!("softcap_cross_entropy backward: unsupported dtypes {:?}, {:?}", s1.dtype(), s3.dtype()),
        };
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
        Ok((crate::model::cuda::fused::softcap_ce_bwd((s1, l1), (s2, l2), (s3, l3), self.cap as f32)?, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Result, Tensor};

    use super::*;
    use crate::model::ops::testing::{Loss, assert_close, assert_near, check_finite_differences, check_grads, flat, grads, rand, targets};

    fn ce_reference(logits: &Tensor, targets: &Tensor, cap: f64) -> Result<Tensor> {
        ops::cross_entropy_rows(&ops::softcap(logits, cap)?, targets)
    }

    /// The cross-entropy in bf16 on the CPU (the GPU formulation): the kernels' f32 losses of
    /// the widened logits, and their gradient rounded once to bf16, bit for bit.
    #[test]
    fn softcap_ce_bf16_reference_is_the_f32_one_rounded_once() {
        let mut rng = fastrand::Rng::with_seed(5);
        let logits = rand(&mut rng, &[9, 40], 50.0, DType::BF16);
        let t = targets(&mut rng, 9, 40);
        let wide = logits.to_dtype(DType::F32).unwrap();
        crate::model::with_gpu_formulation(|| {
            let (l16, l32) = (softcap_cross_entropy(&logits, &t, 30.0).unwrap(), softcap_cross_entropy(&wide, &t, 30.0).unwrap());
            assert_eq!(l16.dtype(), DType::F32);
            assert_eq!(flat(&l16), flat(&l32));
            let lg = Tensor::stack(&[&l32, &(l32.ones_like().unwrap() * 0.25).unwrap()], 0).unwrap();
            let d16 = logits.apply_op3_no_bwd(&t, &lg, &SoftcapCeBwd { cap: 30.0 }).unwrap();
            let d32 = wide.apply_op3_no_bwd(&t, &lg, &SoftcapCeBwd { cap: 30.0 }).unwrap();
            assert_eq!(d16.dtype(), DType::BF16);
            assert_eq!(flat(&d16), flat(&d32.to_dtype(DType::BF16).unwrap()));
            assert!(flat(&d16).iter().any(|&v| v != 0.0));
        });
    }

    #[test]
    fn softcap_cross_entropy_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(1);
        let (n, v, cap) = (37, 53, 30.0);
        let y = targets(&mut rng, n, v);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            // Logits up to +-60, so that the cap bends them; and a row-strided view.
            let wide = rand(&mut rng, &[n, v + 5], 60.0, dtype);
            let logits = wide.narrow(1, 2, v).unwrap();
            assert!(!logits.is_contiguous());
            let got = softcap_cross_entropy(&logits, &y, cap).unwrap();
            assert_eq!(got.dtype(), dtype);
            assert_close(&got, &ce_reference(&logits, &y, cap).unwrap(), tol, &format!("{dtype:?} losses"));
        }
    }

    #[test]
    fn softcap_cross_entropy_gradients_match_the_reference() {
        let mut rng = fastrand::Rng::with_seed(2);
        let (n, v, cap) = (29, 41, 15.0);
        let y = targets(&mut rng, n, v);
        let logits = rand(&mut rng, &[n, v], 40.0, DType::F64);
        let fused = |x: &[Tensor]| softcap_cross_entropy(&x[0], &y, cap);
        let reference = |x: &[Tensor]| ce_reference(&x[0], &y, cap);
        check_grads(&fused, &reference, &[logits], "softcap_cross_entropy");
        // f32 gradients too, at f32 precision.
        let logits = rand(&mut rng, &[n, v], 40.0, DType::F32);
        let (a, b) = (grads(&fused, std::slice::from_ref(&logits), Loss::Weighted), grads(&reference, &[logits], Loss::Weighted));
        assert_close(&a[0], &b[0], 1e-5, "f32 gradient");
    }

    #[test]
    fn softcap_cross_entropy_gradients_match_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(3);
        let y = targets(&mut rng, 4, 6);
        let logits = rand(&mut rng, &[4, 6], 8.0, DType::F64);
        check_finite_differences(&|x| softcap_cross_entropy(&x[0], &y, 5.0), &[logits], "softcap_cross_entropy");
    }

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
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

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(10);
        let half = rand(&mut rng, &[2, 3], 1.0, DType::F16);
        assert!(softcap_cross_entropy(&half, &targets(&mut rng, 2, 3), 30.0).is_err());
        let out_of_range = Tensor::from_vec(vec![0u32, 3], 2, &Device::Cpu).unwrap();
        let e = softcap_cross_entropy(&rand(&mut rng, &[2, 3], 1.0, DType::F32), &out_of_range, 30.0).unwrap_err();
        assert!(e.to_string().contains("target 3 of row 1"), "{e}");
        // The backward op checks its inputs too: the targets, and one loss and gradient per row.
        let (logits, ok) = (rand(&mut rng, &[2, 3], 1.0, DType::F32), targets(&mut rng, 2, 3));
        let bwd = |t: &Tensor, lg: &Tensor| logits.apply_op3_no_bwd(t, lg, &SoftcapCeBwd { cap: 30.0 });
        let e = bwd(&out_of_range, &rand(&mut rng, &[2, 2], 1.0, DType::F32)).unwrap_err();
        assert!(e.to_string().contains("target 3 of row 1"), "{e}");
        let e = bwd(&ok, &rand(&mut rng, &[2, 3], 1.0, DType::F32)).unwrap_err();
        assert!(e.to_string().contains("for 2 rows"), "{e}");
    }

    /// The kernels as compiled for the baseline target (the tests above run the AVX2 versions
    /// where the CPU has AVX2) give the same results as the dispatched ones.
    #[test]
    fn baseline_kernels_match_the_dispatched_ones() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (rows, v) = (6usize, 37usize);
        let data: Vec<f32> = (0..rows * v).map(|_| rng.f32() * 40.0 - 20.0).collect();
        let offsets: Vec<usize> = (0..rows).map(|r| r * v).collect();
        let x = Rows { data: &data, offsets: &offsets, len: v };
        let targets: Vec<usize> = (0..rows).map(|_| rng.usize(0..v)).collect();
        let (mut a, mut b) = (vec![0.0f32; rows], vec![0.0f32; rows]);
        ce_fwd_kernel(x, &targets, 30.0, &mut a);
        ce_fwd_rows(x, &targets, 30.0, &mut b);
        assert_near(&a, &b, "ce forward");
        let g: Vec<f32> = (0..rows).map(|_| rng.f32()).collect();
        let loss = a.clone();
        let (mut a, mut b) = (vec![0.0f32; rows * v], vec![0.0f32; rows * v]);
        ce_bwd_kernel(x, &targets, &loss, &g, 30.0, &mut a);
        ce_bwd_rows(x, &targets, &loss, &g, 30.0, &mut b);
        assert_near(&a, &b, "ce backward");
    }
}
