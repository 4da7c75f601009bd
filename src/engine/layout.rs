//! The arena's layout: every tensor the engine ever touches at a static offset, computed once
//! from `[model]` and the micro-batch shape (llm.c's one allocation). In order:
//!
//! 1. **parameters**, f32 (f64 in the check backend), in `state_dict` order, so each block's
//!    `c_q`, `c_k`, `c_v` are one `(D + 2 KVD, D)` matrix and one GEMM computes all three;
//! 2. **gradients**, the same layout (one region: clipping is one reduction);
//! 3. **optimizer state**: Muon's momentum per matrix, Adam's two moments per other tensor;
//! 4. **constants**: the RoPE tables, and the step's device scalars (the loss summed over the
//!    micro-batches, the gradient norm), read by the host once per step;
//! 5. **activations** of one micro-batch, kept from the forward pass for the backward pass:
//!    per position of the (looped) layer sequence, and the embedding and head's;
//! 6. **scratch**: what lives inside one op sequence (the backward pass's running gradients,
//!    the recomputed MLP activation, Muon's Newton-Schulz stacks).
//!
//! Within regions 5 and 6 the per-row statistics and the losses come first and Muon's stacks
//! last, so that every `(N, ·)` activation and scratch buffer lies in one region,
//! [`Layout::half`]: what a backend with bf16 activations stores in bf16.
//!
//! Regions 5 and 6 hold nothing between micro-batches: the poison mode fills them with NaN there
//! (and the scratch between the forward and backward passes), so a read of a value that was
//! never written in the current pass shows as a NaN loss or gradient.

use std::collections::HashMap;

use super::backend::Buf;
pub use super::lora::LoraShape;
use crate::model::{FinalLane, ModelConfig, ParamGroup, gpt_group_of};

/// Elements every region of the arena starts on: 64 `f32` (256 bytes), the alignment
/// cuBLASLt's heuristic assumes of an operand by default and more than any vector load of the
/// kernels needs (16 bytes). `cudaMalloc` returns 256-byte aligned memory, so an offset that is a
/// multiple of this is an aligned address. (Views inside a region, such as the key columns of
/// the fused qkv product, can still start anywhere: the GPU backend gives cuBLASLt each
/// operand's real alignment, [`super::lt::LtPlan::alignments`].)
pub const ALIGN: usize = 64;

/// A bump allocator of arena offsets, each region starting on a multiple of its alignment.
#[derive(Default)]
pub(crate) struct Bump(pub(crate) usize, usize);

impl Bump {
    /// An allocator whose every region starts on a multiple of `align` elements.
    pub(crate) fn aligned(align: usize) -> Self {
        Bump(0, align)
    }

    /// The next `len` elements (from the next multiple of the alignment).
    pub(crate) fn take(&mut self, len: usize) -> Buf {
        if self.1 > 1 {
            self.0 = self.0.next_multiple_of(self.1);
        }
        let b = Buf { off: self.0, len };
        self.0 += len;
        b
    }

    /// The region allocated since `start`.
    fn since(&self, start: usize) -> Buf {
        Buf { off: start, len: self.0 - start }
    }
}

/// One parameter: its name, shape, optimizer group, and where its value, gradient and
/// optimizer state live.
#[derive(Clone, Debug)]
pub struct Slot {
    /// The `state_dict` name.
    pub name: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// The optimizer group.
    pub group: ParamGroup,
    /// The value.
    pub value: Buf,
    /// The gradient (summed over the step's micro-batches).
    pub grad: Buf,
    /// Muon's momentum buffer (matrices) or Adam's first moment.
    pub state0: Buf,
    /// Adam's second moment (empty for matrices).
    pub state1: Buf,
}

/// The activations one position of the layer sequence keeps for the backward pass (`N` rows
/// of the micro-batch; `D` model width, `KVD` key/value width, `F` MLP width).
#[derive(Clone, Copy, Debug)]
pub struct PositionBufs {
    /// The stream after the U-Net skip into this position (decoder positions that pop one).
    pub skipped: Buf,
    /// `u = h mix[0] + x0 mix[1]` `(N, D)`.
    pub u: Buf,
    /// `1 / rms(u)` `(N)`.
    pub rstd1: Buf,
    /// The normed (and `ln_scale`d) input of attention (and of the MLP when parallel) `(N, D)`.
    pub n1: Buf,
    /// `n1 Wqkv^T` `(N, D + 2 KVD)`.
    pub qkv: Buf,
    /// Queries after norm, RoPE and gain `(N, D)`.
    pub q: Buf,
    /// Keys after norm and RoPE `(N, KVD)`.
    pub k: Buf,
    /// `1 / rms` per (row, query head), per (row, key head).
    pub rq: Buf,
    /// See `rq`.
    pub rk: Buf,
    /// The attention output `(N, D)`.
    pub att: Buf,
    /// The attention output after XSA (positions of XSA blocks) `(N, D)`.
    pub y: Buf,
    /// The attention output after the sparse attention gate (`model.attn_gate`) `(N, D)`.
    pub yg: Buf,
    /// The attention sublayer's output `y Wo^T` `(N, D)`.
    pub ao: Buf,
    /// `u + attn_scale ao` (sequential blocks) `(N, D)`.
    pub u2: Buf,
    /// `1 / rms(u2)` `(N)`.
    pub rstd2: Buf,
    /// The MLP's normed input (sequential blocks) `(N, D)`.
    pub n2: Buf,
    /// The MLP's pre-activation `(N, F)`.
    pub pre: Buf,
    /// The MLP sublayer's output `(N, D)`.
    pub mo: Buf,
    /// The block's output, the stream into the next position `(N, D)` (lane 0's on the
    /// two-lane decoder).
    pub out: Buf,
    /// Lane 1's output on the two-lane decoder (`model.parallel_decoder_start`) `(N, D)`.
    pub out1: Buf,
}

/// The scratch of one pass.
#[derive(Clone, Copy, Debug)]
pub struct Scratch {
    /// The running gradient of the stream, and its partner for ops that cannot work in place
    /// `(N, D)` each.
    pub g: Buf,
    /// See `g`.
    pub g2: Buf,
    /// Gradient of a normed input `(N, D)`.
    pub dn: Buf,
    /// Gradient of an attention or MLP sublayer output `(N, D)` each.
    pub dao: Buf,
    /// See `dao`.
    pub dmo: Buf,
    /// Gradient of the attention output before the projection (after XSA) `(N, D)`, and before
    /// XSA `(N, D)`.
    pub dy: Buf,
    /// See `dy`.
    pub datt: Buf,
    /// The sparse attention gate's pre-sigmoid gradients `(N, H)` (`model.attn_gate`).
    pub dz: Buf,
    /// Gradient of the embedding rows before SmearGate `(N, D)` (`model.smear_gate`).
    pub dsmear: Buf,
    /// Gradients of BigramHash's projected rows `(N, D)` (with a projection) and of its table's
    /// rows `(N, bigram_dim)` (`model.bigram_vocab_size`).
    pub dbigram_proj: Buf,
    /// See `dbigram_proj`.
    pub dbigram: Buf,
    /// Lane 1's running gradient and its partner on the two-lane decoder `(N, D)` each.
    pub gl: Buf,
    /// See `gl`.
    pub gl2: Buf,
    /// Gradients of the normed-and-rotated queries `(N, D)` and keys `(N, KVD)`.
    pub dq: Buf,
    /// See `dq`.
    pub dk: Buf,
    /// Gradient of the fused qkv product `(N, D + 2 KVD)`.
    pub dqkv: Buf,
    /// The MLP activation (recomputed in the backward pass) `(N, F)`, and its gradient.
    pub act: Buf,
    /// See `act`.
    pub dact: Buf,
    /// Gradient of the normed embedding `x0` (summed over every block's residual mix) and of
    /// the embedding rows `(N, D)`.
    pub dx0: Buf,
    /// See `dx0`.
    pub demb: Buf,
}

/// Muon's work for one shape: the stacked updates of its matrices and the Newton-Schulz
/// buffers.
#[derive(Clone, Debug)]
pub struct MuonGroup {
    /// Stored shape `(rows, cols)` of each matrix.
    pub shape: (usize, usize),
    /// The slots of the matrices, in `state_dict` order.
    pub members: Vec<usize>,
    /// `U` of each matrix, stacked `(K, rows, cols)`.
    pub u: Buf,
    /// `X` and its next iterate, `(K, a, b)` with `a = min(rows, cols)`.
    pub x: Buf,
    /// See `x`.
    pub x2: Buf,
    /// `A = X X^T` and `B = b A + c A A`, `(K, a, a)`.
    pub a: Buf,
    /// See `a`.
    pub b: Buf,
}

/// The whole arena.
pub struct Layout {
    /// Every parameter, in `state_dict` order.
    pub slots: Vec<Slot>,
    index: HashMap<String, usize>,
    /// All parameter values (one region).
    pub params: Buf,
    /// All gradients (one region, the parameters' layout).
    pub grads: Buf,
    /// All optimizer state.
    pub state: Buf,
    /// The activations region (dead between micro-batches).
    pub activations: Buf,
    /// The scratch region (dead outside a pass).
    pub scratch_region: Buf,
    /// The activations and scratch that a bf16-activation backend stores in bf16: every
    /// `(N, ·)` tensor of the passes and their gradients (one region, from the first such
    /// activation to the last scratch buffer before Muon's). Outside it, in f32 whatever the
    /// backend: parameters, gradients, optimizer state, the constants, the per-row statistics
    /// (`rstd*`, `rq`, `rk`), the per-token losses, and Muon's Newton-Schulz stacks.
    pub half: Buf,
    /// RoPE tables `(T, R / 2)` each.
    pub cos: Buf,
    /// See `cos`.
    pub sin: Buf,
    /// The step's device scalars: the loss sum ([`Layout::loss_sum`]), the gradient norm
    /// ([`Layout::grad_norm`]), two spare.
    pub stats: Buf,
    /// The embedding rows `(N, D)`, `1 / rms` of each, and the normed embedding `x0`.
    pub emb: Buf,
    /// The embedding rows after SmearGate `(N, D)` (`model.smear_gate`; what `x0` norms).
    pub smeared: Buf,
    /// BigramHash's table rows `(N, bigram_dim)` and, with a projection, their projection
    /// `(N, D)`, before the scale (`model.bigram_vocab_size`; `emb` has them added).
    pub bigram: Buf,
    /// See `bigram`.
    pub bigram_proj: Buf,
    /// See `emb`.
    pub rstd0: Buf,
    /// See `emb`.
    pub x0: Buf,
    /// `1 / rms` of the final stream, and the normed final stream `(N, D)`.
    pub rstdf: Buf,
    /// See `rstdf`.
    pub nf: Buf,
    /// Logits `(N, V)`, overwritten by their gradient.
    pub logits: Buf,
    /// Per-token losses `(N)`.
    pub losses: Buf,
    /// The two-lane decoder's final stream, the lanes' mean (`parallel_final_lane = "mean"`)
    /// `(N, D)`.
    pub lanes_final: Buf,
    /// Per position of the longest layer sequence.
    pub positions: Vec<PositionBufs>,
    /// Gradient reaching each U-Net skip from the decoder that popped it `(N, D)`.
    pub dskip: Vec<Buf>,
    /// The pass's scratch.
    pub scratch: Scratch,
    /// Muon's work per shape.
    pub muon: Vec<MuonGroup>,
    /// The LoRA adapters' buffers ([`Sizing::lora`]).
    pub lora: Option<super::lora::LoraLayout>,
    /// Rows of a micro-batch, tokens per row.
    pub rows: usize,
    /// See `rows`.
    pub t: usize,
    /// What the arena is sized for.
    pub sizing: Sizing,
}

/// What an arena is sized for: the micro-batch shape its views start at, the most tokens a
/// micro-batch of any later shape may have and its longest row ([`Layout::reshaped`]), and the
/// per-document LoRA adapters it holds (phased TTT's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sizing {
    /// Rows of the micro-batch.
    pub rows: usize,
    /// Tokens per row.
    pub t: usize,
    /// The most tokens of a micro-batch (`rows x t` of any shape).
    pub tokens: usize,
    /// The longest row.
    pub max_t: usize,
    /// Adapters for this many documents at this rank.
    pub lora: Option<LoraShape>,
}

impl Sizing {
    /// Micro-batches of `rows x t` only, no adapters.
    pub fn fixed(rows: usize, t: usize) -> Self {
        Sizing { rows, t, tokens: rows * t, max_t: t, lora: None }
    }
}

impl Layout {
    /// The layout for `cfg` and micro-batches of `rows x t` tokens.
    pub fn new(cfg: &ModelConfig, rows: usize, t: usize) -> Layout {
        Layout::sized(cfg, Sizing::fixed(rows, t))
    }

    /// The layout for `cfg` sized by `sizing`: every per-token buffer holds `sizing.tokens`
    /// tokens and is viewed at its first `rows x t` ([`Layout::reshaped`] views another shape
    /// of the same arena), with the LoRA adapters' region when `sizing.lora` asks for one.
    pub fn sized(cfg: &ModelConfig, sizing: Sizing) -> Layout {
        let Sizing { rows, t, tokens: cap, max_t, lora: lora_shape } = sizing;
        assert!(rows * t <= cap && t <= max_t, "a {rows} x {t} micro-batch in an arena sized for {cap} tokens, rows of at most {max_t}");
        let lora_plan = lora_shape.map(|s| super::lora::Plan::new(cfg, s, ALIGN));
        let mut bump = Bump::aligned(ALIGN);
        let shapes = cfg.param_shapes();
        let sizes: Vec<usize> = shapes.iter().map(|(_, s)| s.iter().product()).collect();
        // Each parameter on an aligned offset within the parameter region (and so within the
        // gradient region, laid out alike), except the key and value weights, which follow the
        // query weight with no gap: the three are one matrix, one GEMM.
        let mut starts = Vec::with_capacity(sizes.len());
        let mut at = 0;
        for ((name, _), n) in shapes.iter().zip(&sizes) {
            if !(name.ends_with(".attn.c_k.weight") || name.ends_with(".attn.c_v.weight")) {
                at = usize::next_multiple_of(at, ALIGN);
            }
            starts.push(at);
            at += n;
        }
        // The adapters' values after the model's (so that the weights' bf16 copy holds them too).
        let lora_at = at.next_multiple_of(ALIGN);
        if let Some(p) = &lora_plan {
            at = lora_at + p.len();
        }
        let params = bump.take(at);
        let grads = bump.take(params.len);
        let state_start = bump.0.next_multiple_of(ALIGN);
        let mut slots = Vec::with_capacity(shapes.len());
        for (((name, shape), n), at) in shapes.into_iter().zip(sizes).zip(starts) {
            let group = gpt_group_of(&name, shape.len());
            let state0 = bump.take(n);
            let state1 = bump.take(if group == ParamGroup::Matrix { 0 } else { n });
            slots.push(Slot { name, shape, group, value: params.sub(at, n), grad: grads.sub(at, n), state0, state1 });
        }
        let lora_moments = lora_plan.as_ref().map(|p| (bump.take(p.len()), bump.take(p.len())));
        let state = bump.since(state_start);
        let half = cfg.rotary_dims() / 2;
        let (cos, sin) = (bump.take(max_t * half).sub(0, t * half), bump.take(max_t * half).sub(0, t * half));
        let stats = bump.take(4);

        let (n, d, kvd, f, v) = (rows * t, cfg.model_dim, cfg.kv_dim(), cfg.mlp_mult * cfg.model_dim, cfg.vocab_size);
        // A per-token buffer of `per` elements a token: room for the capacity, viewed at `n`.
        let nt = move |bump: &mut Bump, per: usize| bump.take(cap * per).sub(0, n * per);
        let act_start = bump.0.next_multiple_of(ALIGN);
        let layers = cfg.layer_sequence(true);
        // The activations' per-row statistics and the per-token losses first: they stay f32
        // when the rest of the activations and the scratch are bf16 (`half` below).
        let (rstd0, rstdf, losses) = (nt(&mut bump, 1), nt(&mut bump, 1), nt(&mut bump, 1));
        // Decoder position p pops a skip while p - encoders < skip_count, in either layout.
        let pops = |pos: usize| {
            [true, false].iter().any(|&looped| {
                let (enc, dec) = cfg.encoder_decoder(looped);
                pos >= enc.len() && pos - enc.len() < cfg.skip_count().min(enc.len()) && pos < enc.len() + dec.len()
            })
        };
        // A position's physical block differs between the layouts: size for the larger need.
        let unlooped = cfg.layer_sequence(false);
        let needs = |pos: usize, f: &dyn Fn(usize) -> bool| f(layers[pos]) || unlooped.get(pos).is_some_and(|&i| f(i));
        // A decoder position of a two-lane block, in either layout.
        let lane = |pos: usize| {
            [true, false].iter().any(|&looped| {
                let (enc, dec) = cfg.encoder_decoder(looped);
                pos >= enc.len() && dec.get(pos - enc.len()).is_some_and(|&i| cfg.two_lane(i))
            })
        };
        let row_stats: Vec<[Buf; 4]> = (0..layers.len())
            .map(|pos| {
                let seq = needs(pos, &|i| !cfg.parallel(i));
                [nt(&mut bump, 1), nt(&mut bump, cfg.num_heads), nt(&mut bump, cfg.num_kv_heads), nt(&mut bump, if seq { 1 } else { 0 })]
            })
            .collect();
        let half_start = bump.0.next_multiple_of(ALIGN);
        let (emb, x0) = (nt(&mut bump, d), nt(&mut bump, d));
        let smeared = nt(&mut bump, if cfg.smear_gate { d } else { 0 });
        let (bigram_on, projected) = (cfg.bigram_vocab_size > 0, cfg.bigram_vocab_size > 0 && cfg.bigram_dim != d);
        let bigram = nt(&mut bump, if bigram_on { cfg.bigram_dim } else { 0 });
        let bigram_proj = nt(&mut bump, if projected { d } else { 0 });
        let positions = row_stats
            .iter()
            .enumerate()
            .map(|(pos, &[rstd1, rq, rk, rstd2])| {
                let pops = pops(pos);
                let seq = needs(pos, &|i| !cfg.parallel(i));
                let xsa = needs(pos, &|i| cfg.xsa(i));
                PositionBufs {
                    skipped: nt(&mut bump, if pops { d } else { 0 }),
                    u: nt(&mut bump, d),
                    rstd1,
                    n1: nt(&mut bump, d),
                    qkv: nt(&mut bump, d + 2 * kvd),
                    q: nt(&mut bump, d),
                    k: nt(&mut bump, kvd),
                    rq,
                    rk,
                    att: nt(&mut bump, d),
                    y: nt(&mut bump, if xsa { d } else { 0 }),
                    yg: nt(&mut bump, if cfg.attn_gate { d } else { 0 }),
                    ao: nt(&mut bump, d),
                    u2: nt(&mut bump, if seq { d } else { 0 }),
                    rstd2,
                    n2: nt(&mut bump, if seq { d } else { 0 }),
                    pre: nt(&mut bump, f),
                    mo: nt(&mut bump, d),
                    out: nt(&mut bump, d),
                    out1: nt(&mut bump, if lane(pos) { d } else { 0 }),
                }
            })
            .collect();
        let (nf, logits) = (nt(&mut bump, d), nt(&mut bump, v));
        let lanes = cfg.lanes_from().is_some();
        let lanes_final = nt(&mut bump, if lanes && cfg.parallel_final_lane == FinalLane::Mean { d } else { 0 });
        // Each adapter's `h = x A` `(N, r)`, kept for its backward pass.
        let lora_h = lora_plan.as_ref().map(|p| p.adapters().map(|_| nt(&mut bump, p.rank())).collect::<Vec<_>>());
        let activations = bump.since(act_start);

        let scratch_start = bump.0.next_multiple_of(ALIGN);
        let dskip = (0..cfg.skip_count()).map(|_| nt(&mut bump, d)).collect();
        let scratch = Scratch {
            g: nt(&mut bump, d),
            g2: nt(&mut bump, d),
            dn: nt(&mut bump, d),
            dao: nt(&mut bump, d),
            dmo: nt(&mut bump, d),
            dy: nt(&mut bump, d),
            datt: nt(&mut bump, d),
            dz: nt(&mut bump, if cfg.attn_gate { cfg.num_heads } else { 0 }),
            dsmear: nt(&mut bump, if cfg.smear_gate { d } else { 0 }),
            dbigram_proj: nt(&mut bump, if projected { d } else { 0 }),
            dbigram: nt(&mut bump, if bigram_on { cfg.bigram_dim } else { 0 }),
            gl: nt(&mut bump, if lanes { d } else { 0 }),
            gl2: nt(&mut bump, if lanes { d } else { 0 }),
            dq: nt(&mut bump, d),
            dk: nt(&mut bump, kvd),
            dqkv: nt(&mut bump, d + 2 * kvd),
            act: nt(&mut bump, f),
            dact: nt(&mut bump, f),
            dx0: nt(&mut bump, d),
            demb: nt(&mut bump, d),
        };
        // The adapters' `dh` `(N, r)`.
        let lora_dh = lora_plan.as_ref().map(|p| nt(&mut bump, p.rank()));
        let half = bump.since(half_start);
        // Muon's Newton-Schulz stacks: scratch, f32.
        let mut muon: Vec<MuonGroup> = Vec::new();
        for (i, s) in slots.iter().enumerate().filter(|(_, s)| s.group == ParamGroup::Matrix) {
            let shape = (s.shape[0], s.shape[1]);
            match muon.iter_mut().find(|g| g.shape == shape) {
                Some(g) => g.members.push(i),
                None => muon.push(MuonGroup {
                    shape,
                    members: vec![i],
                    u: Buf::default(),
                    x: Buf::default(),
                    x2: Buf::default(),
                    a: Buf::default(),
                    b: Buf::default(),
                }),
            }
        }
        for g in &mut muon {
            let (k, (r, c)) = (g.members.len(), g.shape);
            let m = r.min(c);
            g.u = bump.take(k * r * c);
            g.x = bump.take(k * r * c);
            g.x2 = bump.take(k * r * c);
            g.a = bump.take(k * m * m);
            g.b = bump.take(k * m * m);
        }
        let scratch_region = bump.since(scratch_start);
        let lora = match (lora_plan, lora_moments, lora_h, lora_dh) {
            (Some(p), Some(moments), Some(h), Some(dh)) => {
                let len = p.len();
                Some(p.place((params.sub(lora_at, len), grads.sub(lora_at, len)), moments, h, dh))
            }
            _ => None,
        };
        let index = slots.iter().enumerate().map(|(i, s)| (s.name.clone(), i)).collect();
        Layout {
            slots,
            index,
            params,
            grads,
            state,
            activations,
            scratch_region,
            half,
            cos,
            sin,
            stats,
            emb,
            smeared,
            bigram,
            bigram_proj,
            rstd0,
            x0,
            rstdf,
            nf,
            logits,
            losses,
            lanes_final,
            positions,
            dskip,
            scratch,
            muon,
            lora,
            rows,
            t,
            sizing,
        }
    }

    /// The same arena viewed at micro-batches of `rows x t` (within its [`Sizing`]: every
    /// offset as before, the per-token buffers' views and the RoPE tables' cut to the shape).
    pub fn reshaped(&self, cfg: &ModelConfig, rows: usize, t: usize) -> anyhow::Result<Layout> {
        let s = self.sizing;
        anyhow::ensure!(
            rows >= 1 && t >= 1 && rows * t <= s.tokens && t <= s.max_t,
            "a pass of {rows} x {t} tokens in an arena sized for {} tokens, rows of at most {}",
            s.tokens,
            s.max_t
        );
        Ok(Layout::sized(cfg, Sizing { rows, t, ..s }))
    }

    /// The rest of a per-token buffer of `per` elements a token past the micro-batch's view,
    /// up to the arena's capacity (`None` when the view is the whole of it).
    pub fn capacity_tail(&self, b: Buf, per: usize) -> Option<Buf> {
        let (n, cap) = (self.rows * self.t, self.sizing.tokens);
        (n < cap && b.len == n * per).then(|| Buf { off: b.end(), len: (cap - n) * per })
    }

    /// The gradients of the model's parameters: the gradient region but the LoRA adapters'
    /// (what an SGD step of the base clips and sums over the ranks).
    pub fn base_grads(&self) -> Buf {
        match &self.lora {
            Some(l) => Buf { off: self.grads.off, len: l.grads.off - self.grads.off },
            None => self.grads,
        }
    }

    /// Elements in the arena.
    pub fn len(&self) -> usize {
        self.scratch_region.end()
    }

    /// Whether the arena is empty (never, for a model).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device scalar the forward pass adds each micro-batch's loss sum to.
    pub fn loss_sum(&self) -> Buf {
        self.stats.sub(0, 1)
    }

    /// The device scalar clipping writes the gradient norm to.
    pub fn grad_norm(&self) -> Buf {
        self.stats.sub(1, 1)
    }

    /// The slot of parameter `name` (panics on an unknown name: the schedule only asks for the
    /// names `param_shapes` gives).
    pub fn slot(&self, name: &str) -> &Slot {
        &self.slots[self.index[name]]
    }

    /// The slot index of parameter `name`.
    #[cfg(feature = "tools")]
    pub fn slot_index(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    /// The arena's regions in bytes (`(name, bytes)`, as [`Layout::regions`]) with `elem`
    /// bytes per element, and with bf16 activations (`half`) the `half` region at 2 bytes per
    /// element and the weights' bf16 copy as one more region.
    pub fn region_bytes(&self, elem: usize, half: bool) -> Vec<(&'static str, usize)> {
        let starts = [self.params.off, self.grads.off, self.state.off, self.cos.off, self.scratch_region.off, self.len()];
        let mut out: Vec<(&'static str, usize)> = self
            .regions()
            .iter()
            .zip(starts.windows(2))
            .map(|(&(name, n), w)| {
                let inside = if half { w[1].min(self.half.end()).saturating_sub(w[0].max(self.half.off)) } else { 0 };
                (name, (n - inside) * elem + inside * 2)
            })
            .collect();
        if half {
            out.push(("weights' bf16 copy", self.params.len * 2));
        }
        out
    }

    /// The arena's regions and their sizes in elements, for the log and the report:
    /// `(name, elements)`, each with the alignment padding up to the next (so they sum to the
    /// arena); the constants (RoPE tables, the step's scalars) count with the activations.
    pub fn regions(&self) -> [(&'static str, usize); 5] {
        [
            ("parameters", self.grads.off - self.params.off),
            ("gradients", self.state.off - self.grads.off),
            ("optimizer", self.cos.off - self.state.off),
            ("activations", self.scratch_region.off - self.cos.off),
            ("scratch", self.len() - self.scratch_region.off),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regions are disjoint and tile the arena; q, k, v weights are one matrix per block;
    /// the record's looped sequence has its 17 positions.
    #[test]
    fn regions_tile_the_arena_and_qkv_is_contiguous() {
        let cfg = ModelConfig { vocab_size: 64, model_dim: 32, num_heads: 4, num_kv_heads: 2, ..ModelConfig::record() };
        let l = Layout::new(&cfg, 2, 8);
        let total: usize = l.regions().iter().map(|(_, n)| n).sum();
        assert_eq!(total, l.len());
        let q = l.slot("blocks.3.attn.c_q.weight");
        let k = l.slot("blocks.3.attn.c_k.weight");
        let v = l.slot("blocks.3.attn.c_v.weight");
        assert_eq!((q.value.end(), k.value.end()), (k.value.off, v.value.off));
        assert_eq!((q.grad.end(), k.grad.end()), (k.grad.off, v.grad.off));
        assert_eq!(l.positions.len(), 17);
        let elems = cfg.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>();
        assert!(l.params.len >= elems && l.params.len < elems + ALIGN * l.slots.len(), "{} for {elems}", l.params.len);
        let mut all: Vec<Buf> = l.slots.iter().flat_map(|s| [s.value, s.grad, s.state0, s.state1]).collect();
        all.extend(
            l.positions.iter().flat_map(|p| [p.u, p.n1, p.qkv, p.q, p.k, p.att, p.y, p.ao, p.u2, p.n2, p.pre, p.mo, p.out, p.skipped]),
        );
        all.sort_by_key(|b| b.off);
        for w in all.windows(2) {
            assert!(!w[0].overlaps(w[1]), "{:?} and {:?} overlap", w[0], w[1]);
        }
    }

    /// The bf16 region holds every `(N, ·)` activation and scratch buffer and none of the f32
    /// ones (parameters, gradients, optimizer state, constants, per-row statistics, losses,
    /// Muon's stacks), on the 04-27 model (every element's buffers); its bytes count 2 each.
    #[test]
    fn the_half_region_holds_the_activations_and_nothing_f32() {
        let cfg = ModelConfig { vocab_size: 64, model_dim: 64, num_heads: 2, num_kv_heads: 1, ..ModelConfig::record_0427() };
        let l = Layout::new(&cfg, 2, 64);
        let inside = |b: Buf| b.len == 0 || (b.off >= l.half.off && b.end() <= l.half.end());
        let outside = |b: Buf| b.len == 0 || !b.overlaps(l.half);
        for b in [l.params, l.grads, l.state, l.cos, l.sin, l.stats, l.rstd0, l.rstdf, l.losses] {
            assert!(outside(b), "{b:?} in the bf16 region {:?}", l.half);
        }
        for g in &l.muon {
            assert!([g.u, g.x, g.x2, g.a, g.b].into_iter().all(outside), "Muon's stacks in the bf16 region");
        }
        for p in &l.positions {
            assert!([p.rstd1, p.rq, p.rk, p.rstd2].into_iter().all(outside), "a position's statistics in the bf16 region");
            let acts = [p.skipped, p.u, p.n1, p.qkv, p.q, p.k, p.att, p.y, p.yg, p.ao, p.u2, p.n2, p.pre, p.mo, p.out, p.out1];
            assert!(acts.into_iter().all(inside), "a position's activation outside the bf16 region");
        }
        let sc = &l.scratch;
        let scratch = [sc.g, sc.g2, sc.dn, sc.dao, sc.dmo, sc.dy, sc.datt, sc.dz, sc.dsmear, sc.gl, sc.gl2, sc.dq, sc.dk, sc.dqkv];
        assert!(scratch.into_iter().chain([sc.act, sc.dact, sc.dx0, sc.demb, sc.dbigram_proj, sc.dbigram]).all(inside));
        let acts = [l.emb, l.smeared, l.bigram, l.bigram_proj, l.x0, l.nf, l.logits, l.lanes_final];
        assert!(acts.into_iter().chain(l.dskip.iter().copied()).all(inside));
        assert!(l.half.off.is_multiple_of(ALIGN));
        let f32_bytes: usize = l.region_bytes(4, false).iter().map(|r| r.1).sum();
        let half_bytes: usize = l.region_bytes(4, true).iter().map(|r| r.1).sum();
        assert_eq!(f32_bytes, 4 * l.len());
        assert_eq!(half_bytes, 4 * l.len() - 2 * l.half.len + 2 * l.params.len);
    }

    /// Every region and every parameter, gradient, optimizer state, activation and scratch
    /// buffer starts on a multiple of [`ALIGN`] elements (256 bytes: what cuBLASLt assumes of
    /// an operand and what 16-byte vector loads need), on shapes where nothing is a multiple of
    /// anything: 5 query heads (a 5-element query gain), 1 key/value head, an odd vocabulary and
    /// sequence, a 3-row micro-batch. Only the key and value weights follow the query weight
    /// unaligned, as one matrix with it. (The bump allocator without alignment puts the first
    /// parameter after the 5-element gain at an odd offset.)
    #[test]
    fn every_buffer_starts_aligned_on_odd_shapes() {
        let cfg =
            ModelConfig { vocab_size: 1001, model_dim: 320, num_heads: 5, num_kv_heads: 1, rope_dims: Some(16), ..ModelConfig::record() };
        let l = Layout::new(&cfg, 3, 67);
        let aligned = |what: &str, b: Buf| assert!(b.len == 0 || b.off.is_multiple_of(ALIGN), "{what} starts at {}", b.off);
        for s in &l.slots {
            let fused = s.name.ends_with(".attn.c_k.weight") || s.name.ends_with(".attn.c_v.weight");
            if !fused {
                aligned(&s.name, s.value);
                aligned(&s.name, s.grad);
            }
            aligned(&s.name, s.state0);
            aligned(&s.name, s.state1);
        }
        assert!(l.slots.iter().any(|s| s.name.ends_with("q_gain") && s.value.len == 5), "the model has a 5-element gain");
        for (what, b) in [("params", l.params), ("grads", l.grads), ("state", l.state), ("cos", l.cos), ("sin", l.sin)] {
            aligned(what, b);
        }
        for (what, b) in [("stats", l.stats), ("emb", l.emb), ("rstd0", l.rstd0), ("x0", l.x0), ("rstdf", l.rstdf), ("nf", l.nf)] {
            aligned(what, b);
        }
        for (what, b) in [("logits", l.logits), ("losses", l.losses), ("activations", l.activations), ("scratch", l.scratch_region)] {
            aligned(what, b);
        }
        for p in &l.positions {
            for b in [p.skipped, p.u, p.rstd1, p.n1, p.qkv, p.q, p.k, p.rq, p.rk, p.att, p.y, p.ao, p.u2, p.rstd2, p.n2, p.pre, p.mo, p.out]
            {
                aligned("a position's activation", b);
            }
        }
        let s = &l.scratch;
        for b in [s.g, s.g2, s.dn, s.dao, s.dmo, s.dy, s.datt, s.dq, s.dk, s.dqkv, s.act, s.dact, s.dx0, s.demb] {
            aligned("scratch", b);
        }
        for g in &l.muon {
            for b in [g.u, g.x, g.x2, g.a, g.b] {
                aligned("muon", b);
            }
        }
        l.dskip.iter().for_each(|&b| aligned("dskip", b));
        let total: usize = l.regions().iter().map(|(_, n)| n).sum();
        assert_eq!(total, l.len());
    }
}
