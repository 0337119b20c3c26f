"""Refs: the only mutable files in a store.

``refs/heads/<name>`` holds the digest of a manifest's current version and
moves (by atomic rename, invariant 3) on every committed edit.
``refs/pins/<name>`` holds a frozen manifest digest and never moves unless a
user forces it.  A ref file is one line, ``blake3:<64 hex>\\n``.

Reads take no lock: rename guarantees a reader sees the old or the new file,
complete.  Names and manifest keys are validated as normalized POSIX relative
paths (no ``..``, no absolute paths, no empty segments, no NUL, no backslash)
so that neither a ref nor a ``checkout`` can ever escape its directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

from ._fs import makedirs, write_file_atomic
from ._layout import HEADS, LOCKS, PINS, TMP
from .digest import Digest
from .errors import InvalidDigestError, InvalidInputError, InvalidTypeError, StoreFormatError

__all__ = ["validate_key", "validate_name", "read_ref", "write_ref", "list_refs", "ref_path", "lock_path"]

_MAX_KEY = 4096
_MAX_SEGMENT = 255


def validate_key(key: object, what: str = "key") -> str:
    """Return ``key`` if it is a normalized POSIX relative path, else raise InvalidInputError."""
    if not isinstance(key, str):
        raise InvalidTypeError(f"a manifest {what} must be a str, not {type(key).__name__}")
    problem = None
    if not key:
        problem = "it is empty"
    elif len(key) > _MAX_KEY:
        problem = f"it is longer than {_MAX_KEY} characters"
    elif "\x00" in key:
        problem = "it contains NUL"
    elif "\\" in key:
        problem = "it contains a backslash (use '/')"
    elif key.startswith("/"):
        problem = "it is absolute"
    else:
        for seg in key.split("/"):
            if seg == "":
                problem = "it has an empty segment ('//' or a trailing '/')"
            elif seg in (".", ".."):
                problem = f"it has a '{seg}' segment"
            elif len(seg.encode("utf-8", "surrogatepass")) > _MAX_SEGMENT:
                problem = f"a segment is longer than {_MAX_SEGMENT} bytes"
            if problem:
                break
    if problem:
        raise InvalidInputError(
            f"invalid {what} {key!r}: {problem}; {what}s are normalized relative POSIX paths like 'data/train.h5'"
        )
    return key


def validate_name(name: object) -> str:
    """Validate a head or pin name (a key that also may not contain ':')."""
    validate_key(name, "name")
    assert isinstance(name, str)
    if ":" in name:
        raise InvalidInputError(f"invalid name {name!r}: ':' is reserved for digests like 'blake3:...'")
    return name


def ref_path(root: Path, kind: str, name: str) -> Path:
    """``<root>/refs/heads/<name>`` or ``<root>/refs/pins/<name>``."""
    return root / (HEADS if kind == "heads" else PINS) / name


def lock_path(root: Path, kind: str, name: str) -> Path:
    """Sidecar lock file for a name: ``<root>/locks/<kind>/<blake3(name)[:32]>.lock``.

    Hashed, not ``<name>.lock``: the names ``x`` and ``x.lock/y`` are both valid,
    and their lock files would collide (a file where a directory must be).
    """
    from .digest import new_hasher

    h = new_hasher()
    h.update(name.encode("utf-8", "surrogatepass"))
    return root / LOCKS / kind / f"{h.hexdigest()[:32]}.lock"


def read_ref(root: Path, kind: str, name: str) -> Optional[Digest]:
    """Lock-free read of a ref; ``None`` if it does not exist."""
    p = ref_path(root, kind, name)
    try:
        text = p.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        return None
    try:
        return Digest.parse(text.decode("ascii").strip())
    except (UnicodeDecodeError, InvalidDigestError):
        raise StoreFormatError(f"ref {p} is damaged (content {text[:80]!r}); restore it or remove it") from None


def write_ref(root: Path, kind: str, name: str, digest: Digest, *, durable: bool = True) -> None:
    """Point a ref at ``digest`` by atomic rename (creating parent dirs as needed)."""
    p = ref_path(root, kind, name)
    if p.is_dir():
        raise InvalidInputError(f"name {name!r} is a prefix of other names ({p} is a directory); choose another")
    try:
        makedirs(p.parent, durable)  # new dirs: setgid mode copied, entries fsynced when durable
    except (FileExistsError, NotADirectoryError):
        raise InvalidInputError(
            f"name {name!r} conflicts with an existing name that is a prefix of it; choose another"
        ) from None
    write_file_atomic(root / TMP, p, f"{digest}\n".encode(), durable=durable, mode=0o444)


def list_refs(root: Path, kind: str) -> Dict[str, Digest]:
    """All refs of a kind, name -> digest, sorted by name."""
    base = root / (HEADS if kind == "heads" else PINS)
    out: Dict[str, Digest] = {}
    for dirpath, _dirs, files in os.walk(base):
        for f in files:
            name = os.path.relpath(os.path.join(dirpath, f), base).replace(os.sep, "/")
            d = read_ref(root, kind, name)
            if d is not None:
                out[name] = d
    return dict(sorted(out.items()))
