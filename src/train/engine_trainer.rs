//! The explicit engine ([`crate::engine`]) as a session's [`Executor`]: the schedule of
//! [`crate::train::trainer`] (LR multiplier, training fraction, Muon momentum warm-up,
//! clipping, Muon then Adam per group) with each step's work done on the engine's arena. A
//! candle [`Gpt`] mirrors the weights for what reads them (validation, the snapshots the stages
//! after training take, the saved weights): it is synced only when one of them asks
//! ([`Executor::synced_model`]), not after every step, and on a GPU device to device (one copy
//! of the parameter region, ordered by CUDA events). The micro-batch's token tensors reach the
//! engine as they are: on a GPU device to device, with no host read. On the CPU backends or,
//! in a `cuda` build, the GPU backend ([`crate::engine::gpu`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};

use crate::device::phase_clock::PhaseTimes;
use crate::engine::Engine;
use crate::engine::backend::Tokens;
use crate::engine::exchange::ExchangeStats;
use crate::engine::gpu::GpuPrecision;
use crate::engine::optim::MuonStep;
use crate::engine::step::{ADAM_GROUPS, OptimizerStep};
use crate::model::flash_attn::Attention;
use crate::model::{Gpt, ParamGroup};
use crate::train::config::TrainConfig;
pub use crate::train::executor::EngineOptions;
use crate::train::executor::{Executor, MicroTimes, StepOutcome};

/// The engine of `model` on its GPU: when the model's matmuls are bf16, GEMMs on the bf16
/// tensor cores, with bf16 activations if `o` asks; full f32 otherwise.
fn gpu_engine(model: &Gpt, rows: usize, t: usize, o: EngineOptions) -> anyhow::Result<Engine> {
    anyhow::ensure!(model.device().is_cuda(), "the engine runs on the CPU or on a CUDA GPU, not {:?}", model.device().location());
    let precision = match (model.matmul_dtype() == DType::BF16, o.bf16_activations) {
        (false, false) => GpuPrecision::F32,
        (false, true) => anyhow::bail!("stage `step_executor` impl \"engine\": key `activations` = \"bf16\" needs key `dtype` = \"bf16\""),
        (true, false) => GpuPrecision::Bf16Gemms,
        (true, true) => GpuPrecision::Bf16,
    };
    let mut engine = Engine::gpu(model.config(), rows, t, model.device(), precision, o.cuda_graph, o.poison)?;
    // cuDNN's attention where the model asks for it (its own kernels, flash_mma, otherwise).
    engine.set_cudnn(model.attention_choice() == Attention::Cudnn)?;
    Ok(engine)
}

/// The engine, the candle model mirroring its weights, and the step in progress.
pub struct EngineTrainer {
    engine: Engine,
    mirror: Gpt,
    cfg: TrainConfig,
    micro_steps: usize,
    micro_done: usize,
    step: u64,
    /// Tokens per micro-batch.
    tokens: usize,
    phases: PhaseTimes,
    /// The step's gradient exchange so far (several ranks).
    exchanged: ExchangeStats,
    /// The engine has weights the mirror does not (a step since the last sync).
    stale: bool,
    /// Times the mirror was synced (report field `train.engine.mirror_syncs`).
    syncs: u64,
}

impl EngineTrainer {
    /// An engine for `model` (its config, dtype, device and initial weights) on
    /// micro-batches of `rows x t` tokens, `micro_steps` per step.
    pub fn new(model: Gpt, cfg: &TrainConfig, micro_steps: usize, (rows, t): (usize, usize), o: EngineOptions) -> anyhow::Result<Self> {
        anyhow::ensure!(micro_steps >= 1, "a step needs at least one micro-batch");
        let mut engine = if model.device().is_cpu() {
            anyhow::ensure!(
                model.matmul_dtype() == model.dtype(),
                "stage `step_executor` impl \"engine\": key `dtype` must be \"f32\" or \"f64\" on the CPU (bf16 matmuls are the GPU backend's)"
            );
            Engine::cpu(model.config(), rows, t, model.dtype(), o.poison)?
        } else {
            gpu_engine(&model, rows, t, o)?
        };
        engine.load_params(&model.state_dict().into_iter().collect())?;
        engine.zero_grads();
        Ok(Self {
            engine,
            mirror: model,
            cfg: cfg.clone(),
            micro_steps,
            micro_done: 0,
            step: 0,
            tokens: rows * t,
            phases: PhaseTimes::default(),
            exchanged: ExchangeStats::default(),
            stale: false,
            syncs: 0,
        })
    }

    /// Trains as one of `ranks` (data parallel; a world of one changes nothing): the last
    /// micro-batch of each step averages the gradients over the ranks in buckets sent while its
    /// backward pass runs (`overlap`), DDP's sizes from `o`; Muon is sharded. On a GPU the
    /// collectives are NCCL's on the engine's communication stream; errors when its
    /// communicator cannot start.
    pub fn with_ranks(mut self, ranks: std::sync::Arc<dyn crate::dist::Collective>, o: &EngineOptions) -> anyhow::Result<Self> {
        let elems = |mib: f64| ((mib * (1 << 20) as f64) / self.engine.dtype().size_in_bytes() as f64).max(1.0) as usize;
        self.engine.set_ranks(ranks, (elems(o.first_bucket_mib), elems(o.bucket_mib)), o.overlap)?;
        Ok(self)
    }

    /// The engine.
    #[cfg(feature = "tools")]
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Copies the engine's weights into the mirror model when it does not hold them yet: the
    /// parameter region in one copy (device to device on a GPU), then each parameter set.
    fn sync_mirror(&mut self) -> anyhow::Result<()> {
        if !self.stale {
            return Ok(());
        }
        self.engine.copy_params_into(&mut self.mirror)?;
        self.stale = false;
        self.syncs += 1;
        Ok(())
    }

    /// Times the mirror has been synced.
    #[cfg(feature = "tools")]
    pub fn mirror_syncs(&self) -> u64 {
        self.syncs
    }
}

impl Executor for EngineTrainer {
    fn model(&self) -> &Gpt {
        &self.mirror
    }

    fn synced_model(&mut self) -> anyhow::Result<&Gpt> {
        self.sync_mirror()?;
        Ok(&self.mirror)
    }

    /// Validation scored by the engine's own forward passes ([`Engine::score`]) in its arena:
    /// no mirror sync, no second model's activations. Sequences shorter than the engine's (the
    /// validation's rows under `packed_docs`, whose one training row holds many) are scored in
    /// the same arena viewed at as many of them as it holds ([`Engine::reshape`]), then the
    /// training shape is restored; other lengths (longer, or not a multiple of 64 on a GPU) go
    /// to the mirror.
    fn score(&mut self, x: &[u32], y: &[u32], rows: usize) -> anyhow::Result<f64> {
        anyhow::ensure!(self.micro_done == 0, "validation inside a step ({} of {} micro-batches done)", self.micro_done, self.micro_steps);
        let (train_rows, train_t) = (self.engine.rows(), self.engine.seq_len());
        let t = x.len() / rows.max(1);
        if let Some(view) = self.engine.shorter_rows(t, (train_rows, train_t)).filter(|_| t * rows == x.len()) {
            let looping = self.mirror.looping();
            self.engine.reshape(view, t)?;
            let scored = self.engine.score(x, y, looping);
            self.engine.reshape(train_rows, train_t)?;
            return scored;
        }
        if x.len() != rows * train_t {
            #[cfg(feature = "candle")]
            return crate::eval::validation::nll_sum(self.synced_model()?, x, y, rows);
            #[cfg(not(feature = "candle"))]
            anyhow::bail!("validation rows of {} tokens, the engine's are {}: the candle executor scores other lengths", t, train_t);
        }
        self.engine.score(x, y, self.mirror.looping())
    }

    fn score_rows(&self) -> usize {
        self.engine.rows()
    }

    fn set_looping(&mut self, on: bool) {
        self.mirror.set_looping(on);
    }

    fn load_weights(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        self.mirror.load_state(tensors)?;
        self.engine.load_params(tensors)?;
        self.stale = false;
        Ok(())
    }

    fn micro_step(&mut self, x: &Tensor, y: &Tensor) -> anyhow::Result<MicroTimes> {
        crate::train::executor::check_micro_batch(self.micro_done, self.micro_steps, self.step, self.cfg.iterations)?;
        // The session has checked the shapes and, on the CPU, the ids against the vocabulary
        // (`Session::check_batch`, as for the candle executor); the backend checks the length.
        let tokens = Tokens::Tensors { x, y };
        let n = self.tokens as f64;
        // The loss stays on the device until the step ends (no host read per micro-batch).
        let (looping, scale) = (self.mirror.looping(), 1.0 / (n * self.micro_steps as f64));
        let r = if self.micro_done + 1 == self.micro_steps {
            // The step's last micro-batch: on several ranks its backward pass sends the
            // gradients to be averaged as it finishes them.
            let (r, x) = self.engine.exchanged_micro_step(tokens, looping, scale)?;
            self.exchanged = x;
            r
        } else {
            self.engine.micro_step_tokens(tokens, looping, scale)?
        };
        self.micro_done += 1;
        // The wait for the exchange ends the backward phase (the all-reduce is part of it).
        let backward = r.backward + if self.micro_done == self.micro_steps { self.exchanged.exposed } else { Duration::ZERO };
        let times = MicroTimes { forward: r.forward, backward };
        self.phases.forward += times.forward;
        self.phases.backward += times.backward;
        Ok(times)
    }

    fn finish_step(&mut self, elapsed_ms: f64) -> anyhow::Result<StepOutcome> {
        anyhow::ensure!(self.micro_done == self.micro_steps, "step ended after {} of {} micro-batches", self.micro_done, self.micro_steps);
        let t0 = Instant::now();
        let c = &self.cfg;
        let (lr_mul, frac, momentum) = c.schedule(self.step, elapsed_ms);
        let muon = MuonStep {
            lr: c.matrix_lr * lr_mul,
            momentum,
            nesterov: true,
            backend_steps: c.muon_backend_steps,
            ns: c.muon_ns,
            row_norm: c.muon_row_norm,
            weight_decay: c.muon_weight_decay,
        };
        let tied = self.mirror.config().tie_embeddings;
        let adam = ADAM_GROUPS.map(|(group, _)| {
            let (lr, wd) = match group {
                ParamGroup::Embedding => (if tied { c.tied_embed_lr } else { c.embed_lr }, c.embed_weight_decay),
                ParamGroup::Head => (c.head_lr, c.head_weight_decay),
                _ => (c.scalar_lr, c.scalar_weight_decay),
            };
            (lr * lr_mul, wd)
        });
        let clip = c.grad_clip_norm.max(0.0);
        let stats = self.engine.optimizer_step(&OptimizerStep { clip, muon, adam, betas: (c.beta1, c.beta2), eps: c.adam_eps })?;
        let train_loss = stats.loss_sum / (self.tokens * self.micro_steps) as f64;
        anyhow::ensure!(train_loss.is_finite(), "the training loss is {train_loss} at step {}", self.step + 1);
        // The mirror is synced when something reads the weights (`synced_model`).
        self.stale = true;
        let host = PhaseTimes { optimizer: t0.elapsed(), ..std::mem::take(&mut self.phases) };
        // On a GPU the host only queues the passes (its clock would put the whole step's device
        // time in the optimizer phase, where the loss read waits): the device's own times.
        let phases = self.engine.device_phase_times()?.unwrap_or(host);
        let x = std::mem::take(&mut self.exchanged);
        // What the step waited for: the exchange after the backward pass, and Muon's.
        let comm = x.exposed + self.engine.last_comm();
        let overlapped = x.comm.saturating_sub(x.exposed);
        let outcome = StepOutcome { train_loss, lr_mul, frac, momentum, grad_norm: stats.grad_norm, phases, comm, overlapped };
        self.micro_done = 0;
        self.step += 1;
        Ok(outcome)
    }

    fn discard_partial_step(&mut self) -> usize {
        let n = self.micro_done;
        self.engine.zero_grads();
        self.engine.forget_phase_times();
        self.phases = PhaseTimes::default();
        self.exchanged = ExchangeStats::default();
        self.micro_done = 0;
        n
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
        // On the model's device (device to device on a GPU), as the candle executor's state is.
        self.engine.optimizer_state_on(self.mirror.device())
    }

    fn restore(&mut self, step: u64, optimizer: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        self.engine.load_optimizer_state(optimizer)?;
        self.step = step;
        self.discard_partial_step();
        Ok(())
    }

    fn flush_phase_times(&mut self) -> anyhow::Result<PhaseTimes> {
        Ok(PhaseTimes::default())
    }

    fn startup_lines(&self) -> Vec<String> {
        let (total, regions) = self.engine.arena_bytes();
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let parts: Vec<String> = regions.iter().map(|(n, b)| format!("{n} {:.1}", mib(*b))).collect();
        let dtype = if self.engine.dtype() == DType::F64 { "f64" } else { "f32" };
        vec![format!("engine: {} {dtype} arena {:.1} MiB ({} MiB)", self.engine.device_name(), mib(total), parts.join(", "))]
    }

    fn report(&self) -> Option<serde_json::Value> {
        let (total, regions) = self.engine.arena_bytes();
        let map: serde_json::Map<String, serde_json::Value> = regions.iter().map(|(n, b)| (n.to_string(), (*b).into())).collect();
        let backend = format!("{}-{:?}", self.engine.device_name(), self.engine.dtype()).to_lowercase();
        let mut report = serde_json::json!({ "backend": backend, "arena_bytes": total, "regions": map, "mirror_syncs": self.syncs });
        if let Some(c) = self.engine.graph_counts() {
            // Units of work (forward, backward, optimizer step) captured as CUDA graphs,
            // replayed, and run op by op (first sightings, or graphs off).
            report["graphs"] = serde_json::json!({ "captured": c.captured, "replayed": c.replayed, "eager": c.eager });
            // The attention the GPU backend ran: cuDNN, or flash_mma (with cuDNN's refusal).
            report["attention"] = self.engine.attention_name().into();
        }
        Some(report)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;
    use crate::train::trainer::Trainer;

    fn batch(seed: u64, rows: usize, t: usize, vocab: u32) -> (Tensor, Tensor) {
        let mut r = fastrand::Rng::with_seed(seed);
        let x: Vec<u32> = (0..rows * t).map(|_| r.u32(0..vocab)).collect();
        let y: Vec<u32> = (0..rows * t).map(|_| r.u32(0..vocab)).collect();
        (Tensor::from_vec(x, (rows, t), &Device::Cpu).unwrap(), Tensor::from_vec(y, (rows, t), &Device::Cpu).unwrap())
    }

    fn weights(e: &mut dyn Executor) -> Vec<(String, Vec<f64>)> {
        e.synced_model().unwrap().state_dict().into_iter().map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f64>().unwrap())).collect()
    }

    /// Three steps of two micro-batches each, in f64, with every training element of the records
    /// on (Polar Express, MuonEq-R, decoupled decay in Muon and every Adam group, clipping, the momentum
    /// warm-up, an untied head, looping switched on after the first step): the engine's weights
    /// and optimizer state are the candle executor's to 1e-9, and so are the losses.
    #[test]
    fn engine_steps_equal_the_candle_trainers_in_f64() {
        let mut mcfg = crate::engine::tests::record_small();
        mcfg.tie_embeddings = false;
        let cfg = TrainConfig {
            max_wallclock_seconds: 0.0,
            muon_ns: crate::optim::NewtonSchulz::PolarExpress,
            muon_row_norm: true,
            muon_weight_decay: 0.095,
            embed_weight_decay: 0.085,
            scalar_weight_decay: 0.02,
            head_weight_decay: 0.01,
            grad_clip_norm: 0.5,
            muon_momentum_warmup_steps: 2,
            ..TrainConfig::default()
        };
        let model = || {
            let mut m = Gpt::new(&mcfg, 3, DType::F64, &Device::Cpu).unwrap();
            m.set_looping(false);
            m
        };
        let (rows, t) = (2, 6);
        let mut candle: Box<dyn Executor> = Box::new(Trainer::new(model(), &cfg, 2).unwrap());
        let mut engine: Box<dyn Executor> = Box::new(EngineTrainer::new(model(), &cfg, 2, (rows, t), EngineOptions::default()).unwrap());
        for step in 0..3 {
            for e in [&mut candle, &mut engine] {
                if step == 1 {
                    e.set_looping(true);
                }
            }
            let mut outs = Vec::new();
            for e in [&mut candle, &mut engine] {
                for m in 0..2 {
                    let (x, y) = batch(10 * step + m, rows, t, mcfg.vocab_size as u32);
                    e.micro_step(&x, &y).unwrap();
                }
                outs.push(e.finish_step(0.0).unwrap());
            }
            assert!((outs[0].train_loss - outs[1].train_loss).abs() < 1e-9 * outs[0].train_loss, "step {step}: {outs:?}");
            let (ga, gb) = (outs[0].grad_norm.unwrap(), outs[1].grad_norm.unwrap());
            assert!((ga - gb).abs() < 1e-9 * ga, "step {step}: grad norm {ga} vs {gb}");
        }
        for ((name, a), (_, b)) in weights(candle.as_mut()).iter().zip(weights(engine.as_mut())) {
            let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
            assert!(err < 1e-9, "{name}: max difference {err:e}");
        }
        // Validation: the engine scores 3 sequences (looped) with its own forward passes, as
        // the candle executor's model does; not inside a step.
        let (x, y) = batch(99, 3, t, mcfg.vocab_size as u32);
        let (x, y) = (x.flatten_all().unwrap().to_vec1::<u32>().unwrap(), y.flatten_all().unwrap().to_vec1::<u32>().unwrap());
        let (sa, sb) = (candle.score(&x, &y, 3).unwrap(), engine.score(&x, &y, 3).unwrap());
        // (The candle model's token losses pass through f32: 1e-7 of the sum.)
        assert!((sa - sb).abs() < 1e-7 * sa, "validation sums {sa} vs {sb}");
        let (bx, by) = batch(7, rows, t, mcfg.vocab_size as u32);
        engine.micro_step(&bx, &by).unwrap();
        let err = engine.score(&x, &y, 3).unwrap_err().to_string();
        assert!(err.contains("inside a step"), "{err}");
        engine.discard_partial_step();
        let state = |e: &dyn Executor| -> HashMap<String, Vec<f64>> {
            e.optimizer_state()
                .unwrap()
                .into_iter()
                .map(|(n, t)| (n, t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()))
                .collect()
        };
        let (sa, sb) = (state(candle.as_ref()), state(engine.as_ref()));
        assert_eq!(sa.len(), sb.len());
        for (name, a) in &sa {
            let b = &sb[name];
            let err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
            assert!(err < 1e-9, "{name}: max difference {err:e}");
        }
    }

    /// Trained on one packed row (`packed_docs`: 1 x 24 here, documents cut every 4), the engine
    /// scores validation's shorter rows in its own arena (5 rows of 6: two views of 4 rows, the
    /// last padded), as the candle model scores them, and trains on as before: the step after
    /// it equals the candle executor's.
    #[test]
    fn a_packed_engine_scores_shorter_rows_in_its_arena() {
        let mcfg = crate::model::ModelConfig {
            document_attention: true,
            document_max_len: 4,
            bos_id: 3,
            ..crate::engine::tests::record_0427_small()
        };
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let model = || Gpt::new(&mcfg, 5, DType::F64, &Device::Cpu).unwrap();
        let (rows, t) = (1, 24);
        let mut candle = Trainer::new(model(), &cfg, 1).unwrap();
        let mut engine = EngineTrainer::new(model(), &cfg, 1, (rows, t), EngineOptions::default()).unwrap();
        let vocab = mcfg.vocab_size as u32;
        for e in [&mut candle as &mut dyn Executor, &mut engine] {
            let (x, y) = batch(1, rows, t, vocab);
            e.micro_step(&x, &y).unwrap();
            e.finish_step(0.0).unwrap();
        }
        let (x, y) = batch(2, 5, 6, vocab);
        let (x, y) = (x.flatten_all().unwrap().to_vec1::<u32>().unwrap(), y.flatten_all().unwrap().to_vec1::<u32>().unwrap());
        let (sa, sb) = (candle.score(&x, &y, 5).unwrap(), engine.score(&x, &y, 5).unwrap());
        assert!((sa - sb).abs() < 1e-7 * sa, "validation sums {sa} vs {sb}");
        assert_eq!(engine.mirror_syncs(), 0, "scored by the engine, not by the mirror");
        let mut outs = Vec::new();
        for e in [&mut candle as &mut dyn Executor, &mut engine] {
            let (x, y) = batch(3, rows, t, vocab);
            e.micro_step(&x, &y).unwrap();
            outs.push(e.finish_step(0.0).unwrap());
        }
        assert!((outs[0].train_loss - outs[1].train_loss).abs() < 1e-9 * outs[0].train_loss, "the step after: {outs:?}");
    }

    /// The mirror is synced only when something reads the weights: three steps leave it
    /// untouched (the engine's arena has moved on), the first read copies once and gives the
    /// engine's weights, a second read without a step copies nothing, and the next step makes
    /// it stale again.
    #[test]
    fn the_mirror_is_synced_only_when_the_weights_are_read() {
        let mcfg = crate::engine::tests::baseline_small();
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let model = Gpt::new(&mcfg, 3, DType::F32, &Device::Cpu).unwrap();
        let initial: Vec<Vec<f32>> = model.state_dict().iter().map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap()).collect();
        let (rows, t) = (2, 6);
        let mut e = EngineTrainer::new(model, &cfg, 1, (rows, t), EngineOptions::default()).unwrap();
        for step in 0..3 {
            let (x, y) = batch(step, rows, t, mcfg.vocab_size as u32);
            e.micro_step(&x, &y).unwrap();
            e.finish_step(0.0).unwrap();
        }
        assert_eq!(e.mirror_syncs(), 0, "no step synced the mirror");
        let stale: Vec<Vec<f32>> = e.model().state_dict().iter().map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap()).collect();
        assert_eq!(stale, initial, "the mirror still holds the initial weights");
        let engine: Vec<Vec<f32>> = e.engine().params().unwrap().iter().map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap()).collect();
        let synced: Vec<Vec<f32>> =
            e.synced_model().unwrap().state_dict().iter().map(|(_, t)| t.flatten_all().unwrap().to_vec1().unwrap()).collect();
        assert_eq!(synced, engine, "the synced mirror holds the engine's weights");
        assert_ne!(synced, initial);
        e.synced_model().unwrap();
        assert_eq!(e.mirror_syncs(), 1, "a second read without a step copies nothing");
        let (x, y) = batch(9, rows, t, mcfg.vocab_size as u32);
        e.micro_step(&x, &y).unwrap();
        e.finish_step(0.0).unwrap();
        e.synced_model().unwrap();
        assert_eq!(e.mirror_syncs(), 2);
    }
}
