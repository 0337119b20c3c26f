"""Where things live under a store root or a remote prefix (format 1).  See docs/format.md.

The object key layout is written once, here, and used by the local object
store (a path under ``<root>``) and the S3 one (a key under ``<prefix>``):
``objects/<2 hex>/<62 hex><codec suffix>``.  Remotes hold raw objects only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

from .codecs import RAW, Codec, by_suffix
from .digest import Digest
from .errors import InvalidDigestError

__all__ = [
    "FORMAT_VERSION", "CONFIG_FILE", "REMOTES_FILE", "OBJECTS", "REFS", "HEADS", "PINS", "LOCKS", "TMP", "BAD",
    "SUBDIRS", "FIXED_DIRS",
    "object_relpath", "object_path", "parse_object_name", "object_key", "parse_object_key", "is_fanout",
]

FORMAT_VERSION = 1
CONFIG_FILE = "store.toml"
REMOTES_FILE = "remotes.toml"
OBJECTS = "objects"
REFS = "refs"
HEADS = "refs/heads"
PINS = "refs/pins"
LOCKS = "locks"
TMP = "tmp"
BAD = "bad"

SUBDIRS = (OBJECTS, HEADS, PINS, LOCKS, TMP)

FIXED_DIRS = (OBJECTS, TMP, REFS, HEADS, PINS, "refs/log", "refs/log/heads", "refs/log/pins", LOCKS, "locks/names",
              BAD, "state", "cache", "cache/stat", "cache/hashed", "cache/checkout")
"""Every directory of a store at a fixed place: none may be a symbolic link (``_fs.refuse_planted_links``)."""

_HEX = frozenset("0123456789abcdef")


def object_relpath(digest: Digest, codec: Codec = RAW) -> str:
    """``objects/<2 hex>/<62 hex>[suffix]`` for a digest stored with ``codec``."""
    h = digest.hex
    return f"{OBJECTS}/{h[:2]}/{h[2:]}{codec.suffix}"


def object_path(root: Path, digest: Digest, codec: Codec = RAW) -> Path:
    """Absolute path of an object file under ``root``."""
    return root / object_relpath(digest, codec)


def is_fanout(name: str) -> bool:
    """Is ``name`` a fan-out directory name (two lowercase hex digits)?"""
    return len(name) == 2 and name[0] in _HEX and name[1] in _HEX


def parse_object_name(fanout: str, name: str) -> Optional[Tuple[Digest, Codec]]:
    """Inverse of :func:`object_relpath` for one directory entry; ``None`` if stray."""
    if not is_fanout(fanout):
        return None
    codec, stem = by_suffix(name)
    if len(stem) != 62:
        return None
    try:
        return Digest(fanout + stem), codec
    except (InvalidDigestError, ValueError):
        return None


def object_key(prefix: str, digest: Digest) -> str:
    """``<prefix>objects/ab/cdef...``: where a (raw) object lives on a remote."""
    return prefix + object_relpath(digest, RAW)


def parse_object_key(prefix: str, key: str) -> Optional[Digest]:
    """Inverse of :func:`object_key`; ``None`` for any other key."""
    base = f"{prefix}{OBJECTS}/"
    if not key.startswith(base):
        return None
    rest = key[len(base):]
    if len(rest) != 65 or rest[2] != "/":
        return None
    parsed = parse_object_name(rest[:2], rest[3:])
    if parsed is None or parsed[1] is not RAW:
        return None
    return parsed[0]
