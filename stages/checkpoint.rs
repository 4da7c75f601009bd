//! Kind `checkpoint`: saves everything a run needs to continue exactly (weights, optimizer
//! state, loader state, step, training time, data fingerprint, averaged weights) every
//! `every` steps, at the end and on Ctrl-C, into `RUN_DIR/checkpoints/step_N.safetensors`
//! (format: [`crate::train::checkpoint`]).
//!
//! - `atomic`: the stage passes every snapshot on at once and hands a due one to its writer
//!   thread, which serialises it and writes it atomically (temporary file, fsync, rename), then
//!   keeps the newest `keep`. The executor pays only for the snapshot's copy of the weights
//!   (its `snapshot` histogram); this stage's histograms are `serialize` and `write` (on the
//!   writer) and `wait` (a due snapshot waiting for the previous write to finish).
//!
//! A write that fails (a full disk, say) leaves the previous checkpoints as they were; with
//! `on_error = "stop"` the run stops with the error, with `"continue"` training goes on and
//! the report counts the failure. A killed process never leaves a half-written file under a
//! checkpoint's name; its temporary file is removed by the next run that writes there.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{config, resumed};
use crate::runtime::stage::{BuildCtx, Ctx, Demand, Emitter, Transform};
use crate::train::checkpoint::{AveragerMeta, CheckpointMeta, VERSION};
use crate::train::log::StageLog;
use crate::train::snapshot::{Moment, TrainSnapshot};

/// What a failed checkpoint write does to the run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// Stop the run with the error (the previous checkpoints stay).
    #[default]
    Stop,
    /// Log it, count it in the report, and keep training.
    Continue,
}

/// Parameters of `checkpoint/atomic`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AtomicParams {
    /// Save every this many steps (0: only at the end and on Ctrl-C).
    pub every: u64,
    /// Checkpoints kept (the newest); older ones are deleted after each successful write.
    pub keep: usize,
    /// Save when training ends (and on Ctrl-C).
    pub at_end: bool,
    /// What a failed write does: "stop" or "continue".
    pub on_error: OnError,
}

impl Default for AtomicParams {
    fn default() -> Self {
        Self { every: 1000, keep: 3, at_end: true, on_error: OnError::Stop }
    }
}

/// A write handed to the writer thread.
struct Job {
    step: u64,
    meta: CheckpointMeta,
    tensors: Vec<(String, candle_core::Tensor)>,
}

/// What the writer reports back.
struct Written {
    step: u64,
    result: anyhow::Result<(PathBuf, u64)>,
    serialize: Duration,
    write: Duration,
}

/// `checkpoint/atomic`.
pub struct Atomic {
    p: AtomicParams,
    dir: Option<PathBuf>,
    seed: u64,
    model: serde_json::Value,
    jobs: Option<flume::Sender<Job>>,
    done: flume::Receiver<Written>,
    writer: Option<JoinHandle<()>>,
    in_flight: Option<u64>,
    last_saved: Option<u64>,
    written: Vec<serde_json::Value>,
    failures: Vec<String>,
    log: StageLog,
    stage: String,
}

impl Transform for Atomic {
    const KIND: &'static str = "checkpoint";
    const IMPL: &'static str = "atomic";
    const DOC: &'static str =
        "Saves weights, optimizer, loader and averager state every N steps, at the end and on Ctrl-C; atomic writes on its own thread.";
    type Params = AtomicParams;
    type In = TrainSnapshot;
    type Out = TrainSnapshot;
    const OUTPUT_OPTIONAL: bool = true;

    /// The snapshots it saves: every `every`-th step's, and the last (0: the last only).
    fn demand(p: &AtomicParams) -> Demand {
        Demand::every(p.every)
    }

    fn check(p: &AtomicParams, _ctx: &BuildCtx) -> anyhow::Result<()> {
        anyhow::ensure!(p.keep >= 1, "`keep` must be at least 1");
        Ok(())
    }

    fn memory(_p: &AtomicParams, ctx: &BuildCtx) -> anyhow::Result<Vec<crate::runtime::memory::Need>> {
        use crate::model::memory::{MODEL_KEYS, snapshot_bytes, snapshots_need};
        let m = &config(ctx)?.model;
        m.check()?;
        // The writer copies a snapshot's tensors to the host and serialises them into one buffer.
        Ok(vec![
            snapshots_need(m, ctx.stage, ctx.queue),
            crate::runtime::memory::Need::host(
                "a checkpoint's host copy and serialised bytes",
                snapshot_bytes(m).saturating_mul(2),
                &MODEL_KEYS,
            ),
        ])
    }

    fn build(p: AtomicParams, ctx: &BuildCtx) -> anyhow::Result<Self> {
        Self::check(&p, ctx)?;
        let dir = ctx.run_dir.map(|d| d.join(crate::train::checkpoint::DIR));
        let (jobs_tx, jobs_rx) = flume::bounded::<Job>(1);
        let (done_tx, done_rx) = flume::unbounded::<Written>();
        let writer = match &dir {
            Some(d) => {
                let (d, keep) = (d.clone(), p.keep);
                Some(
                    std::thread::Builder::new()
                        .name(format!("{}-writer", ctx.stage))
                        .spawn(move || writer(&d, keep, jobs_rx, done_tx))
                        .context("cannot start the checkpoint writer thread")?,
                )
            }
            None => None,
        };
        Ok(Self {
            p,
            dir,
            seed: ctx.run.seed,
            model: serde_json::to_value(&config(ctx)?.model)?,
            jobs: Some(jobs_tx),
            done: done_rx,
            writer,
            in_flight: None,
            last_saved: resumed(ctx).map(|c| c.meta.step),
            written: Vec::new(),
            failures: Vec::new(),
            log: StageLog::new(ctx.run_dir),
            stage: ctx.stage.into(),
        })
    }

    fn process(&mut self, snap: TrainSnapshot, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.collect(ctx, false)?;
        let due = match snap.moment {
            Moment::Start => false,
            Moment::Step => self.p.every > 0 && snap.step.is_multiple_of(self.p.every),
            Moment::Final(_) => self.p.at_end,
        } && self.last_saved != Some(snap.step)
            && self.dir.is_some();
        let is_final = matches!(snap.moment, Moment::Final(_));
        if due {
            self.submit(&snap, ctx)?;
        }
        out.emit(snap)?;
        if is_final {
            // The run ends here: wait for the last write, however long (Ctrl-C included).
            ctx.finishing(|ctx| self.collect(ctx, true))?;
        }
        Ok(())
    }

    fn flush(&mut self, _out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let result = ctx.finishing(|ctx| self.collect(ctx, true));
        self.jobs = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
        self.publish(ctx);
        result
    }
}

impl Atomic {
    /// Hands `snap` to the writer, after the previous write finished.
    fn submit(&mut self, snap: &TrainSnapshot, ctx: &mut Ctx) -> anyhow::Result<()> {
        if self.in_flight.is_some() {
            let t0 = Instant::now();
            self.collect(ctx, true)?;
            ctx.record("wait", t0.elapsed().as_nanos() as u64);
        }
        let st = &snap.state;
        let meta = CheckpointMeta {
            version: VERSION,
            step: snap.step,
            train_ms: snap.train_ms,
            train_loss: snap.train_loss,
            loader: st.loader.as_deref().cloned(),
            rank_loaders: st.rank_loaders.to_vec(),
            rolling: st.rolling,
            data: st.data.clone(),
            seed: self.seed,
            model: self.model.clone(),
            averager: snap.averager.as_ref().map(|a| AveragerMeta { kind: a.kind.clone(), count: a.count }),
            extra: st.history.clone(),
        };
        let mut tensors = Vec::with_capacity(snap.weights.len() * 4);
        tensors.extend(snap.weights.iter().map(|(n, t)| (format!("model.{n}"), t.clone())));
        tensors.extend(st.optimizer.iter().map(|(n, t)| (format!("optim.{n}"), t.clone())));
        if let Some(a) = &snap.averager {
            tensors.extend(a.tensors.iter().map(|(n, t)| (format!("avg.{n}"), t.clone())));
        }
        let jobs = self.jobs.as_ref().context("the checkpoint writer has stopped")?;
        jobs.send(Job { step: snap.step, meta, tensors }).map_err(|_| anyhow::anyhow!("the checkpoint writer thread has stopped"))?;
        self.in_flight = Some(snap.step);
        self.last_saved = Some(snap.step);
        Ok(())
    }

    /// Takes the writer's results; with `wait`, until the write in flight is done.
    fn collect(&mut self, ctx: &mut Ctx, wait: bool) -> anyhow::Result<()> {
        while self.in_flight.is_some() {
            let w = if wait {
                match self.done.recv() {
                    Ok(w) => w,
                    Err(_) => anyhow::bail!("the checkpoint writer thread ended without reporting step {:?}", self.in_flight),
                }
            } else {
                match self.done.try_recv() {
                    Ok(w) => w,
                    Err(_) => return Ok(()),
                }
            };
            self.in_flight = None;
            ctx.record("serialize", w.serialize.as_nanos() as u64);
            match w.result {
                Ok((path, bytes)) => {
                    ctx.record("write", w.write.as_nanos() as u64);
                    self.written.push(serde_json::json!({
                        "step": w.step,
                        "path": path.display().to_string(),
                        "bytes": bytes,
                        "serialize_ms": w.serialize.as_secs_f64() * 1e3,
                        "write_ms": w.write.as_secs_f64() * 1e3,
                    }));
                    self.log.line(&format!(
                        "checkpoint: step:{} {} ({bytes} bytes, {:.0}ms)",
                        w.step,
                        path.display(),
                        (w.serialize + w.write).as_secs_f64() * 1e3
                    ));
                }
                Err(e) => {
                    let msg = format!("checkpoint of step {} failed: {e:#}", w.step);
                    self.failures.push(msg.clone());
                    match self.p.on_error {
                        OnError::Stop => {
                            self.publish(ctx);
                            anyhow::bail!("{msg} (the previous checkpoints are intact; `on_error = \"continue\"` keeps training instead)");
                        }
                        OnError::Continue => {
                            self.log.line(&format!("note: stage `{}`: {msg}; training goes on (on_error = \"continue\")", self.stage))
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn publish(&self, ctx: &Ctx) {
        ctx.publish(
            "checkpoint",
            serde_json::json!({
                "stage": self.stage,
                "dir": self.dir.as_ref().map(|d| d.display().to_string()),
                "every": self.p.every,
                "keep": self.p.keep,
                "written": self.written,
                "failures": self.failures,
            }),
        );
    }
}

/// The writer thread: serialise, write atomically, prune; one job at a time.
fn writer(dir: &Path, keep: usize, jobs: flume::Receiver<Job>, done: flume::Sender<Written>) {
    for job in jobs.iter() {
        let t0 = Instant::now();
        let bytes = crate::train::checkpoint::encode(&job.meta, &job.tensors);
        drop(job.tensors);
        let serialize = t0.elapsed();
        let t1 = Instant::now();
        let result = bytes.and_then(|b| {
            let path = crate::train::checkpoint::write(dir, job.step, &b)?;
            crate::train::checkpoint::prune(dir, keep)?;
            Ok((path, b.len() as u64))
        });
        if done.send(Written { step: job.step, result, serialize, write: t1.elapsed() }).is_err() {
            return;
        }
    }
}
