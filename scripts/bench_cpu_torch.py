"""PyTorch eager on the CPU: the challenge's `train_gpt.py` GPT at the demo's model and batch
shape (pipelines/demo.toml: vocabulary 1024, 4 layers, width 128, 4/2 heads, MLP x2, 16
sequences of 256 tokens per step), with the same number of threads as the run it is compared
with. Prints the median ms of a whole training step (forward, backward, Muon on the block
matrices, Adam on the rest), and of forward + backward alone.

The script imports the challenge's GPT, Muon and data loader from a `train_gpt.py` you fetch
(nothing of it is in this repository). Its Newton-Schulz runs in bf16 (for the GPU); on the CPU
that would time bf16 emulation, so it is replaced by the same iteration in f32, which is what
the engine and the candle executor run on the CPU.

    TRAIN_GPT=path/to/train_gpt.py python3 scripts/bench_cpu_torch.py --threads 2

Needs torch, numpy and sentencepiece (the script's imports).
"""

import argparse
import glob
import importlib.util
import os
import statistics
import time

import torch


def load_script(path):
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ns5_f32(G, steps=10, eps=1e-7):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.float()
    X /= X.norm() + eps
    transposed = G.size(0) > G.size(1)
    if transposed:
        X = X.T
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.T if transposed else X


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30, help="timed steps (after 3 warm-up steps)")
    ap.add_argument("--shards", default="data/demo/shards/fineweb_train_*.bin")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1337)
    tg = load_script(os.environ["TRAIN_GPT"])
    tg.zeropower_via_newtonschulz5 = ns5_f32
    model = tg.GPT(
        vocab_size=1024, num_layers=4, model_dim=128, num_heads=4, num_kv_heads=2, mlp_mult=2,
        tie_embeddings=True, tied_embed_init_std=0.005, logit_softcap=30.0, rope_base=10000.0, qk_gain_init=1.5,
    ).float()
    blocks = list(model.blocks.named_parameters())
    patterns = tg.CONTROL_TENSOR_NAME_PATTERNS
    matrix = [p for n, p in blocks if p.ndim == 2 and not any(x in n for x in patterns)]
    scalar = [p for n, p in blocks if p.ndim < 2 or any(x in n for x in patterns)] + [model.skip_weights]
    opts = [
        torch.optim.Adam([model.tok_emb.weight], lr=0.05, betas=(0.9, 0.95), eps=1e-8),
        tg.Muon(matrix, lr=0.04, momentum=0.95, backend_steps=5),
        torch.optim.Adam(scalar, lr=0.04, betas=(0.9, 0.95), eps=1e-8),
    ]
    tokens = torch.cat([tg.load_data_shard(__import__("pathlib").Path(f)) for f in sorted(glob.glob(args.shards))[:1]])
    rows, t = 16, 256
    span = rows * t + 1

    def batch(i):
        w = tokens[i * span:(i + 1) * span].long()
        return w[:-1].reshape(rows, t), w[1:].reshape(rows, t)

    step_ms, fb_ms = [], []
    for i in range(args.steps + 3):
        x, y = batch(i)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        for o in opts:
            o.step()
        model.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if i >= 3:
            fb_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t0) * 1e3)
    print(f"torch {torch.__version__} eager, {args.threads} threads, {args.steps} steps of {rows}x{t} tokens")
    print(f"step median {statistics.median(step_ms):.1f} ms  forward+backward median {statistics.median(fb_ms):.1f} ms  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
