//! [`Backend`] for [`KernelBackend`] apart from its ops (those are `ops.rs`'s [`Kernels`]):
//! the arena's uploads and reads, the micro-batch's tokens and the ids' CSR built from them on
//! the device, units of work and their graphs, the timing marks and the reductions the host
//! reads.
//!
//! [`Kernels`]: crate::engine::op::Kernels

use candle_core::{DType, Device as CandleDevice, Tensor};

use super::kernels as k;
use super::ops::{BLOCK, csr_rows, flat, i, id_source, l};
use super::{Arg, Device, KernelBackend, Launch, Space, Unit};
use crate::engine::backend::{Backend, Buf, GraphCounts};
use crate::engine::op::{self, Op};

impl<D: Device> KernelBackend<D> {
    /// The three launches that build the CSR of `ids` into the tokens' space (offsets per
    /// row, positions, the gradient's pieces), from the micro-batch's ids already there.
    pub(super) fn csr_build(&self, ids: op::Ids) -> [Launch; 3] {
        let t = self.tokens;
        let (x, n, vocab, chunk) = (Arg::Ptr(Space::Tokens, t.x()), l(t.n), i(csr_rows(t, ids)), i(t.chunk));
        let (counts, off, pos) =
            (Arg::Ptr(Space::Tokens, t.counts()), Arg::Ptr(Space::Tokens, t.csr_off()), Arg::Ptr(Space::Tokens, t.csr_pos()));
        let (seq, buckets) = id_source(ids);
        let chunks = [t.chunks() as u32, 1, 1];
        let (piece, poff) = (i(t.piece), Arg::Ptr(Space::Tokens, t.pieces()));
        [
            Launch { kernel: k::eng_csr_count, grid: chunks, block: 32, args: vec![x, n, vocab, chunk, counts, seq, buckets] },
            Launch { kernel: k::eng_csr_scan, grid: [1, 1, 1], block: BLOCK, args: vec![counts, i(t.chunks()), vocab, off, piece, poff] },
            Launch { kernel: k::eng_csr_fill, grid: chunks, block: 32, args: vec![x, n, vocab, chunk, counts, pos, seq, buckets] },
        ]
    }
}

impl<D: Device> Backend for KernelBackend<D> {
    fn dtype(&self) -> DType {
        DType::F32
    }

    fn device_name(&self) -> String {
        self.dev.name()
    }

    fn len(&self) -> usize {
        self.len
    }

    fn upload(&mut self, dst: Buf, src: &Tensor) -> anyhow::Result<()> {
        anyhow::ensure!(src.elem_count() == dst.len, "uploading {} elements into a {}-element region", src.elem_count(), dst.len);
        self.check([], [dst]);
        self.outside_unit("an upload");
        anyhow::ensure!(!self.comm_open, "an upload with collectives in flight (queued outside a unit, not joined: comm_join)");
        let v: Vec<f32> = src.to_device(&CandleDevice::Cpu)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut done = 0;
        for b in self.pieces(dst) {
            let part = &v[done..done + b.len];
            done += b.len;
            match self.at(b.off) {
                (Space::Act, off) => {
                    let bits: Vec<u16> = part.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                    self.dev.write_half(Space::Act, off, &bits)?;
                }
                (space, off) => self.dev.write(space, off, &part.iter().map(|x| x.to_bits()).collect::<Vec<u32>>())?,
            }
        }
        Ok(())
    }

    fn download(&self, src: Buf, shape: &[usize]) -> anyhow::Result<Tensor> {
        self.check([src], []);
        self.outside_unit("a download");
        anyhow::ensure!(!self.comm_open, "a download with collectives in flight (queued outside a unit, not joined: comm_join)");
        let mut v: Vec<f32> = Vec::with_capacity(src.len);
        for b in self.pieces(src) {
            match self.at(b.off) {
                (Space::Act, off) => {
                    v.extend(self.dev.read_half(Space::Act, off, b.len)?.into_iter().map(|x| half::bf16::from_bits(x).to_f32()))
                }
                (space, off) => v.extend(self.dev.read(space, off, b.len)?.into_iter().map(f32::from_bits)),
            }
        }
        Ok(Tensor::from_vec(v, shape, &CandleDevice::Cpu)?)
    }

    fn download_to(&self, src: Buf, shape: &[usize], device: &CandleDevice) -> anyhow::Result<Tensor> {
        self.check([src], []);
        self.outside_unit("a download");
        match self.pieces(src).as_slice() {
            [b] if self.at(b.off).0 == Space::Arena => self.dev.tensor(self.at(b.off).1, src.len, shape, device),
            _ => Ok(self.download(src, shape)?.to_device(device)?),
        }
    }

    fn set_tokens(&mut self, x: &[u32], y: &[u32]) {
        self.load_tokens(crate::engine::backend::Tokens::Host { x, y }).expect("writing the micro-batch's tokens to the device");
    }

    fn load_tokens(&mut self, tokens: crate::engine::backend::Tokens<'_>) -> anyhow::Result<()> {
        use crate::engine::backend::Tokens;
        self.outside_unit("writing the micro-batch's tokens");
        let t = self.tokens;
        let (nx, ny) = tokens.lens();
        anyhow::ensure!(nx == t.n && ny == t.n, "{nx} ids and {ny} targets for a {}-token micro-batch", t.n);
        match tokens {
            Tokens::Host { x, y } => {
                self.dev.write(Space::Tokens, t.x(), x)?;
                self.dev.write(Space::Tokens, t.y(), y)?;
            }
            Tokens::Tensors { x, y } => {
                self.dev.write_tensor(Space::Tokens, t.x(), x)?;
                self.dev.write_tensor(Space::Tokens, t.y(), y)?;
            }
        }
        // The ids' CSR for the embedding's gradient, on the device (kernels/engine/embedding.cuh).
        for launch in self.csr_build(op::Ids::Tokens) {
            self.dev.launch(&launch);
        }
        // The document starts (if attention asks for them) are of the old ids.
        self.starts_for = None;
        self.cudnn.lens_for = None;
        Ok(())
    }

    fn sum(&self, src: Buf) -> f64 {
        self.reduce(src, 0)
    }

    fn sum_sq(&self, src: Buf) -> f64 {
        self.reduce(src, 1)
    }

    fn all_finite(&self, src: Buf) -> bool {
        self.reduce(src, 2) == 0.0
    }

    fn begin_unit(&mut self, key: &str) {
        self.outside_unit("opening a unit of work");
        self.unit = Some(Unit { key: key.to_string(), work: Vec::new(), scalars: Vec::new() });
    }

    fn end_unit(&mut self) {
        // A unit's collectives end inside it: a captured graph's streams must meet again.
        self.queue_join();
        let u = self.unit.take().expect("end_unit without begin_unit");
        self.run_unit(u);
    }

    fn set_comm(&mut self, ranks: std::sync::Arc<dyn crate::dist::Collective>) -> anyhow::Result<bool> {
        self.start_comm(ranks)
    }

    fn comm_all_reduce(&mut self, regions: &[Buf], op: crate::dist::ReduceOp) {
        self.queue_all_reduce(regions, op)
    }

    fn comm_broadcast(&mut self, pieces: &[(Buf, usize)]) {
        self.queue_broadcast(pieces)
    }

    fn comm_join(&mut self) {
        self.queue_join()
    }

    fn queues_collectives(&self) -> bool {
        self.comm
    }

    fn fence(&self) -> anyhow::Result<()> {
        self.dev.fence()
    }

    fn graph_counts(&self) -> Option<GraphCounts> {
        Some(self.counts)
    }

    fn set_cudnn(&mut self, on: bool) -> anyhow::Result<()> {
        self.cudnn.on = on;
        Ok(())
    }

    fn attention_name(&self) -> String {
        KernelBackend::attention_name(self)
    }

    fn synchronize(&self) -> anyhow::Result<()> {
        self.dev.synchronize()
    }

    fn timing_mark(&mut self) -> Option<usize> {
        self.outside_unit("a timing mark");
        self.dev.timing_mark()
    }

    fn timing_ms(&self, from: usize, to: usize) -> anyhow::Result<f64> {
        self.dev.timing_ms(from, to)
    }

    fn timing_reset(&self) {
        self.dev.timing_reset()
    }

    fn timing_done(&self, mark: usize) -> bool {
        self.dev.timing_done(mark)
    }

    fn timing_release(&self, mark: usize) {
        self.dev.timing_release(mark)
    }

    fn half_region(&self) -> Option<Buf> {
        self.half.map(|h| h.act)
    }

    fn refresh_weights(&mut self, params: Buf) {
        let Some(h) = self.half else { return };
        assert_eq!(params, h.params, "the weights' bf16 copy is of the parameter region");
        let args = vec![self.a(params), Arg::Ptr(Space::Mirror, 0), l(params.len)];
        self.launch(k::eng_cast_bf16, flat(params.len), BLOCK, args);
    }

    fn run(&mut self, op: Op) {
        op.apply(self)
    }
}
