//! Phased TTT's per-document LoRA adapters on the engine ([`LoraModel`] for
//! [`EngineModel`]): the adapters, their gradients and AdamW's moments live in the engine's
//! arena ([`crate::engine::lora`]), sized for the stage's `batch_docs` documents at its rank
//! and for its longest window; each chunk's pass runs the arena at `docs x width`
//! ([`crate::engine::Engine::reshape`]), the width rounded up to 64 on a GPU (the attention's
//! granule; positions past a window are ignored, and causal attention keeps them out of the
//! window's scores).
//!
//! A pass runs the documents with a chunk in it, each through its own adapters: when they are
//! the batch's last documents (the work queue lists a batch's documents shortest first, so
//! those with chunks left are), a pass of those rows alone; else a row for every document, those
//! without a chunk all ignored targets (no loss, no gradient). The adapters' AdamW steps every
//! document's set either way (the others' gradients are zero), as the candle model's batched
//! optimizer does. The loss of a pass keeps
//! each training row's scored positions at weight `1 / chunk` (every trained chunk has `chunk`
//! targets: only a document's last chunk is shorter, and it is never trained on); a row that
//! only scores has its gradient dropped after the fused loss.
//!
//! The warm start of A keeps the last full batch's set in the arena; a batch of fresh adapters
//! in between (a short batch) sets it aside first (device to device on a GPU) and the next warm
//! start puts it back.

use candle_core::{DType, Device, Tensor};

use super::engine_eval::{EngineModel, Pending};
use crate::engine::evaluate::{LoraAdam, LoraPass};
use crate::eval::executor::EvalModel;
use crate::eval::lora::{LoraModel, LoraSpec, LoraStep};
use crate::model::lora::Lora;
use crate::model::ops::softcap_ce::IGNORED_TARGET;

impl EngineModel {
    /// The engine's row length for a pass of `width` positions: on a GPU the next multiple of 64.
    fn lora_t(&self, width: usize) -> usize {
        if self.on_gpu() { width.next_multiple_of(crate::engine::step::GPU_SEQ_MULTIPLE) } else { width }
    }

    fn lora_pass<'a>(&self, p: &'a Pending) -> LoraPass<'a> {
        let scale = self.lora.spec.map_or(1.0, |s| s.scale());
        LoraPass { x: &p.x, y: &p.y, looping: self.looping(), scale, first_doc: p.first, train: &p.train, grad_scale: p.grad_scale }
    }
}

impl LoraModel for EngineModel {
    fn lora_begin(&mut self, spec: &LoraSpec, docs: usize, seed: u64, warm: bool) -> anyhow::Result<()> {
        let shape = self
            .engine()
            .schedule()
            .layout
            .lora
            .as_ref()
            .map(|l| l.shape)
            .ok_or_else(|| anyhow::anyhow!("internal: phased TTT's adapters on an evaluation engine sized without them"))?;
        anyhow::ensure!(
            docs <= shape.docs && spec.rank == shape.rank,
            "internal: adapters for {docs} documents at rank {} in an arena sized for {} at rank {}",
            spec.rank,
            shape.docs,
            shape.rank
        );
        let kept = self.lora.holds_kept || self.lora.saved.is_some();
        if warm && kept {
            if let Some(values) = self.lora.saved.take() {
                self.engine_mut().lora_restore(&values)?;
            }
            self.engine_mut().lora_zero_b()?;
            self.engine_mut().lora_reset_optimizer()?;
        } else {
            if self.lora.holds_kept {
                let device = self.device();
                self.lora.saved = Some(self.engine().lora_values(&device)?);
            }
            // Drawn as the candle model draws them (the same seed gives the same A).
            let dtype = if self.on_gpu() { DType::F32 } else { self.engine().dtype() };
            let fresh = Lora::new(self.config(), self.looping(), (docs, spec.rank), seed, dtype, &Device::Cpu)?;
            let tensors: Vec<(String, Tensor)> = fresh.vars().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
            self.engine_mut().lora_load(&tensors)?;
        }
        self.lora.holds_kept = false;
        self.lora.spec = Some(*spec);
        self.lora.pending = None;
        Ok(())
    }

    fn lora_score(&mut self, s: &LoraStep<'_>) -> anyhow::Result<Vec<f32>> {
        anyhow::ensure!(self.lora.spec.is_some(), "internal: a LoRA pass before `lora_begin`");
        let (docs, w) = (s.rows(), s.width);
        let t = self.lora_t(w);
        // The rows run: from the first document with a chunk on when every later one has one
        // too (the work queue's batches list their documents shortest first, so those with
        // chunks left are the last ones): a pass of those alone through their adapters; else
        // every document's row, those without a chunk all ignored.
        let first = (0..docs).find(|&r| s.active[r]).unwrap_or(0);
        let first = if (first..docs).all(|r| s.active[r]) { first } else { 0 };
        let rows = docs - first;
        // Every training row's scored positions weigh 1 / their count: one count for all.
        let counts: Vec<usize> = (0..docs).filter(|&r| s.active[r] && s.train[r]).map(|r| s.scored[r].len()).collect();
        anyhow::ensure!(
            counts.windows(2).all(|c| c[0] == c[1]) && counts.first() != Some(&0),
            "internal: the engine's LoRA step weighs every trained chunk alike; these have {counts:?} targets"
        );
        let grad_scale = counts.first().map_or(0.0, |&c| 1.0 / c as f64);
        let (mut x, mut y) = (vec![0u32; rows * t], vec![IGNORED_TARGET; rows * t]);
        for r in (first..docs).filter(|&r| s.active[r]) {
            let j = r - first;
            x[j * t..][..w].copy_from_slice(&s.x[r * w..][..w]);
            let sc = &s.scored[r];
            y[j * t + sc.start..j * t + sc.end].copy_from_slice(&s.y[r * w + sc.start..r * w + sc.end]);
        }
        let train: Vec<bool> = (first..docs).map(|r| s.train[r] && s.active[r]).collect();
        self.engine_mut().reshape_padded(rows, t, w)?;
        let pending = Pending { x, y, train, grad_scale, first };
        let nll = {
            let pass = self.lora_pass(&pending);
            self.engine_mut().lora_forward(&pass)?
        };
        self.lora.pending = pending.train.iter().any(|&k| k).then_some(pending);
        let mut out = vec![0f32; docs * w];
        for r in (first..docs).filter(|&r| s.active[r]) {
            out[r * w..][..w].copy_from_slice(&nll[(r - first) * t..][..w]);
        }
        Ok(out)
    }

    fn lora_adapt(&mut self) -> anyhow::Result<()> {
        let p = self.lora.pending.take().ok_or_else(|| anyhow::anyhow!("internal: a LoRA step without a training pass"))?;
        let spec = self.lora.spec.ok_or_else(|| anyhow::anyhow!("internal: a LoRA step before `lora_begin`"))?;
        let adam = LoraAdam { lr: spec.lr, betas: spec.betas, eps: spec.eps, weight_decay: spec.weight_decay };
        let pass = self.lora_pass(&p);
        self.engine_mut().lora_backward(&pass, adam)
    }

    fn lora_end(&mut self, keep: bool) -> anyhow::Result<()> {
        self.lora.pending = None;
        self.lora.spec = None;
        if keep {
            self.lora.holds_kept = true;
            self.lora.saved = None;
        }
        Ok(())
    }

    fn lora_forget(&mut self) {
        self.lora.holds_kept = false;
        self.lora.saved = None;
    }

    fn lora_kept_a(&mut self) -> anyhow::Result<Option<Vec<f64>>> {
        let values = if let Some(v) = &self.lora.saved {
            let e = self.engine();
            let a = e.schedule().layout.lora.as_ref().map(|l| l.slots[0][0]).expect("adapters in the arena");
            let off = a.a.off - e.schedule().layout.lora.as_ref().expect("adapters").values.off;
            v.narrow(0, off, a.a.len)?
        } else if self.lora.holds_kept {
            let slots = self.config().layer_sequence(self.looping()).len();
            self.engine().lora_tensors(slots)?.swap_remove(0).1.flatten_all()?
        } else {
            return Ok(None);
        };
        Ok(Some(values.to_dtype(DType::F64)?.to_vec1()?))
    }
}
