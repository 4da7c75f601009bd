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
        }
    }
}

impl ModelConfig {
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
        Ok(())
    }

    /// Whether physical block `layer` runs attention and MLP in parallel.
    pub fn parallel(&self, layer: usize) -> bool {
        self.parallel_residual_start.is_some_and(|start| layer >= start)
    }

    /// The factor on block `layer`'s normed inputs: `1/sqrt(layer + 1)` under `ln_scale`.
    pub fn ln_scale_of(&self, layer: usize) -> Option<f64> {
        self.ln_scale.then(|| 1.0 / ((layer + 1) as f64).sqrt())
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.model_dim / self.num_heads
    }

    /// Width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim()
    }

    /// Encoder blocks (`num_layers / 2`).
    pub fn encoder_layers(&self) -> usize {
        self.num_layers / 2
    }

    /// Learned skip vectors (`min(encoders, decoders)`).
    pub fn skip_count(&self) -> usize {
        self.encoder_layers().min(self.num_layers - self.encoder_layers())
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
        }
        if !self.tie_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, d]));
        }
        out
    }
}
