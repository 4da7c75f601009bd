//! The trial behind `attention = "auto"`: an attention implementation runs the forward and
//! backward pass of one micro-batch's attention at the run's shapes, timed (its first pass's
//! output and gradients must be finite), after a check against the materialised attention in
//! f32 ([`ops::causal_attention_tokens`]) on random inputs of two sequences of the run's
//! length (shorter only where the reference's scores would pass [`CHECK_SCORE_BYTES`]). The
//! check compares the output and the q, k, v gradients block by block (one head's 64-row tile
//! of a sequence: the flash kernels' unit of work), so a wrong tile is not diluted by the rest.
//!
//! [`trial`] takes any attention functions, so that its measurement and its rejections are
//! tested on the CPU; [`check_flash`] is one flash implementation's trial, which
//! [`crate::train::attention_choice`] runs in a child process per implementation (a kernel that faults
//! the GPU cannot take the training process's CUDA context with it); [`choose`] picks from the
//! outcomes.

#[cfg(feature = "candle")]
use std::time::Instant;

use candle_core::DType;
#[cfg(feature = "candle")]
use candle_core::{Device, Result, Tensor, Var};
use serde::{Deserialize, Serialize};

#[cfg(feature = "candle")]
use crate::model::compare::Blocks;
#[cfg(feature = "candle")]
use crate::model::compare::{blockwise_rel_err, worst};
#[cfg(feature = "candle")]
use crate::model::flash_attn::{self, FlashKernels};
#[cfg(feature = "candle")]
use crate::model::ops;

/// Largest blockwise relative error of a bf16 flash implementation against the f32 reference.
/// Rounding the inputs and the results to bf16 alone puts the worst 64-row tile of a head at
/// 4.5e-3 (`tests::bf16_rounding_alone_passes_the_flash_check`, where a bias of 0.01 shows
/// 9.6e-2); the kernels also round probabilities and score gradients to bf16, and their
/// errors over whole tensors measured 3-4e-3 on an H100.
pub const FLASH_TOLERANCE: f64 = 3e-2;
/// Bytes of one `(B, H, T, T)` f32 score tensor the agreement check's reference may store: the
/// check runs at the run's own sequence length unless that would exceed it (the baseline's two
/// sequences of 1024 tokens, 8 heads: 64 MiB).
pub const CHECK_SCORE_BYTES: usize = 256 << 20;
/// Rows of a check block (the flash kernels' tile).
const CHECK_TILE: usize = 64;

/// Shapes of one micro-batch's attention: `batch` sequences of `t` tokens, `heads` query heads
/// over `kv_heads` KV heads of `head_dim` channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttentionShape {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// The agreement check's shape: at most `batch` sequences, as long as the run's unless
    /// their scores would pass [`CHECK_SCORE_BYTES`] (then the longest multiple of 64 that fits,
    /// at least 64).
    fn check(self, batch: usize) -> Self {
        let batch = batch.clamp(1, self.batch.max(1));
        let per_t2 = batch * self.heads.max(1) * 4;
        let fits = ((CHECK_SCORE_BYTES / per_t2) as f64).sqrt() as usize;
        let t = if self.t <= fits { self.t } else { (fits / CHECK_TILE * CHECK_TILE).max(CHECK_TILE).min(self.t) };
        Self { batch, t, ..self }
    }

    /// How the output and the q, k, v gradients split into check blocks: per sequence, per
    /// 64-row tile, per head.
    #[cfg(feature = "candle")]
    fn blocks(self) -> [Blocks; 4] {
        let tile = CHECK_TILE.min(self.t.max(1));
        let q = Blocks { cols: self.heads * self.head_dim, seq_rows: self.t, block_rows: tile, block_cols: self.head_dim };
        let kv = Blocks { cols: self.kv_heads * self.head_dim, ..q };
        [q, q, kv, kv]
    }
}

/// An attention implementation under trial: token-major `(q, k, v)` of `shape` to the output.
#[cfg(feature = "candle")]
pub type AttentionFn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor, AttentionShape) -> Result<Tensor>;

/// What one candidate measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The candidate's name.
    pub name: String,
    /// Worst blockwise relative error of its output and its q, k, v gradients against the
    /// reference; `None` where it did not run.
    pub rel_err: Option<f64>,
    /// Median time of one forward and backward pass at the full shape (ms, host clock around
    /// device synchronisations); `None` where it was left out before or during timing.
    pub ms: Option<f64>,
    /// Why it was left out (an error, a disagreement); `None` for an eligible candidate.
    pub rejected: Option<String>,
}

impl Outcome {
    /// An outcome that never ran: `name` left out for `why`.
    pub fn left_out(name: &str, why: String) -> Self {
        Self { name: name.into(), rel_err: None, ms: None, rejected: Some(why) }
    }
}

/// How a trial runs.
#[derive(Clone, Copy, Debug)]
pub struct TrialSettings {
    /// The candidates' dtype (the reference runs in f32).
    pub dtype: DType,
    /// Sequences of the agreement check (at most the shape's batch).
    pub check_batch: usize,
    /// Largest blockwise relative error a candidate may show.
    pub tolerance: f64,
    /// How long untimed passes warm up (clocks, caches, the kernels' first loads) after the
    /// first pass, before the timed ones.
    pub warm_up: std::time::Duration,
    /// Timed passes; the median counts.
    pub reps: usize,
    /// Seed of the check's random inputs.
    pub seed: u64,
}

impl TrialSettings {
    /// The settings of the flash implementations' trial: bf16, two check sequences,
    /// [`FLASH_TOLERANCE`], 300 ms of warm-up, ten timed passes.
    pub fn flash() -> Self {
        Self {
            dtype: DType::BF16,
            check_batch: 2,
            tolerance: FLASH_TOLERANCE,
            warm_up: std::time::Duration::from_millis(300),
            reps: 10,
            seed: 0x5eed,
        }
    }
}

/// Runs every candidate on `device`: the agreement check against `reference` (in f32), then,
/// for those that agree, timed forward and backward passes at the full `shape`. Errors only
/// where the reference itself fails; a candidate's error leaves it out.
#[cfg(feature = "candle")]
pub fn trial(
    device: &Device,
    shape: AttentionShape,
    candidates: &[(&str, AttentionFn<'_>)],
    reference: AttentionFn<'_>,
    settings: TrialSettings,
) -> anyhow::Result<Vec<Outcome>> {
    use anyhow::Context;
    let check = shape.check(settings.check_batch);
    let inputs = Inputs::random(check, settings.seed, device)?;
    let want = inputs
        .run(reference, check, DType::F32)
        .map_err(|e| anyhow::anyhow!("{}", first_line(&e)))
        .with_context(|| format!("the attention trial's f32 reference ({}x{} tokens) failed", check.batch, check.t))?;
    let mut outcomes = Vec::with_capacity(candidates.len());
    for &(name, f) in candidates {
        let mut outcome = Outcome { name: name.into(), rel_err: None, ms: None, rejected: None };
        match inputs.run(f, check, settings.dtype) {
            Err(e) => outcome.rejected = Some(format!("failed: {}", first_line(&e))),
            Ok(got) => {
                let err = worst(got.iter().zip(&want).zip(check.blocks()).map(|((g, w), b)| blockwise_rel_err(g, w, b)));
                outcome.rel_err = Some(err);
                // A NaN error is a disagreement too.
                if err.is_nan() || err > settings.tolerance {
                    outcome.rejected = Some(format!("disagrees with the materialised attention: blockwise rel err {err:.2e}"));
                }
            }
        }
        if outcome.rejected.is_none() {
            match time(device, f, shape, settings) {
                Ok(ms) => outcome.ms = Some(ms),
                Err(e) => outcome.rejected = Some(format!("failed at the full shape: {}", first_line(&e))),
            }
        }
        outcomes.push(outcome);
    }
    Ok(outcomes)
}

/// The choice among `outcomes`: the first eligible one (the incumbent) unless another eligible
/// one is faster by more than `margin` (a fraction of the incumbent's time), then the fastest
/// of those. The margin keeps near-ties on the incumbent, so that timing noise does not change
/// the kernels (and the bits) from one run to the next.
pub fn choose(outcomes: &[Outcome], margin: f64) -> Option<&Outcome> {
    let timed = |o: &&Outcome| o.rejected.is_none() && o.ms.is_some_and(f64::is_finite);
    let mut eligible = outcomes.iter().filter(timed);
    let incumbent = eligible.next()?;
    let bar = incumbent.ms? * (1.0 - margin);
    let challenger = eligible
        .filter(|o| o.ms.is_some_and(|ms| ms < bar))
        .min_by(|a, b| a.ms.unwrap_or(f64::INFINITY).total_cmp(&b.ms.unwrap_or(f64::INFINITY)));
    Some(challenger.unwrap_or(incumbent))
}

/// One line for the train log: every candidate's time and error, or why it was left out.
pub fn summary(outcomes: &[Outcome], shape: AttentionShape, settings: TrialSettings) -> String {
    let parts: Vec<String> = outcomes
        .iter()
        .map(|o| match (&o.rejected, o.ms, o.rel_err) {
            (Some(why), _, _) => format!("{} left out ({why})", o.name),
            (None, Some(ms), Some(err)) => format!("{} {ms:.2} ms rel_err {err:.1e}", o.name),
            (None, _, _) => format!("{} not measured", o.name),
        })
        .collect();
    let check = shape.check(settings.check_batch);
    format!(
        "median forward+backward of {}x{} tokens, {}/{} heads (check on {}x{}): {}",
        shape.batch,
        shape.t,
        shape.heads,
        shape.kv_heads,
        check.batch,
        check.t,
        parts.join(", ")
    )
}

/// One flash implementation's trial on `device` at `shape` ([`TrialSettings::flash`]): what a
/// child process of [`crate::train::attention_choice`] measures and prints.
#[cfg(feature = "candle")]
pub fn check_flash(device: &Device, kernels: FlashKernels, shape: AttentionShape) -> anyhow::Result<Outcome> {
    if kernels == FlashKernels::Cudnn {
        // cuDNN falls back to flash_mma where it cannot run: the trial must not time that.
        let check = shape.check(TrialSettings::flash().check_batch);
        for s in [shape, check] {
            if let Some(why) = flash_attn::cudnn_unavailable(device, s.batch, s.t, s.heads, s.kv_heads, s.head_dim, false) {
                return Ok(Outcome::left_out(kernels.name(), why));
            }
        }
    }
    let flash = move |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| {
        flash_attn::flash_attention(q, k, v, s.batch, s.heads, s.kv_heads, kernels)
    };
    let reference =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| ops::causal_attention_tokens(q, k, v, s.batch, s.heads, s.kv_heads);
    let mut outcomes = trial(device, shape, &[(kernels.name(), &flash)], &reference, TrialSettings::flash())?;
    outcomes.pop().ok_or_else(|| anyhow::anyhow!("the trial gave no outcome"))
}

/// Random q, k, v and an output gradient of one shape, on the host in f64.
#[cfg(feature = "candle")]
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad: Tensor,
    device: Device,
}

#[cfg(feature = "candle")]
impl Inputs {
    fn random(s: AttentionShape, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = fastrand::Rng::with_seed(seed);
        let n = s.batch * s.t;
        let mut normal = |cols: usize| -> Result<Tensor> {
            // Unit variance: scores of about unit spread at the 1/sqrt(head_dim) scale.
            let v: Vec<f64> = (0..n * cols).map(|_| (rng.f64() + rng.f64() + rng.f64() - 1.5) * 2.0).collect();
            Tensor::from_vec(v, (n, cols), &Device::Cpu)
        };
        let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        Ok(Self { q: normal(qw)?, k: normal(kw)?, v: normal(kw)?, grad: normal(qw)?, device: device.clone() })
    }

    /// `f`'s output and q, k, v gradients (under the random output gradient) in `dtype`, back
    /// on the host in f64.
    fn run(&self, f: AttentionFn<'_>, s: AttentionShape, dtype: DType) -> Result<[Vec<f64>; 4]> {
        let var = |t: &Tensor| Var::from_tensor(&t.to_dtype(dtype)?.to_device(&self.device)?);
        let (q, k, v) = (var(&self.q)?, var(&self.k)?, var(&self.v)?);
        let y = f(q.as_tensor(), k.as_tensor(), v.as_tensor(), s)?;
        let g = self.grad.to_dtype(y.dtype())?.to_device(&self.device)?;
        let grads = (&y * g)?.sum_all()?.backward()?;
        let host = |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1() };
        let grad = |x: &Var| -> Result<Vec<f64>> {
            host(grads.get(x.as_tensor()).ok_or_else(|| candle_core::Error::Msg("the attention gave no input gradient".into()))?)
        };
        Ok([host(&y)?, grad(&q)?, grad(&k)?, grad(&v)?])
    }
}

/// Median time (ms) of one forward and backward pass of `f` at `shape`, after the settings'
/// warm-up. The inputs are drawn on the device (their values do not change the kernels' work);
/// the first pass's output and gradients must be finite, so a kernel that goes wrong only at
/// the full shape (more tiles, a larger grid) is an error here.
#[cfg(feature = "candle")]
fn time(device: &Device, f: AttentionFn<'_>, shape: AttentionShape, settings: TrialSettings) -> Result<f64> {
    let n = shape.batch * shape.t;
    let var = |heads: usize| Var::from_tensor(&Tensor::randn(0f32, 1f32, (n, heads * shape.head_dim), device)?.to_dtype(settings.dtype)?);
    let (q, k, v) = (var(shape.heads)?, var(shape.kv_heads)?, var(shape.kv_heads)?);
    // The output's own backward pass (a gradient of ones): the kernels' cost does not depend
    // on the gradient's values.
    let pass = || -> Result<(Tensor, candle_core::backprop::GradStore)> {
        let y = f(q.as_tensor(), k.as_tensor(), v.as_tensor(), shape)?;
        let grads = y.backward()?;
        Ok((y, grads))
    };
    let (y, grads) = pass()?;
    for (what, t) in [
        ("output", Some(&y)),
        ("q gradient", grads.get(q.as_tensor())),
        ("k gradient", grads.get(k.as_tensor())),
        ("v gradient", grads.get(v.as_tensor())),
    ] {
        let t = t.ok_or_else(|| candle_core::Error::Msg(format!("no {what}")))?;
        let sq = t.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_scalar::<f32>()?;
        if !sq.is_finite() {
            candle_core::bail!("the {what} at the full shape is not finite (sum of squares {sq})");
        }
    }
    drop((y, grads));
    let warm = Instant::now();
    while warm.elapsed() < settings.warm_up {
        drop(pass()?);
        device.synchronize()?;
    }
    let mut ms = Vec::with_capacity(settings.reps.max(1));
    for _ in 0..settings.reps.max(1) {
        let start = Instant::now();
        drop(pass()?);
        device.synchronize()?;
        ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// An error's message without the backtrace candle appends under `RUST_BACKTRACE`.
#[cfg(feature = "candle")]
fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: AttentionShape = AttentionShape { batch: 3, t: 24, heads: 4, kv_heads: 2, head_dim: 8 };

    fn settings() -> TrialSettings {
        TrialSettings { dtype: DType::F64, check_batch: 2, tolerance: 1e-3, warm_up: std::time::Duration::ZERO, reps: 2, seed: 7 }
    }

    fn exact(q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape) -> Result<Tensor> {
        ops::causal_attention_tokens(q, k, v, s.batch, s.heads, s.kv_heads)
    }

    /// The attention in f64 agrees with the f32 reference (closely, not exactly: the reference
    /// really ran in f32) and is timed; a candidate that mixes in the next token's value, one
    /// that adds a small bias, one that fails and one with a NaN in its output are left out,
    /// each with its reason.
    #[test]
    fn trial_keeps_the_correct_attention_and_leaves_out_wrong_or_failing_ones() {
        let peek = |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| -> Result<Tensor> {
            // Each query also sees the next token's value: shift v up by one row within a sequence.
            let d = s.kv_heads * s.head_dim;
            let v3 = v.reshape((s.batch, s.t, d))?;
            let next = Tensor::cat(&[v3.narrow(1, 1, s.t - 1)?, v3.narrow(1, s.t - 1, 1)?], 1)?.reshape((s.batch * s.t, d))?;
            exact(q, k, &((v * 0.5)? + (next * 0.5)?)?, s)
        };
        let biased = |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| exact(q, k, v, s)? + 0.01;
        let failing = |_: &Tensor, _: &Tensor, _: &Tensor, _: AttentionShape| -> Result<Tensor> { candle_core::bail!("no kernel image") };
        // One NaN in the output (a NaN error must not pass as the largest of the others).
        let nan = |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| -> Result<Tensor> {
            let y = exact(q, k, v, s)?;
            let mut mask = vec![0.0f64; y.elem_count()];
            mask[5] = f64::NAN;
            let mask = Tensor::from_vec(mask, y.shape(), y.device())?.to_dtype(y.dtype())?;
            y + mask
        };
        let candidates: [(&str, AttentionFn<'_>); 5] =
            [("peek", &peek), ("exact", &exact), ("biased", &biased), ("failing", &failing), ("nan", &nan)];
        let out = trial(&Device::Cpu, SHAPE, &candidates, &exact, settings()).unwrap();
        assert_eq!(out.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(), ["peek", "exact", "biased", "failing", "nan"]);

        let ok = &out[1];
        assert!(ok.rejected.is_none(), "{ok:?}");
        let err = ok.rel_err.unwrap();
        assert!(err > 0.0 && err < 1e-6, "f64 against the f32 reference: {err}");
        assert!(ok.ms.is_some_and(|ms| ms.is_finite() && ms > 0.0), "{ok:?}");

        for wrong in [&out[0], &out[2]] {
            let why = wrong.rejected.as_deref().unwrap_or_default();
            assert!(why.contains("disagrees") && wrong.rel_err.unwrap() > 1e-3 && wrong.ms.is_none(), "{wrong:?}");
        }
        assert!(out[3].rejected.as_deref().is_some_and(|w| w.contains("no kernel image")) && out[3].rel_err.is_none(), "{:?}", out[3]);
        assert!(
            out[4].rel_err.is_some_and(f64::is_nan) && out[4].rejected.as_deref().is_some_and(|w| w.contains("disagrees")),
            "{:?}",
            out[4]
        );

        assert_eq!(choose(&out, 0.05).map(|o| o.name.as_str()), Some("exact"));
        let line = summary(&out, SHAPE, settings());
        assert!(line.starts_with("median forward+backward of 3x24 tokens, 4/2 heads (check on 2x24): peek left out (disagrees"), "{line}");
        assert!(line.contains("exact ") && line.contains("failing left out (failed: no kernel image)"), "{line}");
    }

    /// At the production settings (bf16 against f32, [`FLASH_TOLERANCE`], 64-row tiles of
    /// head dim 64), the exact maths on bf16-rounded inputs with a bf16-rounded result passes
    /// with room; wrong attention does not: one tile of one head of one sequence off by 20%
    /// (which a whole-tensor norm dilutes under the tolerance, asserted), a bias of 0.01, and
    /// keys and values one token off (each query sees the next key, not the first).
    #[test]
    fn bf16_rounding_alone_passes_the_flash_check() {
        let shape = AttentionShape { batch: 2, t: 256, heads: 8, kv_heads: 4, head_dim: 64 };
        // Timing is not what this test is about: one timed pass, no warm-up (the CPU is slow).
        let settings = TrialSettings { reps: 1, warm_up: std::time::Duration::ZERO, ..TrialSettings::flash() };
        // The candidates get bf16 q, k, v; each computes in f32 and rounds its result to bf16.
        let f32_exact = |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| -> Result<Tensor> {
            exact(&q.to_dtype(DType::F32)?, &k.to_dtype(DType::F32)?, &v.to_dtype(DType::F32)?, s)
        };
        let rounded = |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| f32_exact(q, k, v, s)?.to_dtype(DType::BF16);
        // Scales one head's columns over rows `rows` of the output.
        let scaled = |rows: std::ops::Range<usize>, head: usize, by: f32| {
            move |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| -> Result<Tensor> {
                let y = f32_exact(q, k, v, s)?;
                let cols = s.heads * s.head_dim;
                let mut mask = vec![1f32; y.elem_count()];
                for r in rows.clone() {
                    mask[r * cols + head * s.head_dim..r * cols + (head + 1) * s.head_dim].fill(by);
                }
                (y * Tensor::from_vec(mask, (s.batch * s.t, cols), q.device())?)?.to_dtype(DType::BF16)
            }
        };
        let one_tile = scaled(192..256, 1, 0.8);
        let biased = |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| (f32_exact(q, k, v, s)? + 0.01)?.to_dtype(DType::BF16);
        let next_key = |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| -> Result<Tensor> {
            // Keys and values shifted one token earlier: query i attends to keys 1..=i+1.
            let shift = |x: &Tensor| -> Result<Tensor> {
                let w = x.dim(1)?;
                let x3 = x.to_dtype(DType::F32)?.reshape((s.batch, s.t, w))?;
                Tensor::cat(&[x3.narrow(1, 1, s.t - 1)?, x3.narrow(1, s.t - 1, 1)?], 1)?.reshape((s.batch * s.t, w))
            };
            exact(&q.to_dtype(DType::F32)?, &shift(k)?, &shift(v)?, s)?.to_dtype(DType::BF16)
        };
        let candidates: [(&str, AttentionFn<'_>); 4] =
            [("rounded", &rounded), ("one_tile", &one_tile), ("biased", &biased), ("next_key", &next_key)];
        let out = trial(&Device::Cpu, shape, &candidates, &exact, settings).unwrap();
        let err = out[0].rel_err.unwrap();
        assert!(out[0].rejected.is_none() && err > 1e-3 && err < 1e-2, "{:?}", out[0]);
        for wrong in &out[1..] {
            assert!(wrong.rejected.as_deref().is_some_and(|w| w.contains("disagrees")), "{wrong:?} (rounding alone: {err:.2e})");
        }
        assert!(out[2].rel_err.unwrap() > 5e-2, "{:?}", out[2]);
        // The one-tile error over the whole output: under the tolerance, which is why the
        // check goes block by block.
        let inputs = Inputs::random(shape, settings.seed, &Device::Cpu).unwrap();
        let want = inputs.run(&exact, shape, DType::F32).unwrap();
        let got = inputs.run(&one_tile, shape, DType::BF16).unwrap();
        let whole = crate::model::compare::rel_err(&got[0], &want[0]);
        assert!(whole < FLASH_TOLERANCE && whole > err, "whole-output error {whole:.2e}");
    }

    /// The incumbent (the first eligible outcome) keeps the choice unless another is faster
    /// by more than the margin; rejected and untimed outcomes are never chosen; none eligible
    /// chooses nothing.
    #[test]
    fn choose_keeps_the_incumbent_within_the_margin() {
        let o = |name: &str, ms: Option<f64>, rejected: Option<&str>| Outcome {
            name: name.into(),
            rel_err: Some(1e-3),
            ms,
            rejected: rejected.map(Into::into),
        };
        let name = |out: &[Outcome]| choose(out, 0.05).map(|o| o.name.clone());
        assert_eq!(name(&[o("first", Some(10.0), None), o("close", Some(9.6), None)]).as_deref(), Some("first"));
        assert_eq!(name(&[o("first", Some(10.0), None), o("a", Some(9.0), None), o("b", Some(8.0), None)]).as_deref(), Some("b"));
        assert_eq!(name(&[o("wrong", Some(1.0), Some("disagrees")), o("slow", Some(9.0), None)]).as_deref(), Some("slow"));
        assert_eq!(name(&[o("nan", Some(f64::NAN), None), o("ok", Some(9.0), None)]).as_deref(), Some("ok"));
        assert_eq!(name(&[o("wrong", Some(1.0), Some("disagrees"))]), None);
        assert_eq!(name(&[o("untimed", None, None)]), None);
    }

    /// An outcome crosses the process boundary as JSON unchanged.
    #[test]
    fn outcomes_round_trip_through_json() {
        let o = Outcome { name: "flash_mma".into(), rel_err: Some(4.5e-3), ms: Some(3.25), rejected: None };
        let back: Outcome = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
        assert_eq!(back, o);
    }
}
