//! `pipeline parity`: does a device compute what the CPU computes? A small GPT (the baseline's
//! architecture at toy size, seeded, so its weights are the same on every device) takes one
//! batch on the device in the given precision and on the CPU in f64; the loss and every
//! parameter's gradient are compared as relative errors, each against its bound.
//! This is part (a) of `scripts/gpu-check.sh`; on a CPU build it checks the f32 path (fused
//! CPU ops) against f64.
//!
//! In f32 the bound is one tolerance. In bf16 it is each quantity's own: on the toy model the
//! bf16 graph takes the MLP's gradients about 5e-3 from f64 and the attention's about 1e-2 (the
//! query gains' up to 3e-2), so one tolerance is either too loose for most quantities or fails
//! on a correct device. Each bound is [`EXPECTED_FACTOR`] times the error the device's
//! formulation *should* have ([`FEW_FACTOR`] for quantities of fewer than [`FEW_VALUES`]
//! values): the same graph in bf16 on the kernels' CPU references
//! ([`crate::model::with_gpu_formulation`]), RMS over [`DRAWS`] draws of the rounding, at least
//! [`EXPECTED_FLOOR`] ([`LOSS_FLOOR`] for the loss).
//!
//! The reference is f64 with one exception: the per-head RMS norm of q and k, which on the GPU
//! reads bf16 rows and so takes bf16's epsilon (7.8e-3, as PyTorch's `F.rms_norm` under
//! autocast), takes that epsilon in the reference too. With f64's there, the epsilon and not the
//! rounding would be most of the q and k projections' error (4.2e-2 instead of 1.0e-2 at seed
//! 1), and their bounds (then 0.17) would pass a query gain 5% off. On a CPU device, whose bf16
//! graph differs (f32 activations, so f32's epsilon), the reference keeps f64's epsilon and the
//! bounds are still the GPU formulation's.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::model::compare::{rel_err, worst};
use crate::model::flash_attn::FlashKernels;
use crate::model::{Gpt, ModelConfig};

/// One compared quantity.
#[derive(Clone, Debug, Serialize)]
pub struct Compared {
    /// `loss` or the parameter's name.
    pub name: String,
    /// `‖device − reference‖ / ‖reference‖`.
    pub rel_err: f64,
    /// In bf16, the model's quantities: the error bf16 rounding alone gives (see the module doc).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<f64>,
    /// The largest `rel_err` that passes.
    pub bound: f64,
}

impl Compared {
    /// A quantity judged against a fixed bound.
    fn fixed(name: String, rel_err: f64, bound: f64) -> Self {
        Self { name, rel_err, expected: None, bound }
    }

    /// Whether `rel_err` is within `bound` (a NaN is not).
    pub fn ok(&self) -> bool {
        self.rel_err <= self.bound
    }

    /// `rel_err / bound`, 0 for a zero bound met and infinite for one missed (NaN stays NaN).
    pub fn ratio(&self) -> f64 {
        if self.bound > 0.0 || self.rel_err.is_nan() {
            self.rel_err / self.bound
        } else if self.rel_err == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    }
}

/// What `pipeline parity` found.
#[derive(Clone, Debug, Serialize)]
pub struct ParityReport {
    /// The device checked.
    pub device: String,
    /// Its parameter dtype.
    pub dtype: String,
    /// Loss on the device and on the CPU in f64.
    pub loss: (f64, f64),
    /// Every comparison, loss first.
    pub compared: Vec<Compared>,
    /// The largest relative error.
    pub max_rel_err: f64,
    /// The bound of every quantity in f32 and f64; in bf16 the smallest bound ([`EXPECTED_FLOOR`]).
    pub tolerance: f64,
    /// How the bounds were set, in words.
    pub rule: String,
    /// The largest `rel_err / bound` (0 for an exact zero bound met; infinite for one missed):
    /// at most 1 when `ok`.
    pub worst_ratio: f64,
    /// Whether every error is within its bound.
    pub ok: bool,
}

/// Tolerance on relative errors: bf16 keeps 8 bits of mantissa (about 4e-3 per rounding). The
/// CPU's f32 gradients measure about 4e-4 from f64 on the toy model (the loss 4e-8), nearly all
/// of it from RMS norm's epsilon, which is the dtype's machine epsilon as in PyTorch
/// (`F.rms_norm(eps=None)`): 1.2e-7 in f32 against the embedding rows' mean square of about
/// 2e-4. f32 gets 2e-3. bf16 has no one tolerance (see the module doc); this is its floor.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 | DType::F16 => EXPECTED_FLOOR,
        DType::F32 => 2e-3,
        _ => 1e-9,
    }
}

/// A bf16 quantity's bound is this many times its expected error. Measured on the CPU
/// (`bf16_bound_margin`, ignored: 24 seeds, 23 quantities, 4 fresh draws each): a fresh draw
/// of the rounding is at most 1.38 times the RMS of three others (quantities of
/// [`FEW_VALUES`] values or more); the GPU's kernels round a little more (flash attention's
/// probabilities in bf16).
pub const EXPECTED_FACTOR: f64 = 4.0;

/// Quantities of fewer values than this (the query gains: one per head) get [`FEW_FACTOR`]:
/// the relative error of a few long sums that partly cancel varies much more from one draw of
/// the rounding to the next (`bf16_bound_margin`: a fresh draw at up to 3.2 times the RMS of
/// three others, against 1.4 for every quantity of 64 values or more).
pub const FEW_VALUES: usize = 16;

/// The bound's factor for quantities of fewer than [`FEW_VALUES`] values.
pub const FEW_FACTOR: f64 = 8.0;

/// The smallest bound of a bf16 gradient: a few roundings.
pub const EXPECTED_FLOOR: f64 = 1e-2;

/// The smallest bound of the bf16 loss, a mean over 256 tokens whose expected error is about
/// 3e-6.
pub const LOSS_FLOOR: f64 = 1e-4;

/// Draws of the rounding behind an expected error: the weights scaled by `1 + j * s * u` (`u`
/// uniform in [-1, 1), draw `j`, `s` = [`DRAW_STEP`]), which moves where values round (each
/// draw against its own f64 reference).
pub const DRAWS: usize = 3;

/// One bf16 step (2^-8): a draw moves most values across a rounding boundary.
pub const DRAW_STEP: f64 = 1.0 / 256.0;

/// The toy model: vocabulary 256, 2 layers, width 64, 4 heads, 2 KV heads.
fn toy() -> ModelConfig {
    ModelConfig { vocab_size: 256, num_layers: 2, model_dim: 64, num_heads: 4, num_kv_heads: 2, ..ModelConfig::default() }
}

/// Loss and named gradients as f64 host values.
type Named = (f64, Vec<(String, Vec<f64>)>);

/// Loss and named gradients of `model` on `x`, `y`.
fn loss_and_grads(model: &Gpt, x: &Tensor, y: &Tensor) -> anyhow::Result<Named> {
    let loss = model.loss(x, y)?;
    let grads = loss.backward()?;
    let mut out = Vec::new();
    for (name, var, _) in model.params() {
        let g = grads.get(var.as_tensor()).ok_or_else(|| anyhow::anyhow!("no gradient for `{name}`"))?;
        out.push((name.clone(), g.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f64>()?));
    }
    Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, out))
}

/// The checked problem: the toy model's weights (f64 host values) and one batch of 4 x 64
/// tokens.
struct Problem {
    seed: u64,
    state: HashMap<String, Tensor>,
    x: Vec<u32>,
    y: Vec<u32>,
}

const ROWS: usize = 4;
const T: usize = 64;

impl Problem {
    fn new(seed: u64) -> anyhow::Result<Self> {
        let cfg = toy();
        let mut rng = fastrand::Rng::with_seed(seed);
        let toks: Vec<u32> = (0..ROWS * (T + 1)).map(|_| rng.u32(0..cfg.vocab_size as u32)).collect();
        let x = (0..ROWS).flat_map(|r| toks[r * (T + 1)..r * (T + 1) + T].to_vec()).collect();
        let y = (0..ROWS).flat_map(|r| toks[r * (T + 1) + 1..(r + 1) * (T + 1)].to_vec()).collect();
        // The zero-initialised output projections would make most gradients zero: perturb every
        // parameter the same way on both sides (host-side values, so both get the same numbers).
        let mut prng = fastrand::Rng::with_seed(seed ^ 0x5eed);
        let mut state = HashMap::new();
        for (name, var, _) in Gpt::new(&cfg, seed, DType::F64, &Device::Cpu)?.params() {
            let base = var.as_tensor().flatten_all()?.to_vec1::<f64>()?;
            let v: Vec<f64> = base.iter().map(|b| b + 0.02 * (prng.f64() * 2.0 - 1.0)).collect();
            state.insert(name.clone(), Tensor::from_vec(v, var.dims(), &Device::Cpu)?);
        }
        Ok(Self { seed, state, x, y })
    }

    /// Draw `j` of the rounding (see [`DRAWS`]); draw 0 is the problem itself.
    fn draw(&self, j: usize) -> anyhow::Result<Self> {
        let mut rng = fastrand::Rng::with_seed(self.seed ^ 0xd4a3 ^ j as u64);
        let mut state = HashMap::new();
        // In name order: the map's own order differs from one map to the next, and with it
        // which values each weight would draw.
        let mut names: Vec<&String> = self.state.keys().collect();
        names.sort();
        for name in names {
            let t = &self.state[name];
            let v: Vec<f64> =
                t.flatten_all()?.to_vec1::<f64>()?.iter().map(|w| w * (1.0 + j as f64 * DRAW_STEP * (2.0 * rng.f64() - 1.0))).collect();
            state.insert(name.clone(), Tensor::from_vec(v, t.dims(), &Device::Cpu)?);
        }
        Ok(Self { seed: self.seed, state, x: self.x.clone(), y: self.y.clone() })
    }

    /// Loss and gradients on `device`: f64 throughout, or `dtype` (bf16 is the executor's mixed
    /// precision: f32 weights, bf16 matmuls).
    fn on(&self, device: &Device, dtype: DType) -> anyhow::Result<Named> {
        self.with_qk_eps(device, dtype, None)
    }

    /// [`Self::on`] with the q/k norms' epsilon `qk_eps` in place of their input dtype's.
    fn with_qk_eps(&self, device: &Device, dtype: DType, qk_eps: Option<f64>) -> anyhow::Result<Named> {
        let (param_dtype, matmul_dtype) = if dtype == DType::BF16 { (DType::F32, DType::BF16) } else { (dtype, dtype) };
        let mut model = Gpt::new(&toy(), self.seed, param_dtype, device)?.with_matmul_dtype(matmul_dtype).with_qk_norm_eps(qk_eps);
        model.load_state(&self.state)?;
        let x = Tensor::from_slice(&self.x, (ROWS, T), device)?;
        let y = Tensor::from_slice(&self.y, (ROWS, T), device)?;
        loss_and_grads(&model, &x, &y)
    }

    /// The reference: f64 on the CPU, the q/k norms with epsilon `qk_eps` (see [`qk_eps`]).
    fn reference(&self, qk_eps: Option<f64>) -> anyhow::Result<Named> {
        self.with_qk_eps(&Device::Cpu, DType::F64, qk_eps)
    }
}

/// The epsilon of the per-head q/k RMS norm in the GPU's bf16 formulation: those norms read
/// bf16 rows (as under PyTorch's autocast) and so take bf16's epsilon.
fn gpu_bf16_qk_eps() -> f64 {
    crate::model::ops::rms_eps(DType::BF16)
}

/// The q/k norms' epsilon of the reference for `device` in `dtype`: the one the device's
/// formulation uses where it is not f64's in effect (the GPU in bf16), so that the comparison
/// measures rounding rather than a different epsilon. Elsewhere the reference's own (f64's):
/// an f32 norm's epsilon, 1.2e-7, is within the f32 tolerance.
fn qk_eps(device: &Device, dtype: DType) -> Option<f64> {
    (!device.is_cpu() && dtype == DType::BF16).then(gpu_bf16_qk_eps)
}

/// How many values each quantity of [`errors`] has, in its order.
fn value_counts(named: &Named) -> Vec<usize> {
    std::iter::once(1).chain(named.1.iter().map(|(_, v)| v.len())).collect()
}

/// `(name, relative error)` of `got` against `want`, the loss first.
fn errors(got: &Named, want: &Named) -> Vec<(String, f64)> {
    let mut out = vec![("loss".to_string(), ((got.0 - want.0) / want.0).abs())];
    out.extend(got.1.iter().zip(&want.1).map(|((name, g), (_, r))| (name.clone(), rel_err(g, r))));
    out
}

/// Each quantity's expected error in bf16: the GPU's formulation in bf16 on the CPU's
/// references, against f64 with the same q/k epsilon, RMS over [`DRAWS`] draws of the rounding.
fn expected_bf16(problem: &Problem) -> anyhow::Result<Vec<f64>> {
    let mut sq: Vec<f64> = Vec::new();
    for j in 0..DRAWS {
        let p = problem.draw(j)?;
        let reference = p.reference(Some(gpu_bf16_qk_eps()))?;
        let emulated = crate::model::with_gpu_formulation(|| p.on(&Device::Cpu, DType::BF16))?;
        let e = errors(&emulated, &reference);
        sq.resize(e.len(), 0.0);
        for (s, (_, e)) in sq.iter_mut().zip(e) {
            *s += e * e / DRAWS as f64;
        }
    }
    Ok(sq.into_iter().map(f64::sqrt).collect())
}

/// The bf16 bound of the quantity `name` (`loss`, a parameter's gradient, a kernel check) of
/// `values` values, from its expected error.
pub fn bf16_bound(name: &str, values: usize, expected: f64) -> f64 {
    let factor = if values < FEW_VALUES && name != "loss" { FEW_FACTOR } else { EXPECTED_FACTOR };
    let floor = if name == "loss" { LOSS_FLOOR } else { EXPECTED_FLOOR };
    (factor * expected).max(floor)
}

/// The model's quantities, `got` in `dtype` against the f64 `reference` of `problem`, each
/// with its bound.
fn model_comparisons(problem: &Problem, reference: &Named, got: &Named, dtype: DType) -> anyhow::Result<Vec<Compared>> {
    let errs = errors(got, reference);
    Ok(if dtype == DType::BF16 {
        let expected = expected_bf16(problem)?;
        errs.into_iter()
            .zip(expected)
            .zip(value_counts(reference))
            .map(|(((name, rel_err), x), n)| Compared { bound: bf16_bound(&name, n, x), name, rel_err, expected: Some(x) })
            .collect()
    } else {
        errs.into_iter().map(|(name, e)| Compared::fixed(name, e, tolerance(dtype))).collect()
    })
}

/// Compares `device` in `dtype` against the CPU in f64 on one batch of 4 x 64 tokens.
pub fn run(device: &Device, device_name: &str, dtype: DType, seed: u64) -> anyhow::Result<ParityReport> {
    let problem = Problem::new(seed)?;
    let reference = problem.reference(qk_eps(device, dtype))?;
    let got = problem.on(device, dtype)?;
    let tol = tolerance(dtype);
    let mut compared = model_comparisons(&problem, &reference, &got, dtype)?;
    if !device.is_cpu() {
        compared.extend(kernel_checks(device, dtype, seed)?);
        for (name, dedicated) in [("upload stream", true), ("upload sync", false)] {
            // 3 x the copy stream's ring: every slot is reused twice.
            // The count itself is the error: one differing token fails.
            let (differing, of) = crate::device::cuda_copy::check_copies(device, dedicated, 3 * crate::device::cuda_copy::RING)?;
            compared.push(Compared::fixed(format!("{name}: tokens differing of {of}"), differing as f64, 0.0));
        }
    }
    let rule = if dtype == DType::BF16 {
        format!(
            "model: max({EXPECTED_FACTOR} x expected ({FEW_FACTOR} x under {FEW_VALUES} values), {EXPECTED_FLOOR:.0e}; loss \
             {LOSS_FLOOR:.0e}), expected = the GPU's graph in bf16 on the CPU's kernel references against f64 with the same q/k \
             norm epsilon (RMS of {DRAWS} draws); kernels: the same, expected = the op's CPU reference in bf16"
        )
    } else {
        format!("{tol:.0e}")
    };
    Ok(ParityReport {
        device: device_name.into(),
        dtype: if dtype == DType::BF16 { "bf16 matmuls, f32 weights".into() } else { format!("{dtype:?}").to_lowercase() },
        loss: (got.0, reference.0),
        max_rel_err: worst(compared.iter().map(|c| c.rel_err)),
        worst_ratio: worst(compared.iter().map(Compared::ratio)),
        ok: compared.iter().all(Compared::ok),
        compared,
        tolerance: tol,
        rule,
    })
}

/// [`crate::model::ops::norm_rope`] of `x` `(N, heads * D)` with RoPE tables for
/// sequences of `t`.
fn norm_rope_case(x: &Tensor, t: usize, heads: usize) -> candle_core::Result<Tensor> {
    let d = x.dim(1)? / heads;
    let (cos, sin) = crate::model::ops::rope_tables(t, d, 10_000.0, x.dtype(), x.device())?;
    crate::model::ops::norm_rope(x, &Tensor::cat(&[&cos, &sin], 1)?, heads, None)
}

/// Attention of `b` sequences with `heads` query heads over `kv` KV heads of 64 channels, q, k
/// and v the column blocks of `x` `(b*t, (heads + 2 kv) * 64)`: the flash `kernels` where they
/// run (CUDA, bf16), the fused attention elsewhere (its CPU implementation is the reference).
fn attention_case(x: &Tensor, b: usize, heads: usize, kv: usize, kernels: FlashKernels) -> candle_core::Result<Tensor> {
    use crate::model::flash_attn;
    let d = flash_attn::HEAD_DIM;
    let (q, k, v) = (x.narrow(1, 0, heads * d)?, x.narrow(1, heads * d, kv * d)?, x.narrow(1, (heads + kv) * d, kv * d)?);
    if flash_attn::unsupported(q.device(), q.dtype(), x.dim(0)? / b, d).is_none() {
        flash_attn::flash_attention(&q, &k, &v, b, heads, kv, kernels)
    } else {
        crate::model::ops::causal_attention_tokens(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, b, heads, kv)
    }
}

/// [`attention_case`] within documents: 2 sequences of 192 with segments starting mid-tile,
/// on a tile's edge, twice in a row and at a sequence's start (flash_mma's document kernels, or
/// cuDNN's ragged attention, where they run; the fused masked attention elsewhere).
fn attention_docs_case(x: &Tensor, kernels: FlashKernels) -> candle_core::Result<Tensor> {
    use crate::model::flash_attn;
    let (b, t, heads, kv) = (2, 192, 4, 2);
    let d = flash_attn::HEAD_DIM;
    let mut ids = vec![5u32; b * t];
    for p in [0, 37, 64, 65, 150, t, t + 100] {
        ids[p] = 1;
    }
    let docs = crate::model::ops::DocumentMask::at_token(&ids, t, crate::model::ops::DocRule::at(1))?;
    let (q, k, v) = (x.narrow(1, 0, heads * d)?, x.narrow(1, heads * d, kv * d)?, x.narrow(1, (heads + kv) * d, kv * d)?);
    if flash_attn::unsupported(q.device(), q.dtype(), t, d).is_none() {
        flash_attn::flash_attention_docs(&q, &k, &v, b, heads, kv, kernels, &docs)
    } else {
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        crate::model::ops::document_attention_tokens(&q, &k, &v, b, heads, kv, Some(&docs))
    }
}

/// `x` in f32 when it is bf16 (the residual stream's dtype under mixed precision), else itself.
fn widened(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.dtype() == DType::BF16 { crate::model::ops::cast(x, DType::F32) } else { Ok(x.clone()) }
}

/// A device op and the shape of the random input it is checked on.
type KernelCase = (&'static str, Vec<usize>, fn(&Tensor) -> candle_core::Result<Tensor>);

/// The device's own kernels against their CPU references in f64, on random inputs of awkward
/// sizes (rows not a multiple of a block, lengths not a multiple of a warp): each op's output
/// and the gradient of its input under a random output gradient, as `kernel <op> <shape>
/// out|grad`. In bf16 each is bounded by its expected error, the op's CPU reference run in bf16
/// (see [`bf16_bound`]); the output gradient is of the output's dtype (the cross-entropy's
/// losses are f32 whatever its logits).
pub fn kernel_checks(device: &Device, dtype: DType, seed: u64) -> anyhow::Result<Vec<Compared>> {
    use crate::model::ops::{self, causal_softmax};
    let cases: Vec<KernelCase> = vec![
        ("causal_softmax", vec![2, 3, 128, 128], |x| causal_softmax(x, 0.125)),
        ("causal_softmax", vec![1, 2, 1000, 1000], |x| causal_softmax(x, 0.3)),
        ("rms_norm", vec![1000, 512], ops::rms_norm),
        ("rms_norm", vec![37, 3, 70], ops::rms_norm),
        ("relu_sq", vec![333, 1024], ops::relu_sq),
        ("norm_rope", vec![3 * 100, 4 * 64], |x| norm_rope_case(x, 100, 4)),
        ("norm_rope", vec![2 * 9, 3 * 6], |x| norm_rope_case(x, 9, 3)),
        // The per-channel parameters are rows of x itself, so that their gradients are checked too.
        ("scale_add", vec![257, 96], |x| ops::scale_add(&(x * 0.5)?, x, &x.get(0)?)),
        ("scale_cols", vec![100, 64], |x| ops::scale_cols(x, &x.get(3)?)),
        ("embedding", vec![50, 512], |w| {
            crate::model::ops::embedding(
                w,
                &Tensor::from_vec((0..3000u32).map(|i| (i * 7919) % 49).collect::<Vec<u32>>(), 3000, w.device())?,
            )
        }),
        ("resid_mix", vec![130, 512], |x| ops::resid_mix(x, &((x * 0.3)? + 0.1)?, &x.narrow(0, 0, 2)?)),
        // Mixed precision where the kernels run bf16: the f32 stream's inputs are x widened (the
        // `_f32_bf16` kernels); in the f64 reference everything stays f64.
        ("rms_norm_to", vec![1000, 512], |x| ops::rms_norm_to(&widened(x)?, x.dtype())),
        ("rms_norm_to", vec![37, 70], |x| ops::rms_norm_to(&widened(x)?, x.dtype())),
        ("scale_add_mixed", vec![257, 96], |x| ops::scale_add(&widened(&(x * 0.5)?)?, x, &widened(&x.get(0)?)?)),
        // Logits scaled so that the soft-cap (30) bends them; targets spread over the classes.
        ("softcap_ce", vec![300, 1024], |x| {
            let targets = Tensor::from_vec((0..300u32).map(|i| (i * 7919) % 1024).collect::<Vec<u32>>(), 300, x.device())?;
            ops::softcap_cross_entropy(&(x * 20.0)?, &targets, 30.0)
        }),
        ("softcap_ce", vec![7, 50], |x| {
            let targets = Tensor::from_vec(vec![0u32, 49, 3, 17, 25, 49, 1], 7, x.device())?;
            ops::softcap_cross_entropy(&(x * 20.0)?, &targets, 30.0)
        }),
        // Several tiles each way, grouped heads (and, with one KV head, a group of four); both
        // implementations of the flash kernels.
        ("attention", vec![2 * 192, (4 + 2 * 2) * 64], |x| attention_case(x, 2, 4, 2, FlashKernels::Wmma)),
        ("attention", vec![3 * 64, (4 + 2) * 64], |x| attention_case(x, 3, 4, 1, FlashKernels::Wmma)),
        ("attention_mma", vec![2 * 192, (4 + 2 * 2) * 64], |x| attention_case(x, 2, 4, 2, FlashKernels::Mma)),
        ("attention_mma", vec![3 * 64, (4 + 2) * 64], |x| attention_case(x, 3, 4, 1, FlashKernels::Mma)),
        ("attention_mma_docs", vec![2 * 192, (4 + 2 * 2) * 64], |x| attention_docs_case(x, FlashKernels::Mma)),
        // cuDNN's fused attention (flash_mma, with a warning line, where cuDNN cannot run).
        ("attention_cudnn", vec![2 * 192, (4 + 2 * 2) * 64], |x| attention_case(x, 2, 4, 2, FlashKernels::Cudnn)),
        ("attention_cudnn", vec![3 * 64, (4 + 2) * 64], |x| attention_case(x, 3, 4, 1, FlashKernels::Cudnn)),
        ("attention_cudnn_docs", vec![2 * 192, (4 + 2 * 2) * 64], |x| attention_docs_case(x, FlashKernels::Cudnn)),
    ];
    let kernel_dtype = if dtype == DType::F64 { DType::F32 } else { dtype };
    let mut rng = fastrand::Rng::with_seed(seed ^ 0xcafe);
    let mut out = Vec::new();
    for (name, shape, op) in cases {
        let n: usize = shape.iter().product();
        let x = Tensor::from_vec((0..n).map(|_| rng.f64() * 4.0 - 2.0).collect::<Vec<f64>>(), shape.as_slice(), &Device::Cpu)?;
        let g_seed = rng.u64(..);
        let run = |d: &Device, dt: DType| -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
            let x = candle_core::Var::from_tensor(&x.to_dtype(dt)?.to_device(d)?)?;
            let y = op(x.as_tensor())?;
            // The same output gradient on both sides, of the output's shape.
            let mut grng = fastrand::Rng::with_seed(g_seed);
            let g = Tensor::from_vec((0..y.elem_count()).map(|_| grng.f64() * 2.0 - 1.0).collect::<Vec<f64>>(), y.shape(), &Device::Cpu)?;
            let grads = (&y * g.to_dtype(y.dtype())?.to_device(d)?)?.sum_all()?.backward()?;
            let dx = grads.get(x.as_tensor()).ok_or_else(|| anyhow::anyhow!("{name}: no gradient"))?;
            let host =
                |t: &Tensor| -> anyhow::Result<Vec<f64>> { Ok(t.to_dtype(DType::F64)?.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?) };
            Ok((host(&y)?, host(dx)?))
        };
        let (want_y, want_dx) = run(&Device::Cpu, DType::F64)?;
        let (got_y, got_dx) = run(device, kernel_dtype)?;
        let errs = [("out", rel_err(&got_y, &want_y)), ("grad", rel_err(&got_dx, &want_dx))];
        if kernel_dtype == DType::BF16 {
            // The kernel's expected error: its CPU reference in bf16 (f32 inside, one rounding out).
            let (emu_y, emu_dx) = crate::model::with_gpu_formulation(|| run(&Device::Cpu, DType::BF16))?;
            let expected = [rel_err(&emu_y, &want_y), rel_err(&emu_dx, &want_dx)];
            for (((what, e), x), n) in errs.into_iter().zip(expected).zip([want_y.len(), want_dx.len()]) {
                let name = format!("kernel {name} {shape:?} {what}");
                out.push(Compared { bound: bf16_bound(&name, n, x), name, rel_err: e, expected: Some(x) });
            }
        } else {
            for (what, e) in errs {
                out.push(Compared::fixed(format!("kernel {name} {shape:?} {what}"), e, tolerance(dtype)));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU's f32 path (fused ops) agrees with f64; and the check can fail: an f32 model
    /// judged against the f64 tolerance does not pass.
    #[test]
    fn cpu_f32_matches_f64_and_the_check_can_fail() {
        let r = run(&Device::Cpu, "cpu", DType::F32, 3).unwrap();
        assert!(r.ok, "{r:?}");
        assert_eq!(r.compared.len(), 1 + Gpt::new(&toy(), 3, DType::F32, &Device::Cpu).unwrap().params().len());
        assert!(r.compared.iter().all(|c| c.rel_err > 0.0), "f32 cannot equal f64 exactly: {r:?}");
        assert!(r.max_rel_err > tolerance(DType::F64), "{}", r.max_rel_err);
    }

    /// The kernel checks' plumbing on the CPU (the ops' CPU implementations in f32 against
    /// f64): close but not exact, for every case.
    #[test]
    fn kernel_checks_compare_outputs_and_gradients() {
        let r = kernel_checks(&Device::Cpu, DType::F32, 1).unwrap();
        assert_eq!(r.len(), 48);
        assert!(r.iter().all(|c| c.rel_err > 0.0 && c.rel_err < 1e-5), "{r:?}");
    }

    /// The mixed precision (bf16 matmuls over f32 weights) runs on the CPU too: each quantity
    /// within its bound, and clearly less exact than f32 (the matmuls really are bf16).
    #[test]
    fn cpu_mixed_bf16_is_within_its_bounds() {
        let r = run(&Device::Cpu, "cpu", DType::BF16, 3).unwrap();
        assert!(r.ok, "{r:?}");
        for c in &r.compared {
            let floor = if c.name == "loss" { LOSS_FLOOR } else { EXPECTED_FLOOR };
            assert!(c.expected.is_some() && c.bound >= floor, "{c:?}");
        }
        assert!(r.worst_ratio > 0.0 && r.worst_ratio <= 1.0, "{}", r.worst_ratio);
        // The bounds repeat: every draw of the rounding is the seed's.
        let again = run(&Device::Cpu, "cpu", DType::BF16, 3).unwrap();
        let bounds = |r: &ParityReport| r.compared.iter().map(|c| c.bound.to_bits()).collect::<Vec<_>>();
        assert_eq!(bounds(&r), bounds(&again));
        let f32 = run(&Device::Cpu, "cpu", DType::F32, 3).unwrap();
        assert!(r.max_rel_err > 2.0 * f32.max_rel_err, "bf16 {} vs f32 {}", r.max_rel_err, f32.max_rel_err);
    }

    /// The expected errors are bf16's: the GPU formulation in bf16 on the CPU's references is
    /// far from f32 (every gradient beyond 1e-3) and within a few roundings of the f64
    /// reference with the same q/k epsilon (every one under 3e-2), and a fresh draw of the
    /// rounding stays within bounds. Against a reference with f64's epsilon in the q/k norms,
    /// the q and k projections' errors are several times larger: there the epsilon, not the
    /// rounding, is most of the error (which is why the reference takes the device's).
    #[test]
    fn expected_errors_are_bf16_rounding() {
        let problem = Problem::new(1).unwrap();
        let expected = expected_bf16(&problem).unwrap();
        let reference = problem.reference(Some(gpu_bf16_qk_eps())).unwrap();
        let names: Vec<String> = errors(&reference, &reference).into_iter().map(|(n, _)| n).collect();
        for (name, x) in names.iter().zip(&expected) {
            assert!(x.is_finite() && *x < 3e-2, "{name}: {x}");
            if name != "loss" {
                assert!(*x > 1e-3, "{name}: {x}");
            }
        }
        let emulated = crate::model::with_gpu_formulation(|| problem.on(&Device::Cpu, DType::BF16)).unwrap();
        let f64_eps = errors(&emulated, &problem.reference(None).unwrap());
        for ((name, e), x) in f64_eps.iter().zip(&expected) {
            if name.contains("attn.c_q") || name.contains("attn.c_k") {
                assert!(*e > 3.0 * x, "{name}: {e} against f64's epsilon, expected {x} with bf16's");
            }
        }
        let fresh = problem.draw(DRAWS + 1).unwrap();
        let fresh_ref = fresh.reference(Some(gpu_bf16_qk_eps())).unwrap();
        let got = crate::model::with_gpu_formulation(|| fresh.on(&Device::Cpu, DType::BF16)).unwrap();
        for (((name, e), x), n) in errors(&got, &fresh_ref).into_iter().zip(&expected).zip(value_counts(&fresh_ref)) {
            assert!(e <= bf16_bound(&name, n, *x), "{name}: {e} vs expected {x}");
        }
    }

    /// The bf16 bounds catch what one tolerance would not: a device with one per-channel scale
    /// 3% off (say a kernel reading a stale copy) fails on the gradients it feeds, while its
    /// largest error stays under the 5e-2 a single bf16 tolerance allowed.
    #[test]
    fn bf16_bounds_catch_a_small_wrong_weight() {
        let problem = Problem::new(3).unwrap();
        let reference = problem.reference(Some(gpu_bf16_qk_eps())).unwrap();
        let mut wrong = problem.draw(0).unwrap();
        let scale = wrong.state.get_mut("blocks.1.mlp_scale").unwrap();
        *scale = (&*scale * 1.03).unwrap();
        let got = crate::model::with_gpu_formulation(|| wrong.on(&Device::Cpu, DType::BF16)).unwrap();
        let judged = model_comparisons(&problem, &reference, &got, DType::BF16).unwrap();
        let failed: Vec<&str> = judged.iter().filter(|c| !c.ok()).map(|c| c.name.as_str()).collect();
        assert!(failed.contains(&"blocks.1.mlp.proj.weight"), "{judged:?}");
        // 5e-2: the one bf16 tolerance this check had before.
        assert!(worst(judged.iter().map(|c| c.rel_err)) < 5e-2, "{judged:?}");

        // (A correct device passing: `expected_errors_are_bf16_rounding`, on a draw of its own.)
    }

    /// The q/k epsilon in the reference is what lets the attention's gradients be checked: a
    /// query gain 5% off fails on the q and k projections' gradients. Against the f64-epsilon
    /// reference the same device's errors are far under the bounds that reference would give
    /// (its expected error there is mostly the epsilon).
    #[test]
    fn bf16_bounds_catch_a_wrong_query_gain() {
        let problem = Problem::new(3).unwrap();
        let mut wrong = problem.draw(0).unwrap();
        let gain = wrong.state.get_mut("blocks.0.attn.q_gain").unwrap();
        *gain = (&*gain * 1.05).unwrap();
        let got = crate::model::with_gpu_formulation(|| wrong.on(&Device::Cpu, DType::BF16)).unwrap();
        let judged = model_comparisons(&problem, &problem.reference(Some(gpu_bf16_qk_eps())).unwrap(), &got, DType::BF16).unwrap();
        let failed: Vec<&str> = judged.iter().filter(|c| !c.ok()).map(|c| c.name.as_str()).collect();
        assert!(failed.contains(&"blocks.0.attn.c_q.weight") && failed.contains(&"blocks.0.attn.c_k.weight"), "{judged:?}");

        let old_ref = problem.reference(None).unwrap();
        let correct = crate::model::with_gpu_formulation(|| problem.on(&Device::Cpu, DType::BF16)).unwrap();
        for ((name, e), (_, x)) in errors(&got, &old_ref).into_iter().zip(errors(&correct, &old_ref)) {
            if name == "blocks.0.attn.c_q.weight" {
                let bound = bf16_bound(&name, 64 * 64, x);
                assert!(e < 0.5 * bound, "{name}: {e} against f64's epsilon, whose bound would be {bound}");
            }
        }
    }

    /// Every kernel check in bf16 on the CPU references (what the GPU's are bounded by): each
    /// error of bf16 size (the reference really rounded), deterministic, so equal to its
    /// expected error. This runs every op's bf16 reference, the cross-entropy's f32 losses of
    /// bf16 logits included.
    #[test]
    fn kernel_checks_in_bf16_on_the_cpu_references() {
        let r = crate::model::with_gpu_formulation(|| kernel_checks(&Device::Cpu, DType::BF16, 1)).unwrap();
        assert_eq!(r.len(), 48);
        for c in &r {
            assert!(c.rel_err > 5e-4 && c.rel_err < 1e-2, "{c:?}");
            assert_eq!(c.expected, Some(c.rel_err), "{c:?}");
            assert!(c.ok() && c.bound >= EXPECTED_FLOOR, "{c:?}");
        }
    }

    /// A NaN fails its comparison; a fixed bound of zero passes only zero.
    #[test]
    fn compared_judges_nan_and_zero_bounds() {
        assert!(!Compared::fixed("x".into(), f64::NAN, 1.0).ok());
        assert!(Compared::fixed("copies".into(), 0.0, 0.0).ok());
        assert!(!Compared::fixed("copies".into(), 1.0, 0.0).ok());
        assert_eq!(Compared::fixed("copies".into(), 0.0, 0.0).ratio(), 0.0);
        assert_eq!(Compared::fixed("copies".into(), 2.0, 0.0).ratio(), f64::INFINITY);
        assert!(Compared::fixed("x".into(), f64::NAN, 1.0).ratio().is_nan());
        assert_eq!(Compared::fixed("x".into(), 1e-3, 1e-2).ratio(), 0.1);
    }

    /// The measurement behind [`EXPECTED_FACTOR`] and [`FEW_FACTOR`] (slow: `cargo test
    /// --release --lib bf16_bound_margin -- --ignored --nocapture`): over 24 seeds, each of 4
    /// fresh draws of the rounding (draws 3 to 6) against the RMS of draws 0 to 2, the largest
    /// ratio of a gradient's error (beyond 1e-3) to its expected error, for quantities of
    /// [`FEW_VALUES`] values or more and for the others. Each must stay under half its factor.
    #[test]
    #[ignore]
    fn bf16_bound_margin() {
        let (mut many, mut few): (f64, f64) = (0.0, 0.0);
        for seed in 1..25 {
            let problem = Problem::new(seed).unwrap();
            let expected = expected_bf16(&problem).unwrap();
            let mut worst_here = (0.0, String::new());
            for j in DRAWS..DRAWS + 4 {
                let p = problem.draw(j).unwrap();
                let reference = p.reference(Some(gpu_bf16_qk_eps())).unwrap();
                let got = crate::model::with_gpu_formulation(|| p.on(&Device::Cpu, DType::BF16)).unwrap();
                for (((name, e), x), n) in errors(&got, &reference).into_iter().zip(&expected).zip(value_counts(&reference)) {
                    if e <= 1e-3 {
                        continue;
                    }
                    let class = if n < FEW_VALUES { &mut few } else { &mut many };
                    *class = class.max(e / x);
                    if e / x > worst_here.0 {
                        worst_here = (e / x, name);
                    }
                }
            }
            eprintln!("seed {seed}: largest error / expected {:.2} ({})", worst_here.0, worst_here.1);
        }
        eprintln!("over all seeds: {many:.2} (factor {EXPECTED_FACTOR}); under {FEW_VALUES} values {few:.2} (factor {FEW_FACTOR})");
        assert!(many < EXPECTED_FACTOR / 2.0 && few < FEW_FACTOR / 2.0, "{many} {few}");
    }
}
