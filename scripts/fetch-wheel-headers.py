#!/usr/bin/env python3
"""Extracts part of a PyPI wheel (its header files) without downloading the whole wheel.

    fetch-wheel-headers.py NAME VERSION PREFIX DEST   # members under PREFIX -> DEST/
    fetch-wheel-headers.py --list NAME VERSION        # the wheel's member names

A wheel is a zip archive, whose central directory (at its end) says where each member lies:
this reads the directory and then only the wanted members with HTTP Range requests, through a
seekable file object handed to `zipfile` (which checks each member's CRC-32). The manylinux
x86_64 wheel is picked; for a CPython-tagged one any of them does, as only headers are read.
If the server ignores Range, the whole wheel is downloaded instead and checked against PyPI's
sha256. DEST is written whole or not at all (extracted beside it, then renamed), so that
"DEST exists" means a complete extraction. Standard library only.

scripts/build-cuda.sh uses it for the headers of cuDNN (nvidia-cudnn-cu13, a 517 MB wheel) and
cudnn-frontend (nvidia-cudnn-frontend, 11.6 MB).
"""

import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile

PYPI = "https://pypi.org/pypi"
TIMEOUT_S = 120
# Range reads are cached in aligned blocks; one request fetches a run of missing blocks.
BLOCK = 256 * 1024


class RangeUnsupported(Exception):
    """The server answered a Range request with the whole file."""


def urlopen(request):
    """urllib's urlopen with three tries for transient network errors (not for HTTP errors)."""
    for attempt in range(3):
        try:
            return urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError:
            raise
        except OSError:
            if attempt == 2:
                raise
            time.sleep(2 * (attempt + 1))


def wheel_file(name, version):
    """PyPI's record (url, size, digests) of the manylinux x86_64 wheel of NAME==VERSION."""
    try:
        with urlopen(f"{PYPI}/{name}/{version}/json") as r:
            base, files = r.geturl(), json.load(r)["urls"]
    except urllib.error.HTTPError as e:
        if e.code != 404:
            raise
        # Some mirrors serve only the project's document, which lists every release's files.
        with urlopen(f"{PYPI}/{name}/json") as r:
            base, files = r.geturl(), json.load(r)["releases"].get(version, [])
    wheels = sorted(
        (f for f in files if f["filename"].endswith(".whl") and "manylinux" in f["filename"] and "x86_64" in f["filename"]),
        key=lambda f: f["filename"],
    )
    if not wheels:
        sys.exit(f"error: PyPI lists no manylinux x86_64 wheel for {name}=={version}")
    # Mirrors may give the file's address relative to the document's.
    return dict(wheels[0], url=urllib.parse.urljoin(base, wheels[0]["url"]))


class HttpRangeFile(io.RawIOBase):
    """A read-only, seekable file over a URL, read with HTTP Range requests."""

    def __init__(self, url, size):
        super().__init__()
        self.url, self.size, self.pos = url, size, 0
        self.blocks = {}
        self.fetched = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def fetch(self, first, last):
        """Blocks first..=last in one request."""
        start, end = first * BLOCK, min((last + 1) * BLOCK, self.size) - 1
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
        with urlopen(request) as r:
            if r.status != 206 or not (r.headers.get("Content-Range") or "").startswith(f"bytes {start}-"):
                raise RangeUnsupported()
            data = r.read()
        if len(data) != end - start + 1:
            raise OSError(f"short Range read of {self.url}: {len(data)} of {end - start + 1} bytes")
        self.fetched += len(data)
        for i in range(first, last + 1):
            self.blocks[i] = data[(i - first) * BLOCK : (i - first + 1) * BLOCK]

    def read(self, n=-1):
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if self.pos >= end:
            return b""
        first, last = self.pos // BLOCK, (end - 1) // BLOCK
        missing = [i for i in range(first, last + 1) if i not in self.blocks]
        while missing:
            run = 1
            while run < len(missing) and missing[run] == missing[0] + run:
                run += 1
            self.fetch(missing[0], missing[run - 1])
            missing = missing[run:]
        data = b"".join(self.blocks[i] for i in range(first, last + 1))
        out = data[self.pos - first * BLOCK : end - first * BLOCK]
        self.pos = end
        return out

    def readinto(self, b):
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def download(wheel, directory):
    """The whole wheel into `directory`, checked against PyPI's sha256; its path."""
    path = os.path.join(directory, wheel["filename"])
    digest = hashlib.sha256()
    with urlopen(wheel["url"]) as r, open(path, "wb") as out:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    if digest.hexdigest() != wheel["digests"]["sha256"]:
        sys.exit(f"error: sha256 mismatch for {wheel['filename']}")
    return path


def extract(archive, prefix, dest):
    """Members under `prefix` into dest/ (relative to the prefix); how many files."""
    members = [i for i in archive.infolist() if i.filename.startswith(prefix) and not i.is_dir()]
    if not members:
        sys.exit(f"error: the wheel has no member under {prefix!r} (see --list)")
    tmp = dest + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    for info in members:
        rel = info.filename[len(prefix) :].lstrip("/")
        parts = rel.split("/")
        if not rel or ".." in parts or os.path.isabs(rel):
            sys.exit(f"error: refusing member name {info.filename!r}")
        path = os.path.join(tmp, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            out.write(archive.read(info))  # raises BadZipFile on a CRC mismatch
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return len(members)


def main(argv):
    listing = argv[:1] == ["--list"]
    if (listing and len(argv) != 3) or (not listing and len(argv) != 4):
        sys.exit(__doc__.split("\n\n")[1])
    name, version = argv[-2:] if listing else argv[:2]
    wheel = wheel_file(name, version)
    source = HttpRangeFile(wheel["url"], wheel["size"])
    with tempfile.TemporaryDirectory() as scratch:
        try:
            archive = zipfile.ZipFile(io.BufferedReader(source, buffer_size=BLOCK))
        except RangeUnsupported:
            print(f"note: the server ignores Range: downloading all of {wheel['filename']}", file=sys.stderr)
            source = None
            archive = zipfile.ZipFile(download(wheel, scratch))
        with archive:
            if listing:
                for info in archive.infolist():
                    print(f"{info.file_size:>12}  {info.filename}")
                return
            prefix, dest = argv[2], argv[3]
            count = extract(archive, prefix, dest)
    read = f"{source.fetched / 1e6:.1f} of {wheel['size'] / 1e6:.1f} MB read" if source else "whole wheel read"
    print(f"{wheel['filename']}: {count} files under {prefix} -> {dest} ({read})", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
