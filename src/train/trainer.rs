//! One optimizer step of the baseline, as `train_gpt.py` takes it (spec 3.6 to 3.8): for each of
//! the step's micro-batches a forward pass and `backward(loss / A)`, gradients summed over the
//! micro-batches; optional clipping of the global gradient norm; the Muon momentum warm-up and
//! the LR multiplier applied to every group's base LR; then Muon on the block matrices and Adam
//! on the embedding, the control tensors and an untied head. The 04-09 record's training
//! elements come from `[train]`, each off by default: MuonEq-R and weight decay in Muon, AdamW
//! per group, the warm-down on the training fraction ([`TrainConfig::lr_mul`]).
//!
//! The trainer knows nothing of channels or threads: the `step_executor` stage feeds it
//! micro-batches and decides when to validate and stop.

use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::device::phase_clock::{Phase, PhaseClock, PhaseTimes};
use crate::dist::{Collective, ReduceOp};
use crate::model::{Gpt, ParamGroup};
use crate::optim::{Adam, Muon};
use crate::train::config::TrainConfig;
pub use crate::train::executor::{MicroTimes, StepOutcome};

/// The model with its optimizers and the step in progress.
pub struct Trainer {
    model: Gpt,
    muon: Muon,
    adams: Vec<Adam>,
    cfg: TrainConfig,
    micro_steps: usize,
    /// Gradients summed over this step's micro-batches so far (parameters only).
    grads: GradStore,
    micro_done: usize,
    loss_sum: f64,
    /// The step's summed loss on the device (GPU runs; the CPU sums on the host).
    loss_dev: Option<Tensor>,
    step: u64,
    /// Wait for the device at each phase's end, so that phase times are device times.
    sync_phases: bool,
    /// Device-side phase spans (CUDA events) when the phases are not synchronised.
    clock: PhaseClock,
    /// The host's phase times of the step in progress (used when the clock is inert).
    host_phases: PhaseTimes,
    /// The ranks training together (a world of one: no collective).
    ranks: std::sync::Arc<dyn Collective>,
}

impl Trainer {
    /// Groups `model`'s parameters as the script does: block matrices to Muon at `matrix_lr`
    /// (with `muon_row_norm` and `muon_weight_decay`); the embedding to Adam at `tied_embed_lr`
    /// (tied) or `embed_lr`, AdamW with `embed_weight_decay`; control tensors and skip weights to
    /// Adam at `scalar_lr`, AdamW with `scalar_weight_decay`; an untied head to Adam at
    /// `head_lr`, AdamW with `head_weight_decay`.
    pub fn new(model: Gpt, cfg: &TrainConfig, micro_steps: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(micro_steps >= 1, "a step needs at least one micro-batch");
        let group = |g: ParamGroup| -> Vec<(String, Var)> {
            model.params().iter().filter(|(_, _, x)| *x == g).map(|(n, v, _)| (n.clone(), v.clone())).collect()
        };
        let betas = (cfg.beta1, cfg.beta2);
        let embed_lr = if model.config().tie_embeddings { cfg.tied_embed_lr } else { cfg.embed_lr };
        let mut muon = Muon::new(group(ParamGroup::Matrix), cfg.matrix_lr, cfg.muon_momentum, cfg.muon_backend_steps)?
            .with_prefix("muon")
            .with_coefficients(cfg.muon_ns)
            .with_row_norm(cfg.muon_row_norm)
            .with_weight_decay(cfg.muon_weight_decay);
        if model.matmul_dtype() != model.dtype() {
            // Mixed precision: Newton-Schulz in the matmul dtype, as the record does in bf16.
            muon = muon.with_ns_dtype(model.matmul_dtype());
        }
        let mut adams = vec![
            Adam::new(group(ParamGroup::Embedding), embed_lr, betas, cfg.adam_eps)?
                .with_prefix("adam_embed")
                .with_weight_decay(cfg.embed_weight_decay),
            Adam::new(group(ParamGroup::Scalar), cfg.scalar_lr, betas, cfg.adam_eps)?
                .with_prefix("adam_scalar")
                .with_weight_decay(cfg.scalar_weight_decay),
        ];
        let head = group(ParamGroup::Head);
        if !head.is_empty() {
            adams
                .push(Adam::new(head, cfg.head_lr, betas, cfg.adam_eps)?.with_prefix("adam_head").with_weight_decay(cfg.head_weight_decay));
        }
        Ok(Self {
            model,
            muon,
            adams,
            cfg: cfg.clone(),
            micro_steps,
            grads: GradStore::default(),
            micro_done: 0,
            loss_sum: 0.0,
            loss_dev: None,
            step: 0,
            sync_phases: false,
            clock: PhaseClock::new(&Device::Cpu),
            host_phases: PhaseTimes::default(),
            ranks: std::sync::Arc::new(crate::dist::single::Single),
        })
    }

    /// Trains as one of the ranks of `ranks` (data parallel): each step's gradients are
    /// averaged over the ranks before clipping, and Muon orthogonalises only this rank's share
    /// of the matrices, the updates then summed over the ranks (the records' sharded Muon).
    pub fn with_ranks(mut self, ranks: std::sync::Arc<dyn Collective>) -> Self {
        self.muon.set_shard(ranks.clone());
        self.ranks = ranks;
        self
    }

    /// The model.
    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// Mutable model (to load weights before training).
    pub fn model_mut(&mut self) -> &mut Gpt {
        &mut self.model
    }

    /// Optimizer steps taken.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Waits for the device at the end of every phase (forward, backward, optimizer) when
    /// `on`, so that [`MicroTimes`] and [`StepOutcome::optimizer`] time the device's work. When
    /// off, the device is awaited once per step (the loss read): on a GPU those host times are
    /// then only the time to queue the work, and CUDA events give the device's phase times
    /// ([`StepOutcome::device`]). No effect on the CPU.
    pub fn with_phase_sync(mut self, on: bool) -> Self {
        self.sync_phases = on;
        // Without the waits a GPU's phases are timed by events on its stream.
        self.clock = PhaseClock::new(if on { &Device::Cpu } else { self.model.device() });
        self
    }

    /// Whether the phases are timed on the device ([`StepOutcome::device`]) rather than by the
    /// host's clock.
    pub fn device_timed(&self) -> bool {
        self.clock.active()
    }

    /// Phase times not yet returned by a step (device spans still running: waits for them; zero
    /// when the host times): for the end of a run, so that its totals hold every phase.
    pub fn flush_phase_times(&mut self) -> anyhow::Result<PhaseTimes> {
        Ok(self.clock.take_all()?.unwrap_or_default())
    }

    fn phase_end(&self) -> anyhow::Result<()> {
        if self.sync_phases {
            self.model.device().synchronize()?;
        }
        Ok(())
    }

    /// Micro-batches of the current step taken so far.
    pub fn micro_done(&self) -> usize {
        self.micro_done
    }

    /// Micro-batches per step.
    pub fn micro_steps(&self) -> usize {
        self.micro_steps
    }

    /// Forward and backward of one micro-batch (`x`, `y`: `(rows, seq_len)` u32), adding
    /// `∇(loss / A)` to the step's gradients.
    pub fn micro_step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<MicroTimes> {
        crate::train::executor::check_micro_batch(self.micro_done, self.micro_steps, self.step, self.cfg.iterations)?;
        let t0 = Instant::now();
        let m0 = self.clock.mark()?;
        let loss = self.model.loss(x, y)?;
        if self.model.device().is_cpu() {
            // On the host reading the value costs nothing: check every micro-batch.
            let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            anyhow::ensure!(value.is_finite(), "the training loss is {value} at step {} micro-batch {}", self.step + 1, self.micro_done);
            self.loss_sum += value;
        } else {
            // On a GPU a read is a host synchronisation: sum on the device, read once per step.
            let l = loss.detach().to_dtype(DType::F32)?;
            self.loss_dev = Some(match self.loss_dev.take() {
                Some(acc) => (acc + l)?,
                None => l,
            });
        }
        self.phase_end()?;
        let (m1, m2) = (self.clock.mark()?, self.clock.mark()?);
        self.clock.span(Phase::Forward, m0, m1);
        let t1 = Instant::now();
        let mut store = (loss / self.micro_steps as f64)?.backward()?;
        for (_, var, _) in self.model.params() {
            // Only the parameters' gradients are kept; the activations' go with `store`.
            if let Some(g) = store.remove(var.as_tensor()) {
                // Detached: a gradient can still reference the op graph of its backward rule
                // (and through it this micro-batch's activations), which must not outlive `store`.
                let g = g.detach();
                let sum = match self.grads.remove(var.as_tensor()) {
                    Some(prev) => (prev + g)?,
                    None => g,
                };
                self.grads.insert(var.as_tensor(), sum);
            }
        }
        drop(store);
        self.phase_end()?;
        let m3 = self.clock.mark()?;
        self.clock.span(Phase::Backward, m2, m3);
        self.micro_done += 1;
        let times = MicroTimes { forward: t1 - t0, backward: t1.elapsed() };
        self.host_phases.forward += times.forward;
        self.host_phases.backward += times.backward;
        Ok(times)
    }

    /// Ends the step once all its micro-batches are in: clips, sets the schedule and steps every
    /// optimizer. `elapsed_ms` is the training time before this step (validation excluded), for
    /// the wall-clock warm-down and the training fraction.
    pub fn finish_step(&mut self, elapsed_ms: f64) -> anyhow::Result<StepOutcome> {
        anyhow::ensure!(self.micro_done == self.micro_steps, "step ended after {} of {} micro-batches", self.micro_done, self.micro_steps);
        let t0 = Instant::now();
        if let Some(acc) = self.loss_dev.take() {
            let sum = acc.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            anyhow::ensure!(sum.is_finite(), "the training loss is {sum} at step {}", self.step + 1);
            self.loss_sum = sum;
        }
        let m0 = self.clock.mark()?;
        let c = &self.cfg;
        let (lr_mul, frac, momentum) = c.schedule(self.step, elapsed_ms);
        let comm = self.average_gradients()?;
        let c = &self.cfg;
        let grad_norm = if c.grad_clip_norm > 0.0 { Some(self.clip(c.grad_clip_norm)?) } else { None };
        self.muon.step(&self.grads, self.muon.base_lr() * lr_mul, momentum)?;
        let comm = comm + self.muon.last_comm();
        for adam in &mut self.adams {
            adam.step(&self.grads, adam.base_lr() * lr_mul)?;
        }
        self.phase_end()?;
        let m1 = self.clock.mark()?;
        self.clock.span(Phase::Optimizer, m0, m1);
        let host = PhaseTimes { optimizer: t0.elapsed(), ..std::mem::take(&mut self.host_phases) };
        let phases = if self.device_timed() { self.clock.take_ended()?.unwrap_or_default() } else { host };
        let outcome = StepOutcome {
            train_loss: self.loss_sum / self.micro_steps as f64,
            lr_mul,
            frac,
            momentum,
            grad_norm,
            phases,
            comm,
            overlapped: std::time::Duration::ZERO,
        };
        self.grads = GradStore::default();
        self.micro_done = 0;
        self.loss_sum = 0.0;
        self.step += 1;
        Ok(outcome)
    }

    /// Several ranks: every gradient replaced by its mean over the ranks (DDP's all-reduce, in
    /// buckets of [`crate::dist::bucket::DEFAULT_BUCKET_ELEMS`]); returns the collectives' wall
    /// time. Every rank's autograd produced gradients for the same parameters.
    fn average_gradients(&mut self) -> anyhow::Result<std::time::Duration> {
        if self.ranks.is_identity() {
            return Ok(std::time::Duration::ZERO);
        }
        let (vars, grads): (Vec<Var>, Vec<Tensor>) =
            self.model.params().iter().filter_map(|(_, v, _)| Some((v.clone(), self.grads.get(v.as_tensor())?.clone()))).unzip();
        let (mean, stats) = crate::dist::bucket::all_reduce_tensors(
            self.ranks.as_ref(),
            &grads,
            ReduceOp::Mean,
            crate::dist::bucket::DEFAULT_BUCKET_ELEMS,
        )?;
        for (v, g) in vars.iter().zip(mean) {
            self.grads.insert(v.as_tensor(), g);
        }
        Ok(stats.comm)
    }

    /// Drops the micro-batches of an unfinished step (the run ended inside it).
    pub fn discard_partial_step(&mut self) -> usize {
        let n = self.micro_done;
        self.host_phases = PhaseTimes::default();
        self.grads = GradStore::default();
        self.micro_done = 0;
        self.loss_sum = 0.0;
        self.loss_dev = None;
        n
    }

    /// `torch.nn.utils.clip_grad_norm_`: scales every gradient by `max / (norm + 1e-6)` when the
    /// global norm exceeds `max`; returns the norm before clipping.
    fn clip(&mut self, max: f64) -> anyhow::Result<f64> {
        let mut sq = 0.0f64;
        for (_, var, _) in self.model.params() {
            if let Some(g) = self.grads.get(var.as_tensor()) {
                sq += g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
            }
        }
        let norm = sq.sqrt();
        let coef = max / (norm + 1e-6);
        if coef < 1.0 {
            for (_, var, _) in self.model.params() {
                if let Some(g) = self.grads.remove(var.as_tensor()) {
                    self.grads.insert(var.as_tensor(), (g * coef)?);
                }
            }
        }
        Ok(norm)
    }

    /// Every optimizer's state as named tensors (`muon.*`, `adam_embed.*`, `adam_scalar.*`,
    /// `adam_head.*`).
    pub fn optimizer_state(&self) -> Vec<(String, Tensor)> {
        let mut v = self.muon.state_tensors();
        for a in &self.adams {
            v.extend(a.state_tensors());
        }
        v
    }

    /// Continues from a checkpoint: `step` steps taken, optimizer state from `optimizer` (the
    /// names [`Trainer::optimizer_state`] gives). Errors name the tensor that is missing or
    /// does not fit; the model's weights are loaded separately.
    pub fn restore(&mut self, step: u64, optimizer: &std::collections::HashMap<String, Tensor>) -> anyhow::Result<()> {
        self.muon.load_state_tensors(optimizer)?;
        for a in &mut self.adams {
            a.load_state_tensors(optimizer)?;
        }
        self.step = step;
        self.discard_partial_step();
        Ok(())
    }
}

impl crate::train::executor::Executor for Trainer {
    fn model(&self) -> &Gpt {
        &self.model
    }

    fn score(&mut self, x: &[u32], y: &[u32], rows: usize) -> anyhow::Result<f64> {
        crate::eval::validation::nll_sum(&self.model, x, y, rows)
    }

    fn set_looping(&mut self, on: bool) {
        self.model.set_looping(on);
    }

    fn load_weights(&mut self, tensors: &std::collections::HashMap<String, Tensor>) -> anyhow::Result<()> {
        self.model.load_state(tensors)
    }

    fn micro_step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<MicroTimes> {
        Trainer::micro_step(self, x, y)
    }

    fn finish_step(&mut self, elapsed_ms: f64) -> anyhow::Result<StepOutcome> {
        Trainer::finish_step(self, elapsed_ms)
    }

    fn discard_partial_step(&mut self) -> usize {
        Trainer::discard_partial_step(self)
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn micro_done(&self) -> usize {
        self.micro_done
    }

    fn micro_steps(&self) -> usize {
        self.micro_steps
    }

    fn optimizer_state(&self) -> anyhow::Result<Vec<(String, Tensor)>> {
        Ok(Trainer::optimizer_state(self))
    }

    fn restore(&mut self, step: u64, optimizer: &std::collections::HashMap<String, Tensor>) -> anyhow::Result<()> {
        Trainer::restore(self, step, optimizer)
    }

    fn flush_phase_times(&mut self) -> anyhow::Result<PhaseTimes> {
        Trainer::flush_phase_times(self)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use candle_core::Device;

    use super::*;
    use crate::model::ModelConfig;

    fn tiny() -> ModelConfig {
        ModelConfig { vocab_size: 16, num_layers: 2, model_dim: 8, num_heads: 2, num_kv_heads: 1, ..ModelConfig::default() }
    }

    fn batch(seed: u64, rows: usize, t: usize) -> (Tensor, Tensor) {
        let mut r = fastrand::Rng::with_seed(seed);
        let v: Vec<u32> = (0..rows * (t + 1)).map(|_| r.u32(0..16)).collect();
        let x: Vec<u32> = (0..rows).flat_map(|i| v[i * (t + 1)..i * (t + 1) + t].to_vec()).collect();
        let y: Vec<u32> = (0..rows).flat_map(|i| v[i * (t + 1) + 1..(i + 1) * (t + 1)].to_vec()).collect();
        (Tensor::from_vec(x, (rows, t), &Device::Cpu).unwrap(), Tensor::from_vec(y, (rows, t), &Device::Cpu).unwrap())
    }

    fn params(t: &Trainer) -> Vec<Vec<f64>> {
        t.model().params().iter().map(|(_, v, _)| v.flatten_all().unwrap().to_vec1::<f64>().unwrap()).collect()
    }

    /// No step past `train.iterations`, ever: the trainer refuses the micro-batch that would
    /// start one, and leaves the weights as the last step left them.
    #[test]
    fn no_step_past_the_last_iteration() {
        let cfg = TrainConfig { iterations: 2, warmdown_iters: 0, max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let mut t = Trainer::new(Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap(), &cfg, 1).unwrap();
        let (x, y) = batch(3, 2, 6);
        for _ in 0..2 {
            t.micro_step(&x, &y).unwrap();
            t.finish_step(0.0).unwrap();
        }
        let before = params(&t);
        let e = t.micro_step(&x, &y).unwrap_err().to_string();
        assert!(e.contains("refusing to train step 3") && e.contains("`train.iterations` is 2"), "{e}");
        assert_eq!((t.step(), t.micro_done()), (2, 0));
        assert_eq!(params(&t), before);
    }

    /// Two micro-batches of 2 rows accumulate to the same update as one micro-batch of 4 rows
    /// (the mean loss over equal-sized micro-batches is the mean over their union).
    #[test]
    fn accumulation_equals_one_big_batch() {
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let mk = || Trainer::new(Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap(), &cfg, 1).unwrap();
        let (x, y) = batch(2, 4, 6);
        let mut one = mk();
        one.micro_step(&x, &y).unwrap();
        let a = one.finish_step(0.0).unwrap();
        let mut two = Trainer::new(Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap(), &cfg, 2).unwrap();
        two.micro_step(&x.narrow(0, 0, 2).unwrap(), &y.narrow(0, 0, 2).unwrap()).unwrap();
        two.micro_step(&x.narrow(0, 2, 2).unwrap(), &y.narrow(0, 2, 2).unwrap()).unwrap();
        let b = two.finish_step(0.0).unwrap();
        assert!((a.train_loss - b.train_loss).abs() < 1e-12);
        for (p, q) in params(&one).iter().zip(params(&two).iter()) {
            for (u, v) in p.iter().zip(q) {
                assert!((u - v).abs() < 1e-9, "{u} vs {v}");
            }
        }
        assert_eq!((two.step(), two.micro_done()), (1, 0));
    }

    /// The gradients kept between micro-batches are detached: none holds the op graph (and with
    /// it the activations) of the micro-batch it came from — in the GPU formulation too, where
    /// they come straight out of the backward rules.
    #[test]
    fn kept_gradients_hold_no_graph() {
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        for gpu_formulation in [false, true] {
            let mut t = Trainer::new(Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap(), &cfg, 2).unwrap();
            let (x, y) = batch(4, 2, 5);
            let step = |t: &mut Trainer| t.micro_step(&x, &y).unwrap();
            if gpu_formulation {
                crate::model::with_gpu_formulation(|| step(&mut t))
            } else {
                step(&mut t)
            };
            let kept: Vec<bool> =
                t.model().params().iter().filter_map(|(_, v, _)| t.grads.get(v.as_tensor()).map(|g| g.track_op())).collect();
            assert_eq!(kept.len(), t.model().params().len());
            assert!(kept.iter().all(|&tracks| !tracks), "gpu formulation {gpu_formulation}: {kept:?}");
        }
    }

    /// A loss that is not finite stops training with an error naming the step and micro-batch
    /// (what a diverged model, or on a GPU a target outside the vocabulary, produces).
    #[test]
    fn a_non_finite_loss_is_an_error() {
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let mut model = Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap();
        let mut state: std::collections::HashMap<String, Tensor> = model.state_dict().into_iter().collect();
        let emb = state["tok_emb.weight"].clone();
        state.insert("tok_emb.weight".into(), (emb * f64::NAN).unwrap());
        model.load_state(&state).unwrap();
        let mut t = Trainer::new(model, &cfg, 1).unwrap();
        let (x, y) = batch(5, 2, 5);
        let e = t.micro_step(&x, &y).unwrap_err().to_string();
        assert!(e.contains("the training loss is NaN at step 1 micro-batch 0"), "{e}");
    }

    /// Phase synchronisation changes timing only: on the CPU both settings give the same
    /// weights bit for bit, the host times the phases, and there are no device times.
    #[test]
    fn phase_sync_changes_nothing_but_timing() {
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let run = |sync: bool| {
            let mut t = Trainer::new(Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap(), &cfg, 2).unwrap().with_phase_sync(sync);
            assert!(!t.device_timed());
            let (x, y) = batch(4, 2, 5);
            for _ in 0..2 {
                t.micro_step(&x, &y).unwrap();
            }
            let out = t.finish_step(0.0).unwrap();
            let p = out.phases;
            assert!(p.forward > Duration::ZERO && p.backward > Duration::ZERO && p.optimizer > Duration::ZERO, "{p:?}");
            assert_eq!(t.flush_phase_times().unwrap(), PhaseTimes::default());
            t.model().params().iter().flat_map(|(_, v, _)| v.flatten_all().unwrap().to_vec1::<f64>().unwrap()).collect::<Vec<_>>()
        };
        assert_eq!(run(true), run(false));
    }

    #[test]
    fn clipping_bounds_the_update_and_reports_the_norm() {
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, grad_clip_norm: 1e-3, ..TrainConfig::default() };
        let mut t = Trainer::new(Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap(), &cfg, 1).unwrap();
        let (x, y) = batch(3, 2, 5);
        t.micro_step(&x, &y).unwrap();
        let mut sq = 0.0;
        for (_, v, _) in t.model().params() {
            if let Some(g) = t.grads.get(v.as_tensor()) {
                sq += g.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            }
        }
        t.clip(1e-3).unwrap();
        let mut after = 0.0;
        for (_, v, _) in t.model().params() {
            if let Some(g) = t.grads.get(v.as_tensor()) {
                after += g.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
            }
        }
        assert!(sq.sqrt() > 1e-3, "the test needs a gradient larger than the clip");
        assert!((after.sqrt() - 1e-3).abs() < 1e-6, "clipped norm {}", after.sqrt());
    }

    /// The record's `[train]` keys reach the optimizers, each group its own decay; the defaults
    /// leave every one off.
    #[test]
    fn training_element_keys_reach_the_optimizers() {
        let record = TrainConfig {
            muon_row_norm: true,
            muon_weight_decay: 0.095,
            embed_weight_decay: 0.085,
            scalar_weight_decay: 0.02,
            head_weight_decay: 0.01,
            ..TrainConfig::default()
        };
        let untied = ModelConfig { tie_embeddings: false, ..tiny() };
        let t = Trainer::new(Gpt::new(&untied, 1, DType::F32, &Device::Cpu).unwrap(), &record, 1).unwrap();
        assert!(t.muon.row_norm());
        assert_eq!(t.muon.weight_decay(), 0.095);
        let wd: Vec<f64> = t.adams.iter().map(|a| a.weight_decay()).collect();
        assert_eq!(wd, [0.085, 0.02, 0.01]);
        let t = Trainer::new(Gpt::new(&untied, 1, DType::F32, &Device::Cpu).unwrap(), &TrainConfig::default(), 1).unwrap();
        assert!(!t.muon.row_norm() && t.muon.weight_decay() == 0.0);
        assert!(t.adams.iter().all(|a| a.weight_decay() == 0.0));
    }

    /// With `warmdown_frac` and no cap the step fraction drives the LR, and each step reports
    /// the fraction it used: 10 iterations, warm-down over the last half. The fraction and the
    /// Muon momentum are those of the step's 0-based index, as the record's loop computes them
    /// before `step += 1` (the first step at full LR and the warm-up's start momentum).
    #[test]
    fn warmdown_frac_schedules_on_the_step_fraction() {
        let cfg = TrainConfig {
            iterations: 10,
            warmdown_frac: 0.5,
            max_wallclock_seconds: 0.0,
            muon_momentum_warmup_start: 0.92,
            muon_momentum: 0.99,
            muon_momentum_warmup_steps: 4,
            ..TrainConfig::default()
        };
        let mut t = Trainer::new(Gpt::new(&tiny(), 1, DType::F64, &Device::Cpu).unwrap(), &cfg, 1).unwrap();
        let (x, y) = batch(6, 2, 5);
        let mut seen = Vec::new();
        for _ in 0..10 {
            t.micro_step(&x, &y).unwrap();
            let out = t.finish_step(1e6).unwrap();
            seen.push((out.frac, out.lr_mul, out.momentum));
        }
        for (step, (frac, lr_mul, momentum)) in seen.into_iter().enumerate() {
            let f = (step as f64 / 4.0).min(1.0);
            assert!((momentum - ((1.0 - f) * 0.92 + f * 0.99)).abs() < 1e-12, "step {step}: momentum {momentum}");
            let want = if step < 5 { 1.0 } else { (10 - step) as f64 / 5.0 };
            assert!((frac - step as f64 / 10.0).abs() < 1e-12, "step {step}: frac {frac}");
            assert!((lr_mul - want).abs() < 1e-12, "step {step}: lr_mul {lr_mul}, want {want}");
        }
    }

    #[test]
    fn a_step_needs_all_its_micro_batches() {
        let cfg = TrainConfig::default();
        let mut t = Trainer::new(Gpt::new(&tiny(), 1, DType::F32, &Device::Cpu).unwrap(), &cfg, 2).unwrap();
        let (x, y) = batch(4, 1, 4);
        t.micro_step(&x, &y).unwrap();
        assert!(t.finish_step(0.0).unwrap_err().to_string().contains("1 of 2"));
        assert_eq!(t.discard_partial_step(), 1);
    }

    /// Mixed precision (bf16 matmuls over f32 weights) trains: the loss falls over a few steps
    /// on one batch, and parameters and optimizer state stay f32.
    #[test]
    fn mixed_precision_keeps_f32_state_and_learns() {
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let model = Gpt::new(&tiny(), 1, DType::F32, &Device::Cpu).unwrap().with_matmul_dtype(DType::BF16);
        assert_eq!(model.matmul_dtype(), DType::BF16);
        let mut t = Trainer::new(model, &cfg, 1).unwrap();
        let (x, y) = batch(5, 4, 8);
        let mut losses = Vec::new();
        for _ in 0..8 {
            t.micro_step(&x, &y).unwrap();
            losses.push(t.finish_step(0.0).unwrap().train_loss);
        }
        assert!(losses[7] < losses[0] - 0.1, "{losses:?}");
        assert!(t.model().params().iter().all(|(_, v, _)| v.dtype() == DType::F32));
        assert!(t.optimizer_state().iter().filter(|(n, _)| !n.ends_with(".step")).all(|(_, v)| v.dtype() == DType::F32));
    }
}
