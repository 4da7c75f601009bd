//! [`Kernels`] for [`KernelBackend`]: each op as the launches of `kernels/engine.cu` (the
//! kernel's maths is in its comment there, the device maths it shares with the model's fused
//! kernels in the headers of `kernels/ops/`, and, as the reference, in [`crate::engine::cpu`]),
//! attention as `kernels/flash_mma.cu`'s launches (on its bf16 operands in place, or staged,
//! `place.rs`) or cuDNN's (`sdpa.rs`), GEMMs as cuBLASLt plans. Grids: flat kernels [`flat`],
//! warp-per-row kernels [`warps`], per-channel partial sums a block per [`PART`] rows. The rest
//! of the backend (the arena, the tokens, units, marks) is `backend.rs`'s.

use super::kernels as k;

use super::{Arg, Device, KernelBackend, Launch, REDUCE_BLOCKS, Space, TokenLayout, Work};
use crate::engine::backend::{AttnShape, Buf, HeadShape, Mat, check_regions};
use crate::engine::lt;
use crate::engine::op::{self, Kernels};

/// Rows per partial sum of a per-channel reduction (`PART` in kernels/engine.cu).
pub(super) const PART: usize = 64;
/// The widest row `eng_norm_scale_bwd` takes (`NORM_SCALE_MAX` in kernels/engine/rows.cuh).
const NORM_SCALE_MAX: usize = 1024;
/// The widest row `eng_norm_mix_bwd` takes (`NORM_MIX_MAX` there).
const NORM_MIX_MAX: usize = 512;
/// Threads per block of the flat and row kernels.
pub(super) const BLOCK_THREADS: usize = 256;
/// [`BLOCK_THREADS`] as a launch takes it.
pub(super) const BLOCK: u32 = BLOCK_THREADS as u32;
/// Threads per block of the flash attention kernels.
const FLASH_THREADS: u32 = 128;
/// Flash attention's tile (queries per block, keys per inner step) and head width.
const FLASH_TILE: usize = 64;

/// A grid-stride launch over `n` elements.
pub(super) fn flat(n: usize) -> [u32; 3] {
    [n.div_ceil(BLOCK as usize).clamp(1, 8192) as u32, 1, 1]
}

/// A launch of one warp per item, 8 items per block.
pub(super) fn warps(items: usize) -> [u32; 3] {
    [items.div_ceil(8).max(1) as u32, 1, 1]
}

/// Whether the vectorized q/k norm + RoPE kernels (`eng_qk_norm_rope_*4`) take these heads with
/// `av` values to a 16-byte chunk (4 f32, 8 bf16): 64 wide, a rotated half that is a
/// power-of-two multiple of `av` (its pair partner is a shuffle away), and every matrix's rows on
/// 16 bytes (offsets and strides multiples of `av` elements: the arena's regions start on 256
/// bytes, the bf16 region on a multiple of 64 elements).
fn qk_vector(s: HeadShape, mats: &[Mat], av: usize) -> bool {
    let half = s.rot / 2;
    s.d == 64
        && half.is_multiple_of(av)
        && (half / av).is_power_of_two()
        && mats.iter().all(|m| m.off.is_multiple_of(av) && m.ld.is_multiple_of(av))
}

/// The vectorized q/k kernels' grid: `64 / av` lanes per (row, head).
fn qk_grid(s: HeadShape, av: usize) -> [u32; 3] {
    [(s.rows * s.heads * (64 / av)).div_ceil(BLOCK as usize).max(1) as u32, 1, 1]
}

/// A partial-sum launch over `rows x cols`: blocks of 256 channels by blocks of [`PART`] rows.
fn parts(rows: usize, cols: usize) -> [u32; 3] {
    [cols.div_ceil(BLOCK as usize).max(1) as u32, rows.div_ceil(PART).max(1) as u32, 1]
}

/// A `long` kernel argument.
pub(super) fn l(x: usize) -> Arg {
    Arg::I64(x as i64)
}
/// An `int` kernel argument.
pub(super) fn i(x: usize) -> Arg {
    Arg::I32(i32::try_from(x).expect("a kernel's int argument fits in 32 bits"))
}
fn f(x: f64) -> Arg {
    Arg::F32(x as f32)
}

/// A flag (an `int`, 0 or 1).
pub(super) fn flag(x: bool) -> Arg {
    Arg::I32(x as i32)
}

/// The `t, buckets` arguments of the kernels that read ids through `id_at`
/// (kernels/engine/embedding.cuh): buckets 0 for the tokens themselves.
pub(super) fn id_source(ids: op::Ids) -> (Arg, Arg) {
    match ids {
        op::Ids::Tokens => (i(1), i(0)),
        op::Ids::Bigram { buckets, t } => (i(t), i(buckets)),
    }
}

/// The rows of the CSR of `ids`: the capacity's vocabulary for the tokens (every table a
/// backend of this capacity may look up), the buckets for BigramHash's.
pub(super) fn csr_rows(t: TokenLayout, ids: op::Ids) -> usize {
    match ids {
        op::Ids::Tokens => t.vocab,
        op::Ids::Bigram { buckets, .. } => {
            assert!(buckets <= t.vocab, "BigramHash's {buckets} buckets over the capacity's {} rows", t.vocab);
            buckets
        }
    }
}

impl<D: Device> KernelBackend<D> {
    /// The QK norm + RoPE kernels' shared arguments: gain, its flag, the tables, the shape.
    fn head_args(&self, gain: Buf, has_gain: bool, cos: Buf, sin: Buf, s: HeadShape) -> [Arg; 9] {
        [self.a(gain), flag(has_gain), self.a(cos), self.a(sin), l(s.rows), i(s.heads), i(s.d), i(s.rot), i(s.t)]
    }

    pub(super) fn launch(&mut self, kernel: &'static str, grid: [u32; 3], block: u32, args: Vec<Arg>) {
        self.submit(Work::Launch(Launch { kernel, grid, block, args }));
    }

    pub(super) fn check<const I: usize, const O: usize>(&self, ins: [Buf; I], outs: [Buf; O]) {
        check_regions(self.len, &ins, &outs);
    }

    /// Per-op scratch in `aux`, `len` elements from `off` within it.
    fn scratch(&self, off: usize, len: usize) -> Arg {
        assert!(
            off + len <= self.aux.scratch_len,
            "the op needs {} elements of scratch, the backend has {}",
            off + len,
            self.aux.scratch_len
        );
        Arg::Ptr(Space::Aux, self.aux.scratch + off)
    }

    /// `dst[c] += sum over the partials` after a `*_partial` launch wrote `rows / PART` blocks of
    /// `stride` values from scratch offset 0.
    fn finish(&mut self, rows: usize, stride: usize, width: usize, dst: Buf) {
        self.colsum(0, rows.div_ceil(PART), stride, width, dst);
    }

    /// `dst[c] += sum over p of part[p stride + c]` for the `parts` partials from scratch offset
    /// `at`, in order. One pass when they are few; else two levels (groups of
    /// `colsum_group` partials added by `groups x width / 256` blocks, then the groups), so that
    /// a long sum is not read by the `width / 256` blocks of one pass alone.
    fn colsum(&mut self, at: usize, parts: usize, stride: usize, width: usize, dst: Buf) {
        let part = self.scratch(at, (parts - 1) * stride + width);
        let per = self.colsum_group;
        if parts <= 2 * per {
            self.launch(k::eng_colsum_finish, flat(width), BLOCK, vec![part, i(parts), i(stride), i(width), self.a(dst)]);
            return;
        }
        let groups = parts.div_ceil(per);
        assert!(
            groups * width <= self.aux.mid_len,
            "a per-channel sum of {groups} groups of {width} past the backend's {}",
            self.aux.mid_len
        );
        let mid = Arg::Ptr(Space::Aux, self.aux.mid);
        let grid = [width.div_ceil(BLOCK_THREADS) as u32, groups as u32, 1];
        self.launch(k::eng_colsum_groups, grid, BLOCK, vec![part, i(parts), i(stride), i(width), i(per), mid]);
        self.launch(k::eng_colsum_finish, flat(width), BLOCK, vec![mid, i(groups), i(width), i(width), self.a(dst)]);
    }

    /// The launches of the scalar reduction `mode` (0 sum, 1 sum of squares, 2 non-finite
    /// count) of `src` into `out[0]` (added to it when `acc`).
    fn reduction(&self, src: Buf, mode: i32, out: Arg, acc: bool) -> [Launch; 2] {
        let blocks = src.len.div_ceil(BLOCK as usize).clamp(1, REDUCE_BLOCKS);
        let part = Arg::Ptr(Space::Aux, self.aux.reduce);
        [
            Launch {
                kernel: self.flat_kernel(k::eng_reduce_partial, src),
                grid: [blocks as u32, 1, 1],
                block: BLOCK,
                args: vec![self.a(src), l(src.len), Arg::I32(mode), part],
            },
            Launch { kernel: k::eng_reduce_finish, grid: [1, 1, 1], block: 32, args: vec![part, i(blocks), out, flag(acc)] },
        ]
    }

    /// Where a reduction leaves a result the host or a later kernel reads.
    fn reduced(&self) -> usize {
        self.aux.reduce + REDUCE_BLOCKS
    }

    /// The scalar reduction `mode` of `src`, read by the host (outside units only).
    pub(super) fn reduce(&self, src: Buf, mode: i32) -> f64 {
        self.check([src], []);
        self.outside_unit("a reduction read by the host");
        for launch in self.reduction(src, mode, Arg::Ptr(Space::Aux, self.reduced()), false) {
            self.dev.launch(&launch);
        }
        let word = self.dev.read(Space::Aux, self.reduced(), 1).expect("reading a reduction's result from the device");
        f32::from_bits(word[0]) as f64
    }

    /// The log-sum-exp buffer of the attention call writing `out`.
    pub(super) fn lse(&mut self, out: Buf) -> Arg {
        let next = self.lse.len();
        let k = *self.lse.entry(out.off).or_insert(next);
        assert!(k < self.aux.lse_count, "more attention calls than the backend was sized for ({})", self.aux.lse_count);
        Arg::Ptr(Space::Aux, self.aux.lse + k * self.aux.lse_len)
    }

    /// Flash attention's scalars and grid checks: `(scale_log2, scale, query grid, kv grid)`.
    fn flash(s: AttnShape) -> (Arg, Arg, [u32; 3], [u32; 3]) {
        assert!(
            s.d == FLASH_TILE && s.t.is_multiple_of(FLASH_TILE),
            "the GPU attention needs head width 64 and a sequence a multiple of 64: {s:?}"
        );
        let scale = 1.0 / (s.d as f64).sqrt();
        let tiles = (s.t / FLASH_TILE) as u32;
        let q = [tiles, (s.batch * s.heads) as u32, 1];
        let kv = [tiles, (s.batch * s.kv_heads) as u32, 1];
        (f(scale * std::f64::consts::LOG2_E), f(scale), q, kv)
    }
}

impl<D: Device> KernelBackend<D> {
    /// Under `s.docs`, where each position's document start of the micro-batch's ids is (the
    /// `*_docs_bf16` flash kernels' last argument): `eng_doc_starts` is launched by the first
    /// call after the ids were loaded, the later calls of the micro-batch read its result.
    fn document_starts(&mut self, s: AttnShape) -> Option<Arg> {
        let key = (s.docs?, s.batch, s.t);
        let t = self.tokens;
        assert!(s.batch * s.t <= t.n, "attention within documents over {} x {} positions, {} ids", s.batch, s.t, t.n);
        let (ids, starts) = (Arg::Ptr(Space::Tokens, t.x()), Arg::Ptr(Space::Tokens, t.starts()));
        if self.starts_for != Some(key) {
            self.launch(
                k::eng_doc_starts,
                warps(s.batch),
                BLOCK,
                vec![ids, starts, l(s.batch), i(s.t), i(key.0.bos as usize), i(key.0.max_len as usize)],
            );
            self.starts_for = Some(key);
        }
        Some(starts)
    }

    /// Rows of SmearGate's `cols`-wide rows `e`, checked against the micro-batch's ids.
    fn smear_rows(&self, e: Buf, cols: usize, t: usize) -> usize {
        let rows = e.len / cols;
        assert!(
            rows * cols == e.len && rows <= self.tokens.n && rows.is_multiple_of(t),
            "SmearGate over {} elements of width {cols}, sequences of {t}, {} ids",
            e.len,
            self.tokens.n
        );
        rows
    }

    /// `(rows, head width, window)` of a gate call on `y` `(rows, heads d)` with `x` `(rows, W)`
    /// and `w` `(heads, W)`.
    fn gate_shape(y: Buf, x: Mat, w: Buf, heads: usize) -> (usize, usize, usize) {
        let (rows, win) = (x.rows, x.cols);
        assert!(!x.t && w.len == heads * win && y.len.is_multiple_of(rows * heads), "a gate of {heads} heads on {y:?} with {x:?}, {w:?}");
        (rows, y.len / (rows * heads), win)
    }
}

impl<D: Device> Kernels for KernelBackend<D> {
    fn fill(&mut self, op::Fill { dst, value }: op::Fill) {
        self.check([], [dst]);
        for b in self.pieces(dst) {
            self.launch(self.flat_kernel(k::eng_fill, b), flat(b.len), BLOCK, vec![self.a(b), l(b.len), f(value)]);
        }
    }
    fn copy(&mut self, op::CopyBuf { dst, src }: op::CopyBuf) {
        self.check([src], [dst]);
        assert_eq!(self.is_act(dst), self.is_act(src), "a copy between f32 and bf16 buffers ({src:?} to {dst:?})");
        self.launch(self.flat_kernel(k::eng_copy, dst), flat(dst.len), BLOCK, vec![self.a(dst), self.a(src), l(dst.len)]);
    }
    fn scale(&mut self, op::Scale { dst, a: x }: op::Scale) {
        self.check([], [dst]);
        self.launch(self.flat_kernel(k::eng_scale, dst), flat(dst.len), BLOCK, vec![self.a(dst), l(dst.len), f(x)]);
    }
    fn sum_into(&mut self, op::SumInto { src, dst }: op::SumInto) {
        self.check([src], [dst.sub(0, 1)]);
        for launch in self.reduction(src, 0, self.a(dst), true) {
            self.submit(Work::Launch(launch));
        }
    }
    fn clip_norm(&mut self, op::ClipNorm { g, max, norm }: op::ClipNorm) {
        self.check([g], [norm.sub(0, 1)]);
        let sum_sq = Arg::Ptr(Space::Aux, self.reduced());
        for launch in self.reduction(g, 1, sum_sq, false) {
            self.submit(Work::Launch(launch));
        }
        let max = self.sched(&[max]);
        self.launch(k::eng_clip, flat(g.len), BLOCK, vec![self.a(g), l(g.len), sum_sq, max, self.a(norm)]);
    }
    fn gemm(&mut self, op::Gemm { c, a: a_, b, alpha, beta }: op::Gemm) {
        self.check([a_.span(), b.span()], [c.span()]);
        let ((c, sc), (a_, sa), (b, sb)) = (self.operand(c), self.operand(a_), self.operand(b));
        assert!(sc != Space::Mirror, "a GEMM writes into the weights");
        assert_eq!(sa.is_bf16(), sb.is_bf16(), "a GEMM of a {sa:?} and a {sb:?} operand (one storage type for both)");
        // bf16 operands may write an f32 C (weight gradients); f32 ones never a bf16 C (no
        // cuBLASLt algorithm takes FAST_16BF into bf16).
        assert!(sa.is_bf16() || !sc.is_bf16(), "a GEMM of f32 operands into the bf16 {sc:?} space");
        // cuBLAS's A is our b, its B our a (lt::plan).
        self.submit(Work::Gemm(lt::plan(c, a_, b, alpha, beta), [sb, sa, sc]));
    }
    fn gemm_batched(&mut self, op::GemmBatched { c, a: a_, b, alpha, beta, count, strides }: op::GemmBatched) {
        let spans = [c.batch_span(count, strides[0]), a_.batch_span(count, strides[1]), b.batch_span(count, strides[2])];
        self.check([spans[1], spans[2]], [spans[0]]);
        // Each operand's space from the whole of its batch (a view's offset moves with it).
        let place = |m: Mat, span: Buf| {
            let (whole, space) = self.operand(Mat { off: span.off, rows: 1, cols: span.len, ld: span.len, t: false });
            (Mat { off: m.off - span.off + whole.off, ..m }, space)
        };
        let ((c, sc), (a_, sa), (b, sb)) = (place(c, spans[0]), place(a_, spans[1]), place(b, spans[2]));
        assert!(sc != Space::Mirror, "a GEMM writes into the weights");
        assert_eq!(sa.is_bf16(), sb.is_bf16(), "a GEMM of a {sa:?} and a {sb:?} operand (one storage type for both)");
        assert!(sa.is_bf16() || !sc.is_bf16(), "a GEMM of f32 operands into the bf16 {sc:?} space");
        let p = lt::plan_batched(c, a_, b, alpha, beta, count, strides[0], strides[1], strides[2]);
        self.submit(Work::Gemm(p, [sb, sa, sc]));
    }
    fn embedding_fwd(&mut self, op::EmbeddingFwd { table, out, dim, ids }: op::EmbeddingFwd) {
        self.check([table], [out]);
        let n = out.len / dim;
        let x = Arg::Ptr(Space::Tokens, self.tokens.x());
        let vocab = i(table.len / dim);
        let (t, buckets) = id_source(ids);
        let args = vec![self.a(table), x, self.a(out), l(n), i(dim), vocab, t, buckets];
        self.launch(k::eng_embedding_fwd, flat(out.len), BLOCK, args);
    }
    fn embedding_bwd(&mut self, op::EmbeddingBwd { dout, dtable, dim, ids }: op::EmbeddingBwd) {
        self.check([dout], [dtable]);
        // The tokens' CSR is in the tokens' space from `load_tokens` on; BigramHash's replaces it
        // for its own gradient, and the tokens' is built again after it.
        let bigram = ids != op::Ids::Tokens;
        if bigram {
            self.csr_build(ids).into_iter().for_each(|launch| self.submit(Work::Launch(launch)));
        }
        let t = self.tokens;
        let (rows, csr_rows) = (dtable.len / dim, csr_rows(t, ids));
        assert!(rows <= csr_rows, "the embedding's gradient has {rows} rows, the CSR {csr_rows}");
        let (off, pos, poff) =
            (Arg::Ptr(Space::Tokens, t.csr_off()), Arg::Ptr(Space::Tokens, t.csr_pos()), Arg::Ptr(Space::Tokens, t.pieces()));
        // Rows of more than `piece` tokens: their pieces first (a grid for the most there can be).
        let part = self.scratch(0, t.max_pieces() * dim);
        let pieces = t.max_pieces() as u32;
        let args = vec![self.a(dout), off, pos, poff, part, i(dim), i(csr_rows), i(t.piece)];
        self.launch(k::eng_embedding_pieces, [pieces, 1, 1], BLOCK, args);
        self.launch(k::eng_embedding_bwd, [rows as u32, 1, 1], BLOCK, vec![self.a(dout), off, pos, poff, part, self.a(dtable), i(dim)]);
        if bigram {
            self.csr_build(op::Ids::Tokens).into_iter().for_each(|launch| self.submit(Work::Launch(launch)));
        }
    }
    fn rms_norm_fwd(&mut self, op::RmsNormFwd { x, out, rstd, cols, scale, eps }: op::RmsNormFwd) {
        self.check([x], [out, rstd]);
        let rows = x.len / cols;
        self.launch(
            k::eng_rms_norm_fwd,
            warps(rows),
            BLOCK,
            vec![self.a(x), self.a(out), self.a(rstd), l(rows), i(cols), f(scale), f(eps)],
        );
    }
    fn mix_norm_fwd(&mut self, o: op::MixNormFwd) {
        let (cols, op::MixNormFwd { h, x0, mix, kind, u, out, rstd, scale, eps }) = (o.cols(), o);
        self.check([h, x0, mix], [u, out, rstd]);
        let rows = h.len / cols;
        let resid = flag(kind == op::MixKind::Resid);
        let args =
            vec![self.a(h), self.a(x0), self.a(mix), resid, self.a(u), self.a(out), self.a(rstd), l(rows), i(cols), f(scale), f(eps)];
        self.launch(k::eng_mix_norm_fwd, warps(rows), BLOCK, args);
    }
    fn rms_norm_bwd(&mut self, op::RmsNormBwd { x, rstd, dy, dx, cols, scale, accumulate }: op::RmsNormBwd) {
        self.check([x, rstd, dy], [dx]);
        let rows = x.len / cols;
        let args = vec![self.a(x), self.a(rstd), self.a(dy), self.a(dx), l(rows), i(cols), f(scale), flag(accumulate)];
        self.launch(k::eng_rms_norm_bwd, warps(rows), BLOCK, args);
    }
    fn resid_mix_fwd(&mut self, op::ResidMixFwd { h, x0, mix, out }: op::ResidMixFwd) {
        self.check([h, x0, mix], [out]);
        let cols = mix.len / 2;
        self.launch(k::eng_resid_mix_fwd, flat(out.len), BLOCK, vec![self.a(h), self.a(x0), self.a(mix), self.a(out), l(out.len), i(cols)]);
    }
    fn resid_mix_bwd(&mut self, op::ResidMixBwd { du, h, x0, mix, dh, dx0, dmix }: op::ResidMixBwd) {
        self.check([du, h, x0, mix], [dh, dx0, dmix]);
        let cols = mix.len / 2;
        let rows = du.len / cols;
        self.launch(k::eng_resid_mix_bwd, flat(du.len), BLOCK, vec![self.a(du), self.a(mix), self.a(dh), self.a(dx0), l(du.len), i(cols)]);
        let part = self.scratch(0, rows.div_ceil(PART) * 2 * cols);
        self.launch(k::eng_resid_mix_partial, parts(rows, cols), BLOCK, vec![self.a(du), self.a(h), self.a(x0), l(rows), i(cols), part]);
        self.finish(rows, 2 * cols, 2 * cols, dmix);
    }
    fn scale_add_fwd(&mut self, op::ScaleAddFwd { base, x, s, out }: op::ScaleAddFwd) {
        if base == out {
            self.check([x, s], [out]);
        } else {
            self.check([base, x, s], [out]);
        }
        let cols = s.len;
        self.launch(k::eng_scale_add_fwd, flat(out.len), BLOCK, vec![self.a(base), self.a(x), self.a(s), self.a(out), l(out.len), i(cols)]);
    }
    fn scale_add_bwd(&mut self, op::ScaleAddBwd { dy, x, s, dx, ds }: op::ScaleAddBwd) {
        self.check([dy, x, s], [dx, ds]);
        let (cols, rows) = (s.len, dy.len / s.len);
        self.launch(k::eng_scale_cols, flat(dy.len), BLOCK, vec![self.a(dy), self.a(s), self.a(dx), l(dy.len), i(cols)]);
        let part = self.scratch(0, rows.div_ceil(PART) * cols);
        self.launch(k::eng_dot_partial, parts(rows, cols), BLOCK, vec![self.a(dy), self.a(x), l(rows), i(cols), part]);
        self.finish(rows, cols, cols, ds);
    }
    fn norm_scale_bwd(&mut self, op::NormScaleBwd { x, rstd, dn, g, scale, a, s, dx, ds }: op::NormScaleBwd) {
        let (cols, rows) = (s.len, x.len / s.len);
        if cols > NORM_SCALE_MAX {
            // Wider than the fused kernel's shared sums: the two ops.
            self.rms_norm_bwd(op::RmsNormBwd { x, rstd, dy: dn, dx: g, cols, scale, accumulate: true });
            return self.scale_add_bwd(op::ScaleAddBwd { dy: g, x: a, s, dx, ds });
        }
        self.check([x, rstd, dn, a, s], [g, dx, ds]);
        let part = self.scratch(0, rows.div_ceil(PART) * cols);
        let args = vec![self.a(x), self.a(rstd), self.a(dn), self.a(g), self.a(a), self.a(s), self.a(dx), l(rows), i(cols), f(scale), part];
        self.launch(k::eng_norm_scale_bwd, [rows.div_ceil(PART) as u32, 1, 1], BLOCK, args);
        self.finish(rows, cols, cols, ds);
    }
    fn norm_mix_bwd(&mut self, op::NormMixBwd { x, rstd, dn, du, scale, accumulate, h, x0, mix, dh, dx0, dmix }: op::NormMixBwd) {
        let (cols, rows) = (mix.len / 2, x.len / (mix.len / 2));
        if cols > NORM_MIX_MAX {
            // Wider than the fused kernel's shared sums: the two ops.
            self.rms_norm_bwd(op::RmsNormBwd { x, rstd, dy: dn, dx: du, cols, scale, accumulate });
            return self.resid_mix_bwd(op::ResidMixBwd { du, h, x0, mix, dh, dx0, dmix });
        }
        self.check([x, rstd, dn, h, x0, mix], [du, dh, dx0, dmix]);
        let part = self.scratch(0, rows.div_ceil(PART) * 2 * cols);
        let (a, acc) = (|b: Buf| self.a(b), flag(accumulate));
        let args = vec![a(x), a(rstd), a(dn), a(du), acc, a(h), a(x0), a(mix), a(dh), a(dx0), l(rows), i(cols), f(scale), part];
        self.launch(k::eng_norm_mix_bwd, [rows.div_ceil(PART) as u32, 1, 1], BLOCK, args);
        self.finish(rows, 2 * cols, 2 * cols, dmix);
    }
    fn skip_fwd(&mut self, op::SkipFwd { h, s, w, z, out }: op::SkipFwd) {
        let zb = z.unwrap_or_default();
        self.check([h, s, w, zb], [out]);
        let cols = w.len;
        let args = vec![self.a(h), self.a(s), self.a(w), self.a(zb), flag(z.is_some()), self.a(out), l(out.len), i(cols)];
        self.launch(k::eng_skip_fwd, flat(out.len), BLOCK, args);
    }
    fn skip_bwd(&mut self, op::SkipBwd { dy, h, s, w, z, dh, ds, dw }: op::SkipBwd) {
        let (zb, dz) = z.unwrap_or_default();
        self.check([dy, h, s, w, zb], [dh, ds, dw, dz]);
        let (cols, rows, gated) = (w.len, dy.len / w.len, flag(z.is_some()));
        self.launch(
            k::eng_skip_bwd,
            flat(dy.len),
            BLOCK,
            vec![self.a(dy), self.a(w), self.a(zb), gated, self.a(dh), self.a(ds), l(dy.len), i(cols)],
        );
        let n = rows.div_ceil(PART);
        let part = self.scratch(0, n * 2 * cols);
        self.launch(
            k::eng_skip_partial,
            parts(rows, cols),
            BLOCK,
            vec![self.a(dy), self.a(h), self.a(s), self.a(w), self.a(zb), gated, l(rows), i(cols), part],
        );
        self.finish(rows, 2 * cols, cols, dw);
        if z.is_some() {
            self.launch(k::eng_skip_gate_finish, flat(cols), BLOCK, vec![part, i(n), i(cols), self.a(zb), self.a(dz)]);
        }
    }
    fn qk_norm_rope_fwd(&mut self, op::QkNormRopeFwd { x, out, rstd, gain, cos, sin, s, eps }: op::QkNormRopeFwd) {
        let g = gain.unwrap_or_default();
        self.check([x.span(), g, cos, sin], [out, rstd]);
        let mut args = vec![self.a(x.span()), l(x.ld), self.a(out), self.a(rstd)];
        args.extend(self.head_args(g, gain.is_some(), cos, sin, s));
        args.push(f(eps));
        let av = self.chunk_values();
        if qk_vector(s, &[x, out.mat(s.rows, s.heads * s.d)], av) {
            self.launch(k::eng_qk_norm_rope_fwd4, qk_grid(s, av), BLOCK, args);
        } else {
            self.launch(k::eng_qk_norm_rope_fwd, warps(s.rows * s.heads), BLOCK, args);
        }
    }
    fn qk_norm_rope_bwd(&mut self, op::QkNormRopeBwd { x, rstd, dy, dx, gain, cos, sin, s }: op::QkNormRopeBwd) {
        let (g, dg) = gain.unwrap_or_default();
        self.check([x.span(), rstd, dy, g, cos, sin], [dx.span(), dg]);
        // Per-(row, head) gain gradients after the partial sums' slot (offset 0).
        let n = s.rows.div_ceil(PART);
        let per_item = self.scratch(n * s.heads, s.rows * s.heads);
        let mut args = vec![self.a(x.span()), l(x.ld), self.a(rstd), self.a(dy), self.a(dx.span()), l(dx.ld)];
        args.extend(self.head_args(g, gain.is_some(), cos, sin, s));
        args.push(per_item);
        let av = self.chunk_values();
        if qk_vector(s, &[x, dx, dy.mat(s.rows, s.heads * s.d)], av) {
            self.launch(k::eng_qk_norm_rope_bwd4, qk_grid(s, av), BLOCK, args);
        } else {
            self.launch(k::eng_qk_norm_rope_bwd, warps(s.rows * s.heads), BLOCK, args);
        }
        if gain.is_some() {
            let part = self.scratch(0, n * s.heads);
            self.launch(k::eng_colsum_partial, parts(s.rows, s.heads), BLOCK, vec![per_item, l(s.rows), i(s.heads), part]);
            self.finish(s.rows, s.heads, s.heads, dg);
        }
    }
    fn attention_fwd(&mut self, op::AttentionFwd { q, k, v, out, s }: op::AttentionFwd) {
        self.check([q.span(), k.span(), v.span()], [out]);
        if self.cudnn_fwd(q, k, v, out, s) {
            return;
        }
        let (scale_log2, _, qgrid, _) = Self::flash(s);
        let h = self.half_slots(s);
        let n = s.batch * s.t;
        let (qa, ka, va) = (self.attn_in(q, h[0]), self.attn_in(k, h[1]), self.attn_in(v, h[2]));
        let (oa, o_copy) = self.attn_out(out.mat(n, s.heads * s.d), h[3], false);
        let lse = self.lse(out);
        let mut args = vec![qa, ka, va, oa, lse, i(s.t), i(s.heads), i(s.kv_heads), scale_log2];
        let kernel = match self.document_starts(s) {
            Some(starts) => {
                args.push(starts);
                k::flash_fwd_mma_docs_bf16
            }
            None => k::flash_fwd_mma_bf16,
        };
        self.launch(kernel, qgrid, FLASH_THREADS, args);
        self.attn_finish(&[o_copy]);
    }
    fn attention_bwd(&mut self, op::AttentionBwd { q, k, v, out, dout, dq, dk, dv, dv_acc, s }: op::AttentionBwd) {
        self.check([q.span(), k.span(), v.span(), out, dout], [dq.span(), dk.span(), dv.span()]);
        if self.cudnn_bwd(q, k, v, out, dout, dq, dk, dv, dv_acc, s) {
            return;
        }
        let (scale_log2, scale, qgrid, kvgrid) = Self::flash(s);
        let n = s.batch * s.t;
        let h = self.half_slots(s);
        let (qa, ka, va) = (self.attn_in(q, h[0]), self.attn_in(k, h[1]), self.attn_in(v, h[2]));
        let ga = self.attn_in(dout.mat(n, s.heads * s.d), h[3]);
        let (dqa, dq_copy) = self.attn_out(dq, h[4], false);
        let (dka, dk_copy) = self.attn_out(dk, h[5], false);
        let (dva, dv_copy) = self.attn_out(dv, h[6], dv_acc);
        let lse = self.lse(out);
        let delta = self.scratch(0, n * s.heads);
        self.launch(k::eng_attn_delta, warps(n * s.heads), BLOCK, vec![self.a(out), self.a(dout), delta, l(n), i(s.t), i(s.heads), i(s.d)]);
        let (t, heads, kvh) = (i(s.t), i(s.heads), i(s.kv_heads));
        let common = [qa, ka, va, ga, lse, delta];
        let starts = self.document_starts(s);
        let mut dq_args = common.to_vec();
        dq_args.extend([dqa, t, heads, kvh, scale_log2, scale]);
        let mut dkdv_args = common.to_vec();
        dkdv_args.extend([dka, dva, t, heads, kvh, scale_log2, scale]);
        let (dq_kernel, dkdv_kernel) = match starts {
            Some(p) => {
                dq_args.push(p);
                dkdv_args.push(p);
                (k::flash_bwd_dq_mma_docs_bf16, k::flash_bwd_dkdv_mma_docs_bf16)
            }
            None => (k::flash_bwd_dq_mma_bf16, k::flash_bwd_dkdv_mma_bf16),
        };
        self.launch(dq_kernel, qgrid, FLASH_THREADS, dq_args);
        self.launch(dkdv_kernel, kvgrid, FLASH_THREADS, dkdv_args);
        self.attn_finish(&[dq_copy, dk_copy, dv_copy]);
    }
    fn xsa_fwd(&mut self, op::XsaFwd { y, v, out, s }: op::XsaFwd) {
        self.check([y, v.span()], [out]);
        assert!(s.d <= 128, "XSA kernels take heads up to 128 wide, not {}", s.d);
        let rows = s.batch * s.t;
        let args = vec![self.a(y), self.a(v.span()), l(v.ld), self.a(out), l(rows), i(s.heads), i(s.kv_heads), i(s.d)];
        self.launch(k::eng_xsa_fwd, warps(rows * s.kv_heads), BLOCK, args);
    }
    fn xsa_bwd(&mut self, op::XsaBwd { dout, y, v, dy, dv, s }: op::XsaBwd) {
        self.check([dout, y, v.span()], [dy, dv.span()]);
        assert!(s.d <= 128, "XSA kernels take heads up to 128 wide, not {}", s.d);
        let rows = s.batch * s.t;
        let mut args = self.ptrs(&[dout, y, v.span()]);
        args.extend([l(v.ld), self.a(dy), self.a(dv.span()), l(dv.ld), l(rows), i(s.heads), i(s.kv_heads), i(s.d)]);
        self.launch(k::eng_xsa_bwd, warps(rows * s.kv_heads), BLOCK, args);
    }
    fn smear_fwd(&mut self, op::SmearFwd { e, w, lambda, out, cols, t, bos }: op::SmearFwd) {
        self.check([e, w, lambda], [out]);
        let rows = self.smear_rows(e, cols, t);
        let ids = Arg::Ptr(Space::Tokens, self.tokens.x());
        let args = vec![self.a(e), ids, self.a(w), self.a(lambda), self.a(out), l(rows), i(cols), i(w.len), i(t), i(bos as usize)];
        self.launch(k::eng_smear_fwd, warps(rows), BLOCK, args);
    }
    fn smear_bwd(&mut self, op::SmearBwd { dout, e, w, lambda, de, dw, dlambda, cols, t, bos }: op::SmearBwd) {
        self.check([dout, e, w, lambda], [de, dw, dlambda]);
        let rows = self.smear_rows(e, cols, t);
        let (win, n) = (w.len, rows.div_ceil(PART));
        // Scratch: the partials ((win + 1) per block of rows), then (dz, dl) per row.
        let (part, rowv) = (self.scratch(0, n * (win + 1)), self.scratch(n * (win + 1), 2 * rows));
        let ids = Arg::Ptr(Space::Tokens, self.tokens.x());
        let [dout, e, w, lambda, de] = [dout, e, w, lambda, de].map(|b| self.a(b));
        let args = vec![dout, e, ids, w, lambda, de, rowv, l(rows), i(cols), i(win), i(t), i(bos as usize)];
        self.launch(k::eng_smear_bwd, warps(rows), BLOCK, args);
        self.launch(k::eng_smear_partial, parts(rows, win + 1), BLOCK, vec![e, rowv, l(rows), i(cols), i(win), part]);
        self.colsum(0, n, win + 1, win, dw);
        self.colsum(win, n, win + 1, 1, dlambda);
    }
    fn lanes_fwd(&mut self, op::LanesFwd { l: lanes, ao, mo, w, out }: op::LanesFwd) {
        self.check([lanes[0], lanes[1], ao, mo, w.sa, w.sm, w.r, w.p], out);
        let (n, cols) = (ao.len, w.sa.len);
        let mut args = self.ptrs(&[lanes[0], lanes[1], ao, mo, w.sa, w.sm, w.r, w.p, out[0], out[1]]);
        args.extend([l(n), i(cols)]);
        self.launch(k::eng_lanes_fwd, flat(n), BLOCK, args);
    }
    fn lanes_bwd(&mut self, op::LanesBwd { g, l: lanes, ao, mo, w, dl, dao, dmo, dw }: op::LanesBwd) {
        self.check([g[0], g[1], lanes[0], lanes[1], ao, mo, w.sa, w.sm, w.r, w.p], [dl[0], dl[1], dao, dmo, dw.sa, dw.sm, dw.r, dw.p]);
        let (n, cols) = (ao.len, w.sa.len);
        let rows = n / cols;
        let mut args = self.ptrs(&[g[0], g[1], w.sa, w.sm, w.r, w.p, dl[0], dl[1], dao, dmo]);
        args.extend([l(n), i(cols)]);
        self.launch(k::eng_lanes_bwd, flat(n), BLOCK, args);
        // Scratch: per block of rows the scales' two per-channel partials, then per block six
        // block sums for the lambdas.
        let grid = parts(rows, cols);
        let (parts_n, blocks) = (rows.div_ceil(PART), (grid[0] * grid[1]) as usize);
        let (part, sc) = (self.scratch(0, parts_n * 2 * cols), self.scratch(parts_n * 2 * cols, blocks * 6));
        let mut args = self.ptrs(&[g[0], g[1], lanes[0], lanes[1], ao, mo, w.sa, w.sm, w.p]);
        args.extend([l(rows), i(cols), part, sc]);
        self.launch(k::eng_lanes_partial, grid, BLOCK, args);
        self.colsum(0, parts_n, 2 * cols, cols, dw.sa);
        self.colsum(cols, parts_n, 2 * cols, cols, dw.sm);
        self.launch(k::eng_lanes_finish, [1, 1, 1], 192, vec![sc, i(blocks), self.a(dw.r), self.a(dw.p)]);
    }
    fn attn_gate_fwd(&mut self, op::AttnGateFwd { y, x, w, out, heads, scale }: op::AttnGateFwd) {
        self.check([y, x.span(), w], [out]);
        let (rows, d, win) = Self::gate_shape(y, x, w, heads);
        let args = vec![self.a(y), self.a(x.span()), l(x.ld), self.a(w), self.a(out), l(rows), i(heads), i(d), i(win), f(scale)];
        self.launch(k::eng_attn_gate_fwd, warps(rows * heads), BLOCK, args);
    }
    fn attn_gate_bwd(&mut self, op::AttnGateBwd { dout, y, x, w, dy, dz, heads, scale }: op::AttnGateBwd) {
        self.check([dout, y, x.span(), w], [dy, dz]);
        let (rows, d, win) = Self::gate_shape(y, x, w, heads);
        assert_eq!(dz.len, rows * heads, "the gate's dz is (rows, heads)");
        let mut args = self.ptrs(&[dout, y, x.span()]);
        args.extend([l(x.ld), self.a(w), self.a(dy), self.a(dz), l(rows), i(heads), i(d), i(win), f(scale)]);
        self.launch(k::eng_attn_gate_bwd, warps(rows * heads), BLOCK, args);
    }
    fn act_fwd(&mut self, op::ActFwd { pre, out, a: act }: op::ActFwd) {
        self.check([pre], [out]);
        self.launch(k::eng_act_fwd, flat(out.len), BLOCK, vec![self.a(pre), self.a(out), l(out.len), f(act.slope)]);
    }
    fn act_bwd(&mut self, op::ActBwd { pre, dout, dpre, a: act }: op::ActBwd) {
        self.check([pre, dout], [dpre]);
        self.launch(k::eng_act_bwd, flat(dpre.len), BLOCK, vec![self.a(pre), self.a(dout), self.a(dpre), l(dpre.len), f(act.slope)]);
    }
    fn softcap_ce(&mut self, op::SoftcapCe { logits, losses, vocab, cap, grad_scale }: op::SoftcapCe) {
        self.check([], [logits, losses]);
        let rows = logits.len / vocab;
        let y = Arg::Ptr(Space::Tokens, self.tokens.y());
        self.launch(
            k::eng_softcap_ce,
            [rows as u32, 1, 1],
            BLOCK,
            vec![self.a(logits), y, self.a(losses), i(vocab), f(cap), f(grad_scale)],
        );
    }
    fn adam(&mut self, op::Adam { p, g, m, v, s }: op::Adam) {
        self.check([g], [p, m, v]);
        let sched = self.sched(&[s.lr / s.bias1, 1.0 / s.bias2_sqrt, 1.0 - s.lr * s.weight_decay]);
        let mut args = self.ptrs(&[p, g, m, v]);
        args.extend([l(p.len), f(s.beta1), f(s.beta2), sched, f(s.eps), flag(s.weight_decay != 0.0)]);
        self.launch(k::eng_adam, flat(p.len), BLOCK, args);
    }
    fn momentum(&mut self, op::Momentum { g, buf, u, mu, nesterov }: op::Momentum) {
        self.check([g], [buf, u]);
        let mu = self.sched(&[mu]);
        self.launch(k::eng_momentum, flat(buf.len), BLOCK, vec![self.a(g), self.a(buf), self.a(u), l(buf.len), mu, flag(nesterov)]);
    }
    fn axpby(&mut self, op::Axpby { a: x_scale, x, b: y_scale, y }: op::Axpby) {
        self.check([x], [y]);
        let ab = self.sched(&[x_scale, y_scale]);
        assert_eq!(self.is_act(x), self.is_act(y), "axpby between f32 and bf16 buffers ({x:?} into {y:?})");
        self.launch(self.flat_kernel(k::eng_axpby, y), flat(y.len), BLOCK, vec![ab, self.a(x), self.a(y), l(y.len)]);
    }
    fn row_normalize(&mut self, op::RowNormalize { x, cols, eps }: op::RowNormalize) {
        self.check([], [x]);
        let rows = x.len / cols;
        self.launch(k::eng_row_normalize, warps(rows), BLOCK, vec![self.a(x), l(rows), i(cols), f(eps)]);
    }
    fn normalize_each(&mut self, op::NormalizeEach { x, count, eps }: op::NormalizeEach) {
        self.check([], [x]);
        self.launch(k::eng_normalize_each, [count.max(1) as u32, 1, 1], BLOCK, vec![self.a(x), l(x.len / count.max(1)), f(eps)]);
    }
    fn transpose_each(&mut self, op::TransposeEach { src, dst, count, rows, cols }: op::TransposeEach) {
        self.check([src], [dst]);
        let grid = [flat(rows * cols)[0], count as u32, 1];
        self.launch(k::eng_transpose_each, grid, BLOCK, vec![self.a(src), self.a(dst), i(rows), i(cols)]);
    }
}
