//! Optimizers and schedules of the baseline record: Muon for the block matrices, Adam for the
//! token embedding and the scalar/control parameters, the Muon momentum warm-up, and the LR
//! warm-down with the wall-clock cap.
//!
//! Specification: `/work/shared/research/record_spec.md` §3.6 (optimizers) and §3.7 (LR schedule
//! and wall-clock cap); the formulas below are those of the challenge's `train_gpt.py`.
//!
//! # Muon (§3.6)
//!
//! For a matrix parameter `P` with gradient `G`, momentum `μ` and Nesterov on:
//!
//! ```text
//! buf ← μ·buf + G
//! U   = G + μ·buf                       (Nesterov; without it U = buf)
//! O   = NS5(U)                          (Newton–Schulz orthogonalization, below)
//! O   ← O · sqrt(max(1, rows/cols))     (only tall matrices are scaled up)
//! P   ← P − lr·O
//! ```
//!
//! `NS5` ([`newton_schulz5`]) approximately replaces `U = W Σ Vᵀ` by `W Vᵀ` (all singular values
//! pushed towards 1) with the quintic iteration of the record: `X = U / (‖U‖_F + 1e-7)`; work on
//! `Xᵀ` when `rows > cols` (so that `X·Xᵀ` is the small Gram matrix); repeat
//! `A = X·Xᵀ, B = b·A + c·A·A, X = a·X + B·X` with `(a, b, c) = (3.4445, −4.7750, 2.0315)`;
//! transpose back. On each singular value `s` one iteration is the odd polynomial
//! `s ↦ a·s + b·s³ + c·s⁵`, whose coefficients trade exact convergence for speed: after five
//! steps every normalized singular value in `[0.003, 1]` lands in about `[0.68, 1.14]` rather than
//! exactly at 1 (smaller ones are still on their way up: `1e-3 ↦ 0.47`, `1e-4 ↦ 0.05`).
//!
//! # Adam (§3.6)
//!
//! `torch.optim.Adam` without weight decay, step count `t` starting at 1:
//!
//! ```text
//! m ← β1·m + (1 − β1)·g
//! v ← β2·v + (1 − β2)·g²
//! p ← p − lr · (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + eps)
//! ```
//!
//! (computed as torch does: `denom = sqrt(v)/sqrt(1 − β2^t) + eps`, `p ← p − (lr/(1 − β1^t))·m/denom`).
//!
//! # Schedules (§3.6, §3.7)
//!
//! [`momentum_at`] is the Muon momentum warm-up `μ = (1 − f)·start + f·end`, `f = min(step/W, 1)`.
//! [`lr_multiplier`] is the factor every group's `base_lr` is multiplied by each step: a linear
//! warm-down to 0, time-based when a wall-clock cap is set, step-based otherwise.
//!
//! # Precision
//!
//! Everything is computed in the dtype of the parameters and gradients (f32 on the CPU backend).
//! The record runs `NS5` in bf16 on the GPU (`G.bfloat16()`, update cast back to the parameter
//! dtype); that variant is not implemented here yet: callers that want it can cast `U` before
//! calling [`newton_schulz5`].
//!
//! # Checkpoints
//!
//! Both optimizers expose their state as named tensors ([`Muon::state_tensors`],
//! [`Adam::state_tensors`]) and load it back with a name and shape check
//! ([`Muon::load_state_tensors`], [`Adam::load_state_tensors`]). The names start with a prefix
//! (`muon` / `adam` by default; see [`Muon::with_prefix`], [`Adam::with_prefix`]), so two
//! optimizers saved into one checkpoint (the record has two Adam groups) need distinct prefixes.

mod adam;
mod muon;
mod newton_schulz;
mod schedule;
mod sgd;
mod state;

pub use adam::Adam;
pub use muon::Muon;
pub use newton_schulz::{NS5_COEFFS, NS5_EPS, newton_schulz5};
pub use schedule::{lr_multiplier, momentum_at};
pub use sgd::Sgd;

#[cfg(test)]
mod tests;
