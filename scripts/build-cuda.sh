#!/usr/bin/env bash
# Builds the GPU binary (`--features cuda`) on a machine without a GPU or a CUDA install.
#
#   scripts/build-cuda.sh            # release build for H100/H200 (sm_90a), stripped; prints its path
#   scripts/build-cuda.sh --check    # `cargo check --features cuda` only (what CI runs)
#   scripts/build-cuda.sh --lean     # the lean record build (`--no-default-features`): what a
#                                    # record trains with, its source bundle counted
#                                    # (docs/submitting.md); keep pipeline.d beside the binary
#
# What it does:
# 1. installs the pinned CUDA 13.0 compiler wheels from PyPI into a cache
#    ($CUDA_PIP, default ~/.cache/pipeline-cuda13; ~104 MB download, once);
# 2. fetches the header files of cuDNN 9.28.1 (nvidia-cudnn-cu13), cudnn-frontend 1.32.0
#    (nvidia-cudnn-frontend) and NVRTC 13.0 (nvidia-cuda-nvrtc: nvrtc.h, which the frontend
#    includes) into the same cache, once: scripts/fetch-wheel-headers.py reads only those members
#    of the wheels (517, 11.6 and 90 MB) with HTTP Range requests, about 1.6 MB in all, 4.5 MB
#    of headers. build.rs compiles cpp/cudnn_sdpa.cpp against them; cuDNN itself is loaded at
#    run time (dlopen), so the binary starts without it;
# 3. prepares candle-core for dynamic loading of the CUDA libraries: a copy of the registry's
#    candle-core 0.11.1 in target/cuda-patch/ with one word changed ("dynamic-linking" ->
#    "dynamic-loading", upstream huggingface/candle#3900), used through `--config patch...`
#    for this build only (nothing of it is committed; Cargo.lock is restored afterwards), and
#    with scripts/patch-candle-backprop.py applied: the backward pass stores a node's first
#    gradient instead of adding it to fresh zeros (a memset and an add per node on the GPU);
# 4. builds with CUDA_COMPUTE_CAP (default 90: H100/H200; 80 for a portable build) and the
#    static CUDA runtime (build.rs), so the binary starts on machines without CUDA.
#
# On the GPU machine the binary needs only the driver (libcuda.so.1) and cuBLAS/cuRAND/NVRTC,
# which it loads with dlopen: a PyTorch cu13 install provides them (see scripts/gpu-check.sh),
# as it does libcudnn.so.9 and libcudart.so.13, which cuDNN's attention loads with dlopen too.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=build
lean=()
case "${1:-}" in
  --check) mode=check ;;
  --lean) lean=(--no-default-features) ;;
  "") ;;
  *) echo "usage: $0 [--check | --lean]" >&2; exit 2 ;;
esac

CUDA_PIP=${CUDA_PIP:-$HOME/.cache/pipeline-cuda13}
if [[ ! -x "$CUDA_PIP/nvidia/cu13/bin/nvcc" ]]; then
  echo "== installing the CUDA 13.0 compiler wheels into $CUDA_PIP" >&2
  python3 -m pip install --quiet --no-deps --target "$CUDA_PIP" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
export CUDA_ROOT=$CUDA_PIP/nvidia/cu13

# Header files only, each set in a directory named by its version (nothing of it is committed).
fetch_headers() {  # NAME VERSION PREFIX DEST
  if [[ ! -d "$4" ]]; then
    echo "== fetching the headers of $1==$2 into $4" >&2
    python3 scripts/fetch-wheel-headers.py "$@"
  fi
}
export CUDNN_INCLUDE=$CUDA_PIP/cudnn-9.28.1.4/include
export CUDNN_FRONTEND_INCLUDE=$CUDA_PIP/cudnn-frontend-1.32.0/include
export NVRTC_INCLUDE=$CUDA_PIP/nvrtc-13.0.88/include
fetch_headers nvidia-cudnn-cu13 9.28.1.4 nvidia/cudnn/include/ "$CUDNN_INCLUDE"
fetch_headers nvidia-cudnn-frontend 1.32.0 include/ "$CUDNN_FRONTEND_INCLUDE"
fetch_headers nvidia-cuda-nvrtc 13.0.88 nvidia/cu13/include/ "$NVRTC_INCLUDE"
export PATH=$CUDA_ROOT/bin:$PATH
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
nvcc --version | tail -1 >&2

# candle-core as the registry has it, made to load CUDA with dlopen.
cargo fetch --locked >/dev/null
src=$(find "${CARGO_HOME:-$HOME/.cargo}/registry/src" -maxdepth 1 -mindepth 1 -type d -exec test -d {}/candle-core-0.11.1 \; -print -quit)
[[ -n "$src" ]] || { echo "error: candle-core 0.11.1 is not in the cargo registry after cargo fetch" >&2; exit 1; }
# CANDLE_BACKPROP_PATCH=0 builds without the backward-pass patch (for an A/B of it).
backprop_patch=${CANDLE_BACKPROP_PATCH:-1}
patch=$PWD/target/cuda-patch/candle-core$([[ $backprop_patch == 1 ]] || echo -plain)
if [[ ! -f "$patch/.prepared" || scripts/patch-candle-backprop.py -nt "$patch/.prepared" ]]; then
  rm -rf "$patch"
  mkdir -p "$(dirname "$patch")"
  cp -r "$src/candle-core-0.11.1" "$patch"
  grep -q '"dynamic-linking",' "$patch/Cargo.toml" || { echo "error: candle-core's Cargo.toml no longer names dynamic-linking" >&2; exit 1; }
  sed -i 's/"dynamic-linking",/"dynamic-loading",/' "$patch/Cargo.toml"
  if [[ $backprop_patch == 1 ]]; then python3 scripts/patch-candle-backprop.py "$patch"; fi
  touch "$patch/.prepared"
fi

# The patch changes candle-core's lock entry: keep the committed Cargo.lock as it is.
cp Cargo.lock target/cuda-patch/Cargo.lock.orig
trap 'cp target/cuda-patch/Cargo.lock.orig Cargo.lock' EXIT
args=(--features cuda --config "patch.crates-io.candle-core.path=\"$patch\"")

if [[ $mode == check ]]; then
  echo "== cargo check --features cuda (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP)" >&2
  cargo check "${args[@]}" --all-targets
  echo "== cargo check --no-default-features --features cuda (the lean record build)" >&2
  cargo check "${args[@]}" --no-default-features
  exit 0
fi

echo "== cargo build --release --features cuda (CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP)" >&2
CARGO_TARGET_DIR=target/cuda cargo build --release "${args[@]}" "${lean[@]}"
bin=target/cuda/release/pipeline
# pipeline.d beside the binary lists the sources it was built from: its runs pack them as the
# counted code (src/artifact/bundle/sources.rs). Carry it with the binary.
strip "$bin"
echo "$PWD/$bin"
