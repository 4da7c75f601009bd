//! Per-document LoRA adapters for test-time training (spec 5.4): one independent low-rank
//! adapter per document of a batch, so that the tensors carry a leading batch dimension and row
//! `b` of a forward pass goes through adapter `b` only.
//!
//! ```text
//! A in R^[bsz, r, in] ~ U(-1/sqrt(in), 1/sqrt(in)),  B in R^[bsz, out, r] = 0
//! lora(x)[b] = s (x[b] A[b]^T) B[b]^T                (0 at init)
//! ```
//!
//! `s` is 1 (PR #1626, no alpha scaling) or `alpha / r` (PR #1767's rank-scaled output, alpha
//! 144 in the 04-27 record), set by [`Lora::with_alpha`]. [`Lora::reset_b`] zeroes every B and
//! keeps A: the record's warm start of A, where one batch's adapters start the next batch of
//! the same size from the directions the last one learned.
//!
//! Stored transposed (`A^T` as `[bsz, in, r]`, `B^T` as `[bsz, r, out]`) so that both products
//! are plain batched matmuls; the maths is the spec's.
//!
//! One set per *slot*, a position of the virtual layer sequence (a looped layer's repeats get
//! their own): q (`D -> D`), k and v (`D -> kv_dim`), o (`D -> D`), mlp (`D -> D`); plus one on
//! the output head (`D -> vocab`). Where each one attaches is the forward pass's business
//! ([`super::attention`], [`super::mlp`], [`super::gpt`]): with `n` the normed block input,
//! q/k/v add to the projections of `n` before QK norm and RoPE, o takes `n` and adds after the
//! output projection, mlp takes the MLP's normed input and adds before `mlp_scale`, the head
//! adds to the logits before the soft-cap.
//!
//! Since document `b`'s loss only reaches `A[b]` and `B[b]`, an optimizer over the batched
//! tensors (AdamW is elementwise) is one optimizer per document.

use candle_core::{DType, Device, Result, Tensor, Var};

use super::ModelConfig;
use super::init::Init;

/// Where an adapter of a slot attaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Site {
    /// Added to the query projection.
    Q,
    /// Added to the key projection.
    K,
    /// Added to the value projection.
    V,
    /// Reads the normed block input, added after the attention's output projection.
    O,
    /// Reads the MLP's normed input, added to the MLP's output.
    Mlp,
}

impl Site {
    /// Every site, in the order of a slot's adapters.
    pub const ALL: [Site; 5] = [Site::Q, Site::K, Site::V, Site::O, Site::Mlp];

    /// The site's name in the adapters' names (`lora.{slot}.{site}.a`).
    pub fn name(self) -> &'static str {
        match self {
            Site::Q => "q",
            Site::K => "k",
            Site::V => "v",
            Site::O => "o",
            Site::Mlp => "mlp",
        }
    }

    /// `(in, out)` widths of this site's adapter in a model of `cfg`.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let d = cfg.model_dim;
        match self {
            Site::K | Site::V => (d, cfg.kv_dim()),
            Site::Q | Site::O | Site::Mlp => (d, d),
        }
    }
}

/// One batched adapter: `A^T` `[bsz, in, r]` and `B^T` `[bsz, r, out]`.
struct Adapter {
    a: Var,
    b: Var,
}

impl Adapter {
    fn new(init: &mut Init, (bsz, rank): (usize, usize), (inp, out): (usize, usize), dtype: DType, device: &Device) -> Result<Self> {
        let a = Tensor::from_vec(init.uniform(bsz * inp * rank, 1.0 / (inp as f64).sqrt()), (bsz, inp, rank), &Device::Cpu)?;
        let a = Var::from_tensor(&a.to_dtype(dtype)?.to_device(device)?)?;
        let b = Var::from_tensor(&Tensor::zeros((bsz, rank, out), dtype, device)?)?;
        Ok(Self { a, b })
    }
}

/// The adapters of one batch of documents: a set per slot and the head's.
pub struct Lora {
    rows: usize,
    rank: usize,
    /// The output scale `s` (1, or `alpha / rank`).
    scale: f64,
    /// Per slot, the adapters in [`Site::ALL`] order.
    slots: Vec<[Adapter; 5]>,
    head: Adapter,
}

impl Lora {
    /// Fresh adapters (A drawn from `seed`, B zero) for `rows` documents at rank `rank`, one set
    /// per position of `cfg`'s layer sequence (looped when `looping`).
    pub fn new(
        cfg: &ModelConfig,
        looping: bool,
        (rows, rank): (usize, usize),
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(rows > 0 && rank > 0, "LoRA adapters need at least one document and rank 1 (got {rows} documents, rank {rank})");
        let mut init = Init(fastrand::Rng::with_seed(seed));
        let n_slots = cfg.layer_sequence(looping).len();
        let mut slots = Vec::with_capacity(n_slots);
        for _ in 0..n_slots {
            let mut make = |s: Site| Adapter::new(&mut init, (rows, rank), s.dims(cfg), dtype, device);
            slots.push([make(Site::Q)?, make(Site::K)?, make(Site::V)?, make(Site::O)?, make(Site::Mlp)?]);
        }
        let head = Adapter::new(&mut init, (rows, rank), (cfg.model_dim, cfg.vocab_size), dtype, device)?;
        Ok(Self { rows, rank, scale: 1.0, slots, head })
    }

    /// Scales every adapter's output by `alpha / rank` (PR #1767; `None`: by 1, PR #1626).
    pub fn with_alpha(mut self, alpha: Option<f64>) -> Self {
        self.scale = alpha.map_or(1.0, |a| a / self.rank as f64);
        self
    }

    /// The output scale `s` (1, or `alpha / rank`).
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Zeroes every B (so every adapter outputs 0 again) and keeps A: the warm start of A.
    pub fn reset_b(&self) -> Result<()> {
        for ad in self.slots.iter().flatten().chain(std::iter::once(&self.head)) {
            ad.b.set(&ad.b.as_tensor().zeros_like()?)?;
        }
        Ok(())
    }

    /// Scalar parameters of adapters for `rows` documents at rank `rank` on a model of `cfg`
    /// (looped when `looping`), without making them (memory estimates).
    pub fn count(cfg: &ModelConfig, looping: bool, (rows, rank): (usize, usize)) -> usize {
        let per_slot: usize = Site::ALL.iter().map(|s| s.dims(cfg)).map(|(i, o)| i + o).sum();
        let n = cfg.layer_sequence(looping).len() * per_slot + cfg.model_dim + cfg.vocab_size;
        rows.saturating_mul(rank).saturating_mul(n)
    }

    /// Documents (batch rows) the adapters serve.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of slots (positions of the layer sequence).
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Every trainable tensor with a name (`lora.{slot}.{site}.a`, `lora.head.b`, ...).
    pub fn vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::with_capacity(2 * (5 * self.slots.len() + 1));
        for (i, set) in self.slots.iter().enumerate() {
            for (s, ad) in Site::ALL.iter().zip(set) {
                out.push((format!("lora.{i}.{}.a", s.name()), ad.a.clone()));
                out.push((format!("lora.{i}.{}.b", s.name()), ad.b.clone()));
            }
        }
        out.push(("lora.head.a".into(), self.head.a.clone()));
        out.push(("lora.head.b".into(), self.head.b.clone()));
        out
    }

    /// Number of scalar parameters.
    pub fn param_count(&self) -> usize {
        self.vars().iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// The adapters of a forward pass over the documents `active` (indices into this batch, in
    /// the pass's row order; `None`: every document, in order). Gathering keeps the gradient:
    /// it reaches the gathered documents' slices only.
    #[cfg(feature = "candle")]
    pub fn pass(&self, active: Option<&[u32]>) -> Result<LoraPass> {
        let idx = match active {
            Some(rows) if rows.len() != self.rows || rows.iter().enumerate().any(|(i, &r)| r as usize != i) => {
                Some(Tensor::from_slice(rows, rows.len(), self.head.a.device())?)
            }
            _ => None,
        };
        let take = |ad: &Adapter| -> Result<(Tensor, Tensor)> {
            match &idx {
                Some(i) => Ok((ad.a.as_tensor().index_select(i, 0)?, ad.b.as_tensor().index_select(i, 0)?)),
                None => Ok((ad.a.as_tensor().clone(), ad.b.as_tensor().clone())),
            }
        };
        let mut slots = Vec::with_capacity(self.slots.len());
        for set in &self.slots {
            slots.push([take(&set[0])?, take(&set[1])?, take(&set[2])?, take(&set[3])?, take(&set[4])?]);
        }
        Ok(LoraPass { rows: active.map_or(self.rows, <[u32]>::len), scale: self.scale, slots, head: take(&self.head)? })
    }
}

/// The adapters one forward pass reads: per slot and site `(A^T, B^T)` for its rows (the
/// candle forward pass's, feature `candle`).
#[cfg(feature = "candle")]
pub struct LoraPass {
    rows: usize,
    scale: f64,
    slots: Vec<[(Tensor, Tensor); 5]>,
    head: (Tensor, Tensor),
}

#[cfg(feature = "candle")]
impl LoraPass {
    /// Batch rows of the pass.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Slot `slot`'s adapter at `site` on the token-major `x` `(rows * T, in)`: `(rows * T, out)`
    /// in `like`'s dtype, ready to add to the product it adapts.
    pub(super) fn apply(&self, slot: usize, site: Site, x: &Tensor, like: &Tensor) -> Result<Tensor> {
        let i = Site::ALL.iter().position(|s| *s == site).unwrap_or(0);
        let (a, b) = &self.slots[slot][i];
        batched(a, b, (self.rows, self.scale), x, like)
    }

    /// The head's adapter on the final-normed hidden `x`, in `like`'s dtype.
    pub(super) fn head(&self, x: &Tensor, like: &Tensor) -> Result<Tensor> {
        batched(&self.head.0, &self.head.1, (self.rows, self.scale), x, like)
    }
}

/// `s (x[b] A^T[b]) B^T[b]` per row `b` of `x` `(rows * T, in)`, computed in the adapters' dtype.
#[cfg(feature = "candle")]
fn batched(a: &Tensor, b: &Tensor, (rows, scale): (usize, f64), x: &Tensor, like: &Tensor) -> Result<Tensor> {
    let (n, inp) = x.dims2()?;
    if rows == 0 || n % rows != 0 {
        candle_core::bail!("LoRA: {n} positions do not split into {rows} documents");
    }
    let x = super::ops::cast(x, a.dtype())?.reshape((rows, n / rows, inp))?;
    let y = x.matmul(a)?.matmul(b)?;
    let y = if scale == 1.0 { y } else { (y * scale)? };
    let out = y.dim(2)?;
    super::ops::cast(&y.reshape((n, out))?, like.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        ModelConfig { vocab_size: 16, num_layers: 3, model_dim: 8, num_heads: 2, num_kv_heads: 1, mlp_mult: 2, ..ModelConfig::default() }
    }

    #[test]
    fn shapes_init_and_names_follow_the_spec() {
        let l = Lora::new(&cfg(), false, (3, 4), 1, DType::F64, &Device::Cpu).unwrap();
        assert_eq!((l.rows(), l.rank(), l.slots()), (3, 4, 3));
        assert_eq!(l.param_count(), Lora::count(&cfg(), false, (3, 4)));
        let vars = l.vars();
        assert_eq!(vars.len(), 2 * (5 * 3 + 1));
        let dims = |n: &str| vars.iter().find(|(k, _)| k == n).unwrap().1.dims().to_vec();
        assert_eq!(dims("lora.0.q.a"), [3, 8, 4]);
        assert_eq!(dims("lora.2.k.b"), [3, 4, 4], "k: D -> kv_dim = 4");
        assert_eq!(dims("lora.head.b"), [3, 4, 16]);
        let a = vars[0].1.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let bound = 1.0 / 8f64.sqrt();
        assert!(a.iter().all(|x| x.abs() <= bound) && a.iter().any(|x| x.abs() > bound / 2.0), "A ~ U(±1/sqrt(in))");
        assert!(vars.iter().filter(|(k, _)| k.ends_with(".b")).all(|(_, v)| v.sum_all().unwrap().to_scalar::<f64>().unwrap() == 0.0));
        let looped = ModelConfig { num_loops: 2, loop_start: 1, loop_end: 1, ..cfg() };
        let l = Lora::new(&looped, true, (1, 2), 1, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(l.slots(), looped.layer_sequence(true).len(), "one set per virtual layer");
    }

    /// Row `b` goes through adapter `b` only, and a gathered pass through the gathered ones.
    #[test]
    fn each_row_has_its_own_adapter() {
        let l = Lora::new(&cfg(), false, (3, 2), 2, DType::F64, &Device::Cpu).unwrap();
        let mut rng = fastrand::Rng::with_seed(3);
        for (_, v) in l.vars() {
            let vals: Vec<f64> = (0..v.elem_count()).map(|_| rng.f64() - 0.5).collect();
            v.set(&Tensor::from_vec(vals, v.dims(), &Device::Cpu).unwrap()).unwrap();
        }
        let x = Tensor::from_vec((0..3 * 5 * 8).map(|i| (i as f64 * 0.37).sin()).collect::<Vec<_>>(), (15, 8), &Device::Cpu).unwrap();
        let all = l.pass(None).unwrap().apply(1, Site::Q, &x, &x).unwrap();
        let vars = l.vars();
        let (a, b) = (vars[10].1.as_tensor(), vars[11].1.as_tensor());
        for r in 0..3 {
            let xr = x.narrow(0, r * 5, 5).unwrap();
            let want = xr.matmul(&a.get(r).unwrap()).unwrap().matmul(&b.get(r).unwrap()).unwrap();
            let diff = (all.narrow(0, r * 5, 5).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(diff < 1e-12, "row {r}: {diff}");
        }
        let some = l.pass(Some(&[2, 0])).unwrap();
        let got = some.apply(1, Site::Q, &x.narrow(0, 0, 10).unwrap(), &x).unwrap();
        let a2 = x.narrow(0, 0, 5).unwrap().matmul(&a.get(2).unwrap()).unwrap().matmul(&b.get(2).unwrap()).unwrap();
        let d3 = (got.narrow(0, 0, 5).unwrap() - a2).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        assert!(d3 < 1e-12, "gathered row 0 is document 2: {d3}");
        assert!(Lora::new(&cfg(), false, (0, 2), 0, DType::F32, &Device::Cpu).is_err());
    }

    /// `alpha / rank` scales every output (the head's too); `reset_b` zeroes B and keeps A.
    #[test]
    fn alpha_scales_the_output_and_reset_b_keeps_a() {
        let l = Lora::new(&cfg(), false, (2, 4), 5, DType::F64, &Device::Cpu).unwrap();
        for (_, v) in l.vars().iter().filter(|(k, _)| k.ends_with(".b")) {
            v.set(&v.as_tensor().ones_like().unwrap()).unwrap();
        }
        let x = Tensor::from_vec((0..2 * 3 * 8).map(|i| (i as f64 * 0.21).cos()).collect::<Vec<_>>(), (6, 8), &Device::Cpu).unwrap();
        let plain = l.pass(None).unwrap();
        let l = l.with_alpha(Some(144.0));
        assert_eq!(l.scale(), 36.0);
        let scaled = l.pass(None).unwrap();
        for (p, s) in [
            (plain.apply(0, Site::V, &x, &x).unwrap(), scaled.apply(0, Site::V, &x, &x).unwrap()),
            (plain.head(&x, &x).unwrap(), scaled.head(&x, &x).unwrap()),
        ] {
            let d = ((p * 36.0).unwrap() - s).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
            assert!(d < 1e-9, "{d}");
        }
        let a_before: Vec<f64> = l.vars()[0].1.flatten_all().unwrap().to_vec1().unwrap();
        l.reset_b().unwrap();
        assert!(
            l.vars().iter().filter(|(k, _)| k.ends_with(".b")).all(|(_, v)| v
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
                == 0.0)
        );
        assert_eq!(l.vars()[0].1.flatten_all().unwrap().to_vec1::<f64>().unwrap(), a_before, "A is kept");
        assert_eq!(l.with_alpha(None).scale(), 1.0);
    }
}
