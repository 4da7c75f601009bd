//! How a training session trains: the parameters of the `step_executor/candle` stage that
//! drives it (its `[stages.NAME]` table), read by [`crate::train::session`] and checked by
//! [`crate::train::requirements`].

use candle_core::DType;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::model::flash_attn::Attention;

/// Floating-point types of the training.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 32-bit floats throughout (the CPU default).
    #[default]
    F32,
    /// The challenge's mixed precision (GPUs only): f32 master weights and optimizer state,
    /// bf16 matmuls, f32 elsewhere.
    Bf16,
    /// 64-bit floats (for checks).
    F64,
}

impl Precision {
    /// The parameters' dtype and the matmuls'.
    pub fn dtypes(self) -> (DType, DType) {
        match self {
            Precision::F32 => (DType::F32, DType::F32),
            Precision::Bf16 => (DType::F32, DType::BF16),
            Precision::F64 => (DType::F64, DType::F64),
        }
    }
}

/// How a session trains: the parameters of the `step_executor/candle` stage that drives it.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SessionParams {
    /// Parameter and activation type: "f32", "bf16" or "f64".
    pub dtype: Precision,
    /// Show a progress bar when stdout is a terminal (log lines print above it).
    pub progress: bool,
    /// Attention kernel on a GPU: "auto" (flash attention where it applies: CUDA, bf16, head
    /// dim 64, `seq_len` a multiple of 64; before training, each flash implementation is
    /// checked against the materialised attention and timed at the run's shapes in a process of
    /// its own; `flash_mma` is taken if it agrees and is over 5% faster, or if "flash" is left
    /// out; the train log's `attention_auto` line), "flash" (refuse a run it cannot take),
    /// "flash_mma" (as "flash", on the register-fragment kernels of kernels/flash_mma.cu) or
    /// "materialized" (scores and probabilities stored, for ablations).
    pub attention: Attention,
    /// Wait for the GPU at the end of each phase (forward, backward, optimizer). Off (the
    /// default), the host waits once per step (the loss read) and the report's phase times come
    /// from CUDA events recorded at the phase boundaries; on, from the host's clock after each
    /// wait (slower: the GPU idles while the host queues the next phase). No effect on the CPU.
    pub sync_phases: bool,
    /// Write `RUN_DIR/step_trace/`: the weights before the first step, every micro-batch's tokens
    /// and a row per step (loss, gradient norm, LR multiplier, momentum, looping), so that
    /// another trainer can take the same steps and compare (`scripts/compare-record.py`,
    /// docs/record.md). Costs a copy of each batch to the host; refused with `--resume`.
    pub step_trace: bool,
    /// With `step_trace`: also save the weights after these steps (the last step's always are).
    pub step_trace_weights_at: Vec<u64>,
}

impl Default for SessionParams {
    fn default() -> Self {
        Self {
            dtype: Precision::F32,
            progress: true,
            attention: Attention::Auto,
            sync_phases: false,
            step_trace: false,
            step_trace_weights_at: Vec::new(),
        }
    }
}
