"""The store's own settings file, ``<root>/store.toml`` (written once, atomically; never by a read).

``store.toml`` is read like any other file in a store another user may write
to: it must be a regular file (not a symlink, FIFO, device or directory), at
most :data:`MAX_STORE_TOML_BYTES`, UTF-8 TOML holding exactly one ``[store]``
table whose keys are those of :data:`FIELDS`, each of its TOML type and range
(``format = true`` is a boolean, not the integer 1).  Anything else is a
:class:`~casstore.errors.StoreFormatError` naming the file, the key, the value
and what is expected.  Missing keys other than ``format`` take their defaults
(the file as casstore writes it always has all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, NamedTuple

from ._layout import CONFIG_FILE, FORMAT_VERSION
from .errors import InvalidInputError, StoreFormatError
from .settings import read_toml_file, show_value, toml_type

__all__ = ["StoreConfig", "Field", "FIELDS", "MAX_STORE_TOML_BYTES"]

MAX_STORE_TOML_BYTES = 64 * 1024
"""Largest ``store.toml`` read: casstore writes about 150 bytes."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int in Python, not in TOML


class Field(NamedTuple):
    """One key of ``[store]``: what is expected (quoted in errors) and the check a value must pass."""

    expected: str
    check: Callable[[object], bool]


FIELDS: Mapping[str, Field] = MappingProxyType({
    "format": Field(f"the integer {FORMAT_VERSION}", lambda v: _is_int(v) and v == FORMAT_VERSION),  # not 1.0
    "hash": Field('"blake3" (the only hash this casstore supports)', lambda v: isinstance(v, str) and v == "blake3"),
    "compression": Field('"raw" or "zstd"', lambda v: isinstance(v, str) and v in ("raw", "zstd")),
    "level": Field("an integer zstd level 1-22",
                   lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 22),
    "durable": Field("a boolean (true or false, unquoted)", lambda v: isinstance(v, bool)),
    "shared": Field("a boolean (true or false, unquoted)", lambda v: isinstance(v, bool)),
})
"""key of ``[store]`` -> :class:`Field`: the one table ``load``, ``__post_init__`` and ``to_toml`` use."""


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

    def __post_init__(self) -> None:
        # A config built in code is checked by the same table as one read from disk, so a bad
        # value can never reach to_toml (which would write it into a new store).
        for f in fields(self):
            value = getattr(self, f.name)
            if not FIELDS[f.name].check(value):
                raise InvalidInputError(f"StoreConfig({f.name}={show_value(value)}): expected "
                                        f"{FIELDS[f.name].expected}")

    def to_toml(self) -> bytes:
        """Serialize as TOML (flat ``[store]`` table)."""
        lines = ["# casstore store settings; see docs/format.md", "[store]"]
        for key in FIELDS:
            v = getattr(self, key)
            if isinstance(v, bool):
                lines.append(f"{key} = {'true' if v else 'false'}")
            elif isinstance(v, int):
                lines.append(f"{key} = {v}")
            else:  # checked by __post_init__: a plain name, nothing to escape
                lines.append(f'{key} = "{v}"')
        return ("\n".join(lines) + "\n").encode()

    @classmethod
    def load(cls, root: Path) -> StoreConfig:
        """Read ``root/store.toml``, read-only; raise StoreFormatError if absent, unsafe, bad or too new."""
        path = Path(root) / CONFIG_FILE
        # Not followed: casstore writes a regular file here, and a link planted by another member
        # of a shared store could point at /dev/zero, a FIFO or another store's settings.
        doc = read_toml_file(path, follow_symlinks=False, max_bytes=MAX_STORE_TOML_BYTES)
        if doc is None:
            if path.parent.exists() and not path.parent.is_dir():
                raise StoreFormatError(f"{root} is not a directory, so not a casstore store")
            raise StoreFormatError(
                f"{root} is not a casstore store (no {CONFIG_FILE}); "
                f"create one with `casstore init {root}` or casstore.open(path)"
            )
        damaged = "the store's settings file is damaged or was edited by hand"
        extra = [k for k in doc if k != "store"]
        if extra:
            raise StoreFormatError(f"{path}: unexpected key {show_value(extra[0])} = {show_value(doc[extra[0]])} "
                                   f"outside [store]; {damaged}")
        table = doc.get("store")
        if not isinstance(table, dict):
            raise StoreFormatError(f"{path} has no [store] table (store = {show_value(table)}); not a casstore store")
        unknown = [k for k in table if k not in FIELDS]
        if unknown:
            raise StoreFormatError(
                f"{path}: unknown key store.{show_value(unknown[0])} = {show_value(table[unknown[0]])}; expected only "
                f"{', '.join(FIELDS)} (a store of format {FORMAT_VERSION} has no other settings); {damaged}")
        if "format" not in table:
            raise StoreFormatError(f"{path} has no 'format' field in [store]; not a casstore store")
        fmt = table["format"]
        if _is_int(fmt) and fmt > FORMAT_VERSION:
            raise StoreFormatError(
                f"{root} uses store format {show_value(fmt)}, newer than this casstore understands "
                f"({FORMAT_VERSION}); upgrade casstore"
            )
        values: Dict[str, Any] = {}
        for key, value in table.items():
            spec = FIELDS[key]
            if not spec.check(value):
                raise StoreFormatError(f"{path}: bad value for store.{key}: {show_value(value)} ({toml_type(value)}); "
                                       f"expected {spec.expected}; {damaged}")
            values[key] = value
        return cls(**values)
