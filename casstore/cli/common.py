"""What every command module shares: opening the store, argument types, JSON and help output.

Command modules import from here and from the ``casstore`` package, never from
each other.  Argument types raise :class:`argparse.ArgumentTypeError`, so a bad
value is an argparse usage error (exit 2, one line naming the option), never a
traceback from deep inside the store.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Mapping, Optional, Tuple, Union

from .._fs import path_exists
from .._layout import CONFIG_FILE
from ..digest import Digest
from ..errors import (
    AmbiguousDigestError,
    InvalidDigestError,
    InvalidInputError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    StoreFormatError,
)
from ..store import Store, open_store

__all__ = [
    "cli_words",
    "printable",
    "print_json",
    "Command",
    "Add",
    "Action",
    "default_store_dir",
    "open_from_args",
    "add_global_options",
    "Parser",
    "UnusedParser",
    "resolve_digest",
    "JSON_HELP",
    "add_actions",
    "compress_arg",
    "count_arg",
    "workers_arg",
    "seconds_arg",
    "jsonable",
    "print_help",
]

Command = Callable[[argparse.Namespace], int]
"""A subcommand: parsed arguments in, exit code out."""

Add = Callable[[str, Optional[Command], str], argparse.ArgumentParser]
"""``add(name, fn, help)``: register a top-level subcommand (given to each module's ``register``).

``fn=None`` for a command made of actions (see :func:`add_actions`): alone, it prints its help.
"""

Action = Callable[[str, Command, str], argparse.ArgumentParser]
"""``action(name, fn, help)``: register an action of a command (returned by :func:`add_actions`)."""


def default_store_dir() -> Path:
    """The runtime setting ``store``: ``$CASSTORE_DIR``, a settings file, or ``~/.cache/casstore``."""
    from ..settings import current

    return Path(current().store).expanduser()


class Parser(argparse.ArgumentParser):
    """The ``casstore`` parser class (subcommand parsers inherit it): argparse plus a public walk.

    ``walk`` serves the help/``--json`` checks and the fish completions, which
    would otherwise read argparse internals from outside.
    """

    def options(self) -> List[argparse.Action]:
        """This parser's own arguments and options (not its subcommands')."""
        return [a for a in self._actions if not isinstance(a.choices, dict)]

    def subcommands(self) -> List[Tuple[str, Parser]]:
        """``(name, parser)`` of each direct subcommand or action, in registration order."""
        out: List[Tuple[str, Parser]] = []
        for a in self._actions:
            if isinstance(a.choices, dict):  # the subparsers action maps names to parsers
                out.extend((n, sp) for n, sp in a.choices.items() if isinstance(sp, Parser))
        return out

    def walk(self, path: Tuple[str, ...] = ()) -> Iterator[Tuple[Tuple[str, ...], Parser]]:
        """``(command path, parser)`` for this parser and every subcommand below it, depth first."""
        yield path, self
        for name, sp in self.subcommands():
            yield from sp.walk(path + (name,))


class UnusedParser(Parser):
    """Stands in for the parser of a command that is not being run: takes every call, builds nothing.

    Hazard: argparse builds ~40 parsers and ~270 arguments in ~10 ms, a tenth of a whole
    ``casstore status``; only the command on the command line needs its own.
    """

    def __init__(self) -> None:  # no argparse state at all (nothing reads it)
        pass

    def add_argument(self, *args: object, **kwargs: object) -> argparse.Action:
        return _UNUSED_ACTION

    def add_subparsers(self, *args: object, **kwargs: object) -> UnusedParser:  # type: ignore[override]
        return self

    def add_parser(self, *args: object, **kwargs: object) -> UnusedParser:
        """(the subparsers action's method: nested actions of an unused command are unused too)"""
        return self

    def set_defaults(self, *args: object, **kwargs: object) -> None:
        return None

    def add_mutually_exclusive_group(self, *args: object, **kwargs: object) -> UnusedParser:  # type: ignore[override]
        return self

    def add_argument_group(self, *args: object, **kwargs: object) -> UnusedParser:  # type: ignore[override]
        return self


_UNUSED_ACTION = argparse.Action(["--unused"], "unused")


JSON_HELP = "print one JSON document on stdout (nothing else on stdout)"
"""The help text of every command's ``--json``."""


def open_from_args(args: argparse.Namespace) -> Store:
    """The store chosen by ``--store``, else the ``store`` setting.

    Only the per-user default (``$CASSTORE_DIR`` or the settings' ``store``) is
    created on first use, by any command (README: a new user's first ``casstore ls``
    lists an empty store; it failed with "not a casstore store", found by a bug hunt):
    an explicit ``--store`` that is not a store is refused with a hint, so a typo
    (``--store /data/sotre``) never silently starts a new, empty store beside the real one.
    """
    given: Optional[str] = getattr(args, "store", None)
    if given == "":
        # Hazard: `--store "$UNSET"` used (and made) the default store, not the one meant.
        raise InvalidInputError("--store is empty (an unset variable?): give the store's directory, "
                                "or leave --store out to use the default store")
    if given:
        root = Path(given).expanduser()
        if not path_exists(root / CONFIG_FILE):
            raise StoreFormatError(f"--store {args.store}: no casstore store there; create one with "
                                   f"`casstore init {args.store}` (or omit --store to use the default store)")
        return open_store(root, create=False)
    return open_store(default_store_dir(), create=True)


def add_global_options(parser: argparse.ArgumentParser) -> None:
    """``--store`` and ``--debug`` on a subcommand too, so they may follow it (``casstore ls --store DIR``).

    ``SUPPRESS``: when not given after the subcommand, the value given before it
    (or the top-level default) stays.
    """
    parser.add_argument("--store", metavar="DIR", default=argparse.SUPPRESS,
                        help="store directory (also accepted before the command)")
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks on errors (also accepted before the command)")


def resolve_digest(store: Store, value: str) -> Digest:
    """An object: a digest or unique prefix, or ``TARGET:KEY`` (the entry ``KEY`` of a manifest version).

    ``TARGET`` is anything ``casstore manifest show`` takes (``NAME``, ``NAME~N``,
    ``NAME@HEXPREFIX``, a version digest).  A value that is a digest or prefix is one
    (so ``blake3:9f2c`` is never read as name ``blake3``).  A value that names a file (or
    looks like a path) says so: "malformed digest" would mislead a user who typed
    ``casstore get model.bin``.
    """
    if not value:  # ("" would be read as the file ".")
        raise InvalidInputError("an empty OBJECT: give a digest, a unique digest prefix or NAME:KEY")
    try:
        return store.resolve(value)
    except InvalidDigestError as e:
        if isinstance(e, AmbiguousDigestError):
            raise  # a prefix of several objects: it was meant as a digest
        got, why = _entry_digest(store, value)
        if got is not None:
            return got
        try:
            is_file = Path(value).exists()
        except OSError:  # a name longer than NAME_MAX (and the like) names no file: not "failed unexpectedly"
            is_file = False
        if why is not None and not is_file and not _digest_shaped(value):
            raise why from None  # TARGET:KEY whose version is not there: say which and why
        looks_like_path = "/" in value or "." in value.replace("blake3:", "", 1) or is_file
        if not looks_like_path:
            raise
        if is_file:
            raise ObjectNotFoundError(f"{value!r} is a file, not a digest; store it with `casstore put {value}` "
                                      "and use the digest that prints") from None
        raise ObjectNotFoundError(f"{value!r} is not a digest or digest prefix (and no such file exists); "
                                  "name a file of a version as NAME:KEY, or list objects with "
                                  "`casstore ls --objects`") from None


def _digest_shaped(value: str) -> bool:
    """``ALGO:HEX`` (``sha256:00ff...``): meant as a digest, so a digest error beats "no such name"."""
    algo, _, rest = value.partition(":")
    return algo.isalnum() and rest != "" and all(c in "0123456789abcdefABCDEF" for c in rest)


def _entry_digest(store: Store, value: str) -> Tuple[Optional[Digest], Optional[Exception]]:
    """``TARGET:KEY`` -> (the digest of ``KEY`` in that version, None); with no ``:`` splitting off an
    existing version, (None, why the first split's version was not found), or (None, None) without ``:``.

    Names never hold ``:`` (it is reserved for digests), so the only colons before the key are a
    digest's own (``blake3:HEX:KEY``, ``NAME@blake3:HEX:KEY``): the splits are tried left to right
    and the first that names a version is the one (a leading ``blake3:`` is never a split).  Only
    "no such version" and "not a valid name" move on to the next split; a damaged version, or an
    object that is not a manifest, is an error here as anywhere.  Keys may hold ``:``; a key is only
    looked up, never joined to a path.
    """
    first: Optional[Exception] = None
    # A leading "blake3:" is a version digest's, never a name "blake3" (a digest is always a digest).
    i = value.find(":", len("blake3:") if value.startswith("blake3:") else 0)
    # A TARGET holds at most one colon (NAME@blake3:HEX), so only the first two splits can name a
    # version: a hostile argument of 100,000 colons costs two lookups, not 100,000.
    for _ in range(2):
        if i == -1:
            break
        target, key = value[:i], value[i + 1:]
        if target and key:
            try:
                m = store.manifest(target)
            except (ManifestNotFoundError, InvalidInputError, InvalidDigestError) as e:
                first = first or e
            else:
                entry = m.get(key)
                if entry is None:
                    raise ObjectNotFoundError(f"version {target!r} has no key {key!r}; list its keys with "
                                              f"`casstore manifest show {target}`")
                return entry.digest, None
        i = value.find(":", i + 1)
    return None, first


def add_actions(parent: argparse.ArgumentParser, command: str, dest: str) -> Action:
    """Actions of ``command`` (``casstore manifest show``): returns ``action(name, fn, help)``.

    Each action records its full name (``"manifest show"``) as ``args.command_name``,
    which error lines name.
    """
    sub = parent.add_subparsers(dest=dest, metavar="ACTION")

    def action(name: str, fn: Command, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        add_global_options(p)
        p.set_defaults(func=fn, command_name=f"{command} {name}")
        return p

    return action


def compress_arg(value: str) -> Union[int, str]:
    """``--compress``: a zstd level given as digits becomes an int (``"5"`` -> 5); names go to the store."""
    return int(value) if value.strip().isdigit() else value


def _whole_number(value: str, minimum: int) -> int:
    try:
        n = int(value)
    except ValueError:
        n = minimum - 1
    if n < minimum:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {value!r}")
    return n


def count_arg(value: str) -> int:
    """A whole number >= 0 (``--keep-history``, ``--limit``)."""
    return _whole_number(value, 0)


def workers_arg(value: str) -> int:
    """A whole number >= 1 (``--workers``)."""
    return _whole_number(value, 1)


def seconds_arg(value: str) -> float:
    """A finite number of seconds >= 0 (``--timeout``); ``nan`` and ``inf`` are refused."""
    try:
        s = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {value!r}") from None
    if not math.isfinite(s) or s < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {value!r}")
    return s


def printable(text: str) -> str:
    """``text`` as it may reach a terminal: itself, or its ``repr`` when it holds control characters.

    Hazard: file names, keys and metadata come from disk and other users; printed raw, an escape
    sequence rewrote the terminal and a newline forged a line of output ("deleted   a").
    """
    return text if text.isprintable() and text else repr(text)


def jsonable(value: object) -> object:
    """``value`` with bytes as hex, tuples as lists, recursively (manifest metadata for ``--json``); a NaN
    or infinite float as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``.

    Hazard (found by a bug hunt): metadata may hold them (the API keeps floats exactly), and
    ``json.dumps`` wrote ``NaN`` / ``Infinity``, which are not JSON: strict parsers (Python's with
    ``parse_constant``, JavaScript's ``JSON.parse``) refused the whole document.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {k: jsonable(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(x) for x in value]
    return value


def print_json(doc: object) -> None:
    """Print ``doc`` as one JSON document on stdout (``json`` is imported here, on use: ``add`` and
    ``status`` print it only with ``--json``, and every start of them paid for it)."""
    import json

    print(json.dumps(doc))


def print_help(parser: argparse.ArgumentParser) -> int:
    """Print ``parser``'s help on stderr; return 2 (a command given without its action)."""
    parser.print_help(sys.stderr)
    return 2


# The library's messages name its Python API (a caller of store.checkout needs ``overwrite=True``); on
# the command line the same hint must name the flag.  Found by bug hunts: "pass overwrite=True", "Use
# link='copy'", "pass replace=True", "pull it (store.pull(remote, 'n') merges)", "lower keep_history".
# One table, applied to every error the CLI prints (cli/app.py) and to checkout's warnings; compiled on
# first use (22 patterns: ~3 ms of every command's start, for the few that print an error).
_CLI_WORDS: Tuple[Tuple[str, str], ...] = (
    (r"\boverwrite=True\b", "--overwrite"),
    (r"\bforce=True\b", "--force"),
    (r"\bsync=True\b", "--sync"),
    (r"\breplace=True\b", "--replace"),
    (r"\blink='([a-z]+)'", r"--link \1"),
    (r"\bmerge='(ours|theirs)' or merge='(ours|theirs)'", r"--merge \1 or --merge \2"),
    (r"\bpull with merge=True \(or 'ours'/'theirs'\)",
     "pull without --no-merge (or with --merge ours|theirs)"),
    (r"\bstore\.push\(remote, '([^']*)', --force\)", r"`casstore push REMOTE \1 --force`"),
    (r"\bstore\.pull\(remote, '([^']*)'\)", r"`casstore pull REMOTE \1`"),
    (r"\bkeep_history\b", "--keep-history"),
    (r"\bmax_bytes\b", "--max-size"),
    (r"\b(sha256|md5)='", r"--\1 '"),
    (r"\bstore\.freeze\('([^']*)'\)", r"`casstore freeze \1`"),
    (r"\bstore\.edit\('([^']*)'\)", r"`casstore add \1 DIR` or `casstore manifest set \1 KEY FILE`"),
    (r"\bstore\.pin\('([^']*)', '([^']*)'\)", r"`casstore pin \1 \2`"),
    (r"or pin with allow_missing=True if it lives on a remote", "or pull it from the remote that holds it"),
    (r"\blink=reflink raises here", "--link reflink fails here"),
    (r"; use 1-22, True/False or 'zstd'/'raw'", "; use raw, zstd or a level 1-22"),
    (r"\(put_path stores a file\)", "(`casstore put` stores a file)"),
    (r"\bput_path stores one regular file", "put stores regular files"),
    (r" or casstore\.open\(path\)", ""),
)


# Names that are a flag on the command line but a key in a settings file: reworded only where the
# message is not about the file (a remotes.toml error must name the key to fix).
_FLAG_OR_KEY = r"\bendpoint_url\b"


def cli_words(text: str) -> str:
    """A library message with its Python-API hints in CLI words (``overwrite=True`` -> ``--overwrite``)."""
    for pattern, words in _CLI_WORDS:
        text = re.sub(pattern, words, text)  # (re caches what it compiles)
    if ".toml" not in text:
        text = re.sub(_FLAG_OR_KEY, "--endpoint-url", text)
    return text
