//! The GPT application's config: `[train]` ([`TrainConfig`]), and [`Config`], which joins it
//! to the runtime's `[run]` and stage tables, `[data]` and `[model]`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use figment::value::Dict;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::data::batch::BatchShape;
use crate::data::config::DataConfig;
use crate::eval::validation::ValSettings;
use crate::model::ModelConfig;
use crate::runtime::config::{RunConfig, Tables};
use crate::runtime::stage::Extensions;

/// `[train]`: the shape of a training step, its schedule, optimizers, validation and logging.
/// Defaults are the challenge baseline's (`train_gpt.py`; its environment variable in brackets).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Tokens per sequence [TRAIN_SEQ_LEN].
    pub seq_len: usize,
    /// Tokens per optimizer step over all ranks, the global batch [TRAIN_BATCH_TOKENS].
    pub batch_tokens: usize,
    /// Micro-batches per step on each rank; 0 means 8 / world_size, as the challenge scripts do.
    pub grad_accum_steps: usize,
    /// Optimizer steps to train for [ITERATIONS]; the step-based warm-down ends here.
    pub iterations: u64,
    /// Steps of linear LR warm-down to 0 [WARMDOWN_ITERS]; with a wall-clock cap, this many
    /// average step times before the cap.
    pub warmdown_iters: u64,
    /// Training-time cap in seconds (validation excluded) [MAX_WALLCLOCK_SECONDS]; 0: none. The
    /// step that crosses it is the last; final validation still runs.
    pub max_wallclock_seconds: f64,
    /// Learning rate of the block matrices (Muon) [MATRIX_LR].
    pub matrix_lr: f64,
    /// Learning rate of the control tensors and skip weights (Adam) [SCALAR_LR].
    pub scalar_lr: f64,
    /// Learning rate of the tied embedding (Adam) [TIED_EMBED_LR].
    pub tied_embed_lr: f64,
    /// Learning rate of the untied embedding (Adam) [EMBED_LR].
    pub embed_lr: f64,
    /// Learning rate of the untied output head (Adam) [HEAD_LR].
    pub head_lr: f64,
    /// Adam beta1 [BETA1].
    pub beta1: f64,
    /// Adam beta2 [BETA2].
    pub beta2: f64,
    /// Adam epsilon [ADAM_EPS].
    pub adam_eps: f64,
    /// Muon momentum after warm-up [MUON_MOMENTUM].
    pub muon_momentum: f64,
    /// Muon momentum at step 0 [MUON_MOMENTUM_WARMUP_START].
    pub muon_momentum_warmup_start: f64,
    /// Steps over which Muon momentum rises linearly to `muon_momentum` [MUON_MOMENTUM_WARMUP_STEPS].
    pub muon_momentum_warmup_steps: u64,
    /// Newton-Schulz iterations per Muon step [MUON_BACKEND_STEPS].
    pub muon_backend_steps: usize,
    /// Clip the global gradient norm to this value before the optimizer step [GRAD_CLIP_NORM]; 0: off.
    pub grad_clip_norm: f64,
    /// Validate every this many steps, and at step 0 and the last step [VAL_LOSS_EVERY]; 0: only
    /// the final validation.
    pub val_every: u64,
    /// Tokens per validation batch over all ranks [VAL_BATCH_SIZE].
    pub val_batch_tokens: usize,
    /// Score only the first this many validation targets (rounded down to whole sequences);
    /// 0: the whole split, as the challenge does. For quick CPU runs; the log says when it applies.
    pub val_max_tokens: usize,
    /// Log the training loss at steps 1 to 10 and every this many steps [TRAIN_LOG_EVERY].
    pub log_every: u64,
    /// Log the time breakdown (input wait, H2D, forward, backward, optimizer, validation) every
    /// this many steps; 0: off.
    pub timing_every: u64,
    /// Save the final weights as `RUN_DIR/final_model.safetensors` (PyTorch `state_dict` names).
    pub save_weights: bool,
    /// Start from these weights (a safetensors file with the model's tensor names) instead of
    /// the seeded initialisation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub init_weights: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            seq_len: 1024,
            batch_tokens: 524_288,
            grad_accum_steps: 0,
            iterations: 20_000,
            warmdown_iters: 1_200,
            max_wallclock_seconds: 600.0,
            matrix_lr: 0.04,
            scalar_lr: 0.04,
            tied_embed_lr: 0.05,
            embed_lr: 0.6,
            head_lr: 0.008,
            beta1: 0.9,
            beta2: 0.95,
            adam_eps: 1e-8,
            muon_momentum: 0.95,
            muon_momentum_warmup_start: 0.85,
            muon_momentum_warmup_steps: 500,
            muon_backend_steps: 5,
            grad_clip_norm: 0.0,
            val_every: 1_000,
            val_batch_tokens: 524_288,
            val_max_tokens: 0,
            log_every: 200,
            timing_every: 200,
            save_weights: true,
            init_weights: None,
        }
    }
}

/// The GPT application's whole config: the runtime's `[run]` and stage tables, and the tables
/// of the areas it trains with. Stages read it as a typed extension of their build context
/// ([`Config::extensions`]).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[run]`.
    #[serde(default)]
    pub run: RunConfig,
    /// `[data]`.
    #[serde(default)]
    pub data: DataConfig,
    /// `[model]`: the GPT's shape.
    #[serde(default)]
    pub model: ModelConfig,
    /// `[train]`.
    #[serde(default)]
    pub train: TrainConfig,
    /// `[stages.NAME]`, raw until the graph builder resolves them.
    #[serde(default, skip_serializing)]
    pub stages: BTreeMap<String, Dict>,
}

impl Tables for Config {
    fn run(&self) -> &RunConfig {
        &self.run
    }
    fn stages(&self) -> &BTreeMap<String, Dict> {
        &self.stages
    }
}

impl Config {
    /// The shape of a step's batches (`[train]` over `[run]`'s ranks), with an error naming the
    /// keys that do not divide.
    pub fn batch_shape(&self) -> anyhow::Result<BatchShape> {
        let t = &self.train;
        BatchShape::new(t.seq_len, t.batch_tokens, t.grad_accum_steps, self.run.world_size, self.run.rank)
    }

    /// What validation reads of this config ([`ValSettings`]).
    pub fn validation(&self) -> ValSettings {
        ValSettings {
            val: self.data.val.clone(),
            tokenizer: self.data.tokenizer.clone(),
            seq_len: self.train.seq_len,
            val_batch_tokens: self.train.val_batch_tokens,
            val_max_tokens: self.train.val_max_tokens,
            vocab: self.model.vocab_size,
            world_size: self.run.world_size,
            rank: self.run.rank,
        }
    }

    /// What the stages of a run read besides their own parameters: this config, as a typed
    /// extension (`ctx.ext::<Config>()`). The caller adds the resume state when there is one.
    pub fn extensions(&self) -> Extensions {
        let mut ext = Extensions::default();
        ext.insert(self.clone());
        ext
    }
}
