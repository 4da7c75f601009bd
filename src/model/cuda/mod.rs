//! The GPU side (`cuda` builds only): [`kernels`] launches the fused ops' kernels
//! (`kernels/fused.cu`, compiled to PTX by build.rs) for the `cuda_fwd` of each op in
//! [`super::ops`]; [`flash_attn`] is flash attention's op and launches.

pub(crate) mod flash_attn;
pub(crate) mod kernels;
