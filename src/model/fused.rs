//! Fused, multi-threaded CPU versions of the GPT's hottest ops, for training on CPU.
//!
//! Each op of a candle composite such as [`ops::cross_entropy_rows`]`(`[`ops::softcap`]`(..))`
//! is a separate pass over memory with its own allocation (kept alive for the backward pass, which
//! adds as many passes again), and some of candle's CPU maps and reductions run on one thread.
//! The ops here make one pass per row, spread the rows over rayon's thread pool, and have
//! hand-written backward passes:
//!
//! - [`softcap_cross_entropy`]: logit soft-cap and per-row cross-entropy in one op;
//! - [`rms_norm`]: RMS norm over the last dimension, no weight;
//! - [`causal_attention`]: causal grouped-query attention, one rayon task per (batch, head),
//!   that never materialises the `(T, T)` scores of the whole batch: it works on blocks of 16
//!   query rows, and the backward pass recomputes their probabilities (as flash attention does).
//!
//! Each op gives the same values as its [`ops`] counterpart (up to rounding) and is
//! differentiable once through candle's autograd. Only `f32` and `f64` are supported (and bf16
//! in the GPU formulation, see [`super::with_gpu_formulation`]); on a device other than the CPU
//! the functions fall back to the [`ops`] composites.
//!
//! The inner loops are written to auto-vectorise (small register tiles for the matrix products,
//! branch-free `exp` and `tanh` for `f32`) and are compiled twice: for the baseline target and
//! for AVX2, picked at run time (the module's one `unsafe` block, in `multiversion!`).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType, bail};
use rayon::prelude::*;

use super::ops;

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
pub fn softcap_cross_entropy(logits: &Tensor, targets: &Tensor, cap: f64) -> Result<Tensor> {
    let on_cuda = logits.device().is_cuda() && super::gpu_path(logits);
    if !logits.device().is_cpu() && !on_cuda {
        return ops::cross_entropy_rows(&ops::softcap(logits, cap)?, targets);
    }
    // The GPU formulation on the CPU reads bf16 logits as the kernel does.
    let bf16_reference = super::gpu_path(logits) && logits.dtype() == DType::BF16;
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

/// RMS norm over the last dimension, no weight: `x / sqrt(mean(x^2) + eps)` with
/// `eps = ops::rms_eps(dtype)`, as [`ops::rms_norm`]. Any layout whose last dimension is
/// contiguous (such as `(B, T, H, D)` transposed to `(B, H, T, D)`) is read without a copy.
pub fn rms_norm(x: &Tensor) -> Result<Tensor> {
    if super::gpu_path(x) && x.rank() > 0 {
        // The GPU kernel reads contiguous rows.
        return x.contiguous()?.apply_op1(RmsNorm);
    }
    if !x.device().is_cpu() {
        return ops::rms_norm(x);
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
pub fn rms_norm_to(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return rms_norm(x);
    }
    if super::gpu_path(x) && x.rank() > 0 && mixed_pair(x.dtype(), dtype) {
        return x.contiguous()?.apply_op1(RmsNormTo(dtype));
    }
    super::cast::cast(&rms_norm(x)?, dtype)
}

/// Whether `(wide, narrow)` is a pair the mixed-precision ops take: f32 with bf16 (the GPU's),
/// f64 with f32 (the CPU formulation's stand-in for it).
pub(super) fn mixed_pair(wide: DType, narrow: DType) -> bool {
    matches!((wide, narrow), (DType::F32, DType::BF16) | (DType::F64, DType::F32))
}

/// Whether an op working in `wide` may read or write `other`: the same dtype, or the narrow side
/// of a [`mixed_pair`].
pub(super) fn same_or_narrower(wide: DType, other: DType) -> bool {
    wide == other || mixed_pair(wide, other)
}

/// `v` converted to `dtype` (each value rounded once, to nearest even), as a CPU storage.
pub(super) fn to_storage<T: WithDType>(v: &[T], dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F64 => CpuStorage::F64(v.iter().map(|x| x.to_f64()).collect()),
        // f32 -> f64 is exact, so going through f64 rounds once.
        DType::F32 => CpuStorage::F32(v.iter().map(|x| x.to_f64() as f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.iter().map(|x| half::bf16::from_f64(x.to_f64())).collect()),
        dt => bail!("fused op: cannot write {dt:?}"),
    })
}

/// The elements of a CPU storage as `T` (borrowed when they are `T`, else converted exactly:
/// the narrow dtypes widen without rounding).
pub(super) fn values_as<T: WithDType>(s: &CpuStorage) -> Result<std::borrow::Cow<'_, [T]>> {
    use std::borrow::Cow;
    if s.dtype() == T::DTYPE {
        return Ok(Cow::Borrowed(T::cpu_storage_as_slice(s)?));
    }
    let widen = |v: &mut dyn Iterator<Item = f64>| Cow::Owned(v.map(T::from_f64).collect());
    Ok(match s {
        CpuStorage::F64(v) => widen(&mut v.iter().copied()),
        CpuStorage::F32(v) => widen(&mut v.iter().map(|&x| x as f64)),
        CpuStorage::BF16(v) => widen(&mut v.iter().map(|x| x.to_f64())),
        s => bail!("fused op: unsupported dtype {:?}", s.dtype()),
    })
}

/// Causal scaled-dot-product attention with grouped KV heads, as [`ops::causal_attention`]
/// without the mask argument: `q` is `(B, H, T, D)`, `k` and `v` are `(B, K, T, D)`, query head
/// `h` uses KV head `h / (H / K)`, scores are scaled by `1 / sqrt(D)`. Returns `(B, H, T, D)`.
///
/// Inputs whose last dimension is contiguous are read in place (no copy for transposed heads).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let t = AttnDims::new(q.shape(), k.shape(), v.shape())?.t;
    if super::gpu_path(q) {
        return gpu_attention(q, k, v);
    }
    if !q.device().is_cpu() {
        return ops::causal_attention(q, k, v, &ops::causal_mask(t, q.dtype(), q.device())?);
    }
    check_float("causal_attention", q.dtype())?;
    if k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        bail!("causal_attention: dtypes differ: q {:?}, k {:?}, v {:?}", q.dtype(), k.dtype(), v.dtype());
    }
    unit_last(q)?.apply_op3(&unit_last(k)?, &unit_last(v)?, CausalAttention)
}

/// Attention on a GPU: the two score products on cuBLAS (candle's `matmul`, in the inputs'
/// dtype, so bf16 under mixed precision as PyTorch's autocast does) around the one-kernel
/// [`causal_softmax`](super::causal_softmax::causal_softmax). The `(B, H, T, T)` scores and
/// probabilities are materialised (kept for the backward pass), which bounds the micro-batch.
fn gpu_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (_, h, _, d) = q.dims4()?;
    let (k, v) = (ops::repeat_kv(k, h)?, ops::repeat_kv(v, h)?);
    let scores = q.contiguous()?.matmul(&k.t()?.contiguous()?)?;
    let probs = super::causal_softmax::causal_softmax(&scores, 1.0 / (d as f64).sqrt())?;
    probs.matmul(&v.contiguous()?)
}

// ---------------------------------------------------------------------------------------------
// Plumbing.

/// The float types the kernels run on, with the maths functions they need. For `f32`, `exp`
/// and `tanh` are branch-free approximations (a few ulp) so that loops over them vectorise;
/// `f64` (used by the gradient checks) keeps the standard library's.
trait Real: WithDType {
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        tanh_f32(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
}

/// `e^x`: Cephes' `expf` polynomial after the reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`.
/// Inputs are clamped to `[-87.3, 88.3]` (so tiny results are about 1e-38 rather than 0 or
/// subnormal); NaN stays NaN.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.3);
    let shifted = x * std::f32::consts::LOG2_E + SHIFT;
    let n = shifted - SHIFT;
    // ln 2 split in two so that `x - n ln 2` is exact enough.
    let r = (x - n * 0.693_359_4) + n * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^n from the exponent bits; n is in [-126, 127] after the clamp.
    let two_n = f32::from_bits(shifted.to_bits().wrapping_sub(SHIFT.to_bits()).wrapping_add(127) << 23);
    y * two_n
}

/// `tanh(x)`: the rational approximation of Eigen's `generic_fast_tanh_float` (degree 13 / 6,
/// inputs clamped to +-7.9, where tanh is 1 to f32 precision; `x` itself below 4e-4).
#[inline(always)]
fn tanh_f32(x: f32) -> f32 {
    let c = x.clamp(-7.905_311, 7.905_311);
    let c2 = c * c;
    let mut p = -2.760_768_5e-16f32;
    p = p * c2 + 2.000_188e-13;
    p = p * c2 - 8.604_672e-11;
    p = p * c2 + 5.122_297e-8;
    p = p * c2 + 1.485_722_4e-5;
    p = p * c2 + 6.372_619e-4;
    p = p * c2 + 4.893_524_6e-3;
    let mut q = 1.198_258_4e-6f32;
    q = q * c2 + 1.185_347_1e-4;
    q = q * c2 + 2.268_434_7e-3;
    q = q * c2 + 4.893_525e-3;
    if x.abs() < 4e-4 { x } else { c * p / q }
}

/// Generates `$name`, which runs `$kernel` compiled for AVX2 and FMA when the CPU has them
/// (runtime detection) and as compiled for the baseline target otherwise. The kernels and
/// everything they call are `#[inline(always)]`, so the whole loop nest is compiled with the
/// wider vectors.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident = $kernel:ident($($arg:ident: $ty:ty),* $(,)?);) => {
        $(#[$doc])*
        fn $name<T: Real>($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn wide<T: Real>($($arg: $ty),*) {
                    $kernel::<T>($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: `wide` has no requirement besides the CPU features detected just above.
                    return unsafe { wide::<T>($($arg),*) };
                }
            }
            $kernel::<T>($($arg),*)
        }
    };
}

// The ops of the rest of a block, on token-major matrices (they use the kernels and helpers
// above).
#[path = "fused_block.rs"]
mod block;
pub use block::{causal_attention_tokens, qk_norm_rope, relu_sq, resid_mix, scale_add, scale_cols};

fn check_float(op: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 => Ok(()),
        dt => bail!("{op}: fused CPU op supports f32 and f64, got {dt:?}"),
    }
}

/// `x` itself when its last dimension has stride 1 (or size 1), else a contiguous copy.
fn unit_last(x: &Tensor) -> Result<Tensor> {
    match (x.dims().last(), x.stride().last()) {
        (Some(&n), Some(&s)) if n > 1 && s != 1 => x.contiguous(),
        _ => Ok(x.clone()),
    }
}

/// Start offsets, in storage elements, of every row (last-dimension slice) of `layout`, in
/// row-major order of the leading dimensions. The last dimension must have stride 1.
fn row_offsets(layout: &Layout) -> Result<Vec<usize>> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let Some((&d, lead)) = dims.split_last() else { bail!("fused op: a scalar has no rows") };
    if d > 1 && strides[dims.len() - 1] != 1 {
        bail!("fused op: the last dimension must have stride 1, layout {layout:?}");
    }
    let n: usize = lead.iter().product();
    let start = layout.start_offset();
    if layout.is_contiguous() {
        return Ok((0..n).map(|r| start + r * d).collect());
    }
    let mut offsets = Vec::with_capacity(n);
    let mut index = vec![0usize; lead.len()];
    let mut off = start;
    for _ in 0..n {
        offsets.push(off);
        for a in (0..lead.len()).rev() {
            index[a] += 1;
            off += strides[a];
            if index[a] < lead[a] {
                break;
            }
            off -= strides[a] * lead[a];
            index[a] = 0;
        }
    }
    Ok(offsets)
}

/// The element offset of each index of a 1-D layout.
fn offsets_1d(layout: &Layout) -> Result<Vec<usize>> {
    let n = layout.shape().dims1()?;
    let (start, stride) = (layout.start_offset(), layout.stride()[0]);
    Ok((0..n).map(|i| start + i * stride).collect())
}

fn cpu_slice<'a, T: WithDType>(storage: &'a Storage, what: &str) -> Result<&'a [T]> {
    match storage {
        Storage::Cpu(s) => T::cpu_storage_as_slice(s),
        _ => bail!("fused op: {what} is not on the CPU"),
    }
}

/// Rows of `len` elements of `data`, the `i`-th starting at `offsets[i]`.
#[derive(Clone, Copy)]
struct Rows<'a, T> {
    data: &'a [T],
    offsets: &'a [usize],
    len: usize,
}

impl<'a, T: Copy> Rows<'a, T> {
    #[inline(always)]
    fn row(&self, i: usize) -> &'a [T] {
        let o = self.offsets[i];
        &self.data[o..o + self.len]
    }

    fn count(&self) -> usize {
        self.offsets.len()
    }

    fn sub(&self, range: std::ops::Range<usize>) -> Self {
        Self { offsets: &self.offsets[range], ..*self }
    }

    /// The rows, one after the other: a `(count, len)` row-major matrix.
    #[inline(always)]
    fn gather(&self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.count() * self.len);
        for i in 0..self.count() {
            out.extend_from_slice(self.row(i));
        }
        out
    }

    /// The transpose: a `(len, count)` row-major matrix.
    #[inline(always)]
    fn transposed(&self, zero: T) -> Vec<T> {
        let n = self.count();
        let mut out = vec![zero; self.len * n];
        for i in 0..n {
            for (c, &x) in self.row(i).iter().enumerate() {
                out[c * n + i] = x;
            }
        }
        out
    }
}

#[inline(always)]
fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    // Eight independent partial sums so that the loop vectorises.
    let zero = T::from_f64(0.0);
    let mut acc = [zero; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let mut tail = zero;
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `sum(a * b)` accumulated in f64.
#[inline(always)]
fn dot_f64<T: Real>(a: &[T], b: &[T]) -> f64 {
    let mut acc = [0.0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let mut tail = 0.0;
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x.to_f64() * y.to_f64();
    }
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += x.to_f64() * y.to_f64();
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// `sum(a)` accumulated in f64.
#[inline(always)]
fn sum_f64<T: Real>(a: &[T]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = a.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|x| x.to_f64()).sum();
    for x in chunks {
        for (s, &x) in acc.iter_mut().zip(x) {
            *s += x.to_f64();
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// The largest element (`-inf` for an empty slice).
#[inline(always)]
fn max_of<T: Real>(a: &[T]) -> T {
    let mut acc = [T::from_f64(f64::NEG_INFINITY); 8];
    let chunks = a.chunks_exact(8);
    let mut m = acc[0];
    for &x in chunks.remainder() {
        m = if x > m { x } else { m };
    }
    for x in chunks {
        for (s, &x) in acc.iter_mut().zip(x) {
            *s = if x > *s { x } else { *s };
        }
    }
    acc.iter().fold(m, |m, &x| if x > m { x } else { m })
}

/// `C += A B` for an `(m, k)` matrix `A` given elementwise by `a(row, col)`, a row-major
/// `(k, n)` matrix `B` with row stride `ldb`, and a row-major `(m, n)` matrix `C` with row stride
/// `ldc`. Register tiles of 4 x 8; `A` is packed per 4-row panel first.
// Indexed loops with constant bounds: the iterator version of the tile update is not
// vectorised by LLVM (it spills the tile and runs scalar).
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn gemm_acc<T: Real>((m, n, k): (usize, usize, usize), a: impl Fn(usize, usize) -> T, b: &[T], ldb: usize, c: &mut [T], ldc: usize) {
    const MR: usize = 4;
    const NR: usize = 8;
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let zero = T::from_f64(0.0);
    let mut pack = vec![zero; k * MR];
    for i in (0..m).step_by(MR) {
        let mr = MR.min(m - i);
        for (p, panel) in pack.chunks_exact_mut(MR).enumerate() {
            for (r, x) in panel.iter_mut().enumerate() {
                *x = if r < mr { a(i + r, p) } else { zero };
            }
        }
        // Full tiles: the tile stays in registers only while every index into it is constant.
        let full = n - n % NR;
        for j in (0..full).step_by(NR) {
            let mut acc = [[zero; NR]; MR];
            for p in 0..k {
                let bp: &[T; NR] = b[p * ldb + j..p * ldb + j + NR].try_into().expect("NR elements");
                let ap: &[T; MR] = pack[p * MR..p * MR + MR].try_into().expect("MR elements");
                for r in 0..MR {
                    for l in 0..NR {
                        acc[r][l] += ap[r] * bp[l];
                    }
                }
            }
            for r in 0..MR {
                if r < mr {
                    let cr: &mut [T; NR] = (&mut c[(i + r) * ldc + j..(i + r) * ldc + j + NR]).try_into().expect("NR elements");
                    for l in 0..NR {
                        cr[l] += acc[r][l];
                    }
                }
            }
        }
        for r in 0..mr {
            for jj in full..n {
                let mut s = zero;
                for p in 0..k {
                    s += pack[p * MR + r] * b[p * ldb + jj];
                }
                c[(i + r) * ldc + jj] += s;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Soft-capped cross-entropy.

struct SoftcapCe {
    cap: f64,
}

/// Rows per rayon task.
const CE_ROWS: usize = 8;

/// Checks the targets and returns them as a vector.
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
            CpuStorage::BF16(_) => return self.cpu_fwd(&super::host::widened(s1), l1, s2, l2),
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
        Ok((super::gpu_kernels::softcap_ce_fwd((s1, l1), (s2, l2), self.cap as f32)?, Shape::from(n)))
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
struct SoftcapCeBwd {
    cap: f64,
}

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
            return super::host::narrowed(self.cpu_fwd(&super::host::widened(s1), l1, s2, l2, s3, l3)?);
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
        Ok((super::gpu_kernels::softcap_ce_bwd((s1, l1), (s2, l2), (s3, l3), self.cap as f32)?, l1.shape().clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// RMS norm.

struct RmsNorm;

/// Rows per rayon task.
const RMS_ROWS: usize = 64;

#[inline(always)]
fn rms_fwd_kernel<T: Real>(x: Rows<'_, T>, eps: f64, out: &mut [T]) {
    let d = x.len;
    for (r, y) in out.chunks_exact_mut(d).enumerate() {
        let row = x.row(r);
        let rms = T::from_f64((dot_f64(row, row) / d as f64 + eps).sqrt());
        for (y, &x) in y.iter_mut().zip(row) {
            *y = x / rms;
        }
    }
}

multiversion! {
    /// RMS norm of the rows of `x`.
    fn rms_fwd_rows = rms_fwd_kernel(x: Rows<'_, T>, eps: f64, out: &mut [T]);
}

/// `dx = (g - y * mean(g * y)) / r` with `y = x / r`, that is `g / r - x * sum(g * x) / (d r^3)`.
#[inline(always)]
fn rms_bwd_kernel<T: Real>(x: Rows<'_, T>, g: Rows<'_, T>, eps: f64, out: &mut [T]) {
    let d = x.len;
    for (r, dx) in out.chunks_exact_mut(d).enumerate() {
        let (xr, gr) = (x.row(r), g.row(r));
        let rms = (dot_f64(xr, xr) / d as f64 + eps).sqrt();
        let a = T::from_f64(1.0 / rms);
        let c = T::from_f64(dot_f64(xr, gr) / (d as f64 * rms * rms * rms));
        for ((dx, &x), &g) in dx.iter_mut().zip(xr).zip(gr) {
            *dx = g * a - x * c;
        }
    }
}

multiversion! {
    /// RMS norm gradient rows.
    fn rms_bwd_rows = rms_bwd_kernel(x: Rows<'_, T>, g: Rows<'_, T>, eps: f64, out: &mut [T]);
}

/// RMS norm rows with `eps`: the epsilon of the input's dtype ([`ops::rms_eps`]), which for bf16
/// rows computed in f32 is bf16's.
fn rms_fwd<T: Real>(x: &[T], rows: &[usize], d: usize, eps: f64) -> Vec<T> {
    let x = Rows { data: x, offsets: rows, len: d };
    let mut out = vec![T::from_f64(0.0); rows.len() * d];
    if d > 0 {
        out.par_chunks_mut(RMS_ROWS * d).enumerate().for_each(|(c, out)| {
            rms_fwd_rows(x.sub(c * RMS_ROWS..c * RMS_ROWS + out.len() / d), eps, out);
        });
    }
    out
}

/// Gradient rows of RMS norm: `x` and `g` rows at the given offsets, `d` wide.
fn rms_bwd<T: Real>(x: &[T], xrows: &[usize], g: &[T], grows: &[usize], d: usize, eps: f64) -> Vec<T> {
    let (xr, gr) = (Rows { data: x, offsets: xrows, len: d }, Rows { data: g, offsets: grows, len: d });
    let mut out = vec![T::from_f64(0.0); xrows.len() * d];
    if d > 0 {
        out.par_chunks_mut(RMS_ROWS * d).enumerate().for_each(|(c, out)| {
            let rows = c * RMS_ROWS..c * RMS_ROWS + out.len() / d;
            rms_bwd_rows(xr.sub(rows.clone()), gr.sub(rows), eps, out);
        });
    }
    out
}

impl CustomOp1 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let rows = row_offsets(l)?;
        let d = l.dims().last().copied().unwrap_or(0);
        // The epsilon of the dtype held, as the kernel's: bf16 rows run in f32 with bf16's, and
        // their output is rounded once.
        let eps = ops::rms_eps(s.dtype());
        let out = match &*super::host::widened(s) {
            CpuStorage::F32(x) => CpuStorage::F32(rms_fwd(x, &rows, d, eps)),
            CpuStorage::F64(x) => CpuStorage::F64(rms_fwd(x, &rows, d, eps)),
            s => bail!("rms_norm: unsupported dtype {:?}", s.dtype()),
        };
        let out = (out, l.shape().clone());
        if s.dtype() == DType::BF16 { super::host::narrowed(out) } else { Ok(out) }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = l.dims().last().copied().unwrap_or(0);
        let out = super::gpu_kernels::rows_op("rms_norm_fwd", &[(s, l)], d, ops::rms_eps(s.dtype()) as f32)?;
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // The GPU kernel reads contiguous rows (`x` is: the forward pass made it so); the CPU
        // reads any layout whose last dimension is contiguous.
        let grad = if super::gpu_path(x) { grad.contiguous()? } else { unit_last(grad)? };
        Ok(Some(x.apply_op2_no_bwd(&grad, &RmsNormBwd)?))
    }
}

/// RMS norm with its output in the dtype held: [`rms_norm_to`]'s op. The CPU implementation
/// (norm in the input's dtype, then one rounding) is the mixed kernel's reference.
struct RmsNormTo(DType);

impl CustomOp1 for RmsNormTo {
    fn name(&self) -> &'static str {
        "fused-rms-norm-to"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let rows = row_offsets(l)?;
        let d = l.dims().last().copied().unwrap_or(0);
        let out = match s {
            CpuStorage::F32(x) => to_storage(&rms_fwd(x, &rows, d, ops::rms_eps(DType::F32)), self.0)?,
            CpuStorage::F64(x) => to_storage(&rms_fwd(x, &rows, d, ops::rms_eps(DType::F64)), self.0)?,
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
        let out = super::gpu_kernels::rows_op_mixed("rms_norm_fwd", &[(s, l)], &[], self.0, d, ops::rms_eps(s.dtype()) as f32, &[])?;
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
struct RmsNormBwd;

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
        let eps = ops::rms_eps(xs.dtype());
        let out = match &*super::host::widened(xs) {
            CpuStorage::F32(x) => CpuStorage::F32(rms_bwd(x, &xrows, &values_as::<f32>(gs)?, &grows, d, eps)),
            CpuStorage::F64(x) => CpuStorage::F64(rms_bwd(x, &xrows, &values_as::<f64>(gs)?, &grows, d, eps)),
            _ => bail!("rms_norm backward: unsupported dtypes {:?}, {:?}", xs.dtype(), gs.dtype()),
        };
        let out = (out, xl.shape().clone());
        if xs.dtype() == DType::BF16 { super::host::narrowed(out) } else { Ok(out) }
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
        let eps = ops::rms_eps(xs.dtype()) as f32;
        let out = super::gpu_kernels::rows_op_mixed("rms_norm_bwd", &[(xs, xl), (gs, gl)], &[], xs.dtype(), d, eps, &[])?;
        Ok((out, xl.shape().clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// Causal attention.

struct CausalAttention;

/// Query rows per block: scores are computed for `ATTN_BLOCK` rows at a time (against the keys
/// up to the block's last row), so the causal mask wastes at most half a block per row.
const ATTN_BLOCK: usize = 16;

/// Shapes of one attention call.
#[derive(Clone, Copy)]
struct AttnDims {
    b: usize,
    h: usize,
    kh: usize,
    t: usize,
    d: usize,
}

impl AttnDims {
    fn new(q: &Shape, k: &Shape, v: &Shape) -> Result<Self> {
        let (b, h, t, d) = q.dims4()?;
        let (kb, kh, kt, kd) = k.dims4()?;
        if (kb, kt, kd) != (b, t, d) || v.dims() != k.dims() || kh == 0 || h % kh != 0 {
            bail!("causal_attention: q {q:?}, k {k:?}, v {v:?} do not fit (B, H, T, D), (B, K, T, D) with K dividing H");
        }
        Ok(Self { b, h, kh, t, d })
    }

    fn group(&self) -> usize {
        self.h / self.kh
    }

    fn scale(&self) -> f64 {
        1.0 / (self.d as f64).sqrt()
    }
}

/// In place on one row of raw scores `q_i . k_j` for `j < row.len()`: `row[..=i]` becomes
/// `softmax(scale * row[..=i])`, the rest (the future) 0.
#[inline(always)]
fn causal_softmax<T: Real>(row: &mut [T], i: usize, scale: T) {
    let (live, future) = row.split_at_mut(i + 1);
    future.fill(T::from_f64(0.0));
    for x in live.iter_mut() {
        *x *= scale;
    }
    let m = max_of(live);
    for x in live.iter_mut() {
        *x = (*x - m).exp();
    }
    let inv = T::from_f64(1.0 / sum_f64(live));
    for x in live.iter_mut() {
        *x *= inv;
    }
}

/// Probabilities of query rows `i0..i0 + mb` (rows of `q`, a row-major `(T, D)` matrix) against
/// keys `0..n` with `n = i0 + mb`: `p` becomes the `(mb, n)` matrix.
#[inline(always)]
fn causal_probs<T: Real>(q: &[T], kt: &[T], (t, d): (usize, usize), (i0, mb): (usize, usize), scale: T, p: &mut [T]) {
    let n = i0 + mb;
    p.fill(T::from_f64(0.0));
    gemm_acc((mb, n, d), |r, c| q[(i0 + r) * d + c], kt, t, p, n);
    for (r, row) in p.chunks_exact_mut(n).enumerate() {
        causal_softmax(row, i0 + r, scale);
    }
}

/// One (batch, query head): `q` has the head's `T` rows, `k` and `v` those of its KV head;
/// `out` is the head's `(T, D)` output, zeroed.
#[inline(always)]
fn attn_fwd_kernel<T: Real>(q: Rows<'_, T>, k: Rows<'_, T>, v: Rows<'_, T>, scale: T, out: &mut [T]) {
    let (t, d) = (q.count(), q.len);
    let zero = T::from_f64(0.0);
    let (q, kt, v) = (q.gather(), k.transposed(zero), v.gather());
    let mut p = vec![zero; ATTN_BLOCK * t];
    for i0 in (0..t).step_by(ATTN_BLOCK) {
        let mb = ATTN_BLOCK.min(t - i0);
        let n = i0 + mb;
        let p = &mut p[..mb * n];
        causal_probs(&q, &kt, (t, d), (i0, mb), scale, p);
        gemm_acc((mb, d, n), |r, j| p[r * n + j], &v, d, &mut out[i0 * d..n * d], d);
    }
}

multiversion! {
    /// Attention output of one (batch, query head).
    fn attn_fwd_head = attn_fwd_kernel(q: Rows<'_, T>, k: Rows<'_, T>, v: Rows<'_, T>, scale: T, out: &mut [T]);
}

fn attn_fwd<T: Real>(q: &[T], ql: &Layout, k: &[T], kl: &Layout, v: &[T], vl: &Layout) -> Result<Vec<T>> {
    let dims = AttnDims::new(ql.shape(), kl.shape(), vl.shape())?;
    let AttnDims { b, h, kh, t, d } = dims;
    let (qrows, krows, vrows) = (row_offsets(ql)?, row_offsets(kl)?, row_offsets(vl)?);
    let q = Rows { data: q, offsets: &qrows, len: d };
    let k = Rows { data: k, offsets: &krows, len: d };
    let v = Rows { data: v, offsets: &vrows, len: d };
    let (group, scale) = (dims.group(), T::from_f64(dims.scale()));
    let mut out = vec![T::from_f64(0.0); b * h * t * d];
    if out.is_empty() {
        return Ok(out);
    }
    out.par_chunks_mut(t * d).enumerate().for_each(|(bh, o)| {
        let kv = (bh / h) * kh + (bh % h) / group;
        attn_fwd_head(q.sub(bh * t..(bh + 1) * t), k.sub(kv * t..(kv + 1) * t), v.sub(kv * t..(kv + 1) * t), scale, o);
    });
    Ok(out)
}

/// The inputs of the backward pass for one (batch, KV head): the rows of the group's query
/// heads (`q`, the forward output `o` and its gradient `go`, `G * T` rows each) and of the KV
/// head (`k`, `v`, `T` rows each).
struct AttnBwdIn<'a, T> {
    q: Rows<'a, T>,
    k: Rows<'a, T>,
    v: Rows<'a, T>,
    o: Rows<'a, T>,
    go: Rows<'a, T>,
}

/// Gradients for one (batch, KV head), so that the task owns its `dk`, `dv` (`(T, D)`, zeroed)
/// and the `dq` rows of its group's query heads (`(G, T, D)`, zeroed). Per block of query rows:
/// `P` recomputed, `dP = dO V^T`, `dS = P (dP - rowsum(dO * O)) scale`, `dQ += dS K`,
/// `dK += dS^T Q`, `dV += P^T dO`.
#[inline(always)]
fn attn_bwd_kernel<T: Real>(x: &AttnBwdIn<'_, T>, scale: T, dq: &mut [T], dk: &mut [T], dv: &mut [T]) {
    let (t, d) = (x.k.count(), x.k.len);
    let group = x.q.count() / t.max(1);
    let zero = T::from_f64(0.0);
    let (k, kt, vt) = (x.k.gather(), x.k.transposed(zero), x.v.transposed(zero));
    let mut p = vec![zero; ATTN_BLOCK * t];
    let mut ds = vec![zero; ATTN_BLOCK * t];
    for (hh, dqh) in dq.chunks_exact_mut(t * d).enumerate() {
        let rows = hh * t..(hh + 1) * t;
        let (q, go, o) = (x.q.sub(rows.clone()).gather(), x.go.sub(rows.clone()).gather(), x.o.sub(rows));
        for i0 in (0..t).step_by(ATTN_BLOCK) {
            let mb = ATTN_BLOCK.min(t - i0);
            let n = i0 + mb;
            let (p, ds) = (&mut p[..mb * n], &mut ds[..mb * n]);
            causal_probs(&q, &kt, (t, d), (i0, mb), scale, p);
            ds.fill(zero);
            gemm_acc((mb, n, d), |r, c| go[(i0 + r) * d + c], &vt, t, ds, n);
            for (r, (dsr, pr)) in ds.chunks_exact_mut(n).zip(p.chunks_exact(n)).enumerate() {
                let i = i0 + r;
                let delta = dot(&go[i * d..(i + 1) * d], o.row(i));
                for (s, &p) in dsr.iter_mut().zip(pr) {
                    *s = p * (*s - delta) * scale;
                }
            }
            let (ds, p) = (&*ds, &*p);
            gemm_acc((mb, d, n), |r, j| ds[r * n + j], &k, d, &mut dqh[i0 * d..n * d], d);
            gemm_acc((n, d, mb), |j, r| ds[r * n + j], &q[i0 * d..n * d], d, &mut dk[..n * d], d);
            gemm_acc((n, d, mb), |j, r| p[r * n + j], &go[i0 * d..n * d], d, &mut dv[..n * d], d);
        }
    }
    debug_assert_eq!(group * t * d, dq.len());
}

multiversion! {
    /// Gradients of one (batch, KV head).
    fn attn_bwd_group = attn_bwd_kernel(x: &AttnBwdIn<'_, T>, scale: T, dq: &mut [T], dk: &mut [T], dv: &mut [T]);
}

fn attn_bwd<T: Real>(q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (dq, dk, dv) = attn_bwd_vecs::<T>(q, k, v, o, go)?;
    let AttnDims { b, h, kh, t, d } = AttnDims::new(q.shape(), k.shape(), v.shape())?;
    let dq = Tensor::from_vec(dq, (b, h, t, d), &Device::Cpu)?;
    let dk = Tensor::from_vec(dk, (b, kh, t, d), &Device::Cpu)?;
    let dv = Tensor::from_vec(dv, (b, kh, t, d), &Device::Cpu)?;
    Ok((dq, dk, dv))
}

/// The gradients `(dq, dk, dv)` of [`attn_bwd`] as row-major `(B, H, T, D)`, `(B, K, T, D)`,
/// `(B, K, T, D)` vectors.
type AttnGrads<T> = (Vec<T>, Vec<T>, Vec<T>);

fn attn_bwd_vecs<T: Real>(q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> Result<AttnGrads<T>> {
    let go = unit_last(go)?;
    let dims = AttnDims::new(q.shape(), k.shape(), v.shape())?;
    let AttnDims { b, h, kh, t, d } = dims;
    if o.dims() != q.dims() || go.dims() != q.dims() {
        bail!("causal_attention backward: output {:?} or its gradient {:?} is not {:?}", o.shape(), go.shape(), q.shape());
    }
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (os, ol) = o.storage_and_layout();
    let (gs, gl) = go.storage_and_layout();
    let (qrows, krows, vrows, orows, grows) = (row_offsets(ql)?, row_offsets(kl)?, row_offsets(vl)?, row_offsets(ol)?, row_offsets(gl)?);
    let q = Rows { data: cpu_slice::<T>(&qs, "q")?, offsets: &qrows, len: d };
    let k = Rows { data: cpu_slice::<T>(&ks, "k")?, offsets: &krows, len: d };
    let v = Rows { data: cpu_slice::<T>(&vs, "v")?, offsets: &vrows, len: d };
    let o = Rows { data: cpu_slice::<T>(&os, "output")?, offsets: &orows, len: d };
    let go = Rows { data: cpu_slice::<T>(&gs, "grad")?, offsets: &grows, len: d };
    let (group, scale) = (dims.group(), T::from_f64(dims.scale()));
    let zero = T::from_f64(0.0);
    let mut dq = vec![zero; b * h * t * d];
    let mut dk = vec![zero; b * kh * t * d];
    let mut dv = vec![zero; b * kh * t * d];
    if !dq.is_empty() {
        let chunks = dq.par_chunks_mut(group * t * d).zip(dk.par_chunks_mut(t * d)).zip(dv.par_chunks_mut(t * d));
        chunks.enumerate().for_each(|(kv, ((dq, dk), dv))| {
            // The group's query heads are adjacent: rows (b, kv * G .. (kv + 1) * G, ..).
            let qr = ((kv / kh) * h + (kv % kh) * group) * t..((kv / kh) * h + (kv % kh + 1) * group) * t;
            let kr = kv * t..(kv + 1) * t;
            let x = AttnBwdIn { q: q.sub(qr.clone()), k: k.sub(kr.clone()), v: v.sub(kr), o: o.sub(qr.clone()), go: go.sub(qr) };
            attn_bwd_group(&x, scale, dq, dk, dv);
        });
    }
    Ok((dq, dk, dv))
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "fused-causal-attention"
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
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => CpuStorage::F32(attn_fwd(q, l1, k, l2, v, l3)?),
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => CpuStorage::F64(attn_fwd(q, l1, k, l2, v, l3)?),
            _ => bail!("causal_attention: unsupported dtypes {:?}, {:?}, {:?}", s1.dtype(), s2.dtype(), s3.dtype()),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dq, dk, dv) = match q.dtype() {
            DType::F32 => attn_bwd::<f32>(q, k, v, res, grad)?,
            DType::F64 => attn_bwd::<f64>(q, k, v, res, grad)?,
            dt => bail!("causal_attention: unsupported dtype {dt:?}"),
        };
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
pub(in crate::model) mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::*;

    /// Uniform values in `[-scale, scale)` of `shape`, in `dtype`.
    pub(in crate::model) fn rand(rng: &mut fastrand::Rng, shape: &[usize], scale: f64, dtype: DType) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| (rng.f64() * 2.0 - 1.0) * scale).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    /// Values uniform in [-2, 2) of `shape` from `seed`, in f64.
    pub(in crate::model) fn seeded(shape: &[usize], seed: u64) -> Tensor {
        rand(&mut fastrand::Rng::with_seed(seed), shape, 2.0, DType::F64)
    }

    pub(super) fn targets(rng: &mut fastrand::Rng, n: usize, v: usize) -> Tensor {
        Tensor::from_vec((0..n).map(|_| rng.u32(0..v as u32)).collect::<Vec<_>>(), n, &Device::Cpu).unwrap()
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

    pub(in crate::model) fn flat(t: &Tensor) -> Vec<f64> {
        t.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap()
    }

    /// Asserts `|got - want| <= tol * (1 + |want|)` elementwise (and equal shapes).
    pub(super) fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
        assert_eq!(got.dims(), want.dims(), "{what}: shapes");
        let (g, w) = (flat(got), flat(want));
        let mut worst = (0.0f64, 0usize);
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            let e = (a - b).abs() / (1.0 + b.abs());
            assert!(e.is_finite(), "{what}[{i}]: {a} vs {b}");
            if e > worst.0 {
                worst = (e, i);
            }
        }
        assert!(worst.0 <= tol, "{what}[{}]: {} vs {} (error {:e} > {tol:e})", worst.1, g[worst.1], w[worst.1], worst.0);
    }

    /// The loss whose gradients are compared: a random weighting of every output element, or
    /// a plain sum (whose gradient reaches the op as a stride-0 broadcast).
    #[derive(Clone, Copy)]
    pub(super) enum Loss {
        Weighted,
        Sum,
    }

    pub(super) fn loss_of(out: &Tensor, loss: Loss, seed: u64) -> Tensor {
        match loss {
            Loss::Weighted => {
                let w = rand(&mut fastrand::Rng::with_seed(seed), out.dims(), 1.0, out.dtype());
                (out * w).unwrap().sum_all().unwrap()
            }
            Loss::Sum => out.sum_all().unwrap(),
        }
    }

    /// Gradients of `loss(f(inputs))` with respect to each input.
    pub(super) fn grads(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], loss: Loss) -> Vec<Tensor> {
        let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let g = loss_of(&f(&ts).unwrap(), loss, 99).backward().unwrap();
        vars.iter().map(|v| g.get(v.as_tensor()).expect("a gradient for every input").clone()).collect()
    }

    pub(super) fn check_grads(
        fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
        reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
        inputs: &[Tensor],
        what: &str,
    ) {
        for loss in [Loss::Weighted, Loss::Sum] {
            let (a, b) = (grads(fused, inputs, loss), grads(reference, inputs, loss));
            for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                assert_close(a, b, 1e-12, &format!("{what}: gradient of input {i}"));
            }
        }
    }

    /// Central finite differences of the weighted loss against the backward pass, for every
    /// element of every (f64) input.
    pub(super) fn check_finite_differences(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], what: &str) {
        let analytic: Vec<Vec<f64>> = grads(f, inputs, Loss::Weighted).iter().map(flat).collect();
        let eval = |ins: &[Tensor]| loss_of(&f(ins).unwrap(), Loss::Weighted, 99).to_scalar::<f64>().unwrap();
        let eps = 1e-6;
        for (a, input) in inputs.iter().enumerate() {
            let base = flat(input);
            for idx in 0..base.len() {
                let at = |delta: f64| {
                    let mut v = base.clone();
                    v[idx] += delta;
                    let mut ins = inputs.to_vec();
                    ins[a] = Tensor::from_vec(v, input.dims(), &Device::Cpu).unwrap();
                    eval(&ins)
                };
                let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                let g = analytic[a][idx];
                assert!(
                    (fd - g).abs() <= 1e-7 + 1e-6 * fd.abs().max(g.abs()),
                    "{what}: input {a}[{idx}]: finite difference {fd}, backward {g}"
                );
            }
        }
    }

    fn ce_reference(logits: &Tensor, targets: &Tensor, cap: f64) -> Result<Tensor> {
        ops::cross_entropy_rows(&ops::softcap(logits, cap)?, targets)
    }

    fn attn_reference(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        ops::causal_attention(q, k, v, &ops::causal_mask(q.dim(2)?, q.dtype(), q.device())?)
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

    #[test]
    fn rms_norm_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(4);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            let x = rand(&mut rng, &[3, 5, 7], 3.0, dtype);
            assert_close(&rms_norm(&x).unwrap(), &ops::rms_norm(&x).unwrap(), tol, &format!("{dtype:?} contiguous"));
            // Heads transposed as in the model: the last dimension stays contiguous.
            let x = rand(&mut rng, &[2, 7, 3, 8], 3.0, dtype).transpose(1, 2).unwrap();
            assert_close(&rms_norm(&x).unwrap(), &ops::rms_norm(&x).unwrap(), tol, &format!("{dtype:?} transposed"));
            // A last dimension with stride != 1 is copied first.
            let x = rand(&mut rng, &[4, 6], 3.0, dtype).t().unwrap();
            assert_close(&rms_norm(&x).unwrap(), &ops::rms_norm(&x).unwrap(), tol, &format!("{dtype:?} strided rows"));
        }
        let zeros = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(flat(&rms_norm(&zeros).unwrap()), vec![0.0; 6]);
    }

    #[test]
    fn rms_norm_gradients_match_the_reference() {
        let mut rng = fastrand::Rng::with_seed(5);
        let x = rand(&mut rng, &[2, 7, 3, 8], 2.0, DType::F64);
        let fused = |x: &[Tensor]| rms_norm(&x[0].transpose(1, 2)?);
        let reference = |x: &[Tensor]| ops::rms_norm(&x[0].transpose(1, 2)?);
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

    /// Likewise for relu²'s backward op.
    #[test]
    fn relu_sq_backward_op_matches_autograd() {
        let mut rng = fastrand::Rng::with_seed(10);
        for dtype in [DType::F64, DType::F32] {
            let x = candle_core::Var::from_tensor(&rand(&mut rng, &[4, 33], 2.0, dtype)).unwrap();
            let g = rand(&mut rng, &[4, 33], 1.0, dtype);
            let want = (relu_sq(x.as_tensor()).unwrap() * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let got = x.as_tensor().apply_op2_no_bwd(&g, &block::ReluSqBwd).unwrap();
            assert_eq!(flat(&got), flat(want.get(x.as_tensor()).unwrap()), "{dtype:?}");
        }
    }

    #[test]
    fn rms_norm_gradients_match_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(6);
        let x = rand(&mut rng, &[3, 5], 2.0, DType::F64);
        check_finite_differences(&|x| rms_norm(&x[0]), &[x], "rms_norm");
    }

    /// `(q, k, v)` of shapes `(B, H, T, D)`, `(B, K, T, D)`, `(B, K, T, D)`.
    fn qkv(rng: &mut fastrand::Rng, (b, h, k, t, d): (usize, usize, usize, usize, usize), dtype: DType) -> [Tensor; 3] {
        [rand(rng, &[b, h, t, d], 1.5, dtype), rand(rng, &[b, k, t, d], 1.5, dtype), rand(rng, &[b, k, t, d], 1.0, dtype)]
    }

    #[test]
    fn causal_attention_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(7);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            // T = 37 and 40 span several blocks of query rows.
            for shape in [(2, 4, 2, 7, 8), (2, 3, 3, 5, 4), (1, 4, 1, 9, 3), (2, 2, 2, 1, 8), (1, 4, 2, 37, 8), (2, 2, 1, 40, 5)] {
                let [q, k, v] = qkv(&mut rng, shape, dtype);
                let got = causal_attention(&q, &k, &v).unwrap();
                assert_close(&got, &attn_reference(&q, &k, &v).unwrap(), tol, &format!("{dtype:?} {shape:?}"));
            }
            // Views: v as transposed heads, q with a strided last dimension (copied first).
            let (b, h, kh, t, d) = (2, 4, 2, 7, 8);
            let q = rand(&mut rng, &[b, h, d, t], 1.5, dtype).transpose(2, 3).unwrap();
            let k = rand(&mut rng, &[b, kh, t, d], 1.5, dtype);
            let v = rand(&mut rng, &[b, t, kh, d], 1.0, dtype).transpose(1, 2).unwrap();
            let got = causal_attention(&q, &k, &v).unwrap();
            assert_close(&got, &attn_reference(&q, &k, &v).unwrap(), tol, &format!("{dtype:?} views"));
        }
    }

    #[test]
    fn causal_attention_gradients_match_the_reference() {
        let mut rng = fastrand::Rng::with_seed(8);
        for shape in [(2, 4, 2, 7, 8), (2, 2, 2, 6, 5), (1, 4, 2, 37, 8), (1, 2, 1, 40, 5)] {
            let (b, _, kh, t, d) = shape;
            let [q, k, _] = qkv(&mut rng, shape, DType::F64);
            // v arrives as transposed heads, as in the model.
            let v = rand(&mut rng, &[b, t, kh, d], 1.0, DType::F64);
            let fused = |x: &[Tensor]| causal_attention(&x[0], &x[1], &x[2].transpose(1, 2)?);
            let reference = |x: &[Tensor]| attn_reference(&x[0], &x[1], &x[2].transpose(1, 2)?);
            check_grads(&fused, &reference, &[q, k, v], &format!("causal_attention {shape:?}"));
        }
    }

    #[test]
    fn causal_attention_gradients_match_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(9);
        let [q, k, v] = qkv(&mut rng, (1, 4, 2, 5, 3), DType::F64);
        check_finite_differences(&|x| causal_attention(&x[0], &x[1], &x[2]), &[q, k, v], "causal_attention");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(10);
        let half = rand(&mut rng, &[2, 3], 1.0, DType::F16);
        assert!(rms_norm(&half).is_err());
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
        let [q, k, v] = qkv(&mut rng, (1, 3, 2, 4, 2), DType::F32);
        assert!(causal_attention(&q, &k, &v).is_err(), "3 query heads cannot share 2 KV heads");
        let [q, k, v] = qkv(&mut rng, (1, 2, 1, 4, 2), DType::F16);
        assert!(causal_attention(&q, &k, &v).is_err());
    }

    #[test]
    fn fast_f32_exp_and_tanh_are_accurate() {
        let (mut exp_err, mut tanh_err) = (0.0f64, 0.0f64);
        let mut x = -90.0f64;
        while x < 90.0 {
            let xf = x as f32;
            let xd = xf as f64;
            if xd > -87.0 && xd < 88.0 {
                exp_err = exp_err.max((exp_f32(xf) as f64 - xd.exp()).abs() / xd.exp());
            }
            if xd != 0.0 {
                // Relative error, which also bounds the absolute one (|tanh| <= 1).
                tanh_err = tanh_err.max((tanh_f32(xf) as f64 - xd.tanh()).abs() / xd.tanh().abs());
            }
            x += if x.abs() < 1.0 { 1.3e-6 } else { 1.7e-4 };
        }
        assert!(exp_err < 2e-7, "exp: relative error {exp_err:e}");
        assert!(tanh_err < 1e-6, "tanh: relative error {tanh_err:e}");
        assert!(exp_f32(-200.0) < 2e-38 && exp_f32(-200.0) >= 0.0);
        assert_eq!(tanh_f32(1e-30), 1e-30);
        assert!(exp_f32(f32::NAN).is_nan() && tanh_f32(f32::NAN).is_nan());
    }

    /// The kernels as compiled for the baseline target (the tests above run the AVX2 versions
    /// where the CPU has AVX2) give the same results as the dispatched ones.
    #[test]
    fn baseline_kernels_match_the_dispatched_ones() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (rows, v, t, d) = (6usize, 37usize, 21usize, 12usize);
        let data: Vec<f32> = (0..rows * v).map(|_| rng.f32() * 40.0 - 20.0).collect();
        let offsets: Vec<usize> = (0..rows).map(|r| r * v).collect();
        let x = Rows { data: &data, offsets: &offsets, len: v };
        let targets: Vec<usize> = (0..rows).map(|_| rng.usize(0..v)).collect();
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (i, (a, b)) in a.iter().zip(b).enumerate() {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{what}[{i}]: {a} vs {b}");
            }
        };
        let (mut a, mut b) = (vec![0.0f32; rows], vec![0.0f32; rows]);
        ce_fwd_kernel(x, &targets, 30.0, &mut a);
        ce_fwd_rows(x, &targets, 30.0, &mut b);
        close(&a, &b, "ce forward");
        let g: Vec<f32> = (0..rows).map(|_| rng.f32()).collect();
        let loss = a.clone();
        let (mut a, mut b) = (vec![0.0f32; rows * v], vec![0.0f32; rows * v]);
        ce_bwd_kernel(x, &targets, &loss, &g, 30.0, &mut a);
        ce_bwd_rows(x, &targets, &loss, &g, 30.0, &mut b);
        close(&a, &b, "ce backward");
        let (mut a, mut b) = (vec![0.0f32; rows * v], vec![0.0f32; rows * v]);
        rms_fwd_kernel(x, ops::rms_eps(DType::F32), &mut a);
        rms_fwd_rows(x, ops::rms_eps(DType::F32), &mut b);
        close(&a, &b, "rms forward");
        let (mut a, mut b) = (vec![0.0f32; rows * v], vec![0.0f32; rows * v]);
        rms_bwd_kernel(x, x, ops::rms_eps(DType::F32), &mut a);
        rms_bwd_rows(x, x, ops::rms_eps(DType::F32), &mut b);
        close(&a, &b, "rms backward");
        // Attention with 2 query heads on one KV head; the same random rows serve as every input.
        let data: Vec<f32> = (0..2 * t * d).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let offsets: Vec<usize> = (0..2 * t).map(|r| r * d).collect();
        let q = Rows { data: &data, offsets: &offsets, len: d };
        let k = q.sub(t..2 * t);
        let scale = 1.0 / (d as f32).sqrt();
        let (mut a, mut b) = (vec![0.0f32; t * d], vec![0.0f32; t * d]);
        attn_fwd_kernel(q.sub(0..t), k, k, scale, &mut a);
        attn_fwd_head(q.sub(0..t), k, k, scale, &mut b);
        close(&a, &b, "attention forward");
        let x = AttnBwdIn { q, k, v: k, o: q, go: q };
        let mut a = (vec![0.0f32; 2 * t * d], vec![0.0f32; t * d], vec![0.0f32; t * d]);
        let mut b = a.clone();
        attn_bwd_kernel(&x, scale, &mut a.0, &mut a.1, &mut a.2);
        attn_bwd_group(&x, scale, &mut b.0, &mut b.1, &mut b.2);
        close(&a.0, &b.0, "dq");
        close(&a.1, &b.1, "dk");
        close(&a.2, &b.2, "dv");
    }

    /// Fused vs reference forward + backward on the CPU demo model's shapes (f32). Run with
    /// `cargo test --release --lib model::fused -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn speed_against_the_reference() {
        fn time(f: &dyn Fn()) -> f64 {
            f();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let start = std::time::Instant::now();
                f();
                best = best.min(start.elapsed().as_secs_f64());
            }
            best * 1e3
        }
        // Backward from the output itself (candle seeds it with ones), so that only the op is timed.
        fn fwd_bwd(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, vars: &[Tensor]) {
            f(vars).unwrap().backward().unwrap();
        }
        let report = |what: &str,
                      fused: &dyn Fn(&[Tensor]) -> Result<Tensor>,
                      reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
                      inputs: &[Tensor]| {
            let vars: Vec<Tensor> = inputs.iter().map(|t| Var::from_tensor(t).unwrap().as_tensor().clone()).collect();
            let (f, r) = (time(&|| fwd_bwd(fused, &vars)), time(&|| fwd_bwd(reference, &vars)));
            let (ff, rf) = (time(&|| drop(fused(inputs).unwrap())), time(&|| drop(reference(inputs).unwrap())));
            println!(
                "{what}: fwd+bwd fused {f:.2} ms, reference {r:.2} ms ({:.1}x); fwd only {ff:.2} vs {rf:.2} ms ({:.1}x)",
                r / f,
                rf / ff
            );
        };
        let mut rng = fastrand::Rng::with_seed(0);
        let y = targets(&mut rng, 4096, 1024);
        let logits = rand(&mut rng, &[4096, 1024], 10.0, DType::F32);
        report(
            "softcap_cross_entropy (4096, 1024)",
            &|x| softcap_cross_entropy(&x[0], &y, 30.0),
            &|x| ce_reference(&x[0], &y, 30.0),
            &[logits],
        );
        let x = rand(&mut rng, &[16, 256, 128], 1.0, DType::F32);
        report("rms_norm (16, 256, 128)", &|x| rms_norm(&x[0]), &|x| ops::rms_norm(&x[0]), &[x]);
        for shape in [(16, 4, 2, 256, 32), (64, 4, 2, 64, 32)] {
            let inputs = qkv(&mut rng, shape, DType::F32);
            let f = |x: &[Tensor]| causal_attention(&x[0], &x[1], &x[2]);
            let r = |x: &[Tensor]| attn_reference(&x[0], &x[1], &x[2]);
            report(&format!("causal_attention (B, H, K, T, D) = {shape:?}"), &f, &r, &inputs);
        }
    }
}
