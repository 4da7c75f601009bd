//! The 04-27 record's banked weight layout: its GPT keeps the block matrices of every layer in
//! four stacked parameters instead of one per block, so its `state_dict` (what its
//! `load_state_dict` reads) names them so. With `L` layers:
//!
//! | bank | shape | rows `0..L` | rows `L..2L` |
//! |---|---|---|---|
//! | `qo_bank` | `(2L, d, d)` | `blocks.i.attn.c_q.weight` | `blocks.i.attn.proj.weight` |
//! | `kv_bank` | `(2L, kv, d)` | `blocks.i.attn.c_k.weight` | `blocks.i.attn.c_v.weight` |
//! | `mlp_up_bank` | `(L, h, d)` | `blocks.i.mlp.fc.weight` | |
//! | `mlp_down_bank` | `(L, d, h)` | `blocks.i.mlp.proj.weight` | |
//!
//! Every other tensor keeps its name (`tok_emb.weight`, `blocks.i.attn.q_gain`,
//! `blocks.i.attn.attn_gate_w`, `blocks.i.resid_mix`, `skip_weights`, `parallel_*_lambdas`,
//! `smear_gate.weight`, `smear_lambda`, ...), as in the record. [`to_banks`] and
//! [`from_banks`] convert between the layouts exactly (stacking and slicing, no arithmetic);
//! [`crate::model::Gpt::load_state`] reads either.

use std::collections::HashMap;

use candle_core::{Result, Tensor};

/// The banks: name, and per layer the block tensor of its first and (when stacked twice) second
/// half.
const BANKS: [(&str, &str, Option<&str>); 4] = [
    ("qo_bank", "attn.c_q.weight", Some("attn.proj.weight")),
    ("kv_bank", "attn.c_k.weight", Some("attn.c_v.weight")),
    ("mlp_up_bank", "mlp.fc.weight", None),
    ("mlp_down_bank", "mlp.proj.weight", None),
];

/// Whether `name` is one of the banked block matrices.
fn banked(name: &str) -> bool {
    name.starts_with("blocks.") && BANKS.iter().any(|(_, a, b)| name.ends_with(a) || b.is_some_and(|b| name.ends_with(b)))
}

/// `state` (our `state_dict`, `layers` blocks) in the record's banked layout: the banks first,
/// then every other tensor in `state`'s order.
pub fn to_banks(state: &[(String, Tensor)], layers: usize) -> anyhow::Result<Vec<(String, Tensor)>> {
    let index: HashMap<&str, &Tensor> = state.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let get = |i: usize, leaf: &str| -> anyhow::Result<&Tensor> {
        let name = format!("blocks.{i}.{leaf}");
        index.get(name.as_str()).copied().ok_or_else(|| anyhow::anyhow!("tensor `{name}` is missing: cannot make the banks"))
    };
    let mut out = Vec::with_capacity(state.len());
    for (bank, first, second) in BANKS {
        let mut rows = Vec::new();
        for leaf in std::iter::once(first).chain(second) {
            for i in 0..layers {
                rows.push(get(i, leaf)?);
            }
        }
        out.push((bank.to_string(), Tensor::stack(&rows, 0)?));
    }
    out.extend(state.iter().filter(|(n, _)| !banked(n)).cloned());
    Ok(out)
}

/// `tensors` with the record's banks (if it has them) split back into per-block tensors; a file
/// without banks comes back as it is. Errors name a bank of the wrong depth.
pub fn from_banks(mut tensors: HashMap<String, Tensor>) -> anyhow::Result<HashMap<String, Tensor>> {
    if !BANKS.iter().any(|(b, _, _)| tensors.contains_key(*b)) {
        return Ok(tensors);
    }
    let layers = tensors.get("mlp_up_bank").ok_or_else(|| anyhow::anyhow!("a banked file without `mlp_up_bank`"))?.dim(0)?;
    for (bank, first, second) in BANKS {
        let t = tensors.remove(bank).ok_or_else(|| anyhow::anyhow!("a banked file without `{bank}`"))?;
        let halves: Vec<&str> = std::iter::once(first).chain(second).collect();
        anyhow::ensure!(
            t.dim(0)? == layers * halves.len(),
            "`{bank}` holds {} matrices, not {} for {layers} layers",
            t.dim(0)?,
            layers * halves.len()
        );
        for (h, leaf) in halves.iter().enumerate() {
            for i in 0..layers {
                let m: Result<Tensor> = t.get(h * layers + i);
                tensors.insert(format!("blocks.{i}.{leaf}"), m?);
            }
        }
    }
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;
    use crate::model::{Gpt, ModelConfig};

    /// The record's model in its layout: the names and shapes its `state_dict` has (the banks
    /// and the 04-27 tensors), 35,945,671 values; back to ours bit for bit.
    #[test]
    fn the_04_27_model_banks_and_unbanks_exactly() {
        let cfg =
            ModelConfig { vocab_size: 64, model_dim: 32, num_heads: 4, num_kv_heads: 2, rope_dims: Some(4), ..ModelConfig::record_0427() };
        let m = Gpt::new(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
        let banks = to_banks(&m.state_dict(), cfg.num_layers).unwrap();
        let shape = |n: &str| banks.iter().find(|(k, _)| k == n).map(|(_, t)| t.dims().to_vec());
        assert_eq!(shape("qo_bank"), Some(vec![22, 32, 32]));
        assert_eq!(shape("kv_bank"), Some(vec![22, 16, 32]));
        assert_eq!(shape("mlp_up_bank"), Some(vec![11, 128, 32]));
        assert_eq!(shape("mlp_down_bank"), Some(vec![11, 32, 128]));
        for n in ["tok_emb.weight", "blocks.10.attn.attn_gate_w", "blocks.0.attn.q_gain", "smear_lambda", "parallel_post_lambdas"] {
            assert!(shape(n).is_some(), "{n}");
        }
        assert!(!banks.iter().any(|(n, _)| n.contains("c_q") || n.contains("mlp.fc")));
        let count: usize = banks.iter().map(|(_, t)| t.elem_count()).sum();
        assert_eq!(count, m.param_count());
        // qo_bank[L + 3] is block 3's output projection.
        let proj: Vec<f32> =
            m.state_dict().into_iter().find(|(n, _)| n == "blocks.3.attn.proj.weight").unwrap().1.flatten_all().unwrap().to_vec1().unwrap();
        let row: Vec<f32> = banks[0].1.get(11 + 3).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(proj, row);
        // Back: every tensor bit for bit, and the model loads the banked file as it is.
        let back = from_banks(banks.into_iter().collect()).unwrap();
        for (n, t) in m.state_dict() {
            let (a, b): (Vec<f32>, Vec<f32>) =
                (t.flatten_all().unwrap().to_vec1().unwrap(), back[&n].flatten_all().unwrap().to_vec1().unwrap());
            assert_eq!(a, b, "{n}");
        }
        let mut other = Gpt::new(&cfg, 6, DType::F32, &Device::Cpu).unwrap();
        other.load_state(&to_banks(&m.state_dict(), 11).unwrap().into_iter().collect()).unwrap();
        // The full-size record: its log's count.
        let full = ModelConfig::record_0427();
        assert_eq!(full.param_shapes().iter().map(|(_, s)| s.iter().product::<usize>()).sum::<usize>(), 35_945_671);
    }

    /// A bank of the wrong depth is refused, naming it.
    #[test]
    fn a_bank_of_the_wrong_depth_is_named() {
        let cfg = ModelConfig { vocab_size: 32, num_layers: 2, model_dim: 16, num_heads: 2, num_kv_heads: 1, ..ModelConfig::default() };
        let m = Gpt::new(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
        let mut banks: HashMap<String, Tensor> = to_banks(&m.state_dict(), 2).unwrap().into_iter().collect();
        let short = banks["qo_bank"].narrow(0, 0, 3).unwrap();
        banks.insert("qo_bank".into(), short);
        let e = from_banks(banks).unwrap_err().to_string();
        assert!(e.contains("`qo_bank` holds 3 matrices, not 4"), "{e}");
    }
}
