"""``casstore doctor``: what the store's filesystem does with locks, hard links and reflinks,
and what casstore does about it (issue 17; docs/filesystems.md)."""

from __future__ import annotations

import argparse
import json

from .common import Add, open_from_args

__all__ = ["register"]


def cmd_doctor(args: argparse.Namespace) -> int:
    """Probe the store's filesystem again and print the findings and casstore's answer to each."""
    store = open_from_args(args)
    fs = store.filesystem()
    if args.json:
        print(json.dumps(fs.as_dict(), indent=2))
        return 0
    print(f"store       {fs.root}")
    print(f"filesystem  {fs.fstype} mounted at {fs.mount}")
    print(f"flock       {fs.flock} (two open files of one lock file: the second must be refused)")
    print(f"fcntl (OFD) {fs.posix}")
    print(f"hard links  {fs.hardlinks}")
    print(f"reflink     {fs.reflink}")
    print(f"lock_mode   {fs.setting} -> casstore uses: {fs.lock_mode}")
    for line in fs.actions:
        print(f"  - {line}")
    return 0


def register(add: Add) -> None:
    """Add ``casstore doctor``."""
    sp = add("doctor", cmd_doctor, "probe the store's filesystem (locks, hard links, reflink) and say what "
                                   "casstore does about what it finds")
    sp.add_argument("--json", action="store_true")
