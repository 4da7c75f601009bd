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
