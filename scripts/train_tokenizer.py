#!/usr/bin/env python3
"""Train a sentencepiece BPE model with the challenge tokenizer's settings on a JSONL corpus.

Settings as the challenge's export used them: BPE, byte fallback, split digits, nmt_nfkc
normalisation, no dummy prefix, pad 0 / BOS 1 / EOS 2 / UNK 3.

The trainer sees one sentence per non-empty line of each document's `text`. Whole documents
would not do: sentencepiece silently drops every sentence longer than `max_sentence_length`
bytes, and most State of the Union and Shakespeare documents are far longer than any sensible
limit, so training would see only the Wikipedia leads. Line breaks carry no information for the
model anyway (nmt_nfkc turns them into spaces). The result is deterministic: input order is
fixed, shuffling is off and the random seed is pinned, so the same corpus gives a byte-identical
model. The model holds no output path (it is trained in memory), so where it is written does not change its
bytes; it is written beside `--out` under a temporary name and renamed into place, so an
interrupted run leaves no `--out` behind. (`--threads` is recorded in the model's trainer spec.)
"""
import argparse
import io
import json
import time
from pathlib import Path

import sentencepiece as spm

MAX_SENTENCE_BYTES = 16384


def sentences(corpus: Path, stats: dict):
    with corpus.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            for para in json.loads(line)["text"].split("\n"):
                para = para.strip()
                if not para:
                    continue
                n = len(para.encode("utf-8"))
                if n > MAX_SENTENCE_BYTES:
                    stats["too_long"] += 1
                    continue
                stats["sentences"] += 1
                stats["bytes"] += n
                yield para


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="JSONL with a `text` field")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True, help="output .model path")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0, help="sentencepiece's random seed")
    args = ap.parse_args()
    t0 = time.perf_counter()
    spm.set_random_generator_seed(args.seed)
    stats = {"sentences": 0, "bytes": 0, "too_long": 0}
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(args.corpus, stats),
        model_writer=model,                 # no model_prefix: the model then holds no path
        model_type="bpe",
        vocab_size=args.vocab_size,
        character_coverage=0.999,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="nmt_nfkc",
        add_dummy_prefix=False,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        hard_vocab_limit=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        input_sentence_size=0,              # all sentences
        shuffle_input_sentence=False,
        num_threads=args.threads,
        minloglevel=2,
    )
    tmp = args.out.with_name(f".{args.out.name}.partial")
    tmp.write_bytes(model.getvalue())
    tmp.replace(args.out)
    pieces = spm.SentencePieceProcessor(model_file=str(args.out)).get_piece_size()
    skipped = f", {stats['too_long']} longer than {MAX_SENTENCE_BYTES} B skipped" if stats["too_long"] else ""
    print(
        f"{args.out}: {pieces} pieces, trained on {stats['sentences']:,} lines "
        f"({stats['bytes'] / 1e6:.1f} MB{skipped}) in {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
