//! Host-to-device copies for the `cuda` build: page-locked staging buffers and the copy of a
//! micro-batch from one onto the GPU, either on a dedicated copy stream (`upload/stream`) that
//! the executor's stream waits on through an event, or on the executor's stream itself
//! (`upload/sync`). Both time the copy with CUDA events (device time, not host time).
//!
//! `scripts/gpu-check.sh` exercises it on a GPU (its ablation compares the two uploaders).

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaStream, PinnedHostSlice};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, Device, Storage, Tensor};

use crate::batch::BatchShape;

/// The candle CUDA device behind `device` (an error naming `run.device` otherwise).
pub fn cuda_device(device: &Device) -> anyhow::Result<CudaDevice> {
    match device {
        Device::Cuda(d) => Ok(d.clone()),
        _ => anyhow::bail!("page-locked buffers and copy streams need `run.device` = \"cuda:N\""),
    }
}

/// The CUDA context of `device`.
pub fn context(device: &Device) -> anyhow::Result<Arc<CudaContext>> {
    Ok(cuda_device(device)?.cuda_stream().context().clone())
}

/// `n` page-locked buffers of `len` u32 each, allocated once.
pub fn pinned_buffers(device: &Device, n: usize, len: usize) -> anyhow::Result<Vec<PinnedHostSlice<u32>>> {
    let ctx = context(device)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        // SAFETY: the memory is uninitialised until the pin stage writes a micro-batch into it,
        // and nothing reads a buffer before that (its tokens come from the batch it holds).
        out.push(unsafe { ctx.alloc_pinned::<u32>(len) }?);
    }
    Ok(out)
}

/// Copies micro-batches from page-locked buffers to one GPU.
pub struct Copier {
    device: CudaDevice,
    /// The stream the copies run on.
    copy: Arc<CudaStream>,
    /// The executor's stream (candle's), which must see the data.
    compute: Arc<CudaStream>,
}

impl Copier {
    /// A copier with its own stream (`dedicated`) or on the executor's.
    pub fn new(device: &Device, dedicated: bool) -> anyhow::Result<Self> {
        let device = cuda_device(device)?;
        let compute = device.cuda_stream();
        let copy = if dedicated { compute.context().new_stream()? } else { compute.clone() };
        Ok(Self { device, copy, compute })
    }

    /// Copies `src` (x then y, `2 * shape.tokens()` u32) to the GPU; returns `x`, `y` and the
    /// copy's device time in ns. On a dedicated stream the executor's stream is made to wait
    /// for the copy's event, so no later kernel reads the data early; `src` records the same
    /// event, so its next writer waits for the copy too.
    pub fn copy(&self, src: &PinnedHostSlice<u32>, shape: BatchShape) -> anyhow::Result<(Tensor, Tensor, u64)> {
        let n = 2 * shape.tokens();
        anyhow::ensure!(src.len() == n, "staging buffer of {} tokens for a micro-batch of {n}", src.len());
        let start = self.copy.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        // SAFETY: every element is written by the copy below before anything reads it.
        let mut dst = unsafe { self.copy.alloc::<u32>(n) }?;
        self.copy.memcpy_htod(src, &mut dst)?;
        let end = self.copy.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        if !Arc::ptr_eq(&self.copy, &self.compute) {
            self.compute.wait(&end)?;
        }
        let storage = CudaStorage::wrap_cuda_slice(dst, self.device.clone());
        let both = Tensor::from_storage(Storage::Cuda(storage), (2, shape.rows, shape.seq_len), BackpropOp::none(), false);
        let (x, y) = (both.get(0)?, both.get(1)?);
        // Waits for the copy on this (the uploader's) thread only, never on the executor's.
        let ms = start.elapsed_ms(&end)?;
        Ok((x, y, (ms as f64 * 1e6) as u64))
    }
}
