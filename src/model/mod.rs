//! The challenge's baseline GPT (record `2026-03-17_NaiveBaseline`, spec section 3) in
//! candle, on any candle device and float dtype.
//!
//! - [`ModelConfig`]: the `[model]` table; the baseline's values are the defaults.
//! - [`ops`]: the building blocks (RMS norm without weights, RoPE, causal GQA attention, logit
//!   soft-cap, cross-entropy), each small enough to test against a float64 reference.
//! - [`fused`]: the same RMS norm, causal attention and soft-capped cross-entropy as fused,
//!   multi-threaded CPU ops with their own backward passes (the model uses them; they fall back
//!   to [`ops`] on other devices), tested against [`ops`].
//! - [`causal_softmax`], [`norm_rope`], [`embedding`]: ops whose GPU kernels
//!   (`kernels/fused.cu`, launched by `gpu_kernels` in a `cuda` build) replace candle
//!   composites on a GPU; their CPU implementations are the kernels' references, and the fused
//!   CPU ops of [`fused`] have GPU kernels too.
//! - [`Gpt`]: parameters named exactly as the PyTorch script's `GPT.state_dict()`, the spec's
//!   initialisation, and the forward pass to logits, mean loss or per-token losses.

pub mod causal_softmax;
mod config;
pub mod embedding;
pub mod fused;
mod gpt;
#[cfg(feature = "cuda")]
mod gpu_kernels;
mod host;
pub mod norm_rope;
pub mod ops;

pub use config::ModelConfig;
pub use gpt::{Gpt, ParamGroup};
