"""Where things live under a store root (format 1).  See docs/format.md."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional, Tuple

from .digest import Digest

FORMAT_VERSION = 1
CONFIG_FILE = "store.toml"
OBJECTS = "objects"
REFS = "refs"
HEADS = "refs/heads"
PINS = "refs/pins"
LOCKS = "locks"
TMP = "tmp"
BAD = "bad"

RAW = "raw"
ZSTD = "zstd"
# The codec is known from the file name, never guessed from content: raw
# content may itself begin with zstd's magic number.
SUFFIXES = {RAW: "", ZSTD: ".zst"}
CODECS = (RAW, ZSTD)

SUBDIRS = (OBJECTS, HEADS, PINS, LOCKS, TMP)


def object_relpath(digest: Digest, codec: str) -> str:
    """``objects/<2 hex>/<62 hex>[.zst]`` for a digest stored with ``codec``."""
    h = digest.hex
    return f"{OBJECTS}/{h[:2]}/{h[2:]}{SUFFIXES[codec]}"


def object_path(root: Path, digest: Digest, codec: str) -> Path:
    """Absolute path of an object file under ``root``."""
    return root / object_relpath(digest, codec)


def parse_object_name(fanout: str, name: str) -> Optional[Tuple[Digest, str]]:
    """Inverse of :func:`object_relpath` for one directory entry; ``None`` if stray."""
    if len(fanout) != 2:
        return None
    codec = RAW
    stem = name
    if name.endswith(SUFFIXES[ZSTD]):
        codec = ZSTD
        stem = name[: -len(SUFFIXES[ZSTD])]
    if len(stem) != 62:
        return None
    try:
        return Digest(fanout + stem), codec
    except ValueError:
        return None


def iter_object_files(root: Path, prefix: str = "") -> Iterator[Tuple[Digest, str, str]]:
    """Yield ``(digest, codec, path)`` for every well-formed object file.

    ``prefix`` (hex) narrows the scan to the fan-out directories that can match.
    Stray files are skipped here; ``verify`` reports them.
    """
    objdir = root / OBJECTS
    try:
        fanouts = sorted(os.listdir(objdir))
    except FileNotFoundError:
        return
    for fan in fanouts:
        if prefix and not (fan.startswith(prefix[:2]) if len(prefix) >= 2 else fan.startswith(prefix)):
            continue
        try:
            names = sorted(os.listdir(objdir / fan))
        except (NotADirectoryError, FileNotFoundError):
            continue
        for name in names:
            parsed = parse_object_name(fan, name)
            if parsed is None:
                continue
            if prefix and not parsed[0].hex.startswith(prefix):
                continue
            yield parsed[0], parsed[1], str(objdir / fan / name)
