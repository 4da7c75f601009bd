//! The engine's kernels by name, each declared once below: the launcher (`ops.rs`, `place.rs`,
//! `sdpa.rs`) names a kernel by its constant here (a misspelt one does not compile), the warp
//! emulator's table of kernels is generated from [`ALL`] (`emu.rs`), and the op cases' coverage
//! test reads [`ALL`]. A test checks that kernels/engine.cu (kernels/engine/) and kernels/flash_mma.cu define
//! exactly these entry points, so a kernel added to the `.cu` and not here (or the reverse)
//! fails.

/// Declares each kernel's constant (its `extern "C"` name) and [`ALL`].
macro_rules! kernels {
    ($($name:ident,)*) => {
        $(
            #[doc = concat!("`", stringify!($name), "`.")]
            #[allow(non_upper_case_globals)]
            pub const $name: &str = stringify!($name);
        )*
        /// Every kernel, in the order declared.
        pub const ALL: &[&str] = &[$($name),*];
    };
}

kernels! {
    eng_fill, eng_scale, eng_copy, eng_axpby, eng_reduce_partial, eng_fill_act, eng_scale_act,
    eng_copy_act, eng_axpby_act, eng_reduce_partial_act, eng_reduce_finish, eng_clip, eng_adam,
    eng_momentum, eng_row_normalize, eng_normalize_each, eng_transpose_each, eng_colsum_finish,
    eng_colsum_groups, eng_colsum_partial, eng_embedding_fwd, eng_embedding_pieces,
    eng_embedding_bwd, eng_rms_norm_fwd, eng_mix_norm_fwd, eng_rms_norm_bwd, eng_resid_mix_fwd, eng_resid_mix_bwd,
    eng_resid_mix_partial, eng_scale_add_fwd, eng_norm_scale_bwd, eng_norm_mix_bwd, eng_scale_cols, eng_dot_partial, eng_skip_fwd,
    eng_skip_bwd, eng_skip_partial, eng_skip_gate_finish, eng_qk_norm_rope_fwd,
    eng_qk_norm_rope_bwd, eng_qk_norm_rope_fwd4, eng_qk_norm_rope_bwd4, eng_xsa_fwd, eng_xsa_bwd,
    eng_act_fwd, eng_act_bwd, eng_softcap_ce, eng_to_bf16, eng_from_bf16, eng_cast_bf16,
    eng_attn_delta, eng_csr_count, eng_csr_scan, eng_csr_fill, eng_smear_fwd, eng_smear_bwd,
    eng_smear_partial, eng_attn_gate_fwd, eng_attn_gate_bwd, eng_doc_starts, eng_lanes_fwd,
    eng_lanes_bwd, eng_lanes_partial, eng_lanes_finish, eng_doc_slots, eng_ragged_offsets,
    flash_fwd_mma_bf16, flash_bwd_dq_mma_bf16, flash_bwd_dkdv_mma_bf16, flash_fwd_mma_docs_bf16,
    flash_bwd_dq_mma_docs_bf16, flash_bwd_dkdv_mma_docs_bf16,
}
