//! Kind `ema_swa`: averages the weights of training steps on its own thread, from the
//! executor's snapshots (it never touches the live model, so it never stalls a step).
//!
//! - `ema`: an exponential moving average, `avg ← decay·avg + (1 − decay)·w` after every step
//!   from `start_step` on, in f32, started from the first snapshot (the initial weights), as the
//!   records do (decay 0.997 or 0.9965; spec 4.4).
//! - `swa`: the plain mean of the weights every `every` steps once the LR multiplier has fallen
//!   below `start_lr_mul` (the last part of the warm-down).
//! - `none`: passes the snapshots on untouched (the ablation baseline).
//!
//! The averaged weights ride on every snapshot it passes on (a checkpoint saves them, and a
//! resumed run restores them); with `eval = true` the final snapshot tells the stages after it
//! (artifact, evaluation) to use them. Histogram `update`: the time of one averaging update.
//! On a GPU the update belongs on its own CUDA stream; the seam is [`Averager::fold`].

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use candle_core::{DType, Tensor};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{config, resumed};
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Emitter, Transform};
use crate::train::checkpoint::Checkpoint;
use crate::train::log::StageLog;
use crate::train::snapshot::{AveragerState, EvalWeights, Moment, Tensors, TrainSnapshot};

/// Parameters of `ema_swa/ema`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EmaParams {
    /// Weight of the old average per step (the records use 0.997 and 0.9965).
    pub decay: f64,
    /// First step folded in (0: every step, as the records).
    pub start_step: u64,
    /// Evaluate (and quantize) the averaged weights after training instead of the last step's.
    pub eval: bool,
}

impl Default for EmaParams {
    fn default() -> Self {
        Self { decay: 0.997, start_step: 0, eval: true }
    }
}

/// Parameters of `ema_swa/swa`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SwaParams {
    /// Fold in the weights of every this many steps.
    pub every: u64,
    /// Start once the LR multiplier is below this (0.2: the last fifth of the warm-down).
    pub start_lr_mul: f64,
    /// Evaluate (and quantize) the averaged weights after training instead of the last step's.
    pub eval: bool,
}

impl Default for SwaParams {
    fn default() -> Self {
        Self { every: 50, start_lr_mul: 0.2, eval: true }
    }
}

/// Parameters of `ema_swa/none` (none).
#[derive(Debug, Clone, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct NoneParams {}

/// How an averager folds a snapshot in.
#[derive(Clone, Copy, Debug)]
enum Rule {
    Ema { decay: f64, start_step: u64 },
    Swa { every: u64, start_lr_mul: f64 },
}

impl Rule {
    fn kind(&self) -> &'static str {
        match self {
            Rule::Ema { .. } => "ema",
            Rule::Swa { .. } => "swa",
        }
    }
}

/// The averaged weights (f32) and how many snapshots they hold.
pub struct Averager {
    rule: Rule,
    avg: Option<Tensors>,
    count: u64,
    /// The last step folded in (or restored).
    last_step: Option<u64>,
    eval: bool,
    log: StageLog,
    stage: String,
}

impl Averager {
    fn new(rule: Rule, eval: bool, ctx: &BuildCtx) -> anyhow::Result<Self> {
        let mut a = Self { rule, avg: None, count: 0, last_step: None, eval, log: StageLog::new(ctx.run_dir), stage: ctx.stage.into() };
        if let Some(ck) = resumed(ctx) {
            a.restore(ck)?;
        }
        Ok(a)
    }

    /// Takes the average a checkpoint saved; a checkpoint without one (or with another kind)
    /// starts this averager afresh from the resumed weights, which the log says.
    fn restore(&mut self, ck: &Checkpoint) -> anyhow::Result<()> {
        match &ck.meta.averager {
            Some(m) if m.kind == self.rule.kind() => {
                let tensors = ck.section("avg.");
                anyhow::ensure!(
                    !tensors.is_empty(),
                    "{}: the checkpoint says it holds a {} average but has no `avg.*` tensors",
                    ck.path.display(),
                    m.kind
                );
                self.avg = Some(Arc::new(tensors.into_iter().collect()));
                self.count = m.count;
                self.last_step = Some(ck.meta.step);
            }
            other => {
                let had = other.as_ref().map(|m| format!("a {} average", m.kind)).unwrap_or_else(|| "no average".into());
                self.log.line(&format!(
                    "note: stage `{}` ({}): the checkpoint holds {had}; the {} starts again from the resumed weights",
                    self.stage,
                    self.rule.kind(),
                    self.rule.kind()
                ));
            }
        }
        Ok(())
    }

    /// Folds `snap` in when the rule says so; returns whether it did.
    pub fn fold(&mut self, snap: &TrainSnapshot) -> anyhow::Result<bool> {
        if self.last_step.is_some_and(|s| snap.step <= s) && self.avg.is_some() {
            return Ok(false); // already in (the final snapshot repeats the last step's)
        }
        let take = match self.rule {
            Rule::Ema { start_step, .. } => snap.step >= start_step,
            Rule::Swa { every, start_lr_mul } => {
                snap.moment == Moment::Step && snap.lr_mul < start_lr_mul && snap.step.is_multiple_of(every.max(1))
            }
        };
        if !take {
            return Ok(false);
        }
        let next: Vec<(String, Tensor)> = match (&self.avg, self.rule) {
            (None, _) => snap
                .weights
                .iter()
                .map(|(n, w)| Ok((n.clone(), w.detach().to_dtype(DType::F32)?.copy()?)))
                .collect::<anyhow::Result<_>>()?,
            (Some(avg), rule) => {
                // avg ← a·avg + b·w: EMA a = decay; SWA the running mean a = n/(n+1).
                let (a, b) = match rule {
                    Rule::Ema { decay, .. } => (decay, 1.0 - decay),
                    Rule::Swa { .. } => {
                        let n = self.count as f64;
                        (n / (n + 1.0), 1.0 / (n + 1.0))
                    }
                };
                // By name: a restored average comes in the checkpoint's order.
                let by_name: std::collections::HashMap<&str, &Tensor> = avg.iter().map(|(n, t)| (n.as_str(), t)).collect();
                anyhow::ensure!(
                    by_name.len() == snap.weights.len(),
                    "the snapshot has {} tensors, the average {}",
                    snap.weights.len(),
                    by_name.len()
                );
                let mut out = Vec::with_capacity(avg.len());
                for (name, w) in snap.weights.iter() {
                    let m = by_name.get(name.as_str()).with_context(|| format!("the average has no tensor `{name}`"))?;
                    anyhow::ensure!(
                        m.dims() == w.dims(),
                        "tensor `{name}`: the average has shape {:?}, the snapshot {:?}",
                        m.dims(),
                        w.dims()
                    );
                    // Detached: an average that recorded its op would hold the previous one alive, and
                    // so on back to the first step.
                    out.push((name.clone(), (m.affine(a, 0.0)? + w.detach().to_dtype(DType::F32)?.affine(b, 0.0)?)?.detach()));
                }
                out
            }
        };
        self.avg = Some(Arc::new(next));
        self.count += 1;
        self.last_step = Some(snap.step);
        Ok(true)
    }

    /// Puts the average in the snapshot's (the model's) tensor order, once: an average restored
    /// from a checkpoint comes in no particular order, and what is made of it (the artifact's
    /// manifest) must be the bytes the uninterrupted run made.
    fn align(&mut self, snap: &TrainSnapshot) {
        let Some(avg) = &self.avg else { return };
        if avg.len() != snap.weights.len() || avg.iter().zip(snap.weights.iter()).all(|((a, _), (w, _))| a == w) {
            return;
        }
        let by_name: std::collections::HashMap<&str, &Tensor> = avg.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let ordered: Option<Vec<(String, Tensor)>> =
            snap.weights.iter().map(|(n, _)| by_name.get(n.as_str()).map(|t| (n.clone(), (*t).clone()))).collect();
        if let Some(ordered) = ordered {
            self.avg = Some(Arc::new(ordered));
        }
    }

    fn state(&self) -> Option<AveragerState> {
        self.avg.as_ref().map(|t| AveragerState { kind: self.rule.kind().into(), count: self.count, tensors: t.clone() })
    }

    fn process(&mut self, mut snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let t0 = Instant::now();
        if self.fold(&snap).with_context(|| format!("averaging step {}", snap.step))? {
            ctx.record("update", t0.elapsed().as_nanos() as u64);
        }
        self.align(&snap);
        snap.averager = self.state();
        if snap.is_final_for_eval() && self.eval {
            match &self.avg {
                Some(t) => {
                    self.log.line(&format!(
                        "{}:applying {} weights ({} snapshots averaged)",
                        self.rule.kind(),
                        self.rule.kind().to_uppercase(),
                        self.count
                    ));
                    snap.eval = Some(EvalWeights { label: self.rule.kind().into(), tensors: t.clone() });
                }
                None => self.log.line(&format!(
                    "note: stage `{}` ({}) averaged no snapshot (see its `start_*` keys); the final weights are evaluated",
                    self.stage,
                    self.rule.kind()
                )),
            }
        }
        if matches!(snap.moment, Moment::Final(_)) {
            ctx.publish(
                "averaging",
                serde_json::json!({
                    "stage": self.stage,
                    "kind": self.rule.kind(),
                    "snapshots": self.count,
                    "last_step": self.last_step,
                    "evaluated": snap.eval.as_ref().map(|e| e.label.clone()),
                }),
            );
        }
        out.emit(snap)?;
        Ok(())
    }
}

/// An averager's memory: its snapshots, and the f32 average it keeps.
fn averager_memory(ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
    use crate::model::memory::{MODEL_KEYS, ParamCounts, snapshots_need};
    let m = &config(ctx)?.model;
    m.check()?;
    Ok(vec![
        snapshots_need(m, ctx.stage, ctx.queue),
        crate::runtime::memory::Need::device("average (f32)", ParamCounts::of(m).total.saturating_mul(4), &MODEL_KEYS),
    ])
}

/// `ema_swa/ema`.
pub struct Ema(Averager);

impl Transform for Ema {
    const KIND: &'static str = "ema_swa";
    const IMPL: &'static str = "ema";
    const DOC: &'static str = "Exponential moving average of the weights after every step (f32, own thread); final evaluation can use it.";
    type Params = EmaParams;
    type In = TrainSnapshot;
    type Out = TrainSnapshot;
    const OUTPUT_OPTIONAL: bool = true;

    /// Every step.
    fn demand(_p: &EmaParams) -> Demand {
        Demand::ALL
    }

    fn check(p: &EmaParams, _ctx: &BuildCtx) -> anyhow::Result<()> {
        anyhow::ensure!(p.decay > 0.0 && p.decay < 1.0, "`decay` must be in (0, 1); found {}", p.decay);
        Ok(())
    }

    fn memory(_p: &EmaParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        averager_memory(ctx)
    }

    fn build(p: EmaParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        Ok(Self(Averager::new(Rule::Ema { decay: p.decay, start_step: p.start_step }, p.eval, ctx)?))
    }

    fn process(&mut self, snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.process(snap, out, ctx)
    }
}

/// `ema_swa/swa`.
pub struct Swa(Averager);

impl Transform for Swa {
    const KIND: &'static str = "ema_swa";
    const IMPL: &'static str = "swa";
    const DOC: &'static str = "Mean of the weights every K steps over the end of the warm-down (f32, own thread).";
    type Params = SwaParams;
    type In = TrainSnapshot;
    type Out = TrainSnapshot;
    const OUTPUT_OPTIONAL: bool = true;

    /// The steps it may fold in (every `every`-th) and the last.
    fn demand(p: &SwaParams) -> Demand {
        Demand::every(p.every)
    }

    fn check(p: &SwaParams, _ctx: &BuildCtx) -> anyhow::Result<()> {
        anyhow::ensure!(p.every >= 1, "`every` must be at least 1");
        anyhow::ensure!(
            p.start_lr_mul > 0.0 && p.start_lr_mul <= 1.0 + 1e-12,
            "`start_lr_mul` must be in (0, 1]; found {}",
            p.start_lr_mul
        );
        Ok(())
    }

    fn memory(_p: &SwaParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        averager_memory(ctx)
    }

    fn build(p: SwaParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        // `start_lr_mul = 1` means from the start: every multiplier (at most 1) must pass.
        let start = if p.start_lr_mul >= 1.0 { f64::INFINITY } else { p.start_lr_mul };
        Ok(Self(Averager::new(Rule::Swa { every: p.every, start_lr_mul: start }, p.eval, ctx)?))
    }

    fn process(&mut self, snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.0.process(snap, out, ctx)
    }
}

/// `ema_swa/none`.
pub struct Passthrough;

impl Transform for Passthrough {
    const KIND: &'static str = "ema_swa";
    const IMPL: &'static str = "none";
    const DOC: &'static str = "No averaging: passes the snapshots on (the ablation baseline).";
    type Params = NoneParams;
    type In = TrainSnapshot;
    type Out = TrainSnapshot;
    const OUTPUT_OPTIONAL: bool = true;

    /// Nothing of its own: what its consumers need.
    fn demand(_p: &NoneParams) -> Demand {
        Demand::LAST
    }

    fn build(_p: NoneParams, _ctx: &BuildCtx) -> anyhow::Result<Self> {
        Ok(Self)
    }

    fn process(&mut self, snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, _ctx: &mut Ctx) -> anyhow::Result<()> {
        out.emit(snap)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::{Device, Tensor, Var};

    use super::*;
    use crate::train::snapshot::TrainerState;

    fn snap(step: u64, w: Tensor) -> TrainSnapshot {
        let state = TrainerState {
            optimizer: Arc::new(Vec::new()),
            loader: None,
            rank_loaders: Arc::default(),
            rolling: 0,
            history: serde_json::Value::Null,
            data: String::new(),
        };
        TrainSnapshot {
            step,
            moment: if step == 0 { Moment::Start } else { Moment::Step },
            train_ms: 0.0,
            train_loss: f64::NAN,
            lr_mul: 0.1,
            weights: Arc::new(vec![("w".into(), w)]),
            state: Arc::new(state),
            averager: None,
            eval: None,
        }
    }

    fn averager(rule: Rule) -> Averager {
        Averager { rule, avg: None, count: 0, last_step: None, eval: true, log: StageLog::new(None), stage: "avg".into() }
    }

    fn value(a: &Averager) -> Vec<f32> {
        a.avg.as_ref().unwrap()[0].1.to_vec1::<f32>().unwrap()
    }

    /// EMA by hand, and no autograd history: weights that come from a variable (as a careless
    /// snapshot would) must not make every average hold the previous one.
    #[test]
    fn ema_matches_the_formula_and_keeps_no_history() {
        let var = Var::from_tensor(&Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap()).unwrap();
        let mut a = averager(Rule::Ema { decay: 0.9, start_step: 0 });
        assert!(a.fold(&snap(0, var.as_tensor().copy().unwrap())).unwrap());
        for step in 1..=3u64 {
            var.set(&Tensor::new(&[step as f32 + 1.0, 0.0], &Device::Cpu).unwrap()).unwrap();
            assert!(a.fold(&snap(step, var.as_tensor().copy().unwrap())).unwrap());
            assert!(!a.avg.as_ref().unwrap()[0].1.track_op(), "the average records its op at step {step}");
        }
        // avg0 = [1, 2]; then w = [2, 0], [3, 0], [4, 0].
        let mut want = [1f64, 2.0];
        for w in [2.0, 3.0, 4.0] {
            want = [0.9 * want[0] + 0.1 * w, 0.9 * want[1]];
        }
        let got = value(&a);
        assert!((got[0] as f64 - want[0]).abs() < 1e-5 && (got[1] as f64 - want[1]).abs() < 1e-5, "{got:?} vs {want:?}");
        assert_eq!(a.count, 4);
        // The final snapshot repeats the last step: not folded twice.
        assert!(!a.fold(&snap(3, var.as_tensor().copy().unwrap())).unwrap());
    }

    /// SWA is the plain mean of the snapshots its rule takes.
    #[test]
    fn swa_is_the_mean_of_the_taken_steps() {
        let mut a = averager(Rule::Swa { every: 2, start_lr_mul: 0.5 });
        for step in 1..=6u64 {
            let taken = a.fold(&snap(step, Tensor::new(&[step as f32], &Device::Cpu).unwrap())).unwrap();
            assert_eq!(taken, step % 2 == 0, "step {step}");
        }
        assert_eq!(a.count, 3);
        assert!((value(&a)[0] - 4.0).abs() < 1e-6, "mean of 2, 4, 6: {:?}", value(&a));
    }
}
