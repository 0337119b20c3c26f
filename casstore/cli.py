"""The ``casstore`` command line.

Store selection: ``--store DIR``, else ``$CASSTORE_DIR``, else the per-user
default cache directory (``$XDG_CACHE_HOME/casstore`` or ``~/.cache/casstore``).
Exit codes: 0 ok, 1 a casstore error (one line on stderr), 2 bad usage,
130 interrupted.  ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

from . import __version__
from ._progress import human_bytes
from .errors import CasstoreError, ObjectNotFoundError
from .store import Store, open_store

__all__ = ["main", "default_store_dir", "open_from_args"]


def default_store_dir() -> Path:
    """The runtime setting ``store``: ``$CASSTORE_DIR``, a settings file, or ``~/.cache/casstore``."""
    from .settings import current

    return Path(current().store).expanduser()


def _compress_arg(value: str) -> Any:
    """``--compress`` value: a zstd level given as digits becomes an int (``"5"`` -> 5)."""
    return int(value) if value.strip().isdigit() else value


def open_from_args(args: argparse.Namespace, *, create: bool = True) -> Store:
    """The store chosen by ``--store``, ``$CASSTORE_DIR`` or the default (for subcommand modules)."""
    return _store(args, create=create)


def _store(args: argparse.Namespace, *, create: bool = True) -> Store:
    root = Path(args.store).expanduser() if args.store else default_store_dir()
    return open_store(root, create=create)


def cmd_init(args: argparse.Namespace) -> int:
    root = Path(args.dir).expanduser()
    store = open_store(root, create=True, compress=args.compress, durable=not args.scratch,
                       shared=args.shared)
    print(f"casstore store at {store.root} (compression {store.config.compression}, "
          f"durable {str(store.durable).lower()})")
    return 0


def cmd_put(args: argparse.Namespace) -> int:
    store = _store(args)
    compress: Any = args.compress
    for name in args.files:
        if name == "-":
            d = store.put_stream(sys.stdin.buffer, compress=compress)
        else:
            d = store.put_path(name, compress=compress)
        print(f"{d}  {name}" if len(args.files) > 1 or args.names else str(d))
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    d = store.resolve(args.digest)
    with store.open(d, verify=not args.no_verify) as f:
        if args.output and args.output != "-":
            out = Path(args.output)
            # Write next to the target, then rename: a failed or corrupt read
            # never leaves a half-written output file behind.
            fd, tmp = tempfile.mkstemp(dir=out.parent or ".", prefix=f".{out.name}.", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as o:
                    shutil.copyfileobj(f, o, 1 << 20)
                os.replace(tmp, out)
            except BaseException:
                os.unlink(tmp)
                raise
        else:
            shutil.copyfileobj(f, sys.stdout.buffer, 1 << 20)
            sys.stdout.buffer.flush()
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    info = store.stat(store.resolve(args.digest))
    doc = {"digest": str(info.digest), "size": info.size, "stored_size": info.stored_size,
           "codec": info.codec}
    if args.json:
        print(json.dumps(doc))
    else:
        for k, v in doc.items():
            print(f"{k:12} {v}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    n = 0
    for info in store.iter_info():
        n += 1
        if args.json:
            print(json.dumps({"digest": str(info.digest), "size": info.size,
                              "stored_size": info.stored_size, "codec": info.codec}))
        else:
            print(f"{info.digest}  {info.size:>12}  {info.codec}")
    return 0


def casstore_digest(data: bytes) -> Any:
    """The digest ``data`` would be stored under (no store needed)."""
    from .digest import hash_bytes

    return hash_bytes(data)


def cmd_demo(args: argparse.Namespace) -> int:
    """Put, dedupe, get and verify on the default store; explain each step."""
    store = _store(args)
    print(f"store: {store.root}")
    before = sum(1 for _ in store.iter_objects())
    payload = ("casstore demo: the same bytes are stored once. " * 2000).encode()
    t = time.perf_counter()
    d1 = store.put(payload)
    d2 = store.put(bytes(payload))
    print(f"put {human_bytes(len(payload))} twice -> {d1.short()} both times: {d1 == d2} "
          f"({(time.perf_counter() - t) * 1e3:.1f} ms)")
    text = ("\n".join(f"step {i} loss {1 / (i + 1):.6f}" for i in range(20000))).encode()
    dz = store.put(text, compress=True)
    info = store.stat(dz)
    print(f"put a {human_bytes(info.size)} training log with compress=True -> {dz.short()}, stored {info.codec} "
          f"in {human_bytes(info.stored_size)}; the digest is that of the uncompressed bytes: "
          f"{dz == casstore_digest(text)}")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "weights.bin"
        src.write_bytes(os.urandom(8 << 20))
        t = time.perf_counter()
        d3 = store.put_path(src, compress=True)
        dt = time.perf_counter() - t
        info = store.stat(d3)
        print(f"put_path 8 MiB of random bytes with compress=True -> codec {info.codec} "
              f"(compression skipped: it would not pay) in {dt * 1e3:.1f} ms")
        same = store.get(d3) == src.read_bytes()
    print(f"get verified the BLAKE3 digest and returned identical bytes: {same}")
    print(f"raw object path for h5py/np.memmap (read-only): {store.path(d3)}")
    with store.edit("demo") as m:
        m["payload.txt"] = d1
        m["train.log"] = dz
        m["weights.bin"] = d3
        m.meta["note"] = "recorded by casstore demo"
    versions = len(store.history("demo"))
    print(f"manifest 'demo' -> {m.result.digest.short() if m.result else '?'} "
          f"({versions} version{'s' if versions != 1 else ''}; see `casstore manifest show demo`, "
          "`casstore log demo`)")
    after = sum(1 for _ in store.iter_objects())
    print(f"objects in store: {before} before, {after} after (two puts of one payload stored once; "
          "the manifest version is an object too)")
    return 0


def _entry_doc(e: Any) -> Dict[str, Any]:
    doc: Dict[str, Any] = {"digest": str(e.digest), "size": e.size}
    if e.meta:
        doc["meta"] = _jsonable(dict(e.meta))
    return doc


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def cmd_manifest_show(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    man = store.manifest(args.target)
    if args.json:
        print(json.dumps({
            "digest": str(man.digest), "name": man.name, "frozen": man.frozen,
            "parent": str(man.parent) if man.parent else None, "meta": _jsonable(dict(man.meta)),
            "entries": {k: _entry_doc(man[k]) for k in man},
        }, indent=2))
        return 0
    state = "pin (frozen)" if man.frozen and man.name else ("version" if not man.name else "head")
    print(f"{man.name or '-'}  {man.digest}  [{state}]  {len(man)} entries")
    for k, v in man.meta.items():
        print(f"  meta {k} = {v!r}")
    for k in man:
        e = man[k]
        size = "?" if e.size is None else human_bytes(e.size)
        print(f"  {e.digest.short()}  {size:>10}  {k}")
    return 0


def _to_digest(store: Store, value: str) -> Any:
    """A FILE (put into the store) or a digest / unique prefix."""
    if os.path.isfile(value):
        return store.put_path(value)
    return store.resolve(value)


def cmd_manifest_set(args: argparse.Namespace) -> int:
    store = _store(args)
    d = _to_digest(store, args.value)
    with store.edit(args.name, timeout=args.timeout) as m:
        m[args.key] = d
    assert m.result is not None
    print(f"{args.name} -> {m.result.digest}  ({args.key} = {d.short()})")
    return 0


def cmd_manifest_rm(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    with store.edit(args.name, timeout=args.timeout) as m:
        for key in args.keys:
            if key not in m:
                raise ObjectNotFoundError(f"manifest {args.name!r} has no key {key!r}")
            del m[key]
    assert m.result is not None
    print(f"{args.name} -> {m.result.digest}")
    return 0


def cmd_freeze(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    print(store.freeze(args.name))
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    print(store.pin(args.name, args.target, force=args.force))
    return 0


def cmd_unpin(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    print(store.unpin(args.name))
    return 0


def cmd_pins(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    refs = store.heads() if args.heads else store.pins()
    if args.json:
        print(json.dumps({k: str(v) for k, v in refs.items()}))
    else:
        for k, v in refs.items():
            print(f"{v}  {k}")
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    df = store.diff(args.a, args.b)
    if args.json:
        print(json.dumps({
            "added": {k: _entry_doc(e) for k, e in df.added.items()},
            "removed": {k: _entry_doc(e) for k, e in df.removed.items()},
            "changed": {k: [_entry_doc(a), _entry_doc(b)] for k, (a, b) in df.changed.items()},
        }, indent=2))
        return 0
    for k, e in df.added.items():
        print(f"+ {k}  {e.digest.short()}")
    for k, e in df.removed.items():
        print(f"- {k}  {e.digest.short()}")
    for k, (a, b) in df.changed.items():
        print(f"~ {k}  {a.digest.short()} -> {b.digest.short()}")
    return 0


def cmd_checkout(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    written = store.checkout(args.target, args.dir, overwrite=args.overwrite)
    print(f"checked out {len(written)} file(s) into {args.dir}")
    return 0


def cmd_log(args: argparse.Namespace) -> int:
    store = _store(args, create=False)
    for m in store.history(args.target, limit=args.limit):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(store.path(m.digest).stat().st_mtime))
        print(f"{m.digest}  {when}  {len(m)} entries")
    return 0


# Subcommand modules (see the end of _build_parser).  Keep one per line.
_EXTENSIONS: tuple[str, ...] = (
    "_cli_remote",
    "_cli_gc",
    "_cli_cache",
)


def cmd_config(args: argparse.Namespace) -> int:
    from .settings import load_settings

    st = load_settings()
    doc = {k: getattr(st, k) for k in st.sources}
    if args.json:
        print(json.dumps({"settings": doc, "sources": dict(st.sources), "file": st.file}, indent=2))
        return 0
    print(f"# settings file: {st.file or '(none found)'}")
    for k, v in doc.items():
        print(f"{k:15} = {v!r:40} # {st.sources[k]}")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    store = _store(args)
    d = store.fetch(args.url, digest=args.digest, sha256=args.sha256, md5=args.md5, force=args.force or None)
    print(d)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="casstore", description="Content-addressed artifact store.")
    p.add_argument("--store", metavar="DIR", help="store directory (default: $CASSTORE_DIR or ~/.cache/casstore)")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--version", action="version", version=f"casstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(func=fn)
        return sp

    sp = add("init", cmd_init, "create a store in DIR")
    sp.add_argument("dir")
    sp.add_argument("--compress", default=None, type=_compress_arg,
                    help="default codec: raw (default), zstd or a level 1-22")
    sp.add_argument("--scratch", action="store_true", help="no fsync on put (fast; may lose recent puts on power loss)")
    sp.add_argument("--shared", action="store_true", help="group-writable store for several users")
    sp = add("put", cmd_put, "store files (or - for stdin); print their digests")
    sp.add_argument("files", nargs="+")
    sp.add_argument("--compress", default=None, type=_compress_arg,
                    help="raw, zstd or a zstd level (default: the store's)")
    sp.add_argument("--names", action="store_true", help="print 'digest  file' even for one file")
    sp = add("get", cmd_get, "write an object to stdout or -o FILE (verifies its digest)")
    sp.add_argument("digest", help="digest or unique prefix")
    sp.add_argument("-o", "--output", help="output file (written atomically)")
    sp.add_argument("--no-verify", action="store_true", help="skip re-hashing")
    sp = add("stat", cmd_stat, "show an object's size, stored size and codec")
    sp.add_argument("digest")
    sp.add_argument("--json", action="store_true")
    sp = add("ls", cmd_ls, "list objects")
    sp.add_argument("--json", action="store_true")
    add("demo", cmd_demo, "put, dedupe, get and verify on the store, explaining each step")

    sp = add("manifest", lambda a: _usage(sp_manifest), "show or change a manifest (show, set, rm)")
    sp_manifest = sp
    msub = sp.add_subparsers(dest="manifest_command", metavar="ACTION")
    mp = msub.add_parser("show", help="show a manifest by name or digest")
    mp.add_argument("target", help="head or pin name, or a version digest")
    mp.add_argument("--json", action="store_true")
    mp.set_defaults(func=cmd_manifest_show)
    mp = msub.add_parser("set", help="set KEY of manifest NAME to FILE (stored) or DIGEST")
    mp.add_argument("name")
    mp.add_argument("key")
    mp.add_argument("value", metavar="FILE|DIGEST")
    mp.add_argument("--timeout", type=float, default=600.0, help="lock timeout in seconds")
    mp.set_defaults(func=cmd_manifest_set)
    mp = msub.add_parser("rm", help="remove KEY(s) from manifest NAME")
    mp.add_argument("name")
    mp.add_argument("keys", nargs="+")
    mp.add_argument("--timeout", type=float, default=600.0, help="lock timeout in seconds")
    mp.set_defaults(func=cmd_manifest_rm)
    sp = add("freeze", cmd_freeze, "make head NAME a pin (never changes again)")
    sp.add_argument("name")
    sp = add("pin", cmd_pin, "pin TARGET (a name or version digest) as NAME")
    sp.add_argument("name")
    sp.add_argument("target")
    sp.add_argument("--force", action="store_true", help="move an existing pin")
    sp = add("unpin", cmd_unpin, "remove pin NAME (objects go later, through gc)")
    sp.add_argument("name")
    sp = add("pins", cmd_pins, "list pins (or heads with --heads)")
    sp.add_argument("--heads", action="store_true")
    sp.add_argument("--json", action="store_true")
    sp = add("diff", cmd_diff, "keys added, removed and changed from A to B")
    sp.add_argument("a")
    sp.add_argument("b")
    sp.add_argument("--json", action="store_true")
    sp = add("checkout", cmd_checkout, "write the files of a manifest into DIR (verified)")
    sp.add_argument("target")
    sp.add_argument("dir")
    sp.add_argument("--overwrite", action="store_true")
    sp = add("log", cmd_log, "versions of a manifest, newest first")
    sp.add_argument("target")
    sp.add_argument("-n", "--limit", type=int, default=None)
    sp = add("config", cmd_config, "print the effective runtime settings and where each came from")
    sp.add_argument("--json", action="store_true")
    sp = add("fetch", cmd_fetch, "download URL into the store once (other processes wait); print its digest")
    sp.add_argument("url")
    sp.add_argument("--digest", help="expected blake3 digest")
    sp.add_argument("--sha256", help="expected sha256 (hex)")
    sp.add_argument("--md5", help="expected md5 (hex)")
    sp.add_argument("--force", action="store_true", help="download again even if stored")
    # Feature modules add their own subcommands: each casstore/_cli_<feature>.py
    # defines ``register(add)``; list it in _EXTENSIONS.
    import importlib

    for modname in _EXTENSIONS:
        importlib.import_module(f"casstore.{modname}").register(add)
    return p


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help(sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``casstore`` console script; returns the exit code."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
        return rc
    except KeyboardInterrupt:
        print("casstore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except (CasstoreError, OSError) as e:
        if args.debug:
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = type(e).__name__
        print(f"casstore: error: {msg} [{kind}]", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
