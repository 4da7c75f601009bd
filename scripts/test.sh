#!/usr/bin/env bash
# The README's test command (what CI runs): `cargo test --locked`, with the `mpi` feature where
# MPI and libclang are installed, so that the data-parallel tests (tests/data_parallel.rs) run
# two CPU ranks; without them those tests say they are skipped. Extra arguments go to cargo test.
set -euo pipefail
cd "$(dirname "$0")/.."
features=()
if command -v mpicc >/dev/null && command -v mpirun >/dev/null && ldconfig -p 2>/dev/null | grep -q libclang; then
  features=(--features mpi)
else
  echo "scripts/test.sh: MPI or libclang not installed: building without the mpi feature; the two-rank tests will be skipped" >&2
  echo "  (Debian: apt-get install libopenmpi-dev openmpi-bin libclang-dev)" >&2
fi
# `cargo build` first: it writes target/debug/pipeline.d, the list of the binary's sources that
# its runs pack as their source bundle (src/artifact/bundle/sources.rs); `cargo test` builds the
# same binary for the integration tests but writes no such list. Nothing is compiled twice.
cargo build --locked "${features[@]}"
exec cargo test --locked "${features[@]}" "$@"
