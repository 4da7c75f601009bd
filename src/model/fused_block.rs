//! Fused CPU ops for the rest of a transformer block, on the model's token-major layout: the
//! residual stream and every projection are `(N, C)` matrices with `N = B * T` token rows
//! (row `n` is position `n % T` of batch row `n / T`), heads side by side in the columns.
//!
//! Candle's autograd costs every node of the graph a zero-filled gradient buffer and an addition
//! in the backward pass, on top of the node's own gradient, and broadcasts reduce their
//! gradients with slow strided sums. The composites these ops replace (per-channel scales,
//! the residual mix, head reshapes and transposes, QK RMS norm with RoPE and the query gain,
//! `relu().sqr()`) were most of the backward pass of the CPU demo model. Here each is one node:
//!
//! - [`scale_add`]: `base + x * s` with a per-channel vector `s` (the attention and MLP output
//!   scales, the U-Net skips);
//! - [`resid_mix`]: `h * mix[0] + x0 * mix[1]`;
//! - [`relu_sq`]: the square of `relu(x)`;
//! - [`qk_norm_rope`]: per-head RMS norm, rotary embedding and an optional per-head gain of a
//!   query or key projection, heads staying in the columns;
//! - [`causal_attention_tokens`]: [`super::causal_attention`] reading and writing token-major
//!   matrices, so that no transpose or copy of the heads enters the graph.
//!
//! Per-channel gradients (of `s`, `mix`, the gains) are sums over rows: each rayon task sums a
//! fixed block of rows and the blocks are added in order, so results do not depend on thread
//! scheduling. Off the CPU every op falls back to its composite of candle ops.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

use super::{AttnDims, Real, attn_bwd_vecs, attn_fwd, check_float, cpu_slice, dot_f64};
use crate::model::host::{narrowed, widened};
use crate::model::ops;

/// Rows per rayon task for the elementwise ops and the per-channel sums.
const ROWS: usize = 64;

/// `base + x * s` for `base` and `x` of the same shape `(.., C)` and a per-channel `s` of shape
/// `(C,)`: `base + x.broadcast_mul(s)`, in `base`'s dtype.
///
/// `x` may be of the narrower dtype of a mixed-precision pair (a bf16 product added to the f32
/// residual stream): on the GPU path one kernel reads it as it is and the backward pass writes
/// its gradient in that dtype, the values of `cast` then `scale_add` without either cast pass.
pub fn scale_add(base: &Tensor, x: &Tensor, s: &Tensor) -> Result<Tensor> {
    let on_gpu = super::super::gpu_path(base);
    if x.dtype() != base.dtype() && !(on_gpu && super::mixed_pair(base.dtype(), x.dtype())) {
        return scale_add(base, &crate::model::cast::cast(x, base.dtype())?, s);
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

/// The residual mix `h * mix[0] + x0 * mix[1]` for `h` and `x0` of the same shape `(.., C)` and
/// `mix` of shape `(2, C)`.
pub fn resid_mix(h: &Tensor, x0: &Tensor, mix: &Tensor) -> Result<Tensor> {
    let on_gpu = super::super::gpu_path(h);
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

/// `relu(x)^2`, elementwise: `x.relu().sqr()`.
pub fn relu_sq(x: &Tensor) -> Result<Tensor> {
    if super::super::gpu_path(x) && x.rank() > 0 {
        return x.contiguous()?.apply_op1(ReluSq);
    }
    if !x.device().is_cpu() {
        return x.relu()?.sqr();
    }
    check_float("relu_sq", x.dtype())?;
    x.contiguous()?.apply_op1(ReluSq)
}

/// Per-head RMS norm, then RoPE, then (when given) a per-head gain, of a query or key
/// projection `x` of shape `(N, H * D)` whose `N = B * T` rows are token-major (row `n` is at
/// position `n % T`): with `(B, H, T, D)` heads `xh` of `x`, the heads of the result are
/// `ops::rope(ops::rms_norm(xh), cos, sin) * gain[h]`. `cos` and `sin` are the `(T, D / 2)`
/// tables of [`ops::rope_tables`], `gain` has shape `(H,)`. `eps` is the norm's epsilon, by
/// default the input dtype's ([`ops::rms_eps`]). Returns `(N, H * D)`.
pub fn qk_norm_rope(x: &Tensor, gain: Option<&Tensor>, cos: &Tensor, sin: &Tensor, heads: usize, eps: Option<f64>) -> Result<Tensor> {
    let (n, width) = x.dims2()?;
    let (t, half) = cos.dims2()?;
    if heads == 0 || width != heads * 2 * half || sin.dims() != cos.dims() || t == 0 || n % t != 0 {
        bail!("qk_norm_rope: x {:?} with {heads} heads does not fit tables {:?} and {:?}", x.shape(), cos.shape(), sin.shape());
    }
    if let Some(g) = gain
        && g.dims() != [heads]
    {
        bail!("qk_norm_rope: gain {:?} for {heads} heads", g.shape());
    }
    if super::super::gpu_path(x) {
        let table = Tensor::cat(&[cos, sin], 1)?;
        let y = super::super::norm_rope::norm_rope(x, &table, heads, eps)?;
        return match gain {
            // The gain per channel (each head's repeated over its D channels).
            Some(g) => scale_cols(&y, &g.reshape((heads, 1))?.broadcast_as((heads, 2 * half))?.reshape(width)?),
            None => Ok(y),
        };
    }
    if !x.device().is_cpu() {
        let d = 2 * half;
        // The norm is per (token, head) row: on the token-major rows, before the transpose (on
        // a GPU that is the fused norm's one kernel each way).
        let rows = x.reshape((n, heads, d))?;
        let xn = match eps {
            Some(eps) => ops::rms_norm_eps(&rows, eps)?,
            None => super::rms_norm(&rows)?,
        };
        let xh = xn.reshape((n / t, t, heads, d))?.transpose(1, 2)?;
        let mut y = ops::rope(&xh, cos, sin)?;
        if let Some(g) = gain {
            y = y.broadcast_mul(&g.reshape((1, heads, 1, 1))?)?;
        }
        return y.transpose(1, 2)?.reshape((n, width));
    }
    check_float("qk_norm_rope", x.dtype())?;
    let table = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>() };
    let eps = eps.unwrap_or(ops::rms_eps(x.dtype()));
    let op = QkNormRope { heads, half, seq: t, eps, cos: table(cos)?, sin: table(sin)? };
    match gain {
        Some(g) => {
            same_dtypes("qk_norm_rope", &[x, g])?;
            x.contiguous()?.apply_op2(&g.contiguous()?, op)
        }
        None => x.contiguous()?.apply_op1(op),
    }
}

/// Causal grouped-query attention on token-major matrices: `q` is `(N, H * D)`, `k` and `v` are
/// `(N, K * D)` with `N = batch * T` rows (row `n` is position `n % T` of batch row `n / T`).
/// The same as [`super::causal_attention`] on the `(B, H, T, D)` heads of the inputs, with its
/// output's heads put back side by side: returns `(N, H * D)`.
pub fn causal_attention_tokens(q: &Tensor, k: &Tensor, v: &Tensor, batch: usize, heads: usize, kv_heads: usize) -> Result<Tensor> {
    let (n, width) = q.dims2()?;
    if batch == 0 || heads == 0 || kv_heads == 0 || n % batch != 0 || width % heads != 0 {
        bail!("causal_attention_tokens: q {:?} does not split into {batch} rows of {heads} heads", q.shape());
    }
    let (t, d) = (n / batch, width / heads);
    if k.dims() != [n, kv_heads * d] || v.dims() != k.dims() {
        bail!("causal_attention_tokens: k {:?} and v {:?} are not ({n}, {kv_heads} * {d})", k.shape(), v.shape());
    }
    if !q.device().is_cpu() || super::super::gpu_path(q) {
        let split = |x: &Tensor, h: usize| x.reshape((batch, t, h, d))?.transpose(1, 2);
        let y = super::causal_attention(&split(q, heads)?, &split(k, kv_heads)?, &split(v, kv_heads)?)?;
        return y.transpose(1, 2)?.reshape((n, width));
    }
    check_float("causal_attention_tokens", q.dtype())?;
    same_dtypes("causal_attention_tokens", &[q, k, v])?;
    let kv = Shape::from((batch, kv_heads, t, d));
    let dims = AttnDims::new(&Shape::from((batch, heads, t, d)), &kv, &kv)?;
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, AttentionTokens { dims })
}

// ---------------------------------------------------------------------------------------------
// Plumbing.

fn same_dtypes(op: &str, ts: &[&Tensor]) -> Result<()> {
    if ts.iter().any(|t| t.dtype() != ts[0].dtype()) {
        bail!("{op}: dtypes differ: {:?}", ts.iter().map(|t| t.dtype()).collect::<Vec<_>>());
    }
    Ok(())
}

fn last_dim(x: &Tensor) -> Result<usize> {
    match x.dims().last() {
        Some(&c) if c > 0 => Ok(c),
        _ => bail!("fused op: needs a non-empty last dimension, got {:?}", x.shape()),
    }
}

/// The elements of a contiguous layout in its storage.
fn elems<'a, T: Real>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("fused op: input is not contiguous, layout {l:?}") };
    Ok(&T::cpu_storage_as_slice(s)?[a..b])
}

/// [`elems`] as `T` from a storage of `T` (borrowed) or of the narrower dtype of a mixed pair
/// (widened exactly; callers check the pair).
fn elems_as<'a, T: Real>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [T]>> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("fused op: input is not contiguous, layout {l:?}") };
    Ok(match super::values_as::<T>(s)? {
        Cow::Borrowed(v) => Cow::Borrowed(&v[a..b]),
        Cow::Owned(mut v) => {
            v.truncate(b);
            v.drain(..a);
            Cow::Owned(v)
        }
    })
}

/// A CPU tensor's storage, held for reading.
struct Held<'a>(candle_core::StorageRef<'a>, &'a Layout);

impl<'a> Held<'a> {
    fn new(t: &'a Tensor) -> Self {
        let (s, l) = t.storage_and_layout();
        Self(s, l)
    }

    /// The tensor's elements (it must be contiguous).
    fn slice<T: Real>(&self, what: &str) -> Result<&[T]> {
        let Some((a, b)) = self.1.contiguous_offsets() else { bail!("fused op: {what} is not contiguous") };
        Ok(&cpu_slice::<T>(&self.0, what)?[a..b])
    }
}

fn wrap<T: Real>(v: Vec<T>) -> CpuStorage {
    T::to_cpu_storage_owned(v)
}

/// Sums the per-block partial sums in block order.
fn add_partials(parts: Vec<Vec<f64>>, len: usize) -> Vec<f64> {
    let mut total = vec![0.0; len];
    for p in parts {
        for (t, x) in total.iter_mut().zip(p) {
            *t += x;
        }
    }
    total
}

fn from_f64<T: Real>(v: &[f64], shape: impl Into<Shape>) -> Result<Tensor> {
    Tensor::from_vec(v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>(), shape, &Device::Cpu)
}

/// Evaluates `$body` with the type `$t` bound to the float type of `$dtype`.
macro_rules! float_dispatch {
    ($dtype:expr, $op:expr, |$t:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                $body
            }
            DType::F64 => {
                type $t = f64;
                $body
            }
            dt => bail!("{}: unsupported dtype {dt:?}", $op),
        }
    };
}

/// `x * s` for `x` `(.., C)` and `s` `(C,)` (one dtype), written in the dtype held (`x`'s, or
/// the narrower of a mixed pair): the per-channel scale of a gradient in the GPU backward passes
/// of [`ScaleAdd`] and [`ResidMix`]. The CPU implementation is the kernel's reference.
struct ScaleCols(DType);

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
            super::to_storage(&x.chunks(c).flat_map(|row| row.iter().zip(sc).map(|(&a, &b)| a * b)).collect::<Vec<T>>(), self.0)?
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
        let out = super::super::gpu_kernels::rows_op_mixed("scale_cols", &[(xs, xl)], &[(ss, sl)], self.0, c, 0.0, &[])?;
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
pub fn scale_cols(x: &Tensor, s: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&s.contiguous()?, ScaleCols(x.dtype()))
}

/// `sum over rows of (a * b)` for `a`, `b` `(.., C)` of one dtype, or `b` of the narrower of a
/// mixed pair: the per-channel gradient of the GPU formulation, `(C,)` in `a`'s dtype.
/// Accumulated in f32 at least (candle's own sums accumulate in the tensor's dtype: 65,536 rows
/// summed in bf16 keep about two digits), in a fixed order: a kernel pair on a GPU (partial sums
/// of 64 rows, then the partials in order), f64 in row order on the CPU (the reference).
fn column_dot(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let c = last_dim(a)?;
    if a.dims() != b.dims() {
        bail!("column_dot: shapes {:?} and {:?} differ", a.shape(), b.shape());
    }
    if !super::same_or_narrower(a.dtype(), b.dtype()) {
        bail!("column_dot: dtypes {:?} and {:?} are not a mixed pair", a.dtype(), b.dtype());
    }
    a.contiguous()?.reshape(((), c))?.apply_op2_no_bwd(&b.contiguous()?.reshape(((), c))?, &ColumnDot)
}

struct ColumnDot;

fn column_dot_cpu<T: Real>(a: &[T], b: &[T], c: usize) -> Vec<T> {
    let mut acc = vec![0f64; c];
    for (ra, rb) in a.chunks_exact(c).zip(b.chunks_exact(c)) {
        for ((s, x), y) in acc.iter_mut().zip(ra).zip(rb) {
            *s += x.to_f64() * y.to_f64();
        }
    }
    acc.into_iter().map(T::from_f64).collect()
}

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
        Ok((super::super::gpu_kernels::column_dot((s1, l1), (s2, l2))?, Shape::from(c)))
    }
}

/// The GPU backward pass of [`ScaleAdd`]: `(dbase, dx, ds)`, `dx` in `x`'s dtype (narrower
/// under mixed precision: written so by the kernel).
fn scale_add_bwd_gpu(x: &Tensor, s: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let dx = grad.apply_op2_no_bwd(s, &ScaleCols(x.dtype()))?;
    let ds = column_dot(&grad, x)?;
    Ok((grad, dx, ds))
}

/// The GPU backward pass of [`ResidMix`]: `(dh, dx0, dmix)`.
fn resid_mix_bwd_gpu(h: &Tensor, x0: &Tensor, mix: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let dh = grad.apply_op2_no_bwd(&mix.get(0)?, &ScaleCols(h.dtype()))?;
    let dx0 = grad.apply_op2_no_bwd(&mix.get(1)?, &ScaleCols(x0.dtype()))?;
    let dmix = Tensor::stack(&[column_dot(&grad, h)?, column_dot(&grad, x0)?], 0)?;
    Ok((dh, dx0, dmix))
}

// ---------------------------------------------------------------------------------------------
// base + x * s.

struct ScaleAdd;

#[inline(always)]
fn scale_add_kernel<T: Real>(base: &[T], x: &[T], s: &[T], out: &mut [T]) {
    let c = s.len();
    for ((o, b), x) in out.chunks_exact_mut(c).zip(base.chunks_exact(c)).zip(x.chunks_exact(c)) {
        for (((o, &b), &x), &s) in o.iter_mut().zip(b).zip(x).zip(s) {
            *o = b + x * s;
        }
    }
}

multiversion! {
    /// Rows of `base + x * s`.
    fn scale_add_rows = scale_add_kernel(base: &[T], x: &[T], s: &[T], out: &mut [T]);
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

fn scale_add_fwd<T: Real>(base: &[T], x: &[T], s: &[T]) -> Vec<T> {
    let c = s.len();
    let mut out = vec![T::from_f64(0.0); base.len()];
    out.par_chunks_mut(ROWS * c).zip(base.par_chunks(ROWS * c)).zip(x.par_chunks(ROWS * c)).for_each(|((o, b), x)| {
        scale_add_rows(b, x, s, o);
    });
    out
}

fn scale_add_bwd<T: Real>(x: &Tensor, s: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let (xh, sh, gh) = (Held::new(x), Held::new(s), Held::new(&grad));
    let (xv, sv, gv) = (xh.slice::<T>("x")?, sh.slice::<T>("scale")?, gh.slice::<T>("grad")?);
    let c = sv.len();
    let mut dx = vec![T::from_f64(0.0); xv.len()];
    let parts: Vec<Vec<f64>> = dx
        .par_chunks_mut(ROWS * c)
        .zip(gv.par_chunks(ROWS * c))
        .zip(xv.par_chunks(ROWS * c))
        .map(|((dx, g), x)| {
            let mut ds = vec![0.0; c];
            scale_add_bwd_rows(g, x, sv, dx, &mut ds);
            ds
        })
        .collect();
    let ds = from_f64::<T>(&add_partials(parts, c), c)?;
    Ok((Tensor::from_vec(dx, x.shape(), &Device::Cpu)?, ds))
}

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
        let out = super::super::gpu_kernels::rows_op_mixed("scale_add", &[(s1, l1), (s2, l2)], &[(s3, l3)], s1.dtype(), c, 0.0, &[])?;
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
        if super::super::gpu_path(x) {
            let (dbase, dx, ds) = scale_add_bwd_gpu(x, s, grad)?;
            return Ok((Some(dbase), Some(dx), Some(ds)));
        }
        // Off the GPU path `scale_add` cast x to base's dtype, so all three share it here.
        let (dx, ds) = float_dispatch!(x.dtype(), "scale_add", |T| scale_add_bwd::<T>(x, s, grad)?);
        Ok((Some(grad.clone()), Some(dx), Some(ds)))
    }
}

// ---------------------------------------------------------------------------------------------
// h * mix[0] + x0 * mix[1].

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

/// `dh = g * m0`, `dx0 = g * m1` for `mix = [m0, m1]`; adds `g * h` and `g * x0` to the sums
/// `dm = [dm0, dm1]`.
#[inline(always)]
fn mix_bwd_kernel<T: Real>(g: &[T], h: &[T], x0: &[T], mix: &[T], dh: &mut [T], dx0: &mut [T], dm: &mut [f64]) {
    let c = mix.len() / 2;
    let (m0, m1) = mix.split_at(c);
    let (dm0, dm1) = dm.split_at_mut(c);
    let rows = dh.chunks_exact_mut(c).zip(dx0.chunks_exact_mut(c)).zip(g.chunks_exact(c)).zip(h.chunks_exact(c)).zip(x0.chunks_exact(c));
    for ((((dh, dx0), g), h), x0) in rows {
        for i in 0..c {
            let gi = g[i];
            dh[i] = gi * m0[i];
            dx0[i] = gi * m1[i];
            dm0[i] += (gi * h[i]).to_f64();
            dm1[i] += (gi * x0[i]).to_f64();
        }
    }
}

multiversion! {
    /// Gradient rows of the residual mix.
    fn mix_bwd_rows = mix_bwd_kernel(g: &[T], h: &[T], x0: &[T], mix: &[T], dh: &mut [T], dx0: &mut [T], dm: &mut [f64]);
}

fn mix_fwd<T: Real>(h: &[T], x0: &[T], mix: &[T]) -> Vec<T> {
    let c = mix.len() / 2;
    let (m0, m1) = mix.split_at(c);
    let mut out = vec![T::from_f64(0.0); h.len()];
    out.par_chunks_mut(ROWS * c).zip(h.par_chunks(ROWS * c)).zip(x0.par_chunks(ROWS * c)).for_each(|((o, h), x0)| {
        mix_rows(h, x0, m0, m1, o);
    });
    out
}

fn mix_bwd<T: Real>(h: &Tensor, x0: &Tensor, mix: &Tensor, grad: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let grad = grad.contiguous()?;
    let (hh, xh, mh, gh) = (Held::new(h), Held::new(x0), Held::new(mix), Held::new(&grad));
    let (hv, xv, mv, gv) = (hh.slice::<T>("h")?, xh.slice::<T>("x0")?, mh.slice::<T>("mix")?, gh.slice::<T>("grad")?);
    let c = mv.len() / 2;
    let zero = T::from_f64(0.0);
    let (mut dh, mut dx0) = (vec![zero; hv.len()], vec![zero; hv.len()]);
    let parts: Vec<Vec<f64>> = dh
        .par_chunks_mut(ROWS * c)
        .zip(dx0.par_chunks_mut(ROWS * c))
        .zip(gv.par_chunks(ROWS * c))
        .zip(hv.par_chunks(ROWS * c))
        .zip(xv.par_chunks(ROWS * c))
        .map(|((((dh, dx0), g), h), x0)| {
            let mut dm = vec![0.0; 2 * c];
            mix_bwd_rows(g, h, x0, mv, dh, dx0, &mut dm);
            dm
        })
        .collect();
    let dm = from_f64::<T>(&add_partials(parts, 2 * c), (2, c))?;
    Ok((Tensor::from_vec(dh, h.shape(), &Device::Cpu)?, Tensor::from_vec(dx0, h.shape(), &Device::Cpu)?, dm))
}

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
        Ok((super::super::gpu_kernels::rows_op_with("resid_mix", &[(s1, l1), (s2, l2)], &[(s3, l3)], c, 0.0, &[])?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        h: &Tensor,
        x0: &Tensor,
        mix: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        if super::super::gpu_path(h) {
            let (dh, dx0, dm) = resid_mix_bwd_gpu(h, x0, mix, grad)?;
            return Ok((Some(dh), Some(dx0), Some(dm)));
        }
        let (dh, dx0, dm) = float_dispatch!(h.dtype(), "resid_mix", |T| mix_bwd::<T>(h, x0, mix, grad)?);
        Ok((Some(dh), Some(dx0), Some(dm)))
    }
}

// ---------------------------------------------------------------------------------------------
// relu(x)^2.

struct ReluSq;

/// Elements per rayon task.
const ELEMS: usize = 1 << 14;

#[inline(always)]
fn relu_sq_kernel<T: Real>(x: &[T], out: &mut [T]) {
    let zero = T::from_f64(0.0);
    for (o, &x) in out.iter_mut().zip(x) {
        let r = if x > zero { x } else { zero };
        *o = r * r;
    }
}

multiversion! {
    /// `relu(x)^2` of a block.
    fn relu_sq_block = relu_sq_kernel(x: &[T], out: &mut [T]);
}

/// `dx = 2 relu(x) g`.
#[inline(always)]
fn relu_sq_bwd_kernel<T: Real>(x: &[T], g: &[T], out: &mut [T]) {
    let zero = T::from_f64(0.0);
    for ((o, &x), &g) in out.iter_mut().zip(x).zip(g) {
        let r = if x > zero { x } else { zero };
        *o = g * (r + r);
    }
}

multiversion! {
    /// Gradient of `relu(x)^2` on a block.
    fn relu_sq_bwd_block = relu_sq_bwd_kernel(x: &[T], g: &[T], out: &mut [T]);
}

fn relu_sq_fwd<T: Real>(x: &[T]) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); x.len()];
    out.par_chunks_mut(ELEMS).zip(x.par_chunks(ELEMS)).for_each(|(o, x)| relu_sq_block(x, o));
    out
}

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
        Ok((super::super::gpu_kernels::rows_op("relu_sq_fwd", &[(s, l)], d, 0.0)?, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(&grad.contiguous()?, &ReluSqBwd)?))
    }
}

/// `(x, grad) -> 2 relu(x) grad`: [`ReluSq`]'s backward pass, on the CPU (the GPU kernel's
/// reference) or the GPU.
pub(super) struct ReluSqBwd;

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
            let mut out = vec![<T as candle_core::WithDType>::from_f64(0.0); x.len()];
            out.par_chunks_mut(ELEMS).zip(x.par_chunks(ELEMS)).zip(g.par_chunks(ELEMS)).for_each(|((o, x), g)| relu_sq_bwd_block(x, g, o));
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
        Ok((super::super::gpu_kernels::rows_op("relu_sq_bwd", &[(xs, xl), (gs, gl)], d, 0.0)?, xl.shape().clone()))
    }
}

// ---------------------------------------------------------------------------------------------
// Per-head RMS norm, RoPE and gain.

struct QkNormRope {
    heads: usize,
    half: usize,
    seq: usize,
    /// The RMS norm's epsilon.
    eps: f64,
    /// `(T, D / 2)` tables, row-major.
    cos: Vec<f64>,
    sin: Vec<f64>,
}

/// The geometry of one call: `heads` heads of `2 * half` per row, row `n` at position
/// `n % seq`, the tables in `T`.
struct RopeRows<'a, T> {
    heads: usize,
    half: usize,
    seq: usize,
    eps: f64,
    cos: &'a [T],
    sin: &'a [T],
}

/// Rows `n0..` of the forward pass: `out` and `x` hold whole rows of `heads * 2 * half`.
#[inline(always)]
fn qk_fwd_kernel<T: Real>(g: &RopeRows<'_, T>, n0: usize, x: &[T], gain: Option<&[T]>, out: &mut [T]) {
    let (half, d) = (g.half, 2 * g.half);
    let eps = g.eps;
    for (r, (orow, xrow)) in out.chunks_exact_mut(g.heads * d).zip(x.chunks_exact(g.heads * d)).enumerate() {
        let pos = (n0 + r) % g.seq;
        let (cos, sin) = (&g.cos[pos * half..(pos + 1) * half], &g.sin[pos * half..(pos + 1) * half]);
        for (h, (o, xh)) in orow.chunks_exact_mut(d).zip(xrow.chunks_exact(d)).enumerate() {
            // As `ops::rms_norm`, then `ops::rope`, then the gain, rounding for rounding.
            let rms = T::from_f64((dot_f64(xh, xh) / d as f64 + eps).sqrt());
            let (x1, x2) = xh.split_at(half);
            let (o1, o2) = o.split_at_mut(half);
            for i in 0..half {
                let (y1, y2) = (x1[i] / rms, x2[i] / rms);
                o1[i] = y1 * cos[i] + y2 * sin[i];
                o2[i] = y2 * cos[i] - y1 * sin[i];
            }
            if let Some(gain) = gain {
                let w = gain[h];
                for o in o.iter_mut() {
                    *o *= w;
                }
            }
        }
    }
}

multiversion! {
    /// Forward rows of `qk_norm_rope`.
    fn qk_fwd_rows = qk_fwd_kernel(g: &RopeRows<'_, T>, n0: usize, x: &[T], gain: Option<&[T]>, out: &mut [T]);
}

/// Gradient rows `n0..`: `dx` of `x` given the output gradient `go`; with a gain, adds each
/// head's `sum(go * rope(norm(x)))` to `dgain`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn qk_bwd_kernel<T: Real>(g: &RopeRows<'_, T>, n0: usize, x: &[T], go: &[T], gain: Option<&[T]>, dx: &mut [T], dgain: &mut [f64]) {
    let (half, d) = (g.half, 2 * g.half);
    let eps = g.eps;
    let w = g.heads * d;
    for (r, ((dxrow, xrow), gorow)) in dx.chunks_exact_mut(w).zip(x.chunks_exact(w)).zip(go.chunks_exact(w)).enumerate() {
        let pos = (n0 + r) % g.seq;
        let (cos, sin) = (&g.cos[pos * half..(pos + 1) * half], &g.sin[pos * half..(pos + 1) * half]);
        for (h, ((dxh, xh), goh)) in dxrow.chunks_exact_mut(d).zip(xrow.chunks_exact(d)).zip(gorow.chunks_exact(d)).enumerate() {
            let rms = (dot_f64(xh, xh) / d as f64 + eps).sqrt();
            let (x1, x2) = xh.split_at(half);
            let (g1, g2) = goh.split_at(half);
            if gain.is_some() {
                // d gain = sum(go * rope(y)) with y = x / rms as the forward pass rounds it.
                let rt = T::from_f64(rms);
                let mut acc = 0.0f64;
                for i in 0..half {
                    let (y1, y2) = (x1[i] / rt, x2[i] / rt);
                    acc += (g1[i] * (y1 * cos[i] + y2 * sin[i])).to_f64() + (g2[i] * (y2 * cos[i] - y1 * sin[i])).to_f64();
                }
                dgain[h] += acc;
            }
            let w = gain.map_or(T::from_f64(1.0), |gain| gain[h]);
            // dy = rope^T(go * w), kept in dx for now.
            {
                let (d1, d2) = dxh.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (g1[i] * w, g2[i] * w);
                    d1[i] = a * cos[i] - b * sin[i];
                    d2[i] = a * sin[i] + b * cos[i];
                }
            }
            // RMS norm backward: dx = dy / r - x sum(dy x) / (d r^3).
            let a = T::from_f64(1.0 / rms);
            let c = T::from_f64(dot_f64(xh, dxh) / (d as f64 * rms * rms * rms));
            for (dx, &x) in dxh.iter_mut().zip(xh) {
                *dx = *dx * a - x * c;
            }
        }
    }
}

multiversion! {
    /// Gradient rows of `qk_norm_rope`.
    fn qk_bwd_rows = qk_bwd_kernel(g: &RopeRows<'_, T>, n0: usize, x: &[T], go: &[T], gain: Option<&[T]>, dx: &mut [T], dgain: &mut [f64]);
}

impl QkNormRope {
    fn tables<T: Real>(&self) -> (Vec<T>, Vec<T>) {
        (self.cos.iter().map(|&c| T::from_f64(c)).collect(), self.sin.iter().map(|&s| T::from_f64(s)).collect())
    }

    fn fwd<T: Real>(&self, x: &[T], gain: Option<&[T]>) -> Vec<T> {
        let (cos, sin) = self.tables::<T>();
        let g = RopeRows { heads: self.heads, half: self.half, seq: self.seq, eps: self.eps, cos: &cos, sin: &sin };
        let w = self.heads * 2 * self.half;
        let mut out = vec![T::from_f64(0.0); x.len()];
        out.par_chunks_mut(ROWS * w).zip(x.par_chunks(ROWS * w)).enumerate().for_each(|(c, (o, x))| {
            qk_fwd_rows(&g, c * ROWS, x, gain, o);
        });
        out
    }

    fn bwd<T: Real>(&self, x: &Tensor, gain: Option<&Tensor>, grad: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (xh, gh) = (Held::new(x), Held::new(&grad));
        let gainh = gain.map(Held::new);
        let (xv, gv) = (xh.slice::<T>("x")?, gh.slice::<T>("grad")?);
        let gainv = match &gainh {
            Some(h) => Some(h.slice::<T>("gain")?),
            None => None,
        };
        let (cos, sin) = self.tables::<T>();
        let geo = RopeRows { heads: self.heads, half: self.half, seq: self.seq, eps: self.eps, cos: &cos, sin: &sin };
        let w = self.heads * 2 * self.half;
        let mut dx = vec![T::from_f64(0.0); xv.len()];
        let parts: Vec<Vec<f64>> = dx
            .par_chunks_mut(ROWS * w)
            .zip(xv.par_chunks(ROWS * w))
            .zip(gv.par_chunks(ROWS * w))
            .enumerate()
            .map(|(c, ((dx, x), go))| {
                let mut dgain = vec![0.0; if gainv.is_some() { self.heads } else { 0 }];
                qk_bwd_rows(&geo, c * ROWS, x, go, gainv, dx, &mut dgain);
                dgain
            })
            .collect();
        let dgain = match gain {
            Some(_) => Some(from_f64::<T>(&add_partials(parts, self.heads), self.heads)?),
            None => None,
        };
        Ok((Tensor::from_vec(dx, x.shape(), &Device::Cpu)?, dgain))
    }
}

impl CustomOp1 for QkNormRope {
    fn name(&self) -> &'static str {
        "fused-qk-norm-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(s.dtype(), "qk_norm_rope", |T| wrap(self.fwd::<T>(elems(s, l)?, None)));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(float_dispatch!(x.dtype(), "qk_norm_rope", |T| self.bwd::<T>(x, None, grad)?.0)))
    }
}

impl CustomOp2 for QkNormRope {
    fn name(&self) -> &'static str {
        "fused-qk-norm-rope-gain"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = float_dispatch!(s1.dtype(), "qk_norm_rope", |T| wrap(self.fwd::<T>(elems(s1, l1)?, Some(elems(s2, l2)?))));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, gain: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dgain) = float_dispatch!(x.dtype(), "qk_norm_rope", |T| self.bwd::<T>(x, Some(gain), grad)?);
        Ok((Some(dx), dgain))
    }
}

// ---------------------------------------------------------------------------------------------
// Attention on token-major matrices.

struct AttentionTokens {
    dims: AttnDims,
}

/// The `(B, heads, T, D)` view of a contiguous token-major `(B * T, heads * D)` layout.
fn heads_view(l: &Layout, (b, t, d): (usize, usize, usize), heads: usize) -> Layout {
    Layout::new(Shape::from((b, heads, t, d)), vec![t * heads * d, d, heads * d, 1], l.start_offset())
}

/// A row-major `(B, H, T, D)` vector as token-major `(B * T, H * D)`.
fn heads_to_tokens<T: Real>(src: &[T], (_, h, t, d): (usize, usize, usize, usize)) -> Vec<T> {
    let mut out = vec![T::from_f64(0.0); src.len()];
    if out.is_empty() {
        return out;
    }
    out.par_chunks_mut(t * h * d).enumerate().for_each(|(bi, ob)| {
        for hh in 0..h {
            for ti in 0..t {
                let s = ((bi * h + hh) * t + ti) * d;
                ob[(ti * h + hh) * d..(ti * h + hh + 1) * d].copy_from_slice(&src[s..s + d]);
            }
        }
    });
    out
}

impl AttentionTokens {
    fn fwd<T: Real>(&self, q: &[T], ql: &Layout, k: &[T], kl: &Layout, v: &[T], vl: &Layout) -> Result<Vec<T>> {
        let AttnDims { b, h, kh, t, d } = self.dims;
        let (ql, kl, vl) = (heads_view(ql, (b, t, d), h), heads_view(kl, (b, t, d), kh), heads_view(vl, (b, t, d), kh));
        Ok(heads_to_tokens(&attn_fwd(q, &ql, k, &kl, v, &vl)?, (b, h, t, d)))
    }

    fn bwd<T: Real>(&self, q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let AttnDims { b, h, kh, t, d } = self.dims;
        let split = |x: &Tensor, heads: usize| x.detach().contiguous()?.reshape((b, t, heads, d))?.transpose(1, 2);
        let (dq, dk, dv) = attn_bwd_vecs::<T>(&split(q, h)?, &split(k, kh)?, &split(v, kh)?, &split(o, h)?, &split(go, h)?)?;
        let back = |x: Vec<T>, heads: usize| Tensor::from_vec(heads_to_tokens(&x, (b, heads, t, d)), (b * t, heads * d), &Device::Cpu);
        Ok((back(dq, h)?, back(dk, kh)?, back(dv, kh)?))
    }
}

impl CustomOp3 for AttentionTokens {
    fn name(&self) -> &'static str {
        "fused-causal-attention-tokens"
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
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => CpuStorage::F32(self.fwd(q, l1, k, l2, v, l3)?),
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => CpuStorage::F64(self.fwd(q, l1, k, l2, v, l3)?),
            _ => bail!("causal_attention_tokens: unsupported dtypes {:?}, {:?}, {:?}", s1.dtype(), s2.dtype(), s3.dtype()),
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
        let (dq, dk, dv) = float_dispatch!(q.dtype(), "causal_attention_tokens", |T| self.bwd::<T>(q, k, v, res, grad)?);
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Result, Tensor};

    use super::super::tests::{Loss, assert_close, check_finite_differences, check_grads, grads, rand};
    use super::*;

    fn scale_add_ref(x: &[Tensor]) -> Result<Tensor> {
        &x[0] + x[1].broadcast_mul(&x[2])?
    }

    fn mix_ref(x: &[Tensor]) -> Result<Tensor> {
        x[0].broadcast_mul(&x[2].get(0)?)? + x[1].broadcast_mul(&x[2].get(1)?)?
    }

    /// The composite of the model before fusion: heads split out, RMS norm, RoPE, gain, heads put
    /// back.
    fn qk_ref(x: &Tensor, gain: Option<&Tensor>, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
        let (n, w) = x.dims2()?;
        let t = cos.dim(0)?;
        let xh = x.reshape((n / t, t, heads, w / heads))?.transpose(1, 2)?;
        let mut y = ops::rope(&ops::rms_norm(&xh)?, cos, sin)?;
        if let Some(g) = gain {
            y = y.broadcast_mul(&g.reshape((1, heads, 1, 1))?)?;
        }
        y.transpose(1, 2)?.reshape((n, w))
    }

    fn attn_ref(q: &Tensor, k: &Tensor, v: &Tensor, b: usize, h: usize, kh: usize) -> Result<Tensor> {
        let (n, w) = q.dims2()?;
        let (t, d) = (n / b, w / h);
        let split = |x: &Tensor, heads: usize| x.reshape((b, t, heads, d))?.transpose(1, 2);
        let mask = ops::causal_mask(t, q.dtype(), q.device())?;
        ops::causal_attention(&split(q, h)?, &split(k, kh)?, &split(v, kh)?, &mask)?.transpose(1, 2)?.reshape((n, w))
    }

    #[test]
    fn channel_ops_match_the_reference() {
        let mut rng = fastrand::Rng::with_seed(21);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-6)] {
            // 150 rows: two full blocks of rows and a partial one.
            let (base, x) = (rand(&mut rng, &[150, 12], 2.0, dtype), rand(&mut rng, &[150, 12], 2.0, dtype));
            let s = rand(&mut rng, &[12], 1.5, dtype);
            let ins = [base.clone(), x.clone(), s.clone()];
            assert_close(&scale_add(&base, &x, &s).unwrap(), &scale_add_ref(&ins).unwrap(), tol, "scale_add");
            let mix = rand(&mut rng, &[2, 12], 1.5, dtype);
            let ins = [base.clone(), x.clone(), mix.clone()];
            assert_close(&resid_mix(&base, &x, &mix).unwrap(), &mix_ref(&ins).unwrap(), tol, "resid_mix");
            let r = rand(&mut rng, &[3, 7, 11], 2.0, dtype);
            assert_close(&relu_sq(&r).unwrap(), &r.relu().unwrap().sqr().unwrap(), tol, "relu_sq");
        }
    }

    #[test]
    fn channel_op_gradients_match_the_reference_and_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(22);
        let (base, x) = (rand(&mut rng, &[2, 75, 6], 2.0, DType::F64), rand(&mut rng, &[2, 75, 6], 2.0, DType::F64));
        let (s, mix) = (rand(&mut rng, &[6], 1.5, DType::F64), rand(&mut rng, &[2, 6], 1.5, DType::F64));
        let fused = |x: &[Tensor]| scale_add(&x[0], &x[1], &x[2]);
        check_grads(&fused, &scale_add_ref, &[base.clone(), x.clone(), s.clone()], "scale_add");
        let fused = |x: &[Tensor]| resid_mix(&x[0], &x[1], &x[2]);
        check_grads(&fused, &mix_ref, &[base.clone(), x.clone(), mix.clone()], "resid_mix");
        // The model's first block mixes the stream with itself.
        let fused = |x: &[Tensor]| resid_mix(&x[0], &x[0], &x[1]);
        let reference = |x: &[Tensor]| mix_ref(&[x[0].clone(), x[0].clone(), x[1].clone()]);
        check_grads(&fused, &reference, &[base.clone(), mix.clone()], "resid_mix of one stream");
        let fused = |x: &[Tensor]| relu_sq(&x[0]);
        let reference = |x: &[Tensor]| x[0].relu()?.sqr();
        check_grads(&fused, &reference, std::slice::from_ref(&x), "relu_sq");

        let (base, x) = (rand(&mut rng, &[3, 4], 2.0, DType::F64), rand(&mut rng, &[3, 4], 2.0, DType::F64));
        let (s, mix) = (rand(&mut rng, &[4], 1.5, DType::F64), rand(&mut rng, &[2, 4], 1.5, DType::F64));
        check_finite_differences(&|x| scale_add(&x[0], &x[1], &x[2]), &[base.clone(), x.clone(), s], "scale_add");
        check_finite_differences(&|x| resid_mix(&x[0], &x[1], &x[2]), &[base, x.clone(), mix], "resid_mix");
        check_finite_differences(&|x| relu_sq(&x[0]), &[x], "relu_sq");
    }

    #[test]
    fn qk_norm_rope_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(23);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            // 2 x 70 rows of 3 heads of 8: more than one block of rows, positions wrapping.
            let (cos, sin) = ops::rope_tables(70, 8, 10_000.0, dtype, &Device::Cpu).unwrap();
            let x = rand(&mut rng, &[140, 24], 2.0, dtype);
            let gain = rand(&mut rng, &[3], 2.0, dtype);
            let got = qk_norm_rope(&x, Some(&gain), &cos, &sin, 3, None).unwrap();
            assert_close(&got, &qk_ref(&x, Some(&gain), &cos, &sin, 3).unwrap(), tol, &format!("{dtype:?} with gain"));
            let got = qk_norm_rope(&x, None, &cos, &sin, 3, None).unwrap();
            assert_close(&got, &qk_ref(&x, None, &cos, &sin, 3).unwrap(), tol, &format!("{dtype:?} without gain"));
        }
    }

    #[test]
    fn qk_norm_rope_gradients_match_the_reference_and_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(24);
        let (cos, sin) = ops::rope_tables(35, 8, 10_000.0, DType::F64, &Device::Cpu).unwrap();
        let x = rand(&mut rng, &[70, 16], 2.0, DType::F64);
        let gain = rand(&mut rng, &[2], 2.0, DType::F64);
        let fused = |x: &[Tensor]| qk_norm_rope(&x[0], Some(&x[1]), &cos, &sin, 2, None);
        let reference = |x: &[Tensor]| qk_ref(&x[0], Some(&x[1]), &cos, &sin, 2);
        check_grads(&fused, &reference, &[x.clone(), gain], "qk_norm_rope with gain");
        let fused = |x: &[Tensor]| qk_norm_rope(&x[0], None, &cos, &sin, 2, None);
        let reference = |x: &[Tensor]| qk_ref(&x[0], None, &cos, &sin, 2);
        check_grads(&fused, &reference, &[x], "qk_norm_rope");

        let (cos, sin) = ops::rope_tables(3, 4, 10_000.0, DType::F64, &Device::Cpu).unwrap();
        let x = rand(&mut rng, &[6, 8], 2.0, DType::F64);
        let gain = rand(&mut rng, &[2], 2.0, DType::F64);
        check_finite_differences(&|x| qk_norm_rope(&x[0], Some(&x[1]), &cos, &sin, 2, None), &[x.clone(), gain], "qk_norm_rope with gain");
        check_finite_differences(&|x| qk_norm_rope(&x[0], None, &cos, &sin, 2, None), &[x], "qk_norm_rope");
    }

    #[test]
    fn token_major_attention_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(25);
        for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
            for (b, h, kh, t, d) in [(2, 4, 2, 7, 8), (1, 4, 2, 37, 8), (3, 2, 2, 5, 3)] {
                let q = rand(&mut rng, &[b * t, h * d], 1.5, dtype);
                let k = rand(&mut rng, &[b * t, kh * d], 1.5, dtype);
                let v = rand(&mut rng, &[b * t, kh * d], 1.0, dtype);
                let got = causal_attention_tokens(&q, &k, &v, b, h, kh).unwrap();
                assert_close(&got, &attn_ref(&q, &k, &v, b, h, kh).unwrap(), tol, &format!("{dtype:?} {:?}", (b, h, kh, t, d)));
            }
        }
        let q = rand(&mut rng, &[6, 6], 1.0, DType::F32);
        assert!(causal_attention_tokens(&q, &q, &q, 4, 2, 1).is_err(), "6 rows do not split into 4 batch rows");
    }

    #[test]
    fn token_major_attention_gradients_match_the_reference_and_finite_differences() {
        let mut rng = fastrand::Rng::with_seed(26);
        for (b, h, kh, t, d) in [(2, 4, 2, 7, 8), (1, 2, 1, 37, 5)] {
            let q = rand(&mut rng, &[b * t, h * d], 1.5, DType::F64);
            let k = rand(&mut rng, &[b * t, kh * d], 1.5, DType::F64);
            let v = rand(&mut rng, &[b * t, kh * d], 1.0, DType::F64);
            let fused = |x: &[Tensor]| causal_attention_tokens(&x[0], &x[1], &x[2], b, h, kh);
            let reference = |x: &[Tensor]| attn_ref(&x[0], &x[1], &x[2], b, h, kh);
            check_grads(&fused, &reference, &[q, k, v], &format!("causal_attention_tokens {:?}", (b, h, kh, t, d)));
        }
        let (b, h, kh, t, d) = (2, 4, 2, 3, 3);
        let q = rand(&mut rng, &[b * t, h * d], 1.5, DType::F64);
        let k = rand(&mut rng, &[b * t, kh * d], 1.5, DType::F64);
        let v = rand(&mut rng, &[b * t, kh * d], 1.0, DType::F64);
        check_finite_differences(&|x| causal_attention_tokens(&x[0], &x[1], &x[2], b, h, kh), &[q, k, v], "causal_attention_tokens");
    }

    /// f32 gradients of the fused block ops agree with the reference at f32 precision.
    #[test]
    fn f32_gradients_match_the_reference() {
        let mut rng = fastrand::Rng::with_seed(27);
        let (cos, sin) = ops::rope_tables(16, 8, 10_000.0, DType::F32, &Device::Cpu).unwrap();
        let x = rand(&mut rng, &[64, 16], 2.0, DType::F32);
        let gain = rand(&mut rng, &[2], 2.0, DType::F32);
        let fused = |x: &[Tensor]| qk_norm_rope(&x[0], Some(&x[1]), &cos, &sin, 2, None);
        let reference = |x: &[Tensor]| qk_ref(&x[0], Some(&x[1]), &cos, &sin, 2);
        let inputs = [x, gain];
        for (a, b) in grads(&fused, &inputs, Loss::Weighted).iter().zip(grads(&reference, &inputs, Loss::Weighted)) {
            assert_close(a, &b, 1e-4, "f32 qk_norm_rope gradient");
        }
    }

    /// The mixed-precision forms (a narrow product added to a wide stream, a wide stream normed
    /// into a narrow product) give exactly what a cast and the one-dtype op give, forward and
    /// backward, and their gradients come back in each input's dtype. Run on the GPU path with
    /// f64 playing f32's part and f32 bf16's, so that the CPU implementations the GPU kernels
    /// are checked against (`pipeline parity`) are the ones running here.
    #[test]
    fn mixed_precision_ops_equal_a_cast_then_the_op() {
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

            let fused = |t: &[Tensor]| super::super::rms_norm_to(&t[0], narrow);
            let composite = |t: &[Tensor]| super::super::rms_norm(&t[0])?.to_dtype(narrow);
            let inputs = [base.clone()];
            assert_eq!(fused(&inputs).unwrap().dtype(), narrow);
            assert_eq!(bits(&fused(&inputs).unwrap()), bits(&composite(&inputs).unwrap()), "rms_norm_to forward");
            let (gf, gc) = (grads(&fused, &inputs, Loss::Weighted), grads(&composite, &inputs, Loss::Weighted));
            assert_eq!(gf[0].dtype(), wide);
            assert_eq!(bits(&gf[0]), bits(&gc[0]), "rms_norm_to gradient");
        });
        // Off the GPU path the same calls take the composites: equal values, no error.
        let off = scale_add(&base, &x, &s).unwrap();
        assert_eq!(bits(&off), bits(&scale_add(&base, &x.to_dtype(wide).unwrap(), &s).unwrap()));
        let off = super::super::rms_norm_to(&base, narrow).unwrap();
        assert_eq!((off.dtype(), bits(&off)), (narrow, bits(&super::super::rms_norm(&base).unwrap().to_dtype(narrow).unwrap())));
        // Pairs that are not a mixed-precision pair are refused by the ops themselves.
        crate::model::with_gpu_formulation(|| {
            let g16 = rand(&mut rng, &[70, 24], 1.0, DType::F16);
            assert!(column_dot(&base, &g16).is_err());
            assert!(base.apply_op2_no_bwd(&s, &ScaleCols(DType::F16)).is_err());
        });
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(28);
        let x = rand(&mut rng, &[4, 6], 1.0, DType::F32);
        assert!(scale_add(&x, &x, &rand(&mut rng, &[5], 1.0, DType::F32)).is_err());
        assert!(resid_mix(&x, &x, &rand(&mut rng, &[6], 1.0, DType::F32)).is_err());
        assert!(relu_sq(&rand(&mut rng, &[4], 1.0, DType::F16)).is_err());
        let (cos, sin) = ops::rope_tables(4, 4, 10_000.0, DType::F32, &Device::Cpu).unwrap();
        assert!(qk_norm_rope(&x, None, &cos, &sin, 2, None).is_err(), "6 columns are not 2 heads of 4");
        let x = rand(&mut rng, &[4, 8], 1.0, DType::F32);
        assert!(qk_norm_rope(&x, Some(&rand(&mut rng, &[3], 1.0, DType::F32)), &cos, &sin, 2, None).is_err());
    }

    /// The GPU formulation on the CPU in bf16 (what `pipeline parity` measures its expected
    /// errors with) computes as the kernels do: each op's bf16 result is its f32 reference on the
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
            let cases: [(&str, Tensor, Tensor); 4] = [
                ("relu_sq", relu_sq(&x).unwrap(), relu_sq(&wide(&x)).unwrap()),
                (
                    "relu_sq backward",
                    x.apply_op2_no_bwd(&g, &ReluSqBwd).unwrap(),
                    wide(&x).apply_op2_no_bwd(&wide(&g), &ReluSqBwd).unwrap(),
                ),
                ("scale_cols", scale_cols(&x, &sc).unwrap(), scale_cols(&wide(&x), &wide(&sc)).unwrap()),
                ("column_dot", column_dot(&g, &x).unwrap(), column_dot(&wide(&g), &wide(&x)).unwrap()),
            ];
            for (name, got, want) in cases {
                assert_eq!(got.dtype(), DType::BF16, "{name}");
                assert_eq!(bits(&got), bits(&want), "{name}");
            }
        });
    }
}
