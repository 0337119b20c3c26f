"""Runtime settings: the knobs a user changes per run, and where each came from.

Precedence, highest first:

1. environment variables (``CASSTORE_DIR``, ``CASSTORE_COMPRESSION``,
   ``CASSTORE_LOCK_TIMEOUT``, ``CASSTORE_FORCE_DOWNLOAD``, ``CASSTORE_REGENERATE``,
   ``CASSTORE_DURABLE``);
2. a settings file: ``$CASSTORE_CONFIG`` if set, else the nearest ``casstore.toml``
   or ``pyproject.toml`` with a ``[tool.casstore]`` table in the current
   directory or a parent, else ``$XDG_CONFIG_HOME/casstore/casstore.toml``;
3. built-in defaults.

A relative ``store`` path in a settings file is relative to that file's
directory (so every subdirectory of a project sees the same store); in
``CASSTORE_DIR`` it is relative to the current directory.

``casstore config`` prints the effective values and their sources.  These are
settings of a *run*; settings fixed when a store is created live in the store's
own ``store.toml`` (see :mod:`casstore.config`).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from .errors import InvalidInputError, StoreFormatError

__all__ = ["Settings", "load_settings", "current", "KNOBS"]

# knob -> (environment variable, default, parser name)
KNOBS: Dict[str, Tuple[str, Any, str]] = {
    "store": ("CASSTORE_DIR", None, "path"),
    "compression": ("CASSTORE_COMPRESSION", None, "compression"),
    "lock_timeout": ("CASSTORE_LOCK_TIMEOUT", 600.0, "float"),
    "force_download": ("CASSTORE_FORCE_DOWNLOAD", False, "bool"),
    "regenerate": ("CASSTORE_REGENERATE", False, "bool"),
    "durable": ("CASSTORE_DURABLE", None, "bool"),
}


def _default_store() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return str(base / "casstore")


@dataclass(frozen=True, slots=True)
class Settings:
    """Effective runtime settings; ``sources[knob]`` says where each value came from."""

    store: str
    compression: Optional[str]
    lock_timeout: float
    force_download: bool
    regenerate: bool
    durable: Optional[bool]
    sources: Mapping[str, str] = field(default_factory=dict)
    file: Optional[str] = None


def _parse(kind: str, value: Any, where: str) -> Any:
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            v = str(value).strip().lower()
            if v in ("1", "true", "yes", "on"):
                return True
            if v in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(value)
        if kind == "float":
            if isinstance(value, bool):  # float(True) == 1.0: a TOML `true` is not a number of seconds
                raise ValueError(value)
            f = float(value)
            if not f >= 0:  # also refuses NaN, with which a lock wait would never time out
                raise ValueError(value)
            return f
        if kind == "path":
            return str(Path(str(value)).expanduser())
        if kind == "compression":
            from ._codec import normalize_compress

            if isinstance(value, bool):  # compression = true / false in TOML
                return "zstd" if value else "raw"
            v = str(value)
            normalize_compress(int(v) if v.isdigit() else v, 3)
            return v
    except (ValueError, TypeError, InvalidInputError):
        raise InvalidInputError(f"bad value {value!r} for {where}") from None
    raise AssertionError(kind)  # pragma: no cover


def _find_file(cwd: Path, env: Mapping[str, str]) -> Tuple[Optional[Path], Dict[str, Any]]:
    explicit = env.get("CASSTORE_CONFIG")
    candidates = []
    if explicit:
        candidates.append(Path(explicit).expanduser())
    else:
        for d in (cwd, *cwd.parents):
            candidates.append(d / "casstore.toml")
            candidates.append(d / "pyproject.toml")
        xdg = env.get("XDG_CONFIG_HOME")
        candidates.append((Path(xdg) if xdg else Path.home() / ".config") / "casstore" / "casstore.toml")
    for p in candidates:
        try:
            raw = p.read_bytes()
        except (FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError):
            if explicit:
                raise StoreFormatError(f"CASSTORE_CONFIG={explicit} does not exist or cannot be read") from None
            continue
        try:
            doc = tomllib.loads(raw.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise StoreFormatError(f"settings file {p} is not valid TOML: {e}") from None
        if p.name == "pyproject.toml":
            table = doc.get("tool", {}).get("casstore")
            if table is None:
                continue
        else:
            table = doc.get("casstore", doc)
        if not isinstance(table, dict):
            raise StoreFormatError(f"settings file {p}: the casstore settings must be a table")
        unknown = set(table) - set(KNOBS)
        if unknown:
            raise InvalidInputError(
                f"settings file {p}: unknown setting(s) {sorted(unknown)}; known: {sorted(KNOBS)}"
            )
        return p, table
    return None, {}


def load_settings(cwd: Optional[Path] = None, env: Optional[Mapping[str, str]] = None) -> Settings:
    """Read the settings as they apply now (see the module docstring for precedence)."""
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    path, table = _find_file(cwd, env)
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for knob, (var, default, kind) in KNOBS.items():
        if env.get(var) not in (None, ""):
            values[knob] = _parse(kind, env[var], f"${var}")
            sources[knob] = f"env {var}"
        elif knob in table:
            values[knob] = _parse(kind, table[knob], f"{knob} in {path}")
            if kind == "path" and path is not None and not Path(values[knob]).is_absolute():
                # Relative to the settings file, not to wherever the program runs from.
                values[knob] = str(path.parent / values[knob])
            sources[knob] = str(path)
        else:
            values[knob] = _default_store() if knob == "store" else default
            sources[knob] = "default"
    return Settings(sources=sources, file=str(path) if path else None, **values)


_cache: Dict[Tuple[Any, ...], Settings] = {}


def current() -> Settings:
    """:func:`load_settings` for this process, cached per working directory and environment."""
    key = (os.getcwd(), os.environ.get("CASSTORE_CONFIG"),
           *(os.environ.get(var) for var, _, _ in KNOBS.values()))
    s = _cache.get(key)
    if s is None:
        s = load_settings()
        _cache.clear()
        _cache[key] = s
    return s
