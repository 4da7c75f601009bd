//! `pipeline`: GPT training as a declarative graph of stages.
//!
//! A config (`pipelines/*.toml`) names stages (`[stages.NAME] kind, impl, inputs, queue`); the
//! runtime runs each on its own thread, joins them with bounded flume channels, measures every
//! stage and channel with latency histograms, and writes a report that names the bottleneck.
//!
//! Module map:
//! - [`config`]: layered config (TOML, `PIPELINE_*` environment, `--set`);
//! - [`graph`]: checks stage tables against the registry and orders them into a [`graph::Plan`];
//! - [`stage`]: the `Source` / `Transform` / `Sink` contract and registry entries;
//! - [`channel`]: instrumented ports on bounded channels (private hot path);
//! - [`runtime`]: threads, stop and abort, occupancy sampling;
//! - [`report`], [`verdict`]: `report.json`, the text table, the bottleneck verdict;
//! - [`run`]: `pipeline run` as a library call;
//! - [`stages`]: the stage implementations (the top-level `stages/` folder).

pub mod artifact;
pub mod attention_auto;
pub mod batch;
pub mod bpb;
pub mod catalog;
pub mod checkpoint;
pub mod clock;
pub mod compare;
pub mod config;
pub mod control;
#[cfg(feature = "cuda")]
pub mod cuda_copy;
pub mod device;
pub mod error;
pub mod files;
pub mod graph;
pub mod inject;
pub mod memory;
pub mod message;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parity;
pub mod phase_clock;
pub mod pool;
pub mod prepare;
pub mod quant;
pub mod registry;
pub mod report;
pub mod run;
pub mod rundir;
pub mod runtime;
pub mod shard;
pub mod snapshot;
pub mod stage;
pub mod staging;
pub mod tokenizer;
pub mod trainer;
pub mod trainlog;
pub mod ttt;
pub mod validation;
pub mod verdict;
pub mod weights;

mod channel;

#[path = "../stages/mod.rs"]
pub mod stages;
