//! Phased TTT's settings (record spec §5.4, §5.5, §5.7), with the 2026-04-14 record's values as
//! defaults, and their checks.

/// Settings of phased TTT. The defaults are PR #1626's (spec §5.7). The keys of the
/// `ttt_eval/phased` stage, flattened into its table.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(default)]
pub struct PhasedConfig {
    /// LoRA rank of every adapter: q, k, v, o and MLP per slot of the layer sequence, and the
    /// output head (96).
    pub lora_rank: usize,
    /// AdamW learning rate of the adapters (1e-4, constant).
    pub lora_lr: f64,
    /// AdamW betas of the adapters ([0, 0.999]: `β1 = 0`, no first moment).
    pub lora_betas: (f64, f64),
    /// AdamW epsilon (1e-10).
    pub lora_eps: f64,
    /// AdamW decoupled weight decay of the adapters (0.5).
    pub lora_weight_decay: f64,
    /// LoRA alpha: every adapter's output is scaled by `alpha / lora_rank` (PR #1767,
    /// `TTT_LORA_ALPHA`, 144 in the 04-27 record); unset: not scaled (PR #1626).
    pub lora_alpha: Option<f64>,
    /// Warm start of A (PR #1767, `TTT_WARM_START_A`, on in the 04-27 record): a full batch's
    /// adapters start from the last full batch's A with B zeroed (and a fresh optimizer), within
    /// a phase; a phase's global SGD draws fresh adapters. False (PR #1626): a fresh A for every
    /// batch.
    pub lora_warm_start_a: bool,
    /// Targets per chunk of a document (`TTT_CHUNK_SIZE`, 48): scored, then one update.
    pub chunk: usize,
    /// Most tokens of context a chunk's window holds, all of its own document
    /// (`TTT_EVAL_SEQ_LEN`, 2048).
    pub context: usize,
    /// Documents per batch of the work queue, sorted by length, longest batch first
    /// (`TTT_BATCH_SIZE`, 64).
    pub batch_docs: usize,
    /// Documents scored before the last phase's pause (`PHASED_TTT_PREFIX_DOCS`, 2000); the
    /// pauses fall at `prefix_docs * k / phases`.
    pub prefix_docs: usize,
    /// Phases of global SGD on the base model (`PHASED_TTT_NUM_PHASES`, 3); 0: per-document
    /// LoRA TTT only.
    pub phases: usize,
    /// Tokens per chunk of a phase's training stream (`GLOBAL_TTT_CHUNK_TOKENS`, 32768); its
    /// last chunk is not trained on.
    pub global_chunk_tokens: usize,
    /// Sequence length of the global SGD, attention kept inside documents (2048 in the record).
    /// As a stage's key it defaults to 0: the run's `train.seq_len`.
    #[serde(default)]
    pub global_seq_len: usize,
    /// Peak learning rate of the global SGD, cosine-decayed over a phase's chunks (0.001).
    pub global_lr: f64,
    /// SGD momentum of the global SGD (0.9; a fresh optimizer each phase, no weight decay).
    pub global_momentum: f64,
    /// Passes over each global chunk (1).
    pub global_epochs: usize,
    /// Sequences per global SGD step, at most (32).
    pub global_batch_seqs: usize,
    /// Global gradient-norm clip of the global SGD (1.0); 0 turns clipping off.
    pub global_grad_clip: f64,
}

impl PhasedConfig {
    /// The adapters' settings.
    pub fn lora_spec(&self) -> crate::eval::lora::LoraSpec {
        crate::eval::lora::LoraSpec {
            rank: self.lora_rank,
            alpha: self.lora_alpha,
            lr: self.lora_lr,
            betas: self.lora_betas,
            eps: self.lora_eps,
            weight_decay: self.lora_weight_decay,
        }
    }
}

impl Default for PhasedConfig {
    /// PR #1626's values (spec §5.4, §5.5).
    fn default() -> Self {
        Self {
            lora_rank: 96,
            lora_lr: 1e-4,
            lora_betas: (0.0, 0.999),
            lora_eps: 1e-10,
            lora_weight_decay: 0.5,
            lora_alpha: None,
            lora_warm_start_a: false,
            chunk: 48,
            context: 2048,
            batch_docs: 64,
            prefix_docs: 2000,
            phases: 3,
            global_chunk_tokens: 32_768,
            global_seq_len: 2048,
            global_lr: 0.001,
            global_momentum: 0.9,
            global_epochs: 1,
            global_batch_seqs: 32,
            global_grad_clip: 1.0,
        }
    }
}

impl PhasedConfig {
    /// Checks the settings; errors name the key.
    pub fn check(&self) -> anyhow::Result<()> {
        let finite_nonneg = |key: &str, x: f64| {
            anyhow::ensure!(x.is_finite() && x >= 0.0, "`{key}` must be a finite number >= 0, got {x}");
            Ok(())
        };
        anyhow::ensure!(self.lora_rank >= 1, "`lora_rank` must be at least 1");
        finite_nonneg("lora_lr", self.lora_lr)?;
        let (b1, b2) = self.lora_betas;
        anyhow::ensure!((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2), "`lora_betas` must both be in [0, 1), got ({b1}, {b2})");
        anyhow::ensure!(self.lora_eps.is_finite() && self.lora_eps > 0.0, "`lora_eps` must be a finite number > 0, got {}", self.lora_eps);
        finite_nonneg("lora_weight_decay", self.lora_weight_decay)?;
        if let Some(a) = self.lora_alpha {
            anyhow::ensure!(a.is_finite() && a > 0.0, "`lora_alpha` must be a finite number > 0 (144 in the record), got {a}");
        }
        anyhow::ensure!(self.chunk >= 1, "`chunk` must be at least 1");
        anyhow::ensure!(
            self.context >= self.chunk,
            "`context` ({}) must be at least `chunk` ({}): a window holds its chunk",
            self.context,
            self.chunk
        );
        anyhow::ensure!(self.batch_docs >= 1, "`batch_docs` must be at least 1");
        anyhow::ensure!(
            self.phases == 0 || self.prefix_docs >= self.phases,
            "`prefix_docs` ({}) must be at least `phases` ({})",
            self.prefix_docs,
            self.phases
        );
        anyhow::ensure!(self.global_seq_len >= 1, "`global_seq_len` must be at least 1");
        anyhow::ensure!(
            self.global_chunk_tokens >= self.global_seq_len,
            "`global_chunk_tokens` ({}) must be at least `global_seq_len` ({})",
            self.global_chunk_tokens,
            self.global_seq_len
        );
        finite_nonneg("global_lr", self.global_lr)?;
        anyhow::ensure!(
            self.global_momentum.is_finite() && (0.0..1.0).contains(&self.global_momentum),
            "`global_momentum` must be in [0, 1), got {}",
            self.global_momentum
        );
        anyhow::ensure!(self.global_epochs >= 1, "`global_epochs` must be at least 1");
        anyhow::ensure!(self.global_batch_seqs >= 1, "`global_batch_seqs` must be at least 1");
        finite_nonneg("global_grad_clip", self.global_grad_clip)
    }

    /// The most sequences one rank of `world` trains on in a global SGD step, and the key that
    /// bounds them: at most `global_batch_seqs`, and at most a chunk's whole sequences
    /// (`global_chunk_tokens / global_seq_len`), shared between the ranks. The rows of the
    /// engine that runs the global SGD, and what the memory estimate counts.
    pub fn global_rows_per_rank(&self, world: usize) -> (usize, &'static str) {
        crate::eval::ttt::step_rows_per_rank(
            (self.global_chunk_tokens, self.global_seq_len, self.global_batch_seqs),
            world,
            ["global_chunk_tokens", "global_batch_seqs"],
        )
    }

    /// Chunks of a global SGD stream of `tokens` tokens: `⌈(tokens − 1) / global_chunk_tokens⌉`
    /// (spec §5.5); the last is not trained on.
    pub fn global_chunks(&self, tokens: usize) -> usize {
        tokens.saturating_sub(1).div_ceil(self.global_chunk_tokens)
    }

    /// The global SGD's learning rate at chunk `c` of `n`: `global_lr · ½(1 + cos(π·c / max(n − 1, 1)))`.
    pub fn global_chunk_lr(&self, c: usize, n: usize) -> f64 {
        crate::eval::ttt::chunk_cosine(self.global_lr, c, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_records_and_pass() {
        let c = PhasedConfig::default();
        c.check().unwrap();
        assert_eq!((c.lora_rank, c.chunk, c.context, c.batch_docs, c.prefix_docs, c.phases), (96, 48, 2048, 64, 2000, 3));
        assert_eq!(c.global_chunks(32_769), 1);
        assert_eq!(c.global_chunks(32_770), 2);
        assert!((c.global_chunk_lr(0, 95) - 0.001).abs() < 1e-15);
        assert!(c.global_chunk_lr(94, 95).abs() < 1e-15);
        assert!((c.global_chunk_lr(0, 1) - 0.001).abs() < 1e-15);
    }

    #[test]
    fn bad_settings_name_their_key() {
        let bad = |f: &dyn Fn(&mut PhasedConfig), key: &str| {
            let mut c = PhasedConfig::default();
            f(&mut c);
            let e = c.check().unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")), "{key}: {e}");
        };
        bad(&|c| c.lora_rank = 0, "lora_rank");
        bad(&|c| c.lora_lr = f64::NAN, "lora_lr");
        bad(&|c| c.lora_betas = (0.0, 1.0), "lora_betas");
        bad(&|c| c.lora_eps = 0.0, "lora_eps");
        bad(&|c| c.lora_weight_decay = -1.0, "lora_weight_decay");
        bad(&|c| c.lora_alpha = Some(0.0), "lora_alpha");
        bad(&|c| c.chunk = 0, "chunk");
        bad(&|c| c.context = 32, "context");
        bad(&|c| c.batch_docs = 0, "batch_docs");
        bad(&|c| c.prefix_docs = 2, "prefix_docs");
        bad(&|c| c.global_chunk_tokens = 100, "global_chunk_tokens");
        bad(&|c| c.global_lr = -0.1, "global_lr");
        bad(&|c| c.global_momentum = 1.0, "global_momentum");
        bad(&|c| c.global_epochs = 0, "global_epochs");
        bad(&|c| c.global_batch_seqs = 0, "global_batch_seqs");
        bad(&|c| c.global_grad_clip = f64::INFINITY, "global_grad_clip");
        let mut c = PhasedConfig { phases: 0, prefix_docs: 0, ..Default::default() };
        c.check().unwrap();
        c.phases = 1;
        assert!(c.check().is_err());
    }
}
