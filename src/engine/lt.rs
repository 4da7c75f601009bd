//! The engine's GEMMs as cuBLASLt calls: [`plan`] turns one [`crate::engine::op::Gemm`] on row-major
//! arena views into the fields of one `cublasLtMatmul` ([`LtPlan`]), and [`interpret`] runs
//! such a plan on a CPU arena exactly as cuBLASLt defines it, from the plan alone. The GPU
//! backend (cuBLASLt through cudarc) issues these plans; the tests run the whole engine through
//! plan + interpreter and match the CPU backend, so every layout the engine uses is known to
//! map onto cuBLASLt's conventions without a GPU.
//!
//! The cuBLASLt rules encoded here:
//!
//! - **Column-major.** A `cublasLtMatrixLayout` of `rows x cols` with leading dimension `ld`
//!   stores element `(i, j)` at `i + j ld`, and requires `ld >= rows`. `cublasLtMatmul` computes
//!   `D = alpha op(A) op(B) + beta C` with `op(X) = X` (`CUBLAS_OP_N`) or `X^T`
//!   (`CUBLAS_OP_T`), `op(A)` `m x k`, `op(B)` `k x n`, `C` and `D` `m x n`; so A's layout is
//!   `m x k` under N and `k x m` under T, B's `k x n` or `n x k`. Here `D = C` (one layout, one
//!   buffer: cuBLASLt allows `D` to alias `C`, never `A` or `B`).
//! - **The swap of operands.** A row-major `rows x cols` matrix with leading dimension `ld` is,
//!   byte for byte, the column-major storage of its transpose (`cols x rows`, same `ld`). So the
//!   engine's row-major `C = op(a) op(b)` is the column-major `C^T = op(b)^T op(a)^T`: cuBLAS's
//!   A operand is our `b`, its B operand our `a`, `m` is our `n` (C's columns), `n` our `m`,
//!   and a transposed view (`Mat::t`) becomes `CUBLAS_OP_T`, an untransposed one `CUBLAS_OP_N`.
//! - **`beta = 0`.** C is not read: it need not hold valid numbers, and NaN there does not
//!   propagate (the engine writes outputs over poisoned, NaN-filled buffers).
//! - **Strided batch.** With `CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = batch` and
//!   `CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = stride`, matrix `i` of an operand starts
//!   `i stride` elements after the first; a stride of 0 reuses one matrix for every product.
//!
//! The interpreter accumulates each dot product in f64 and stores `alpha dot + beta c` in the
//! arena's type: a checker, not a fast path (plain loops). It panics on a plan cuBLASLt would
//! reject or that would touch memory outside the arena.
//!
//! [`crate::engine::op::Gemm`]: crate::engine::op::Gemm

#[cfg(feature = "tools")]
use candle_core::WithDType;

use super::backend::Mat;

/// `cublasOperation_t` for one operand (discriminants are cuBLAS's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(i32)]
pub enum LtOp {
    /// `CUBLAS_OP_N`: the operand as stored.
    N = 0,
    /// `CUBLAS_OP_T`: the operand transposed.
    T = 1,
}

/// One `cublasLtMatrixLayout` as cuBLASLt reads it: column-major `rows x cols`, `ld` elements
/// between the starts of two columns (`ld >= rows`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LtLayout {
    /// `CUBLASLT_MATRIX_LAYOUT_ROWS`.
    pub rows: u64,
    /// `CUBLASLT_MATRIX_LAYOUT_COLS`.
    pub cols: u64,
    /// `CUBLASLT_MATRIX_LAYOUT_LD`.
    pub ld: i64,
}

impl LtLayout {
    /// The elements one matrix spans, from its first to one past its last (0 when empty).
    #[cfg(feature = "tools")]
    fn span(self) -> i128 {
        if self.rows == 0 || self.cols == 0 { 0 } else { (self.cols as i128 - 1) * self.ld as i128 + self.rows as i128 }
    }
}

/// Everything one `cublasLtMatmul` call needs, in cuBLAS's terms: `D = C = alpha op(A) op(B) +
/// beta C` with `op(A)` `m x k`, `op(B)` `k x n`, `C` `m x n`, all column-major. A, B, C are
/// cuBLAS's operands: [`plan`] puts the engine's `b` in A and its `a` in B.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LtPlan {
    /// `CUBLASLT_MATMUL_DESC_TRANSA`.
    pub trans_a: LtOp,
    /// `CUBLASLT_MATMUL_DESC_TRANSB`.
    pub trans_b: LtOp,
    /// A's layout (as stored, before `trans_a`).
    pub a: LtLayout,
    /// B's layout (as stored, before `trans_b`).
    pub b: LtLayout,
    /// C's layout, which is also D's.
    pub c: LtLayout,
    /// A's first element, in elements from the arena's start.
    pub a_off: usize,
    /// B's first element.
    pub b_off: usize,
    /// C's (and D's) first element.
    pub c_off: usize,
    /// Rows of `op(A)` and of C.
    pub m: u64,
    /// Columns of `op(B)` and of C.
    pub n: u64,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: u64,
    /// `alpha` (the scale type is f32: `CUBLAS_COMPUTE_32F`).
    pub alpha: f32,
    /// `beta` (0: C is not read).
    pub beta: f32,
    /// `CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT` of every layout (1: not batched).
    pub batch: u32,
    /// A's `CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET`, in elements.
    pub stride_a: i64,
    /// B's strided-batch offset.
    pub stride_b: i64,
    /// C's (and D's) strided-batch offset.
    pub stride_c: i64,
}

/// The column-major layout of a stored row-major view (the stored matrix's transpose, same
/// `ld`), and the op that makes it `op(x)^T`, the view's operand transposed.
fn operand(x: Mat) -> (LtOp, LtLayout) {
    let layout = LtLayout { rows: x.cols as u64, cols: x.rows as u64, ld: x.ld as i64 };
    (if x.t { LtOp::T } else { LtOp::N }, layout)
}

/// The cuBLASLt call for the engine's `c = alpha op(a) op(b) + beta c` on row-major views
/// ([`crate::engine::op::Gemm`]): `c^T = op(b)^T op(a)^T` column-major; `alpha` and `beta` are
/// rounded to f32 (the scale type). Panics when the shapes do not agree or `c` is transposed.
///
/// [`crate::engine::op::Gemm`]: crate::engine::op::Gemm
pub fn plan(c: Mat, a: Mat, b: Mat, alpha: f64, beta: f64) -> LtPlan {
    let ((m, k), (k2, n)) = (a.shape(), b.shape());
    assert!(
        k == k2 && c.shape() == (m, n) && !c.t,
        "lt plan: {:?} x {:?} into {:?}{}",
        a.shape(),
        b.shape(),
        c.shape(),
        if c.t { " (transposed output)" } else { "" }
    );
    let ((trans_a, la), (trans_b, lb)) = (operand(b), operand(a));
    LtPlan {
        trans_a,
        trans_b,
        a: la,
        b: lb,
        c: LtLayout { rows: n as u64, cols: m as u64, ld: c.ld as i64 },
        a_off: b.off,
        b_off: a.off,
        c_off: c.off,
        m: n as u64,
        n: m as u64,
        k: k as u64,
        alpha: alpha as f32,
        beta: beta as f32,
        batch: 1,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
    }
}

/// The largest alignment cuBLASLt can be promised for an operand (a power of two from 4 to 256
/// bytes): the largest that divides its first address and, when batched, the byte step between
/// its matrices. cuBLASLt's heuristic assumes 256 unless told (`CUBLASLT_MATMUL_PREF_MIN_
/// ALIGNMENT_*_BYTES`), and an algorithm chosen for 256 may load 16 bytes at a time from an
/// address that is only 4-byte aligned.
pub fn alignment(addr: u64, batch_step_bytes: Option<i64>) -> u32 {
    let mut x = addr | 256;
    if let Some(step) = batch_step_bytes {
        x |= step.unsigned_abs() | 256;
    }
    // The lowest set bit: the largest power of two dividing every term (256 at most).
    (x & x.wrapping_neg()) as u32
}

impl LtPlan {
    /// The alignment in bytes of A, B and C ([`alignment`]) when the `f32` arena starts at the
    /// byte address `base`.
    pub fn alignments(&self, base: u64) -> [u32; 3] {
        self.alignments_in([base; 3], [4; 3])
    }

    /// [`LtPlan::alignments`] with A, B and C each in its own space: starting at byte address
    /// `bases[k]`, `elem[k]` bytes per element (2 for bf16 operands).
    pub fn alignments_in(&self, bases: [u64; 3], elem: [usize; 3]) -> [u32; 3] {
        let offs = [(self.a_off, self.stride_a), (self.b_off, self.stride_b), (self.c_off, self.stride_c)];
        std::array::from_fn(|k| {
            let (off, stride) = offs[k];
            let step = (self.batch > 1).then_some(stride * elem[k] as i64);
            alignment(bases[k] + (elem[k] * off) as u64, step)
        })
    }
}

/// [`plan`] for `count` products, the `i`-th on operands starting `i stride_*` elements after
/// the given views (a stride of 0 reuses one operand for every product).
#[allow(clippy::too_many_arguments)]
pub fn plan_batched(
    c: Mat,
    a: Mat,
    b: Mat,
    alpha: f64,
    beta: f64,
    count: usize,
    stride_c: usize,
    stride_a: usize,
    stride_b: usize,
) -> LtPlan {
    assert!(count >= 1, "lt plan: a batch of {count} products");
    let batch = u32::try_from(count).expect("lt plan: batch count beyond u32");
    // cuBLAS's A is our b and its B our a.
    LtPlan { batch, stride_a: stride_b as i64, stride_b: stride_a as i64, stride_c: stride_c as i64, ..plan(c, a, b, alpha, beta) }
}

/// Checks one operand's layout against its op and shape, and that every batch of it lies in an
/// arena of `len` elements (the first at `off`, the others `stride` apart); returns its span
/// per matrix.
#[cfg(feature = "tools")]
fn check_operand(name: &str, l: LtLayout, op: LtOp, shape: (u64, u64), (off, stride): (usize, i64), batch: u32, len: usize) -> i128 {
    let want = if op == LtOp::N { shape } else { (shape.1, shape.0) };
    assert!((l.rows, l.cols) == want, "lt plan: {name} is {}x{} under {op:?}, the product needs {}x{}", l.rows, l.cols, want.0, want.1);
    assert!(l.ld as i128 >= l.rows as i128, "lt plan: {name}'s ld {} is below its {} rows", l.ld, l.rows);
    let span = l.span();
    if span > 0 {
        // The batches' starts are linear in the index: the first and the last bound them all.
        for i in [0, batch as i128 - 1] {
            let start = off as i128 + i * stride as i128;
            assert!(
                start >= 0 && start + span <= len as i128,
                "lt plan: {name}'s matrix {i} spans {start}..{} outside the {len}-element arena",
                start + span
            );
        }
    }
    span
}

/// Whether `[x, x + lx)` and `[y, y + ly)` share an element.
#[cfg(feature = "tools")]
fn overlap(x: i128, lx: i128, y: i128, ly: i128) -> bool {
    lx > 0 && ly > 0 && x < y + ly && y < x + lx
}

/// Executes `p` on `arena` as `cublasLtMatmul` defines it, from the plan's fields alone (see
/// the module doc for the rules). Panics on a layout that does not fit its op and `m, n, k`,
/// an `ld` below the rows, an element outside the arena, a batch count of 0, or a C whose
/// span overlaps A's, B's or another batch's C's. `T`: any candle element type (f64, f32, bf16, ...).
#[cfg(feature = "tools")]
pub fn interpret<T: WithDType>(p: &LtPlan, arena: &mut [T]) {
    interpret_rounding(p, arena, false)
}

/// [`interpret`], with every element of A and B rounded to bf16 first when `bf16_inputs`: what
/// `CUBLAS_COMPUTE_32F_FAST_16BF` does on the tensor cores (the accumulation stays wide), so
/// that the warp emulator can stand for the GPU's bf16 GEMM maths.
#[cfg(feature = "tools")]
pub fn interpret_rounding<T: WithDType>(p: &LtPlan, arena: &mut [T], bf16_inputs: bool) {
    let len = arena.len();
    assert!(p.batch >= 1, "lt plan: batch count 0");
    let la = check_operand("A", p.a, p.trans_a, (p.m, p.k), (p.a_off, p.stride_a), p.batch, len);
    let lb = check_operand("B", p.b, p.trans_b, (p.k, p.n), (p.b_off, p.stride_b), p.batch, len);
    let lc = check_operand("C", p.c, LtOp::N, (p.m, p.n), (p.c_off, p.stride_c), p.batch, len);
    let start = |off: usize, stride: i64, i: u32| off as i128 + i as i128 * stride as i128;
    for i in 0..p.batch {
        let c0 = start(p.c_off, p.stride_c, i);
        for j in 0..p.batch {
            assert!(
                !overlap(c0, lc, start(p.a_off, p.stride_a, j), la) && !overlap(c0, lc, start(p.b_off, p.stride_b, j), lb),
                "lt plan: C of product {i} overlaps an operand of product {j}"
            );
            assert!(i == j || !overlap(c0, lc, start(p.c_off, p.stride_c, j), lc), "lt plan: C of products {i} and {j} overlap");
        }
    }
    let (alpha, beta) = (p.alpha as f64, p.beta as f64);
    let (lda, ldb, ldc) = (p.a.ld as usize, p.b.ld as usize, p.c.ld as usize);
    for bi in 0..p.batch {
        // Every index below is inside the arena: checked above.
        let (a0, b0, c0) =
            (start(p.a_off, p.stride_a, bi) as usize, start(p.b_off, p.stride_b, bi) as usize, start(p.c_off, p.stride_c, bi) as usize);
        // op(A)(r, q) and op(B)(q, col), column-major.
        let at = |r: usize, q: usize| if p.trans_a == LtOp::N { a0 + r + q * lda } else { a0 + q + r * lda };
        let bt = |q: usize, col: usize| if p.trans_b == LtOp::N { b0 + q + col * ldb } else { b0 + col + q * ldb };
        for col in 0..p.n as usize {
            for r in 0..p.m as usize {
                let round = |x: f64| if bf16_inputs { half::bf16::from_f64(x).to_f64() } else { x };
                let dot: f64 = (0..p.k as usize).map(|q| round(arena[at(r, q)].to_f64()) * round(arena[bt(q, col)].to_f64())).sum();
                let ci = c0 + r + col * ldc;
                // beta = 0: C is not read (NaN there does not propagate).
                let old = if beta == 0.0 { 0.0 } else { beta * arena[ci].to_f64() };
                arena[ci] = T::from_f64(alpha * dot + old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Tensor};

    use super::*;
    use crate::engine::backend::{Backend, Buf};
    use crate::engine::cpu::CpuBackend;
    use crate::engine::op;

    /// `alpha op(a) op(b) + beta c` on row-major views, naively: the arena after the op.
    fn naive(arena: &[f64], c: Mat, a: Mat, b: Mat, alpha: f64, beta: f64) -> Vec<f64> {
        let at = |x: Mat, i: usize, j: usize| if x.t { arena[x.off + j * x.ld + i] } else { arena[x.off + i * x.ld + j] };
        let ((m, k), (_, n)) = (a.shape(), b.shape());
        let mut out = arena.to_vec();
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k).map(|p| at(a, i, p) * at(b, p, j)).sum();
                let old = if beta == 0.0 { 0.0 } else { beta * at(c, i, j) };
                out[c.off + i * c.ld + j] = alpha * s + old;
            }
        }
        out
    }

    /// An arena of `len` random elements in `[-0.5, 0.5)`.
    fn random(len: usize, seed: u64) -> Vec<f64> {
        let mut rng = fastrand::Rng::with_seed(seed);
        (0..len).map(|_| rng.f64() - 0.5).collect()
    }

    /// Plan + interpreter against the naive product: C within 1e-12, every other element
    /// untouched.
    fn check(arena: &[f64], c: Mat, a: Mat, b: Mat, alpha: f64, beta: f64, what: &str) {
        let want = naive(arena, c, a, b, alpha, beta);
        let mut got = arena.to_vec();
        interpret(&plan(c, a, b, alpha, beta), &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let ok = if g.is_nan() && w.is_nan() { true } else { (g - w).abs() <= 1e-12 * w.abs().max(1.0) };
            assert!(ok, "{what}: element {i}: {g} vs {w}");
        }
    }

    /// Every transpose combination of `a` and `b`, `a` a column view (q inside a fused qkv
    /// product), `b` a row view, `c` a column view; beta 0 over NaN, beta 1 (accumulation),
    /// beta 0.5 and alpha 2.
    #[test]
    fn every_layout_matches_the_naive_product() {
        let (m, n, k) = (5, 7, 3);
        for ta in [false, true] {
            for tb in [false, true] {
                for (alpha, beta) in [(1.0, 0.0), (1.0, 1.0), (2.0, 0.5), (2.0, 0.0)] {
                    let (ar, ac) = if ta { (k, m) } else { (m, k) };
                    let (br, bc) = if tb { (n, k) } else { (k, n) };
                    // a: columns 2.. of an (ar, ac + 6) matrix; b: rows 1.. of a (br + 2, bc)
                    // matrix; c: columns 1.. of an (m, n + 3) matrix.
                    let wa = Buf { off: 0, len: ar * (ac + 6) }.mat(ar, ac + 6).cols(2, ac);
                    let wb = Buf { off: wa.span().end() + 4, len: (br + 2) * bc }.mat(br + 2, bc).rows(1, br);
                    let cbuf = Buf { off: wb.off + (br + 1) * bc + 3, len: m * (n + 3) };
                    let c = cbuf.mat(m, n + 3).cols(1, n);
                    let mut arena = random(cbuf.end() + 5, 11);
                    if beta == 0.0 {
                        arena[cbuf.off..cbuf.end()].fill(f64::NAN);
                    }
                    let (a, b) = (if ta { wa.t() } else { wa }, if tb { wb.t() } else { wb });
                    check(&arena, c, a, b, alpha, beta, &format!("ta {ta} tb {tb} alpha {alpha} beta {beta}"));
                    if beta == 0.0 {
                        let mut got = arena.clone();
                        interpret(&plan(c, a, b, alpha, beta), &mut got);
                        assert!((0..m).all(|i| (0..n).all(|j| got[c.off + i * c.ld + j].is_finite())), "NaN in C propagated");
                    }
                }
            }
        }
    }

    /// The engine's shapes: the fused qkv weight gradient from a column view of `dqkv`
    /// transposed, and a vector times a matrix (`m = 1`), plus `k = 1`.
    #[test]
    fn fused_and_degenerate_shapes_match_the_naive_product() {
        let (rows, d, kvd) = (6, 8, 4);
        let w = d + 2 * kvd;
        let dqkv = Buf { off: 0, len: rows * w }.mat(rows, w);
        let x = Buf { off: rows * w, len: rows * d }.mat(rows, d);
        let dw = Buf { off: rows * w + rows * d, len: kvd * d }.mat(kvd, d);
        let arena = random(dw.span().end() + 2, 5);
        check(&arena, dw, dqkv.cols(d, kvd).t(), x, 1.0, 1.0, "dk^T x");
        check(&arena, dw, dqkv.cols(d + kvd, kvd).t(), x, 1.0, 0.0, "dv^T x");
        // A row of x times the k block of dqkv (its rows as the inner dimension).
        check(&arena, Buf { off: 150, len: kvd }.mat(1, kvd), x.rows(2, 1).cols(0, rows), dqkv.cols(d, kvd), 1.0, 0.0, "m = 1");
        check(
            &arena,
            Buf { off: 100, len: 12 }.mat(3, 4),
            Buf { off: 0, len: 3 }.mat(3, 1),
            Buf { off: 10, len: 4 }.mat(1, 4),
            1.5,
            1.0,
            "k = 1",
        );
    }

    /// A batched plan equals one plan per product, with a shared (stride 0) operand on either
    /// side and transposes.
    #[test]
    fn batched_plans_equal_one_plan_per_product() {
        let (m, n, k, count) = (4, 3, 5, 3);
        for (sa_zero, sb_zero, tb) in [(false, false, false), (true, false, true), (false, true, false), (false, false, true)] {
            let (la, lb, lc) = (m * k, k * n, m * n);
            let (sa, sb) = (if sa_zero { 0 } else { la + 2 }, if sb_zero { 0 } else { lb + 1 });
            let a = Buf { off: 0, len: la }.mat(m, k);
            let b_off = count * (la + 2);
            let b = if tb { Buf { off: b_off, len: lb }.mat(n, k).t() } else { Buf { off: b_off, len: lb }.mat(k, n) };
            let c = Buf { off: b_off + count * (lb + 1), len: lc }.mat(m, n);
            let sc = lc + 3;
            let arena = random(c.off + count * sc, 9);
            let mut batched = arena.clone();
            interpret(&plan_batched(c, a, b, 2.0, 1.0, count, sc, sa, sb), &mut batched);
            let mut one = arena.clone();
            for i in 0..count {
                let at = |x: Mat, s: usize| Mat { off: x.off + i * s, ..x };
                interpret(&plan(at(c, sc), at(a, sa), at(b, sb), 2.0, 1.0), &mut one);
            }
            assert_eq!(batched, one, "stride 0 on a {sa_zero}, on b {sb_zero}, b transposed {tb}");
            assert_ne!(batched, arena);
        }
    }

    /// The operand swap itself: cuBLAS's A is our `b`, its `m` our `n`.
    #[test]
    fn the_plan_swaps_the_operands() {
        let a = Buf { off: 0, len: 6 }.mat(2, 3);
        let b = Buf { off: 6, len: 12 }.mat(4, 3).t();
        let p = plan(Buf { off: 20, len: 8 }.mat(2, 4), a, b, 1.0, 0.0);
        assert_eq!((p.m, p.n, p.k, p.trans_a, p.trans_b, p.a_off, p.b_off), (4, 2, 3, LtOp::T, LtOp::N, 6, 0));
        assert_eq!(
            (p.a, p.b, p.c),
            (LtLayout { rows: 3, cols: 4, ld: 3 }, LtLayout { rows: 3, cols: 2, ld: 3 }, LtLayout { rows: 4, cols: 2, ld: 4 })
        );
    }

    /// A valid plan to break: `C (4x3) = A (4x5) B (5x3)` column-major, all N.
    fn good() -> LtPlan {
        let (a, b, c) = (Buf { off: 0, len: 15 }.mat(3, 5), Buf { off: 15, len: 20 }.mat(5, 4), Buf { off: 35, len: 12 }.mat(3, 4));
        plan(c, a, b, 1.0, 0.0)
    }

    #[test]
    fn the_good_plan_runs() {
        let p = good();
        assert_eq!((p.m, p.n, p.k, p.trans_a, p.trans_b), (4, 3, 5, LtOp::N, LtOp::N));
        interpret(&p, &mut vec![0.0f64; 47]);
    }

    #[test]
    #[should_panic(expected = "ld 3 is below its 4 rows")]
    fn an_ld_below_the_rows_is_caught() {
        interpret(&LtPlan { a: LtLayout { ld: 3, ..good().a }, ..good() }, &mut vec![0.0f64; 47]);
    }

    #[test]
    #[should_panic(expected = "A is 4x5 under N, the product needs 3x5")]
    fn an_m_that_does_not_match_a_is_caught() {
        interpret(&LtPlan { m: 3, c: LtLayout { rows: 3, cols: 3, ld: 4 }, ..good() }, &mut vec![0.0f64; 47]);
    }

    #[test]
    #[should_panic(expected = "B is 5x3 under T, the product needs 3x5")]
    fn a_wrong_transpose_is_caught() {
        interpret(&LtPlan { trans_b: LtOp::T, ..good() }, &mut vec![0.0f64; 47]);
    }

    #[test]
    #[should_panic(expected = "outside the 47-element arena")]
    fn a_batch_past_the_arena_is_caught() {
        interpret(&LtPlan { batch: 2, stride_a: 0, stride_b: 0, stride_c: 12, ..good() }, &mut vec![0.0f64; 47]);
    }

    #[test]
    #[should_panic(expected = "overlaps an operand")]
    fn c_over_an_operand_is_caught() {
        interpret(&LtPlan { c_off: 10, ..good() }, &mut vec![0.0f64; 47]);
    }

    #[test]
    #[should_panic(expected = "lt plan: (3, 5) x (4, 4) into (3, 4)")]
    fn mismatched_views_are_caught() {
        plan(Buf { off: 0, len: 12 }.mat(3, 4), Buf { off: 0, len: 15 }.mat(3, 5), Buf { off: 0, len: 16 }.mat(4, 4), 1.0, 0.0);
    }

    /// The CPU backend with every GEMM run as a cuBLASLt plan by [`interpret`].
    struct LtCheckBackend(CpuBackend<f64>, Option<std::sync::Arc<std::sync::Mutex<Vec<LtPlan>>>>);

    impl Backend for LtCheckBackend {
        fn dtype(&self) -> DType {
            self.0.dtype()
        }
        fn device_name(&self) -> String {
            self.0.device_name()
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn upload(&mut self, dst: Buf, src: &Tensor) -> anyhow::Result<()> {
            self.0.upload(dst, src)
        }
        fn download(&self, src: Buf, shape: &[usize]) -> anyhow::Result<Tensor> {
            self.0.download(src, shape)
        }
        fn set_tokens(&mut self, x: &[u32], y: &[u32]) {
            self.0.set_tokens(x, y)
        }
        fn sum(&self, src: Buf) -> f64 {
            self.0.sum(src)
        }
        fn sum_sq(&self, src: Buf) -> f64 {
            self.0.sum_sq(src)
        }
        fn all_finite(&self, src: Buf) -> bool {
            self.0.all_finite(src)
        }
        /// A GEMM as its cuBLASLt plan, interpreted; every other op on the CPU backend.
        fn run(&mut self, o: op::Op) {
            match o {
                op::Op::Gemm(op::Gemm { c, a, b, alpha, beta }) => {
                    let p = plan(c, a, b, alpha, beta);
                    if let Some(plans) = &self.1 {
                        plans.lock().unwrap().push(p);
                    }
                    interpret(&p, self.0.arena_mut());
                }
                op::Op::GemmBatched(g) => g.each().for_each(|g| self.run(g.into())),
                other => self.0.run(other),
            }
        }
    }

    /// `want` and `got`, named tensors in the same order, equal to a relative 1e-12 each.
    fn same(want: &[(String, Tensor)], got: &[(String, Tensor)], what: &str) {
        use crate::engine::tests::{flat, rel_err};
        assert_eq!(want.len(), got.len());
        for ((name, w), (n2, g)) in want.iter().zip(got) {
            assert_eq!(name, n2);
            let err = rel_err(&flat(w), &flat(g));
            assert!(err <= 1e-12, "{what}: {name}: relative error {err:e}");
        }
    }

    /// The decisive check: the engine with every GEMM run as a cuBLASLt plan by the
    /// interpreter (poison on, so beta = 0 outputs start as NaN) gives the CPU backend's loss,
    /// gradients, and weights and optimizer state after Muon and Adam steps, to 1e-12: every
    /// GEMM layout of the forward, backward and Newton-Schulz maps onto cuBLASLt's conventions.
    #[test]
    fn the_engine_through_lt_plans_equals_the_cpu_backend() {
        use crate::engine::layout::Layout;
        use crate::engine::step::{ADAM_GROUPS, Engine};
        use crate::engine::tests::{baseline_small, perturbed, record_small, tokens};
        let (rows, t) = (3, 6);
        for (cfg, looping) in [(record_small(), false), (record_small(), true), (baseline_small(), false)] {
            let what = format!("{} layers, looping {looping}", cfg.num_layers);
            let params = perturbed(&cfg, 7).state_dict().into_iter().collect();
            let mut cpu = Engine::cpu(&cfg, rows, t, DType::F64, true).unwrap();
            let lt = Box::new(LtCheckBackend(CpuBackend::new(Layout::new(&cfg, rows, t).len()), None));
            let mut lt = Engine::with_backend(&cfg, rows, t, lt, true).unwrap();
            for step in 0..2u64 {
                let (x, y) = (tokens(2 * step + 1, rows * t, cfg.vocab_size as u32), tokens(2 * step + 2, rows * t, cfg.vocab_size as u32));
                let mut losses = [0.0f64; 2];
                for (e, loss) in [&mut cpu, &mut lt].into_iter().zip(&mut losses) {
                    if step == 0 {
                        e.load_params(&params).unwrap();
                    }
                    e.zero_grads();
                    e.micro_step(&x, &y, looping, 1.0 / (rows * t) as f64);
                    *loss = e.loss_sum().unwrap();
                }
                assert!((losses[0] - losses[1]).abs() <= 1e-12 * losses[0].abs(), "{what} step {step}: loss {losses:?}");
                same(&cpu.grads().unwrap(), &lt.grads().unwrap(), &format!("{what} step {step} gradients"));
                for e in [&mut cpu, &mut lt] {
                    e.muon(crate::engine::cases::check_muon()).unwrap();
                    for (group, _) in ADAM_GROUPS {
                        e.adam(group, 0.01, (0.9, 0.95), 1e-8, 0.0);
                    }
                }
                same(&cpu.params().unwrap(), &lt.params().unwrap(), &format!("{what} step {step} weights"));
                same(&cpu.optimizer_state().unwrap(), &lt.optimizer_state().unwrap(), &format!("{what} step {step} optimizer state"));
            }
        }
    }

    /// [`alignment`]: the largest power of two up to 256 dividing the address and the batch
    /// step.
    #[test]
    fn alignment_is_the_largest_power_of_two_dividing_address_and_step() {
        assert_eq!(alignment(0, None), 256);
        assert_eq!(alignment(1 << 20, None), 256);
        assert_eq!(alignment(256 + 4, None), 4);
        assert_eq!(alignment(256 + 48, None), 16);
        assert_eq!(alignment(512, Some(8)), 8);
        assert_eq!(alignment(512, Some(-1024)), 256);
        assert_eq!(alignment(512, Some(0)), 256);
    }

    /// Every GEMM of a training step (forward, backward, Newton-Schulz) on shapes where nothing
    /// is a multiple of anything (5 query heads, 1 key/value head, vocabulary 1001, a 67-token
    /// sequence): the alignment each plan promises cuBLASLt divides the operand's address (the
    /// arena at a 256-byte boundary, as `cudaMalloc` gives), and every operand that starts on
    /// a region's boundary (a weight, its gradient, an activation: all of them in today's
    /// schedule) is promised the full 256 bytes. With the unaligned bump allocator the weight
    /// after the 5-element query gain sat at an odd offset and the old plans promised 256.
    #[test]
    fn every_plan_of_a_step_promises_only_the_alignment_it_has() {
        use crate::engine::layout::{ALIGN, Layout};
        use crate::engine::optim::MuonStep;
        use crate::engine::step::Engine;
        use crate::engine::tests::{perturbed, tokens};
        use crate::model::ModelConfig;
        let cfg =
            ModelConfig { vocab_size: 1001, model_dim: 80, num_heads: 5, num_kv_heads: 1, rope_dims: Some(4), ..ModelConfig::record() };
        let cfg =
            ModelConfig { num_layers: 4, num_loops: 1, loop_start: 1, loop_end: 2, parallel_residual_start: Some(3), xsa_last_n: 2, ..cfg };
        let (rows, t) = (1, 67);
        let layout = Layout::new(&cfg, rows, t);
        let plans = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let be = Box::new(LtCheckBackend(CpuBackend::new(layout.len()), Some(plans.clone())));
        let mut e = Engine::with_backend(&cfg, rows, t, be, false).unwrap();
        e.load_params(&perturbed(&cfg, 2).state_dict().into_iter().collect()).unwrap();
        e.zero_grads();
        let (x, y) = (tokens(1, rows * t, cfg.vocab_size as u32), tokens(2, rows * t, cfg.vocab_size as u32));
        e.micro_step(&x, &y, true, 1.0 / (rows * t) as f64);
        e.muon(MuonStep {
            lr: 0.05,
            momentum: 0.95,
            nesterov: true,
            backend_steps: 2,
            ns: crate::optim::NewtonSchulz::Quintic,
            row_norm: true,
            weight_decay: 0.0,
        })
        .unwrap();
        let plans = plans.lock().unwrap();
        assert!(plans.len() > 20, "{} plans", plans.len());
        let base = 7 << 20; // a 256-byte aligned allocation
        let (mut full, mut views) = (0, 0);
        for p in plans.iter() {
            for (which, (off, align)) in
                [(p.a_off, p.alignments(base)[0]), (p.b_off, p.alignments(base)[1]), (p.c_off, p.alignments(base)[2])]
                    .into_iter()
                    .enumerate()
            {
                let addr = base + 4 * off as u64;
                assert!(addr.is_multiple_of(align as u64), "operand {which} of {p:?}: {align}-byte alignment promised at {addr:#x}");
                if off.is_multiple_of(ALIGN) {
                    assert_eq!(align, 256, "operand {which} of {p:?} starts a region");
                    full += 1;
                } else {
                    views += 1;
                }
            }
        }
        assert!(full > 3 * plans.len() / 2, "{full} whole-region operands, {views} views");
    }
}
