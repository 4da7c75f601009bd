#!/usr/bin/env bash
# `pipeline project` checked on CPU ranks: a small model trained on one rank (`pipeline launch
# --nproc 1`, the engine, one thread) and on two (`--nproc 2`, one thread each, every rank the
# one-rank run's micro-batches: weak scaling), MPI's shared-memory all-reduce timed by a small
# C program (latency from 4 bytes, bandwidth from 8 MiB), then the two-rank step predicted from
# the one-rank run (`--keep per-rank`) against the measured one: the error in %.
# A second baseline, one rank run beside a twin (two one-rank runs at once), carries the
# contention for cores and memory that the two ranks meet and the model leaves out.
#
#   scripts/projection-check.sh [STEPS] [ROUNDS]     # default 30 steps, 1 round
#
# Needs target/release/pipeline (PIPELINE_BIN) built with `--features mpi`, mpicc and mpirun,
# and SP1024-vocabulary shards (DATA and TOKENIZER; default ../shared/data/golf_en_sp1024 where
# it exists, else the demo's, data/demo from scripts/fetch-demo-data.sh). Outputs under
# target/projection-check/. The target (issue 47): within 10% of the measured step.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
rounds=${2:-1}
bin=${PIPELINE_BIN:-target/release/pipeline}
# The binary reads PIPELINE_* variables as config keys.
unset PIPELINE_BIN
# The shards: DATA and TOKENIZER, else the project's shared SP1024 shards where they are, else
# the demo's (scripts/fetch-demo-data.sh: a fresh clone has those).
if [[ -z ${DATA:-} && ! -d ../shared/data/golf_en_sp1024 ]]; then
  DATA=data/demo/shards TOKENIZER=${TOKENIZER:-data/demo/tokenizer.model}
  [[ -d $DATA ]] || { echo "projection-check: no shards: set DATA and TOKENIZER, or run scripts/fetch-demo-data.sh" >&2; exit 2; }
fi
data=$(realpath "${DATA:-../shared/data/golf_en_sp1024}")
tok=$(realpath "${TOKENIZER:-../shared/tokenizers/fineweb_1024_bpe.model}")
out=target/projection-check
[[ -x $bin ]] || { echo "projection-check: $bin is missing: cargo build --release --features mpi" >&2; exit 2; }
[[ -d $data ]] || { echo "projection-check: no shards at $data (set DATA)" >&2; exit 2; }
command -v mpicc >/dev/null || { echo "projection-check: mpicc is missing (apt-get install libopenmpi-dev)" >&2; exit 2; }
mkdir -p "$out"
mpirun_flags=(--oversubscribe --bind-to none)
[[ $(id -u) == 0 ]] && mpirun_flags+=(--allow-run-as-root)

# The link: MPI_Allreduce of floats between 2 ranks, median of 200 (after 20 warm-ups).
cat >"$out/allreduce.c" <<'EOF'
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
static int cmp(const void *a, const void *b) { double x = *(double *)a, y = *(double *)b; return (x > y) - (x < y); }
static double median_us(float *buf, int n) {
  double t[200];
  for (int i = 0; i < 220; i++) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    MPI_Allreduce(MPI_IN_PLACE, buf, n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (i >= 20) t[i - 20] = (MPI_Wtime() - t0) * 1e6;
  }
  qsort(t, 200, sizeof(double), cmp);
  return t[100];
}
int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world, big = 2 << 20;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  float *buf = calloc(big, sizeof(float));
  double small = median_us(buf, 1), large = median_us(buf, big);
  double k = world - 1, bytes = big * 4.0;
  /* ring: t = 2k/N B/bw + 2k lat */
  double lat = small / (2 * k), gbs = 2 * k / world * bytes / ((large - small) * 1e-6) / 1e9;
  if (rank == 0) printf("%.3f %.3f %.1f %.1f\n", gbs, lat, small, large);
  MPI_Finalize();
  return 0;
}
EOF
mpicc -O2 -o "$out/allreduce" "$out/allreduce.c"

# The model: 6 layers, 192 wide, 1024 tokens of vocabulary; 8 rows x 256 tokens a micro-batch,
# 2 micro-batches a step on every rank.
cfg=$out/check.toml
cat >"$cfg" <<EOF
[run]
name = "projection-check"
seed = 1337
warmup_items = 2

[data]
train = "$data/fineweb_train_*.bin"
val = "$data/fineweb_val_*.bin"
tokenizer = "$tok"

[model]
vocab_size = 1024
num_layers = 6
model_dim = 192
num_heads = 6
num_kv_heads = 3

[train]
seq_len = 256
batch_tokens = 4096
grad_accum_steps = 2
iterations = $steps
warmdown_iters = 0
max_wallclock_seconds = 0
val_every = 0
val_batch_tokens = 4096
val_max_tokens = 4096
log_every = 1000

[stages.reader]
kind = "shard_reader"
impl = "mmap"
split = "train"

[stages.sampler]
kind = "window_sampler"
impl = "sequential"
inputs = ["reader"]

[stages.pin]
kind = "pin"
impl = "pageable"
inputs = ["sampler"]

[stages.upload]
kind = "upload"
impl = "cpu"
inputs = ["pin"]

[stages.train]
kind = "step_executor"
impl = "engine"
inputs = ["upload"]
EOF

# Predicted against measured for the run in $1: "baseline predicted measured error% exposed".
compare() {
  "$bin" project "$1" --nproc 2 --keep per-rank --link-gbs "$gbs" --link-latency-us "$lat" --json >"$1.projection.json"
  "$bin" project "$1" --nproc 2 --keep per-rank --link-gbs "$gbs" --link-latency-us "$lat" >"$1.projection.txt"
  python3 - "$1" "$out/two" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1] + ".projection.json"))
one, pr = p["measured"]["step_ms"], p["projection"]
two = json.load(open(sys.argv[2] + "/report.json"))["train"]["step_avg_ms"]
print(f"{one:.1f} {pr['step_ms']:.1f} {two:.1f} {100 * (pr['step_ms'] - two) / two:+.1f} {pr['exposed_ms']:.2f}")
EOF
}
one_rank() { RAYON_NUM_THREADS=1 "$bin" launch --nproc 1 "$cfg" --out "$1" -q >/dev/null; }

echo "projection-check: $steps steps a run, $rounds round(s), $(nproc) cores, $(date -u +%FT%TZ)"
echo "baselines: one rank alone (as asked), and one rank beside a twin (two one-rank runs at once,"
echo "so that its compute shares the cores and memory as each rank of the two-rank run does)"
printf '%-6s %-23s %9s %7s %11s %14s %13s %8s %10s\n' round baseline link_GB/s lat_us baseline_ms predicted_2_ms measured_2_ms error_% exposed_ms
errs=()
for ((r = 1; r <= rounds; r++)); do
  read -r gbs lat _ _ < <(mpirun -n 2 "${mpirun_flags[@]}" "$out/allreduce")
  rm -rf "$out"/one* "$out"/pair-* "$out/two"
  one_rank "$out/one"
  one_rank "$out/pair-a" &
  pa=$!
  one_rank "$out/pair-b"
  wait $pa
  RAYON_NUM_THREADS=1 "$bin" launch --nproc 2 "$cfg" --out "$out/two" -q --set train.batch_tokens=8192 >/dev/null
  for base in one pair-a; do
    read -r b pred meas err exposed < <(compare "$out/$base")
    label="one rank alone"
    [[ $base == one ]] || label="one rank beside a twin"
    printf '%-6s %-23s %9.2f %7.2f %11s %14s %13s %8s %10s\n' "$r" "$label" "$gbs" "$lat" "$b" "$pred" "$meas" "$err" "$exposed"
    errs+=("$base:$err")
  done
  python3 - "$out/two" <<'EOF'
import json, sys
t = json.load(open(sys.argv[1] + "/report.json"))["train"]
p = t["timing_ms_per_step"]
print(f"       two ranks measured: forward {p['forward']:.1f}, backward {p['backward']:.1f}, optimizer {p['optimizer']:.1f} ms a step; "
      f"collectives waited for {t['comm_ms_per_step']:.1f} ms, under the backward pass {t['comm_overlapped_ms_per_step']:.1f} ms")
EOF
done
echo "errors (predicted - measured) / measured, %: ${errs[*]}"
