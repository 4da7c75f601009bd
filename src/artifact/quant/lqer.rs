//! LQER: a low-rank correction of the quantization error, stored in a few bits (the 04-27
//! record, PR #1797's `LQER_*` settings, asymmetric form from PR #1530).
//!
//! After the matrices are quantized (GPTQ or rounding), each candidate matrix `W` (rows x cols)
//! has the error `E = W - Ŵ`, `Ŵ = q * s` per row. The `top_k` candidates with the largest
//! `‖E‖_F` get a rank-`r` correction from the thin SVD `E = U Σ Vᵀ`:
//!
//! ```text
//! A = U[:, :r] Σ[:r]      (rows x r)        B = Vᵀ[:r, :]      (r x cols)
//! W_restored = Ŵ + Â B̂    (Â, B̂ the dequantized factors, the product in f32)
//! ```
//!
//! The factors are stored as integers with fp16 scales, each scale covering `group`
//! consecutive values of the row-major factor ([`Factor`]):
//! - asymmetric (the record's default, when `B`'s size is a multiple of `group`): `A` in
//!   `[-2, 1]` with one scale `max|A| / 1.5`; `B` in `[-8, 7]` with a scale per `group` values,
//!   `max|B_g| / 7.5`;
//! - symmetric (otherwise): both factors per row in `±(2^(bits-1) - 1)`, scale `max|row| / Q`.
//!
//! Scales are computed in f32 from `max(|·|max, 1e-10)`, rounded to fp16, and the values
//! rounded half to even with the fp16 scale widened back to f32, as `torch.round` does.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use candle_core::Tensor;
use faer::Mat;
use half::f16;
use rayon::prelude::*;

use super::{Entry, finite_values};

/// LQER's settings (the record: on, rank 4, top 3, asymmetric with groups of 64); the keys are
/// [`super::QuantConfig`]'s `lqer_*`.
#[derive(Clone, Debug, PartialEq)]
pub struct LqerConfig {
    /// Rank `r` of each correction (`LQER_RANK`, 4).
    pub rank: usize,
    /// Matrices corrected: the ones with the largest quantization error `‖W - Ŵ‖_F`
    /// (`LQER_TOP_K`, 3).
    pub top_k: usize,
    /// Bits of both factors in the symmetric form (`LQER_FACTOR_BITS`, 4).
    pub factor_bits: u8,
    /// The asymmetric form (`LQER_ASYM_ENABLED`): A in 2 bits with one scale, B in 4 bits
    /// with a scale per `group` values; false: the symmetric form.
    pub asymmetric: bool,
    /// Values per scale of B in the asymmetric form (`LQER_ASYM_GROUP`, 64).
    pub group: usize,
}

impl Default for LqerConfig {
    fn default() -> Self {
        Self { rank: 4, top_k: 3, factor_bits: 4, asymmetric: true, group: 64 }
    }
}

impl LqerConfig {
    /// Checks the settings; errors name the key (`lqer_rank`, ...).
    pub fn check(&self) -> Result<()> {
        ensure!(self.rank >= 1, "`lqer_rank` must be at least 1 (4 in the record)");
        ensure!(self.top_k >= 1, "`lqer_top_k` must be at least 1 (3 in the record); `lqer = false` turns LQER off");
        ensure!((2..=8).contains(&self.factor_bits), "`lqer_factor_bits` = {} is not in 2..=8 (4 in the record)", self.factor_bits);
        ensure!(self.group >= 1, "`lqer_group` must be at least 1 (64 in the record)");
        Ok(())
    }
}

/// One stored factor: `q` (row-major, `shape`), in `lo..=hi`, value `i` scaled by
/// `scales[i / group]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Factor {
    /// `[rows, r]` for A, `[r, cols]` for B.
    pub shape: [usize; 2],
    /// Consecutive values per scale.
    pub group: usize,
    /// Smallest level.
    pub lo: i8,
    /// Largest level.
    pub hi: i8,
    /// The levels.
    pub q: Vec<i8>,
    /// The fp16 scales, one per group.
    pub scales: Vec<f16>,
}

impl Factor {
    /// Quantizes `values` (`shape`, row-major) in groups of `group` with levels `lo..=hi` and the
    /// scale `max|group| / div` (also the int8 attention gates' rows).
    pub(super) fn quantize(values: &[f32], shape: [usize; 2], group: usize, (lo, hi): (i8, i8), div: f32) -> Self {
        let mut q = Vec::with_capacity(values.len());
        let mut scales = Vec::with_capacity(values.len() / group);
        for g in values.chunks(group) {
            let max = g.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-10);
            let s = f16::from_f32(max / div);
            let sf = s.to_f32();
            scales.push(s);
            q.extend(g.iter().map(|v| (v / sf).round_ties_even().clamp(lo as f32, hi as f32) as i8));
        }
        Self { shape, group, lo, hi, q, scales }
    }

    /// Checks a factor read from a file: sizes, groups and the range of every value.
    pub fn check(&self) -> Result<()> {
        let n = self.shape[0] * self.shape[1];
        ensure!(self.q.len() == n, "{} values for shape {:?}", self.q.len(), self.shape);
        ensure!(self.group >= 1 && n.is_multiple_of(self.group), "groups of {} do not divide {n} values", self.group);
        ensure!(self.scales.len() == n / self.group, "{} scales for {} groups", self.scales.len(), n / self.group);
        ensure!(self.lo < 0 && self.lo < self.hi, "levels {}..={} are not a signed range", self.lo, self.hi);
        if let Some(v) = self.q.iter().find(|&&v| v < self.lo || v > self.hi) {
            anyhow::bail!("value {v} is outside {}..={}", self.lo, self.hi);
        }
        ensure!(self.scales.iter().all(|s| s.is_finite()), "a scale is not finite");
        Ok(())
    }

    /// The values, row-major, in f32.
    pub fn values(&self) -> Vec<f32> {
        self.q.chunks(self.group).zip(&self.scales).flat_map(|(g, s)| g.iter().map(move |&v| v as f32 * s.to_f32())).collect()
    }

    /// Bytes stored: one per value, two per scale.
    pub fn bytes(&self) -> u64 {
        (self.q.len() + 2 * self.scales.len()) as u64
    }
}

/// A matrix's correction `Â B̂`.
#[derive(Clone, Debug, PartialEq)]
pub struct Lqer {
    /// `rows x r`.
    pub a: Factor,
    /// `r x cols`.
    pub b: Factor,
}

impl Lqer {
    /// The rank-`cfg.rank` correction of the error `e` (`rows x cols`, row-major), packed.
    pub fn fit(e: &[f32], rows: usize, cols: usize, cfg: &LqerConfig) -> Result<Self> {
        ensure!(e.len() == rows * cols, "{} error values for a {rows} x {cols} matrix", e.len());
        let m = Mat::<f64>::from_fn(rows, cols, |i, j| f64::from(e[i * cols + j]));
        let svd = m.thin_svd().map_err(|err| anyhow::anyhow!("the SVD of the quantization error did not converge ({err:?})"))?;
        let r = cfg.rank.min(rows).min(cols);
        let (u, s, v) = (svd.U(), svd.S().column_vector(), svd.V());
        let a: Vec<f32> = (0..rows).flat_map(|i| (0..r).map(move |k| (u[(i, k)] * s[k]) as f32)).collect();
        let b: Vec<f32> = (0..r).flat_map(|k| (0..cols).map(move |j| v[(j, k)] as f32)).collect();
        let (sa, sb) = ([rows, r], [r, cols]);
        Ok(if cfg.asymmetric && (r * cols).is_multiple_of(cfg.group) {
            Self { a: Factor::quantize(&a, sa, rows * r, (-2, 1), 1.5), b: Factor::quantize(&b, sb, cfg.group, (-8, 7), 7.5) }
        } else {
            let qm = ((1i16 << (cfg.factor_bits - 1)) - 1) as i8;
            Self { a: Factor::quantize(&a, sa, r, (-qm, qm), qm as f32), b: Factor::quantize(&b, sb, cols, (-qm, qm), qm as f32) }
        })
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.a.shape[1]
    }

    /// Checks a correction read from a file against its matrix's shape.
    pub fn check(&self, rows: usize, cols: usize) -> Result<()> {
        self.a.check().map_err(|e| e.context("LQER factor A"))?;
        self.b.check().map_err(|e| e.context("LQER factor B"))?;
        let r = self.rank();
        ensure!(r >= 1, "LQER rank 0");
        ensure!(self.a.shape == [rows, r], "LQER factor A has shape {:?}, expected [{rows}, {r}]", self.a.shape);
        ensure!(self.b.shape == [r, cols], "LQER factor B has shape {:?}, expected [{r}, {cols}]", self.b.shape);
        Ok(())
    }

    /// `Â B̂` (`rows x cols`, row-major), in f32.
    pub fn correction(&self) -> Vec<f32> {
        let (a, b) = (self.a.values(), self.b.values());
        let (r, cols) = (self.rank(), self.b.shape[1]);
        let mut out = vec![0f32; self.a.shape[0] * cols];
        for (row, ar) in out.chunks_mut(cols).zip(a.chunks(r)) {
            for (k, &ak) in ar.iter().enumerate() {
                for (o, &bv) in row.iter_mut().zip(&b[k * cols..(k + 1) * cols]) {
                    *o += ak * bv;
                }
            }
        }
        out
    }

    /// Bytes stored (values and scales of both factors).
    pub fn bytes(&self) -> u64 {
        self.a.bytes() + self.b.bytes()
    }
}

/// Gives the `cfg.top_k` matrices among `candidates` (indices into `entries`, each a 2-D
/// [`Entry::Quant`] of the tensor at the same index of `state`) with the largest `‖W − Ŵ‖_F`
/// their correction (ties: the earlier tensor first). With `hessians` (the guard), a correction
/// that does not lower `tr(E H Eᵀ)` of a matrix with a Hessian is dropped and the next candidate
/// tried; the dropped ones are returned, each as a line saying why.
pub(super) fn correct(
    state: &[(String, Tensor)],
    entries: &mut [(String, Entry)],
    candidates: &[usize],
    cfg: &LqerConfig,
    hessians: Option<&HashMap<String, Arc<Vec<f32>>>>,
) -> Result<Vec<String>> {
    fn error(state: &[(String, Tensor)], entries: &[(String, Entry)], i: usize) -> Result<Vec<f32>> {
        let Entry::Quant(t) = &entries[i].1 else { anyhow::bail!("internal: LQER candidate `{}` is not quantized", entries[i].0) };
        let w = finite_values(&state[i].1).with_context(|| format!("tensor `{}`", entries[i].0))?;
        Ok(w.iter().zip(t.levels_times_scales()).map(|(w, q)| w - q).collect())
    }
    let shared: &[(String, Entry)] = entries;
    let mut norms: Vec<(usize, f64)> =
        candidates.par_iter().map(|&i| Ok((i, sq_norm(&error(state, shared, i)?)))).collect::<Result<_>>()?;
    norms.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let (mut kept, mut dropped) = (0, Vec::new());
    for &(i, _) in &norms {
        if kept == cfg.top_k {
            break;
        }
        let e = error(state, entries, i)?;
        let (name, entry) = &mut entries[i];
        let Entry::Quant(t) = entry else { unreachable!("checked by `error`") };
        let [rows, cols] = t.shape[..] else { anyhow::bail!("LQER needs a matrix; `{name}` has shape {:?}", t.shape) };
        let fit = Lqer::fit(&e, rows, cols, cfg).with_context(|| format!("LQER of tensor `{name}`"))?;
        if let Some(h) = hessians.and_then(|hs| hs.get(name.as_str())) {
            let after: Vec<f32> = e.iter().zip(fit.correction()).map(|(e, c)| e - c).collect();
            let (before, after) = (h_weighted(&e, h, cols), h_weighted(&after, h, cols));
            if after >= before {
                dropped.push(format!("{name}: tr(E H Eᵀ) {before:.4e} -> {after:.4e}"));
                continue;
            }
        }
        t.lqer = Some(fit);
        kept += 1;
    }
    Ok(dropped)
}

/// `tr(E H Eᵀ)` of the row-major `e` (`rows x cols`) and `h` (`cols x cols`), in f64: GPTQ's
/// objective, the error as the layer's inputs see it.
pub fn h_weighted(e: &[f32], h: &[f32], cols: usize) -> f64 {
    let hm = Mat::<f64>::from_fn(cols, cols, |i, j| f64::from(h[i * cols + j]));
    e.par_chunks(cols)
        .map(|row| (0..cols).map(|i| f64::from(row[i]) * (0..cols).map(|j| hm[(i, j)] * f64::from(row[j])).sum::<f64>()).sum::<f64>())
        .sum()
}

/// `‖e‖_F²` in f64.
pub fn sq_norm(e: &[f32]) -> f64 {
    e.iter().map(|&v| f64::from(v) * f64::from(v)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..rows * cols).map(|_| rng.f32() - 0.5).collect()
    }

    /// A rank-2 error is recovered almost exactly by a rank-2 correction in the symmetric
    /// 8-bit form, and the asymmetric form keeps its levels and groups.
    #[test]
    fn fit_recovers_a_low_rank_error_and_packs_as_the_record() {
        let (rows, cols) = (48, 64);
        let (u, v) = (matrix(rows, 2, 1), matrix(2, cols, 2));
        let e: Vec<f32> = (0..rows * cols).map(|i| (0..2).map(|k| u[(i / cols) * 2 + k] * v[k * cols + i % cols]).sum()).collect();
        let sym = LqerConfig { rank: 2, asymmetric: false, factor_bits: 8, ..LqerConfig::default() };
        let l = Lqer::fit(&e, rows, cols, &sym).unwrap();
        l.check(rows, cols).unwrap();
        let c = l.correction();
        let rest: Vec<f32> = e.iter().zip(&c).map(|(a, b)| a - b).collect();
        assert!(sq_norm(&rest) < 1e-3 * sq_norm(&e), "{} of {}", sq_norm(&rest), sq_norm(&e));
        assert_eq!((l.a.group, l.b.group, l.a.hi, l.b.lo), (2, cols, 127, -127), "per row");

        let asym = Lqer::fit(&e, rows, cols, &LqerConfig { rank: 4, ..LqerConfig::default() }).unwrap();
        asym.check(rows, cols).unwrap();
        assert_eq!((asym.a.lo, asym.a.hi, asym.a.scales.len()), (-2, 1, 1), "A: int2, one scale");
        assert_eq!((asym.b.lo, asym.b.hi, asym.b.group, asym.b.scales.len()), (-8, 7, 64, 4), "B: int4 in groups of 64");
        let used = |q: &[i8]| q.iter().collect::<std::collections::BTreeSet<_>>().len();
        assert!(used(&asym.a.q) >= 3 && used(&asym.b.q) >= 8, "the levels are used");
        let rest: Vec<f32> = e.iter().zip(&asym.correction()).map(|(a, b)| a - b).collect();
        assert!(sq_norm(&rest) < sq_norm(&e), "even in 2 and 4 bits the correction helps");
        // B of 4 x 60 = 240 values is no multiple of 64: the symmetric form.
        let odd = Lqer::fit(&e[..rows * 60], rows, 60, &LqerConfig::default()).unwrap();
        assert_eq!((odd.a.hi, odd.b.group), (7, 60));
    }

    #[test]
    fn a_bad_factor_is_refused_by_what_is_wrong() {
        let e = matrix(8, 64, 3);
        let l = Lqer::fit(&e, 8, 64, &LqerConfig::default()).unwrap();
        assert!(l.check(8, 32).unwrap_err().to_string().contains("factor B"));
        let mut bad = l.clone();
        bad.b.q[0] = 9;
        assert!(format!("{:#}", bad.check(8, 64).unwrap_err()).contains("outside -8..=7"));
        let mut bad = l.clone();
        bad.a.scales.push(f16::ONE);
        assert!(format!("{:#}", bad.check(8, 64).unwrap_err()).contains("scales"));
        assert!(LqerConfig { top_k: 0, ..LqerConfig::default() }.check().unwrap_err().to_string().contains("lqer_top_k"));
    }
}
