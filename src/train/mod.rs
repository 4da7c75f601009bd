//! Training: one optimizer step ([`trainer`]), the optimizers and schedules ([`optim`]), what
//! the step executor hands on ([`snapshot`]), exact-resume checkpoints ([`checkpoint`]), the
//! challenge-format training log ([`log`]) and `attention = "auto"`'s choice
//! ([`attention_choice`]).

pub mod attention_choice;
pub mod checkpoint;
pub mod config;
pub mod log;
pub mod optim;
pub mod snapshot;
pub mod trainer;
