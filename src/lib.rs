//! `pipeline`: GPT training as a declarative graph of stages.
//!
//! A config (`pipelines/*.toml`) names stages (`[stages.NAME] kind, impl, inputs, queue`); the
//! runtime runs each on its own thread, joins them with bounded flume channels, measures every
//! stage and channel with latency histograms, and writes a report that names the bottleneck.
//!
//! The crate is in areas, each a folder, each knowing only the areas listed before it
//! (`tests/layering.rs` checks it):
//! - [`runtime`]: the stage contract, the graph planner, channels, control, metrics, run
//!   directories, the `[run]` config and raw stage tables. It knows no GPT.
//! - [`report`]: `report.json`, the text table and the bottleneck verdict.
//! - [`device`]: which device a run names, and everything CUDA-specific behind one API.
//! - [`dist`]: data parallelism's collectives (MPI on CPU ranks, NCCL on GPU ranks) behind one
//!   trait, and where a rank stands (its launcher's environment).
//! - [`data`]: shards, tokenizer, batches and the loader state, staging buffers.
//! - [`model`]: the GPT, its ops (one file each: reference, CPU kernel, GPU launch).
//! - [`optim`]: Muon, Adam and SGD over candle variables, and the LR schedule.
//! - [`engine`]: the explicit training engine: forward and hand-written backward over one
//!   arena, behind a backend trait (CPU backends in f64 and f32).
//! - [`eval`]: validation, bits per byte, sliding-window scoring and test-time training.
//! - [`train`]: the application's config (`[train]` with the other tables), the training
//!   session (the loop), trainer, snapshots, checkpoints and the training log.
//! - [`artifact`]: weights files, quantization and the compressed artifact.
//! - [`check`]: device-against-CPU parity and the error measures it uses.
//! - [`stages`]: the stage implementations (the top-level `stages/` folder), thin adapters of
//!   the areas above to the stage contract, and their registry.
//! - [`cli`]: the commands of the `pipeline` binary as library calls.

pub mod runtime;

pub mod report;

pub mod device;

pub mod dist;

pub mod data;

pub mod model;

pub mod optim;

pub mod engine;

pub mod eval;

pub mod train;

pub mod artifact;

#[cfg(feature = "tools")]
pub mod check;

#[path = "../stages/mod.rs"]
pub mod stages;

pub mod cli;
