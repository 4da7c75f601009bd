//! The CPU references of the GPU ops compute in f64: these convert a contiguous CPU storage
//! (f32, bf16 or f64) to f64 values and back to the storage's dtype.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, bail};

/// The values of a contiguous `s` with layout `l` as f64 (`op` names the caller in errors).
pub(super) fn to_f64(op: &str, s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("{op}: the CPU reference needs contiguous inputs, got {l:?}") };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].iter().map(|&x| x as f64).collect(),
        CpuStorage::F64(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f64()).collect(),
        s => bail!("{op}: unsupported dtype {:?}", s.dtype()),
    })
}

/// `v` rounded to `dtype` (f32, bf16 or f64).
pub(super) fn from_f64(op: &str, v: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v.into_iter().map(|x| x as f32).collect()),
        DType::F64 => CpuStorage::F64(v),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f64).collect()),
        dt => bail!("{op}: unsupported dtype {dt:?}"),
    })
}

/// `s` with bf16 values widened to f32 (exactly); other dtypes as they are. A kernel reading
/// bf16 computes in f32: a CPU reference handed bf16 inputs runs its f32 code on them, then
/// [`narrowed`] rounds its output once, as the kernel's store does.
pub(super) fn widened(s: &CpuStorage) -> std::borrow::Cow<'_, CpuStorage> {
    use std::borrow::Cow;
    match s {
        CpuStorage::BF16(v) => Cow::Owned(CpuStorage::F32(v.iter().map(|x| x.to_f32()).collect())),
        s => Cow::Borrowed(s),
    }
}

/// An f32 output of a CPU reference run on [`widened`] bf16 inputs, rounded to bf16 (to nearest
/// even); an output already narrower (a mixed op's) as it is.
pub(super) fn narrowed((s, shape): (CpuStorage, candle_core::Shape)) -> Result<(CpuStorage, candle_core::Shape)> {
    Ok(match s {
        CpuStorage::F32(v) => (CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()), shape),
        s => (s, shape),
    })
}
