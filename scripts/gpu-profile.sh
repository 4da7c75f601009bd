#!/usr/bin/env bash
# Kernel-level profile of one training micro-batch on a GPU, to see where a step's device time
# goes below the report's forward / backward / optimizer split: Nsight Compute (`ncu`) times
# every kernel of one step of one micro-batch (ROWS x seq_len tokens, default 64 x 1024, the
# baseline's micro-batch), and scripts/ncu_summary.py sums the forward and backward kernels by
# family (flash attention, cuBLAS products, fused row kernels, casts, candle's own) and by
# kernel, largest first. Nsight serialises kernels and fixes clocks at base, so absolute times
# run above the training run's; read the shares.
#
# usage: scripts/gpu-profile.sh BIN DATA_DIR TOKENIZER [OUT_DIR]
#   BIN        a `cuda` build of pipeline (scripts/build-cuda.sh)
#   DATA_DIR   challenge-format shards fineweb_train_*.bin and fineweb_val_*.bin
#   TOKENIZER  the sentencepiece model the shards were made with
# ROWS=N and SEQ=T set the micro-batch (default 64 x 1024); EXTRA='--set KEY=VALUE ...' adds settings (e.g.
# EXTRA="--set 'stages.train.attention=\"materialized\"'" to profile the other attention);
# NCU=path/to/ncu when it is not on the PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:?usage: $0 BIN DATA_DIR TOKENIZER [OUT_DIR]}
DATA=${2:?usage: $0 BIN DATA_DIR TOKENIZER [OUT_DIR]}
TOK=${3:?usage: $0 BIN DATA_DIR TOKENIZER [OUT_DIR]}
OUT=${4:-gpu-profile-out}
ROWS=${ROWS:-64}
SEQ=${SEQ:-1024}
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)}
[[ -n $NCU && -x $NCU ]] || { echo "gpu-profile: no ncu (Nsight Compute) found; set NCU=path" >&2; exit 1; }
read -r -a extra <<< "${EXTRA:-}"
if libdir=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null) && [[ -d "$libdir" ]]; then
  export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}"
fi
mkdir -p "$OUT"
rm -rf "$OUT/run"
# One step of one micro-batch; the forward and backward pass are ~1,000 launches, the capture
# stops after LAUNCHES (the validation and stages after training are not needed).
"$NCU" --metrics gpu__time_duration.sum --launch-count "${LAUNCHES:-1500}" --csv --print-units base --log-file "$OUT/ncu.csv" \
  "$BIN" run pipelines/baseline.toml --out "$OUT/run" -q \
  --set "data.train=\"$DATA/fineweb_train_*.bin\"" --set "data.val=\"$DATA/fineweb_val_*.bin\"" --set "data.tokenizer=\"$TOK\"" \
  --set train.iterations=1 --set train.seq_len=$SEQ --set train.batch_tokens=$((ROWS * SEQ)) --set train.grad_accum_steps=1 --set train.val_every=0 \
  --set train.val_max_tokens=65536 --set train.max_wallclock_seconds=0 "${extra[@]}" > "$OUT/run.log" 2>&1 \
  || { echo "gpu-profile: the profiled run failed, see $OUT/run.log" >&2; tail -5 "$OUT/run.log" >&2; exit 1; }
python3 scripts/ncu_summary.py "$OUT/ncu.csv" | tee "$OUT/summary.txt"
