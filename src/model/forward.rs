//! The candle executor's forward pass over the [`Gpt`]'s parameters (feature `candle`):
//! embedding, the U-Net of [`super::block`]s with skip connections, the output head and the
//! loss, on candle's autograd. How each product and norm is computed is the pass's
//! [`Formulation`]. The engine (`crate::engine`) runs the same model without it.

use std::cell::RefCell;

use candle_core::{DType, Result, Tensor};

use super::Gpt;
use super::config::FinalLane;
use super::formulation::{Formulation, PassExtras};
use super::observe::{InputObserver, Observer};
use super::ops::{DocumentMask, cast, embedding, gated_skip, rms_norm, rope_tables, scale_add, smear_gate, softcap, softcap_cross_entropy};

impl Gpt {
    /// The parameter `name` as a tensor of the forward pass (detached during evaluation).
    pub(super) fn p(&self, name: &str) -> Tensor {
        let t = self.params[self.index[name]].1.as_tensor();
        if self.detached.get() { t.detach() } else { t.clone() }
    }

    /// Per-position cross-entropy like [`Gpt::token_losses`], without building an autograd
    /// graph (evaluation).
    pub fn eval_token_losses(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.frozen_token_losses(x, y, PassExtras::default())
    }

    /// Per-position cross-entropy with the base weights frozen (read detached, so a backward
    /// pass reaches only what `extras` brings: test-time LoRA adapters), under `extras`'
    /// document mask if it has one.
    pub fn frozen_token_losses(&self, x: &Tensor, y: &Tensor, extras: PassExtras<'_>) -> Result<Tensor> {
        let _detached = self.detach_for_eval();
        self.token_losses_with(x, y, extras)
    }

    /// Forward passes read detached parameters until the guard drops.
    fn detach_for_eval(&self) -> impl Drop + '_ {
        struct Reset<'a>(&'a std::cell::Cell<bool>);
        impl Drop for Reset<'_> {
            fn drop(&mut self) {
                self.0.set(false);
            }
        }
        self.detached.set(true);
        Reset(&self.detached)
    }

    /// Soft-capped logits `(B*T, V)` for input ids `x` of shape `(B, T)` (u32).
    pub fn logits(&self, x: &Tensor) -> Result<Tensor> {
        softcap(&cast(&self.raw_logits(x)?, self.dtype)?, self.cfg.logit_softcap)
    }

    /// Logits before the soft-cap, `(B*T, V)`: in the matmul dtype under mixed precision on the
    /// GPU path (the head's product stays bf16, as under autocast), else the model's.
    ///
    /// The residual stream and every projection stay `(B*T, C)` matrices (token-major, heads side
    /// by side), so that no reshape or transpose enters the autograd graph; the per-channel
    /// scales, the residual mix, QK norm with RoPE, attention and relu² are fused ops.
    fn raw_logits(&self, x: &Tensor) -> Result<Tensor> {
        self.raw_logits_observed(x, None, PassExtras::default())
    }

    /// Hands the input of every matrix product of a forward pass over `x` `(B, T)` to `observer`
    /// (see [`super::observe`]), without an autograd graph; the logits are dropped.
    pub fn observe_inputs(&self, x: &Tensor, observer: &mut dyn InputObserver) -> Result<()> {
        let _detached = self.detach_for_eval();
        let observer: RefCell<&mut dyn InputObserver> = RefCell::new(&mut *observer);
        self.raw_logits_observed(x, Some(&observer), PassExtras::default()).map(drop)
    }

    /// [`Gpt::raw_logits`], with an observer of the products' inputs and the pass's extras
    /// (adapters: as many as `x` has rows; a document mask: `x`'s shape).
    fn raw_logits_observed<'a>(&self, x: &Tensor, observer: Option<Observer<'a>>, extras: PassExtras<'_>) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (b, t) = x.dims2()?;
        // Under `model.document_attention` a pass without a mask of its own gets its rows' (on
        // a GPU the ids come to the host for it: 4 bytes a token).
        let own_mask;
        let extras = if cfg.document_attention && extras.docs.is_none() {
            let ids: Vec<u32> = x.flatten_all()?.to_vec1()?;
            own_mask = DocumentMask::at_token(&ids, t, cfg.doc_rule())?;
            PassExtras { docs: Some(&own_mask), ..extras }
        } else {
            extras
        };
        let emb = self.p("tok_emb.weight");
        let mut e = embedding(&emb, &x.flatten_all()?)?;
        if cfg.bigram_vocab_size > 0 {
            e = (e + self.bigram(x)?)?;
        }
        if cfg.smear_gate {
            e = smear_gate(&e, x, &self.p("smear_gate.weight"), &self.p("smear_lambda"), cfg.bos_id)?;
        }
        let mut h = rms_norm(&e)?;
        if let Some(l) = extras.lora
            && (l.rows() != b || l.slots() != cfg.layer_sequence(self.looping).len())
        {
            candle_core::bail!(
                "LoRA adapters for {} rows and {} slots, a pass of {b} rows and {} slots",
                l.rows(),
                l.slots(),
                cfg.layer_sequence(self.looping).len()
            );
        }
        if let Some(m) = extras.docs
            && (m.rows(), m.t()) != (b, t)
        {
            candle_core::bail!("a document mask of {} rows of {} for a pass of {b} rows of {t}", m.rows(), m.t());
        }
        let f = Formulation::choose(&h, self.dtype, self.matmul_dtype, self.attention, (t, cfg.head_dim()))
            .observed(observer)
            .with_extras(extras);
        let x0 = h.clone();
        let (cos, sin) = rope_tables(t, cfg.rotary_dims(), cfg.rope_base_for(t), self.dtype, &self.device)?;
        // Under mixed precision on the GPU path q and k are bf16, and so are the rope tables (the
        // script casts them to q's dtype): cast once per forward pass, not per layer.
        let (cos, sin) = match f.mixed() {
            Some(low) => (cos.to_dtype(low)?, sin.to_dtype(low)?),
            None => (cos, sin),
        };
        // The U-Net over the layer sequence (looped or not): encoder outputs are pushed, and
        // decoder position j pops one while j < skip_count.
        let (encoder, decoder) = cfg.encoder_decoder(self.looping);
        let skip_count = cfg.skip_count();
        let mut skips = Vec::with_capacity(encoder.len());
        for (slot, &i) in encoder.iter().enumerate() {
            h = self.block(&f, (i, slot), &h, &x0, b, &cos, &sin)?;
            skips.push(h.clone());
        }
        let skip_w = self.p("skip_weights");
        let gates = cfg.skip_gates.then(|| self.p("skip_gates"));
        let skip = |h: &Tensor, s: &Tensor, j: usize| -> Result<Tensor> {
            match &gates {
                Some(z) => gated_skip(h, s, &skip_w.get(j)?, &z.get(j)?),
                None => scale_add(h, s, &skip_w.get(j)?),
            }
        };
        // The two-lane decoder's lanes, once a block at or past `parallel_decoder_start` has
        // run (both start as the stream; skips enter lane 0).
        let mut lanes: Option<(Tensor, Tensor)> = None;
        for (j, &i) in decoder.iter().enumerate() {
            if cfg.two_lane(i) {
                let (mut l0, l1) = lanes.take().unwrap_or_else(|| (h.clone(), h.clone()));
                if j < skip_count
                    && let Some(s) = skips.pop()
                {
                    l0 = skip(&l0, &s, j)?;
                }
                lanes = Some(self.lane_block(&f, (i, encoder.len() + j), (&l0, &l1), &x0, b, &cos, &sin)?);
                continue;
            }
            if j < skip_count
                && let Some(s) = skips.pop()
            {
                h = skip(&h, &s, j)?;
            }
            h = self.block(&f, (i, encoder.len() + j), &h, &x0, b, &cos, &sin)?;
        }
        if let Some((l0, l1)) = lanes {
            h = match cfg.parallel_final_lane {
                FinalLane::Mean => ((l0 + l1)? * 0.5)?,
                FinalLane::Attn => l0,
                FinalLane::Mlp => l1,
            };
        }
        let (head, head_name) = if cfg.tie_embeddings { (emb, "tok_emb.weight") } else { (self.p("lm_head.weight"), "lm_head.weight") };
        let n = f.norm_in(&h)?;
        f.observe(&n, || vec![head_name.to_string()])?;
        f.adapt_head(&n, f.linear(&n, &head)?)
    }

    /// Per-position cross-entropy `(B*T,)` of targets `y` `(B, T)` given inputs `x`.
    pub fn token_losses(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.token_losses_with(x, y, PassExtras::default())
    }

    /// [`Gpt::token_losses`] with per-document adapters and/or a document mask.
    pub fn token_losses_with(&self, x: &Tensor, y: &Tensor, extras: PassExtras<'_>) -> Result<Tensor> {
        let logits = self.raw_logits_observed(x, None, extras)?;
        // Cross-entropy in float32 at least, as the script does (`logits.float()`; float64 stays
        // float64 for checks). On the GPU path the kernel reads bf16 logits as they are.
        let logits = match logits.dtype() {
            DType::F64 | DType::F32 => logits,
            DType::BF16 if super::gpu_path(&logits) => logits,
            _ => cast(&logits, DType::F32)?,
        };
        softcap_cross_entropy(&logits, &y.flatten_all()?, self.cfg.logit_softcap)
    }

    /// Mean cross-entropy over all positions (what training minimises).
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.token_losses(x, y)?.mean_all()
    }
}

impl Gpt {
    /// BigramHash's rows for ids `x` `(B, T)`: `scale (W_b[b] P^T)` (no `P` when the table is
    /// as wide as the model), `b` each position's bucket ([`embedding::bigram_ids`], computed
    /// on the host: the ids come to the host for it, 4 bytes a token, as for a document mask).
    fn bigram(&self, x: &Tensor) -> Result<Tensor> {
        let cfg = &self.cfg;
        let t = x.dims2()?.1;
        let buckets = embedding::bigram_ids(&x.flatten_all()?.to_vec1::<u32>()?, t, cfg.bigram_vocab_size);
        let n = buckets.len();
        let rows = embedding(&self.p("bigram.embed.weight"), &Tensor::from_vec(buckets, n, x.device())?)?;
        let rows = if cfg.bigram_dim == cfg.model_dim {
            rows
        } else {
            let w = self.p("bigram.proj.weight");
            match self.matmul_dtype {
                Some(md) => cast(&cast(&rows, md)?.matmul(&cast(&w, md)?.t()?)?, self.dtype)?,
                None => rows.matmul(&w.t()?)?,
            }
        };
        rows.broadcast_mul(&self.p("bigram.scale"))
    }
}
