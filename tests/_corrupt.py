"""Damage a stored object on purpose (tests of verification)."""

from __future__ import annotations

import os
from pathlib import Path


def flip_byte(path: Path, offset: int) -> None:
    """Flip the low bit of the byte at ``offset`` of a read-only (0o444) object file, in place."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    os.chmod(path, 0o444)
