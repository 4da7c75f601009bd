//! The queries' and keys' per-head RMS norm, rotary embedding and gain, in one op each way.
//! For each head `x_h` (width `D`) of a token-major row at position `p`, the gain `w` (`(H,)`,
//! queries only) and the tables of [`super::rope`] for the first `R <= D` dims (`R = D`: full
//! RoPE; `R < D`: the record's partial RoPE, dims `R..D` passed through unrotated):
//!
//! ```text
//! y_h = rope_p(x_h / r_h) * w[h],   r_h = sqrt(sum(x_h^2) / D + eps)
//! backward: dy_h = rope_p^T(g_h * w[h]);   dx_h = dy_h / r_h - x_h sum(dy_h x_h) / (D r_h^3)
//!           dw[h] = sum over rows of g_h . rope_p(x_h / r_h)
//! ```
//!
//! `rope_p` rotates the pairs `(i, i + R/2)` for `i < R/2` and leaves the other dims as they are.
//!
//! - reference: the composite of [`super::rms_norm_reference`], [`super::rope`] and a broadcast
//!   gain on `(B, H, T, D)` heads (in the tests), and, for the GPU kernels, the f64 row
//!   functions of [`NormRope`] (`fwd_rows`, `bwd_rows`);
//! - CPU kernel: [`forward_rows`] and [`backward_rows`], with the gain folded in, [`ROWS`] rows
//!   per rayon task, called by [`QkNormRope`] (the model's op) and by the engine's `CpuBackend`
//!   (which reads strided views, saves `1 / r_h` and reuses it in the backward pass);
//! - GPU: [`norm_rope`] (`norm_rope_fwd` / `_bwd` of `kernels/fused.cu`, with the
//!   16-byte-chunk forms `norm_rope_vec_*`), then the gain as [`super::scale_cols`]; partial
//!   RoPE there is the candle composite (the fused norm, then RoPE of the first `R` dims), until
//!   the kernels learn it.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

#[cfg(feature = "candle")]
use super::scale_cols::scale_cols;
#[cfg(feature = "candle")]
use super::{check_float, same_dtypes};
#[cfg(feature = "candle")]
use crate::model::host::convert::{self, float_dispatch, wrap};
#[cfg(feature = "candle")]
use crate::model::host::rows::{Held, elems, tensor_from_f64};
use crate::model::host::rows::{ROWS, add_partials, split_rows};
use crate::model::host::simd::{Real, dot_f64, multiversion};
#[cfg(feature = "candle")]
use crate::model::ops;

/// Per-head RMS norm, then RoPE, then (when given) a per-head gain, of a query or key
/// projection `x` of shape `(N, H * D)` whose `N = B * T` rows are token-major (row `n` is at
/// position `n % T`): with `(B, H, T, D)` heads `xh` of `x`, the heads of the result are
/// `ops::rope(ops::rms_norm_reference(xh), cos, sin) * gain[h]` (RoPE of the first `R` dims).
/// `cos` and `sin` are the `(T, R / 2)` tables of [`ops::rope_tables`] (`R = D`: the whole
/// head), `gain` has shape `(H,)`. `eps` is the norm's epsilon, by default the input dtype's
/// ([`ops::rms_eps`]). Returns `(N, H * D)`.
#[cfg(feature = "candle")]
pub fn qk_norm_rope(x: &Tensor, gain: Option<&Tensor>, cos: &Tensor, sin: &Tensor, heads: usize, eps: Option<f64>) -> Result<Tensor> {
    let (n, width) = x.dims2()?;
    let (t, half) = cos.dims2()?;
    let d = width.checked_div(heads).unwrap_or(0);
    if heads == 0 || width != heads * d || half == 0 || 2 * half > d || sin.dims() != cos.dims() || t == 0 || n % t != 0 {
        bail!("qk_norm_rope: x {:?} with {heads} heads does not fit tables {:?} and {:?}", x.shape(), cos.shape(), sin.shape());
    }
    if let Some(g) = gain
        && g.dims() != [heads]
    {
        bail!("qk_norm_rope: gain {:?} for {heads} heads", g.shape());
    }
    if crate::model::gpu_path(x) && 2 * half == d {
        let table = Tensor::cat(&[cos, sin], 1)?;
        let y = norm_rope(x, &table, heads, eps)?;
        return match gain {
            // The gain per channel (each head's repeated over its D channels).
            Some(g) => scale_cols(&y, &g.reshape((heads, 1))?.broadcast_as((heads, 2 * half))?.reshape(width)?),
            None => Ok(y),
        };
    }
    if !x.device().is_cpu() || crate::model::gpu_path(x) {
        // The norm is per (token, head) row: on the token-major rows, before the transpose (on
        // a GPU that is the fused norm's one kernel each way).
        let rows = x.reshape((n, heads, d))?;
        let xn = match eps {
            Some(eps) => ops::rms_norm_eps(&rows, eps)?,
            None => super::rms_norm(&rows)?,
        };
        let xh = xn.reshape((n / t, t, heads, d))?.transpose(1, 2)?;
        let mut y = if 2 * half == d {
            ops::rope(&xh, cos, sin)?
        } else {
            let rotated = ops::rope(&xh.narrow(3, 0, 2 * half)?, cos, sin)?;
            Tensor::cat(&[&rotated, &xh.narrow(3, 2 * half, d - 2 * half)?], 3)?
        };
        if let Some(g) = gain {
            y = y.broadcast_mul(&g.reshape((1, heads, 1, 1))?)?;
        }
        return y.transpose(1, 2)?.reshape((n, width));
    }
    check_float("qk_norm_rope", x.dtype())?;
    let table = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>() };
    let eps = eps.unwrap_or(ops::rms_eps(x.dtype()));
    let op = QkNormRope { heads, d, half, seq: t, eps, cos: table(cos)?, sin: table(sin)? };
    match gain {
        Some(g) => {
            same_dtypes("qk_norm_rope", &[x, g])?;
            x.contiguous()?.apply_op2(&g.contiguous()?, op)
        }
        None => x.contiguous()?.apply_op1(op),
    }
}

#[cfg(feature = "candle")]
struct QkNormRope {
    heads: usize,
    /// Head width.
    d: usize,
    /// Rotated pairs per head (`R / 2`).
    half: usize,
    seq: usize,
    /// The RMS norm's epsilon.
    eps: f64,
    /// `(T, D / 2)` tables, row-major.
    cos: Vec<f64>,
    sin: Vec<f64>,
}

/// The geometry of one call: `heads` heads of `d` per row, the first `2 * half` of each
/// rotated, row `n` at position `n % seq`, the `(seq, half)` tables in `T`.
pub(crate) struct RopeRows<'a, T> {
    pub(crate) heads: usize,
    pub(crate) d: usize,
    pub(crate) half: usize,
    pub(crate) seq: usize,
    /// The RMS norm's epsilon.
    pub(crate) eps: f64,
    pub(crate) cos: &'a [T],
    pub(crate) sin: &'a [T],
}

/// Rows `n0..` of the forward pass: `out` holds whole rows of `heads * d`; row `n` of `x`
/// starts at `n * ldx`. `1 / r` of each head into `rstd` (`heads` per row, from row `n0`) when
/// given.
#[inline(always)]
fn qk_fwd_kernel<T: Real>(
    g: &RopeRows<'_, T>,
    n0: usize,
    (x, ldx): (&[T], usize),
    gain: Option<&[T]>,
    out: &mut [T],
    mut rstd: Option<&mut [T]>,
) {
    let (half, d) = (g.half, g.d);
    let eps = g.eps;
    let w = g.heads * d;
    for (r, orow) in out.chunks_exact_mut(w).enumerate() {
        let xrow = &x[(n0 + r) * ldx..][..w];
        let pos = (n0 + r) % g.seq;
        let (cos, sin) = (&g.cos[pos * half..(pos + 1) * half], &g.sin[pos * half..(pos + 1) * half]);
        for (h, (o, xh)) in orow.chunks_exact_mut(d).zip(xrow.chunks_exact(d)).enumerate() {
            // As `ops::rms_norm`, then `ops::rope`, then the gain, rounding for rounding.
            let rms = (dot_f64(xh, xh) / d as f64 + eps).sqrt();
            if let Some(rstd) = rstd.as_deref_mut() {
                rstd[r * g.heads + h] = T::from_f64(1.0 / rms);
            }
            let rms = T::from_f64(rms);
            let (x1, rest) = xh.split_at(half);
            let (x2, xp) = rest.split_at(half);
            let (o1, rest) = o.split_at_mut(half);
            let (o2, op) = rest.split_at_mut(half);
            for i in 0..half {
                let (y1, y2) = (x1[i] / rms, x2[i] / rms);
                o1[i] = y1 * cos[i] + y2 * sin[i];
                o2[i] = y2 * cos[i] - y1 * sin[i];
            }
            // Partial RoPE: the dims past the rotated ones are only normed.
            for (o, &x) in op.iter_mut().zip(xp) {
                *o = x / rms;
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
    fn qk_fwd_rows = qk_fwd_kernel(g: &RopeRows<'_, T>, n0: usize, x: (&[T], usize), gain: Option<&[T]>, out: &mut [T], rstd: Option<&mut [T]>);
}

/// Gradient rows `n0..n0 + rows`: `dx` of `x` given the output gradient `go` (contiguous rows
/// of `heads * d`), row `r` of the block written at `dx[r * lddx..]`; `r` of each head
/// recomputed from `x` or, given `rstd`, `1 / rstd` as the forward pass saved it. With a gain,
/// adds each head's `sum(go * rope(norm(x)))` to `dgain`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn qk_bwd_kernel<T: Real>(
    g: &RopeRows<'_, T>,
    (n0, rows): (usize, usize),
    (x, ldx): (&[T], usize),
    go: &[T],
    (gain, rstd): (Option<&[T]>, Option<&[T]>),
    (dx, lddx): (&mut [T], usize),
    dgain: &mut [f64],
) {
    let (half, d) = (g.half, g.d);
    let eps = g.eps;
    let w = g.heads * d;
    for r in 0..rows {
        let n = n0 + r;
        let (xrow, gorow) = (&x[n * ldx..][..w], &go[n * w..][..w]);
        let dxrow = &mut dx[r * lddx..][..w];
        let pos = n % g.seq;
        let (cos, sin) = (&g.cos[pos * half..(pos + 1) * half], &g.sin[pos * half..(pos + 1) * half]);
        for (h, ((dxh, xh), goh)) in dxrow.chunks_exact_mut(d).zip(xrow.chunks_exact(d)).zip(gorow.chunks_exact(d)).enumerate() {
            let rms = match rstd {
                Some(rstd) => 1.0 / rstd[n * g.heads + h].to_f64(),
                None => (dot_f64(xh, xh) / d as f64 + eps).sqrt(),
            };
            let (x1, rest) = xh.split_at(half);
            let (x2, xp) = rest.split_at(half);
            let (g1, rest) = goh.split_at(half);
            let (g2, gp) = rest.split_at(half);
            if gain.is_some() {
                // d gain = sum(go * rope(y)) with y = x / rms as the forward pass rounds it.
                let rt = T::from_f64(rms);
                let mut acc = 0.0f64;
                for i in 0..half {
                    let (y1, y2) = (x1[i] / rt, x2[i] / rt);
                    acc += (g1[i] * (y1 * cos[i] + y2 * sin[i])).to_f64() + (g2[i] * (y2 * cos[i] - y1 * sin[i])).to_f64();
                }
                for (&g, &x) in gp.iter().zip(xp) {
                    acc += (g * (x / rt)).to_f64();
                }
                dgain[h] += acc;
            }
            let w = gain.map_or(T::from_f64(1.0), |gain| gain[h]);
            // dy = rope^T(go * w), kept in dx for now.
            {
                let (d1, rest) = dxh.split_at_mut(half);
                let (d2, dp) = rest.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (g1[i] * w, g2[i] * w);
                    d1[i] = a * cos[i] - b * sin[i];
                    d2[i] = a * sin[i] + b * cos[i];
                }
                for (d, &g) in dp.iter_mut().zip(gp) {
                    *d = g * w;
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
    fn qk_bwd_rows = qk_bwd_kernel(g: &RopeRows<'_, T>, rows: (usize, usize), x: (&[T], usize), go: &[T], gain_rstd: (Option<&[T]>, Option<&[T]>), dx: (&mut [T], usize), dgain: &mut [f64]);
}

/// The forward pass on the CPU, for the model's op and the engine's backend: the rows of `x`
/// (row `n` at `n * ldx`, `heads * d` wide) into the contiguous `out`, `1 / r` per (row, head)
/// into `rstd` when given; [`ROWS`] rows per rayon task.
pub(crate) fn forward_rows<T: Real>(geo: &RopeRows<'_, T>, x: (&[T], usize), gain: Option<&[T]>, out: &mut [T], rstd: Option<&mut [T]>) {
    let w = geo.heads * geo.d;
    match rstd {
        Some(rstd) => out.par_chunks_mut(ROWS * w).zip(rstd.par_chunks_mut(ROWS * geo.heads)).enumerate().for_each(|(c, (o, r))| {
            qk_fwd_rows(geo, c * ROWS, x, gain, o, Some(r));
        }),
        None => out.par_chunks_mut(ROWS * w).enumerate().for_each(|(c, o)| qk_fwd_rows(geo, c * ROWS, x, gain, o, None)),
    }
}

/// The backward pass on the CPU, for the model's op and the engine's backend: `dx` (row `n` at
/// `n * lddx`) of the `rows` rows of `x` given `go`, written; `r` from `rstd` when given. Returns
/// the gain's gradient in f64 (empty without a gain), summed per block of [`ROWS`] rows and the
/// blocks added in order.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_rows<T: Real>(
    geo: &RopeRows<'_, T>,
    rows: usize,
    x: (&[T], usize),
    go: &[T],
    gain: Option<&[T]>,
    rstd: Option<&[T]>,
    (dx, lddx): (&mut [T], usize),
) -> Vec<f64> {
    let w = geo.heads * geo.d;
    let nh = if gain.is_some() { geo.heads } else { 0 };
    let parts: Vec<Vec<f64>> = split_rows(dx, lddx, w, rows)
        .into_par_iter()
        .map(|(n0, block)| {
            let mut dgain = vec![0.0; nh];
            let n = if block.is_empty() { 0 } else { (block.len() - w) / lddx + 1 };
            qk_bwd_rows(geo, (n0, n), x, go, (gain, rstd), (block, lddx), &mut dgain);
            dgain
        })
        .collect();
    add_partials(parts, nh)
}

#[cfg(feature = "candle")]
impl QkNormRope {
    fn tables<T: Real>(&self) -> (Vec<T>, Vec<T>) {
        (self.cos.iter().map(|&c| T::from_f64(c)).collect(), self.sin.iter().map(|&s| T::from_f64(s)).collect())
    }

    fn geometry<'a, T>(&self, cos: &'a [T], sin: &'a [T]) -> RopeRows<'a, T> {
        RopeRows { heads: self.heads, d: self.d, half: self.half, seq: self.seq, eps: self.eps, cos, sin }
    }

    fn fwd<T: Real>(&self, x: &[T], gain: Option<&[T]>) -> Vec<T> {
        let (cos, sin) = self.tables::<T>();
        let mut out = vec![T::from_f64(0.0); x.len()];
        forward_rows(&self.geometry(&cos, &sin), (x, self.heads * self.d), gain, &mut out, None);
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
        let w = self.heads * self.d;
        let mut dx = vec![T::from_f64(0.0); xv.len()];
        let sums = backward_rows(&self.geometry(&cos, &sin), xv.len() / w, (xv, w), gv, gainv, None, (&mut dx, w));
        let dgain = match gain {
            Some(_) => Some(tensor_from_f64::<T>(&sums, self.heads)?),
            None => None,
        };
        Ok((Tensor::from_vec(dx, x.shape(), &Device::Cpu)?, dgain))
    }
}

#[cfg(feature = "candle")]
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

#[cfg(feature = "candle")]
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

/// `rope(rms_norm(head))` for every head of `x` `(N, heads * D)`, whose row `n` is position
/// `n % T`; `table` is `(T, D)`: the `(T, D / 2)` cos table then the sin table of
/// [`ops::rope_tables`], side by side. `eps` is the norm's epsilon, by default the input dtype's
/// ([`ops::rms_eps`]). Returns `(N, heads * D)`. Differentiable in `x`.
#[cfg(feature = "candle")]
pub fn norm_rope(x: &Tensor, table: &Tensor, heads: usize, eps: Option<f64>) -> Result<Tensor> {
    let (n, width) = x.dims2()?;
    let (t, d) = table.dims2()?;
    if heads == 0 || d % 2 != 0 || width != heads * d || t == 0 || n % t != 0 {
        bail!("norm_rope: x {:?} with {heads} heads does not fit the table {:?}", x.shape(), table.shape());
    }
    let table = table.to_dtype(x.dtype())?.contiguous()?;
    let eps = eps.unwrap_or(ops::rms_eps(x.dtype()));
    x.contiguous()?.apply_op2(&table, NormRope { heads, eps })
}

#[cfg(feature = "candle")]
struct NormRope {
    heads: usize,
    /// The RMS norm's epsilon.
    eps: f64,
}

/// `(x, grad, table) -> dx` of [`NormRope`].
#[cfg(feature = "candle")]
struct NormRopeBwd {
    heads: usize,
    eps: f64,
}

#[cfg(feature = "candle")]
fn host(s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    convert::to_f64("norm_rope", s, l)
}

#[cfg(feature = "candle")]
fn storage(v: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
    convert::from_f64("norm_rope", v, dtype)
}

/// Row geometry: `(d, seq)` from the table's layout, checked against `x`'s element count.
#[cfg(feature = "candle")]
fn geometry(xl: &Layout, tl: &Layout) -> Result<(usize, usize)> {
    let (seq, d) = tl.shape().dims2()?;
    if d == 0 || !xl.shape().elem_count().is_multiple_of(d) {
        bail!("norm_rope: x {:?} does not split into rows of {d}", xl.shape());
    }
    Ok((d, seq))
}

/// The reference forward pass in f64.
#[cfg(feature = "candle")]
fn fwd_rows(x: &[f64], table: &[f64], d: usize, heads: usize, seq: usize, eps: f64) -> Vec<f64> {
    let half = d / 2;
    let mut out = vec![0.0; x.len()];
    for (r, (xr, o)) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).enumerate() {
        let tr = &table[((r / heads) % seq) * d..][..d];
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        for i in 0..half {
            let (y1, y2, c, s) = (xr[i] * inv, xr[i + half] * inv, tr[i], tr[half + i]);
            o[i] = y1 * c + y2 * s;
            o[i + half] = y2 * c - y1 * s;
        }
    }
    out
}

/// The reference backward pass in f64: rotate the gradient back, then RMS norm's backward.
#[cfg(feature = "candle")]
fn bwd_rows(x: &[f64], g: &[f64], table: &[f64], d: usize, heads: usize, seq: usize, eps: f64) -> Vec<f64> {
    let half = d / 2;
    let mut out = vec![0.0; x.len()];
    for (r, ((xr, gr), o)) in x.chunks_exact(d).zip(g.chunks_exact(d)).zip(out.chunks_exact_mut(d)).enumerate() {
        let tr = &table[((r / heads) % seq) * d..][..d];
        let mut dy = vec![0.0; d];
        for i in 0..half {
            let (g1, g2, c, s) = (gr[i], gr[i + half], tr[i], tr[half + i]);
            dy[i] = g1 * c - g2 * s;
            dy[i + half] = g1 * s + g2 * c;
        }
        let inv = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
        let k = xr.iter().zip(&dy).map(|(a, b)| a * b).sum::<f64>() / d as f64 * inv * inv * inv;
        for ((o, dy), x) in o.iter_mut().zip(&dy).zip(xr) {
            *o = dy * inv - x * k;
        }
    }
    out
}

/// Runs `kernel` (`norm_rope_fwd` or `_bwd`) over the head rows of `inputs` (x first, then the
/// gradient) with the table `(ts, tl)`; the output has x's shape. Head rows that split into
/// 16-byte chunks (64 values in bf16 or f32, as the baseline's) take the chunked kernels
/// (`norm_rope_vec_*`: several rows per warp, one 16-byte load per lane and tensor).
#[cfg(feature = "cuda")]
#[cfg(feature = "candle")]
fn launch(
    kernel: &str,
    (heads, eps): (usize, f64),
    inputs: &[(&candle_core::CudaStorage, &Layout)],
    (ts, tl): (&candle_core::CudaStorage, &Layout),
) -> Result<(candle_core::CudaStorage, Shape)> {
    let xl = inputs[0].1;
    let (d, seq) = geometry(xl, tl)?;
    let eps = eps as f32;
    let chunked = kernel.replacen("norm_rope_", "norm_rope_vec_", 1);
    let out = crate::model::cuda::fused::rows_op_chunked(kernel, &chunked, inputs, &[(ts, tl)], d, eps, &[heads as i32, seq as i32])?;
    Ok((out, xl.shape().clone()))
}

#[cfg(feature = "candle")]
impl CustomOp2 for NormRope {
    fn name(&self) -> &'static str {
        "norm-rope"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ts: &CpuStorage, tl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (d, seq) = geometry(xl, tl)?;
        let out = fwd_rows(&host(xs, xl)?, &host(ts, tl)?, d, self.heads, seq, self.eps);
        Ok((storage(out, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        launch("norm_rope_fwd", (self.heads, self.eps), &[(xs, xl)], (ts, tl))
    }

    fn bwd(&self, x: &Tensor, table: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = x.apply_op3_no_bwd(&grad.contiguous()?, table, &NormRopeBwd { heads: self.heads, eps: self.eps })?;
        Ok((Some(dx), None))
    }
}

#[cfg(feature = "candle")]
impl CustomOp3 for NormRopeBwd {
    fn name(&self) -> &'static str {
        "norm-rope-bwd"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        ts: &CpuStorage,
        tl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if xl.dims() != gl.dims() {
            bail!("norm_rope backward: gradient {:?} for x {:?}", gl.shape(), xl.shape());
        }
        let (d, seq) = geometry(xl, tl)?;
        let out = bwd_rows(&host(xs, xl)?, &host(gs, gl)?, &host(ts, tl)?, d, self.heads, seq, self.eps);
        Ok((storage(out, xs.dtype())?, xl.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        ts: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        launch("norm_rope_bwd", (self.heads, self.eps), &[(xs, xl), (gs, gl)], (ts, tl))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Result, Tensor, Var};

    use super::*;
    use crate::model::ops::testing::{Loss, assert_close, check_finite_differences, check_grads, flat, grads, rand, seeded};

    /// The composite of the model before fusion: heads split out, RMS norm, RoPE, gain, heads put
    /// back.
    fn qk_ref(x: &Tensor, gain: Option<&Tensor>, cos: &Tensor, sin: &Tensor, heads: usize) -> Result<Tensor> {
        let (n, w) = x.dims2()?;
        let t = cos.dim(0)?;
        let (d, r) = (w / heads, 2 * cos.dim(1)?);
        let xh = ops::rms_norm_reference(&x.reshape((n / t, t, heads, d))?.transpose(1, 2)?)?;
        // RoPE of the first r dims; the rest pass through.
        let rotated = ops::rope(&xh.narrow(3, 0, r)?, cos, sin)?;
        let mut y = if r == d { rotated } else { Tensor::cat(&[&rotated, &xh.narrow(3, r, d - r)?], 3)? };
        if let Some(g) = gain {
            y = y.broadcast_mul(&g.reshape((1, heads, 1, 1))?)?;
        }
        y.transpose(1, 2)?.reshape((n, w))
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

    /// Partial RoPE (the record's 16 of 64 dims, here 4 of 8 and 2 of 6): the CPU kernel and
    /// the GPU formulation against the reference, forward and backward, and finite differences.
    #[test]
    fn partial_rope_matches_the_reference() {
        let mut rng = fastrand::Rng::with_seed(29);
        for (d, r) in [(8usize, 4usize), (6, 2)] {
            let (cos, sin) = ops::rope_tables(35, r, 10_000.0, DType::F64, &Device::Cpu).unwrap();
            let x = rand(&mut rng, &[70, 2 * d], 2.0, DType::F64);
            let gain = rand(&mut rng, &[2], 2.0, DType::F64);
            let want = qk_ref(&x, Some(&gain), &cos, &sin, 2).unwrap();
            assert_close(&qk_norm_rope(&x, Some(&gain), &cos, &sin, 2, None).unwrap(), &want, 1e-12, "partial, CPU kernel");
            let gpu = crate::model::with_gpu_formulation(|| qk_norm_rope(&x, Some(&gain), &cos, &sin, 2, None)).unwrap();
            assert_close(&gpu, &want, 1e-12, "partial, GPU formulation");
            // The unrotated dims are the normed input times the gain.
            let xs = flat(&x);
            let ys = flat(&want);
            let (g0, row) = (flat(&gain)[0], &xs[..d]);
            let rms = (row.iter().map(|v| v * v).sum::<f64>() / d as f64 + ops::rms_eps(DType::F64)).sqrt();
            for i in r..d {
                assert!((ys[i] - row[i] / rms * g0).abs() < 1e-12, "dim {i} of {d} must pass through");
            }
            let fused = |x: &[Tensor]| qk_norm_rope(&x[0], Some(&x[1]), &cos, &sin, 2, None);
            let reference = |x: &[Tensor]| qk_ref(&x[0], Some(&x[1]), &cos, &sin, 2);
            check_grads(&fused, &reference, &[x.clone(), gain.clone()], "partial qk_norm_rope with gain");
            let on_gpu = |x: &[Tensor]| crate::model::with_gpu_formulation(|| qk_norm_rope(&x[0], Some(&x[1]), &cos, &sin, 2, None));
            check_grads(&on_gpu, &reference, &[x, gain], "partial qk_norm_rope, GPU formulation");
            let (cos, sin) = ops::rope_tables(3, r, 10_000.0, DType::F64, &Device::Cpu).unwrap();
            let x = rand(&mut rng, &[6, 2 * d], 2.0, DType::F64);
            let gain = rand(&mut rng, &[2], 2.0, DType::F64);
            check_finite_differences(&|x| qk_norm_rope(&x[0], Some(&x[1]), &cos, &sin, 2, None), &[x, gain], "partial qk_norm_rope");
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

    /// The composite it replaces: heads `(B, H, T, D)`, `ops::rope(ops::rms_norm_reference(..))`, back to
    /// token-major rows.
    fn composite(x: &Tensor, cos: &Tensor, sin: &Tensor, b: usize, t: usize, h: usize, d: usize) -> Tensor {
        let xh = x.reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap();
        ops::rope(&ops::rms_norm_reference(&xh).unwrap(), cos, sin).unwrap().transpose(1, 2).unwrap().reshape((b * t, h * d)).unwrap()
    }

    #[test]
    fn matches_the_composite_forward_and_backward() {
        for (b, t, h, d) in [(2usize, 5usize, 3usize, 4usize), (1, 7, 1, 8), (3, 2, 2, 2)] {
            let (cos, sin) = ops::rope_tables(t, d, 10_000.0, DType::F64, &Device::Cpu).unwrap();
            let table = Tensor::cat(&[&cos, &sin], 1).unwrap();
            let x = Var::from_tensor(&seeded(&[b * t, h * d], 3)).unwrap();
            let g = seeded(&[b * t, h * d], 4);
            let ours = norm_rope(x.as_tensor(), &table, h, None).unwrap();
            let want = composite(x.as_tensor(), &cos, &sin, b, t, h, d);
            for (a, w) in flat(&ours).iter().zip(flat(&want)) {
                assert!((a - w).abs() < 1e-12, "{:?}: {a} vs {w}", (b, t, h, d));
            }
            let d_ours = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap().clone();
            let d_want = (want * &g).unwrap().sum_all().unwrap().backward().unwrap().get(x.as_tensor()).unwrap().clone();
            for (a, w) in flat(&d_ours).iter().zip(flat(&d_want)) {
                assert!((a - w).abs() < 1e-12, "{:?} gradient: {a} vs {w}", (b, t, h, d));
            }
        }
    }

    #[test]
    fn rejects_shapes_that_do_not_fit() {
        let table = Tensor::zeros((4, 8), DType::F64, &Device::Cpu).unwrap();
        assert!(norm_rope(&Tensor::zeros((8, 12), DType::F64, &Device::Cpu).unwrap(), &table, 2, None).is_err(), "12 != 2 * 8");
        assert!(
            norm_rope(&Tensor::zeros((6, 16), DType::F64, &Device::Cpu).unwrap(), &table, 2, None).is_err(),
            "6 rows are not whole sequences of 4"
        );
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut rng = fastrand::Rng::with_seed(28);
        let x = rand(&mut rng, &[4, 6], 1.0, DType::F32);
        let (cos, sin) = ops::rope_tables(4, 4, 10_000.0, DType::F32, &Device::Cpu).unwrap();
        assert!(qk_norm_rope(&x, None, &cos, &sin, 2, None).is_err(), "6 columns are not 2 heads of 4");
        let x = rand(&mut rng, &[4, 8], 1.0, DType::F32);
        assert!(qk_norm_rope(&x, Some(&rand(&mut rng, &[3], 1.0, DType::F32)), &cos, &sin, 2, None).is_err());
    }
}
