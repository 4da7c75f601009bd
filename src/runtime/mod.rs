//! The ground floor: runs a graph of stages and measures it, knowing nothing of what the stages
//! compute (no GPT, no tokens, no tensors).
//!
//! - [`config`]: layered config (TOML, `PIPELINE_*` environment, `--set`): the `[run]` table
//!   and the raw `[stages.NAME]` tables; other top-level tables belong to the areas above.
//! - [`stage`]: the `Source` / `Transform` / `Sink` contract, build context and extensions;
//!   [`driver`]: the registry entries made from them and the loops that drive them;
//!   [`registry`]: a list of stage implementations, passed into the planner.
//! - [`graph`]: checks stage tables against a registry and orders them into a [`graph::Plan`].
//! - [`exec`]: threads, stop and abort, occupancy sampling; [`trace`]: the per-item trace;
//!   [`channel`]: instrumented ports on bounded channels (private hot path); [`control`],
//!   [`clock`], [`metrics`].
//! - [`message`], [`pool`]: what travels on channels and reusable buffers.
//! - [`memory`]: a run's memory estimate against its budget; [`inject`]: slowdown and fault
//!   injection; [`catalog`]: `pipeline stages`.
//! - [`error`], [`files`], [`rundir`]: config errors, user-named files, run directories;
//!   [`build_info`]: which build of the binary is running (its features, its profile).

pub mod build_info;
pub mod catalog;
mod channel;
pub mod clock;
pub mod config;
pub mod console;
pub mod control;
pub mod driver;
pub mod error;
pub mod exec;
pub mod files;
pub mod graph;
pub mod inject;
pub mod memory;
pub mod message;
pub mod metrics;
pub mod pool;
pub mod registry;
pub mod rundir;
pub mod stage;
pub mod trace;
