//! `pipeline artifact`: the challenge's post-training step (spec 3.10) on a weights file.
//! Quantize (per-row int8, or fewer bits), compress (zlib, zstd or brotli), write the artifact
//! atomically, report its size against the 16,000,000-byte cap, then read it back, dequantize,
//! and score the validation split again: the round-trip val_bpb is the challenge's score.
//!
//! Log lines follow the script's (the `_exact` line is the official score):
//! `Serialized model int8+zlib: N bytes (payload:P raw:R payload_ratio:X.XXx)`,
//! `final_int8_zlib_roundtrip val_loss:X val_bpb:Y eval_time:Tms` and
//! `final_int8_zlib_roundtrip_exact val_loss:X val_bpb:Y` (8 decimals).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::artifact::quant::{ARTIFACT_CAP_BYTES, ArtifactStats, QuantConfig, from_bytes, quantize};
use crate::eval::validation::Validator;
use crate::model::Gpt;
use crate::train::config::Config;

/// What `pipeline artifact` measured.
#[derive(Clone, Debug, Serialize)]
pub struct ArtifactReport {
    /// The artifact file.
    pub path: PathBuf,
    /// Its sizes.
    pub stats: ArtifactStats,
    /// Bytes of the weights as float tensors.
    pub raw_bytes: u64,
    /// Whether the artifact alone fits the cap (code bytes not included).
    pub fits_cap: bool,
    /// val_loss / val_bpb of the weights before quantization.
    pub before: (f64, f64),
    /// val_loss / val_bpb after the round trip.
    pub after: (f64, f64),
    /// Scored validation tokens.
    pub val_tokens: u64,
    /// Round-trip evaluation time, ms.
    pub eval_ms: f64,
}

/// An artifact written and read back.
pub struct Written {
    /// Its sizes.
    pub stats: ArtifactStats,
    /// Bytes of the weights as float tensors.
    pub raw_bytes: u64,
    /// The weights dequantized from the file as read back (f32, CPU).
    pub restored: Vec<(String, Tensor)>,
    /// Quantizing and compressing.
    pub quantize: Duration,
    /// Writing the file (atomically).
    pub write: Duration,
    /// Reading it back and dequantizing.
    pub restore: Duration,
}

/// Quantizes `state`, compresses it, writes the artifact atomically to `out`, then reads the
/// file back and dequantizes it, as the challenge's evaluation does.
pub fn write_and_restore(state: &[(String, Tensor)], q: &QuantConfig, out: &Path) -> anyhow::Result<Written> {
    q.check()?;
    let raw_bytes: u64 = state.iter().map(|(_, t)| (t.elem_count() * t.dtype().size_in_bytes()) as u64).sum();
    let t0 = Instant::now();
    let artifact = quantize(state, q)?.compress(q.codec, q.level)?;
    let quantize_time = t0.elapsed();
    let t1 = Instant::now();
    crate::runtime::rundir::write_atomic_if_changed(out, &artifact.bytes)?;
    let write = t1.elapsed();
    let t2 = Instant::now();
    let bytes = std::fs::read(out).with_context(|| format!("cannot read back {}", out.display()))?;
    let restored = from_bytes(&bytes).with_context(|| format!("cannot read the artifact {}", out.display()))?;
    let restored = restored.dequantize(Some(DType::F32), &Device::Cpu)?;
    Ok(Written { stats: artifact.stats, raw_bytes, restored, quantize: quantize_time, write, restore: t2.elapsed() })
}

/// The size lines of the log: the script's `Serialized model ...` line and the cap check.
pub fn size_lines(q: &QuantConfig, out: &Path, w: &Written) -> [String; 2] {
    let s = &w.stats;
    let fits = s.compressed_bytes <= ARTIFACT_CAP_BYTES;
    [
        format!(
            "Serialized model int{}+{}: {} bytes (payload:{} raw:{} payload_ratio:{:.2}x)",
            q.bits,
            q.codec,
            s.compressed_bytes,
            s.payload_bytes,
            w.raw_bytes,
            w.raw_bytes as f64 / s.payload_bytes.max(1) as f64
        ),
        format!(
            "artifact {}: {} bytes of the {ARTIFACT_CAP_BYTES}-byte cap ({}; the code's bytes are not counted here)",
            out.display(),
            s.compressed_bytes,
            if fits { "fits" } else { "OVER THE CAP" }
        ),
    ]
}

/// The default artifact path: beside the weights, `<stem>.int<bits>.<codec>.pgqz`.
pub fn default_path(weights: &Path, q: &QuantConfig) -> PathBuf {
    let stem = weights.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    weights.with_file_name(format!("{stem}.int{}.{}.pgqz", q.bits, q.codec))
}

/// Quantizes `weights` (a safetensors file of the `[model]` in `config`) into `out`, then
/// scores the round trip on one process over the whole validation split, or its first
/// `val_max_tokens` targets when that is not 0 (said in the log); `log` receives the lines.
pub fn build(
    config: &Config,
    weights: &Path,
    q: &QuantConfig,
    out: &Path,
    val_max_tokens: usize,
    mut log: impl FnMut(&str),
) -> anyhow::Result<ArtifactReport> {
    q.check()?;
    // The score is the whole split's, on this one process, whatever the training run capped.
    let mut config = config.clone();
    config.train.val_max_tokens = val_max_tokens;
    config.run.world_size = 1;
    config.run.rank = 0;
    let config = &config;
    let shape = config.batch_shape()?;
    let validator = Validator::load(&config.validation(), shape.micro_steps)?;
    if validator.targets() < validator.split_targets() {
        log(&format!(
            "note: scoring the first {} of the {} validation targets (--val-max-tokens); the challenge scores them all",
            validator.targets(),
            validator.split_targets()
        ));
    }
    let mut model = Gpt::new(&config.model, config.run.seed, DType::F32, &Device::Cpu)?;
    let tensors = crate::model::weights::load(weights, Some(DType::F32))?;
    model.load_state(&tensors).with_context(|| format!("{} does not fit `[model]`", weights.display()))?;
    let score =
        |m: &Gpt| -> anyhow::Result<crate::eval::bpb::BpbAccumulator> { validator.run(m, || true)?.context("validation did not finish") };
    let before = score(&model)?;
    let written = write_and_restore(&model.state_dict(), q, out)?;
    for l in size_lines(q, out, &written) {
        log(&l);
    }
    let (s, raw_bytes) = (written.stats, written.raw_bytes);
    let fits = s.compressed_bytes <= ARTIFACT_CAP_BYTES;
    let state: std::collections::HashMap<_, _> = written.restored.into_iter().collect();
    model.load_state(&state)?;
    let t0 = Instant::now();
    let after = score(&model)?;
    let eval_ms = t0.elapsed().as_secs_f64() * 1e3;
    let tag = format!("final_int{}_{}_roundtrip", q.bits, q.codec);
    log(&format!("pre-quantization val_loss:{:.4} val_bpb:{:.4}", before.val_loss(), before.val_bpb()));
    log(&format!("{tag} val_loss:{:.4} val_bpb:{:.4} eval_time:{eval_ms:.0}ms", after.val_loss(), after.val_bpb()));
    log(&format!("{tag}_exact val_loss:{:.8} val_bpb:{:.8}", after.val_loss(), after.val_bpb()));
    Ok(ArtifactReport {
        path: out.to_path_buf(),
        stats: s,
        raw_bytes,
        fits_cap: fits,
        before: (before.val_loss(), before.val_bpb()),
        after: (after.val_loss(), after.val_bpb()),
        val_tokens: after.tokens(),
        eval_ms,
    })
}

/// A model of `[model]` on the run's device holding `weights` (f32).
pub fn model_from(config: &Config, weights: &[(String, Tensor)]) -> anyhow::Result<Gpt> {
    let device = crate::device::open(&config.run)?;
    let mut model = Gpt::new(&config.model, config.run.seed, DType::F32, &device)?;
    let state: std::collections::HashMap<_, _> = weights.iter().cloned().collect();
    model.load_state(&state).context("the weights do not fit `[model]`")?;
    Ok(model)
}
