"""Manifest commands: ``manifest show|set|rm``, ``freeze``, ``pin``, ``unpin``, ``pins``, ``diff``,
``checkout``, ``log``, ``rm`` and ``mv``, all through the :class:`~casstore.Store` facade.

Every TARGET that is read (show, diff, checkout, log, pin) may be a version:
``NAME~N`` (N versions back) or ``NAME@<hex>`` (docs/manifests.md).  Errors
name CLI flags (``--force``), not the Python keywords the library's own
messages mention.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple

from .._progress import human_bytes
from ..digest import Digest
from ..errors import (
    AmbiguousDigestError,
    CasstoreError,
    FrozenError,
    InvalidDigestError,
    InvalidInputError,
    NameExistsError,
    ObjectNotFoundError,
)
from ..manifests import Manifest, MetaDiff, is_internal
from ..manifests.checkout import log as checkout_log
from ..manifests.ops import same_meta
from ..manifests.provenance import INPUTS_KEY
from ..store import Store
from .common import Add, add_actions, cli_words, count_arg, jsonable, open_from_args, printable, seconds_arg

if TYPE_CHECKING:
    from .. import Entry

__all__ = ["register"]


def _entry_doc(e: Entry) -> Dict[str, Any]:
    doc: Dict[str, Any] = {"digest": str(e.digest), "size": e.size}
    if e.meta:
        doc["meta"] = jsonable(dict(e.meta))
    return doc


def cmd_manifest_show(args: argparse.Namespace) -> int:
    """``casstore manifest show TARGET``: a manifest's entries and metadata."""
    store = open_from_args(args)
    man = store.manifest(args.target)
    if args.json:
        print(json.dumps({
            "digest": str(man.digest), "name": man.name, "frozen": man.frozen,
            "parent": str(man.parent) if man.parent else None, "meta": jsonable(dict(man.meta)),
            "entries": {k: _entry_doc(man[k]) for k in man},
        }, indent=2))
        return 0
    pinned = man.name is not None and man.frozen and store.refs.get("pins", man.name) == man.digest
    state = "pin (frozen)" if pinned else ("head" if man.name and not man.frozen else "version")
    label = args.target if man.name and args.target != man.name else (man.name or "-")  # exp~2, exp@9f2c
    print(f"{label}  {man.digest}  [{state}]  {len(man)} entries")
    for k, v in man.meta.items():
        print(f"  meta {printable(k)} = {v!r}")
    for k in man:
        e = man[k]
        size = "?" if e.size is None else human_bytes(e.size)
        print(f"  {e.digest.short()}  {size:>10}  {k}")
    return 0


def _to_digest(store: Store, value: str) -> Digest:
    """A FILE (put into the store: a regular file or a pipe, as ``casstore put`` takes) or a digest / unique prefix.

    Found by a bug hunt: a directory (or FIFO) whose name looks like hex was taken for a digest prefix,
    so ``manifest set NAME k 5b`` stored whatever object starts with 5b.  Anything at that path is meant.
    """
    if not value:
        raise InvalidInputError("an empty FILE|DIGEST: give a file to store or a digest (prefix)")
    if os.path.isdir(value):
        raise InvalidInputError(f"{value!r} is a directory; manifest set stores one file "
                                f"(`casstore add NAME {value}` snapshots a folder as a version)")
    if os.path.lexists(value):
        return store.put_path(value)  # (a FIFO is streamed, a device refused, a dangling link not found)
    try:
        return store.resolve(value)
    except AmbiguousDigestError:
        raise  # a prefix of several objects: the value was meant as a digest
    except InvalidDigestError as e:
        # "malformed digest" would mislead when the value was meant as a file name.
        raise ObjectNotFoundError(f"{value!r} is neither a file nor a digest or digest prefix") from e


def cmd_manifest_set(args: argparse.Namespace) -> int:
    """``casstore manifest set NAME KEY FILE|DIGEST``."""
    store = open_from_args(args)
    d = _to_digest(store, args.value)
    with store.edit(args.name, timeout=args.timeout) as m:
        m[args.key] = d
    assert m.result is not None
    if args.json:
        print(json.dumps({"name": args.name, "digest": str(m.result.digest), "key": args.key, "value": str(d)}))
        return 0
    print(f"{args.name} -> {m.result.digest}  ({args.key} = {d.short()})")
    return 0


def cmd_manifest_rm(args: argparse.Namespace) -> int:
    """``casstore manifest rm NAME KEY...``."""
    store = open_from_args(args)
    with store.edit(args.name, timeout=args.timeout) as m:
        for key in args.keys:
            if key not in m:
                raise ObjectNotFoundError(f"manifest {args.name!r} has no key {key!r}")
            del m[key]
    assert m.result is not None
    if args.json:
        print(json.dumps({"name": args.name, "digest": str(m.result.digest), "removed": list(args.keys)}))
        return 0
    print(f"{args.name} -> {m.result.digest}")
    return 0


def cmd_freeze(args: argparse.Namespace) -> int:
    """``casstore freeze NAME``: the head becomes a pin."""
    d = open_from_args(args).freeze(args.name)
    print(json.dumps({"pin": args.name, "digest": str(d)}) if args.json else d)
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    """``casstore pin NAME TARGET``."""
    store = open_from_args(args)
    try:
        d = store.pin(args.name, args.target, force=args.force)
        print(json.dumps({"pin": args.name, "digest": str(d)}) if args.json else d)
    except FrozenError:
        old = store.pins().get(args.name)
        raise FrozenError(f"pin {args.name!r} already points to {old}; pass --force to move it") from None
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """``casstore rm NAME [--force]``: delete a head (a pin with --force); its versions stay until gc."""
    store = open_from_args(args)
    try:
        d = store.remove(args.name, force=args.force, timeout=args.timeout)
    except FrozenError:
        raise FrozenError(
            f"{args.name!r} is a pin (frozen); pass --force to remove it, or `casstore unpin {args.name}` first"
        ) from None
    if args.json:
        print(json.dumps({"removed": args.name, "digest": str(d)}))
        return 0
    print(f"removed {args.name} (was {d}; its versions stay until gc collects them: "
          f"`casstore pin NEWNAME {d.short()}` keeps that one)")
    return 0


def cmd_mv(args: argparse.Namespace) -> int:
    """``casstore mv OLD NEW [--force]``: rename a head (a pin with --force), history and all."""
    store = open_from_args(args)
    # What NEW names now, to say it (found by a bug hunt: `mv X PIN --force` replaced a pin, and neither the
    # refusal nor the success said it was one, nor which version it held).
    was_pin, was_head = store.refs.get("pins", args.new), store.refs.get("heads", args.new)
    was = was_pin or was_head
    what = "a pin" if was_pin is not None else "a head"
    try:
        d = store.rename(args.old, args.new, force=args.force, timeout=args.timeout)
    except FrozenError:
        raise FrozenError(
            f"{args.old!r} is a pin (frozen); pass --force to rename it, or `casstore unpin {args.old}` first"
        ) from None
    except NameExistsError:
        held = f" ({what} of {was.short()})" if was is not None else ""
        raise NameExistsError(
            f"{args.new!r} already exists{held}; pass --force to replace it, or choose another name"
        ) from None
    if args.json:
        print(json.dumps({"old": args.old, "new": args.new, "digest": str(d),
                          "replaced": None if was is None or was == d else {"kind": what[2:], "digest": str(was)}}))
        return 0
    print(f"{args.old} -> {args.new}  ({d})")
    if was is not None and was != d:
        print(f"replaced {what} {args.new} (was {was}; its versions stay until gc collects them: "
              f"`casstore pin NEWNAME {was.short()}` keeps that one)")
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    """``casstore unpin NAME``."""
    d = open_from_args(args).unpin(args.name)
    print(json.dumps({"unpinned": args.name, "digest": str(d)}) if args.json else d)
    return 0


def cmd_pins(args: argparse.Namespace) -> int:
    """``casstore pins [--heads] [--all]``: internal records (``_fetch/...``) only with ``--all``."""
    store = open_from_args(args)
    refs = store.heads() if args.heads else store.pins()
    if not args.all:
        refs = {k: v for k, v in refs.items() if not is_internal(k)}
    if args.json:
        print(json.dumps({k: str(v) for k, v in refs.items()}))
    else:
        for k, v in refs.items():
            print(f"{v}  {k}")
    return 0


def _meta_doc(md: MetaDiff) -> Dict[str, Any]:
    return {"added": jsonable(dict(md.added)), "removed": jsonable(dict(md.removed)),
            "changed": {k: [jsonable(x), jsonable(y)] for k, (x, y) in md.changed.items()}}


def _show(value: object) -> str:
    text = repr(value)  # repr: control characters in hostile metadata are escaped, never printed
    return text if len(text) <= 80 else text[:77] + "..."


def _show_input(value: object) -> str:
    """An input label (``"blake3:<hex>"`` / ``"manifest blake3:<hex>"``) with its digest shortened."""
    if isinstance(value, str):
        kind, _, d = value.rpartition(" ")
        if kind in ("", "manifest") and d.startswith("blake3:") and len(d) == 71:
            try:
                return f"{kind} {Digest.parse(d).short()}".lstrip()
            except InvalidDigestError:
                pass
    return _show(value)


_GONE = object()


def _leaves(a: object, b: object, path: Tuple[str, ...], out: List[Tuple[Tuple[str, ...], object, object]]) -> None:
    """Leaf-level changes between two metadata values (nested maps are walked, everything else compared)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in list(a) + [k for k in b if k not in a]:
            _leaves(a.get(k, _GONE), b.get(k, _GONE), path + (str(k),), out)
    elif a is _GONE or b is _GONE or not same_meta(a, b):
        out.append((path, a, b))


def _meta_lines(label: str, md: MetaDiff, skip: Tuple[Tuple[str, ...], ...] = (),
                show: Callable[[object], str] = _show) -> List[str]:
    changes: List[Tuple[Tuple[str, ...], object, object]] = []
    for k, v in md.added.items():
        changes.append(((k,), _GONE, v))
    for k, v in md.removed.items():
        changes.append(((k,), v, _GONE))
    for k, (x, y) in md.changed.items():
        _leaves(x, y, (k,), changes)
    lines = []
    for path, x, y in changes:
        if any(path[:len(s)] == s for s in skip):
            continue
        where = ".".join(printable(p) for p in path)
        if x is _GONE:
            lines.append(f"{label} + {where} = {show(y)}")
        elif y is _GONE:
            lines.append(f"{label} - {where} (was {show(x)})")
        else:
            lines.append(f"{label} ~ {where}: {show(x)} -> {show(y)}")
    return lines


def cmd_diff(args: argparse.Namespace) -> int:
    """``casstore diff A B``: keys added, removed and changed; metadata, derive params and inputs changed."""
    store = open_from_args(args)
    df = store.diff(args.a, args.b)
    if args.json:
        print(json.dumps({
            "a": str(df.a), "b": str(df.b), "same": not df,
            "added": {k: _entry_doc(e) for k, e in df.added.items()},
            "removed": {k: _entry_doc(e) for k, e in df.removed.items()},
            "changed": {k: [_entry_doc(a), _entry_doc(b)] for k, (a, b) in df.changed.items()},
            "meta": _meta_doc(df.meta),
            "entry_meta": {k: _meta_doc(md) for k, md in df.entry_meta.items()},
            "params": _meta_doc(df.params),
            "inputs": _meta_doc(df.inputs),
        }, indent=2))
        return 0
    for k, e in df.added.items():
        print(f"+ {k}  {e.digest.short()}")
    for k, e in df.removed.items():
        print(f"- {k}  {e.digest.short()}")
    for k, (a, b) in df.changed.items():
        if a.digest != b.digest or a.size != b.size:
            print(f"~ {k}  {a.digest.short()} -> {b.digest.short()}")
        else:
            print(f"~ {k}  {a.digest.short()} (metadata only)")
        for line in _meta_lines("meta", df.entry_meta.get(k, MetaDiff())):
            print(f"    {line}")
    # Params and inputs are shown on their own lines, not again as paths inside the derive record.
    for line in (_meta_lines("param", df.params) + _meta_lines("input", df.inputs, show=_show_input)
                 + _meta_lines("meta", df.meta, skip=(("derive", "params"), ("derive", "inputs"), (INPUTS_KEY,)))):
        print(line)
    return 0


class _CheckoutWords(logging.Filter):
    """Rewords a checkout warning's hints as flags (:func:`~casstore.cli.common.cli_words`) while the command runs."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = cli_words(record.getMessage()), None
        return True


def cmd_checkout(args: argparse.Namespace) -> int:
    """``casstore checkout TARGET DIR [--sync [--force]] [--link MODE] [--overwrite]``."""
    if args.force and not args.sync:
        raise InvalidInputError("--force only applies with --sync (it lets sync remove or replace files changed "
                                "since casstore wrote them); use --overwrite to replace other files")
    store = open_from_args(args)
    # A bar by bytes on a terminal's stderr only (None); --json asks for a quiet, script-driven run.
    words = _CheckoutWords()
    checkout_log.addFilter(words)
    try:
        written = store.checkout(args.target, args.dir, overwrite=args.overwrite, sync=args.sync, link=args.link,
                                 force=args.force, progress=None if not args.json else False)
    except InvalidInputError as e:  # hints in CLI words
        raise InvalidInputError(cli_words(str(e))) from None
    finally:
        checkout_log.removeFilter(words)
    if args.json:
        print(json.dumps({"target": args.target, "dir": args.dir, "written": [str(p) for p in written],
                          "removed": list(written.removed), "kept": list(written.kept)}, indent=2))
        return 0
    line = f"checked out {len(written)} file(s) into {args.dir}"
    if args.sync:
        line += f"; sync removed {len(written.removed)} file(s) an earlier checkout wrote"
        if written.kept:
            line += f" and kept {len(written.kept)} changed since (--force removes them)"
    print(line)
    return 0


def _version_time(store: Store, d: Digest) -> Optional[float]:
    """The version object's mtime: when this store wrote it (a version records no time: docs/design.md)."""
    try:
        return store.path(d).stat().st_mtime
    except (CasstoreError, OSError):
        return None


def _capped(keys: List[str], cap: int) -> Tuple[List[str], int]:
    """At most ``cap`` keys (0: all) and how many more there are."""
    if cap <= 0 or len(keys) <= cap:
        return keys, 0
    return keys[:cap], len(keys) - cap


def _log_doc(store: Store, m: Manifest, parent: Optional[Manifest], keys_cap: int, with_keys: bool) -> Dict[str, Any]:
    """One version of ``casstore log``: digest, time, message and what changed from its parent."""
    when = _version_time(store, m.digest)
    message = m.meta.get("message")
    doc: Dict[str, Any] = {"digest": str(m.digest), "parent": str(m.parent) if m.parent else None, "time": when,
                           "message": message if isinstance(message, str) else None, "entries": len(m),
                           "meta": jsonable(dict(m.meta))}
    if m.parent is not None and parent is None:  # its parent was collected by gc (or is damaged)
        doc["changes"] = None
        return doc
    if parent is None:
        added, modified, removed, meta_keys = list(m), [], [], sorted(m.meta)
    else:
        df = store.diff(parent, m)
        added, modified, removed = list(df.added), list(df.changed), list(df.removed)
        meta_keys = sorted([*df.meta.added, *df.meta.removed, *df.meta.changed])
    changes: Dict[str, Any] = {"added": len(added), "modified": len(modified), "removed": len(removed),
                               "meta": meta_keys}
    if with_keys:
        for label, ks in (("added", added), ("modified", modified), ("removed", removed)):
            shown, more = _capped(ks, keys_cap)
            changes[f"{label}_keys"] = shown
            changes[f"{label}_more"] = more
    doc["changes"] = changes
    return doc


def _log_lines(doc: Mapping[str, Any]) -> List[str]:
    when = "?" if doc["time"] is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["time"]))
    ch = doc["changes"]
    what = "parent not in the store" if ch is None else f"+{ch['added']} ~{ch['modified']} -{ch['removed']}"
    msg = doc["message"]
    text = f"{doc['digest']}  {when}  {doc['entries']} entries  {what}"
    if msg:
        text += "  " + printable(msg)  # stored metadata: never raw control characters
    lines = [text]
    if ch is None or "added_keys" not in ch:  # one line per version unless --keys
        return lines
    if [k for k in ch["meta"] if k != "message"]:
        lines.append("    meta: " + ", ".join(printable(k) for k in ch["meta"] if k != "message"))
    for label, sign in (("added", "+"), ("modified", "~"), ("removed", "-")):
        for k in ch.get(f"{label}_keys", ()):
            lines.append(f"    {sign} {printable(k)}")
        if ch.get(f"{label}_more"):
            lines.append(f"    {sign} ... {ch[f'{label}_more']} more")
    return lines


def cmd_log(args: argparse.Namespace) -> int:
    """``casstore log TARGET``: versions, newest first, with message, time and changed keys."""
    store = open_from_args(args)
    versions = store.history(args.target, limit=None if args.limit is None else args.limit + 1)
    shown = versions if args.limit is None else versions[:args.limit]
    docs = []
    for i, m in enumerate(shown):
        parent: Optional[Manifest] = None
        if m.parent is not None:
            if i + 1 < len(versions) and versions[i + 1].digest == m.parent:
                parent = versions[i + 1]
            else:
                try:
                    parent = store.manifest(m.parent)
                except (CasstoreError, OSError):
                    parent = None
        doc = _log_doc(store, m, parent, args.max_keys, args.keys or args.json)
        if args.json:
            docs.append(doc)
        else:
            print("\n".join(_log_lines(doc)), flush=True)
    if args.json:
        print(json.dumps(docs, indent=2))
    return 0


_TARGET_HELP = "a name, NAME~N (N versions back), NAME@HEXPREFIX (a version of NAME) or a version digest"


def register(add: Add) -> None:
    """Add the manifest subcommands to the ``casstore`` parser."""
    action = add_actions(add("manifest", None, "show or change a manifest (show, set, rm)"),
                         "manifest", "manifest_command")
    mp = action("show", cmd_manifest_show, "show a manifest by name or digest")
    mp.add_argument("target", help="head or pin name, NAME~N, NAME@HEXPREFIX, or a version digest")
    mp.add_argument("--json", action="store_true")
    mp = action("set", cmd_manifest_set, "set KEY of manifest NAME to FILE (stored) or DIGEST")
    mp.add_argument("name", help="the head to edit (made on first use)")
    mp.add_argument("key", help="the key (a relative path such as data/train.bin)")
    mp.add_argument("value", metavar="FILE|DIGEST", help="a file to store, or a stored object's digest or prefix")
    mp.add_argument("--timeout", type=seconds_arg, default=600.0, help="lock timeout in seconds")
    mp.add_argument("--json", action="store_true")
    mp = action("rm", cmd_manifest_rm, "remove KEY(s) from manifest NAME")
    mp.add_argument("name", help="the head to edit")
    mp.add_argument("keys", nargs="+", metavar="KEY", help="keys to remove")
    mp.add_argument("--timeout", type=seconds_arg, default=600.0, help="lock timeout in seconds")
    mp.add_argument("--json", action="store_true")
    sp = add("freeze", cmd_freeze, "make head NAME a pin (never changes again)")
    sp.add_argument("name", help="the head to freeze")
    sp.add_argument("--json", action="store_true")
    sp = add("pin", cmd_pin, "pin TARGET (a name, NAME~N, NAME@HEXPREFIX or version digest) as NAME")
    sp.add_argument("name", help="the pin's name")
    sp.add_argument("target", help=_TARGET_HELP)
    sp.add_argument("--force", action="store_true", help="move an existing pin")
    sp.add_argument("--json", action="store_true")
    sp = add("unpin", cmd_unpin, "remove pin NAME (objects go later, through gc)")
    sp.add_argument("name", help="the pin to remove")
    sp.add_argument("--json", action="store_true")
    sp = add("pins", cmd_pins, "list pins (or heads with --heads)")
    sp.add_argument("--heads", action="store_true", help="list heads instead of pins")
    sp.add_argument("--all", action="store_true", help="also internal records (_fetch/...)")
    sp.add_argument("--json", action="store_true")
    sp = add("diff", cmd_diff, "keys, metadata, derive params and inputs added, removed and changed from A to B")
    sp.add_argument("a", help=_TARGET_HELP)
    sp.add_argument("b", help=_TARGET_HELP)
    sp.add_argument("--json", action="store_true")
    sp = add("checkout", cmd_checkout, "write the files of a manifest into DIR (verified)")
    sp.add_argument("target", help=_TARGET_HELP)
    sp.add_argument("dir", help="the folder to write into (made if missing)")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--overwrite", action="store_true", help="replace files (and links) in the way")
    sp.add_argument("--sync", action="store_true",
                    help="also remove files the previous checkout of this name wrote that this version lacks")
    sp.add_argument("--force", action="store_true", help="with --sync: also remove or replace such files "
                    "changed since casstore wrote them")
    sp.add_argument("--link", choices=("copy", "reflink", "hardlink", "symlink"), default="copy",
                    help="copy (reflinked where possible), reflink (clone or error), hardlink or symlink "
                         "(to the read-only object)")
    sp = add("log", cmd_log, "versions of a name, newest first: time, message and changed keys")
    sp.add_argument("target", help=_TARGET_HELP)
    sp.add_argument("-n", "--limit", type=count_arg, default=None, help="show at most this many versions")
    sp.add_argument("--keys", "-v", action="store_true",
                    help="also list the keys each version added (+), modified (~) and removed (-)")
    sp.add_argument("--max-keys", type=count_arg, default=10, metavar="N",
                    help="with --keys or --json: at most N keys of each kind per version, then '... N more' "
                         "(default 10; 0 lists all)")
    sp.add_argument("--json", action="store_true", help="one JSON document: a list of versions, newest first, "
                    "each with its changes (keys capped by --max-keys)")
    sp = add("rm", cmd_rm, "delete name NAME (a head; a pin needs --force); its versions stay until gc")
    sp.add_argument("name", help="the head (or, with --force, pin) to delete")
    sp.add_argument("--force", action="store_true", help="also remove a pin")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--timeout", type=seconds_arg, default=600.0, help="lock timeout in seconds")
    sp = add("mv", cmd_mv, "rename OLD to NEW with its history (a pin, or an existing NEW, needs --force)")
    sp.add_argument("old", help="the current name")
    sp.add_argument("new", help="the new name")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--force", action="store_true", help="rename a pin, or replace an existing NEW")
    sp.add_argument("--timeout", type=seconds_arg, default=600.0, help="lock timeout in seconds")
