//! Stage implementations, one file per stage kind, each implementation a type beside its
//! siblings, all registered in [`REGISTRY`].
//!
//! This folder is compiled as the `stages` module of the `pipeline` crate (a `#[path]` module
//! declared in `src/lib.rs`), so stages use the runtime through `crate::`.
//!
//! Adding an implementation: write a type implementing `Source`, `Transform` or `Sink` (see
//! `crate::stage`) in its kind's file, then add one line below. The first implementation of a
//! kind is the kind's default when a config leaves out `impl`.

use crate::stage::{SinkImpl, SourceImpl, StageFactory, TransformImpl};

pub mod delay;
pub mod drain;
pub mod pin;
pub mod shard_reader;
pub mod step_executor;
pub mod synthetic;
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
    &TransformImpl::<upload::Cpu>::new(),
    &SinkImpl::<step_executor::Candle>::new(),
];
