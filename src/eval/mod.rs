//! Scoring: the bits-per-byte metric ([`bpb`]), validation as the challenge scores it
//! ([`validation`]), sliding-window scoring ([`sliding`]), score-first test-time training
//! ([`ttt`]), and
//! phased TTT with per-document LoRA ([`phased`]).

pub mod bpb;
pub mod phased;
pub mod sliding;
pub mod ttt;
pub mod validation;
