//! The GPT application's config: `[train]` ([`TrainConfig`]), and [`Config`], which joins it
//! to the runtime's `[run]` and stage tables, `[data]` and `[model]`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use figment::value::Dict;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::report::ablation::plan::AblationConfig;

use crate::data::batch::BatchShape;
use crate::data::config::DataConfig;
use crate::eval::validation::ValSettings;
use crate::model::ModelConfig;
use crate::runtime::config::{RunConfig, Tables};
use crate::runtime::stage::Extensions;

/// The layout of saved weights (`train.weights_layout`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum WeightsLayout {
    /// One tensor per block matrix (`blocks.i.attn.c_q.weight`, ...).
    #[default]
    Blocks,
    /// The 04-27 record's banks ([`crate::model::banks`]).
    Banks,
}

impl WeightsLayout {
    /// `state` (our `state_dict` of a `layers`-block model) in this layout.
    pub fn apply(self, state: Vec<(String, candle_core::Tensor)>, layers: usize) -> anyhow::Result<Vec<(String, candle_core::Tensor)>> {
        match self {
            Self::Blocks => Ok(state),
            Self::Banks => crate::model::banks::to_banks(&state, layers),
        }
    }
}

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
    /// Seconds taken off `max_wallclock_seconds` for the stopping rule and the LR schedule,
    /// kept for the work after training (the 04-09 record: 12, for GPTQ) [GPTQ_RESERVE_SECONDS];
    /// 0: none. Must be below the cap; without a cap it has no effect.
    pub gptq_reserve_seconds: f64,
    /// The 04-09 record's warm-down: the last this fraction of the training budget (time under a
    /// cap, else steps; see [`TrainConfig::training_frac`]) decays the LR linearly to `min_lr`
    /// (the record: 0.72) [WARMDOWN_FRAC]. In [0, 1]; 0: off, and `warmdown_iters` applies.
    pub warmdown_frac: f64,
    /// Floor on the LR multiplier during the warm-down (the record: 0) [MIN_LR]. In [0, 1].
    pub min_lr: f64,
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
    /// Newton-Schulz coefficients: "quintic" (the same `(3.4445, -4.7750, 2.0315)` every
    /// iteration; the baseline and the 04-09 record) or "polar_express" (per-iteration tuples,
    /// at most 5 steps; the 04-27 record).
    pub muon_ns: crate::optim::NewtonSchulz,
    /// MuonEq-R: each row of the Muon update divided by its L2 norm before Newton-Schulz (the
    /// 04-09 record: true).
    pub muon_row_norm: bool,
    /// Decoupled weight decay of the block matrices: `P ← P·(1 − lr·wd)` each step before the
    /// Muon update (the 04-09 record: 0.095); 0: none.
    pub muon_weight_decay: f64,
    /// AdamW weight decay of the embedding, tied or not (the 04-09 record: 0.085) [EMBED_WD]; 0:
    /// plain Adam.
    pub embed_weight_decay: f64,
    /// AdamW weight decay of the control tensors and skip weights/gates (the 04-09 record: 0.02)
    /// [ADAM_WD]; 0: plain Adam.
    pub scalar_weight_decay: f64,
    /// AdamW weight decay of an untied output head (the record keeps plain Adam: 0).
    pub head_weight_decay: f64,
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
    /// Score each validation batch as one row of all its tokens, as the 04-27 record's
    /// `eval_val` does: its documents kept apart by `model.document_attention` and cut every
    /// `model.document_max_len`, so that a document reads past the rows' edges, SmearGate too.
    /// false: rows of `seq_len`, each on its own (the baseline's and the 04-09 record's).
    pub val_packed: bool,
    /// Log the training loss at steps 1 to 10 and every this many steps [TRAIN_LOG_EVERY].
    pub log_every: u64,
    /// Log the time breakdown (input wait, H2D, forward, backward, optimizer, validation) every
    /// this many steps; 0: off.
    pub timing_every: u64,
    /// Save the final weights as `RUN_DIR/final_model.safetensors` (PyTorch `state_dict` names).
    pub save_weights: bool,
    /// The tensor names of the saved weights (`final_model.safetensors`, a step trace's):
    /// "blocks" (one tensor per block matrix, as the baseline's and the 04-09 record's GPT hold
    /// them) or "banks" (the 04-27 record's `qo_bank`, `kv_bank`, `mlp_up_bank`,
    /// `mlp_down_bank`: what its GPT's `load_state_dict` reads). Either loads back.
    pub weights_layout: WeightsLayout,
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
            gptq_reserve_seconds: 0.0,
            warmdown_frac: 0.0,
            min_lr: 0.0,
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
            muon_ns: crate::optim::NewtonSchulz::Quintic,
            muon_row_norm: false,
            muon_weight_decay: 0.0,
            embed_weight_decay: 0.0,
            scalar_weight_decay: 0.0,
            head_weight_decay: 0.0,
            grad_clip_norm: 0.0,
            val_every: 1_000,
            val_batch_tokens: 524_288,
            val_max_tokens: 0,
            val_packed: false,
            log_every: 200,
            timing_every: 200,
            save_weights: true,
            weights_layout: WeightsLayout::Blocks,
            init_weights: None,
        }
    }
}

impl TrainConfig {
    /// The training-time cap the run stops at and schedules against, ms:
    /// `(max_wallclock_seconds − gptq_reserve_seconds) · 1000`; 0 when there is no cap
    /// (`max_wallclock_seconds` 0). Without a reserve exactly `max_wallclock_seconds · 1000`.
    pub fn cap_ms(&self) -> f64 {
        if self.max_wallclock_seconds > 0.0 { (self.max_wallclock_seconds - self.gptq_reserve_seconds) * 1e3 } else { 0.0 }
    }

    /// The training fraction of a step that starts after `step` steps and `elapsed_ms` of
    /// training time (validation excluded): `elapsed_ms / cap_ms` under a cap ([`TrainConfig::cap_ms`]),
    /// else `step / iterations` ([`crate::optim::training_frac`]). What the `warmdown_frac`
    /// schedule and the model's depth-recurrence switch read.
    pub fn training_frac(&self, step: u64, elapsed_ms: f64) -> f64 {
        crate::optim::training_frac(step, self.iterations, elapsed_ms, self.cap_ms())
    }

    /// The LR multiplier of a step that starts after `step` steps and `elapsed_ms` of training
    /// time: 0 at or past `iterations`; with `warmdown_frac > 0` the record's rule on
    /// [`TrainConfig::training_frac`] ([`crate::optim::lr_multiplier_frac`]); else the baseline's
    /// `warmdown_iters` rule against [`TrainConfig::cap_ms`] ([`crate::optim::lr_multiplier`]),
    /// floored at `min_lr`.
    pub fn lr_mul(&self, step: u64, elapsed_ms: f64) -> f64 {
        if step >= self.iterations {
            0.0
        } else if self.warmdown_frac > 0.0 {
            crate::optim::lr_multiplier_frac(self.training_frac(step, elapsed_ms), self.warmdown_frac, self.min_lr)
        } else {
            crate::optim::lr_multiplier(step, self.iterations, self.warmdown_iters, elapsed_ms, self.cap_ms()).max(self.min_lr)
        }
    }

    /// The schedule of a step that starts after `step` steps and `elapsed_ms` of training time,
    /// as every executor applies it: `(lr_mul, training fraction, Muon momentum)`.
    pub fn schedule(&self, step: u64, elapsed_ms: f64) -> (f64, f64, f64) {
        let momentum =
            crate::optim::momentum_at(step, self.muon_momentum_warmup_steps, self.muon_momentum_warmup_start, self.muon_momentum);
        (self.lr_mul(step, elapsed_ms), self.training_frac(step, elapsed_ms), momentum)
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
    /// `[ablation]`: what `pipeline ablate` varies (`pipeline run` ignores it).
    #[serde(default, skip_serializing_if = "AblationConfig::is_empty")]
    pub ablation: AblationConfig,
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

    /// The training micro-batch as the sampler makes it and the step executor takes it:
    /// [`Config::batch_shape`]'s rows, or under the `packed_docs` sampler one row of all their
    /// tokens ([`BatchShape::packed`]). Validation, calibration and evaluation read rows.
    pub fn train_shape(&self) -> anyhow::Result<BatchShape> {
        let rows = self.batch_shape()?;
        Ok(if self.packed_docs() { rows.packed() } else { rows })
    }

    /// Whether the training data comes from the `packed_docs` window sampler.
    pub fn packed_docs(&self) -> bool {
        self.stages.values().any(|d| {
            let is = |key: &str, want: &str| d.get(key).and_then(|v| v.as_str()) == Some(want);
            is("kind", "window_sampler") && is("impl", "packed_docs")
        })
    }

    /// What validation reads of this config ([`ValSettings`]). Which ranks share the split is
    /// the collective's business ([`crate::eval::validation::Validator::shared`]).
    pub fn validation(&self) -> ValSettings {
        ValSettings {
            val: self.data.val.clone(),
            tokenizer: self.data.tokenizer.clone(),
            seq_len: self.train.seq_len,
            val_batch_tokens: self.train.val_batch_tokens,
            val_max_tokens: self.train.val_max_tokens,
            vocab: self.model.vocab_size,
            packed: self.train.val_packed,
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

/// The 04-09 record's training elements over the defaults (tests of the keys and their log).
#[cfg(test)]
pub(crate) fn record_train() -> TrainConfig {
    TrainConfig {
        muon_row_norm: true,
        muon_weight_decay: 0.095,
        embed_weight_decay: 0.085,
        scalar_weight_decay: 0.02,
        warmdown_frac: 0.72,
        min_lr: 0.0,
        gptq_reserve_seconds: 12.0,
        ..TrainConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::lr_multiplier;

    /// Without the record's keys the schedule is the baseline's bit for bit: the cap is
    /// `max_wallclock_seconds · 1000` and the multiplier `lr_multiplier`'s, with and without a cap.
    #[test]
    fn defaults_keep_the_baseline_schedule_bit_for_bit() {
        for max in [600.0, 150.0, 0.5, 0.0] {
            let t = TrainConfig { max_wallclock_seconds: max, ..TrainConfig::default() };
            assert_eq!(t.cap_ms().to_bits(), (max * 1e3).to_bits());
            for step in [0u64, 1, 500, 18_800, 19_400, 19_999, 20_000, 20_001] {
                for elapsed in [0.0, 1.0, 123_456.7, 540_000.0, 599_999.0, 600_000.0, 600_038.0] {
                    let old = lr_multiplier(step, t.iterations, t.warmdown_iters, elapsed, max * 1e3);
                    assert_eq!(t.lr_mul(step, elapsed).to_bits(), old.to_bits(), "cap {max} step {step} elapsed {elapsed}");
                }
            }
        }
    }

    /// The record's schedule: the cap 600 s less 12 s, and the warm-down over the last 72 % of it.
    #[test]
    fn record_schedule_on_the_shortened_cap() {
        let t = TrainConfig { gptq_reserve_seconds: 12.0, warmdown_frac: 0.72, ..TrainConfig::default() };
        assert_eq!(t.cap_ms(), 588_000.0);
        assert_eq!(t.training_frac(100, 294_000.0), 0.5);
        assert_eq!(t.lr_mul(100, 0.28 * 588_000.0), 1.0);
        assert!((t.lr_mul(1000, 0.64 * 588_000.0) - 0.5).abs() < 1e-12);
        assert_eq!(t.lr_mul(4000, 588_000.0), 0.0);
        assert_eq!(t.lr_mul(4000, 600_000.0), 0.0);
        // No step at or past `iterations` moves the weights, whatever the clock says.
        assert_eq!(t.lr_mul(20_000, 0.0), 0.0);
        // The floor.
        let floored = TrainConfig { min_lr: 0.1, ..t.clone() };
        assert_eq!(floored.lr_mul(4000, 580_000.0), 0.1);
        assert!((floored.lr_mul(1000, 0.64 * 588_000.0) - 0.5).abs() < 1e-12);
        // Without a cap the fraction counts steps, and the reserve is moot.
        let steps = TrainConfig { max_wallclock_seconds: 0.0, iterations: 1000, ..t };
        assert_eq!(steps.cap_ms(), 0.0);
        assert_eq!(steps.training_frac(640, 1e9), 0.64);
        assert!((steps.lr_mul(640, 1e9) - 0.5).abs() < 1e-12);
        assert_eq!(steps.lr_mul(280, 0.0), 1.0);
    }

    /// `min_lr` floors the baseline's `warmdown_iters` rule too (past the cap the LR stays at it).
    #[test]
    fn min_lr_floors_the_iteration_warmdown() {
        let t = TrainConfig { min_lr: 0.2, max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        assert!((t.lr_mul(19_400, 0.0) - 0.5).abs() < 1e-12);
        assert_eq!(t.lr_mul(19_999, 0.0), 0.2);
        let capped = TrainConfig { min_lr: 0.2, ..TrainConfig::default() };
        assert_eq!(capped.lr_mul(6001, 600_038.0), 0.2);
    }
}
