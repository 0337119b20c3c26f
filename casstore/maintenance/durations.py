"""Durations and sizes as users write them: ``"1h30m"``, ``timedelta(...)``, ``"1.5GiB"``.

Shared by gc (``grace``), limits (``max_bytes``), verify (``recheck_after``)
and the CLI.  Wrong types and values raise :class:`InvalidTypeError` /
:class:`InvalidInputError` naming the argument (``what``) and the accepted forms.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Union

from ..errors import InvalidInputError, InvalidTypeError

__all__ = ["Duration", "Size", "parse_duration", "parse_size"]

Duration = Union[int, float, str, timedelta]
"""Seconds, a :class:`~datetime.timedelta`, or a string like ``"90s"``, ``"10m"``, ``"1h30m"``, ``"2d"``."""

Size = Union[int, float, str]
"""Bytes, or a string like ``"500M"``, ``"10G"``, ``"1.5TiB"`` (K/M/G/T/P are powers of 1024)."""

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DUR_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(min|[smhdw]?)")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)


def parse_duration(value: Duration, what: str = "grace") -> float:
    """Seconds from ``90``, ``90.5``, ``timedelta(...)``, ``"90s"``, ``"10m"``, ``"1h"``, ``"2d"``, ``"1h30m"``."""
    if isinstance(value, bool):  # a bool is an int to Python, never a duration to a user
        raise InvalidTypeError(f"{what} must be seconds, a timedelta or a string like '1h', not a bool")
    if isinstance(value, timedelta):
        secs = value.total_seconds()
    elif isinstance(value, (int, float)):
        secs = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        pos = 0
        secs = 0.0
        for m in _DUR_RE.finditer(text):
            if m.start() != pos or (not m.group(2) and m.end() != len(text)):
                break
            secs += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if not text or pos != len(text):
            raise InvalidInputError(
                f"invalid {what} {value!r}: use seconds or a duration like '90s', '10m', '1h', '2d' or '1h30m'"
            )
    else:
        raise InvalidTypeError(f"{what} must be seconds, a timedelta or a string like '1h', not {type(value).__name__}")
    if math.isnan(secs) or secs < 0:
        raise InvalidInputError(f"invalid {what} {value!r}: it must not be negative")
    return secs


def parse_size(value: Size, what: str = "max_bytes") -> int:
    """Bytes from ``1000``, ``"500M"``, ``"10G"``, ``"1.5GiB"`` (K/M/G/T/P are powers of 1024)."""
    if isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be a number of bytes or a string like '10G', not a bool")
    if isinstance(value, (int, float)):
        n = float(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise InvalidInputError(f"invalid {what} {value!r}: use bytes or a size like '500M', '10G', '1.5TiB'")
        n = float(m.group(1)) * 1024 ** " kmgtp".index(m.group(2).lower() or " ")
    else:
        raise InvalidTypeError(f"{what} must be a number of bytes or a string like '10G', not {type(value).__name__}")
    # Hazard: int(float("inf")) raises a bare OverflowError (issue 11, class 10: limit(float("inf"))).
    if math.isnan(n) or n < 0 or math.isinf(n):
        raise InvalidInputError(f"invalid {what} {value!r}: it must be a finite, non-negative number of bytes")
    return int(n)
