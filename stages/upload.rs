//! Kind `upload`: turns staged micro-batches into tensors on the executor's device.
//!
//! - `cpu`: candle CPU tensors, made with one copy out of the staging buffer (which then goes
//!   back to the pin stage's pool).
//! - `sync`: tensors on `run.device`: on a GPU, a copy queued on the device's (the executor's)
//!   stream, in line with its kernels (from page-locked buffers after `pin/pinned`, timed with
//!   CUDA events); on the CPU the same as `cpu`.
//! - `stream` (`cuda` build, after `pin/pinned`): the copy runs on the stage's own CUDA stream;
//!   the executor's stream waits for the copy's event, so the copy of the next micro-batch
//!   overlaps the current step.
//!
//! On a GPU neither waits for the device: a copy is queued and its batch emitted at once (see
//! [`crate::device::cuda_copy`]). Copy times (CUDA events, histogram `copy_event`) are read once the copy
//! has completed, so a batch's `upload_ns` is the device time of the copies that completed since
//! the previous batch was emitted (usually its predecessors'); the rest are read at the end.

use candle_core::{Device, Tensor};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::data::batch::{DeviceBatch, PinnedBatch};
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};

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
        out.emit(copy_to(batch, &Device::Cpu)?)?;
        Ok(())
    }
}

/// `x`, `y` of `batch` as tensors on `device`, made with one copy each out of the staging
/// buffer, which goes back to its pool once they exist.
fn copy_to(batch: PinnedBatch, device: &Device) -> anyhow::Result<DeviceBatch> {
    let t0 = std::time::Instant::now();
    let shape = batch.meta.shape;
    let n = shape.tokens();
    let buf = batch.buf.as_slice()?;
    let x = Tensor::from_slice(&buf[..n], (shape.rows, shape.seq_len), device)?;
    let y = Tensor::from_slice(&buf[n..2 * n], (shape.rows, shape.seq_len), device)?;
    Ok(DeviceBatch { meta: batch.meta.clone(), x, y, upload_ns: t0.elapsed().as_nanos() as u64 })
}

/// `x`, `y` of `batch` copied from its page-locked buffer by `copier`; `upload_ns` is the device
/// time of the copies that completed meanwhile (each also in the `copy_event` histogram). The
/// buffer may go back to its pool at once: its next writer waits for this copy's event.
fn copy_pinned(copier: &mut crate::device::cuda_copy::Copier, batch: PinnedBatch, ctx: &mut Ctx) -> anyhow::Result<DeviceBatch> {
    let crate::data::staging::Staging::Pinned(src) = &**batch.buf else {
        anyhow::bail!("a CUDA copy stream copies from page-locked buffers: use `pin/pinned` before it");
    };
    let (x, y) = copier.copy(src, batch.meta.shape.rows, batch.meta.shape.seq_len)?;
    let upload_ns = record_copies(copier.finished()?, ctx);
    Ok(DeviceBatch { meta: batch.meta.clone(), x, y, upload_ns })
}

/// Records each copy time (ns) in the `copy_event` histogram; returns their sum.
fn record_copies(times: Vec<u64>, ctx: &mut Ctx) -> u64 {
    times.into_iter().inspect(|&ns| ctx.record("copy_event", ns)).sum()
}

/// Parameters of `upload/sync` (none).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SyncParams {}

/// `upload/sync`.
pub struct OnDevice {
    device: Device,
    /// Copies from page-locked buffers on the executor's stream.
    copier: Option<crate::device::cuda_copy::Copier>,
}

impl Transform for OnDevice {
    const KIND: &'static str = "upload";
    const IMPL: &'static str = "sync";
    const DOC: &'static str =
        "Copies x, y onto `run.device`, queued on the executor's stream in line with its kernels (on the CPU the same as `cpu`).";
    type Params = SyncParams;
    type In = PinnedBatch;
    type Out = DeviceBatch;

    fn check(_p: &SyncParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        crate::device::parse(&ctx.run.device)?;
        Ok(())
    }
    fn build(_p: SyncParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        let device = crate::device::open(ctx.run)?;
        let copier = if device.is_cuda() { Some(crate::device::cuda_copy::Copier::new(&device, false)?) } else { None };
        Ok(Self { device, copier })
    }
    fn process(&mut self, batch: PinnedBatch, out: &mut Emitter<'_, DeviceBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        if let Some(c) = &mut self.copier
            && batch.buf.is_pinned()
        {
            out.emit(copy_pinned(c, batch, ctx)?)?;
            return Ok(());
        }
        out.emit(copy_to(batch, &self.device)?)?;
        Ok(())
    }
    fn flush(&mut self, _out: &mut Emitter<'_, DeviceBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        if let Some(c) = &mut self.copier {
            record_copies(c.drain()?, ctx);
        }
        Ok(())
    }
}

/// Parameters of `upload/stream` (none).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StreamParams {}

/// `upload/stream`.
pub struct CopyStream {
    copier: crate::device::cuda_copy::Copier,
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
        crate::device::require_gpu(ctx.run, "`upload/stream` (a CUDA copy stream)", "`impl = \"cpu\"` or `\"sync\"`")?;
        Ok(())
    }

    fn build(p: StreamParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        Ok(Self { copier: crate::device::cuda_copy::Copier::new(&crate::device::open(ctx.run)?, true)? })
    }

    fn process(&mut self, batch: PinnedBatch, out: &mut Emitter<'_, DeviceBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        out.emit(copy_pinned(&mut self.copier, batch, ctx)?)?;
        Ok(())
    }

    fn flush(&mut self, _out: &mut Emitter<'_, DeviceBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        record_copies(self.copier.drain()?, ctx);
        Ok(())
    }
}
