"""Local refs: the only mutable files in a store.

``refs/heads/<name>`` names a manifest's current version and moves on every
committed edit; ``refs/pins/<name>`` names a frozen version and never moves
unless a user forces it.  Since issue 17 a ref file is only a *cache*: the
truth is the name's **claim log**, ``refs/log/<kind>/<blake3(name)[:32]>/``,
holding one entry per position of the name's history, ``0``, ``1``, ``2``, ...
Entry ``<n>`` is a symbolic link whose target text is the name's value at
position ``n``: ``blake3:<64 hex>`` (a version) or ``removed`` (the name was
removed there).  A ref file is ``blake3:<64 hex>\\n<n>\\n``: the value and
the position it was read at (a file without the second line, written before
the log existed, stands for position ``-1``).

Hazards first, then how each is met:

* **Locks that lie.**  Some NFS and FUSE setups grant every ``flock`` to
  everyone; Lustre without ``-o flock`` refuses it.  With 4 writers whose
  lock never excluded anyone, 81 of 100 one-key edits were lost.  So a
  compare-and-swap never trusts the lock: it *claims* position ``n + 1``
  (the successor of the position ``n`` it read) by creating the entry
  exclusively.  ``symlink(2)`` fails with ``EEXIST`` if anyone created that
  position first, on local filesystems and on NFSv3+ (an exclusive create at
  the server) alike, and the value comes with the creation in one step, so
  there is no empty or half-written claim to read.  Exactly one writer wins
  each position; the others get ``False`` (``edit`` re-applies its changes
  on the winner's version and claims the next one).  Where ``symlink`` is
  refused (EPERM/EOPNOTSUPP/ENOSYS on some FUSE filesystems), a fully
  written and synced temp file is ``link(2)``-ed into place (also exclusive
  and atomic); where that is refused too, the entry is created with
  ``O_CREAT | O_EXCL`` and written at once, and a reader that finds such an
  entry still empty waits for its content (:data:`_INCOMPLETE_WAIT`), then
  reports it as damaged with what to remove.  Locks stay the fast path:
  under a lock that works the holder read the newest position, so its claim
  never loses and no work is redone.
* **A crash between the claim and the ref write.**  The ref file may lag the
  log (the writer died, or two writers wrote the cache out of order).  Every
  read therefore follows the log from the cached position to the newest one
  (one failed ``readlink`` when the cache is current), and a writer's
  expected position is the newest, not the cached one.  A name whose *first*
  claim landed but whose ref file was never written is still found: a
  missing ref file with a log is resolved from the log, and :meth:`list`
  (hence gc's roots) also walks the logs for names without a ref file (the
  log directory holds a ``name`` file for that).
* **A name removed and made again.**  A removal is a claim too: position
  ``n + 1`` holds ``removed``, after which the ref file is deleted.  Making
  the name again claims ``n + 2``: one log, one sequence of positions per
  name, across incarnations, so a writer who read the old incarnation can
  never claim into the new one (its position is taken).  A remover's unlink
  of the ref file can race a re-creator's first ref write; the remover
  checks the log after its unlink and writes the ref file back for a newer
  claim, so a live name never stays unlisted.
* **Renaming a name.**  ``rename(old, new)`` claims the value for ``new``,
  then claims ``removed`` for ``old``: a lock-free reader may see the
  version under both names for a moment, never under neither (a crash in
  between leaves both; the rename can be run again).  Under a working lock
  (``ops.rename`` holds both names' locks) nothing else interleaves.
* **Pins.**  A pin is a ref of kind ``pins`` with its own log; creating,
  forcing and removing a pin are claims like any other.
* **Pruning.**  Claims are kept, never pruned: a writer that read position
  ``n`` and stalled (a paused process, a suspended laptop) may claim
  ``n + 1`` at any later time, and if ``n + 1`` had been deleted meanwhile
  its exclusive create would succeed and fork the history without anyone
  noticing.  Pruning would be safe only with a check the stale writer makes
  after its claim (that position ``n`` still exists, with positions deleted
  strictly oldest first) plus a grace period far beyond any stall; until
  that is needed a claim costs one symbolic link per version (one inode,
  often no data block), next to the version object itself.
* **Durability.**  With ``durable`` the claim's directory is fsynced after
  the claim (``symlink`` has no data to sync; a ``link``-ed or created
  entry's file is fsynced before).  The ref file is written durably only
  when it is created (its directory entry is what listing and gc walk); a
  replacement of an existing one is not fsynced: after a power loss a stale
  or empty ref file is corrected by the log.
* **Non-atomic rename for readers.**  Some FUSE passthroughs let a reader
  see a ref file missing or empty while it is being replaced (39 false "no
  manifest named 'exp'" in 8 x 200 edits on bindfs).  A reader that finds
  the ref file missing or unreadable resolves the name from its log (the
  newest position, found by a galloping search over the positions, which
  are contiguous), so it reports "not found" only for a name with no log
  or whose newest claim is ``removed``.  A damaged ref file of a name with
  no log (written before logs existed) is retried briefly
  (:data:`_READ_RETRIES`), then reported as damaged.
* A ref file or claim is read without following symbolic links out of the
  store: a ref file must be a regular file (a planted FIFO cannot hang a
  reader, a link cannot point a name outside the store); a claim is read
  with ``readlink``, never opened through, and its text must be a digest or
  ``removed``.
* Writers of one name still serialize on that name's sidecar lock where it
  works (``locks/names/<blake3(name)[:32]>.lock``, see ``_lock.py``); a
  caller that also takes the store-wide GC lock takes the name lock FIRST,
  then the GC lock (``_gclock.py``).
* Removing the last name under a prefix removes the directories it left
  empty (``_prune``), so that prefix can be a name again.  A writer whose
  directory is pruned between its ``mkdir`` and its rename makes it again
  and retries (``_PRUNE_RETRIES``); a prefix that is really another name's
  file is told apart by ``_blocked``.  That check runs before a new name's
  first claim, so a name that could never get a ref file is not claimed.
* Listing walks the directory iteratively (no recursion limit): one odd name
  (a file that is not a valid name: not a ref casstore wrote) can never break
  ``heads``, gc, verify or usage for everyone.  A valid name whose ref cannot
  be read is the opposite case: it is listed as damaged, never dropped
  (:class:`~casstore.refs.base.RefListing`), or gc would collect what it holds.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from .._fs import Staging, fsync_dir, makedirs, refuse_links_between, write_file_atomic
from .._layout import HEADS, LOCKS, PINS, REFS, TMP
from .._lock import DEFAULT_TIMEOUT, FileLock
from .._paths import MAX_KEY_BYTES, MAX_SEGMENTS, validate_key
from ..digest import Digest, new_hasher
from ..errors import InvalidDigestError, InvalidInputError, InvalidTypeError, StoreFormatError
from .base import KINDS, Ref, RefListing, RefStore

__all__ = ["LocalRefs", "validate_name", "LOG"]

LOG = f"{REFS}/log"
"""``<root>/refs/log/<kind>/<blake3(name)[:32]>/<position>``: the claim logs (module docstring)."""

_REMOVED = "removed"
_NAME_FILE = "name"
_READ_RETRIES = 50
"""Reads of a damaged ref file of a name without a log before it is reported (2 ms apart: ~0.1 s)."""
_INCOMPLETE_WAIT = 2.0
"""Seconds a reader waits for an ``O_EXCL``-created claim (the last fallback) to get its content."""
_CLAIM_MAX = 300
"""Bytes of a claim written as a file: a digest or ``removed``; anything longer is damaged."""
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EACCES)


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


def _name_hash(name: str) -> str:
    h = new_hasher()
    h.update(name.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


def _lock_path(root: Path, kind: str, name: str) -> Path:
    """Sidecar lock file for a name: ``<root>/locks/<kind>/<blake3(name)[:32]>.lock``.

    Hashed, not ``<name>.lock``: the names ``x`` and ``x.lock/y`` are both valid,
    and their lock files would collide (a file where a directory must be).
    """
    return root / LOCKS / kind / f"{_name_hash(name)}.lock"


def _log_dir(root: Path, kind: str, name: str) -> Path:
    """``<root>/refs/log/<kind>/<blake3(name)[:32]>``: the name's claims (hashed, like its lock)."""
    return root / LOG / kind / _name_hash(name)


@dataclass(frozen=True, slots=True)
class _State:
    """A name as resolved: its newest position, its value there, whether a ref file was found."""

    pos: int
    """Newest claimed position (``-1``: none; a ref file from before logs, or no such name)."""
    digest: Optional[Digest]
    """The value at :attr:`pos`; ``None``: the name does not exist (never made, or removed)."""
    cached: bool
    """A ref file exists (creating one must be durable; replacing it need not be)."""


class _Damaged(Exception):
    """A ref file that does not parse (read mid-replacement where renames are not atomic, or damaged)."""


def _read_ref_file(p: Path) -> Optional[Tuple[Digest, int]]:
    """(value, position) cached in a ref file; ``None`` if there is none; :class:`_Damaged` if unparsable."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise StoreFormatError(f"ref {p} is a symbolic link or special file, not a ref; remove it") from None
        if e.errno == errno.ESTALE:
            raise _Damaged(f"ref {p} was replaced while it was opened (ESTALE); read it again") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return None
        if not stat.S_ISREG(st.st_mode):
            raise StoreFormatError(f"ref {p} is not a regular file (a FIFO or device?); remove it")
        text = os.read(fd, 256)
    except OSError as e:
        # NFS and FUSE passthroughs: the file was replaced between our open and read (the
        # server's inode is gone).  Not damage: the log has the answer, or a second look does.
        if e.errno not in (errno.ESTALE, errno.ENOENT):
            raise
        raise _Damaged(f"ref {p} was replaced while it was read ({e.strerror}); read it again") from None
    finally:
        os.close(fd)
    try:
        lines = text.decode("ascii").split("\n")
        d = Digest.parse(lines[0].strip())
        pos = -1
        if len(lines) > 1 and lines[1].strip():
            pos = int(lines[1].strip())
            if not 0 <= pos < 1 << 62:
                raise ValueError(pos)
        return d, pos
    except (UnicodeDecodeError, InvalidDigestError, ValueError):
        raise _Damaged(f"ref {p} is damaged (content {text[:80]!r}); restore it or remove it") from None


def _read_claim(ld: Path, pos: int) -> Tuple[bool, Optional[Digest]]:
    """(claimed?, value) of position ``pos`` of the log ``ld``; value ``None``: removed there."""
    p = ld / str(pos)
    try:
        try:
            text = os.readlink(p)
        except OSError as e:
            if e.errno != errno.ESTALE:
                raise
            text = os.readlink(p)  # a stale cached handle (NFS): claims never change, so look again
    except (FileNotFoundError, NotADirectoryError):
        return False, None
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        from_file = _read_claim_file(p)  # not a symbolic link: written by a fallback (module docstring)
        if from_file is None:
            return False, None
        text = from_file
    if text == _REMOVED:
        return True, None
    try:
        return True, Digest.parse(text)
    except InvalidDigestError:
        raise StoreFormatError(
            f"claim {p} is damaged (target {text[:80]!r}); remove the newest claims of that name back to the "
            "last good one, then point the name again (casstore pin/edit)"
        ) from None


def _read_claim_file(p: Path) -> Optional[str]:
    """The text of a claim written as a regular file (``link`` or ``O_EXCL`` fallback); ``None`` if gone."""
    deadline = time.monotonic() + _INCOMPLETE_WAIT
    while True:
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):
                raise StoreFormatError(f"claim {p} is a special file; remove it") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreFormatError(f"claim {p} is not a regular file or symbolic link; remove it")
            data = os.read(fd, _CLAIM_MAX)
        finally:
            os.close(fd)
        if data.endswith(b"\n"):
            return data[:-1].decode("ascii", "replace")
        # Only the O_EXCL fallback can show an entry before its content: its writer writes at once.
        if time.monotonic() >= deadline:
            raise StoreFormatError(
                f"claim {p} is incomplete (content {data[:80]!r}): its writer died between creating and "
                "writing it; remove that file (it is the newest claim of its name)"
            )
        time.sleep(0.002)


def _newest(ld: Path) -> Optional[Tuple[int, Optional[Digest]]]:
    """The newest claimed position of log ``ld`` and its value; ``None`` if it has no claim.

    Positions are claimed in order and never deleted, so they are contiguous from 0: a
    galloping search finds the newest in about 2 log2(n) ``readlink`` calls.
    """
    ok, val = _read_claim(ld, 0)
    if not ok:
        return None
    lo, step = 0, 1
    while True:
        hi = lo + step
        ok, v = _read_claim(ld, hi)
        if not ok:
            break
        lo, val, step = hi, v, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ok, v = _read_claim(ld, mid)
        if ok:
            lo, val = mid, v
        else:
            hi = mid
    return lo, val


def _resolve(root: Path, kind: str, name: str) -> _State:
    """The name's newest position and value: the ref file's cache, followed along the log."""
    p = _ref_path(root, kind, name)
    ld = _log_dir(root, kind, name)
    damaged: Optional[_Damaged] = None
    for _ in range(_READ_RETRIES):
        try:
            cached = _read_ref_file(p)
        except _Damaged as e:
            cached, damaged = None, e
        if cached is not None:
            val: Optional[Digest] = cached[0]
            pos = cached[1]
        else:
            found = _newest(ld)
            if found is None:
                if damaged is None:
                    return _State(-1, None, False)  # no ref file and no log: no such name
                time.sleep(0.002)  # a ref file from before logs, mid-replacement: look again
                continue
            pos, val = found
        while True:  # the cache may lag the log (a crash after a claim, writers out of order)
            ok, v = _read_claim(ld, pos + 1)
            if not ok:
                break
            pos, val = pos + 1, v
        return _State(pos, val, cached is not None or damaged is not None)
    assert damaged is not None
    raise StoreFormatError(str(damaged))


def _claim(root: Path, kind: str, name: str, pos: int, value: Optional[Digest], durable: bool) -> bool:
    """Claim position ``pos`` of the name's log for ``value`` (``None``: removed), exclusively.

    ``False`` when another writer claimed it first.
    """
    ld = _log_dir(root, kind, name)
    refuse_links_between(ld, root)  # a planted link at the log would take the claim outside the store
    text = _REMOVED if value is None else str(value)
    path = ld / str(pos)
    for attempt in range(2):
        try:
            os.symlink(text, path)
            break
        except FileExistsError:
            return False
        except FileNotFoundError:
            if attempt:
                raise
            _make_log(root, ld, name, durable)
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            if not os.path.isdir(ld):
                _make_log(root, ld, name, durable)
            return _claim_file(root, path, text, durable)
    if durable:
        fsync_dir(ld)
    return True


def _make_log(root: Path, ld: Path, name: str, durable: bool) -> None:
    """Make a name's log directory with its ``name`` file (read by :func:`_list_refs` for names
    whose first claim landed but whose ref file was never written)."""
    makedirs(ld, durable)
    if not os.path.lexists(ld / _NAME_FILE):
        write_file_atomic(root / TMP, ld / _NAME_FILE, name.encode("utf-8", "surrogatepass"), durable=durable)


def _claim_file(root: Path, path: Path, text: str, durable: bool) -> bool:
    """The fallbacks where symbolic links are refused: ``link`` a written temp file, else ``O_EXCL``."""
    data = f"{text}\n".encode("ascii")
    with Staging(root / TMP, "claim") as st:
        st.write(data)
        if durable:
            st.sync()
        try:
            os.link(st.path, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
        else:
            if durable:
                fsync_dir(path.parent)
            return True
    try:  # no hard links either: create exclusively and write at once (readers wait for the content)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    if durable:
        fsync_dir(path.parent)
    return True


def _refuse_other_kind_clash(root: Path, kind: str, name: str) -> None:
    """Refuse a name that is the folder of a name of the other kind, or has one as its folder.

    Hazard (found by a bug hunt): heads and pins live in two trees, so head ``team`` and pin ``team/best``
    could both be made, and then ``freeze team`` failed ("is a prefix of other names; choose another"):
    the head could never be frozen.  One lstat per level of the name (the same name in the other kind
    is fine: freeze writes the pin of a head's name).
    """
    other = "pins" if kind == "heads" else "heads"
    parts = name.split("/")
    clash = None
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        if os.path.isfile(_ref_path(root, other, prefix)):
            clash = prefix
            break
    else:
        if os.path.isdir(_ref_path(root, other, name)):
            clash = name + "/..."
    if clash is not None:
        raise InvalidInputError(
            f"name {name!r} clashes with the {other[:-1]} {clash!r} (one name would be the other's folder, "
            f"and heads become pins of the same name); rename or remove that {other[:-1]} first "
            "(casstore mv / casstore rm), or choose another name")


def _check_ref_dir(root: Path, kind: str, name: str, durable: bool) -> None:
    """Make the ref file's directory, refusing a name that is a prefix of others or has one as a prefix."""
    p = _ref_path(root, kind, name)
    _refuse_other_kind_clash(root, kind, name)
    for attempt in range(_PRUNE_RETRIES):
        if p.is_dir():
            raise InvalidInputError(f"name {name!r} is a prefix of other names ({p} is a directory); choose another")
        try:
            makedirs(p.parent, durable)  # new dirs: setgid mode copied, entries fsynced when durable
            refuse_links_between(p.parent, root)  # before any claim: a link at a prefix leads outside
            return
        except (FileExistsError, NotADirectoryError, FileNotFoundError):
            if _blocked(root, kind, p) or attempt == _PRUNE_RETRIES - 1:
                raise InvalidInputError(
                    f"name {name!r} conflicts with an existing name that is a prefix of it; choose another"
                ) from None
            # a directory we were making was pruned meanwhile (_prune): make it again


def _write_ref(root: Path, kind: str, name: str, digest: Digest, pos: int, *, durable: bool = True) -> None:
    """Cache ``digest`` at position ``pos`` in the ref file by atomic rename (creating parent dirs)."""
    p = _ref_path(root, kind, name)
    for attempt in range(_PRUNE_RETRIES):
        _check_ref_dir(root, kind, name, durable)
        try:
            write_file_atomic(root / TMP, p, f"{digest}\n{pos}\n".encode(), durable=durable, mode=0o444)
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


def _list_refs(root: Path, kind: str) -> RefListing:
    """All refs of a kind, sorted by name: ref files resolved along their logs, and names whose log
    has claims but no ref file (a crash before a first ref write); a name with a log whose ref or
    newest claim is damaged is listed as damaged, never dropped (:class:`RefListing`)."""
    base = root / (HEADS if kind == "heads" else PINS)
    out: Dict[str, Digest] = {}
    damaged: Dict[str, str] = {}
    seen: Set[str] = set()
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
            except (InvalidInputError, InvalidTypeError):
                continue  # not a ref casstore wrote (verify reports stray files)
            seen.add(_name_hash(name))
            try:
                d = _resolve(root, kind, name).digest
            except StoreFormatError as e:
                # A name casstore claimed (it has a log) is damaged; a file with no log behind it was
                # planted (a FIFO, a link, junk: test_hostile_names), not a ref: verify reports it.
                if os.path.isdir(_log_dir(root, kind, name)):
                    damaged[name] = str(e)
                continue
            if d is not None:
                out[name] = d
    for name in _unlisted(root, kind, seen):
        try:
            d = _resolve(root, kind, name).digest
        except StoreFormatError as e:
            damaged[name] = str(e)
            continue
        if d is not None:
            out[name] = d
    return RefListing(dict(sorted(out.items())), dict(sorted(damaged.items())))


def _unlisted(root: Path, kind: str, seen: Set[str]) -> List[str]:
    """Names with a log but no ref file (hashes not in ``seen``), read from their logs' ``name`` files."""
    out: List[str] = []
    try:
        ents = list(os.scandir(root / LOG / kind))
    except OSError:
        return out
    for ent in ents:
        if ent.name in seen or not ent.is_dir(follow_symlinks=False):
            continue
        try:
            fd = os.open(Path(ent.path) / _NAME_FILE, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # a log whose first claim never happened
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            raw = os.read(fd, MAX_KEY_BYTES + 1)
        finally:
            os.close(fd)
        try:
            name = validate_name(raw.decode("utf-8", "surrogatepass"))
        except (UnicodeDecodeError, InvalidInputError, InvalidTypeError):
            continue
        if _name_hash(name) == ent.name:  # a planted or misplaced name file is ignored
            out.append(name)
    return out


def _prune(root: Path, kind: str, name: str) -> None:
    """Remove the directories of ``name`` left empty (``team/`` after ``team/a`` went), so the
    name ``team`` can be created again.  A writer that made such a directory just before we
    remove it retries its rename after making it again (``Staging.commit``, ``_write_ref``)."""
    base = root / (HEADS if kind == "heads" else PINS)
    parts = name.split("/")[:-1]
    while parts:
        try:
            os.rmdir(base.joinpath(*parts))
        except OSError:  # not empty (another name lives there), or gone already
            return
        parts.pop()


def _token(state: _State) -> str:
    return f"{state.pos}:{'' if state.digest is None else state.digest.hex}"


_BLIND_TRIES = 10_000
"""Claims a blind :meth:`LocalRefs.write` or :meth:`LocalRefs.remove` makes before giving up: each
lost claim means another writer moved the name, so only a name moved thousands of times a second
by others can starve one."""


class LocalRefs(RefStore):
    """Heads and pins as files under ``<root>/refs``: a compare-and-swap claims the next position of
    the name's log exclusively (correct without locks); the name's lock makes claims never lose where
    locks work."""

    def __init__(self, root: Path, *, durable: bool = True) -> None:
        self.root = root
        """The store root."""
        self.durable = durable
        """fsync claims, new ref files and their directories."""

    def lock(self, name: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT, what: str = "",
             heartbeat: Optional[float] = None) -> FileLock:
        """The lock of one name (heads and pins alike): hold it across a read-modify-write.

        Only the fast, fair path: correctness never depends on it (a :meth:`swap` is a
        claim that loses if anyone moved the name, lock or no lock).  ``heartbeat``:
        seconds between beats while held, for long work (fetch, derive) that waiters
        must not time out on while it progresses (``_lock.py``).
        """
        return FileLock(_lock_path(self.root, "names", validate_name(name)), timeout=timeout,
                        what=what or f"name {name!r}", heartbeat=heartbeat)

    def read(self, kind: str, name: str) -> Optional[Ref]:
        """Lock-free read, following the name's log past a lagging ref file.

        The token is ``<position>:<hex>``: a compare-and-swap against it loses once the
        name moved, even back to the same digest."""
        st = _resolve(self.root, _kind(kind), validate_name(name))
        return None if st.digest is None else Ref(st.digest, _token(st))

    def swap(self, kind: str, name: str, new: Optional[Digest], expected: Optional[Ref]) -> bool:
        """:meth:`compare_and_swap` without taking the name's lock (the caller holds it, or runs
        where locks do not work): correct either way, since the move is an exclusive claim."""
        kind, name = _kind(kind), validate_name(name)
        st = _resolve(self.root, kind, name)
        if expected is None:
            if st.digest is not None:
                return False
        elif st.digest is None or _token(st) != expected.token:
            return False
        return self._move(kind, name, st, new)

    def _move(self, kind: str, name: str, st: _State, new: Optional[Digest]) -> bool:
        """Claim the position after ``st`` for ``new``, then update the ref file; ``False`` if lost."""
        root, durable = self.root, self.durable
        if new is not None and not st.cached:
            _check_ref_dir(root, kind, name, durable)  # never claim a name that could get no ref file
        pos = st.pos + 1
        if not _claim(root, kind, name, pos, new, durable):
            return False
        if new is None:
            self._uncache(kind, name)
            return True
        try:
            _write_ref(root, kind, name, new, pos, durable=durable and not st.cached)
        except (InvalidInputError, StoreFormatError):
            # A name that is a prefix of this one (or has it as a prefix), or a planted link, appeared
            # since the check: take the claim back (removed), so the log never holds a name no
            # listing can show.
            _claim(root, kind, name, pos + 1, None, durable)
            raise
        return True

    def _uncache(self, kind: str, name: str) -> None:
        """Delete a removed name's ref file; put it back if a newer claim made the name again meanwhile."""
        try:
            os.unlink(_ref_path(self.root, kind, name))
        except FileNotFoundError:
            pass
        _prune(self.root, kind, name)
        # Unsynced on purpose: the removal's claim is durable; a ref file back after a power loss
        # is followed to that claim.  A re-creator's first ref write may have landed just before our
        # unlink: its claim is in the log, so resolving again finds it.
        st = _resolve(self.root, kind, name)
        if st.digest is not None and not st.cached:
            _write_ref(self.root, kind, name, st.digest, st.pos, durable=self.durable)

    def write(self, kind: str, name: str, digest: Digest) -> None:
        """Point a ref at ``digest`` (a blind write: the name's next position, whatever it held).

        Meant under :meth:`lock`; where locks do not work, racing blind writes all land,
        one after the other, and the last one wins (no fork, no half state)."""
        kind, name = _kind(kind), validate_name(name)
        for _ in range(_BLIND_TRIES):
            if self._move(kind, name, _resolve(self.root, kind, name), digest):
                return
        raise _starved(name)

    def remove(self, kind: str, name: str) -> bool:
        """Remove a ref (a blind removal, meant under :meth:`lock`); ``False`` if it did not exist."""
        kind, name = _kind(kind), validate_name(name)
        for _ in range(_BLIND_TRIES):
            st = _resolve(self.root, kind, name)
            if st.digest is None:
                if st.cached:  # a removal that crashed before deleting the ref file
                    self._uncache(kind, name)
                return False
            if self._move(kind, name, st, None):
                return True
        raise _starved(name)

    def rename(self, kind: str, old: str, new: str) -> bool:
        """Give ref ``old``'s value to ``new``, then remove ``old`` (meant under both names' locks);
        ``False`` if ``old`` did not exist.  A ref already at ``new`` is replaced.

        Two claims: a lock-free reader may see the value under both names for a moment,
        never under neither; a crash in between leaves both (run the rename again)."""
        kind, old, new = _kind(kind), validate_name(old), validate_name(new)
        d = _resolve(self.root, kind, old).digest
        if d is None:
            return False
        self.write(kind, new, d)
        self.remove(kind, old)
        return True

    def compare_and_swap(self, kind: str, name: str, new: Optional[Digest], expected: Optional[Ref], *,
                         timeout: Optional[float] = DEFAULT_TIMEOUT) -> bool:
        """Move ``name`` to ``new`` (``None``: remove it) only if it still is ``expected``.

        Under the name's lock (the fast path), by an exclusive claim (the guarantee)."""
        with self.lock(name, timeout=timeout):
            return self.swap(kind, name, new, expected)

    def scan(self, kind: str) -> RefListing:
        """Every ref of a kind, readable and damaged (:class:`RefListing`)."""
        return _list_refs(self.root, _kind(kind))

    def __repr__(self) -> str:
        return f"LocalRefs({str(self.root)!r})"


def _starved(name: str) -> StoreFormatError:
    return StoreFormatError(
        f"name {name!r}: gave up after {_BLIND_TRIES} tries, other writers kept moving it; "
        "find what writes it in a loop and stop it, then run again"
    )


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidInputError(f"ref kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind
