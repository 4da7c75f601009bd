//! Conversions between CPU storages and the kernels' working types: the CPU references of the
//! GPU ops compute in f64 ([`to_f64`], [`from_f64`]); a kernel handed bf16 runs its f32 code
//! ([`widened`]) and rounds once on the way out ([`narrowed`]), as the GPU kernels do; mixed
//! ops read a narrower input as the wide type ([`values_as`]) and write either ([`to_storage`]).
//! [`float_dispatch!`] runs generic kernel code for the storage's float type.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, DType, Layout, Result, WithDType, bail};

#[cfg(feature = "candle")]
use super::simd::Real;

/// The values of a contiguous `s` with layout `l` as f64 (`op` names the caller in errors).
#[cfg(feature = "candle")]
pub(crate) fn to_f64(op: &str, s: &CpuStorage, l: &Layout) -> Result<Vec<f64>> {
    let Some((a, b)) = l.contiguous_offsets() else { bail!("{op}: the CPU reference needs contiguous inputs, got {l:?}") };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].iter().map(|&x| x as f64).collect(),
        CpuStorage::F64(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f64()).collect(),
        s => bail!("{op}: unsupported dtype {:?}", s.dtype()),
    })
}

/// `v` rounded to `dtype` (f32, bf16 or f64).
#[cfg(feature = "candle")]
pub(crate) fn from_f64(op: &str, v: Vec<f64>, dtype: DType) -> Result<CpuStorage> {
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
#[cfg(feature = "candle")]
pub(crate) fn widened(s: &CpuStorage) -> std::borrow::Cow<'_, CpuStorage> {
    use std::borrow::Cow;
    match s {
        CpuStorage::BF16(v) => Cow::Owned(CpuStorage::F32(v.iter().map(|x| x.to_f32()).collect())),
        s => Cow::Borrowed(s),
    }
}

/// An f32 output of a CPU reference run on [`widened`] bf16 inputs, rounded to bf16 (to nearest
/// even); an output already narrower (a mixed op's) as it is.
#[cfg(feature = "candle")]
pub(crate) fn narrowed((s, shape): (CpuStorage, candle_core::Shape)) -> Result<(CpuStorage, candle_core::Shape)> {
    Ok(match s {
        CpuStorage::F32(v) => (CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()), shape),
        s => (s, shape),
    })
}

/// `v` converted to `dtype` (each value rounded once, to nearest even), as a CPU storage.
#[cfg(feature = "candle")]
pub(crate) fn to_storage<T: WithDType>(v: &[T], dtype: DType) -> Result<CpuStorage> {
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
#[cfg(feature = "candle")]
pub(crate) fn values_as<T: WithDType>(s: &CpuStorage) -> Result<std::borrow::Cow<'_, [T]>> {
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

/// `v` as a CPU storage of its own dtype.
#[cfg(feature = "candle")]
pub(crate) fn wrap<T: Real>(v: Vec<T>) -> CpuStorage {
    T::to_cpu_storage_owned(v)
}

/// Evaluates `$body` with the type `$t` bound to the float type of `$dtype`.
#[cfg(feature = "candle")]
macro_rules! float_dispatch {
    ($dtype:expr, $op:expr, |$t:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            dt => candle_core::bail!("{}: unsupported dtype {dt:?}", $op),
        }
    };
}
#[cfg(feature = "candle")]
pub(crate) use float_dispatch;
