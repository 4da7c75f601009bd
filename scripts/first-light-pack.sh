#!/usr/bin/env bash
# Fills first-light/ (ignored by git) with what scripts/gpu-first-light.sh needs on the GPU
# machine: the `cuda` binary, xz-compressed, and a few shards and the tokenizers of SP1024 (the
# baseline's data) and SP8192 (the record's). Run it here, on the machine without a GPU.
#
#   scripts/first-light-pack.sh SP1024_DIR SP8192_DIR TOKENIZER_DIR [TRAIN_GPT]
#   scripts/first-light-pack.sh ../shared/data/golf_en_sp1024 ../shared/data/golf_en_sp8192 ../shared/tokenizers
#
# SPx_DIR: challenge-format shards (fineweb_train_*.bin, fineweb_val_*.bin); TOKENIZER_DIR holds
# fineweb_1024_bpe.model and fineweb_8192_bpe.model; TRAIN_GPT: the challenge's train_gpt.py,
# fetched by you (it is copied into first-light/, never committed). SHARDS=N train shards of
# each (default 4: enough for the first light's steps), every val shard. BUILD=0 packs the
# binary already built at target/cuda/release/pipeline instead of running scripts/build-cuda.sh
# (about 20 minutes cold on 2 cores). It ends with the folder's size: with the checkout it must
# stay under the device tool's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: $0 SP1024_DIR SP8192_DIR TOKENIZER_DIR [TRAIN_GPT]"
sp1024=${1:?$usage} sp8192=${2:?$usage} tokens=${3:?$usage} train_gpt=${4:-}
SHARDS=${SHARDS:-4}
dest=first-light
for f in "$sp1024/fineweb_train_000000.bin" "$sp1024/fineweb_val_000000.bin" "$sp8192/fineweb_train_000000.bin" \
         "$sp8192/fineweb_val_000000.bin" "$tokens/fineweb_1024_bpe.model" "$tokens/fineweb_8192_bpe.model"; do
  [[ -f $f ]] || { echo "error: $f does not exist" >&2; exit 2; }
done
[[ -z $train_gpt || -f $train_gpt ]] || { echo "error: $train_gpt does not exist" >&2; exit 2; }

if [[ ${BUILD:-1} == 1 ]]; then
  scripts/build-cuda.sh >&2
fi
bin=target/cuda/release/pipeline
[[ -x $bin ]] || { echo "error: no $bin (run scripts/build-cuda.sh, or drop BUILD=0)" >&2; exit 1; }

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/sp1024" "$dest.tmp/sp8192" "$dest.tmp/tokenizers"
xz -T0 -6 -c "$bin" > "$dest.tmp/pipeline.xz"
for pair in "sp1024:$sp1024" "sp8192:$sp8192"; do
  sub=${pair%%:*} src=${pair#*:}
  ls "$src"/fineweb_train_*.bin | sort | head -n "$SHARDS" | xargs -I{} cp {} "$dest.tmp/$sub/"
  cp "$src"/fineweb_val_*.bin "$dest.tmp/$sub/"
done
cp "$tokens/fineweb_1024_bpe.model" "$tokens/fineweb_8192_bpe.model" "$dest.tmp/tokenizers/"
[[ -n $train_gpt ]] && cp "$train_gpt" "$dest.tmp/train_gpt.py"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "$dest/: $(du -sh "$dest" | cut -f1) ($(ls "$dest"/sp1024 | wc -l) + $(ls "$dest"/sp8192 | wc -l) shards, binary $(du -h "$dest/pipeline.xz" | cut -f1)$([[ -n $train_gpt ]] && echo ', train_gpt.py'))"
echo "on the GPU machine, from the checkout's root: scripts/gpu-first-light.sh $dest \$OUT"
