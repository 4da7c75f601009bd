//! GPTQ time per matrix ([`pipeline::artifact::gptq::quantize_matrix`]) at the 2026-04-09
//! record's matrix shapes.
//!
//! Shapes (`[rows, cols]` = `[out, in]`): c_q 512x512, c_k 256x512 (c_v is the same shape),
//! mlp.fc 2048x512, mlp.proj 512x2048 (the one with a 2048x2048 Hessian), tok_emb 8192x512.
//! Weights are random with std 0.02, the scales SD-clip (k = 12.85, int6; the embedding k = 20,
//! int8), `H = X^T X / n` for a random `X` of n = 4096 rows whose columns share 4 factors and
//! differ in size, so `H` has off-diagonal mass and act-order has something to sort. Only
//! `quantize_matrix` is timed (the Hessian and the scales are made once per shape), with the
//! record's settings ([`GptqConfig::default`]: damping 0.01, blocks of 128, act-order).
//!
//! Run: `cargo bench --bench gptq` (about a minute on 2 cores); one shape:
//! `cargo bench --bench gptq -- mlp.proj`. The whole record (67 matrices) is timed by the ignored
//! test `artifact::gptq::tests::record_matrices_time`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use pipeline::artifact::gptq::{GptqConfig, quantize_matrix, sd_clip_scales};
use synthetic::{correlated_hessian, normal};

/// The tests' synthetic inputs (one source for both).
#[path = "../src/artifact/synthetic.rs"]
mod synthetic;

/// Rows of the random `X` behind each Hessian.
const SAMPLES: usize = 4096;

fn bench(c: &mut Criterion) {
    let h512 = correlated_hessian(512, SAMPLES, 1);
    let h2048 = correlated_hessian(2048, SAMPLES, 2);
    let cfg = GptqConfig::default();
    let mut g = c.benchmark_group("gptq");
    // Whole-matrix runs of 0.05 to 1 s: 10 samples (criterion's minimum) keep the run short.
    g.sample_size(10).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    let shapes = [
        ("c_q_512x512", 512, 512, 31i8, 12.85),
        ("c_k_256x512", 256, 512, 31, 12.85),
        ("mlp.fc_2048x512", 2048, 512, 31, 12.85),
        ("mlp.proj_512x2048", 512, 2048, 31, 12.85),
        ("tok_emb_8192x512", 8192, 512, 127, 20.0),
    ];
    let mut rng = fastrand::Rng::with_seed(3);
    for (name, rows, cols, qmax, k) in shapes {
        let w: Vec<f32> = (0..rows * cols).map(|_| (normal(&mut rng) * 0.02) as f32).collect();
        let s: Vec<f32> = sd_clip_scales(&w, rows, cols, qmax, k).iter().map(|v| v.to_f32()).collect();
        let h = if cols == 2048 { &h2048 } else { &h512 };
        g.bench_function(name, |b| b.iter(|| black_box(quantize_matrix(&w, rows, cols, h, &s, qmax, &cfg).unwrap())));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
