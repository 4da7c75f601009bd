//! Checks of a device against the CPU: `pipeline parity` ([`parity`]) and the error measures
//! it and the kernel tests use ([`compare`]).

pub mod compare;
pub mod parity;
