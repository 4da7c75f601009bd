#!/usr/bin/env bash
# The lean record build (`--no-default-features`, docs/submitting.md): it compiles, runs the
# runtime end to end, and refuses by name what it leaves out (the candle executor). The test
# command builds the full binary; this builds the lean one in the same target folder (the
# dependencies are reused: only the crate compiles, twice, about 3.5 min on 2 cores), so run it after
# anything that needs the full binary, or build that again afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
# The lean build with the candle executor alone (docs/commands.md) compiles too: items gated
# on `tools` and on `candle` must not lean on each other.
# Warnings are errors for the crate only (`cargo rustc`: the dependencies' build is reused).
cargo rustc --locked --lib --no-default-features --features candle -- -D warnings
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The lean build itself, once; a warning in the crate (dead code left behind) fails the check.
cargo build --locked --no-default-features 2>&1 | tee "$tmp/build.log"
if grep -q '^warning' "$tmp/build.log"; then echo "lean: the build has warnings"; exit 1; fi
bin="${CARGO_TARGET_DIR:-target}/debug/pipeline"

"$bin" run pipelines/synthetic.toml --out "$tmp/synthetic" --set stages.source.count=100 >"$tmp/run.log" 2>&1 || { cat "$tmp/run.log"; exit 1; }
echo "lean: the synthetic graph ran"

# Asked for the candle executor, the lean build names the key and says how to get it.
for key in stages.train.impl stages.eval.executor stages.artifact.executor; do
  if out=$("$bin" validate pipelines/demo.toml --set "$key=candle" 2>&1); then
    echo "lean: $key = candle was accepted"; exit 1
  fi
  grep -q "the candle executor is not in this build" <<<"$out" || { echo "lean: $key = candle: no clear refusal:"; echo "$out"; exit 1; }
done
echo "lean: the candle executor is refused by name"
