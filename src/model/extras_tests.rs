//! [`PassExtras`] through the whole model: per-document LoRA adapters (zero at init, one per
//! row, gradients only to the adapters when the base is frozen) and the document mask (a packed
//! row scores each document as a row of its own would).

use candle_core::{DType, Device, Tensor};

use super::lora::Lora;
use super::{Gpt, ModelConfig, PassExtras};
use crate::model::ops::DocumentMask;

fn cfg() -> ModelConfig {
    ModelConfig {
        vocab_size: 16,
        num_layers: 3,
        model_dim: 8,
        num_heads: 2,
        num_kv_heads: 1,
        mlp_mult: 2,
        tie_embeddings: false,
        parallel_residual_start: Some(2),
        num_loops: 1,
        loop_start: 1,
        loop_end: 1,
        ..ModelConfig::default()
    }
}

/// A model with every parameter perturbed (zero-initialised projections would hide errors).
fn model() -> Gpt {
    let m = Gpt::new(&cfg(), 4, DType::F64, &Device::Cpu).unwrap();
    let mut rng = fastrand::Rng::with_seed(5);
    for (_, v, _) in m.params() {
        let vals: Vec<f64> = (0..v.elem_count()).map(|_| rng.f64() * 0.8 - 0.4).collect();
        v.set(&Tensor::from_vec(vals, v.dims(), &Device::Cpu).unwrap()).unwrap();
    }
    m
}

fn ids(v: &[u32], rows: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), (rows, v.len() / rows), &Device::Cpu).unwrap()
}

fn vec1(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
}

fn perturb(l: &Lora, seed: u64, scale: f64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for (_, v) in l.vars() {
        let vals: Vec<f64> = (0..v.elem_count()).map(|_| (rng.f64() - 0.5) * scale).collect();
        v.set(&Tensor::from_vec(vals, v.dims(), &Device::Cpu).unwrap()).unwrap();
    }
}

#[test]
fn fresh_adapters_change_nothing_and_each_row_has_its_own() {
    let m = model();
    let x = ids(&[3, 5, 7, 9, 11, 2, 4, 6, 8, 10], 2);
    let y = ids(&[5, 7, 9, 11, 13, 4, 6, 8, 10, 12], 2);
    let base = vec1(&m.eval_token_losses(&x, &y).unwrap());
    let l = Lora::new(m.config(), m.looping(), (2, 3), 7, DType::F64, &Device::Cpu).unwrap();
    let pass = l.pass(None).unwrap();
    let fresh = vec1(&m.frozen_token_losses(&x, &y, PassExtras { lora: Some(&pass), docs: None }).unwrap());
    assert_eq!(base, fresh, "B = 0: the adapters add nothing");
    // Perturb only document 1's adapters: row 0's losses stay, row 1's move.
    let mut rng = fastrand::Rng::with_seed(8);
    for (_, v) in l.vars() {
        let mut vals = vec1(v.as_tensor());
        let half = vals.len() / 2;
        for x in &mut vals[half..] {
            *x += rng.f64() - 0.5;
        }
        v.set(&Tensor::from_vec(vals, v.dims(), &Device::Cpu).unwrap()).unwrap();
    }
    let pass = l.pass(None).unwrap();
    let moved = vec1(&m.frozen_token_losses(&x, &y, PassExtras { lora: Some(&pass), docs: None }).unwrap());
    assert_eq!(moved[..5], base[..5], "document 0 does not see document 1's adapter");
    assert!(moved[5..].iter().zip(&base[5..]).all(|(a, b)| (a - b).abs() > 1e-9), "every position of document 1 moves");
    // A gathered pass over document 1 alone scores row 1 as the full pass did.
    let one = l.pass(Some(&[1])).unwrap();
    let alone = vec1(
        &m.frozen_token_losses(
            &x.get(1).unwrap().unsqueeze(0).unwrap(),
            &y.get(1).unwrap().unsqueeze(0).unwrap(),
            PassExtras { lora: Some(&one), docs: None },
        )
        .unwrap(),
    );
    assert!(alone.iter().zip(&moved[5..]).all(|(a, b)| (a - b).abs() < 1e-12));
    let wrong = Lora::new(m.config(), m.looping(), (3, 3), 7, DType::F64, &Device::Cpu).unwrap().pass(None).unwrap();
    assert!(m.frozen_token_losses(&x, &y, PassExtras { lora: Some(&wrong), docs: None }).is_err(), "3 adapters for 2 rows");
}

/// With the base frozen, a backward pass reaches the adapters only, and their gradients are
/// the finite differences of the loss.
#[test]
fn frozen_base_gradients_reach_only_the_adapters_and_match_finite_differences() {
    let m = model();
    let x = ids(&[3, 5, 7, 9, 11, 2, 4, 6, 8, 10], 2);
    let y = ids(&[5, 7, 9, 11, 13, 4, 6, 8, 10, 12], 2);
    let l = Lora::new(m.config(), m.looping(), (2, 2), 9, DType::F64, &Device::Cpu).unwrap();
    perturb(&l, 10, 0.6);
    let loss = |l: &Lora| {
        let pass = l.pass(None).unwrap();
        m.frozen_token_losses(&x, &y, PassExtras { lora: Some(&pass), docs: None }).unwrap().sum_all().unwrap()
    };
    let grads = loss(&l).backward().unwrap();
    for (name, v, _) in m.params() {
        assert!(grads.get(v.as_tensor()).is_none(), "the frozen base parameter {name} got a gradient");
    }
    let h = 1e-6;
    for (name, v) in l.vars() {
        let g = vec1(grads.get(v.as_tensor()).unwrap_or_else(|| panic!("{name} has no gradient")));
        let vals = vec1(v.as_tensor());
        // Two entries per tensor: the first and one in the middle.
        for e in [0, vals.len() / 2] {
            let at = |d: f64| {
                let mut w = vals.clone();
                w[e] += d;
                v.set(&Tensor::from_vec(w, v.dims(), &Device::Cpu).unwrap()).unwrap();
                loss(&l).to_scalar::<f64>().unwrap()
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            v.set(&Tensor::from_vec(vals.clone(), v.dims(), &Device::Cpu).unwrap()).unwrap();
            assert!((fd - g[e]).abs() <= 1e-6 * (1.0 + fd.abs()), "{name}[{e}]: backward {} vs finite differences {fd}", g[e]);
        }
    }
}

/// Two documents packed in one row under the mask score as two rows of their own (to rounding:
/// RoPE makes attention depend on offsets only); without the mask the second one would see the
/// first.
#[test]
fn a_masked_packed_row_scores_each_document_alone() {
    let m = model();
    let bos = 1u32;
    let (d0, d1) = ([bos, 5, 7, 9, 2], [bos, 4, 6, 8, 10, 12, 3]);
    let packed: Vec<u32> = d0.iter().chain(&d1).copied().collect();
    let target: Vec<u32> = packed.iter().map(|t| (t * 3 + 1) % 16).collect();
    let mask = DocumentMask::at_token(&packed, packed.len(), crate::model::ops::DocRule::at(bos)).unwrap();
    let masked = vec1(&m.frozen_token_losses(&ids(&packed, 1), &ids(&target, 1), PassExtras { lora: None, docs: Some(&mask) }).unwrap());
    let first = vec1(&m.eval_token_losses(&ids(&packed[..5], 1), &ids(&target[..5], 1)).unwrap());
    let second = vec1(&m.eval_token_losses(&ids(&packed[5..], 1), &ids(&target[5..], 1)).unwrap());
    let alone: Vec<f64> = first.into_iter().chain(second).collect();
    for (i, (a, b)) in masked.iter().zip(&alone).enumerate() {
        assert!((a - b).abs() < 1e-10, "position {i}: packed {a}, alone {b}");
    }
    let unmasked = vec1(&m.eval_token_losses(&ids(&packed, 1), &ids(&target, 1)).unwrap());
    assert!((unmasked[6] - alone[6]).abs() > 1e-6, "without the mask the second document sees the first");
    // Gradients flow through the masked path (training uses it).
    let loss =
        m.token_losses_with(&ids(&packed, 1), &ids(&target, 1), PassExtras { lora: None, docs: Some(&mask) }).unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    assert!(m.params().iter().all(|(_, v, _)| grads.get(v.as_tensor()).is_some()));
}
