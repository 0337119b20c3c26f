"""Verify (and repair) a store: every object re-hashed, every reference resolved.

``store.verify()`` returns a :class:`VerifyReport`:

* ``corrupt`` -- digests with an object file whose bytes do not hash to its
  name (a flipped byte, a truncated or empty file, an undecodable zstd frame,
  a frame that decodes to more than its recorded size, a size that disagrees
  with the manifest or the recorded size, a file swapped for something that
  is not a regular file since the scan);
* ``missing`` -- digests a head or pin (any stored version of it) references
  but the store does not hold;
* ``orphaned`` -- paths under ``objects/`` that are not objects (wrong name,
  wrong place, not a regular file: a symlink, FIFO, device or directory is
  listed here and never opened or followed);
* ``stale_tmp`` -- staging files in ``tmp/`` whose writer is dead;
* ``wrong_sizes`` -- manifest entries that record a size other than their good
  object's (a version pulled or written by hand; the object is kept).  A size
  that disagrees with a manifest never makes a good object corrupt: in fast
  mode the file is then hashed, and the hash decides.

``fast=True`` checks sizes and headers only (a raw object's size against the
manifests, a compressed object's header and recorded size) and reads at most
a few bytes per object.  Full verification hashes every object on a pool of
threads (:func:`casstore.digest.hash_fd` for files stored byte for byte, the
codec's bounded decoder otherwise) and records what it verified and when in
``state/verify.msgpack``; ``incremental=True`` then skips files unchanged
since a verification younger than ``recheck_after``.  That record is hostile
input too (``state/`` is group-writable in a shared store): it is read only as
a regular file of at most :data:`STATE_MAX_BYTES`, anything else means an empty
record (everything re-hashed) and a warning.

Hazards (issue 11): every object file is opened with
:func:`casstore.objects.reader.open_object_file` (``O_NOFOLLOW | O_NONBLOCK``,
regular files only), so a FIFO planted after the scan cannot hang verify and
a symlink is never followed; decoding is bounded by the size the object
records, so a decompression bomb costs at most that much output (it is
reported corrupt, never inflated).

``repair=True`` moves corrupt object files and stray entries to ``bad/``
(never deletes them; moved relative to directory descriptors of their
directory and of ``bad/``, never through a link: :mod:`casstore.maintenance.files`,
:func:`casstore._fs.move_into`), removes stale staging files (one it cannot
remove is left, with a warning), and
reports in ``lost`` every digest a pin or head needs that now has no good
copy, naming who needs it: put the original data again (a re-put writes a
fresh copy, because the damaged one is no longer in ``objects/``).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple

import msgpack

from .._fs import makedirs, move_into, open_store_dir, read_small_file, stale_entries, sweep_stale, write_file_atomic
from .._layout import BAD, OBJECTS
from .._progress import Progress, human_bytes
from .._shared import STATE
from ..digest import Digest, hash_bytes, hash_fd, new_hasher
from ..errors import (
    CasstoreError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
    ReadOnlyError,
    StoreFormatError,
)
from ..manifests.graph import Graph, compute_live, version_refs
from ..manifests.model import SeenNodes
from ..objects.local import LocalObjects, ObjFile
from ..objects.reader import open_object_file
from .durations import Duration, parse_duration
from .files import ObjectDirs

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["VerifyReport", "verify", "STATE_FILE", "STATE_MAX_BYTES"]

log = logging.getLogger("casstore.verify")

STATE_FILE = "verify.msgpack"
"""The incremental record, under ``<root>/state``."""

StateRecord = List[object]
"""``[size, mtime_ns, inode, verified_at]`` of one object file."""

EMPTY_HEX = hash_bytes(b"").hex
_SMALL = 1 << 20  # below this, hashing on the scanning thread beats a hop to the pool
_CHUNK = 1 << 20  # decoded bytes hashed per read (bounded memory)
_WINDOW = 64 << 20  # mmap window for big files: fewer blake3 pool start-ups than 32 MiB (measured 0.88x -> 0.97x)


@dataclass(frozen=True, slots=True)
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
    upstream: Tuple[Digest, ...] = ()
    """Objects a pin or head needs that are not here but are on the store's upstream (read-through
    fetches each on first read, e.g. after ``pull --lazy``): not damage, neither missing nor lost."""
    damaged_refs: Tuple[str, ...] = ()
    """Heads and pins whose ref cannot be read (``head 'exp': claim ... is damaged; ...``): what
    they hold is unknown, so gc refuses to run until each is fixed or removed as the line says."""
    wrong_sizes: Tuple[str, ...] = ()
    """Entries of heads' and pins' current versions that record a size other than their (good) object's, one line each
    (``head 'exp' entry 'a.bin' records 3 bytes, but blake3:... holds 11``): a version pulled from a
    remote or written by hand that misstates sizes; the object is kept, the entry is what is wrong."""
    provenance: Tuple[str, ...] = ()
    """Malformed or unreadable derive provenance records of pins and current heads (what gc warns
    about; it keeps nothing extra for them).  Not damage by itself: ``ok`` does not depend on it."""

    @property
    def ok(self) -> bool:
        """No corrupt, missing or orphaned entries, unreadable versions or refs, or misstated sizes
        (stale staging files are housekeeping, not damage)."""
        return not (self.corrupt or self.missing or self.orphaned or self.unreadable or self.damaged_refs
                    or self.wrong_sizes)

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
        for r in self.damaged_refs:
            lines.append(f"BADREF   {r}")
        for w in self.wrong_sizes:
            lines.append(f"SIZE     {w}")
        if self.wrong_sizes:
            lines.append("the objects above are good and kept; their entries are wrong: set each again "
                         "(`casstore manifest set NAME KEY OBJECT`, or `casstore add` the folder)")
        for p in self.orphaned:
            lines.append(f"STRAY    {p}: not an object; casstore never reads it")
        for p in self.stale_tmp:
            lines.append(f"STALE    {p}: staging file of a dead writer")
        for p in self.quarantined:
            lines.append(f"MOVED    {p}")
        for p in self.removed_tmp:
            lines.append(f"REMOVED  {p}")
        for w in self.provenance:
            lines.append(f"PROVENANCE {w}")
        if self.upstream:
            lines.append(f"{len(self.upstream)} object(s) needed by pins or heads are not here but on the upstream; "
                         "they are fetched (verified) on first read")
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
            "damaged_refs": list(self.damaged_refs),
            "wrong_sizes": list(self.wrong_sizes),
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
            "provenance": list(self.provenance),
            "upstream": [str(d) for d in self.upstream],
        }


# -- checking one file ----------------------------------------------------------------------


class _Check(NamedTuple):
    status: str
    """``ok``, ``corrupt`` or ``gone``."""
    nbytes: int
    problem: str
    usize: int = -1
    """A good object's uncompressed size (-1: not known)."""


_GONE = _Check("gone", 0, "")


def _check_file(f: ObjFile, expected: Optional[int], fast: bool) -> _Check:
    """Check one object file found by the scan (see the module docstring)."""
    try:
        fd, st = open_object_file(f.path, f.digest, noatime=True)
    except ObjectNotFoundError:
        return _GONE  # removed since the scan (gc, limit)
    except IntegrityError as e:  # swapped for a link, FIFO or directory since the scan: never followed
        return _Check("corrupt", 0, str(e))
    try:
        return _check_open(f, fd, st.st_size, expected, fast)
    except IntegrityError as e:
        return _Check("corrupt", 0, f"file {f.path} {e}")
    except OSError as e:  # EIO from a failing disk: the copy cannot be trusted
        return _Check("corrupt", 0, f"file {f.path} cannot be read ({e.strerror or e})")
    finally:
        os.close(fd)


def _check_open(f: ObjFile, fd: int, size: int, expected: Optional[int], fast: bool) -> _Check:
    codec = f.codec
    if size == 0 and f.hex != EMPTY_HEX:
        return _Check("corrupt", 0, f"file {f.path} is empty (lost in a crash?)")
    problem = codec.header_problem(fd, size)
    if problem is not None:
        return _Check("corrupt", 0, f"{codec.name} file {f.path} {problem}")
    usize = codec.size_of(fd, size)
    assert usize is not None  # header_problem checked it
    if fast:
        if expected is not None and usize != expected:
            # A truncated object, or a manifest entry that misstates a good object's size (a pulled
            # or hand-written version)?  Sizes cannot tell: the hash decides, for this file only.
            # Hazard (found by a bug hunt): `verify --fast --repair` moved a good object to bad/
            # because one entry of one manifest said 3 bytes.
            r = _check_open(f, fd, size, expected, False)
            if r.status != "ok" and "manifest says" not in r.problem:
                what = "has" if codec.byte_exact else "holds"
                r = r._replace(problem=f"{r.problem}; it {what} {usize} bytes but a manifest says {expected}")
            return r
        return _Check("ok", 0, "", usize)
    # Full mode: the hash decides.  A manifest entry's size can be wrong (an entry
    # recorded with allow_missing, a pulled manifest); a file whose bytes hash to
    # its name is good and must never be quarantined.
    if codec.byte_exact:
        got = hash_fd(fd, size, window=_WINDOW)
        if got != f.digest:
            if expected is not None and size != expected:
                return _Check("corrupt", size, f"file {f.path} has {size} bytes but a manifest says {expected} "
                                               f"(truncated?) and hashes to {got}")
            return _Check("corrupt", size, f"file {f.path} hashes to {got}")
        return _Check("ok", size, "", size)
    # Decoded through the codec's bounded stream: a frame that decodes to more than
    # usize (a decompression bomb) raises after at most usize + 1 bytes of output.
    h = new_hasher()
    n = 0
    with open(fd, "rb", buffering=0, closefd=False) as raw:
        try:
            with codec.open_decoder(raw, usize, what=f"{codec.name} file {f.path}") as reader:
                while True:
                    chunk = reader.read(_CHUNK)
                    if not chunk:
                        break
                    h.update(chunk)
                    n += len(chunk)
        except IntegrityError as e:
            return _Check("corrupt", size, f"{codec.name} file {f.path} cannot be decoded ({e})")
    got_hex = h.hexdigest()
    if got_hex != f.hex or n != usize:
        return _Check("corrupt", size, f"{codec.name} file {f.path} decodes to {n} bytes hashing to "
                                       f"blake3:{got_hex}")
    return _Check("ok", size, "", usize)


# -- incremental state ---------------------------------------------------------------------------


def _state_key(f: ObjFile) -> str:
    return f.hex + f.codec.suffix


STATE_MAX_BYTES = 1 << 28
"""The largest ``state/verify.msgpack`` read (256 MiB: a record for a million objects takes ~100 MiB);
a larger one is ignored (everything is re-hashed) and replaced."""


def _load_state(path: Path) -> Dict[str, StateRecord]:
    # Hazard (found by a bug hunt): the record was read with Path.read_bytes(), so a FIFO planted at
    # state/verify.msgpack (state/ is group-writable in a shared store) hung every full verify forever,
    # and a link to /dev/zero exhausted memory.  read_small_file never follows a link, never waits on
    # a FIFO or device, reads regular files of at most STATE_MAX_BYTES only.
    if not os.path.lexists(path):
        return {}  # the first full verify: nothing to say
    raw = read_small_file(path, STATE_MAX_BYTES)
    if raw is None:
        log.warning("ignoring %s (not a regular file, larger than %d bytes, or unreadable): every object is "
                    "hashed again and the record replaced", path, STATE_MAX_BYTES)
        return {}
    try:
        doc = msgpack.unpackb(raw, raw=False)
        files = doc.get("files") if isinstance(doc, dict) and doc.get("v") == 1 else None
        return files if isinstance(files, dict) else {}
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError):
        return {}  # a lost or damaged record only means re-hashing


def _save_state(store: Store, files: Dict[str, StateRecord]) -> None:
    d = store.root / STATE
    try:
        makedirs(d)
        write_file_atomic(store.objects.tmp, d / STATE_FILE, msgpack.packb({"v": 1, "files": files}),
                          durable=False, mode=0o664 if store.config.shared else 0o644)
    except OSError:  # read-only store: the record is an optimisation
        pass


def _fresh_enough(rec: object, f: ObjFile, now: float, recheck: float) -> bool:
    """Is ``rec`` a record of this very file (size, mtime, inode) verified less than ``recheck`` ago?"""
    if not (isinstance(rec, list) and len(rec) == 4 and rec[:3] == [f.size, f.mtime_ns, f.ino]):
        return False
    at = rec[3]
    return isinstance(at, (int, float)) and not isinstance(at, bool) and now - float(at) < recheck


# -- repair helpers -----------------------------------------------------------------------------


def _quarantine(bad: Path, bad_fd: int, dirs: ObjectDirs, src: Path, name: str) -> Optional[Path]:
    """Move ``src`` (under ``objects/``) to ``bad/<name>`` (``bad_fd``: ``bad/`` opened by
    :func:`open_store_dir`); ``None`` if it is gone or its directory became a link."""
    dir_fd, entry = dirs.locate(src)
    if dir_fd is None:
        return None
    # Both sides by descriptor: the entry itself, never what a link points to, and never into a bad/
    # swapped for a link since the store was opened (found by a bug hunt: corrupt objects and planted
    # stray files were moved by path into bad/ -> /etc/cron.d).
    moved = move_into(dir_fd, entry, bad_fd, name)
    return None if moved is None else bad / moved


def _present_now(objects: LocalObjects, h: str) -> bool:
    """Does a regular object file for ``h`` exist now (put after our scan)?  Planted entries do not count."""
    return bool(objects.scan(h)[0])


# -- verify -------------------------------------------------------------------------------------


def verify(store: Store, *, fast: bool = False, repair: bool = False, incremental: bool = False,
           recheck_after: Duration = "30d", workers: int = 2, progress: Optional[bool] = None) -> VerifyReport:
    """Check every object and every reference; see the module docstring.

    ``workers``: threads hashing files concurrently (BLAKE3 also uses its own
    threads on big files).  ``progress``: a bar on stderr; ``None`` = only when
    stderr is a terminal.
    """
    if isinstance(workers, bool) or not isinstance(workers, int):
        raise InvalidTypeError(f"workers must be an int (hashing threads), not {type(workers).__name__}")
    if workers < 1:
        raise InvalidInputError(f"workers must be at least 1, not {workers}")
    recheck = parse_duration(recheck_after, "recheck_after")
    if repair and not store.writable:  # (found by a bug hunt: "verify failed unexpectedly: Read-only file system")
        raise ReadOnlyError(f"{store.root} cannot be written here (a read-only mount, or another user's store): "
                            "repair moves and removes files; run verify without repair to see what is damaged")
    t0 = time.monotonic()
    now = time.time()
    root = store.root
    objects = store.objects
    files, strays = objects.scan()
    stale = stale_entries(objects.tmp, now=now)

    # References: every stored version of every head and pin (full history).
    need: Dict[str, List[str]] = {}
    expected: Dict[str, int] = {}  # the first size an entry records for each digest
    other_sizes: Dict[str, Set[int]] = {}  # sizes other entries record for it, when they differ
    labels: Dict[Digest, str] = {}  # current versions of heads and pins (to name entries that misstate sizes)
    details: Dict[str, str] = {}
    walk_corrupt: Set[str] = set()  # versions whose bytes failed their hash when read
    unreadable: Set[str] = set()  # versions that hash fine but do not decode
    g = Graph(objects)
    seen_versions: Set[Digest] = set()
    walked_nodes: SeenNodes = {}
    damaged_refs: List[str] = []
    for kind in ("pins", "heads"):
        listing = store.refs.scan(kind)
        damaged_refs += [f"{kind[:-1]} {name!r}: {why}" for name, why in listing.damaged.items()]
        for name, d in listing.refs.items():
            label = f"{kind[:-1]} {name!r}"
            cur: Optional[Digest] = d
            depth = 0
            while cur is not None and cur not in seen_versions:
                where = label if depth == 0 else f"{label} ({depth} back)"
                h = cur.hex
                try:
                    doc = g.doc(cur, where, required=False)
                except IntegrityError as e:
                    walk_corrupt.add(h)
                    need.setdefault(h, []).append(f"{where} (manifest version)")
                    details.setdefault(h, str(e).split(";")[0])
                    break
                except StoreFormatError as e:
                    need.setdefault(h, []).append(f"{where} (manifest version)")
                    details.setdefault(h, str(e))
                    unreadable.add(h)
                    break
                if doc is None:
                    if depth == 0:  # a ref to a missing version; a missing parent was collected by gc
                        need.setdefault(h, []).append(f"{where} (manifest version)")
                    gone = g.missing_trees.get(cur)
                    if gone is not None:  # the version is here, its tree's root node (or bundle) is not
                        need.setdefault(gone, []).append(f"{where} (manifest tree node)")
                    break
                seen_versions.add(cur)
                if depth == 0:  # what a checkout or status of the name reads; history is gc's to drop
                    labels[cur] = where
                need.setdefault(h, []).append(f"{where} (manifest version)")
                try:
                    # Tree-shaped versions: node objects are needed too (yielded before they are read,
                    # so a missing or corrupt one is reported by the object pass); shared nodes once.
                    for key, eh, size in version_refs(doc, walked_nodes):
                        if not key:
                            need.setdefault(eh, []).append(f"{where} (manifest tree node)")
                            continue
                        need.setdefault(eh, []).append(f"{where} entry {key!r}")
                        if size is not None and expected.setdefault(eh, size) != size:
                            other_sizes.setdefault(eh, set()).add(size)
                except (ObjectNotFoundError, IntegrityError):
                    pass  # the node is in `need`: the object pass reports it missing or corrupt
                except StoreFormatError as e:
                    details.setdefault(h, str(e))
                    unreadable.add(h)
                cur = doc.parent
                depth += 1

    # Objects: choose what to check (incremental skips recently verified, unchanged files).
    state = _load_state(root / STATE / STATE_FILE) if not fast else {}
    todo: List[ObjFile] = []
    skipped = 0
    new_state: Dict[str, StateRecord] = {}
    for f in files:
        key = _state_key(f)
        rec = state.get(key)
        if incremental and not fast and f.hex not in walk_corrupt and _fresh_enough(rec, f, now, recheck):
            assert isinstance(rec, list)
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
        if r.status == "gone":
            continue
        checked += 1
        bytes_checked += f.size
        if r.status == "ok":
            good.add(f.hex)
            if not fast:
                new_state[_state_key(f)] = [f.size, f.mtime_ns, f.ino, now]
        else:
            corrupt_files.append(f)
            details[f.hex] = r.problem
    corrupt_hex = sorted({f.hex for f in corrupt_files})
    wrong_sizes = _misstated_sizes(g, labels, files, results, expected, other_sizes)
    present = {f.hex for f in files}
    missing: List[str] = []
    for h in sorted(need):
        if h in present:
            continue
        if _present_now(objects, h):  # put after our scan
            good.add(h)
            continue
        missing.append(h)

    # Read-through: what the upstream holds is not missing here, only not fetched yet (one listing).
    # A corrupt object the upstream holds is not lost either: once repair moves it aside, the next read
    # fetches a good copy.
    up = objects.upstream
    ask = missing + [h for h in corrupt_hex if h in need]
    remote_h = {d.hex for d in up.present(Digest(h) for h in ask)} if up is not None and ask else set()
    missing = [h for h in missing if h not in remote_h]
    for h in missing:
        needers = need[h]
        details[h] = ("referenced by " + ", ".join(needers[:5])
                      + (f" and {len(needers) - 5} more" if len(needers) > 5 else ""))

    quarantined: List[Path] = []
    removed: List[Path] = []
    if repair:
        objdir = root / OBJECTS
        bad = root / BAD
        # (StoreFormatError if bad/ is a link or not a directory: nothing is moved, the error says what to do.)
        bad_fd = open_store_dir(bad) if corrupt_files or strays else -1
        try:
            with ObjectDirs(objdir) as dirs:
                for f in corrupt_files:
                    fan, fname = os.path.basename(os.path.dirname(f.path)), os.path.basename(f.path)
                    moved = _quarantine(bad, bad_fd, dirs, Path(f.path), fan + fname)
                    if moved is not None:
                        quarantined.append(moved)
                        new_state.pop(_state_key(f), None)
                for p in strays:
                    rel = p.relative_to(objdir)
                    moved = _quarantine(bad, bad_fd, dirs, p, "stray-" + str(rel).replace(os.sep, "_"))
                    if moved is not None:
                        quarantined.append(moved)
        finally:
            if bad_fd >= 0:
                os.close(bad_fd)
        if stale:
            removed = sweep_stale(objects.tmp)

    # Needed by a pin or head, with no good copy: report who needs it (never silent).
    lost_h = [h for h in sorted(need) if h not in good and h not in remote_h]
    lost_h = _still_needed(store, lost_h, set(corrupt_hex) | set(missing), good, missing, details)
    lost = {Digest(h): tuple(need[h]) for h in lost_h}
    shown = set(corrupt_hex) | set(missing) | set(lost_h) | unreadable

    if not fast and store.writable:
        _save_state(store, new_state)

    try:
        # The same reading of provenance records as gc's (keep_history 0: pins and current heads).
        provenance = tuple(compute_live(objects, store.refs, 0).warnings)
    except (CasstoreError, OSError):
        provenance = ()  # a root gc cannot read: already reported above as missing, corrupt or unreadable
    return VerifyReport(
        corrupt=tuple(Digest(h) for h in corrupt_hex),
        missing=tuple(Digest(h) for h in missing),
        orphaned=tuple(strays),
        stale_tmp=tuple(stale),
        unreadable=tuple(Digest(h) for h in sorted(unreadable - set(corrupt_hex))),
        details=MappingProxyType({Digest(h): v for h, v in details.items() if h in shown}),
        lost=MappingProxyType(lost),
        quarantined=tuple(quarantined),
        damaged_refs=tuple(damaged_refs),
        wrong_sizes=wrong_sizes,
        provenance=provenance,
        upstream=tuple(Digest(h) for h in sorted(remote_h) if h not in good),
        removed_tmp=tuple(removed),
        checked=checked,
        skipped=skipped,
        bytes_checked=bytes_checked,
        seconds=time.monotonic() - t0,
        fast=fast,
        repaired=repair,
    )


def _still_needed(store: Store, lost_h: List[str], damaged: Set[str], good: Set[str], missing: List[str],
                  details: Dict[str, str]) -> List[str]:
    """``lost_h`` without what vanished while verify ran and no ref needs any more.

    An object present at the scan and gone when its turn came (``_GONE``) is neither corrupt nor
    missing.  Hazard (found by a bug hunt): a gc collecting history while verify ran made verify print
    "LOST ... put the original data again" for each collected object, then "store is healthy".  The
    refs are read again (only then): what they still need and the store no longer has is missing
    (not ok); what they do not need was collected, legitimately, and is not reported.
    """
    vanished = [h for h in lost_h if h not in damaged]
    if not vanished:
        return lost_h
    objects = store.objects
    back = {h for h in vanished if _present_now(objects, h)}  # put again after the scan: good
    good |= back
    vanished = [h for h in vanished if h not in back]
    try:
        live = compute_live(objects, store.refs, 1 << 62).live  # every version, as the walk above
    except (CasstoreError, OSError):
        live = None  # cannot tell: report them as the walk found them
    keep = set(lost_h) - set(vanished) - back
    for h in vanished:
        if live is None or h in live:
            keep.add(h)
            missing.append(h)
            details.setdefault(h, "removed while verify ran (by gc or a size limit?) although a pin or head "
                                  "still references it")
    missing.sort()
    return [h for h in lost_h if h in keep]


_SIZE_LINES_MAX = 100  # entries named per verify; the rest are counted


def _misstated_sizes(g: Graph, labels: Mapping[Digest, str], files: List[ObjFile],
                     results: Mapping[str, _Check], expected: Mapping[str, int],
                     other_sizes: Mapping[str, Set[int]]) -> Tuple[str, ...]:
    """Entries of current versions (``labels``) that record a size other than their good object's.

    The object is good (it hashes to its name); the manifest version is wrong (pulled or written by
    hand: ``edit`` checks sizes against present objects).  Status and checkout trust recorded sizes.
    """
    actual: Dict[str, int] = {}
    for f in files:
        if f.hex not in expected or f.hex in actual:
            continue
        r = results.get(f.path)
        if r is not None:
            if r.status == "ok" and r.usize >= 0:
                actual[f.hex] = r.usize
        elif f.codec.byte_exact:  # skipped (incremental): verified before and unchanged since
            actual[f.hex] = f.size
        else:
            try:
                fd, st = open_object_file(f.path, f.digest, noatime=True)
            except (CasstoreError, OSError):
                continue
            try:
                usize = f.codec.size_of(fd, st.st_size)
            except OSError:
                usize = None
            finally:
                os.close(fd)
            if usize is not None:
                actual[f.hex] = usize
    wrong = {h for h, a in actual.items() if expected[h] != a or h in other_sizes}
    if not wrong:
        return ()
    lines: List[str] = []
    more = 0
    seen: SeenNodes = {}
    for v, where in labels.items():
        try:
            doc = g.doc(v, where, required=False)
            if doc is None:
                continue
            for key, eh, size in version_refs(doc, seen):
                if key and eh in wrong and size is not None and size != actual[eh]:
                    if len(lines) < _SIZE_LINES_MAX:
                        lines.append(f"{where} entry {key!r} records {size} bytes, but blake3:{eh} holds "
                                     f"{actual[eh]}")
                    else:
                        more += 1
        except CasstoreError:
            continue  # a damaged node: reported by the object pass
    if more:
        lines.append(f"... and {more} more entries")
    return tuple(lines)


def _check_all(todo: List[ObjFile], expected: Mapping[str, int], fast: bool, workers: int,
               progress: Optional[bool]) -> Dict[str, _Check]:
    """Check files; returns path -> result.

    Big files are hashed on a pool of ``workers`` threads (BLAKE3 and mmap page
    faults release the GIL); small ones on this thread meanwhile, where a
    thread hop would cost more than the hashing and only contend for the GIL.
    """
    results: Dict[str, _Check] = {}
    total = len(todo) if fast else sum(f.size for f in todo)
    with Progress(total, desc="verify", unit="files" if fast else "B", enabled=progress) as bar:
        big = [] if fast else [f for f in todo if f.size >= _SMALL]
        small = todo if not big else [f for f in todo if f.size < _SMALL]
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="casstore-verify") as ex:
            futs: List[Tuple[ObjFile, Future[_Check]]] = [
                (f, ex.submit(_check_file, f, expected.get(f.hex), False)) for f in big]
            for f in small:
                results[f.path] = _check_file(f, expected.get(f.hex), fast)
                bar.update(1 if fast else f.size)
            for f, fut in futs:
                results[f.path] = fut.result()
                bar.update(f.size)
    return results
