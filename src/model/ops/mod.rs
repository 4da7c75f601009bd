//! The model's ops, one file per op (its backward pass included). Each file holds, in this
//! order: what the op computes (the module doc, in maths), the reference formulation it is
//! tested against (plain candle ops or float64 code), the public function the model calls,
//! the CPU kernel (the forward and backward over row slices, multi-threaded with rayon,
//! compiled twice by [`crate::model::host::simd::multiversion!`]: the `CustomOp`'s `cpu_fwd`
//! calls them, and so does the engine's CPU backend, `crate::engine::cpu`, so that each op's
//! CPU maths is written once), the GPU launch (the `cuda_fwd`, calling
//! [`crate::model::cuda::fused`], whose device maths is in `kernels/ops/`), and the tests
//! comparing the kernel with the reference. The candle side (the reference, the public
//! function and its `CustomOp`, the GPU launch) is the candle executor's and compiles with the
//! feature `candle` only; the row kernels the engine calls compile in every build.
//!
//! | file | op |
//! |---|---|
//! | [`rms_norm`] | RMS norm without weight; [`rms_norm_to`] into a narrower dtype |
//! | [`qk_norm_rope`] | per-head RMS norm, RoPE and gain of q and k |
//! | [`rope`] | the RoPE tables and the reference rotation |
//! | [`attention`] | causal GQA attention, `(B, H, T, D)` heads or token-major matrices |
//! | [`causal_softmax`] | the masked softmax of materialised scores (GPU attention) |
//! | [`doc_mask`] | the document mask of packed rows (attention kept inside documents) |
//! | [`softcap_ce`] | logit soft-cap and cross-entropy |
//! | [`scale_add`] | `base + x * s`, per-channel `s` |
//! | [`resid_mix`] | `h * mix[0] + x0 * mix[1]` |
//! | [`relu_sq`] | `relu(x)^2`, and the engine's leaky variant through the same kernel |
//! | [`leaky_relu_sq`] | `leaky_relu(x, a)^2` (composed) |
//! | [`skip_gate`] | the sigmoid-gated U-Net skip (composed; row kernels for the engine) |
//! | [`smear_gate`] | SmearGate: a gated share of the previous token's embedding, none onto BOS (composed) |
//! | [`attn_gate`] | the sparse attention-output gate, a sigmoid per head (composed) |
//! | [`xsa`] | exclusive self-attention: a head's output less its own value's direction (composed; row kernels for the engine) |
//! | [`scale_cols`] | `x * s` and the per-channel sum `column_dot` (GPU backward passes) |
//! | [`embedding`] | the token-embedding lookup (GPU backward kernel; its CPU reference is the engine's backward) |
//! | [`cast`] | f32 <-> bf16 casts (GPU kernel) |
//!
//! Where an op runs: on the CPU its fused kernel; on the GPU path ([`crate::model::gpu_path`]:
//! CUDA in f32 or bf16, or the CPU inside [`crate::model::with_gpu_formulation`]) the kernels of
//! `kernels/fused.cu`, whose CPU implementations (in f64, or in f32 rounded once for bf16) are
//! their references; elsewhere (other devices or dtypes) the candle composite. The kernels
//! support `f32` and `f64` on the CPU (and bf16 in the GPU formulation).
//!
//! The model's tensors are token-major: `(N, C)` matrices with `N = B * T` rows (row `n` is
//! position `n % T` of sequence `n / T`), heads side by side in the columns. Per-channel
//! gradients are sums over rows: each rayon task sums a fixed block of rows and the blocks are
//! added in order, so results do not depend on thread scheduling.

#[cfg(feature = "candle")]
use candle_core::{DType, Result, Tensor, bail};

pub mod attention;
pub mod attn_gate;
pub mod cast;
pub mod causal_softmax;
pub mod doc_mask;
pub mod embedding;
pub mod lanes;
pub mod leaky_relu_sq;
pub mod qk_norm_rope;
pub mod relu_sq;
pub mod resid_mix;
pub mod rms_norm;
pub mod rope;
pub mod scale_add;
pub mod scale_cols;
pub mod skip_gate;
pub mod smear_gate;
pub mod softcap_ce;
#[cfg(test)]
pub(crate) mod testing;
pub mod xsa;

/// The ops on candle tensors, with their autograd (the candle executor's).
#[cfg(feature = "candle")]
pub use self::{
    attention::{
        causal_attention, causal_attention_reference, causal_attention_tokens, causal_mask, document_attention_tokens, repeat_kv,
        softmax_last,
    },
    attn_gate::attn_gate,
    cast::cast,
    causal_softmax::causal_softmax,
    embedding::embedding,
    leaky_relu_sq::leaky_relu_sq,
    qk_norm_rope::{norm_rope, qk_norm_rope},
    relu_sq::relu_sq,
    resid_mix::resid_mix,
    rms_norm::{rms_norm, rms_norm_eps, rms_norm_reference, rms_norm_to},
    rope::rope,
    scale_add::scale_add,
    scale_cols::scale_cols,
    skip_gate::gated_skip,
    smear_gate::smear_gate,
    softcap_ce::{cross_entropy_rows, softcap, softcap_cross_entropy},
    xsa::xsa,
};
pub(crate) use attention::{AttentionGrads, attention_token_major_bwd, attention_token_major_fwd};
pub use doc_mask::{DocRule, DocumentMask};
pub use rms_norm::rms_eps;
pub use rope::rope_tables;

/// An error unless `dtype` is one the CPU kernels run on (`f32`, `f64`); `op` names the caller.
#[cfg(feature = "candle")]
fn check_float(op: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::F64 => Ok(()),
        dt => bail!("{op}: fused CPU op supports f32 and f64, got {dt:?}"),
    }
}

/// An error naming every dtype unless the tensors `ts` share one.
#[cfg(feature = "candle")]
fn same_dtypes(op: &str, ts: &[&Tensor]) -> Result<()> {
    if ts.iter().any(|t| t.dtype() != ts[0].dtype()) {
        bail!("{op}: dtypes differ: {:?}", ts.iter().map(|t| t.dtype()).collect::<Vec<_>>());
    }
    Ok(())
}

/// The size of `x`'s last dimension, which must be non-empty.
#[cfg(feature = "candle")]
fn last_dim(x: &Tensor) -> Result<usize> {
    match x.dims().last() {
        Some(&c) if c > 0 => Ok(c),
        _ => bail!("fused op: needs a non-empty last dimension, got {:?}", x.shape()),
    }
}

/// Whether `(wide, narrow)` is a pair the mixed-precision ops take: f32 with bf16 (the GPU's),
/// f64 with f32 (the CPU formulation's stand-in for it).
#[cfg(feature = "candle")]
fn mixed_pair(wide: DType, narrow: DType) -> bool {
    matches!((wide, narrow), (DType::F32, DType::BF16) | (DType::F64, DType::F32))
}

/// Whether an op working in `wide` may read or write `other`: the same dtype, or the narrow side
/// of a [`mixed_pair`].
#[cfg(feature = "candle")]
fn same_or_narrower(wide: DType, other: DType) -> bool {
    wide == other || mixed_pair(wide, other)
}
