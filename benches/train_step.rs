//! One CPU training step of a small GPT: forward, backward, and the optimizer step with the
//! challenge script's parameter groups (Muon for block matrices, Adam for the embedding and the
//! control tensors), in tokens per second, with the share of each phase.
//!
//! Model: 4 layers, width 128, 4 heads (2 KV heads), vocabulary 1024, about 0.59 M parameters
//! (the planned CPU demo model). Shapes: 64 x 64 and 16 x 256 tokens per micro-batch (4,096
//! tokens each).
//!
//! Run: `cargo bench --bench train_step`.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pipeline::model::{Gpt, ModelConfig, ParamGroup};
use pipeline::optim::{Adam, Muon};

fn demo_model() -> Gpt {
    let cfg = ModelConfig { vocab_size: 1024, num_layers: 4, model_dim: 128, num_heads: 4, num_kv_heads: 2, ..ModelConfig::default() };
    Gpt::new(&cfg, 0, DType::F32, &Device::Cpu).expect("demo model builds")
}

fn group(m: &Gpt, g: ParamGroup) -> Vec<(String, Var)> {
    m.params().iter().filter(|(_, _, x)| *x == g).map(|(n, v, _)| (n.clone(), v.clone())).collect()
}

struct Step {
    model: Gpt,
    muon: Muon,
    adam_embed: Adam,
    adam_scalar: Adam,
    x: Tensor,
    y: Tensor,
}

impl Step {
    fn new(rows: usize, seq: usize) -> Self {
        let model = demo_model();
        let muon = Muon::new(group(&model, ParamGroup::Matrix), 0.04, 0.95, 5).unwrap();
        let adam_embed = Adam::new(group(&model, ParamGroup::Embedding), 0.05, (0.9, 0.95), 1e-8).unwrap().with_prefix("adam_embed");
        let adam_scalar = Adam::new(group(&model, ParamGroup::Scalar), 0.04, (0.9, 0.95), 1e-8).unwrap().with_prefix("adam_scalar");
        let mut rng = fastrand::Rng::with_seed(1);
        let toks: Vec<u32> = (0..rows * (seq + 1)).map(|_| rng.u32(0..1024)).collect();
        let x: Vec<u32> = (0..rows).flat_map(|r| toks[r * (seq + 1)..r * (seq + 1) + seq].to_vec()).collect();
        let y: Vec<u32> = (0..rows).flat_map(|r| toks[r * (seq + 1) + 1..(r + 1) * (seq + 1)].to_vec()).collect();
        let x = Tensor::from_vec(x, (rows, seq), &Device::Cpu).unwrap();
        let y = Tensor::from_vec(y, (rows, seq), &Device::Cpu).unwrap();
        Self { model, muon, adam_embed, adam_scalar, x, y }
    }

    /// One step; returns the time of (forward, backward, optimizer).
    fn run(&mut self) -> [Duration; 3] {
        let t0 = Instant::now();
        let loss = self.model.loss(&self.x, &self.y).unwrap();
        let t1 = Instant::now();
        let grads = loss.backward().unwrap();
        let t2 = Instant::now();
        self.muon.step(&grads, 0.04, 0.95).unwrap();
        self.adam_embed.step(&grads, 0.05).unwrap();
        self.adam_scalar.step(&grads, 0.04).unwrap();
        [t1 - t0, t2 - t1, t2.elapsed()]
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("train_step/demo_model");
    // Steps take hundreds of ms on 2 cores: 10 samples keep the run to about a minute.
    g.sample_size(10).measurement_time(Duration::from_secs(8)).throughput(Throughput::Elements(4096));
    let mut table = Vec::new();
    for (rows, seq) in [(64usize, 64usize), (16, 256)] {
        let mut step = Step::new(rows, seq);
        g.bench_function(format!("{rows}x{seq}"), |b| b.iter(|| step.run()));
        let mut sum = [Duration::ZERO; 3];
        let n = 5;
        for _ in 0..n {
            for (s, d) in sum.iter_mut().zip(step.run()) {
                *s += d;
            }
        }
        table.push((rows, seq, sum.map(|d| d.as_secs_f64() * 1e3 / n as f64)));
    }
    g.finish();
    println!("\ndemo model ({} parameters), one training step of 4,096 tokens on CPU:", demo_model().param_count());
    println!("{:<10} {:>10} {:>12} {:>10} {:>10} {:>10}", "shape", "ms/step", "tokens/s", "forward", "backward", "optimizer");
    for (rows, seq, [f, b, o]) in table {
        let total = f + b + o;
        println!(
            "{:<10} {:>10.1} {:>12.0} {:>9.0}% {:>9.0}% {:>9.0}%",
            format!("{rows}x{seq}"),
            total,
            4096.0 / (total / 1e3),
            100.0 * f / total,
            100.0 * b / total,
            100.0 * o / total
        );
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
