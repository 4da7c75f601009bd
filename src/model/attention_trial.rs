//! `attention = "auto"` on a GPU: before training, each flash implementation
//! ([`FlashKernels`]) runs the forward and backward pass of one micro-batch's attention at the
//! run's own shapes, timed, and is checked on a slice of the same inputs against the
//! materialised attention in f32 ([`fused::causal_attention_tokens`]). The fastest one that
//! agrees within the bf16 tolerance trains the run, and the train log says what was measured.
//! An implementation that fails to launch or disagrees is left out, so a kernel that was never
//! measured on the GPU at hand cannot silently train a run with wrong attention.
//!
//! The trial itself ([`trial`]) takes any attention functions, so that its measurement and its
//! rejections are tested on the CPU.

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor, Var};

use super::flash_attn::{self, FlashKernels};
use super::fused;
use crate::parity::{rel_err, worst};

/// Shapes of one micro-batch's attention: `batch` sequences of `t` tokens, `heads` query heads
/// over `kv_heads` KV heads of `head_dim` channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    fn with_batch(self, batch: usize) -> Self {
        Self { batch, ..self }
    }
}

/// An attention implementation under trial: token-major `(q, k, v)` of `shape` to the output.
pub type AttentionFn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor, AttentionShape) -> Result<Tensor>;

/// What one candidate measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The candidate's name.
    pub name: &'static str,
    /// Largest relative error (Frobenius norm) of its output and its q, k, v gradients against
    /// the reference, on the check slice; `None` where it did not run.
    pub rel_err: Option<f64>,
    /// Mean time of one forward and backward pass at the full shape (ms), host clock around a
    /// device synchronisation; `None` where it was left out before timing.
    pub ms: Option<f64>,
    /// Why it was left out (an error, or a disagreement); `None` for an eligible candidate.
    pub rejected: Option<String>,
}

/// How a trial runs.
#[derive(Clone, Copy, Debug)]
pub struct TrialSettings {
    /// The candidates' dtype (the reference runs in f32).
    pub dtype: DType,
    /// Sequences of the agreement check (at most the shape's batch).
    pub check_batch: usize,
    /// Largest relative error a candidate may show.
    pub tolerance: f64,
    /// Timed repetitions after one untimed warm-up pass.
    pub reps: usize,
    /// Seed of the random inputs.
    pub seed: u64,
}

/// Runs every candidate on `device`: the agreement check against `reference` (in f32) on
/// `settings.check_batch` sequences, then, for those that agree, `settings.reps` timed forward
/// and backward passes at the full `shape`. Errors only where the reference itself fails; a
/// candidate's error rejects it.
pub fn trial(
    device: &Device,
    shape: AttentionShape,
    candidates: &[(&'static str, AttentionFn<'_>)],
    reference: AttentionFn<'_>,
    settings: TrialSettings,
) -> Result<Vec<Outcome>> {
    let check = shape.with_batch(settings.check_batch.clamp(1, shape.batch.max(1)));
    let inputs = Inputs::random(check, settings.seed, device)?;
    let want = inputs.run(reference, check, DType::F32)?;
    let mut outcomes = Vec::with_capacity(candidates.len());
    for &(name, f) in candidates {
        let mut outcome = Outcome { name, rel_err: None, ms: None, rejected: None };
        match inputs.run(f, check, settings.dtype) {
            Err(e) => outcome.rejected = Some(format!("failed: {}", first_line(&e))),
            Ok(got) => {
                let err = worst(want.iter().zip(&got).map(|(w, g)| if g.len() == w.len() { rel_err(g, w) } else { f64::INFINITY }));
                outcome.rel_err = Some(err);
                // A NaN error is a disagreement too.
                if err.is_nan() || err > settings.tolerance {
                    outcome.rejected = Some(format!("disagrees with the materialised attention: rel err {err:.2e}"));
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

/// The fastest eligible candidate.
pub fn fastest(outcomes: &[Outcome]) -> Option<&Outcome> {
    outcomes
        .iter()
        .filter(|o| o.rejected.is_none())
        .filter_map(|o| o.ms.filter(|ms| ms.is_finite()).map(|ms| (o, ms)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(o, _)| o)
}

/// One line for the train log: every candidate's time and error, or why it was left out.
pub fn summary(outcomes: &[Outcome], shape: AttentionShape) -> String {
    let parts: Vec<String> = outcomes
        .iter()
        .map(|o| match (&o.rejected, o.ms, o.rel_err) {
            (Some(why), _, _) => format!("{} left out ({why})", o.name),
            (None, Some(ms), Some(err)) => format!("{} {ms:.2} ms rel_err {err:.1e}", o.name),
            (None, _, _) => format!("{} not measured", o.name),
        })
        .collect();
    format!(
        "{} per forward+backward of {}x{} tokens, {}/{} heads: {}",
        if outcomes.len() == 1 { "time" } else { "times" },
        shape.batch,
        shape.t,
        shape.heads,
        shape.kv_heads,
        parts.join(", ")
    )
}

/// The flash kernels `attention = "auto"` trains with on `device` for micro-batches of
/// `shape`: both implementations tried (bf16, against the materialised attention in f32 on two
/// sequences, three timed passes each), the fastest that agrees within the bf16 tolerance. The
/// string is the train log's account of the trial. An error where neither agrees.
pub fn choose_flash(device: &Device, shape: AttentionShape) -> anyhow::Result<(FlashKernels, String)> {
    let kinds = [FlashKernels::Wmma, FlashKernels::Mma];
    let run = |k: FlashKernels| {
        move |q: &Tensor, kk: &Tensor, v: &Tensor, s: AttentionShape| flash_attn::flash_attention(q, kk, v, s.batch, s.heads, s.kv_heads, k)
    };
    let (wmma, mma) = (run(kinds[0]), run(kinds[1]));
    let candidates: [(&'static str, AttentionFn<'_>); 2] = [(kinds[0].name(), &wmma), (kinds[1].name(), &mma)];
    let reference =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape| fused::causal_attention_tokens(q, k, v, s.batch, s.heads, s.kv_heads);
    let settings =
        TrialSettings { dtype: DType::BF16, check_batch: 2, tolerance: crate::parity::tolerance(DType::BF16), reps: 3, seed: 0x5eed };
    let outcomes = trial(device, shape, &candidates, &reference, settings)?;
    let line = summary(&outcomes, shape);
    let best = fastest(&outcomes)
        .ok_or_else(|| anyhow::anyhow!("no flash kernel runs correctly on this GPU ({line}); set attention = \"materialized\""))?;
    let chosen = kinds.into_iter().find(|k| k.name() == best.name).expect("a candidate's name");
    Ok((chosen, line))
}

/// Random q, k, v and an output gradient of one shape, on the host in f64.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    grad: Tensor,
    device: Device,
}

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

/// Mean time (ms) of one forward and backward pass of `f` at `shape` after one warm-up pass.
fn time(device: &Device, f: AttentionFn<'_>, shape: AttentionShape, settings: TrialSettings) -> Result<f64> {
    let inputs = Inputs::random(shape, settings.seed ^ 1, device)?;
    let var = |t: &Tensor| Var::from_tensor(&t.to_dtype(settings.dtype)?.to_device(device)?);
    let (q, k, v) = (var(&inputs.q)?, var(&inputs.k)?, var(&inputs.v)?);
    let pass = || -> Result<()> {
        // The output's own backward pass (a gradient of ones): the kernels' cost does not
        // depend on the gradient's values.
        f(q.as_tensor(), k.as_tensor(), v.as_tensor(), shape)?.backward().map(drop)
    };
    pass()?;
    device.synchronize()?;
    let start = Instant::now();
    for _ in 0..settings.reps.max(1) {
        pass()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() * 1e3 / settings.reps.max(1) as f64)
}

/// An error's message without the backtrace candle appends under `RUST_BACKTRACE`.
fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: AttentionShape = AttentionShape { batch: 3, t: 24, heads: 4, kv_heads: 2, head_dim: 8 };

    fn settings() -> TrialSettings {
        TrialSettings { dtype: DType::F64, check_batch: 2, tolerance: 1e-3, reps: 2, seed: 7 }
    }

    fn exact(q: &Tensor, k: &Tensor, v: &Tensor, s: AttentionShape) -> Result<Tensor> {
        fused::causal_attention_tokens(q, k, v, s.batch, s.heads, s.kv_heads)
    }

    /// The attention in f64 agrees with the f32 reference (closely, not exactly: the reference
    /// really ran in f32) and is timed; a candidate that mixes in the next token's value, one
    /// that adds a small bias, one that fails and one with a NaN in its output are left out,
    /// each with its reason; the fastest eligible candidate is the one chosen.
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
        let candidates: [(&'static str, AttentionFn<'_>); 5] =
            [("peek", &peek), ("exact", &exact), ("biased", &biased), ("failing", &failing), ("nan", &nan)];
        let out = trial(&Device::Cpu, SHAPE, &candidates, &exact, settings()).unwrap();
        assert_eq!(out.iter().map(|o| o.name).collect::<Vec<_>>(), ["peek", "exact", "biased", "failing", "nan"]);
        assert!(
            out[4].rel_err.is_some_and(f64::is_nan) && out[4].rejected.as_deref().is_some_and(|w| w.contains("disagrees")),
            "{:?}",
            out[4]
        );

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

        assert_eq!(fastest(&out).map(|o| o.name), Some("exact"));
        let line = summary(&out, SHAPE);
        assert!(line.starts_with("times per forward+backward of 3x24 tokens, 4/2 heads: peek left out (disagrees"), "{line}");
        assert!(line.contains("exact ") && line.contains("failing left out (failed: no kernel image)"), "{line}");
    }

    /// The choice is the fastest eligible outcome: a faster rejected one or one without a time
    /// is never chosen; none eligible chooses nothing.
    #[test]
    fn fastest_skips_rejected_and_untimed_outcomes() {
        let o =
            |name, ms: Option<f64>, rejected: Option<&str>| Outcome { name, rel_err: Some(1e-3), ms, rejected: rejected.map(Into::into) };
        let out = [
            o("slow", Some(9.0), None),
            o("wrong", Some(1.0), Some("disagrees")),
            o("fast", Some(4.0), None),
            o("nan", Some(f64::NAN), None),
        ];
        assert_eq!(fastest(&out).map(|o| o.name), Some("fast"));
        assert_eq!(fastest(&out[1..2]), None);
        assert_eq!(fastest(&[o("untimed", None, None)]), None);
    }

    /// On a machine without flash attention (the CPU), `auto`'s trial refuses with both
    /// implementations' reasons instead of training on a kernel that cannot run.
    #[test]
    fn choose_flash_names_every_reason_when_none_runs() {
        let shape = AttentionShape { batch: 2, t: 64, heads: 2, kv_heads: 1, head_dim: 64 };
        let err = choose_flash(&Device::Cpu, shape).unwrap_err().to_string();
        assert!(err.contains("flash left out (failed:") && err.contains("flash_mma left out (failed:"), "{err}");
        assert!(err.contains("attention = \"materialized\""), "{err}");
    }
}
