//! The engine's attention on cuDNN's fused flash attention (`attention = "cudnn"`): each
//! attention op becomes one [`Work::Sdpa`] call (a cuDNN graph's descriptor and where its
//! tensors are), which the CUDA device runs through cuDNN ([`crate::device::cudnn`]) and the
//! warp emulator through the CPU interpreter of the same maths.
//!
//! - **Operands in place.** cuDNN takes strided tensors, so q, k and v are read where they are,
//!   views of the fused qkv rows included, when they are bf16 activations on 16 bytes; else
//!   (an f32 arena) they are staged as flash attention stages them. The output and the
//!   gradients are written in place when they are contiguous bf16 activations, else through a
//!   staging slot (and added, for a `dv` that exclusive self-attention wrote first).
//! - **Statistics.** The forward pass writes each query's log-sum-exp (natural log, cuDNN's
//!   `Stats`) into the call's log-sum-exp buffer (packed per sequence; token-major for
//!   documents), which the backward pass reads.
//! - **Graphs before work.** The forward builds both its graph and its backward's (the
//!   backward's strides are known then: its outputs are contiguous), before any of its work is
//!   queued, so that a refusal (no libcudnn, or a shape cuDNN does not take) turns cuDNN off
//!   for the run in one line, with nothing half-queued, and attention runs on flash_mma. A
//!   backward runs on cuDNN exactly when its forward did (the statistics differ).
//! - **Documents** (attention within documents, `AttnShape::docs`): cuDNN's ragged layout,
//!   packed: row r's documents in slots `r t ..` in order, then its unused slots (length 0),
//!   each slot starting where the one before ends (`eng_doc_slots`: lengths and first
//!   positions), and per row stride the offsets `start * stride` (`eng_ragged_offsets`), all
//!   made on the device at the micro-batch's first call that needs them.
//! - **CUDA graphs.** A call only queues cuDNN's kernels on the engine's stream with a workspace
//!   allocated when its graph was built, so a unit that holds it is captured as any other.

use super::kernels as k;
use std::collections::HashSet;

use super::ops::{BLOCK, flat, i, l, warps};
use super::{Device, KernelBackend, RAGGED_UNITS, Space, Work};
use crate::device::cudnn::{SdpaDesc, SdpaPtrs, causal_descs, describe};
use crate::engine::backend::{AttnShape, Buf, Mat};
use crate::model::ops::DocRule;

/// An element of a memory space.
pub type Loc = (Space, usize);

/// Where each tensor of a cuDNN call is (the fields of [`SdpaPtrs`]; `None` where unused).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct SdpaAt {
    pub q: Option<Loc>,
    pub k: Option<Loc>,
    pub v: Option<Loc>,
    pub o: Option<Loc>,
    pub dout: Option<Loc>,
    pub dq: Option<Loc>,
    pub dk: Option<Loc>,
    pub dv: Option<Loc>,
    pub stats: Option<Loc>,
    pub seq_len: Option<Loc>,
    pub off_q: Option<Loc>,
    pub off_k: Option<Loc>,
    pub off_v: Option<Loc>,
    pub off_o: Option<Loc>,
    pub off_dq: Option<Loc>,
    pub off_dk: Option<Loc>,
    pub off_dv: Option<Loc>,
    pub off_stats: Option<Loc>,
}

/// One cuDNN attention call: its graph and its tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct SdpaCall {
    /// The graph (built by [`Device::sdpa_prepare`] before the call is queued).
    pub desc: SdpaDesc,
    /// Its tensors.
    pub at: SdpaAt,
}

impl SdpaCall {
    /// The call's addresses, `addr` giving each location's.
    pub fn ptrs(&self, addr: impl Fn(Space, usize) -> u64) -> SdpaPtrs {
        let a = |x: Option<Loc>| x.map_or(0, |(s, o)| addr(s, o));
        let t = &self.at;
        SdpaPtrs {
            q: a(t.q),
            k: a(t.k),
            v: a(t.v),
            o: a(t.o),
            dout: a(t.dout),
            dq: a(t.dq),
            dk: a(t.dk),
            dv: a(t.dv),
            stats: a(t.stats),
            seq_len: a(t.seq_len),
            off_q: a(t.off_q),
            off_k: a(t.off_k),
            off_v: a(t.off_v),
            off_o: a(t.off_o),
            off_dq: a(t.off_dq),
            off_dk: a(t.off_dk),
            off_dv: a(t.off_dv),
            off_stats: a(t.off_stats),
        }
    }
}

/// The backend's use of cuDNN.
#[derive(Debug, Default)]
pub(super) struct CudnnState {
    /// Attention runs on cuDNN (turned off by a refusal).
    pub on: bool,
    /// Why cuDNN was turned off.
    pub refused: Option<String>,
    /// Attention outputs (arena offsets) whose forward ran on cuDNN.
    outs: HashSet<usize>,
    /// For which `(BOS id, rows, length)` the document lengths of the micro-batch are on the device.
    pub lens_for: Option<(DocRule, usize, usize)>,
    /// The row stride of each array of ragged offsets written so far.
    units: Vec<usize>,
}

/// Where one operand of a call is, and its row stride: in place, or staged into a slot.
#[derive(Clone, Copy)]
struct Place {
    at: Loc,
    ld: usize,
    /// Staged from (copied into the slot before the call, or out of it after).
    staged: Option<Mat>,
}

impl<D: Device> KernelBackend<D> {
    /// What attention runs: `cudnn`, or `flash_mma` (with cuDNN's refusal, if it was asked).
    pub(super) fn attention_name(&self) -> String {
        match (&self.cudnn.refused, self.cudnn.on) {
            (_, true) => "cudnn".into(),
            (Some(why), false) => format!("flash_mma (cuDNN refused: {why})"),
            (None, false) => "flash_mma".into(),
        }
    }

    /// `m` in place when cuDNN can read or write it there (bf16 activations, untransposed,
    /// 16-byte rows; `contiguous` for outputs), else slot `slot` of the half space.
    fn sdpa_place(&self, m: Mat, slot: usize, contiguous: bool) -> Place {
        if self.is_act(m.span()) && !m.t && m.ld.is_multiple_of(8) && (!contiguous || m.ld == m.cols) {
            let at = self.at(m.off);
            if at.1.is_multiple_of(8) {
                return Place { at, ld: m.ld, staged: None };
            }
        }
        Place { at: (Space::Half, slot), ld: m.cols, staged: Some(m) }
    }

    /// The forward's and the backward's descriptors of a call on `s` with q, k, v at `qkv`.
    fn sdpa_descs(&self, s: AttnShape, qkv: [&Place; 3]) -> (SdpaDesc, SdpaDesc) {
        causal_descs(s.batch, s.t, s.heads, s.kv_heads, s.d, s.docs.is_some(), [qkv[0].ld, qkv[1].ld, qkv[2].ld])
    }

    /// Turns cuDNN off for the run, saying why once.
    fn cudnn_refuse(&mut self, why: String) {
        eprintln!("warning: cuDNN attention is off for this run ({why}); attention runs on flash_mma");
        self.cudnn.on = false;
        self.cudnn.refused = Some(why);
    }

    /// Attention's forward on cuDNN; false (nothing queued) where it does not run there.
    pub(super) fn cudnn_fwd(&mut self, q: Mat, k: Mat, v: Mat, out: Buf, s: AttnShape) -> bool {
        // Whatever ran this output before, its backward follows this forward.
        self.cudnn.outs.remove(&out.off);
        if !self.cudnn.on {
            return false;
        }
        let h = self.half_slots(s);
        let n = s.batch * s.t;
        let [qp, kp, vp] = self.qkv_places(q, k, v, h);
        let op = self.sdpa_place(out.mat(n, s.heads * s.d), h[3], true);
        let (fwd, bwd) = self.sdpa_descs(s, [&qp, &kp, &vp]);
        if let Err(e) = self.dev.sdpa_prepare(&fwd).and_then(|_| self.dev.sdpa_prepare(&bwd)) {
            self.cudnn_refuse(format!("{e:#}"));
            return false;
        }
        self.stage_in(&[qp, kp, vp]);
        let stats = self.lse_loc(out);
        let mut at = SdpaAt { q: Some(qp.at), k: Some(kp.at), v: Some(vp.at), o: Some(op.at), stats: Some(stats), ..Default::default() };
        if let Some(rule) = s.docs {
            self.ragged(s, rule, [qp.ld, kp.ld, vp.ld], &mut at);
        }
        self.submit(Work::Sdpa(Box::new(SdpaCall { desc: fwd, at })));
        self.stage_out(&[(op, false)]);
        self.cudnn.outs.insert(out.off);
        true
    }

    /// Attention's backward on cuDNN, where its forward ran there; false (nothing queued) else.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cudnn_bwd(
        &mut self,
        q: Mat,
        k: Mat,
        v: Mat,
        out: Buf,
        dout: Buf,
        dq: Mat,
        dk: Mat,
        dv: Mat,
        dv_acc: bool,
        s: AttnShape,
    ) -> bool {
        if !self.cudnn.outs.contains(&out.off) {
            return false;
        }
        let h = self.half_slots(s);
        let n = s.batch * s.t;
        let [qp, kp, vp] = self.qkv_places(q, k, v, h);
        let op = self.sdpa_place(out.mat(n, s.heads * s.d), h[7], true);
        let gp = self.sdpa_place(dout.mat(n, s.heads * s.d), h[3], true);
        let (dqp, dkp) = (self.sdpa_place(dq, h[4], true), self.sdpa_place(dk, h[5], true));
        let dvp = if dv_acc { Place { at: (Space::Half, h[6]), ld: dv.cols, staged: Some(dv) } } else { self.sdpa_place(dv, h[6], true) };
        let (_, bwd) = self.sdpa_descs(s, [&qp, &kp, &vp]);
        if let Err(e) = self.dev.sdpa_prepare(&bwd) {
            panic!("cuDNN refused the backward of an attention whose forward it ran ({}): {e:#}", describe(&bwd));
        }
        self.stage_in(&[qp, kp, vp, op, gp]);
        let stats = self.lse_loc(out);
        let mut at = SdpaAt {
            q: Some(qp.at),
            k: Some(kp.at),
            v: Some(vp.at),
            o: Some(op.at),
            dout: Some(gp.at),
            dq: Some(dqp.at),
            dk: Some(dkp.at),
            dv: Some(dvp.at),
            stats: Some(stats),
            ..Default::default()
        };
        if let Some(rule) = s.docs {
            self.ragged(s, rule, [qp.ld, kp.ld, vp.ld], &mut at);
            let kv = s.kv_heads * s.d;
            (at.off_dq, at.off_dk, at.off_dv) =
                (Some(self.offsets(s, s.heads * s.d)), Some(self.offsets(s, kv)), Some(self.offsets(s, kv)));
        }
        self.submit(Work::Sdpa(Box::new(SdpaCall { desc: bwd, at })));
        self.stage_out(&[(dqp, false), (dkp, false), (dvp, dv_acc)]);
        true
    }

    /// Where q, k and v are read (slots 0, 1, 2 of `h` when staged).
    fn qkv_places(&self, q: Mat, k: Mat, v: Mat, h: [usize; 8]) -> [Place; 3] {
        [self.sdpa_place(q, h[0], false), self.sdpa_place(k, h[1], false), self.sdpa_place(v, h[2], false)]
    }

    /// Copies the staged operands among `places` into their slots.
    fn stage_in(&mut self, places: &[Place]) {
        for p in places {
            if let Some(m) = p.staged {
                self.half_in(m, p.at.1);
            }
        }
    }

    /// Copies the staged outputs among `places` out of their slots (added where `true`).
    fn stage_out(&mut self, places: &[(Place, bool)]) {
        for &(p, acc) in places {
            if let Some(m) = p.staged {
                self.half_out(p.at.1, m, acc);
            }
        }
    }

    /// A call over documents: the slots' lengths, and the offsets of q, k, v (rows `lds` apart),
    /// o (and do) and the statistics.
    fn ragged(&mut self, s: AttnShape, rule: DocRule, lds: [usize; 3], at: &mut SdpaAt) {
        at.seq_len = Some(self.doc_slots(s, rule));
        (at.off_q, at.off_k, at.off_v) = (Some(self.offsets(s, lds[0])), Some(self.offsets(s, lds[1])), Some(self.offsets(s, lds[2])));
        (at.off_o, at.off_stats) = (Some(self.offsets(s, s.heads * s.d)), Some(self.offsets(s, s.heads)));
    }

    /// The log-sum-exp buffer of the call writing `out`, as a location.
    fn lse_loc(&mut self, out: Buf) -> Loc {
        match self.lse(out) {
            super::Arg::Ptr(space, off) => (space, off),
            other => unreachable!("a log-sum-exp buffer is a pointer, not {other:?}"),
        }
    }

    /// The micro-batch's document slots (`eng_doc_slots`: each slot's length and first
    /// position), launched by the first call of the micro-batch that needs them; the slots'
    /// lengths.
    fn doc_slots(&mut self, s: AttnShape, rule: DocRule) -> Loc {
        let key = (rule, s.batch, s.t);
        let t = self.tokens;
        assert!(s.batch * s.t <= t.n, "attention within documents over {} x {} positions, {} ids", s.batch, s.t, t.n);
        let p = |off| super::Arg::Ptr(Space::Tokens, off);
        if self.cudnn.lens_for != Some(key) {
            let args = vec![
                p(t.x()),
                p(t.ragged()),
                p(t.slot_len()),
                p(t.slot_start()),
                l(s.batch),
                i(s.t),
                i(rule.bos as usize),
                i(rule.max_len as usize),
            ];
            self.launch(k::eng_doc_slots, warps(s.batch), BLOCK, args);
            self.cudnn.lens_for = Some(key);
            // The offsets follow the slots' starts: each is written again at its first use.
            self.cudnn.units.clear();
        }
        (Space::Tokens, t.slot_len())
    }

    /// The slots' lengths and first positions (`n + 1`, the end last) as `eng_doc_slots`
    /// made them from the loaded ids (tests).
    #[cfg(test)]
    pub(super) fn doc_slots_read(&mut self, s: AttnShape, rule: DocRule) -> (Vec<u32>, Vec<u32>) {
        let n = s.batch * s.t;
        self.cudnn.lens_for = None;
        self.doc_slots(s, rule);
        let at = self.offsets(s, 1);
        let read = |off, len| self.dev.read(Space::Tokens, off, len).expect("reading the slots");
        (read(self.tokens.slot_len(), n), read(at.1, n + 1))
    }

    /// The ragged offsets `start * unit` of the micro-batch's `n` slots (after
    /// [`Self::doc_slots`]; written at the first call of the micro-batch that asks for `unit`).
    fn offsets(&mut self, s: AttnShape, unit: usize) -> Loc {
        let t = self.tokens;
        let n = s.batch * s.t;
        let k = match self.cudnn.units.iter().position(|&u| u == unit) {
            Some(k) => k,
            None => {
                let k = self.cudnn.units.len();
                // At most 7 strides (q, k, v, o, dk/dv, the statistics); int32 offsets checked by
                // the descriptor.
                assert!(k < RAGGED_UNITS, "more than {RAGGED_UNITS} row strides in cuDNN's ragged attention");
                let args = vec![
                    super::Arg::Ptr(Space::Tokens, t.slot_start()),
                    super::Arg::Ptr(Space::Tokens, t.ragged_offsets(k)),
                    l(n),
                    l(unit),
                ];
                self.launch(k::eng_ragged_offsets, flat(n + 1), BLOCK, args);
                self.cudnn.units.push(unit);
                k
            }
        };
        (Space::Tokens, t.ragged_offsets(k))
    }
}
