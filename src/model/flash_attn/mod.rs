//! Which attention kernel the model runs, and the entry to flash attention (its op and launches:
//! `cuda` (its op and launches, `cuda` builds only), `kernels/flash_attn.cu`, `kernels/flash_mma.cu`).
//!
//! [`Attention::Materialized`] is the attention of [`super::ops::attention`]: on a GPU the two score
//! products on cuBLAS around a one-kernel causal softmax, the `(B, H, T, T)` probabilities kept
//! for the backward pass. [`Attention::Flash`] never stores them: one kernel computes the output
//! and each query's log-sum-exp, and the backward pass recomputes the probabilities tile by tile
//! (dk/dv and dq in two deterministic kernels, no atomics). It runs on CUDA in bf16 with head
//! dim 64 and a sequence length that is a multiple of 64 (the challenge's shapes); the CPU
//! reference it is checked against (`pipeline parity`) is
//! [`super::ops::causal_attention_tokens`], the same maths in float64.
//!
//! The flash kernels come in two implementations of one design ([`FlashKernels`]): WMMA
//! fragments with the scores staged in shared memory (`flash_attn.cu`, measured on an H100), and
//! raw `mma.sync` register fragments with the softmax in registers and double-buffered tiles
//! (`flash_mma.cu`, `attention = "flash_mma"`), checked on the CPU by the warp emulator
//! (`tests/warp_emulation.rs`) and on a GPU by `pipeline parity`. A third is cuDNN's fused
//! flash attention (`cudnn.rs`, `attention = "cudnn"`), with flash_mma where cuDNN refuses.

use candle_core::{DType, Device};
#[cfg(feature = "candle")]
use candle_core::{Result, Tensor};

#[cfg(feature = "candle")]
use super::ops::DocumentMask;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The attention kernel of a GPU run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    /// Flash attention where it applies (CUDA, bf16, head dim 64, seq_len a multiple of 64),
    /// the materialised one elsewhere. The step executor resolves it to the faster flash
    /// implementation that agrees with the materialised attention (`train::attention_trial`);
    /// a model left on it runs the WMMA kernels.
    #[default]
    Auto,
    /// Flash attention; a run whose shapes or device it does not fit is refused.
    Flash,
    /// Flash attention on the register-fragment kernels (`kernels/flash_mma.cu`); refused where
    /// flash attention cannot run.
    #[serde(rename = "flash_mma")]
    FlashMma,
    /// cuDNN's fused flash attention (`cudnn.rs`, `cuda` builds with libcudnn.so.9 at run
    /// time): in the engine and the candle path alike, at the shapes flash attention takes (a
    /// run it cannot take is refused, as for "flash"). Where cuDNN cannot be loaded or refuses
    /// a shape, the run says so in one line and runs the flash_mma kernels.
    Cudnn,
    /// Scores and probabilities materialised (cuBLAS products around the fused softmax).
    Materialized,
}

impl Attention {
    /// The flash kernels this choice runs where flash attention applies; `None` for
    /// [`Attention::Materialized`].
    pub fn flash_kernels(self) -> Option<FlashKernels> {
        match self {
            Attention::Auto | Attention::Flash => Some(FlashKernels::Wmma),
            Attention::FlashMma => Some(FlashKernels::Mma),
            Attention::Cudnn => Some(FlashKernels::Cudnn),
            Attention::Materialized => None,
        }
    }

    /// Whether a run that flash attention cannot take is refused rather than materialised.
    pub fn requires_flash(self) -> bool {
        matches!(self, Attention::Flash | Attention::FlashMma | Attention::Cudnn)
    }

    /// The name in the TOML.
    pub fn name(self) -> &'static str {
        match self {
            Attention::Auto => "auto",
            Attention::Flash => "flash",
            Attention::FlashMma => "flash_mma",
            Attention::Cudnn => "cudnn",
            Attention::Materialized => "materialized",
        }
    }
}

/// The implementations of flash attention: two of our own, and cuDNN's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernels {
    /// `kernels/flash_attn.cu`: WMMA 16x16x16 fragments, scores staged in shared memory.
    Wmma,
    /// `kernels/flash_mma.cu`: `mma.sync` m16n8k16 register fragments, softmax in registers,
    /// tiles double-buffered by `cp.async`.
    Mma,
    /// cuDNN's fused flash attention (`cudnn.rs`), flash_mma where cuDNN refuses.
    Cudnn,
}

impl FlashKernels {
    /// Every implementation, the one measured on an H100 first (the incumbent of the trials).
    pub const ALL: [FlashKernels; 3] = [FlashKernels::Wmma, FlashKernels::Mma, FlashKernels::Cudnn];

    /// The name the train log gives the kernels (the `attention` value that picks them).
    pub fn name(self) -> &'static str {
        match self {
            FlashKernels::Wmma => "flash",
            FlashKernels::Mma => "flash_mma",
            FlashKernels::Cudnn => "cudnn",
        }
    }

    /// The `attention` value that runs these kernels and nothing else.
    pub fn attention(self) -> Attention {
        match self {
            FlashKernels::Wmma => Attention::Flash,
            FlashKernels::Mma => Attention::FlashMma,
            FlashKernels::Cudnn => Attention::Cudnn,
        }
    }
}

/// Why a binary without the `cuda` feature runs no flash attention, ours or cuDNN's.
const NO_CUDA: &str = "this binary was built without the `cuda` feature";

/// Head dimension the flash kernels are compiled for.
pub const HEAD_DIM: usize = 64;
/// Rows per tile: the sequence length must be a multiple of it.
pub const TILE: usize = 64;

/// Why flash attention cannot run on `device` with q, k, v of `dtype`, sequences of `t` tokens
/// and `d`-wide heads; `None` when it can.
pub fn unsupported(device: &Device, dtype: DType, t: usize, d: usize) -> Option<String> {
    if !cfg!(feature = "cuda") {
        return Some(NO_CUDA.into());
    }
    if !device.is_cuda() {
        return Some("it runs on CUDA devices only".into());
    }
    if dtype != DType::BF16 {
        return Some(format!("it runs in bf16 (mixed precision), not {dtype:?}"));
    }
    if d != HEAD_DIM {
        return Some(format!("its kernels are built for head dim {HEAD_DIM}, the model's is {d}"));
    }
    if t == 0 || !t.is_multiple_of(TILE) {
        return Some(format!("the sequence length {t} is not a multiple of {TILE}"));
    }
    None
}

/// Causal GQA attention of token-major `q` `(B*T, H*D)`, `k` and `v` `(B*T, K*D)` (`batch` = B
/// rows, `heads` = H, `kv_heads` = K), returning `(B*T, H*D)`: the result of
/// [`super::ops::causal_attention_tokens`], computed by the flash `kernels`. Errors (naming
/// the reason) where [`unsupported`] says so.
#[cfg(feature = "candle")]
pub fn flash_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    kernels: FlashKernels,
) -> Result<Tensor> {
    checked(q, k, v, batch, heads, kv_heads)?;
    if kernels == FlashKernels::Cudnn
        && let Some(o) = try_cudnn(q, k, v, batch, heads, kv_heads, None)?
    {
        return Ok(o);
    }
    imp::apply(q, k, v, batch, heads, kv_heads, kernels, None)
}

/// Why cuDNN's attention cannot run on `device` for `batch` rows of `t` tokens, `heads` /
/// `kv_heads` heads of `d` (attending within documents with `docs`): no `cuda` build, no
/// libcudnn, or a shape cuDNN refuses (its graphs are built to find out); `None` when it can.
#[cfg(feature = "candle")]
pub fn cudnn_unavailable(device: &Device, batch: usize, t: usize, heads: usize, kv_heads: usize, d: usize, docs: bool) -> Option<String> {
    #[cfg(feature = "cuda")]
    return cudnn::unavailable(device, batch, t, heads, kv_heads, d, docs);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, batch, t, heads, kv_heads, d, docs);
        Some(NO_CUDA.into())
    }
}

/// cuDNN's attention ([`Attention::Cudnn`]) where it runs; `None` where it cannot (no libcudnn,
/// a shape it refuses), said once per reason: the caller runs the flash_mma kernels.
#[cfg(feature = "candle")]
fn try_cudnn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    docs: Option<&DocumentMask>,
) -> Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    let why = match cudnn::apply(q, k, v, batch, heads, kv_heads, docs)? {
        Ok(o) => return Ok(Some(o)),
        Err(why) => why,
    };
    #[cfg(not(feature = "cuda"))]
    let why = {
        let _ = (q, k, v, batch, heads, kv_heads, docs);
        NO_CUDA.to_string()
    };
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if !said.contains(&why) {
        eprintln!("warning: cuDNN attention cannot run here ({why}); attention runs on flash_mma");
        said.push(why);
    }
    Ok(None)
}

/// The checks of a flash attention call: shapes that split as the arguments say, and
/// [`unsupported`]'s conditions; returns the sequence length.
#[cfg(feature = "candle")]
fn checked(q: &Tensor, k: &Tensor, v: &Tensor, batch: usize, heads: usize, kv_heads: usize) -> Result<usize> {
    let (n, width) = q.dims2()?;
    if batch == 0 || heads == 0 || kv_heads == 0 || n % batch != 0 || width % heads != 0 || !heads.is_multiple_of(kv_heads) {
        candle_core::bail!("flash_attention: q {:?} does not split into {batch} rows of {heads} heads ({kv_heads} KV heads)", q.shape());
    }
    let (t, d) = (n / batch, width / heads);
    if k.dims() != [n, kv_heads * d] || v.dims() != k.dims() || k.dtype() != q.dtype() || v.dtype() != q.dtype() {
        candle_core::bail!("flash_attention: k {:?} and v {:?} do not fit q {:?}", k.shape(), v.shape(), q.shape());
    }
    if let Some(why) = unsupported(q.device(), q.dtype(), t, d) {
        candle_core::bail!("flash attention cannot run here: {why}");
    }
    Ok(t)
}

/// [`flash_attention`] under a document mask: each position sees only the earlier positions of
/// its own segment (the result of [`super::ops::document_attention_tokens`]). A mask that is
/// plain causal runs `kernels` as they are; any other runs the document entry points of
/// `kernels/flash_mma.cu` (`flash_*_mma_docs_bf16`, the only kernels that take segments),
/// reading each position's segment start from the device (uploaded once per mask).
#[allow(clippy::too_many_arguments)]
#[cfg(feature = "candle")]
pub fn flash_attention_docs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    kernels: FlashKernels,
    docs: &DocumentMask,
) -> Result<Tensor> {
    if docs.is_causal() {
        return flash_attention(q, k, v, batch, heads, kv_heads, kernels);
    }
    let t = checked(q, k, v, batch, heads, kv_heads)?;
    if (docs.rows(), docs.t()) != (batch, t) {
        candle_core::bail!("flash_attention: a document mask of {} rows of {} for {batch} rows of {t}", docs.rows(), docs.t());
    }
    if kernels == FlashKernels::Cudnn
        && let Some(o) = try_cudnn(q, k, v, batch, heads, kv_heads, Some(docs))?
    {
        return Ok(o);
    }
    let starts = docs.starts_on(q.device())?;
    imp::apply(q, k, v, batch, heads, kv_heads, FlashKernels::Mma, Some(starts))
}

#[cfg(all(not(feature = "cuda"), feature = "candle"))]
mod imp {
    use candle_core::{Result, Tensor};

    use super::FlashKernels;

    #[allow(clippy::too_many_arguments)]
    pub fn apply(_: &Tensor, _: &Tensor, _: &Tensor, _: usize, _: usize, _: usize, _: FlashKernels, _: Option<Tensor>) -> Result<Tensor> {
        candle_core::bail!("flash attention needs a `cuda` build")
    }
}

/// The flash attention op of a `cuda` build.
#[cfg(all(feature = "cuda", feature = "candle"))]
mod cuda;
/// cuDNN's attention as a candle op (`cuda` builds).
#[cfg(all(feature = "cuda", feature = "candle"))]
mod cudnn;
#[cfg(all(feature = "cuda", feature = "candle"))]
use cuda as imp;
