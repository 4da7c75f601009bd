//! The whole-engine checks beside the op cases of [`super::cases`]: [`model_check`] runs one
//! micro-batch of a small model with every element of a record ([`check_models`]: the 04-09
//! elements, the 04-27 elements), then one Muon and Adam step, on the engine under test and on
//! the f64 CPU engine, and compares the loss, every gradient and every weight within
//! [`ModelBounds`]; [`graph_check`] runs three steps with graphs on and off and compares them
//! bit for bit. `pipeline engine-check` and the emulator's tests run both.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::optim::MuonStep;
use super::step::{ADAM_GROUPS, Engine, OptimizerStep};
use crate::model::{Gpt, Init, MlpActivation, ModelConfig};

/// The Muon step of the whole-engine checks (row-normalised, with weight decay).
pub(crate) fn check_muon() -> MuonStep {
    MuonStep {
        lr: 0.05,
        momentum: 0.95,
        nesterov: true,
        backend_steps: 5,
        ns: crate::optim::NewtonSchulz::Quintic,
        row_norm: true,
        weight_decay: 0.01,
    }
}

/// A model of `cfg` with every parameter perturbed (the zero-initialised projections would
/// leave most gradients zero), in f64 on the CPU.
pub(crate) fn perturbed(cfg: &ModelConfig, seed: u64) -> Gpt {
    let mut m = Gpt::new(cfg, seed, DType::F64, &Device::Cpu).expect("a model of a checked config");
    let mut rng = fastrand::Rng::with_seed(seed + 100);
    let state: HashMap<String, Tensor> = m
        .state_dict()
        .into_iter()
        .map(|(n, t)| {
            let noise: Vec<f64> = (0..t.elem_count()).map(|_| 0.1 * (rng.f64() * 2.0 - 1.0)).collect();
            let noise = Tensor::from_vec(noise, t.dims(), &Device::Cpu).expect("noise of the tensor's shape");
            (n, (t + noise).expect("same shapes"))
        })
        .collect();
    m.load_state(&state).expect("the model's own tensors");
    m
}

/// Record-mini's switches (every element of the record) at a small size.
pub(crate) fn record_small() -> ModelConfig {
    ModelConfig {
        vocab_size: 48,
        num_layers: 4,
        model_dim: 32,
        num_heads: 4,
        num_kv_heads: 2,
        mlp_mult: 4,
        mlp_activation: MlpActivation::LeakyRelu2,
        leaky_relu_slope: 0.5,
        qk_gain_init: 5.25,
        rope_dims: Some(4),
        rope_train_seq_len: Some(6),
        ln_scale: true,
        xsa_last_n: 2,
        skip_gates: true,
        loop_start: 1,
        loop_end: 2,
        num_loops: 1,
        enable_looping_at: 0.5,
        parallel_residual_start: Some(3),
        init: Init::Orthogonal,
        ..ModelConfig::default()
    }
}

/// The model of the whole-engine check: every element of the record (XSA, gated skips, partial
/// RoPE, QK gain, LeakyReLU², parallel residuals, depth recurrence, `ln_scale`) with an untied
/// head, at width 128 with heads 64 wide (the GPU attention's).
pub fn check_model() -> ModelConfig {
    ModelConfig {
        vocab_size: 96,
        model_dim: 128,
        num_heads: 2,
        num_kv_heads: 1,
        rope_dims: Some(16),
        rope_train_seq_len: Some(64),
        tie_embeddings: false,
        ..record_small()
    }
}

/// The 04-27 record's model for the whole-engine check: [`check_model`] with SmearGate (BOS fix),
/// the sparse attention gate, attention within documents and the two-lane decoder (after the
/// loop, in place of parallel residuals, lanes averaged).
pub fn check_model_0427() -> ModelConfig {
    ModelConfig {
        smear_gate: true,
        smear_gate_window: 12,
        attn_gate: true,
        attn_gate_window: 12,
        attn_gate_init_std: 0.5,
        attn_gate_scale: 0.5,
        document_attention: true,
        bos_id: 1,
        parallel_residual_start: None,
        parallel_decoder_start: Some(3),
        ..check_model()
    }
}

/// The whole-engine check's models: the 04-09 record's elements, then the 04-27 record's.
pub fn check_models() -> [(&'static str, ModelConfig); 2] {
    [("04-09 elements", check_model()), ("04-27 elements", check_model_0427())]
}

/// The micro-batch of the whole-engine check: one sequence of 64 tokens.
pub const CHECK_ROWS_T: (usize, usize) = (1, 64);

/// How far the whole engine may be from the f64 CPU engine.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct ModelBounds {
    /// The loss's relative error.
    pub loss: f64,
    /// A tensor's `‖device − f64‖` may be `tensor · ‖f64‖ + floor`: the floor is for the small
    /// sums of many terms (the query gains' gradients, about 2e-3 in norm) that rounding
    /// moves more than their share.
    pub tensor: f64,
    /// See `tensor`.
    pub floor: f64,
}

impl ModelBounds {
    /// The f32 CPU backend: every op in f32. Measured on the check model (the test
    /// `the_f32_cpu_engine_matches_the_f64_one`): loss 4e-8, tensors up to 2e-5 of their norm.
    pub const CPU_F32: ModelBounds = ModelBounds { loss: 1e-5, tensor: 1e-3, floor: 1e-6 };
    /// The GPU backend with f32 GEMMs: attention in bf16 (flash_mma), the rest f32. Measured in
    /// the warp emulator (the same kernels): loss 1.4e-5, tensors up to 2.5e-2 of their norm
    /// (a key weight's gradient: bf16 attention through six virtual layers), half the bound.
    pub const GPU_F32_GEMMS: ModelBounds = ModelBounds { loss: 1e-3, tensor: 5e-2, floor: 4e-4 };
    /// The GPU backend with bf16 GEMMs (the training default): every product's inputs rounded
    /// to bf16 too. Measured in the warp emulator with bf16-rounding GEMMs
    /// (`model_bounds_of_bf16_gemms`): loss 3.9e-5, a query gain's gradient 1.2e-1 of its
    /// (small) norm, the skip gates' weights 4.2e-2, each under 0.4 of its bound.
    pub const GPU_BF16_GEMMS: ModelBounds = ModelBounds { loss: 2e-3, tensor: 1e-1, floor: 1e-3 };
    /// The GPU backend with bf16 activations: every activation and activation gradient stored
    /// in bf16 besides the GEMMs' bf16 inputs. Measured in the warp emulator (the test
    /// `the_engine_with_bf16_activations_on_the_emulated_gpu_matches_the_cpu_engine`): loss
    /// 6.1e-5, tensors up to 6.2e-2 of their norm (a key weight's gradient), weights after the
    /// step 4.0e-2 (the skip gates); the bounds leave about 2.5 times that.
    pub const GPU_BF16_ACTIVATIONS: ModelBounds = ModelBounds { loss: 2e-3, tensor: 1.5e-1, floor: 2e-3 };
}

/// One compared quantity of the whole-engine check.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Compared {
    /// `loss`, `grad NAME` or `weight NAME` (after one Muon and Adam step).
    pub name: String,
    /// `|device − f64| / |f64|` (the loss) or `‖device − f64‖ / ‖f64‖` (a tensor).
    pub rel_err: f64,
    /// The largest `rel_err` that passes (a tensor's includes the floor over its norm).
    pub bound: f64,
}

impl Compared {
    /// Whether the error is within the bound (a NaN is not).
    pub fn ok(&self) -> bool {
        self.rel_err <= self.bound
    }
}

/// The whole engine `dut` (built for `cfg`, one of [`check_models`], on [`CHECK_ROWS_T`])
/// against the f64 CPU engine: one looped micro-batch's loss and every gradient, then every
/// weight after one Muon and one Adam step, each against `bounds`. Under a document mask or
/// SmearGate the tokens hold the BOS at a tile's middle and twice in a row.
pub fn model_check(dut: &mut Engine, cfg: &ModelConfig, bounds: ModelBounds, seed: u64) -> anyhow::Result<Vec<Compared>> {
    let (rows, t) = CHECK_ROWS_T;
    let n = rows * t;
    let mut reference = Engine::cpu(cfg, rows, t, DType::F64, false)?;
    let params: HashMap<String, Tensor> = perturbed(cfg, seed).state_dict().into_iter().collect();
    let mut rng = fastrand::Rng::with_seed(seed + 7);
    let mut x: Vec<u32> = (0..n).map(|_| rng.u32(0..cfg.vocab_size as u32)).collect();
    if cfg.document_attention || cfg.smear_gate {
        for p in [20, 40, 41].into_iter().filter(|&p| p < n) {
            x[p] = cfg.bos_id;
        }
    }
    let y: Vec<u32> = (0..n).map(|_| rng.u32(0..cfg.vocab_size as u32)).collect();
    let mut losses = Vec::new();
    for e in [&mut reference, &mut *dut] {
        e.load_params(&params)?;
        e.zero_grads();
        e.micro_step(&x, &y, true, 1.0 / n as f64);
        losses.push(e.loss_sum()? / n as f64);
    }
    let mut out = vec![Compared { name: "loss".into(), rel_err: (losses[1] - losses[0]).abs() / losses[0].abs(), bound: bounds.loss }];
    let tensors = |what: &str, a: Vec<(String, Tensor)>, b: Vec<(String, Tensor)>, out: &mut Vec<Compared>| -> anyhow::Result<()> {
        for ((name, a), (_, b)) in a.iter().zip(&b) {
            let a: Vec<f64> = a.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
            let b: Vec<f64> = b.to_dtype(DType::F64)?.flatten_all()?.to_vec1()?;
            let diff = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
            let norm = a.iter().map(|x| x * x).sum::<f64>().sqrt().max(f64::MIN_POSITIVE);
            let rel_err = if diff.is_nan() { f64::INFINITY } else { diff / norm };
            out.push(Compared { name: format!("{what} {name}"), rel_err, bound: bounds.tensor + bounds.floor / norm });
        }
        Ok(())
    };
    tensors("grad", reference.grads()?, dut.grads()?, &mut out)?;
    for e in [&mut reference, &mut *dut] {
        e.muon(check_muon())?;
        for (group, _) in ADAM_GROUPS {
            e.adam(group, 0.01, (0.9, 0.95), 1e-8, 0.0);
        }
    }
    tensors("weight", reference.params()?, dut.params()?, &mut out)?;
    Ok(out)
}

/// How an engine ran three steps with units replayed as graphs against op by op
/// ([`graph_check`]).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct GraphOutcome {
    /// Losses, gradient norms and weights identical bit for bit.
    pub identical: bool,
    /// With graphs: units captured, replayed and run op by op.
    pub counts: (u64, u64, u64),
    /// Without graphs: units run op by op (every one).
    pub eager: u64,
}

impl GraphOutcome {
    /// Identical, and with graphs each unit (forward, backward, optimizer) ran op by op in the
    /// first step, was captured in the second and replayed from then on.
    pub fn ok(&self) -> bool {
        self.identical && self.counts == (3, 6, 3) && self.eager == 9
    }
}

/// Three steps of `cfg` on `rows x t` tokens from the weights of `perturbed(cfg, seed)`, with a
/// learning rate, momentum and clip that change every step, on `make(false)` (every unit op by
/// op) and on `make(true)` (units captured and replayed): the losses, gradient norms and
/// weights must be the same bit for bit, since a replay reads each step's values from device
/// memory.
pub fn graph_check(
    cfg: &ModelConfig,
    (rows, t): (usize, usize),
    seed: u64,
    make: &mut dyn FnMut(bool) -> anyhow::Result<Engine>,
) -> anyhow::Result<GraphOutcome> {
    let params: HashMap<String, Tensor> = perturbed(cfg, seed).state_dict().into_iter().collect();
    let mut runs = Vec::new();
    for graphs in [false, true] {
        let mut e = make(graphs)?;
        e.load_params(&params)?;
        e.zero_grads();
        let mut stats = Vec::new();
        let mut rng = fastrand::Rng::with_seed(seed);
        for step in 0..3u64 {
            let x: Vec<u32> = (0..rows * t).map(|_| rng.u32(0..cfg.vocab_size as u32)).collect();
            let y: Vec<u32> = (0..rows * t).map(|_| rng.u32(0..cfg.vocab_size as u32)).collect();
            e.micro_step(&x, &y, cfg.recurrent(), 1.0 / (rows * t) as f64);
            let k = step as f64;
            let muon = MuonStep {
                lr: 0.02 + 0.01 * k,
                momentum: 0.85 + 0.05 * k,
                nesterov: true,
                backend_steps: 5,
                // Per-iteration coefficients (constant over a run, so a graph may keep them).
                ns: crate::optim::NewtonSchulz::PolarExpress,
                row_norm: true,
                weight_decay: 0.01,
            };
            let s = OptimizerStep {
                clip: 0.3 + k,
                muon,
                adam: [(0.01 + 0.01 * k, 0.0), (0.02 - 0.005 * k, 0.01), (0.03, 0.0)],
                betas: (0.9, 0.95),
                eps: 1e-8,
            };
            stats.push(e.optimizer_step(&s)?);
        }
        let weights: Vec<Vec<u32>> = e
            .params()?
            .iter()
            .map(|(_, w)| Ok(w.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect()))
            .collect::<anyhow::Result<_>>()?;
        anyhow::ensure!(stats.iter().all(|s| s.loss_sum.is_finite()), "non-finite losses in the graph check: {stats:?}");
        runs.push((stats, weights, e.graph_counts().unwrap_or_default()));
    }
    let (eager, graphs) = (&runs[0], &runs[1]);
    Ok(GraphOutcome {
        identical: eager.0 == graphs.0 && eager.1 == graphs.1,
        counts: (graphs.2.captured, graphs.2.replayed, graphs.2.eager),
        eager: eager.2.eager,
    })
}
