#!/usr/bin/env bash
# `pipeline project` checked on CPU ranks: a small model trained on one rank (`pipeline launch
# --nproc 1`, the engine, one thread) and on two (`--nproc 2`, one thread each, every rank the
# one-rank run's micro-batches: weak scaling), MPI's shared-memory all-reduce timed by a small
# C program (latency from 4 bytes, bandwidth from 8 MiB), then the two-rank step predicted from
# the one-rank run (`--keep per-rank`) against the measured one: the error in %.
#
#   scripts/projection-check.sh [STEPS] [ROUNDS]     # default 30 steps, 1 round
#
# Needs target/release/pipeline (PIPELINE_BIN) built with `--features mpi`, mpicc and mpirun,
# and the shared shards (DATA, default ../shared/data/golf_en_sp1024; TOKENIZER). Outputs under
# target/projection-check/. The target (issue 47): within 10% of the measured step.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-30}
rounds=${2:-1}
bin=${PIPELINE_BIN:-target/release/pipeline}
# The binary reads PIPELINE_* variables as config keys.
unset PIPELINE_BIN
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

step_ms() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]+"/report.json"))["train"]["step_avg_ms"])' "$1"; }
echo "projection-check: $steps steps a run, $rounds round(s), $(nproc) cores, $(date -u +%FT%TZ)"
printf '%-6s %9s %9s %12s %13s %12s %8s\n' round link_GB/s lat_us one_rank_ms predicted_2_ms measured_2_ms error_%
errs=()
for ((r = 1; r <= rounds; r++)); do
  read -r gbs lat _ _ < <(mpirun -n 2 "${mpirun_flags[@]}" "$out/allreduce")
  rm -rf "$out/one" "$out/two"
  RAYON_NUM_THREADS=1 "$bin" launch --nproc 1 "$cfg" --out "$out/one" -q >/dev/null
  RAYON_NUM_THREADS=1 "$bin" launch --nproc 2 "$cfg" --out "$out/two" -q --set train.batch_tokens=8192 >/dev/null
  "$bin" project "$out/one" --nproc 2 --keep per-rank --link-gbs "$gbs" --link-latency-us "$lat" --json >"$out/projection.json"
  "$bin" project "$out/one" --nproc 2 --keep per-rank --link-gbs "$gbs" --link-latency-us "$lat" >"$out/projection.txt"
  one=$(step_ms "$out/one")
  two=$(step_ms "$out/two")
  line=$(python3 - "$out/projection.json" "$two" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))["projection"]
two = float(sys.argv[2])
print(f"{p['step_ms']:.2f} {two:.2f} {100 * (p['step_ms'] - two) / two:+.1f} {p['exposed_ms']:.2f}")
EOF
)
  read -r pred meas err exposed <<<"$line"
  printf '%-6s %9.2f %9.2f %12.2f %13s %12s %8s\n' "$r" "$gbs" "$lat" "$one" "$pred" "$meas" "$err"
  echo "       predicted exposed communication $exposed ms; measured (report's comm_ms_per_step) $(python3 -c 'import json,sys; t=json.load(open(sys.argv[1]+"/report.json"))["train"]; print(round(t["comm_ms_per_step"],2), "ms waited,", round(t["comm_overlapped_ms_per_step"],2), "ms hidden")' "$out/two")"
  errs+=("$err")
done
echo "errors (predicted - measured) / measured: ${errs[*]} %"
