//! `[model]`: the shape of the GPT.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The MLP's activation before its down projection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum MlpActivation {
    /// `relu(x)^2` (the baseline).
    #[default]
    Relu2,
    /// `leaky_relu(x, leaky_relu_slope)^2` (the 04-09 record, slope 0.5).
    LeakyRelu2,
}

/// `[model]`: sizes and switches of the GPT (defaults: the challenge's baseline; each switch
/// off gives the baseline's model bit for bit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Vocabulary size (must match the tokenizer).
    pub vocab_size: usize,
    /// Transformer blocks; the first half are U-Net encoders, the rest decoders.
    pub num_layers: usize,
    /// Width of the residual stream.
    pub model_dim: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention); must divide `num_heads`.
    pub num_kv_heads: usize,
    /// MLP hidden width as a multiple of `model_dim`.
    pub mlp_mult: usize,
    /// Use the token embedding as the output head.
    pub tie_embeddings: bool,
    /// RoPE base.
    pub rope_base: f64,
    /// Logits are squashed to `softcap * tanh(z / softcap)`.
    pub logit_softcap: f64,
    /// Initial value of every query head's learned gain.
    pub qk_gain_init: f64,
    /// Standard deviation of the tied embedding's normal initialisation.
    pub tied_embed_init_std: f64,
    /// The MLP's activation: "relu2" (the baseline) or "leaky_relu2" (the 04-09 record).
    pub mlp_activation: MlpActivation,
    /// Slope of `leaky_relu2` for negative inputs, in [0, 1] (the record: 0.5).
    pub leaky_relu_slope: f64,
    /// Scale each block's normed attention and MLP inputs by `1/sqrt(layer + 1)`, `layer` the
    /// physical block index (the record: on).
    pub ln_scale: bool,
    /// From this physical block on, attention and MLP read the same normed input and both add
    /// to the stream (GPT-J-style parallel residuals; the record: 7). Absent: every block is
    /// sequential.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel_residual_start: Option<usize>,
    /// Sigmoid-gated U-Net skips: `h = g * h + (1 - g) * skip_weights[j] * skip`, with
    /// `g = sigmoid(skip_gates[j])` learned per channel (initially 0.5); off, the skip is added
    /// (`h + skip_weights[j] * skip`, the baseline).
    pub skip_gates: bool,
    /// Rotate only the first this many dims of each query and key head (partial RoPE; even, at
    /// most the head dim; the record: 16 of 64); the rest pass through. Absent: the whole head.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_dims: Option<usize>,
    /// The sequence length RoPE was trained at: longer evaluated sequences get the NTK-rescaled
    /// base `rope_base * (T / rope_train_seq_len)^(r / (r - 2))`, `r` the rotated dims (the
    /// record: 2048). Absent: never rescaled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_train_seq_len: Option<usize>,
    /// Exclusive self-attention in the last this many physical blocks: each head's output loses
    /// its component along its own token's normalised value vector (the record: all 11). 0: none.
    pub xsa_last_n: usize,
    /// Depth recurrence: blocks `loop_start..=loop_end` run `num_loops + 1` times in a row once
    /// looping is on (the record: 3). Read only when `num_loops > 0`.
    pub loop_start: usize,
    /// Last block of the repeated range, inclusive (the record: 5).
    pub loop_end: usize,
    /// Extra passes over `loop_start..=loop_end` (the record: 2, so the range runs 3 times);
    /// 0: no recurrence.
    pub num_loops: usize,
    /// The training-time fraction at which looping switches on (the record: 0.35); it stays on
    /// for the rest of training and for every evaluation after it. 0: looped from the start.
    pub enable_looping_at: f64,
    /// Initialisation of the block matrices: "default" (uniform +-1/sqrt(fan_in), the
    /// baseline) or "orthogonal" (gain 1, for `c_q`, `c_k`, `c_v`, `fc` when both dims are at
    /// least 64; the record). The zero-initialised projections stay zero either way.
    pub init: Init,
    /// SmearGate on the embedding lane (the 04-27 record): before the embedding's norm,
    /// `e_t <- e_t + smear_lambda * sigmoid(smear_gate . e_t[:smear_gate_window]) * e_{t-1}`,
    /// both parameters zero at init (so the model starts as without it), and no smear onto a
    /// token that is `bos_id` (the BOS fix: a document's first token does not see the last
    /// one of the document before it).
    pub smear_gate: bool,
    /// The leading channels of `e_t` that drive the smear's gate (the record: 12, its
    /// GATE_WINDOW); at most `model_dim`.
    pub smear_gate_window: usize,
    /// The token that starts a document (the tokenizer's BOS: 1 in the challenge's): SmearGate
    /// does not smear onto it, and `document_attention` starts a segment at it. Checked against
    /// the tokenizer when either is on.
    pub bos_id: u32,
    /// Document-masked attention (the 04-27 record's variable-length attention over packed
    /// rows): in every pass, training, validation and evaluation alike, a position attends only
    /// to the positions of its own document, documents starting at each `bos_id` (and at each
    /// row's start).
    pub document_attention: bool,
    /// Under `document_attention`, a document longer than this is attended in pieces of this
    /// many tokens from its own start (the 04-27 record's loader cuts its packed rows at its
    /// TRAIN_SEQ_LEN, its evaluation at EVAL_SEQ_LEN: 2048); 0: only a row's end cuts one.
    /// Rows no longer than it (the row samplers' `train.seq_len`) are unchanged by it; the
    /// `packed_docs` sampler's one long row is not.
    pub document_max_len: usize,
    /// Sparse attention-output gate (the 04-27 record): each head's attention output is scaled
    /// by `sigmoid(attn_gate_scale * attn_gate_w[h] . x_t[:attn_gate_window])`, `x` the
    /// block's normed attention input, before the output projection; `attn_gate_w` is
    /// `(heads, attn_gate_window)` per block, an Adam control tensor.
    pub attn_gate: bool,
    /// The leading channels of `x_t` the attention gate reads (the record: 12, GATE_WINDOW);
    /// at most `model_dim`.
    pub attn_gate_window: usize,
    /// Standard deviation of `attn_gate_w`'s normal initialisation; 0: zeros, every gate 0.5
    /// at init (the record: 0).
    pub attn_gate_init_std: f64,
    /// The factor inside the gate's sigmoid (the record: 0.5).
    pub attn_gate_scale: f64,
    /// Two-lane parallel decoder (the 04-27 record: 8): from this physical block on, the
    /// decoder carries two streams; attention reads lane 0 (mixed with `x0` by `resid_mix`),
    /// the MLP reads lane 1, and each lane becomes `resid[i, l] * lane_l + post[i, 0, l] *
    /// attn + post[i, 1, l] * mlp` with the learned `parallel_resid_lambdas` (init 1.1) and
    /// `parallel_post_lambdas` (init 1); U-Net skips enter lane 0. Absent or 0: one stream.
    /// Not with `parallel_residual_start`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel_decoder_start: Option<usize>,
    /// What the two lanes hand to the final norm: "mean" (the record), "attn" (lane 0) or
    /// "mlp" (lane 1).
    pub parallel_final_lane: FinalLane,
    /// BigramHash (the records of 2026-03-20: 10,240 buckets): a learned table of
    /// `bigram_vocab_size` rows added to the token embedding before its norm. Position `i` of a
    /// sequence reads row `(36313 x_i XOR 27191 x_{i-1}) mod (bigram_vocab_size - 1)`, a
    /// sequence's first position the last row; the row goes through `bigram.proj` `(model_dim,
    /// bigram_dim)` when `bigram_dim != model_dim` and is scaled by the learned scalar
    /// `bigram.scale` (init 0.05). The table starts at zero (Adam with the embedding), the
    /// projection orthogonal over `sqrt(2 num_layers)` under `init = "orthogonal"` (Muon).
    /// 0: off.
    pub bigram_vocab_size: usize,
    /// Width of the BigramHash table's rows (the records: 128); at most `model_dim`.
    pub bigram_dim: usize,
}

/// The two-lane decoder's output (`model.parallel_final_lane`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinalLane {
    /// `(lane0 + lane1) / 2`.
    #[default]
    Mean,
    /// Lane 0, the attention's.
    Attn,
    /// Lane 1, the MLP's.
    Mlp,
}

/// How the block matrices are initialised (`model.init`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Init {
    /// Uniform in +-1/sqrt(fan_in) (PyTorch's `nn.Linear` default; the baseline).
    #[default]
    Default,
    /// A random orthogonal matrix (gain 1) where both dims are at least 64 (the record).
    Orthogonal,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            vocab_size: 1024,
            num_layers: 9,
            model_dim: 512,
            num_heads: 8,
            num_kv_heads: 4,
            mlp_mult: 2,
            tie_embeddings: true,
            rope_base: 10_000.0,
            logit_softcap: 30.0,
            qk_gain_init: 1.5,
            tied_embed_init_std: 0.005,
            mlp_activation: MlpActivation::Relu2,
            leaky_relu_slope: 0.5,
            ln_scale: false,
            parallel_residual_start: None,
            skip_gates: false,
            rope_dims: None,
            rope_train_seq_len: None,
            xsa_last_n: 0,
            loop_start: 0,
            loop_end: 0,
            num_loops: 0,
            enable_looping_at: 0.0,
            init: Init::Default,
            smear_gate: false,
            smear_gate_window: 12,
            bos_id: 1,
            document_attention: false,
            document_max_len: 0,
            attn_gate: false,
            attn_gate_window: 12,
            attn_gate_init_std: 0.0,
            attn_gate_scale: 1.0,
            parallel_decoder_start: None,
            parallel_final_lane: FinalLane::Mean,
            bigram_vocab_size: 0,
            bigram_dim: 128,
        }
    }
}

impl ModelConfig {
    /// The 04-09 record's `[model]` (spec 4.2, 4.3; `pipelines/record.toml`): 35,944,536
    /// parameters.
    #[cfg(feature = "tools")]
    pub fn record() -> ModelConfig {
        ModelConfig {
            vocab_size: 8192,
            num_layers: 11,
            mlp_mult: 4,
            qk_gain_init: 5.25,
            mlp_activation: MlpActivation::LeakyRelu2,
            ln_scale: true,
            parallel_residual_start: Some(7),
            skip_gates: true,
            rope_dims: Some(16),
            rope_train_seq_len: Some(2048),
            xsa_last_n: 11,
            loop_start: 3,
            loop_end: 5,
            num_loops: 2,
            enable_looping_at: 0.35,
            init: Init::Orthogonal,
            ..ModelConfig::default()
        }
    }

    /// The 04-27 record's `[model]` (PR #1855; `pipelines/record-0427.toml`): the 04-09's with
    /// SmearGate, document-masked attention, the sparse attention gate, the two-lane decoder
    /// from block 8 in place of the parallel residuals, QK gain 5.0 and RoPE never rescaled: 35,945,671 parameters.
    #[cfg(feature = "tools")]
    pub fn record_0427() -> ModelConfig {
        ModelConfig {
            qk_gain_init: 5.0,
            rope_train_seq_len: None,
            parallel_residual_start: None,
            parallel_decoder_start: Some(8),
            smear_gate: true,
            document_attention: true,
            document_max_len: 2048,
            attn_gate: true,
            attn_gate_scale: 0.5,
            ..ModelConfig::record()
        }
    }

    /// The `[model]` keys where `other` differs from this config: `(key, ours, theirs)` as JSON
    /// values, in key order (what a resume or an artifact for another architecture names).
    pub fn differences(&self, other: &ModelConfig) -> Vec<(String, serde_json::Value, serde_json::Value)> {
        let as_map = |c: &ModelConfig| match serde_json::to_value(c) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        let (a, b) = (as_map(self), as_map(other));
        let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
        keys.sort();
        keys.dedup();
        let null = serde_json::Value::Null;
        keys.into_iter()
            .filter_map(|k| {
                let (x, y) = (a.get(k).unwrap_or(&null), b.get(k).unwrap_or(&null));
                (x != y).then(|| (k.clone(), x.clone(), y.clone()))
            })
            .collect()
    }

    /// Checks the sizes fit together; errors name the `model.*` keys.
    pub fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.vocab_size >= 2, "`model.vocab_size` must be at least 2");
        anyhow::ensure!(self.num_layers >= 1, "`model.num_layers` must be at least 1");
        anyhow::ensure!(self.num_heads >= 1 && self.num_kv_heads >= 1, "`model.num_heads` and `model.num_kv_heads` must be at least 1");
        anyhow::ensure!(
            self.model_dim.is_multiple_of(self.num_heads),
            "`model.model_dim` ({}) must be divisible by `model.num_heads` ({})",
            self.model_dim,
            self.num_heads
        );
        anyhow::ensure!(
            self.num_heads.is_multiple_of(self.num_kv_heads),
            "`model.num_heads` ({}) must be divisible by `model.num_kv_heads` ({})",
            self.num_heads,
            self.num_kv_heads
        );
        anyhow::ensure!(
            self.head_dim().is_multiple_of(2),
            "head dim `model.model_dim / model.num_heads` = {} must be even for RoPE",
            self.head_dim()
        );
        anyhow::ensure!(self.mlp_mult >= 1, "`model.mlp_mult` must be at least 1");
        anyhow::ensure!(self.logit_softcap > 0.0, "`model.logit_softcap` must be positive");
        anyhow::ensure!(self.rope_base > 0.0, "`model.rope_base` must be positive");
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.leaky_relu_slope),
            "`model.leaky_relu_slope` must be in [0, 1]; found {}",
            self.leaky_relu_slope
        );
        if let Some(start) = self.parallel_residual_start {
            anyhow::ensure!(
                start < self.num_layers,
                "`model.parallel_residual_start` ({start}) must name a block below `model.num_layers` ({}); leave it out for none",
                self.num_layers
            );
        }
        if let Some(r) = self.rope_dims {
            anyhow::ensure!(
                r >= 2 && r.is_multiple_of(2) && r <= self.head_dim(),
                "`model.rope_dims` ({r}) must be even, at least 2 and at most the head dim `model.model_dim / model.num_heads` = {}",
                self.head_dim()
            );
        }
        if let Some(t) = self.rope_train_seq_len {
            anyhow::ensure!(t >= 1, "`model.rope_train_seq_len` must be at least 1; leave it out for no rescaling");
            anyhow::ensure!(
                self.rotary_dims() > 2,
                "`model.rope_train_seq_len` rescales the base by (T / len)^(r / (r - 2)): the rotated dims r = {} must be above 2",
                self.rotary_dims()
            );
        }
        anyhow::ensure!(
            self.xsa_last_n <= self.num_layers,
            "`model.xsa_last_n` ({}) must be at most `model.num_layers` ({})",
            self.xsa_last_n,
            self.num_layers
        );
        if self.num_loops > 0 {
            anyhow::ensure!(
                self.loop_start <= self.loop_end && self.loop_end < self.num_layers,
                "the loop range `model.loop_start`..=`model.loop_end` ({}..={}) must lie within the {} blocks of `model.num_layers`",
                self.loop_start,
                self.loop_end,
                self.num_layers
            );
        }
        for (on, key, w) in
            [(self.smear_gate, "smear_gate_window", self.smear_gate_window), (self.attn_gate, "attn_gate_window", self.attn_gate_window)]
        {
            anyhow::ensure!(
                !on || (1..=self.model_dim).contains(&w),
                "`model.{key}` ({w}) must be between 1 and the width `model.model_dim` ({})",
                self.model_dim
            );
        }
        anyhow::ensure!(
            u32::try_from(self.document_max_len).is_ok(),
            "`model.document_max_len` ({}) must be below 2^32",
            self.document_max_len
        );
        anyhow::ensure!(
            (self.bos_id as usize) < self.vocab_size,
            "`model.bos_id` ({}) must be a token of the vocabulary `model.vocab_size` ({})",
            self.bos_id,
            self.vocab_size
        );
        anyhow::ensure!(
            self.attn_gate_init_std.is_finite() && self.attn_gate_init_std >= 0.0,
            "`model.attn_gate_init_std` must be finite and at least 0; found {}",
            self.attn_gate_init_std
        );
        if self.bigram_vocab_size > 0 {
            anyhow::ensure!(
                self.bigram_vocab_size >= 2,
                "`model.bigram_vocab_size` ({}) must be at least 2 (the hash takes its rows mod `bigram_vocab_size - 1`); 0: off",
                self.bigram_vocab_size
            );
            anyhow::ensure!(
                (1..=self.model_dim).contains(&self.bigram_dim),
                "`model.bigram_dim` ({}) must be between 1 and the width `model.model_dim` ({})",
                self.bigram_dim,
                self.model_dim
            );
            anyhow::ensure!(
                self.vocab_size <= crate::model::ops::embedding::BIGRAM_MAX_VOCAB,
                "`model.bigram_vocab_size`: the records' hash multiplies ids in 32 bits, exact for vocabularies up to {}; `model.vocab_size` is {}",
                crate::model::ops::embedding::BIGRAM_MAX_VOCAB,
                self.vocab_size
            );
        }
        anyhow::ensure!(self.attn_gate_scale.is_finite(), "`model.attn_gate_scale` must be finite; found {}", self.attn_gate_scale);
        if let Some(start) = self.lanes_from() {
            anyhow::ensure!(
                start < self.num_layers,
                "`model.parallel_decoder_start` ({start}) must name a block below `model.num_layers` ({}); 0 or left out: one stream",
                self.num_layers
            );
            anyhow::ensure!(
                !self.recurrent() || start > self.loop_end,
                "`model.parallel_decoder_start` ({start}) must come after the loop range (`model.loop_end` = {}): the lanes run the blocks past it",
                self.loop_end
            );
            anyhow::ensure!(
                self.parallel_residual_start.is_none(),
                "`model.parallel_decoder_start` and `model.parallel_residual_start` are two forms of parallel blocks: set one"
            );
        }
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.enable_looping_at),
            "`model.enable_looping_at` is a fraction of training time in [0, 1]; found {}",
            self.enable_looping_at
        );
        Ok(())
    }

    /// The dims of each q/k head that RoPE rotates (`rope_dims`, or the whole head).
    pub fn rotary_dims(&self) -> usize {
        self.rope_dims.unwrap_or(self.head_dim())
    }

    /// The RoPE base for sequences of `t` tokens: `rope_base`, NTK-rescaled to
    /// `rope_base * (t / L)^(r / (r - 2))` when `t` exceeds `rope_train_seq_len = L`.
    pub fn rope_base_for(&self, t: usize) -> f64 {
        match self.rope_train_seq_len {
            Some(l) if t > l => {
                let r = self.rotary_dims() as f64;
                self.rope_base * (t as f64 / l as f64).powf(r / (r - 2.0))
            }
            _ => self.rope_base,
        }
    }

    /// Whether physical block `layer` applies exclusive self-attention.
    pub fn xsa(&self, layer: usize) -> bool {
        layer + self.xsa_last_n >= self.num_layers
    }

    /// Whether the model has depth recurrence (`num_loops > 0`).
    pub fn recurrent(&self) -> bool {
        self.num_loops > 0
    }

    /// The physical blocks in the order a forward pass runs them: `0..num_layers`, or with
    /// looping on `[0, loop_start) + [loop_start..=loop_end] * (num_loops + 1) + (loop_end,
    /// num_layers)` (the record: `[0,1,2,3,4,5,3,4,5,3,4,5,6,7,8,9,10]`).
    pub fn layer_sequence(&self, looped: bool) -> Vec<usize> {
        if !(looped && self.recurrent()) {
            return (0..self.num_layers).collect();
        }
        let mut seq: Vec<usize> = (0..self.loop_start).collect();
        for _ in 0..=self.num_loops {
            seq.extend(self.loop_start..=self.loop_end);
        }
        seq.extend(self.loop_end + 1..self.num_layers);
        seq
    }

    /// The encoder and decoder halves of [`ModelConfig::layer_sequence`]: the first
    /// `len / 2` entries push U-Net skips, the rest pop them.
    pub fn encoder_decoder(&self, looped: bool) -> (Vec<usize>, Vec<usize>) {
        let mut enc = self.layer_sequence(looped);
        let dec = enc.split_off(enc.len() / 2);
        (enc, dec)
    }

    /// The first block of the two-lane decoder, when it has one (`parallel_decoder_start`, 0
    /// meaning none as the record's PARALLEL_START_LAYER=0 does).
    pub fn lanes_from(&self) -> Option<usize> {
        self.parallel_decoder_start.filter(|&s| s > 0)
    }

    /// Whether physical block `layer` runs on the two-lane decoder's lanes.
    pub fn two_lane(&self, layer: usize) -> bool {
        self.lanes_from().is_some_and(|start| layer >= start)
    }

    /// Whether physical block `layer` runs attention and MLP in parallel.
    pub fn parallel(&self, layer: usize) -> bool {
        self.parallel_residual_start.is_some_and(|start| layer >= start)
    }

    /// The factor on block `layer`'s normed inputs: `1/sqrt(layer + 1)` under `ln_scale`.
    pub fn ln_scale_of(&self, layer: usize) -> Option<f64> {
        self.ln_scale.then(|| 1.0 / ((layer + 1) as f64).sqrt())
    }

    /// Where attention segments start under `document_attention` (`bos_id`, `document_max_len`).
    pub fn doc_rule(&self) -> crate::model::ops::DocRule {
        crate::model::ops::DocRule { bos: self.bos_id, max_len: self.document_max_len as u32 }
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.model_dim / self.num_heads
    }

    /// Width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim()
    }

    /// Learned skip vectors: `min(encoders, decoders)` of the longest layout (the looped one
    /// under recurrence: the record's 8), so that every skip of either layout has its row.
    pub fn skip_count(&self) -> usize {
        let (enc, dec) = self.encoder_decoder(true);
        enc.len().min(dec.len())
    }

    /// Every parameter's name and shape, in `state_dict` order: what [`crate::model::Gpt::new`]
    /// makes, known without allocating anything (the memory estimate needs it before a model
    /// too big to fit is made).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (v, d, kvd, hidden) = (self.vocab_size, self.model_dim, self.kv_dim(), self.mlp_mult.saturating_mul(self.model_dim));
        let mut out = vec![("tok_emb.weight".to_string(), vec![v, d]), ("skip_weights".to_string(), vec![self.skip_count(), d])];
        if self.skip_gates {
            out.push(("skip_gates".to_string(), vec![self.skip_count(), d]));
        }
        for i in 0..self.num_layers {
            let p = |s: &str| format!("blocks.{i}.{s}");
            out.extend([
                (p("attn.c_q.weight"), vec![d, d]),
                (p("attn.c_k.weight"), vec![kvd, d]),
                (p("attn.c_v.weight"), vec![kvd, d]),
                (p("attn.proj.weight"), vec![d, d]),
                (p("attn.q_gain"), vec![self.num_heads]),
                (p("mlp.fc.weight"), vec![hidden, d]),
                (p("mlp.proj.weight"), vec![d, hidden]),
                (p("attn_scale"), vec![d]),
                (p("mlp_scale"), vec![d]),
                (p("resid_mix"), vec![2, d]),
            ]);
            if self.attn_gate {
                out.push((p("attn.attn_gate_w"), vec![self.num_heads, self.attn_gate_window]));
            }
        }
        if self.lanes_from().is_some() {
            out.push(("parallel_post_lambdas".to_string(), vec![self.num_layers, 2, 2]));
            out.push(("parallel_resid_lambdas".to_string(), vec![self.num_layers, 2]));
        }
        if self.smear_gate {
            out.push(("smear_gate.weight".to_string(), vec![1, self.smear_gate_window]));
            out.push(("smear_lambda".to_string(), vec![1]));
        }
        if self.bigram_vocab_size > 0 {
            out.push(("bigram.embed.weight".to_string(), vec![self.bigram_vocab_size, self.bigram_dim]));
            if self.bigram_dim != d {
                out.push(("bigram.proj.weight".to_string(), vec![d, self.bigram_dim]));
            }
            out.push(("bigram.scale".to_string(), vec![1]));
        }
        if !self.tie_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, d]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_has_its_parameter_count_groups_and_layer_order() {
        let cfg = ModelConfig::record();
        cfg.check().unwrap();
        let shapes = cfg.param_shapes();
        let count: usize = shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(count, 35_944_536, "model_params of the 04-09 record's log");
        let group = |g| shapes.iter().filter(|(n, s)| crate::model::gpt_group_of(n, s.len()) == g).count();
        use crate::model::ParamGroup::*;
        assert_eq!((group(Matrix), group(Embedding), group(Scalar)), (66, 1, 46));
        assert_eq!(cfg.layer_sequence(true), [0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(cfg.encoder_decoder(true), (vec![0, 1, 2, 3, 4, 5, 3, 4], vec![5, 3, 4, 5, 6, 7, 8, 9, 10]));
        assert_eq!(cfg.encoder_decoder(false), (vec![0, 1, 2, 3, 4], vec![5, 6, 7, 8, 9, 10]));
        assert_eq!(cfg.skip_count(), 8);
        assert_eq!((cfg.rotary_dims(), cfg.rope_base_for(2048)), (16, 10_000.0), "never rescaled at the training length");
        let rescaled = 10_000.0 * 2f64.powf(16.0 / 14.0);
        assert!((cfg.rope_base_for(4096) - rescaled).abs() < 1e-9);
        assert!((0..11).all(|l| cfg.xsa(l)));
        assert!(!cfg.parallel(6) && cfg.parallel(7) && cfg.parallel(10));
    }

    /// The 04-27 record: its log's parameter count, its optimizer groups (the new tensors are
    /// Adam's), and `pipelines/record-0427.toml`'s `[model]` is this config.
    #[test]
    fn the_04_27_record_has_its_parameter_count_and_config() {
        let cfg = ModelConfig::record_0427();
        cfg.check().unwrap();
        let shapes = cfg.param_shapes();
        let count: usize = shapes.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(count, 35_945_671, "model_params of the 04-27 record's log");
        use crate::model::ParamGroup::*;
        for (name, s) in &shapes {
            if name.contains("attn_gate") || name.contains("smear") || name.starts_with("parallel_") {
                assert_eq!(crate::model::gpt_group_of(name, s.len()), Scalar, "{name}");
            }
        }
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/pipelines/record-0427.toml")).unwrap();
        let table: toml::Table = text.parse().unwrap();
        let model: ModelConfig = table["model"].clone().try_into().unwrap();
        assert_eq!(model.differences(&cfg), vec![], "pipelines/record-0427.toml's [model]");
    }

    /// Layer orders for several loop settings: the sequence, its halves and the skip count.
    #[test]
    fn layer_sequences_for_several_loops() {
        let cfg = |layers, start, end, loops| ModelConfig {
            num_layers: layers,
            loop_start: start,
            loop_end: end,
            num_loops: loops,
            ..ModelConfig::default()
        };
        // (config, looped sequence, encoder length, skips)
        let cases = [
            (cfg(9, 0, 0, 0), vec![0, 1, 2, 3, 4, 5, 6, 7, 8], 4, 4),
            (cfg(4, 1, 2, 1), vec![0, 1, 2, 1, 2, 3], 3, 3),
            (cfg(4, 0, 3, 1), vec![0, 1, 2, 3, 0, 1, 2, 3], 4, 4),
            (cfg(5, 4, 4, 3), vec![0, 1, 2, 3, 4, 4, 4, 4], 4, 4),
            (cfg(3, 0, 0, 2), vec![0, 0, 0, 1, 2], 2, 2),
            (cfg(1, 0, 0, 1), vec![0, 0], 1, 1),
        ];
        for (c, seq, enc, skips) in cases {
            c.check().unwrap();
            assert_eq!(c.layer_sequence(true), seq, "{c:?}");
            assert_eq!(c.layer_sequence(false), (0..c.num_layers).collect::<Vec<_>>());
            let (e, d) = c.encoder_decoder(true);
            assert_eq!((e.len(), e.len() + d.len()), (enc, seq.len()));
            assert_eq!(c.skip_count(), skips);
        }
        // Without loops the baseline's U-Net: 4 skips of 9 layers, as before.
        assert_eq!(ModelConfig::default().skip_count(), 4);
    }

    /// BigramHash's keys are checked, each refusal naming its key: one bucket besides the first
    /// position's is the least, the table at most as wide as the model, and the vocabulary small
    /// enough for the records' 32-bit hash; off (0 buckets) nothing else is read.
    #[test]
    fn bigram_keys_are_checked_and_named() {
        let on = ModelConfig { bigram_vocab_size: 2, bigram_dim: 512, ..ModelConfig::default() };
        on.check().unwrap();
        assert_eq!(on.param_shapes().iter().filter(|(n, _)| n.starts_with("bigram.")).count(), 2, "no projection at the model's width");
        for (bad, key) in [
            (ModelConfig { bigram_vocab_size: 1, ..on.clone() }, "`model.bigram_vocab_size`"),
            (ModelConfig { bigram_dim: 513, ..on.clone() }, "`model.bigram_dim`"),
            (ModelConfig { bigram_dim: 0, ..on.clone() }, "`model.bigram_dim`"),
            (ModelConfig { vocab_size: 60_000, ..on.clone() }, "`model.vocab_size`"),
        ] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
        ModelConfig { bigram_vocab_size: 0, bigram_dim: 0, vocab_size: 60_000, ..ModelConfig::default() }.check().unwrap();
    }
}
