//! The `pipeline` command line: `run`, `validate`, `report`, `stages`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};

use pipeline::cli::run::{self, RunError};
use pipeline::model::attention_trial::{AttentionShape, TrialSettings};
use pipeline::report::document::Report;
use pipeline::runtime::config;
use pipeline::runtime::control::Control;
use pipeline::runtime::graph;
use pipeline::stages::REGISTRY;
use pipeline::train::config::Config;

/// `println!` that takes a closed stdout (a pipe to `head`, a terminal gone after SIGHUP) as
/// nothing to print to, instead of panicking: the run directory has everything.
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($t)*);
    }};
}

/// `print!`, likewise.
macro_rules! out_raw {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = write!(std::io::stdout().lock(), $($t)*);
    }};
}

/// `eprintln!`, likewise.
macro_rules! err {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stderr().lock(), $($t)*);
    }};
}

/// mimalloc keeps freed tensor buffers for reuse: with glibc's allocator every large CPU
/// tensor was a fresh mmap, and page faults plus TLB shootdowns on munmap took about a fifth
/// of a demo training step (perf).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// GPT training as a declarative graph of measured stages.
#[derive(Parser)]
#[command(name = "pipeline", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline and write its run directory (config.toml, report.json).
    Run {
        /// The pipeline config (TOML).
        config: PathBuf,
        /// Run directory (default: <[run] out_dir>/<name>-<UTC time>).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Override a config value: --set stages.mid.delay_us=2000 (repeatable; read as TOML).
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Print only errors and the final report, no progress lines.
        #[arg(long, short)]
        quiet: bool,
        /// Continue a run from a checkpoint: a run directory (its newest checkpoint) or a
        /// checkpoint file. The run goes on in that run directory unless --out names another.
        #[arg(long, value_name = "RUN_DIR|CHECKPOINT")]
        resume: Option<PathBuf>,
    },
    /// Check a pipeline config without running it (exit 2 on any problem).
    Validate {
        /// The pipeline config (TOML).
        config: PathBuf,
        /// Override a config value, as for `run`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// Print the bottleneck report of a finished run.
    Report {
        /// The run directory (holding report.json).
        run_dir: PathBuf,
        /// Print report.json instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Data preparation.
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Quantize a weights file into the challenge's compressed artifact, report its size against
    /// the 16,000,000-byte cap, and score the round trip on the validation split.
    Artifact {
        /// The weights (safetensors, e.g. RUN_DIR/final_model.safetensors).
        weights: PathBuf,
        /// The config the weights were trained with ([model], [data] val and tokenizer, [train]
        /// seq_len and val_* keys), e.g. RUN_DIR/config.toml.
        #[arg(long)]
        config: PathBuf,
        /// Override a config value, as for `run`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Bits per quantized weight (8 as the baseline; 6 as the later records).
        #[arg(long, default_value_t = 8)]
        bits: u8,
        /// Compressor: zlib (the baseline's), zstd or brotli.
        #[arg(long, default_value = "zlib")]
        codec: pipeline::artifact::quant::Codec,
        /// Compression level (default: zlib 9, zstd 22, brotli 11).
        #[arg(long)]
        level: Option<i32>,
        /// Where to write the artifact (default: beside the weights, <stem>.int<bits>.<codec>.pgqz).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Score only the first N validation targets (0: the whole split, the challenge's rule).
        #[arg(long, default_value_t = 0)]
        val_max_tokens: usize,
    },
    /// Compare a device with the CPU: a small seeded GPT's loss and gradients on one batch,
    /// against f64 on the CPU (exit 1 when an error is beyond its bound: in f32 one tolerance,
    /// in bf16 each quantity's from the error the bf16 graph should have).
    Parity {
        /// The device: "cpu" or "cuda:N".
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Parameter dtype on the device: f32 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Seed of the weights and the batch.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Time one flash-attention implementation's forward and backward pass at a micro-batch's
    /// shapes, after checking it against the materialised attention in f32 (what `attention =
    /// "auto"` runs, one process per implementation). Exit 0 with the outcome, even a rejection.
    AttentionTrial {
        /// The device: "cuda:N" (on the CPU every flash implementation is left out).
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// The implementation: "flash" (WMMA) or "flash_mma" (register fragments).
        #[arg(long)]
        kernels: String,
        /// Sequences per micro-batch.
        #[arg(long, default_value_t = 64)]
        batch: usize,
        /// Tokens per sequence (a multiple of 64).
        #[arg(long, default_value_t = 1024)]
        seq_len: usize,
        /// Query heads.
        #[arg(long, default_value_t = 8)]
        heads: usize,
        /// Key/value heads.
        #[arg(long, default_value_t = 4)]
        kv_heads: usize,
        /// Channels per head.
        #[arg(long, default_value_t = 64)]
        head_dim: usize,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
    /// List stage kinds, their implementations and parameters.
    Stages {
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize text into challenge-format train and val shards plus manifest.json.
    ///
    /// Inputs: .jsonl (one object per line with a string field `text`) or text files, where two
    /// or more consecutive blank lines separate documents. The first documents are the val split.
    Prepare {
        /// The sentencepiece model (.model).
        #[arg(long)]
        tokenizer: PathBuf,
        /// Input files (.jsonl or text), in order.
        #[arg(long = "input", required = true, num_args = 1..)]
        inputs: Vec<PathBuf>,
        /// Output folder for the shards and manifest.json.
        #[arg(long)]
        out: PathBuf,
        /// The first N documents are the val split.
        #[arg(long, conflicts_with = "val_frac")]
        val_docs: Option<usize>,
        /// The first fraction F of the documents are the val split (default 0.05).
        #[arg(long)]
        val_frac: Option<f64>,
        /// Tokens per shard (the challenge uses 100,000,000).
        #[arg(long, default_value_t = 100_000_000)]
        shard_tokens: usize,
        /// Replace shards already in the output folder.
        #[arg(long)]
        force: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run { config, out, sets, quiet, resume } => cmd_run(config, out, sets, quiet, resume),
        Command::Validate { config, sets } => cmd_validate(config, sets),
        Command::Report { run_dir, json } => cmd_report(run_dir, json),
        Command::Stages { json } => cmd_stages(json),
        Command::Parity { device, dtype, seed, json } => cmd_parity(&device, &dtype, seed, json),
        Command::AttentionTrial { device, kernels, batch, seq_len, heads, kv_heads, head_dim, json } => {
            cmd_attention_trial(&device, &kernels, AttentionShape { batch, t: seq_len, heads, kv_heads, head_dim }, json)
        }
        Command::Artifact { weights, config, sets, bits, codec, level, out, val_max_tokens } => {
            cmd_artifact(weights, config, sets, pipeline::artifact::quant::QuantConfig { bits, codec, level }, out, val_max_tokens)
        }
        Command::Data { command: DataCommand::Prepare { tokenizer, inputs, out, val_docs, val_frac, shard_tokens, force } } => {
            let val = match (val_docs, val_frac) {
                (Some(n), _) => pipeline::data::prepare::ValSplit::Docs(n),
                (None, f) => pipeline::data::prepare::ValSplit::Frac(f.unwrap_or(0.05)),
            };
            cmd_prepare(pipeline::data::prepare::PrepareOptions { tokenizer, inputs, out, val, shard_tokens, force })
        }
    };
    ExitCode::from(code as u8)
}

fn cmd_run(path: PathBuf, out: Option<PathBuf>, sets: Vec<String>, quiet: bool, resume: Option<PathBuf>) -> i32 {
    // Install the handler first, so a signal at any moment still ends in a written report.
    let control = Arc::new(Control::new());
    if let Err(e) = handle_stop_signals(control.clone()) {
        err!("error: cannot install the handler of SIGINT, SIGTERM and SIGHUP: {e}");
        return 1;
    }
    let loaded = match config::load::<Config>(&path, &sets) {
        Ok(l) => l,
        Err(e) => {
            err!("error: {e}");
            return 2;
        }
    };
    let result = run::run(&loaded, out.as_deref(), resume.as_deref(), control, |dir, memory| {
        if !quiet {
            err!("pipeline: run directory {}", dir.display());
            err!("pipeline: {}", memory.summary().replace('\n', "\npipeline: "));
        }
    });
    match result {
        Ok(outcome) => {
            out!("{}", outcome.report.render());
            if let Some(e) = &outcome.report.run.error {
                err!("error: {e}");
            }
            // Every other stage that failed, too: the first failure is often not the only one
            // (a full disk fails the checkpoint and then the weights).
            for (name, st) in &outcome.report.stages {
                if let Some(e) = &st.error
                    && outcome.report.run.error.as_deref() != Some(&format!("stage `{name}` failed: {e}"))
                {
                    err!("error: stage `{name}` {}: {e}", st.state);
                }
            }
            if let Some(e) = &outcome.report_error {
                // The table leaves out the sections and histograms: print what report.json
                // would have held, so nothing the run measured is lost.
                if let Ok(json) = serde_json::to_string_pretty(&outcome.report) {
                    out!("report.json (not saved):\n{json}");
                }
                err!("error: {e}: the report above (table and report.json) is its only copy");
            }
            outcome.exit_code()
        }
        Err(RunError::Complete(message)) => {
            out!("{message}");
            0
        }
        Err(e) => {
            err!("error: {e}");
            e.exit_code()
        }
    }
}

/// SIGINT, SIGTERM and SIGHUP all stop a run as Ctrl-C does (the first drains and flushes, a
/// second stops every stage where it stands); the first one's number sets the exit code. A
/// thread of its own takes them (signal-hook's self-pipe), so nothing runs in the handler.
fn handle_stop_signals(control: Arc<Control>) -> std::io::Result<()> {
    use pipeline::runtime::control::StopSignal;
    let numbers: Vec<i32> = StopSignal::ALL.iter().map(|s| s.number()).collect();
    let mut signals = signal_hook::iterator::Signals::new(&numbers)?;
    std::thread::Builder::new().name("signals".into()).spawn(move || {
        for n in signals.forever() {
            let Some(signal) = StopSignal::from_number(n) else { continue };
            let again = control.stopping();
            control.interrupt_by(signal);
            let name = signal.name();
            if again {
                err!("pipeline: {name} while stopping: stopping every stage now");
            } else {
                err!(
                    "pipeline: {name}: draining in-flight items, then flushing and writing the report (again to stop at once; exit {})",
                    signal.exit_code()
                );
            }
        }
    })?;
    Ok(())
}

fn cmd_attention_trial(device: &str, kernels: &str, shape: AttentionShape, json: bool) -> i32 {
    use pipeline::model::flash_attn::FlashKernels;
    let Some(kernels) = FlashKernels::ALL.into_iter().find(|k| k.name() == kernels) else {
        err!("error: --kernels {kernels:?}: use flash or flash_mma");
        return 2;
    };
    if [shape.batch, shape.t, shape.heads, shape.kv_heads, shape.head_dim].contains(&0) || !shape.heads.is_multiple_of(shape.kv_heads) {
        err!("error: --batch, --seq-len, --heads, --kv-heads and --head-dim must be positive, --heads a multiple of --kv-heads");
        return 2;
    }
    let result = pipeline::device::open_named(device).and_then(|d| pipeline::model::attention_trial::check_flash(&d, kernels, shape));
    match result {
        Ok(o) => {
            if json {
                out!("{}", serde_json::to_string(&o).unwrap_or_default());
            } else {
                out!("{}", pipeline::model::attention_trial::summary(std::slice::from_ref(&o), shape, TrialSettings::flash()));
            }
            0
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

fn cmd_parity(device: &str, dtype: &str, seed: u64, json: bool) -> i32 {
    let dtype = match dtype {
        "f32" => candle_core::DType::F32,
        "bf16" => candle_core::DType::BF16,
        other => {
            err!("error: --dtype {other:?}: use f32 or bf16");
            return 2;
        }
    };
    let result = pipeline::device::open_named(device).and_then(|d| pipeline::check::parity::run(&d, device, dtype, seed));
    match result {
        Ok(r) => {
            if json {
                out!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
            } else {
                out!("parity {} {} vs cpu f64: loss {:.6} vs {:.6}", r.device, r.dtype, r.loss.0, r.loss.1);
                for c in &r.compared {
                    let expected = c.expected.map(|x| format!(" (expected {x:.1e})")).unwrap_or_default();
                    let verdict = if c.ok() { "" } else { "  FAILED" };
                    out!("  {:<32} rel_err {:.3e}  bound {:.1e}{expected}{verdict}", c.name, c.rel_err, c.bound);
                }
                out!("bounds: {}", r.rule);
                let verdict = if r.ok { "ok, every error within its bound" } else { "FAILED" };
                out!("max rel_err {:.3e}, worst error / bound {:.2}: {verdict}", r.max_rel_err, r.worst_ratio);
            }
            if r.ok { 0 } else { 1 }
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

fn cmd_validate(path: PathBuf, sets: Vec<String>) -> i32 {
    let result = config::load::<Config>(&path, &sets).map_err(RunError::from).and_then(|loaded| {
        let plan = graph::plan(&loaded, &REGISTRY)?;
        run::check_run_table(&loaded)?;
        let ext = loaded.config.extensions();
        graph::check_resources(&plan, &loaded, &ext)?;
        let memory = graph::memory(&plan, &loaded, &ext, run::gpu_free(&loaded.config.run));
        out!("{}", memory.summary());
        graph::check_memory(&memory, &loaded)?;
        Ok(plan)
    });
    match result {
        Ok(plan) => {
            let names: Vec<String> =
                plan.stages.iter().map(|s| format!("{} ({}/{})", s.name, s.factory.kind(), s.factory.name())).collect();
            out!("{}: ok, {} stages: {}", path.display(), plan.stages.len(), names.join(" -> "));
            0
        }
        Err(e) => {
            err!("error: {e}");
            2
        }
    }
}

fn cmd_artifact(
    weights: PathBuf,
    path: PathBuf,
    sets: Vec<String>,
    q: pipeline::artifact::quant::QuantConfig,
    out: Option<PathBuf>,
    val_max_tokens: usize,
) -> i32 {
    let loaded = match config::load::<Config>(&path, &sets) {
        Ok(l) => l,
        Err(e) => {
            err!("error: {e}");
            return 2;
        }
    };
    let out = out.unwrap_or_else(|| pipeline::artifact::roundtrip::default_path(&weights, &q));
    match pipeline::artifact::roundtrip::build(&loaded.config, &weights, &q, &out, val_max_tokens, |l| out!("{l}")) {
        Ok(_) => 0,
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

fn cmd_report(run_dir: PathBuf, json: bool) -> i32 {
    match Report::load(&run_dir) {
        Ok(r) if json => match serde_json::to_string_pretty(&r) {
            Ok(s) => {
                out!("{s}");
                0
            }
            Err(e) => {
                err!("error: {e}");
                1
            }
        },
        Ok(r) => {
            out_raw!("{}", r.render());
            0
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

fn cmd_prepare(opts: pipeline::data::prepare::PrepareOptions) -> i32 {
    let t = std::time::Instant::now();
    match pipeline::data::prepare::prepare(&opts) {
        Ok(m) => {
            out!(
                "{}: val {} docs, {} tokens in {} shard(s); train {} docs, {} tokens in {} shard(s); tokenizer {} ({} pieces); {:.1} s",
                opts.out.display(),
                m.val.docs,
                m.val.tokens,
                m.val.shards.len(),
                m.train.docs,
                m.train.tokens,
                m.train.shards.len(),
                opts.tokenizer.display(),
                m.tokenizer["vocab_size"],
                t.elapsed().as_secs_f64()
            );
            0
        }
        Err(e) => {
            err!("error: {e:#}");
            1
        }
    }
}

fn cmd_stages(json: bool) -> i32 {
    if json {
        match serde_json::to_string_pretty(&pipeline::runtime::catalog::catalog(&REGISTRY)) {
            Ok(s) => out!("{s}"),
            Err(e) => {
                err!("error: {e}");
                return 1;
            }
        }
    } else {
        out_raw!("{}", pipeline::runtime::catalog::render(&REGISTRY));
    }
    0
}
