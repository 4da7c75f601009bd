//! Where the GPU backend's buffers are: an arena offset resolved to a device space and an
//! offset in it (with bf16 activations the layout's `half` region lives in [`Space::Act`], the
//! rest of the arena closed up, and GEMM operands among the weights read their bf16 copy,
//! [`Space::Mirror`]), the `_act` forms of the flat kernels, and attention's bf16 staging
//! (operands that are not contiguous bf16 activations are copied to the `half` space and back).

use super::kernels as k;
use super::ops::{BLOCK, flag, flat, i, l};
use super::{Arg, Device, KernelBackend, Space};
use crate::engine::backend::{AttnShape, Buf, Mat};

impl<D: Device> KernelBackend<D> {
    /// Where arena element `off` lives: its space and its offset there (with bf16 activations
    /// the `half` region is [`Space::Act`] and the arena after it is closed up).
    pub(super) fn at(&self, off: usize) -> (Space, usize) {
        match self.half {
            Some(h) if off >= h.act.off && off < h.act.end() => (Space::Act, off - h.act.off),
            Some(h) if off >= h.act.end() => (Space::Arena, off - h.act.len),
            _ => (Space::Arena, off),
        }
    }

    /// Activations to a 16-byte chunk of the kernels' chunked paths (`AV` in kernels/engine.cu):
    /// 8 bf16 with bf16 activations, else 4 floats.
    pub(super) fn chunk_values(&self) -> usize {
        if self.half.is_some() { 8 } else { 4 }
    }

    /// Whether `b` holds bf16 activations.
    pub(super) fn is_act(&self, b: Buf) -> bool {
        self.half.is_some_and(|h| b.len > 0 && b.off >= h.act.off && b.end() <= h.act.end())
    }

    /// `b` as a kernel's pointer argument. Panics when `b` straddles an edge of the bf16
    /// activations (a kernel reads one storage type per argument).
    pub(super) fn a(&self, b: Buf) -> Arg {
        if let Some(h) = self.half {
            let inside = |x: usize| x > b.off && x < b.end();
            assert!(!inside(h.act.off) && !inside(h.act.end()), "{b:?} straddles the bf16 activations {:?}", h.act);
        }
        let (space, off) = self.at(b.off);
        Arg::Ptr(space, off)
    }

    /// Each of `bufs` as a kernel's pointer argument ([`Self::a`]), in order.
    pub(super) fn ptrs(&self, bufs: &[Buf]) -> Vec<Arg> {
        bufs.iter().map(|&b| self.a(b)).collect()
    }

    /// `b` cut at the edges of the bf16 activations (a fill or poison of a whole region).
    pub(super) fn pieces(&self, b: Buf) -> Vec<Buf> {
        let Some(h) = self.half else { return vec![b] };
        let mut cuts = vec![b.off];
        cuts.extend([h.act.off, h.act.end()].into_iter().filter(|&x| x > b.off && x < b.end()));
        cuts.push(b.end());
        cuts.windows(2).map(|w| Buf { off: w[0], len: w[1] - w[0] }).collect()
    }

    /// `kernel`, or its `_act` form when `b` holds bf16 activations.
    pub(super) fn flat_kernel(&self, kernel: &'static str, b: Buf) -> &'static str {
        if !self.is_act(b) {
            return kernel;
        }
        match kernel {
            k::eng_fill => k::eng_fill_act,
            k::eng_scale => k::eng_scale_act,
            k::eng_copy => k::eng_copy_act,
            k::eng_axpby => k::eng_axpby_act,
            k::eng_reduce_partial => k::eng_reduce_partial_act,
            other => panic!("`{other}` has no form for bf16 activations"),
        }
    }

    /// A GEMM operand: its view in its space, and the space (with bf16 activations, weights are
    /// read from their bf16 copy).
    pub(super) fn operand(&self, m: Mat) -> (Mat, Space) {
        if let Some(h) = self.half {
            let span = m.span();
            if span.len > 0 && span.off >= h.params.off && span.end() <= h.params.end() {
                return (Mat { off: m.off - h.params.off, ..m }, Space::Mirror);
            }
            self.a(span);
        }
        let (space, off) = self.at(m.off);
        (Mat { off, ..m }, space)
    }

    /// Half-space offsets of q, k, v, o (or dout), dq, dk, dv for `s`.
    pub(super) fn half_slots(&self, s: AttnShape) -> [usize; 8] {
        let n = s.batch * s.t;
        let round = |x: usize| x.div_ceil(8) * 8;
        let (q, kv) = (round(n * s.heads * s.d), round(n * s.kv_heads * s.d));
        // q, k, v, the output (or its gradient), dq, dk, dv, and for cuDNN's backward the output
        // beside its gradient.
        let slots = [0, q, q + kv, q + 2 * kv, 2 * q + 2 * kv, 3 * q + 2 * kv, 3 * q + 3 * kv, 3 * q + 4 * kv];
        assert!(slots[7] + q <= self.half_len, "attention of {s:?} needs more bf16 scratch than the backend has");
        slots
    }

    /// `half[slot] = m` as contiguous bf16.
    pub(super) fn half_in(&mut self, m: Mat, slot: usize) {
        assert!(!m.t, "attention's operands are read untransposed");
        let args = vec![self.a(m.span()), l(m.ld), Arg::Ptr(Space::Half, slot), l(m.rows), i(m.cols)];
        self.launch(k::eng_to_bf16, flat(m.rows * m.cols), BLOCK, args);
    }

    /// `m (+)= half[slot]`.
    pub(super) fn half_out(&mut self, slot: usize, m: Mat, acc: bool) {
        let args = vec![Arg::Ptr(Space::Half, slot), self.a(m.span()), l(m.ld), l(m.rows), i(m.cols), flag(acc)];
        self.launch(k::eng_from_bf16, flat(m.rows * m.cols), BLOCK, args);
    }

    /// An attention operand as flash attention reads it: the buffer itself when it is a
    /// contiguous bf16 activation, else its copy at `half[slot]`.
    pub(super) fn attn_in(&mut self, m: Mat, slot: usize) -> Arg {
        if self.is_act(m.span()) && m.ld == m.cols && !m.t {
            return self.a(m.span());
        }
        self.half_in(m, slot);
        Arg::Ptr(Space::Half, slot)
    }

    /// Where flash attention writes output `m` (`+=` when `acc`): `m` itself when it is a
    /// contiguous bf16 activation written over, else `half[slot]`, copied out by
    /// [`Self::attn_finish`].
    pub(super) fn attn_out(&self, m: Mat, slot: usize, acc: bool) -> (Arg, Option<(usize, Mat, bool)>) {
        if self.is_act(m.span()) && m.ld == m.cols && !m.t && !acc {
            return (self.a(m.span()), None);
        }
        (Arg::Ptr(Space::Half, slot), Some((slot, m, acc)))
    }

    /// The copies out that [`Self::attn_out`] left.
    pub(super) fn attn_finish(&mut self, outs: &[Option<(usize, Mat, bool)>]) {
        for &(slot, m, acc) in outs.iter().flatten() {
            self.half_out(slot, m, acc);
        }
    }
}
