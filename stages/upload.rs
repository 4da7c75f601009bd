//! Kind `upload`: turns staged micro-batches into tensors on the executor's device.
//!
//! - `cpu`: candle CPU tensors, made with one copy out of the staging buffer (which then goes
//!   back to the pin stage's pool). The CUDA implementations (`sync`: copy on the executor's
//!   stream; `stream`: copy on a dedicated stream with an event the executor waits on) come with
//!   the `cuda` build.

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
