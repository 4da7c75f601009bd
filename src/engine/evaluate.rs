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

impl Engine {
    /// The loss (nats) of each of the `rows x t` positions of inputs `x` and targets `y`
    /// (exactly the engine's micro-batch; an ignored position's is 0), by one
    /// forward pass (a unit of its own: `eval losses`, a CUDA graph on a GPU) and one read of
    /// the losses. Gradients and the optimizer state are untouched.
    pub fn token_losses(&mut self, x: &[u32], y: &[u32], looping: bool) -> Result<Vec<f32>> {
        let l = &self.schedule.layout;
        let (n, losses, stats) = (l.rows * l.t, l.losses, l.stats);
        anyhow::ensure!(x.len() == n && y.len() == n, "{} ids and {} targets for the engine's {n}-token micro-batch", x.len(), y.len());
        self.be.load_tokens(Tokens::Host { x, y })?;
        self.be.begin_unit(if looping { "eval losses looped" } else { "eval losses" });
        self.schedule.forward(self.be.as_mut(), looping, 0.0);
        self.be.end_unit();
        let out = self.be.download(losses, &[n])?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        // The forward pass added its losses to the step's loss sum: an evaluation keeps none.
        self.be.fill(stats, 0.0);
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
        self.be.load_tokens(Tokens::Host { x, y: x })?;
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
        self.be.fill(stats, 0.0);
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
        self.be.fill(state, 0.0);
    }

    /// One SGD step with momentum `momentum` at `lr` from the gradients summed so far (clipped
    /// to the global norm `clip` first, 0: no clipping), then the gradients and the loss sum
    /// zeroed. Nothing is read back.
    pub fn sgd_step(&mut self, lr: f64, momentum: f64, clip: f64) {
        let l = &self.schedule.layout;
        let (grads, norm, stats) = (l.grads, l.grad_norm(), l.stats);
        if clip > 0.0 {
            self.be.clip_norm(grads, clip, norm);
        }
        for s in &self.schedule.layout.slots {
            if momentum > 0.0 {
                self.be.axpby(1.0, s.grad, momentum, s.state0);
                self.be.axpby(-lr, s.state0, 1.0, s.value);
            } else {
                self.be.axpby(-lr, s.grad, 1.0, s.value);
            }
        }
        self.be.fill(grads, 0.0);
        self.be.fill(stats, 0.0);
    }

    /// Every gradient summed over `ranks` (one all-reduce of the gradient region, through the
    /// host: test-time training's steps are few against training's).
    pub fn sum_grads_over(&mut self, ranks: &dyn crate::dist::Collective) -> Result<()> {
        let grads = self.schedule.layout.grads;
        let mine = self.be.download(grads, &[grads.len])?;
        let (mut summed, _) =
            crate::dist::bucket::all_reduce_tensors(ranks, &[mine], crate::dist::ReduceOp::Sum, crate::dist::bucket::DEFAULT_BUCKET_ELEMS)?;
        self.be.upload(grads, &summed.remove(0))?;
        Ok(())
    }
}
