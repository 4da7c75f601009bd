//! Steady state allocates no batch buffers: counted with a global allocator.
//!
//! The sampler fills buffers it gets from a fixed pool, and the pin stage copies into buffers of
//! its own fixed pool; after warm-up neither path may call the allocator at all.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use pipeline::data::batch::BatchShape;
use pipeline::data::sampler::{Sampler, SequentialSampler, ShuffledSampler};
use pipeline::data::shard::{AccessMode, ShardFile, write_shard};
use pipeline::runtime::pool::Pool;

struct Counting;
static ALLOCS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn sampler_and_pin_pools_allocate_nothing_per_batch() {
    let dir = std::env::temp_dir().join(format!("pipeline-noalloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for s in 0..3 {
        let t: Vec<u16> = (0..50_000u32).map(|i| (i % 1000) as u16).collect();
        write_shard(&dir.join(format!("fineweb_train_{s:06}.bin")), &t).unwrap();
    }
    let files: Vec<Arc<ShardFile>> =
        (0..3).map(|s| Arc::new(ShardFile::open(&dir.join(format!("fineweb_train_{s:06}.bin")), s, AccessMode::Mmap).unwrap())).collect();
    let sh = BatchShape { seq_len: 256, rows: 8, micro_steps: 2, world_size: 1, rank: 0 };
    let n = 2 * sh.tokens();
    let sampler_pool = Pool::new(2, || vec![0u32; n]);
    let pin_pool = Pool::new(2, || vec![0u32; n]);
    let mut samplers: Vec<Box<dyn Sampler>> = vec![
        Box::new(ShuffledSampler::new(files.clone(), sh, Some(1000), 0, 1, None).unwrap()),
        Box::new(SequentialSampler::new(files, sh, Some(1000), None).unwrap()),
    ];
    for s in &mut samplers {
        let step = |s: &mut Box<dyn Sampler>| {
            let mut a = sampler_pool.take(None).unwrap();
            s.fill(&mut a).unwrap();
            let mut b = pin_pool.take(None).unwrap();
            b.copy_from_slice(&a);
            drop(a);
            drop(b);
        };
        for _ in 0..10 {
            step(s); // warm-up: internal scratch buffers reach their size
        }
        let before = ALLOCS.load(Ordering::Relaxed);
        for _ in 0..200 {
            step(s);
        }
        let per_batch = (ALLOCS.load(Ordering::Relaxed) - before) as f64 / 200.0;
        assert_eq!(per_batch, 0.0, "allocations per batch in steady state");
    }
    assert_eq!((sampler_pool.made(), pin_pool.made()), (2, 2));
    std::fs::remove_dir_all(&dir).unwrap();
}
