"""Pipeline commands: ``fetch`` (download a URL into the store once, across processes)."""

from __future__ import annotations

import argparse
import json

from .common import Add, open_from_args

__all__ = ["register"]


def cmd_fetch(args: argparse.Namespace) -> int:
    """``casstore fetch URL``: print the digest of the downloaded (or already stored) bytes."""
    store = open_from_args(args)
    d = store.fetch(args.url, digest=args.digest, sha256=args.sha256, md5=args.md5, force=args.force or None,
                    refresh=args.refresh, remote=args.remote)
    print(json.dumps({"digest": str(d)}) if args.json else d)  # not the URL: it may carry a token
    return 0


def register(add: Add) -> None:
    """Add ``casstore fetch`` to the ``casstore`` parser."""
    sp = add("fetch", cmd_fetch, "download URL into the store once (other processes wait); print its digest")
    sp.add_argument("url", help="http(s):// or file:// URL")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--digest", help="expected blake3 digest")
    sp.add_argument("--sha256", help="expected sha256 (hex)")
    sp.add_argument("--md5", help="expected md5 (hex)")
    sp.add_argument("--force", action="store_true", help="download again even if stored")
    sp.add_argument("--refresh", action="store_true",
                    help="revalidate a stored download with the server (ETag / Last-Modified; 304 keeps it)")
    sp.add_argument("--remote", metavar="NAME",
                    help="download once across machines sharing this remote: pull it from there if it was "
                         "downloaded already, else download and push it (docs/pipelines.md, 'Across machines')")
