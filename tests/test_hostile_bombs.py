"""Hostile input, class 3: decompression bombs in zstd objects.

zstd output is bounded by the size the object records (its size trailer).
More output, or a frame that claims more than the recorded size, is an
``IntegrityError`` with nothing allocated beyond the bound, from ``get``,
``open`` (streamed), ``raw_path`` (materialization) and ``verify``.  The
bombs are real zstd frames written by hand under ``objects/``; peak memory is
measured in a fresh interpreter (``VmHWM``).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import blake3
import pytest
import zstandard
from conftest import run_py

import casstore
from casstore.errors import IntegrityError

BOMB = 512 << 20  # decoded size of the bomb: far above the bound the test allows


def _trailer(size: int) -> bytes:
    # docs/format.md: a skippable frame (magic 0x184D2A5E, 12 bytes: "CSZ1" + u64 size)
    return struct.pack("<II4sQ", 0x184D2A5E, 12, b"CSZ1", size)


def _zeros_frame(n: int) -> bytes:
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    chunk = b"\0" * (16 << 20)
    out = []
    with_writer = cctx.compressobj(size=n)
    left = n
    while left:
        k = min(left, len(chunk))
        out.append(with_writer.compress(chunk[:k]))
        left -= k
    out.append(with_writer.flush())
    return b"".join(out)


def _plant(root: Path, content: bytes, stored: bytes) -> str:
    """Write ``stored`` as the zstd object file of ``content``'s digest; return the digest string."""
    h = blake3.blake3(content).hexdigest()
    d = root / "objects" / h[:2]
    d.mkdir(parents=True, exist_ok=True)
    (d / (h[2:] + ".zst")).write_bytes(stored)
    return "blake3:" + h


@pytest.fixture(scope="module")
def bomb_frame() -> bytes:
    return _zeros_frame(BOMB)


CHILD = r"""
import json, sys
import casstore
from casstore.errors import IntegrityError
s = casstore.open(sys.argv[1])
d, how = sys.argv[2], sys.argv[3]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
base = hwm()
try:
    if how == "get":
        s.get(d)
    elif how == "open":
        with s.open(d) as f:
            while f.read(1 << 20):
                pass
    elif how == "raw_path":
        s.raw_path(d)
    elif how == "verify":
        r = s.verify()
        print(json.dumps({"corrupt": [str(x) for x in r.corrupt], "grew": hwm() - base}))
        sys.exit(0)
    result = "no error"
except IntegrityError as e:
    result = "IntegrityError: " + str(e)
print(json.dumps({"result": result, "grew": hwm() - base}))
"""


@pytest.mark.parametrize("how", ["get", "open", "raw_path"])
def test_bomb_is_refused_with_bounded_memory(how: str, store: casstore.Store, bomb_frame: bytes) -> None:
    content = os.urandom(1000)
    d = _plant(store.root, content, bomb_frame + _trailer(len(content)))
    r = run_py(CHILD, str(store.root), d, how, timeout=60)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["result"].startswith("IntegrityError"), out
    assert out["grew"] < 64 << 20, out  # nowhere near the 512 MiB the frame decodes to
    assert not (store.root / "objects" / d[7:9] / d[9:]).exists()  # raw_path published nothing


def test_verify_reports_a_bomb_with_bounded_memory(store: casstore.Store, bomb_frame: bytes) -> None:
    content = os.urandom(1000)
    d = _plant(store.root, content, bomb_frame + _trailer(len(content)))
    r = run_py(CHILD, str(store.root), d, "verify", timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["corrupt"] == [d]
    assert out["grew"] < 64 << 20, out


def test_trailer_claiming_a_terabyte_does_not_allocate_it(store: casstore.Store) -> None:
    content = os.urandom(5000) * 4
    frame = zstandard.ZstdCompressor(level=3).compress(content)
    d = _plant(store.root, content, frame + _trailer(1 << 40))
    assert store.stat(d).size == 1 << 40  # stat reads the trailer only
    for read in (lambda: store.get(d), lambda: store.open(d).read(), lambda: store.raw_path(d)):
        with pytest.raises(IntegrityError):
            read()


def test_frame_longer_than_its_trailer_is_refused_before_the_extra_bytes(store: casstore.Store) -> None:
    content = b"A" * 10_000
    longer = content + b"B" * 10_000
    frame = zstandard.ZstdCompressor(level=3).compress(longer)
    d = _plant(store.root, content, frame + _trailer(len(content)))
    with pytest.raises(IntegrityError, match="more than its recorded"):
        store.get(d)
    with store.open(d) as f:
        with pytest.raises(IntegrityError):
            f.read()
    with pytest.raises(IntegrityError):
        store.get(d, verify=False)  # the bound holds even without hashing


def test_undecodable_frame_is_integrity_error(store: casstore.Store) -> None:
    content = b"hello" * 1000
    frame = bytearray(zstandard.ZstdCompressor(level=3).compress(content))
    frame[len(frame) // 2] ^= 0xFF
    d = _plant(store.root, content, bytes(frame) + _trailer(len(content)))
    for read in (lambda: store.get(d), lambda: store.open(d).read(), lambda: store.raw_path(d)):
        with pytest.raises(IntegrityError):
            read()
