//! How one forward pass computes, chosen once per pass: the dtype the activations around the
//! matrix products stay in, how a product is taken, how the stream is normed into a product,
//! and which attention kernel runs. [`super::attention`], [`super::mlp`] and the output head
//! are written once on top of it.
//!
//! Two formulations, from the device, the parameters' dtype and the matmul dtype:
//!
//! - plain (the CPU, and the GPU without mixed precision): activations in the parameters'
//!   dtype; under a matmul dtype each product casts its inputs to it and its output back;
//! - mixed precision on the GPU path ([`super::gpu_path`] with a matmul dtype set): as under
//!   PyTorch's autocast, each projection's output stays in the matmul dtype (bf16) through QK
//!   norm, RoPE, attention and relu², and is added to the f32 residual stream by `scale_add`
//!   as it is; the stream is normed straight into bf16 ([`rms_norm_to`]); flash attention runs
//!   where [`Attention`] asks for it and the shapes allow.
//!
//! A pass may also carry [`PassExtras`]: per-document LoRA adapters, which [`Formulation::adapt`]
//! adds where the blocks call it, and a document mask, under which attention stays within each
//! segment: flash_mma's document kernels (or cuDNN's ragged attention) where flash runs, else
//! the fused or materialised masked attention.

use candle_core::{DType, Result, Tensor};

use super::flash_attn::{self, Attention, FlashKernels};
use super::lora::{LoraPass, Site};
use super::observe::{Observer, observe};
use super::ops::{DocumentMask, cast, document_attention_tokens, rms_norm, rms_norm_to};

/// What a forward pass may add to the model's own computation.
#[derive(Clone, Copy, Default)]
pub struct PassExtras<'a> {
    /// Per-document LoRA adapters, one per batch row (test-time training, spec 5.4).
    pub lora: Option<&'a LoraPass>,
    /// A document mask over packed rows: attention stays inside each document (spec 5.5).
    pub docs: Option<&'a DocumentMask>,
}

/// The formulation of one forward pass (see the module doc).
#[derive(Clone, Copy)]
pub(super) struct Formulation<'a, 'e> {
    /// The parameters' dtype (the residual stream's).
    param: DType,
    /// The matmul dtype when it differs from the parameters'.
    matmul: Option<DType>,
    /// The dtype the activations around the products stay in, under mixed precision on the GPU
    /// path (`None`: the plain formulation).
    low: Option<DType>,
    /// The flash kernels attention runs on (`None`: the materialised or fused attention).
    flash: Option<FlashKernels>,
    /// Who watches the products' inputs (GPTQ's calibration), if anyone.
    observer: Option<Observer<'a>>,
    /// Adapters and a document mask, if the pass has them (a lifetime of their own: the model
    /// may make a pass's mask itself, under `model.document_attention`).
    extras: PassExtras<'e>,
}

impl<'a, 'e> Formulation<'a, 'e> {
    /// The formulation of a pass over the stream `h` (on the model's device, in the
    /// parameters' dtype `param`) of sequences of `t` tokens with `head_dim`-wide heads.
    /// Flash attention only runs under mixed precision on the GPU path, and where it does not
    /// apply (e.g. an evaluation window that is not a multiple of 64) the materialised
    /// attention runs even under "flash".
    pub(super) fn choose(h: &Tensor, param: DType, matmul: Option<DType>, attention: Attention, (t, head_dim): (usize, usize)) -> Self {
        let low = matmul.filter(|_| super::gpu_path(h));
        let flash =
            low.and_then(|low| attention.flash_kernels().filter(|_| flash_attn::unsupported(h.device(), low, t, head_dim).is_none()));
        Self { param, matmul, low, flash, observer: None, extras: PassExtras::default() }
    }

    /// The same formulation with `extras` (under a document mask with segments, flash attention
    /// runs flash_mma's document kernels, or cuDNN's ragged attention).
    pub(super) fn with_extras(self, extras: PassExtras<'e>) -> Self {
        // Segments run on flash_mma's document kernels (the only ones of our own that take them)
        // or on cuDNN's ragged graphs.
        let segments = |k| if k == FlashKernels::Cudnn { k } else { FlashKernels::Mma };
        let flash = self.flash.map(|k| if extras.docs.is_none_or(DocumentMask::is_causal) { k } else { segments(k) });
        Self { extras, flash, ..self }
    }

    /// `y` plus slot `slot`'s adapter at `site` on `x`, when the pass has adapters; else `y`.
    pub(super) fn adapt(&self, slot: usize, site: Site, x: &Tensor, y: Tensor) -> Result<Tensor> {
        match self.extras.lora {
            Some(l) => {
                let a = l.apply(slot, site, x, &y)?;
                y + a
            }
            None => Ok(y),
        }
    }

    /// The logits `y` plus the head's adapter on the final-normed `x`, when the pass has one.
    pub(super) fn adapt_head(&self, x: &Tensor, y: Tensor) -> Result<Tensor> {
        match self.extras.lora {
            Some(l) => {
                let a = l.head(x, &y)?;
                y + a
            }
            None => Ok(y),
        }
    }

    /// The same formulation, handing the products' inputs to `observer`.
    pub(super) fn observed(self, observer: Option<Observer<'a>>) -> Self {
        Self { observer, ..self }
    }

    /// Hands the input `x` of the products with the weights `names` makes to the observer, if
    /// there is one ([`super::observe`]).
    pub(super) fn observe(&self, x: &Tensor, names: impl FnOnce() -> Vec<String>) -> Result<()> {
        observe(self.observer, x, names)
    }

    /// The matmul dtype the activations stay in under mixed precision on the GPU path; `None`
    /// in the plain formulation.
    pub(super) fn mixed(&self) -> Option<DType> {
        self.low
    }

    /// The dtype of the activations around the products.
    pub(super) fn activations(&self) -> DType {
        self.low.unwrap_or(self.param)
    }

    /// `x` in the activations' dtype (a no-op where it is already).
    pub(super) fn cast_to_activations(&self, x: &Tensor) -> Result<Tensor> {
        cast(x, self.activations())
    }

    /// `x W^T` for `x` of shape `(N, in)` and `W` of shape `(out, in)`: under mixed precision
    /// on the GPU path with `x` already in the matmul dtype and the result left in it; else in
    /// the matmul dtype with the result in the parameters'.
    pub(super) fn linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        match (self.low, self.matmul) {
            (Some(_), _) => x.matmul(&cast(w, x.dtype())?.t()?),
            (None, None) => x.matmul(&w.t()?),
            (None, Some(md)) => cast(&cast(x, md)?.matmul(&cast(w, md)?.t()?)?, self.param),
        }
    }

    /// RMS norm of the residual stream `u` as the input of the products that follow: in the
    /// activations' dtype (one kernel writes the narrow rows under mixed precision, see
    /// [`rms_norm_to`]).
    pub(super) fn norm_in(&self, u: &Tensor) -> Result<Tensor> {
        match self.low {
            Some(low) => rms_norm_to(u, low),
            None => rms_norm(u),
        }
    }

    /// Causal GQA attention of token-major `q` `(B*T, H*D)`, `k`, `v` `(B*T, K*D)`: flash
    /// attention where chosen, else the fused or materialised attention (under the pass's
    /// document mask, if it has one).
    pub(super) fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, batch: usize, heads: usize, kv_heads: usize) -> Result<Tensor> {
        match self.flash {
            Some(kernels) => match self.extras.docs {
                Some(docs) => flash_attn::flash_attention_docs(q, k, v, batch, heads, kv_heads, kernels, docs),
                None => flash_attn::flash_attention(q, k, v, batch, heads, kv_heads, kernels),
            },
            None => document_attention_tokens(q, k, v, batch, heads, kv_heads, self.extras.docs),
        }
    }
}
