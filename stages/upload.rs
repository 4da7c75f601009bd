//! Kind `upload`: turns staged micro-batches into tensors on the executor's device.
//!
//! - `cpu`: candle CPU tensors, made with one copy out of the staging buffer (which then goes
//!   back to the pin stage's pool).
//! - `sync`: tensors on `run.device`: on a GPU, a copy on the device's (the executor's) stream
//!   that returns when the data is there; on the CPU the same as `cpu`. The `stream` upload (a
//!   dedicated copy stream from page-locked buffers, an event the executor waits on) is the
//!   next step of the `cuda` build.

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
        let x = Tensor::from_slice(&batch.buf[..n], (shape.rows, shape.seq_len), &Device::Cpu)?;
        let y = Tensor::from_slice(&batch.buf[n..2 * n], (shape.rows, shape.seq_len), &Device::Cpu)?;
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
        Ok(Self { device: crate::device::open(ctx.config)? })
    }
    fn process(&mut self, batch: PinnedBatch, out: &mut Emitter<'_, DeviceBatch>, _ctx: &mut Ctx) -> anyhow::Result<()> {
        let t0 = std::time::Instant::now();
        let shape = batch.meta.shape;
        let n = shape.tokens();
        let x = Tensor::from_slice(&batch.buf[..n], (shape.rows, shape.seq_len), &self.device)?;
        let y = Tensor::from_slice(&batch.buf[n..2 * n], (shape.rows, shape.seq_len), &self.device)?;
        let meta = batch.meta.clone();
        drop(batch); // the copy is done: the staging buffer goes back to its pool now
        let upload_ns = t0.elapsed().as_nanos() as u64;
        out.emit(DeviceBatch { meta, x, y, upload_ns })?;
        Ok(())
    }
}
