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
from typing import BinaryIO, Dict, List, Optional, Protocol, Union

from .._fs import inside_dir, path_exists
from .._layout import CONFIG_FILE
from .._progress import Progress, human_bytes
from ..codecs import normalize_compress
from ..digest import Digest
from ..errors import (
    CasstoreError,
    DiskFullError,
    InvalidInputError,
    ObjectNotFoundError,
    ReadOnlyError,
    StoreFormatError,
)
from ..store import Store, open_store
from .common import Add, UnusedParser, compress_arg, open_from_args, printable, resolve_digest, workers_arg

__all__ = ["register"]


def cmd_init(args: argparse.Namespace) -> int:
    """``casstore init DIR`` (or ``casstore --store DIR init``; DIR wins when both are given): create
    a store (an existing one is opened and left as it is)."""
    store_opt: Optional[str] = getattr(args, "store", None)
    if args.dir is None and store_opt is None:
        raise InvalidInputError("init needs a directory: `casstore init DIR` (or `casstore --store DIR init`)")
    target = args.dir if args.dir is not None else store_opt
    assert target is not None
    if not target:
        raise InvalidInputError("init needs a directory, not an empty argument (an unset variable?)")
    root = Path(target).expanduser()
    existed = path_exists(root / CONFIG_FILE)
    if existed:
        store = open_store(root, create=False)
        _check_same_options(args, store)
    else:
        store = open_store(root, create=True, compress=args.compress, durable=not args.scratch,
                           shared=args.shared)
    cfg = store.config
    if args.json:
        print(json.dumps({"store": str(store.root), "created": not existed, "compression": cfg.compression,
                          "level": cfg.level, "durable": cfg.durable, "shared": cfg.shared}))
        return 0
    print(f"casstore store at {store.root} (compression {cfg.compression}, durable {str(cfg.durable).lower()}"
          f"{', shared' if cfg.shared else ''})" + ("; it already existed, left as it is" if existed else ""))
    return 0


def _check_same_options(args: argparse.Namespace, store: Store) -> None:
    """``init`` of an existing store: options given that differ from its store.toml are an error naming each.

    Options left out are not compared (``casstore init DIR`` again is a no-op):
    the store's settings were fixed when it was created and init never rewrites them.
    """
    cfg = store.config
    diffs: List[str] = []
    if args.compress is not None:
        try:
            level = normalize_compress(args.compress, cfg.level)
        except (CasstoreError, ValueError, TypeError) as e:
            raise InvalidInputError(f"--compress {args.compress}: {e}") from None
        want = ("zstd", level) if level else ("raw", None)
        have = ("zstd", cfg.level) if cfg.compression == "zstd" else ("raw", None)
        if want != have:
            diffs.append(f"compression {have[0]}{'' if have[1] is None else f' level {have[1]}'} "
                         f"(asked: {want[0]}{'' if want[1] is None else f' level {want[1]}'})")
    if args.scratch and cfg.durable:
        diffs.append("durable (asked: --scratch)")
    if args.shared and not cfg.shared:
        diffs.append("not shared (asked: --shared)")
    if diffs:
        raise StoreFormatError(f"{store.root} is already a store with different options: {'; '.join(diffs)}; "
                               "a store's options are fixed when it is created: init a new DIR for these")


def cmd_put(args: argparse.Namespace) -> int:
    """``casstore put FILE...``: store files (``-`` reads stdin) and print their digests."""
    sizes = _check_put_args(args.files)  # every argument before anything is stored
    store = open_from_args(args)
    done: List[Dict[str, object]] = []
    # On a terminal only (Progress checks stderr); bytes of the files named, stdin has no known size.
    with Progress(sum(sizes.values()), desc="put", enabled=None if sizes else False) as bar:
        for name in args.files:
            if name == "-":
                d = store.put_stream(sys.stdin.buffer, compress=args.compress)
            else:
                d = store.put_path(name, compress=args.compress)
                bar.update(sizes[name])
            done.append({"file": name, "digest": str(d)})
            if not args.json:
                # (found by a bug hunt: a file named "a\nblake3:000...0  model.bin" forged a line of output)
                print(f"{d}  {printable(name)}" if len(args.files) > 1 or args.names else str(d), flush=True)
    if args.json:
        print(json.dumps(done, indent=2))
    return 0


def _check_put_args(files: List[str]) -> Dict[str, int]:
    """Sizes of the regular files named; an InvalidInputError naming the first that is not one.

    Checked up front so a typo in the fifth argument stores nothing, rather than
    four objects and a traceback-free error the user must untangle.
    """
    sizes: Dict[str, int] = {}
    if files.count("-") > 1:
        raise InvalidInputError("'-' (stdin) given more than once; stdin can be read only once")
    for name in files:
        shown = printable(name)  # (a newline in it would cut the one-line error short)
        if name == "-":
            if sys.stdin is None:  # started with stdin closed (`<&-`)
                raise InvalidInputError("'-' reads stdin, but stdin is closed")
            continue
        try:
            st = os.stat(name)
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{shown}: no such file; nothing was stored") from None
        except OSError as e:
            raise InvalidInputError(f"{shown}: {e.strerror or e}; nothing was stored") from None
        if stat.S_ISDIR(st.st_mode):
            raise InvalidInputError(f"{shown} is a directory; nothing was stored "
                                    f"(snapshot a folder with `casstore add NAME {shown}`)")
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"{shown} is not a regular file (a FIFO, socket or device); nothing was stored "
                                    f"(pipe it in with `casstore put - < {shown}`)")
        if not os.access(name, os.R_OK):
            raise ReadOnlyError(f"{shown}: permission denied; nothing was stored")
        sizes[name] = st.st_size
    return sizes


class _Reader(Protocol):
    """What ``get`` copies from: an object reader, or one that also counts for the progress bar."""

    def read(self, n: int = -1, /) -> bytes: ...


def _output_error(out: Path, e: OSError) -> Union[OSError, CasstoreError]:
    """A typed one-liner naming ``-o FILE`` as given (not our temporary name beside it)."""
    msg = f"cannot write -o {out}: {e.strerror or e}"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ReadOnlyError(msg)
    if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP):
        return InvalidInputError(msg)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"{msg}; free space and run get again", e.errno)
    return OSError(e.errno, e.strerror, str(out))


def _copy_out(src: _Reader, o: BinaryIO, out: Path) -> None:
    """``src`` into ``o``, then close ``o``; a failed write or flush (a full disk, ``/dev/full``) is
    :func:`_output_error`'s typed error naming ``-o FILE`` (a failed read keeps its own error: a
    damaged object is not the output's fault)."""
    try:
        while True:
            chunk = src.read(1 << 20)
            if not chunk:
                break
            try:
                o.write(chunk)
            except OSError as e:
                raise _output_error(out, e) from e
    except BaseException:
        try:
            o.close()
        except OSError:
            pass  # the first error is the one to report
        raise
    try:
        o.close()
    except OSError as e:
        raise _output_error(out, e) from e


def _write_output(src: _Reader, output: str) -> None:
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
        _copy_out(src, o, out)
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
        _copy_out(src, os.fdopen(fd, "wb"), out)
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


def _write_stdout(src: _Reader) -> None:
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        raise InvalidInputError("stdout is closed; give -o FILE")
    shutil.copyfileobj(src, sys.stdout.buffer, 1 << 20)
    sys.stdout.buffer.flush()


class _Counted:
    """A reader that advances a progress bar by the bytes each ``read`` returns (``get``'s copy loop)."""

    def __init__(self, src: BinaryIO, bar: Progress) -> None:
        self.src = src
        self.bar = bar

    def read(self, n: int = -1) -> bytes:
        """Read like ``src.read`` and count what came back."""
        data = self.src.read(n)
        self.bar.update(len(data))
        return data


def _stdout_is_regular_file() -> bool:
    """``casstore get D > file``: stdout is a file, so a bar on the terminal's stderr garbles nothing."""
    try:
        return sys.stdout is not None and stat.S_ISREG(os.fstat(sys.stdout.fileno()).st_mode)
    except (ValueError, OSError, AttributeError):
        return False


_OBJECT_HELP = ("a digest or unique prefix, or NAME:KEY for the file KEY of a version (NAME~N:KEY, "
                "NAME@HEXPREFIX:KEY and VERSION-DIGEST:KEY too)")


def cmd_get(args: argparse.Namespace) -> int:
    """``casstore get OBJECT [-o FILE]``: write an object's bytes (verified unless --no-verify); OBJECT may
    be ``NAME:KEY`` (:func:`~casstore.cli.common.resolve_digest`)."""
    store = open_from_args(args)
    d = resolve_digest(store, args.digest)
    if args.output == "":  # (was: the bytes went to stdout, past the refusal to write binary to a terminal)
        raise InvalidInputError("-o is empty: give a file to write, or - for stdout")
    to_file = bool(args.output and args.output != "-")
    if to_file and inside_dir(args.output, store.root):
        # Hazard (found by a bug hunt): `get A -o <store>/objects/..` replaced object B's file by a rename
        # (its mode 0444 is no obstacle to that) and `-o <store>/store.toml` broke every later command.
        raise InvalidInputError(f"-o {printable(args.output)} is inside the store at {store.root}: get never "
                                "writes there (it would replace the store's own files); write it elsewhere")
    # A bar (on a terminal's stderr only) when the bytes go to a file; never beside bytes going to a
    # terminal or a pager, whose screen it would garble.
    show = None if to_file or (args.output is None and _stdout_is_regular_file()) else False
    with store.open(d, verify=not args.no_verify) as f, \
            Progress(store.stat(d).size if show is None else 0, desc="get", enabled=show) as bar:
        src: _Reader = f if show is False else _Counted(f, bar)
        if to_file:
            _write_output(src, args.output)
            return 0
        head = b""
        if args.output is None and _stdout_is_terminal():
            head = f.read(8192)
            if _looks_binary(head):
                raise InvalidInputError(f"{d.short()} looks binary and stdout is a terminal; write it with "
                                        "-o FILE, pipe it (`| less`), or pass -o - to print it anyway")
        if head:
            if sys.stdout is None:  # started with stdout closed (`>&-`); not a terminal, so unreachable
                raise InvalidInputError("stdout is closed; give -o FILE")
            sys.stdout.buffer.write(head)
        _write_stdout(src)
    return 0


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout is not None and os.isatty(sys.stdout.fileno())
    except (ValueError, OSError, AttributeError):
        return False


def _looks_binary(head: bytes) -> bool:
    """A NUL byte or text that is not UTF-8 (as ``git`` and ``curl`` judge): it would garble the terminal."""
    if b"\x00" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < len(head) - 3  # a character cut at the end of the sample is still text
    return False


def cmd_stat(args: argparse.Namespace) -> int:
    """``casstore stat OBJECT``: size, stored size and codec of one object (or of ``NAME:KEY``)."""
    store = open_from_args(args)
    info = store.stat(resolve_digest(store, args.digest))
    doc = {"digest": str(info.digest), "size": info.size, "stored_size": info.stored_size, "codec": info.codec}
    if args.json:
        print(json.dumps(doc))
    else:
        for k, v in doc.items():
            print(f"{k:12} {v}")
    return 0


def _when(t: Optional[float]) -> str:
    return "?" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _ls_names(args: argparse.Namespace) -> int:
    """``casstore ls``: heads and pins with versions, size, last change; internal records only with --all."""
    store = open_from_args(args)
    rows = store.name_rows(include_internal=args.all, filters=args.filter, sort=args.sort or "name",
                           reverse=args.reverse, max_versions=args.max_versions)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    if args.jsonl:
        for r in rows:
            print(json.dumps(r.to_dict()))
        return 0
    human = _stdout_is_terminal()  # exact bytes when piped, so `| sort -n` and scripts read numbers
    table = []
    for r in rows:
        versions = f"{r.versions}+" if r.versions_capped else str(r.versions)
        size = "?" if r.problem else (human_bytes(r.size) if human else str(r.size))
        name = printable(r.name)  # names come from disk: never raw control chars
        extra = ""
        if r.url is not None:
            extra = "  " + printable(r.url)
        if r.problem:
            extra += f"  ({r.problem})"
        table.append((name, r.kind, versions, size, _when(r.time), r.digest.short() if human else str(r.digest),
                      extra))
    if human and not table:
        print("no names (heads or pins) yet; `casstore add NAME DIR` saves a folder, `casstore ls --objects` "
              "lists objects", file=sys.stderr)
        return 0
    width = max([len(t[0]) for t in table] + [4])
    if human:
        print(f"{'NAME':{width}}  KIND  {'VERSIONS':>8}  {'SIZE':>10}  {'LAST CHANGE':16}  DIGEST")
    for name, kind, versions, size, when, digest, extra in table:
        print(f"{name:{width}}  {kind:4}  {versions:>8}  {size:>10}  {when:16}  {digest}{extra}")
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    """``casstore ls``: heads and pins (``--objects``: every object, one line or JSON document each)."""
    if not args.objects:
        return _ls_names(args)
    if args.names:
        raise InvalidInputError("--names and --objects: choose one (names are the default)")
    for flag, given in (("--all", args.all), ("--sort", args.sort is not None), ("--reverse", args.reverse),
                        ("--filter", bool(args.filter))):
        if given:
            raise InvalidInputError(f"{flag} applies to the name listing; drop --objects to list names")
    store = open_from_args(args)
    docs = []
    for info in store.iter_info():
        doc = {"digest": str(info.digest), "size": info.size, "stored_size": info.stored_size, "codec": info.codec}
        if args.json:
            docs.append(doc)
        elif args.jsonl:  # streamed: a million objects need not fit in one document
            print(json.dumps(doc))
        else:
            print(f"{info.digest}  {info.size:>12}  {info.codec}")
    if args.json:
        print(json.dumps(docs, indent=1))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Put, dedupe, get and verify; explain each step (in a temporary store unless ``--store`` is given)."""
    if args.store:
        return _demo(open_from_args(args), args.json, temporary=False)
    with tempfile.TemporaryDirectory(prefix="casstore-demo-") as tmp:
        return _demo(open_store(Path(tmp) / "store", create=True), args.json, temporary=True)


def _demo(store: Store, as_json: bool, *, temporary: bool) -> int:
    facts: Dict[str, object] = {"store": str(store.root), "temporary": temporary}
    lines: List[str] = []

    def say(text: str) -> None:
        lines.append(text)
        if not as_json:
            print(text, flush=True)

    say("casstore demo: a short tour of what the store does, one step per line.")
    if temporary:
        say(f"store: {store.root} -- a temporary store, deleted when the demo ends "
            "(`casstore --store DIR demo` runs it in DIR and keeps what it made)")
    else:
        say(f"store: {store.root} (given with --store; what the demo stores stays there, under the name 'demo')")
    before = sum(1 for _ in store.iter_objects())
    payload = ("casstore demo: the same bytes are stored once. " * 2000).encode()
    t = time.perf_counter()
    d1 = store.put(payload)
    d2 = store.put(bytes(payload))
    facts["dedupe"] = {"digest": str(d1), "same_digest": d1 == d2}
    say(f"1. put {human_bytes(len(payload))} twice -> {d1.short()} both times: {d1 == d2} "
        f"({(time.perf_counter() - t) * 1e3:.1f} ms); an object's name is the BLAKE3 hash of its bytes, "
        "so equal bytes are stored once")
    text = ("\n".join(f"step {i} loss {1 / (i + 1):.6f}" for i in range(20000))).encode()
    dz = store.put(text, compress=True)
    info = store.stat(dz)
    facts["compressed"] = {"digest": str(dz), "size": info.size, "stored_size": info.stored_size,
                           "codec": info.codec}
    say(f"2. put a {human_bytes(info.size)} training log with compress=True -> {dz.short()}, stored {info.codec} "
        f"in {human_bytes(info.stored_size)}; the digest is that of the uncompressed bytes: "
        f"{dz == Digest.of(text)}")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "weights.bin"
        src.write_bytes(os.urandom(8 << 20))
        t = time.perf_counter()
        d3 = store.put_path(src, compress=True)
        dt = time.perf_counter() - t
        info = store.stat(d3)
        say(f"3. put_path 8 MiB of random bytes with compress=True -> codec {info.codec} "
            f"(compression skipped: it would not pay) in {dt * 1e3:.1f} ms")
        same = store.get(d3) == src.read_bytes()
    facts["random"] = {"digest": str(d3), "codec": info.codec, "verified": same}
    say(f"4. get re-hashed the bytes it read (BLAKE3) and returned identical bytes: {same}")
    say(f"5. raw object path for h5py/np.memmap (read-only): {store.path(d3)}")
    with store.edit("demo") as m:
        m["payload.txt"] = d1
        m["train.log"] = dz
        m["weights.bin"] = d3
        m.meta["note"] = "recorded by casstore demo"
    versions = len(store.history("demo"))
    facts["manifest"] = {"name": "demo", "digest": str(m.result.digest) if m.result else None, "versions": versions}
    say(f"6. manifest 'demo' -> {m.result.digest.short() if m.result else '?'}: names three objects by key "
        f"({versions} version{'s' if versions != 1 else ''}; "
        + ("`casstore --store DIR demo` keeps it for `casstore manifest show demo` and `casstore log demo`)"
           if temporary else f"see `casstore --store {store.root} manifest show demo`, `... log demo`)"))
    after = sum(1 for _ in store.iter_objects())
    facts["objects"] = {"before": before, "after": after}
    say(f"7. objects in store: {before} before, {after} after (two puts of one payload stored once; "
        "the manifest version is an object too)")
    if as_json:
        facts["lines"] = lines
        print(json.dumps(facts, indent=2))
    return 0


def register(add: Add) -> None:
    """Add the object subcommands to the ``casstore`` parser."""

    sp = add("init", cmd_init, "create a store in DIR (an existing store is left as it is)")
    sp.add_argument("dir", nargs="?", help="the store directory (created with its parents; default: the --store one)")
    sp.add_argument("--compress", default=None, type=compress_arg,
                    help="default codec: raw (default), zstd or a level 1-22")
    sp.add_argument("--scratch", action="store_true", help="no fsync on put (fast; may lose recent puts on power loss)")
    sp.add_argument("--shared", action="store_true", help="group-writable store for several users")
    sp.add_argument("--json", action="store_true")
    sp = add("put", cmd_put, "store files (or - for stdin); print their digests")
    sp.add_argument("files", nargs="+", metavar="FILE",
                    help="regular files, or - for stdin (all are checked before anything is stored)")
    sp.add_argument("--compress", default=None, type=compress_arg,
                    help="raw, zstd or a zstd level (default: the store's)")
    sp.add_argument("--names", action="store_true", help="print 'digest  file' even for one file")
    sp.add_argument("--json", action="store_true")
    sp = add("get", cmd_get, "write an object (or a file of a version, NAME:KEY) to stdout or -o FILE "
                             "(verifies its digest)")
    sp.add_argument("digest", metavar="OBJECT", help=_OBJECT_HELP)
    sp.add_argument("-o", "--output",
                    help="output file (written atomically; a device, pipe or symlink is written in place); "
                         "- writes to stdout even when it is a terminal")
    sp.add_argument("--no-verify", action="store_true", help="skip re-hashing")
    sp = add("stat", cmd_stat, "show an object's size, stored size and codec")
    sp.add_argument("digest", metavar="OBJECT", help=_OBJECT_HELP)
    sp.add_argument("--json", action="store_true")
    sp = add("ls", cmd_ls, "list heads and pins: versions, size, last change (or objects with --objects)")
    filter_help, sort_keys = "", tuple[str, ...]()  # not the command being run: its help is never shown
    if not isinstance(sp, UnusedParser):
        from ..maintenance.listing import FILTER_HELP, SORT_KEYS  # help of `ls`

        filter_help, sort_keys = FILTER_HELP, SORT_KEYS
    fmt = sp.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON document: a list of names (or objects), "
                     "sizes in exact bytes, time in seconds since the epoch")
    fmt.add_argument("--jsonl", action="store_true", help="JSON Lines: one JSON document per name (or object)")
    sp.add_argument("--objects", action="store_true", help="list every object (digest, size, codec) instead of names")
    sp.add_argument("--names", action="store_true", help="list heads and pins (the default; kept for scripts)")
    sp.add_argument("--all", action="store_true", help="also internal records (_fetch/..., with their URL)")
    sp.add_argument("--sort", choices=sort_keys, default=None,
                    help="name (A-Z, the default), size (largest first), time (newest first), versions (most first)")
    sp.add_argument("--reverse", "-r", action="store_true", help="reverse the sort order")
    sp.add_argument("--filter", "-f", action="append", default=[], metavar="EXPR",
                    help=f"only names matching EXPR; repeat to AND several. {filter_help}")
    sp.add_argument("--max-versions", type=workers_arg, default=1000, metavar="N",
                    help="stop counting a name's history after N versions, shown as N+ (default 1000)")
    sp = add("demo", cmd_demo, "a guided tour: put, dedupe, get, verify and a manifest, each step explained "
                               "(in a temporary store unless --store is given)")
    sp.add_argument("--json", action="store_true")
