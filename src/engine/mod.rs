//! The explicit training engine: the GPT's forward pass and a hand-written backward pass over
//! one arena, behind a backend trait (llm.c's design), instead of candle's autograd.
//!
//! Why: autograd allocates every node's output and every input's gradient, sums gradients node
//! by node, and cannot fuse across a block or choose a GEMM's `beta`. Here every tensor has a
//! static offset in one allocation ([`layout`]); the backward pass is written out in reverse
//! order ([`schedule`]) with weight gradients accumulated in place by GEMMs with `beta = 1`; the
//! optimizers are flat loops over the same arena ([`optim`]).
//!
//! - [`backend`]: the [`backend::Backend`] trait, every op the schedule runs;
//! - [`cases`]: one check per op against the f64 CPU backend, for every device (the tests'
//!   warp emulator, `pipeline engine-check` on a GPU or the CPU);
//! - [`cpu`]: its CPU backends, f64 (checks) and f32 (speed), one generic implementation;
//! - [`gpu`]: the GPU backend, over a device that runs kernel launches and cuBLASLt plans
//!   (CUDA, or the warp emulator in tests);
//! - [`layout`]: the arena's regions and every tensor's offset;
//! - [`lora`]: per-document LoRA adapters in the arena (phased TTT) and their products;
//! - [`lt`]: every GEMM as a column-major cuBLASLt call (the GPU backend's), and a CPU
//!   interpreter of those calls that checks the layouts without a GPU;
//! - [`schedule`]: the schedule, the model op by op, forward and backward;
//! - [`optim`]: Muon (Newton-Schulz batched per shape) and Adam/AdamW over the arena;
//! - [`step`]: [`Engine`], what a training step does with them, and the exchange of
//!   parameters and optimizer state as named tensors (the candle executor's names);
//! - [`evaluate`]: what the evaluations after training do with it: per-token losses of
//!   forward passes, SGD with momentum over every parameter (test-time training);
//! - [`support`]: every `[model]` key and what the engine does with it (implements or
//!   refuses it, naming the key);
//! - [`timed`]: per-op timings of any backend (`pipeline engine-check`);
//! - [`exchange`]: several ranks: the gradients averaged over the ranks in buckets that leave
//!   while the backward pass runs.
//!
//! The `step_executor` stage's `impl = "engine"` trains with it ([`crate::train`]); the
//! checks against candle's autograd are in `tests.rs`.

pub mod backend;
#[cfg(any(test, feature = "tools"))]
pub mod cases;
pub mod cpu;
pub mod evaluate;
pub mod exchange;
pub mod gpu;
pub mod layout;
pub mod lora;
mod lora_ops;
pub mod lt;
#[cfg(any(test, feature = "tools"))]
pub mod model_check;
pub mod op;
#[cfg(test)]
#[cfg(any(test, feature = "tools"))]
mod op_checks;
pub mod optim;
pub mod schedule;
pub mod step;
pub mod support;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(feature = "tools")]
pub mod timed;

pub use step::Engine;
