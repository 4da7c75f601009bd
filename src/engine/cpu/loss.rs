//! The soft-capped cross-entropy fused with its gradient (llm.c's fused classifier): one pass
//! per row reads the logits, writes the row's loss, and overwrites the logits with their
//! gradient, so the `(N, V)` matrix is the only one the head ever needs:
//!
//! ```text
//! t[j]    = tanh(x[j] / c),  z[j] = c t[j]               (the soft-cap)
//! loss    = logsumexp_j z[j] - z[y]
//! x[j]   <- scale (softmax(z)[j] - [j == y]) (1 - t[j]^2)
//! ```
//!
//! `scale` is `1 / (N A)`: the mean over the micro-batch's `N` tokens and its share of an
//! `A`-micro-batch step, which is what `backward(loss / A)` gives.

use rayon::prelude::*;

use crate::model::cpu::simd::{Real, max_of, multiversion, sum_f64};

#[inline(always)]
fn ce_kernel<T: Real>(logits: &mut [T], targets: &[u32], losses: &mut [T], vocab: usize, cap: f64, scale: f64) {
    let (c, inv_c, one) = (T::from_f64(cap), T::from_f64(1.0 / cap), T::from_f64(1.0));
    let mut t = vec![T::from_f64(0.0); vocab];
    for ((row, &y), loss) in logits.chunks_exact_mut(vocab).zip(targets).zip(losses.iter_mut()) {
        // row <- z, t <- tanh.
        for (x, t) in row.iter_mut().zip(t.iter_mut()) {
            *t = (*x * inv_c).tanh();
            *x = c * *t;
        }
        let m = max_of(row);
        for x in row.iter_mut() {
            *x = (*x - m).exp();
        }
        let sum = sum_f64(row);
        let lse = m.to_f64() + sum.ln();
        let y = y as usize;
        *loss = T::from_f64(lse - (c * t[y]).to_f64());
        let a = T::from_f64(scale / sum);
        let s = T::from_f64(scale);
        for (x, &t) in row.iter_mut().zip(&t) {
            *x = *x * a * (one - t * t);
        }
        row[y] -= s * (one - t[y] * t[y]);
    }
}

multiversion! {
    fn ce_rows = ce_kernel(logits: &mut [T], targets: &[u32], losses: &mut [T], vocab: usize, cap: f64, scale: f64);
}

/// Rows per rayon task.
const CE_ROWS: usize = 16;

pub(super) fn softcap_ce<T: Real>(logits: &mut [T], targets: &[u32], losses: &mut [T], vocab: usize, cap: f64, scale: f64) {
    logits.par_chunks_mut(CE_ROWS * vocab).zip(losses.par_chunks_mut(CE_ROWS)).enumerate().for_each(|(i, (l, out))| {
        ce_rows(l, &targets[i * CE_ROWS..i * CE_ROWS + out.len()], out, vocab, cap, scale);
    });
}
