//! What the CPU kernels of [`super::ops`] share (the host side of the ops; the engine's CPU
//! backend runs the same kernels): the float arithmetic and its AVX2 dispatch ([`simd`]), the
//! rows of a tensor as the kernels read them ([`rows`]), and the conversions between storages
//! and working types ([`convert`]). Nothing here knows an op.

pub(crate) mod convert;
pub(crate) mod rows;
pub(crate) mod simd;
