#!/usr/bin/env python3
"""Single-threaded numpy implementation of the records' ShuffledSequenceLoader.next_batch, timed.

The yardstick for the Rust shuffled sampler (benches/sampler.rs runs this and prints both):
per-shard random phase and permutation of sequence starts, shards chosen with probability
proportional to what they have left (one uniform draw against the normalised cumulative sum),
rows read from a memory map into int64 x, y of shape (rows, seq_len).

Prints one line: `numpy_ms_per_batch <mean> batches <n> rows <rows> seq_len <T>`.
"""
import argparse
import glob
import time

import numpy as np


class Loader:
    def __init__(self, files, seq_len, seed):
        self.t = seq_len
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.maps = []
        for f in files:
            header = np.fromfile(f, dtype="<i4", count=256)
            assert header[0] == 20240520 and header[1] == 1
            self.maps.append(np.memmap(f, dtype="<u2", mode="r", offset=1024, shape=(int(header[2]),)))
        self.starts = [None] * len(self.maps)
        for s in range(len(self.maps)):
            self.reset(s)

    def reset(self, s):
        n, t = len(self.maps[s]), self.t
        max_phase = min(t - 1, max(0, n - t - 1))
        phase = int(self.rng.integers(max_phase + 1)) if max_phase > 0 else 0
        m = (n - 1 - phase) // t
        self.starts[s] = list(phase + self.rng.permutation(m) * t)

    def next_batch(self, rows):
        t = self.t
        x = np.empty((rows, t), dtype=np.int64)
        y = np.empty((rows, t), dtype=np.int64)
        for i in range(rows):
            remaining = np.array([len(s) for s in self.starts], dtype=np.float64)
            if remaining.sum() == 0:
                for s in range(len(self.maps)):
                    self.reset(s)
                remaining = np.array([len(s) for s in self.starts], dtype=np.float64)
            s = self.rng.choice(len(self.maps), p=remaining / remaining.sum())
            k = self.starts[s].pop()
            w = np.asarray(self.maps[s][k:k + t + 1], dtype=np.int64)
            x[i] = w[:-1]
            y[i] = w[1:]
        return x, y


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", required=True, help="glob of train shards")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    files = sorted(glob.glob(args.shards))
    assert files, f"no shard matches {args.shards}"
    loader = Loader(files, args.seq_len, seed=0)
    for _ in range(args.warmup):
        loader.next_batch(args.rows)
    t0 = time.perf_counter()
    for _ in range(args.batches):
        loader.next_batch(args.rows)
    ms = (time.perf_counter() - t0) * 1e3 / args.batches
    print(f"numpy_ms_per_batch {ms:.4f} batches {args.batches} rows {args.rows} seq_len {args.seq_len}")


if __name__ == "__main__":
    main()
