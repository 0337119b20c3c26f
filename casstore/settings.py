"""Runtime settings: the knobs a user changes per run, and where each came from.

Precedence, highest first:

1. environment variables (``CASSTORE_DIR``, ``CASSTORE_COMPRESSION``,
   ``CASSTORE_LOCK_TIMEOUT``, ``CASSTORE_FORCE_DOWNLOAD``, ``CASSTORE_REGENERATE``,
   ``CASSTORE_DURABLE``, ``CASSTORE_LOCK_MODE``, ...: one per :data:`KNOBS` row); an empty variable counts as unset;
2. a settings file: ``$CASSTORE_CONFIG`` if set, else the nearest ``casstore.toml``
   or ``pyproject.toml`` with a ``[tool.casstore]`` table in the current
   directory or a parent, else ``$XDG_CONFIG_HOME/casstore/casstore.toml``;
3. built-in defaults.

A relative ``store`` path in a settings file is relative to that file's
directory (so every subdirectory of a project sees the same store); in
``CASSTORE_DIR`` it is relative to the current directory.

Every source is hostile until checked (docs/security.md).  :data:`KNOBS` is the
one table of knobs: each row names the environment variable, the default and
the :class:`Kind` that checks a value, from a TOML file (the TOML type must be
right: ``durable = "false"`` is a string, not a boolean, and is refused) or
from the environment (text, parsed strictly: ASCII digits only, no ``nan``).
Unknown keys in a settings file are refused (a misspelt knob would otherwise
silently fall back to its default); every value in the file is checked, even
one the environment overrides.  Unknown ``CASSTORE_*`` variables are ignored
(the environment is a namespace shared with other tools).  A bad value raises
:class:`~casstore.errors.InvalidInputError` naming the file or variable, the
key, the value and what is expected; a settings file that cannot be read, is
not a regular file, is larger than :data:`MAX_SETTINGS_BYTES`, is not UTF-8 or
is not TOML raises :class:`~casstore.errors.StoreFormatError`.  Reading never
blocks: a FIFO, a device or a directory is refused before it is opened, and
the file is opened non-blocking and checked again with ``fstat``.  During
discovery a candidate this user may not read is skipped as if absent;
``CASSTORE_CONFIG=/dev/null`` means "no settings file".

``casstore config`` prints the effective values and their sources.  These are
settings of a *run*; settings fixed when a store is created live in the store's
own ``store.toml`` (see :mod:`casstore.config`).
"""

from __future__ import annotations

import errno
import math
import os
import re
import stat
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple, Union

from ._fs import collector_paused
from .errors import InvalidInputError, InvalidTypeError, StoreFormatError

__all__ = [
    "Settings", "load_settings", "current", "KNOBS", "Knob", "Kind", "read_toml_file", "show_value", "toml_type",
    "MAX_SETTINGS_BYTES", "MAX_LOCK_TIMEOUT", "LOCK_MODES",
]

MAX_SETTINGS_BYTES = 1 << 20
"""Largest settings file read (casstore.toml, pyproject.toml): a settings file is a few hundred
bytes; a bigger one is a mistake or an attack (tomllib needs seconds and memory for megabytes)."""

MAX_LOCK_TIMEOUT = 365 * 24 * 3600.0
"""Longest ``lock_timeout`` accepted (a year): finite, so deadline arithmetic cannot overflow."""

_MAX_PATH_BYTES = 4096  # PATH_MAX on Linux: a longer `store` fails at the first syscall anyway
_SHOW_LIMIT = 80  # characters of a value's repr kept in an error message
_COMPRESSION_NAMES = {"raw": "raw", "none": "raw", "off": "raw", "zstd": "zstd", "auto": "zstd", "on": "zstd"}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
# ASCII only: float() and int() also accept other scripts' digits, "nan", "inf" and "1_0".
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_LEVEL = re.compile(r"[0-9]{1,2}")


# -- showing hostile values -----------------------------------------------------------------


def show_value(value: object, limit: int = _SHOW_LIMIT) -> str:
    """``repr(value)`` cut to ``limit`` characters, safe for any value a TOML parser returns.

    ``repr`` of a huge int raises ValueError (the 4300-digit limit; TOML hex
    literals have no such limit) and of a deeply nested array RecursionError;
    an error message must never fail or fill a screen.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<{'negative ' if value < 0 else ''}integer of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters)"
    return text


def toml_type(value: object) -> str:
    """The TOML name of a parsed value's type ("a boolean", "an integer", "a table"...), for messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date/time" if type(value).__module__ == "datetime" else type(value).__name__


def _printable(text: str, limit: int = 200) -> str:
    # A path, key or parser message with a newline or escape would forge lines in the CLI's
    # one-line error (and in logs): such text is shown as a repr.
    return text if text.isprintable() and len(text) <= limit else show_value(text, limit)


def _show_path(path: Union[str, Path]) -> str:
    return _printable(str(path))


# -- reading a settings file without trusting it ---------------------------------------------


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def read_toml_file(path: Path, *, follow_symlinks: bool = True, max_bytes: int = MAX_SETTINGS_BYTES,
                   unreadable_is_missing: bool = False) -> Optional[Dict[str, Any]]:
    """Parse the TOML file at ``path``; ``None`` if it does not exist.

    ``unreadable_is_missing``: also ``None`` if permission is denied (for
    discovery: a file this user cannot read cannot be this user's settings,
    and under another user's 0700 home its existence cannot even be known).

    Raises :class:`~casstore.errors.StoreFormatError` naming the file if it
    exists but is not a regular file (a FIFO would block ``open`` forever, a
    device such as ``/dev/zero`` never ends), is a symbolic link and
    ``follow_symlinks`` is false, is larger than ``max_bytes``, cannot be read,
    is not UTF-8 or is not TOML.  The type is checked with ``stat`` before the
    open (so a device is never opened) and with ``fstat`` after it (the path
    may have been swapped in between; ``O_NONBLOCK`` keeps that open from
    blocking), and at most ``max_bytes + 1`` bytes are read whatever
    ``st_size`` claims.
    """
    shown = _show_path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        st = os.stat(path, follow_symlinks=follow_symlinks)
        if not stat.S_ISREG(st.st_mode):
            raise StoreFormatError(f"settings file {shown} is {_file_kind(st.st_mode)}, not a regular file")
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError:  # an embedded NUL (from $CASSTORE_CONFIG): no such file can exist
        raise StoreFormatError(f"settings file path {shown} contains a NUL character") from None
    except PermissionError as e:
        if unreadable_is_missing:
            return None
        raise StoreFormatError(f"cannot read settings file {shown}: {e.strerror or e}") from None
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise StoreFormatError(
                f"settings file {shown} is a symbolic link (refused: it may point anywhere)") from None
        raise StoreFormatError(f"cannot read settings file {shown}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
            raise StoreFormatError(f"settings file {shown} is {_file_kind(st.st_mode)}, not a regular file")
        chunks: List[bytes] = []
        got = 0
        while got <= max_bytes:  # st_size may lie (procfs) or the file may grow: count what is read
            chunk = os.read(fd, max_bytes + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise StoreFormatError(f"cannot read settings file {shown}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if got > max_bytes:
        raise StoreFormatError(f"settings file {shown} is larger than {max_bytes} bytes; refused")
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise StoreFormatError(
            f"settings file {shown} is not UTF-8 (byte {raw[e.start]:#04x} at offset {e.start})") from None
    try:
        # Hazard (a CI run): a hostile document drives tomllib near the recursion limit, and a cyclic
        # collection that starts there runs the process's weakref finalizers (an index cache's release,
        # a temporary directory's cleanup) at that depth, where they fail with RecursionError and are
        # lost.  No collection while a document is parsed.
        with collector_paused():
            return tomllib.loads(text)
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise StoreFormatError(f"settings file {shown} is not valid TOML: nested too deeply") from None
    except ValueError as e:  # TOMLDecodeError, and int() refusing a literal of more than 4300 digits
        raise StoreFormatError(f"settings file {shown} is not valid TOML: {_printable(str(e))}") from None


# -- the knobs --------------------------------------------------------------------------------


class _Refused(Exception):
    """A value failed a knob's check; the argument (may be empty) says why beyond the expectation."""


@dataclass(frozen=True, slots=True)
class Kind:
    """How one knob's value is checked, from a TOML file and from an environment variable.

    ``from_toml`` receives whatever the TOML parser returned and must insist on
    the TOML type; ``from_env`` receives the variable's text.  Both return the
    effective value or raise; ``in_file`` / ``in_env`` say what each accepts
    and are quoted in every error message.
    ``relative_to_file``: a relative path from a file is taken relative to it.
    """

    name: str
    in_file: str
    in_env: str
    from_toml: Callable[[object], object]
    from_env: Callable[[str], object]
    relative_to_file: bool = False


class Knob(NamedTuple):
    """One row of :data:`KNOBS`: environment variable, default (a callable is called) and :class:`Kind`."""

    env: str
    default: object
    kind: Kind


def _bool_toml(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise _Refused()


def _bool_env(text: str) -> bool:
    v = text.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _Refused()


_MAX_STEPS = 1000  # names in a regenerate / force_download list: a real job names a handful
_MAX_STEP = 4096  # characters of one name, URL or pattern


def _step(item: object, urls: bool) -> str:
    if not isinstance(item, str) or not item or len(item) > _MAX_STEP or not item.isprintable() \
            or item != item.strip():
        raise _Refused("each item must be a non-empty printable string without surrounding spaces")
    if urls and "://" not in item and not item.startswith("_fetch/"):
        raise _Refused(f"{show_value(item)} is neither a URL nor a fetch record name (_fetch/...)")
    return item


def _steps(items: List[object], urls: bool) -> Union[bool, Tuple[str, ...]]:
    if len(items) > _MAX_STEPS:
        raise _Refused(f"more than {_MAX_STEPS} items")
    names = tuple(dict.fromkeys(_step(i, urls) for i in items))  # order kept, duplicates dropped
    return names or False  # an empty list: nothing is forced


def _steps_toml(urls: bool) -> Callable[[object], object]:
    def check(value: object) -> Union[bool, Tuple[str, ...]]:
        if isinstance(value, bool):
            return value
        if not isinstance(value, list):
            raise _Refused()
        return _steps(value, urls)
    return check


def _steps_env(urls: bool) -> Callable[[str], object]:
    def check(text: str) -> Union[bool, Tuple[str, ...]]:
        v = text.strip()
        if v.lower() in _TRUE:
            return True
        if v.lower() in _FALSE:
            return False
        items: List[object] = [i.strip() for i in v.split(",") if i.strip()]
        import difflib  # (only here: 1.4 ms of every CLI start otherwise)

        for i in items:
            near = difflib.get_close_matches(str(i).lower(), sorted(_TRUE | _FALSE), n=1, cutoff=0.75)
            if near:  # "ture", "flase": a misspelt boolean must not become a step name that matches nothing
                raise _Refused(f"{show_value(i)} looks like a misspelt boolean ({near[0]!r}?)")
        return _steps(items, urls)
    return check


def _seconds(value: Union[int, float]) -> float:
    if isinstance(value, float) and not math.isfinite(value):  # NaN: a lock wait that never times out
        raise _Refused("not finite")
    # Compare before float(): float() of a huge int raises OverflowError.
    if not 0 <= value <= MAX_LOCK_TIMEOUT:
        raise _Refused("out of range")
    return float(value)


def _seconds_toml(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):  # True == 1: not a number of seconds
        raise _Refused()
    return _seconds(value)


def _seconds_env(text: str) -> float:
    v = text.strip()
    if not _DECIMAL.fullmatch(v):
        raise _Refused()
    return _seconds(float(v))  # "1e999" is inf here, refused as not finite


MAX_BYTES_SETTING = 1 << 62  # any real size fits; a typo of 20 digits does not


def _bytes_toml(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_BYTES_SETTING:
        raise _Refused()
    return value


def _bytes_env(text: str) -> int:
    v = text.strip()
    if not re.fullmatch(r"[0-9]{1,19}", v) or not 0 < int(v) <= MAX_BYTES_SETTING:
        raise _Refused()
    return int(v)


def _compression_name(text: str) -> str:
    name = _COMPRESSION_NAMES.get(text.lower())
    if name is None:
        raise _Refused()
    return name


def _level(level: int) -> str:
    if not 1 <= level <= 22:
        raise _Refused("zstd levels are 1-22")
    return str(level)


def _compression_toml(value: object) -> str:
    if isinstance(value, bool):  # compression = true / false, as compress=True/False in the API
        return "zstd" if value else "raw"
    if isinstance(value, int):
        return _level(value)
    if isinstance(value, str):
        return _compression_name(value)
    raise _Refused()


def _compression_env(text: str) -> str:
    v = text.strip()
    return _level(int(v)) if _LEVEL.fullmatch(v) else _compression_name(v)


def _store_path(text: str) -> str:
    if not text:
        raise _Refused("empty")
    if "\0" in text:
        raise _Refused("contains a NUL character")
    try:
        size = len(os.fsencode(text))
    except UnicodeEncodeError:  # a lone surrogate that is not a surrogateescape'd byte
        raise _Refused("not encodable as a file name") from None
    if size > _MAX_PATH_BYTES:
        raise _Refused(f"longer than {_MAX_PATH_BYTES} bytes")
    try:
        return str(Path(text).expanduser())
    except RuntimeError:  # "~" with no $HOME and no passwd entry
        raise _Refused("cannot expand '~': no home directory") from None


def _store_toml(value: object) -> str:
    if not isinstance(value, str):
        raise _Refused()
    return _store_path(value)


def _default_store() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME")
    try:
        base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: ignore relative
    except RuntimeError:
        raise InvalidInputError("no home directory for the default store; set CASSTORE_DIR") from None
    return str(base / "casstore")


_BOOL = Kind("bool", "a boolean (true or false, unquoted)", "1, true, yes, on, 0, false, no or off",
             _bool_toml, _bool_env)
_SECONDS = Kind("seconds", f"a number of seconds from 0 to {MAX_LOCK_TIMEOUT:.0f} (unquoted)",
                f"a decimal number of seconds from 0 to {MAX_LOCK_TIMEOUT:.0f}", _seconds_toml, _seconds_env)
_COMPRESSION = Kind("compression", '"raw", "zstd" (or "none"/"off", "auto"/"on"), true/false or an integer zstd '
                    "level 1-22", "raw, zstd (or none/off, auto/on) or a zstd level 1-22",
                    _compression_toml, _compression_env)
_BYTES = Kind("bytes", f"a whole number of bytes from 1 to {MAX_BYTES_SETTING} (unquoted)",
              f"ASCII digits: a number of bytes from 1 to {MAX_BYTES_SETTING}", _bytes_toml, _bytes_env)
_STEPS = Kind("steps", "a boolean, or an array of derive names (shell-style patterns: \"qm9/*\")",
               "1, true, yes, on, 0, false, no, off, or derive names separated by commas",
               _steps_toml(False), _steps_env(False))
_URLS = Kind("urls", "a boolean, or an array of URLs or fetch record names (_fetch/...; patterns allowed)",
             "1, true, yes, on, 0, false, no, off, or URLs / fetch record names separated by commas",
             _steps_toml(True), _steps_env(True))
LOCK_MODES = ("auto", "flock", "posix", "lease")
"""``lock_mode`` values; ``none`` is accepted as another spelling of ``lease`` (no kernel locks)."""


def _lock_mode_env(text: str) -> str:
    v = text.strip().lower()
    v = "lease" if v == "none" else v
    if v not in LOCK_MODES:
        raise _Refused()
    return v


def _lock_mode_toml(value: object) -> str:
    if not isinstance(value, str):
        raise _Refused()
    return _lock_mode_env(value)


_LOCK_MODE = Kind("lock_mode", '"auto" (probe the filesystem), "flock", "posix" (OFD fcntl locks) or "lease" '
                  '(alias "none": exclusive-create lease files, no kernel locks)',
                  "auto, flock, posix, lease or none", _lock_mode_toml, _lock_mode_env)
_PATH = Kind("path", "a non-empty directory path string", "a non-empty directory path",
             _store_toml, _store_path, relative_to_file=True)

KNOBS: Mapping[str, Knob] = MappingProxyType({
    "store": Knob("CASSTORE_DIR", _default_store, _PATH),
    "compression": Knob("CASSTORE_COMPRESSION", None, _COMPRESSION),
    "lock_timeout": Knob("CASSTORE_LOCK_TIMEOUT", 600.0, _SECONDS),
    "force_download": Knob("CASSTORE_FORCE_DOWNLOAD", False, _URLS),
    "regenerate": Knob("CASSTORE_REGENERATE", False, _STEPS),
    "durable": Knob("CASSTORE_DURABLE", None, _BOOL),
    "fetch_max_bytes": Knob("CASSTORE_FETCH_MAX_BYTES", 64 << 30, _BYTES),
    "fetch_deadline": Knob("CASSTORE_FETCH_DEADLINE", 24 * 3600.0, _SECONDS),
    "lock_mode": Knob("CASSTORE_LOCK_MODE", "auto", _LOCK_MODE),
})
"""knob -> :class:`Knob` (environment variable, default, :class:`Kind`): the one source of truth."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Effective runtime settings; ``sources[knob]`` says where each value came from."""

    store: str
    compression: Optional[str]
    lock_timeout: float
    """Seconds a fetch/derive waiter waits on a holder that shows no sign of life (docs/pipelines.md)."""
    force_download: Union[bool, Tuple[str, ...]]
    """Download again, once per job: every URL (True), or the URLs / fetch names (patterns) listed."""
    regenerate: Union[bool, Tuple[str, ...]]
    """Run derive steps again, once per job: all (True), or the derive names (patterns) listed."""
    durable: Optional[bool]
    fetch_max_bytes: int
    """Largest download ``fetch`` accepts when the server announces no size and no checksum names one."""
    fetch_deadline: float
    """Seconds a whole ``fetch`` may take (besides the per-read timeout)."""
    lock_mode: str = "auto"
    """How casstore locks (docs/filesystems.md): ``auto`` probes each filesystem once; ``flock``,
    ``posix`` or ``lease`` force a choice where the probe cannot tell (locks local to each host)."""
    sources: Mapping[str, str] = field(default_factory=dict)
    file: Optional[str] = None


def _refuse(where: str, key: str, value: object, expected: str, why: str, *, in_file: bool) -> InvalidInputError:
    got = show_value(value)
    if in_file:  # the TOML type is half of what is wrong with `durable = "false"`
        got += f" ({toml_type(value)})"
    return InvalidInputError(f"{where}: bad value for {key}: {got}; expected {expected}"
                             + (f" ({why})" if why else ""))


# -- finding the file -------------------------------------------------------------------------


def _table_of(path: Path, doc: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """The casstore table of a parsed settings file (None: a pyproject without one) and its key prefix."""
    shown = _show_path(path)
    if path.name == "pyproject.toml":
        tool = doc.get("tool")
        if tool is None:
            return None, ""
        if not isinstance(tool, dict):
            raise StoreFormatError(f"settings file {shown}: 'tool' = {show_value(tool)} is not a table")
        table, prefix = tool.get("casstore"), "tool.casstore."
        if table is None:
            return None, ""
    elif "casstore" in doc:
        table, prefix = doc["casstore"], "casstore."
        others = sorted(set(doc) - {"casstore"})
        if others:
            raise InvalidInputError(
                f"settings file {shown}: keys {show_value(others)} outside the [casstore] table; "
                "put every setting in the table, or use no table at all")
    else:
        table, prefix = doc, ""
    if not isinstance(table, dict):
        raise StoreFormatError(
            f"settings file {shown}: {prefix.rstrip('.') or 'casstore'} = {show_value(table)} "
            f"({toml_type(table)}): the casstore settings must be a table")
    unknown = [k for k in table if k not in KNOBS]
    if unknown:
        key = unknown[0]
        import difflib  # (only for this message)

        near = difflib.get_close_matches(key, list(KNOBS), n=1)
        raise InvalidInputError(
            f"settings file {shown}: unknown setting {prefix}{_printable(key, _SHOW_LIMIT)} = {show_value(table[key])}"
            + (f"; did you mean {near[0]!r}?" if near else "")
            + f" (known: {', '.join(KNOBS)}; unknown keys are refused so a misspelt one is not ignored)")
    return table, prefix


def _cwd() -> Optional[str]:
    """The working directory, or ``None`` if it was deleted (found by a bug hunt: ``os.getcwd()`` raised
    FileNotFoundError and every command, reads included, ended "failed unexpectedly")."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        return None


def _find_file(cwd: Optional[Path], env: Mapping[str, str]) -> Tuple[Optional[Path], Dict[str, Any], str]:
    explicit = env.get("CASSTORE_CONFIG")
    candidates: List[Path] = []
    if explicit == os.devnull:  # the way to say "no settings file" (a device is otherwise refused)
        return None, {}, ""
    if explicit:
        try:
            candidates.append(Path(explicit).expanduser())
        except RuntimeError:  # "~" with no home directory
            candidates.append(Path(explicit))
    else:
        for d in (cwd, *cwd.parents) if cwd is not None else ():  # (no working directory: no project file)
            candidates.append(d / "casstore.toml")
            candidates.append(d / "pyproject.toml")
        xdg = env.get("XDG_CONFIG_HOME")
        if xdg and os.path.isabs(xdg):  # the XDG spec: a relative path is invalid and ignored
            candidates.append(Path(xdg) / "casstore" / "casstore.toml")
        else:
            try:
                candidates.append(Path.home() / ".config" / "casstore" / "casstore.toml")
            except RuntimeError:  # no home directory: no user settings file
                pass
    for p in candidates:
        doc = read_toml_file(p, unreadable_is_missing=not explicit)
        if doc is None:
            if explicit:
                raise StoreFormatError(f"CASSTORE_CONFIG={_show_path(explicit)}: no such settings file")
            continue
        table, prefix = _table_of(p, doc)
        if table is None:
            continue
        return p, table, prefix
    return None, {}, ""


def load_settings(cwd: Optional[Union[str, os.PathLike[str]]] = None,
                  env: Optional[Mapping[str, str]] = None) -> Settings:
    """Read the settings as they apply now (see the module docstring for precedence and checks)."""
    if cwd is not None and not isinstance(cwd, (str, os.PathLike)):
        raise InvalidTypeError(f"load_settings(cwd=...) takes a path, not {type(cwd).__name__}")
    env = os.environ if env is None else env
    where = _cwd() if cwd is None else os.fspath(cwd)
    here = Path(where).absolute() if where is not None else None
    path, table, prefix = _find_file(here, env)
    # Every value in the file is checked, even one the environment overrides: whether a
    # settings file is valid must not depend on the environment it happens to be read in.
    in_file: Dict[str, Any] = {}
    if path is not None:
        for knob, value in table.items():  # _table_of refused unknown keys
            kind = KNOBS[knob].kind
            try:
                in_file[knob] = kind.from_toml(value)
            except _Refused as e:
                raise _refuse(f"settings file {_show_path(path)}", prefix + knob, value, kind.in_file, str(e),
                              in_file=True) from None
            if kind.relative_to_file and not Path(in_file[knob]).is_absolute():
                # Relative to the settings file, not to wherever the program runs from.
                in_file[knob] = str(path.absolute().parent / in_file[knob])
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    for knob, (var, default, kind) in KNOBS.items():
        text = env.get(var)
        if text:  # an empty variable counts as unset
            try:
                values[knob] = kind.from_env(text)
            except _Refused as e:
                raise _refuse(f"environment variable {var}", knob, text, kind.in_env, str(e), in_file=False) from None
            sources[knob] = f"env {var}"
        elif knob in in_file:
            values[knob] = in_file[knob]
            sources[knob] = str(path)
        else:
            values[knob] = default() if callable(default) else default
            sources[knob] = "default"
    return Settings(sources=sources, file=str(path) if path else None, **values)


_cache: Dict[Tuple[Optional[str], ...], Settings] = {}


def current() -> Settings:
    """:func:`load_settings` for this process, cached per working directory and environment."""
    key = (_cwd(), os.environ.get("CASSTORE_CONFIG"), *(os.environ.get(k.env) for k in KNOBS.values()))
    s = _cache.get(key)
    if s is None:
        s = load_settings()
        _cache.clear()
        _cache[key] = s
    return s
