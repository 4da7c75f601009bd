//! The challenge's baseline GPT (record `2026-03-17_NaiveBaseline`, spec section 3) and the
//! 04-09 record's elements (spec 4.3), each a switch, in candle, on any candle device and float
//! dtype.
//!
//! # Map of this folder
//!
//! The model, from the top:
//!
//! - [`config`]: [`ModelConfig`], the `[model]` table (the baseline's values are the defaults).
//! - [`gpt`]: [`Gpt`]: parameters named exactly as the PyTorch script's `GPT.state_dict()`, the
//!   spec's initialisation, optimizer groups ([`ParamGroup`]), loading and reading them.
//! - With the feature `candle` (the candle executor): `forward`, the forward pass's assembly
//!   on candle's autograd (embedding, the U-Net of blocks with skips, the output head, the
//!   loss), and `block`, `attention`, `mlp`: one transformer block and its two sublayers, each
//!   written once.
//! - [`observe`]: watching the inputs of a pass's matrix products (GPTQ's calibration).
//! - [`lora`]: per-document LoRA adapters a pass may carry ([`PassExtras`]; test-time
//!   training), attached in [`attention`], [`mlp`] and the head.
//! - [`formulation`]: how one forward pass computes (chosen once per pass from the device,
//!   the parameters' dtype and the matmul dtype, see [`gpu_path`]): the products, the dtype of
//!   the activations, the norm into a product, and the attention kernel.
//!
//! The ops, and what runs them:
//!
//! - [`ops`]: one file per op (RMS norm, QK norm + RoPE, attention, soft-capped cross-entropy,
//!   the residual adds and mix, relu², embedding, casts, ...), each with its maths, its
//!   reference formulation, its CPU kernel, its GPU launch and its tests.
//! - [`host`]: what the CPU kernels share (the engine's CPU backend runs them too): SIMD
//!   helpers and their AVX2 dispatch, row access,
//!   storage conversions.
//! - `cuda` (`cuda` builds only): the launches of `kernels/fused.cu`.
//! - [`flash_attn`]: which attention kernel a GPU run takes ([`flash_attn::Attention`],
//!   [`flash_attn::FlashKernels`], [`flash_attn::unsupported`]) and, in `cuda` builds, its op
//!   and launches (`attention = "auto"`'s timed trial of the flash implementations is
//!   `train::attention_trial`'s).
//! - `init`: the initial values (uniform, normal, orthogonal) from one seeded generator.
//! - [`memory`]: what a model takes in memory, from its shapes alone; [`weights`]: state-dict
//!   files (safetensors with the script's names); [`compare`]: error measures against a
//!   reference (the ops' tests, the attention trial, `pipeline parity`).
//!
//! # Where the record's elements live
//!
//! Each of the 04-09 record's elements is a switch in [`ModelConfig`] (checked there, its
//! parameters in `ModelConfig::param_shapes` and [`Gpt::new`]), read where the element lives,
//! and written again from its formula in `reference.rs` (tests only):
//!
//! - parallel residuals, `ln_scale`: [`block`];
//! - partial RoPE (`rope_dims`, NTK rescale), QK gain: [`attention`] and the op
//!   [`ops::qk_norm_rope`] (its tables from [`ops::rope`]); XSA: [`attention`] and [`ops::xsa`];
//! - LeakyReLU²: [`mlp`] and [`ops::leaky_relu_sq`];
//! - depth recurrence (the virtual layer sequence) and gated skips: the U-Net loop of the
//!   forward assembly (`forward`), with the layer order from `ModelConfig::layer_sequence`;
//! - orthogonal init: `init.rs`.
//!
//! Every element is a row of the table [`elements::ELEMENTS`] (its keys, how to turn it on),
//! which the engine's test against this model walks (docs/architecture.md, "Where a model
//! element plugs in").
//!
//! A new op gets its own file in [`ops`] with the same parts as the others, its device maths in
//! `kernels/ops/<op>.cuh`, and an entry point in `kernels/fused.cu` launched through
//! `cuda::fused`.

#[cfg(feature = "candle")]
mod attention;
pub mod banks;
#[cfg(feature = "candle")]
mod block;
pub mod compare;
mod config;
#[cfg(all(feature = "cuda", feature = "candle"))]
mod cuda;
pub mod elements;
#[cfg(test)]
mod extras_tests;
pub mod flash_attn;
#[cfg(feature = "candle")]
mod formulation;
#[cfg(feature = "candle")]
mod forward;
mod gpt;
pub(crate) mod host;
mod init;
pub mod lora;
pub mod memory;
#[cfg(feature = "candle")]
mod mlp;
pub mod observe;
pub mod ops;
#[cfg(test)]
mod reference;
pub mod weights;

pub use config::{FinalLane, Init, MlpActivation, ModelConfig};
#[cfg(feature = "tools")]
pub use elements::{ELEMENTS, Element};
#[cfg(feature = "candle")]
pub use formulation::PassExtras;
pub use gpt::{Gpt, ParamGroup, group_of as gpt_group_of};
use std::cell::Cell;

#[cfg(feature = "candle")]
use candle_core::{DType, Tensor};

thread_local! {
    static GPU_FORMULATION_ON_CPU: Cell<bool> = const { Cell::new(false) };
}

/// Whether `x` takes the GPU formulation of the model's ops (the kernels of `kernels/fused.cu`
/// around cuBLAS products, see [`ops`]): on a CUDA device in f32 or bf16; on the CPU only
/// inside [`with_gpu_formulation`], where the same graph runs on the kernels' CPU references
/// (in f64, f32, or bf16 as the kernels compute it: inputs widened to f32, one rounding on the
/// way out).
#[cfg(feature = "candle")]
pub(crate) fn gpu_path(x: &Tensor) -> bool {
    let dev = x.device();
    if dev.is_cuda() {
        matches!(x.dtype(), DType::F32 | DType::BF16)
    } else {
        dev.is_cpu() && GPU_FORMULATION_ON_CPU.with(Cell::get) && matches!(x.dtype(), DType::F32 | DType::F64 | DType::BF16)
    }
}

/// Runs `f` (forward and backward passes) with CPU tensors taking the GPU formulation: the GPU
/// graph's assembly and backward wiring, checked on a machine without a GPU (this thread only).
/// In bf16 it also gives the errors the GPU's rounding should have (`pipeline parity`'s bounds).
#[cfg(feature = "tools")]
pub fn with_gpu_formulation<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            GPU_FORMULATION_ON_CPU.with(|c| c.set(self.0));
        }
    }
    let _reset = Reset(GPU_FORMULATION_ON_CPU.with(|c| c.replace(true)));
    f()
}
