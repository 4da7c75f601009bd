//! Checks of a device against the CPU: `pipeline parity` ([`parity`]: the candle executor's
//! kernels and model), with the error measures of `model::compare` (which the kernels' tests and
//! the attention trial use too), and `pipeline engine-check` ([`engine`]: the explicit engine's
//! backend, op by op and whole, and its per-op timings).

pub mod engine;
pub mod parity;
