//! Error measures for comparing a device's numbers with a reference: the parity check
//! ([`crate::check::parity`]), the attention trial ([`crate::train::attention_trial`]) and tests.

/// The largest of `errors` (0 for none), NaN if any is NaN: `f64::max` drops NaNs, so a NaN
/// error folded with it would pass any tolerance.
#[cfg(feature = "candle")]
pub fn worst(errors: impl IntoIterator<Item = f64>) -> f64 {
    errors.into_iter().fold(0.0, |a, b| if b.is_nan() || b > a { b } else { a })
}

/// Relative error of `a` against `b` in the Frobenius norm (the absolute error where `b` is 0;
/// infinite where the lengths differ).
#[cfg(feature = "candle")]
pub fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    if den == 0.0 { num } else { num / den }
}

/// How a row-major `(rows, cols)` matrix splits into blocks: `block_rows` consecutive rows (the
/// last block of a `seq_rows` sequence may be shorter) by `block_cols` consecutive columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg(feature = "candle")]
pub struct Blocks {
    /// Columns per row.
    pub cols: usize,
    /// Rows per sequence: blocks never straddle two.
    pub seq_rows: usize,
    /// Rows per block within a sequence.
    pub block_rows: usize,
    /// Columns per block.
    pub block_cols: usize,
}

/// The worst [`rel_err`] over the blocks of `a` against `b`: an error confined to one block
/// (one head's tile of a sequence, say) counts in full instead of being diluted by the rest.
/// Infinite where the lengths differ or do not fit `blocks`.
#[cfg(feature = "candle")]
pub fn blockwise_rel_err(a: &[f64], b: &[f64], blocks: Blocks) -> f64 {
    let Blocks { cols, seq_rows, block_rows, block_cols } = blocks;
    if a.len() != b.len() || cols == 0 || seq_rows == 0 || block_rows == 0 || block_cols == 0 || !a.len().is_multiple_of(cols * seq_rows) {
        return f64::INFINITY;
    }
    let rows = a.len() / cols;
    let mut errors = Vec::new();
    for seq in (0..rows).step_by(seq_rows) {
        for r0 in (seq..seq + seq_rows).step_by(block_rows) {
            let r1 = (r0 + block_rows).min(seq + seq_rows);
            for c0 in (0..cols).step_by(block_cols) {
                let c1 = (c0 + block_cols).min(cols);
                let (mut num, mut den) = (0.0, 0.0);
                for r in r0..r1 {
                    for i in r * cols + c0..r * cols + c1 {
                        num += (a[i] - b[i]) * (a[i] - b[i]);
                        den += b[i] * b[i];
                    }
                }
                errors.push(if den == 0.0 { num.sqrt() } else { (num / den).sqrt() });
            }
        }
    }
    worst(errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A NaN error is the worst of all, wherever it sits; no errors is 0.
    #[test]
    fn worst_keeps_nan() {
        assert!(worst([1e-3, f64::NAN, 2e-3]).is_nan());
        assert!(worst([f64::NAN, 1e-3]).is_nan());
        assert_eq!(worst([1e-3, 4e-3, 2e-3]), 4e-3);
        assert_eq!(worst([]), 0.0);
        assert_eq!(worst([f64::INFINITY, 1.0]), f64::INFINITY);
    }

    /// One block's error shows in full blockwise while the whole matrix dilutes it; blocks stop
    /// at sequence ends; a NaN and a length mismatch are never small.
    #[test]
    fn blockwise_error_finds_one_bad_block() {
        // 2 sequences of 6 rows, 4 columns; blocks of 4 rows (the last of a sequence has 2) by 2 columns.
        let want: Vec<f64> = (0..48).map(|i| 1.0 + (i % 7) as f64).collect();
        let blocks = Blocks { cols: 4, seq_rows: 6, block_rows: 4, block_cols: 2 };
        let mut got = want.clone();
        // Rows 10 and 11 (the second sequence's short block), columns 2 and 3: off by 10%.
        for i in [42, 43, 46, 47] {
            got[i] *= 1.1;
        }
        let whole = rel_err(&got, &want);
        let block = blockwise_rel_err(&got, &want, blocks);
        assert!((block - 0.1).abs() < 1e-12, "{block}");
        assert!(whole < 0.03, "{whole}");
        // A block that straddled the sequences (rows 8-11) would have diluted it.
        let straddling = blockwise_rel_err(&got, &want, Blocks { seq_rows: 12, ..blocks });
        assert!(straddling < 0.09, "{straddling}");
        got[0] = f64::NAN;
        assert!(blockwise_rel_err(&got, &want, blocks).is_nan());
        assert_eq!(blockwise_rel_err(&got[1..], &want[1..], blocks), f64::INFINITY);
        assert_eq!(blockwise_rel_err(&want, &want, blocks), 0.0);
    }
}
