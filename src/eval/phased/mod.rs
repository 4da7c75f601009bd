//! Phased TTT, the test-time training of the records since PR #1626 (record spec §5): the
//! validation stream cut into documents, each scored chunk by chunk with its own LoRA adapters
//! trained on the chunks already scored, and after a prefix of documents the base model itself
//! trained with SGD on the documents scored so far, in phases.
//!
//! - [`run`]: the loop ([`phased_ttt`]): batches of documents, the chunk loop, the pauses;
//! - [`global`]: a phase's global SGD on the base model, attention kept inside documents;
//! - [`docs`]: the documents, the work queue, each document's chunks and the phase boundaries;
//! - [`config`]: the settings and their checks; [`progress`]: the `ttp:` line.

pub mod config;
pub mod docs;
pub mod global;
pub mod progress;
pub mod run;
#[cfg(test)]
mod tests;

pub use config::PhasedConfig;
pub use run::{PhaseReport, PhasedEvent, PhasedOutcome, PhasedTimes, phased_ttt};
