//! What the CPU kernels of [`super::ops`] share: the float arithmetic and its AVX2 dispatch
//! ([`simd`]), the rows of a tensor as the kernels read them ([`rows`]), and the conversions
//! between storages and working types ([`host`]). Nothing here knows an op.

pub(crate) mod host;
pub(crate) mod rows;
pub(crate) mod simd;
