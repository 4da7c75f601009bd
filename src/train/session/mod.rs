//! A training session: the loop of the challenge's training script, driven one micro-batch at
//! a time by the `step_executor` stage (`stages/step_executor.rs`).
//!
//! Each optimizer step takes `grad_accum_steps` micro-batches; validation runs at step 0,
//! every `train.val_every` steps and after the last step; training ends at `train.iterations`
//! or at the `train.max_wallclock_seconds` cap less `train.gptq_reserve_seconds` (the step
//! crossing it is the last, and the final validation still runs), when the session asks the graph to stop. Logs use the challenge
//! script's formats ([`crate::train::log`]); the report gets a `train` section; the final
//! weights go to `RUN_DIR/final_model.safetensors` with the script's `state_dict` names.
//!
//! If the graph stops first: after Ctrl-C the weights are saved without a final validation
//! (so the process ends promptly); when the input ends or `run.max_seconds` passes, the final
//! validation runs too. A step left half-accumulated is dropped, and said so.
//!
//! Several ranks (data parallel): after each step they agree on the clock and on stopping,
//! and validation is shared among them (see docs/ranks.md).
//!
//! The loop is this file; what it writes is beside it: [`startup`] (the log's opening lines)
//! and [`report`] (the report's `train` section).
//!
//! Output: a [`TrainSnapshot`] before the first step, after every step and at the end, for the
//! stages after training. The session pays for one copy of the parameters per snapshot
//! (histogram `snapshot`); with no stage after it, it makes none. Every step also gets a row
//! in `RUN_DIR/steps.tsv`. Resuming: [`crate::train::resume`]; checks and the memory
//! estimate: [`crate::train::requirements`].

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::DType;

use crate::data::batch::{BatchShape, DeviceBatch, LoaderState};
use crate::eval::bpb::BpbAccumulator;
use crate::eval::validation::Validator;
use crate::model::Gpt;
use crate::model::flash_attn::{Attention, FlashKernels};
use crate::runtime::control::StopReason;
use crate::runtime::stage::{Ctx, Demand, Emitter};
use crate::train::attention_choice;
use crate::train::attention_trial::AttentionShape;
use crate::train::checkpoint::Checkpoint;
use crate::train::config::{Config, TrainConfig};
use crate::train::engine_trainer::EngineTrainer;
use crate::train::executor::StepOutcome;
use crate::train::executor::{Executor, ExecutorKind};
use crate::train::log::{Phases, StepTable, TrainLog, train_line, val_line};
use crate::train::params::SessionParams;
use crate::train::requirements;
use crate::train::resume::{self, History, ValPoint, data_fingerprint, trained_attention};
use crate::train::snapshot::{Ending, Moment, TrainSnapshot, TrainerState};
use crate::train::step_trace::Trace;
#[cfg(feature = "candle")]
use crate::train::trainer::Trainer;

mod report;
mod startup;

use report::peak_rss_kib;
use startup::{looping_line, startup_lines};

/// A training session: the model, its trainer and validator, the clocks, the log, and what
/// the snapshots and the report are made of.
pub struct Session {
    /// The ranks training together (a world of one without a launcher).
    ranks: std::sync::Arc<dyn crate::dist::Collective>,
    /// Several ranks: the ranks agreed at a step's end to stop (one of them was asked to).
    agreed_stop: bool,
    /// The steps' collectives' wall time so far (several ranks).
    comm_total: Duration,
    /// Collective time hidden under the backward pass (the engine's overlapped all-reduce).
    overlapped_total: Duration,
    trainer: Box<dyn Executor>,
    validator: Validator,
    log: TrainLog,
    cfg: TrainConfig,
    shape: BatchShape,
    vocab: u32,
    unigram_bpb: Option<f64>,
    /// On a GPU, the attention trained with (`flash`, `flash_mma`, `cudnn`, `materialized`).
    attention: Option<&'static str>,
    /// `attention = "auto"`'s trials and choice.
    auto_choice: Option<attention_choice::Choice>,
    weights_path: Option<std::path::PathBuf>,
    started: bool,
    done: bool,
    /// Training time before `mark` (validation excluded).
    train_before_mark: Duration,
    /// When the running stretch of training time began; `None` while paused.
    mark: Option<Instant>,
    /// Training time when the current step's first micro-batch arrived.
    step_start_ms: f64,
    idle_since: Option<Instant>,
    window: Phases,
    window_steps: u64,
    total: Phases,
    last_loss: f64,
    vals: Vec<ValPoint>,
    last_val: Option<BpbAccumulator>,
    ending: Option<Ending>,
    dropped_micro: usize,
    /// The step whose weights were last saved.
    saved_at: Option<u64>,
    /// Which steps' snapshots the stages after training need (`None`: no stage reads them):
    /// every step for an EMA, every N-th for checkpoints, the last only for the artifact and
    /// evaluation. A snapshot is a read of the weights (the engine's mirror is synced for it)
    /// and a copy of them, so steps nobody needs get none.
    snapshots: Option<Demand>,
    /// The sampler's state after the last micro-batch taken, and the rolling fingerprint.
    loader: Option<Arc<LoaderState>>,
    /// Several ranks with the shuffled sampler: every rank's sampler state after the last
    /// step, gathered at its end (a checkpoint resumes each rank from its own).
    rank_loaders: Arc<Vec<LoaderState>>,
    rolling: u64,
    /// The last step's LR multiplier.
    lr_mul: f64,
    steps: StepTable,
    /// Fingerprint of the training data files (checked on resume).
    data: String,
    /// The step this process started from (0 unless resumed).
    resumed_from: u64,
    /// Resumed from a checkpoint made after the last step: train nothing, only redo the
    /// closing work (final validation, weights) and hand the final snapshot on.
    finish_only: Option<Ending>,
    /// Training time at the end of the last step (what its snapshot and checkpoint record).
    step_end_ms: f64,
    /// Loader state and rolling fingerprint after the current step's latest micro-batch.
    step_loader: Option<(Arc<LoaderState>, u64)>,
    /// The last snapshot's copy of the parameters, with its step.
    last_weights: Option<(u64, crate::train::snapshot::Tensors)>,
    /// `step_trace = true`: `RUN_DIR/step_trace/` ([`crate::train::step_trace`]).
    trace: Option<Trace>,
}

impl Session {
    /// A session on `c` with `p`, continuing from `resume` when given, writing its log,
    /// step table and weights under `run_dir` (none under `pipeline validate`'s checks), and
    /// making snapshots of the steps `snapshots` names (`None`: no stage reads them; the final
    /// snapshot always goes). Runs `attention = "auto"`'s trials on a GPU.
    pub fn new(
        p: SessionParams,
        c: &Config,
        resume: Option<&Checkpoint>,
        run_dir: Option<&Path>,
        snapshots: Option<Demand>,
        executor: ExecutorKind,
    ) -> anyhow::Result<Self> {
        requirements::check(&p, c)?;
        // A checkpoint made after the last step: no step is trained, ever again.
        let finish_only = resume.and_then(|ck| resume::training_end(ck.meta.step, ck.meta.train_ms, &c.train));
        let shape = c.train_shape()?;
        let device = crate::device::open(&c.run)?;
        let ranks = crate::dist::world();
        // The executor's validation is shared by the ranks, each scoring 1/W of the split.
        let validator = Validator::shared(&c.validation(), shape.micro_steps, ranks.clone())?;
        let (param_dtype, matmul_dtype) = p.dtype.dtypes();
        let mut model = Gpt::new(&c.model, c.run.seed, param_dtype, &device)?.with_matmul_dtype(matmul_dtype).with_attention(p.attention);
        let mut flash = model.flash_kernels(shape.seq_len).context("stage `step_executor`, key `attention`")?;
        // "auto" on a GPU: both flash implementations tried at this run's shapes, each in a
        // process of its own, the faster that agrees taken.
        let mut auto_choice = None;
        let trained = resume.and_then(trained_attention);
        // Resuming, "auto" keeps the kernels the checkpoint trained with (no trial).
        let kept = resume.and_then(|ck| attention_choice::kept(trained.as_deref(), &ck.path)).filter(|_| flash.is_some());
        if let (Attention::Auto, Some(choice)) = (p.attention, kept) {
            model = model.with_attention(choice.kernels.attention());
            flash = Some(choice.kernels);
            auto_choice = Some(choice);
        } else if p.attention == Attention::Auto && flash.is_some() {
            // The candle path tries every implementation, the WMMA kernels the incumbent; the
            // engine its own two (kernels/flash_mma.cu through its backend, and cuDNN), the
            // mirror's validation then taking the same.
            let kinds: &[FlashKernels] = match executor {
                ExecutorKind::Candle => &FlashKernels::ALL,
                ExecutorKind::Engine(_) => &[FlashKernels::Mma, FlashKernels::Cudnn],
            };
            let m = &c.model;
            let at = AttentionShape {
                batch: shape.rows,
                t: shape.seq_len,
                heads: m.num_heads,
                kv_heads: m.num_kv_heads,
                head_dim: m.head_dim(),
            };
            let key = "stage `step_executor`, key `attention` = \"auto\"";
            let exe = attention_choice::this_binary().context(key)?;
            let choice = attention_choice::choose_flash(&exe, &c.run.device, at, attention_choice::TIMEOUT, kinds).context(key)?;
            model = model.with_attention(choice.kernels.attention());
            flash = Some(choice.kernels);
            auto_choice = Some(choice);
        }
        if let Some(path) = &c.train.init_weights {
            let tensors = crate::model::weights::load(path, None).context("`train.init_weights`")?;
            model.load_state(&tensors).with_context(|| format!("`train.init_weights` = {} does not fit `[model]`", path.display()))?;
        }
        // Depth recurrence starts off until `model.enable_looping_at` of training has passed
        // (a resume takes the checkpoint's layout).
        model.set_looping(c.model.enable_looping_at <= 0.0);
        let mut trainer: Box<dyn Executor> = match executor {
            #[cfg(feature = "candle")]
            ExecutorKind::Candle => {
                Box::new(Trainer::new(model, &c.train, shape.micro_steps)?.with_phase_sync(p.sync_phases).with_ranks(ranks.clone()))
            }
            #[cfg(not(feature = "candle"))]
            ExecutorKind::Candle => return Err(crate::eval::executor::candle_missing("stage `step_executor`, impl = \"candle\"")),
            ExecutorKind::Engine(options) => Box::new(
                EngineTrainer::new(model, &c.train, shape.micro_steps, (shape.rows, shape.seq_len), options)
                    .and_then(|e| e.with_ranks(ranks.clone(), &options))
                    .context("stage `step_executor`")?,
            ),
        };
        let data = data_fingerprint(c)?;
        let history = match resume {
            Some(ck) => Some(resume::resume(trainer.as_mut(), ck, shape, &data)?),
            None => None,
        };
        let unigram_bpb = match &c.data.train {
            Some(glob) => Some(validator.unigram_bpb(glob, c.model.vocab_size)?),
            None => None,
        };
        let mut log = TrainLog::new(run_dir, c.train.iterations, p.progress, resume.is_some())?;
        if let Some(ck) = resume {
            log.line(&format!(
                "resume: {} step:{} train_time:{:.0}ms data_fingerprint:{:016x}",
                ck.path.display(),
                ck.meta.step,
                ck.meta.train_ms,
                ck.meta.rolling
            ));
            if let Some(line) = resume::iterations_changed(ck, c.train.iterations) {
                log.line(&line);
            }
            if let Some(ending) = finish_only {
                log.line(&format!(
                    "resume: training ended at step {}/{} ({}): no step is trained; the final validation and the stages after training run again",
                    ck.meta.step,
                    c.train.iterations,
                    resume::ending_name(ending, &c.train)
                ));
            }
        }
        startup_lines(&mut log, c, trainer.as_ref(), &validator, shape, unigram_bpb);
        if !device.is_cpu() {
            let timing = if p.sync_phases { "device (synchronised per phase)" } else { "device (CUDA events, no sync per phase)" };
            log.line(&format!("attention:{} phase_times:{timing}", flash.map_or("materialized", |k| k.name())));
            if let ExecutorKind::Engine(_) = executor {
                // cuDNN where chosen (flash_mma, said in one line, where it refuses), else the
                // engine's own flash_mma kernels.
                let engine = if flash == Some(FlashKernels::Cudnn) { "cuDNN's fused attention" } else { "its own kernels (flash_mma)" };
                log.line(&format!(
                    "attention: the engine trains with {engine}; {} is the candle mirror's, for validation",
                    flash.map_or("materialized", |k| k.name())
                ));
            }
            if let Some(choice) = &auto_choice {
                log.line(&format!("attention_auto: {}", choice.line));
            }
            let now = flash.map_or("materialized", |k| k.name());
            if let Some(then) = trained.as_deref().filter(|&then| then != now) {
                log.line(&format!(
                    "attention: the checkpoint trained with {then}, this run with {now} (key `attention`): the resumed run is not the uninterrupted one bit for bit"
                ));
            }
        }
        let resumed_from = trainer.step();
        let trace = match run_dir.filter(|_| p.step_trace) {
            None => None,
            Some(dir) => {
                anyhow::ensure!(resume.is_none(), "key `step_trace`: a trace starts at step 0, and this run resumes a checkpoint");
                anyhow::ensure!(
                    ranks.world() == 1,
                    "key `step_trace`: a trace is one rank's batches; this run has {} ranks",
                    ranks.world()
                );
                Some(Trace::create(dir, shape, &p.step_trace_weights_at)?)
            }
        };
        let steps = StepTable::new(run_dir, resume.map(|ck| ck.meta.step))?;
        let (train_ms, vals, last_loss, rolling, lr_mul) = match (resume, history) {
            (Some(ck), Some(h)) => (ck.meta.train_ms, h.validations, ck.meta.train_loss, ck.meta.rolling, h.lr_mul.unwrap_or(1.0)),
            _ => (0.0, Vec::new(), f64::NAN, crate::data::batch::FINGERPRINT_SEED, 1.0),
        };
        Ok(Self {
            trainer,
            validator,
            log,
            cfg: c.train.clone(),
            shape,
            vocab: c.model.vocab_size as u32,
            unigram_bpb,
            attention: (!device.is_cpu()).then(|| flash.map_or("materialized", |k| k.name())),
            auto_choice,
            weights_path: (c.train.save_weights).then(|| run_dir.map(|d| d.join("final_model.safetensors"))).flatten(),
            started: false,
            done: false,
            train_before_mark: Duration::from_secs_f64(train_ms / 1e3),
            mark: None,
            step_start_ms: 0.0,
            idle_since: None,
            window: Phases::default(),
            window_steps: 0,
            total: Phases::default(),
            last_loss,
            vals,
            last_val: None,
            ending: None,
            dropped_micro: 0,
            saved_at: None,
            snapshots,
            loader: resume.and_then(|ck| resume::loader_for(ck, &shape)).map(Arc::new),
            rank_loaders: Arc::new(resume.map(|ck| ck.meta.rank_loaders.clone()).unwrap_or_default()),
            rolling,
            lr_mul,
            steps,
            data,
            resumed_from,
            finish_only,
            step_end_ms: train_ms,
            step_loader: None,
            ranks,
            agreed_stop: false,
            comm_total: Duration::ZERO,
            overlapped_total: Duration::ZERO,
            last_weights: None,
            trace,
        })
    }
}

impl Session {
    /// Trains on one micro-batch: validates at step 0 first, ends the step when it is the last
    /// micro-batch of one, and ends training when the step is the last. On an error the
    /// weights of the last finished step are kept ([`Session::on_failure`]: the runtime calls
    /// no `flush` after a failed stage).
    pub fn process(&mut self, b: DeviceBatch, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let result = self.take(b, out, ctx);
        if result.is_err() {
            // The runtime skips `flush` after an error: keep what training made now.
            self.on_failure(ctx);
        }
        result
    }

    /// One micro-batch (what `process` does, errors left to it).
    fn take(&mut self, b: DeviceBatch, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let arrived = Instant::now();
        // Several ranks stop together, at the end of the step where they agreed to
        // (`agree_after_step`): until then a rank asked to stop trains on what is in flight.
        let stop_now = ctx.stopping() && (self.ranks.world() == 1 || self.agreed_stop);
        if self.done || stop_now {
            // Batches still in flight after the last step, or after a stop (Ctrl-C, max_seconds),
            // are not part of the run: the step they would complete is dropped in `flush`.
            ctx.discard();
            return Ok(());
        }
        if let Some(ending) = self.finish_only {
            // Training had ended: the batches a resumed sampler sends are not trained on.
            return self.finish_resumed(ending, out, ctx);
        }
        if !self.started {
            self.started = true;
            if self.cfg.val_every > 0 && self.trainer.step() == 0 {
                self.validate(ctx, false)?;
            }
            if self.trace.is_some() {
                let state = self.state_to_save()?;
                if let Some(trace) = &self.trace {
                    trace.weights(0, &state)?;
                }
            }
            self.send(Moment::Start, out, ctx)?;
            self.mark = Some(Instant::now());
        } else if let Some(t) = self.idle_since {
            self.window.data_wait += arrived - t;
        }
        self.check_batch(&b)?;
        if self.trainer.micro_done() == 0 {
            self.step_start_ms = self.train_ms();
        }
        if let Some(trace) = self.trace.as_mut() {
            trace.batch(&b.x, &b.y)?;
        }
        let t = self.trainer.micro_step(&b.x, &b.y).with_context(|| format!("training step {}", self.trainer.step() + 1))?;
        ctx.trace_phases(&[("forward", t.forward), ("backward", t.backward)]);
        self.window.h2d += Duration::from_nanos(b.upload_ns);
        self.step_loader = Some((b.meta.state.clone(), b.meta.rolling));
        if self.trainer.micro_done() == self.trainer.micro_steps() {
            self.end_step(out, ctx)?;
        }
        self.idle_since = Some(Instant::now());
        Ok(())
    }

    /// Emits a snapshot (when a stage reads it: the final one, or a step's the stages after
    /// training need), timing the copy of the parameters.
    fn send(&mut self, moment: Moment, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let Some(demand) = self.snapshots else {
            return Ok(());
        };
        let step = self.trainer.step();
        if matches!(moment, Moment::Start | Moment::Step) && !demand.wants(step) {
            return Ok(());
        }
        let weights = match &self.last_weights {
            Some((s, w)) if *s == step => w.clone(),
            _ => {
                let t0 = Instant::now();
                let model = self.trainer.synced_model()?;
                let mut copied = Vec::with_capacity(model.params().len());
                for (name, t) in model.state_dict() {
                    // A copy (the optimizers update the parameters in place), detached: a copy of
                    // a variable would record the op, and every average made from it would
                    // chain to the previous one, holding all of them alive.
                    copied.push((name, t.detach().copy()?));
                }
                ctx.record("snapshot", t0.elapsed().as_nanos() as u64);
                let w = Arc::new(copied);
                self.last_weights = Some((step, w.clone()));
                w
            }
        };
        let history = serde_json::to_value(History {
            shape: self.shape,
            validations: self.vals.clone(),
            attention: self.attention.map(String::from),
            lr_mul: Some(self.lr_mul),
            iterations: Some(self.cfg.iterations),
            looping: self.trainer.model().looping(),
        })?;
        let state = TrainerState {
            optimizer: Arc::new(self.trainer.optimizer_state()?),
            loader: self.loader.clone(),
            rank_loaders: self.rank_loaders.clone(),
            rolling: self.rolling,
            history,
            data: self.data.clone(),
        };
        let snap = TrainSnapshot {
            step,
            moment,
            // The training time at the end of the last step: what the cap was judged by, and
            // without the part of a step a stop dropped, so a resume from its checkpoint goes on
            // as the uninterrupted run would.
            train_ms: self.step_end_ms,
            train_loss: self.last_loss,
            lr_mul: self.lr_mul,
            weights,
            state: Arc::new(state),
            averager: None,
            eval: None,
        };
        out.emit(snap)?;
        Ok(())
    }

    /// A run resumed after its last step: the final validation (its weights are saved again
    /// only if they differ from the file's), then the final snapshot for the stages after
    /// training; no step, no snapshot of a step.
    fn finish_resumed(&mut self, ending: Ending, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        self.started = true;
        self.ending = Some(ending);
        // The final validation runs again even if the checkpoint's history has it (a checkpoint
        // of the final snapshot): the report's final score comes from it. Same weights, same
        // numbers; the history keeps one entry.
        let step = self.trainer.step();
        if self.vals.last().is_some_and(|v| v.step == step) {
            self.vals.pop();
        }
        self.end_training(ending, None, out, ctx)
    }

    /// Training is over (`ending`): the final validation, `note` logged after it, the closing
    /// lines and weights, then the final snapshot, and the graph asked to stop.
    fn end_training(
        &mut self,
        ending: Ending,
        note: Option<String>,
        out: &mut Emitter<'_, TrainSnapshot>,
        ctx: &mut Ctx,
    ) -> anyhow::Result<()> {
        ctx.finishing(|ctx| -> anyhow::Result<()> {
            self.final_validation(ctx)?;
            if let Some(n) = &note {
                self.log.line(n);
            }
            self.wrap_up()
        })?;
        self.done = true;
        self.log.finish();
        self.send(Moment::Final(ending), out, ctx)?;
        ctx.request_stop();
        Ok(())
    }

    /// After the input ended or the graph stopped: the dropped partial step, the weights, the
    /// final validation unless interrupted, the final snapshot and the report's `train` section.
    pub fn close(&mut self, out: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        if let Some(ending) = self.finish_only
            && !self.started
            && ctx.stop_reason() == StopReason::Completed
        {
            // The input ended before a batch came: the closing work still runs.
            self.finish_resumed(ending, out, ctx)?;
            self.publish(ctx);
            return Ok(());
        }
        if self.done || !self.started {
            self.publish(ctx);
            self.log.finish();
            return Ok(());
        }
        if self.ranks.world() > 1 && !self.agreed_stop && ctx.stop_reason() != StopReason::Failed {
            // The other ranks may be inside a step this one will not take: they would wait for
            // it forever. The job is ended (`pipeline launch`, MPI), this rank named.
            let step = self.trainer.step();
            let partial = self.trainer.discard_partial_step();
            anyhow::bail!(
                "rank {} of {}: its input ended after step {step} (and {partial} micro-batch(es) of step {}), but several ranks \
                 end only together, where they agree: at `train.iterations`, `run.max_seconds` or Ctrl-C; every rank is stopped",
                self.ranks.rank(),
                self.ranks.world(),
                step + 1
            );
        }
        self.dropped_micro = self.trainer.discard_partial_step();
        if self.dropped_micro > 0 {
            self.log.line(&format!(
                "note: the input ended inside step {}; its {} micro-batch(es) were dropped",
                self.trainer.step() + 1,
                self.dropped_micro
            ));
        }
        self.pause();
        let step = self.trainer.step();
        match ctx.stop_reason() {
            StopReason::Interrupted => {
                self.ending = Some(Ending::Interrupted);
                self.log.line(&format!(
                    "stopping_early: interrupted train_time:{:.0}ms step:{step}/{}",
                    self.train_ms(),
                    self.cfg.iterations
                ));
                ctx.finishing(|_| self.save_weights())?;
                self.send(Moment::Final(Ending::Interrupted), out, ctx)?;
            }
            StopReason::Completed => {
                self.ending = Some(Ending::InputEnded);
                ctx.finishing(|ctx| -> anyhow::Result<()> {
                    self.final_validation(ctx)?;
                    self.wrap_up()
                })?;
                self.send(Moment::Final(Ending::InputEnded), out, ctx)?;
            }
            StopReason::Failed => {
                self.on_failure(ctx);
                return Ok(());
            }
        }
        self.done = true;
        self.publish(ctx);
        self.log.finish();
        Ok(())
    }

    /// Another stage failed, or this one did: saves the weights of the last finished step when
    /// every parameter is finite (a failure an hour in must not lose the hour), and publishes
    /// the `train` section. Its own errors are logged, not raised: the first error is the story.
    fn on_failure(&mut self, ctx: &Ctx) {
        if self.done && self.ending == Some(Ending::Failed) {
            return;
        }
        self.pause();
        self.ending = Some(Ending::Failed);
        self.done = true;
        self.trainer.discard_partial_step();
        if self.started {
            let finite = match self.trainer.synced_model() {
                Ok(m) => m.params().iter().all(|(_, v, _)| {
                    v.as_tensor()
                        .to_dtype(DType::F64)
                        .and_then(|t| t.sum_all())
                        .and_then(|t| t.to_scalar::<f64>())
                        .is_ok_and(f64::is_finite)
                }),
                Err(e) => {
                    self.log.line(&format!("note: the weights could not be read after the failure: {e:#}"));
                    false
                }
            };
            if !finite {
                self.log.line("note: the run failed with non-finite weights; they were not saved");
            } else if let Err(e) = self.save_weights() {
                self.log.line(&format!("note: the run failed and its weights could not be saved either: {e:#}"));
            }
        }
        self.publish(ctx);
        self.log.finish();
    }

    fn check_batch(&self, b: &DeviceBatch) -> anyhow::Result<()> {
        let s = self.shape;
        anyhow::ensure!(
            b.x.dims() == [s.rows, s.seq_len] && b.y.dims() == [s.rows, s.seq_len],
            "micro-batch shapes {:?} / {:?}, expected ({}, {}) from `[train]`",
            b.x.dims(),
            b.y.dims(),
            s.rows,
            s.seq_len
        );
        anyhow::ensure!(
            b.meta.micro as usize == self.trainer.micro_done(),
            "micro-batches out of order: got micro-batch {} of step {}, expected micro-batch {}",
            b.meta.micro,
            b.meta.step,
            self.trainer.micro_done()
        );
        if !b.x.device().is_cpu() {
            // A read on a GPU is a host synchronisation per micro-batch; the sampler checks token
            // ids against the tokenizer (`check_tokens`) before they get here.
            return Ok(());
        }
        let max = b.x.max_all()?.to_scalar::<u32>()?.max(b.y.max_all()?.to_scalar::<u32>()?);
        anyhow::ensure!(
            max < self.vocab,
            "token id {max} in step {} is not below `model.vocab_size` = {} (shards made with another tokenizer?)",
            b.meta.step + 1,
            self.vocab
        );
        Ok(())
    }

    /// Training time so far, ms.
    fn train_ms(&self) -> f64 {
        let running = self.mark.map(|m| m.elapsed()).unwrap_or_default();
        (self.train_before_mark + running).as_secs_f64() * 1e3
    }

    /// The trainer's phase times (host clock, or device events: [`crate::train::trainer::StepOutcome::phases`]).
    fn add_phases(&mut self, d: crate::device::phase_clock::PhaseTimes) {
        self.window.forward += d.forward;
        self.window.backward += d.backward;
        self.window.optimizer += d.optimizer;
    }

    /// Turns depth recurrence on after the step that brings the training-time fraction to
    /// `model.enable_looping_at` (the steps after it run looped), and logs the layout.
    fn switch_looping(&mut self, step: u64, train_ms: f64) {
        let model = self.trainer.model();
        if !model.config().recurrent() || model.looping() {
            return;
        }
        let frac = self.cfg.training_frac(step, train_ms);
        if frac >= model.config().enable_looping_at {
            let line = looping_line(model.config(), step, frac);
            self.trainer.set_looping(true);
            self.log.line(&line);
        }
    }

    /// The largest of every rank's `values` (the values themselves on one rank).
    fn agree_max(&self, values: &[f64]) -> anyhow::Result<Vec<f64>> {
        if self.ranks.is_identity() {
            return Ok(values.to_vec());
        }
        self.ranks.all_reduce_host(values, crate::dist::ReduceOp::Max).context("the ranks' agreement at the end of a step")
    }

    /// After a step, several ranks agree on the training time (the slowest rank's, so that the
    /// wall-clock cap ends them at the same step) and on stopping: a stop asked of any rank
    /// (Ctrl-C, `run.max_seconds`) stops all after this step. Returns the training time.
    fn agree_after_step(&mut self, ctx: &mut Ctx) -> anyhow::Result<f64> {
        let agreed = self.agree_max(&[self.train_ms(), if ctx.stopping() { 1.0 } else { 0.0 }])?;
        if agreed[1] > 0.0 {
            self.agreed_stop = true;
            if !ctx.stopping() {
                self.log.line(&format!("note: another rank was asked to stop: every rank stops after step {}", self.trainer.step()));
                ctx.request_stop();
            }
        }
        Ok(agreed[0])
    }

    fn pause(&mut self) {
        if let Some(m) = self.mark.take() {
            self.train_before_mark += m.elapsed();
        }
    }

    /// Several ranks with the shuffled sampler, whose states differ by rank: every rank's
    /// state after this step, for the checkpoints (a few hundred bytes per rank).
    fn gather_loaders(&mut self) -> anyhow::Result<()> {
        let Some(mine) = self.loader.as_deref().filter(|l| self.ranks.world() > 1 && matches!(l, LoaderState::Shuffled { .. })) else {
            return Ok(());
        };
        let all = self.ranks.all_gather_bytes(&serde_json::to_vec(mine)?).context("gathering the ranks' sampler states")?;
        let states = all.iter().map(|b| serde_json::from_slice(b)).collect::<Result<Vec<LoaderState>, _>>()?;
        self.rank_loaders = Arc::new(states);
        Ok(())
    }

    fn end_step(&mut self, emitter: &mut Emitter<'_, TrainSnapshot>, ctx: &mut Ctx) -> anyhow::Result<()> {
        let t0 = Instant::now();
        // Several ranks: the LR schedule reads one clock, the slowest rank's.
        let start_ms = self.agree_max(&[self.step_start_ms])?[0];
        let out = self.trainer.finish_step(start_ms)?;
        ctx.trace_phases(&[("optimizer", t0.elapsed())]);
        self.comm_total += out.comm;
        self.overlapped_total += out.overlapped;
        if !self.ranks.is_identity() {
            // What the step waited for its collectives (gradient all-reduce, sharded Muon's
            // exchange), also inside the phases above (candle: the optimizer; the engine: the
            // backward pass for the all-reduce, the optimizer for Muon's), and the all-reduce
            // time that ran under the backward pass instead.
            ctx.record("allreduce", out.comm.as_nanos() as u64);
            ctx.record("allreduce_overlapped", out.overlapped.as_nanos() as u64);
        }
        self.add_phases(out.phases);
        self.window_steps += 1;
        self.last_loss = out.train_loss;
        self.lr_mul = out.lr_mul;
        if let Some((state, rolling)) = self.step_loader.take() {
            self.loader = Some(state);
            self.rolling = rolling;
            self.gather_loaders()?;
        }
        let (step, total) = (self.trainer.step(), self.cfg.iterations);
        let train_ms = self.agree_after_step(ctx)?;
        self.step_end_ms = train_ms;
        let ending = resume::training_end(step, train_ms, &self.cfg);
        let last = ending.is_some();
        self.trace_step(step, &out, last)?;
        self.switch_looping(step, train_ms);
        let p = &out.phases;
        self.steps.row(step, out.train_loss, out.lr_mul, train_ms, self.rolling, [p.forward, p.backward, p.optimizer]);
        self.send(Moment::Step, emitter, ctx)?;
        // As the script: no train lines at all when log_every is 0.
        if self.cfg.log_every > 0 && (step <= 10 || step.is_multiple_of(self.cfg.log_every) || last) {
            self.log.line(&train_line(step, total, out.train_loss, train_ms));
        }
        self.log.progress(step, out.train_loss, train_ms / step as f64);
        if let Some(ending) = ending {
            self.ending = Some(ending);
            self.pause();
            let note = (ending == Ending::WallclockCap)
                .then(|| format!("stopping_early: wallclock_cap train_time:{train_ms:.0}ms step:{step}/{total}"));
            self.end_training(ending, note, emitter, ctx)?;
        } else if self.cfg.val_every > 0 && step.is_multiple_of(self.cfg.val_every) {
            self.validate(ctx, false)?;
        }
        if last {
            // On a GPU the last update's span, so that the run's totals hold every phase.
            let rest = self.trainer.flush_phase_times()?;
            self.add_phases(rest);
        }
        if self.cfg.timing_every > 0 && (step.is_multiple_of(self.cfg.timing_every) || last) {
            self.log.line(&self.window.line(step, total, self.window_steps));
            self.total.add(&self.window);
            self.window = Phases::default();
            self.window_steps = 0;
        }
        Ok(())
    }

    /// A validation pass, with the training clock paused. A routine one (`final_pass` false)
    /// gives way to a stop (Ctrl-C, `run.max_seconds`): the stop's own path saves the weights
    /// and, unless interrupted, validates in full. The final one gives way only to an abort.
    fn validate(&mut self, ctx: &mut Ctx, final_pass: bool) -> anyhow::Result<()> {
        self.pause();
        let t0 = Instant::now();
        // Several ranks score the split together and agree before each batch whether to go
        // on: one rank's stop cuts the pass short on all.
        let keep_going = || if final_pass { !ctx.aborted() } else { !ctx.stopping() };
        let trainer = &mut self.trainer;
        let multiple = trainer.score_rows();
        let acc = self.validator.run_with(&mut |x, y, rows| trainer.score(x, y, rows), multiple, keep_going).context("validation")?;
        self.window.validation += t0.elapsed();
        ctx.trace_phases(&[("validation", t0.elapsed())]);
        let step = self.trainer.step();
        let train_ms = self.train_ms();
        let Some(acc) = acc else {
            self.log.line(&format!("note: the validation at step {step} was cut short by the stop and is not reported"));
            if self.started && !self.done {
                self.mark = Some(Instant::now());
            }
            return Ok(());
        };
        self.log.line(&val_line(step, self.cfg.iterations, acc.val_loss(), acc.val_bpb(), train_ms));
        self.vals.push(ValPoint { step, val_loss: acc.val_loss(), val_bpb: acc.val_bpb(), train_time_ms: train_ms });
        self.last_val = Some(acc);
        if self.started && !self.done {
            self.mark = Some(Instant::now());
        }
        Ok(())
    }

    /// The final validation, unless the last step was just validated. The weights are saved
    /// first, so that a validation that fails (out of memory, say) does not take them along.
    fn final_validation(&mut self, ctx: &mut Ctx) -> anyhow::Result<()> {
        let step = self.trainer.step();
        self.save_weights()?;
        if self.vals.last().is_none_or(|v| v.step != step) {
            self.done = true; // keeps the clock paused
            self.validate(ctx, true)?;
        }
        Ok(())
    }

    /// The closing lines, and the weights unless `final_validation` saved them already.
    fn wrap_up(&mut self) -> anyhow::Result<()> {
        if let (Some(acc), Some(u)) = (&self.last_val, self.unigram_bpb) {
            self.log.line(&format!(
                "final val_loss:{:.4} val_bpb:{:.4} unigram_bpb:{u:.4} ({} val tokens, {} bytes)",
                acc.val_loss(),
                acc.val_bpb(),
                acc.tokens(),
                acc.bytes()
            ));
        }
        if let Some(kb) = peak_rss_kib() {
            self.log.line(&format!("peak memory (process RSS): {} MiB", kb / 1024));
        }
        if self.saved_at != Some(self.trainer.step()) {
            self.save_weights()?;
        }
        Ok(())
    }

    /// With a trace: its row of `step` (the loop as it was during the step: called before the
    /// switch) and, when it wants them, the weights after it (`last`: the run's last step).
    fn trace_step(&mut self, step: u64, out: &StepOutcome, last: bool) -> anyhow::Result<()> {
        let looping = self.trainer.model().looping();
        let Some(trace) = self.trace.as_mut() else { return Ok(()) };
        trace.step(step, out, looping)?;
        if trace.wants_weights(step, last) {
            let state = self.state_to_save()?;
            if let Some(trace) = &self.trace {
                trace.weights(step, &state)?;
            }
        }
        Ok(())
    }

    /// The weights as they are saved (`final_model.safetensors`, a trace's): the model's
    /// `state_dict` in `train.weights_layout`.
    fn state_to_save(&mut self) -> anyhow::Result<Vec<(String, candle_core::Tensor)>> {
        let model = self.trainer.synced_model()?;
        self.cfg.weights_layout.apply(model.state_dict(), model.config().num_layers)
    }

    fn save_weights(&mut self) -> anyhow::Result<()> {
        if let Some(path) = self.weights_path.clone() {
            let state = self.state_to_save()?;
            crate::model::weights::save(&path, &state)?;
            self.saved_at = Some(self.trainer.step());
            self.log.line(&format!("saved weights: {} (step {})", path.display(), self.trainer.step()));
        }
        Ok(())
    }
}
