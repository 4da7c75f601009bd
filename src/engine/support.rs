//! What of the model the engine implements, key by key: [`check`] destructures
//! [`ModelConfig`] without `..`, so a new `[model]` key does not compile until the engine says
//! here what it does with it: implement it (and name where) or refuse it with an error naming
//! the key. The element table ([`crate::model::ELEMENTS`]) and its test
//! (`engine::tests::every_model_element_alone_matches_candle_in_f64`) check that what is named
//! implemented is implemented: engine equals candle in f64 with each element alone.

use crate::model::ModelConfig;

/// An error naming the first `[model]` key of `cfg` the engine does not implement (after
/// [`ModelConfig::check`]'s own checks). Every key is listed with where the engine reads it.
pub fn check(cfg: &ModelConfig) -> anyhow::Result<()> {
    cfg.check()?;
    let ModelConfig {
        // Shapes: the layout's regions and every GEMM's (`layout`, `schedule`).
        vocab_size: _,
        num_layers: _,
        model_dim: _,
        num_heads: _,
        num_kv_heads: _,
        mlp_mult: _,
        // The head: the embedding's transpose or `lm_head.weight` (`layout`, `schedule`).
        tie_embeddings: _,
        // The RoPE tables (`Engine::with_backend`, from `rope_base_for` and `rotary_dims`).
        rope_base: _,
        rope_dims: _,
        rope_train_seq_len: _,
        // The loss (`op::SoftcapCe`).
        logit_softcap: _,
        // Initial values: candle makes the weights, the engine loads them (`Engine::load_params`).
        qk_gain_init: _,
        tied_embed_init_std: _,
        init: _,
        // The MLP (`op::ActFwd`/`act_bwd`).
        mlp_activation: _,
        leaky_relu_slope: _,
        // The block's norms (`op::RmsNormFwd`'s scale).
        ln_scale: _,
        // The block's wiring (`schedule`'s forward and backward of a block).
        parallel_residual_start: _,
        xsa_last_n: _,
        // The U-Net's skips (`op::SkipFwd`/`skip_bwd`).
        skip_gates: _,
        // The layer sequence (`ModelConfig::layer_sequence`; the trainer switches looping on at
        // `enable_looping_at`).
        loop_start: _,
        loop_end: _,
        num_loops: _,
        enable_looping_at: _,
        // The 04-27 record's SmearGate with the BOS fix (`op::SmearFwd`/`smear_bwd`,
        // before the embedding's norm in `schedule`).
        smear_gate: _,
        smear_gate_window: _,
        bos_id: _,
        // Attention within documents (`AttnShape::docs`: the backends mask by the micro-batch's
        // ids, cut every `document_max_len`: `DocRule`).
        document_attention: _,
        document_max_len: _,
        // The sparse attention-output gate (`op::AttnGateFwd`/`attn_gate_bwd` and two
        // GEMMs for its weights' and input's gradients, in `schedule`).
        attn_gate: _,
        attn_gate_window: _,
        attn_gate_init_std: _,
        attn_gate_scale: _,
        // The two-lane parallel decoder (`op::LanesFwd`/`lanes_bwd`; `schedule`'s lane
        // blocks and final stream).
        parallel_decoder_start: _,
        parallel_final_lane: _,
        // BigramHash (`op::EmbeddingFwd`/`embedding_bwd` at `op::Ids::Bigram`, a GEMM each way
        // for its projection and `op::ScaleAddFwd`/`scale_add_bwd` for its scale, in
        // `schedule`).
        bigram_vocab_size: _,
        bigram_dim: _,
    } = cfg;
    Ok(())
}
