//! [`Engine`]: a backend, the schedule on its arena, and what a training step does with them:
//! micro-batches accumulated into the gradient region, clipping, the optimizers, and the
//! exchange with the rest of the program (parameters and optimizer state as named tensors with
//! the candle executor's names, so checkpoints and every stage after training are the same).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use super::backend::{Backend, Buf, GraphCounts, Tokens};
use super::cpu::CpuBackend;
use super::exchange::{Exchange, ExchangeStats};
use super::gpu::{Capacity, GpuPrecision, HalfRegions};
use super::layout::{Layout, Sizing};
use super::optim::{self, MuonStep};
use super::schedule::Schedule;
use crate::device::phase_clock::{Phase, PhaseTimes};
use crate::engine::backend::BackendExt;
use crate::engine::op;
use crate::model::ops::{rms_eps, rope_tables};
use crate::model::{ModelConfig, ParamGroup, gpt_group_of};

/// The Adam groups and their checkpoint prefixes (the candle executor's).
pub const ADAM_GROUPS: [(ParamGroup, &str); 3] =
    [(ParamGroup::Embedding, "adam_embed"), (ParamGroup::Scalar, "adam_scalar"), (ParamGroup::Head, "adam_head")];

/// The GPU engine's attention takes sequences a multiple of this many tokens (a pass of
/// shorter rows is padded up to it: phased TTT's LoRA windows).
pub const GPU_SEQ_MULTIPLE: usize = 64;

/// The scratch a [`KernelBackend`] needs for `cfg` on micro-batches of `rows x t` tokens;
/// errors when the GPU attention cannot take the shapes (head width 64, `t` a multiple of 64).
pub fn kernel_capacity(cfg: &ModelConfig, rows: usize, t: usize) -> anyhow::Result<Capacity> {
    let d = cfg.head_dim();
    anyhow::ensure!(d == 64, "the GPU engine's attention takes heads 64 wide; this model's are {d} (model_dim / num_heads)");
    anyhow::ensure!(
        t.is_multiple_of(GPU_SEQ_MULTIPLE),
        "the GPU engine's attention takes sequences a multiple of {GPU_SEQ_MULTIPLE} tokens, not {t}"
    );
    let calls = cfg.layer_sequence(false).len().max(cfg.layer_sequence(true).len());
    Ok(Capacity {
        tokens: rows * t,
        // The ids' CSR has a row for each row of every table the embedding ops look up.
        vocab: cfg
            .param_shapes()
            .iter()
            .filter(|(n, s)| gpt_group_of(n, s.len()) == ParamGroup::Embedding)
            .map(|(_, s)| s[0])
            .max()
            .unwrap_or(cfg.vocab_size),
        width: 2 * cfg.model_dim,
        attn_width: cfg.num_heads * d,
        kv_width: cfg.num_kv_heads * d,
        heads: cfg.num_heads,
        attention_calls: calls,
        colsum_group: crate::engine::gpu::COLSUM_GROUP,
        embed_piece: crate::engine::gpu::EMBED_PIECE,
    })
}

/// [`kernel_capacity`] for an arena sized by `sizing`: its most tokens, its longest row.
pub fn kernel_capacity_sized(cfg: &ModelConfig, sizing: Sizing) -> anyhow::Result<Capacity> {
    let cap = kernel_capacity(cfg, 1, sizing.max_t)?;
    Ok(Capacity { tokens: sizing.tokens, ..cap })
}

/// What one micro-batch took (its loss stays on the device: [`Engine::loss_sum`]).
#[derive(Clone, Copy, Debug)]
pub struct MicroResult {
    /// The forward pass, the loss and its gradient included (on a GPU: the time to enqueue it).
    pub forward: Duration,
    /// The backward pass.
    pub backward: Duration,
}

/// One optimizer step's settings (the schedule applied): clipping, Muon, the Adam groups.
#[derive(Clone, Copy, Debug)]
pub struct OptimizerStep {
    /// Clip the gradients' global norm to this (0: no clipping).
    pub clip: f64,
    /// Muon over the block matrices.
    pub muon: MuonStep,
    /// `(lr, weight decay)` of each Adam group, in [`ADAM_GROUPS`] order.
    pub adam: [(f64, f64); 3],
    /// Adam's `(β1, β2)`.
    pub betas: (f64, f64),
    /// Adam's `ε`.
    pub eps: f64,
}

/// What a step's device scalars held, read once at its end.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The sum of every token loss of the step's micro-batches.
    pub loss_sum: f64,
    /// The gradients' global norm before clipping (`None`: no clipping).
    pub grad_norm: Option<f64>,
}

/// The explicit training engine of one model (see the module doc of [`crate::engine`]).
pub struct Engine {
    pub(super) be: Box<dyn Backend>,
    pub(super) schedule: Schedule,
    /// Fill the dead regions with NaN around every pass.
    poison: bool,
    /// Steps each Adam group has taken (its bias correction's `t`).
    adam_steps: [u64; 3],
    /// Steps the LoRA adapters' AdamW has taken since it was reset.
    pub(super) lora_steps: u64,
    /// The pass length the RoPE tables' base is for (the row length but in a padded pass:
    /// [`Engine::reshape_padded`]).
    pub(super) rope_len: usize,
    /// Several ranks: the gradient exchange (none on one rank).
    exchange: Option<Exchange>,
    /// Wall time of the last optimizer step's collectives (sharded Muon's exchange).
    last_comm: Duration,
    /// The step's phases as spans between the backend's timing marks (a backend with a device
    /// clock: CUDA events on the engine's stream), read once when the step ends
    /// ([`Engine::device_phase_times`]).
    spans: Vec<(Phase, usize, usize)>,
}

impl Engine {
    /// An engine for `cfg` on micro-batches of `rows x t` tokens on the CPU, in `dtype` (`F64`:
    /// the check backend; `F32`: the fast one), with every parameter zero until
    /// [`Engine::load_params`]. `poison`: NaN in every dead buffer (checks for aliasing).
    pub fn cpu(cfg: &ModelConfig, rows: usize, t: usize, dtype: DType, poison: bool) -> anyhow::Result<Engine> {
        Engine::cpu_sized(cfg, Sizing::fixed(rows, t), dtype, poison)
    }

    /// [`Engine::cpu`] on an arena sized by `sizing` (passes of other shapes within it, LoRA
    /// adapters: [`Engine::reshape`], [`Engine::lora_forward`]).
    pub fn cpu_sized(cfg: &ModelConfig, sizing: Sizing, dtype: DType, poison: bool) -> anyhow::Result<Engine> {
        super::support::check(cfg)?;
        let len = Layout::sized(cfg, sizing).len();
        let be: Box<dyn Backend> = match dtype {
            DType::F64 => Box::new(CpuBackend::<f64>::new(len)),
            DType::F32 => Box::new(CpuBackend::<f32>::new(len)),
            other => anyhow::bail!("the engine's CPU backends run in f32 or f64, not {other:?} (bf16 is the GPU backend's)"),
        };
        Engine::with_backend_sized(cfg, sizing, be, poison)
    }

    /// An engine for `cfg` on micro-batches of `rows x t` tokens on the GPU of `device` (a
    /// candle CUDA device, [`crate::device::open`]: the kernel backend shares its context on a
    /// stream of its own; in `precision` ([`GpuPrecision`]); each pass
    /// and the optimizer step captured once as a CUDA graph and replayed when `graphs`, else
    /// launched op by op). Errors name what the GPU attention cannot take (head width 64,
    /// sequences a multiple of 64), a device that cannot start, and a build without the `cuda`
    /// feature.
    #[allow(clippy::too_many_arguments)]
    pub fn gpu(
        cfg: &ModelConfig,
        rows: usize,
        t: usize,
        device: &Device,
        precision: GpuPrecision,
        graphs: bool,
        poison: bool,
    ) -> anyhow::Result<Engine> {
        Engine::gpu_sized(cfg, Sizing::fixed(rows, t), device, precision, graphs, poison)
    }

    /// [`Engine::gpu`] on an arena sized by `sizing` (its longest row a multiple of 64, as every
    /// pass's must be).
    pub fn gpu_sized(
        cfg: &ModelConfig,
        sizing: Sizing,
        device: &Device,
        precision: GpuPrecision,
        graphs: bool,
        poison: bool,
    ) -> anyhow::Result<Engine> {
        super::support::check(cfg)?;
        let cap = kernel_capacity_sized(cfg, sizing)?;
        let layout = Layout::sized(cfg, sizing);
        let half = (precision == GpuPrecision::Bf16).then(|| HalfRegions::of(&layout));
        let be = super::gpu::gpu_backend(device, precision, graphs, layout.len(), cap, half)?;
        Engine::with_backend_sized(cfg, sizing, be, poison)
    }

    /// An engine for `cfg` on micro-batches of `rows x t` tokens on `be`, whose arena must
    /// hold `Layout::new(cfg, rows, t).len()` elements (all zero) in the dtype it computes in;
    /// the rest as [`Engine::cpu`].
    #[cfg(any(test, feature = "tools"))]
    pub(crate) fn with_backend(cfg: &ModelConfig, rows: usize, t: usize, be: Box<dyn Backend>, poison: bool) -> anyhow::Result<Engine> {
        Engine::with_backend_sized(cfg, Sizing::fixed(rows, t), be, poison)
    }

    /// [`Engine::with_backend`] on an arena sized by `sizing` (`Layout::sized(cfg, sizing)`).
    pub(crate) fn with_backend_sized(cfg: &ModelConfig, sizing: Sizing, be: Box<dyn Backend>, poison: bool) -> anyhow::Result<Engine> {
        super::support::check(cfg)?;
        let dtype = be.dtype();
        let schedule = Schedule::sized(cfg, sizing, rms_eps(dtype));
        let len = schedule.layout.len();
        anyhow::ensure!(be.len() == len, "the backend's arena holds {} elements, this model's layout {len}", be.len());
        let mut e = Engine {
            be,
            schedule,
            poison,
            adam_steps: [0; 3],
            lora_steps: 0,
            rope_len: sizing.t,
            exchange: None,
            last_comm: Duration::ZERO,
            spans: Vec::new(),
        };
        e.upload_rope()?;
        if poison {
            let (a, b) = (e.schedule.layout.activations, e.schedule.layout.scratch_region);
            e.be.op(op::Fill { dst: a, value: f64::NAN });
            e.be.op(op::Fill { dst: b, value: f64::NAN });
            // The RoPE tables sit among the constants, not the activations: keep them.
        }
        Ok(e)
    }

    /// Hands the micro-batch's ids to the backend, whose token buffers hold the arena's
    /// capacity: host ids of a smaller shape ([`Engine::reshape`]) are padded with ignored
    /// positions.
    pub(super) fn load_tokens(&mut self, tokens: Tokens<'_>) -> anyhow::Result<()> {
        let cap = self.schedule.layout.sizing.tokens;
        match tokens {
            Tokens::Host { x, y } if x.len() < cap => {
                let (mut px, mut py) = (x.to_vec(), y.to_vec());
                px.resize(cap, 0);
                py.resize(cap, crate::model::ops::softcap_ce::IGNORED_TARGET);
                self.be.load_tokens(Tokens::Host { x: &px, y: &py })
            }
            _ => self.be.load_tokens(tokens),
        }
    }

    /// The RoPE tables of the current row length, uploaded.
    pub(super) fn upload_rope(&mut self) -> anyhow::Result<()> {
        let (cfg, l) = (self.schedule.config(), &self.schedule.layout);
        let t = l.t;
        let (cos, sin) = rope_tables(t, cfg.rotary_dims(), cfg.rope_base_for(self.rope_len), self.be.dtype(), &Device::Cpu)?;
        let (c, s) = (l.cos, l.sin);
        self.be.upload(c, &cos)?;
        self.be.upload(s, &sin)
    }

    /// The schedule (and through it the layout).
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Where the backend runs (`"cpu"`, or the GPU and its GEMM maths).
    pub fn device_name(&self) -> String {
        self.be.device_name()
    }

    /// The arena's dtype.
    pub fn dtype(&self) -> DType {
        self.be.dtype()
    }

    /// The arena's size in bytes, and per region `(name, bytes)`.
    pub fn arena_bytes(&self) -> (usize, Vec<(&'static str, usize)>) {
        let size = self.be.dtype().size_in_bytes();
        let regions = self.schedule.layout.region_bytes(size, self.be.half_region().is_some());
        (regions.iter().map(|r| r.1).sum(), regions)
    }

    /// Loads every parameter from `tensors` (the model's `state_dict` names; any float dtype).
    /// Errors name a missing tensor or a shape that does not fit; nothing changes unless all
    /// fit.
    pub fn load_params(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        for s in &self.schedule.layout.slots {
            let t = tensors.get(&s.name).ok_or_else(|| anyhow::anyhow!("tensor `{}` is missing", s.name))?;
            anyhow::ensure!(t.dims() == s.shape, "tensor `{}` has shape {:?}, this model's is {:?}", s.name, t.dims(), s.shape);
        }
        for s in &self.schedule.layout.slots {
            self.be.upload(s.value, &tensors[&s.name])?;
        }
        Ok(())
    }

    /// Every parameter as a named CPU tensor in the arena's dtype, in `state_dict` order.
    #[cfg(feature = "tools")]
    pub fn params(&self) -> anyhow::Result<Vec<(String, Tensor)>> {
        self.params_on(&Device::Cpu)
    }

    /// Every parameter as a named tensor on `device`, in `state_dict` order, copied out of
    /// the arena in one piece ([`Backend::download_to`]: device to device on the GPU backend).
    pub fn params_on(&self, device: &Device) -> anyhow::Result<Vec<(String, Tensor)>> {
        let l = &self.schedule.layout;
        let all = self.be.download_to(l.params, &[l.params.len], device)?;
        l.slots
            .iter()
            .map(|s| Ok((s.name.clone(), all.narrow(0, s.value.off - l.params.off, s.value.len)?.reshape(s.shape.as_slice())?)))
            .collect()
    }

    /// Copies every parameter into `model` (a candle model of the same config: the mirror that
    /// reads the engine's weights), device to device on a GPU.
    pub fn copy_params_into(&self, model: &mut crate::model::Gpt) -> anyhow::Result<()> {
        let params: HashMap<String, Tensor> = self.params_on(model.device())?.into_iter().collect();
        model.load_state(&params)
    }

    /// Every gradient summed so far, named as its parameter.
    #[cfg(feature = "tools")]
    pub fn grads(&self) -> anyhow::Result<Vec<(String, Tensor)>> {
        self.schedule.layout.slots.iter().map(|s| Ok((s.name.clone(), self.be.download(s.grad, &s.shape)?))).collect()
    }

    /// Forward and backward of one micro-batch (`x`, `y`: `rows * t` token ids each), adding
    /// `grad_scale d(sum of token losses)/dp` to the gradients and the sum of its tokens'
    /// losses to [`Engine::loss_sum`]; returns the two passes' times. `looping`: the looped
    /// layer sequence (depth recurrence on). Each pass is one unit of work
    /// ([`Backend::begin_unit`]): no host read, a CUDA graph on the GPU.
    pub fn micro_step(&mut self, x: &[u32], y: &[u32], looping: bool, grad_scale: f64) -> MicroResult {
        self.micro_step_with(Tokens::Host { x, y }, looping, grad_scale, &mut |_, _| {}).expect("host token ids reach the backend")
    }

    /// [`Engine::micro_step`] on token ids wherever they are ([`Tokens`]: on the GPU backend,
    /// tensors on its GPU reach it device to device).
    pub fn micro_step_tokens(&mut self, tokens: Tokens<'_>, looping: bool, grad_scale: f64) -> anyhow::Result<MicroResult> {
        self.micro_step_with(tokens, looping, grad_scale, &mut |_, _| {})
    }

    /// Trains as one of `ranks` (data parallel), from now on: the last micro-batch of each
    /// step goes through [`Engine::exchanged_micro_step`], which averages the gradients over the
    /// ranks in buckets of `buckets` = `(first, rest)` elements, sent while the backward pass
    /// runs when `overlap`; Muon is sharded ([`optim::muon`]). A world of one without a transport
    /// ([`crate::dist::Collective::is_identity`]) changes nothing.
    /// On the GPU backend the collectives run on its device ([`Backend::set_comm`]: NCCL on a
    /// stream of its own); errors when its communicator cannot start.
    pub fn set_ranks(
        &mut self,
        ranks: std::sync::Arc<dyn crate::dist::Collective>,
        buckets: (usize, usize),
        overlap: bool,
    ) -> anyhow::Result<()> {
        if !ranks.is_identity() {
            let device = self.be.set_comm(ranks.clone())?;
            self.exchange = Some(Exchange::new(&self.schedule, ranks, buckets, overlap, device)?);
        }
        Ok(())
    }

    /// The gradient exchange, when several ranks train.
    #[cfg(feature = "tools")]
    pub fn exchange(&self) -> Option<&Exchange> {
        self.exchange.as_ref()
    }

    /// [`Engine::micro_step_tokens`] for the last micro-batch of a step: on several ranks
    /// ([`Engine::set_ranks`]) every gradient is the ranks' mean when it returns, each bucket
    /// sent as soon as the backward pass has finished it. On one rank, the plain micro-step.
    pub fn exchanged_micro_step(
        &mut self,
        tokens: Tokens<'_>,
        looping: bool,
        grad_scale: f64,
    ) -> anyhow::Result<(MicroResult, ExchangeStats)> {
        let Some(exchange) = self.exchange.take() else {
            return Ok((self.micro_step_tokens(tokens, looping, grad_scale)?, ExchangeStats::default()));
        };
        let mut pass = exchange.pass(looping);
        let r = self.micro_pass(tokens, looping, grad_scale, &mut |be, event| pass.at(&exchange, be, event), true);
        let stats = exchange.finish(self.be.as_mut(), pass);
        self.exchange = Some(exchange);
        Ok((r?, stats?))
    }

    /// [`Engine::micro_step_tokens`], calling `at(backend, event)` at each event of the
    /// backward pass ([`Schedule::backward_with`]). On a backend that batches a pass into one
    /// unit of work (the GPU's), `at` must not read the arena.
    pub fn micro_step_with(
        &mut self,
        tokens: Tokens<'_>,
        looping: bool,
        grad_scale: f64,
        at: &mut dyn FnMut(&mut dyn Backend, usize),
    ) -> anyhow::Result<MicroResult> {
        self.micro_pass(tokens, looping, grad_scale, at, false)
    }

    /// [`Engine::micro_step_with`]; `exchanged`: the backward pass sends gradients, a unit with
    /// a key of its own (other work than the other micro-batches': one graph each on a GPU, not
    /// one graph recaptured at every change).
    fn micro_pass(
        &mut self,
        tokens: Tokens<'_>,
        looping: bool,
        grad_scale: f64,
        at: &mut dyn FnMut(&mut dyn Backend, usize),
        exchanged: bool,
    ) -> anyhow::Result<MicroResult> {
        let (acts, scratch) = (self.schedule.layout.activations, self.schedule.layout.scratch_region);
        let t0 = Instant::now();
        // The forward span starts before the ids: a stream that waits for their upload shows
        // the wait as forward time.
        let m0 = self.be.timing_mark();
        self.load_tokens(tokens)?;
        self.be.begin_unit(if looping { "forward looped" } else { "forward" });
        self.schedule.forward(self.be.as_mut(), looping, grad_scale);
        if self.poison {
            self.be.op(op::Fill { dst: scratch, value: f64::NAN });
        }
        self.be.end_unit();
        let t1 = Instant::now();
        let m1 = self.be.timing_mark();
        self.be.begin_unit(match (looping, exchanged) {
            (false, false) => "backward",
            (true, false) => "backward looped",
            (false, true) => "backward exchanged",
            (true, true) => "backward looped exchanged",
        });
        self.schedule.backward_with(self.be.as_mut(), looping, at);
        if self.poison {
            self.be.op(op::Fill { dst: acts, value: f64::NAN });
            self.be.op(op::Fill { dst: scratch, value: f64::NAN });
        }
        self.be.end_unit();
        let m2 = self.be.timing_mark();
        self.span(Phase::Forward, m0, m1);
        self.span(Phase::Backward, m1, m2);
        Ok(MicroResult { forward: t1 - t0, backward: t1.elapsed() })
    }

    /// The summed loss (nats) of the targets `y` after the inputs `x`: sequences of the engine's
    /// `t` tokens, any number of them, scored by forward passes alone in micro-batches of the
    /// engine's rows (validation: no backward pass, no gradient touched; the forward's
    /// activations live in the training arena, so scoring needs no memory of its own). A last,
    /// partial micro-batch is padded with its first sequence, whose copies' losses are taken
    /// off. The losses add up on the device; one host read at the end (and one for a padded
    /// micro-batch). The passes are units of their own (`score`, `score looped`: graphs of
    /// their own on a GPU, beside the training pass's). Between training steps only: it uses,
    /// and leaves at zero, the step's loss sum.
    pub fn score(&mut self, x: &[u32], y: &[u32], looping: bool) -> anyhow::Result<f64> {
        let l = &self.schedule.layout;
        let (t, n, losses, sum) = (l.t, l.rows * l.t, l.losses, l.loss_sum());
        anyhow::ensure!(
            x.len() == y.len() && x.len().is_multiple_of(t),
            "scoring {} ids and {} targets: sequences of {t} tokens are scored",
            x.len(),
            y.len()
        );
        self.be.op(op::Fill { dst: sum, value: 0.0 });
        let mut padding = 0.0;
        for (xc, yc) in x.chunks(n).zip(y.chunks(n)) {
            let (px, py);
            let (xs, ys) = if xc.len() == n {
                (xc, yc)
            } else {
                px = xc.iter().chain(xc[..t].iter().cycle().take(n - xc.len())).copied().collect::<Vec<u32>>();
                py = yc.iter().chain(yc[..t].iter().cycle().take(n - yc.len())).copied().collect::<Vec<u32>>();
                (&px[..], &py[..])
            };
            self.load_tokens(Tokens::Host { x: xs, y: ys })?;
            self.be.begin_unit(if looping { "score looped" } else { "score" });
            self.schedule.forward(self.be.as_mut(), looping, 0.0);
            self.be.end_unit();
            if xc.len() < n {
                padding += self.be.sum(losses.sub(xc.len(), n - xc.len()));
            }
        }
        let total = self.loss_sum()? - padding;
        self.be.op(op::Fill { dst: sum, value: 0.0 });
        Ok(total)
    }

    /// The sum of the token losses of the micro-batches since [`Engine::zero_grads`] (a read
    /// from the device: it waits for the work before it).
    pub fn loss_sum(&self) -> anyhow::Result<f64> {
        self.scalar(self.schedule.layout.loss_sum())
    }

    fn scalar(&self, b: Buf) -> anyhow::Result<f64> {
        Ok(self.be.download(b, &[1])?.to_dtype(DType::F64)?.to_vec1::<f64>()?[0])
    }

    /// Zeroes the gradients and the loss sum (the start of a step).
    pub fn zero_grads(&mut self) {
        let (g, stats) = (self.schedule.layout.grads, self.schedule.layout.stats);
        self.be.op(op::Fill { dst: g, value: 0.0 });
        self.be.op(op::Fill { dst: stats, value: 0.0 });
    }

    /// The optimizer step that ends a training step, as one unit of work (a CUDA graph on the
    /// GPU: the schedule's values change, the launches do not): clipping, Muon, each Adam group
    /// (groups without parameters skipped), the gradients zeroed; then the gradient norm is read
    /// and the loss sum zeroed. The step's loss sum is read first (a host read that waits for
    /// the backward pass): when it is not finite the update is skipped, so that the arena keeps
    /// the weights of the last finished step (what a failed run saves), and the caller fails the
    /// step on the returned loss.
    pub fn optimizer_step(&mut self, s: &OptimizerStep) -> anyhow::Result<StepStats> {
        let loss_sum = self.loss_sum()?;
        if !loss_sum.is_finite() {
            return Ok(StepStats { loss_sum, grad_norm: None });
        }
        let l = &self.schedule.layout;
        let (grads, norm, stats) = (l.grads, l.grad_norm(), l.stats);
        let m0 = self.be.timing_mark();
        self.be.begin_unit("optimizer");
        if s.clip > 0.0 {
            self.be.op(op::ClipNorm { g: grads, max: s.clip, norm });
        }
        let ranks = self.exchange.as_ref().map(|x| x.ranks().clone());
        let muon = optim::muon(self.be.as_mut(), &self.schedule.layout, s.muon, ranks.as_deref());
        if muon.is_ok() {
            for ((group, _), (lr, wd)) in ADAM_GROUPS.iter().zip(s.adam) {
                self.adam(*group, lr, s.betas, s.eps, wd);
            }
            self.be.op(op::Fill { dst: grads, value: 0.0 });
        }
        // Closed whatever happened: a unit left open would refuse every later read.
        self.be.end_unit();
        if self.exchange.as_ref().is_some_and(|x| x.on_device()) {
            // The world's collectives (the step's agreement, on candle's stream) after this
            // unit's broadcasts: two communicators never run at once.
            self.be.fence()?;
        }
        let m1 = self.be.timing_mark();
        self.span(Phase::Optimizer, m0, m1);
        self.last_comm = muon?;
        let grad_norm = if s.clip > 0.0 { Some(self.scalar(norm)?) } else { None };
        self.be.op(op::Fill { dst: stats, value: 0.0 });
        Ok(StepStats { loss_sum, grad_norm })
    }

    /// Keeps a phase's span when the backend has a device clock.
    fn span(&mut self, phase: Phase, from: Option<usize>, to: Option<usize>) {
        if let (Some(a), Some(b)) = (from, to) {
            self.spans.push((phase, a, b));
        }
    }

    /// The device time of each phase since the last call (or since [`Engine::forget_phase_times`]),
    /// summed over the micro-batches and optimizer steps in between, from the backend's timing
    /// marks; `None` when the backend has no device clock (the CPU backends: the host's clock
    /// times their phases, as [`MicroResult`] does). Nothing is waited for: a span the device
    /// has not finished (the optimizer unit, when no host read follows it: no clipping) stays
    /// for the next call, so a step's optimizer time may come with the next step's phases.
    pub fn device_phase_times(&mut self) -> anyhow::Result<Option<PhaseTimes>> {
        if self.spans.is_empty() {
            return Ok(None);
        }
        let mut t = PhaseTimes::default();
        let (done, pending): (Vec<_>, Vec<_>) = std::mem::take(&mut self.spans).into_iter().partition(|&(_, _, b)| self.be.timing_done(b));
        let read = done.iter().try_for_each(|&(phase, a, b)| -> anyhow::Result<()> {
            let d = Duration::from_secs_f64(self.be.timing_ms(a, b)?.max(0.0) / 1e3);
            match phase {
                Phase::Forward => t.forward += d,
                Phase::Backward => t.backward += d,
                Phase::Optimizer => t.optimizer += d,
            }
            Ok(())
        });
        let keep: Vec<usize> = pending.iter().flat_map(|&(_, a, b)| [a, b]).collect();
        for m in done.iter().flat_map(|&(_, a, b)| [a, b]).filter(|m| !keep.contains(m)) {
            self.be.timing_release(m);
        }
        self.spans = pending;
        read.map(|()| Some(t))
    }

    /// Forgets the phase spans not read yet (a step given up halfway) and every timing mark.
    pub fn forget_phase_times(&mut self) {
        self.spans.clear();
        self.be.timing_reset();
    }

    /// Tokens per sequence of its micro-batches.
    pub fn seq_len(&self) -> usize {
        self.schedule.layout.t
    }

    /// Sequences per micro-batch.
    pub fn rows(&self) -> usize {
        self.schedule.layout.rows
    }

    /// How many rows of `t` tokens an arena of `base` (`rows x t`) micro-batches holds when
    /// viewed at them ([`Engine::reshape`]), for rows shorter than the base's that its attention
    /// takes (on a GPU a multiple of [`GPU_SEQ_MULTIPLE`]); `None` for any other length.
    pub fn shorter_rows(&self, t: usize, (rows, base_t): (usize, usize)) -> Option<usize> {
        let takes = self.device_name() == "cpu" || t.is_multiple_of(GPU_SEQ_MULTIPLE);
        (t >= 1 && t < base_t && takes).then(|| rows * base_t / t)
    }

    /// How the backend ran its units of work (`None`: op by op, the CPU backends).
    pub fn graph_counts(&self) -> Option<GraphCounts> {
        self.be.graph_counts()
    }

    /// Runs attention on cuDNN (`on`; the GPU backend, which says so once and runs flash_mma
    /// where cuDNN refuses) or on the backend's own kernels; an error on the CPU backends.
    pub fn set_cudnn(&mut self, on: bool) -> anyhow::Result<()> {
        self.be.set_cudnn(on)
    }

    /// The attention the backend runs (`cudnn`, `flash_mma` with cuDNN's refusal if any, or
    /// `reference` on the CPU), for the log and the report.
    pub fn attention_name(&self) -> String {
        self.be.attention_name()
    }

    /// The backend (tests drive ops on it directly).
    #[cfg(test)]
    pub(crate) fn backend(&self) -> &dyn Backend {
        self.be.as_ref()
    }

    /// Whether every gradient is finite.
    #[cfg(feature = "tools")]
    pub fn grads_finite(&self) -> bool {
        self.be.all_finite(self.schedule.layout.grads)
    }

    /// Whether every parameter is finite.
    #[cfg(feature = "tools")]
    pub fn params_finite(&self) -> bool {
        self.be.all_finite(self.schedule.layout.params)
    }

    /// One Muon step over the block matrices (on one rank).
    #[cfg(feature = "tools")]
    pub fn muon(&mut self, s: MuonStep) -> anyhow::Result<()> {
        optim::muon(self.be.as_mut(), &self.schedule.layout, s, None).map(|_| ())
    }

    /// Wall time of the last optimizer step's collectives (sharded Muon's exchange; zero on
    /// one rank).
    pub fn last_comm(&self) -> Duration {
        self.last_comm
    }

    /// One Adam step of `group` (its step count advances first).
    pub fn adam(&mut self, group: ParamGroup, lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) {
        let Some(i) = ADAM_GROUPS.iter().position(|(g, _)| *g == group) else { return };
        if !self.schedule.layout.slots.iter().any(|s| s.group == group) {
            return;
        }
        self.adam_steps[i] += 1;
        optim::adam(self.be.as_mut(), &self.schedule.layout, group, self.adam_steps[i], lr, betas, eps, weight_decay);
    }

    /// The optimizer state with the candle optimizers' names: `muon.{p}.momentum_buffer`,
    /// `{adam_*}.{p}.exp_avg`, `.exp_avg_sq` and `{adam_*}.step` (groups with parameters only).
    pub fn optimizer_state(&self) -> anyhow::Result<Vec<(String, Tensor)>> {
        self.optimizer_state_on(&Device::Cpu)
    }

    /// [`Engine::optimizer_state`] as tensors on `device` (the step counts stay on the CPU),
    /// copied out of the arena's optimizer region in one piece ([`Backend::download_to`]:
    /// device to device on the GPU backend, no host copy of the moments per snapshot).
    pub fn optimizer_state_on(&self, device: &Device) -> anyhow::Result<Vec<(String, Tensor)>> {
        let l = &self.schedule.layout;
        let all = self.be.download_to(l.state, &[l.state.len], device)?;
        let part = |b: Buf, shape: &[usize]| -> anyhow::Result<Tensor> { Ok(all.narrow(0, b.off - l.state.off, b.len)?.reshape(shape)?) };
        let mut out = Vec::new();
        for s in l.slots.iter().filter(|s| s.group == ParamGroup::Matrix) {
            out.push((format!("muon.{}.momentum_buffer", s.name), part(s.state0, &s.shape)?));
        }
        for (i, (group, prefix)) in ADAM_GROUPS.iter().enumerate() {
            let members: Vec<_> = l.slots.iter().filter(|s| s.group == *group).collect();
            if members.is_empty() {
                continue;
            }
            for s in members {
                out.push((format!("{prefix}.{}.exp_avg", s.name), part(s.state0, &s.shape)?));
                out.push((format!("{prefix}.{}.exp_avg_sq", s.name), part(s.state1, &s.shape)?));
            }
            out.push((format!("{prefix}.step"), Tensor::new(&[self.adam_steps[i] as i64], &Device::Cpu)?));
        }
        Ok(out)
    }

    /// Loads the state [`Engine::optimizer_state`] names (a checkpoint of either executor).
    /// Errors name the tensor that is missing, does not fit, or is not this model's; nothing
    /// changes unless all fit.
    pub fn load_optimizer_state(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        let want = self.optimizer_state()?;
        for (name, like) in &want {
            let t = tensors.get(name).ok_or_else(|| anyhow::anyhow!("optimizer state tensor {name} is missing"))?;
            anyhow::ensure!(t.dims() == like.dims(), "optimizer state tensor {name} has shape {:?}, expected {:?}", t.dims(), like.dims());
        }
        let known: std::collections::HashSet<&String> = want.iter().map(|(n, _)| n).collect();
        let mut unknown: Vec<&String> = tensors.keys().filter(|k| !known.contains(k)).collect();
        unknown.sort();
        if let Some(k) = unknown.first() {
            anyhow::bail!("unexpected optimizer state tensor {k} (no such parameter in this optimizer)");
        }
        let mut steps = self.adam_steps;
        for (i, (_, prefix)) in ADAM_GROUPS.iter().enumerate() {
            if let Some(t) = tensors.get(&format!("{prefix}.step")) {
                let v = t.to_dtype(DType::F64)?.to_vec1::<f64>()?[0];
                anyhow::ensure!(
                    v.is_finite() && v >= 0.0 && v.fract() == 0.0,
                    "optimizer state tensor {prefix}.step holds {v}, not a non-negative integer"
                );
                steps[i] = v as u64;
            }
        }
        let slots = self.schedule.layout.slots.clone();
        for s in &slots {
            let prefix = match s.group {
                ParamGroup::Matrix => {
                    self.be.upload(s.state0, &tensors[&format!("muon.{}.momentum_buffer", s.name)])?;
                    continue;
                }
                g => ADAM_GROUPS.iter().find(|(x, _)| *x == g).map(|(_, p)| *p).unwrap_or("adam"),
            };
            self.be.upload(s.state0, &tensors[&format!("{prefix}.{}.exp_avg", s.name)])?;
            self.be.upload(s.state1, &tensors[&format!("{prefix}.{}.exp_avg_sq", s.name)])?;
        }
        self.adam_steps = steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tests::{baseline_small, perturbed, tokens};

    fn flat(v: Vec<(String, Tensor)>) -> Vec<Vec<f64>> {
        v.into_iter().map(|(_, t)| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()).collect()
    }

    /// A step whose loss is not finite leaves every weight and the optimizer state as the last
    /// finished step left them (what a failed run saves) and returns the loss for the caller to
    /// fail on; a finite one updates them.
    #[test]
    fn a_non_finite_loss_skips_the_update() {
        let cfg = baseline_small();
        let (rows, t) = (2, 6);
        let mut e = Engine::cpu(&cfg, rows, t, DType::F64, false).unwrap();
        e.load_params(&perturbed(&cfg, 3).state_dict().into_iter().collect()).unwrap();
        e.zero_grads();
        let step = OptimizerStep {
            clip: 0.5,
            muon: MuonStep {
                lr: 0.05,
                momentum: 0.95,
                nesterov: true,
                backend_steps: 5,
                ns: crate::optim::NewtonSchulz::Quintic,
                row_norm: false,
                weight_decay: 0.0,
            },
            adam: [(0.01, 0.0); 3],
            betas: (0.9, 0.95),
            eps: 1e-8,
        };
        let (x, y) = (tokens(1, rows * t, cfg.vocab_size as u32), tokens(2, rows * t, cfg.vocab_size as u32));
        e.micro_step(&x, &y, false, 1.0 / (rows * t) as f64);
        let (weights, state) = (flat(e.params().unwrap()), flat(e.optimizer_state().unwrap()));
        let loss = e.schedule.layout.loss_sum();
        e.be.op(op::Fill { dst: loss, value: f64::NAN });
        let s = e.optimizer_step(&step).unwrap();
        assert!(s.loss_sum.is_nan() && s.grad_norm.is_none(), "{s:?}");
        assert!(flat(e.params().unwrap()) == weights && flat(e.optimizer_state().unwrap()) == state, "the update ran");
        e.be.op(op::Fill { dst: loss, value: 1.0 });
        let s = e.optimizer_step(&step).unwrap();
        assert!(s.loss_sum == 1.0 && s.grad_norm.is_some());
        assert!(flat(e.params().unwrap()) != weights, "a finite loss updates the weights");
    }
}
