//! Kind `window_sampler`: cuts micro-batches `x, y` of shape `(rows, seq_len)` out of the shards
//! the shard reader sends, in a deterministic, resumable order: `sequential` (the baseline's
//! stream) or `shuffled` (the records' loader), the samplers of [`crate::data::sampler`]; or
//! `packed_docs` (the 04-27 record's document packing, [`crate::data::packed`]): one row of
//! all the micro-batch's tokens, its documents kept apart by the model's attention.
//!
//! The stage receives every shard first (the reader's output), then produces micro-batches
//! until the graph stops or `max_steps` steps are done. Reads from the shards happen here, so
//! with `mmap` page-fault time shows up in this stage's service time.
use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{config, resumed};
use crate::data::batch::{BatchMeta, BatchShape, LoaderState, Shard, TokenBatch, TokenBuf};
use crate::data::packed::PackedSampler;
use crate::data::sampler::{Sampler, SequentialSampler, ShuffledSampler};
use crate::data::shard::ShardFile;
use crate::runtime::pool::Pool;
use crate::runtime::stage::{BuildCtx, Ctx, Emitter, Transform};

// ---------------------------------------------------------------------------------------------
// The stage
// ---------------------------------------------------------------------------------------------

/// Parameters of `window_sampler/sequential`, `window_sampler/shuffled` and
/// `window_sampler/packed_docs`.
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
    Packed,
}

/// The stage body shared by both implementations.
pub struct WindowStage {
    order: Order,
    params: SamplerParams,
    shape: BatchShape,
    seed: u64,
    vocab: Option<usize>,
    /// The token that starts a document (`model.bos_id`: `packed_docs` starts each shard at it).
    bos: u32,
    shards: Vec<Arc<ShardFile>>,
    sampler: Option<Box<dyn Sampler>>,
    pool: Option<Pool<TokenBuf>>,
    /// Where a resumed run's sampler continues.
    resume: Option<LoaderState>,
}

impl WindowStage {
    fn build(order: Order, params: SamplerParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&params)?;
        let c = config(ctx)?;
        if order == Order::Packed {
            packed_check(c)?;
        }
        let shape = c.train_shape()?;
        let vocab = if params.check_tokens { c.data.tokenizer_vocab()? } else { None };
        let resume = resumed(ctx).and_then(|ck| crate::train::resume::loader_for(ck, &shape));
        let bos = c.model.bos_id;
        Ok(Self { order, params, shape, seed: ctx.run.seed, vocab, bos, shards: Vec::new(), sampler: None, pool: None, resume })
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
        if self.order != Order::Shuffled && shards.iter().enumerate().any(|(i, s)| s.index != i) {
            anyhow::bail!(
                "the {} sampler streams every shard, but the reader sent only some (set `rank_shards = false` on the reader)",
                if self.order == Order::Packed { "packed_docs" } else { "sequential" }
            );
        }
        let sampler: Box<dyn Sampler> = match self.order {
            Order::Sequential => Box::new(SequentialSampler::new(shards, self.shape, self.vocab, self.resume.as_ref())?),
            Order::Shuffled => {
                Box::new(ShuffledSampler::new(shards, self.shape, self.vocab, self.seed, self.params.workers, self.resume.as_ref())?)
            }
            Order::Packed => Box::new(PackedSampler::new(shards, self.shape, self.vocab, self.bos, self.resume.as_ref())?),
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
            LoaderState::Sequential { rolling, .. } | LoaderState::Shuffled { rolling, .. } | LoaderState::Packed { rolling, .. } => {
                *rolling
            }
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
                if $order == Order::Packed {
                    packed_check(config(ctx)?)?;
                }
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

/// What `packed_docs` needs of the model: its documents cut as the record's loader cuts them,
/// unless attention spans the whole row on purpose.
fn packed_check(c: &crate::train::config::Config) -> anyhow::Result<()> {
    let m = &c.model;
    anyhow::ensure!(
        !m.document_attention || m.document_max_len > 0,
        "`model.document_max_len` is 0: under `packed_docs` a document would be attended whole across the micro-batch's one row of {} tokens; the record's loader cuts at its training length: set `model.document_max_len = {}` (`train.seq_len`), or larger on purpose",
        c.batch_shape()?.tokens(),
        c.train.seq_len
    );
    Ok(())
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
sampler_impl!(
    PackedDocs,
    "packed_docs",
    Order::Packed,
    "The 04-27 record's document packing: one row of the micro-batch's tokens straight through the shards from a BOS, documents kept apart by attention (model.document_attention, cut every model.document_max_len)."
);
