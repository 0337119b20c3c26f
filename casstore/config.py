"""The store's own settings file, ``<root>/store.toml`` (written once, atomically)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict

from ._layout import CONFIG_FILE, FORMAT_VERSION
from .errors import StoreFormatError

__all__ = ["StoreConfig"]


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Settings fixed when a store is created (``store.toml``).

    ``compression``: default codec for puts, ``"raw"`` or ``"zstd"``;
    ``level``: zstd level; ``durable``: fsync before a put returns;
    ``shared``: group-writable files for multi-user stores.
    """

    format: int = FORMAT_VERSION
    hash: str = "blake3"
    compression: str = "raw"
    level: int = 3
    durable: bool = True
    shared: bool = False

    def to_toml(self) -> bytes:
        """Serialize as TOML (flat ``[store]`` table)."""
        lines = ["# casstore store settings; see docs/format.md", "[store]"]
        for key in ("format", "hash", "compression", "level", "durable", "shared"):
            v = getattr(self, key)
            if isinstance(v, bool):
                lines.append(f"{key} = {'true' if v else 'false'}")
            elif isinstance(v, int):
                lines.append(f"{key} = {v}")
            else:
                lines.append(f'{key} = "{v}"')
        return ("\n".join(lines) + "\n").encode()

    @classmethod
    def load(cls, root: Path) -> StoreConfig:
        """Read ``root/store.toml``; raise StoreFormatError if absent, bad or too new."""
        path = root / CONFIG_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise StoreFormatError(
                f"{root} is not a casstore store (no {CONFIG_FILE}); "
                f"create one with `casstore init {root}` or casstore.open(path)"
            ) from None
        except IsADirectoryError:
            raise StoreFormatError(f"{path} is a directory, not a casstore settings file") from None
        try:
            doc: Dict[str, Any] = tomllib.loads(raw.decode("utf-8")).get("store", {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise StoreFormatError(f"{path} is not valid TOML ({e}); the store's settings are damaged") from None
        fmt = doc.get("format")
        if not isinstance(fmt, int):
            raise StoreFormatError(f"{path} has no integer 'format' field; not a casstore store")
        if fmt > FORMAT_VERSION:
            raise StoreFormatError(
                f"{root} uses store format {fmt}, newer than this casstore understands "
                f"({FORMAT_VERSION}); upgrade casstore"
            )
        if doc.get("hash", "blake3") != "blake3":
            raise StoreFormatError(f"{root} uses hash {doc.get('hash')!r}; only blake3 is supported")
        cfg = cls()
        known = {k: doc[k] for k in ("format", "compression", "level", "durable", "shared") if k in doc}
        try:
            return replace(cfg, **known)
        except TypeError as e:  # pragma: no cover - unknown types
            raise StoreFormatError(f"{path}: {e}") from None
