"""Maintenance commands: ``gc``, ``verify``, ``du``, ``stats``.

``casstore gc`` only plans (a dry run) unless ``--yes`` is given; ``--remote NAME``
collects on a remote instead (``du --remote NAME`` reports its usage).  Long work
shows a progress bar on a terminal and stays quiet when piped; ``--json``
prints one JSON document for scripts.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Sequence, Union

from .._progress import human_bytes
from ..errors import InvalidInputError
from .common import Add, cli_words, count_arg, open_from_args, seconds_arg

if TYPE_CHECKING:
    from ..digest import Digest
    from ..maintenance import GCPlan, GCResult
    from ..sync.remote_gc import RemoteGCPlan, RemoteGCResult

__all__ = ["register"]


def _report_gc(args: argparse.Namespace, plan: Union[GCPlan, RemoteGCPlan], asked: Sequence[Digest],
               result: Union[GCResult, RemoteGCResult, None], *, kept: str, failed: int, again: str) -> None:
    """Print a gc plan (and its result), local or remote alike: one JSON document, or lines for humans."""
    if args.json:
        doc = plan.to_dict(objects=args.verbose)
        doc["dry_run"] = not args.yes
        if asked:
            doc["why"] = {str(d): plan.why(d) for d in asked}
        if result is not None:
            doc["result"] = result.to_dict()
        print(json.dumps(doc, indent=2))
        return
    print(cli_words(plan.summary()))  # ("lower keep_history" -> "--keep-history")
    if args.verbose:
        for d in plan.objects:
            print(f"  delete {d}  {plan.why(d)}")
    for d in asked:
        print(f"{d}  {plan.why(d)}")
    if result is not None:
        print(f"deleted {len(result.deleted)} objects, freed {human_bytes(result.freed_bytes)} "
              f"in {result.seconds:.1f}s" + (f"; {len(result.skipped)} kept after all ({kept})"
                                             if result.skipped else "")
              + (f"; {failed} deletes failed (run again)" if failed else ""))
    elif not args.yes and plan.files:
        print(f"dry run: nothing deleted; run `{again}` (same options) to delete")
    elif args.yes and not plan.files:
        print("nothing to delete")  # (the plan's "would be deleted" line alone read as a dry run)


def cmd_gc_remote(args: argparse.Namespace) -> int:
    """``casstore gc --remote NAME``: plan (and with --yes execute) a gc of a remote."""
    store = open_from_args(args)
    if args.max_size is not None:
        raise InvalidInputError("--max-size applies to the local store only; drop it or drop --remote")
    plan = store.plan_gc(keep_history=args.keep_history, grace=args.grace, remote=args.remote)
    asked = [plan.resolve(w) for w in args.why]
    result = plan.execute(timeout=args.timeout) if args.yes and plan.files else None
    failed = len(result.failed) if result is not None else 0
    _report_gc(args, plan, asked, result, kept="referenced again", failed=failed,
               again=f"casstore gc --remote {args.remote} --yes")
    return 1 if failed else 0


def cmd_gc(args: argparse.Namespace) -> int:
    """Plan (and with --yes execute) a garbage collection, or a size limit with --max-size."""
    if args.remote:
        return cmd_gc_remote(args)
    store = open_from_args(args)
    if args.max_size is not None:
        plan = store.plan_limit(args.max_size, keep_history=args.keep_history, grace=args.grace)
    else:
        plan = store.plan_gc(keep_history=args.keep_history, grace=args.grace)
    asked = [store.resolve(w) for w in args.why]  # before execute: why it stays or goes, as planned
    result = plan.execute(timeout=args.timeout) if args.yes and plan.files else None
    _report_gc(args, plan, asked, result, kept="in use again", failed=0, again="casstore gc --yes")
    return 0 if plan.met else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Verify every object and reference; exit 1 if anything is damaged."""
    store = open_from_args(args)
    report = store.verify(fast=args.fast, repair=args.repair, incremental=args.incremental)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.summary())
    return 0 if report.ok else 1


def cmd_du_remote(args: argparse.Namespace) -> int:
    """``casstore du --remote NAME``: bytes the remote's live names reference vs bytes stored there."""
    store = open_from_args(args)
    if args.names or args.shared:
        raise InvalidInputError("du --remote lists every remote pin and head; NAME and --shared are local-only")
    u = store.remote_usage(args.remote)
    rows = [n for n in u.by_name if args.by is None or n.kind == args.by]
    if args.json:
        doc = u.to_dict()
        doc["names"] = [n.to_dict() for n in rows]
        print(json.dumps(doc, indent=2))
        return 0
    print(f"{'kind':4}  {'entries':>8}  {'logical':>10}  {'stored':>10}  name")
    for n in rows:
        miss = f"  ({n.missing} missing on the remote)" if n.missing else ""
        print(f"{n.kind:4}  {n.entries:>8}  {human_bytes(n.logical_bytes):>10}  {human_bytes(n.stored_bytes):>10}  "
              f"{n.name}{miss}")
    print(f"{u.remote}: {u.objects} objects, {human_bytes(u.stored_bytes)} stored; live names reference "
          f"{human_bytes(u.live_logical_bytes)} as files, {human_bytes(u.live_stored_bytes)} stored "
          f"({u.dedupe_ratio:.2f}x dedupe); {human_bytes(u.other_bytes)} is history or unreferenced "
          f"(see `casstore gc --remote {args.remote}`)")
    return 0


def cmd_du(args: argparse.Namespace) -> int:
    """Disk usage per pin and head (their current versions); with NAME or --shared, what each shares."""
    if args.remote:
        return cmd_du_remote(args)
    store = open_from_args(args)
    u = store.usage(shares=args.names or ([*store.pins(), *store.heads()] if args.shared else []))
    rows = [n for n in u.by_name if (args.by is None or n.kind == args.by) and (not args.names or n.name in args.names)]
    if args.json:
        print(json.dumps([n.to_dict() for n in rows], indent=2))
        return 0
    print(f"{'kind':4}  {'entries':>8}  {'logical':>10}  {'stored':>10}  {'exclusive':>10}  {'shared':>10}  name")
    for n in rows:
        miss = f"  ({n.missing} missing)" if n.missing else ""
        print(f"{n.kind:4}  {n.entries:>8}  {human_bytes(n.logical_bytes):>10}  {human_bytes(n.stored_bytes):>10}  "
              f"{human_bytes(n.exclusive_bytes):>10}  {human_bytes(n.shared_bytes):>10}  {n.name}{miss}")
        for s in n.shared_with:
            print(f"{'':4}  shares {human_bytes(s.stored_bytes):>10} ({s.objects} object{'s' * (s.objects != 1)}) "
                  f"with {s.kind} {s.name}")
    print(f"total: {u.objects} objects, {human_bytes(u.stored_bytes)} stored; "
          f"{human_bytes(u.unreferenced_bytes)} in {u.unreferenced_objects} unreferenced objects (see `casstore gc`)")
    print("exclusive: freed if only that name went (unless history keeps it); shared: another live name has it too")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    """Store-wide usage: objects, bytes, compression, dedupe of the live names, history."""
    store = open_from_args(args)
    u = store.usage()
    fs = store.filesystem()  # cached per mount: locks, hard links, reflink (issue 17; casstore doctor)
    if args.json:
        doc = u.to_dict()
        doc["filesystem"] = fs.as_dict()
        print(json.dumps(doc, indent=2))
        return 0
    print(f"store            {store.root}")
    print(f"filesystem       {fs.fstype}; locks: {fs.lock_mode} (casstore doctor explains)")
    print(f"objects          {u.objects} ({u.files} files: {u.codecs.get('raw', 0)} raw, "
          f"{u.codecs.get('zstd', 0)} zstd)")
    print(f"logical bytes    {human_bytes(u.logical_bytes)}")
    print(f"stored bytes     {human_bytes(u.stored_bytes)}")
    print(f"compression      {u.compression_ratio:.2f}x")
    print(f"live names       reference {human_bytes(u.live_logical_bytes)} as files; "
          f"{u.live_objects} distinct objects, {human_bytes(u.live_unique_bytes)} "
          f"({human_bytes(u.live_stored_bytes)} on disk)"
          + (f"; {u.live_missing} missing" if u.live_missing else ""))
    print(f"dedupe savings   {human_bytes(u.dedupe_savings)} ({u.dedupe_ratio:.2f}x dedupe, "
          f"{u.reduction_ratio:.2f}x with compression; live names only)")
    print(f"history          {u.history_versions} older version(s) referencing "
          f"{human_bytes(u.history_logical_bytes)}; {human_bytes(u.history_stored_bytes)} in "
          f"{u.history_objects} objects only history keeps")
    print(f"names            {sum(1 for n in u.by_name if n.kind == 'pin')} pins, "
          f"{sum(1 for n in u.by_name if n.kind == 'head')} heads, {u.versions} manifest versions")
    print(f"unreferenced     {u.unreferenced_objects} objects, {human_bytes(u.unreferenced_bytes)}")
    return 0


def register(add: Add) -> None:
    """Add the maintenance subcommands to the ``casstore`` parser."""
    sp = add("gc", cmd_gc, "delete unreferenced objects (plans only, unless --yes)")
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="only show the plan (the default)")
    mode.add_argument("--yes", "-y", action="store_true", help="delete what the plan lists")
    sp.add_argument("--keep-history", type=count_arg, default=5, metavar="N",
                    help="versions kept behind each head's current one (default 5)")
    sp.add_argument("--grace", default="1h",
                    help="keep objects written within this long: 90s, 10m, 1h, 2d (default 1h)")
    sp.add_argument("--max-size", default=None, metavar="SIZE",
                    help="instead: evict least-recently-used unreferenced objects until the store fits SIZE "
                         "(e.g. 50G); exits 1 if pinned and head-referenced data alone exceed it")
    sp.add_argument("--remote", default=None, metavar="NAME",
                    help="collect on this remote (a configured name or s3:// URL) instead of the local store: "
                         "its pins and heads are the roots, ages are the server's LastModified")
    sp.add_argument("--timeout", type=seconds_arg, default=600.0,
                    help="seconds to wait for commits (with --remote: pushes) in progress")
    sp.add_argument("-v", "--verbose", action="store_true", help="list every object and why it goes")
    sp.add_argument("--why", action="append", default=[], metavar="DIGEST",
                    help="say why this object (digest or unique prefix) stays or goes; repeatable")
    sp.add_argument("--json", action="store_true")
    sp = add("verify", cmd_verify, "re-hash every object and check every reference (exit 1 if damaged)")
    sp.add_argument("--fast", action="store_true", help="sizes and headers only (no hashing)")
    sp.add_argument("--repair", action="store_true",
                    help="move corrupt and stray files to bad/, remove stale staging files; never deletes data")
    sp.add_argument("--incremental", action="store_true",
                    help="skip files unchanged since a verification within the last 30 days")
    sp.add_argument("--json", action="store_true")
    sp = add("du", cmd_du, "disk usage per pin and head; with NAME, what it shares with other names")
    sp.add_argument("names", nargs="*", metavar="NAME",
                    help="only these names, each with the bytes it shares with every other live name")
    sp.add_argument("--by", choices=("pin", "head"), default=None, help="only pins or only heads")
    sp.add_argument("--shared", action="store_true", help="list what every name shares with each other name")
    sp.add_argument("--remote", default=None, metavar="NAME",
                    help="a remote's pins and heads instead: bytes they reference vs bytes stored on the remote")
    sp.add_argument("--json", action="store_true")
    sp = add("stats", cmd_stats, "objects, bytes, compression, dedupe of the live names, history")
    sp.add_argument("--json", action="store_true", help="one JSON document")

