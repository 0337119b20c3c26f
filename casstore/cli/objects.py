"""Object commands: ``init``, ``put``, ``get``, ``stat``, ``ls`` and ``demo``."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Optional, Union

from .._progress import human_bytes
from ..digest import Digest
from ..errors import CasstoreError, InvalidInputError, ReadOnlyError
from ..store import open_store
from .common import Add, compress_arg, open_from_args

__all__ = ["register"]


def cmd_init(args: argparse.Namespace) -> int:
    """``casstore init DIR``: create a store (an existing one is opened and left as it is)."""
    root = Path(args.dir).expanduser()
    store = open_store(root, create=True, compress=args.compress, durable=not args.scratch,
                       shared=args.shared)
    print(f"casstore store at {store.root} (compression {store.config.compression}, "
          f"durable {str(store.durable).lower()})")
    return 0


def cmd_put(args: argparse.Namespace) -> int:
    """``casstore put FILE...``: store files (``-`` reads stdin) and print their digests."""
    store = open_from_args(args)
    for name in args.files:
        if name == "-":
            if sys.stdin is None:  # started with stdin closed (`<&-`)
                raise InvalidInputError("'-' reads stdin, but stdin is closed")
            d = store.put_stream(sys.stdin.buffer, compress=args.compress)
        else:
            d = store.put_path(name, compress=args.compress)
        print(f"{d}  {name}" if len(args.files) > 1 or args.names else str(d))
    return 0


def _output_error(out: Path, e: OSError) -> Union[OSError, CasstoreError]:
    """A typed one-liner naming ``-o FILE`` as given (not our temporary name beside it)."""
    msg = f"cannot write -o {out}: {e.strerror or e}"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ReadOnlyError(msg)
    if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP):
        return InvalidInputError(msg)
    return OSError(e.errno, e.strerror, str(out))


def _write_output(src: BinaryIO, output: str) -> None:
    """Copy ``src`` into the file ``output``: a new or regular file atomically, else in place.

    In place means opened for writing as ``cp`` would: a device or FIFO
    (``/dev/null``, a named pipe), and any symlink (``/dev/stdout`` is one, to
    ``/proc/self/fd/1``).  Renaming a temporary file over them would replace the
    node itself (as root, ``/dev/null``), or the file a shell redirected stdout to,
    under the shell's feet.
    """
    out = Path(output)
    try:
        lst: Optional[os.stat_result] = os.lstat(out)
    except FileNotFoundError:
        lst = None
    except OSError as e:
        raise _output_error(out, e) from e
    if lst is not None and _is_stdout(out):
        _write_stdout(src)  # /dev/stdout, /dev/fd/1: reopening it would truncate what the shell appends to
        return
    if lst is not None and not stat.S_ISREG(lst.st_mode):
        try:  # a directory fails here (EISDIR); a dangling symlink creates its target, as cp would
            o = open(out, "wb")
        except OSError as e:
            raise _output_error(out, e) from e
        with o:
            shutil.copyfileobj(src, o, 1 << 20)
        return
    if lst is not None:
        mode = stat.S_IMODE(lst.st_mode)  # replacing a file: keep its permissions
    else:
        umask = os.umask(0o022)  # only readable by setting it; nothing else here creates files meanwhile
        os.umask(umask)
        mode = 0o666 & ~umask
    # Write next to the target, then rename: a failed or corrupt read never
    # leaves a half-written output file behind.
    try:
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".part")
    except OSError as e:
        raise _output_error(out, e) from e
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600; a new output gets what any new file would
        with os.fdopen(fd, "wb") as o:
            shutil.copyfileobj(src, o, 1 << 20)
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise


def _is_stdout(path: Path) -> bool:
    """True if ``path`` names the file our stdout is (``/dev/stdout``, ``/proc/self/fd/1``)."""
    if sys.stdout is None:
        return False
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_stdout(src: BinaryIO) -> None:
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        raise InvalidInputError("stdout is closed; give -o FILE")
    shutil.copyfileobj(src, sys.stdout.buffer, 1 << 20)
    sys.stdout.buffer.flush()


def cmd_get(args: argparse.Namespace) -> int:
    """``casstore get DIGEST [-o FILE]``: write an object's bytes (verified unless --no-verify)."""
    store = open_from_args(args, create=False)
    d = store.resolve(args.digest)
    with store.open(d, verify=not args.no_verify) as f:
        if args.output and args.output != "-":
            _write_output(f, args.output)
        else:
            _write_stdout(f)
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    """``casstore stat DIGEST``: size, stored size and codec of one object."""
    store = open_from_args(args, create=False)
    info = store.stat(store.resolve(args.digest))
    doc = {"digest": str(info.digest), "size": info.size, "stored_size": info.stored_size, "codec": info.codec}
    if args.json:
        print(json.dumps(doc))
    else:
        for k, v in doc.items():
            print(f"{k:12} {v}")
    return 0


def _ls_names(args: argparse.Namespace) -> int:
    """``casstore ls --names [--all]``: heads and pins; internal records (with their URL) only with --all."""
    names = open_from_args(args, create=False).names(include_internal=args.all)
    if args.json:
        print(json.dumps([{"name": n.name, "kind": n.kind, "digest": str(n.digest), "internal": n.internal,
                           "url": n.url} for n in names], indent=2))
        return 0
    for n in names:
        url = "" if n.url is None else "  " + (n.url if n.url.isprintable() else repr(n.url))  # stored data
        print(f"{n.kind:4}  {n.digest}  {n.name}{url}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """``casstore ls``: every object, one line (or one JSON document) each; ``--names``: heads and pins."""
    if args.names:
        return _ls_names(args)
    if args.all:
        raise InvalidInputError("--all lists internal names (_fetch/...): use it with --names")
    store = open_from_args(args, create=False)
    for info in store.iter_info():
        if args.json:
            print(json.dumps({"digest": str(info.digest), "size": info.size,
                              "stored_size": info.stored_size, "codec": info.codec}))
        else:
            print(f"{info.digest}  {info.size:>12}  {info.codec}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Put, dedupe, get and verify on the store; explain each step."""
    store = open_from_args(args)
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
          f"{dz == Digest.of(text)}")
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


def register(add: Add) -> None:
    """Add the object subcommands to the ``casstore`` parser."""
    sp = add("init", cmd_init, "create a store in DIR")
    sp.add_argument("dir")
    sp.add_argument("--compress", default=None, type=compress_arg,
                    help="default codec: raw (default), zstd or a level 1-22")
    sp.add_argument("--scratch", action="store_true", help="no fsync on put (fast; may lose recent puts on power loss)")
    sp.add_argument("--shared", action="store_true", help="group-writable store for several users")
    sp = add("put", cmd_put, "store files (or - for stdin); print their digests")
    sp.add_argument("files", nargs="+")
    sp.add_argument("--compress", default=None, type=compress_arg,
                    help="raw, zstd or a zstd level (default: the store's)")
    sp.add_argument("--names", action="store_true", help="print 'digest  file' even for one file")
    sp = add("get", cmd_get, "write an object to stdout or -o FILE (verifies its digest)")
    sp.add_argument("digest", help="digest or unique prefix")
    sp.add_argument("-o", "--output",
                    help="output file (written atomically; a device, pipe or symlink is written in place)")
    sp.add_argument("--no-verify", action="store_true", help="skip re-hashing")
    sp = add("stat", cmd_stat, "show an object's size, stored size and codec")
    sp.add_argument("digest")
    sp.add_argument("--json", action="store_true")
    sp = add("ls", cmd_ls, "list objects (or heads and pins with --names)")
    sp.add_argument("--json", action="store_true",
                    help="JSON: one document per object (JSON Lines); with --names one JSON list")
    sp.add_argument("--names", action="store_true", help="list heads and pins instead of objects")
    sp.add_argument("--all", action="store_true", help="with --names: also internal records (_fetch/... with URL)")
    add("demo", cmd_demo, "put, dedupe, get and verify on the store, explaining each step")
