#!/usr/bin/env bash
# Data parallel on the CPU, measured side by side in one session: the demo's training (its
# stages after training left out) on one rank with 1 and with 2 threads and on 2 ranks (MPI,
# `pipeline launch --nproc 2`, one thread each), with the candle executor and with the engine
# (its gradient all-reduce overlapped with the backward pass, and not). Every run trains the
# same global batch (16 x 256 tokens, one micro-batch per rank), one after another.
#
#   scripts/bench-ranks.sh [STEPS] [ROUNDS]    # default 60 steps, 1 round
#
# Prints, per run: ms per step (the median of steps 6 on, from steps.tsv), tokens/s, and from
# report.json the time a step waited for its collectives and the all-reduce time that ran
# under the backward pass instead. Several rounds interleave the runs (noisy machines).
# Needs target/release/pipeline built with `--features mpi` and the demo data
# (scripts/fetch-demo-data.sh). Outputs under target/bench-ranks/.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-60}
rounds=${2:-1}
bin=${PIPELINE_BIN:-target/release/pipeline}
# The binary reads PIPELINE_* variables as config keys (`PIPELINE_BIN` would be key `bin`).
unset PIPELINE_BIN
out=target/bench-ranks
[[ -x $bin ]] || { echo "bench-ranks: $bin is missing: cargo build --release --features mpi" >&2; exit 2; }
[[ -f data/demo/tokenizer.model ]] || { echo "bench-ranks: no demo data: scripts/fetch-demo-data.sh" >&2; exit 2; }
mkdir -p "$out"
# The demo's training alone: everything before its first stage after training, data paths made
# absolute (the config is written elsewhere).
cfg=$out/demo-train.toml
sed -n '/^\[stages.ema\]/q;p' pipelines/demo.toml | sed "s#\"data/demo/#\"$PWD/data/demo/#" >"$cfg"
common=(--set "train.iterations=$steps" --set train.val_every=0 --set train.max_wallclock_seconds=0 --set train.grad_accum_steps=1 -q)

run() { # name, ranks, threads, extra --set arguments...
  local name=$1 ranks=$2 threads=$3
  shift 3
  local dir=$out/$name
  rm -rf "$dir"
  if [[ $ranks == 1 ]]; then
    RAYON_NUM_THREADS=$threads "$bin" run "$cfg" --out "$dir" "${common[@]}" "$@" >/dev/null
  else
    RAYON_NUM_THREADS=$threads "$bin" launch --nproc "$ranks" "$cfg" --out "$dir" "${common[@]}" "$@" >/dev/null
  fi
  python3 - "$dir" "$name" "$ranks" "$threads" <<'EOF'
import json, statistics, sys
d, name, ranks, threads = sys.argv[1:]
rows = [l.split("\t") for l in open(f"{d}/steps.tsv").read().splitlines()[1:]]
t = [float(r[3]) for r in rows]
per = [b - a for a, b in zip(t, t[1:])][5:]
ms = statistics.median(per)
tr = json.load(open(f"{d}/report.json"))["train"]
tok = 16 * 256
print(f"{name:<22} {ranks:>5} {threads:>7} {ms:>9.1f} {tok / ms * 1e3:>9.0f} {tr.get('comm_ms_per_step', 0):>9.2f} {tr.get('comm_overlapped_ms_per_step', 0):>11.2f}")
EOF
}

echo "steps: $steps, rounds: $rounds, $(nproc) cores, $(date -u +%FT%TZ)"
printf '%-22s %5s %7s %9s %9s %9s %11s\n' run ranks threads ms/step tok/s comm_wait comm_hidden
for ((r = 1; r <= rounds; r++)); do
  run candle-1x1 1 1
  run candle-1x2 1 2
  run candle-2x1 2 1
  run engine-1x1 1 1 --set stages.train.impl=engine
  run engine-1x2 1 2 --set stages.train.impl=engine
  run engine-2x1-overlap 2 1 --set stages.train.impl=engine
  run engine-2x1-no-overlap 2 1 --set stages.train.impl=engine --set stages.train.overlap_allreduce=false
done
