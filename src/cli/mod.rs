//! The commands of the `pipeline` binary as library calls: `src/main.rs` parses arguments and
//! prints; what a command does lives here.

pub mod run;
