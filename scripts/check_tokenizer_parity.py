#!/usr/bin/env python3
"""Check that `pipeline data prepare` (kitoken, in Rust) tokenised a corpus as python sentencepiece does.

How to run
----------
    # the demo data (scripts/fetch-demo-data.sh made it): all three paths are the defaults
    scripts/check_tokenizer_parity.py

    # any model and corpus: prepare shards with the pipeline, then compare
    target/release/pipeline data prepare --tokenizer M.model --input C.jsonl --out /tmp/s --force
    scripts/check_tokenizer_parity.py --model M.model --corpus C.jsonl --shards /tmp/s [--min-match 99.99]

Python sentencepiece is imported if it is installed; otherwise it is taken from
data/.cache/py-sentencepiece-* (where fetch-demo-data.sh installs it), and installed there with
`pip install --target` when that is missing too. Exit status: 0 when the token match is at least
--min-match percent, 1 when below, 2 when the inputs do not fit together (wrong shards, a
manifest naming another model or corpus, document counts that differ).

What it compares
----------------
Reference: every document of the JSONL corpus (field `text`; blank lines and documents whose text
is blank are skipped, as `data prepare` does) encoded with `sp.encode(text)`, with BOS (id 1)
prepended. Candidate: the shards listed in the directory's manifest.json, val shards then train
shards, in order; they hold the documents back to back, each starting with BOS, and the first
`val.docs` documents are the val split. The token stream of each split is cut at every BOS, so the
number of pieces must equal the split's document count (kitoken never emits BOS from text).

Counts: "documents differ" is the number of documents whose id sequences are not identical.
"tokens differ" is an edit count: after trimming the common prefix and suffix of the two
sequences, difflib's opcodes are taken and each non-equal opcode counts max(len of the reference
side, len of the candidate side). Percent match = 100 * (1 - tokens differ / reference tokens),
reference tokens including the BOS of each document.
"""
import argparse
import difflib
import glob
import hashlib
import json
import os
import subprocess
import sys
import time
import unicodedata
from array import array
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SENTENCEPIECE_VERSION = "0.2.1"
SHARD_MAGIC, SHARD_VERSION, HEADER_INTS = 20240520, 1, 256
BOS = 1


def import_sentencepiece():
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        cached = sorted(glob.glob(str(ROOT / "data/.cache/py-sentencepiece-*")), reverse=True)
        cached = [c for c in cached if (Path(c) / "sentencepiece").is_dir()]
        if not cached:
            target = ROOT / f"data/.cache/py-sentencepiece-{SENTENCEPIECE_VERSION}"
            print(f"parity: installing sentencepiece=={SENTENCEPIECE_VERSION} into {target}", file=sys.stderr)
            partial = target.with_name(target.name + ".partial")
            subprocess.run(["rm", "-rf", str(partial)], check=True)
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(partial),
                 f"sentencepiece=={SENTENCEPIECE_VERSION}"],
                check=True,
                env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_ROOT_USER_ACTION": "ignore"},
            )
            partial.rename(target)
            cached = [str(target)]
        sys.path.insert(0, cached[0])
    import sentencepiece

    return sentencepiece


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_documents(corpus: Path) -> list:
    docs = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            text = json.loads(line)["text"]
            if text.strip():
                docs.append(text)
    return docs


def read_shard(path: Path) -> array:
    data = path.read_bytes()
    header = array("i")
    header.frombytes(data[: HEADER_INTS * 4])
    tokens = array("H")
    tokens.frombytes(data[HEADER_INTS * 4 :])
    if sys.byteorder == "big":
        header.byteswap()
        tokens.byteswap()
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise SystemExit(f"parity: {path}: not a challenge shard (header {header[0]}, {header[1]})")
    if header[2] != len(tokens):
        raise SystemExit(f"parity: {path}: header says {header[2]} tokens, file holds {len(tokens)}")
    return tokens


def split_at_bos(tokens: array) -> list:
    starts = [i for i, t in enumerate(tokens) if t == BOS]
    if tokens and (not starts or starts[0] != 0):
        raise SystemExit(f"parity: a split's token stream does not start with BOS ({tokens[:8].tolist()}...)")
    return [tokens[s:e].tolist() for s, e in zip(starts, starts[1:] + [len(tokens)])]


def edit_count(a: list, b: list) -> tuple:
    """(tokens that differ, [(i1, i2, j1, j2), ...] regions) between reference a and candidate b."""
    p = 0
    while p < len(a) and p < len(b) and a[p] == b[p]:
        p += 1
    s = 0
    while s < len(a) - p and s < len(b) - p and a[len(a) - 1 - s] == b[len(b) - 1 - s]:
        s += 1
    ma, mb = a[p : len(a) - s], b[p : len(b) - s]
    total, regions = 0, []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ma, mb, autojunk=False).get_opcodes():
        if tag != "equal":
            total += max(i2 - i1, j2 - j1)
            regions.append((p + i1, p + i2, p + j1, p + j2))
    return total, regions


class Pieces:
    def __init__(self, sp):
        self.sp = sp

    def text(self, ids: list) -> str:
        """The normalised text a run of ids stands for (byte pieces joined into UTF-8)."""
        out = bytearray()
        for i in ids:
            piece = self.sp.id_to_piece(i)
            if self.sp.is_byte(i):
                out.append(int(piece[3:5], 16))
            elif self.sp.is_control(i):
                out += f"<{piece}>".encode()
            else:
                out += piece.replace("\u2581", " ").encode()
        return out.decode("utf-8", errors="backslashreplace")

    def show(self, ids: list) -> str:
        return " ".join(f"{i}:{self.sp.id_to_piece(i)!r}" for i in ids)


def describe(ch: str) -> str:
    name = unicodedata.name(ch, "unassigned or control")
    return f"U+{ord(ch):04X} {name}"


def kind_of(ref_text: str, cand_text: str) -> str:
    """A label for one differing region, from the characters the two sides disagree on."""
    unusual = sorted({c for c in ref_text + cand_text if not (" " <= c <= "~")})
    if unusual:
        return ", ".join(describe(c) for c in unusual[:3])
    return f"same ASCII text, different pieces" if ref_text == cand_text else f"ASCII {ref_text!r} vs {cand_text!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "data/demo/tokenizer.model", help="sentencepiece .model")
    ap.add_argument("--corpus", type=Path, default=ROOT / "data/demo/corpus.jsonl", help="JSONL corpus with a `text` field")
    ap.add_argument("--shards", type=Path, default=ROOT / "data/demo/shards", help="folder `data prepare` wrote (manifest.json and shards)")
    ap.add_argument("--min-match", type=float, default=99.99, help="percent of tokens that must match (default 99.99)")
    ap.add_argument("--show", type=int, default=5, help="differing documents to print (default 5)")
    ap.add_argument("--context", type=int, default=4, help="tokens of context either side of a difference (default 4)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="sentencepiece encoding threads")
    ap.add_argument("--no-sha-check", action="store_true", help="do not require manifest.json to name this model and corpus")
    args = ap.parse_args()

    spm = import_sentencepiece()
    t0 = time.perf_counter()
    manifest = json.loads((args.shards / "manifest.json").read_text())
    if not args.no_sha_check:
        model_sha, corpus_sha = sha256_file(args.model), sha256_file(args.corpus)
        if manifest["tokenizer"]["sha256"] != model_sha:
            print(f"parity: {args.shards}/manifest.json names tokenizer {manifest['tokenizer']['path']} "
                  f"(sha256 {manifest['tokenizer']['sha256'][:12]}), not {args.model} ({model_sha[:12]})", file=sys.stderr)
            return 2
        if [i["sha256"] for i in manifest["inputs"]] != [corpus_sha]:
            print(f"parity: {args.shards}/manifest.json names inputs {[i['path'] for i in manifest['inputs']]}, "
                  f"not just {args.corpus} (sha256 {corpus_sha[:12]})", file=sys.stderr)
            return 2

    cand_docs = []
    for split in ("val", "train"):
        stream = array("H")
        for name in manifest[split]["shards"]:
            stream.extend(read_shard(args.shards / name))
        docs = split_at_bos(stream)
        if len(docs) != manifest[split]["docs"]:
            print(f"parity: the {split} shards hold {len(docs)} BOS-started documents; manifest.json says "
                  f"{manifest[split]['docs']}", file=sys.stderr)
            return 2
        cand_docs += [(split, d) for d in docs]

    texts = read_documents(args.corpus)
    if len(texts) != len(cand_docs):
        print(f"parity: {args.corpus} holds {len(texts)} documents, the shards {len(cand_docs)}", file=sys.stderr)
        return 2
    sp = spm.SentencePieceProcessor(model_file=str(args.model))
    if sp.bos_id() != BOS:
        print(f"parity: {args.model} has BOS id {sp.bos_id()}, not {BOS}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    ref_docs = []
    for i in range(0, len(texts), 256):
        ref_docs += [[BOS] + ids for ids in sp.encode(texts[i : i + 256], num_threads=args.threads)]
    t2 = time.perf_counter()

    pieces = Pieces(sp)
    ref_tokens = sum(len(d) for d in ref_docs)
    cand_tokens = sum(len(d) for _, d in cand_docs)
    differing, diff_tokens, kinds, shown = 0, 0, Counter(), []
    for n, (ref, (split, cand)) in enumerate(zip(ref_docs, cand_docs)):
        if ref == cand:
            continue
        differing += 1
        count, regions = edit_count(ref, cand)
        diff_tokens += count
        for i1, i2, j1, j2 in regions:
            kinds[kind_of(pieces.text(ref[i1:i2]), pieces.text(cand[j1:j2]))] += 1
        if len(shown) < args.show:
            shown.append((n, split, ref, cand, regions))

    match = 100.0 * (1 - diff_tokens / ref_tokens) if ref_tokens else 100.0
    print(f"model      {args.model} ({sp.get_piece_size()} pieces)")
    print(f"corpus     {args.corpus}")
    print(f"shards     {args.shards} ({manifest['val']['docs']} val + {manifest['train']['docs']} train documents)")
    print(f"documents compared      {len(ref_docs):,}")
    print(f"tokens compared         {ref_tokens:,} (python sentencepiece, BOS included; shards hold {cand_tokens:,})")
    print(f"documents that differ   {differing:,}")
    print(f"tokens that differ      {diff_tokens:,} (edit count: max of the two sides per difflib opcode)")
    print(f"match                   {match:.5f}% of tokens, {100.0 * (1 - differing / len(ref_docs)):.3f}% of documents")
    print(f"time                    {t2 - t1:.1f} s encoding with sentencepiece, {time.perf_counter() - t0:.1f} s in all")
    if kinds:
        print("\nkinds of difference (differing regions, by the non-ASCII characters in them):")
        for kind, c in kinds.most_common(12):
            print(f"  {c:6,}  {kind}")
    for n, split, ref, cand, regions in shown:
        text = texts[n]
        print(f"\ndocument {n} ({split}, {len(ref):,} vs {len(cand):,} tokens, {len(regions)} differing region(s)):")
        for i1, i2, j1, j2 in regions[:3]:
            c = args.context
            print(f"  at token {i1}: python   {pieces.show(ref[max(0, i1 - c):i2 + c])}")
            print(f"  {' ' * len(str(i1))}           pipeline {pieces.show(cand[max(0, j1 - c):j2 + c])}")
            before = pieces.text(ref[max(1, i1 - c):i1])
            at = text.find(before[-12:]) if before.strip() else -1
            if at >= 0:
                snippet = text[at:at + 12 + 24]
                print(f"  {' ' * len(str(i1))}           text     {snippet!r}")
            for ch in sorted({ch for ch in pieces.text(ref[i1:i2]) + pieces.text(cand[j1:j2]) if ord(ch) > 126 or ord(ch) < 32}):
                print(f"  {' ' * len(str(i1))}           char     {describe(ch)}")
    ok = match >= args.min_match
    print(f"\nparity: {'PASS' if ok else 'FAIL'}: {match:.5f}% match {'>=' if ok else '<'} --min-match {args.min_match}%")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
