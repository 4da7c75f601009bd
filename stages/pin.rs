//! Kind `pin`: copies each micro-batch into a staging buffer from a bounded pool, the buffer an
//! upload to the device reads from.
//!
//! - `pageable`: plain host memory. The `pinned` implementation (page-locked memory from the
//!   CUDA driver, which lets copies to the GPU run asynchronously) comes with the `cuda` build
//!   and plugs in here with the same pool.
//!
//! The pool holds `buffers` staging buffers made at build time; a buffer goes back to the pool
//! when the last holder of the batch drops it (after the upload's copy). When all are in use
//! this stage waits: the pool bounds the batches in flight past this point.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::batch::{BatchShape, PinnedBatch, TokenBatch, TokenBuf};
use crate::pool::Pool;
use crate::stage::{BuildCtx, Ctx, Emitter, Transform};

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
    pool: Pool<TokenBuf>,
}

impl Pageable {
    /// Buffers made so far (stays at `buffers`: no allocation per batch).
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
        BatchShape::from_config(ctx.config)?;
        Ok(())
    }
    fn build(p: PinParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        let tokens = 2 * BatchShape::from_config(ctx.config)?.tokens();
        Ok(Self { pool: Pool::new(p.buffers, || vec![0u32; tokens]) })
    }
    fn process(&mut self, batch: TokenBatch, out: &mut Emitter<'_, PinnedBatch>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let n = 2 * batch.meta.shape.tokens();
        let mut buf = self.pool.take(Some(ctx))?;
        anyhow::ensure!(buf.len() >= n, "micro-batch of {n} tokens does not fit the {}-token staging buffers", buf.len());
        buf[..n].copy_from_slice(&batch.buf[..n]);
        let meta = batch.meta.clone();
        drop(batch); // the sampler's buffer goes back to its pool now
        out.emit(PinnedBatch { meta, buf: Arc::new(buf) })?;
        Ok(())
    }
}
