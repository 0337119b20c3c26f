"""What every command module shares: opening the store, argument types, JSON and help output.

Command modules import from here and from the ``casstore`` package, never from
each other.  Argument types raise :class:`argparse.ArgumentTypeError`, so a bad
value is an argparse usage error (exit 2, one line naming the option), never a
traceback from deep inside the store.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

from ..store import Store, open_store

__all__ = [
    "Command",
    "Add",
    "Action",
    "default_store_dir",
    "open_from_args",
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


def open_from_args(args: argparse.Namespace, *, create: bool = True) -> Store:
    """The store chosen by ``--store``, else the ``store`` setting (``create=False``: never make one)."""
    root = Path(args.store).expanduser() if args.store else default_store_dir()
    return open_store(root, create=create)


def add_actions(parent: argparse.ArgumentParser, command: str, dest: str) -> Action:
    """Actions of ``command`` (``casstore manifest show``): returns ``action(name, fn, help)``.

    Each action records its full name (``"manifest show"``) as ``args.command_name``,
    which error lines name.
    """
    sub = parent.add_subparsers(dest=dest, metavar="ACTION")

    def action(name: str, fn: Command, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
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


def jsonable(value: object) -> object:
    """``value`` with bytes as hex, tuples as lists, recursively (manifest metadata for ``--json``)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, Mapping):
        return {k: jsonable(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(x) for x in value]
    return value


def print_help(parser: argparse.ArgumentParser) -> int:
    """Print ``parser``'s help on stderr; return 2 (a command given without its action)."""
    parser.print_help(sys.stderr)
    return 2
