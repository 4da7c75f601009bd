//! The warp emulator's collectives (tests only): a stand-in for NCCL on a communication stream
//! that checks the ordering the GPU relies on, run over any [`Collective`] (the engine's tests
//! use [`crate::dist::threads`]: ranks as threads, every call recorded).
//!
//! A collective runs as late as the GPU may run it: at the join. When it is queued, the
//! stand-in keeps the values of its regions (what the device holds then, after the work before
//! it); at the join it checks that no work in between wrote them (the values are unchanged, bit
//! for bit: accumulating writes included), then runs the collective on the kept values and
//! writes the result. So work that writes a region before its collective is joined (a bucket
//! sent before its gradients are final) fails the check; work that reads one before the join
//! reads this rank's own values, not the ranks' result, so the ranks' weights part (the tests
//! compare them); and a host read with collectives still in flight (a missing join) is
//! refused.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use super::{CommCall, Space};
use crate::dist::{Collective, ReduceOp};

/// One collective in flight: its pieces `(space, offset, values sent)` (the device's values when
/// it was queued) and what it does with them (one call of the ranks' collective for the whole
/// group, as NCCL's group is one launch; broadcasts one call per root).
struct Flight {
    pieces: Vec<(Space, usize, Vec<f32>)>,
    what: What,
    /// Out of place: where the result goes, and its values when queued (nothing may write
    /// them in flight either).
    out: Option<(Space, usize, Vec<f32>)>,
}

/// What a collective does with its pieces.
#[derive(Clone, Copy, Debug)]
enum What {
    AllReduce(ReduceOp),
    Broadcast(usize),
}

/// The stand-in's communicator: the ranks and the collectives queued since the last join.
pub(super) struct EmuComm {
    ranks: Arc<dyn Collective>,
    flights: Mutex<Vec<Flight>>,
}

/// How the stand-in reads and writes the device's memory (as f32, whatever the space).
pub(super) trait Memory {
    fn get(&self, space: Space, off: usize, len: usize) -> Vec<f32>;
    fn set(&self, space: Space, off: usize, values: &[f32]);
}

impl EmuComm {
    pub(super) fn new(ranks: Arc<dyn Collective>) -> Self {
        Self { ranks, flights: Mutex::new(Vec::new()) }
    }

    /// Whether collectives are in flight (queued, not joined).
    pub(super) fn in_flight(&self) -> bool {
        !self.flights.lock().expect("the flights").is_empty()
    }

    /// Queues or joins `c` on `mem`.
    pub(super) fn run(&self, mem: &dyn Memory, c: &CommCall) {
        let mut flights = self.flights.lock().expect("the flights");
        let rank = self.ranks.rank();
        let keep = |pieces: &mut dyn Iterator<Item = (Space, usize, usize)>| -> Vec<(Space, usize, Vec<f32>)> {
            pieces.map(|(space, off, len)| (space, off, mem.get(space, off, len))).collect()
        };
        match c {
            CommCall::AllReduce { pieces, op } => {
                flights.push(Flight { pieces: keep(&mut pieces.iter().copied()), what: What::AllReduce(*op), out: None });
            }
            CommCall::Broadcast { pieces } => {
                let mut roots: Vec<usize> = pieces.iter().map(|p| p.3).collect();
                roots.sort_unstable();
                roots.dedup();
                for root in roots {
                    let mine = &mut pieces.iter().filter(|p| p.3 == root).map(|&(s, o, n, _)| (s, o, n));
                    flights.push(Flight { pieces: keep(mine), what: What::Broadcast(root), out: None });
                }
            }
            &CommCall::AllReduceInto { src, dst, len, op } => {
                let out = Some((dst.0, dst.1, mem.get(dst.0, dst.1, len)));
                flights.push(Flight { pieces: keep(&mut std::iter::once((src.0, src.1, len))), what: What::AllReduce(op), out });
            }
            CommCall::Join => {
                for f in flights.drain(..) {
                    for (space, off, sent) in f.pieces.iter().chain(f.out.as_ref()) {
                        let now = mem.get(*space, *off, sent.len());
                        assert!(
                            now.iter().zip(sent).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "rank {rank}: work wrote {space:?}[{off}..{}] while its collective ({:?}) was in flight (queued before the join)",
                            off + sent.len(),
                            f.what
                        );
                    }
                    let flat: Vec<f32> = f.pieces.iter().flat_map(|p| p.2.iter().copied()).collect();
                    let t = Tensor::from_vec(flat, f.pieces.iter().map(|p| p.2.len()).sum::<usize>(), &candle_core::Device::Cpu)
                        .expect("a host tensor");
                    let out = match f.what {
                        What::AllReduce(op) => self.ranks.all_reduce(&t, op),
                        What::Broadcast(root) => self.ranks.broadcast(&t, root),
                    }
                    .and_then(|t| Ok(t.to_vec1::<f32>()?))
                    .unwrap_or_else(|e| panic!("rank {rank}: the stand-in's collective failed: {e:#}"));
                    if let Some((space, off, _)) = &f.out {
                        mem.set(*space, *off, &out);
                        continue;
                    }
                    let mut at = 0;
                    for (space, off, sent) in &f.pieces {
                        mem.set(*space, *off, &out[at..at + sent.len()]);
                        at += sent.len();
                    }
                }
            }
        }
    }
}
