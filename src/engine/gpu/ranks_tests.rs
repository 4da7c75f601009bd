//! Data parallelism on the GPU backend, in the warp emulator: ranks as threads
//! ([`crate::dist::threads`]), each an engine over an emulated device whose collectives run
//! through NCCL's stand-in ([`super::emu_comm`]), which runs each collective as late as the GPU
//! may (at the join) and checks that no work touched its regions in between. The buckets,
//! their ready events, the units of work and their graphs are the CUDA device's.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;

use super::KernelBackend;
use super::emu::{self, EmuDevice};
use crate::dist::Collective;
use crate::dist::threads::Threads;
use crate::engine::Engine;
use crate::engine::cases::perturbed;
use crate::engine::layout::Layout;
use crate::engine::step::{OptimizerStep, kernel_capacity};
use crate::engine::tests::{baseline_small, tokens};
use crate::model::ModelConfig;

fn cfg() -> ModelConfig {
    ModelConfig { model_dim: 64, num_heads: 1, num_kv_heads: 1, num_layers: 2, ..baseline_small() }
}

const ROWS: usize = 1;
const T: usize = 64;

/// An engine on an emulated GPU with the perturbed weights of seed 3, graphs on.
fn engine(name: &str) -> Engine {
    let cfg = cfg();
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join(format!("ranks-{name}.mem")));
    let be = KernelBackend::new(dev, Layout::new(&cfg, ROWS, T).len(), kernel_capacity(&cfg, ROWS, T).unwrap()).unwrap();
    let mut e = Engine::with_backend(&cfg, ROWS, T, Box::new(be), false).unwrap();
    let params: HashMap<String, Tensor> = perturbed(&cfg, 3).state_dict().into_iter().collect();
    e.load_params(&params).unwrap();
    e.zero_grads();
    e
}

fn step() -> OptimizerStep {
    OptimizerStep { clip: 1.0, muon: crate::engine::cases::check_muon(), adam: [(0.01, 0.0); 3], betas: (0.9, 0.95), eps: 1e-8 }
}

/// Micro-batch `k` of step `s`.
fn batch(s: usize, k: usize) -> Vec<u32> {
    tokens((10 * s + k) as u64, ROWS * T + 1, cfg().vocab_size as u32)
}

fn weights(e: &Engine) -> Vec<f64> {
    e.params().unwrap().iter().flat_map(|(_, t)| crate::engine::tests::flat(t)).collect()
}

fn grads(e: &Engine) -> Vec<f64> {
    e.grads().unwrap().iter().flat_map(|(_, t)| crate::engine::tests::flat(t)).collect()
}

/// Two emulated GPU ranks, each with one micro-batch a step, train the weights of one with both:
/// gradients averaged in several buckets sent during the backward pass, Muon's updates
/// broadcast from their owners, all of it queued on the device inside the units of work, which
/// are captured and replayed as graphs. Every rank records the same collectives in the same
/// order: per step, one mean per bucket, then the broadcasts of Muon's updates.
#[test]
fn two_emulated_gpu_ranks_train_the_weights_of_one() {
    let steps = 3;
    let n = (ROWS * T) as f64;
    let mut one = engine("one");
    let mut first_grads = Vec::new();
    for s in 0..steps {
        for k in 0..2 {
            let b = batch(s, k);
            one.micro_step(&b[..ROWS * T], &b[1..], false, 0.5 / n);
        }
        if s == 0 {
            first_grads = grads(&one);
        }
        one.optimizer_step(&step()).unwrap();
    }
    let want = weights(&one);
    let ranks = Threads::world(2);
    let out = Threads::run(&ranks, move |c| {
        let r = c.rank();
        let mut e = engine(&format!("rank{r}"));
        // Buckets of 4 Ki elements (the first 1 Ki): several per pass.
        e.set_ranks(c as Arc<dyn Collective>, (1 << 10, 4 << 10), true).unwrap();
        let x = e.exchange().unwrap();
        assert!(x.on_device(), "the GPU backend queues its collectives");
        let buckets = x.buckets(false).len();
        let mut averaged = Vec::new();
        for s in 0..steps {
            let b = batch(s, r);
            let tokens = crate::engine::backend::Tokens::Host { x: &b[..ROWS * T], y: &b[1..] };
            let (_, stats) = e.exchanged_micro_step(tokens, false, 1.0 / n).unwrap();
            assert_eq!(stats.buckets, buckets);
            if s == 0 {
                averaged = grads(&e);
            }
            e.optimizer_step(&step()).unwrap();
        }
        (weights(&e), buckets, e.graph_counts().unwrap(), averaged)
    });
    for (r, (w, buckets, counts, averaged)) in out.iter().enumerate() {
        assert!(*buckets >= 3, "{buckets} buckets");
        // The exchange's own result, before clipping and the optimizers (which would hide a sum
        // in place of the mean: both are scale-free): the ranks' mean is one rank's gradient.
        let err = crate::engine::tests::rel_err(averaged, &first_grads);
        assert!(err < 1e-5, "rank {r}: step 1's averaged gradients {err:e} from one rank's");
        // Not bit for bit: one rank adds a gradient's uses across both micro-batches in one
        // sum, two ranks per micro-batch before the mean. Measured: 2.3e-4 here, and 2.3e-4
        // between one rank taking its two micro-batches in either order; a rank training on
        // its own micro-batch alone ends 9.8e-2 away.
        let err = crate::engine::tests::rel_err(w, &want);
        assert!(err < 1e-3, "rank {r}: weights {err:e} from one rank's");
        assert!(counts.replayed >= 2, "rank {r}: units with collectives are replayed as graphs: {counts:?}");
        let calls = ranks[0].calls(r);
        let means = calls.iter().filter(|c| c.op == "all_reduce(Mean)").count();
        let casts = calls.iter().filter(|c| c.op.starts_with("broadcast")).count();
        assert_eq!(means, steps * buckets, "rank {r}: {calls:?}");
        // Each Muon matrix from its owner, both owners used (the stand-in packs a group's pieces
        // per root).
        assert_eq!(casts, 2 * steps, "rank {r}: {calls:?}");
        assert!(calls.iter().any(|c| c.op == "broadcast(0)") && calls.iter().any(|c| c.op == "broadcast(1)"));
    }
    assert_eq!(ranks[0].calls(0), ranks[0].calls(1), "both ranks call the same collectives in the same order");
    assert_eq!(out[0].0, out[1].0, "the ranks hold the same weights, bit for bit");
}

/// A bucket sent before the backward pass has finished its gradients (here: every bucket at the
/// pass's first event) is caught by the stand-in: the pass writes a region whose all-reduce is
/// in flight.
#[test]
#[should_panic(expected = "while its collective")]
fn a_bucket_sent_before_its_gradients_are_final_is_caught() {
    let ranks = Threads::world(1);
    let c: Arc<dyn Collective> = ranks[0].clone();
    let mut e = engine("early");
    e.set_ranks(c.clone(), (1 << 10, 4 << 10), true).unwrap();
    let early = crate::engine::exchange::Exchange::new(e.schedule(), c, (1 << 10, 4 << 10), true, true).unwrap();
    let mut pass = early.pass(false);
    let b = batch(0, 0);
    let tokens = crate::engine::backend::Tokens::Host { x: &b[..ROWS * T], y: &b[1..] };
    let _ = e.micro_step_with(tokens, false, 1.0, &mut |be, _| pass.at(&early, be, usize::MAX));
}

/// A collective queued and never joined leaves the device's regions undefined for the host: a
/// read is refused, naming why (on a GPU it would read before NCCL wrote).
#[test]
fn a_host_read_before_the_join_is_refused() {
    use crate::engine::backend::{Backend, Buf};
    let ranks = Threads::world(1);
    let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join("ranks-unjoined.mem"));
    let mut be = KernelBackend::new(dev, 1024, kernel_capacity(&cfg(), ROWS, T).unwrap()).unwrap();
    assert!(be.set_comm(ranks[0].clone()).unwrap(), "the GPU backend queues collectives");
    let region = Buf { off: 256, len: 64 };
    be.upload(region, &Tensor::ones(64, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap()).unwrap();
    be.comm_all_reduce(&[region], crate::dist::ReduceOp::Sum);
    let err = be.download(region, &[64]).unwrap_err();
    assert!(format!("{err:#}").contains("in flight"), "{err:#}");
    be.comm_join();
    assert_eq!(be.download(region, &[64]).unwrap().to_vec1::<f32>().unwrap(), vec![1.0; 64]);
    assert_eq!(ranks[0].calls(0).len(), 1);
}

/// engine-check's check of the collectives ([`super::comm::comm_check`]) passes on emulated
/// ranks: two (the mean, the broadcast from the last rank and the compute beside them give the
/// values of two ranks, in the op-by-op, captured and replayed rounds) and one (what a GPU runs).
#[test]
fn the_collectives_check_passes_on_one_and_two_emulated_ranks() {
    for world in [1, 2] {
        let ranks = Threads::world(world);
        let out = Threads::run(&ranks, |c| {
            let dev = EmuDevice::new(emu::emulator(), emu::temp_dir().join(format!("comm-check-{}-{}.mem", c.world(), c.rank())));
            let mut be = KernelBackend::new(dev, super::comm::CHECK_ARENA, kernel_capacity(&cfg(), ROWS, T).unwrap()).unwrap();
            super::comm::comm_check(&mut be, c, 1).unwrap()
        });
        for flags in out {
            assert_eq!(flags.len(), 2);
            for (what, ok, detail) in flags {
                assert!(ok, "world {world}: {what}: {detail}");
            }
        }
        assert_eq!(ranks[0].calls(0).iter().filter(|c| c.op == "all_reduce(Mean)").count(), 3);
    }
}
