//! Kind `pin`: copies each micro-batch into a staging buffer from a bounded pool, the buffer an
//! upload to the device reads from.
//!
//! - `pageable`: plain host memory.
//! - `pinned`: page-locked memory from the CUDA driver (`cuda` build, `run.device` = "cuda:N"),
//!   which lets `upload/stream` copy to the GPU asynchronously. A buffer back in the pool is
//!   written again only after its last copy completed (its CUDA event).
//!
//! The pool holds `buffers` staging buffers made at build time; a buffer goes back to the pool
//! when the last holder of the batch drops it (after the upload's copy). When all are in use
//! this stage waits: the pool bounds the batches in flight past this point.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::config;
use crate::data::batch::{PinnedBatch, TokenBatch};
use crate::data::staging::Staging;
use crate::runtime::pool::Pool;
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};

/// Parameters of `pin/pageable`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PinParams {
    /// Staging buffers in the pool (each holds one micro-batch's x and y).
    pub buffers: usize,
}

impl Default for PinParams {
    fn default() -> Self {
        Self { buffers: 4 }
    }
}

/// `pin/pageable`.
pub struct Pageable {
    pool: Pool<Staging>,
}

impl Pageable {
    /// Buffers made so far (stays at `buffers`: no allocation per batch).
    #[cfg(feature = "tools")]
    pub fn buffers_made(&self) -> usize {
        self.pool.made()
    }
}

impl Transform for Pageable {
    const KIND: &'static str = "pin";
    const IMPL: &'static str = "pageable";
    const DOC: &'static str = "Copies each micro-batch into a staging buffer from a fixed pool of plain host memory.";
    type Params = PinParams;
    type In = TokenBatch;
    type Out = PinnedBatch;

    fn check(p: &PinParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        anyhow::ensure!(p.buffers >= 1, "`buffers` must be at least 1");
        config(ctx)?.batch_shape()?;
        Ok(())
    }
    fn build(p: PinParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        let tokens = 2 * config(ctx)?.batch_shape()?.tokens();
        Ok(Self { pool: Pool::new(p.buffers, || Staging::Host(vec![0u32; tokens])) })
    }
    fn process(&mut self, batch: TokenBatch, out: &mut Emitter<'_, PinnedBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        stage(&self.pool, batch, out, ctx)
    }
}

/// Copies `batch` into a buffer of `pool` and emits it.
fn stage(pool: &Pool<Staging>, batch: TokenBatch, out: &mut Emitter<'_, PinnedBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
    let n = 2 * batch.meta.shape.tokens();
    let mut buf = pool.take(Some(ctx))?;
    let dst = buf.as_mut_slice()?;
    anyhow::ensure!(dst.len() >= n, "micro-batch of {n} tokens does not fit the {}-token staging buffers", dst.len());
    dst[..n].copy_from_slice(&batch.buf[..n]);
    let meta = batch.meta.clone();
    drop(batch); // the sampler's buffer goes back to its pool now
    out.emit(PinnedBatch { meta, buf: Arc::new(buf) })?;
    Ok(())
}

/// `pin/pinned`.
pub struct Pinned {
    pool: Pool<Staging>,
}

impl Transform for Pinned {
    const KIND: &'static str = "pin";
    const IMPL: &'static str = "pinned";
    const DOC: &'static str =
        "Copies each micro-batch into page-locked (pinned) buffers from a fixed pool, for asynchronous copies to the GPU (cuda build).";
    type Params = PinParams;
    type In = TokenBatch;
    type Out = PinnedBatch;

    fn check(p: &PinParams, ctx: &BuildCtx) -> anyhow::Result<()> {
        Pageable::check(p, ctx)?;
        crate::device::require_gpu(ctx.run, "`pin/pinned` (page-locked memory)", "`impl = \"pageable\"`")?;
        Ok(())
    }

    fn build(p: PinParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        let tokens = 2 * config(ctx)?.batch_shape()?.tokens();
        let device = crate::device::open(ctx.run)?;
        let mut made = crate::device::cuda_copy::pinned_buffers(&device, p.buffers, tokens)?;
        Ok(Self { pool: Pool::new(p.buffers, || Staging::Pinned(made.pop().expect("one buffer per pool slot"))) })
    }

    fn process(&mut self, batch: TokenBatch, out: &mut Emitter<'_, PinnedBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        stage(&self.pool, batch, out, ctx)
    }
}
