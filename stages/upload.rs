//! Kind `upload`: turns staged micro-batches into tensors on the executor's device.
//!
//! - `cpu`: candle CPU tensors, made with one copy out of the staging buffer (which then goes
//!   back to the pin stage's pool).
//! - `sync`: tensors on `run.device`: on a GPU, a copy on the device's (the executor's) stream
//!   (from page-locked buffers after `pin/pinned`, timed with CUDA events); on the CPU the same
//!   as `cpu`.
//! - `stream` (`cuda` build, after `pin/pinned`): the copy runs on the stage's own CUDA stream;
//!   an event recorded after it is what the executor's stream waits on, so the copy of the next
//!   micro-batch overlaps the current step. `upload_ns` is the copy's device time (CUDA events).

use candle_core::{Device, Tensor};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::batch::{DeviceBatch, PinnedBatch};
use crate::stage::{BuildCtx, Ctx, Emitter, Transform};

/// Parameters of `upload/cpu` (none).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CpuParams {}

/// `upload/cpu`.
pub struct Cpu;

impl Transform for Cpu {
    const KIND: &'static str = "upload";
    const IMPL: &'static str = "cpu";
    const DOC: &'static str = "Makes candle CPU tensors x, y from the staging buffer (one copy).";
    type Params = CpuParams;
    type In = PinnedBatch;
    type Out = DeviceBatch;

    fn build(_p: CpuParams, _ctx: &BuildCtx) -> anyhow::Result<Self> {
        Ok(Self)
    }
    fn process(&mut self, batch: PinnedBatch, out: &mut Emitter<'_, DeviceBatch>, _ctx: &mut Ctx) -> anyhow::Result<()> {
        let t0 = std::time::Instant::now();
        let shape = batch.meta.shape;
        let n = shape.tokens();
        let buf = batch.buf.as_slice()?;
        let x = Tensor::from_slice(&buf[..n], (shape.rows, shape.seq_len), &Device::Cpu)?;
        let y = Tensor::from_slice(&buf[n..2 * n], (shape.rows, shape.seq_len), &Device::Cpu)?;
        let meta = batch.meta.clone();
        drop(batch); // the staging buffer goes back to its pool now
        let upload_ns = t0.elapsed().as_nanos() as u64;
        out.emit(DeviceBatch { meta, x, y, upload_ns })?;
        Ok(())
    }
}

/// Parameters of `upload/sync` (none).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SyncParams {}

/// `upload/sync`.
pub struct OnDevice {
    device: Device,
    /// Copies from page-locked buffers on the executor's stream.
    #[cfg(feature = "cuda")]
    copier: Option<crate::cuda_copy::Copier>,
}

impl Transform for OnDevice {
    const KIND: &'static str = "upload";
    const IMPL: &'static str = "sync";
    const DOC: &'static str = "Copies x, y onto `run.device` on the executor's stream (synchronous; on the CPU the same as `cpu`).";
    type Params = SyncParams;
    type In = PinnedBatch;
    type Out = DeviceBatch;

    fn check(_p: &SyncParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        crate::device::parse(&ctx.config.run.device)?;
        Ok(())
    }
    fn build(_p: SyncParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        let device = crate::device::open(ctx.config)?;
        #[cfg(feature = "cuda")]
        let copier = if device.is_cuda() { Some(crate::cuda_copy::Copier::new(&device, false)?) } else { None };
        Ok(Self {
            device,
            #[cfg(feature = "cuda")]
            copier,
        })
    }
    fn process(&mut self, batch: PinnedBatch, out: &mut Emitter<'_, DeviceBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let t0 = std::time::Instant::now();
        let shape = batch.meta.shape;
        #[cfg(feature = "cuda")]
        if let (Some(c), crate::staging::Staging::Pinned(src)) = (&self.copier, &**batch.buf) {
            let (x, y, upload_ns) = c.copy(src, shape)?;
            ctx.record("copy_event", upload_ns);
            let meta = batch.meta.clone();
            drop(batch);
            out.emit(DeviceBatch { meta, x, y, upload_ns })?;
            return Ok(());
        }
        let n = shape.tokens();
        let buf = batch.buf.as_slice()?;
        let x = Tensor::from_slice(&buf[..n], (shape.rows, shape.seq_len), &self.device)?;
        let y = Tensor::from_slice(&buf[n..2 * n], (shape.rows, shape.seq_len), &self.device)?;
        let meta = batch.meta.clone();
        drop(batch); // the copy is done: the staging buffer goes back to its pool now
        let upload_ns = t0.elapsed().as_nanos() as u64;
        let _ = &ctx;
        out.emit(DeviceBatch { meta, x, y, upload_ns })?;
        Ok(())
    }
}

/// Parameters of `upload/stream` (none).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StreamParams {}

/// `upload/stream`.
pub struct CopyStream {
    #[cfg(feature = "cuda")]
    copier: crate::cuda_copy::Copier,
}

impl Transform for CopyStream {
    const KIND: &'static str = "upload";
    const IMPL: &'static str = "stream";
    const DOC: &'static str =
        "Copies x, y from page-locked buffers on its own CUDA stream; the executor's stream waits on the copy's event (cuda build).";
    type Params = StreamParams;
    type In = PinnedBatch;
    type Out = DeviceBatch;

    fn check(_p: &StreamParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        crate::device::require_gpu(ctx.config, "`upload/stream` (a CUDA copy stream)", "`impl = \"cpu\"` or `\"sync\"`")?;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn build(p: StreamParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        Ok(Self { copier: crate::cuda_copy::Copier::new(&crate::device::open(ctx.config)?, true)? })
    }

    #[cfg(not(feature = "cuda"))]
    fn build(p: StreamParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        anyhow::bail!("`upload/stream` needs the `cuda` build")
    }

    #[cfg(feature = "cuda")]
    fn process(&mut self, batch: PinnedBatch, out: &mut Emitter<'_, DeviceBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let crate::staging::Staging::Pinned(src) = &**batch.buf else {
            anyhow::bail!("`upload/stream` copies from page-locked buffers: use `pin/pinned` before it");
        };
        let (x, y, upload_ns) = self.copier.copy(src, batch.meta.shape)?;
        ctx.record("copy_event", upload_ns);
        let meta = batch.meta.clone();
        // The buffer may go back to the pool now: its next writer waits for this copy's event.
        drop(batch);
        out.emit(DeviceBatch { meta, x, y, upload_ns })?;
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn process(&mut self, _batch: PinnedBatch, _out: &mut Emitter<'_, DeviceBatch>, _ctx: &mut Ctx) -> anyhow::Result<()> {
        anyhow::bail!("`upload/stream` needs the `cuda` build")
    }
}
