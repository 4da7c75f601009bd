//! The GPT's forward pass and its hand-written backward pass over the arena ([`Layout`]), as
//! one schedule of [`Backend`] ops: the model of [`crate::model`] (the baseline's, the 04-09
//! record's and the 04-27 record's elements: SmearGate, document-masked attention, the sparse
//! attention gate, the two-lane decoder), op for op, written out in the order it runs. The math of each step is
//! beside it; `N` rows of the micro-batch, `D` model width, `V` vocabulary, `s` the block's
//! `ln_scale` factor (1 without it).
//!
//! ```text
//! forward                                   backward (reverse order, G = dL/d stream)
//! x0 = rms(smear(E[x]))                     dE[x] += smear'(rms'(dx0)) (smear: model.smear_gate)
//! per position p of the layer sequence, physical block i:
//!   h  = skip(h, enc[j]) (decoder pops)      G += dskip[e] (encoder outputs popped later)
//!   u  = h mix0 + x0 mix1                   G = G mix0, dx0 += G mix1, dmix += colsum
//!   n1 = s rms(u)
//!   qkv = n1 Wqkv^T                          dWqkv += dqkv^T n1, dn1 = dqkv Wqkv
//!   q = rope(rms_h(qkv_q)) gain, k = rope(rms_h(qkv_k)), v = qkv_v
//!   a = attn(q, k, v); y = xsa(a, v)         attention recomputes its probabilities (and
//!                                            stays within documents: model.document_attention)
//!   y = sigmoid(s W n1[:, :Wg]) y per head   dW += dz^T n1[:, :Wg], dn1[:, :Wg] += dz W
//!                                            (model.attn_gate)
//!   ao = y Wo^T                              dWo += dao^T y
//!   sequential: u2 = u + attn_scale ao; n2 = s rms(u2); out = u2 + mlp_scale mlp(n2)
//!   parallel:   out = u + attn_scale ao + mlp_scale mlp(n1)
//!   two-lane (model.parallel_decoder_start, lanes l0 l1; both start as the stream, skips
//!   enter l0): u = l0 mix0 + x0 mix1; a = attn_scale attn(s rms(u)); m = mlp_scale mlp(s rms(l1));
//!   l_k' = r[k] l_k + p[0, k] a + p[1, k] m; the head reads the lanes' mean (or one lane)
//! mlp(x) = act(x Wfc^T) Wp^T, act = leaky_relu(., slope)^2 (recomputed in the backward pass)
//! logits = rms(h) E^T (or the untied head); loss = mean softcap-CE, fused with its gradient
//! ```
//!
//! Weight gradients are GEMMs with `beta = 1`: they accumulate in place over the positions
//! that share a block (depth recurrence) and over the step's micro-batches.

use super::backend::{Activation, AttnShape, Backend, Buf, HeadShape, LaneBufs, Mat};
use super::layout::{Layout, PositionBufs, Sizing};
pub use super::lora::LoraOn;
use crate::engine::backend::BackendExt;
use crate::engine::op;
use crate::model::lora::Site;
use crate::model::ops::DocRule;
use crate::model::{FinalLane, MlpActivation, ModelConfig};

/// The model's shape and switches as the schedule reads them, and the layout it runs on.
pub struct Schedule {
    cfg: ModelConfig,
    /// The arena's layout.
    pub layout: Layout,
    /// The norms' epsilon (the arena dtype's machine epsilon, as `F.rms_norm(eps=None)`).
    eps: f64,
    /// Attention kept inside the documents this BOS starts, whatever the model's own rule
    /// (`model.document_attention`): phased TTT's global SGD masks its rows at each document
    /// ([`Schedule::set_documents`]); `None`: the model's rule.
    documents: Option<u32>,
    /// The passes go through the per-document LoRA adapters of the arena, and the backward pass
    /// trains them alone ([`Schedule::set_lora`]; `None`: no adapters, the base trained as
    /// usual).
    pub(super) lora: Option<LoraOn>,
}

/// The input of one matrix product after a forward pass ([`Schedule::product_inputs`]).
#[derive(Clone, Debug)]
pub struct ProductInput {
    /// The state-dict names of the weights that read it.
    pub weights: Vec<String>,
    /// Where it is, `(N, cols)` row-major (the MLP's pre-activation when `act`).
    pub x: Buf,
    /// Its width.
    pub cols: usize,
    /// The product reads `act(x)`, not `x` ([`Schedule::activate`]).
    pub act: bool,
}

/// One position of the layer sequence: its physical block, the skip it pops (decoder index
/// `j`, encoder position `e`) and whether its output is pushed as a skip that is popped later.
struct Step {
    layer: usize,
    pops: Option<(usize, usize)>,
    pushed: Option<usize>,
    /// A block of the two-lane decoder (`model.parallel_decoder_start`).
    lane: bool,
}

/// The parameter names of physical block `i`.
struct BlockNames(usize);

impl BlockNames {
    fn name(&self, leaf: &str) -> String {
        format!("blocks.{}.{leaf}", self.0)
    }
}

impl Schedule {
    /// The schedule of `cfg` on micro-batches of `rows x t` tokens, the norms with `eps`.
    #[cfg(feature = "tools")]
    pub fn new(cfg: &ModelConfig, rows: usize, t: usize, eps: f64) -> Schedule {
        Schedule::sized(cfg, Sizing::fixed(rows, t), eps)
    }

    /// The schedule of `cfg` on an arena sized by `sizing` ([`Layout::sized`]).
    pub fn sized(cfg: &ModelConfig, sizing: Sizing, eps: f64) -> Schedule {
        Schedule { cfg: cfg.clone(), layout: Layout::sized(cfg, sizing), eps, documents: None, lora: None }
    }

    /// From now on the passes go through the arena's LoRA adapters ([`LoraOn`]: row `b` through
    /// document `first_doc + b`'s, outputs scaled by `scale`) and the backward pass adds no gradient to the base's matrices and embedding (`Some`;
    /// the small per-channel parameters' gradients are still written: the caller zeroes the
    /// gradients after the adapters' step), or run the base model alone (`None`). Panics
    /// when the arena holds no adapters.
    pub fn set_lora(&mut self, on: Option<LoraOn>) {
        if let Some(on) = on {
            let l = self.layout.lora.as_ref().expect("LoRA passes on an arena without adapters");
            assert!(
                on.first_doc + self.layout.rows <= l.shape.docs,
                "rows of documents {}.. past the arena's {}",
                on.first_doc,
                l.shape.docs
            );
        }
        self.lora = on;
    }

    /// Whether the base's weights are frozen (a LoRA pass).
    fn frozen(&self) -> bool {
        self.lora.is_some()
    }

    /// From now on attention stays inside the documents that `bos` starts (`Some`), as the
    /// candle model's explicit document mask does, or follows the model's own rule (`None`).
    pub fn set_documents(&mut self, bos: Option<u32>) {
        self.documents = bos;
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn n(&self) -> usize {
        self.layout.rows * self.layout.t
    }

    fn attn_shape(&self) -> AttnShape {
        let c = &self.cfg;
        let docs = self.documents.map(|bos| DocRule { bos, ..c.doc_rule() }).or(c.document_attention.then(|| c.doc_rule()));
        AttnShape { batch: self.layout.rows, t: self.layout.t, heads: c.num_heads, kv_heads: c.num_kv_heads, d: c.head_dim(), docs }
    }

    fn head_shape(&self, heads: usize) -> HeadShape {
        HeadShape { rows: self.n(), heads, d: self.cfg.head_dim(), rot: self.cfg.rotary_dims(), t: self.layout.t }
    }

    fn activation(&self) -> Activation {
        match self.cfg.mlp_activation {
            MlpActivation::Relu2 => Activation { slope: 0.0 },
            MlpActivation::LeakyRelu2 => Activation { slope: self.cfg.leaky_relu_slope },
        }
    }

    /// A parameter's value as a stored matrix.
    fn w(&self, name: &str) -> Mat {
        let s = self.layout.slot(name);
        s.value.mat(s.shape[0], s.shape[1])
    }

    /// A parameter's gradient as a stored matrix.
    fn dw(&self, name: &str) -> Mat {
        let s = self.layout.slot(name);
        s.grad.mat(s.shape[0], s.shape[1])
    }

    /// Block `i`'s fused `(D + 2 KVD, D)` q, k, v weights (and gradient), contiguous by layout.
    fn wqkv(&self, i: usize, grad: bool) -> Mat {
        let b = BlockNames(i);
        let (q, v) = (self.layout.slot(&b.name("attn.c_q.weight")), self.layout.slot(&b.name("attn.c_v.weight")));
        let (start, end) = if grad { (q.grad.off, v.grad.end()) } else { (q.value.off, v.value.end()) };
        let d = self.cfg.model_dim;
        Buf { off: start, len: end - start }.mat((end - start) / d, d)
    }

    fn value(&self, name: &str) -> Buf {
        self.layout.slot(name).value
    }

    fn grad(&self, name: &str) -> Buf {
        self.layout.slot(name).grad
    }

    /// The head's weights: the embedding when tied.
    fn head_name(&self) -> &'static str {
        if self.cfg.tie_embeddings { "tok_emb.weight" } else { "lm_head.weight" }
    }

    /// The q, k, v column views of a `(N, D + 2 KVD)` matrix.
    fn qkv_views(&self, m: Buf) -> (Mat, Mat, Mat) {
        let (d, kvd) = (self.cfg.model_dim, self.cfg.kv_dim());
        let all = m.mat(self.n(), d + 2 * kvd);
        (all.cols(0, d), all.cols(d, kvd), all.cols(d + kvd, kvd))
    }

    /// The layer sequence as the schedule runs it (see [`Step`]).
    fn plan(&self, looping: bool) -> Vec<Step> {
        let (enc, dec) = self.cfg.encoder_decoder(looping);
        let skips = self.cfg.skip_count();
        // Decoder j pops encoder output enc.len() - 1 - j while j < skip_count (a stack).
        let pop = |j: usize| (j < skips && j < enc.len()).then(|| (j, enc.len() - 1 - j));
        let mut out: Vec<Step> = enc.iter().map(|&layer| Step { layer, pops: None, pushed: None, lane: false }).collect();
        out.extend(dec.iter().enumerate().map(|(j, &layer)| Step { layer, pops: pop(j), pushed: None, lane: self.cfg.two_lane(layer) }));
        for j in 0..dec.len() {
            if let Some((_, e)) = pop(j) {
                out[e].pushed = Some(e);
            }
        }
        out
    }

    /// The input of every matrix product of the forward pass just run, in the pass's order (each
    /// repeat of a looped block again), with the state-dict names of the weights that read it:
    /// what GPTQ's calibration sums `X^T X` of (the candle model's observer,
    /// [`crate::model::observe`], hands it the same inputs). All but the MLP's second product
    /// read a buffer the pass keeps; that one reads `act(pre)`, which [`Schedule::activate`]
    /// recomputes.
    pub fn product_inputs(&self, looping: bool) -> Vec<ProductInput> {
        let (l, d) = (&self.layout, self.cfg.model_dim);
        let mut out = Vec::new();
        for (pos, step) in self.plan(looping).iter().enumerate() {
            let (p, i, b) = (&l.positions[pos], step.layer, BlockNames(step.layer));
            let qkv = ["c_q", "c_k", "c_v"].map(|w| b.name(&format!("attn.{w}.weight"))).to_vec();
            out.push(ProductInput { weights: qkv, x: p.n1, cols: d, act: false });
            let y = match (self.cfg.attn_gate, self.cfg.xsa(i)) {
                (true, _) => p.yg,
                (false, true) => p.y,
                (false, false) => p.att,
            };
            out.push(ProductInput {
                weights: vec![b.name("attn.proj.weight")],
                x: y,
                cols: self.cfg.num_heads * self.cfg.head_dim(),
                act: false,
            });
            let mlp_in = if self.cfg.parallel(i) && !step.lane { p.n1 } else { p.n2 };
            out.push(ProductInput { weights: vec![b.name("mlp.fc.weight")], x: mlp_in, cols: d, act: false });
            out.push(ProductInput { weights: vec![b.name("mlp.proj.weight")], x: p.pre, cols: self.cfg.mlp_mult * d, act: true });
        }
        out.push(ProductInput { weights: vec![self.head_name().to_string()], x: l.nf, cols: d, act: false });
        out
    }

    /// `out = act(pre)`, the MLP's activation (a [`ProductInput`] with `act`); returns `out`,
    /// the scratch buffer it writes.
    pub fn activate(&self, be: &mut dyn Backend, pre: Buf) -> Buf {
        let out = self.layout.scratch.act;
        be.op(op::ActFwd { pre, out, a: self.activation() });
        out
    }

    /// The forward pass of the micro-batch whose tokens the backend holds, through the loss
    /// and its gradient (left in the logits, scaled by `grad_scale`); the sum of the per-token
    /// losses is added to the loss scalar (`layout.stats`, read once per step).
    pub fn forward(&self, be: &mut dyn Backend, looping: bool, grad_scale: f64) {
        let l = &self.layout;
        let (n, d, eps) = (self.n(), self.cfg.model_dim, self.eps);
        // The weights changed since the last pass (an optimizer step, a load).
        be.refresh_weights(l.params);
        // x0 = rms(E[x]).
        be.op(op::EmbeddingFwd { table: self.value("tok_emb.weight"), out: l.emb, dim: d, ids: op::Ids::Tokens });
        if self.cfg.bigram_vocab_size > 0 {
            self.bigram_fwd(be);
        }
        // SmearGate (x0 = rms(smear(E[x]))): each row takes in a gated share of the one before.
        if self.cfg.smear_gate {
            let (w, lambda) = (self.value("smear_gate.weight"), self.value("smear_lambda"));
            be.op(op::SmearFwd { e: l.emb, w, lambda, out: l.smeared, cols: d, t: l.t, bos: self.cfg.bos_id });
        }
        be.op(op::RmsNormFwd { x: self.embedded(), out: l.x0, rstd: l.rstd0, cols: d, scale: 1.0, eps });
        let plan = self.plan(looping);
        let mut h = l.x0;
        // Lane 1 of the two-lane decoder, once its first block has run.
        let mut h1: Option<Buf> = None;
        for (pos, step) in plan.iter().enumerate() {
            let p = &l.positions[pos];
            // Both lanes start as the stream; the skip enters lane 0.
            let lane1 = h1.unwrap_or(h);
            if let Some((j, e)) = step.pops {
                // h' = h + w s, or k + sigmoid(z) (h - k) with k = w s.
                let (w, z) = self.skip_rows(j);
                be.op(op::SkipFwd { h, s: l.positions[e].out, w, z, out: p.skipped });
                h = p.skipped;
            }
            if step.lane {
                self.lane_block_fwd(be, (step.layer, pos), p, [h, lane1]);
                h1 = Some(p.out1);
            } else {
                self.block_fwd(be, (step.layer, pos), p, h);
            }
            h = p.out;
        }
        if let Some(h1) = h1
            && self.cfg.parallel_final_lane == FinalLane::Mean
        {
            // The lanes' mean: (l0 + l1) / 2.
            be.op(op::CopyBuf { dst: l.lanes_final, src: h });
            be.op(op::Axpby { a: 0.5, x: h1, b: 0.5, y: l.lanes_final });
        }
        let h = self.final_stream(&plan);
        // logits = s rms(h) W^T; the loss and its gradient in one pass.
        be.op(op::RmsNormFwd { x: h, out: l.nf, rstd: l.rstdf, cols: d, scale: 1.0, eps });
        let v = self.cfg.vocab_size;
        be.op(op::Gemm { c: l.logits.mat(n, v), a: l.nf.mat(n, d), b: self.w(self.head_name()).t(), alpha: 1.0, beta: 0.0 });
        if let Some(ad) = self.head_adapter() {
            self.lora_fwd(be, ad, l.nf, l.logits.mat(n, v));
        }
        be.op(op::SoftcapCe { logits: l.logits, losses: l.losses, vocab: v, cap: self.cfg.logit_softcap, grad_scale });
        be.op(op::SumInto { src: l.losses, dst: l.loss_sum() });
    }

    /// BigramHash's buckets of the micro-batch's ids.
    fn bigram_ids(&self) -> op::Ids {
        op::Ids::Bigram { buckets: self.cfg.bigram_vocab_size, t: self.layout.t }
    }

    /// BigramHash: `emb += s R P^T`, `R` the table's rows at the buckets (`emb += s R` when the
    /// table is as wide as the model: no `P`).
    fn bigram_fwd(&self, be: &mut dyn Backend) {
        let (l, n, d, db) = (&self.layout, self.n(), self.cfg.model_dim, self.cfg.bigram_dim);
        be.op(op::EmbeddingFwd { table: self.value("bigram.embed.weight"), out: l.bigram, dim: db, ids: self.bigram_ids() });
        let rows = if db == d {
            l.bigram
        } else {
            let p = self.w("bigram.proj.weight");
            be.op(op::Gemm { c: l.bigram_proj.mat(n, d), a: l.bigram.mat(n, db), b: p.t(), alpha: 1.0, beta: 0.0 });
            l.bigram_proj
        };
        be.op(op::ScaleAddFwd { base: l.emb, x: rows, s: self.value("bigram.scale"), out: l.emb });
    }

    /// Backward of [`Schedule::bigram_fwd`] from the embedding rows' gradient `demb`:
    /// `dZ = s demb`, `ds += sum(demb Z)` (`Z = R P^T`), `dP += dZ^T R`, `dR = dZ P`, and the
    /// table's rows' gradient added at the buckets.
    fn bigram_bwd(&self, be: &mut dyn Backend, demb: Buf) {
        let (l, sc, n, d, db) = (&self.layout, &self.layout.scratch, self.n(), self.cfg.model_dim, self.cfg.bigram_dim);
        let (rows, drows) = if db == d { (l.bigram, sc.dbigram) } else { (l.bigram_proj, sc.dbigram_proj) };
        let (s, ds) = (self.value("bigram.scale"), self.grad("bigram.scale"));
        be.op(op::ScaleAddBwd { dy: demb, x: rows, s, dx: drows, ds });
        if db != d {
            let (p, dp) = (self.w("bigram.proj.weight"), self.dw("bigram.proj.weight"));
            be.op(op::Gemm { c: dp, a: drows.mat(n, d).t(), b: l.bigram.mat(n, db), alpha: 1.0, beta: 1.0 });
            be.op(op::Gemm { c: sc.dbigram.mat(n, db), a: drows.mat(n, d), b: p, alpha: 1.0, beta: 0.0 });
        }
        if let Some(tail) = l.capacity_tail(sc.dbigram, db) {
            be.op(op::Fill { dst: tail, value: 0.0 });
        }
        be.op(op::EmbeddingBwd { dout: sc.dbigram, dtable: self.grad("bigram.embed.weight"), dim: db, ids: self.bigram_ids() });
    }

    /// The embedding rows `x0` norms: after SmearGate when it is on.
    fn embedded(&self) -> Buf {
        if self.cfg.smear_gate { self.layout.smeared } else { self.layout.emb }
    }

    /// Block `i`'s sparse attention gate: its weights `(H, W)` and their gradient as stored
    /// matrices, and the gate input's `(N, W)` view of `n1`.
    fn attn_gate_parts(&self, i: usize, n1: Buf) -> (Mat, Mat, Mat) {
        let name = BlockNames(i).name("attn.attn_gate_w");
        (self.w(&name), self.dw(&name), n1.mat(self.n(), self.cfg.model_dim).cols(0, self.cfg.attn_gate_window))
    }

    /// Skip row `j`: the weights and, with gates, the gate logits.
    fn skip_rows(&self, j: usize) -> (Buf, Option<Buf>) {
        let d = self.cfg.model_dim;
        let w = self.value("skip_weights").sub(j * d, d);
        let z = self.cfg.skip_gates.then(|| self.value("skip_gates").sub(j * d, d));
        (w, z)
    }

    /// Block `i` at position `pos`: reads the stream `h`, writes `p.out`.
    fn block_fwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), p: &PositionBufs, h: Buf) {
        let (l, b, eps) = (&self.layout, BlockNames(i), self.eps);
        let s = self.cfg.ln_scale_of(i).unwrap_or(1.0);
        // u = h mix0 + x0 mix1, n1 = s rms(u): one pass.
        let mix = self.value(&b.name("resid_mix"));
        be.op(op::MixNormFwd { h, x0: l.x0, mix, kind: op::MixKind::Resid, u: p.u, out: p.n1, rstd: p.rstd1, scale: s, eps });
        self.attention_fwd(be, (i, pos), p);
        if self.cfg.parallel(i) {
            // out = u + attn_scale ao + mlp_scale mlp(n1).
            self.mlp_fwd(be, (i, pos), p.n1, p.pre, p.mo);
            be.op(op::ScaleAddFwd { base: p.u, x: p.ao, s: self.value(&b.name("attn_scale")), out: p.out });
            be.op(op::ScaleAddFwd { base: p.out, x: p.mo, s: self.value(&b.name("mlp_scale")), out: p.out });
        } else {
            // u2 = u + attn_scale ao; out = u2 + mlp_scale mlp(s rms(u2)).
            let sa = self.value(&b.name("attn_scale"));
            be.op(op::MixNormFwd { h: p.u, x0: p.ao, mix: sa, kind: op::MixKind::Scale, u: p.u2, out: p.n2, rstd: p.rstd2, scale: s, eps });
            self.mlp_fwd(be, (i, pos), p.n2, p.pre, p.mo);
            be.op(op::ScaleAddFwd { base: p.u2, x: p.mo, s: self.value(&b.name("mlp_scale")), out: p.out });
        }
    }

    /// The stream the head reads: the last position's output, or on the two-lane decoder the
    /// lane `model.parallel_final_lane` names (the lanes' mean in its own buffer).
    fn final_stream(&self, plan: &[Step]) -> Buf {
        let last = &self.layout.positions[plan.len() - 1];
        if !plan.last().is_some_and(|s| s.lane) {
            return last.out;
        }
        match self.cfg.parallel_final_lane {
            FinalLane::Mean => self.layout.lanes_final,
            FinalLane::Attn => last.out,
            FinalLane::Mlp => last.out1,
        }
    }

    /// Block `i`'s two-lane mix parameters (values, or gradients with `grad`).
    fn lane_bufs(&self, i: usize, grad: bool) -> LaneBufs {
        let b = BlockNames(i);
        let at = |name: &str| if grad { self.grad(name) } else { self.value(name) };
        LaneBufs {
            sa: at(&b.name("attn_scale")),
            sm: at(&b.name("mlp_scale")),
            r: at("parallel_resid_lambdas").sub(2 * i, 2),
            p: at("parallel_post_lambdas").sub(4 * i, 4),
        }
    }

    /// Block `i` on the two-lane decoder's lanes `l` (attention reads `u = l0 mix0 + x0 mix1`,
    /// the MLP `l1`): writes lane 0's output to `p.out`, lane 1's to `p.out1`.
    fn lane_block_fwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), p: &PositionBufs, l: [Buf; 2]) {
        let (lay, b, d, eps) = (&self.layout, BlockNames(i), self.cfg.model_dim, self.eps);
        let s = self.cfg.ln_scale_of(i).unwrap_or(1.0);
        let mix = self.value(&b.name("resid_mix"));
        be.op(op::MixNormFwd { h: l[0], x0: lay.x0, mix, kind: op::MixKind::Resid, u: p.u, out: p.n1, rstd: p.rstd1, scale: s, eps });
        self.attention_fwd(be, (i, pos), p);
        be.op(op::RmsNormFwd { x: l[1], out: p.n2, rstd: p.rstd2, cols: d, scale: s, eps });
        self.mlp_fwd(be, (i, pos), p.n2, p.pre, p.mo);
        be.op(op::LanesFwd { l, ao: p.ao, mo: p.mo, w: self.lane_bufs(i, false), out: [p.out, p.out1] });
    }

    /// Backward of [`Schedule::lane_block_fwd`] on inputs `l` from the lanes' gradients `g`
    /// (used up) into `g_in`, the gradients of `l`.
    fn lane_block_bwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), p: &PositionBufs, l: [Buf; 2], g: [Buf; 2], g_in: [Buf; 2]) {
        let (lay, sc, b, d) = (&self.layout, self.layout.scratch, BlockNames(i), self.cfg.model_dim);
        let s = self.cfg.ln_scale_of(i).unwrap_or(1.0);
        // dl_k = r[k] G_k; dao, dmo; the scales' and lambdas' gradients.
        be.op(op::LanesBwd {
            g,
            l,
            ao: p.ao,
            mo: p.mo,
            w: self.lane_bufs(i, false),
            dl: g_in,
            dao: sc.dao,
            dmo: sc.dmo,
            dw: self.lane_bufs(i, true),
        });
        // m = mlp(s rms(l1)): into lane 1's gradient.
        self.mlp_bwd(be, (i, pos), p.n2, p.pre, sc.dmo, false);
        be.op(op::RmsNormBwd { x: l[1], rstd: p.rstd2, dy: sc.dn, dx: g_in[1], cols: d, scale: s, accumulate: true });
        // a = attention(s rms(u)), u = l0 mix0 + x0 mix1: du, then dl0 += du mix0 (by way of
        // dy, free once attention's backward is done).
        self.attention_bwd(be, (i, pos), p, sc.dao, false);
        let (mix, dmix) = (self.value(&b.name("resid_mix")), self.grad(&b.name("resid_mix")));
        let (x, rstd, dn) = (p.u, p.rstd1, sc.dn);
        be.op(op::NormMixBwd {
            x,
            rstd,
            dn,
            du: sc.datt,
            scale: s,
            accumulate: false,
            h: l[0],
            x0: lay.x0,
            mix,
            dh: sc.dy,
            dx0: sc.dx0,
            dmix,
        });
        be.op(op::Axpby { a: 1.0, x: sc.dy, b: 1.0, y: g_in[0] });
    }

    /// Attention of block `i` at position `pos` on `p.n1` into `p.ao`.
    fn attention_fwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), p: &PositionBufs) {
        let (l, b, n, d) = (&self.layout, BlockNames(i), self.n(), self.cfg.model_dim);
        let kvd = self.cfg.kv_dim();
        // qkv = n1 [Wq; Wk; Wv]^T: one GEMM for the three projections.
        be.op(op::Gemm { c: p.qkv.mat(n, d + 2 * kvd), a: p.n1.mat(n, d), b: self.wqkv(i, false).t(), alpha: 1.0, beta: 0.0 });
        let (xq, xk, xv) = self.qkv_views(p.qkv);
        // The adapters add to the projections before the q/k norm.
        for (site, y) in [(Site::Q, xq), (Site::K, xk), (Site::V, xv)] {
            if let Some(ad) = self.adapter(pos, site) {
                self.lora_fwd(be, ad, p.n1, y);
            }
        }
        let (heads, kv_heads) = (self.cfg.num_heads, self.cfg.num_kv_heads);
        let gain = self.value(&b.name("attn.q_gain"));
        be.op(op::QkNormRopeFwd {
            x: xq,
            out: p.q,
            rstd: p.rq,
            gain: Some(gain),
            cos: l.cos,
            sin: l.sin,
            s: self.head_shape(heads),
            eps: self.eps,
        });
        be.op(op::QkNormRopeFwd {
            x: xk,
            out: p.k,
            rstd: p.rk,
            gain: None,
            cos: l.cos,
            sin: l.sin,
            s: self.head_shape(kv_heads),
            eps: self.eps,
        });
        let shape = self.attn_shape();
        be.op(op::AttentionFwd { q: p.q.mat(n, d), k: p.k.mat(n, kvd), v: xv, out: p.att, s: shape });
        let y = if self.cfg.xsa(i) {
            be.op(op::XsaFwd { y: p.att, v: xv, out: p.y, s: shape });
            p.y
        } else {
            p.att
        };
        // The sparse gate: head h of row n times sigmoid(scale w[h] . n1[n, :W]).
        let y = if self.cfg.attn_gate {
            let (w, _, x) = self.attn_gate_parts(i, p.n1);
            be.op(op::AttnGateFwd { y, x, w: w.span(), out: p.yg, heads, scale: self.cfg.attn_gate_scale });
            p.yg
        } else {
            y
        };
        be.op(op::Gemm { c: p.ao.mat(n, d), a: y.mat(n, d), b: self.w(&b.name("attn.proj.weight")).t(), alpha: 1.0, beta: 0.0 });
        if let Some(ad) = self.adapter(pos, Site::O) {
            self.lora_fwd(be, ad, p.n1, p.ao.mat(n, d));
        }
    }

    /// The MLP of block `i`: `pre = x Wfc^T`, `out = act(pre) Wp^T`.
    fn mlp_fwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), x: Buf, pre: Buf, out: Buf) {
        let (b, n, d) = (BlockNames(i), self.n(), self.cfg.model_dim);
        let f = self.cfg.mlp_mult * d;
        let act = self.layout.scratch.act;
        be.op(op::Gemm { c: pre.mat(n, f), a: x.mat(n, d), b: self.w(&b.name("mlp.fc.weight")).t(), alpha: 1.0, beta: 0.0 });
        be.op(op::ActFwd { pre, out: act, a: self.activation() });
        be.op(op::Gemm { c: out.mat(n, d), a: act.mat(n, f), b: self.w(&b.name("mlp.proj.weight")).t(), alpha: 1.0, beta: 0.0 });
        if let Some(ad) = self.adapter(pos, Site::Mlp) {
            self.lora_fwd(be, ad, x, out.mat(n, d));
        }
    }

    /// The backward pass of the micro-batch [`Schedule::forward`] just ran, adding every
    /// parameter's gradient into the gradient region.
    pub fn backward(&self, be: &mut dyn Backend, looping: bool) {
        self.backward_with(be, looping, &mut |_, _| {});
    }

    /// [`Schedule::backward`], calling `at(be, event)` at each of its [`Schedule::grad_events`]
    /// points, in order: `0` once the head's gradient is in, `k` (1 to `P`) once position
    /// `P - k` of the `P`-position layer sequence is done (its skip included), `P + 1` at the
    /// end. The gradients [`Schedule::grad_events`] says are final at an event may be read (and
    /// replaced) from then on: no later op of the pass touches them.
    pub fn backward_with(&self, be: &mut dyn Backend, looping: bool, at: &mut dyn FnMut(&mut dyn Backend, usize)) {
        let (l, sc) = (&self.layout, self.layout.scratch);
        let (n, d, v) = (self.n(), self.cfg.model_dim, self.cfg.vocab_size);
        let plan = self.plan(looping);
        // The head: dW += dlogits^T nf; dnf = dlogits W; G = rms'(dnf).
        let head = self.head_name();
        if !self.frozen() {
            be.op(op::Gemm { c: self.dw(head), a: l.logits.mat(n, v).t(), b: l.nf.mat(n, d), alpha: 1.0, beta: 1.0 });
        }
        be.op(op::Gemm { c: sc.dn.mat(n, d), a: l.logits.mat(n, v), b: self.w(head), alpha: 1.0, beta: 0.0 });
        if let Some(ad) = self.head_adapter() {
            self.lora_bwd(be, ad, l.nf, l.logits.mat(n, v), sc.dn);
        }
        be.op(op::RmsNormBwd { x: self.final_stream(&plan), rstd: l.rstdf, dy: sc.dn, dx: sc.g, cols: d, scale: 1.0, accumulate: false });
        be.op(op::Fill { dst: sc.dx0, value: 0.0 });
        // On the two-lane decoder, G splits between the lanes as the final stream took them.
        let (mut g, mut g2) = (sc.g, sc.g2);
        let (mut gl, mut gl2) = (sc.gl, sc.gl2);
        if plan.last().is_some_and(|s| s.lane) {
            match self.cfg.parallel_final_lane {
                FinalLane::Mean => {
                    be.op(op::CopyBuf { dst: gl, src: g });
                    be.op(op::Scale { dst: gl, a: 0.5 });
                    be.op(op::Scale { dst: g, a: 0.5 });
                }
                FinalLane::Attn => be.op(op::Fill { dst: gl, value: 0.0 }),
                FinalLane::Mlp => {
                    be.op(op::CopyBuf { dst: gl, src: g });
                    be.op(op::Fill { dst: g, value: 0.0 });
                }
            }
        }
        at(be, 0);
        for (pos, step) in plan.iter().enumerate().rev() {
            let p = &l.positions[pos];
            if let Some(e) = step.pushed {
                // This output also went into a skip: its gradient from there joins G.
                be.op(op::Axpby { a: 1.0, x: l.dskip[e], b: 1.0, y: g });
            }
            let input = if step.pops.is_some() {
                p.skipped
            } else if pos == 0 {
                l.x0
            } else {
                l.positions[pos - 1].out
            };
            let before = if pos == 0 { l.x0 } else { l.positions[pos - 1].out };
            // The lanes' first block reads the stream before the skip as lane 1.
            let first_lane = step.lane && !plan[pos - 1].lane;
            if step.lane {
                let lane1 = if first_lane { before } else { l.positions[pos - 1].out1 };
                self.lane_block_bwd(be, (step.layer, pos), p, [input, lane1], [g, gl], [g2, gl2]);
                std::mem::swap(&mut gl, &mut gl2);
            } else {
                self.block_bwd(be, (step.layer, pos), p, input, g, g2);
            }
            std::mem::swap(&mut g, &mut g2);
            if let Some((j, e)) = step.pops {
                let (w, z) = self.skip_rows(j);
                let dw = self.grad("skip_weights").sub(j * d, d);
                let z = z.map(|z| (z, self.grad("skip_gates").sub(j * d, d)));
                be.op(op::SkipBwd { dy: g, h: before, s: l.positions[e].out, w, z, dh: g2, ds: l.dskip[e], dw });
                std::mem::swap(&mut g, &mut g2);
            }
            if first_lane {
                // Both lanes started as this stream.
                be.op(op::Axpby { a: 1.0, x: gl, b: 1.0, y: g });
            }
            at(be, plan.len() - pos);
        }
        if self.frozen() {
            // The embedding is frozen and nothing below it learns.
            at(be, plan.len() + 1);
            return;
        }
        // G is now the gradient of the first block's input, x0 itself.
        be.op(op::Axpby { a: 1.0, x: g, b: 1.0, y: sc.dx0 });
        be.op(op::RmsNormBwd { x: self.embedded(), rstd: l.rstd0, dy: sc.dx0, dx: sc.demb, cols: d, scale: 1.0, accumulate: false });
        let demb = if self.cfg.smear_gate {
            let (w, lambda) = (self.value("smear_gate.weight"), self.value("smear_lambda"));
            let (dw, dlambda) = (self.grad("smear_gate.weight"), self.grad("smear_lambda"));
            be.op(op::SmearBwd { dout: sc.demb, e: l.emb, w, lambda, de: sc.dsmear, dw, dlambda, cols: d, t: l.t, bos: self.cfg.bos_id });
            sc.dsmear
        } else {
            sc.demb
        };
        if let Some(tail) = l.capacity_tail(demb, d) {
            // A backend whose ids fill the arena's capacity (the GPU's CSR) reads past the
            // micro-batch there: the padded positions' gradient is zero.
            be.op(op::Fill { dst: tail, value: 0.0 });
        }
        be.op(op::EmbeddingBwd { dout: demb, dtable: self.grad("tok_emb.weight"), dim: d, ids: op::Ids::Tokens });
        if self.cfg.bigram_vocab_size > 0 {
            self.bigram_bwd(be, demb);
        }
        at(be, plan.len() + 1);
    }

    /// For each parameter (the layout's slots, in order), the event of
    /// [`Schedule::backward_with`] after which the backward pass adds nothing more to its
    /// gradient: the head's at `0` (tied to the embedding: at the end), a block's once the
    /// first position (in forward order) that runs it is done, the skip weights and gates once
    /// the first decoder position that pops a skip is done, the embedding's at the end (`P + 1`).
    /// A parameter the pass never touches (an empty skip table) is final at `0`.
    pub fn grad_events(&self, looping: bool) -> Vec<usize> {
        let plan = self.plan(looping);
        let p = plan.len();
        // Position `pos` is done at event `p - pos`: the first use in forward order is the last
        // in the backward pass.
        let first_use = |used: &dyn Fn(&Step) -> bool| plan.iter().position(used).map_or(0, |pos| p - pos);
        self.layout
            .slots
            .iter()
            .map(|s| {
                let name = s.name.as_str();
                if name == "tok_emb.weight" {
                    p + 1
                } else if name == "lm_head.weight" {
                    0
                } else if name == "skip_weights" || name == "skip_gates" {
                    first_use(&|st| st.pops.is_some())
                } else if let Some(i) = name.strip_prefix("blocks.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok())
                {
                    first_use(&|st| st.layer == i)
                } else {
                    // A parameter this schedule does not know: final only at the end.
                    p + 1
                }
            })
            .collect()
    }

    /// The number of positions of the layer sequence (`P` of [`Schedule::grad_events`]).
    #[cfg(feature = "tools")]
    pub fn positions(&self, looping: bool) -> usize {
        self.plan(looping).len()
    }

    /// Backward of block `i` at a position whose input stream was `h`: `g` holds the gradient
    /// of the block's output and is used up; `g_in` gets the gradient of its input.
    #[allow(clippy::too_many_arguments)]
    fn block_bwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), p: &PositionBufs, h: Buf, g: Buf, g_in: Buf) {
        let (l, sc, b) = (&self.layout, self.layout.scratch, BlockNames(i));
        let s = self.cfg.ln_scale_of(i).unwrap_or(1.0);
        let (attn_scale, mlp_scale) = (self.value(&b.name("attn_scale")), self.value(&b.name("mlp_scale")));
        let (d_attn_scale, d_mlp_scale) = (self.grad(&b.name("attn_scale")), self.grad(&b.name("mlp_scale")));
        if self.cfg.parallel(i) {
            // out = u + attn_scale ao + mlp_scale mo: G flows to u unchanged.
            be.op(op::ScaleAddBwd { dy: g, x: p.mo, s: mlp_scale, dx: sc.dmo, ds: d_mlp_scale });
            be.op(op::ScaleAddBwd { dy: g, x: p.ao, s: attn_scale, dx: sc.dao, ds: d_attn_scale });
            self.mlp_bwd(be, (i, pos), p.n1, p.pre, sc.dmo, false);
            self.attention_bwd(be, (i, pos), p, sc.dao, true);
        } else {
            // out = u2 + mlp_scale mo; u2 = u + attn_scale ao.
            be.op(op::ScaleAddBwd { dy: g, x: p.mo, s: mlp_scale, dx: sc.dmo, ds: d_mlp_scale });
            self.mlp_bwd(be, (i, pos), p.n2, p.pre, sc.dmo, false);
            // G += the second norm's gradient, then through the scaled add: one pass.
            let (x, rstd, dn) = (p.u2, p.rstd2, sc.dn);
            be.op(op::NormScaleBwd { x, rstd, dn, g, scale: s, a: p.ao, s: attn_scale, dx: sc.dao, ds: d_attn_scale });
            self.attention_bwd(be, (i, pos), p, sc.dao, false);
        }
        // G += the first norm's gradient; u = h mix0 + x0 mix1: one pass.
        let (mix, dmix) = (self.value(&b.name("resid_mix")), self.grad(&b.name("resid_mix")));
        let (x, rstd, dn) = (p.u, p.rstd1, sc.dn);
        be.op(op::NormMixBwd { x, rstd, dn, du: g, scale: s, accumulate: true, h, x0: l.x0, mix, dh: g_in, dx0: sc.dx0, dmix });
    }

    /// Backward of block `i`'s attention from `dao` (the gradient of `ao`) into `dn`, the
    /// gradient of its input `n1` (added to `dn` when `accumulate`).
    fn attention_bwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), p: &PositionBufs, dao: Buf, accumulate: bool) {
        let (l, sc, b, n, d) = (&self.layout, self.layout.scratch, BlockNames(i), self.n(), self.cfg.model_dim);
        let kvd = self.cfg.kv_dim();
        let (xsa, gate) = (self.cfg.xsa(i), self.cfg.attn_gate);
        let y = if xsa { p.y } else { p.att };
        let yo = if gate { p.yg } else { y };
        let wo = b.name("attn.proj.weight");
        // ao = yo Wo^T: dWo += dao^T yo; dyo = dao Wo.
        if !self.frozen() {
            be.op(op::Gemm { c: self.dw(&wo), a: dao.mat(n, d).t(), b: yo.mat(n, d), alpha: 1.0, beta: 1.0 });
        }
        be.op(op::Gemm { c: sc.dy.mat(n, d), a: dao.mat(n, d), b: self.w(&wo), alpha: 1.0, beta: 0.0 });
        let (xq, xk, xv) = self.qkv_views(p.qkv);
        let (dxq, dxk, dxv) = self.qkv_views(sc.dqkv);
        let shape = self.attn_shape();
        // Through the gate (dy and dz; the GEMMs of w's and n1's gradients follow n1's below),
        // then XSA: each writes the buffer the other of `dy`, `datt` is not.
        let mut dcur = sc.dy;
        if gate {
            let (w, _, x) = self.attn_gate_parts(i, p.n1);
            be.op(op::AttnGateBwd {
                dout: sc.dy,
                y,
                x,
                w: w.span(),
                dy: sc.datt,
                dz: sc.dz,
                heads: self.cfg.num_heads,
                scale: self.cfg.attn_gate_scale,
            });
            dcur = sc.datt;
        }
        let datt = if xsa {
            let out = if dcur == sc.dy { sc.datt } else { sc.dy };
            be.op(op::XsaBwd { dout: dcur, y: p.att, v: xv, dy: out, dv: dxv, s: shape });
            out
        } else {
            dcur
        };
        be.op(op::AttentionBwd {
            q: p.q.mat(n, d),
            k: p.k.mat(n, kvd),
            v: xv,
            out: p.att,
            dout: datt,
            dq: sc.dq.mat(n, d),
            dk: sc.dk.mat(n, kvd),
            dv: dxv,
            dv_acc: xsa,
            s: shape,
        });
        let (heads, kv_heads) = (self.cfg.num_heads, self.cfg.num_kv_heads);
        let gain = (self.value(&b.name("attn.q_gain")), self.grad(&b.name("attn.q_gain")));
        be.op(op::QkNormRopeBwd {
            x: xq,
            rstd: p.rq,
            dy: sc.dq,
            dx: dxq,
            gain: Some(gain),
            cos: l.cos,
            sin: l.sin,
            s: self.head_shape(heads),
        });
        be.op(op::QkNormRopeBwd {
            x: xk,
            rstd: p.rk,
            dy: sc.dk,
            dx: dxk,
            gain: None,
            cos: l.cos,
            sin: l.sin,
            s: self.head_shape(kv_heads),
        });
        // qkv = n1 Wqkv^T: dWqkv += dqkv^T n1; dn1 (+)= dqkv Wqkv.
        let dqkv = sc.dqkv.mat(n, d + 2 * kvd);
        if !self.frozen() {
            be.op(op::Gemm { c: self.wqkv(i, true), a: dqkv.t(), b: p.n1.mat(n, d), alpha: 1.0, beta: 1.0 });
        }
        be.op(op::Gemm { c: sc.dn.mat(n, d), a: dqkv, b: self.wqkv(i, false), alpha: 1.0, beta: if accumulate { 1.0 } else { 0.0 } });
        if gate {
            // z = scale x[:, :W] w^T: dw += dz^T x; dn1[:, :W] += dz w (scale is in dz).
            let (w, dw, x) = self.attn_gate_parts(i, p.n1);
            let dz = sc.dz.mat(n, self.cfg.num_heads);
            if !self.frozen() {
                be.op(op::Gemm { c: dw, a: dz.t(), b: x, alpha: 1.0, beta: 1.0 });
            }
            be.op(op::Gemm { c: sc.dn.mat(n, d).cols(0, self.cfg.attn_gate_window), a: dz, b: w, alpha: 1.0, beta: 1.0 });
        }
        // The adapters: o's from dao, q's, k's and v's from their projections' gradients;
        // each adds its input's gradient to dn1.
        for (site, dy) in [(Site::O, dao.mat(n, d)), (Site::Q, dxq), (Site::K, dxk), (Site::V, dxv)] {
            if let Some(ad) = self.adapter(pos, site) {
                self.lora_bwd(be, ad, p.n1, dy, sc.dn);
            }
        }
    }

    /// Backward of block `i`'s MLP on input `x` from `dmo` into `dn` (added when `accumulate`).
    fn mlp_bwd(&self, be: &mut dyn Backend, (i, pos): (usize, usize), x: Buf, pre: Buf, dmo: Buf, accumulate: bool) {
        let (sc, b, n, d) = (self.layout.scratch, BlockNames(i), self.n(), self.cfg.model_dim);
        let f = self.cfg.mlp_mult * d;
        let (fc, proj) = (b.name("mlp.fc.weight"), b.name("mlp.proj.weight"));
        // act = act(pre) again; out = act Wp^T: dWp += dmo^T act; dact = dmo Wp.
        be.op(op::ActFwd { pre, out: sc.act, a: self.activation() });
        if !self.frozen() {
            be.op(op::Gemm { c: self.dw(&proj), a: dmo.mat(n, d).t(), b: sc.act.mat(n, f), alpha: 1.0, beta: 1.0 });
        }
        be.op(op::Gemm { c: sc.dact.mat(n, f), a: dmo.mat(n, d), b: self.w(&proj), alpha: 1.0, beta: 0.0 });
        // dpre = act'(pre) dact (into the activation's buffer, no longer needed).
        be.op(op::ActBwd { pre, dout: sc.dact, dpre: sc.act, a: self.activation() });
        // pre = x Wfc^T: dWfc += dpre^T x; dx (+)= dpre Wfc.
        if !self.frozen() {
            be.op(op::Gemm { c: self.dw(&fc), a: sc.act.mat(n, f).t(), b: x.mat(n, d), alpha: 1.0, beta: 1.0 });
        }
        be.op(op::Gemm { c: sc.dn.mat(n, d), a: sc.act.mat(n, f), b: self.w(&fc), alpha: 1.0, beta: if accumulate { 1.0 } else { 0.0 } });
        if let Some(ad) = self.adapter(pos, Site::Mlp) {
            self.lora_bwd(be, ad, x, dmo.mat(n, d), sc.dn);
        }
    }
}
