//! Causal grouped-query attention. For query head `h` (of `H`) on KV head `g = h / (H / K)`,
//! head width `D`, positions `i` and `j <= i`:
//!
//! ```text
//! s[i, j] = q[i] . k[j] / sqrt(D)
//! p[i, :] = softmax_{j <= i}(s[i, :])                    (0 above the diagonal)
//! o[i]    = sum_j p[i, j] v[j]
//! backward, with do = dL/do:
//! dp[i, j] = do[i] . v[j]
//! ds[i, j] = p[i, j] (dp[i, j] - do[i] . o[i]) / sqrt(D)
//! dq[i] = sum_j ds[i, j] k[j];  dk[j] += sum_i ds[i, j] q[i];  dv[j] += sum_i p[i, j] do[i]
//! ```
//!
//! - reference: [`causal_attention_reference`] (scores, additive [`causal_mask`],
//!   [`softmax_last`], [`repeat_kv`] for the groups), candle composites;
//! - CPU kernel: [`CausalAttention`] on `(B, H, T, D)` heads, one rayon task per (batch,
//!   head) forward and per (batch, KV head) backward, in blocks of [`ATTN_BLOCK`] query rows
//!   whose probabilities the backward pass recomputes (as flash attention does), so the
//!   `(T, T)` scores of the whole batch never exist; [`causal_attention_tokens`] reads and
//!   writes the model's token-major `(B*T, H*D)` matrices ([`AttentionTokens`]);
//! - GPU: the score products on cuBLAS around [`super::causal_softmax`] (`gpu_attention`), or
//!   flash attention ([`crate::model::flash_attn`]), chosen by the model.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp3, D, DType, Device, Layout, Tensor};
#[cfg(feature = "candle")]
use candle_core::{Result, Shape, bail};
use rayon::prelude::*;

use super::doc_mask::DocumentMask;
#[cfg(feature = "candle")]
use super::{check_float, same_dtypes};
#[cfg(feature = "candle")]
use crate::model::host::convert::float_dispatch;
use crate::model::host::rows::Rows;
#[cfg(feature = "candle")]
use crate::model::host::rows::{cpu_slice, row_offsets, unit_last};
use crate::model::host::simd::{Real, dot, gemm_acc, max_of, multiversion, sum_f64};

/// Softmax over the last dimension (the shift by the row maximum is detached: softmax does not
/// depend on it).
#[cfg(feature = "candle")]
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// A `(T, T)` additive causal mask: 0 on and below the diagonal, -inf above.
#[cfg(feature = "candle")]
pub fn causal_mask(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
    Tensor::from_vec(v, (t, t), device)?.to_dtype(dtype)
}

/// Causal scaled-dot-product attention with grouped KV heads: `q` is `(B, H, T, D)`, `k` and
/// `v` are `(B, K, T, D)`; query head `h` uses KV head `h / (H / K)` (PyTorch's `enable_gqa`).
/// Returns `(B, H, T, D)`.
#[cfg(feature = "candle")]
pub fn causal_attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let (_, h, _, d) = q.dims4()?;
    let (k, v) = (repeat_kv(k, h)?, repeat_kv(v, h)?);
    let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * (1.0 / (d as f64).sqrt()))?;
    let probs = softmax_last(&scores.broadcast_add(mask)?)?;
    probs.matmul(&v.contiguous()?)
}

/// `(B, K, T, D)` key or value heads repeated to `(B, heads, T, D)`: query head `h` gets KV
/// head `h / (heads / K)`. `x` itself when `K == heads`.
#[cfg(feature = "candle")]
pub fn repeat_kv(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, kv, t, d) = x.dims4()?;
    if kv == heads {
        return Ok(x.clone());
    }
    x.unsqueeze(2)?.broadcast_as((b, kv, heads / kv, t, d))?.reshape((b, heads, t, d))
}

/// Causal scaled-dot-product attention with grouped KV heads, as [`ops::causal_attention`]
/// without the mask argument: `q` is `(B, H, T, D)`, `k` and `v` are `(B, K, T, D)`, query head
/// `h` uses KV head `h / (H / K)`, scores are scaled by `1 / sqrt(D)`. Returns `(B, H, T, D)`.
///
/// Inputs whose last dimension is contiguous are read in place (no copy for transposed heads).
#[cfg(feature = "candle")]
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let t = AttnDims::new(q.shape(), k.shape(), v.shape())?.t;
    if crate::model::gpu_path(q) {
        return gpu_attention(q, k, v);
    }
    if !q.device().is_cpu() {
        return causal_attention_reference(q, k, v, &causal_mask(t, q.dtype(), q.device())?);
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
#[cfg(feature = "candle")]
fn gpu_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (_, h, _, d) = q.dims4()?;
    let (k, v) = (repeat_kv(k, h)?, repeat_kv(v, h)?);
    let scores = q.contiguous()?.matmul(&k.t()?.contiguous()?)?;
    let probs = super::causal_softmax::causal_softmax(&scores, 1.0 / (d as f64).sqrt())?;
    probs.matmul(&v.contiguous()?)
}

#[cfg(feature = "candle")]
struct CausalAttention;

/// Query rows per block: scores are computed for `ATTN_BLOCK` rows at a time (against the keys
/// up to the block's last row), so the causal mask wastes at most half a block per row.
const ATTN_BLOCK: usize = 16;

/// Shapes of one attention call.
#[derive(Clone, Copy)]
#[cfg(feature = "candle")]
struct AttnDims {
    b: usize,
    h: usize,
    kh: usize,
    t: usize,
    d: usize,
}

#[cfg(feature = "candle")]
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

/// Per query position of one sequence, the first key position it may see ([`DocumentMask::row`]);
/// `None`: every earlier position (plain causal attention).
type KeyStarts<'a> = Option<&'a [u32]>;

/// In place on one row of raw scores `q_i . k_j` for `j < row.len()`: `row[lo..=i]` becomes
/// `softmax(scale * row[lo..=i])`, the rest (earlier documents and the future) 0.
#[inline(always)]
fn causal_softmax_row<T: Real>(row: &mut [T], lo: usize, i: usize, scale: T) {
    let (live, future) = row.split_at_mut(i + 1);
    future.fill(T::from_f64(0.0));
    let (hidden, live) = live.split_at_mut(lo);
    hidden.fill(T::from_f64(0.0));
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

/// The first key any of the query rows from `i0` on may see: the first row's start (starts
/// never fall along a row), so that a block skips the earlier documents' keys whole (a packed
/// row of many documents costs its segments' work, not the row's).
#[inline(always)]
fn first_key(lo: KeyStarts<'_>, i0: usize) -> usize {
    lo.map_or(0, |l| l[i0] as usize)
}

/// Probabilities of query rows `i0..i0 + mb` (rows of `q`, a row-major `(T, D)` matrix) against
/// keys `j0..i0 + mb` with `j0 = first_key(lo, i0)`: `p` becomes the `(mb, i0 + mb - j0)`
/// matrix (0 at keys `lo` hides).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn causal_probs<T: Real>(q: &[T], kt: &[T], (t, d): (usize, usize), (i0, mb): (usize, usize), lo: KeyStarts<'_>, scale: T, p: &mut [T]) {
    let j0 = first_key(lo, i0);
    let n = i0 + mb - j0;
    p.fill(T::from_f64(0.0));
    gemm_acc((mb, n, d), |r, c| q[(i0 + r) * d + c], &kt[j0..], t, p, n);
    for (r, row) in p.chunks_exact_mut(n).enumerate() {
        let i = i0 + r;
        causal_softmax_row(row, lo.map_or(0, |l| l[i] as usize) - j0, i - j0, scale);
    }
}

/// One (batch, query head): `q` has the head's `T` rows, `k` and `v` those of its KV head;
/// `out` is the head's `(T, D)` output, zeroed; `lo` the sequence's document mask, if any.
#[inline(always)]
fn attn_fwd_kernel<T: Real>(q: Rows<'_, T>, k: Rows<'_, T>, v: Rows<'_, T>, lo: KeyStarts<'_>, scale: T, out: &mut [T]) {
    let (t, d) = (q.count(), q.len);
    let zero = T::from_f64(0.0);
    let (q, kt, v) = (q.gather(), k.transposed(zero), v.gather());
    let mut p = vec![zero; ATTN_BLOCK * t];
    for i0 in (0..t).step_by(ATTN_BLOCK) {
        let mb = ATTN_BLOCK.min(t - i0);
        let (j0, end) = (first_key(lo, i0), i0 + mb);
        let n = end - j0;
        let p = &mut p[..mb * n];
        causal_probs(&q, &kt, (t, d), (i0, mb), lo, scale, p);
        gemm_acc((mb, d, n), |r, j| p[r * n + j], &v[j0 * d..], d, &mut out[i0 * d..end * d], d);
    }
}

multiversion! {
    /// Attention output of one (batch, query head).
    fn attn_fwd_head = attn_fwd_kernel(q: Rows<'_, T>, k: Rows<'_, T>, v: Rows<'_, T>, lo: KeyStarts<'_>, scale: T, out: &mut [T]);
}

#[allow(clippy::too_many_arguments)]
#[cfg(feature = "candle")]
fn attn_fwd<T: Real>(q: &[T], ql: &Layout, k: &[T], kl: &Layout, v: &[T], vl: &Layout, mask: Option<&DocumentMask>) -> Result<Vec<T>> {
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
        let lo = mask.map(|m| m.row(bh / h));
        attn_fwd_head(q.sub(bh * t..(bh + 1) * t), k.sub(kv * t..(kv + 1) * t), v.sub(kv * t..(kv + 1) * t), lo, scale, o);
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
fn attn_bwd_kernel<T: Real>(x: &AttnBwdIn<'_, T>, lo: KeyStarts<'_>, scale: T, dq: &mut [T], dk: &mut [T], dv: &mut [T]) {
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
            let (j0, end) = (first_key(lo, i0), i0 + mb);
            let n = end - j0;
            let (p, ds) = (&mut p[..mb * n], &mut ds[..mb * n]);
            causal_probs(&q, &kt, (t, d), (i0, mb), lo, scale, p);
            ds.fill(zero);
            gemm_acc((mb, n, d), |r, c| go[(i0 + r) * d + c], &vt[j0..], t, ds, n);
            for (r, (dsr, pr)) in ds.chunks_exact_mut(n).zip(p.chunks_exact(n)).enumerate() {
                let i = i0 + r;
                let delta = dot(&go[i * d..(i + 1) * d], o.row(i));
                for (s, &p) in dsr.iter_mut().zip(pr) {
                    *s = p * (*s - delta) * scale;
                }
            }
            let (ds, p) = (&*ds, &*p);
            gemm_acc((mb, d, n), |r, j| ds[r * n + j], &k[j0 * d..], d, &mut dqh[i0 * d..end * d], d);
            gemm_acc((n, d, mb), |j, r| ds[r * n + j], &q[i0 * d..end * d], d, &mut dk[j0 * d..end * d], d);
            gemm_acc((n, d, mb), |j, r| p[r * n + j], &go[i0 * d..end * d], d, &mut dv[j0 * d..end * d], d);
        }
    }
    debug_assert_eq!(group * t * d, dq.len());
}

multiversion! {
    /// Gradients of one (batch, KV head).
    fn attn_bwd_group = attn_bwd_kernel(x: &AttnBwdIn<'_, T>, lo: KeyStarts<'_>, scale: T, dq: &mut [T], dk: &mut [T], dv: &mut [T]);
}

#[cfg(feature = "candle")]
fn attn_bwd<T: Real>(q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (dq, dk, dv) = attn_bwd_vecs::<T>(q, k, v, o, go, None)?;
    let AttnDims { b, h, kh, t, d } = AttnDims::new(q.shape(), k.shape(), v.shape())?;
    let dq = Tensor::from_vec(dq, (b, h, t, d), &Device::Cpu)?;
    let dk = Tensor::from_vec(dk, (b, kh, t, d), &Device::Cpu)?;
    let dv = Tensor::from_vec(dv, (b, kh, t, d), &Device::Cpu)?;
    Ok((dq, dk, dv))
}

/// The gradients `(dq, dk, dv)` of [`attn_bwd`] as row-major `(B, H, T, D)`, `(B, K, T, D)`,
/// `(B, K, T, D)` vectors.
type AttnGrads<T> = (Vec<T>, Vec<T>, Vec<T>);

#[cfg(feature = "candle")]
fn attn_bwd_vecs<T: Real>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    go: &Tensor,
    mask: Option<&DocumentMask>,
) -> Result<AttnGrads<T>> {
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
            attn_bwd_group(&x, mask.map(|m| m.row(kv / kh)), scale, dq, dk, dv);
        });
    }
    Ok((dq, dk, dv))
}

#[cfg(feature = "candle")]
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
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => CpuStorage::F32(attn_fwd(q, l1, k, l2, v, l3, None)?),
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => CpuStorage::F64(attn_fwd(q, l1, k, l2, v, l3, None)?),
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

/// Shapes of a token-major attention call: `(batch, t, heads, kv_heads, d)`.
pub(crate) type TokenDims = (usize, usize, usize, usize, usize);

/// Row offsets of head `head` of a token-major matrix with row stride `ld` for sequence `b`:
/// the `T` rows `(b T + i) ld + head d`.
fn head_rows(ld: usize, (b, t, d): (usize, usize, usize), head: usize) -> Vec<usize> {
    (0..t).map(|i| (b * t + i) * ld + head * d).collect()
}

/// [`causal_attention_tokens`]'s forward on plain slices (the engine's CPU backend): `q`, `k`,
/// `v` token-major views `(slice, row stride)` (k and v may be column blocks of one fused
/// product), `out` the contiguous `(B T, H D)` output; under a document mask each position
/// sees only its own segment's keys. The kernels are this file's, one task per (batch, head).
pub(crate) fn attention_token_major_fwd<T: Real>(
    (q, ldq): (&[T], usize),
    (k, ldk): (&[T], usize),
    (v, ldv): (&[T], usize),
    out: &mut [T],
    (b, t, h, kh, d): TokenDims,
    mask: Option<&DocumentMask>,
) {
    let (group, scale) = (h / kh, T::from_f64(1.0 / (d as f64).sqrt()));
    let heads: Vec<Vec<T>> = (0..b * h)
        .into_par_iter()
        .map(|bh| {
            let (bi, hh) = (bh / h, bh % h);
            let (qo, ko, vo) =
                (head_rows(ldq, (bi, t, d), hh), head_rows(ldk, (bi, t, d), hh / group), head_rows(ldv, (bi, t, d), hh / group));
            let rows = |data, offsets| Rows { data, offsets, len: d };
            let mut o = vec![T::from_f64(0.0); t * d];
            attn_fwd_head(rows(q, &qo), rows(k, &ko), rows(v, &vo), mask.map(|m| m.row(bi)), scale, &mut o);
            o
        })
        .collect();
    out.par_chunks_mut(t * h * d).enumerate().for_each(|(bi, ob)| {
        for hh in 0..h {
            let src = &heads[bi * h + hh];
            for i in 0..t {
                ob[(i * h + hh) * d..(i * h + hh + 1) * d].copy_from_slice(&src[i * d..(i + 1) * d]);
            }
        }
    });
}

/// Where [`attention_token_major_bwd`] puts the gradients: token-major views `(slice from
/// the view's first element, row stride)`. `dq` and `dk` are written; `dv` is written, or
/// accumulated (`+=`) when `dv_acc` (exclusive self-attention wrote its part first).
pub(crate) struct AttentionGrads<'a, T> {
    /// `dq`.
    pub(crate) dq: (&'a mut [T], usize),
    /// `dk`.
    pub(crate) dk: (&'a mut [T], usize),
    /// `dv`.
    pub(crate) dv: (&'a mut [T], usize),
    /// Add to `dv` rather than overwrite it.
    pub(crate) dv_acc: bool,
}

/// A token-major view cut into its `b` sequences' runs of `t` rows.
fn by_sequence<T>((data, ld): (&mut [T], usize), b: usize, t: usize) -> Vec<&mut [T]> {
    let mut out = Vec::with_capacity(b);
    let mut rest = data;
    for bi in 0..b {
        let take = if bi + 1 < b { t * ld } else { rest.len() };
        let (c, tail) = std::mem::take(&mut rest).split_at_mut(take);
        out.push(c);
        rest = tail;
    }
    out
}

/// The backward pass of [`attention_token_major_fwd`] (probabilities recomputed per block of
/// query rows), one task per (batch, KV head); `(o, go)` are the forward output and its
/// gradient, contiguous `(B T, H D)`; `mask` as the forward pass had it.
pub(crate) fn attention_token_major_bwd<T: Real>(
    (q, ldq): (&[T], usize),
    (k, ldk): (&[T], usize),
    (v, ldv): (&[T], usize),
    (o, go): (&[T], &[T]),
    grads: AttentionGrads<'_, T>,
    (b, t, h, kh, d): TokenDims,
    mask: Option<&DocumentMask>,
) {
    let (group, scale, w) = (h / kh, T::from_f64(1.0 / (d as f64).sqrt()), h * d);
    let zero = T::from_f64(0.0);
    let parts: Vec<AttnGrads<T>> = (0..b * kh)
        .into_par_iter()
        .map(|bk| {
            let (bi, g) = (bk / kh, bk % kh);
            let qo: Vec<usize> = (g * group..(g + 1) * group).flat_map(|hh| head_rows(ldq, (bi, t, d), hh)).collect();
            let oo: Vec<usize> = (g * group..(g + 1) * group).flat_map(|hh| head_rows(w, (bi, t, d), hh)).collect();
            let (ko, vo) = (head_rows(ldk, (bi, t, d), g), head_rows(ldv, (bi, t, d), g));
            let rows = |data, offsets| Rows { data, offsets, len: d };
            let x = AttnBwdIn { q: rows(q, &qo), k: rows(k, &ko), v: rows(v, &vo), o: rows(o, &oo), go: rows(go, &oo) };
            let (mut dq, mut dk, mut dv) = (vec![zero; group * t * d], vec![zero; t * d], vec![zero; t * d]);
            attn_bwd_group(&x, mask.map(|m| m.row(bi)), scale, &mut dq, &mut dk, &mut dv);
            (dq, dk, dv)
        })
        .collect();
    let AttentionGrads { dq, dk, dv, dv_acc } = grads;
    let (lq, lk, lv) = (dq.1, dk.1, dv.1);
    let seqs = by_sequence(dq, b, t).into_iter().zip(by_sequence(dk, b, t)).zip(by_sequence(dv, b, t));
    seqs.collect::<Vec<_>>().into_par_iter().enumerate().for_each(|(bi, ((cq, ck), cv))| {
        for g in 0..kh {
            let (dq, dk, dv) = &parts[bi * kh + g];
            for i in 0..t {
                for (j, hh) in (g * group..(g + 1) * group).enumerate() {
                    cq[i * lq + hh * d..][..d].copy_from_slice(&dq[(j * t + i) * d..(j * t + i + 1) * d]);
                }
                ck[i * lk + g * d..][..d].copy_from_slice(&dk[i * d..(i + 1) * d]);
                let out = &mut cv[i * lv + g * d..][..d];
                if dv_acc {
                    for (x, &y) in out.iter_mut().zip(&dv[i * d..(i + 1) * d]) {
                        *x += y;
                    }
                } else {
                    out.copy_from_slice(&dv[i * d..(i + 1) * d]);
                }
            }
        }
    });
}

/// Causal grouped-query attention on token-major matrices: `q` is `(N, H * D)`, `k` and `v` are
/// `(N, K * D)` with `N = batch * T` rows (row `n` is position `n % T` of batch row `n / T`).
/// The same as [`super::causal_attention`] on the `(B, H, T, D)` heads of the inputs, with its
/// output's heads put back side by side: returns `(N, H * D)`.
#[cfg(feature = "candle")]
pub fn causal_attention_tokens(q: &Tensor, k: &Tensor, v: &Tensor, batch: usize, heads: usize, kv_heads: usize) -> Result<Tensor> {
    document_attention_tokens(q, k, v, batch, heads, kv_heads, None)
}

/// [`causal_attention_tokens`] under a [`DocumentMask`] (`None`: plain causal attention): each
/// position sees only the earlier positions of its own segment. On the CPU the fused kernel
/// skips the hidden keys; elsewhere the reference adds the mask to materialised scores.
#[allow(clippy::too_many_arguments)]
#[cfg(feature = "candle")]
pub fn document_attention_tokens(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    mask: Option<&DocumentMask>,
) -> Result<Tensor> {
    let (n, width) = q.dims2()?;
    if batch == 0 || heads == 0 || kv_heads == 0 || n % batch != 0 || width % heads != 0 {
        bail!("causal_attention_tokens: q {:?} does not split into {batch} rows of {heads} heads", q.shape());
    }
    let (t, d) = (n / batch, width / heads);
    if k.dims() != [n, kv_heads * d] || v.dims() != k.dims() {
        bail!("causal_attention_tokens: k {:?} and v {:?} are not ({n}, {kv_heads} * {d})", k.shape(), v.shape());
    }
    let mask = mask.filter(|m| !m.is_causal());
    if let Some(m) = mask
        && (m.rows(), m.t()) != (batch, t)
    {
        bail!("document_attention_tokens: a mask of {} rows of {} for {batch} rows of {t}", m.rows(), m.t());
    }
    if !q.device().is_cpu() || crate::model::gpu_path(q) {
        let split = |x: &Tensor, h: usize| x.reshape((batch, t, h, d))?.transpose(1, 2);
        let (qh, kh, vh) = (split(q, heads)?, split(k, kv_heads)?, split(v, kv_heads)?);
        let y = match mask {
            Some(m) => causal_attention_reference(&qh, &kh, &vh, &m.additive(q.dtype(), q.device())?)?,
            None => causal_attention(&qh, &kh, &vh)?,
        };
        return y.transpose(1, 2)?.reshape((n, width));
    }
    check_float("causal_attention_tokens", q.dtype())?;
    same_dtypes("causal_attention_tokens", &[q, k, v])?;
    let kv = Shape::from((batch, kv_heads, t, d));
    let dims = AttnDims::new(&Shape::from((batch, heads, t, d)), &kv, &kv)?;
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, AttentionTokens { dims, mask: mask.cloned() })
}

#[cfg(feature = "candle")]
struct AttentionTokens {
    dims: AttnDims,
    mask: Option<DocumentMask>,
}

/// The `(B, heads, T, D)` view of a contiguous token-major `(B * T, heads * D)` layout.
#[cfg(feature = "candle")]
fn heads_view(l: &Layout, (b, t, d): (usize, usize, usize), heads: usize) -> Layout {
    Layout::new(Shape::from((b, heads, t, d)), vec![t * heads * d, d, heads * d, 1], l.start_offset())
}

/// A row-major `(B, H, T, D)` vector as token-major `(B * T, H * D)`.
#[cfg(feature = "candle")]
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

#[cfg(feature = "candle")]
impl AttentionTokens {
    fn fwd<T: Real>(&self, q: &[T], ql: &Layout, k: &[T], kl: &Layout, v: &[T], vl: &Layout) -> Result<Vec<T>> {
        let AttnDims { b, h, kh, t, d } = self.dims;
        let (ql, kl, vl) = (heads_view(ql, (b, t, d), h), heads_view(kl, (b, t, d), kh), heads_view(vl, (b, t, d), kh));
        Ok(heads_to_tokens(&attn_fwd(q, &ql, k, &kl, v, &vl, self.mask.as_ref())?, (b, h, t, d)))
    }

    fn bwd<T: Real>(&self, q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, go: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let AttnDims { b, h, kh, t, d } = self.dims;
        let split = |x: &Tensor, heads: usize| x.detach().contiguous()?.reshape((b, t, heads, d))?.transpose(1, 2);
        let (dq, dk, dv) =
            attn_bwd_vecs::<T>(&split(q, h)?, &split(k, kh)?, &split(v, kh)?, &split(o, h)?, &split(go, h)?, self.mask.as_ref())?;
        let back = |x: Vec<T>, heads: usize| Tensor::from_vec(heads_to_tokens(&x, (b, heads, t, d)), (b * t, heads * d), &Device::Cpu);
        Ok((back(dq, h)?, back(dk, kh)?, back(dv, kh)?))
    }
}

#[cfg(feature = "candle")]
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

    use super::*;
    use crate::model::ops::testing::{assert_close, assert_near, check_finite_differences, check_grads, rand};

    fn t(v: &[f64], shape: &[usize]) -> Tensor {
        Tensor::from_vec(v.to_vec(), shape, &Device::Cpu).unwrap()
    }

    fn attn_reference(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        causal_attention_reference(q, k, v, &causal_mask(q.dim(2)?, q.dtype(), q.device())?)
    }

    /// `(q, k, v)` of shapes `(B, H, T, D)`, `(B, K, T, D)`, `(B, K, T, D)`.
    fn qkv(rng: &mut fastrand::Rng, (b, h, k, t, d): (usize, usize, usize, usize, usize), dtype: DType) -> [Tensor; 3] {
        [rand(rng, &[b, h, t, d], 1.5, dtype), rand(rng, &[b, k, t, d], 1.5, dtype), rand(rng, &[b, k, t, d], 1.0, dtype)]
    }

    fn attn_ref(q: &Tensor, k: &Tensor, v: &Tensor, b: usize, h: usize, kh: usize) -> Result<Tensor> {
        let (n, w) = q.dims2()?;
        let (t, d) = (n / b, w / h);
        let split = |x: &Tensor, heads: usize| x.reshape((b, t, heads, d))?.transpose(1, 2);
        let mask = causal_mask(t, q.dtype(), q.device())?;
        causal_attention_reference(&split(q, h)?, &split(k, kh)?, &split(v, kh)?, &mask)?.transpose(1, 2)?.reshape((n, w))
    }

    #[test]
    fn attention_matches_a_naive_reference_with_grouped_heads() {
        let (b, h, kv, tt, d) = (1usize, 4usize, 2usize, 3usize, 2usize);
        let mut rng = fastrand::Rng::with_seed(3);
        let mut r = |n: usize| (0..n).map(|_| rng.f64() * 2.0 - 1.0).collect::<Vec<f64>>();
        let (qv, kvv, vv) = (r(b * h * tt * d), r(b * kv * tt * d), r(b * kv * tt * d));
        let q = t(&qv, &[b, h, tt, d]);
        let k = t(&kvv, &[b, kv, tt, d]);
        let v = t(&vv, &[b, kv, tt, d]);
        let mask = causal_mask(tt, DType::F64, &Device::Cpu).unwrap();
        let got = causal_attention_reference(&q, &k, &v, &mask).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for hh in 0..h {
            let g = hh / (h / kv);
            for i in 0..tt {
                let qi = &qv[(hh * tt + i) * d..(hh * tt + i + 1) * d];
                let s: Vec<f64> =
                    (0..=i).map(|j| (0..d).map(|c| qi[c] * kvv[(g * tt + j) * d + c]).sum::<f64>() / (d as f64).sqrt()).collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for c in 0..d {
                    let want: f64 = (0..=i).map(|j| (s[j] - m).exp() / z * vv[(g * tt + j) * d + c]).sum();
                    let gv = got[(hh * tt + i) * d + c];
                    assert!((gv - want).abs() < 1e-12, "head {hh} pos {i} dim {c}: {gv} vs {want}");
                }
            }
        }
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

    /// Packed rows under a document mask: the fused kernel matches the reference with the
    /// additive mask (values and gradients), and each segment gets what it gets as a row of its
    /// own.
    #[test]
    fn document_masked_attention_keeps_to_its_segments() {
        let mut rng = fastrand::Rng::with_seed(27);
        let (b, h, kh, t, d) = (2, 4, 2, 37, 5);
        // Row 0: BOS at 0, 9, 10 and 30; row 1: one BOS at 20 (its first segment has none).
        let mut x = vec![7u32; b * t];
        for p in [0, 9, 10, 30, t + 20] {
            x[p] = 1;
        }
        let q = rand(&mut rng, &[b * t, h * d], 1.5, DType::F64);
        let k = rand(&mut rng, &[b * t, kh * d], 1.5, DType::F64);
        let v = rand(&mut rng, &[b * t, kh * d], 1.0, DType::F64);
        // Whole documents, and documents cut every 7 positions (`model.document_max_len`: the
        // packed rows' rule), so that query blocks of 16 start past keys they skip.
        for rule in [crate::model::ops::DocRule::at(1), crate::model::ops::DocRule { bos: 1, max_len: 7 }] {
            let mask = DocumentMask::at_token(&x, t, rule).unwrap();
            let masked_ref = |x: &[Tensor]| -> Result<Tensor> {
                let split = |y: &Tensor, heads: usize| y.reshape((b, t, heads, d))?.transpose(1, 2);
                let add = mask.additive(DType::F64, &Device::Cpu)?;
                causal_attention_reference(&split(&x[0], h)?, &split(&x[1], kh)?, &split(&x[2], kh)?, &add)?
                    .transpose(1, 2)?
                    .reshape((b * t, h * d))
            };
            let fused = |x: &[Tensor]| document_attention_tokens(&x[0], &x[1], &x[2], b, h, kh, Some(&mask));
            let got = fused(&[q.clone(), k.clone(), v.clone()]).unwrap();
            assert_close(&got, &masked_ref(&[q.clone(), k.clone(), v.clone()]).unwrap(), 1e-12, "masked forward");
            check_grads(&fused, &masked_ref, &[q.clone(), k.clone(), v.clone()], "masked attention gradients");
            for bi in 0..b {
                for (s, len) in mask.segments(bi) {
                    let rows = |x: &Tensor| x.narrow(0, bi * t + s, len).unwrap();
                    let alone = causal_attention_tokens(&rows(&q), &rows(&k), &rows(&v), 1, h, kh).unwrap();
                    assert_close(&rows(&got), &alone, 1e-12, &format!("{rule:?}: row {bi} segment at {s}"));
                }
            }
            let plain = causal_attention_tokens(&q, &k, &v, b, h, kh).unwrap();
            let diff = (plain - &got).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(diff > 1e-3, "the mask must change the positions after a BOS");
        }
        let wrong = DocumentMask::at_token(&x[..t], t, crate::model::ops::DocRule::at(1)).unwrap();
        assert!(document_attention_tokens(&q, &k, &v, b, h, kh, Some(&wrong)).is_err(), "a mask of 1 row for 2");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(10);
        let [q, k, v] = qkv(&mut rng, (1, 3, 2, 4, 2), DType::F32);
        assert!(causal_attention(&q, &k, &v).is_err(), "3 query heads cannot share 2 KV heads");
        let [q, k, v] = qkv(&mut rng, (1, 2, 1, 4, 2), DType::F16);
        assert!(causal_attention(&q, &k, &v).is_err());
    }

    /// The kernels as compiled for the baseline target give the dispatched ones' results.
    #[test]
    fn baseline_kernels_match_the_dispatched_ones() {
        let mut rng = fastrand::Rng::with_seed(11);
        let (t, d) = (21usize, 12usize);
        // Attention with 2 query heads on one KV head; the same random rows serve as every input.
        let data: Vec<f32> = (0..2 * t * d).map(|_| rng.f32() * 2.0 - 1.0).collect();
        let offsets: Vec<usize> = (0..2 * t).map(|r| r * d).collect();
        let q = Rows { data: &data, offsets: &offsets, len: d };
        let k = q.sub(t..2 * t);
        let scale = 1.0 / (d as f32).sqrt();
        let (mut a, mut b) = (vec![0.0f32; t * d], vec![0.0f32; t * d]);
        attn_fwd_kernel(q.sub(0..t), k, k, None, scale, &mut a);
        attn_fwd_head(q.sub(0..t), k, k, None, scale, &mut b);
        assert_near(&a, &b, "attention forward");
        let x = AttnBwdIn { q, k, v: k, o: q, go: q };
        let mut a = (vec![0.0f32; 2 * t * d], vec![0.0f32; t * d], vec![0.0f32; t * d]);
        let mut b = a.clone();
        attn_bwd_kernel(&x, None, scale, &mut a.0, &mut a.1, &mut a.2);
        attn_bwd_group(&x, None, scale, &mut b.0, &mut b.1, &mut b.2);
        assert_near(&a.0, &b.0, "dq");
        assert_near(&a.1, &b.1, "dk");
        assert_near(&a.2, &b.2, "dv");
    }
}
