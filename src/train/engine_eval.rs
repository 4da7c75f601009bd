//! The explicit engine as an evaluation's model ([`EvalModel`], here a floor above both the
//! engine and the evaluations, as [`super::engine_trainer`] is for training), and the choice
//! of executor ([`open`], [`check`]): GPTQ's calibration passes, the
//! round trip's scores, sliding windows, score-first TTT and phased TTT (its global SGD and its
//! LoRA adapters) on the engine's arena ([`crate::engine::evaluate`]), on the
//! CPU in the model's dtype (f32, or f64 for checks) or on a GPU with bf16 activations (GEMMs
//! on bf16 operands, f32 master weights, as the records' autocast evaluation).
//!
//! The scoring and SGD passes run micro-batches of a fixed `rows x t` (phased TTT's LoRA passes
//! view the same arena at their own shapes, `Engine::reshape_padded`): a batch of other rows is
//! cut into micro-batches of `rows`, the last one padded with rows whose targets are
//! [`IGNORED_TARGET`] (no loss, no gradient), so an SGD step's mean loss and gradient are those
//! of its own rows whatever their number. Phased TTT's LoRA passes run on the same arena
//! (`engine_lora.rs`). No candle copy of the weights is kept: the model the engine is built
//! from is dropped once its weights are in the arena.

use std::collections::HashMap;

use anyhow::Context;
use candle_core::Tensor;

use crate::dist::Collective;
use crate::engine::Engine;
use crate::engine::gpu::GpuPrecision;
use crate::engine::layout::{LoraShape, Sizing};
#[cfg(feature = "candle")]
use crate::eval::candle_model::CandleModel;
use crate::eval::executor::{EvalExecutor, EvalModel, SgdStep};
use crate::model::flash_attn::Attention;
use crate::model::observe::InputObserver;
use crate::model::ops::softcap_ce::IGNORED_TARGET;
use crate::model::{Gpt, ModelConfig};

/// Whether `executor` can run `cfg` on rows of `t` tokens (on a GPU when `gpu`): the engine's
/// refusal, naming the element or shape, and how to ask for candle; candle runs every model.
/// `stage` names the stage in the message.
pub fn check(executor: EvalExecutor, cfg: &ModelConfig, t: usize, gpu: bool, stage: &str) -> anyhow::Result<()> {
    if executor == EvalExecutor::Candle {
        return crate::eval::executor::require_candle(&format!("stage `{stage}`, executor = \"candle\""));
    }
    let refusal =
        crate::engine::support::check(cfg).err().or_else(|| if gpu { crate::engine::step::kernel_capacity(cfg, 1, t).err() } else { None });
    match refusal {
        None => Ok(()),
        Some(e) => Err(anyhow::anyhow!(
            "stage `{stage}`: the engine cannot run this evaluation: {e:#}; set `stages.{stage}.executor = \"candle\"` to run it on the candle model"
        )),
    }
}

/// `model` as an evaluation's model on `executor`; the engine on micro-batches of `rows x t`.
pub fn open(model: Gpt, executor: EvalExecutor, rows: usize, t: usize) -> anyhow::Result<Box<dyn EvalModel>> {
    open_sized(model, executor, Sizing::fixed(rows, t))
}

/// [`open`] with the engine's arena sized by `sizing` (phased TTT: its global SGD's
/// micro-batches, and its LoRA passes' adapters and longest windows).
pub fn open_sized(model: Gpt, executor: EvalExecutor, sizing: Sizing) -> anyhow::Result<Box<dyn EvalModel>> {
    Ok(match executor {
        #[cfg(feature = "candle")]
        EvalExecutor::Candle => Box::new(CandleModel::new(model)),
        #[cfg(not(feature = "candle"))]
        EvalExecutor::Candle => return Err(crate::eval::executor::candle_missing("executor = \"candle\"")),
        EvalExecutor::Engine => Box::new(EngineModel::sized(model, sizing)?),
    })
}

/// The arena phased TTT's engine needs: its global SGD's `global` micro-batches (`rows x t`)
/// and passes of `batch_docs` documents' windows of up to `context` tokens through adapters of
/// rank `rank` (on a GPU the windows rounded up to 64 tokens).
pub fn phased_sizing(global: (usize, usize), (batch_docs, context, rank): (usize, usize, usize), gpu: bool) -> Sizing {
    let context = if gpu { context.next_multiple_of(crate::engine::step::GPU_SEQ_MULTIPLE) } else { context };
    Sizing {
        rows: global.0,
        t: global.1,
        tokens: (global.0 * global.1).max(batch_docs * context),
        max_t: global.1.max(context),
        lora: Some(LoraShape { docs: batch_docs, rank }),
    }
}

/// The engine of an evaluation.
pub struct EngineModel {
    engine: Engine,
    /// The shape of the scoring and SGD passes (a LoRA pass reshapes the arena).
    base: (usize, usize),
    /// Phased TTT's adapters (`engine_lora.rs`).
    pub(super) lora: EngineLora,
    /// The passes go through the looped layer sequence (the model's state when built).
    looping: bool,
    /// The model's device (where GPTQ's observer gets the products' inputs).
    device: candle_core::Device,
    /// The SGD momentum of the optimizer [`EvalModel::reset_sgd`] made.
    momentum: Option<f64>,
}

impl EngineModel {
    /// An engine of `model`'s config and weights (its device; on the CPU its dtype) on
    /// micro-batches of `rows x t`. Errors name what the engine cannot run (an element it
    /// lacks, a shape the GPU attention refuses).
    #[cfg(feature = "tools")]
    pub fn new(model: Gpt, rows: usize, t: usize) -> anyhow::Result<Self> {
        Self::sized(model, Sizing::fixed(rows, t))
    }

    /// [`EngineModel::new`] on an arena sized by `sizing` ([`phased_sizing`]).
    pub fn sized(model: Gpt, sizing: Sizing) -> anyhow::Result<Self> {
        let (rows, t) = (sizing.rows, sizing.t);
        anyhow::ensure!(rows >= 1 && t >= 1, "an evaluation engine of {rows} rows of {t} tokens");
        let mut engine = if model.device().is_cpu() {
            Engine::cpu_sized(model.config(), sizing, model.dtype(), false)?
        } else {
            let mut e = Engine::gpu_sized(model.config(), sizing, model.device(), GpuPrecision::Bf16, true, false)?;
            e.set_cudnn(model.attention_choice() == Attention::Cudnn)?;
            e
        };
        let weights: HashMap<String, Tensor> = model.state_dict().into_iter().collect();
        engine.load_params(&weights).context("the evaluation engine's weights")?;
        Ok(Self::with_engine(engine, &model))
    }

    /// `engine` (holding `model`'s weights, for its config and shapes) as the evaluation's model,
    /// looped and placed as `model`: an engine on another backend (the tests' emulated GPU).
    pub fn with_engine(engine: Engine, model: &Gpt) -> Self {
        let base = (engine.rows(), engine.seq_len());
        Self { engine, base, lora: Default::default(), looping: model.looping(), device: model.device().clone(), momentum: None }
    }

    /// The engine.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The engine, to run on.
    pub(super) fn engine_mut(&mut self) -> &mut Engine {
        &mut self.engine
    }

    /// Whether the engine runs on a GPU.
    pub(super) fn on_gpu(&self) -> bool {
        self.engine.device_name() != "cpu"
    }

    /// Whether the passes go through the looped layer sequence.
    pub(super) fn looping(&self) -> bool {
        self.looping
    }

    /// The model's device.
    pub(super) fn device(&self) -> candle_core::Device {
        self.device.clone()
    }

    /// The engine back at the scoring and SGD passes' shape (after LoRA passes).
    fn at_base(&mut self) -> anyhow::Result<()> {
        self.engine.reshape(self.base.0, self.base.1)
    }

    /// What an evaluation engine for `cfg` on `rows x t` micro-batches holds on `device`
    /// (`run.device`): its f32 arena, and on a GPU the bf16 activations at 2 bytes and the
    /// kernel backend's other spaces and cuBLASLt's workspace, as the training engine's
    /// memory counts them ([`crate::train::requirements::engine_memory`]).
    pub fn arena_bytes(cfg: &ModelConfig, rows: usize, t: usize, device: &str) -> u64 {
        Self::arena_bytes_sized(cfg, Sizing::fixed(rows, t), device)
    }

    /// [`EngineModel::arena_bytes`] of an arena sized by `sizing` (with adapters, their values,
    /// gradients, moments and kept products).
    pub fn arena_bytes_sized(cfg: &ModelConfig, sizing: Sizing, device: &str) -> u64 {
        let gpu = matches!(crate::device::parse(device), Ok(crate::device::DeviceName::Cuda(_)));
        let layout = crate::engine::layout::Layout::sized(cfg, sizing);
        let arena: usize = layout.region_bytes(4, gpu).iter().map(|r| r.1).sum();
        // A shape the GPU attention refuses is the executor check's to report.
        let kernels = if gpu { crate::engine::step::kernel_capacity_sized(cfg, sizing).map_or(0, |c| c.scratch_bytes()) } else { 0 };
        (arena + kernels) as u64
    }

    /// Cuts `rows x t` ids and targets into the engine's micro-batches, the last one padded
    /// with ignored positions; `f(x, y, real rows)` for each.
    fn micro_batches(
        &mut self,
        x: &[u32],
        y: &[u32],
        mut f: impl FnMut(&mut Engine, &[u32], &[u32], usize) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        let (rows, t) = (self.engine.rows(), self.engine.seq_len());
        let n = rows * t;
        for (xc, yc) in x.chunks(n).zip(y.chunks(n)) {
            if xc.len() == n {
                f(&mut self.engine, xc, yc, rows)?;
            } else {
                let (mut px, mut py) = (xc.to_vec(), yc.to_vec());
                px.resize(n, 0);
                py.resize(n, IGNORED_TARGET);
                f(&mut self.engine, &px, &py, xc.len() / t)?;
            }
        }
        Ok(())
    }
}

impl EvalModel for EngineModel {
    fn config(&self) -> &ModelConfig {
        self.engine.schedule().config()
    }

    fn describe(&self) -> String {
        format!("engine ({} {:?})", self.engine.device_name(), self.engine.dtype()).to_lowercase()
    }

    fn token_losses(&mut self, x: &[u32], y: &[u32], t: usize) -> anyhow::Result<Vec<f32>> {
        anyhow::ensure!(x.len() == y.len() && x.len().is_multiple_of(t), "{} ids and {} targets in rows of {t}", x.len(), y.len());
        self.at_base()?;
        if let Some(view) = self.engine.shorter_rows(t, self.base) {
            // Shorter rows (a packed validation's last, partial batch): the arena viewed at as
            // many of them as it holds; the next call goes back to the base shape.
            self.engine.reshape(view, t)?;
        }
        anyhow::ensure!(
            t == self.engine.seq_len(),
            "internal: rows of {t} tokens scored by an evaluation engine of {}-token rows",
            self.engine.seq_len()
        );
        let looping = self.looping;
        let mut out = Vec::with_capacity(x.len());
        self.micro_batches(x, y, |engine, x, y, real| {
            let losses = engine.token_losses(x, y, looping)?;
            out.extend_from_slice(&losses[..real * t]);
            Ok(())
        })?;
        Ok(out)
    }

    fn reset_sgd(&mut self, momentum: f64) -> anyhow::Result<()> {
        anyhow::ensure!(momentum.is_finite() && momentum >= 0.0, "SGD momentum must be a finite number >= 0, got {momentum}");
        self.engine.reset_sgd();
        self.momentum = Some(momentum);
        Ok(())
    }

    fn sgd_step(&mut self, s: &SgdStep<'_>, ranks: &dyn Collective) -> anyhow::Result<()> {
        let momentum = self.momentum.ok_or_else(|| anyhow::anyhow!("internal: an SGD step before `reset_sgd`"))?;
        self.at_base()?;
        anyhow::ensure!(
            s.t == self.engine.seq_len(),
            "internal: SGD on rows of {} tokens, the engine's are {}",
            s.t,
            self.engine.seq_len()
        );
        let looping = self.looping;
        // d(mean over the batch's rows x t positions)/dp: every rank's share summed.
        let scale = 1.0 / (s.rows * s.t) as f64;
        self.engine.set_documents(s.doc_bos);
        let pass = self.micro_batches(s.x, s.y, |engine, x, y, _| {
            engine.micro_step(x, y, looping, scale);
            Ok(())
        });
        self.engine.set_documents(None);
        pass?;
        if !s.x.is_empty() {
            let value = self.engine.loss_sum()?;
            anyhow::ensure!(value.is_finite(), "the TTT training loss is {value} on the sequences from target {}", s.from);
        }
        if !ranks.is_identity() {
            self.engine.sum_grads_over(ranks)?;
        }
        self.engine.sgd_step(s.lr, momentum, s.grad_clip);
        Ok(())
    }

    fn observe_inputs(&mut self, x: &[u32], t: usize, observer: &mut dyn InputObserver) -> anyhow::Result<()> {
        self.at_base()?;
        anyhow::ensure!(
            t == self.engine.seq_len() && x.len().is_multiple_of(t),
            "internal: {} ids in rows of {t} for an engine of {}-token rows",
            x.len(),
            self.engine.seq_len()
        );
        let looping = self.looping;
        let device = self.device.clone();
        // The ids as their own targets: padding rows are cut off by `real`, not by their targets.
        self.micro_batches(x, x, |engine, x, _, real| engine.observe_inputs(x, real, looping, observer, &device))
    }
}

/// The engine's adapters' state between calls.
#[derive(Default)]
pub struct EngineLora {
    /// The live batch's settings.
    pub(super) spec: Option<crate::eval::lora::LoraSpec>,
    /// The arena's adapters are the kept set (the last full batch's).
    pub(super) holds_kept: bool,
    /// The kept set, set aside while a fresh one is in the arena.
    pub(super) saved: Option<Tensor>,
    /// The last forward pass, when a row trains: its inputs for the backward pass.
    pub(super) pending: Option<Pending>,
}

/// A forward pass whose backward pass is still to run.
pub(super) struct Pending {
    /// Inputs, `rows x t`.
    pub(super) x: Vec<u32>,
    /// Targets (ignored outside the scored positions).
    pub(super) y: Vec<u32>,
    /// Per row: its gradient is kept.
    pub(super) train: Vec<bool>,
    /// Each kept position's weight.
    pub(super) grad_scale: f64,
    /// The document of the first row.
    pub(super) first: usize,
}
