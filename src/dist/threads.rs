//! A world of ranks as threads of one process: each collective meets the other ranks' calls
//! at a barrier over shared memory, and every call is recorded, in order, per rank. What the
//! engine's tests train several ranks with where no MPI is at hand (the GPU backend in the warp
//! emulator, whose device collectives run through it), and what tests read to check which
//! collectives ran, in which order, with how many elements.
//!
//! Every rank must call the same collectives in the same order (as with any backend); sums run
//! in rank order in f64, so every rank gets the same bits. CPU tensors only.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use super::{Collective, ReduceOp};

/// What the ranks share: the barrier, each rank's contribution to the collective under way,
/// and the record of calls.
struct Shared {
    barrier: Gate,
    slots: Mutex<Vec<Vec<f64>>>,
    log: Mutex<Vec<Vec<Call>>>,
}

/// What a rank raises when another rank's failure stops it (followed by that rank's number).
const OTHER_FAILED: &str = "stopped: the threads' world lost rank";

/// No rank has failed (see [`Gate::failed`]).
const NONE_FAILED: usize = usize::MAX;

/// A barrier that gives up when a rank has failed ([`Threads::run`] says so), where
/// `std::sync::Barrier` would wait for the dead rank for ever.
struct Gate {
    n: usize,
    /// Ranks arrived, and the generation (bumped when all have).
    state: Mutex<(usize, u64)>,
    turn: Condvar,
    /// The first rank that failed, or [`NONE_FAILED`].
    failed: AtomicUsize,
}

impl Gate {
    fn wait(&self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.n {
            *s = (0, generation + 1);
            self.turn.notify_all();
            return;
        }
        while s.1 == generation {
            let failed = self.failed.load(Ordering::SeqCst);
            assert!(failed == NONE_FAILED, "{OTHER_FAILED} {failed} (it failed before meeting this collective)");
            s = self.turn.wait_timeout(s, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// One recorded collective call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    /// The operation (`all_reduce`, `broadcast`, `all_gather`, `reduce_scatter`, `barrier`,
    /// `all_reduce_host`, `all_gather_bytes`), with its reduce op or root: `all_reduce(Mean)`,
    /// `broadcast(1)`.
    pub op: String,
    /// Elements this rank passed.
    pub elems: usize,
}

/// One rank of a world of threads.
pub struct Threads {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
}

impl Threads {
    /// A world of `n` ranks: hand element `r` to the thread that runs rank `r`.
    pub fn world(n: usize) -> Vec<Arc<Threads>> {
        assert!(n >= 1, "a world of {n} ranks");
        let shared = Arc::new(Shared {
            barrier: Gate { n, state: Mutex::new((0, 0)), turn: Condvar::new(), failed: AtomicUsize::new(NONE_FAILED) },
            slots: Mutex::new(vec![Vec::new(); n]),
            log: Mutex::new(vec![Vec::new(); n]),
        });
        (0..n).map(|rank| Arc::new(Threads { rank, world: n, shared: shared.clone() })).collect()
    }

    /// Runs `f` for every rank of `ranks` on a thread of its own and returns their results in
    /// rank order; a rank that panics stops the others at their next collective (instead of
    /// leaving them waiting for it), and the first failure is raised here.
    pub fn run<T: Send + 'static>(ranks: &[Arc<Threads>], f: impl Fn(Arc<Threads>) -> T + Send + Sync + 'static) -> Vec<T> {
        let mut results = Self::run_all(ranks, f);
        // The failure that started it, not the others' "another rank failed".
        let message = |e: &Box<dyn std::any::Any + Send>| {
            e.downcast_ref::<String>().map(String::as_str).or_else(|| e.downcast_ref::<&str>().copied()).unwrap_or("").to_string()
        };
        let first = results.iter().position(|r| r.as_ref().is_err_and(|e| !message(e).contains(OTHER_FAILED)));
        if let Some(k) = first.or_else(|| results.iter().position(|r| r.is_err())) {
            std::panic::resume_unwind(results.swap_remove(k).err().expect("an error"));
        }
        results.into_iter().map(|r| r.unwrap_or_else(|_| unreachable!("no rank failed"))).collect()
    }

    /// As [`Threads::run`], every rank's outcome in rank order, the panics included (what a
    /// failing rank raised, and what the ranks it left behind raised).
    fn run_all<T: Send + 'static>(
        ranks: &[Arc<Threads>],
        f: impl Fn(Arc<Threads>) -> T + Send + Sync + 'static,
    ) -> Vec<std::thread::Result<T>> {
        let f = Arc::new(f);
        let handles: Vec<_> = ranks
            .iter()
            .cloned()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let (shared, rank) = (c.shared.clone(), c.rank);
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(c)));
                    if r.is_err() {
                        let _ = shared.barrier.failed.compare_exchange(NONE_FAILED, rank, Ordering::SeqCst, Ordering::SeqCst);
                        shared.barrier.turn.notify_all();
                    }
                    r
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank's thread")).collect()
    }

    /// Rank `r`'s calls so far, in order.
    pub fn calls(&self, r: usize) -> Vec<Call> {
        self.shared.log.lock().unwrap_or_else(|e| e.into_inner())[r].clone()
    }

    /// Every rank's values, in rank order, once all have given theirs.
    fn meet(&self, op: String, mine: Vec<f64>) -> Vec<Vec<f64>> {
        self.shared.log.lock().unwrap_or_else(|e| e.into_inner())[self.rank].push(Call { op, elems: mine.len() });
        self.shared.slots.lock().unwrap_or_else(|e| e.into_inner())[self.rank] = mine;
        self.shared.barrier.wait();
        let all = self.shared.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        // Nobody writes its next contribution before every rank has read this one.
        self.shared.barrier.wait();
        all
    }

    fn reduce(&self, all: &[Vec<f64>], op: ReduceOp) -> Vec<f64> {
        let n = all[0].len();
        (0..n)
            .map(|i| {
                let vals = all.iter().map(|v| v[i]);
                match op {
                    ReduceOp::Sum => vals.sum(),
                    ReduceOp::Mean => vals.sum::<f64>() / self.world as f64,
                    ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
                }
            })
            .collect()
    }
}

/// `t`'s elements as f64 (CPU tensors only).
fn values(t: &Tensor) -> anyhow::Result<Vec<f64>> {
    anyhow::ensure!(t.device().is_cpu(), "the threads' collective takes CPU tensors");
    Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// `v` as a tensor of `dims` in `dtype`.
fn tensor(v: Vec<f64>, dims: &[usize], dtype: DType) -> anyhow::Result<Tensor> {
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dtype)?)
}

impl Collective for Threads {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor> {
        let all = self.meet(format!("all_reduce({op:?})"), values(t)?);
        tensor(self.reduce(&all, op), t.dims(), t.dtype())
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> anyhow::Result<Tensor> {
        anyhow::ensure!(root < self.world, "broadcast from rank {root} in a world of {}", self.world);
        let mut all = self.meet(format!("broadcast({root})"), values(t)?);
        tensor(std::mem::take(&mut all[root]), t.dims(), t.dtype())
    }

    fn all_gather(&self, t: &Tensor) -> anyhow::Result<Tensor> {
        let all = self.meet("all_gather".into(), values(t)?);
        let mut dims = vec![self.world];
        dims.extend_from_slice(t.dims());
        tensor(all.concat(), &dims, t.dtype())
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> anyhow::Result<Tensor> {
        let first = t.dims().first().copied().unwrap_or(0);
        anyhow::ensure!(first > 0 && first % self.world == 0, "reduce-scatter of shape {:?} over {} ranks", t.dims(), self.world);
        let all = self.meet(format!("reduce_scatter({op:?})"), values(t)?);
        let full = self.reduce(&all, op);
        let n = full.len() / self.world;
        let mut dims = t.dims().to_vec();
        dims[0] = first / self.world;
        tensor(full[self.rank * n..(self.rank + 1) * n].to_vec(), &dims, t.dtype())
    }

    fn barrier(&self) -> anyhow::Result<()> {
        self.meet("barrier".into(), Vec::new());
        Ok(())
    }

    fn all_reduce_host(&self, values: &[f64], op: ReduceOp) -> anyhow::Result<Vec<f64>> {
        let all = self.meet(format!("all_reduce_host({op:?})"), values.to_vec());
        Ok(self.reduce(&all, op))
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> anyhow::Result<Vec<Vec<u8>>> {
        let all = self.meet("all_gather_bytes".into(), bytes.iter().map(|&b| b as f64).collect());
        Ok(all.into_iter().map(|v| v.into_iter().map(|b| b as u8).collect()).collect())
    }

    fn abort(&self, _code: i32) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each operation on three ranks gives what its definition says, the same on every rank.
    #[test]
    fn three_threads_agree_on_every_operation() {
        let ranks = Threads::world(3);
        let out = Threads::run(&ranks, |c| {
            let r = c.rank() as f32;
            let t = Tensor::new(&[r, 10.0 + r, 20.0 + r], &Device::Cpu).unwrap();
            let sum = c.all_reduce(&t, ReduceOp::Sum).unwrap().to_vec1::<f32>().unwrap();
            let mean = c.all_reduce(&t, ReduceOp::Mean).unwrap().to_vec1::<f32>().unwrap();
            let b = c.broadcast(&t, 2).unwrap().to_vec1::<f32>().unwrap();
            let g = c.all_gather(&t).unwrap().dims().to_vec();
            let rs = c.reduce_scatter(&Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap(), ReduceOp::Sum).unwrap();
            let bytes = c.all_gather_bytes(&[c.rank() as u8; 2]).unwrap();
            (sum, mean, b, g, rs.to_vec1::<f32>().unwrap(), bytes)
        });
        for (r, (sum, mean, b, g, rs, bytes)) in out.into_iter().enumerate() {
            assert_eq!(sum, vec![3.0, 33.0, 63.0]);
            assert_eq!(mean, vec![1.0, 11.0, 21.0]);
            assert_eq!(b, vec![2.0, 12.0, 22.0]);
            assert_eq!(g, vec![3, 3]);
            assert_eq!(rs, vec![3.0 * (r + 1) as f32]);
            assert_eq!(bytes, vec![vec![0, 0], vec![1, 1], vec![2, 2]]);
        }
        let calls = ranks[1].calls(1);
        assert_eq!(calls.len(), 6);
        assert_eq!(calls[0], Call { op: "all_reduce(Sum)".into(), elems: 3 });
        assert_eq!(calls[2].op, "broadcast(2)");
    }

    /// A rank that fails stops the others at their next collective: the run fails (here, with
    /// the failing rank's message) instead of waiting for the dead rank for ever.
    /// The ranks left behind stop at their collective within a bounded time, naming the rank
    /// that was lost.
    #[test]
    fn the_ranks_left_behind_name_the_lost_rank() {
        let ranks = Threads::world(3);
        let t0 = std::time::Instant::now();
        let outcomes = Threads::run_all(&ranks, |c| {
            if c.rank() == 2 {
                panic!("rank 2 lost");
            }
            c.barrier().unwrap();
        });
        let said: Vec<Option<String>> =
            outcomes.into_iter().map(|r| r.err().map(|e| e.downcast_ref::<String>().cloned().unwrap_or_default())).collect();
        for r in [0, 1] {
            let m = said[r].as_deref().unwrap_or_else(|| panic!("rank {r} went on"));
            assert!(m.contains("stopped: the threads' world lost rank 2"), "rank {r}: {m}");
        }
        assert!(t0.elapsed() < std::time::Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    #[should_panic(expected = "rank 1 gives up")]
    fn a_failing_rank_fails_the_run_instead_of_hanging_it() {
        let ranks = Threads::world(2);
        Threads::run(&ranks, |c| {
            if c.rank() == 1 {
                panic!("rank 1 gives up");
            }
            c.barrier().unwrap();
        });
    }
}
