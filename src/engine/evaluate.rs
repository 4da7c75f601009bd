//! The evaluations after training on the engine's arena ([`crate::train::engine_eval`] drives
//! them): the per-token losses of a forward pass, and test-time training's SGD with momentum
//! over every parameter.
//!
//! ```text
//! losses:  forward(x, y) only; losses[i] = softcap-CE of position i (grad_scale 0: no gradient kept)
//! SGD:     g ← clip(g)                      torch's clip_grad_norm_: g · min(1, max / (‖g‖ + 1e-6))
//!          buf ← μ·buf + g                  (buf starts at 0, so the first step is torch's clone of g)
//!          p ← p − lr·buf                   (μ = 0: p ← p − lr·g)
//! ```
//!
//! The momentum buffer of a parameter is its slot's `state0` (Muon's momentum or Adam's first
//! moment while training): an evaluation's engine is built from the final weights and never
//! runs the training optimizers, so the optimizer region holds the SGD state instead of a
//! region of its own. Positions whose target is
//! [`IGNORED_TARGET`](crate::model::ops::softcap_ce::IGNORED_TARGET) count in no loss and send no
//! gradient: a partial batch of rows is padded with them.

use anyhow::Result;
use candle_core::DType;

use super::Engine;
use super::backend::Tokens;
use crate::engine::backend::BackendExt;
use crate::engine::op;

impl Engine {
    /// The loss (nats) of each of the `rows x t` positions of inputs `x` and targets `y`
    /// (exactly the engine's micro-batch; an ignored position's is 0), by one
    /// forward pass (a unit of its own: `eval losses`, a CUDA graph on a GPU) and one read of
    /// the losses. Gradients and the optimizer state are untouched.
    pub fn token_losses(&mut self, x: &[u32], y: &[u32], looping: bool) -> Result<Vec<f32>> {
        let l = &self.schedule.layout;
        let (n, losses, stats) = (l.rows * l.t, l.losses, l.stats);
        anyhow::ensure!(x.len() == n && y.len() == n, "{} ids and {} targets for the engine's {n}-token micro-batch", x.len(), y.len());
        self.load_tokens(Tokens::Host { x, y })?;
        self.be.begin_unit(if looping { "eval losses looped" } else { "eval losses" });
        self.schedule.forward(self.be.as_mut(), looping, 0.0);
        self.be.end_unit();
        let out = self.be.download(losses, &[n])?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        // The forward pass added its losses to the step's loss sum: an evaluation keeps none.
        self.be.op(op::Fill { dst: stats, value: 0.0 });
        Ok(out)
    }

    /// Hands the input of every matrix product of a forward pass over the ids `x` (exactly the
    /// engine's micro-batch; no loss is kept) to `observer`, as the candle model's
    /// [`crate::model::Gpt::observe_inputs`] does: each as an `(N, in)` tensor on `device`
    /// (device to device on a GPU), the first `rows` rows of the micro-batch only (the rest is
    /// padding), and only those it wants ([`crate::model::observe::InputObserver::wants`]).
    /// GPTQ's calibration sums `X^T X` of them.
    pub fn observe_inputs(
        &mut self,
        x: &[u32],
        rows: usize,
        looping: bool,
        observer: &mut dyn crate::model::observe::InputObserver,
        device: &candle_core::Device,
    ) -> Result<()> {
        let l = &self.schedule.layout;
        let (n, t, stats) = (l.rows * l.t, l.t, l.stats);
        anyhow::ensure!(x.len() == n && rows <= l.rows, "{} ids ({rows} rows) for the engine's {n}-token micro-batch", x.len());
        // Targets do not matter (the loss is dropped): the ids themselves.
        self.load_tokens(Tokens::Host { x, y: x })?;
        self.be.begin_unit(if looping { "observe looped" } else { "observe" });
        self.schedule.forward(self.be.as_mut(), looping, 0.0);
        self.be.end_unit();
        for input in self.schedule.product_inputs(looping) {
            if !observer.wants(&input.weights) {
                continue;
            }
            let src = if input.act { self.schedule.activate(self.be.as_mut(), input.x) } else { input.x };
            let m = rows * t;
            let xt = self.be.download_to(src.sub(0, m * input.cols), &[m, input.cols], device)?;
            observer.observe(&input.weights, &xt)?;
        }
        self.be.op(op::Fill { dst: stats, value: 0.0 });
        Ok(())
    }

    /// Attention inside the documents that `bos` starts from now on (`Some`), or the model's
    /// own rule (`None`): [`super::schedule::Schedule::set_documents`].
    pub fn set_documents(&mut self, bos: Option<u32>) {
        self.schedule.set_documents(bos);
    }

    /// Zeroes the SGD momentum (a fresh optimizer: torch's buffers start as the first gradient).
    pub fn reset_sgd(&mut self) {
        let state = self.schedule.layout.state;
        self.be.op(op::Fill { dst: state, value: 0.0 });
    }

    /// One SGD step with momentum `momentum` at `lr` from the gradients summed so far (clipped
    /// to the global norm `clip` first, 0: no clipping), then the gradients and the loss sum
    /// zeroed. Nothing is read back.
    pub fn sgd_step(&mut self, lr: f64, momentum: f64, clip: f64) {
        let l = &self.schedule.layout;
        let (grads, norm, stats) = (l.grads, l.grad_norm(), l.stats);
        if clip > 0.0 {
            // The base's gradients (the adapters', if the arena holds any, are zero).
            self.be.op(op::ClipNorm { g: l.base_grads(), max: clip, norm });
        }
        for s in &self.schedule.layout.slots {
            if momentum > 0.0 {
                self.be.op(op::Axpby { a: 1.0, x: s.grad, b: momentum, y: s.state0 });
                self.be.op(op::Axpby { a: -lr, x: s.state0, b: 1.0, y: s.value });
            } else {
                self.be.op(op::Axpby { a: -lr, x: s.grad, b: 1.0, y: s.value });
            }
        }
        self.be.op(op::Fill { dst: grads, value: 0.0 });
        self.be.op(op::Fill { dst: stats, value: 0.0 });
    }

    /// Every gradient of the base summed over `ranks` (one all-reduce of the gradient region
    /// but the LoRA adapters', through the host: test-time training's steps are few against
    /// training's).
    pub fn sum_grads_over(&mut self, ranks: &dyn crate::dist::Collective) -> Result<()> {
        let grads = self.schedule.layout.base_grads();
        let mine = self.be.download(grads, &[grads.len])?;
        let (mut summed, _) =
            crate::dist::bucket::all_reduce_tensors(ranks, &[mine], crate::dist::ReduceOp::Sum, crate::dist::bucket::DEFAULT_BUCKET_ELEMS)?;
        self.be.upload(grads, &summed.remove(0))?;
        Ok(())
    }
}

/// AdamW of the LoRA adapters (phased TTT's `lora_*` keys).
#[derive(Clone, Copy, Debug)]
pub struct LoraAdam {
    /// Learning rate.
    pub lr: f64,
    /// `(β1, β2)`.
    pub betas: (f64, f64),
    /// `ε`.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// One pass through the LoRA adapters on the engine's current shape: [`Engine::lora_forward`],
/// then (when a row trains) [`Engine::lora_backward`].
#[derive(Clone, Copy, Debug)]
pub struct LoraPass<'a> {
    /// Inputs, `rows x t`: row `b` is document `first_doc + b`'s.
    pub x: &'a [u32],
    /// Targets; [`IGNORED_TARGET`](crate::model::ops::softcap_ce::IGNORED_TARGET) where a position is neither scored nor trained on.
    pub y: &'a [u32],
    /// Through the looped layer sequence.
    pub looping: bool,
    /// The adapters' output scale (`alpha / rank`, or 1).
    pub scale: f64,
    /// The document of the first row: row `b` goes through document `first_doc + b`'s
    /// adapters.
    pub first_doc: usize,
    /// Per row: its positions' gradients are kept (the rest are scored only).
    pub train: &'a [bool],
    /// Each kept position's weight in the loss the adapters step on.
    pub grad_scale: f64,
}

impl Engine {
    /// Views the arena at micro-batches of `rows x t` from now on (within its sizing,
    /// [`super::layout::Layout::reshaped`]); the RoPE tables follow a new row length.
    pub fn reshape(&mut self, rows: usize, t: usize) -> Result<()> {
        self.reshape_padded(rows, t, t)
    }

    /// [`Engine::reshape`] for rows of `len` real positions padded to `t` (a GPU's attention
    /// takes multiples of 64): the RoPE tables' base is `len`'s, as a pass of `len` positions
    /// has it ([`crate::model::ModelConfig::rope_base_for`]: past the training length it
    /// grows with the pass), so that the padding changes no score.
    pub fn reshape_padded(&mut self, rows: usize, t: usize, len: usize) -> Result<()> {
        anyhow::ensure!(len >= 1 && len <= t, "rows of {len} positions padded to {t}");
        let l = &self.schedule.layout;
        if (l.rows, l.t, self.rope_len) == (rows, t, len) {
            return Ok(());
        }
        let new_rope = (l.t, self.rope_len) != (t, len);
        self.schedule.layout = l.reshaped(self.schedule.config(), rows, t)?;
        self.rope_len = len;
        if new_rope {
            self.upload_rope()?;
        }
        Ok(())
    }

    fn lora_layout(&self) -> Result<&super::lora::LoraLayout> {
        self.schedule.layout.lora.as_ref().ok_or_else(|| anyhow::anyhow!("internal: a LoRA pass on an engine sized without adapters"))
    }

    /// Loads adapters (the candle adapters' names and shapes, `[docs, rows, cols]` with at most
    /// the arena's documents: the first ones), and starts a fresh AdamW (moments, gradients
    /// and step count zero).
    pub fn lora_load(&mut self, tensors: &[(String, candle_core::Tensor)]) -> Result<()> {
        let named = self.lora_layout()?.named(usize::MAX);
        for (name, t) in tensors {
            let (_, buf, shape) =
                named.iter().find(|(n, ..)| n == name).ok_or_else(|| anyhow::anyhow!("no LoRA adapter `{name}` in the arena"))?;
            let dims = t.dims();
            anyhow::ensure!(
                dims.len() == 3 && dims[0] <= shape[0] && dims[1..] == shape[1..],
                "LoRA adapter `{name}` has shape {dims:?}, the arena's is {shape:?} (at most that many documents)"
            );
            self.be.upload(buf.sub(0, t.elem_count()), t)?;
        }
        self.lora_reset_optimizer()
    }

    /// Zeroes every adapter's B (they output 0 again; A kept: the warm start of A).
    pub fn lora_zero_b(&mut self) -> Result<()> {
        let bs: Vec<_> = self.lora_layout()?.named(usize::MAX).into_iter().filter(|(n, ..)| n.ends_with(".b")).map(|(_, b, _)| b).collect();
        for b in bs {
            self.be.op(op::Fill { dst: b, value: 0.0 });
        }
        Ok(())
    }

    /// A fresh AdamW for the adapters: moments and gradients zero, step count 0.
    pub fn lora_reset_optimizer(&mut self) -> Result<()> {
        let (m, v) = (self.lora_layout()?.m, self.lora_layout()?.v);
        let grads = self.schedule.layout.grads;
        self.be.op(op::Fill { dst: m, value: 0.0 });
        self.be.op(op::Fill { dst: v, value: 0.0 });
        self.be.op(op::Fill { dst: grads, value: 0.0 });
        self.lora_steps = 0;
        Ok(())
    }

    /// Every adapter value, as one tensor on `device` (to set aside and
    /// [`Engine::lora_restore`] later).
    pub fn lora_values(&self, device: &candle_core::Device) -> Result<candle_core::Tensor> {
        let v = self.lora_layout()?.values;
        self.be.download_to(v, &[v.len], device)
    }

    /// Puts back values [`Engine::lora_values`] set aside.
    pub fn lora_restore(&mut self, values: &candle_core::Tensor) -> Result<()> {
        let v = self.lora_layout()?.values;
        anyhow::ensure!(values.elem_count() == v.len, "{} LoRA values for an arena of {}", values.elem_count(), v.len);
        self.be.upload(v, values)
    }

    /// The adapters of the first `slots` positions and the head's, named as the candle
    /// adapters' (checks).
    pub fn lora_tensors(&self, slots: usize) -> Result<Vec<(String, candle_core::Tensor)>> {
        self.lora_layout()?.named(slots).into_iter().map(|(name, b, shape)| Ok((name, self.be.download(b, &shape)?))).collect()
    }

    /// The forward pass of [`LoraPass`] through the adapters: every position's loss (0 where
    /// ignored), and the gradient of the loss the adapters step on left in the logits.
    pub fn lora_forward(&mut self, p: &LoraPass<'_>) -> Result<Vec<f32>> {
        let l = &self.schedule.layout;
        let (rows, t) = (l.rows, l.t);
        let n = rows * t;
        let docs = self.lora_layout()?.shape.docs;
        anyhow::ensure!(p.x.len() == n && p.y.len() == n && p.train.len() == rows, "a LoRA pass of {} ids for {rows} x {t}", p.x.len());
        anyhow::ensure!(
            p.first_doc + rows <= docs,
            "a LoRA pass of {rows} rows from document {} through adapters for {docs} documents",
            p.first_doc
        );
        self.load_tokens(Tokens::Host { x: p.x, y: p.y })?;
        self.schedule.set_lora(Some(super::lora::LoraOn { scale: p.scale, first_doc: p.first_doc }));
        self.be.begin_unit(&format!("lora forward {}", lora_key(p, rows, t)));
        self.schedule.forward(self.be.as_mut(), p.looping, p.grad_scale);
        self.be.end_unit();
        self.schedule.set_lora(None);
        let (losses, stats) = (self.schedule.layout.losses, self.schedule.layout.stats);
        self.be.op(op::Fill { dst: stats, value: 0.0 });
        Ok(self.be.download(losses, &[n])?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
    }

    /// The backward pass of the [`Engine::lora_forward`] just run (the same `p`), into the
    /// adapters alone (the base frozen: no gradient of its matrices or embedding is computed)
    /// from the training rows' losses, then one AdamW step of every adapter (those of rows that
    /// did not train too: their gradient is zero, their moments and decay go on, as a batched
    /// optimizer's do). The gradients are zero again after it.
    pub fn lora_backward(&mut self, p: &LoraPass<'_>, adam: LoraAdam) -> Result<()> {
        let l = &self.schedule.layout;
        let (rows, t, v) = (l.rows, l.t, self.schedule.config().vocab_size);
        let (logits, grads) = (l.logits, l.grads);
        let lora = self.lora_layout()?.clone();
        anyhow::ensure!(p.train.len() == rows, "{} rows to train of a {rows}-row pass", p.train.len());
        self.lora_steps += 1;
        let k = self.lora_steps as f64;
        let step = super::backend::AdamStep {
            lr: adam.lr,
            beta1: adam.betas.0,
            beta2: adam.betas.1,
            eps: adam.eps,
            weight_decay: adam.weight_decay,
            bias1: 1.0 - adam.betas.0.powf(k),
            bias2_sqrt: (1.0 - adam.betas.1.powf(k)).sqrt(),
        };
        self.schedule.set_lora(Some(super::lora::LoraOn { scale: p.scale, first_doc: p.first_doc }));
        self.be.begin_unit(&format!("lora backward {}", lora_key(p, rows, t)));
        // A row that does not train keeps its scores, not its gradient.
        for (r, _) in p.train.iter().enumerate().filter(|(_, k)| !**k) {
            self.be.op(op::Fill { dst: logits.sub(r * t * v, t * v), value: 0.0 });
        }
        self.schedule.backward(self.be.as_mut(), p.looping);
        self.be.op(op::Adam { p: lora.values, g: lora.grads, m: lora.m, v: lora.v, s: step });
        // The base's small parameters got gradients too (they are frozen): none is kept.
        self.be.op(op::Fill { dst: grads, value: 0.0 });
        self.be.end_unit();
        self.schedule.set_lora(None);
        Ok(())
    }
}

/// A LoRA pass's shape, for its units' keys (a GPU backend captures one graph per key).
fn lora_key(p: &LoraPass<'_>, rows: usize, t: usize) -> String {
    format!("{rows}x{t}{}", if p.looping { " looped" } else { "" })
}
