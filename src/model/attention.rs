//! The attention sublayer of block `i`: causal grouped-query self-attention of the normed
//! stream `x` `(B*T, D)`, heads side by side in the columns:
//!
//! ```text
//! q = rope(rms_norm_h(x Wq^T)) * q_gain[h]      (per head h)
//! k = rope(rms_norm_h(x Wk^T))
//! v = x Wv^T
//! a = causal_attention(q, k, v)
//! a = xsa(a, v)                                 (physical blocks under model.xsa_last_n)
//! a = a * sigmoid(s attn_gate_w[h] . x[:W])      (per head, under model.attn_gate)
//! y = a Wproj^T
//! ```
//!
//! RoPE rotates the first `model.rope_dims` dims of each head (all by default) with the tables
//! the forward pass made for its sequence length (NTK-rescaled past `model.rope_train_seq_len`).
//!
//! The products, the dtype q, k, v stay in and the attention kernel are the pass's
//! [`Formulation`]'s; the ops are [`super::ops::qk_norm_rope`] and
//! [`super::ops::attention`] (or flash attention) and [`super::ops::xsa`].

use candle_core::{Result, Tensor};

use super::Gpt;
use super::formulation::Formulation;
use super::lora::Site;
use super::ops::{attn_gate, qk_norm_rope, xsa};

impl Gpt {
    /// Causal GQA self-attention of block `i` at layer-sequence position `slot` on the
    /// `(B*T, D)` input `x` (`b` batch rows): per-head RMS norm, RoPE and the query gain on q
    /// and k, then the output projection. The pass's LoRA adapters (if any) add to q, k, v
    /// before the norm and, reading `x`, to the output.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        f: &Formulation,
        (i, slot): (usize, usize),
        x: &Tensor,
        b: usize,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        let cfg = self.config();
        let (h, kvh) = (cfg.num_heads, cfg.num_kv_heads);
        let p = |s: &str| self.p(&format!("blocks.{i}.attn.{s}"));
        // x arrives in the activations' dtype from `norm_in` (the cast is a no-op then); under
        // mixed precision q, k, v, the attention output and its projection stay in it, and so
        // does the gain, as the script casts it to q's dtype (`raw_logits` cast the rope tables).
        let x = f.cast_to_activations(x)?;
        f.observe(&x, || ["c_q", "c_k", "c_v"].map(|w| format!("blocks.{i}.attn.{w}.weight")).to_vec())?;
        let q = f.adapt(slot, Site::Q, &x, f.linear(&x, &p("c_q.weight"))?)?;
        let q = qk_norm_rope(&q, Some(&f.cast_to_activations(&p("q_gain"))?), cos, sin, h, self.qk_eps)?;
        let k = qk_norm_rope(&f.adapt(slot, Site::K, &x, f.linear(&x, &p("c_k.weight"))?)?, None, cos, sin, kvh, self.qk_eps)?;
        let v = f.adapt(slot, Site::V, &x, f.linear(&x, &p("c_v.weight"))?)?;
        let mut y = f.attention(&q, &k, &v, b, h, kvh)?;
        if cfg.xsa(i) {
            y = xsa(&y, &v, h, kvh)?;
        }
        if cfg.attn_gate {
            y = attn_gate(&y, &x, &f.cast_to_activations(&p("attn_gate_w"))?, cfg.attn_gate_scale)?;
        }
        f.observe(&y, || vec![format!("blocks.{i}.attn.proj.weight")])?;
        f.adapt(slot, Site::O, &x, f.linear(&y, &p("proj.weight"))?)
    }
}
