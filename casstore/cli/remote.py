"""Remote commands: ``remote add|ls|check|rm``, ``push`` and ``pull`` (see docs/remotes.md).

Remote settings live in ``<store>/remotes.toml``; credentials come the usual AWS
ways and are never stored.  ``push`` and ``pull`` go through the
:class:`~casstore.Store` facade (``store.remotes()``, ``add_remote``,
``remove_remote``, ``remote``, ``push``, ``pull``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Optional, Union

from .._progress import human_bytes
from ..store import Store
from .common import Add, add_actions, open_from_args, workers_arg

if TYPE_CHECKING:
    from .. import Remote
    from ..sync import TransferReport

__all__ = ["register"]


def _remote(store: Store, name: str, workers: Optional[int] = None) -> Remote:
    """Remote ``name`` from the store's remotes.toml, with ``workers`` parallel transfers if given."""
    return store.remote(name, workers=workers)


def cmd_remote_add(args: argparse.Namespace) -> int:
    """``casstore remote add NAME URL``: record a remote in the store's remotes.toml."""
    store = open_from_args(args)
    rem = store.add_remote(args.name, args.url, endpoint_url=args.endpoint_url, region=args.region,
                         profile=args.profile, replace=args.replace)
    if args.create_bucket:
        rem.create_bucket()
    if args.upstream:
        store.set_upstream(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "url": rem.url, "endpoint_url": rem.endpoint_url,
                          "upstream": store.upstream == args.name}))
        return 0
    print(f"remote {args.name!r}: {rem.url}" + (f" at {rem.endpoint_url}" if rem.endpoint_url else ""))
    return 0


def cmd_remote_rm(args: argparse.Namespace) -> int:
    """``casstore remote rm NAME``: forget a remote."""
    open_from_args(args).remove_remote(args.name)
    if args.json:
        print(json.dumps({"removed": args.name}))
    return 0


def cmd_remote_ls(args: argparse.Namespace) -> int:
    """``casstore remote ls [NAME]``: configured remotes, or one remote's pins and heads."""
    store = open_from_args(args)
    if not args.name:
        remotes = store.remotes()
        if args.json:
            print(json.dumps(remotes, indent=2))
        for name, cfg in remotes.items():
            if not args.json:
                extra = f"  (endpoint {cfg['endpoint_url']})" if cfg.get("endpoint_url") else ""
                print(f"{name}\t{cfg['url']}{extra}")
        return 0
    rem = _remote(store, args.name)
    refs = {kind: rem.refs.list(kind) for kind in ("pins", "heads")}
    doc: dict[str, Any] = {"remote": args.name, "url": rem.url,
                           "pins": {k: str(v) for k, v in refs["pins"].items()},
                           "heads": {k: str(v) for k, v in refs["heads"].items()}}
    if args.objects:
        n = size = 0
        for info in rem.objects.iter_info():
            n += 1
            size += info.stored_size
        doc["objects"] = n
        doc["bytes"] = size
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for kind in ("pins", "heads"):
        for name, d in refs[kind].items():
            print(f"{kind[:-1]:4}  {d}  {name}")
    if args.objects:
        print(f"{doc['objects']} object(s), {human_bytes(doc['bytes'])}")
    return 0


def cmd_remote_upstream(args: argparse.Namespace) -> int:
    """``casstore remote upstream [NAME | --none]``: show or set the remote the store reads through."""
    store = open_from_args(args)
    if args.none:
        store.set_upstream(None)
    elif args.name:
        store.set_upstream(args.name)
    if args.json:
        print(json.dumps({"upstream": store.upstream}))
    elif store.upstream is None:
        print("no upstream: missing objects are not fetched on read (set one: casstore remote upstream NAME)")
    else:
        print(f"upstream: {store.upstream} (missing objects are fetched from it, verified, on first read)")
    return 0


def cmd_remote_check(args: argparse.Namespace) -> int:
    """``casstore remote check NAME``: probe the server's conditional writes."""
    rem = _remote(open_from_args(args), args.name)
    rem.check()
    if args.json:
        print(json.dumps({"name": args.name, "remote": rem.describe(), "create_only": True, "compare_and_swap": True}))
        return 0
    print(f"{rem.describe()}: create-only writes (If-None-Match: *) and compare-and-swap (If-Match) work")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    """``casstore push NAME [PIN|HEAD...]``."""
    store = open_from_args(args)
    rem = _remote(store, args.remote, args.workers)
    report = store.push(rem, *args.names, force=args.force)
    _print_report(report, args)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """``casstore pull NAME [PIN|HEAD...]``."""
    store = open_from_args(args)
    rem = _remote(store, args.remote, args.workers)
    merge: Union[bool, str] = True
    if args.no_merge:
        merge = False
    elif args.merge:
        merge = args.merge
    report = store.pull(rem, *args.names, merge=merge, lazy=args.lazy)
    _print_report(report, args)
    return 0


def _print_report(report: TransferReport, args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps({"refs": report.refs, "objects": report.objects, "bytes": report.bytes,
                          "present": report.present, "seconds": round(report.seconds, 3)}))
        return
    for ref, what in report.refs.items():
        print(f"{ref}: {what}")
    print(f"{report.objects} object(s), {human_bytes(report.bytes)} transferred; "
          f"{report.present} already there; {report.seconds:.1f} s", file=sys.stderr)


def register(add: Add) -> None:
    """Add the remote subcommands to the ``casstore`` parser."""
    action = add_actions(add("remote", None,
                             "configure remotes on S3-compatible object stores (add, ls, upstream, check, rm)"),
                         "remote", "remote_command")
    rp = action("add", cmd_remote_add, "record remote NAME at URL (s3://bucket/prefix) in the store's remotes.toml")
    rp.add_argument("name", help="a name for the remote (used by push, pull and remote ls)")
    rp.add_argument("url", help="s3://bucket/prefix")
    rp.add_argument("--endpoint-url", help="server of a non-AWS store, e.g. http://host:8333 (SeaweedFS, MinIO)")
    rp.add_argument("--region", help="bucket region (default: from the AWS config, else us-east-1)")
    rp.add_argument("--profile", help="AWS profile for this remote's credentials")
    rp.add_argument("--replace", action="store_true", help="replace an existing remote of that name")
    rp.add_argument("--create-bucket", action="store_true", help="create the bucket if it does not exist")
    rp.add_argument("--upstream", action="store_true",
                    help="read through it: fetch missing objects from it on first read")
    rp.add_argument("--json", action="store_true")
    rp = action("upstream", cmd_remote_upstream, "show or set the remote missing objects are fetched from on read")
    rp.add_argument("name", nargs="?", help="a remote from `casstore remote ls` (default: show the current one)")
    rp.add_argument("--none", action="store_true", help="read through no remote")
    rp.add_argument("--json", action="store_true")
    rp = action("ls", cmd_remote_ls, "list configured remotes, or the pins and heads on remote NAME")
    rp.add_argument("name", nargs="?", help="a remote to list the pins and heads of (default: list remotes)")
    rp.add_argument("--objects", action="store_true", help="also count the remote's objects and bytes")
    rp.add_argument("--json", action="store_true")
    rp = action("check", cmd_remote_check, "check that remote NAME's server honours create-only and CAS writes")
    rp.add_argument("name", help="a remote from `casstore remote ls`")
    rp.add_argument("--json", action="store_true")
    rp = action("rm", cmd_remote_rm, "forget remote NAME (the remote itself is untouched)")
    rp.add_argument("name", help="a remote from `casstore remote ls`")
    rp.add_argument("--json", action="store_true")

    sp = add("push", cmd_push, "upload pins/heads (all if none named) and the objects the remote lacks")
    sp.add_argument("remote", metavar="NAME", help="a remote from `casstore remote ls`")
    sp.add_argument("names", nargs="*", metavar="PIN|HEAD", help="names to transfer (default: all)")
    sp.add_argument("--force", action="store_true",
                    help="overwrite a diverged remote head (never a pin), or replace a damaged ref")
    sp.add_argument("--workers", type=workers_arg, default=None, help="parallel transfers (default 16)")
    sp.add_argument("--json", action="store_true")
    sp = add("pull", cmd_pull, "download pins/heads (all if none named), verifying every object")
    sp.add_argument("remote", metavar="NAME", help="a remote from `casstore remote ls`")
    sp.add_argument("names", nargs="*", metavar="PIN|HEAD", help="names to transfer (default: all)")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--no-merge", action="store_true", help="refuse to merge a diverged head (conflict error)")
    g.add_argument("--merge", choices=["ours", "theirs"], help="merge a diverged head; conflicting keys take this side")
    sp.add_argument("--lazy", action="store_true",
                    help="refs and manifests only; objects arrive as they are read (the remote must be the upstream)")
    sp.add_argument("--workers", type=workers_arg, default=None, help="parallel transfers (default 16)")
    sp.add_argument("--json", action="store_true")
