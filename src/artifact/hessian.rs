//! GPTQ's calibration (spec 4.5): the Hessian of every matrix the artifact quantizes, from the
//! inputs the trained model's products see on training data.
//!
//! ```text
//! H_W = (1 / batches) Σ_batches Σ_passes X^T X      X (N, in): the input of x W^T
//! ```
//!
//! - the model is the one to quantize (the EMA weights after a run), looped when the model has
//!   depth recurrence, so each repeat of a looped block adds its own `X^T X`;
//! - the batches are a fresh shuffled sampler's first `batches` micro-batches with the training
//!   seed and shape, the same rows the first training batches saw ([`calibration_sampler`]);
//!   each is cut into forward passes of at most `rows_per_pass` sequences (the sum is the same);
//! - the matrices are those [`super::quant`] quantizes and a product reads: the 2-D attention and
//!   MLP weights over [`PASSTHROUGH_MAX_NUMEL`] elements, and the output head (the tied
//!   embedding) from the final norm's output. `c_q`, `c_k` and `c_v` read one input, so they
//!   share one Hessian (computed once, counted three times as the record counts them);
//! - sums are f32 on the model's device, as the record's (`x.float()`, `H += x^T x`), and come
//!   back to the host once at the end.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use candle_core::{DType, Device, Tensor};

use super::quant::PASSTHROUGH_MAX_NUMEL;
use crate::data::sampler::{Sampler, ShuffledSampler};
use crate::data::shard::{AccessMode, ShardFile, glob_sorted};
use crate::eval::executor::EvalModel;
use crate::model::observe::InputObserver;
use crate::train::config::Config;

/// The Hessians of one calibration.
#[derive(Debug)]
pub struct Hessians {
    /// Per weight name, `H` row-major `(in, in)`; weights that read one input share it.
    pub by_weight: HashMap<String, Arc<Vec<f32>>>,
    /// Distinct inputs summed (one per shared group).
    pub distinct: usize,
    /// Calibration batches.
    pub batches: usize,
    /// Tokens those batches held.
    pub tokens: u64,
    /// Time per batch (forward passes and sums).
    pub batch_times: Vec<Duration>,
}

/// The weights of `state` a calibration collects for: 2-D float tensors over
/// [`PASSTHROUGH_MAX_NUMEL`] elements (what the artifact quantizes per row). Those no product
/// reads (an untied input embedding) get no Hessian and are rounded to nearest.
pub fn targets(state: &[(String, Tensor)]) -> HashSet<String> {
    state
        .iter()
        .filter(|(_, t)| t.dtype().is_float() && t.rank() == 2 && t.elem_count() > PASSTHROUGH_MAX_NUMEL)
        .map(|(n, _)| n.clone())
        .collect()
}

/// Sums `X^T X` per input group.
struct Collector {
    wanted: HashSet<String>,
    /// The first wanted name of each group -> its running sum.
    sums: HashMap<String, Tensor>,
    /// Every wanted name -> its group's first name.
    group_of: HashMap<String, String>,
}

impl InputObserver for Collector {
    fn wants(&self, weights: &[String]) -> bool {
        weights.iter().any(|w| self.wanted.contains(w))
    }

    fn observe(&mut self, weights: &[String], x: &Tensor) -> candle_core::Result<()> {
        let mut names = weights.iter().filter(|w| self.wanted.contains(*w));
        let Some(first) = names.next() else { return Ok(()) };
        // A group is keyed by its first weight; later passes find the names already there.
        let key = first.clone();
        if !self.group_of.contains_key(first) {
            self.group_of.insert(first.clone(), key.clone());
            for n in names {
                self.group_of.insert(n.clone(), key.clone());
            }
        }
        let x = x.to_dtype(DType::F32)?;
        let xtx = x.t()?.matmul(&x)?;
        let sum = match self.sums.remove(&key) {
            Some(s) => (s + xtx)?,
            None => xtx,
        };
        self.sums.insert(key, sum);
        Ok(())
    }
}

/// A fresh shuffled sampler over `[data] train` with the training seed, shape and rank: the
/// rows of the first training batches (the records' calibration data).
pub fn calibration_sampler(config: &Config) -> Result<ShuffledSampler> {
    let pattern = config.data.train.as_deref().context("`data.train` is not set: GPTQ calibrates on training data")?;
    let paths = glob_sorted(pattern)?;
    let shape = config.batch_shape()?;
    let files: Vec<(usize, &std::path::Path)> =
        paths.iter().enumerate().filter(|(i, _)| i % shape.world_size == shape.rank).map(|(i, p)| (i, p.as_path())).collect();
    let shards = ShardFile::open_set(&files, AccessMode::Mmap)?;
    let vocab = config.data.tokenizer_vocab()?;
    ShuffledSampler::new(shards, shape, vocab, config.run.seed, 1, None)
}

/// Collects the Hessians of `wanted` through `model` over `batches` micro-batches of `rows`
/// sequences of `seq_len` tokens, which `fill` writes (x then y, as a sampler does), cut into
/// forward passes of at most `rows_per_pass` sequences. `keep_going` is asked before each
/// batch (an abort gives `Ok(None)`).
#[allow(clippy::too_many_arguments)]
pub fn collect(
    model: &mut dyn EvalModel,
    (rows, seq_len): (usize, usize),
    batches: usize,
    rows_per_pass: usize,
    wanted: HashSet<String>,
    mut fill: impl FnMut(&mut [u32]) -> Result<()>,
    mut keep_going: impl FnMut() -> bool,
) -> Result<Option<Hessians>> {
    ensure!(batches >= 1, "calibration needs at least one batch");
    let t = seq_len;
    let rows_per_pass = rows_per_pass.clamp(1, rows);
    let mut buf = vec![0u32; 2 * rows * t];
    let mut c = Collector { wanted, sums: HashMap::new(), group_of: HashMap::new() };
    let mut batch_times = Vec::with_capacity(batches);
    for b in 0..batches {
        if !keep_going() {
            return Ok(None);
        }
        let t0 = Instant::now();
        fill(&mut buf).with_context(|| format!("calibration batch {b}"))?;
        for start in (0..rows).step_by(rows_per_pass) {
            let n = rows_per_pass.min(rows - start);
            model.observe_inputs(&buf[start * t..(start + n) * t], t, &mut c).with_context(|| format!("calibration batch {b}"))?;
        }
        // The sums are on the device: a batch's time is when they are done.
        for sum in c.sums.values() {
            sum.device().synchronize()?;
        }
        batch_times.push(t0.elapsed());
    }
    let distinct = c.sums.len();
    let mut host: HashMap<String, Arc<Vec<f32>>> = HashMap::with_capacity(distinct);
    for (key, sum) in c.sums {
        let h = (sum / batches as f64)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
        host.insert(key, Arc::new(h));
    }
    let by_weight = c.group_of.iter().map(|(w, key)| (w.clone(), host[key].clone())).collect();
    Ok(Some(Hessians { by_weight, distinct, batches, tokens: (batches * rows * t) as u64, batch_times }))
}

/// [`collect`] over the first `batches` micro-batches of [`calibration_sampler`].
pub fn collect_from_training_data(
    model: &mut dyn EvalModel,
    config: &Config,
    batches: usize,
    rows_per_pass: usize,
    wanted: HashSet<String>,
    keep_going: impl FnMut() -> bool,
) -> Result<Option<Hessians>> {
    let mut sampler = calibration_sampler(config)?;
    let shape = sampler.shape();
    collect(model, (shape.rows, shape.seq_len), batches, rows_per_pass, wanted, |buf| sampler.fill(buf).map(drop), keep_going)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::candle_model::CandleModel;
    use crate::eval::executor::EvalModel;
    use crate::model::{Gpt, ModelConfig};

    /// Three blocks, block 1 looped once ([0, 1, 1, 2]), untouched init: the output projections
    /// are zero, so every block passes the stream on unchanged (resid_mix [1; 0]) and the
    /// skips only scale it, and every normed input is `n = rms_norm(E[x])`.
    fn cfg() -> ModelConfig {
        ModelConfig {
            vocab_size: 64,
            num_layers: 3,
            model_dim: 32,
            num_heads: 4,
            num_kv_heads: 2,
            mlp_mult: 2,
            loop_start: 1,
            loop_end: 1,
            num_loops: 1,
            ..ModelConfig::default()
        }
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>().sqrt();
        let den: f32 = b.iter().map(|y| y * y).sum::<f32>().sqrt();
        assert!(den > 0.0 && num <= 1e-5 * den, "{what}: relative error {}", num / den);
    }

    #[test]
    fn hessians_are_the_sums_of_the_products_inputs() {
        let cfg = cfg();
        let model = Gpt::new(&cfg, 3, DType::F64, &Device::Cpu).unwrap();
        assert!(model.looping());
        let (rows, t) = (3, 8);
        let mut rng = fastrand::Rng::with_seed(4);
        let data: Vec<Vec<u32>> = (0..2).map(|_| (0..2 * rows * t).map(|_| rng.u32(..64)).collect()).collect();
        let wanted = targets(&model.state_dict())
            .into_iter()
            .chain(model.state_dict().into_iter().filter(|(_, t)| t.rank() == 2).map(|(n, _)| n))
            .collect::<HashSet<_>>();
        let run = |model: &Gpt, batches: usize, rows_per_pass: usize| {
            let mut k = 0;
            collect(
                &mut CandleModel::new(model),
                (rows, t),
                batches,
                rows_per_pass,
                wanted.clone(),
                |buf| {
                    buf.copy_from_slice(&data[k]);
                    k += 1;
                    Ok(())
                },
                || true,
            )
            .unwrap()
            .unwrap()
        };
        let h = run(&model, 2, 2);
        assert_eq!((h.batches, h.tokens), (2, 2 * (rows * t) as u64));
        // By hand: n = rms_norm(E[x]) for each batch's inputs; S = (S_1 + S_2) / 2 with S_b = n^T n.
        let emb = model.param("tok_emb.weight").unwrap().as_tensor().clone();
        let s_of = |w: Option<&Tensor>| -> Vec<f32> {
            let mut total: Option<Tensor> = None;
            for d in &data {
                let ids = Tensor::from_slice(&d[..rows * t], rows * t, &Device::Cpu).unwrap();
                let mut n = crate::model::ops::rms_norm(&emb.embedding(&ids).unwrap()).unwrap();
                if let Some(w) = w {
                    n = n.matmul(&w.t().unwrap()).unwrap().relu().unwrap().sqr().unwrap();
                }
                let s = n.t().unwrap().matmul(&n).unwrap();
                total = Some(match total {
                    Some(x) => (x + s).unwrap(),
                    None => s,
                });
            }
            (total.unwrap() / 2.0).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
        };
        let s = s_of(None);
        let twice: Vec<f32> = s.iter().map(|v| 2.0 * v).collect();
        let get = |n: &str| h.by_weight.get(n).unwrap_or_else(|| panic!("no Hessian for {n}")).clone();
        close(&get("blocks.0.attn.c_q.weight"), &s, "block 0 qkv");
        close(&get("blocks.0.mlp.fc.weight"), &s, "block 0 fc");
        close(&get("blocks.2.attn.c_q.weight"), &s, "block 2 qkv");
        // Block 1 runs twice in the looped model: both applications add.
        close(&get("blocks.1.attn.c_q.weight"), &twice, "looped block 1");
        close(&get("blocks.1.mlp.fc.weight"), &twice, "looped block 1 fc");
        // The tied head reads the final norm's output: the same rows (the skips only scale them).
        close(&get("tok_emb.weight"), &s, "head");
        // The MLP's output projection reads relu(n Wfc^T)^2.
        let fc = model.param("blocks.0.mlp.fc.weight").unwrap().as_tensor().clone();
        close(&get("blocks.0.mlp.proj.weight"), &s_of(Some(&fc)), "block 0 mlp.proj");
        // q, k and v share one input, so one Hessian; 4 distinct inputs per block + the head.
        assert!(Arc::ptr_eq(&get("blocks.0.attn.c_q.weight"), &get("blocks.0.attn.c_v.weight")));
        assert!(Arc::ptr_eq(&get("blocks.0.attn.c_q.weight"), &get("blocks.0.attn.c_k.weight")));
        assert_eq!(h.distinct, 3 * 4 + 1);
        assert_eq!(h.by_weight.len(), 3 * 6 + 1);
        assert_eq!(get("blocks.0.mlp.proj.weight").len(), (2 * 32) * (2 * 32));
        // The cut into forward passes does not change the sums.
        let one_pass = run(&model, 2, 100);
        for (name, v) in &h.by_weight {
            close(&one_pass.by_weight[name], v, name);
        }
        // Unlooped, block 1 adds once.
        let mut unlooped = Gpt::new(&cfg, 3, DType::F64, &Device::Cpu).unwrap();
        unlooped.set_looping(false);
        let u = run(&unlooped, 2, rows);
        close(&u.by_weight["blocks.1.attn.c_q.weight"], &s, "unlooped block 1");
    }

    #[test]
    fn targets_are_the_large_matrices_and_an_abort_stops() {
        let cfg = ModelConfig {
            vocab_size: 1024,
            num_layers: 2,
            model_dim: 128,
            num_heads: 4,
            num_kv_heads: 2,
            mlp_mult: 4,
            ..ModelConfig::default()
        };
        let model = Gpt::new(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let mut t: Vec<String> = targets(&model.state_dict()).into_iter().collect();
        t.sort();
        // 128 x 512 = 65,536 elements stays float; only the 1024 x 128 embedding is quantized.
        assert_eq!(t, ["tok_emb.weight"]);
        let r = collect(&mut CandleModel::new(&model), (2, 4), 3, 2, t.into_iter().collect(), |_| Ok(()), || false).unwrap();
        assert!(r.is_none());
        let err =
            collect(&mut CandleModel::new(&model), (2, 4), 1, 2, HashSet::new(), |_| anyhow::bail!("shard gone"), || true).unwrap_err();
        assert!(format!("{err:#}").contains("calibration batch 0") && format!("{err:#}").contains("shard gone"), "{err:#}");
    }

    /// GPTQ's Hessians from the engine's forward passes (the inputs it keeps for its backward pass,
    /// and the MLP's activation recomputed) equal candle's observer's, weight by weight, for every
    /// element: the looped blocks add each repeat, the gate's and XSA's outputs feed the
    /// projection, the lanes' MLP reads lane 1. A pass of 3 rows on an engine of 2 pads one.
    #[test]
    fn hessians_from_the_engine_equal_candles() {
        use crate::train::engine_eval::EngineModel;
        use crate::train::engine_eval_tests::{configs, pair, stream};
        for (name, cfg) in configs() {
            let (c, e) = pair(&cfg, DType::F64);
            let wanted: HashSet<String> = c.state_dict().into_iter().filter(|(_, t)| t.rank() == 2).map(|(n, _)| n).collect();
            let batches: Vec<Vec<u32>> = (0..2).map(|b| stream(2 * 3 * 12, cfg.vocab_size, 10 + b)).collect();
            let run = |m: &mut dyn EvalModel| {
                let mut k = 0;
                collect(
                    m,
                    (3, 12),
                    2,
                    3,
                    wanted.clone(),
                    |buf| {
                        buf.copy_from_slice(&batches[k]);
                        k += 1;
                        Ok(())
                    },
                    || true,
                )
                .unwrap()
                .unwrap()
            };
            let a = run(&mut CandleModel::new(&c));
            let b = run(&mut EngineModel::new(e, 2, 12).unwrap());
            assert_eq!(a.by_weight.len(), b.by_weight.len(), "{name}: weights with a Hessian");
            assert_eq!(a.distinct, b.distinct, "{name}: distinct inputs");
            for (w, h) in &a.by_weight {
                let g = b.by_weight.get(w).unwrap_or_else(|| panic!("{name}: the engine has no Hessian for {w}"));
                let (x, y): (Vec<f64>, Vec<f64>) = (h.iter().map(|&v| v as f64).collect(), g.iter().map(|&v| v as f64).collect());
                let err = crate::engine::tests::rel_err(&x, &y);
                assert!(err < 1e-6, "{name}: {w}'s Hessian differs by {err:e} of its norm");
            }
        }
    }
}
