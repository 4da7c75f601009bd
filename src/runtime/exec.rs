//! Runs a [`Plan`]: one OS thread per stage (named after it), bounded channels between them,
//! and the main thread watching.
//!
//! The main thread samples every channel's length each `[run] sample_interval_us`, enforces
//! `[run] max_seconds`, turns a graceful stop into an abort when `[run] drain_timeout_ms`
//! passes, and collects each stage's measurements when its thread ends. A stage that fails or
//! panics aborts the graph; stages blocked on a channel notice within [`POLL`]. A stage still
//! running [`ABORT_GRACE`] after an abort is reported as `hung` and left behind (the process
//! exits anyway), so the report is always written.
//!
//! [`POLL`]: crate::runtime::control::POLL

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::runtime::clock::Clock;
use crate::runtime::config::RunConfig;
use crate::runtime::control::{Control, StopReason};
use crate::runtime::driver::{ErasedChannelHandle, Runnable, StageEnv, Wiring};
use crate::runtime::graph::Plan;
use crate::runtime::metrics::Hist;
use crate::runtime::stage::{BuildCtx, Ctx, Extensions};
use crate::runtime::trace::{CounterTrace, StageTrace, TraceData};

/// How long stages get to leave after an abort before they are reported as hung.
pub const ABORT_GRACE: Duration = Duration::from_secs(3);

/// How a stage's thread ended.
#[derive(Clone, Debug, PartialEq)]
pub enum StageState {
    /// Its loop and flush completed.
    Finished,
    /// It returned an error.
    Failed(String),
    /// It panicked.
    Panicked(String),
    /// It did not end within [`ABORT_GRACE`] of an abort.
    Hung,
}

impl StageState {
    /// Lower-case name, as the report shows it.
    pub fn as_str(&self) -> &'static str {
        match self {
            StageState::Finished => "finished",
            StageState::Failed(_) => "failed",
            StageState::Panicked(_) => "panicked",
            StageState::Hung => "hung",
        }
    }
}

/// What one stage thread measured.
pub struct StageResult {
    /// How it ended.
    pub state: StageState,
    /// Its measurements (absent if it hung).
    pub env: Option<StageEnv>,
    /// Its own named histograms ([`Ctx::record`]).
    pub extra: BTreeMap<String, Hist>,
    /// Clock reading when the thread ended.
    pub end: u64,
}

/// Sampled lengths of one channel.
#[derive(Clone, Debug, Default)]
pub struct OccupancySamples {
    /// Number of samples.
    pub samples: u64,
    /// Sum of sampled lengths.
    pub sum: u64,
    /// Samples that found the channel empty.
    pub empty: u64,
    /// Samples that found it full.
    pub full: u64,
    /// The length over time, at most [`TIMELINE_POINTS`] points.
    pub timeline: Timeline,
}

/// Most points a [`Timeline`] keeps.
pub const TIMELINE_POINTS: usize = 256;

/// A bounded series of a channel's sampled length over the run: each point is the mean of
/// `width` consecutive samples; when the series is full, neighbours are merged in pairs and
/// the width doubles, so a run of any length keeps between 128 and 256 points.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// Samples per point.
    width: u64,
    /// Per point: seconds from the run's start to its first sample, sum of lengths, samples.
    points: Vec<(f64, u64, u64)>,
}

impl Timeline {
    /// Adds a sample of length `len` taken `t` seconds into the run.
    pub fn push(&mut self, t: f64, len: u64) {
        self.width = self.width.max(1);
        match self.points.last_mut() {
            Some(last) if last.2 < self.width => {
                last.1 += len;
                last.2 += 1;
            }
            _ => {
                if self.points.len() == TIMELINE_POINTS {
                    let merged = self.points.chunks(2).map(|c| c.iter().fold((c[0].0, 0, 0), |a, p| (a.0, a.1 + p.1, a.2 + p.2)));
                    self.points = merged.collect();
                    self.width *= 2;
                    return self.push(t, len);
                }
                self.points.push((t, len, 1));
            }
        }
    }

    /// `(seconds into the run, mean length)` per point, to 0.1 ms and 0.001 items (what a plot
    /// can show; the report stays small).
    pub fn points(&self) -> Vec<[f64; 2]> {
        // Through decimal text: the nearest double to the rounded decimal prints short.
        let round = |x: f64, places: usize| format!("{x:.places$}").parse().unwrap_or(x);
        self.points.iter().map(|&(t, sum, n)| [round(t, 4), round(sum as f64 / n.max(1) as f64, 3)]).collect()
    }
}

/// Everything a run measured, before it becomes a report.
pub struct RunResult {
    /// The run's clock.
    pub clock: Clock,
    /// Clock reading when the stage threads were started.
    pub start: u64,
    /// Clock reading when the last stage ended (or was given up on).
    pub end: u64,
    /// Per stage, in plan order.
    pub stages: Vec<StageResult>,
    /// Per stage with an input channel (plan order; `None` for sources).
    pub occupancy: Vec<Option<OccupancySamples>>,
    /// Why the run ended.
    pub reason: StopReason,
    /// The signal that stopped it, if one did.
    pub signal: Option<crate::runtime::control::StopSignal>,
    /// The first stage failure: (stage name, message).
    pub failure: Option<(String, String)>,
    /// Milliseconds from the first abort (failure, timeout, second Ctrl-C) to the last stage
    /// ending.
    pub stop_ms: Option<f64>,
    /// Things the report should mention (drain timed out, max_seconds reached, ...).
    pub notes: Vec<String>,
    /// Report sections published by stages (`train`, ...).
    pub sections: BTreeMap<String, serde_json::Value>,
    /// What the trace recorded (`[run] trace = true`): [`crate::runtime::trace::write`] it.
    pub trace: Option<TraceData>,
}

/// A stage that could not be built; the run does not start.
#[derive(Debug, thiserror::Error)]
#[error("stage `{stage}` ({kind}/{imp}) could not be built: {message}")]
pub struct BuildError {
    /// Stage name.
    pub stage: String,
    /// Its kind.
    pub kind: String,
    /// Its implementation.
    pub imp: String,
    /// What went wrong.
    pub message: String,
    /// The system failed it (a file it reads could not be, for a permission or disk error),
    /// not the config ([`crate::runtime::files::is_system_error`]).
    pub system: bool,
}

struct Done {
    index: usize,
    state: StageState,
    env: StageEnv,
    extra: BTreeMap<String, Hist>,
    trace: Option<StageTrace>,
    end: u64,
}

/// Every stage of a plan, built; nothing runs yet ([`build`], then [`run`]).
pub struct Built {
    runnables: Vec<Option<Box<dyn Runnable>>>,
}

/// Builds every stage of `plan` with `[run]` and the application's extensions (its config,
/// the resume state): a stage that cannot be built means nothing runs.
pub fn build(plan: &Plan, run: &RunConfig, ext: &Extensions, run_dir: Option<&Path>) -> Result<Built, BuildError> {
    let mut runnables: Vec<Option<Box<dyn Runnable>>> = Vec::with_capacity(plan.stages.len());
    for s in &plan.stages {
        let ctx = BuildCtx { run_dir, ..s.check_ctx(run, ext) };
        let r = s.factory.instantiate(&s.params, &ctx).map_err(|e| BuildError {
            stage: s.name.clone(),
            kind: s.factory.kind().into(),
            imp: s.factory.name().into(),
            system: crate::runtime::files::is_system_error(&e),
            message: format!("{e:#}"),
        })?;
        runnables.push(Some(r));
    }
    Ok(Built { runnables })
}

/// Runs the stages [`build`] made, to the end. `control` is shared with whoever may interrupt
/// the run (the signal handler).
pub fn run(plan: &Plan, run: &RunConfig, built: Built, control: Arc<Control>) -> RunResult {
    let clock = Clock::new();
    let mut runnables = built.runnables;

    // One input channel per consuming stage; senders for each edge; probes for sampling.
    let mut channels: Vec<Option<Box<dyn ErasedChannelHandle>>> = plan.stages.iter().map(|s| s.factory.input_channel(s.queue)).collect();
    let probes: Vec<Option<crate::runtime::channel::Probe>> = channels.iter().map(|c| c.as_ref().map(|c| c.probe())).collect();
    let mut wirings: Vec<Wiring> = Vec::with_capacity(plan.stages.len());
    for (i, s) in plan.stages.iter().enumerate() {
        let input = channels[i].as_mut().and_then(|c| c.take_receiver());
        let mut outputs = Vec::new();
        for &c in &s.consumers {
            let edge = plan.stages[c].inputs.iter().position(|&j| j == i).expect("consumer lists its producer") as u32;
            let tx = channels[c].as_ref().expect("a consumer has an input channel").sender();
            outputs.push((tx, edge));
        }
        wirings.push(Wiring { index: i, input, outputs });
    }
    // The builder's own senders must go, or consumers would never see their inputs end.
    drop(channels);

    let sections = Arc::new(Mutex::new(BTreeMap::new()));
    let (done_tx, done_rx) = flume::unbounded::<Done>();
    let start = clock.now();
    let started_at = Instant::now();
    let mut handles = Vec::new();
    for (i, (s, wiring)) in plan.stages.iter().zip(wirings).enumerate() {
        let runnable = runnables[i].take().expect("built once");
        let env = StageEnv::new(clock.clone(), control.clone(), run.instrument, run.warmup_items, s.inputs.len(), s.consumers.len());
        let mut ctx = Ctx::new(&s.name, control.clone(), sections.clone());
        if run.trace {
            ctx.set_trace(StageTrace::new(run.trace_items, clock.clone()));
        }
        let (t_done, t_control, t_clock) = (done_tx.clone(), control.clone(), clock.clone());
        let spawned = std::thread::Builder::new().name(s.name.clone()).spawn(move || {
            let mut env = env;
            let outcome = catch_unwind(AssertUnwindSafe(|| runnable.run(wiring, &mut env, &mut ctx)));
            let state = match outcome {
                Ok(Ok(())) => StageState::Finished,
                Ok(Err(e)) => StageState::Failed(format!("{e:#}")),
                Err(payload) => StageState::Panicked(panic_message(payload.as_ref())),
            };
            if state != StageState::Finished {
                t_control.fail();
            }
            let extra = ctx.take_extra();
            let trace = ctx.take_trace();
            let _ = t_done.send(Done { index: i, state, env, extra, trace, end: t_clock.now() });
        });
        match spawned {
            Ok(h) => handles.push((i, h)),
            Err(e) => {
                // Could not start a thread: stop what already runs and report it as this stage's failure.
                control.fail();
                let env = StageEnv::new(clock.clone(), control.clone(), false, 0, s.inputs.len(), s.consumers.len());
                let _ = done_tx.send(Done {
                    index: i,
                    state: StageState::Failed(format!("cannot start its thread: {e}")),
                    env,
                    extra: BTreeMap::new(),
                    trace: None,
                    end: clock.now(),
                });
            }
        }
    }
    drop(done_tx);

    // Watch.
    let n = plan.stages.len();
    let mut results: Vec<Option<Done>> = (0..n).map(|_| None).collect();
    let mut occupancy: Vec<Option<OccupancySamples>> = probes.iter().map(|p| p.as_ref().map(|_| OccupancySamples::default())).collect();
    // Traced: each channel's length changes, as counters (a change per item at most twice).
    let mut counters: Vec<Option<CounterTrace>> =
        probes.iter().map(|p| p.as_ref().filter(|_| run.trace).map(|_| CounterTrace::new(run.trace_items.saturating_mul(2)))).collect();
    let interval = Duration::from_micros(run.sample_interval_us.max(50));
    let drain_timeout = Duration::from_millis(run.drain_timeout_ms);
    let max_run = (run.max_seconds > 0.0).then(|| Duration::from_secs_f64(run.max_seconds));
    let mut notes = Vec::new();
    let mut failure: Option<(String, String)> = None;
    let mut stop_seen: Option<Instant> = None;
    let mut abort_seen: Option<Instant> = None;
    let mut remaining = n;
    let mut next_sample = Instant::now();
    while remaining > 0 {
        let now = Instant::now();
        let wait = next_sample.saturating_duration_since(now);
        match done_rx.recv_timeout(wait) {
            Ok(d) => {
                if failure.is_none()
                    && let StageState::Failed(m) | StageState::Panicked(m) = &d.state
                {
                    failure = Some((plan.stages[d.index].name.clone(), m.clone()));
                }
                let i = d.index;
                results[i] = Some(d);
                remaining -= 1;
            }
            Err(flume::RecvTimeoutError::Timeout) => {}
            Err(flume::RecvTimeoutError::Disconnected) => break,
        }
        let now = Instant::now();
        if now >= next_sample {
            for (i, (p, o)) in probes.iter().zip(occupancy.iter_mut()).enumerate() {
                if let (Some(p), Some(o)) = (p, o.as_mut())
                    && let Some(len) = p()
                {
                    o.samples += 1;
                    o.sum += len as u64;
                    o.empty += (len == 0) as u64;
                    o.full += (len >= plan.stages[i].queue) as u64;
                    o.timeline.push(now.duration_since(started_at).as_secs_f64(), len as u64);
                    if let Some(c) = counters[i].as_mut() {
                        c.sample(clock.now(), len);
                    }
                }
            }
            next_sample = now + interval;
        }
        if let Some(limit) = max_run
            && !control.stopping()
            && now.duration_since(started_at) >= limit
        {
            notes.push(format!("stopped after max_seconds = {}", run.max_seconds));
            control.request_stop();
        }
        if control.stopping() && (stop_seen.is_none() || control.finishing()) {
            // A stage doing its closing work restarts the drain clock.
            stop_seen = Some(now);
        }
        if let Some(t) = stop_seen
            && !control.aborting()
            && now.duration_since(t) >= drain_timeout
        {
            notes.push(format!(
                "in-flight items did not drain within drain_timeout_ms = {}; stages were stopped where they stood",
                run.drain_timeout_ms
            ));
            control.abort();
        }
        if control.aborting() && abort_seen.is_none() {
            abort_seen = Some(now);
        }
        if let Some(t) = abort_seen
            && now.duration_since(t) >= ABORT_GRACE
        {
            break;
        }
    }
    let end = clock.now();
    let stop_ms = abort_seen.map(|t| t.elapsed().as_secs_f64() * 1e3);
    for (i, h) in handles {
        if results.get(i).is_some_and(Option::is_some) {
            let _ = h.join();
        }
    }
    let traces: Vec<Option<StageTrace>> = results.iter_mut().map(|d| d.as_mut().and_then(|d| d.trace.take())).collect();
    let stages = results
        .into_iter()
        .enumerate()
        .map(|(i, d)| match d {
            Some(d) => StageResult { state: d.state, env: Some(d.env), extra: d.extra, end: d.end },
            None => {
                notes.push(format!("stage `{}` did not stop within {} s of the abort", plan.stages[i].name, ABORT_GRACE.as_secs()));
                StageResult { state: StageState::Hung, env: None, extra: BTreeMap::new(), end }
            }
        })
        .collect();
    let sections = sections.lock().map(|s| s.clone()).unwrap_or_default();
    let trace = run.trace.then(|| TraceData {
        stages: plan.stages.iter().map(|s| s.name.clone()).collect(),
        traces,
        counters: counters
            .into_iter()
            .enumerate()
            .filter_map(|(i, c)| {
                let s = &plan.stages[i];
                let name = match s.inputs.as_slice() {
                    [p] => format!("{}->{}", plan.stages[*p].name, s.name),
                    _ => format!("{} input", s.name),
                };
                c.map(|c| (name, c))
            })
            .collect(),
        clock: clock.clone(),
        start,
    });
    RunResult {
        clock,
        start,
        end,
        stages,
        occupancy,
        reason: control.reason(),
        signal: control.signal(),
        failure,
        stop_ms,
        notes,
        sections,
        trace,
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The timeline stays within its bound, keeps the first sample's time, and every point is
    /// the mean of equally many samples (a ramp's means stay on the ramp).
    #[test]
    fn timeline_is_bounded_and_averages() {
        let mut t = Timeline::default();
        for k in 0..10_000u64 {
            t.push(k as f64 * 1e-3, k);
        }
        let p = t.points();
        assert!((TIMELINE_POINTS / 2..=TIMELINE_POINTS).contains(&p.len()), "{} points", p.len());
        assert_eq!(p[0][0], 0.0);
        let w = t.width as f64;
        for pt in &p[..p.len() - 1] {
            // A point starting at sample s averages s .. s + w - 1.
            let s = pt[0] * 1e3;
            assert!((pt[1] - (s + (w - 1.0) / 2.0)).abs() < 1e-3, "{pt:?} width {w}");
        }
        assert!(Timeline::default().points().is_empty());
    }
}
