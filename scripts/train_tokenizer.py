#!/usr/bin/env python3
"""Train a sentencepiece BPE model with the challenge tokenizer's settings on a JSONL corpus.

Settings as the challenge's export used them: BPE, byte fallback, split digits, nmt_nfkc
normalisation, no dummy prefix, pad 0 / BOS 1 / EOS 2 / UNK 3.
"""
import argparse
import json
from pathlib import Path

import sentencepiece as spm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", type=Path, required=True, help="JSONL with a `text` field")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True, help="output .model path")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    texts = (json.loads(line)["text"] for line in args.corpus.open(encoding="utf-8") if line.strip())
    prefix = args.out.with_suffix("")
    spm.SentencePieceTrainer.train(
        sentence_iterator=texts,
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=args.vocab_size,
        character_coverage=0.999,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="nmt_nfkc",
        add_dummy_prefix=False,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3,
        hard_vocab_limit=False,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        seed_sentencepiece_size=1_000_000,
        num_threads=args.threads,
        minloglevel=2,
    )
    vocab = prefix.with_suffix(".vocab")
    if vocab.exists():
        vocab.unlink()
    print(f"{args.out}: {args.vocab_size} pieces")


if __name__ == "__main__":
    main()
