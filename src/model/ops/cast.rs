//! The cast between f32 and bf16: `y = round_to_nearest_even(x)` (or the exact widening), the
//! gradient cast back to the input's dtype.
//!
//! Casts between f32 and bf16 on CUDA devices: one vectorised kernel each way
//! (`kernels/fused.cu`); candle's own cast ran at about a sixth of the memory bandwidth here
//! (Nsight Compute, H100: 368 µs for a 65,536 x 512 bf16 -> f32 cast, the mixed-precision
//! graph's most frequent kernel). Differentiable (the gradient is cast back). Other devices and
//! dtype pairs take candle's `to_dtype`; the op's CPU implementation (round to nearest even, as
//! the kernel) is tested against it.

#[cfg(feature = "candle")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "candle")]
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// `x` as `dtype`.
#[cfg(feature = "candle")]
pub fn cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    if x.device().is_cuda() && matches!((x.dtype(), dtype), (DType::F32, DType::BF16) | (DType::BF16, DType::F32)) {
        let x = x.contiguous()?;
        if x.layout().start_offset() % 8 == 0 {
            return x.apply_op1(Cast(dtype));
        }
    }
    x.to_dtype(dtype)
}

/// The cast to the dtype held.
#[cfg(feature = "candle")]
struct Cast(DType);

#[cfg(feature = "candle")]
impl CustomOp1 for Cast {
    fn name(&self) -> &'static str {
        "cast"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let Some((a, b)) = l.contiguous_offsets() else { candle_core::bail!("cast: the input must be contiguous, got {l:?}") };
        let out = match (s, self.0) {
            (CpuStorage::F32(v), DType::BF16) => CpuStorage::BF16(v[a..b].iter().map(|&x| half::bf16::from_f32(x)).collect()),
            (CpuStorage::BF16(v), DType::F32) => CpuStorage::F32(v[a..b].iter().map(|x| x.to_f32()).collect()),
            (s, to) => candle_core::bail!("cast: {:?} to {to:?} is not this op's", s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((crate::model::cuda::fused::cast(s, l, self.0)?, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(cast(grad, arg.dtype())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The op's CPU implementation rounds as candle's cast does, both ways, ties and extremes
    /// included, and its gradient comes back in the input's dtype.
    #[test]
    fn cpu_cast_matches_candles() {
        let mut vals: Vec<f32> = (0..4000).map(|i| ((i as f32) * 0.7311).sin() * 10f32.powi(i % 9 - 4)).collect();
        vals.extend([0.0, -0.0, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::MAX, f32::MIN_POSITIVE, 65504.0]);
        let x = Tensor::from_vec(vals, 4007, &Device::Cpu).unwrap();
        let ours = x.apply_op1(Cast(DType::BF16)).unwrap();
        let theirs = x.to_dtype(DType::BF16).unwrap();
        assert_eq!(ours.to_vec1::<half::bf16>().unwrap(), theirs.to_vec1::<half::bf16>().unwrap());
        let back = ours.apply_op1(Cast(DType::F32)).unwrap();
        assert_eq!(back.to_vec1::<f32>().unwrap(), theirs.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap());
        let v = candle_core::Var::from_tensor(&x).unwrap();
        let g = v.as_tensor().apply_op1(Cast(DType::BF16)).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(g.get(v.as_tensor()).unwrap().dtype(), DType::F32);
    }
}
