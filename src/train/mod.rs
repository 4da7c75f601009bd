//! Training: the application's config ([`config`]), the loop ([`session`], driven by the
//! `step_executor` stage, with its parameters in [`params`]) with what it needs before it starts ([`requirements`]) and how it
//! continues from a checkpoint ([`resume`]), one optimizer step ([`trainer`] on candle's autograd, [`engine_trainer`] on the explicit engine, both an [`executor::Executor`]), what the session
//! hands on ([`snapshot`]) and its optional step-by-step trace ([`step_trace`]), exact-resume checkpoints ([`checkpoint`]), the challenge-format
//! training log ([`log`]) and `attention = "auto"`'s choice ([`attention_choice`], over the timed
//! trials of [`attention_trial`]).

pub mod attention_choice;
pub mod attention_trial;
pub mod checkpoint;
pub mod config;
pub mod engine_eval;
#[cfg(test)]
pub(crate) mod engine_eval_tests;
pub mod engine_lora;
pub mod engine_trainer;
pub mod executor;
pub mod log;
pub mod params;
pub mod requirements;
pub mod resume;
pub mod session;
pub mod snapshot;
pub mod step_trace;
#[cfg(feature = "candle")]
pub mod trainer;
