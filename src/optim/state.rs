//! Optimizer state as named tensors in a checkpoint: names, and loading with a shape check.

#[cfg(feature = "candle")]
use std::collections::{HashMap, HashSet};

#[cfg(feature = "candle")]
use candle_core::Tensor;

/// The state-tensor name `"{prefix}.{param}.{what}"`.
#[cfg(feature = "candle")]
pub(super) fn state_name(prefix: &str, param: &str, what: &str) -> String {
    format!("{prefix}.{param}.{what}")
}

/// Takes tensor `name` from `tensors`, checking its shape against `like` and converting it to
/// `like`'s dtype and device.
#[cfg(feature = "candle")]
pub(super) fn take_state(tensors: &HashMap<String, Tensor>, name: &str, like: &Tensor) -> anyhow::Result<Tensor> {
    let t = tensors.get(name).ok_or_else(|| anyhow::anyhow!("optimizer state tensor {name} is missing"))?;
    if t.dims() != like.dims() {
        anyhow::bail!("optimizer state tensor {name} has shape {:?}, expected {:?}", t.dims(), like.dims());
    }
    Ok(t.detach().to_device(like.device())?.to_dtype(like.dtype())?)
}

/// Fails on a tensor in `tensors` that carries `prefix.` but is not in `expected`.
#[cfg(feature = "candle")]
pub(super) fn reject_unexpected(tensors: &HashMap<String, Tensor>, prefix: &str, expected: &HashSet<String>) -> anyhow::Result<()> {
    let dotted = format!("{prefix}.");
    let mut unexpected: Vec<&String> = tensors.keys().filter(|k| k.starts_with(&dotted) && !expected.contains(*k)).collect();
    unexpected.sort();
    if let Some(k) = unexpected.first() {
        anyhow::bail!("unexpected optimizer state tensor {k} (no such parameter in this optimizer)");
    }
    Ok(())
}
