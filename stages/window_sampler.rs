//! Kind `window_sampler`: cuts micro-batches `x, y` of shape `(rows, seq_len)` out of the shards
//! the shard reader sends, in a deterministic, resumable order: `sequential` (the baseline's
//! stream) or `shuffled` (the records' loader), the samplers of [`crate::data::sampler`].
//!
//! The stage receives every shard first (the reader's output), then produces micro-batches
//! until the graph stops or `max_steps` steps are done. Reads from the shards happen here, so
//! with `mmap` page-fault time shows up in this stage's service time.
use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{config, resumed};
use crate::data::batch::{BatchMeta, BatchShape, LoaderState, Shard, TokenBatch, TokenBuf};
use crate::data::sampler::{Sampler, SequentialSampler, ShuffledSampler};
use crate::data::shard::ShardFile;
use crate::runtime::pool::Pool;
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};

// ---------------------------------------------------------------------------------------------
// The stage
// ---------------------------------------------------------------------------------------------

/// Parameters of `window_sampler/sequential` and `window_sampler/shuffled`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SamplerParams {
    /// Threads copying rows into a micro-batch (shuffled only; 1 copies on the stage's thread).
    /// The order does not depend on it.
    pub workers: usize,
    /// Micro-batch buffers this stage owns; it waits for one to come back when all are in use.
    pub buffers: usize,
    /// Stop after this many optimizer steps (each `grad_accum_steps` micro-batches); 0 runs
    /// until the graph stops.
    pub max_steps: u64,
    /// Check every token id against the tokenizer's vocabulary size (when `[data] tokenizer` is
    /// set).
    pub check_tokens: bool,
}

impl Default for SamplerParams {
    fn default() -> Self {
        Self { workers: 1, buffers: 4, max_steps: 0, check_tokens: true }
    }
}

/// Which sampler a stage builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Order {
    Sequential,
    Shuffled,
}

/// The stage body shared by both implementations.
pub struct WindowStage {
    order: Order,
    params: SamplerParams,
    shape: BatchShape,
    seed: u64,
    vocab: Option<usize>,
    shards: Vec<Arc<ShardFile>>,
    sampler: Option<Box<dyn Sampler>>,
    pool: Option<Pool<TokenBuf>>,
    /// Where a resumed run's sampler continues.
    resume: Option<LoaderState>,
}

impl WindowStage {
    fn build(order: Order, params: SamplerParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&params)?;
        let shape = config(ctx)?.batch_shape()?;
        let vocab = if params.check_tokens { config(ctx)?.data.tokenizer_vocab()? } else { None };
        let resume = resumed(ctx).and_then(|c| crate::train::resume::loader_for(c, &shape));
        Ok(Self { order, params, shape, seed: ctx.run.seed, vocab, shards: Vec::new(), sampler: None, pool: None, resume })
    }

    fn check(p: &SamplerParams) -> anyhow::Result<()> {
        anyhow::ensure!(p.workers >= 1, "`workers` must be at least 1");
        anyhow::ensure!(p.buffers >= 1, "`buffers` must be at least 1");
        Ok(())
    }

    /// Builds the sampler once every shard has arrived.
    fn start(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.shards.is_empty(), "no shards arrived from the reader");
        self.shards.sort_by_key(|s| s.index);
        let shards = std::mem::take(&mut self.shards);
        if self.order == Order::Sequential && shards.iter().enumerate().any(|(i, s)| s.index != i) {
            anyhow::bail!(
                "the sequential sampler streams every shard, but the reader sent only some (set `rank_shards = false` on the reader)"
            );
        }
        let sampler: Box<dyn Sampler> = match self.order {
            Order::Sequential => Box::new(SequentialSampler::new(shards, self.shape, self.vocab, self.resume.as_ref())?),
            Order::Shuffled => {
                Box::new(ShuffledSampler::new(shards, self.shape, self.vocab, self.seed, self.params.workers, self.resume.as_ref())?)
            }
        };
        let tokens = 2 * self.shape.tokens();
        self.pool = Some(Pool::new(self.params.buffers, || vec![0u32; tokens]));
        self.sampler = Some(sampler);
        Ok(())
    }

    fn next_batch(&mut self, ctx: &mut Ctx) -> anyhow::Result<Option<TokenBatch>> {
        if self.sampler.is_none() {
            self.start()?;
        }
        let sampler = self.sampler.as_mut().expect("started above");
        let shape = sampler.shape();
        let done = sampler.state().micro_batches();
        if self.params.max_steps > 0 && done >= self.params.max_steps * shape.micro_steps as u64 {
            return Ok(None);
        }
        let pool = self.pool.as_ref().expect("made with the sampler");
        let mut buf = pool.take(Some(ctx))?;
        let fingerprint = sampler.fill(&mut buf)?;
        let state = sampler.state();
        let rolling = match &state {
            LoaderState::Sequential { rolling, .. } | LoaderState::Shuffled { rolling, .. } => *rolling,
        };
        let meta = BatchMeta {
            step: done / shape.micro_steps as u64,
            micro: (done % shape.micro_steps as u64) as u32,
            shape,
            fingerprint,
            rolling,
            state: Arc::new(state),
        };
        Ok(Some(TokenBatch { meta, buf: Arc::new(buf) }))
    }
}

macro_rules! sampler_impl {
    ($ty:ident, $name:literal, $order:expr, $doc:literal) => {
        #[doc = $doc]
        pub struct $ty(WindowStage);

        impl Transform for $ty {
            const KIND: &'static str = "window_sampler";
            const IMPL: &'static str = $name;
            const DOC: &'static str = $doc;
            type Params = SamplerParams;
            type In = Shard;
            type Out = TokenBatch;

            fn check(p: &SamplerParams, ctx: &BuildCtx) -> anyhow::Result<()> {
                WindowStage::check(p)?;
                config(ctx)?.batch_shape()?;
                if p.check_tokens {
                    config(ctx)?.data.tokenizer_vocab()?;
                }
                Ok(())
            }
            fn build(p: SamplerParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
                Ok(Self(WindowStage::build($order, p, ctx)?))
            }
            fn process(&mut self, shard: Shard, _out: &mut Emitter<'_, TokenBatch>, _ctx: &mut Ctx) -> anyhow::Result<()> {
                self.0.shards.push(shard.0);
                Ok(())
            }
            fn produce(&mut self, ctx: &mut Ctx) -> anyhow::Result<Option<TokenBatch>> {
                self.0.next_batch(ctx)
            }
        }
    };
}

sampler_impl!(
    Sequential,
    "sequential",
    Order::Sequential,
    "The baseline's contiguous token stream over all shards (same windows as the reference loader)."
);
sampler_impl!(
    Shuffled,
    "shuffled",
    Order::Shuffled,
    "The records' shuffled sequences: random phase and permutation per shard epoch, shards picked by what they have left."
);
