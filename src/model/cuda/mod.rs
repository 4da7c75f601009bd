//! The GPU side of the fused ops (`cuda` builds only): [`fused`] launches the fused ops'
//! kernels (`kernels/fused.cu`, compiled to PTX by build.rs) for the `cuda_fwd` of each op in
//! [`super::ops`]. Flash attention's launches live with it, in `model::flash_attn`.

pub(crate) mod fused;
