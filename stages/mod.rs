//! Stage implementations, one file per stage kind, each implementation a type beside its
//! siblings, all registered in [`REGISTRY`].
//!
//! This folder is compiled as the `stages` module of the `pipeline` crate (a `#[path]` module
//! declared in `src/lib.rs`), so stages use the runtime through `crate::`.
//!
//! Adding an implementation: write a type implementing `Source`, `Transform` or `Sink` (see
//! `crate::runtime::stage`) in its kind's file, then add one line below. The first implementation of a
//! kind is the kind's default when a config leaves out `impl`.

use crate::runtime::stage::{SinkImpl, SourceImpl, StageFactory, TransformImpl};

pub mod artifact;
pub mod checkpoint;
pub mod delay;
pub mod drain;
pub mod ema_swa;
pub mod pin;
pub mod shard_reader;
pub mod step_executor;
pub mod synthetic;
pub mod ttt_eval;
pub mod upload;
pub mod window_sampler;

/// Every stage implementation, in the order `pipeline stages` lists them.
pub static REGISTRY: &[&dyn StageFactory] = &[
    &SourceImpl::<synthetic::Blobs>::new(),
    &TransformImpl::<delay::Sleep>::new(),
    &TransformImpl::<delay::Spin>::new(),
    &SinkImpl::<drain::Count>::new(),
    &SinkImpl::<drain::Batches>::new(),
    &SourceImpl::<shard_reader::Mmap>::new(),
    &SourceImpl::<shard_reader::Pread>::new(),
    &TransformImpl::<window_sampler::Shuffled>::new(),
    &TransformImpl::<window_sampler::Sequential>::new(),
    &TransformImpl::<pin::Pageable>::new(),
    &TransformImpl::<pin::Pinned>::new(),
    &TransformImpl::<upload::Cpu>::new(),
    &TransformImpl::<upload::OnDevice>::new(),
    &TransformImpl::<upload::CopyStream>::new(),
    &TransformImpl::<step_executor::Candle>::new(),
    &TransformImpl::<ema_swa::Ema>::new(),
    &TransformImpl::<ema_swa::Swa>::new(),
    &TransformImpl::<ema_swa::Passthrough>::new(),
    &TransformImpl::<checkpoint::Atomic>::new(),
    &TransformImpl::<artifact::Quantize>::new(),
    &SinkImpl::<ttt_eval::ScoreFirst>::new(),
    &SinkImpl::<ttt_eval::Sliding>::new(),
];
