//! Optimizers and schedules of the baseline record: Muon for the block matrices, Adam for the
//! token embedding and the scalar/control parameters, the Muon momentum warm-up, and the LR
//! warm-down with the wall-clock cap; and the 04-09 record's additions, each off by default:
//! MuonEq-R row normalisation, decoupled weight decay in Muon, AdamW, and the warm-down on the
//! training fraction.
//!
//! Specification: `/work/shared/research/record_spec.md` §3.6 (optimizers), §3.7 (LR schedule
//! and wall-clock cap) and §4.4 (the 04-09 record's training); the formulas below are those of
//! the challenge's `train_gpt.py` and of the record's script.
//!
//! # Muon (§3.6)
//!
//! For a matrix parameter `P` with gradient `G`, momentum `μ` and Nesterov on:
//!
//! ```text
//! buf ← μ·buf + G
//! U   = G + μ·buf                       (Nesterov; without it U = buf)
//! U   ← U / max(‖U_i‖, 1e-7), each row i   (MuonEq-R; only with row normalisation)
//! O   = NS5(U)                          (Newton–Schulz orthogonalization, below)
//! O   ← O · sqrt(max(1, rows/cols))     (only tall matrices are scaled up)
//! P   ← P · (1 − lr·wd)                 (decoupled weight decay; skipped when wd = 0)
//! P   ← P − lr·O
//! ```
//!
//! **MuonEq-R** ([`Muon::with_row_norm`], 04-09 §4.4) equalises the rows before the
//! orthogonalization: every row of `U` gets unit L2 norm (computed in f32 or wider; a row below
//! `1e-7` is divided by `1e-7`, so a zero row stays zero). NS5 then normalizes by the Frobenius
//! norm as before (`‖U‖_F = sqrt(rows)` for nonzero rows).
//!
//! **Decoupled weight decay** ([`Muon::with_weight_decay`], the record: 0.095) shrinks the
//! weights towards 0 by `lr·wd` of themselves each step, at the step's scheduled `lr`, apart
//! from the gradient (so at `lr = 0.022`, `1 − 0.022·0.095 = 0.99791` per step at full LR).
//! Like the record's Muon it applies to every parameter of the group, one without a gradient
//! in that step included.
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
//! # Adam (§3.6) and AdamW (§4.4)
//!
//! `torch.optim.Adam` without weight decay, step count `t` starting at 1; `torch.optim.AdamW`
//! with weight decay `wd` ([`Adam::with_weight_decay`]; the record: 0.085 on the embedding, 0.02
//! on the scalars), whose first line is skipped when `wd = 0`:
//!
//! ```text
//! p ← p · (1 − lr·wd)                   (AdamW only)
//! m ← β1·m + (1 − β1)·g
//! v ← β2·v + (1 − β2)·g²
//! p ← p − lr · (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + eps)
//! ```
//!
//! (computed as torch does: `denom = sqrt(v)/sqrt(1 − β2^t) + eps`, `p ← p − (lr/(1 − β1^t))·m/denom`).
//!
//! The decay applies to every parameter with a gradient in `grads`, a zero one included (the
//! record's skip-weight rows that get no signal before looping starts still shrink by
//! `1 − lr·wd` each step); a parameter missing from `grads` is skipped whole, as torch skips
//! `p.grad is None`.
//!
//! # Schedules (§3.6, §3.7)
//!
//! [`momentum_at`] is the Muon momentum warm-up `μ = (1 − f)·start + f·end`, `f = min(step/W, 1)`.
//! [`lr_multiplier`] is the factor every group's `base_lr` is multiplied by each step: a linear
//! warm-down to 0, time-based when a wall-clock cap is set, step-based otherwise.
//!
//! The 04-09 record's schedule (§4.4) reads the **training fraction** [`training_frac`]:
//! `frac = elapsed_ms / cap_ms` under a cap (`cap_ms` the cap less the GPTQ reserve; training time
//! only), else `step / iterations`. [`lr_multiplier_frac`] is then
//!
//! ```text
//! lr_mul = 1                                        while frac < 1 − warmdown_frac
//!        = max((1 − frac) / warmdown_frac, min_lr)  after
//! ```
//!
//! (the record: `warmdown_frac = 0.72`, `min_lr = 0`: full LR for the first 28 % of the budget,
//! then linear to 0). Every group's decay factor `1 − lr·wd` follows the same multiplier.
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

#[cfg(feature = "candle")]
pub use adam::Adam;
#[cfg(feature = "candle")]
pub use muon::Muon;
pub use muon::ROW_NORM_EPS;
pub use newton_schulz::{NS5_COEFFS, NS5_EPS, NewtonSchulz, POLAR_EXPRESS_COEFFS};
#[cfg(feature = "tools")]
pub use newton_schulz::{newton_schulz, newton_schulz5};
pub use schedule::{lr_multiplier, lr_multiplier_frac, momentum_at, training_frac};
#[cfg(feature = "candle")]
pub use sgd::Sgd;

#[cfg(test)]
mod tests;
