//! Scoring: the bits-per-byte metric ([`bpb`]) and its byte count checked against the text
//! ([`byte_check`]), validation as the challenge scores it
//! ([`validation`]) on the split's files ([`sidecar`]: CaseOps byte sidecars), sliding-window scoring ([`sliding`]), score-first test-time training
//! ([`ttt`]), and
//! phased TTT with per-document LoRA ([`phased`]), and the legality audit of an evaluation
//! ([`audit`]). They run on either executor ([`executor`]: candle here, the engine in
//! [`crate::train::engine_eval`]).

#[cfg(feature = "tools")]
pub mod audit;
pub mod bpb;
#[cfg(feature = "tools")]
pub mod byte_check;
#[cfg(feature = "candle")]
pub mod candle_model;
pub mod executor;
pub mod lora;
pub mod phased;
pub mod sidecar;
pub mod sliding;
pub mod ttt;
pub mod validation;
