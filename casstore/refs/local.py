"""Local refs: the only mutable files in a store.

``refs/heads/<name>`` holds the digest of a manifest's current version and
moves (by atomic rename, invariant 3) on every committed edit.
``refs/pins/<name>`` holds a frozen manifest digest and never moves unless a
user forces it.  A ref file is one line, ``blake3:<64 hex>\\n``.

Hazards and lock order:

* Reads take no lock: rename guarantees a reader sees the old or the new
  file, complete.  Writers of one name serialize on that name's sidecar lock
  (``locks/names/<blake3(name)[:32]>.lock``, see ``_lock.py``); a caller that
  also takes the store-wide GC lock takes the name lock FIRST, then the GC
  lock (``_gclock.py``).
* A ref file is opened without following symlinks and must be a regular
  file: a planted FIFO cannot hang a reader, a planted link cannot point a
  name outside the store.
* Removing (or renaming away) the last name under a prefix removes the
  directories it left empty (``_prune``), so that prefix can be a name again.
  A writer whose directory is pruned between its ``mkdir`` and its rename
  makes it again and retries (``_PRUNE_RETRIES``); a prefix that is really
  another name's file is told apart by ``_blocked``.
* Listing walks the directory iteratively (no recursion limit): one odd name
  can never break ``heads``, gc, verify or usage for everyone.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Dict, List, Optional

from .._fs import fsync_dir, makedirs, write_file_atomic
from .._layout import HEADS, LOCKS, PINS, TMP
from .._lock import DEFAULT_TIMEOUT, FileLock
from .._paths import MAX_KEY_BYTES, MAX_SEGMENTS, validate_key
from ..digest import Digest, new_hasher
from ..errors import InvalidDigestError, InvalidInputError, InvalidTypeError, StoreFormatError
from .base import KINDS, Ref, RefStore

__all__ = ["LocalRefs", "validate_name"]

def validate_name(name: object) -> str:
    """Validate a head or pin name (a key that also may not contain ':')."""
    validate_key(name, "name")
    assert isinstance(name, str)
    if ":" in name:
        raise InvalidInputError(f"invalid name {name!r}: ':' is reserved for digests like 'blake3:...'")
    return name


def _ref_path(root: Path, kind: str, name: str) -> Path:
    """``<root>/refs/heads/<name>`` or ``<root>/refs/pins/<name>``."""
    return root / (HEADS if kind == "heads" else PINS) / name


def _lock_path(root: Path, kind: str, name: str) -> Path:
    """Sidecar lock file for a name: ``<root>/locks/<kind>/<blake3(name)[:32]>.lock``.

    Hashed, not ``<name>.lock``: the names ``x`` and ``x.lock/y`` are both valid,
    and their lock files would collide (a file where a directory must be).
    """
    h = new_hasher()
    h.update(name.encode("utf-8", "surrogatepass"))
    return root / LOCKS / kind / f"{h.hexdigest()[:32]}.lock"


def _read_ref(root: Path, kind: str, name: str) -> Optional[Digest]:
    """Lock-free read of a ref; ``None`` if it does not exist."""
    p = _ref_path(root, kind, name)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise StoreFormatError(f"ref {p} is a symbolic link or special file, not a ref; remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise StoreFormatError(f"ref {p} is not a regular file (a FIFO or device?); remove it")
        text = os.read(fd, 256)
    finally:
        os.close(fd)
    try:
        return Digest.parse(text.decode("ascii").strip())
    except (UnicodeDecodeError, InvalidDigestError):
        raise StoreFormatError(f"ref {p} is damaged (content {text[:80]!r}); restore it or remove it") from None


def _write_ref(root: Path, kind: str, name: str, digest: Digest, *, durable: bool = True) -> None:
    """Point a ref at ``digest`` by atomic rename (creating parent dirs as needed)."""
    p = _ref_path(root, kind, name)
    for attempt in range(_PRUNE_RETRIES):
        if p.is_dir():
            raise InvalidInputError(f"name {name!r} is a prefix of other names ({p} is a directory); choose another")
        try:
            makedirs(p.parent, durable)  # new dirs: setgid mode copied, entries fsynced when durable
        except (FileExistsError, NotADirectoryError, FileNotFoundError):
            if _blocked(root, kind, p) or attempt == _PRUNE_RETRIES - 1:
                raise InvalidInputError(
                    f"name {name!r} conflicts with an existing name that is a prefix of it; choose another"
                ) from None
            continue  # a directory we were making was pruned meanwhile (_prune): make it again
        try:
            write_file_atomic(root / TMP, p, f"{digest}\n".encode(), durable=durable, mode=0o444)
            return
        except FileNotFoundError:
            if attempt == _PRUNE_RETRIES - 1:
                raise


def _blocked(root: Path, kind: str, p: Path) -> bool:
    """Whether a parent of ref path ``p`` is a file (another name is a prefix of this one).
    Otherwise a failed makedirs/rename lost a race with :func:`_prune` and is retried."""
    base = root / (HEADS if kind == "heads" else PINS)
    for parent in p.parents:
        if parent == base:
            return False
        try:
            st = os.lstat(parent)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            return True
    return False


_PRUNE_RETRIES = 16
"""Attempts to create a ref whose directory other processes keep pruning (each prune needs a
remove of the last name there, so a writer that loses 16 times in a row is not expected)."""


def _list_refs(root: Path, kind: str) -> Dict[str, Digest]:
    """All refs of a kind, name -> digest, sorted by name."""
    base = root / (HEADS if kind == "heads" else PINS)
    out: Dict[str, Digest] = {}
    todo: List[str] = [""]  # an explicit stack: deep names cannot hit a recursion limit
    while todo:
        rel = todo.pop()
        try:
            ents = list(os.scandir(base / rel if rel else base))
        except OSError:  # gone meanwhile, not a directory, or a planted tree past PATH_MAX
            continue
        for ent in ents:
            name = f"{rel}/{ent.name}" if rel else ent.name
            if ent.is_dir(follow_symlinks=False):
                # A valid name has at most MAX_SEGMENTS segments and MAX_KEY_BYTES bytes:
                # deeper subtrees hold no ref, so a planted deep tree is never walked.
                if name.count("/") + 1 < MAX_SEGMENTS and len(name) < MAX_KEY_BYTES:
                    todo.append(name)
                continue
            try:
                name = validate_name(name)
                d = _read_ref(root, kind, name)
            except (InvalidInputError, InvalidTypeError, StoreFormatError):
                continue  # not a ref casstore wrote (verify reports stray files)
            if d is not None:
                out[name] = d
    return dict(sorted(out.items()))


def _prune(root: Path, kind: str, name: str) -> None:
    """Remove the directories of ``name`` left empty (``team/`` after ``team/a`` went), so the
    name ``team`` can be created again.  A writer that made such a directory just before we
    remove it retries its rename after making it again (``Staging.commit``, ``_rename_ref``)."""
    base = root / (HEADS if kind == "heads" else PINS)
    parts = name.split("/")[:-1]
    while parts:
        try:
            os.rmdir(base.joinpath(*parts))
        except OSError:  # not empty (another name lives there), or gone already
            return
        parts.pop()


def _remove_ref(root: Path, kind: str, name: str, *, durable: bool = True) -> bool:
    """Remove a ref file; ``False`` if it did not exist."""
    p = _ref_path(root, kind, name)
    try:
        os.unlink(p)
    except FileNotFoundError:
        return False
    if durable:
        fsync_dir(p.parent)
    _prune(root, kind, name)
    return True


def _rename_ref(root: Path, kind: str, old: str, new: str, *, durable: bool = True) -> bool:
    """Move a ref file to another name by one rename (replacing a ref there); ``False`` if ``old`` did not exist.

    One ``rename(2)``: a lock-free reader sees ``old`` or ``new``, never both and never half a file.
    """
    src, dst = _ref_path(root, kind, old), _ref_path(root, kind, new)
    for attempt in range(_PRUNE_RETRIES):
        if dst.is_dir():
            raise InvalidInputError(f"name {new!r} is a prefix of other names ({dst} is a directory); choose another")
        if not os.path.lexists(src):
            return False
        try:
            makedirs(dst.parent, durable)
            os.rename(src, dst)
            break
        except (FileExistsError, NotADirectoryError, FileNotFoundError):
            if _blocked(root, kind, dst) or attempt == _PRUNE_RETRIES - 1:
                if not os.path.lexists(src):
                    return False
                raise InvalidInputError(
                    f"name {new!r} conflicts with an existing name that is a prefix of it; choose another"
                ) from None
            # a directory we had just made was pruned meanwhile (_prune): make it again
    if durable:
        fsync_dir(dst.parent)  # the new entry first: a power loss may keep both names, never neither
        if src.parent != dst.parent:
            fsync_dir(src.parent)
    _prune(root, kind, old)
    return True


class LocalRefs(RefStore):
    """Heads and pins as files under ``<root>/refs``; compare-and-swap under the name's lock."""

    def __init__(self, root: Path, *, durable: bool = True) -> None:
        self.root = root
        """The store root."""
        self.durable = durable
        """fsync ref files and their directories."""

    def lock(self, name: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT, what: str = "",
             heartbeat: Optional[float] = None) -> FileLock:
        """The lock of one name (heads and pins alike): hold it across a read-modify-write.

        ``heartbeat``: seconds between beats while held, for long work (fetch,
        derive) that waiters must not time out on while it progresses (``_lock.py``).
        """
        return FileLock(_lock_path(self.root, "names", validate_name(name)), timeout=timeout,
                        what=what or f"name {name!r}", heartbeat=heartbeat)

    def read(self, kind: str, name: str) -> Optional[Ref]:
        """Lock-free read; the token of a local ref is its digest."""
        d = _read_ref(self.root, _kind(kind), validate_name(name))
        return None if d is None else Ref(d, d.hex)

    def write(self, kind: str, name: str, digest: Digest) -> None:
        """Point a ref at ``digest`` by atomic rename (the caller holds :meth:`lock`)."""
        _write_ref(self.root, _kind(kind), validate_name(name), digest, durable=self.durable)

    def remove(self, kind: str, name: str) -> bool:
        """Remove a ref (the caller holds :meth:`lock`); ``False`` if it did not exist."""
        return _remove_ref(self.root, _kind(kind), validate_name(name), durable=self.durable)

    def rename(self, kind: str, old: str, new: str) -> bool:
        """Move ref ``old`` to ``new`` by one atomic rename (the caller holds both names' locks);
        ``False`` if ``old`` did not exist.  A ref already at ``new`` is replaced."""
        return _rename_ref(self.root, _kind(kind), validate_name(old), validate_name(new), durable=self.durable)

    def compare_and_swap(self, kind: str, name: str, new: Optional[Digest], expected: Optional[Ref], *,
                         timeout: Optional[float] = DEFAULT_TIMEOUT) -> bool:
        """Move ``name`` to ``new`` (``None``: remove it) only if it still is ``expected``."""
        with self.lock(name, timeout=timeout):
            cur = self.read(kind, name)
            if (cur is None) != (expected is None) or (cur is not None and expected is not None
                                                        and cur.digest != expected.digest):
                return False
            if new is None:
                self.remove(kind, name)
            else:
                self.write(kind, name, new)
            return True

    def list(self, kind: str) -> Dict[str, Digest]:
        """Every ref of a kind, name -> digest, sorted by name."""
        return _list_refs(self.root, _kind(kind))

    def __repr__(self) -> str:
        return f"LocalRefs({str(self.root)!r})"


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidInputError(f"ref kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind
