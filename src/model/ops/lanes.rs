//! The 04-27 record's two-lane parallel decoder's mix: from `model.parallel_decoder_start` on,
//! a block reads two lanes `l0` (attention's) and `l1` (the MLP's) and hands on two. With `ao`
//! and `mo` its attention and MLP outputs `(N, C)`, `sa` and `sm` their per-channel scales
//! (`attn_scale`, `mlp_scale`), `r` the block's `parallel_resid_lambdas` row `(2,)` and `p` its
//! `parallel_post_lambdas` `(2, 2)` (`p[0, k]` takes attention into lane `k`, `p[1, k]` the MLP):
//!
//! ```text
//! A = sa ao,  M = sm mo                          (per channel)
//! out_k = r[k] l_k + p[0, k] A + p[1, k] M       (k = 0, 1)
//! ```
//!
//! Backward, with `G_k` the gradient of `out_k`:
//!
//! ```text
//! dl_k = r[k] G_k
//! dA = p[0, 0] G_0 + p[0, 1] G_1;   dM = p[1, 0] G_0 + p[1, 1] G_1
//! dao = sa dA;   dmo = sm dM;   dsa += colsum(dA ao);   dsm += colsum(dM mo)
//! dr[k] += sum G_k l_k;   dp[0, k] += sum G_k A;   dp[1, k] += sum G_k M
//! ```
//!
//! The candle model composes the forward from broadcasts ([`crate::model::Gpt`]'s lane block),
//! whose backward passes give the gradients; the engine's CPU backend runs the row kernels
//! below, tested against that composite; its GPU kernels (`eng_lanes_*` in kernels/engine.cu)
//! are checked against these.

use rayon::prelude::*;

use crate::model::host::rows::{ROWS, add_partials};
use crate::model::host::simd::Real;

/// The mix's parameters: scales `sa`, `sm` `(C,)`, `r` `(2,)`, `p` `(2, 2)` row-major.
#[derive(Clone, Copy)]
pub(crate) struct LaneParams<'a, T> {
    /// `attn_scale`.
    pub(crate) sa: &'a [T],
    /// `mlp_scale`.
    pub(crate) sm: &'a [T],
    /// `parallel_resid_lambdas[i]`.
    pub(crate) r: &'a [T],
    /// `parallel_post_lambdas[i]`.
    pub(crate) p: &'a [T],
}

/// `out_k = r[k] l_k + p[0, k] A + p[1, k] M` (the module doc's forward).
pub(crate) fn lanes_rows_fwd<T: Real>(l: [&[T]; 2], ao: &[T], mo: &[T], w: LaneParams<'_, T>, out: [&mut [T]; 2]) {
    let c = w.sa.len();
    let [o0, o1] = out;
    o0.par_chunks_mut(ROWS * c).zip(o1.par_chunks_mut(ROWS * c)).enumerate().for_each(|(blk, (o0, o1))| {
        let base = blk * ROWS * c;
        for (i, (a, b)) in o0.iter_mut().zip(o1.iter_mut()).enumerate() {
            let (j, col) = (base + i, i % c);
            let (am, mm) = (w.sa[col] * ao[j], w.sm[col] * mo[j]);
            *a = w.r[0] * l[0][j] + w.p[0] * am + w.p[2] * mm;
            *b = w.r[1] * l[1][j] + w.p[1] * am + w.p[3] * mm;
        }
    });
}

/// Where [`lanes_rows_bwd`] writes: `dl` and `dao`, `dmo` written; `dsa`, `dsm`, `dr`, `dp`
/// added to.
pub(crate) struct LaneGrads<'a, T> {
    /// `dl_k`.
    pub(crate) dl: [&'a mut [T]; 2],
    /// `dao`.
    pub(crate) dao: &'a mut [T],
    /// `dmo`.
    pub(crate) dmo: &'a mut [T],
    /// `dsa`.
    pub(crate) dsa: &'a mut [T],
    /// `dsm`.
    pub(crate) dsm: &'a mut [T],
    /// `dr`.
    pub(crate) dr: &'a mut [T],
    /// `dp`.
    pub(crate) dp: &'a mut [T],
}

/// The module doc's backward: per-channel and scalar sums in f64 over fixed row blocks, added
/// in block order.
pub(crate) fn lanes_rows_bwd<T: Real>(g: [&[T]; 2], l: [&[T]; 2], ao: &[T], mo: &[T], w: LaneParams<'_, T>, out: LaneGrads<'_, T>) {
    let c = w.sa.len();
    let LaneGrads { dl: [dl0, dl1], dao, dmo, dsa, dsm, dr, dp } = out;
    // Per block: dsa, dsm per channel, then dr[0], dr[1], dp[0..4].
    let parts: Vec<Vec<f64>> = dl0
        .par_chunks_mut(ROWS * c)
        .zip(dl1.par_chunks_mut(ROWS * c))
        .zip(dao.par_chunks_mut(ROWS * c))
        .zip(dmo.par_chunks_mut(ROWS * c))
        .enumerate()
        .map(|(blk, (((dl0, dl1), dao), dmo))| {
            let mut s = vec![0.0; 2 * c + 6];
            let base = blk * ROWS * c;
            for i in 0..dl0.len() {
                let (j, col) = (base + i, i % c);
                let (g0, g1) = (g[0][j], g[1][j]);
                let (am, mm) = (w.sa[col] * ao[j], w.sm[col] * mo[j]);
                let da = w.p[0] * g0 + w.p[1] * g1;
                let dm = w.p[2] * g0 + w.p[3] * g1;
                dl0[i] = w.r[0] * g0;
                dl1[i] = w.r[1] * g1;
                dao[i] = w.sa[col] * da;
                dmo[i] = w.sm[col] * dm;
                s[col] += (da * ao[j]).to_f64();
                s[c + col] += (dm * mo[j]).to_f64();
                let t = &mut s[2 * c..];
                t[0] += (g0 * l[0][j]).to_f64();
                t[1] += (g1 * l[1][j]).to_f64();
                t[2] += (g0 * am).to_f64();
                t[3] += (g1 * am).to_f64();
                t[4] += (g0 * mm).to_f64();
                t[5] += (g1 * mm).to_f64();
            }
            s
        })
        .collect();
    let total = add_partials(parts, 2 * c + 6);
    let add = |dst: &mut [T], src: &[f64]| {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d += T::from_f64(s);
        }
    };
    add(dsa, &total[..c]);
    add(dsm, &total[c..2 * c]);
    add(dr, &total[2 * c..2 * c + 2]);
    add(dp, &total[2 * c + 2..]);
}

#[cfg(test)]
mod tests {
    use candle_core::{Tensor, Var};

    use super::*;
    use crate::model::ops::testing::{flat, seeded};

    /// The row kernels against the composite's autograd in f64 (the candle lane block's form:
    /// broadcasts of the scales and the lambdas), both lanes and every parameter's gradient.
    #[test]
    fn match_the_composite_and_its_gradients() {
        let (n, c) = (70, 5);
        let v = |shape: &[usize], seed| Var::from_tensor(&seeded(shape, seed)).unwrap();
        let (l0, l1, ao, mo) = (v(&[n, c], 1), v(&[n, c], 2), v(&[n, c], 3), v(&[n, c], 4));
        let (sa, sm, r, p) = (v(&[c], 5), v(&[c], 6), v(&[2], 7), v(&[2, 2], 8));
        let a = ao.as_tensor().broadcast_mul(sa.as_tensor()).unwrap();
        let m = mo.as_tensor().broadcast_mul(sm.as_tensor()).unwrap();
        let lane = |l: &Tensor, k: usize| -> Tensor {
            let s = |t: &Tensor, i: usize, j: Option<usize>| {
                let w = match j {
                    Some(j) => p.as_tensor().get(i).unwrap().get(j).unwrap(),
                    None => r.as_tensor().get(i).unwrap(),
                };
                t.broadcast_mul(&w).unwrap()
            };
            ((s(l, k, None) + s(&a, 0, Some(k))).unwrap() + s(&m, 1, Some(k))).unwrap()
        };
        let (o0, o1) = (lane(l0.as_tensor(), 0), lane(l1.as_tensor(), 1));
        let (g0, g1) = (seeded(&[n, c], 9), seeded(&[n, c], 10));
        let loss = ((&o0 * &g0).unwrap().sum_all().unwrap() + (&o1 * &g1).unwrap().sum_all().unwrap()).unwrap();
        let grads = loss.backward().unwrap();

        let (fl0, fl1, fao, fmo) = (flat(l0.as_tensor()), flat(l1.as_tensor()), flat(ao.as_tensor()), flat(mo.as_tensor()));
        let (fsa, fsm, fr, fp) = (flat(sa.as_tensor()), flat(sm.as_tensor()), flat(r.as_tensor()), flat(p.as_tensor()));
        let w = LaneParams { sa: &fsa, sm: &fsm, r: &fr, p: &fp };
        let (mut out0, mut out1) = (vec![0.0; n * c], vec![0.0; n * c]);
        lanes_rows_fwd([&fl0, &fl1], &fao, &fmo, w, [&mut out0, &mut out1]);
        let close = |a: &[f64], b: &[f64], what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() < 1e-12, "{what}[{i}]: {x} vs {y}");
            }
        };
        close(&out0, &flat(&o0), "out0");
        close(&out1, &flat(&o1), "out1");

        let (fg0, fg1) = (flat(&g0), flat(&g1));
        let z = |k| vec![0.0; k];
        let (mut dl0, mut dl1, mut dao, mut dmo) = (z(n * c), z(n * c), z(n * c), z(n * c));
        let (mut dsa, mut dsm, mut dr, mut dp) = (z(c), z(c), z(2), z(4));
        let out =
            LaneGrads { dl: [&mut dl0, &mut dl1], dao: &mut dao, dmo: &mut dmo, dsa: &mut dsa, dsm: &mut dsm, dr: &mut dr, dp: &mut dp };
        lanes_rows_bwd([&fg0, &fg1], [&fl0, &fl1], &fao, &fmo, w, out);
        let want = |x: &Var| flat(grads.get(x.as_tensor()).unwrap());
        for (got, x, what) in [
            (&dl0, &l0, "dl0"),
            (&dl1, &l1, "dl1"),
            (&dao, &ao, "dao"),
            (&dmo, &mo, "dmo"),
            (&dsa, &sa, "dsa"),
            (&dsm, &sm, "dsm"),
            (&dr, &r, "dr"),
            (&dp, &p, "dp"),
        ] {
            close(got, &want(x), what);
        }
    }
}
