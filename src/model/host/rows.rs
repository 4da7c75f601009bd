//! Rows of CPU tensors as the kernels read them: [`Rows`] (the rows of a layout whose last
//! dimension is contiguous, wherever they start), their offsets ([`row_offsets`]), contiguous
//! element slices of a storage ([`elems`], [`elems_as`], [`Held`]), and the ordered sum of
//! per-task partial sums ([`add_partials`]) that keeps per-channel gradients independent of
//! thread scheduling; for the engine's buffers, contiguous matrices as [`Rows`]
//! ([`dense_offsets`]) and strided views cut into row blocks ([`split_rows`]).

#[cfg(feature = "candle")]
use std::borrow::Cow;

use rayon::prelude::*;

#[cfg(feature = "candle")]
use candle_core::{CpuStorage, Device, Layout, Result, Shape, Storage, Tensor, WithDType, bail};

#[cfg(feature = "candle")]
use super::convert::values_as;
use super::simd::Real;

/// Rows per rayon task for the elementwise ops and the per-channel sums.
pub(crate) const ROWS: usize = 64;

/// `x` itself when its last dimension has stride 1 (or size 1), else a contiguous copy.
#[cfg(feature = "candle")]
pub(crate) fn unit_last(x: &Tensor) -> Result<Tensor> {
    match (x.dims().last(), x.stride().last()) {
        (Some(&n), Some(&s)) if n > 1 && s != 1 => x.contiguous(),
        _ => Ok(x.clone()),
    }
}

/// Start offsets, in storage elements, of every row (last-dimension slice) of `layout`, in
/// row-major order of the leading dimensions. The last dimension must have stride 1.
#[cfg(feature = "candle")]
pub(crate) fn row_offsets(layout: &Layout) -> Result<Vec<usize>> {
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

/// The offsets of `rows` rows of `len` one after the other (`0, len, 2 len, ..`): a contiguous
/// row-major matrix read as [`Rows`] (the engine's buffers).
pub(crate) fn dense_offsets(rows: usize, len: usize) -> Vec<usize> {
    (0..rows).map(|r| r * len).collect()
}

/// The element offset of each index of a 1-D layout.
#[cfg(feature = "candle")]
pub(crate) fn offsets_1d(layout: &Layout) -> Result<Vec<usize>> {
    let n = layout.shape().dims1()?;
    let (start, stride) = (layout.start_offset(), layout.stride()[0]);
    Ok((0..n).map(|i| start + i * stride).collect())
}

/// The elements of a CPU storage as `T` (`what` names the input in errors).
#[cfg(feature = "candle")]
pub(crate) fn cpu_slice<'a, T: WithDType>(storage: &'a Storage, what: &str) -> Result<&'a [T]> {
    match storage {
        Storage::Cpu(s) => T::cpu_storage_as_slice(s),
        _ => bail!("fused op: {what} is not on the CPU"),
    }
}

/// Rows of `len` elements of `data`, the `i`-th starting at `offsets[i]`.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a, T> {
    pub(crate) data: &'a [T],
    pub(crate) offsets: &'a [usize],
    pub(crate) len: usize,
}

impl<'a, T: Copy> Rows<'a, T> {
    /// Row `i`.
    #[inline(always)]
    pub(crate) fn row(&self, i: usize) -> &'a [T] {
        let o = self.offsets[i];
        &self.data[o..o + self.len]
    }

    /// The number of rows.
    pub(crate) fn count(&self) -> usize {
        self.offsets.len()
    }

    /// The rows in `range`.
    pub(crate) fn sub(&self, range: std::ops::Range<usize>) -> Self {
        Self { offsets: &self.offsets[range], ..*self }
    }

    /// The rows, one after the other: a `(count, len)` row-major matrix.
    #[inline(always)]
    pub(crate) fn gather(&self) -> Vec<T> {
        let mut out = Vec::with_capacity(self.count() * self.len);
        for i in 0..self.count() {
            out.extend_from_slice(self.row(i));
        }
        out
    }

    /// The transpose: a `(len, count)` row-major matrix.
    #[inline(always)]
    pub(crate) fn transposed(&self, zero: T) -> Vec<T> {
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

/// The elements of a contiguous layout in its storage.
#[cfg(feature = "candle")]
pub(crate) fn elems<'a, T: Real>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("fused op: input is not contiguous, layout {l:?}") };
    Ok(&T::cpu_storage_as_slice(s)?[a..b])
}

/// [`elems`] as `T` from a storage of `T` (borrowed) or of the narrower dtype of a mixed pair
/// (widened exactly; callers check the pair).
#[cfg(feature = "candle")]
pub(crate) fn elems_as<'a, T: Real>(s: &'a CpuStorage, l: &Layout) -> Result<Cow<'a, [T]>> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("fused op: input is not contiguous, layout {l:?}") };
    Ok(match values_as::<T>(s)? {
        Cow::Borrowed(v) => Cow::Borrowed(&v[a..b]),
        Cow::Owned(mut v) => {
            v.truncate(b);
            v.drain(..a);
            Cow::Owned(v)
        }
    })
}

/// A CPU tensor's storage, held for reading.
#[cfg(feature = "candle")]
pub(crate) struct Held<'a>(candle_core::StorageRef<'a>, &'a Layout);

#[cfg(feature = "candle")]
impl<'a> Held<'a> {
    /// Holds `t`'s storage for reading.
    pub(crate) fn new(t: &'a Tensor) -> Self {
        let (s, l) = t.storage_and_layout();
        Self(s, l)
    }

    /// The tensor's elements (it must be contiguous).
    pub(crate) fn slice<T: Real>(&self, what: &str) -> Result<&[T]> {
        let Some((a, b)) = self.1.contiguous_offsets() else { bail!("fused op: {what} is not contiguous") };
        Ok(&cpu_slice::<T>(&self.0, what)?[a..b])
    }
}

/// Per-channel f64 sums over row blocks, added in block order into `acc` (`+=`).
pub(crate) fn column_sums<T: Real>(rows: usize, cols: usize, acc: &mut [T], per_row: impl Fn(usize, &mut [f64]) + Sync) {
    let parts: Vec<Vec<f64>> = (0..rows.div_ceil(ROWS))
        .into_par_iter()
        .map(|blk| {
            let mut s = vec![0.0; cols];
            for r in blk * ROWS..((blk + 1) * ROWS).min(rows) {
                per_row(r, &mut s);
            }
            s
        })
        .collect();
    add_into(acc, &add_partials(parts, cols));
}

/// `acc += sums`, per channel: per-channel sums (in f64, from fixed row blocks) added to a
/// buffer of the working type.
pub(crate) fn add_into<T: Real>(acc: &mut [T], sums: &[f64]) {
    for (a, &s) in acc.iter_mut().zip(sums) {
        *a += T::from_f64(s);
    }
}

/// Sums the per-block partial sums in block order.
pub(crate) fn add_partials(parts: Vec<Vec<f64>>, len: usize) -> Vec<f64> {
    let mut total = vec![0.0; len];
    for p in parts {
        for (t, x) in total.iter_mut().zip(p) {
            *t += x;
        }
    }
    total
}

/// A strided `(rows, width)` view with row stride `ld` cut into blocks of [`ROWS`] rows: each
/// block the slice from its first row's start to its last row's end, with its first row (so
/// that rayon tasks can each write their own rows of a view such as a column block of a wider
/// matrix).
pub(crate) fn split_rows<T>(data: &mut [T], ld: usize, width: usize, rows: usize) -> Vec<(usize, &mut [T])> {
    let mut out = Vec::with_capacity(rows.div_ceil(ROWS));
    let mut rest = data;
    let mut r0 = 0;
    while r0 < rows {
        let n = ROWS.min(rows - r0);
        let span = (n - 1) * ld + width;
        let take = if r0 + n < rows { n * ld } else { rest.len() };
        let (block, tail) = std::mem::take(&mut rest).split_at_mut(take);
        out.push((r0, &mut block[..span]));
        rest = tail;
        r0 += n;
    }
    out
}

/// A CPU tensor of `shape` in `T` from f64 values (the per-channel sums of a backward pass).
#[cfg(feature = "candle")]
pub(crate) fn tensor_from_f64<T: Real>(v: &[f64], shape: impl Into<Shape>) -> Result<Tensor> {
    Tensor::from_vec(v.iter().map(|&x| T::from_f64(x)).collect::<Vec<T>>(), shape, &Device::Cpu)
}
