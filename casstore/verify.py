"""Verify (and repair) a store: every object re-hashed, every reference resolved.

``store.verify()`` returns a :class:`VerifyReport`:

* ``corrupt`` -- digests with an object file whose bytes do not hash to its
  name (a flipped byte, a truncated or empty file, an undecodable zstd frame,
  a size that disagrees with the manifest or the zstd size trailer);
* ``missing`` -- digests a head or pin (any stored version of it) references
  but the store does not hold;
* ``orphaned`` -- paths under ``objects/`` that are not objects (wrong name,
  wrong place, not a regular file): casstore never reads them;
* ``stale_tmp`` -- staging files in ``tmp/`` whose writer is dead.

``fast=True`` checks sizes and headers only (a raw object's size against the
manifests, a zstd object's magic number and size trailer) and reads at most a
few bytes per object.  Full verification hashes every object on a pool of
threads (BLAKE3 over mmap windows, like ``put_path``) and records what it
verified and when in ``state/verify.msgpack``; ``incremental=True`` then skips
files unchanged since a verification younger than ``recheck_after``.

``repair=True`` moves corrupt object files and stray entries to ``bad/``
(never deletes them), removes stale staging files, and reports in ``lost``
every digest a pin or head needs that now has no good copy, naming who needs
it: put the original data again (a re-put writes a fresh copy, because the
damaged one is no longer in ``objects/``).
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Set, Tuple

import blake3
import msgpack

from ._fs import stale_entries, sweep_stale, write_file_atomic
from ._layout import BAD, OBJECTS, TMP
from .codecs import ZSTD

RAW = "raw"  # TRANSITIONAL
from ._progress import Progress, human_bytes
from ._shared import STATE, makedirs
from .digest import Digest, new_hasher
from .errors import IntegrityError, StoreFormatError
from .gc import Graph, ObjFile, entry_items, parse_duration, scan_objects
from .refs import list_refs

if TYPE_CHECKING:
    from .store import Store

__all__ = ["VerifyReport", "verify", "STATE_FILE"]

STATE_FILE = "verify.msgpack"
EMPTY_HEX = blake3.blake3(b"").hexdigest()
_SMALL = 1 << 20  # below this, read() + one-thread blake3 beats mmap + the thread pool
_WINDOW = 64 << 20  # mmap window for big files (bounded address space)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found (and, with ``repair``, did)."""

    corrupt: Tuple[Digest, ...]
    missing: Tuple[Digest, ...]
    orphaned: Tuple[Path, ...]
    stale_tmp: Tuple[Path, ...]
    unreadable: Tuple[Digest, ...]
    """Manifest versions a head or pin reaches that hash correctly but cannot be decoded
    (not a manifest, a newer format, malformed entries): what they reference is unknown."""
    details: Mapping[Digest, str]
    """What is wrong with each corrupt or missing digest (file and reason, or who references it)."""
    lost: Mapping[Digest, Tuple[str, ...]]
    """Digests a pin or head needs with no good copy left, and who needs them."""
    quarantined: Tuple[Path, ...]
    """Repair: where corrupt files and stray entries were moved (under ``bad/``)."""
    removed_tmp: Tuple[Path, ...]
    """Repair: stale staging files removed."""
    checked: int
    """Object files checked."""
    skipped: int
    """Incremental: files unchanged since a recent verification, not re-hashed."""
    bytes_checked: int
    seconds: float
    fast: bool
    repaired: bool

    @property
    def ok(self) -> bool:
        """No corrupt, missing or orphaned entries (stale staging files are housekeeping, not damage)."""
        return not (self.corrupt or self.missing or self.orphaned or self.unreadable)

    def summary(self) -> str:
        """A few lines for humans, naming each problem and what to do."""
        mode = "fast (sizes and headers)" if self.fast else "full (re-hashed)"
        lines = [f"verified {self.checked} object files, {human_bytes(self.bytes_checked)}, {mode}"
                 + (f"; {self.skipped} unchanged since their last verification skipped" if self.skipped else "")
                 + f" in {self.seconds:.1f}s"]
        for d in self.corrupt:
            lines.append(f"CORRUPT  {d}: {self.details.get(d, '')}")
        for d in self.missing:
            lines.append(f"MISSING  {d}: {self.details.get(d, '')}")
        for d in self.unreadable:
            lines.append(f"BADMANIF {d}: {self.details.get(d, '')}")
        for p in self.orphaned:
            lines.append(f"STRAY    {p}: not an object; casstore never reads it")
        for p in self.stale_tmp:
            lines.append(f"STALE    {p}: staging file of a dead writer")
        for p in self.quarantined:
            lines.append(f"MOVED    {p}")
        for p in self.removed_tmp:
            lines.append(f"REMOVED  {p}")
        for d, who in self.lost.items():
            lines.append(f"LOST     {d}: needed by {', '.join(who)}; no good copy is left in objects/ "
                         "-- put the original data again (or fetch it from a remote)")
        if self.ok and not self.stale_tmp:
            lines.append("store is healthy")
        elif not self.repaired and (self.corrupt or self.orphaned or self.stale_tmp):
            lines.append("run `casstore verify --repair` to move damaged and stray files to bad/ "
                         "and remove stale staging files")
        return "\n".join(lines)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {
            "ok": self.ok,
            "corrupt": [str(d) for d in self.corrupt],
            "missing": [str(d) for d in self.missing],
            "orphaned": [str(p) for p in self.orphaned],
            "stale_tmp": [str(p) for p in self.stale_tmp],
            "unreadable": [str(d) for d in self.unreadable],
            "details": {str(k): v for k, v in self.details.items()},
            "lost": {str(k): list(v) for k, v in self.lost.items()},
            "quarantined": [str(p) for p in self.quarantined],
            "removed_tmp": [str(p) for p in self.removed_tmp],
            "checked": self.checked,
            "skipped": self.skipped,
            "bytes_checked": self.bytes_checked,
            "seconds": round(self.seconds, 3),
            "fast": self.fast,
            "repaired": self.repaired,
        }


# -- checking one file ----------------------------------------------------------------------


def _hash_raw(fd: int, size: int) -> str:
    if size < _SMALL:
        buf = os.read(fd, size + 1)  # a short read of a regular file means end of file
        while len(buf) < size:
            more = os.read(fd, size + 1 - len(buf))
            if not more:
                break
            buf += more
        if len(buf) != size:
            raise IntegrityError(f"changed size while being read ({len(buf)} bytes, expected {size})")
        return str(blake3.blake3(buf).hexdigest())
    h = new_hasher(threaded=True)  # fork-safe: single-threaded in forked children
    off = 0
    while off < size:
        n = min(_WINDOW, size - off)
        with mmap.mmap(fd, n, prot=mmap.PROT_READ, offset=off) as mm:
            mm.madvise(mmap.MADV_SEQUENTIAL)
            h.update(mm)
        off += n
    return str(h.hexdigest())


def _check_file(f: ObjFile, expected: Optional[int], fast: bool) -> Tuple[str, int, str]:
    """``(status, bytes read, problem)``; status is ``ok``, ``corrupt`` or ``gone``."""
    try:
        fd = os.open(f.path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return "gone", 0, ""
    try:
        size = f.size  # from the scan; a file that differs fails its hash or the read
        if f.codec == RAW:
            if size == 0 and f.hex != EMPTY_HEX:
                return "corrupt", 0, f"file {f.path} is empty (lost in a crash?)"
            if fast:
                if expected is not None and size != expected:
                    return "corrupt", 0, f"file {f.path} has {size} bytes but a manifest says {expected} (truncated?)"
                return "ok", 0, ""
            # Full mode: the hash decides.  A manifest entry's size can be wrong (an
            # entry recorded with allow_missing, a pulled manifest); a file whose bytes
            # hash to its name is good and must never be quarantined.
            got = _hash_raw(fd, size)
            if got != f.hex:
                if expected is not None and size != expected:
                    return "corrupt", size, (f"file {f.path} has {size} bytes but a manifest says {expected} "
                                             f"(truncated?) and hashes to blake3:{got}")
                return "corrupt", size, f"file {f.path} hashes to blake3:{got}"
            return "ok", size, ""
        # zstd: magic number at the start, size trailer at the end (docs/format.md)
        usize = ZSTD.size_of(fd, size)
        if usize is None:
            return "corrupt", 0, f"compressed file {f.path} has no size trailer (truncated or damaged)"
        if os.pread(fd, 4, 0) != _ZSTD_MAGIC:
            return "corrupt", 0, f"compressed file {f.path} does not start with a zstd frame"
        if fast:
            if expected is not None and usize != expected:
                return "corrupt", 0, f"compressed file {f.path} holds {usize} bytes but a manifest says {expected}"
            return "ok", 0, ""
        h = new_hasher()
        n = 0
        with open(fd, "rb", buffering=0, closefd=False) as raw:
            try:
                reader = ZSTD.open_decoder(raw, usize, what=f"compressed file {f.path}")
                while True:
                    chunk = reader.read(1 << 20)
                    if not chunk:
                        break
                    h.update(chunk)
                    n += len(chunk)
            except IntegrityError as e:
                return "corrupt", size, f"compressed file {f.path} cannot be decoded ({e})"
        got = h.hexdigest()
        if got != f.hex or n != usize:
            return "corrupt", size, f"compressed file {f.path} decodes to {n} bytes hashing to blake3:{got}"
        return "ok", size, ""
    except IntegrityError as e:
        return "corrupt", 0, f"file {f.path} {e}"
    finally:
        os.close(fd)


# -- stale staging files ----------------------------------------------------------------------


def _stale_tmp(tmpdir: Path, now: float) -> List[Path]:
    """Staging files :func:`casstore._fs.sweep_stale` would remove (without removing them)."""
    return stale_entries(tmpdir, now=now)


# -- incremental state ---------------------------------------------------------------------------


def _state_key(f: ObjFile) -> str:
    return f.hex if f.codec == RAW else f.hex + ".zst"


def _load_state(path: Path) -> Dict[str, List[Any]]:
    try:
        doc = msgpack.unpackb(path.read_bytes(), raw=False)
        files = doc.get("files") if isinstance(doc, dict) and doc.get("v") == 1 else None
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, msgpack.UnpackException, msgpack.ExtraData):
        return {}  # a lost or damaged record only means re-hashing


def _save_state(store: Store, files: Dict[str, List[Any]]) -> None:
    d = store.root / STATE
    try:
        makedirs(d)
        shared = bool(store.config.shared)
        write_file_atomic(store.root / TMP, d / STATE_FILE, msgpack.packb({"v": 1, "files": files}),
                          durable=False, mode=0o664 if shared else 0o644)
    except OSError:  # read-only store: the record is an optimisation
        pass


# -- repair helpers -----------------------------------------------------------------------------


def _quarantine(root: Path, src: Path, name: str) -> Path:
    bad = root / BAD
    makedirs(bad)
    dest = bad / name
    i = 1
    while os.path.lexists(dest):
        dest = bad / f"{name}.{i}"
        i += 1
    os.rename(src, dest)
    return dest


# -- verify -------------------------------------------------------------------------------------


def verify(store: Store, *, fast: bool = False, repair: bool = False, incremental: bool = False,
           recheck_after: Any = "30d", workers: int = 2, progress: Optional[bool] = None) -> VerifyReport:
    """Check every object and every reference; see the module docstring.

    ``workers``: threads hashing files concurrently (BLAKE3 also uses its own
    threads on big files).  ``progress``: a bar on stderr; ``None`` = only when
    stderr is a terminal.
    """
    t0 = time.monotonic()
    now = time.time()
    root = store.root
    recheck = parse_duration(recheck_after, "recheck_after")
    files, strays = scan_objects(root)
    stale = _stale_tmp(root / TMP, now)

    # References: every stored version of every head and pin (full history).
    need: Dict[str, List[str]] = {}
    expected: Dict[str, int] = {}
    details: Dict[str, str] = {}
    walk_corrupt: Set[str] = set()  # versions whose bytes failed their hash when read
    unreadable: Set[str] = set()  # versions that hash fine but do not decode
    g = Graph(store)
    seen_versions: Set[str] = set()
    for kind in ("pins", "heads"):
        for name, d in list_refs(root, kind).items():
            label = f"{kind[:-1]} {name!r}"
            cur: Optional[str] = d.hex
            depth = 0
            while cur is not None and cur not in seen_versions:
                where = label if depth == 0 else f"{label} ({depth} back)"
                try:
                    doc = g.doc(cur, where, required=False)
                except IntegrityError as e:
                    walk_corrupt.add(cur)
                    need.setdefault(cur, []).append(f"{where} (manifest version)")
                    details.setdefault(cur, str(e).split(";")[0])
                    break
                except StoreFormatError as e:
                    need.setdefault(cur, []).append(f"{where} (manifest version)")
                    details.setdefault(cur, str(e))
                    unreadable.add(cur)
                    break
                if doc is None:
                    if depth == 0:  # a ref to a missing version; a missing parent was collected by gc
                        need.setdefault(cur, []).append(f"{where} (manifest version)")
                    break
                seen_versions.add(cur)
                need.setdefault(cur, []).append(f"{where} (manifest version)")
                try:
                    for key, h, size in entry_items(doc, where):
                        need.setdefault(h, []).append(f"{where} entry {key!r}")
                        if size is not None:
                            expected.setdefault(h, size)
                except StoreFormatError as e:
                    details.setdefault(cur, str(e))
                    unreadable.add(cur)
                p = doc.get("parent")
                cur = p.hex() if isinstance(p, bytes) else None
                depth += 1

    # Objects: choose what to check (incremental skips recently verified, unchanged files).
    state = _load_state(root / STATE / STATE_FILE) if not fast else {}
    todo: List[ObjFile] = []
    skipped = 0
    new_state: Dict[str, List[Any]] = {}
    for f in files:
        key = _state_key(f)
        rec = state.get(key)
        if incremental and not fast and f.hex not in walk_corrupt and isinstance(rec, list) and len(rec) == 4 \
                and rec[:3] == [f.size, f.mtime_ns, f.ino] and now - float(rec[3]) < recheck:
            skipped += 1
            new_state[key] = rec
            continue
        todo.append(f)
    results = _check_all(todo, expected, fast, workers, progress)
    # A version that failed its hash when the walk read it is re-checked in full
    # even in fast mode, so repair acts on exactly the damaged file.
    for f in files:
        if f.hex in walk_corrupt and (fast or f.path not in results):
            results[f.path] = _check_file(f, expected.get(f.hex), False)

    good: Set[str] = set()
    corrupt_files: List[ObjFile] = []
    checked = 0
    bytes_checked = 0
    for f in files:
        r = results.get(f.path)
        if r is None:  # skipped (incremental): verified before, unchanged since
            good.add(f.hex)
            continue
        status, _nbytes, problem = r
        if status == "gone":
            continue
        checked += 1
        bytes_checked += f.size
        if status == "ok":
            good.add(f.hex)
            if not fast:
                new_state[_state_key(f)] = [f.size, f.mtime_ns, f.ino, now]
        else:
            corrupt_files.append(f)
            details[f.hex] = problem
    corrupt_hex = sorted({f.hex for f in corrupt_files})
    present = {f.hex for f in files}
    missing: List[str] = []
    for h in sorted(need):
        if h in present:
            continue
        if store.contains(Digest(h)):  # put after our scan
            good.add(h)
            continue
        missing.append(h)
        who = need[h]
        details[h] = "referenced by " + ", ".join(who[:5]) + (f" and {len(who) - 5} more" if len(who) > 5 else "")

    quarantined: List[Path] = []
    removed: List[Path] = []
    if repair:
        for f in corrupt_files:
            fan, name = os.path.basename(os.path.dirname(f.path)), os.path.basename(f.path)
            try:
                quarantined.append(_quarantine(root, Path(f.path), fan + name))
            except FileNotFoundError:
                continue
            new_state.pop(_state_key(f), None)
        for p in strays:
            try:
                rel = p.relative_to(root / OBJECTS)
                quarantined.append(_quarantine(root, p, "stray-" + str(rel).replace(os.sep, "_")))
            except FileNotFoundError:
                continue
        if stale:
            removed = sweep_stale(root / TMP)

    # Needed by a pin or head, with no good copy: report who needs it (never silent).
    lost_h = [h for h in sorted(need) if h not in good]
    lost = {Digest(h): tuple(need[h]) for h in lost_h}
    shown = set(corrupt_hex) | set(missing) | set(lost_h) | unreadable

    if not fast and store.writable:
        _save_state(store, new_state)

    return VerifyReport(
        corrupt=tuple(Digest(h) for h in corrupt_hex),
        missing=tuple(Digest(h) for h in missing),
        orphaned=tuple(strays),
        stale_tmp=tuple(stale),
        unreadable=tuple(Digest(h) for h in sorted(unreadable - set(corrupt_hex))),
        details=MappingProxyType({Digest(h): v for h, v in details.items() if h in shown}),
        lost=MappingProxyType(lost),
        quarantined=tuple(quarantined),
        removed_tmp=tuple(removed),
        checked=checked,
        skipped=skipped,
        bytes_checked=bytes_checked,
        seconds=time.monotonic() - t0,
        fast=fast,
        repaired=repair,
    )


def _check_all(todo: List[ObjFile], expected: Mapping[str, int], fast: bool, workers: int,
               progress: Optional[bool]) -> Dict[str, Tuple[str, int, str]]:
    """Check files; returns path -> (status, bytes, problem).

    Big files are hashed on a pool of ``workers`` threads (BLAKE3 and mmap page
    faults release the GIL); small ones on this thread meanwhile, where a
    thread hop would cost more than the hashing and only contend for the GIL.
    """
    results: Dict[str, Tuple[str, int, str]] = {}
    total = len(todo) if fast else sum(f.size for f in todo)
    with Progress(total, desc="verify", unit="files" if fast else "B", enabled=progress) as bar:
        big = [] if fast or workers < 1 else [f for f in todo if f.size >= _SMALL]
        small = todo if not big else [f for f in todo if f.size < _SMALL]
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="casstore-verify") as ex:
            futs: List[Tuple[ObjFile, Future[Tuple[str, int, str]]]] = [
                (f, ex.submit(_check_file, f, expected.get(f.hex), False)) for f in big]
            for f in small:
                results[f.path] = _check_file(f, expected.get(f.hex), fast)
                bar.update(1 if fast else f.size)
            for f, fut in futs:
                results[f.path] = fut.result()
                bar.update(f.size)
    return results
