//! GPTQ's solver: the column-by-column loop of one block of columns for a tile of rows
//! (Optimal Brain Quantization's update, the module documentation of [`super`] in maths), the
//! innermost work of [`super::quantize_matrix`], which drives it block by block and tile by
//! tile and applies the GEMM between blocks.

/// One block of columns of the in-block loop: the working matrix's row stride `n`, the error
/// buffer's row stride `bs`, the block's first column `b0`, its diagonal part of `U` (`nb x nb`,
/// row-major: `ublk[j * nb + k] = U[b0 + j, b0 + k]`) and `Q`.
#[derive(Clone, Copy)]
pub(super) struct Block<'a> {
    pub(super) n: usize,
    pub(super) bs: usize,
    pub(super) b0: usize,
    pub(super) nb: usize,
    pub(super) ublk: &'a [f64],
    pub(super) qmax: f64,
}

/// The column-by-column loop of one block for a tile of rows.
///
/// `w_rows` and `q_rows` are the tile's rows of the working `W` and of `q` (row stride `n`),
/// `e_rows` its rows of the error buffer (stride `bs`), `s_rows` its scales. Writes the block's
/// `q` and errors; the block's columns of `W` are not written back (only later columns are read
/// again, and those get the GEMM). The update of column `j` itself (`k = j` in the module
/// documentation) is skipped: its value is not used after `q_j` and `e_j`.
///
/// Compiled twice, for the baseline target and for AVX2 (picked at run time): the update loop is
/// most of GPTQ's time outside the factorization, and the baseline x86-64 target has only 2-wide
/// SSE2 and no rounding instruction. Without FMA: each update stays one multiply and one
/// subtraction, rounded separately, as in the reference.
pub(super) fn quantize_block_tile(blk: Block<'_>, w_rows: &[f64], q_rows: &mut [i8], e_rows: &mut [f64], s_rows: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        fn wide(blk: Block<'_>, w_rows: &[f64], q_rows: &mut [i8], e_rows: &mut [f64], s_rows: &[f32]) {
            block_tile_kernel(blk, w_rows, q_rows, e_rows, s_rows);
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: `wide` has no requirement besides the CPU feature detected just above.
            unsafe { wide(blk, w_rows, q_rows, e_rows, s_rows) };
            return;
        }
    }
    block_tile_kernel(blk, w_rows, q_rows, e_rows, s_rows);
}

/// The body of [`quantize_block_tile`], inlined into each of its versions.
#[inline(always)]
pub(super) fn block_tile_kernel(blk: Block<'_>, w_rows: &[f64], q_rows: &mut [i8], e_rows: &mut [f64], s_rows: &[f32]) {
    let Block { n, bs, b0, nb, ublk, qmax } = blk;
    let rt = s_rows.len();
    let s: Vec<f64> = s_rows.iter().map(|&v| f64::from(v)).collect();
    // tile[k * rt + r] = W[r, b0 + k]: column k of the block, contiguous over the tile's rows.
    let mut tile = vec![0.0f64; nb * rt];
    for (r, w_row) in w_rows.chunks_exact(n).enumerate() {
        for (k, &x) in w_row[b0..b0 + nb].iter().enumerate() {
            tile[k * rt + r] = x;
        }
    }
    let mut e = vec![0.0f64; rt];
    for j in 0..nb {
        let (done, rest) = tile.split_at_mut((j + 1) * rt);
        let col = &done[j * rt..];
        let d = ublk[j * nb + j];
        // q_j = clamp(round(w_j / s), -Q, Q), e_j = (w_j - q_j s) / U_jj, per row.
        for (r, ((&wj, &sr), er)) in col.iter().zip(&s).zip(e.iter_mut()).enumerate() {
            let qj = quantize_value(wj, sr, qmax);
            q_rows[r * n + b0 + j] = qj as i8;
            *er = (wj - qj * sr) / d;
            e_rows[r * bs + j] = *er;
        }
        // w_k -= e_j * U_jk for the block's later columns k.
        for (c, &ujk) in rest.chunks_exact_mut(rt).zip(&ublk[j * nb + j + 1..(j + 1) * nb]) {
            for (x, &er) in c.iter_mut().zip(&e) {
                *x -= er * ujk;
            }
        }
    }
}

/// `clamp(round_half_even(w / s), -qmax, qmax)` in f64; 0 for a zero scale.
#[inline(always)]
pub(super) fn quantize_value(w: f64, s: f64, qmax: f64) -> f64 {
    if s > 0.0 { (w / s).round_ties_even().clamp(-qmax, qmax) } else { 0.0 }
}
