//! The challenge's baseline GPT (record `2026-03-17_NaiveBaseline`, spec section 3) in
//! candle, on any candle device and float dtype.
//!
//! - [`ModelConfig`]: the `[model]` table; the baseline's values are the defaults.
//! - [`ops`]: the building blocks (RMS norm without weights, RoPE, causal GQA attention, logit
//!   soft-cap, cross-entropy), each small enough to test against a float64 reference.
//! - [`fused`]: the same RMS norm, causal attention and soft-capped cross-entropy as fused,
//!   multi-threaded CPU ops with their own backward passes (the model uses them; they fall back
//!   to [`ops`] on other devices), tested against [`ops`].
//! - [`causal_softmax`], [`norm_rope`], [`embedding`], [`cast`]: ops whose GPU kernels
//!   (`kernels/fused.cu`, launched by `gpu_kernels` in a `cuda` build) replace candle
//!   composites on a GPU; their CPU implementations are the kernels' references, and the fused
//!   CPU ops of [`fused`] have GPU kernels too.
//! - [`flash_attn`]: the choice of attention kernel and flash attention
//!   (`kernels/flash_attn.cu`), checked against [`fused::causal_attention_tokens`];
//!   [`attention_trial`]: `attention = "auto"`'s timed trial of the flash implementations.
//! - [`Gpt`]: parameters named exactly as the PyTorch script's `GPT.state_dict()`, the spec's
//!   initialisation, and the forward pass to logits, mean loss or per-token losses.

pub mod attention_trial;
pub mod cast;
pub mod causal_softmax;
mod config;
pub mod embedding;
pub mod flash_attn;
pub mod fused;
mod gpt;
#[cfg(feature = "cuda")]
mod gpu_kernels;
mod host;
pub mod memory;
pub mod norm_rope;
pub mod ops;
pub mod weights;

pub use config::ModelConfig;
pub use gpt::{Gpt, ParamGroup, group_of as gpt_group_of};

use std::cell::Cell;

use candle_core::{DType, Tensor};

thread_local! {
    static GPU_FORMULATION_ON_CPU: Cell<bool> = const { Cell::new(false) };
}

/// Whether `x` takes the GPU formulation of the model's ops (the kernels of `kernels/fused.cu`
/// around cuBLAS products, see [`fused`]): on a CUDA device in f32 or bf16; on the CPU only
/// inside [`with_gpu_formulation`], where the same graph runs on the kernels' CPU references
/// (in f64, f32, or bf16 as the kernels compute it: inputs widened to f32, one rounding on the
/// way out).
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
