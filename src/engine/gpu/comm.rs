//! The GPU backend's collectives (data parallel): regions of the arena resolved to device
//! spaces and queued as [`CommCall`]s with the rest of the work, so that the gradient
//! exchange and sharded Muon's exchange of updates run on the device's communication stream
//! inside the units of work (and their CUDA graphs) instead of through the host.
//!
//! ```text
//! compute stream:  ... grads of bucket 0 final ─┬─ more backward ... ─┬─ (join) optimizer
//!                                               │ fork                │
//! comm stream:                                  └─ all-reduce(bucket 0) ... all-reduce(k) ─┘
//! ```
//!
//! Every collective forks from the compute stream where it is queued; a join (explicit, or
//! the one every unit of work that queued collectives ends with, so that a captured graph's
//! streams meet again) makes the compute stream wait for all of them.

use super::{CommCall, Device, KernelBackend, Space, Work};
use crate::dist::{Collective, ReduceOp};
use crate::engine::backend::BackendExt;
use crate::engine::backend::Buf;
use crate::engine::op;

impl<D: Device> KernelBackend<D> {
    /// `regions` as device pieces `(space, offset, elements)`: each cut at the edges of the
    /// bf16 activations, then resolved to its space; neighbours in one space merged.
    fn comm_pieces(&self, regions: &[Buf]) -> Vec<(Space, usize, usize)> {
        let mut out: Vec<(Space, usize, usize)> = Vec::new();
        for r in regions.iter().filter(|r| r.len > 0) {
            for p in self.pieces(*r) {
                let (space, off) = self.at(p.off);
                match out.last_mut() {
                    Some(last) if last.0 == space && last.1 + last.2 == off => last.2 += p.len,
                    _ => out.push((space, off, p.len)),
                }
            }
        }
        out
    }

    /// Starts the device's communicator among `ranks`.
    pub(super) fn start_comm(&mut self, ranks: std::sync::Arc<dyn Collective>) -> anyhow::Result<bool> {
        self.dev.comm_init(ranks)?;
        self.comm = true;
        Ok(true)
    }

    fn ensure_comm(&self) {
        assert!(self.comm, "a collective queued on {} before set_comm", self.dev.name());
    }

    /// Queues the collective `c` (open until the next join).
    fn queue(&mut self, c: CommCall) {
        self.ensure_comm();
        self.comm_open = true;
        self.submit(Work::Comm(c));
    }

    /// Queues an all-reduce of `regions`.
    pub(super) fn queue_all_reduce(&mut self, regions: &[Buf], op: ReduceOp) {
        let pieces = self.comm_pieces(regions);
        if !pieces.is_empty() {
            self.queue(CommCall::AllReduce { pieces, op });
        }
    }

    /// Queues broadcasts of `(region, root)`.
    pub(super) fn queue_broadcast(&mut self, pieces: &[(Buf, usize)]) {
        let pieces: Vec<(Space, usize, usize, usize)> =
            pieces.iter().flat_map(|&(b, root)| self.comm_pieces(&[b]).into_iter().map(move |(s, o, n)| (s, o, n, root))).collect();
        if !pieces.is_empty() {
            self.queue(CommCall::Broadcast { pieces });
        }
    }

    /// Queues a join when collectives are open.
    pub(super) fn queue_join(&mut self) {
        if std::mem::take(&mut self.comm_open) {
            self.submit(Work::Comm(CommCall::Join));
        }
    }
}

/// Elements of the arena [`comm_check`] needs: four regions of 4096 and three 256 x 256
/// matrices for its busy work.
pub const CHECK_ARENA: usize = 4 * 4096 + 3 * 256 * 256;

/// A check of the backend's collectives among `ranks` (engine-check runs it on a GPU at a world
/// of one; the tests on emulated ranks): three rounds of one unit of work, the first run op by
/// op, the second captured as a graph, the third replayed. Each round, after `busy` GEMMs on
/// the compute stream, the unit scales a region `a`, all-reduces it (mean) out of place into
/// `d`, broadcasts a region `b` from the last rank, scales `c` beside them, joins, and scales
/// `d` after the join. Each rank's inputs are made from its rank, so the values say whether the
/// ranks were combined; and at a world of one, where a collective only copies, they say whether
/// it was ordered: a collective not forked after the scale copies the old `a` (the busy GEMMs
/// make that likely to show), one not joined before `d`'s scale is overwritten or unscaled.
/// Returns `(what, ok, detail)` flags: the values of every round, and the capture.
pub fn comm_check<D: Device>(
    be: &mut KernelBackend<D>,
    ranks: std::sync::Arc<dyn Collective>,
    busy: usize,
) -> anyhow::Result<Vec<(String, bool, String)>> {
    use crate::engine::backend::Backend;
    let (world, rank) = (ranks.world(), ranks.rank());
    let n = 4096;
    anyhow::ensure!(be.len >= CHECK_ARENA, "the collectives' check needs an arena of {CHECK_ARENA} elements");
    be.set_comm(ranks)?;
    let [a, b, c, d] = [0, 1, 2, 3].map(|k| Buf { off: k * n, len: n });
    let m = |k: usize| Buf { off: 4 * n + k * 256 * 256, len: 256 * 256 }.mat(256, 256);
    let f = |i: usize| (i as f32 * 0.37).sin();
    let host = |v: Vec<f32>| candle_core::Tensor::from_vec(v, n, &candle_core::Device::Cpu);
    be.op(op::Fill { dst: Buf { off: 4 * n, len: 3 * 256 * 256 }, value: 1e-3 });
    let mut worst = 0f32;
    for _ in 0..3 {
        be.upload(a, &host((0..n).map(|i| f(i) + rank as f32).collect())?)?;
        be.upload(b, &host((0..n).map(|i| f(i) * (rank + 1) as f32).collect())?)?;
        be.upload(c, &host((0..n).map(f).collect())?)?;
        be.op(op::Fill { dst: d, value: 0.0 });
        be.begin_unit("collectives check");
        for _ in 0..busy {
            be.op(op::Gemm { c: m(2), a: m(0), b: m(1), alpha: 1.0, beta: 0.0 });
        }
        be.op(op::Scale { dst: a, a: 2.0 });
        let (src, dst) = (be.at(a.off), be.at(d.off));
        be.queue(CommCall::AllReduceInto { src, dst, len: n, op: ReduceOp::Mean });
        be.op(op::Scale { dst: c, a: 2.0 });
        be.comm_broadcast(&[(b, world - 1)]);
        be.op(op::Scale { dst: c, a: 1.5 });
        be.comm_join();
        be.op(op::Scale { dst: d, a: 3.0 });
        be.end_unit();
        let got = |buf: Buf| -> anyhow::Result<Vec<f32>> { Ok(be.download(buf, &[n])?.to_vec1::<f32>()?) };
        // (region, mul, add): a = 2 (f + r); d = 3 (2 f + (W - 1)); b = W f; c = 3 f.
        let want = [(a, 2.0, 2.0 * rank as f32), (d, 6.0, 3.0 * (world as f32 - 1.0)), (b, world as f32, 0.0), (c, 3.0, 0.0)];
        for (buf, mul, add) in want {
            for (i, v) in got(buf)?.into_iter().enumerate() {
                let w = f(i) * mul + add;
                worst = worst.max((v - w).abs() / w.abs().max(1.0));
            }
        }
    }
    let counts = be.graph_counts().unwrap_or_default();
    Ok(vec![
        (
            format!("collectives on the engine's communication stream (a world of {world})"),
            worst < 1e-6,
            format!(
                "a mean out of place after {busy} GEMMs and a scale, a broadcast, compute beside them and after the join, 3 rounds: worst relative error {worst:.1e}"
            ),
        ),
        (
            "a unit with collectives captured as a graph and replayed".to_string(),
            counts.captured >= 1 && counts.replayed >= 1,
            format!("{} captured, {} replayed, {} op by op", counts.captured, counts.replayed, counts.eager),
        ),
    ])
}
