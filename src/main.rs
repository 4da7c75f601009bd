//! The `pipeline` command line: the arguments of every command (clap) and their dispatch to
//! `pipeline::cli`, where each command lives.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use pipeline::cli;
#[cfg(feature = "tools")]
use pipeline::train::attention_trial::AttentionShape;

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

/// What `run` takes, and `launch` passes on to every rank.
#[derive(clap::Args)]
struct RunArgs {
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
}

#[derive(Subcommand)]
enum Command {
    /// Run a pipeline and write its run directory (config.toml, report.json).
    Run {
        #[command(flatten)]
        args: RunArgs,
    },
    /// Run a config on N local ranks (data parallel), as `torchrun --standalone` does.
    ///
    /// CPU ranks run under `mpirun` (the binary needs the `mpi` feature); GPU ranks get NCCL's
    /// id from the launcher. One rank's failure stops every rank, naming it. Rank 0 writes the
    /// run directory; every rank gets the same flags.
    Launch {
        /// Ranks to start (each takes 1/N of every step's micro-batches).
        #[arg(long)]
        nproc: usize,
        /// Every rank's training log on stdout, each line tagged `[r] ` (default: rank 0's).
        #[arg(long)]
        all_ranks: bool,
        #[command(flatten)]
        args: RunArgs,
    },
    /// Run a config and variants of it one after another and compare them side by side.
    ///
    /// The base config runs first, then each value of each --vary (one key changed at a time,
    /// or every combination with --grid), all with the same seed and data order, each in its
    /// own run directory under the ablation directory (ablation.json, ablation.txt). Ctrl-C
    /// lets the current run finish; rerun with the same --out to go on.
    #[cfg(feature = "tools")]
    Ablate {
        /// The pipeline config (TOML); its `[ablation]` table is used when no --vary is given.
        config: PathBuf,
        /// A key and the values to try: --vary stages.sampler.queue=2,100 (repeatable).
        #[arg(long = "vary", value_name = "KEY=V1,V2")]
        varies: Vec<String>,
        /// Run every combination of the varied values instead of one key at a time.
        #[arg(long)]
        grid: bool,
        /// Run every variant N times, with run.seed = the config's seed + 0..N, and report mean,
        /// standard deviation and Welch's t-test of the score against the base.
        #[arg(long, value_name = "N")]
        seeds: Option<u32>,
        /// The ablation directory (default: <[run] out_dir>/ablation-<name>-<UTC time>); an
        /// existing one goes on where it stopped.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Override a config value in every run, as for `run`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Print only errors, each run's outcome and the comparison.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Predict each channel's best depth from a finished run's recorded service times.
    ///
    /// Replays the chain that feeds the executor (or a loader's sink) as a queue with every
    /// channel depth from 1 to 128, and prints the predicted input wait and throughput per depth
    /// and the smallest depth within 1% of the best.
    #[cfg(feature = "tools")]
    Advise {
        /// The run directory (holding report.json).
        run_dir: PathBuf,
        /// Print the advice as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Predict the step time on N ranks (GPUs) from a one-rank run's report.
    ///
    /// The run's per-phase times, its gradient buckets and their ready times in the backward
    /// pass, and a ring model of the interconnect (H100 SXM NVLink defaults) give the step on N
    /// ranks, its exposed communication and the steps in a wall-clock budget, printed beside
    /// the records' own figures. A prediction, not a measurement (docs/ranks.md).
    #[cfg(feature = "tools")]
    Project {
        /// The one-rank run's directory (report.json, config.toml).
        run_dir: PathBuf,
        /// Ranks to predict.
        #[arg(long, default_value_t = 8)]
        nproc: usize,
        /// Bus bandwidth of the link per rank, GB/s (nccl-tests' busbw; default: NCCL's ring on H100 SXM NVLink 4).
        #[arg(long, default_value_t = pipeline::report::projection::H100_SXM_LINK_GBS)]
        link_gbs: f64,
        /// Latency of one step of a ring collective, µs.
        #[arg(long, default_value_t = pipeline::report::projection::H100_SXM_LATENCY_US)]
        link_latency_us: f64,
        /// The wall-clock budget, s (the challenge's 600).
        #[arg(long, default_value_t = 600.0)]
        budget_s: f64,
        /// The batch the ranks keep: global (each rank 1/N of the run's micro-batches, as the
        /// records) or per-rank (each the run's micro-batches: N times the batch).
        #[arg(long, value_enum, default_value = "global")]
        keep: pipeline::report::projection::Keep,
        /// The share (0 to 1) of the optimizer's time that is Muon's Newton-Schulz, instead of
        /// the estimate from FLOPs.
        #[arg(long)]
        ns_share: Option<f64>,
        /// Print the projection as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check finished runs (one per seed) against the challenge's rules and write the records
    /// folder (docs/submitting.md).
    ///
    /// Each rule is a line with its figure: artifact + code bytes, training and evaluation
    /// time, seeds, one config, the validation's byte count, the legality audit of the
    /// evaluation, and the significance against --against. Exit 0 and the folder when every
    /// check passes; 1 and no folder when one fails; 2 on unreadable input.
    #[cfg(feature = "tools")]
    Submission {
        /// The runs' directories, one per seed.
        #[arg(required_unless_present = "verify")]
        runs: Vec<PathBuf>,
        /// The records folder to write (absent or empty).
        #[arg(long, required_unless_present = "verify")]
        out: Option<PathBuf>,
        /// Check a records folder instead: unpack its source bundle into an empty directory,
        /// build it, rerun its config at a tiny size with the rebuilt binary and with this one,
        /// and compare their weights byte for byte (docs/submitting.md).
        #[arg(long, value_name = "FOLDER", conflicts_with_all = ["runs", "out", "against"])]
        verify: Option<PathBuf>,
        /// With --verify: where to unpack, build and rerun (kept; default: a temporary folder).
        #[arg(long, value_name = "DIR", requires = "verify")]
        work: Option<PathBuf>,
        /// With --verify: override a config value in both reruns (repeatable; read as TOML).
        #[arg(long = "set", value_name = "KEY=VALUE", requires = "verify")]
        sets: Vec<String>,
        /// What to beat: the record's val_bpb (e.g. 1.0611), or a baseline's run directories.
        #[arg(long, num_args = 1.., value_name = "BPB|RUN_DIR")]
        against: Vec<String>,
        /// Distinct seeds required.
        #[arg(long, default_value_t = 3)]
        seeds: usize,
        /// Validation tokens the legality audit scores (twice).
        #[arg(long, default_value_t = 8192)]
        audit_tokens: usize,
        /// The entry's name (default: the runs' `run.name`).
        #[arg(long, default_value = "")]
        name: String,
        /// The author's name.
        #[arg(long, default_value = "")]
        author: String,
        /// The author's GitHub id.
        #[arg(long, default_value = "")]
        github_id: String,
        /// One paragraph on what the entry does.
        #[arg(long, default_value = "")]
        blurb: String,
        /// The entry's date, YYYY-MM-DD (default: today, UTC).
        #[arg(long, default_value = "")]
        date: String,
        /// Print the checks and figures as JSON.
        #[arg(long)]
        json: bool,
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
        /// The run directory (holding report.json), or with --html an ablation directory.
        run_dir: PathBuf,
        /// Print report.json instead of the table.
        #[arg(long)]
        json: bool,
        /// Write report.html again (a run's page, or an ablation's) and print its path.
        #[arg(long, conflicts_with = "json")]
        html: bool,
    },
    /// Data preparation.
    #[cfg(feature = "tools")]
    Data {
        #[command(subcommand)]
        command: DataCommand,
    },
    /// Quantize a weights file into the challenge's compressed artifact, report its size against
    /// the 16,000,000-byte cap, and score the round trip on the validation split.
    #[cfg(feature = "tools")]
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
        /// The rounding: quantize (to nearest) or gptq (Hessians from the config's training
        /// data). Default: the config's `artifact` stage's implementation, else quantize.
        #[arg(long, value_enum)]
        method: Option<cli::artifact::MethodArg>,
        /// Bits per quantized weight of the matrices (8 as the baseline; 6 as the later
        /// records). Default: the config's `artifact` stage's `bits`, else 8.
        #[arg(long)]
        bits: Option<u8>,
        /// Compressor: zlib (the baseline's), zstd or brotli. Default: the config's artifact
        /// stage's, else zlib.
        #[arg(long)]
        codec: Option<pipeline::artifact::quant::Codec>,
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
    #[cfg(feature = "tools")]
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
    /// Check the explicit engine's backend on a device against the CPU in f64 and time it: every
    /// op case (each kernel and GEMM layout) one line each, the whole engine's loss, gradients
    /// and weights on a small model with every record element, graph replay against op-by-op
    /// launches and the device-to-device paths (GPU), then per-op timings at the baseline's
    /// shapes. Exit 1 when an error is beyond its bound.
    #[cfg(feature = "tools")]
    EngineCheck {
        /// The device: "cpu" (the f32 CPU backend) or "cuda:N".
        #[arg(long, default_value = "cuda:0")]
        device: String,
        /// GEMM maths: bf16 (tensor cores, the GPU default) or f32 (the CPU's only).
        #[arg(long)]
        dtype: Option<String>,
        /// Storage of the activations for the timings and the graph check: bf16 (the default
        /// with --dtype bf16 on a GPU) or f32. The whole-engine checks run every precision on a
        /// GPU.
        #[arg(long)]
        activations: Option<String>,
        /// Attention for the timings and the graph check: flash_mma (the engine's own kernels,
        /// the default) or cudnn (cuDNN's fused attention; flash_mma, said in one line, where
        /// cuDNN cannot run). The whole-engine checks run both on a GPU.
        #[arg(long)]
        attention: Option<String>,
        /// Shapes of the timings: baseline (the GPU default: 9 layers, width 512, 64 x 1024
        /// tokens), record-0427 (the 04-27 record's model, looped, 24 x 2048 tokens), small (the
        /// CPU default: a check of the plumbing), or none.
        #[arg(long)]
        timing: Option<String>,
        /// Rows per micro-batch of the timings instead of the shape's (fewer for a smaller GPU).
        #[arg(long)]
        rows: Option<usize>,
        /// Seed of the arenas, weights and tokens.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Also write the report as JSON to this file (the text goes to stdout).
        #[arg(long)]
        json_out: Option<PathBuf>,
    },
    /// Time one flash-attention implementation's forward and backward pass at a micro-batch's
    /// shapes, after checking it against the materialised attention in f32 (what `attention =
    /// "auto"` runs, one process per implementation). Exit 0 with the outcome, even a rejection.
    #[cfg(feature = "tools")]
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
    /// Audit the legality of a run's configured evaluation (its `ttt_eval` stage) on a prefix
    /// of the validation split: every target scored once, no score moved by a later token, and
    /// (where the model claims document attention) no document seeing the one before it.
    ///
    /// Exit 0 when the audit passes, 1 when a check fails, 2 on an error.
    #[cfg(feature = "tools")]
    AuditEval {
        /// A finished run directory (its config.toml and the weights its evaluation scored) or a
        /// config file (weights initialised from run.seed).
        path: PathBuf,
        /// Validation targets scored (the prefix audited).
        #[arg(long, default_value_t = 8192)]
        tokens: usize,
        /// Override a config value, as for `run`.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Print the report as JSON.
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

#[cfg(feature = "tools")]
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
        /// Apply the CaseOps case transform (the 04-27 record's tokenizer; the model must reserve
        /// its operators) and write the val byte sidecar `fineweb_val_bytes_NNNNNN.bin`.
        #[arg(long)]
        caseops: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run { args: RunArgs { config, out, sets, quiet, resume } } => {
            let code = cli::run::command(config, out, sets, quiet, resume);
            // Among several ranks: finalise MPI, or end every rank when this one failed.
            cli::ranks::leave(code);
            code
        }
        Command::Launch { nproc, all_ranks, args: RunArgs { config, out, sets, quiet, resume } } => {
            cli::launch::command(config, cli::launch::Options { nproc, sets, out, resume, quiet, all_ranks })
        }
        #[cfg(feature = "tools")]
        Command::Ablate { config, varies, grid, seeds, out, sets, quiet } => {
            cli::ablate::command(config, cli::ablate::Options { varies, grid, seeds, out, sets, quiet })
        }
        #[cfg(feature = "tools")]
        Command::Advise { run_dir, json } => cli::advise::command(run_dir, json),
        #[cfg(feature = "tools")]
        Command::Project { run_dir, nproc, link_gbs, link_latency_us, budget_s, keep, ns_share, json } => {
            cli::project::command(run_dir, cli::project::Options { nproc, link_gbs, link_latency_us, budget_s, keep, ns_share, json })
        }
        #[cfg(feature = "tools")]
        Command::Submission { verify: Some(folder), work, sets, .. } => {
            cli::verify::command(&folder, cli::verify::VerifyOptions { work, sets })
        }
        #[cfg(feature = "tools")]
        Command::Submission { runs, out, against, seeds, audit_tokens, name, author, github_id, blurb, date, json, .. } => {
            let out = out.unwrap_or_default();
            let entry = cli::submission::Entry { name, author, github_id, blurb, date, ..Default::default() };
            cli::submission::command(runs, cli::submission::Options { out, against, seeds, audit_tokens, entry, json })
        }
        Command::Validate { config, sets } => cli::validate::command(config, sets),
        Command::Report { run_dir, json, html } => cli::report::command(run_dir, json, html),
        Command::Stages { json } => cli::stages::command(json),
        #[cfg(feature = "tools")]
        Command::AuditEval { path, tokens, sets, json } => {
            cli::audit::command(path, pipeline::stages::ttt_eval::audit::AuditOptions { tokens, sets }, json)
        }
        #[cfg(feature = "tools")]
        Command::Parity { device, dtype, seed, json } => cli::check::parity(&device, &dtype, seed, json),
        #[cfg(feature = "tools")]
        Command::EngineCheck { device, dtype, activations, attention, timing, rows, seed, json, json_out } => {
            let precision =
                cli::check::Precision { dtype: dtype.as_deref(), activations: activations.as_deref(), attention: attention.as_deref() };
            cli::check::engine_check(&device, precision, timing.as_deref(), rows, seed, json, json_out.as_deref())
        }
        #[cfg(feature = "tools")]
        Command::AttentionTrial { device, kernels, batch, seq_len, heads, kv_heads, head_dim, json } => {
            cli::check::attention_trial(&device, &kernels, AttentionShape { batch, t: seq_len, heads, kv_heads, head_dim }, json)
        }
        #[cfg(feature = "tools")]
        Command::Artifact { weights, config, sets, method, bits, codec, level, out, val_max_tokens } => {
            cli::artifact::command(weights, config, cli::artifact::Options { sets, method, bits, codec, level, out, val_max_tokens })
        }
        #[cfg(feature = "tools")]
        Command::Data { command: DataCommand::Prepare { tokenizer, inputs, out, val_docs, val_frac, shard_tokens, force, caseops } } => {
            let val = match (val_docs, val_frac) {
                (Some(n), _) => pipeline::data::prepare::ValSplit::Docs(n),
                (None, f) => pipeline::data::prepare::ValSplit::Frac(f.unwrap_or(0.05)),
            };
            cli::data::command(pipeline::data::prepare::PrepareOptions { tokenizer, inputs, out, val, shard_tokens, force, caseops })
        }
    };
    ExitCode::from(code as u8)
}
