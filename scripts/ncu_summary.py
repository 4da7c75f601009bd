#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV of kernel durations (`ncu --metrics gpu__time_duration.sum
--csv --print-units base`) for one training micro-batch of `pipeline`: the kernels from the first
launch through the embedding gradient (`embedding_bwd_*`, the backward pass's last kernel),
summed by family and by kernel, largest first.

usage: scripts/ncu_summary.py NCU_CSV [TOP]
"""
import collections
import csv
import re
import sys

# Kernel families, first match wins.
FAMILIES = [
    ("flash attention", r"^flash_"),
    ("cuBLAS products", r"nvjet|gemm|cublas|splitKreduce"),
    ("casts", r"^cast_"),
    ("fused row kernels", r"^(rms_norm|norm_rope|relu_sq|scale_cols|scale_add|resid_mix|causal_softmax|column_dot|embedding_bwd)"),
    ("candle copies", r"copy"),
    ("candle elementwise and reductions", r""),
]


def family(name):
    return next(f for f, pat in FAMILIES if re.search(pat, name))


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(sys.argv[1]) as f:
        lines = [l for l in f if l.startswith('"')]
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        sys.exit(f"{sys.argv[1]}: no gpu__time_duration.sum rows (ran ncu with --metrics gpu__time_duration.sum --csv?)")
    names = [r["Kernel Name"] for r in rows]
    ns = [float(r["Metric Value"].replace(",", "")) for r in rows]
    ends = [i for i, n in enumerate(names) if n.startswith("embedding_bwd")]
    if not ends:
        sys.exit(f"{sys.argv[1]}: no embedding_bwd launch: the capture ends before the first backward pass (raise --launch-count)")
    end = ends[0] + 1
    by_kernel, count, by_family = collections.defaultdict(float), collections.Counter(), collections.defaultdict(float)
    for n, t in zip(names[:end], ns[:end]):
        short = n.split("(")[0][:70]
        by_kernel[short] += t
        count[short] += 1
        by_family[family(n)] += t
    total = sum(by_kernel.values())
    print(f"one micro-batch, forward + backward: {total / 1e6:.1f} ms in {end} kernels (Nsight clocks)")
    print("\nby family:")
    for f, t in sorted(by_family.items(), key=lambda kv: -kv[1]):
        print(f"  {t / 1e6:8.2f} ms {100 * t / total:5.1f}%  {f}")
    print(f"\ntop {top} kernels:")
    for k, t in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {t / 1e6:8.2f} ms {100 * t / total:5.1f}% {count[k]:5d}x  {k}")


if __name__ == "__main__":
    main()
