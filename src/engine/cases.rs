//! The engine's op checks: one case per backend op (and per variant that takes another kernel
//! path: accumulate or write, gated or not, with or without the query gain), each a short
//! sequence of ops on an arena of random values, run on the backend under test and on the f64
//! CPU backend ([`CpuBackend<f64>`], every op's reference) from the same values; the **whole**
//! arena is compared afterwards, so a write outside an op's outputs fails too.
//!
//! The whole-engine checks ([`model_check`], [`graph_check`]) are in [`super::model_check`]
//! and re-exported here, so that one module names everything `pipeline engine-check` runs.
//!
//! The one table serves every device: the warp emulator in the tests (`engine::gpu`, where
//! a test also checks that the table launches every kernel the engine has), the real GPU and
//! the f32 CPU backend in `pipeline engine-check` ([`crate::check::engine`]).
//!
//! The arena's values are multiples of 1/64 in [-1, 1]: exact in bf16, so a GEMM on the bf16
//! tensor cores (`CUBLAS_COMPUTE_32F_FAST_16BF` rounds its inputs) loses nothing to rounding
//! and the GEMM cases' bound holds for every GEMM maths: they check layouts and plans, not
//! precision (the model check does that). Shapes cross the kernels' edges: rows not a multiple
//! of a block (8) or of a partial sum (64), rows wider than a warp and not a multiple of it,
//! strided views, a vocabulary with unused and repeated rows.

use candle_core::{Device, Tensor};

use super::backend::{Activation, AdamStep, AttnShape, Backend, Buf, HeadShape, Mat};
use super::cpu::CpuBackend;
use super::gpu::Capacity;
use super::layout::Bump;
pub use super::model_check::{
    CHECK_ROWS_T, Compared, GraphOutcome, ModelBounds, check_model, check_model_0427, check_models, graph_check, model_check,
};
#[cfg(test)]
pub(crate) use super::model_check::{check_muon, perturbed, record_small};
use crate::engine::backend::BackendExt;
use crate::engine::op;
use crate::model::ops::DocRule;

mod rows;
use rows::{
    attn_gate_case, lanes_case, mix_norm_case, norm_mix_case, norm_scale_case, rms_bwd_case, skip_bwd_case, skip_case, smear_case,
    unaligned,
};

/// Tokens (rows) of the row ops: more than two partial sums (64), not a multiple of 8.
pub const N: usize = 130;
/// Row width: wider than a warp, not a multiple of 32.
const W: usize = 48;
/// Vocabulary of the embedding and loss cases.
const VOCAB: usize = 40;
/// BigramHash's buckets in the embedding cases (fewer than the vocabulary's rows, so that the
/// capacity's CSR is not theirs), over sequences of [`BIGRAM_T`] (not a divisor of [`N`]).
const BUCKETS: usize = 29;
const BIGRAM_T: usize = 12;
/// Head ops: 3 query heads of 16 on 1 key/value head, 6 of 16 dims rotated, positions mod 10.
const HEADS: (usize, usize, usize) = (3, 16, 1);
/// The q/k norm + RoPE cases at the GPU engine's head width: 3 query heads of 64 on 1
/// key/value head (the vectorized kernels' shape; 390 heads, not a multiple of a block's 16).
const WIDE_HEADS: (usize, usize, usize) = (3, 64, 1);
/// Attention: 2 sequences of 64 tokens, 2 query heads of 64 on 1 key/value head (the GPU
/// kernels' head width).
const ATTN: (usize, usize, usize, usize, usize) = (2, 64, 2, 1, 64);

/// Bounds (largest `|device - f64| / max(1, |f64|)` over the arena): flat loops and the
/// optimizers do a few f32 operations per element; GEMMs sum 37 exact products in f32; rows
/// sum up to 48 values, head rows 16 with a square root; attention rounds q, k, v and the
/// probabilities to bf16 (4e-3 per rounding, 7e-3 measured in the emulator).
const FLAT: f64 = 1e-6;
const OPTIM: f64 = 2e-6;
const GEMM: f64 = 1e-5;
const ROWS: f64 = 2e-5;
const ATTENTION: f64 = 3e-2;

/// One op check.
pub struct Case {
    /// The op (and variant) it checks, as `pipeline engine-check` prints it.
    pub name: &'static str,
    /// Arena elements it uses (from 0).
    pub len: usize,
    /// The largest error that passes.
    pub bound: f64,
    /// The ops, on a backend whose arena holds at least `len` random elements.
    pub run: fn(&mut dyn Backend),
}

/// The scratch a kernel backend needs to run every case ([`Case::len`] elements of arena
/// aside): the largest of each case's needs.
pub fn capacity() -> Capacity {
    let (b, t, h, kvh, d) = ATTN;
    Capacity {
        tokens: N.max(b * t),
        vocab: VOCAB,
        width: 2 * W,
        attn_width: (WIDE_HEADS.0 * WIDE_HEADS.1).max(h * d),
        kv_width: (WIDE_HEADS.2 * WIDE_HEADS.1).max(kvh * d),
        heads: HEADS.0.max(WIDE_HEADS.0).max(h),
        attention_calls: 2,
        // The cases' sums are of 3 partials (130 rows): groups of one take them through both levels.
        colsum_group: 1,
        // The embedding case's ids repeat a few times each: pieces of 2 take them through both levels.
        embed_piece: 2,
    }
}

/// The largest arena a case uses.
pub fn arena_len() -> usize {
    cases().iter().map(|c| c.len).max().unwrap_or(0)
}

/// Token ids of the embedding and loss cases: even rows only (half the vocabulary unused,
/// others repeated), targets anywhere.
fn tokens(seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let x = (0..N).map(|_| rng.u32(0..VOCAB as u32 / 2) * 2).collect();
    let y = (0..N).map(|_| rng.u32(0..VOCAB as u32)).collect();
    (x, y)
}

/// `rows x cols` from the bump allocator.
fn mat(r: &mut Bump, rows: usize, cols: usize) -> Mat {
    r.take(rows * cols).mat(rows, cols)
}

/// The qkv row of the head cases and its q and v views.
fn qkv_views(r: &mut Bump) -> (Mat, Mat, Mat) {
    qkv_views_of(r, HEADS)
}

/// [`qkv_views`] for heads `(heads, d, kv_heads)`.
fn qkv_views_of(r: &mut Bump, (heads, d, kvh): (usize, usize, usize)) -> (Mat, Mat, Mat) {
    let w = heads * d + 2 * kvh * d;
    let qkv = mat(r, N, w);
    (qkv, qkv.cols(0, heads * d), qkv.cols(heads * d + kvh * d, kvh * d))
}

/// The head ops' shape for heads `(heads, d, _)` with `rot` dims rotated, positions mod 10.
fn head_shape((heads, d, _): (usize, usize, usize), rot: usize) -> HeadShape {
    HeadShape { rows: N, heads, d, rot, t: 10 }
}

fn adam_step(wd: f64) -> AdamStep {
    AdamStep { lr: 0.01, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: wd, bias1: 0.19, bias2_sqrt: 0.3 }
}

/// Every op check, in the order `pipeline engine-check` prints them.
pub fn cases() -> Vec<Case> {
    let nw = N * W;
    let (heads, d, kvh) = HEADS;
    let head_len = 12 * N * (heads * d + 2 * kvh * d);
    let wide_len = 4 * N * (WIDE_HEADS.0 * WIDE_HEADS.1 + 2 * WIDE_HEADS.2 * WIDE_HEADS.1) + 4 * 10 * WIDE_HEADS.1;
    let (ab, at, ah, akv, ad) = ATTN;
    let attn_len = 6 * ab * at * (ah + 2 * akv) * ad;
    vec![
        Case { name: "fill", len: 300, bound: FLAT, run: |be| be.op(op::Fill { dst: Buf { off: 10, len: 100 }, value: 0.25 }) },
        Case { name: "scale", len: 300, bound: FLAT, run: |be| be.op(op::Scale { dst: Buf { off: 10, len: 100 }, a: -3.0 }) },
        Case {
            name: "copy",
            len: 300,
            bound: FLAT,
            run: |be| be.op(op::CopyBuf { dst: Buf { off: 150, len: 100 }, src: Buf { off: 10, len: 100 } }),
        },
        Case {
            name: "sum, sum_sq (host reads)",
            len: 300,
            bound: FLAT,
            run: |be| {
                let b = Buf { off: 0, len: 250 };
                // The values land in the arena, so the comparison covers them.
                let (s, q) = (be.sum(b), be.sum_sq(b));
                be.op(op::Fill { dst: Buf { off: 260, len: 1 }, value: s / 10.0 });
                be.op(op::Fill { dst: Buf { off: 261, len: 1 }, value: q / 100.0 });
            },
        },
        Case {
            name: "all_finite",
            len: 300,
            bound: FLAT,
            run: |be| {
                // Its answers land in the arena (1 finite, 0 not) for the comparison.
                let b = Buf { off: 0, len: 250 };
                let finite = be.all_finite(b);
                be.op(op::Fill { dst: Buf { off: 260, len: 1 }, value: if finite { 1.0 } else { 0.0 } });
                be.op(op::Fill { dst: b.sub(5, 1), value: f64::NAN });
                let finite = be.all_finite(b);
                be.op(op::Fill { dst: Buf { off: 261, len: 1 }, value: if finite { 1.0 } else { 0.0 } });
                be.op(op::Fill { dst: b.sub(5, 1), value: 0.5 });
            },
        },
        Case {
            name: "axpby",
            len: 300,
            bound: FLAT,
            run: |be| be.op(op::Axpby { a: 0.5, x: Buf { off: 0, len: 100 }, b: -2.0, y: Buf { off: 100, len: 100 } }),
        },
        Case {
            name: "sum_into (device scalar)",
            len: 300,
            bound: FLAT,
            run: |be| {
                let total = Buf { off: 299, len: 1 };
                be.op(op::SumInto { src: Buf { off: 0, len: 100 }, dst: total });
                be.op(op::SumInto { src: Buf { off: 100, len: 150 }, dst: total });
            },
        },
        Case {
            name: "clip_norm (clips, then not)",
            len: 300,
            bound: FLAT,
            run: |be| {
                let (g, norm) = (Buf { off: 0, len: 200 }, Buf { off: 290, len: 2 });
                be.op(op::ClipNorm { g, max: 0.5, norm: norm.sub(0, 1) });
                be.op(op::ClipNorm { g, max: 1e3, norm: norm.sub(1, 1) });
            },
        },
        Case {
            name: "adam (decoupled decay)",
            len: 1200,
            bound: OPTIM,
            run: |be| {
                let mut r = Bump::default();
                let (p, g, m, v) = (r.take(300), r.take(300), r.take(300), r.take(300));
                be.op(op::Fill { dst: v, value: 0.5 }); // a second moment is never negative
                be.op(op::Adam { p, g, m, v, s: adam_step(0.04) });
            },
        },
        Case {
            name: "adam (no decay)",
            len: 1200,
            bound: OPTIM,
            run: |be| {
                let mut r = Bump::default();
                let (p, g, m, v) = (r.take(300), r.take(300), r.take(300), r.take(300));
                be.op(op::Fill { dst: v, value: 0.25 });
                be.op(op::Adam { p, g, m, v, s: adam_step(0.0) });
            },
        },
        Case {
            name: "momentum (Nesterov, then plain)",
            len: 900,
            bound: OPTIM,
            run: |be| {
                let (g, buf, u) = (Buf { off: 0, len: 300 }, Buf { off: 300, len: 300 }, Buf { off: 600, len: 300 });
                be.op(op::Momentum { g, buf, u, mu: 0.95, nesterov: true });
                be.op(op::Momentum { g, buf, u, mu: 0.85, nesterov: false });
            },
        },
        Case {
            name: "row_normalize",
            len: 300,
            bound: OPTIM,
            run: |be| be.op(op::RowNormalize { x: Buf { off: 0, len: 231 }, cols: 11, eps: 1e-7 }),
        },
        Case {
            name: "normalize_each",
            len: 300,
            bound: OPTIM,
            run: |be| be.op(op::NormalizeEach { x: Buf { off: 0, len: 231 }, count: 3, eps: 1e-7 }),
        },
        Case {
            name: "transpose_each",
            len: 500,
            bound: OPTIM,
            run: |be| {
                be.op(op::TransposeEach { src: Buf { off: 0, len: 231 }, dst: Buf { off: 250, len: 231 }, count: 3, rows: 7, cols: 11 })
            },
        },
        Case {
            name: "unit replayed (schedule scalars)",
            len: 1200,
            bound: OPTIM,
            run: |be| {
                // Three runs of one unit of work with new learning rates and momentum each
                // time: op by op, captured, replayed (a GPU backend); each must read its own.
                let mut r = Bump::default();
                let (p, g, m, v, buf, u) = (r.take(200), r.take(200), r.take(200), r.take(200), r.take(200), r.take(200));
                be.op(op::Fill { dst: v, value: 0.5 });
                for k in 0..3 {
                    let x = 1.0 + k as f64;
                    be.begin_unit("engine-check optimizer");
                    let s = AdamStep { lr: 0.01 * x, bias1: 0.1 * x, bias2_sqrt: 0.2 * x, ..adam_step(0.04) };
                    be.op(op::Adam { p, g, m, v, s });
                    be.op(op::Momentum { g, buf, u, mu: 0.8 + 0.05 * x, nesterov: true });
                    be.op(op::Axpby { a: -0.1 * x, x: u, b: 1.0 - 0.01 * x, y: p });
                    be.end_unit();
                }
            },
        },
        Case { name: "gemm a b", len: 4000, bound: GEMM, run: |be| gemm_case(be, false, false, 1.0, 0.0) },
        Case { name: "gemm a^T b^T (beta 1)", len: 4000, bound: GEMM, run: |be| gemm_case(be, true, true, 0.5, 1.0) },
        Case { name: "gemm a b^T (beta 1)", len: 4000, bound: GEMM, run: |be| gemm_case(be, false, true, 1.0, 1.0) },
        Case { name: "gemm a^T b (beta 0.5)", len: 4000, bound: GEMM, run: |be| gemm_case(be, true, false, -1.0, 0.5) },
        Case {
            name: "gemm_batched (LoRA: x A, then += h B into a column view)",
            len: 6000,
            bound: GEMM,
            run: |be| gemm_batched_case(be, false),
        },
        Case {
            name: "gemm_batched (LoRA backward: dB += h^T dy, dx += dh A^T)",
            len: 6000,
            bound: GEMM,
            run: |be| gemm_batched_case(be, true),
        },
        Case {
            name: "rms_norm_fwd",
            len: 4 * nw,
            bound: ROWS,
            run: |be| {
                be.op(op::RmsNormFwd {
                    x: Buf { off: 0, len: N * W },
                    out: Buf { off: N * W, len: N * W },
                    rstd: Buf { off: 2 * N * W, len: N },
                    cols: W,
                    scale: 0.7,
                    eps: 1e-6,
                })
            },
        },
        Case {
            name: "mix_norm_fwd (16-byte rows: the chunked path)",
            len: 7 * nw,
            bound: ROWS,
            run: |be| mix_norm_case(be, Bump::aligned(8)),
        },
        Case { name: "mix_norm_fwd (unaligned rows)", len: 7 * nw, bound: ROWS, run: |be| mix_norm_case(be, unaligned()) },
        Case {
            name: "norm_scale_bwd (16-byte rows: the chunked path)",
            len: 7 * nw,
            bound: ROWS,
            run: |be| norm_scale_case(be, Bump::aligned(8)),
        },
        Case { name: "norm_scale_bwd (unaligned rows)", len: 7 * nw, bound: ROWS, run: |be| norm_scale_case(be, unaligned()) },
        Case {
            name: "norm_mix_bwd (16-byte rows: the chunked path)",
            len: 10 * nw,
            bound: ROWS,
            run: |be| norm_mix_case(be, Bump::aligned(8)),
        },
        Case { name: "norm_mix_bwd (unaligned rows)", len: 10 * nw, bound: ROWS, run: |be| norm_mix_case(be, unaligned()) },
        Case { name: "rms_norm_bwd (write, then accumulate)", len: 5 * nw, bound: ROWS, run: |be| rms_bwd_case(be, Bump::default()) },
        Case {
            name: "rms_norm_bwd (16-byte rows: the chunked path)",
            len: 5 * nw,
            bound: ROWS,
            run: |be| rms_bwd_case(be, Bump::aligned(4)),
        },
        Case {
            // Rows starting off 16 bytes: the element path of the kernels that move aligned
            // rows in 16-byte chunks (the other cases' rows are aligned).
            name: "rms norm, residual mix, scaled add, activation (unaligned rows)",
            len: 12 * nw,
            bound: ROWS,
            run: |be| {
                let mut r = Bump::default();
                let _ = r.take(1);
                let (a, b, c, d, rstd) = (r.take(N * W), r.take(N * W), r.take(N * W), r.take(N * W), r.take(N));
                let (mix, s) = (r.take(2 * W), r.take(W));
                be.op(op::Fill { dst: rstd, value: 1.5 });
                be.op(op::RmsNormFwd { x: a, out: b, rstd, cols: W, scale: 0.7, eps: 1e-6 });
                be.op(op::RmsNormBwd { x: a, rstd, dy: b, dx: c, cols: W, scale: 0.7, accumulate: true });
                be.op(op::ResidMixFwd { h: a, x0: b, mix, out: d });
                be.op(op::ScaleAddFwd { base: a, x: b, s, out: c });
                be.op(op::ActFwd { pre: a, out: d, a: Activation { slope: 0.5 } });
                be.op(op::ActBwd { pre: a, dout: b, dpre: c, a: Activation { slope: 0.5 } });
                let (du, dh) = (r.take(N * W), r.take(N * W));
                be.op(op::ResidMixBwd { du, h: a, x0: b, mix, dh, dx0: d, dmix: r.take(2 * W) });
            },
        },
        Case {
            name: "resid_mix_fwd",
            len: 4 * nw,
            bound: ROWS,
            run: |be| {
                let mut r = Bump::default();
                let (h, x0, mix, out) = (r.take(N * W), r.take(N * W), r.take(2 * W), r.take(N * W));
                be.op(op::ResidMixFwd { h, x0, mix, out });
            },
        },
        Case {
            name: "resid_mix_bwd",
            len: 8 * nw,
            bound: ROWS,
            run: |be| {
                let mut r = Bump::default();
                let (du, h, x0, mix) = (r.take(N * W), r.take(N * W), r.take(N * W), r.take(2 * W));
                let (dh, dx0, dmix) = (r.take(N * W), r.take(N * W), r.take(2 * W));
                be.op(op::ResidMixBwd { du, h, x0, mix, dh, dx0, dmix });
            },
        },
        Case {
            name: "scale_add_fwd (then in place)",
            len: 4 * nw,
            bound: ROWS,
            run: |be| {
                let mut r = Bump::default();
                let (base, x, s, out) = (r.take(N * W), r.take(N * W), r.take(W), r.take(N * W));
                be.op(op::ScaleAddFwd { base, x, s, out });
                be.op(op::ScaleAddFwd { base: out, x, s, out });
            },
        },
        Case {
            name: "scale_add_bwd",
            len: 4 * nw,
            bound: ROWS,
            run: |be| {
                let mut r = Bump::default();
                let (dy, x, s, dx, ds) = (r.take(N * W), r.take(N * W), r.take(W), r.take(N * W), r.take(W));
                be.op(op::ScaleAddBwd { dy, x, s, dx, ds });
            },
        },
        Case { name: "skip_fwd", len: 4 * nw, bound: ROWS, run: |be| skip_case(be, false, Bump::aligned(8)) },
        Case { name: "skip_fwd (gated)", len: 4 * nw, bound: ROWS, run: |be| skip_case(be, true, Bump::aligned(8)) },
        Case { name: "skip_fwd (gated, unaligned rows)", len: 4 * nw, bound: ROWS, run: |be| skip_case(be, true, unaligned()) },
        Case { name: "skip_bwd", len: 7 * nw, bound: ROWS, run: |be| skip_bwd_case(be, false, Bump::aligned(8)) },
        Case { name: "skip_bwd (gated)", len: 7 * nw, bound: ROWS, run: |be| skip_bwd_case(be, true, Bump::aligned(8)) },
        Case { name: "skip_bwd (gated, unaligned rows)", len: 7 * nw, bound: ROWS, run: |be| skip_bwd_case(be, true, unaligned()) },
        Case {
            name: "act_fwd (leaky relu^2, then relu^2)",
            len: 3 * nw,
            bound: ROWS,
            run: |be| {
                let (pre, out) = (Buf { off: 0, len: N * W }, Buf { off: N * W, len: N * W });
                be.op(op::ActFwd { pre, out, a: Activation { slope: 0.5 } });
                be.op(op::ActFwd { pre, out: Buf { off: 2 * N * W, len: N * W }, a: Activation { slope: 0.0 } });
            },
        },
        Case {
            name: "act_bwd",
            len: 3 * nw,
            bound: ROWS,
            run: |be| {
                be.op(op::ActBwd {
                    pre: Buf { off: 0, len: N * W },
                    dout: Buf { off: N * W, len: N * W },
                    dpre: Buf { off: 2 * N * W, len: N * W },
                    a: Activation { slope: 0.5 },
                })
            },
        },
        Case {
            name: "embedding_fwd",
            len: 2 * nw + VOCAB * W,
            bound: ROWS,
            run: |be| {
                let (x, y) = tokens(5);
                be.set_tokens(&x, &y);
                be.op(op::EmbeddingFwd {
                    table: Buf { off: 0, len: VOCAB * W },
                    out: Buf { off: VOCAB * W, len: N * W },
                    dim: W,
                    ids: op::Ids::Tokens,
                });
            },
        },
        Case {
            name: "embedding_fwd (BigramHash buckets)",
            len: 2 * nw + VOCAB * W,
            bound: ROWS,
            run: |be| {
                let (x, y) = tokens(7);
                be.set_tokens(&x, &y);
                let (table, out) = (Buf { off: 0, len: BUCKETS * W }, Buf { off: VOCAB * W, len: N * W });
                be.op(op::EmbeddingFwd { table, out, dim: W, ids: op::Ids::Bigram { buckets: BUCKETS, t: BIGRAM_T } });
            },
        },
        Case {
            name: "embedding_bwd (the ids' CSR)",
            len: 2 * nw + VOCAB * W,
            bound: ROWS,
            run: |be| {
                let (x, y) = tokens(6);
                be.set_tokens(&x, &y);
                be.op(op::EmbeddingBwd {
                    dout: Buf { off: 0, len: N * W },
                    dtable: Buf { off: N * W, len: VOCAB * W },
                    dim: W,
                    ids: op::Ids::Tokens,
                });
            },
        },
        Case {
            name: "embedding_bwd (BigramHash buckets' CSR, then the ids' again)",
            len: 2 * nw + (VOCAB + BUCKETS) * W,
            bound: ROWS,
            run: |be| {
                let (x, y) = tokens(8);
                be.set_tokens(&x, &y);
                let (dout, dbig, dtab) =
                    (Buf { off: 0, len: N * W }, Buf { off: N * W, len: BUCKETS * W }, Buf { off: N * W + BUCKETS * W, len: VOCAB * W });
                be.op(op::EmbeddingBwd { dout, dtable: dbig, dim: W, ids: op::Ids::Bigram { buckets: BUCKETS, t: BIGRAM_T } });
                // The tokens' gradient after it reads the tokens' CSR, not the buckets'.
                be.op(op::EmbeddingBwd { dout, dtable: dtab, dim: W, ids: op::Ids::Tokens });
            },
        },
        Case { name: "qk_norm_rope_fwd (gain)", len: head_len, bound: ROWS, run: |be| qk_fwd_case(be, HEADS, 6, true) },
        Case { name: "qk_norm_rope_fwd", len: head_len, bound: ROWS, run: |be| qk_fwd_case(be, HEADS, 6, false) },
        Case {
            name: "qk_norm_rope_fwd (64 wide, 16 rotated, gain)",
            len: wide_len,
            bound: ROWS,
            run: |be| qk_fwd_case(be, WIDE_HEADS, 16, true),
        },
        Case {
            name: "qk_norm_rope_fwd (64 wide, all rotated)",
            len: wide_len,
            bound: ROWS,
            run: |be| qk_fwd_case(be, WIDE_HEADS, 64, false),
        },
        Case { name: "qk_norm_rope_bwd (gain)", len: head_len, bound: ROWS, run: |be| qk_bwd_case(be, HEADS, 6, true) },
        Case { name: "qk_norm_rope_bwd", len: head_len, bound: ROWS, run: |be| qk_bwd_case(be, HEADS, 6, false) },
        Case {
            name: "qk_norm_rope_bwd (64 wide, 16 rotated, gain)",
            len: wide_len,
            bound: ROWS,
            run: |be| qk_bwd_case(be, WIDE_HEADS, 16, true),
        },
        Case {
            name: "qk_norm_rope_bwd (64 wide, all rotated)",
            len: wide_len,
            bound: ROWS,
            run: |be| qk_bwd_case(be, WIDE_HEADS, 64, false),
        },
        Case {
            name: "xsa_fwd",
            len: head_len,
            bound: ROWS,
            run: |be| {
                let mut r = Bump::default();
                let (_, _, v) = qkv_views(&mut r);
                let a = AttnShape { batch: 13, t: 10, heads: HEADS.0, kv_heads: HEADS.2, d: HEADS.1, docs: None };
                let y = r.take(N * HEADS.0 * HEADS.1);
                be.op(op::XsaFwd { y, v, out: r.take(N * HEADS.0 * HEADS.1), s: a });
            },
        },
        Case {
            name: "xsa_bwd",
            len: head_len,
            bound: ROWS,
            run: |be| {
                let mut r = Bump::default();
                let (_, _, v) = qkv_views(&mut r);
                let a = AttnShape { batch: 13, t: 10, heads: HEADS.0, kv_heads: HEADS.2, d: HEADS.1, docs: None };
                let width = HEADS.0 * HEADS.1;
                let (dout, y, dy) = (r.take(N * width), r.take(N * width), r.take(N * width));
                let (_, _, dv) = qkv_views(&mut r);
                be.op(op::XsaBwd { dout, y, v, dy, dv, s: a });
            },
        },
        Case {
            name: "softcap_ce (loss and its gradient)",
            len: 3 * N * VOCAB,
            bound: ROWS,
            run: |be| {
                let (x, y) = tokens(9);
                be.set_tokens(&x, &y);
                softcap_case(be);
            },
        },
        Case {
            name: "softcap_ce (ignored targets: zero loss and gradient)",
            len: 3 * N * VOCAB,
            bound: ROWS,
            run: |be| {
                let (x, mut y) = tokens(10);
                // The padding of a partial batch: every third row, and the last.
                for (_, y) in y.iter_mut().enumerate().filter(|(r, _)| r % 3 == 1 || *r == N - 1) {
                    *y = crate::model::ops::softcap_ce::IGNORED_TARGET;
                }
                be.set_tokens(&x, &y);
                softcap_case(be);
            },
        },
        Case { name: "attention_fwd, attention_bwd", len: attn_len, bound: ATTENTION, run: |be| attention_case(be, None) },
        Case {
            name: "attention_fwd, attention_bwd (documents)",
            len: attn_len,
            bound: ATTENTION,
            run: |be| {
                let rule = document_tokens(be, 0);
                attention_case(be, Some(rule));
            },
        },
        Case {
            name: "attention_fwd, attention_bwd (documents cut every 24)",
            len: attn_len,
            bound: ATTENTION,
            run: |be| {
                let rule = document_tokens(be, 24);
                attention_case(be, Some(rule));
            },
        },
        Case { name: "attention_fwd, attention_bwd (cudnn)", len: attn_len, bound: ATTENTION, run: |be| cudnn_case(be, None) },
        Case {
            name: "attention_fwd, attention_bwd (cudnn, documents)",
            len: attn_len,
            bound: ATTENTION,
            run: |be| {
                let rule = document_tokens(be, 0);
                cudnn_case(be, Some(rule));
            },
        },
        Case {
            name: "attention_fwd, attention_bwd (cudnn, documents cut every 24)",
            len: attn_len,
            bound: ATTENTION,
            run: |be| {
                let rule = document_tokens(be, 24);
                cudnn_case(be, Some(rule));
            },
        },
        Case { name: "smear_fwd", len: 3 * nw, bound: ROWS, run: |be| smear_case(be, false, 12, Bump::aligned(8)) },
        Case { name: "smear_fwd (unaligned rows)", len: 3 * nw, bound: ROWS, run: |be| smear_case(be, false, 12, unaligned()) },
        Case { name: "smear_bwd (window past a warp)", len: 5 * nw, bound: ROWS, run: |be| smear_case(be, true, 40, Bump::aligned(8)) },
        Case {
            name: "smear_bwd (window past a warp, unaligned rows)",
            len: 5 * nw,
            bound: ROWS,
            run: |be| smear_case(be, true, 40, unaligned()),
        },
        Case { name: "lanes_fwd (then one lane as both)", len: 7 * nw, bound: ROWS, run: |be| lanes_case(be, false, Bump::aligned(8)) },
        Case { name: "lanes_fwd (unaligned rows)", len: 7 * nw, bound: ROWS, run: |be| lanes_case(be, false, unaligned()) },
        Case { name: "lanes_bwd", len: 11 * nw, bound: ROWS, run: |be| lanes_case(be, true, Bump::aligned(8)) },
        Case { name: "lanes_bwd (unaligned rows)", len: 11 * nw, bound: ROWS, run: |be| lanes_case(be, true, unaligned()) },
        Case { name: "attn_gate_fwd", len: head_len, bound: ROWS, run: |be| attn_gate_case(be, false) },
        Case { name: "attn_gate_bwd", len: head_len, bound: ROWS, run: |be| attn_gate_case(be, true) },
    ]
}

fn gemm_case(be: &mut dyn Backend, ta: bool, tb: bool, alpha: f64, beta: f64) {
    let mut r = Bump::default();
    let (m, n, k) = (13, 9, 37);
    // a a column view of a wider matrix, or a stored transpose; b likewise.
    let a = if ta { mat(&mut r, k, m).t() } else { mat(&mut r, m, 50).cols(3, k) };
    let b = if tb { mat(&mut r, n, k).t() } else { mat(&mut r, k, n) };
    let c = mat(&mut r, m, n);
    be.op(op::Gemm { c, a, b, alpha, beta });
}

/// The LoRA adapters' products: 3 documents of 7 positions, adapters `8 -> 5` of rank 4, the
/// output a column view of a wider matrix (q inside the fused qkv product); backward, the
/// transposed operands of the gradients.
fn gemm_batched_case(be: &mut dyn Backend, backward: bool) {
    let mut r = Bump::default();
    let (docs, t, inp, out, rank) = (3, 7, 8, 5, 4);
    let x = mat(&mut r, docs * t, inp);
    let a = mat(&mut r, docs * inp, rank);
    let h = mat(&mut r, docs * t, rank);
    let b = mat(&mut r, docs * rank, out);
    let y = mat(&mut r, docs * t, out + 6);
    let (xr, ar, hr, br) = (x.rows(0, t), a.rows(0, inp), h.rows(0, t), b.rows(0, rank));
    let yr = y.cols(2, out).rows(0, t);
    let (sx, sa, sh, sb, sy) = (t * inp, inp * rank, t * rank, rank * out, t * (out + 6));
    if backward {
        // dB += s h^T dy; dh = s dy B^T; dA += x^T dh; dx += dh A^T.
        be.op(op::GemmBatched { c: br, a: hr.t(), b: yr, alpha: 0.5, beta: 1.0, count: docs, strides: [sb, sh, sy] });
        be.op(op::GemmBatched { c: hr, a: yr, b: br.t(), alpha: 0.5, beta: 0.0, count: docs, strides: [sh, sy, sb] });
        be.op(op::GemmBatched { c: ar, a: xr.t(), b: hr, alpha: 1.0, beta: 1.0, count: docs, strides: [sa, sx, sh] });
        be.op(op::GemmBatched { c: xr, a: hr, b: ar.t(), alpha: 1.0, beta: 1.0, count: docs, strides: [sx, sh, sa] });
    } else {
        be.op(op::GemmBatched { c: hr, a: xr, b: ar, alpha: 1.0, beta: 0.0, count: docs, strides: [sh, sx, sa] });
        be.op(op::GemmBatched { c: yr, a: hr, b: br, alpha: 2.0, beta: 1.0, count: docs, strides: [sy, sh, sb] });
    }
}

/// The regions of a head case: unaligned for the narrow heads (odd offsets), on 4 elements for
/// the 64-wide ones, as the engine's layout puts them (on 256 bytes), so that the GPU takes its
/// vectorized kernels for them.
fn head_bump(h: (usize, usize, usize)) -> Bump {
    if h == WIDE_HEADS { Bump::aligned(4) } else { Bump::default() }
}

/// q's norm + RoPE for heads `h` with `rot` dims rotated (the tables of 10 positions), with a
/// gain or not.
fn qk_fwd_case(be: &mut dyn Backend, h: (usize, usize, usize), rot: usize, gain: bool) {
    let mut r = head_bump(h);
    let (_, q, _) = qkv_views_of(&mut r, h);
    let (heads, d, _) = h;
    let (cos, sin, g) = (r.take(10 * rot / 2), r.take(10 * rot / 2), r.take(heads));
    let (out, rstd) = (r.take(N * heads * d), r.take(N * heads));
    be.op(op::QkNormRopeFwd { x: q, out, rstd, gain: gain.then_some(g), cos, sin, s: head_shape(h, rot), eps: 1e-6 });
}

/// Its backward pass, into a view of dqkv.
fn qk_bwd_case(be: &mut dyn Backend, h: (usize, usize, usize), rot: usize, gain: bool) {
    let mut r = head_bump(h);
    let (_, q, _) = qkv_views_of(&mut r, h);
    let (heads, d, _) = h;
    let (cos, sin, g, dg) = (r.take(10 * rot / 2), r.take(10 * rot / 2), r.take(heads), r.take(heads));
    let (rstd, dy) = (r.take(N * heads), r.take(N * heads * d));
    be.op(op::Fill { dst: rstd, value: 1.25 });
    let (_, dq, _) = qkv_views_of(&mut r, h);
    be.op(op::QkNormRopeBwd { x: q, rstd, dy, dx: dq, gain: gain.then_some((g, dg)), cos, sin, s: head_shape(h, rot) });
}

/// As the schedule calls it: q and k their own buffers (after the norm and RoPE), v a view of
/// the fused qkv product; dq, dk their own, dv a view of dqkv, added to (XSA wrote first).
fn attention_case(be: &mut dyn Backend, docs: Option<DocRule>) {
    let (batch, t, heads, kvh, d) = ATTN;
    let n = batch * t;
    let w = (heads + 2 * kvh) * d;
    let mut r = Bump::default();
    let (q, k) = (mat(&mut r, n, heads * d), mat(&mut r, n, kvh * d));
    let v = mat(&mut r, n, w).cols((heads + kvh) * d, kvh * d);
    let s = AttnShape { batch, t, heads, kv_heads: kvh, d, docs };
    let out = r.take(n * heads * d);
    be.op(op::AttentionFwd { q, k, v, out, s });
    let dout = r.take(n * heads * d);
    let (dq, dk) = (mat(&mut r, n, heads * d), mat(&mut r, n, kvh * d));
    let dv = mat(&mut r, n, w).cols((heads + kvh) * d, kvh * d);
    be.op(op::AttentionBwd { q, k, v, out, dout, dq, dk, dv, dv_acc: true, s });
}

/// Loads token ids cut into documents (BOS at a sequence's start, mid-sequence, twice in a row,
/// at a sequence's last position; one flash tile each: tests/warp_emu/flash_mma_check.cpp takes
/// documents across tiles); their rule, documents cut every `max_len` (0: whole; 24 cuts
/// inside a tile and at a tile's edge).
fn document_tokens(be: &mut dyn Backend, max_len: u32) -> DocRule {
    let (mut x, y) = tokens(10);
    let bos = 1;
    for p in [0, 17, 64 + 40, 64 + 41, 64 + 63] {
        x[p] = bos;
    }
    be.set_tokens(&x, &y);
    DocRule { bos, max_len }
}

/// The loss case's op on the tokens set: logits scaled to a wide range, then the soft-capped
/// cross-entropy with its gradient.
fn softcap_case(be: &mut dyn Backend) {
    let logits = Buf { off: 0, len: N * VOCAB };
    be.op(op::Scale { dst: logits, a: 20.0 });
    let losses = Buf { off: N * VOCAB, len: N };
    be.op(op::SoftcapCe { logits, losses, vocab: VOCAB, cap: 15.0, grad_scale: 1.0 / N as f64 });
}

/// [`attention_case`] on cuDNN where the backend has it (the GPU backend; where cuDNN refuses,
/// it falls back to flash_mma and says so); the reference computes it as always.
fn cudnn_case(be: &mut dyn Backend, docs: Option<DocRule>) {
    let on = be.set_cudnn(true).is_ok();
    attention_case(be, docs);
    if on {
        be.set_cudnn(false).expect("turning cuDNN off");
    }
}

/// The outcome of one case on one backend.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CaseResult {
    /// The case's name.
    pub name: &'static str,
    /// The largest `|device - f64| / max(1, |f64|)` over the arena (infinite for a NaN where
    /// the reference has none).
    pub err: f64,
    /// The arena element where it is.
    pub at: usize,
    /// The device's value there, and the reference's.
    pub got: f64,
    /// See `got`.
    pub want: f64,
    /// The case's bound.
    pub bound: f64,
}

impl CaseResult {
    /// Whether the error is within the bound.
    pub fn ok(&self) -> bool {
        self.err <= self.bound
    }
}

/// Runs `case` on `dut` (whose arena holds at least `case.len` elements; only those are set
/// and compared) and on the f64 CPU backend, from the same arena of multiples of 1/64 drawn
/// from `seed`, and compares the arenas.
pub fn run(case: &Case, dut: &mut dyn Backend, seed: u64) -> anyhow::Result<CaseResult> {
    anyhow::ensure!(dut.len() >= case.len, "case `{}` needs {} elements, the backend has {}", case.name, case.len, dut.len());
    let mut rng = fastrand::Rng::with_seed(seed ^ (case.name.len() as u64 * 7919));
    let init: Vec<f32> = (0..case.len).map(|_| rng.i32(-64..=64) as f32 / 64.0).collect();
    let init = Tensor::from_vec(init, case.len, &Device::Cpu)?;
    let all = Buf { off: 0, len: case.len };
    let mut reference = CpuBackend::<f64>::new(case.len);
    dut.upload(all, &init)?;
    reference.upload(all, &init)?;
    (case.run)(dut);
    (case.run)(&mut reference);
    let got: Vec<f64> = dut.download(all, &[case.len])?.to_dtype(candle_core::DType::F64)?.to_vec1()?;
    let want: Vec<f64> = reference.download(all, &[case.len])?.to_vec1()?;
    let mut worst = CaseResult { name: case.name, err: 0.0, at: 0, got: 0.0, want: 0.0, bound: case.bound };
    for (k, (&g, &w)) in got.iter().zip(&want).enumerate() {
        let err = if g.is_nan() && w.is_nan() { 0.0 } else { (g - w).abs() / w.abs().max(1.0) };
        let err = if err.is_nan() { f64::INFINITY } else { err };
        if err > worst.err {
            worst = CaseResult { err, at: k, got: g, want: w, ..worst };
        }
    }
    Ok(worst)
}
