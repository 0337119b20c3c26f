"""The path rules every key and name obeys: a normalized relative POSIX path.

Manifest keys become file paths under a checkout or a derive work directory,
and head/pin names become files under ``refs/``.  Joined to a directory, a
valid key always names a path inside it: so the rules live here, in the core
layer, and both the refs layer (names) and the manifest decoder (keys) use
them.  Hazards: ``..`` and absolute paths escape; NUL truncates in C; control
characters and lone surrogates make names that cannot be printed, typed or
encoded; thousands of segments exhaust PATH_MAX and recursion.
"""

from __future__ import annotations

import re
from typing import Optional

from .errors import InvalidInputError, InvalidTypeError

__all__ = ["MAX_KEY_BYTES", "MAX_SEGMENT_BYTES", "MAX_SEGMENTS", "BAD_CHAR", "key_problem", "validate_key"]

MAX_KEY_BYTES = 4096
"""Longest key, in UTF-8 bytes (Linux's PATH_MAX)."""
MAX_SEGMENT_BYTES = 255
"""Longest key segment, in UTF-8 bytes (the longest file name on common filesystems)."""
MAX_SEGMENTS = 256
"""Most segments in one key (directory depth of a checkout)."""

BAD_CHAR = re.compile("[\x00-\x1f\x7f-\x9f\\\\\ud800-\udfff]")
"""C0 and C1 control characters (NUL, newline, ESC...), DEL, backslash and lone surrogates."""
_SHORT_ANY = 63  # 63 characters of any kind are at most 252 UTF-8 bytes: no segment length check needed


def key_problem(key: str) -> Optional[str]:
    """Why ``key`` (a str) is not a valid key, or ``None``."""
    if not key:
        return "it is empty"
    m = BAD_CHAR.search(key)
    if m is not None:
        c = m.group()
        if c == "\x00":
            return "it contains NUL"
        if c == "\\":
            return "it contains a backslash (use '/')"
        if "\ud800" <= c <= "\udfff":
            return ("it is not valid Unicode (a lone surrogate, e.g. a file name in another encoding "
                    "decoded with surrogateescape)")
        return f"it contains the control character U+{ord(c):04X}"
    n = len(key.encode("utf-8"))
    if n > MAX_KEY_BYTES:
        return f"it is {n} bytes long, more than {MAX_KEY_BYTES}"
    if key.startswith("/"):
        return "it is absolute"
    segs = key.split("/")
    if len(segs) > MAX_SEGMENTS:
        return f"it has {len(segs)} segments, more than {MAX_SEGMENTS}"
    for seg in segs:
        if seg == "":
            return "it has an empty segment ('//' or a trailing '/')"
        if seg in (".", ".."):
            return f"it has a '{seg}' segment"
        if len(seg) > _SHORT_ANY and len(seg.encode("utf-8")) > MAX_SEGMENT_BYTES:
            return f"a segment is longer than {MAX_SEGMENT_BYTES} bytes"
    return None


def validate_key(key: object, what: str = "key") -> str:
    """Return ``key`` if it is a normalized relative POSIX path like ``data/train.h5``, else raise.

    :class:`~casstore.errors.InvalidTypeError` for a non-str,
    :class:`~casstore.errors.InvalidInputError` naming the problem otherwise.
    """
    if not isinstance(key, str):
        raise InvalidTypeError(f"a manifest {what} must be a str, not {type(key).__name__}")
    problem = key_problem(key)
    if problem is not None:
        raise InvalidInputError(
            f"invalid {what} {key!r:.200}: {problem}; {what}s are normalized relative POSIX paths "
            "like 'data/train.h5'"
        )
    return key
