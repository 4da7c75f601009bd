//! One CPU training step of the demo model, as the step executor takes it (forward, backward,
//! Muon + Adam with the challenge's groups), in tokens per second, with the share of each phase:
//! on candle's autograd ([`Trainer`], `impl = "candle"`) and on the explicit engine
//! ([`EngineTrainer`], `impl = "engine"`, f32), side by side in one run.
//!
//! Model: `pipelines/demo.toml`'s (4 layers, width 128, 4 heads with 2 KV heads, vocabulary
//! 1024: 592,144 parameters). Shapes: 16 x 256 (the demo's micro-batch) and 64 x 64, both 4,096
//! tokens per step.
//!
//! Run: `cargo bench --bench train_step`.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pipeline::model::{Gpt, ModelConfig};
use pipeline::train::config::TrainConfig;
use pipeline::train::engine_trainer::{EngineOptions, EngineTrainer};
use pipeline::train::executor::Executor;
use pipeline::train::trainer::Trainer;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn demo_model() -> Gpt {
    let cfg = ModelConfig { vocab_size: 1024, num_layers: 4, model_dim: 128, num_heads: 4, num_kv_heads: 2, ..ModelConfig::default() };
    Gpt::new(&cfg, 0, DType::F32, &Device::Cpu).expect("demo model builds")
}

struct Step {
    trainer: Box<dyn Executor>,
    x: Tensor,
    y: Tensor,
}

impl Step {
    fn new(executor: &str, rows: usize, seq: usize) -> Self {
        let cfg = TrainConfig { max_wallclock_seconds: 0.0, ..TrainConfig::default() };
        let trainer: Box<dyn Executor> = match executor {
            "engine" => Box::new(EngineTrainer::new(demo_model(), &cfg, 1, (rows, seq), EngineOptions::default()).unwrap()),
            _ => Box::new(Trainer::new(demo_model(), &cfg, 1).unwrap()),
        };
        let mut rng = fastrand::Rng::with_seed(1);
        let toks: Vec<u32> = (0..rows * (seq + 1)).map(|_| rng.u32(0..1024)).collect();
        let x: Vec<u32> = (0..rows).flat_map(|r| toks[r * (seq + 1)..r * (seq + 1) + seq].to_vec()).collect();
        let y: Vec<u32> = (0..rows).flat_map(|r| toks[r * (seq + 1) + 1..(r + 1) * (seq + 1)].to_vec()).collect();
        let x = Tensor::from_vec(x, (rows, seq), &Device::Cpu).unwrap();
        let y = Tensor::from_vec(y, (rows, seq), &Device::Cpu).unwrap();
        Self { trainer, x, y }
    }

    /// One step; returns the time of (forward, backward, optimizer).
    fn run(&mut self) -> [Duration; 3] {
        let m = self.trainer.micro_step(&self.x, &self.y).unwrap();
        let o = self.trainer.finish_step(0.0).unwrap();
        [m.forward, m.backward, o.phases.optimizer]
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("train_step/demo_model");
    // Steps take a few hundred ms on 2 cores: 10 samples keep the run to about a minute.
    g.sample_size(10).measurement_time(Duration::from_secs(8)).throughput(Throughput::Elements(4096));
    let mut table = Vec::new();
    for (executor, (rows, seq)) in ["candle", "engine"].into_iter().flat_map(|e| [(16usize, 256usize), (64, 64)].map(|s| (e, s))) {
        let mut step = Step::new(executor, rows, seq);
        g.bench_function(format!("{executor}/{rows}x{seq}"), |b| b.iter(|| step.run()));
        let mut sum = [Duration::ZERO; 3];
        let n = 5;
        let t0 = Instant::now();
        for _ in 0..n {
            for (s, d) in sum.iter_mut().zip(step.run()) {
                *s += d;
            }
        }
        let wall = t0.elapsed().as_secs_f64() * 1e3 / n as f64;
        table.push((executor, rows, seq, wall, sum.map(|d| d.as_secs_f64() * 1e3 / n as f64)));
    }
    g.finish();
    println!("\ndemo model ({} parameters), one training step of 4,096 tokens on CPU:", demo_model().param_count());
    println!(
        "{:<8} {:<10} {:>10} {:>12} {:>10} {:>10} {:>10}",
        "executor", "shape", "ms/step", "tokens/s", "forward", "backward", "optimizer"
    );
    for (executor, rows, seq, wall, [f, b, o]) in table {
        let total = f + b + o;
        println!(
            "{:<8} {:<10} {:>10.1} {:>12.0} {:>9.0}% {:>9.0}% {:>9.0}%",
            executor,
            format!("{rows}x{seq}"),
            wall,
            4096.0 / (wall / 1e3),
            100.0 * f / total,
            100.0 * b / total,
            100.0 * o / total
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
