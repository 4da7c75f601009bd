//! Model weights on disk: safetensors files holding the challenge script's `GPT.state_dict()`
//! (same tensor names and shapes), so that PyTorch loads them with
//! `model.load_state_dict(safetensors.torch.load_file(path))` and `pipeline` loads them back.
//!
//! Files are written atomically (temporary name in the same folder, fsync, rename): a reader or
//! a killed process sees the old file or the new one, never half of one; a full disk leaves the
//! old file in place and an error naming the path.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use candle_core::{DType, Device, Tensor};

/// Writes `tensors` (name, tensor) to `path` as safetensors, atomically
/// ([`crate::runtime::rundir::write_atomic_if_changed`]: a file that already holds these bytes is left
/// alone). Tensors are stored in their own dtype, moved to the CPU first.
pub fn save(path: &Path, tensors: &[(String, Tensor)]) -> anyhow::Result<()> {
    let bytes = (|| -> anyhow::Result<Vec<u8>> {
        let cpu = tensors.iter().map(|(n, t)| Ok((n.as_str(), t.to_device(&Device::Cpu)?))).collect::<anyhow::Result<Vec<_>>>()?;
        Ok(safetensors::serialize(cpu, None)?)
    })()
    .with_context(|| format!("cannot write weights to {}", path.display()))?;
    crate::runtime::rundir::write_atomic_if_changed(path, &bytes).context("cannot write weights")?;
    Ok(())
}

/// Reads every tensor of the safetensors file at `path` onto the CPU, converted to `dtype`
/// when given. Errors name the file (missing, truncated, not safetensors).
pub fn load(path: &Path, dtype: Option<DType>) -> anyhow::Result<HashMap<String, Tensor>> {
    crate::runtime::files::ensure_regular(path).context("cannot read weights")?;
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .with_context(|| format!("cannot read weights from {} (is it a safetensors file?)", path.display()))?;
    match dtype {
        None => Ok(tensors),
        Some(dt) => tensors
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_dtype(dt)?)))
            .collect::<anyhow::Result<_>>()
            .with_context(|| format!("cannot convert the weights of {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::model::{Gpt, ModelConfig};

    fn tiny() -> ModelConfig {
        ModelConfig { vocab_size: 32, num_layers: 2, model_dim: 16, num_heads: 2, num_kv_heads: 1, ..ModelConfig::default() }
    }

    #[test]
    fn weights_round_trip_bit_for_bit() {
        let dir = tempdir();
        let path = dir.join("w.safetensors");
        let a = Gpt::new(&tiny(), 3, DType::F32, &Device::Cpu).unwrap();
        save(&path, &a.state_dict()).unwrap();
        let mut b = Gpt::new(&tiny(), 4, DType::F32, &Device::Cpu).unwrap();
        b.load_state(&load(&path, None).unwrap()).unwrap();
        for ((n, x), (_, y)) in a.state_dict().iter().zip(b.state_dict().iter()) {
            let (x, y): (Vec<f32>, Vec<f32>) = (x.flatten_all().unwrap().to_vec1().unwrap(), y.flatten_all().unwrap().to_vec1().unwrap());
            assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "{n} differs after the round trip");
        }
        assert!(fs::read_dir(&*dir).unwrap().count() == 1, "no temporary file left behind");
    }

    #[test]
    fn truncated_or_foreign_files_are_named() {
        let dir = tempdir();
        let path = dir.join("w.safetensors");
        save(&path, &Gpt::new(&tiny(), 3, DType::F32, &Device::Cpu).unwrap().state_dict()).unwrap();
        let bytes = fs::read(&path).unwrap();
        fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let e = format!("{:#}", load(&path, None).unwrap_err());
        assert!(e.contains("w.safetensors"), "{e}");
        fs::write(&path, b"not weights at all").unwrap();
        assert!(format!("{:#}", load(&path, None).unwrap_err()).contains("w.safetensors"));
    }

    #[test]
    fn a_failed_save_keeps_the_old_file() {
        let dir = tempdir();
        let path = dir.join("w.safetensors");
        let m = Gpt::new(&tiny(), 3, DType::F32, &Device::Cpu).unwrap();
        save(&path, &m.state_dict()).unwrap();
        let before = fs::read(&path).unwrap();
        // A folder in the way of the rename: the write fails after the temporary file is made.
        let blocked = dir.join("sub");
        fs::create_dir_all(blocked.join("x")).unwrap();
        let e = format!("{:#}", save(&blocked, &m.state_dict()).unwrap_err());
        assert!(e.contains("sub"), "{e}");
        assert_eq!(fs::read(&path).unwrap(), before);
        assert!(fs::read_dir(&*dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp-")), "temporary removed");
    }

    /// A fresh folder under the system's temporary directory, removed when the test ends
    /// (passing or not).
    struct TempDir(std::path::PathBuf);

    impl std::ops::Deref for TempDir {
        type Target = std::path::Path;
        fn deref(&self) -> &std::path::Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn tempdir() -> TempDir {
        let d = std::env::temp_dir().join(format!("weights-test-{}-{}", std::process::id(), fastrand::u64(..)));
        fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}
