//! The GPT: its parameters (named as the PyTorch script's `state_dict`), their initialisation
//! and optimizer groups, loading and reading them. The engine trains and scores them; the candle
//! executor's forward pass over them is [`super::forward`] (feature `candle`).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};

use super::ModelConfig;
use super::config::Init as InitKind;
use super::flash_attn::{self, Attention, FlashKernels};
use super::init::Init;

/// Which optimizer group a parameter belongs to (as the challenge script splits them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamGroup {
    /// 2-D block matrices: Muon at `matrix_lr`.
    Matrix,
    /// The token embedding: Adam at `tied_embed_lr` (or `embed_lr` when untied).
    Embedding,
    /// Vectors, scalars and control tensors (`q_gain`, `attn_scale`, `mlp_scale`, `resid_mix`,
    /// `skip_weights`, `skip_gates`): Adam at `scalar_lr`.
    Scalar,
    /// The untied output head: Adam at `head_lr`.
    Head,
}

/// Names that mark a block tensor as a control tensor (Adam, fp32), as in the challenge script.
const CONTROL_PATTERNS: [&str; 7] = ["attn_scale", "mlp_scale", "resid_mix", "q_gain", "skip_weight", "skip_gate", "attn_gate"];

/// The baseline GPT.
pub struct Gpt {
    pub(super) cfg: ModelConfig,
    pub(super) params: Vec<(String, Var, ParamGroup)>,
    pub(super) index: HashMap<String, usize>,
    pub(super) device: Device,
    pub(super) dtype: DType,
    /// Matmuls in this dtype when set (the records' bf16 matmuls over f32 master weights).
    pub(super) matmul_dtype: Option<DType>,
    /// Forward passes read detached parameters (no autograd graph): set during evaluation.
    #[cfg(feature = "candle")]
    pub(super) detached: std::cell::Cell<bool>,
    /// The attention kernel on a GPU.
    pub(super) attention: Attention,
    /// The q/k RMS norm's epsilon where it is not its input dtype's (see [`Gpt::with_qk_norm_eps`]).
    #[cfg(feature = "candle")]
    pub(super) qk_eps: Option<f64>,
    /// Whether the forward pass runs the looped layer sequence (depth recurrence on; see
    /// [`Gpt::set_looping`]).
    pub(super) looping: bool,
}

impl Gpt {
    /// A freshly initialised model (spec 3.4): embedding N(0, tied_embed_init_std^2) when tied,
    /// N(0, 1) (PyTorch's `nn.Embedding` default) when not;
    /// attention output and MLP down projections (and an untied head) zero; other matrices
    /// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), or orthogonal under `model.init = "orthogonal"` where
    /// both dims are at least 64 (spec 4.3); q_gain = qk_gain_init, scales 1, resid_mix [1; 0],
    /// skip weights 1, skip gates 0. A model with depth recurrence starts looped.
    pub fn new(cfg: &ModelConfig, seed: u64, dtype: DType, device: &Device) -> anyhow::Result<Self> {
        cfg.check()?;
        let mut init = Init(fastrand::Rng::with_seed(seed));
        let kaiming = |init: &mut Init, shape: &[usize]| init.uniform(shape[0] * shape[1], 1.0 / (shape[1] as f64).sqrt());
        // Values drawn in `param_shapes` order: embedding, then per block c_q, c_k, c_v, fc.
        let mut specs: Vec<(String, Vec<usize>, Vec<f64>)> = Vec::new();
        for (name, shape) in cfg.param_shapes() {
            let n: usize = shape.iter().product();
            let leaf = name.rsplit_once("blocks.").map_or(name.as_str(), |(_, rest)| rest.split_once('.').map_or(rest, |(_, l)| l));
            let values = match leaf {
                // Tied: N(0, tied_embed_init_std^2); untied: nn.Embedding's default N(0, 1).
                "tok_emb.weight" => init.normal(n, if cfg.tie_embeddings { cfg.tied_embed_init_std } else { 1.0 }),
                "attn.c_q.weight" | "attn.c_k.weight" | "attn.c_v.weight" | "mlp.fc.weight"
                    if cfg.init == InitKind::Orthogonal && shape[0] >= 64 && shape[1] >= 64 =>
                {
                    init.orthogonal(shape[0], shape[1])?
                }
                "attn.c_q.weight" | "attn.c_k.weight" | "attn.c_v.weight" | "mlp.fc.weight" => kaiming(&mut init, &shape),
                "attn.proj.weight" | "mlp.proj.weight" | "lm_head.weight" => vec![0.0; n],
                "attn.q_gain" => vec![cfg.qk_gain_init; n],
                // sigmoid(0) = 0.5: stream and skip weighed equally at init.
                "skip_gates" => vec![0.0; n],
                // The attention gate: sigmoid(0) = 0.5 on every head at init unless drawn.
                "attn.attn_gate_w" if cfg.attn_gate_init_std > 0.0 => init.normal(n, cfg.attn_gate_init_std),
                "attn.attn_gate_w" => vec![0.0; n],
                // The smear: a zero gain on a zero-weight gate, so the model starts without it.
                "smear_gate.weight" | "smear_lambda" => vec![0.0; n],
                "parallel_resid_lambdas" => vec![1.1; n],
                // BigramHash: a zero table (the model starts without it), scaled by 0.05, its
                // projection as the records' `_init_weights` leaves a `.proj` that is not marked
                // zero: orthogonal over sqrt(2 layers) where both dims are at least 64.
                "bigram.embed.weight" => vec![0.0; n],
                "bigram.scale" => vec![0.05; n],
                "bigram.proj.weight" if cfg.init == InitKind::Orthogonal && shape[0] >= 64 && shape[1] >= 64 => {
                    let s = 1.0 / (2.0 * cfg.num_layers as f64).sqrt();
                    init.orthogonal(shape[0], shape[1])?.into_iter().map(|x| x * s).collect()
                }
                "bigram.proj.weight" => kaiming(&mut init, &shape),
                "resid_mix" => {
                    let mut mix = vec![1.0; n / 2];
                    mix.extend(vec![0.0; n - n / 2]);
                    mix
                }
                // skip_weights, attn_scale, mlp_scale, parallel_post_lambdas.
                _ => vec![1.0; n],
            };
            specs.push((name, shape, values));
        }
        let mut params = Vec::with_capacity(specs.len());
        for (name, shape, values) in specs {
            let t = Tensor::from_vec(values, shape.as_slice(), &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?;
            let group = group_of(&name, shape.len());
            params.push((name, Var::from_tensor(&t)?, group));
        }
        let index = params.iter().enumerate().map(|(i, (n, _, _))| (n.clone(), i)).collect();
        Ok(Self {
            cfg: cfg.clone(),
            params,
            index,
            device: device.clone(),
            dtype,
            matmul_dtype: None,
            #[cfg(feature = "candle")]
            detached: std::cell::Cell::new(false),
            attention: Attention::Auto,
            #[cfg(feature = "candle")]
            qk_eps: None,
            looping: cfg.recurrent(),
        })
    }

    /// Gives the per-head RMS norm of q and k this epsilon instead of its input dtype's. For a
    /// reference that computes another precision's formulation exactly: under mixed precision
    /// on a GPU those norms read bf16 rows and so take bf16's epsilon (7.8e-3), which an f64
    /// model would otherwise replace with f64's (see `pipeline parity`).
    #[cfg(feature = "tools")]
    pub fn with_qk_norm_eps(mut self, eps: Option<f64>) -> Self {
        self.qk_eps = eps;
        self
    }

    /// Runs every matmul (projections, MLP, output head) in `dtype`, casting inputs and weights
    /// to it and the product back: with f32 parameters and `BF16`, the challenge's mixed
    /// precision (f32 master weights and optimizer state, bf16 matmuls, f32 everywhere else).
    /// Gradients flow back through the casts in f32.
    pub fn with_matmul_dtype(mut self, dtype: DType) -> Self {
        self.matmul_dtype = (dtype != self.dtype).then_some(dtype);
        self
    }

    /// The matmul dtype (the parameters' unless [`Gpt::with_matmul_dtype`] set another).
    pub fn matmul_dtype(&self) -> DType {
        self.matmul_dtype.unwrap_or(self.dtype)
    }

    /// Chooses the attention kernel of GPU runs ([`Attention::Auto`] unless set).
    pub fn with_attention(mut self, attention: Attention) -> Self {
        self.attention = attention;
        self
    }

    /// The attention choice ([`Gpt::with_attention`]).
    pub fn attention_choice(&self) -> Attention {
        self.attention
    }

    /// The flash kernels a forward pass on sequences of `t` tokens takes (`None`: materialised
    /// attention); an error says why [`Attention::Flash`] or [`Attention::FlashMma`] cannot run
    /// here.
    pub fn flash_kernels(&self, t: usize) -> anyhow::Result<Option<FlashKernels>> {
        match self.flash_unsupported(t) {
            Some(why) if self.attention.requires_flash() => anyhow::bail!("attention = \"{}\" cannot run: {why}", self.attention.name()),
            Some(_) => Ok(None),
            None => Ok(self.attention.flash_kernels()),
        }
    }

    /// Why flash attention cannot run this model's q, k, v (the matmul dtype, on its device)
    /// for sequences of `t` tokens; `None` when it can.
    fn flash_unsupported(&self, t: usize) -> Option<String> {
        flash_attn::unsupported(&self.device, self.matmul_dtype(), t, self.cfg.head_dim())
    }

    /// Switches depth recurrence on or off (no effect without `model.num_loops`). A new model
    /// starts looped, as every evaluation after training runs; training starts unlooped until
    /// `model.enable_looping_at` of its time has passed.
    pub fn set_looping(&mut self, on: bool) {
        self.looping = on && self.cfg.recurrent();
    }

    /// Whether the forward pass runs the looped layer sequence.
    pub fn looping(&self) -> bool {
        self.looping
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Every parameter with its PyTorch `state_dict` name and optimizer group.
    pub fn params(&self) -> &[(String, Var, ParamGroup)] {
        &self.params
    }

    /// The parameter called `name`.
    #[cfg(feature = "tools")]
    pub fn param(&self, name: &str) -> Option<&Var> {
        self.index.get(name).map(|&i| &self.params[i].1)
    }

    /// Number of scalar parameters.
    pub fn param_count(&self) -> usize {
        self.params.iter().map(|(_, v, _)| v.elem_count()).sum()
    }

    /// The parameters as named tensors (the PyTorch `state_dict`).
    pub fn state_dict(&self) -> Vec<(String, Tensor)> {
        self.params.iter().map(|(n, v, _)| (n.clone(), v.as_tensor().clone())).collect()
    }

    /// Replaces every parameter from `tensors` (our layout, or the 04-27 record's banked one:
    /// [`super::banks`]); errors name a missing tensor or a shape that differs from this
    /// model's.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>) -> anyhow::Result<()> {
        let unbanked;
        let tensors = if tensors.contains_key("qo_bank") {
            unbanked = super::banks::from_banks(tensors.clone())?;
            &unbanked
        } else {
            tensors
        };
        for (name, var, _) in &self.params {
            let t = tensors.get(name).ok_or_else(|| anyhow::anyhow!("tensor `{name}` is missing"))?;
            anyhow::ensure!(t.dims() == var.dims(), "tensor `{name}` has shape {:?}, this model's is {:?}", t.dims(), var.dims());
        }
        if let Some(extra) = tensors.keys().find(|k| !self.index.contains_key(*k)) {
            anyhow::bail!("tensor `{extra}` is not a parameter of this model");
        }
        // Everything checked: nothing changes unless everything fits.
        for (name, var, _) in &self.params {
            let t = &tensors[name];
            // A copy: a tensor sharing the variable's own storage cannot be set into it.
            var.set(&t.to_dtype(self.dtype)?.to_device(&self.device)?.copy()?)?;
        }
        Ok(())
    }

    /// The device the parameters live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype of the parameters.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

/// The optimizer group of parameter `name` with `ndim` dimensions.
pub fn group_of(name: &str, ndim: usize) -> ParamGroup {
    // BigramHash's table trains with the token embedding, its projection with the matrices
    // (the records' optimizer groups).
    if name == "tok_emb.weight" || name == "bigram.embed.weight" {
        ParamGroup::Embedding
    } else if name == "lm_head.weight" {
        ParamGroup::Head
    } else if name == "bigram.proj.weight" || name.starts_with("blocks.") && ndim == 2 && !CONTROL_PATTERNS.iter().any(|c| name.contains(c))
    {
        ParamGroup::Matrix
    } else {
        ParamGroup::Scalar
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::PassExtras;
    use crate::model::formulation::Formulation;
    use crate::model::ops::rope_tables;

    fn tiny() -> ModelConfig {
        ModelConfig { vocab_size: 16, num_layers: 3, model_dim: 8, num_heads: 2, num_kv_heads: 1, mlp_mult: 2, ..ModelConfig::default() }
    }

    #[test]
    fn baseline_has_the_challenge_parameter_count_and_names() {
        let m = Gpt::new(&ModelConfig::default(), 1337, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(m.param_count(), 17_059_912, "model_params of the baseline log");
        assert_eq!(m.params().len(), 2 + 9 * 10);
        let shape = |n: &str| m.param(n).unwrap().dims().to_vec();
        assert_eq!(shape("tok_emb.weight"), [1024, 512]);
        assert_eq!(shape("blocks.8.attn.c_k.weight"), [256, 512]);
        assert_eq!(shape("blocks.0.mlp.fc.weight"), [1024, 512]);
        assert_eq!(shape("skip_weights"), [4, 512]);
        let groups = |g: ParamGroup| m.params().iter().filter(|(_, _, x)| *x == g).count();
        assert_eq!((groups(ParamGroup::Matrix), groups(ParamGroup::Embedding), groups(ParamGroup::Scalar)), (54, 1, 37));
    }

    /// The 04-09 record's `Optimizers` sorts its parameters so (its `CONTROL_TENSOR_NAME_PATTERNS`
    /// and `p.ndim < 2` to AdamW at `SCALAR_LR`, other block matrices to Muon, `skip_weights` and
    /// `skip_gates` appended to the scalars, the embedding alone at `TIED_EMBED_LR`), which
    /// scripts/compare-record.py confirms step by step (docs/record.md): each of the record's
    /// names, one by one.
    #[test]
    fn the_record_groups_its_parameters_as_its_optimizers_do() {
        let record_patterns = [
            "attn_scale",
            "attn_scales",
            "mlp_scale",
            "mlp_scales",
            "resid_mix",
            "resid_mixes",
            "q_gain",
            "skip_weight",
            "skip_weights",
            "skip_gates",
        ];
        let cfg = ModelConfig::record();
        let mut counts = std::collections::HashMap::new();
        for (name, shape) in cfg.param_shapes() {
            let want = if name == "tok_emb.weight" {
                ParamGroup::Embedding
            } else if let Some(rest) = name.strip_prefix("blocks.") {
                let control = record_patterns.iter().any(|p| rest.contains(p));
                if shape.len() == 2 && !control { ParamGroup::Matrix } else { ParamGroup::Scalar }
            } else {
                assert!(name == "skip_weights" || name == "skip_gates", "{name}: not a parameter the record's optimizers know");
                ParamGroup::Scalar
            };
            assert_eq!(group_of(&name, shape.len()), want, "{name} {shape:?}");
            *counts.entry(format!("{want:?}")).or_insert(0) += 1;
        }
        assert_eq!((counts["Matrix"], counts["Embedding"], counts["Scalar"]), (66, 1, 46), "{counts:?}");
    }

    #[test]
    fn initial_loss_is_about_ln_vocab_and_seeded_init_repeats() {
        let cfg = tiny();
        let a = Gpt::new(&cfg, 5, DType::F64, &Device::Cpu).unwrap();
        let b = Gpt::new(&cfg, 5, DType::F64, &Device::Cpu).unwrap();
        let x = Tensor::from_vec((0..24u32).map(|i| i % 16).collect::<Vec<_>>(), (2, 12), &Device::Cpu).unwrap();
        let y = Tensor::from_vec((0..24u32).map(|i| (i * 7 + 3) % 16).collect::<Vec<_>>(), (2, 12), &Device::Cpu).unwrap();
        let la = a.loss(&x, &y).unwrap().to_scalar::<f64>().unwrap();
        let lb = b.loss(&x, &y).unwrap().to_scalar::<f64>().unwrap();
        assert_eq!(la.to_bits(), lb.to_bits());
        assert!((la - 16f64.ln()).abs() < 0.01, "loss at init {la}, ln 16 = {}", 16f64.ln());
    }

    #[test]
    fn load_state_names_the_bad_tensor() {
        let mut m = Gpt::new(&tiny(), 0, DType::F32, &Device::Cpu).unwrap();
        let mut sd: HashMap<String, Tensor> = m.state_dict().into_iter().collect();
        sd.insert("blocks.0.attn.c_q.weight".into(), Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap());
        let e = m.load_state(&sd).unwrap_err().to_string();
        assert!(e.contains("blocks.0.attn.c_q.weight") && e.contains("[3, 3]"), "{e}");
        sd.remove("blocks.0.attn.c_q.weight");
        assert!(m.load_state(&sd).unwrap_err().to_string().contains("`blocks.0.attn.c_q.weight` is missing"));
    }

    /// Central finite differences of the whole tiny model (in float64, all parameters made
    /// non-trivial first) against candle's backward pass.
    #[test]
    fn gradients_match_finite_differences() {
        let m = moved(&ModelConfig { tie_embeddings: false, ..tiny() }, 11);
        let x = Tensor::from_vec((0..10u32).map(|i| (i * 5 + 1) % 16).collect::<Vec<_>>(), (2, 5), &Device::Cpu).unwrap();
        let y = Tensor::from_vec((0..10u32).map(|i| (i * 3 + 2) % 16).collect::<Vec<_>>(), (2, 5), &Device::Cpu).unwrap();
        crate::model::reference::assert_gradients_match_finite_differences(&m, &x, &y);
    }

    /// A tiny f64 model with `cfg`, every parameter moved off its initial value (zero
    /// projections, and the 04-27 elements' zero gates and gains, would hide their gradients).
    fn moved(cfg: &ModelConfig, seed: u64) -> Gpt {
        let m = Gpt::new(cfg, 9, DType::F64, &Device::Cpu).unwrap();
        let mut rng = fastrand::Rng::with_seed(seed);
        for (_, v, _) in m.params() {
            let vals: Vec<f64> = (0..v.elem_count()).map(|_| rng.f64() * 0.8 - 0.4).collect();
            v.set(&Tensor::from_vec(vals, v.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        m
    }

    /// Each 04-27 element alone on the tiny model: it changes the loss (it is wired in) and
    /// autograd's gradients of every parameter, its own included, match finite differences.
    #[test]
    fn the_04_27_elements_are_wired_in_and_differentiate() {
        let x = Tensor::from_vec((0..12u32).map(|i| (i * 5 + 1) % 16).collect::<Vec<_>>(), (2, 6), &Device::Cpu).unwrap();
        let y = Tensor::from_vec((0..12u32).map(|i| (i * 3 + 2) % 16).collect::<Vec<_>>(), (2, 6), &Device::Cpu).unwrap();
        for name in ["SmearGate", "document-masked attention", "sparse attention gate", "two-lane parallel decoder"] {
            let mut cfg = tiny();
            (crate::model::elements::element(name).unwrap().enable)(&mut cfg);
            let m = moved(&cfg, 11);
            // The same weights without the element: its own parameters left out.
            let mut off = tiny();
            off.vocab_size = cfg.vocab_size;
            let mut plain = Gpt::new(&off, 9, DType::F64, &Device::Cpu).unwrap();
            let shared: HashMap<String, Tensor> = m.state_dict().into_iter().filter(|(n, _)| plain.param(n).is_some()).collect();
            plain.load_state(&shared).unwrap();
            let (a, b) = (m.loss(&x, &y).unwrap().to_scalar::<f64>().unwrap(), plain.loss(&x, &y).unwrap().to_scalar::<f64>().unwrap());
            assert!((a - b).abs() > 1e-6, "{name}: the loss does not move ({a} vs {b})");
            crate::model::reference::assert_gradients_match_finite_differences(&m, &x, &y);
        }
    }

    /// The lane block against its formula, each lambda a different value (so that a swapped
    /// index shows): `l_k' = resid[i,k] l_k + post[i,0,k] a + post[i,1,k] m`, with `a` the
    /// attention of lane 0 mixed with `x0` and `m` the MLP of lane 1, each times its scale.
    #[test]
    fn the_lane_block_is_its_formula() {
        let mut cfg = tiny();
        cfg.parallel_decoder_start = Some(1);
        cfg.ln_scale = true;
        let m = moved(&cfg, 21);
        let (b, t, d) = (2, 4, cfg.model_dim);
        let l0 = crate::model::ops::testing::seeded(&[b * t, d], 1);
        let l1 = crate::model::ops::testing::seeded(&[b * t, d], 2);
        let x0 = crate::model::ops::testing::seeded(&[b * t, d], 3);
        let f = Formulation::choose(&l0, DType::F64, None, Attention::Auto, (t, cfg.head_dim()));
        let (cos, sin) = rope_tables(t, cfg.rotary_dims(), cfg.rope_base_for(t), DType::F64, &Device::Cpu).unwrap();
        let i = 2;
        let (n0, n1) = m.lane_block(&f, (i, 1), (&l0, &l1), &x0, b, &cos, &sin).unwrap();
        let p = |s: &str| m.p(&format!("blocks.{i}.{s}"));
        let s = 1.0 / 3f64.sqrt();
        let u = crate::model::ops::resid_mix(&l0, &x0, &p("resid_mix")).unwrap();
        let a = m.attention(&f, (i, 1), &f.norm_in(&u).unwrap().affine(s, 0.0).unwrap(), b, &cos, &sin).unwrap();
        let a = a.broadcast_mul(&p("attn_scale")).unwrap();
        let mm = m.mlp(&f, (i, 1), &f.norm_in(&l1).unwrap().affine(s, 0.0).unwrap()).unwrap().broadcast_mul(&p("mlp_scale")).unwrap();
        let resid: Vec<f64> = m.p("parallel_resid_lambdas").flatten_all().unwrap().to_vec1().unwrap();
        let post: Vec<f64> = m.p("parallel_post_lambdas").flatten_all().unwrap().to_vec1().unwrap();
        let flat = crate::model::ops::testing::flat;
        let (lv, av, mv) = ([flat(&l0), flat(&l1)], flat(&a), flat(&mm));
        for (k, got) in [flat(&n0), flat(&n1)].iter().enumerate() {
            for (j, g) in got.iter().enumerate() {
                let want = resid[i * 2 + k] * lv[k][j] + post[i * 4 + k] * av[j] + post[i * 4 + 2 + k] * mv[j];
                assert!((g - want).abs() < 1e-12, "lane {k}[{j}]: {g} vs {want}");
            }
        }
        // The lambdas differ, so a swapped index would not pass.
        assert!(resid[i * 2] != resid[i * 2 + 1] && post[i * 4 + 1] != post[i * 4 + 2]);
    }

    /// Causality with every 04-27 element on: changing the input at position `k` leaves every
    /// earlier position's loss as it was (no element reads ahead), and moves position `k`'s.
    #[test]
    fn the_04_27_model_reads_no_future_token() {
        let mut cfg = tiny();
        for name in ["SmearGate", "document-masked attention", "sparse attention gate", "two-lane parallel decoder"] {
            (crate::model::elements::element(name).unwrap().enable)(&mut cfg);
        }
        let m = moved(&cfg, 17);
        let ids: Vec<u32> = vec![5, 7, 2, 9, 3, 4, 6, 8];
        let y = Tensor::from_vec(vec![7u32, 2, 9, 3, 4, 6, 8, 1], (1, 8), &Device::Cpu).unwrap();
        let losses = |ids: &[u32]| {
            let x = Tensor::from_vec(ids.to_vec(), (1, ids.len()), &Device::Cpu).unwrap();
            m.token_losses(&x, &y).unwrap().to_vec1::<f64>().unwrap()
        };
        let base = losses(&ids);
        for k in 1..ids.len() {
            let mut changed = ids.clone();
            changed[k] = (changed[k] + 5) % 16;
            let l = losses(&changed);
            for p in 0..k {
                assert!((l[p] - base[p]).abs() < 1e-12, "position {p} moved when token {k} changed");
            }
            assert!((l[k] - base[k]).abs() > 1e-9, "position {k} did not move with its own token");
        }
    }

    /// SmearGate's BOS fix under a document mask: a packed row's second document scores as it
    /// does alone; without the fix (a `bos_id` the row does not hold, the mask still at the
    /// document) the first document's last token leaks into it.
    #[test]
    fn smear_with_the_bos_fix_keeps_documents_apart() {
        let mut cfg = tiny();
        (crate::model::elements::element("SmearGate").unwrap().enable)(&mut cfg);
        let bos = cfg.bos_id;
        let row: Vec<u32> = vec![5, 7, 2, bos, 9, 4, 6];
        let targets: Vec<u32> = vec![7, 2, bos, 9, 4, 6, 8];
        let losses = |m: &Gpt, x: &[u32], y: &[u32], mask_bos: u32| -> Vec<f64> {
            let mask = crate::model::ops::DocumentMask::at_token(x, x.len(), crate::model::ops::DocRule::at(mask_bos)).unwrap();
            let xt = Tensor::from_vec(x.to_vec(), (1, x.len()), &Device::Cpu).unwrap();
            let yt = Tensor::from_vec(y.to_vec(), (1, y.len()), &Device::Cpu).unwrap();
            let extras = PassExtras { docs: Some(&mask), ..Default::default() };
            m.token_losses_with(&xt, &yt, extras).unwrap().to_vec1::<f64>().unwrap()
        };
        let m = moved(&cfg, 13);
        let packed = losses(&m, &row, &targets, bos);
        let alone = losses(&m, &row[3..], &targets[3..], bos);
        for (p, a) in packed[3..].iter().zip(&alone) {
            assert!((p - a).abs() < 1e-10, "packed {p} vs alone {a}");
        }
        // The smear without its fix: the model's BOS is a token the row lacks.
        let leaky = moved(&ModelConfig { bos_id: 0, ..cfg.clone() }, 13);
        let packed = losses(&leaky, &row, &targets, bos);
        let alone = losses(&leaky, &row[3..], &targets[3..], bos);
        assert!((packed[3] - alone[0]).abs() > 1e-6, "without the fix the document's first token must see the last one's smear");
    }

    fn formulation_cfg() -> ModelConfig {
        ModelConfig { vocab_size: 32, num_layers: 3, model_dim: 16, num_heads: 4, num_kv_heads: 2, mlp_mult: 2, ..ModelConfig::default() }
    }

    /// A model of `formulation_cfg` with every parameter perturbed (zero-initialised
    /// projections would leave most gradients zero).
    fn perturbed(dtype: DType) -> Gpt {
        let mut m = Gpt::new(&formulation_cfg(), 3, dtype, &Device::Cpu).unwrap();
        let mut rng = fastrand::Rng::with_seed(11);
        let state: HashMap<String, Tensor> = m
            .state_dict()
            .into_iter()
            .map(|(n, t)| {
                let noise: Vec<f64> = (0..t.elem_count()).map(|_| 0.05 * (rng.f64() * 2.0 - 1.0)).collect();
                let noise = Tensor::from_vec(noise, t.dims(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
                (n, (t + noise).unwrap())
            })
            .collect();
        m.load_state(&state).unwrap();
        m
    }

    /// Loss and every gradient (in f64) of `m` on a fixed batch.
    fn loss_and_grads(m: &Gpt) -> (f64, Vec<Vec<f64>>) {
        let x = Tensor::from_vec((0..36u32).map(|i| (i * 5 + 1) % 32).collect::<Vec<_>>(), (3, 12), &Device::Cpu).unwrap();
        let y = Tensor::from_vec((0..36u32).map(|i| (i * 11 + 7) % 32).collect::<Vec<_>>(), (3, 12), &Device::Cpu).unwrap();
        let loss = m.loss(&x, &y).unwrap();
        let grads = loss.backward().unwrap();
        let flat = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let g: Vec<Vec<f64>> = m.params().iter().map(|(_, v, _)| flat(grads.get(v.as_tensor()).unwrap())).collect();
        (loss.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), g)
    }

    fn assert_close(what: &str, m: &Gpt, (la, ga): &(f64, Vec<Vec<f64>>), (lb, gb): &(f64, Vec<Vec<f64>>), tol: f64) {
        assert!((la - lb).abs() <= tol * la.abs(), "{what}: loss {la} vs {lb}");
        for ((name, _, _), (a, b)) in m.params().iter().zip(ga.iter().zip(gb)) {
            let num: f64 = a.iter().zip(b).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
            let den: f64 = a.iter().map(|p| p * p).sum::<f64>().sqrt();
            assert!(den > 0.0 && num <= tol * den, "{what} {name}: rel err {}", num / den);
        }
    }

    /// The GPU formulation (the kernels' ops around the matrix products), assembled on the CPU
    /// where each op runs its CPU reference, gives the CPU formulation's loss and gradients: the
    /// GPU graph's wiring (forward and backward) is checked on every machine. In f32 the two
    /// round differently, which shows that the other graph really ran.
    #[test]
    fn gpu_formulation_matches_the_cpu_one() {
        for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
            let m = perturbed(dtype);
            let cpu = loss_and_grads(&m);
            let gpu = crate::model::with_gpu_formulation(|| loss_and_grads(&m));
            assert_close(&format!("{dtype:?}"), &m, &cpu, &gpu, tol);
            if dtype == DType::F32 {
                assert_ne!(cpu.1, gpu.1, "the GPU formulation must be a different graph");
            }
        }
    }

    /// The GPU formulation under mixed precision keeps the activations around the matmuls in
    /// the matmul dtype (q, k, v, attention, the MLP's hidden layer): with f32 playing bf16's
    /// part over f64 parameters, its loss and gradients are the f64 model's to f32 rounding,
    /// and differ from the f64 GPU formulation's (the low-precision graph really ran).
    #[test]
    fn mixed_gpu_formulation_matches_the_cpu_one() {
        let m = perturbed(DType::F64);
        let exact = loss_and_grads(&m);
        let m = m.with_matmul_dtype(DType::F32);
        let mixed = crate::model::with_gpu_formulation(|| loss_and_grads(&m));
        assert_close("f32 activations", &m, &exact, &mixed, 1e-4);
        let m = m.with_matmul_dtype(DType::F64);
        let wide = crate::model::with_gpu_formulation(|| loss_and_grads(&m));
        assert_close("f64 GPU formulation", &m, &exact, &wide, 1e-10);
        assert_ne!(wide.1, mixed.1);
    }
}
