"""``casstore cache info|verify NAME``: inspect index caches kept by ``IndexCache.preserve``.

``NAME`` is the pin name given to ``preserve`` (or a manifest or cache-object digest).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from .._progress import human_bytes
from ..errors import IntegrityError
from .common import Add, add_actions, open_from_args

if TYPE_CHECKING:
    from .. import IndexCache

__all__ = ["register"]


def _open(args: argparse.Namespace, verify: str) -> IndexCache:
    """The preserved cache ``args.name``; IndexCache comes from the package's public names."""
    from .. import IndexCache

    return IndexCache.open(open_from_args(args), args.name, verify=verify)


def cmd_cache_info(args: argparse.Namespace) -> int:
    """Print an index cache's name, digest, length, records and sizes (no data is read)."""
    cache = _open(args, "record")
    try:
        info = cache.info()
    finally:
        cache.close()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"index cache {info['name'] or args.name}")
    print(f"  object    {info['digest']}")
    if info["manifest"]:
        print(f"  manifest  {info['manifest']}")
    print(f"  records   {info['records']:,} of {info['length']:,} indices")
    size, file_size = human_bytes(info["bytes"]), human_bytes(info["file_bytes"] or 0)
    print(f"  payload   {size}  (file {file_size}, format {info['format']})")
    print(f"  file      {info['file']}")
    return 0


def cmd_cache_verify(args: argparse.Namespace) -> int:
    """Hash the whole object and check every record's checksum; exit 1 on damage."""
    try:
        cache = _open(args, "record")
        try:
            n = cache.verify()
        finally:
            cache.close()
    except IntegrityError as e:
        if args.json:
            print(json.dumps({"name": args.name, "ok": False, "error": str(e)}))
        print(f"casstore: index cache {args.name!r} is damaged: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"name": args.name, "ok": True, "records": n}))
        return 0
    print(f"index cache {args.name!r}: object digest and {n:,} record checksums OK")
    return 0


def register(add: Add) -> None:
    """Add ``casstore cache info`` and ``casstore cache verify``."""
    action = add_actions(add("cache", None, "inspect preserved index caches (info, verify)"), "cache", "cache_command")
    p = action("info", cmd_cache_info, "length, records, bytes and object of a preserved index cache")
    p.add_argument("name", help="the name given to IndexCache.preserve, or a digest")
    p.add_argument("--json", action="store_true")
    p = action("verify", cmd_cache_verify, "check the whole object's digest and every record's checksum")
    p.add_argument("name", help="the name given to IndexCache.preserve, or a digest")
    p.add_argument("--json", action="store_true")
