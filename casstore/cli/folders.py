"""Folder commands: ``casstore add NAME DIR`` and ``casstore status NAME DIR`` (docs/folders.md).

Both go through the :class:`~casstore.Store` facade.  Errors name CLI flags
(``--exclude``), not the library's keywords.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Dict, Iterator, List, Tuple

from ..errors import FileChangedError, FrozenError, InvalidInputError
from ..folders import Skipped
from .common import Add, open_from_args, print_json, printable

__all__ = ["register"]


def meta_arg(value: str) -> Tuple[str, str]:
    """``--meta KEY=VALUE`` (VALUE is kept as text)."""
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, val


def _cli_hint(e: Exception) -> str:
    return str(e).replace("exclude=[...]", "--exclude GLOB")


def _skipped_docs(skipped: Tuple[Skipped, ...]) -> List[Dict[str, str]]:
    return [{"path": s.path, "reason": s.reason} for s in skipped]


class _PrintedSkips(logging.Filter):
    """Drops the library's per-file "skipped" warnings while a command that prints them itself runs
    (found by a bug hunt: each skipped file was reported twice on a terminal)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: skipped %s: %s")


@contextlib.contextmanager
def _skips_printed_here() -> Iterator[None]:
    quiet = _PrintedSkips()
    folders_log = logging.getLogger("casstore.folders")
    folders_log.addFilter(quiet)
    try:
        yield
    finally:
        folders_log.removeFilter(quiet)


def cmd_add(args: argparse.Namespace) -> int:
    """``casstore add NAME DIR [-m MSG] [--meta k=v ...] [--exclude GLOB ...] [--json]``."""
    store = open_from_args(args)
    meta = dict(args.meta) if args.meta else None
    try:
        with _skips_printed_here():
            r = store.add(args.name, args.dir, message=args.message, meta=meta, exclude=args.exclude,
                          progress=None if not args.json else False)
    except InvalidInputError as e:
        raise InvalidInputError(_cli_hint(e)) from None
    except FileChangedError as e:
        raise FileChangedError(_cli_hint(e)) from None
    except FrozenError:
        raise FrozenError(f"{args.name!r} is frozen (a pin) and can never change; add to a new name, "
                          f"e.g. casstore add {args.name}-v2 {args.dir}") from None
    if args.json:
        print_json({"name": args.name, "version": str(r.digest), "created": r.created, "files": len(r.manifest),
                    "added": list(r.added), "modified": list(r.modified), "deleted": list(r.deleted),
                    "skipped": _skipped_docs(r.skipped), "hashed": r.hashed, "hashed_bytes": r.hashed_bytes})
        return 0
    if r.created:
        print(f"{args.name} -> {r.digest}  ({len(r.manifest)} files: {len(r.added)} added, "
              f"{len(r.modified)} modified, {len(r.deleted)} deleted)")
    else:
        print(f"{args.name} unchanged at {r.digest}  ({len(r.manifest)} files; no new version)")
    for s in r.skipped:
        print(f"skipped {printable(s.path)}: {s.reason}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """``casstore status NAME DIR [--version NAME~N] [--exclude GLOB ...] [--json]``."""
    store = open_from_args(args)
    try:
        with _skips_printed_here():
            st = store.status(args.name, args.dir, version=args.version, exclude=args.exclude,
                              progress=None if not args.json else False)
    except InvalidInputError as e:
        raise InvalidInputError(_cli_hint(e)) from None
    if args.json:
        print_json({"name": args.name, "version": str(st.version) if st.version else None,
                    "added": list(st.added), "modified": list(st.modified), "deleted": list(st.deleted),
                    "unchanged": len(st.unchanged), "skipped": _skipped_docs(st.skipped)})
        return 0
    for label, keys in (("added", st.added), ("modified", st.modified), ("deleted", st.deleted)):
        for k in keys:
            print(f"{label:9} {printable(k)}")
    for s in st.skipped:
        print(f"skipped   {printable(s.path)}: {s.reason}")
    if not st:
        print(f"clean: {len(st.unchanged)} file(s) unchanged")
    elif st.version is None and not args.version:
        # (found by a bug hunt: a mistyped name listed every file as "added", silently)
        print(f"casstore: note: no head or pin named {printable(args.name)!r} yet, so every file is new "
              "(`casstore ls` lists the names)", file=sys.stderr)
    return 0


def register(add: Add) -> None:
    """Add ``add`` and ``status`` to the ``casstore`` parser."""
    sp = add("add", cmd_add, "snapshot folder DIR as one new version of NAME (unchanged files are not re-read)")
    sp.add_argument("name", help="the name to add a version to (made on first use)")
    sp.add_argument("dir", help="the folder to snapshot (symlinks and special files are skipped)")
    sp.add_argument("-m", "--message", help="a message kept in the version's metadata")
    sp.add_argument("--meta", type=meta_arg, action="append", metavar="KEY=VALUE",
                    help="a metadata entry (repeatable; VALUE is text)")
    sp.add_argument("--exclude", action="append", metavar="GLOB",
                    help="leave out paths matching GLOB, whole or by any segment (repeatable)")
    sp.add_argument("--json", action="store_true", help="one JSON document on stdout")
    sp = add("status", cmd_status, "files of DIR added, modified or deleted against NAME's head")
    sp.add_argument("name", help="the name to compare with")
    sp.add_argument("dir", help="the folder")
    sp.add_argument("--version", metavar="TARGET", help="compare with this version instead (NAME~N, NAME@HEX)")
    sp.add_argument("--exclude", action="append", metavar="GLOB",
                    help="leave out paths matching GLOB, as given to add (repeatable)")
    sp.add_argument("--json", action="store_true", help="one JSON document on stdout")
