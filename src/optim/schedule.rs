//! The schedules of §3.6 and §3.7: the Muon momentum warm-up and the LR multiplier (linear
//! warm-down to 0, time-based under a wall-clock cap); and the 04-09 record's warm-down on the
//! training fraction (§4.4).

/// The Muon momentum warm-up (§3.6): `(1 − f)·start + f·end` with `f = min(step/warmup_steps, 1)`.
///
/// `warmup_steps == 0` means no warm-up: the result is `end`. The record uses
/// `start = 0.85, end = 0.95, warmup_steps = 500`.
pub fn momentum_at(step: u64, warmup_steps: u64, start: f64, end: f64) -> f64 {
    let f = if warmup_steps == 0 { 1.0 } else { (step as f64 / warmup_steps as f64).min(1.0) };
    (1.0 - f) * start + f * end
}

/// The LR multiplier of §3.7 (no warm-up, linear warm-down to 0); every group uses
/// `lr = base_lr · lr_multiplier(..)`.
///
/// * `step ≥ iterations`: 0, whatever else holds. No such step is ever trained (the trainer
///   refuses it); if one were, it must not move the weights at the full LR, as `train_gpt.py`'s
///   1 would.
/// * `warmdown_iters == 0`: always 1.
/// * Time-based, when `max_wallclock_ms > 0`: with `step_ms = elapsed_ms / max(step, 1)`,
///   `wd_ms = warmdown_iters · step_ms` and `remaining = max(max_wallclock_ms − elapsed_ms, 0)`,
///   the result is `remaining / max(wd_ms, 1e-9)` when `remaining ≤ wd_ms`, else 1. So the LR falls
///   linearly to 0 over the estimated last `warmdown_iters` steps before the cap, and is 0 once
///   the cap has passed. `elapsed_ms` is training time only (validation excluded).
/// * Step-based, when `max_wallclock_ms ≤ 0` (cap disabled): during the last `warmdown_iters`
///   steps (`iterations − warmdown_iters ≤ step < iterations`) the result is
///   `(iterations − step) / warmdown_iters`, else 1.
pub fn lr_multiplier(step: u64, iterations: u64, warmdown_iters: u64, elapsed_ms: f64, max_wallclock_ms: f64) -> f64 {
    if step >= iterations {
        return 0.0;
    }
    if warmdown_iters == 0 {
        return 1.0;
    }
    if max_wallclock_ms > 0.0 {
        let step_ms = elapsed_ms / step.max(1) as f64;
        let warmdown_ms = warmdown_iters as f64 * step_ms;
        let remaining_ms = (max_wallclock_ms - elapsed_ms).max(0.0);
        if remaining_ms <= warmdown_ms { remaining_ms / warmdown_ms.max(1e-9) } else { 1.0 }
    } else {
        let warmdown_start = iterations.saturating_sub(warmdown_iters);
        if warmdown_start <= step && step < iterations { ((iterations - step) as f64 / warmdown_iters as f64).max(0.0) } else { 1.0 }
    }
}

/// The training fraction of the record's schedule (04-09, §4.4): how far through its budget a
/// run is when a step starts. With a cap (`cap_ms > 0`, the effective one: the wall-clock cap
/// less any reserve), `elapsed_ms / cap_ms`, training time only; without one,
/// `step / iterations` (`iterations == 0` counts as 1). Not clamped: past the cap it exceeds 1.
///
/// The LR warm-down ([`lr_multiplier_frac`]) and the model's depth-recurrence switch read this
/// same fraction.
pub fn training_frac(step: u64, iterations: u64, elapsed_ms: f64, cap_ms: f64) -> f64 {
    if cap_ms > 0.0 { elapsed_ms / cap_ms } else { step as f64 / iterations.max(1) as f64 }
}

/// The record's LR multiplier on the training fraction `frac` ([`training_frac`]), 04-09 §4.4:
/// 1 while `frac < 1 − warmdown_frac`, then `max((1 − frac) / warmdown_frac, min_lr)`, so a
/// linear decay to `min_lr` over the last `warmdown_frac` of the budget (the record: 0.72 and
/// 0, so 1 up to frac 0.28, 0.5 at 0.64, 0 at 1; past the budget `min_lr`).
///
/// `warmdown_frac ≤ 0` means no warm-down: always 1. The caller keeps the rule that a step at
/// or past `iterations` gets 0 (see [`lr_multiplier`]).
pub fn lr_multiplier_frac(frac: f64, warmdown_frac: f64, min_lr: f64) -> f64 {
    if warmdown_frac <= 0.0 || frac < 1.0 - warmdown_frac { 1.0 } else { ((1.0 - frac) / warmdown_frac).max(min_lr) }
}
