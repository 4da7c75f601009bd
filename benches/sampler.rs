//! Micro-batch build time of the samplers, side by side with a single-threaded numpy
//! implementation of the same shuffled algorithm (`scripts/bench_numpy_sampler.py`).
//!
//! Shape: the 2026-04-09 record's micro-batch, 48 rows x 2048 tokens = 98,304 tokens.
//! Shards: `SAMPLER_BENCH_SHARDS` (a glob), else `../shared/data/golf_en_sp8192` when present,
//! else six synthetic 1,000,000-token shards made in a temporary folder.
//!
//! Run: `cargo bench --bench sampler` (needs python3 with numpy for the numpy figure; without it
//! the Rust figures are still printed). The target: the shuffled sampler builds a
//! micro-batch in at most a quarter of numpy's time.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pipeline::data::batch::BatchShape;
use pipeline::data::sampler::{Sampler, SequentialSampler, ShuffledSampler};
use pipeline::data::shard::{AccessMode, ShardFile, glob_sorted, write_shard};

const ROWS: usize = 48;
const SEQ: usize = 2048;

fn shard_glob() -> String {
    if let Ok(g) = std::env::var("SAMPLER_BENCH_SHARDS") {
        return g;
    }
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/golf_en_sp8192");
    if shared.is_dir() {
        return shared.join("fineweb_train_*.bin").display().to_string();
    }
    let dir = std::env::temp_dir().join(format!("pipeline-sampler-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = fastrand::Rng::with_seed(7);
    for s in 0..6 {
        let toks: Vec<u16> = (0..1_000_000).map(|_| rng.u16(0..8192)).collect();
        write_shard(&dir.join(format!("fineweb_train_{s:06}.bin")), &toks).unwrap();
    }
    dir.join("fineweb_train_*.bin").display().to_string()
}

fn open(glob: &str, mode: AccessMode) -> Vec<Arc<ShardFile>> {
    ShardFile::open_all(&glob_sorted(glob).unwrap(), mode).unwrap()
}

fn shape() -> BatchShape {
    BatchShape { seq_len: SEQ, rows: ROWS, micro_steps: 8, world_size: 1, rank: 0 }
}

fn mean_ms(mut f: impl FnMut(), n: usize) -> f64 {
    for _ in 0..10 {
        f();
    }
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    t.elapsed().as_secs_f64() * 1e3 / n as f64
}

fn bench(c: &mut Criterion) {
    let glob = shard_glob();
    let mut buf = vec![0u32; 2 * ROWS * SEQ];
    let mut g = c.benchmark_group("sampler/98304_tokens");
    // Each iteration builds one micro-batch; 10 samples keep the run short on 2 cores.
    g.sample_size(10).measurement_time(Duration::from_secs(4)).throughput(Throughput::Elements((ROWS * SEQ) as u64));
    let mut rows = Vec::new();
    for (name, mode, workers) in
        [("shuffled_mmap_w1", AccessMode::Mmap, 1), ("shuffled_mmap_w2", AccessMode::Mmap, 2), ("shuffled_pread_w1", AccessMode::Pread, 1)]
    {
        let mut s = ShuffledSampler::new(open(&glob, mode), shape(), Some(65_536), 0, workers, None).unwrap();
        g.bench_function(name, |b| b.iter(|| s.fill(&mut buf).unwrap()));
        rows.push((
            name,
            mean_ms(
                || {
                    s.fill(&mut buf).unwrap();
                },
                200,
            ),
        ));
    }
    let mut s = SequentialSampler::new(open(&glob, AccessMode::Mmap), shape(), Some(65_536), None).unwrap();
    g.bench_function("sequential_mmap", |b| b.iter(|| s.fill(&mut buf).unwrap()));
    rows.push((
        "sequential_mmap",
        mean_ms(
            || {
                s.fill(&mut buf).unwrap();
            },
            200,
        ),
    ));
    g.finish();

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/bench_numpy_sampler.py");
    let numpy = std::process::Command::new("python3")
        .arg(&script)
        .args(["--shards", &glob, "--rows", &ROWS.to_string(), "--seq-len", &SEQ.to_string()])
        .output();
    let numpy_ms = numpy.ok().filter(|o| o.status.success()).and_then(|o| {
        let s = String::from_utf8_lossy(&o.stdout).to_string();
        s.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok())
    });
    println!("\nmicro-batch of {ROWS} x {SEQ} = {} tokens from {glob}", ROWS * SEQ);
    println!("{:<22} {:>12} {:>14}", "sampler", "ms / batch", "vs numpy");
    if let Some(n) = numpy_ms {
        println!("{:<22} {:>12.3} {:>14}", "numpy (1 thread)", n, "1.00x");
    }
    for (name, ms) in rows {
        let ratio = numpy_ms.map(|n| format!("{:.2}x time", ms / n)).unwrap_or_else(|| "(no numpy)".into());
        println!("{name:<22} {ms:>12.3} {ratio:>14}");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
