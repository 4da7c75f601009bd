//! Scoring: the bits-per-byte metric ([`bpb`]), validation as the challenge scores it
//! ([`validation`]), and sliding-window scoring with score-first test-time training ([`ttt`]).

pub mod bpb;
pub mod ttt;
pub mod validation;
