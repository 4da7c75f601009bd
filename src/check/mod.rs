//! Checks of a device against the CPU: `pipeline parity` ([`parity`]), with the error measures
//! of `model::compare` (which the kernels' tests and the attention trial use too).

pub mod parity;
