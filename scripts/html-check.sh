#!/usr/bin/env bash
# The HTML report in a real browser: runs the loader ablation
# (`pipeline ablate pipelines/loader.toml --vary stages.sampler.queue=2,100`, stopped after a few
# batches) and a short training run of the demo graph with a tiny model, then opens every
# report.html they wrote in headless chromium. Each page must load with no console message,
# hold its plots in the DOM, and give a screenshot that is more than a blank page.
#
#   scripts/html-check.sh                  # needs chromium (Debian: apt-get install chromium)
#
# The loader reads data/demo when scripts/fetch-demo-data.sh has made it, else the tiny corpus
# this script makes itself (no network: a small BPE tokenizer written by python3, shards by
# `pipeline data prepare`, from the repository's README and docs); the training run always
# trains on the tiny corpus. Takes about a minute after the build.
# Environment: PIPELINE_BIN (default: build target/release/pipeline), CHROMIUM (default: chromium
# on the PATH), KEEP=1 keeps the scratch directory (it is kept anyway on a failure).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "html-check: $*"; }
fail() {
  echo "html-check: FAILED: $*" >&2
  echo "html-check: the pages and screenshots are in $work" >&2
  exit 1
}

browser=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [[ -z "$browser" ]]; then
  echo "html-check: no chromium on the PATH (Debian: apt-get install chromium; or set CHROMIUM)" >&2
  exit 2
fi
if [[ -z "${PIPELINE_BIN:-}" ]]; then
  cargo build --release --locked --quiet
  PIPELINE_BIN="${CARGO_TARGET_DIR:-target}/release/pipeline"
fi
bin=$PIPELINE_BIN
# The binary reads PIPELINE_* variables as config overrides.
unset PIPELINE_BIN
work=$(mktemp -d "${TMPDIR:-/tmp}/html-check.XXXXXX")
trap 'status=$?; if [[ $status == 0 && -z "${KEEP:-}" ]]; then rm -rf "$work"; fi' EXIT

# --- the tiny corpus: tokenizer (the tests' BPE pieces), corpus.jsonl, shards -----------------
tiny=$work/tiny
mkdir -p "$tiny"
python3 - "$tiny" <<'EOF'
import json, pathlib, struct, sys

out = pathlib.Path(sys.argv[1])
# A sentencepiece BPE model as src/data/tokenizer.rs `build_bpe_model` writes it: <pad> <s> </s>
# (control), <unk>, 256 byte-fallback pieces, then the merges best first; identity normaliser.
PIECES = ("▁t he ▁the in er an on re ▁a at en or es ed is it ar al st le ou ▁s ▁w ▁o ▁c ▁f ▁p ▁b ▁m ▁i "
          "▁d ing ▁of ▁to ▁an ▁and ▁in ▁is ion ch th ▁th ▁ e t a o i n s r h l d c u m f p g w y b v k").split()

def varint(n):
    n &= (1 << 64) - 1
    b = bytearray()
    while True:
        if n < 0x80:
            b.append(n)
            return bytes(b)
        b.append((n & 0x7F) | 0x80)
        n >>= 7

def field(num, wire, payload):
    key = varint(num << 3 | wire)
    if wire == 0:
        return key + varint(payload)
    if wire == 5:
        return key + struct.pack("<f", payload)
    return key + varint(len(payload)) + payload

def piece(text, kind, score):
    return field(1, 2, field(1, 2, text.encode()) + field(2, 5, score) + field(3, 0, kind))

NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6
model = b"".join(piece(t, CONTROL, 0.0) for t in ("<pad>", "<s>", "</s>"))
model += piece("<unk>", UNKNOWN, 0.0)
model += b"".join(piece(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256))
model += b"".join(piece(p, NORMAL, -float(i)) for i, p in enumerate(PIECES))
trainer = field(3, 0, 2) + field(35, 0, 1) + field(40, 0, 3) + field(41, 0, 1) + field(42, 0, 2) + field(43, 0, 0)
normalizer = field(1, 2, b"identity") + field(3, 0, 0) + field(4, 0, 0) + field(5, 0, 1)
model += field(2, 2, trainer) + field(3, 2, normalizer)
(out / "tokenizer.model").write_bytes(model)
(out / "vocab").write_text(str(4 + 256 + len(PIECES)))

root = pathlib.Path(".")
pages = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
docs = [p.strip() for page in pages for p in page.read_text().split("\n\n") if len(p.strip()) > 40]
with open(out / "corpus.jsonl", "w") as f:
    for d in docs * 3:
        f.write(json.dumps({"text": d}) + "\n")
print(f"html-check: tiny corpus: {len(docs) * 3} documents, tokenizer of {4 + 256 + len(PIECES)} pieces")
EOF
"$bin" data prepare --tokenizer "$tiny/tokenizer.model" --input "$tiny/corpus.jsonl" --out "$tiny/shards" --val-frac 0.1 >/dev/null
vocab=$(cat "$tiny/vocab")

# --- the loader ablation ------------------------------------------------------------------------
if compgen -G "data/demo/shards/fineweb_train_*.bin" >/dev/null && [[ -f data/demo/tokenizer.model ]]; then
  say "loader ablation on data/demo"
  data_sets=()
else
  say "loader ablation on the tiny corpus (no data/demo)"
  data_sets=(--set "data.train=\"$tiny/shards/fineweb_train_*.bin\"" --set "data.tokenizer=\"$tiny/tokenizer.model\""
    --set train.seq_len=256 --set train.batch_tokens=16384)
fi
"$bin" ablate pipelines/loader.toml --vary stages.sampler.queue=2,100 --set stages.sink.stop_after_steps=50 \
  --set run.max_seconds=0 "${data_sets[@]}" --out "$work/ablation" -q >"$work/ablation.log" 2>&1 ||
  { cat "$work/ablation.log" >&2; fail "pipeline ablate pipelines/loader.toml did not complete"; }

# --- a short training run: the demo graph with a tiny model -------------------------------------
cat >"$work/tiny.toml" <<EOF
[run]
name = "html-check"
seed = 1337
warmup_items = 2

[data]
train = "$tiny/shards/fineweb_train_*.bin"
val = "$tiny/shards/fineweb_val_*.bin"
tokenizer = "$tiny/tokenizer.model"

[model]
vocab_size = $vocab
num_layers = 2
model_dim = 32
num_heads = 2
num_kv_heads = 1

[train]
seq_len = 32
batch_tokens = 256
grad_accum_steps = 1
iterations = 40
warmdown_iters = 0
max_wallclock_seconds = 0
val_every = 10
val_batch_tokens = 1024
log_every = 10

[stages.reader]
kind = "shard_reader"
impl = "mmap"
split = "train"

[stages.sampler]
kind = "window_sampler"
impl = "shuffled"
inputs = ["reader"]

[stages.pin]
kind = "pin"
impl = "pageable"
inputs = ["sampler"]

[stages.upload]
kind = "upload"
impl = "cpu"
inputs = ["pin"]

[stages.train]
kind = "step_executor"
impl = "candle"
inputs = ["upload"]
EOF
say "training run of a tiny model"
"$bin" run "$work/tiny.toml" --out "$work/train" -q >"$work/train.log" 2>&1 ||
  { cat "$work/train.log" >&2; fail "the training run failed"; }

# --- every page in the browser ------------------------------------------------------------------
# check PAGE MIN_SVGS PART...: loads with no console message, holds at least MIN_SVGS plots and
# every PART in the DOM, and its screenshot is a page of plots, not a blank or an error page.
check() {
  local page=$1 min_svgs=$2 name
  shift 2
  name=$(echo "${page#"$work"/}" | tr '/=' '__')
  [[ -f "$page" ]] || fail "$page was not written"
  local url="file://$(realpath "$page")"
  local flags=(--headless=new --no-sandbox --disable-gpu --hide-scrollbars --no-first-run --disable-extensions)
  "$browser" "${flags[@]}" --enable-logging=stderr --v=0 --window-size=1280,2000 \
    --screenshot="$work/$name.png" "$url" >"$work/$name.browser.log" 2>&1 ||
    { cat "$work/$name.browser.log" >&2; fail "chromium could not open $page"; }
  if grep -E ":CONSOLE|Uncaught|Failed to load|ERR_FILE_NOT_FOUND|net::ERR" "$work/$name.browser.log" >&2; then
    fail "$page: console messages or failed loads (above)"
  fi
  "$browser" "${flags[@]}" --dump-dom "$url" >"$work/$name.dom.html" 2>/dev/null ||
    fail "chromium could not dump the DOM of $page"
  local svgs
  svgs=$(grep -o '<svg' "$work/$name.dom.html" | wc -l)
  [[ "$svgs" -ge "$min_svgs" ]] || fail "$page: $svgs <svg> elements in the DOM, expected at least $min_svgs"
  for part in "$@"; do
    grep -qF "$part" "$work/$name.dom.html" || fail "$page: \"$part\" is not in the DOM"
  done
  python3 - "$work/$name.png" <<'EOF' || fail "$page: the screenshot is not a page of plots"
import struct, sys, zlib

path = sys.argv[1]
data = open(path, "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, idat = 8, b""
while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    pos += 12 + n
    if kind == b"IHDR":
        width, height, depth, colour = struct.unpack(">IIBB", body[:10])
    elif kind == b"IDAT":
        idat += body
assert depth == 8 and colour in (2, 6), f"unexpected PNG format (depth {depth}, colour type {colour})"
bpp = 3 if colour == 2 else 4
raw, stride = zlib.decompress(idat), width * bpp
prev, rows, at = bytearray(stride), [], 0
for _ in range(height):
    kind, line = raw[at], bytearray(raw[at + 1:at + 1 + stride])
    at += 1 + stride
    for x in range(stride):
        a = line[x - bpp] if x >= bpp else 0
        b = prev[x]
        c = prev[x - bpp] if x >= bpp else 0
        if kind == 1:
            line[x] = (line[x] + a) & 255
        elif kind == 2:
            line[x] = (line[x] + b) & 255
        elif kind == 3:
            line[x] = (line[x] + (a + b) // 2) & 255
        elif kind == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    rows.append(bytes(line))
    prev = line
colours, inked = set(), 0
for y in range(0, height, 2):
    row = rows[y]
    for x in range(0, width, 2):
        px = row[x * bpp:x * bpp + 3]
        colours.add(px)
        inked += sum(px) < 600
total = ((height + 1) // 2) * ((width + 1) // 2)
print(f"html-check: {path}: {width}x{height}, {len(data) // 1024} KiB, {len(colours)} colours, {100 * inked / total:.1f}% inked")
assert len(colours) >= 40, f"only {len(colours)} colours: a blank or plain page"
assert inked / total >= 0.02, "almost nothing drawn"
EOF
  say "ok: $page ($svgs plots)"
}

check "$work/ablation/report.html" 5 "Comparison" "stages.sampler.queue=100/report.html" "sampler: service time per item"
for variant in base stages.sampler.queue=2 stages.sampler.queue=100; do
  check "$work/ablation/$variant/report.html" 8 "Stage graph" "Verdict" "sampler: service time per item" "length over time"
done
check "$work/train/report.html" 8 "Stage graph" "Training" "loss against steps" "step time against steps"
say "every page loads in $("$browser" --version 2>/dev/null | head -1) with no console message, and shows its plots"
