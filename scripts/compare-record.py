#!/usr/bin/env python3
"""Step-by-step comparison of a `pipeline` run with the challenge's own training code.

`pipeline` trains with `step_trace = true` (RUN_DIR/step_trace/: the weights before step 1, every
micro-batch's tokens, a row per step); this script then runs the *record's own* training code
(the 04-09 record's `train_model()`, or the baseline `train_gpt.py`'s `main()`) on the CPU in f32
from the same weights on the same batches, and prints, per step, both train losses, gradient
norms, LR multipliers and momenta, the weights' largest difference at the traced steps, and the
validation scores at the end. It names the first step and the first tensor where the two part
beyond rounding.

What is replaced in the record's code, and only this (each text patch must apply, or the script
stops naming it): FlashAttention-3 (and its varlen call) by exact attention in f32;
`torch.compile` by the eager function; bf16 (autocast, `.bfloat16()` weights, Newton-Schulz and
Muon's update buffer) by f32; DDP by one process; its data loader by the trace's batches (but
in a packed 04-27 run, below: its own loader then runs, checked against them); its micro-batch
count (`8 // world_size`) by the run's; its warm-up steps (which it undoes) are skipped. The
record's GPT, parameter groups, optimizers, schedules, clipping, looping switch and EMA run as
written.

Needs torch, numpy and sentencepiece (`pip install torch numpy sentencepiece`) and the record's
script, fetched by you from the public repository (never commit it):

    git clone https://github.com/openai/parameter-golf /tmp/parameter-golf
    REC=/tmp/parameter-golf/records/track_10min_16mb/2026-04-09_SP8192_3LayerRecur_ParResid_QK525_LegalTTT
    ./target/release/pipeline run pipelines/record-mini.toml --out runs/cmp \\
        --set stages.sampler.impl=sequential --set stages.train.step_trace=true \\
        --set 'stages.train.step_trace_weights_at=[1,2,5,10,20,50,100,150,200]'
    python3 scripts/compare-record.py --record $REC/train_gpt.py --run runs/cmp

`--init record` starts the record's code from its own initialisation (`--seed`) instead of the
run's weights, on the same batches: the figure to set beside ours over seeds. The baseline:
`--record /tmp/parameter-golf/train_gpt.py` on a run of pipelines/demo.toml (flavour detected).

The 04-27 record (`records/track_10min_16mb/2026-04-27_SP8192_LQER_SparseGate_BOSSmearFix_9HpStack_1.0611/
train_gpt.py`) on a run of pipelines/record-0427-mini.toml: besides the above, Triton is a
stand-in whose kernels are never called (its unfused MLP and cross-entropy run), its auxiliary
CUDA stream is inert, and FlashAttention-3's varlen call is exact attention in f32 over each
segment of `cu_seqlens` (causal within it). Its validation (`eval_val`: each batch one flat row)
runs as written when the run validates so too (`train.val_packed = true`, record-0427-mini's);
for a run that validates in rows it scores rows of EVAL_SEQ_LEN instead (the dense call, kept
inside documents at BOS by the exact attention), a patch named "validation in rows". The byte counts its CaseOps sidecar gives come from the tokenizer's tables, as
the 04-09 record counts them. Its batches depend on the run's sampler:

- packed (`stages.<sampler>.impl = "packed_docs"`, record-0427-mini's default: one flat row a
  micro-batch, documents cut every train.seq_len = model.document_max_len tokens): the record's
  own DocumentPackingLoader runs as written on data.train's shards (only its pinned memory
  unpinned), and every micro-batch it returns is checked, token for token, against the trace's
  in its place; its segments (`cu_seqlens`) go to the varlen attention:

    REC=/tmp/parameter-golf/records/track_10min_16mb/2026-04-27_SP8192_LQER_SparseGate_BOSSmearFix_9HpStack_1.0611
    ./target/release/pipeline run pipelines/record-0427-mini.toml --out runs/cmp \\
        --set stages.train.step_trace=true --set 'stages.train.step_trace_weights_at=[1,20,100,200]'
    python3 scripts/compare-record.py --record $REC/train_gpt.py --run runs/cmp

- rows (any other sampler, e.g. `--set 'stages.sampler.impl="shuffled"'`): its loader is
  replaced by the trace's (rows, seq_len) rows, fed without `cu_seqlens`: the dense attention
  call runs, kept inside documents at BOS by the exact attention (what its varlen call computes
  within a row).

Exit code 0 when the train losses agree within `--loss-tol` over the first `--strict-steps`
steps (and always with `--init record`, `--init-weights` or `--export-init`, which judge
nothing), 1 when they part (a NaN parts) or, in a packed run, when a micro-batch of the record's
own loader differs from the trace's (the step, the micro-batch and the first differing position
named), 2 on bad input (a patch that does not apply, a run that is not a whole f32 trace, a
packed run on another script, not of one row or with model.document_max_len other than
train.seq_len), 3 when the record's code or this script fails.

`--self-test` checks what needs no torch; `--self-test-torch [RECORD]` checks the varlen
attention against the exact attention kept inside the same segments (with RECORD, the 04-27
record's script, on the segments its own `_build_cu_seqlens` cuts).
"""

import argparse
import base64
import json
import lzma
import math
import os
import re
import struct
import sys
import tempfile
import time
import types
from pathlib import Path


def fail(msg):
    print(f"compare-record: {msg}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------------------------------------
# The record's source: unpacked, flavour, patches
# ---------------------------------------------------------------------------------------------


def record_source(path):
    """The record's Python source; the 04-09 record ships lzma+base85-packed."""
    text = Path(path).read_text(encoding="utf-8")
    m = re.search(r'b85decode\("(.*?)"\)', text, re.S)
    if m and len(text) < 40000 and "exec(" in text:
        raw = base64.b85decode(m.group(1))
        if "FORMAT_RAW" in text:
            return lzma.decompress(raw, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}]).decode()
        return lzma.decompress(raw).decode()
    return text


def flavour(src):
    if "class DocumentPackingLoader" in src and "_PE_COEFFS" in src and "def train_model(h, device, val_data)" in src:
        return "record0427"
    if "def train_model(h,device,val_data)" in src and "class Optimizers" in src:
        return "record"
    if "class DistributedTokenLoader" in src and "def main() -> None:" in src:
        return "baseline"
    fail("the script is none of the 04-27 record's, the 04-09 record's or the baseline's train_gpt.py (no DocumentPackingLoader/_PE_COEFFS, no train_model/Optimizers, no main/DistributedTokenLoader)")


# (name, old, new): every one must occur in the source.
PATCHES = {
    "record": [
        ("Newton-Schulz in f32", "X=G.bfloat16()", "X=G.float()"),
        ("Muon's update buffer in f32", "dtype=torch.bfloat16);curr=0", "dtype=torch.float32);curr=0"),
        ("f32 weights", "base_model=GPT(h).to(device).bfloat16();restore_fp32_params(base_model)", "base_model=GPT(h).to(device)"),
    ],
    "record0427": [
        ("Newton-Schulz in f32", "X = G.bfloat16()", "X = G.float()"),
        ("Muon's gradient in f32", "g = p.grad.bfloat16()", "g = p.grad.float()"),
        ("f32 weights", "base_model = GPT(h).to(device).bfloat16()", "base_model = GPT(h).to(device)"),
        # The fused MLP is a Triton kernel (GPU only); its unfused form is the same maths.
        ("the unfused MLP", "self.use_fused = True", "self.use_fused = False"),
    ],
    # Validation in rows, for a run that validates in rows (`train.val_packed = false`): sequences
    # of EVAL_SEQ_LEN, attention kept inside documents by the attention shim (the record's
    # eval_val takes each batch as one flat row, whose SmearGate would also cross the rows'
    # edges: what `train.val_packed = true` does, with no patch).
    "record0427_val_rows": [
        (
            "validation in rows",
            "logits = run_forward_logits(\n                    x[None], cu_seqlens=cu_seqlens, max_seqlen=max_seqlen\n                ).detach()",
            "logits = run_forward_logits(_cmp_rows(x, seq_len)).detach()",
        ),
    ],
    # A packed run (impl = "packed_docs"), on top of "record0427": its DocumentPackingLoader runs
    # as written, but for the pinned memory a CPU has none of.
    "record0427_packed": [
        (
            "the loader's inputs unpinned",
            "inputs = torch.empty(per_rank_span - 1, dtype=torch.int64, pin_memory=True)",
            "inputs = torch.empty(per_rank_span - 1, dtype=torch.int64, pin_memory=False)",
        ),
        (
            "the loader's targets unpinned",
            "targets = torch.empty(per_rank_span - 1, dtype=torch.int64, pin_memory=True)",
            "targets = torch.empty(per_rank_span - 1, dtype=torch.int64, pin_memory=False)",
        ),
        ("the loader's cu_seqlens unpinned", "cu_seqlens = cu_seqlens.pin_memory()", "cu_seqlens = cu_seqlens"),
    ],
    "baseline": [
        ("Newton-Schulz in f32", "X = G.bfloat16()", "X = G.float()"),
        (
            "Muon's update buffer in f32",
            "updates_flat = torch.zeros(total_params, device=params[0].device, dtype=torch.bfloat16)",
            "updates_flat = torch.zeros(total_params, device=params[0].device, dtype=torch.float32)",
        ),
        ("f32 weights", ").to(device).bfloat16()", ").to(device)"),
        ("the CPU", 'device = torch.device("cuda", local_rank)', 'device = torch.device("cpu")'),
        ("no CUDA check", "if not torch.cuda.is_available():", "if False:"),
        ("no set_device", "torch.cuda.set_device(device)", "pass"),
        ("the run's micro-batches", "grad_accum_steps = 8 // world_size", 'grad_accum_steps = int(os.environ["CMP_GRAD_ACCUM"])'),
        ("exact attention on the CPU", "enable_math_sdp(False)", "enable_math_sdp(True)"),
        ("no nvidia-smi", 'subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=False).stdout', '"(no nvidia-smi: CPU)"'),
    ],
}


def py311_fstrings(src):
    """The record is written for Python 3.12, whose f-strings may hold the quote they are in
    (`f"{", ".join(xs)}"`); before 3.12 such a string is a syntax error. Rewrites the strings
    nested inside the braces of `f"..."` with single quotes (same value). A best effort for the
    records' scripts (checked on the 04-09 record's), run only before Python 3.12: a source it
    cannot rewrite still fails to compile, naming the line."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith('f"', i) and not src.startswith('f"""', i) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            out.append('f"')
            i += 2
            depth = 0
            while i < n:
                c = src[i]
                if depth == 0:
                    if c == "\\":
                        out.append(src[i : i + 2])
                        i += 2
                        continue
                    if c == '"':
                        out.append(c)
                        i += 1
                        break
                    if c == "{":
                        if src.startswith("{{", i):
                            out.append("{{")
                            i += 2
                            continue
                        depth = 1
                    out.append(c)
                    i += 1
                    continue
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                elif c == '"':
                    j = src.index('"', i + 1)
                    inner = src[i + 1 : j]
                    # An inner string holding ' or \\ is left as it is (a syntax error before
                    # 3.12 that names the line): rewriting it could change its value.
                    out.append("'" + inner + "'" if "'" not in inner and "\\" not in inner else '"' + inner + '"')
                    i = j + 1
                    continue
                out.append(c)
                i += 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def patched(src, kind):
    for name, old, new in PATCHES[kind]:
        if old not in src:
            fail(f"patch '{name}' does not apply: {old!r} is not in the record's script (another version?)")
        src = src.replace(old, new)
    return src


# ---------------------------------------------------------------------------------------------
# Our run: config, trace, reports
# ---------------------------------------------------------------------------------------------


def read_safetensors(path):
    import numpy as np
    import torch

    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    dtypes = {"F32": np.float32, "F64": np.float64, "F16": np.float16}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in dtypes:
            fail(f"{path}: tensor {name} has dtype {meta['dtype']} (f32 expected: trace an f32 run)")
        a, b = meta["data_offsets"]
        arr = np.frombuffer(data[base + a : base + b], dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])
        out[name] = torch.from_numpy(arr.astype(np.float32).copy())
    return out


def write_safetensors(path, tensors):
    """`tensors` (name -> f32 torch tensor) as a safetensors file (what `train.init_weights` reads)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        b = tensors[name].detach().float().contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = Path(str(path) + ".tmp")
    tmp.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    tmp.replace(path)


def read_tsv(path):
    lines = Path(path).read_text().splitlines()
    head = lines[0].split("\t")
    return [dict(zip(head, line.split("\t"))) for line in lines[1:] if line.strip()]


def our_run(run_dir):
    run = Path(run_dir)
    cfg_path = run / "config.toml"
    trace = run / "step_trace"
    if not cfg_path.is_file():
        fail(f"{cfg_path} is missing: --run takes the run directory of `pipeline run`")
    if not (trace / "trace.json").is_file():
        fail(f"{trace}/trace.json is missing: run with `--set stages.<step_executor>.step_trace=true`")
    import tomllib  # Python 3.11

    cfg = tomllib.loads(cfg_path.read_text())
    meta = json.loads((trace / "trace.json").read_text())
    rows = read_tsv(trace / "steps.tsv")
    report = json.loads((run / "report.json").read_text()) if (run / "report.json").is_file() else {}
    return cfg, meta, rows, report


def stage(cfg, kind):
    for name, s in cfg.get("stages", {}).items():
        if s.get("kind") == kind:
            return name, s
    return None, {}


def packed_run(cfg, kind, meta):
    """Whether the run sampled with `packed_docs` (a stage of kind window_sampler): the 04-27
    record's DocumentPackingLoader, one flat row a micro-batch, its documents cut every
    train.seq_len tokens. The record's own loader then runs, checked against the trace."""
    names = [n for n, s in cfg.get("stages", {}).items() if s.get("kind") == "window_sampler" and s.get("impl") == "packed_docs"]
    if not names:
        return False
    where = f'stages.{names[0]}.impl = "packed_docs"'
    if kind != "record0427":
        fail(f"the run's sampler is packed ({where}, the 04-27 record's DocumentPackingLoader), which only the 04-27 record's script has, not the {dict(record='04-09 record', baseline='baseline').get(kind, kind)}'s: trace a run with another sampler (--set 'stages.{names[0]}.impl=\"shuffled\"')")
    if meta["rows"] != 1:
        fail(f"the run's sampler is packed ({where}) but step_trace/trace.json has rows = {meta['rows']}: a packed micro-batch is one flat row")
    dml, seq = cfg["model"].get("document_max_len"), cfg["train"]["seq_len"]
    if dml != seq:
        fail(f"the run's sampler is packed ({where}) with model.document_max_len = {dml}, train.seq_len = {seq}: the record's loader cuts documents every TRAIN_SEQ_LEN tokens; set model.document_max_len = train.seq_len")
    return True


def env_for(cfg, kind, meta):
    """The record's hyperparameters (its environment variables) from our resolved config."""
    m, t = cfg["model"], cfg["train"]
    if t.get("max_wallclock_seconds", 0) > 0:
        fail("the run has a wall-clock cap (train.max_wallclock_seconds > 0): its schedule depends on time; trace a run with --set train.max_wallclock_seconds=0")
    _, ex = stage(cfg, "step_executor")
    if ex.get("dtype", "f32") != "f32":
        fail(f"the run trained in {ex.get('dtype')}: trace an f32 run")
    e = {
        "VOCAB_SIZE": m["vocab_size"],
        "NUM_LAYERS": m["num_layers"],
        "MODEL_DIM": m["model_dim"],
        "NUM_HEADS": m["num_heads"],
        "NUM_KV_HEADS": m["num_kv_heads"],
        "MLP_MULT": m["mlp_mult"],
        "TIE_EMBEDDINGS": int(m["tie_embeddings"]),
        "ROPE_BASE": m["rope_base"],
        "LOGIT_SOFTCAP": m["logit_softcap"],
        "QK_GAIN_INIT": m["qk_gain_init"],
        "TIED_EMBED_INIT_STD": m["tied_embed_init_std"],
        "ITERATIONS": t["iterations"],
        "TRAIN_SEQ_LEN": t["seq_len"],
        "TRAIN_BATCH_TOKENS": meta["rows"] * meta["seq_len"] * meta["micro_steps"],
        "MAX_WALLCLOCK_SECONDS": 0,
        "WARMUP_STEPS": 0,
        "VAL_LOSS_EVERY": 0,
        "TRAIN_LOG_EVERY": 0,
        "VAL_BATCH_SIZE": t["val_batch_tokens"],
        "VAL_BATCH_TOKENS": t["val_batch_tokens"],
        "MATRIX_LR": t["matrix_lr"],
        "SCALAR_LR": t["scalar_lr"],
        "TIED_EMBED_LR": t["tied_embed_lr"],
        "EMBED_LR": t["embed_lr"],
        "HEAD_LR": t["head_lr"],
        "BETA1": t["beta1"],
        "BETA2": t["beta2"],
        "ADAM_EPS": t["adam_eps"],
        "MUON_MOMENTUM": t["muon_momentum"],
        "MUON_MOMENTUM_WARMUP_START": t["muon_momentum_warmup_start"],
        "MUON_MOMENTUM_WARMUP_STEPS": t["muon_momentum_warmup_steps"],
        "MUON_BACKEND_STEPS": t["muon_backend_steps"],
        "GRAD_CLIP_NORM": t["grad_clip_norm"],
        "CMP_GRAD_ACCUM": meta["micro_steps"],
    }
    if kind == "baseline":
        val = os.path.abspath(cfg["data"]["val"])
        if os.path.basename(val) != "fineweb_val_*.bin":
            fail(f"the baseline reads DATA_PATH/fineweb_val_*.bin; the run's data.val is {cfg['data']['val']}")
        e["DATA_PATH"] = os.path.dirname(val)
        e["TOKENIZER_PATH"] = os.path.abspath(cfg["data"]["tokenizer"])
        e["WARMDOWN_ITERS"] = t["warmdown_iters"]
        return {k: str(v) for k, v in e.items()}
    _, ema = stage(cfg, "ema_swa")
    e.update(record_keys(m, t, ema))
    if kind == "record0427":
        return env_0427(cfg, e)
    e.update(
        {
            "EMBEDDING_DIM": m["model_dim"],
            "PARALLEL_RESIDUAL_START": m["parallel_residual_start"] if m.get("parallel_residual_start") is not None else -1,
        }
    )
    require(record_needs(m, ema), "the record's code")
    return {k: str(v) for k, v in e.items()}


def record_keys(m, t, ema):
    """The variables both records read alike."""
    return {
        "XSA_LAST_N": m.get("xsa_last_n", 0),
        "SKIP_GATES_ENABLED": int(m.get("skip_gates", False)),
        "ROPE_DIMS": m.get("rope_dims") or 0,
        "ROPE_TRAIN_SEQ_LEN": m.get("rope_train_seq_len") or t["seq_len"],
        "LN_SCALE": int(m.get("ln_scale", False)),
        "NUM_LOOPS": m.get("num_loops", 0),
        "LOOP_START": m.get("loop_start", 0),
        "LOOP_END": m.get("loop_end", 0),
        "ENABLE_LOOPING_AT": m.get("enable_looping_at", 0.0),
        "WARMDOWN_FRAC": t["warmdown_frac"],
        "MIN_LR": t["min_lr"],
        "MUON_ROW_NORMALIZE": int(t["muon_row_norm"]),
        "MUON_WD": t["muon_weight_decay"],
        "EMBED_WD": t["embed_weight_decay"],
        "ADAM_WD": t["scalar_weight_decay"],
        "EMA_DECAY": ema.get("decay", 0.0),
        "EVAL_SEQ_LEN": t["seq_len"],
    }


def record_needs(m, ema):
    """What both records hard-code, which our keys must then hold: (holds, what)."""
    return [
        (m.get("mlp_activation") == "leaky_relu2" and m.get("leaky_relu_slope") == 0.5, 'model.mlp_activation = "leaky_relu2" with leaky_relu_slope = 0.5'),
        (m.get("init") == "orthogonal", 'model.init = "orthogonal"'),
        (ema and ema.get("start_step", 0) == 0, "an ema stage from step 0"),
    ]


def require(needs, whose):
    for ok, what in needs:
        if not ok:
            fail(f"{whose} has {what}; this run does not")


def env_0427(cfg, e):
    """The 04-27 record's variables (docs/record.md's table), and what its code hard-codes."""
    m, t = cfg["model"], cfg["train"]
    lanes = m.get("parallel_decoder_start") or 0
    windows = {m["smear_gate_window"] if m.get("smear_gate") else None, m["attn_gate_window"] if m.get("attn_gate") else None} - {None}
    e.update(
        {
            "ROPE_YARN": int(m.get("rope_train_seq_len") is not None),
            "PARALLEL_START_LAYER": lanes,
            "PARALLEL_FINAL_LANE": m.get("parallel_final_lane", "mean"),
            "SMEAR_GATE_ENABLED": int(m.get("smear_gate", False)),
            "SPARSE_ATTN_GATE_ENABLED": int(m.get("attn_gate", False)),
            "SPARSE_ATTN_GATE_INIT_STD": m.get("attn_gate_init_std", 0.0),
            "SPARSE_ATTN_GATE_SCALE": m.get("attn_gate_scale", 1.0),
            "GATE_WINDOW": next(iter(windows)) if len(windows) == 1 else 12,
            "FUSED_CE_ENABLED": 0,
            "CASEOPS_ENABLED": 0,
        }
    )
    _, ema = stage(cfg, "ema_swa")
    require(
        record_needs(m, ema)
        + [
            (t.get("muon_ns") == "polar_express", 'train.muon_ns = "polar_express"'),
            (m.get("parallel_residual_start") is None, "no model.parallel_residual_start (its parallel blocks are the two lanes)"),
            (len(windows) <= 1, "one GATE_WINDOW: model.smear_gate_window equal to model.attn_gate_window"),
            (m.get("document_attention") and m.get("bos_id", 1) == 1, "model.document_attention = true with bos_id = 1 (it keeps every pass inside documents at BOS_ID = 1)"),
            (lanes > 0, "model.parallel_decoder_start set (its GPT always has the lanes' parameters)"),
            (t.get("weights_layout") == "banks", 'train.weights_layout = "banks" (its GPT\'s tensor names)'),
        ],
        "the 04-27 record's code",
    )
    return {k: str(v) for k, v in e.items()}


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------

# The document mask the attention shim applies (04-27: attention inside documents), per pass:
# `(B, T, T)` booleans, True where a query may see a key; None: plain causal.
DOC_MASK = [None]


def doc_mask_of(x, bos=1):
    """Rows `x` (B, T) -> (B, T, T): position i sees key j when j <= i and no BOS lies in (j, i]."""
    import torch

    b, t = x.shape
    seg = torch.cumsum((x == bos).long(), dim=1)  # the document index of each position
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (seg[:, :, None] == seg[:, None, :]) & causal


def dense_attention(q, k, v, causal=True, mask=None):
    """Attention in f32 over (B, T, H, D) / (B, T, KH, D), grouped-query heads by repetition;
    `mask` (B, T, T), True where a query may see a key, in place of the causal one."""
    import torch

    b, t, h, d = q.shape
    rep = h // k.shape[2]
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(rep, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(rep, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if mask is not None:
        s = s.masked_fill(~mask[:, None, :, :], float("-inf"))
    elif causal:
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vh).transpose(1, 2)


def exact_attention(q, k, v, causal=True):
    """FlashAttention-3's `flash_attn_func(q, k, v, causal=True)` in f32: (B, T, H, D) in and out,
    grouped-query heads by repetition; kept inside documents where DOC_MASK is set."""
    return dense_attention(q, k, v, causal, DOC_MASK[0])


def exact_varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=0, max_seqlen_k=0, causal=True, window_size=(-1, -1), **rest):
    """FlashAttention-3's `flash_attn_varlen_func` in f32: q (total, H, D), k and v (total, KH, D),
    one flat row cut into the segments that `cu_seqlens` bounds (int32, padded at its end with
    repeats of `total`: zero-length segments, skipped); each segment attended on its own, causal
    within it; (total, H, D) out. One segment at a time: no (total x total) matrix."""
    import torch

    if rest or tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"flash_attn_varlen_func with {sorted(rest) or ''} window_size={window_size}: the shim attends whole causal segments")
    if cu_seqlens_k is not cu_seqlens_q and not torch.equal(cu_seqlens_q, cu_seqlens_k):
        raise NotImplementedError("flash_attn_varlen_func with different query and key segments")
    total = q.shape[0]
    bounds = [int(b) for b in cu_seqlens_q.tolist()]
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds[:8]}... do not cut a row of {total} positions")
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if b == a:
            continue
        if max_seqlen_q and b - a > max_seqlen_q:
            raise ValueError(f"a segment of {b - a} positions is longer than max_seqlen {max_seqlen_q}")
        out.append(dense_attention(q[None, a:b], k[None, a:b], v[None, a:b], causal)[0])
    return torch.cat(out, dim=0)


class StopRun(Exception):
    pass


class Comparison:
    def __init__(self, args, cfg, meta, rows, kind, packed=False):
        import numpy as np

        self.args, self.cfg, self.meta, self.kind, self.packed = args, cfg, meta, kind, packed
        self.ours = {int(r["step"]): r for r in rows}
        self.steps = len(rows)
        trace = Path(args.run) / "step_trace"
        shape = (meta["micro_steps"], 2, meta["rows"], meta["seq_len"])
        tokens = np.fromfile(trace / "batches.u16", dtype="<u2")
        per_step = int(np.prod(shape))
        if tokens.size != per_step * self.steps:
            fail(f"{trace}/batches.u16 holds {tokens.size} tokens; {self.steps} steps of {shape} need {per_step * self.steps}")
        self.batches = tokens.reshape((self.steps,) + shape)
        if self.steps != cfg["train"]["iterations"]:
            fail(f"the run took {self.steps} of train.iterations = {cfg['train']['iterations']} steps (stopped early?): the schedules depend on iterations; compare a run that ended at train.iterations")
        self.weights_at = sorted(int(p.stem.split("_")[1]) for p in trace.glob("weights_*.safetensors"))
        self.trace = trace
        self.micro = 0  # micro-batches served
        self.checked = 0  # packed: the record's own loader's micro-batches found equal to the trace's
        self.losses = []  # this step's micro-batch losses
        self.norm = float("nan")
        self.groups = {}
        self.looping = None
        self.done = 0  # steps finished
        self.table = []
        self.first_loss = None
        self.first_weight = None
        self.weight_checks = []
        self.vals = {}

    # -- hooks -------------------------------------------------------------------------------

    def next_batch(self):
        import torch

        step, m = divmod(self.micro, self.meta["micro_steps"])
        if m == 0 and step > 0:
            self.step_end(step)
        if step >= self.steps:
            fail(f"the record's code asked for step {step + 1}, the trace has {self.steps}")
        b = torch.from_numpy(self.batches[step, m].astype("int64"))
        self.micro += 1
        return b[0], b[1]

    def check_batch(self, inputs, targets):
        """A packed run: the micro-batch the record's own loader returned, (1, n) inputs and
        targets, against the trace's one in its place (taken as next_batch serves it, with the
        step accounting); exit 1 on the first token that differs."""
        import torch

        step, m = divmod(self.micro, self.meta["micro_steps"])
        x, y = self.next_batch()
        for what, theirs, ours in (("inputs", inputs[0], x[0]), ("targets", targets[0], y[0])):
            theirs = theirs.to(torch.int64)
            if theirs.shape == ours.shape and torch.equal(theirs, ours):
                continue
            n = min(theirs.numel(), ours.numel())
            diff = (theirs[:n] != ours[:n]).nonzero()
            at = int(diff[0]) if diff.numel() else n
            said = f"token {int(theirs[at])} (record's) vs {int(ours[at])} (ours)" if at < n else f"{theirs.numel()} tokens (record's) vs {ours.numel()} (ours)"
            print(
                f"compare-record: step {step + 1}, micro-batch {m + 1} of {self.meta['micro_steps']}: the record's own loader's {what} differ from the trace's "
                f"first at position {at}: {said} (after {self.checked} equal micro-batches; the record's loader reads data.train's sorted shards from shard 0's first BOS, on one rank)",
                file=sys.stderr,
            )
            sys.exit(1)
        self.checked += 1

    def step_end(self, step):
        """Step `step` (1-based) has finished on the record's side."""
        if step <= self.done:
            return
        self.done = step
        ours = self.ours.get(step)
        loss = sum(self.losses) / max(len(self.losses), 1)
        self.losses = []
        row = {"step": step, "record_loss": loss, "record_grad_norm": self.norm, **self.groups, "record_looping": self.looping}
        if ours:
            ol = float(ours["train_loss"])
            row.update(
                {
                    "our_loss": ol,
                    "loss_rel": abs(loss - ol) / abs(ol),
                    "our_grad_norm": float(ours["grad_norm"]),
                    "our_lr_mul": float(ours["lr_mul"]),
                    "our_momentum": float(ours["momentum"]),
                    "our_looping": bool(int(ours["looping"])),
                }
            )
            if self.first_loss is None and self.args.init == "ours" and not row["loss_rel"] <= self.args.loss_tol:
                self.first_loss = step
        self.table.append(row)
        if step in self.weights_at and self.args.init == "ours":
            self.compare_weights(step)
        self.norm = float("nan")
        if self.args.progress and (step <= 5 or step % 25 == 0):
            print(f"  record's code: step {step}/{self.steps} loss {loss:.6f}", file=sys.stderr, flush=True)

    def compare_weights(self, step):
        ours = read_safetensors(self.trace / f"weights_{step}.safetensors")
        theirs = {k: v.detach().float() for k, v in self.model.state_dict().items()}
        worst = (0.0, None)
        per = {}
        for name, w in ours.items():
            if name not in theirs:
                fail(f"weights_{step}: our tensor {name} has no counterpart in the record's GPT")
            t = theirs[name]
            # Relative to the tensor's norm: Adam's first steps move the weights of a tiny
            # gradient by about +-lr whichever its rounding, so an element's largest difference
            # is not a measure of parting.
            scale = max(float(w.norm()), 1e-12)
            d = float((t - w).norm()) / scale
            per[name] = d
            if not math.isnan(worst[0]) and not d <= worst[0]:  # a NaN is the worst, and stays
                worst = (d, name)
        self.weight_checks.append({"step": step, "worst_rel": worst[0], "worst_tensor": worst[1], "per_tensor": per})
        if self.first_weight is None and not worst[0] <= self.args.weight_tol:
            firsts = [n for n, d in per.items() if not d <= self.args.weight_tol]
            self.first_weight = (step, worst[1], worst[0], firsts)

    # -- runs --------------------------------------------------------------------------------

    def install(self, mod):
        import torch

        cmp = self
        our_init = None
        if self.args.init_weights:
            our_init = read_safetensors(self.args.init_weights)
        elif self.args.init == "ours":
            our_init = read_safetensors(self.trace / "weights_0.safetensors")

        class TraceLoader:
            def __init__(self, *a, **k):
                pass

            def next_batch(self, *a, **k):
                return cmp.next_batch()

        orig_init = mod.GPT._init_weights

        def _init_weights(model):
            orig_init(model)
            cmp.model = model
            if our_init is not None:
                sd = model.state_dict()
                missing = sorted(set(sd) - set(our_init))
                extra = sorted(set(our_init) - set(sd))
                if missing or extra:
                    fail(f"the run's weights do not fit the record's GPT: missing {missing}, unexpected {extra}")
                for name, w in our_init.items():
                    if tuple(sd[name].shape) != tuple(w.shape):
                        fail(f"{name}: ours {tuple(w.shape)}, the record's {tuple(sd[name].shape)}")
                with torch.no_grad():
                    model.load_state_dict(our_init, strict=True)

        orig_forward = mod.GPT.forward

        def forward(model, *a, **k):
            out = orig_forward(model, *a, **k)
            if model.training and torch.is_grad_enabled():
                cmp.losses.append(float(out.detach()))
                cmp.looping = bool(getattr(model, "looping_active", False))
            return out

        orig_clip = torch.nn.utils.clip_grad_norm_

        def clip(params, max_norm, *a, **k):
            n = orig_clip(params, max_norm, *a, **k)
            cmp.norm = float(n)
            return n

        orig_muon_step = mod.Muon.step

        def muon_step(opt, *a, **k):
            g = opt.param_groups[0]
            cmp.groups = {"record_lr_mul": g["lr"] / g.get("base_lr", g["lr"]), "record_momentum": g["momentum"]}
            return orig_muon_step(opt, *a, **k)

        orig_eval = mod.eval_val

        def eval_val(*a, **k):
            if cmp.micro > 0:
                cmp.step_end(cmp.micro // cmp.meta["micro_steps"])
            out = orig_eval(*a, **k)
            label = "final" if "final" not in cmp.vals else "ema"
            cmp.vals[label] = (float(out[0]), float(out[1]))
            if cmp.kind == "baseline":
                raise StopRun()
            return out

        mod.GPT._init_weights = _init_weights
        mod.GPT.forward = forward
        mod.Muon.step = muon_step
        mod.eval_val = eval_val
        torch.nn.utils.clip_grad_norm_ = clip
        if self.kind == "record0427":

            class PackedTraceLoader:
                """Our rows as they are (B, T), without `cu_seqlens`: the dense attention call
                then runs, with the shim keeping it inside documents."""

                def __init__(self, *a, **k):
                    pass

                def next_batch(self, *a, **k):
                    x, y = cmp.next_batch()
                    DOC_MASK[0] = doc_mask_of(x)
                    return x, y, None, 0

            class CheckedLoader(mod.DocumentPackingLoader):
                """A packed run: the record's own DocumentPackingLoader, as written; each
                micro-batch it returns checked against the trace's (its flat row's segments,
                `cu_seqlens`, go to the varlen attention)."""

                def next_batch(self, *a, **k):
                    inputs, targets, cu_seqlens, max_seqlen = super().next_batch(*a, **k)
                    cmp.check_batch(inputs, targets)
                    return inputs, targets, cu_seqlens, max_seqlen

            def rows(x, seq_len):
                r = x.reshape(-1, seq_len)
                DOC_MASK[0] = doc_mask_of(r)
                return r

            if self.packed:
                mod.DocumentPackingLoader = CheckedLoader
            else:
                mod.DocumentPackingLoader = PackedTraceLoader
                mod.BOS_ID = 1  # what its loader sets on reading the first shard
            mod._cmp_rows = rows
        elif self.kind == "record":
            mod.ShuffledSequenceLoader = TraceLoader
        else:
            mod.DistributedTokenLoader = TraceLoader
            orig_load = mod.load_validation_tokens

            def load_validation_tokens(pattern, seq_len):
                return cmp.trim_val(orig_load(pattern, seq_len))

            mod.load_validation_tokens = load_validation_tokens

    def trim_val(self, tokens):
        n = self.cfg["train"].get("val_max_tokens", 0)
        seq = self.cfg["train"]["seq_len"]
        if n and tokens.numel() - 1 > n:
            n = n // seq * seq
            tokens = tokens[: n + 1]
        return tokens

    def token_bytes(self, val):
        """The bytes of each validation target (the sidecar the 04-27 record reads with CaseOps):
        a piece's bytes, plus its leading space unless the previous token is a boundary, as
        our byte tables and the 04-09 record count them."""
        import torch

        tok = val.val_tokens.long()
        prev = torch.cat([tok[:1], tok[:-1]])
        n = val.base_bytes_lut[tok].long() + (val.has_leading_space_lut[tok] & ~val.is_boundary_token_lut[prev]).long()
        return n.to(torch.int32)

    def run(self, mod):
        import torch

        torch.manual_seed(self.args.seed)
        if self.kind in ("record", "record0427"):
            h = mod.Hyperparameters()
            h.grad_accum_steps = self.meta["micro_steps"]
            h.world_size, h.rank, h.distributed, h.is_main_process = 1, 0, False, True
            h.tokenizer_path = self.cfg["data"]["tokenizer"]
            h.val_files = self.cfg["data"]["val"]
            h.logfile = None
            if self.packed:
                # Its loader globs h.train_files (DATA_PATH's fineweb_train_*.bin) and cuts at
                # h.train_seq_len (TRAIN_SEQ_LEN, set from train.seq_len = model.document_max_len).
                h.train_files = os.path.abspath(self.cfg["data"]["train"])
            val = mod.ValidationData(h, torch.device("cpu"))
            val.val_tokens = self.trim_val(val.val_tokens)
            if self.kind == "record0427":
                val.val_bytes = self.token_bytes(val)
            # The 04-09 record's train_model returns (model, compiled); the 04-27's a third too.
            model = mod.train_model(h, torch.device("cpu"), val)[0]
            mod.eval_val(h, torch.device("cpu"), val, model)
        else:
            cwd = os.getcwd()
            with tempfile.TemporaryDirectory() as tmp:
                os.chdir(tmp)
                try:
                    mod.main()
                except StopRun:
                    pass
                finally:
                    os.chdir(cwd)


def install_gpu_stubs():
    """What the 04-27 record's script touches of a GPU at import and in training, made inert
    on the CPU: Triton (its kernels are only decorated: the comparison runs the unfused
    paths), an auxiliary CUDA stream (its Adam steps run in order here)."""
    import contextlib

    import torch
    import torch._dynamo  # noqa: F401  (torch's own Triton probe, before the stand-in is there)
    import torch.optim  # noqa: F401

    class Anything(types.ModuleType):
        """A module whose every attribute is a do-nothing callable (decorators return what they
        decorate)."""

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)

            def stub(*a, **k):
                if len(a) == 1 and callable(a[0]) and not k:
                    return a[0]
                return lambda f=None, *b, **c: f

            return stub

    triton = Anything("triton")
    tl = Anything("triton.language")
    tl.constexpr = object
    triton.language = tl
    desc = types.ModuleType("triton.tools.tensor_descriptor")
    desc.TensorDescriptor = object
    tools = types.ModuleType("triton.tools")
    tools.tensor_descriptor = desc
    sys.modules.update({"triton": triton, "triton.language": tl, "triton.tools": tools, "triton.tools.tensor_descriptor": desc})

    class Stream:
        def wait_stream(self, other):
            pass

    torch.cuda.Stream = lambda *a, **k: Stream()
    torch.cuda.current_stream = lambda *a, **k: Stream()
    torch.cuda.stream = lambda s: contextlib.nullcontext()


def load_record(src, kind, env, path, packed=False, val_rows=True):
    import torch

    os.environ.update(env)
    torch.compile = lambda model=None, **k: model if model is not None else (lambda f: f)
    for name in ("synchronize", "set_device", "manual_seed_all", "reset_peak_memory_stats"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_reserved = lambda *a, **k: 0
    fa = types.ModuleType("flash_attn_interface")
    fa.flash_attn_func = exact_attention
    fa.flash_attn_varlen_func = exact_varlen_attention
    sys.modules["flash_attn_interface"] = fa
    if kind == "record0427":
        install_gpu_stubs()
    mod = types.ModuleType("record_train_gpt")
    mod.__file__ = os.path.abspath(path)  # the baseline reads its own code for its size line
    src = patched(src, kind)
    if kind == "record0427" and val_rows:
        src = patched(src, "record0427_val_rows")
    if packed:
        src = patched(src, "record0427_packed")
    if sys.version_info < (3, 12):
        src = py311_fstrings(src)
    code = compile(src, "record_train_gpt.py", "exec")
    exec(code, mod.__dict__)
    return mod


def our_vals(report):
    """Our final and post-EMA validation (loss, bpb) from report.json."""
    out = {}
    tr = report.get("train") or {}
    if "val_bpb" in tr:
        out["final"] = (tr["val_loss"], tr["val_bpb"])
    art = report.get("artifact") or {}
    if art.get("weights") == "ema" and art.get("before"):
        out["ema"] = (art["before"]["val_loss"], art["before"]["val_bpb"])
    return out


def self_test():
    """The parts that need no torch, checked on made-up sources (the tests run this)."""
    nested = 'xs = ["b", "a"]\ns = f"{", ".join(sorted(xs))}: {len(xs)} {{kept}} {"q"!r}"\n'
    fixed = py311_fstrings(nested)
    scope = {}
    exec(compile(fixed, "nested", "exec"), scope)
    assert scope["s"] == "a, b: 2 {kept} 'q'", scope["s"]
    assert py311_fstrings('f"plain {x}" + "f\\"{y}"') == 'f"plain {x}" + "f\\"{y}"'
    plain = "def train_model(h,device,val_data):pass\nclass Optimizers:pass\nX=G.bfloat16()\n"
    packed = 'import lzma as L,base64 as B\nexec(L.decompress(B.b85decode("%s"),format=L.FORMAT_RAW,filters=[{"id":L.FILTER_LZMA2}]))' % base64.b85encode(
        lzma.compress(plain.encode(), format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}])
    ).decode()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "train_gpt.py"
        path.write_text(packed)
        src = record_source(path)
    assert src == plain and flavour(src) == "record"
    newer = "_PE_COEFFS = ()\nclass DocumentPackingLoader: pass\ndef train_model(h, device, val_data): pass\nclass Optimizers: pass\n"
    assert flavour(newer) == "record0427"
    import contextlib
    import io

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            patched(src, "record")
    except SystemExit as e:
        assert e.code == 2 and "does not apply" in said.getvalue(), said.getvalue()
    else:
        raise AssertionError("a patch that does not apply must stop the script")
    print("compare-record self-test: ok")


def self_test_torch(record=None):
    """The varlen attention (what FlashAttention-3's `flash_attn_varlen_func` is here) against
    the exact attention kept inside the same segments by DOC_MASK, values and gradients, on
    random grouped-query q, k, v over a row of documents: one without a BOS at the row's start,
    one of a single token, two cut every `cut` tokens, the segments' list padded with repeats of
    the row's length. With `record` (the 04-27 record's script, loaded with the packed patches),
    the segments are those its own `_build_cu_seqlens` cuts, checked equal to ours first."""
    import torch

    total, heads, kv_heads, dim, cut = 53, 4, 2, 8, 10
    bos = [5, 9, 30, 31]
    starts = []
    for a, b in zip([0] + bos, bos + [total]):
        starts += list(range(a, b, cut))  # a document's segments: from its start, every `cut`
    bounds = starts + [total]
    assert bounds == [0, 5, 9, 19, 29, 30, 31, 41, 51, 53], bounds
    cu = torch.full((16,), total, dtype=torch.int32)
    cu[: len(bounds)] = torch.tensor(bounds, dtype=torch.int32)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    if record:
        src = record_source(record)
        if flavour(src) != "record0427":
            fail(f"--self-test-torch takes the 04-27 record's script; {record} is the {flavour(src)}'s")
        mod = load_record(src, "record0427", {}, record, packed=True)
        cu, longest_r = mod._build_cu_seqlens(bos, total, torch.device("cpu"), cut, 64)
        got = [int(b) for b in cu.tolist()]
        assert got[: len(bounds)] == bounds and set(got[len(bounds) :]) <= {total} and longest_r == longest, (got, longest_r)
        print(f"  the record's _build_cu_seqlens: {len(bounds) - 1} segments {bounds}, padded to {len(got)}, max_seqlen {longest_r}: as ours")
    seg = torch.zeros(total, dtype=torch.long)
    seg[starts[1:]] = 1
    seg = torch.cumsum(seg, 0)
    mask = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, n, dim, generator=g, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    w = torch.randn(total, heads, dim, generator=g)
    worst = 0.0
    outs = []
    for how in ("varlen", "masked"):
        if how == "varlen":
            y = exact_varlen_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True, window_size=(-1, -1))
        else:
            DOC_MASK[0] = mask[None]
            try:
                y = exact_attention(q[None], k[None], v[None], causal=True)[0]
            finally:
                DOC_MASK[0] = None
        assert y.shape == (total, heads, dim), y.shape
        grads = torch.autograd.grad((y * w).sum(), (q, k, v))
        outs.append((y.detach(),) + grads)
    for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
        d = float((a - b).abs().max())
        worst = max(worst, d)
        assert d <= 1e-5, f"varlen attention: {name} differs from the masked attention's by {d:.2e}"
    # Each segment on its own: the values of one segment changed move its outputs, no other.
    v2 = v.detach().clone()
    v2[bounds[3] : bounds[4]] += 1.0
    y1 = exact_varlen_attention(q.detach(), k.detach(), v.detach(), cu, cu, causal=True)
    y2 = exact_varlen_attention(q.detach(), k.detach(), v2, cu, cu, causal=True)
    moved = (y1 - y2).abs().amax(dim=(1, 2)) > 0
    assert moved.nonzero().flatten().tolist() == list(range(bounds[3], bounds[4])), moved.nonzero().flatten().tolist()
    print(f"compare-record torch self-test: ok (varlen attention = masked attention over {len(bounds) - 1} segments, values and gradients within {worst:.1e})")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return
    if sys.argv[1:2] == ["--self-test-torch"] and len(sys.argv) <= 3:
        self_test_torch(sys.argv[2] if len(sys.argv) == 3 else None)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", required=True, help="the record's train_gpt.py (the 04-27 or 04-09 record's, or the baseline's), fetched by you")
    ap.add_argument("--run", required=True, help="a pipeline run directory made with step_trace = true")
    ap.add_argument("--init", choices=["ours", "record"], default=None, help="start from the run's weights (default) or the record's own initialisation")
    ap.add_argument("--init-weights", help="start from these weights (a safetensors file with the state_dict names, e.g. another run's step_trace/weights_0.safetensors) on the run's batches; both losses are printed, no parting judged")
    ap.add_argument("--export-init", metavar="PATH", help="write the record's own initial weights for --seed to PATH (safetensors, for `--set train.init_weights=PATH`) and stop")
    ap.add_argument("--seed", type=int, default=None, help="torch's seed for --init record (default: the run's run.seed)")
    ap.add_argument("--loss-tol", type=float, default=1e-4, help="relative train-loss difference that counts as parting (default 1e-4)")
    ap.add_argument("--strict-steps", type=int, default=20, help="steps that must agree within --loss-tol for exit code 0 (default 20)")
    ap.add_argument("--weight-tol", type=float, default=1e-3, help="largest weight difference ||record - ours|| / ||ours|| of a tensor that counts as rounding (default 1e-3)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    ap.add_argument("--json", help="write the whole comparison here as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args()
    args.progress = not args.quiet
    if args.init_weights and args.init:
        fail("--init and --init-weights: give one")
    args.init = "given" if args.init_weights else (args.init or "ours")
    try:
        import numpy  # noqa: F401
        import sentencepiece  # noqa: F401
        import torch
    except ImportError as e:
        fail(f"{e.name} is not installed: pip install torch numpy sentencepiece")
    if args.threads:
        torch.set_num_threads(args.threads)
    import warnings

    warnings.filterwarnings("ignore")
    cfg, meta, rows, report = our_run(args.run)
    if args.seed is None:
        args.seed = int(cfg["run"]["seed"])
    src = record_source(args.record)
    kind = flavour(src)
    packed = packed_run(cfg, kind, meta)
    val_packed = bool(cfg["train"].get("val_packed", False))
    if val_packed and kind != "record0427":
        fail("the run validates packed (train.val_packed = true), as only the 04-27 record's eval_val does: trace a run with --set train.val_packed=false")
    env = env_for(cfg, kind, meta)
    env["SEED"] = str(args.seed)  # the baseline's main() seeds torch itself
    mod = load_record(src, kind, env, args.record, packed, val_rows=not val_packed)
    if args.export_init:
        torch.manual_seed(args.seed)
        model = mod.GPT(mod.Hyperparameters()) if kind in ("record", "record0427") else None
        if model is None:
            fail("--export-init takes a record's script (the baseline builds its GPT inside main())")
        write_safetensors(args.export_init, model.state_dict())
        print(f"wrote the record's initial weights for seed {args.seed} to {args.export_init}")
        return
    cmp = Comparison(args, cfg, meta, rows, kind, packed)
    cmp.install(mod)
    t0 = time.time()
    data = "its own loader on data.train, checked against the trace" if packed else "the trace's batches"
    print(f"record's code: {kind} ({args.record}); run: {args.run}; {cmp.steps} steps; init: {args.init}; seed {args.seed}; batches: {data}", flush=True)
    cmp.run(mod)
    if cmp.done < cmp.steps:
        cmp.step_end(cmp.steps)
    print(f"record's code ran {cmp.done} steps in {time.time() - t0:.0f} s")
    if packed:
        print(f"batches: {cmp.checked} micro-batches of the record's own loader equal the trace's, token for token")
    print()
    print(f"{'step':>5} {'our loss':>10} {'record':>10} {'rel diff':>9} {'our |g|':>9} {'record':>9} {'lr_mul':>13} {'momentum':>13} loop")
    for r in cmp.table:
        s = r["step"]
        if not (s <= 20 or s % 25 == 0 or s == cmp.steps or s == cmp.first_loss):
            continue
        print(
            f"{s:>5} {r.get('our_loss', float('nan')):>10.6f} {r['record_loss']:>10.6f} {r.get('loss_rel', float('nan')):>9.2e} "
            f"{r.get('our_grad_norm', float('nan')):>9.4f} {r['record_grad_norm']:>9.4f} "
            f"{r.get('our_lr_mul', float('nan')):>6.4f}/{r.get('record_lr_mul', float('nan')):<6.4f} "
            f"{r.get('our_momentum', float('nan')):>6.4f}/{r.get('record_momentum', float('nan')):<6.4f} "
            f"{int(bool(r.get('our_looping')))}/{int(bool(r['record_looping']))}"
        )
    if cmp.weight_checks:
        print()
        print("weights (largest ||record - ours|| / ||ours|| over the tensors):")
        for w in cmp.weight_checks:
            print(f"  step {w['step']:>4}: {w['worst_rel']:.2e} in {w['worst_tensor']}")
    ours_v = our_vals(report)
    print()
    for label in ("final", "ema"):
        o, r = ours_v.get(label), cmp.vals.get(label)
        if r:
            os_ = f"val_loss {o[0]:.5f} val_bpb {o[1]:.5f}" if o else "(not in report.json)"
            d = f"  diff {o[1] - r[1]:+.5f} bpb" if o else ""
            print(f"{label:>5}: ours {os_}  record's code val_loss {r[0]:.5f} val_bpb {r[1]:.5f}{d}")
    print()
    strict = [r for r in cmp.table[: args.strict_steps] if "loss_rel" in r]
    rels = [r["loss_rel"] for r in strict]
    worst = float("nan") if any(math.isnan(x) for x in rels) or not rels else max(rels)
    if args.init == "ours":
        if cmp.first_loss is None:
            print(f"train losses agree within {args.loss_tol:g} (relative) at every step; worst over the first {len(strict)}: {worst:.2e}")
        else:
            print(f"train losses part first at step {cmp.first_loss} (beyond {args.loss_tol:g} relative); worst over the first {len(strict)}: {worst:.2e}")
        if cmp.first_weight:
            step, name, d, firsts = cmp.first_weight
            print(f"weights part first at traced step {step}: {name} ({d:.2e}); beyond {args.weight_tol:g} there: {', '.join(firsts[:8])}")
        elif cmp.weight_checks:
            print(f"weights agree within {args.weight_tol:g} at every traced step")
    if args.json:
        Path(args.json).write_text(json.dumps({"kind": kind, "init": args.init, "seed": args.seed, "packed": packed, "batches_checked": cmp.checked, "steps": cmp.table, "weights": cmp.weight_checks, "vals": {"record": cmp.vals, "ours": ours_v}}, indent=1))
    ok = args.init != "ours" or (bool(strict) and worst <= args.loss_tol)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    try:
        main()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # the record's code failed (another version of it?), or ours
        import traceback

        traceback.print_exc()
        print(f"compare-record: the comparison failed: {e!r}", file=sys.stderr)
        sys.exit(3)
