//! The op cases of the row kernels' families ([`super::cases`]'s table): the RMS norm and the
//! passes fused with it, the skips, SmearGate, the two-lane mix and the attention gate, each on
//! regions that put the GPU on its 16-byte chunked path or off it.

use super::{HEADS, N, W, mat, tokens};
use crate::engine::backend::{Backend, BackendExt, LaneBufs};
use crate::engine::layout::Bump;
use crate::engine::op;

/// Regions from one element past the arena's start: rows off 16 bytes (the element path of
/// the kernels that move aligned rows in 16-byte chunks). [`Bump::aligned`]`(8)` gives rows on
/// 16 bytes in either storage (the chunked path).
pub(super) fn unaligned() -> Bump {
    let mut r = Bump::default();
    let _ = r.take(1);
    r
}

/// A residual mix and its norm, then a scaled add of them and its norm, each in one pass, on
/// buffers from `r` (unaligned, or on 16-byte rows in either storage: the kernel's chunked
/// path, which norms the sum from registers).
pub(super) fn mix_norm_case(be: &mut dyn Backend, mut r: Bump) {
    let (h, x0, u, out, rstd) = (r.take(N * W), r.take(N * W), r.take(N * W), r.take(N * W), r.take(N));
    let (mix, s) = (r.take(2 * W), r.take(W));
    be.op(op::MixNormFwd { h, x0, mix, kind: op::MixKind::Resid, u, out, rstd, scale: 0.7, eps: 1e-6 });
    let (u2, out2, rstd2) = (r.take(N * W), r.take(N * W), r.take(N));
    be.op(op::MixNormFwd { h: u, x0: out, mix: s, kind: op::MixKind::Scale, u: u2, out: out2, rstd: rstd2, scale: 1.0, eps: 1e-6 });
}

/// The second norm's gradient into the stream's, then through the scaled add, in one pass
/// (three blocks of rows, the last short), on buffers from `r`.
pub(super) fn norm_scale_case(be: &mut dyn Backend, mut r: Bump) {
    let (x, rstd, dn, g, a) = (r.take(N * W), r.take(N), r.take(N * W), r.take(N * W), r.take(N * W));
    let (s, dx, ds) = (r.take(W), r.take(N * W), r.take(W));
    be.op(op::Fill { dst: rstd, value: 1.5 });
    be.op(op::NormScaleBwd { x, rstd, dn, g, scale: 0.7, a, s, dx, ds });
}

/// The first norm's gradient into `u`'s (written, then accumulated), then through the residual
/// mix, in one pass (three blocks of rows, the last short), on buffers from `r`.
pub(super) fn norm_mix_case(be: &mut dyn Backend, mut r: Bump) {
    let (x, rstd, dn, du, h, x0) = (r.take(N * W), r.take(N), r.take(N * W), r.take(N * W), r.take(N * W), r.take(N * W));
    let (mix, dh, dx0, dmix) = (r.take(2 * W), r.take(N * W), r.take(N * W), r.take(2 * W));
    be.op(op::Fill { dst: rstd, value: 1.5 });
    for accumulate in [false, true] {
        be.op(op::NormMixBwd { x, rstd, dn, du, scale: 0.7, accumulate, h, x0, mix, dh, dx0, dmix });
    }
}

/// The RMS norm's gradient written, then accumulated, on buffers from `r` (unaligned, or on
/// 16-byte rows: the kernels' chunked path).
pub(super) fn rms_bwd_case(be: &mut dyn Backend, mut r: Bump) {
    let (x, rstd, dy, dx) = (r.take(N * W), r.take(N), r.take(N * W), r.take(N * W));
    be.op(op::Fill { dst: rstd, value: 1.5 });
    be.op(op::RmsNormBwd { x, rstd, dy, dx, cols: W, scale: 0.7, accumulate: false });
    be.op(op::RmsNormBwd { x, rstd, dy, dx, cols: W, scale: 1.3, accumulate: true });
}

/// SmearGate over `N` rows of `W` in sequences of 10 with a window of `win`, forward or
/// backward, on regions from `r`; the BOS (4) mid-sequence and at a sequence's start.
pub(super) fn smear_case(be: &mut dyn Backend, backward: bool, win: usize, mut r: Bump) {
    let (mut x, y) = tokens(11);
    for p in [25, 30, 31] {
        x[p] = 4;
    }
    be.set_tokens(&x, &y);
    let (e, w, lambda) = (r.take(N * W), r.take(win), r.take(1));
    if backward {
        let (dout, de, dw, dl) = (r.take(N * W), r.take(N * W), r.take(win), r.take(1));
        be.op(op::SmearBwd { dout, e, w, lambda, de, dw, dlambda: dl, cols: W, t: 10, bos: 4 });
    } else {
        be.op(op::SmearFwd { e, w, lambda, out: r.take(N * W), cols: W, t: 10, bos: 4 });
    }
}

/// The two-lane mix on `N` rows of `W`, forward (twice: distinct lanes, then the lanes' first
/// block, both lanes one buffer) or backward.
pub(super) fn lanes_case(be: &mut dyn Backend, backward: bool, mut r: Bump) {
    let (l0, l1, ao, mo) = (r.take(N * W), r.take(N * W), r.take(N * W), r.take(N * W));
    let w = LaneBufs { sa: r.take(W), sm: r.take(W), r: r.take(2), p: r.take(4) };
    if backward {
        let (g0, g1) = (r.take(N * W), r.take(N * W));
        let (dl, dao, dmo) = ([r.take(N * W), r.take(N * W)], r.take(N * W), r.take(N * W));
        let dw = LaneBufs { sa: r.take(W), sm: r.take(W), r: r.take(2), p: r.take(4) };
        be.op(op::LanesBwd { g: [g0, g1], l: [l0, l1], ao, mo, w, dl, dao, dmo, dw });
    } else {
        let out = [r.take(N * W), r.take(N * W)];
        be.op(op::LanesFwd { l: [l0, l1], ao, mo, w, out });
        be.op(op::LanesFwd { l: [l0, l0], ao, mo, w, out });
    }
}

/// The sparse attention gate on `N` rows of the head cases' heads, its input a 12-column view
/// of a `W`-wide matrix, forward or backward.
pub(super) fn attn_gate_case(be: &mut dyn Backend, backward: bool) {
    let (heads, d, _) = HEADS;
    let mut r = Bump::default();
    let x = mat(&mut r, N, W).cols(0, 12);
    let (y, w) = (r.take(N * heads * d), r.take(heads * 12));
    if backward {
        let (dout, dy, dz) = (r.take(N * heads * d), r.take(N * heads * d), r.take(N * heads));
        be.op(op::AttnGateBwd { dout, y, x, w, dy, dz, heads, scale: 0.5 });
    } else {
        be.op(op::AttnGateFwd { y, x, w, out: r.take(N * heads * d), heads, scale: 0.5 });
    }
}

pub(super) fn skip_case(be: &mut dyn Backend, gated: bool, mut r: Bump) {
    let (h, s, w, z, out) = (r.take(N * W), r.take(N * W), r.take(W), r.take(W), r.take(N * W));
    be.op(op::SkipFwd { h, s, w, z: gated.then_some(z), out });
}

pub(super) fn skip_bwd_case(be: &mut dyn Backend, gated: bool, mut r: Bump) {
    let (dy, h, s, w, z, dz) = (r.take(N * W), r.take(N * W), r.take(N * W), r.take(W), r.take(W), r.take(W));
    let (dh, ds, dw) = (r.take(N * W), r.take(N * W), r.take(W));
    be.op(op::SkipBwd { dy, h, s, w, z: gated.then_some((z, dz)), dh, ds, dw });
}
