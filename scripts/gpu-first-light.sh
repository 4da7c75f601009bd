#!/usr/bin/env bash
# The engine's first light on a GPU: one command that checks it and measures it, under 8
# minutes on one H100, its results in one folder of at most 8 files (docs/gpu.md says how to
# prepare and read it).
#
#   scripts/gpu-first-light.sh [IN] [OUT]        # on the GPU machine, from the repository's root
#
# IN (default first-light/, ignored by git; scripts/first-light-pack.sh fills it here) holds:
#   pipeline.xz                      the `cuda` binary (scripts/build-cuda.sh), xz-compressed
#   sp1024/fineweb_{train,val}_*.bin a few challenge-format SP1024 shards (the baseline's data)
#   sp8192/fineweb_{train,val}_*.bin a few SP8192 shards (the 04-09 record's data)
#   tokenizers/fineweb_1024_bpe.model, tokenizers/fineweb_8192_bpe.model
#   train_gpt.py                     optional: the challenge's script, fetched by whoever runs
#                                    this (never committed), trained on the same shards and GPU
# OUT (default $OUT when set, else first-light-out/) gets:
#   summary.txt        every figure and verdict of the run (also the end of stdout)
#   engine-check.txt   (a) `pipeline engine-check`: every op, the whole engine, graphs, the
#   engine-check.json      device-to-device paths, per-op timings at the baseline's shapes
#   engine-check-record.*  (a) the per-op timings at the 04-27 record's shapes, looped (GPU only)
#   runs.tar.gz        every run's train.log, report.json, steps.tsv and output
#   gpu.txt            nvidia-smi, and GPU memory sampled during the record run
#
# Parts:
#   (a) engine-check on cuda:0 (bf16 activations and GEMMs; the whole engine in every precision);
#   (b) the baseline (pipelines/baseline.toml, 524,288 tokens a step) for STEPS steps (default
#       30) on the engine (bf16, graphs on) and on the candle executor, side by side, and the
#       challenge's train_gpt.py for PT_STEPS (default 40) on the same shards when given;
#   (c) the engine's baseline run again with graphs off: final weights bit-identical to (b)'s,
#       ms/step with and without graphs, and the report's graph counts;
#   (d) pipelines/record.toml on the engine for RECORD_STEPS (default 20) steps: ms/step, the
#       arena, and peak GPU memory (nvidia-smi sampled every 200 ms); if it runs out of memory
#       at the record's 8 micro-batches of 48 x 2048, again with 16 of 24 x 2048;
#   (f) pipelines/record-0427.toml on the engine for RECORD0427_STEPS (default 8) steps at its own
#       8 micro-batches, each one packed row of 98,304 tokens (`packed_docs`; 16 of 49,152 if
#       refused or out of memory), EMA on, validation
#       on the engine: ms/step, the arena, graph and mirror counts, and the device phases of
#       steps 1-3 and the last from steps.tsv (step 1 runs op by op, step 2 captures the graphs);
#       its per-op table is (a)'s `engine-check --timing record-0427` (engine-check-record.*);
#   (g) the seeds' loader settings on the engine (the baseline, LOADER_STEPS, default 15): page-
#       locked staging with a copy stream against pageable staging with a synchronous copy:
#       ms/step and the executor's input wait (its share and p99, from report.json);
#   (h) the engine with an f32 arena (`activations = "f32"`, GPU only) beside the default bf16
#       activations of (a), (b) and (f): engine-check's per-op table (engine-check-f32.txt), the
#       baseline for STEPS steps (ms/step, final val_loss, the arena), record-0427 for
#       RECORD0427_STEPS;
#   (i) cuDNN's fused attention (`attention = "cudnn"`, libcudnn.so.9 from the machine's PyTorch
#       install): engine-check's op cases, whole engine and per-op table with --attention cudnn
#       at the baseline's and the 04-27 record's shapes (runs/engine-check-*cudnn.txt;
#       attention's forward and backward TFLOP/s beside (a)'s flash_mma), the attention trial of cudnn, flash_mma and flash at the baseline's shapes
#       (64 x 1024, 8/4 heads) and the 04-27 record's (48 x 2048), and the baseline for STEPS
#       steps on the engine with attention "cudnn" against "flash_mma" (and (b)'s PyTorch);
#   (j) the engine through NCCL at world size 1: the baseline for STEPS steps on the engine
#       (attention flash_mma) plain, then through `pipeline launch --nproc 1` (every gradient
#       bucket and Muon's update exchange through NCCL on the engine's communication stream,
#       inside its CUDA graphs): steady ms/step of each and the overhead in % (target: under
#       1%); `pipeline project --nproc 8` of the plain run (runs/project.txt);
#   (e) everything above into OUT.
#
# PARTS (default abcdfghij) picks the parts to run, e.g. PARTS=abh; IMPLS (default "engine candle")
# the executors of (b).
# SMOKE=1 runs every part on the CPU with a tiny model (the binary from BIN, the data
# in IN as above but any tokenizer, SMOKE_VOCAB its vocabulary): a check of this script, not a
# measurement; tests/first_light.rs runs it in CI. Exit 1 when a check fails or a run breaks.
set -uo pipefail
cd "$(dirname "$0")/.."
IN=${1:-first-light}
OUT=${2:-${OUT:-first-light-out}}
SMOKE=${SMOKE:-0}
STEPS=${STEPS:-30}
PT_STEPS=${PT_STEPS:-40}
RECORD_STEPS=${RECORD_STEPS:-20}
RECORD0427_STEPS=${RECORD0427_STEPS:-8}
LOADER_STEPS=${LOADER_STEPS:-15}
PARTS=${PARTS:-abcdfghij}
part() { [[ $PARTS == *$1* ]]; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/first-light.XXXXXX")
trap 'rm -rf "$work"' EXIT
runs=$work/runs
mkdir -p "$runs"
summary=$OUT/summary.txt
: > "$summary"
say() { echo "$*" | tee -a "$summary"; }
status=0
fail() { say "FAILED: $*"; status=1; }

# --- the binary, the libraries, the data ---------------------------------------------------
if [[ -n ${BIN:-} ]]; then
  : # the binary given
elif [[ -f $IN/pipeline.xz ]]; then
  BIN=$work/pipeline
  xz -dc "$IN/pipeline.xz" > "$BIN" && chmod +x "$BIN" || { echo "cannot unpack $IN/pipeline.xz" >&2; exit 1; }
else
  echo "no binary: put the cuda build at $IN/pipeline.xz (scripts/first-light-pack.sh) or set BIN" >&2
  exit 1
fi
for f in "$IN"/sp1024/fineweb_train_000000.bin "$IN"/sp1024/fineweb_val_000000.bin "$IN"/sp8192/fineweb_train_000000.bin \
         "$IN"/tokenizers/fineweb_1024_bpe.model "$IN"/tokenizers/fineweb_8192_bpe.model; do
  [[ -f $f ]] || { echo "missing $f (scripts/first-light-pack.sh prepares $IN)" >&2; exit 1; }
done
IN=$(cd "$IN" && pwd)
# cuBLAS, cuRAND, NVRTC, NCCL and cuDNN come from the machine's PyTorch cu13 install (the driver
# supplies libcuda).
for lib in cu13/lib cudnn/lib; do
  if libdir=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], '$lib'))" 2>/dev/null) && [[ -d $libdir ]]; then
    export LD_LIBRARY_PATH="$libdir:${LD_LIBRARY_PATH:-}"
  fi
done
# NCCL (part j): cudarc opens `libnccl.so`, PyTorch's wheel has only `libnccl.so.2`: a link to it.
if [[ $SMOKE != 1 ]] && ncclso=$(python3 -c "import nvidia, os, glob; print((glob.glob(os.path.join(list(nvidia.__path__)[0], 'nccl/lib/libnccl.so*')) + glob.glob(os.path.join(list(nvidia.__path__)[0], 'cu13/lib/libnccl.so*')))[0])" 2>/dev/null); then
  mkdir -p "$work/nccl" && ln -sf "$ncclso" "$work/nccl/libnccl.so" && export LD_LIBRARY_PATH="$work/nccl:$(dirname "$ncclso"):$LD_LIBRARY_PATH"
fi

DEVICE=cuda:0 PIN=pinned UPLOAD=stream DTYPE=bf16
tiny=() tiny_baseline=() tiny_record=()
if [[ $SMOKE == 1 ]]; then
  DEVICE=cpu PIN=pageable UPLOAD=sync DTYPE=f32 STEPS=6 PT_STEPS=0 RECORD_STEPS=4 RECORD0427_STEPS=4 LOADER_STEPS=4
  vocab=${SMOKE_VOCAB:?SMOKE=1 needs SMOKE_VOCAB, the vocabulary of the tokenizers in IN}
  tiny=(--set run.device='"cpu"' --set model.model_dim=64 --set model.num_heads=2 --set model.num_kv_heads=1
        --set model.vocab_size="$vocab" --set train.batch_tokens=1024 --set train.seq_len=128 --set train.grad_accum_steps=2
        --set train.val_batch_tokens=1024 --set train.val_max_tokens=4096)
  tiny_baseline=(--set model.num_layers=2 --set stages.eval.stride=64)
  # The record's 11 blocks (its layer switches name them), at width 64.
  tiny_record=(--set model.num_layers=11 --set model.rope_train_seq_len=128 --set stages.eval.seq_len=128 --set stages.eval.stride=64
               --set stages.eval.chunk_tokens=512 --set stages.eval.batch_seqs=2 --set stages.eval.batch_windows=2)
fi

{ echo "== gpu-first-light $(date -u +%FT%TZ)"; nvidia-smi 2>&1 || echo "(no nvidia-smi)"; } > "$OUT/gpu.txt"
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
say "== gpu-first-light $(date -u +%FT%TZ) on ${gpu:-$DEVICE}$([[ $SMOKE == 1 ]] && echo ' (SMOKE: CPU, tiny model; not a measurement)')"
say "binary: $("$BIN" --version 2>&1 | head -1)"

# A run's steady ms/step (steps 3 to the last of steps.tsv: start-up and first loads out).
steady() {
  python3 - "$1/steps.tsv" <<'PY'
import sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().split("\n")[1:] if l.strip()]
t = {int(r[0]): float(r[3]) for r in rows}
last = max(t)
first = 2 if last >= 4 else 1
print(f"{(t[last] - t[first]) / (last - first):.1f}")
PY
}
# A field of a run's report.json (a Python expression on `r`).
field() {
  python3 - "$1/report.json" "$2" <<'PY' 2>/dev/null || echo "?"
import json, sys
r = json.load(open(sys.argv[1]))
print(eval(sys.argv[2]))
PY
}
# pipeline run CONFIG NAME SETTINGS...: its output in runs/NAME.out, 0 when it completed.
train() {
  local config=$1 name=$2
  shift 2
  "$BIN" run "$config" --out "$runs/$name" -q "$@" > "$runs/$name.out" 2>&1
}
# train_record CONFIG NAME SETTINGS...: a record at its 8 micro-batches of 48 x 2048, and when
# that is refused or runs out of memory (not in the smoke) again at 16 of 24 x 2048 (`accum`
# says so: 16, else empty); a failure is reported with the end of runs/NAME.out.
train_record() {
  local config=$1 name=$2
  shift 2
  accum=""
  train "$config" "$name" "$@" && return
  if grep -qiE "out of memory|CUDA_ERROR_OUT_OF_MEMORY|memory" "$runs/$name.out" && [[ $SMOKE != 1 ]]; then
    say "$name at 8 micro-batches of 48 x 2048: refused or out of memory; again with 16 of 24 x 2048"
    mv "$runs/$name.out" "$runs/$name-oom.out"
    rm -rf "${runs:?}/$name"
    accum=16
    train "$config" "$name" "$@" --set train.grad_accum_steps=16 && return
  fi
  fail "$name run (runs/$name.out): $(tail -2 "$runs/$name.out" | tr '\n' ' ')"
}

common1024=(--set "data.train=\"$IN/sp1024/fineweb_train_*.bin\"" --set "data.val=\"$IN/sp1024/fineweb_val_*.bin\""
            --set "data.tokenizer=\"$IN/tokenizers/fineweb_1024_bpe.model\"" --set train.val_every=0 --set train.val_max_tokens=65536
            --set train.max_wallclock_seconds=0 --set train.log_every=10 --set stages.pin.impl="\"$PIN\"" --set stages.upload.impl="\"$UPLOAD\""
            --set stages.train.dtype="\"$DTYPE\"" "${tiny[@]}" "${tiny_baseline[@]}")

# --- (a) engine-check -----------------------------------------------------------------------
if part a; then
say "== (a) pipeline engine-check --device $DEVICE"
check=(engine-check --device "$DEVICE" --json-out "$OUT/engine-check.json")
[[ $SMOKE == 1 ]] && check+=(--timing small)
"$BIN" "${check[@]}" > "$OUT/engine-check.txt" 2>&1 || fail "engine-check (engine-check.txt)"
grep -E '^(engine-check|stream|graphs|transfer)|micro-batch: |optimizer step: |FAILED' "$OUT/engine-check.txt" | tee -a "$summary"
# The 04-27 record's per-op table (on the CPU its model is minutes a pass: not in the smoke).
if [[ $SMOKE != 1 ]]; then
  "$BIN" engine-check --device "$DEVICE" --timing record-0427 --json-out "$OUT/engine-check-record.json" > "$OUT/engine-check-record.txt" 2>&1 \
    || fail "engine-check --timing record-0427 (engine-check-record.txt)"
  grep -E '^timings|micro-batch: |optimizer step: ' "$OUT/engine-check-record.txt" | sed 's/^/record-0427 /' | tee -a "$summary"
fi

fi

# --- (b) the baseline: engine, candle, PyTorch ------------------------------------------------
declare -A ms
if part b; then
say "== (b) baseline, $STEPS steps: engine ($DTYPE, activations auto: bf16 on a GPU; graphs on) and candle, side by side"
for impl in ${IMPLS:-engine candle}; do
  if train pipelines/baseline.toml "baseline-$impl" "${common1024[@]}" --set train.iterations="$STEPS" --set stages.train.impl="\"$impl\""; then
    ms[$impl]=$(steady "$runs/baseline-$impl")
    say "baseline $impl: steady ${ms[$impl]} ms/step, $(field "$runs/baseline-$impl" "round(r['train']['tokens_per_s'])") tokens/s, final val_loss $(field "$runs/baseline-$impl" "round(r['train']['val_loss'], 4)")"
  else
    fail "baseline on $impl (runs/baseline-$impl.out): $(tail -2 "$runs/baseline-$impl.out" | tr '\n' ' ')"
  fi
done
say "engine graphs: $(field "$runs/baseline-engine" "r['train']['engine'].get('graphs')"); mirror syncs: $(field "$runs/baseline-engine" "r['train']['engine'].get('mirror_syncs')")"
if [[ -n ${ms[engine]:-} && -n ${ms[candle]:-} ]]; then
  say "engine / candle throughput: $(python3 -c "print(f'{${ms[candle]} / ${ms[engine]}:.2f}x')") (target: above 1x; candle measured 910 ms on an H100 on 2026-11-22)"
fi
if [[ -f $IN/train_gpt.py && $PT_STEPS -gt 0 ]]; then
  mkdir -p "$runs/pytorch"
  (cd "$runs/pytorch" && PYTHONUNBUFFERED=1 DATA_PATH=$IN/sp1024 TOKENIZER_PATH=$IN/tokenizers/fineweb_1024_bpe.model ITERATIONS=$PT_STEPS \
    WARMUP_STEPS=5 VAL_LOSS_EVERY=0 TRAIN_LOG_EVERY=5 MAX_WALLCLOCK_SECONDS=0 RUN_ID=first-light timeout 300 python3 "$IN/train_gpt.py") \
    > "$runs/pytorch.out" 2>&1 || fail "train_gpt.py (runs/pytorch.out): $(tail -2 "$runs/pytorch.out" | tr '\n' ' ')"
  pt=$(python3 - "$runs/pytorch.out" <<'PY'
import re, sys
steps = [(int(m[1]), float(m[2])) for m in re.finditer(r"^step:(\d+)/\d+ train_loss:\S+ train_time:(\d+)ms", open(sys.argv[1]).read(), re.M)]
if len(steps) >= 2:
    (s0, t0), (s1, t1) = steps[1], steps[-1]
    print(f"{(t1 - t0) / (s1 - s0):.1f}")
PY
  )
  if [[ -n $pt ]]; then
    say "pytorch train_gpt.py: steady $pt ms/step (same shards, same GPU)"
    for impl in engine candle; do
      [[ -n ${ms[$impl]:-} ]] && say "$impl / pytorch throughput: $(python3 -c "print(f'{$pt / ${ms[$impl]}:.2f}x')")"
    done
  else
    fail "no step lines in runs/pytorch.out"
  fi
else
  say "pytorch: not run ($IN/train_gpt.py not given)"
fi

fi

# --- (c) graph replay against op-by-op launches ------------------------------------------------
if part c; then
say "== (c) the engine's baseline again with graphs off"
if train pipelines/baseline.toml baseline-eager "${common1024[@]}" --set train.iterations="$STEPS" --set stages.train.impl='"engine"' \
     --set stages.train.cuda_graph=false; then
  eager=$(steady "$runs/baseline-eager")
  say "engine without graphs: steady $eager ms/step (with graphs: ${ms[engine]:-?})"
  if cmp -s "$runs/baseline-engine/final_model.safetensors" "$runs/baseline-eager/final_model.safetensors"; then
    say "graph replay vs op by op: final weights bit-identical"
  else
    fail "graph replay vs op by op: final weights differ"
  fi
else
  fail "the eager engine run (runs/baseline-eager.out): $(tail -2 "$runs/baseline-eager.out" | tr '\n' ' ')"
fi

fi

# --- (d) the record on the engine ---------------------------------------------------------------
if part d; then
say "== (d) pipelines/record.toml on the engine, $RECORD_STEPS steps"
record=(--set "data.train=\"$IN/sp8192/fineweb_train_*.bin\"" --set "data.val=\"$IN/sp8192/fineweb_val_*.bin\""
        --set "data.tokenizer=\"$IN/tokenizers/fineweb_8192_bpe.model\"" --set train.iterations="$RECORD_STEPS" --set train.val_every=0
        --set train.val_max_tokens=65536 --set train.max_wallclock_seconds=0 --set train.gptq_reserve_seconds=0 --set train.log_every=5
        --set stages.train.impl='"engine"' --set stages.train.dtype="\"$DTYPE\"" --set stages.pin.impl="\"$PIN\""
        --set stages.upload.impl="\"$UPLOAD\"" --set stages.artifact.calibration_batches=2 --set stages.eval.epochs=1 "${tiny[@]}"
        "${tiny_record[@]}")
sampler=""
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$work/memory.log" 2>/dev/null &
  sampler=$!
fi
train_record pipelines/record.toml record "${record[@]}"
[[ -n $sampler ]] && kill "$sampler" 2>/dev/null
if [[ -f $runs/record/steps.tsv ]]; then
  say "record on the engine$([[ -n $accum ]] && echo ", $accum micro-batches a step"): steady $(steady "$runs/record") ms/step, arena $(field "$runs/record" "round(r['train']['engine']['arena_bytes'] / 2**30, 1)") GiB, graphs $(field "$runs/record" "r['train']['engine'].get('graphs')")"
  grep -E "^(step:$RECORD_STEPS/|final |looping|pre-quantization|final_.*roundtrip )" "$runs/record/train.log" 2>/dev/null | head -6 | tee -a "$summary"
fi
if [[ -s $work/memory.log ]]; then
  peak=$(sort -n "$work/memory.log" | tail -1)
  say "peak GPU memory during the record run: $peak MiB (nvidia-smi, every 200 ms)"
  { echo "== GPU memory used during the record run (MiB, every 200 ms)"; cat "$work/memory.log"; } >> "$OUT/gpu.txt"
fi

fi

# --- (f) the 04-27 record on the engine ----------------------------------------------------------
say "== (f) pipelines/record-0427.toml on the engine, $RECORD0427_STEPS steps (EMA on, validation on the engine)"
r0427=(--set "data.train=\"$IN/sp8192/fineweb_train_*.bin\"" --set "data.val=\"$IN/sp8192/fineweb_val_*.bin\""
       --set "data.tokenizer=\"$IN/tokenizers/fineweb_8192_bpe.model\"" --set train.iterations="$RECORD0427_STEPS" --set train.val_every=4
       --set train.val_max_tokens=262144 --set train.max_wallclock_seconds=0 --set train.gptq_reserve_seconds=0 --set train.log_every=1
       --set stages.train.impl='"engine"' --set stages.train.dtype="\"$DTYPE\"" --set stages.pin.impl="\"$PIN\"" --set stages.upload.impl="\"$UPLOAD\""
       --set stages.ckpt.every=0 --set stages.artifact.impl='"quantize"' --set stages.artifact.codec='"zlib"' --set stages.artifact.level=1
       --set stages.artifact.eval=false --set stages.eval.impl='"sliding"' --set stages.eval.stride=2048 "${tiny[@]}")
# The smoke: the record's 11 blocks at width 64, sequences of 128.
[[ $SMOKE == 1 ]] && r0427+=(--set model.num_layers=11 --set train.val_max_tokens=4096 --set stages.eval.seq_len=128 --set stages.eval.stride=64)
if part f; then
train_record pipelines/record-0427.toml record-0427 "${r0427[@]}"
fi
if part f && [[ -f $runs/record-0427/steps.tsv ]]; then
  say "record-0427 on the engine$([[ -n $accum ]] && echo ", $accum micro-batches a step"): steady $(steady "$runs/record-0427") ms/step, arena $(field "$runs/record-0427" "round(r['train']['engine']['arena_bytes'] / 2**30, 1)") GiB, graphs $(field "$runs/record-0427" "r['train']['engine'].get('graphs')"), mirror syncs $(field "$runs/record-0427" "r['train']['engine'].get('mirror_syncs')")"
  # Each step's device phases (steps.tsv): step 1 runs op by op, step 2 captures the graphs.
  python3 - "$runs/record-0427/steps.tsv" <<'PY' | tee -a "$summary"
import sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().split("\n")[1:] if l.strip()]
for r in rows[:3] + rows[3:][-1:]:
    print(f"record-0427 step {r[0]}: forward {r[5]} ms, backward {r[6]} ms, optimizer {r[7]} ms")
PY
fi

# --- (g) the seeds' loader settings on the engine ---------------------------------------------------
if part g; then
say "== (g) the baseline on the engine, $LOADER_STEPS steps: page-locked staging and a copy stream against pageable and a synchronous copy"
loaders=("pinned stream" "pageable sync")
[[ $SMOKE == 1 ]] && loaders=("pageable cpu" "pageable sync")
for v in "${loaders[@]}"; do
  read -r pin upload <<< "$v"
  name="loader-$pin-$upload"
  if train pipelines/baseline.toml "$name" "${common1024[@]}" --set train.iterations="$LOADER_STEPS" --set stages.train.impl='"engine"' \
       --set stages.pin.impl="\"$pin\"" --set stages.upload.impl="\"$upload\""; then
    say "loader $pin + $upload: steady $(steady "$runs/$name") ms/step, executor input wait $(field "$runs/$name" "(lambda c: '%.3f%% of its time, p99 %.0f us' % (100 * c['recv_blocked_fraction'], c['recv_blocked_us']['p99']))(next(c for k, c in r['channels'].items() if k.endswith('->train')))")"
  else
    fail "loader $pin + $upload (runs/$name.out): $(tail -2 "$runs/$name.out" | tr '\n' ' ')"
  fi
done

fi

# --- (h) the f32 arena beside the bf16 activations -------------------------------------------
if part h; then
say "== (h) the engine with activations = \"f32\" (an f32 arena) beside (b)'s and (f)'s bf16 activations: engine-check's timings, the baseline ($STEPS steps), record-0427 ($RECORD0427_STEPS steps)"
if [[ $SMOKE == 1 || $DTYPE != bf16 ]]; then
  say "f32 arena: not run (bf16 activations are the GPU backend's, with dtype bf16; the warp emulator's tests check them on the CPU)"
else
  "$BIN" engine-check --device "$DEVICE" --activations f32 > "$OUT/engine-check-f32.txt" 2>&1 || fail "engine-check --activations f32 (engine-check-f32.txt)"
  grep -E '^(engine-check|timings)|micro-batch: |optimizer step: |FAILED' "$OUT/engine-check-f32.txt" | sed 's/^/f32 arena /' | tee -a "$summary"
  if train pipelines/baseline.toml baseline-f32 "${common1024[@]}" --set train.iterations="$STEPS" --set stages.train.impl='"engine"' \
       --set stages.train.activations='"f32"'; then
    say "baseline engine, f32 arena: steady $(steady "$runs/baseline-f32") ms/step (bf16 activations: ${ms[engine]:-not run}), final val_loss $(field "$runs/baseline-f32" "round(r['train']['val_loss'], 4)"), arena $(field "$runs/baseline-f32" "round(r['train']['engine']['arena_bytes'] / 2**30, 2)") GiB"
  else
    fail "baseline with an f32 arena (runs/baseline-f32.out): $(tail -2 "$runs/baseline-f32.out" | tr '\n' ' ')"
  fi
  train_record pipelines/record-0427.toml record-0427-f32 "${r0427[@]}" --set stages.train.activations='"f32"'
  if [[ -f $runs/record-0427-f32/steps.tsv ]]; then
    say "record-0427 on the engine, f32 arena$([[ -n $accum ]] && echo ", $accum micro-batches a step"): steady $(steady "$runs/record-0427-f32") ms/step, arena $(field "$runs/record-0427-f32" "round(r['train']['engine']['arena_bytes'] / 2**30, 1)") GiB, final val_loss $(field "$runs/record-0427-f32" "round(r['train']['val_loss'], 4)")"
  fi
fi
fi

# --- (i) cuDNN's fused attention ------------------------------------------------------------------
if part i; then
say "== (i) cuDNN attention: engine-check --attention cudnn, the attention trials, the baseline with cudnn and flash_mma"
if [[ $SMOKE == 1 ]]; then
  say "cuDNN is the GPU backend's: engine-check --attention cudnn refuses the CPU (checked), the rest is not run in the smoke"
  if "$BIN" engine-check --device cpu --attention cudnn > "$runs/engine-check-cudnn.txt" 2>&1; then
    fail "engine-check --attention cudnn ran on the CPU"
  fi
else
  "$BIN" engine-check --device "$DEVICE" --attention cudnn > "$runs/engine-check-cudnn.txt" 2>&1 || fail "engine-check --attention cudnn (runs/engine-check-cudnn.txt)"
  grep -E '^(engine-check|timings)|cudnn|attention_(fwd|bwd)|micro-batch: |FAILED|warning' "$runs/engine-check-cudnn.txt" | sed 's/^/cudnn /' | tee -a "$summary"
  grep -E 'attention_(fwd|bwd)' "$OUT/engine-check.txt" | sed 's/^/flash_mma /' | tee -a "$summary"
  # The 04-27 record's shapes: documents, so cuDNN's ragged graphs (24 x 2048 = 49,152 slots).
  "$BIN" engine-check --device "$DEVICE" --attention cudnn --timing record-0427 > "$runs/engine-check-record-cudnn.txt" 2>&1 \
    || fail "engine-check --attention cudnn --timing record-0427 (runs/engine-check-record-cudnn.txt)"
  grep -E '^timings|attention_(fwd|bwd)|micro-batch: |warning' "$runs/engine-check-record-cudnn.txt" | sed 's/^/record-0427 cudnn /' | tee -a "$summary"
  [[ -f $OUT/engine-check-record.txt ]] && grep -E 'attention_(fwd|bwd)' "$OUT/engine-check-record.txt" | sed 's/^/record-0427 flash_mma /' | tee -a "$summary"
  for shape in "64 1024" "48 2048"; do
    set -- $shape
    for k in cudnn flash_mma flash; do
      line=$("$BIN" attention-trial --device "$DEVICE" --kernels "$k" --batch "$1" --seq-len "$2" --heads 8 --kv-heads 4 --head-dim 64 2>&1 | tail -1)
      say "attention trial $k at $1 x $2: $line"
    done
  done
  for att in cudnn flash_mma; do
    if train pipelines/baseline.toml "baseline-$att" "${common1024[@]}" --set train.iterations="$STEPS" --set stages.train.impl='"engine"' \
         --set stages.train.attention="\"$att\""; then
      ms[$att]=$(steady "$runs/baseline-$att")
      say "baseline engine, attention $att: steady ${ms[$att]} ms/step, final val_loss $(field "$runs/baseline-$att" "round(r['train']['val_loss'], 4)")"
    else
      fail "baseline, attention $att (runs/baseline-$att.out): $(tail -2 "$runs/baseline-$att.out" | tr '\n' ' ')"
    fi
  done
  grep -h "cuDNN" "$runs"/baseline-cudnn.out | head -3 | tee -a "$summary"
  if [[ -n ${ms[cudnn]:-} && -n ${ms[flash_mma]:-} ]]; then
    say "cudnn / flash_mma throughput: $(python3 -c "print(f'{${ms[flash_mma]} / ${ms[cudnn]}:.2f}x')")"
    [[ -n ${pt:-} ]] && say "cudnn / pytorch throughput: $(python3 -c "print(f'{$pt / ${ms[cudnn]}:.2f}x')") (target: 1.2x)"
  fi
fi

fi

# --- (j) NCCL at world size 1 ---------------------------------------------------------------------
if part j; then
say "== (j) the engine through NCCL at world size 1: the baseline plain and through pipeline launch --nproc 1, $STEPS steps each"
if [[ $SMOKE == 1 ]]; then
  say "NCCL is the GPU's: not run in the smoke (CPU ranks through MPI: tests/data_parallel.rs)"
else
  nccl=("${common1024[@]}" --set train.iterations="$STEPS" --set stages.train.impl='"engine"' --set stages.train.attention='"flash_mma"')
  plain=baseline-flash_mma
  if [[ -z ${ms[flash_mma]:-} ]]; then
    plain=baseline-plain
    train pipelines/baseline.toml "$plain" "${nccl[@]}" || fail "the plain engine run (runs/$plain.out): $(tail -2 "$runs/$plain.out" | tr '\n' ' ')"
  fi
  "$BIN" launch --nproc 1 pipelines/baseline.toml --out "$runs/baseline-nccl1" -q "${nccl[@]}" > "$runs/baseline-nccl1.out" 2>&1 \
    || fail "launch --nproc 1 (runs/baseline-nccl1.out): $(tail -3 "$runs/baseline-nccl1.out" | tr '\n' ' ')"
  if [[ -f $runs/$plain/steps.tsv && -f $runs/baseline-nccl1/steps.tsv ]]; then
    a=$(steady "$runs/$plain") b=$(steady "$runs/baseline-nccl1")
    say "baseline engine plain: steady $a ms/step; through NCCL (launch --nproc 1): steady $b ms/step; overhead $(python3 -c "print(f'{100 * ($b - $a) / $a:+.2f}%')") (target: under 1%)"
    say "NCCL run: collective $(field "$runs/baseline-nccl1" "r.get('ranks', {}).get('backend')"); graphs $(field "$runs/baseline-nccl1" "r['train']['engine'].get('graphs')"); final val_loss $(field "$runs/baseline-nccl1" "round(r['train']['val_loss'], 4)") (plain $(field "$runs/$plain" "round(r['train']['val_loss'], 4)"))"
    grep -hiE "warning|nccl" "$runs/baseline-nccl1.out" | head -4 | tee -a "$summary"
  fi
  if [[ -f $runs/$plain/report.json ]]; then
    "$BIN" project "$runs/$plain" --nproc 8 > "$runs/project.txt" 2>&1 || fail "pipeline project (runs/project.txt): $(tail -2 "$runs/project.txt" | tr '\n' ' ')"
    sed 's/^/project /' "$runs/project.txt" | head -30 | tee -a "$summary"
  fi
fi
fi

# --- (e) the results ------------------------------------------------------------------------------
# Weights stay behind (train_gpt.py's final_model.pt alone is 67 MB): the device tool brings
# back files of at most 16 MiB.
(cd "$work" && find runs \( -name '*.safetensors' -o -name '*.pgqz' -o -name '*.pt' -o -name '*.ptz' \) -delete; tar czf "$OUT/runs.tar.gz" runs)
say "== $( [[ $status == 0 ]] && echo 'first light: every check passed' || echo 'first light: FAILED (see above)' ); files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit $status
