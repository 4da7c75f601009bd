//! Window samplers: the sequential stream matches the reference loader; shuffled rows are
//! windows of owned shards that cover each shard epoch once; order does not depend on the
//! worker count; N batches equal N/2 + save + restore + N/2; resident memory stays small on a
//! 10 GB glob.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use pipeline::data::batch::{BatchShape, LoaderState};
use pipeline::data::sampler::{Sampler, SequentialSampler, ShuffledSampler};
use pipeline::data::shard::{AccessMode, ShardFile, write_shard};

/// Token at position `p` of shard `s`: invertible for s < 16, p < 4096.
fn tok(s: usize, p: usize) -> u16 {
    ((s << 12) | p) as u16
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pipeline-sampler-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn make_shards(dir: &Path, sizes: &[usize]) -> Vec<Vec<u16>> {
    sizes
        .iter()
        .enumerate()
        .map(|(s, &n)| {
            let t: Vec<u16> = (0..n).map(|p| tok(s, p)).collect();
            write_shard(&dir.join(format!("fineweb_train_{s:06}.bin")), &t).unwrap();
            t
        })
        .collect()
}

fn open(dir: &Path, n: usize, mode: AccessMode) -> Vec<Arc<ShardFile>> {
    let paths: Vec<PathBuf> = (0..n).map(|s| dir.join(format!("fineweb_train_{s:06}.bin"))).collect();
    ShardFile::open_all(&paths, mode).unwrap()
}

fn shape(seq_len: usize, rows: usize, world: usize, rank: usize) -> BatchShape {
    BatchShape { seq_len, rows, micro_steps: 2, world_size: world, rank }
}

#[test]
fn sequential_matches_the_reference_token_stream() {
    let dir = scratch("seq");
    let sizes = [1000, 777, 1500];
    let toks = make_shards(&dir, &sizes);
    let stream: Vec<u16> = toks.concat();
    for (world, rank) in [(1, 0), (2, 0), (2, 1), (4, 3)] {
        for mode in [AccessMode::Mmap, AccessMode::Pread] {
            let sh = shape(16, 4, world, rank);
            let local = sh.tokens();
            let mut s = SequentialSampler::new(open(&dir, 3, mode), sh, None, None).unwrap();
            let mut buf = vec![0u32; 2 * local];
            let mut cursor = 0usize;
            for step in 0..200 {
                s.fill(&mut buf).unwrap();
                // Reference: take span * world tokens from the wrapping stream; rank r uses slice r.
                let span = local + 1;
                let chunk: Vec<u16> = (0..span * world).map(|i| stream[(cursor + i) % stream.len()]).collect();
                cursor = (cursor + span * world) % stream.len();
                let mine = &chunk[rank * span..(rank + 1) * span];
                let x: Vec<u32> = mine[..local].iter().map(|&t| t as u32).collect();
                let y: Vec<u32> = mine[1..].iter().map(|&t| t as u32).collect();
                assert_eq!(&buf[..local], &x[..], "x differs at micro-step {step} (world {world}, rank {rank}, {mode:?})");
                assert_eq!(&buf[local..], &y[..], "y differs at micro-step {step}");
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shuffled_rows_are_windows_of_owned_shards_covering_each_epoch_once() {
    let dir = scratch("shuf");
    let sizes = [4000, 3000, 4000, 2500];
    make_shards(&dir, &sizes);
    let (t, rows) = (16usize, 8usize);
    let sh = shape(t, rows, 2, 1); // rank 1 of 2 owns shards 1 and 3
    let mut s = ShuffledSampler::new(open(&dir, 4, AccessMode::Mmap), sh, None, 42, 1, None).unwrap();
    let mut buf = vec![0u32; 2 * sh.tokens()];
    let mut windows: Vec<(usize, u64)> = Vec::new();
    let mut phase_of = std::collections::HashMap::new();
    // Fill until the first shard epoch ends; the state then says how many rows of the last
    // batch already belong to the second epoch.
    let epoch0_rows = loop {
        s.fill(&mut buf).unwrap();
        for r in 0..rows {
            let x = &buf[r * t..(r + 1) * t];
            let y = &buf[sh.tokens() + r * t..sh.tokens() + (r + 1) * t];
            let (shard, start) = ((x[0] >> 12) as usize, (x[0] & 0xfff) as u64);
            assert_eq!(shard % 2, 1, "rank 1 must only see odd shards, got {shard}");
            for j in 0..t {
                assert_eq!(x[j], tok(shard, start as usize + j) as u32, "x row is not a contiguous window");
                assert_eq!(y[j], tok(shard, start as usize + j + 1) as u32, "y is not x shifted by one");
            }
            windows.push((shard, start));
        }
        let LoaderState::Shuffled { shards, .. } = s.state() else { panic!("shuffled state expected") };
        if shards.iter().all(|c| c.epoch > 0) {
            let into_next: u64 = shards.iter().map(|c| c.consumed).sum();
            break windows.len() - into_next as usize;
        }
    };
    let epoch0 = &windows[..epoch0_rows];
    for &(shard, start) in epoch0 {
        let phase = *phase_of.entry(shard).or_insert(start % t as u64);
        assert_eq!(start % t as u64, phase, "starts of one shard epoch share a phase");
    }
    let unique: std::collections::HashSet<_> = epoch0.iter().collect();
    assert_eq!(unique.len(), epoch0.len(), "a window was used twice in one epoch");
    // Every sequence of every owned shard was used: m = (n - 1 - phase) / t per shard.
    let expected: usize = [1usize, 3].iter().map(|&s| (sizes[s] - 1 - phase_of[&s] as usize) / t).sum();
    assert_eq!(epoch0.len(), expected, "one epoch must use every sequence of every owned shard exactly once");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn run(s: &mut dyn Sampler, n: usize) -> Vec<(u64, Vec<u32>)> {
    let mut buf = vec![0u32; 2 * s.shape().tokens()];
    (0..n).map(|_| (s.fill(&mut buf).unwrap(), buf.clone())).collect()
}

#[test]
fn worker_count_does_not_change_the_shuffled_order() {
    let dir = scratch("workers");
    make_shards(&dir, &[4000, 3900, 4000]);
    let sh = shape(32, 16, 1, 0);
    let mut one = ShuffledSampler::new(open(&dir, 3, AccessMode::Mmap), sh, None, 7, 1, None).unwrap();
    let mut four = ShuffledSampler::new(open(&dir, 3, AccessMode::Pread), sh, None, 7, 4, None).unwrap();
    assert_eq!(run(&mut one, 40), run(&mut four, 40));
    // And the seed matters.
    let mut other = ShuffledSampler::new(open(&dir, 3, AccessMode::Mmap), sh, None, 8, 1, None).unwrap();
    let mut again = ShuffledSampler::new(open(&dir, 3, AccessMode::Mmap), sh, None, 7, 1, None).unwrap();
    assert_ne!(run(&mut other, 5), run(&mut again, 5));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn n_batches_equal_half_plus_save_restore_plus_half() {
    let dir = scratch("resume");
    make_shards(&dir, &[1000, 2000, 1500, 900]);
    let sh = shape(32, 8, 1, 0);
    let n = 60; // several shard epochs for the shuffled sampler, several wraps for the stream
    for workers in [1, 4] {
        for sequential in [true, false] {
            let make = |state: Option<&LoaderState>| -> Box<dyn Sampler> {
                if sequential {
                    Box::new(SequentialSampler::new(open(&dir, 4, AccessMode::Mmap), sh, None, state).unwrap())
                } else {
                    Box::new(ShuffledSampler::new(open(&dir, 4, AccessMode::Mmap), sh, None, 3, workers, state).unwrap())
                }
            };
            let whole = run(make(None).as_mut(), n);
            let mut first = make(None);
            let mut parts = run(first.as_mut(), n / 2);
            let saved = serde_json::to_string(&first.state()).unwrap();
            drop(first);
            let restored: LoaderState = serde_json::from_str(&saved).unwrap();
            assert!(saved.len() < 1024, "loader state should be small, is {} bytes", saved.len());
            let mut second = make(Some(&restored));
            parts.extend(run(second.as_mut(), n - n / 2));
            for (i, (a, b)) in whole.iter().zip(&parts).enumerate() {
                assert_eq!(a.0, b.0, "fingerprint differs at micro-batch {i} (sequential {sequential}, workers {workers})");
                assert_eq!(a.1, b.1, "tokens differ at micro-batch {i}");
            }
            assert_eq!(make(None).state(), make(None).state());
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn token_ids_at_or_above_the_vocabulary_are_named() {
    let dir = scratch("vocab");
    make_shards(&dir, &[3000]);
    let sh = shape(16, 4, 1, 0);
    let mut s = ShuffledSampler::new(open(&dir, 1, AccessMode::Mmap), sh, Some(100), 0, 1, None).unwrap();
    let mut buf = vec![0u32; 2 * sh.tokens()];
    let e = (0..10).find_map(|_| s.fill(&mut buf).err()).expect("ids >= 100 must be caught").to_string();
    assert!(e.contains("fineweb_train_000000.bin") && e.contains("vocabulary size 100"), "{e}");
    let mut q = SequentialSampler::new(open(&dir, 1, AccessMode::Pread), sh, Some(100), None).unwrap();
    let e = (0..10).find_map(|_| q.fill(&mut buf).err()).expect("ids >= 100 must be caught").to_string();
    assert!(e.contains("is not below the tokenizer's vocabulary size 100"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)).unwrap().parse().unwrap();
    kb / 1024.0
}

#[test]
fn resident_memory_stays_small_on_a_10_gb_glob() {
    let dir = scratch("sparse");
    // Ten sparse 1 GB shards: a real header, then a hole that reads as token 0.
    let tokens_per_shard: u64 = 500_000_000;
    for s in 0..10 {
        let p = dir.join(format!("fineweb_train_{s:06}.bin"));
        pipeline::data::shard::write_raw(&p, &[pipeline::data::shard::MAGIC, 1, tokens_per_shard as i32], &[]).unwrap();
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(1024 + 2 * tokens_per_shard).unwrap();
    }
    let sh = BatchShape { seq_len: 2048, rows: 48, micro_steps: 8, world_size: 1, rank: 0 };
    let mut buf = vec![0u32; 2 * sh.tokens()];
    let before = rss_mb();
    for mode in [AccessMode::Mmap, AccessMode::Pread] {
        let mut s = ShuffledSampler::new(open(&dir, 10, mode), sh, None, 0, 2, None).unwrap();
        for _ in 0..800 {
            s.fill(&mut buf).unwrap();
        }
        let mut q = SequentialSampler::new(open(&dir, 10, mode), sh, None, None).unwrap();
        for _ in 0..800 {
            q.fill(&mut buf).unwrap();
        }
        let rss = rss_mb();
        // 800 shuffled micro-batches touch about 300 MB of distinct pages; the reader must not keep them.
        assert!(rss < 200.0, "{mode:?}: resident memory {rss:.0} MB (was {before:.0} MB before sampling) while sampling a 10 GB glob");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
