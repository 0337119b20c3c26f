"""Manifest operations: edit transactions, reads, history, freeze, pins, diff.

Model (docs/manifests.md):

* A manifest *version* is an ordinary object (:mod:`casstore.manifests.model`).
* A *head* (``refs/heads/<name>``) names the current version of a mutable
  manifest.  ``store.edit(name)`` is a transaction: it takes the name's lock,
  writes the new version as an object, then moves the ref by rename.
* A *pin* (``refs/pins/<name>``) names a frozen version and never moves.
  ``freeze(name)`` turns a head into a pin.

Invariants kept here (docs/design.md): (2) a version is written as an object
before the ref moves, and every object it names exists when a ref lands on it;
(3) refs move only by atomic rename, readers take no lock; (5) a frozen
manifest or pin never changes.

Lock order: the name's lock (``store.refs.lock(name)``, heads and pins alike;
``rename`` takes two, in sorted name order) FIRST, then the store's GC lock
shared (``_gclock.commit_lock``) while objects are checked and the ref lands,
so gc cannot delete between the check and the ref (docs/maintenance.md).
gc takes no name lock, so the two never deadlock.

Every version read goes through :func:`casstore.manifests.model.load_manifest`
(a verified read and THE decoder): a hostile or damaged version is refused
with StoreFormatError or IntegrityError before anything uses one of its keys.
Versions are addressable wherever a name is read (:func:`resolve_target`):
``NAME~N`` (N versions back along the parent chain) and ``NAME@<hex prefix>``
(a version of that name's history).  A name that exists literally wins, so
heads made before this syntax with ``~`` or ``@`` in them keep working; new
names may not contain either (:func:`check_new_name`).

Crash points for tests: ``manifest.before_object``, ``manifest.after_object``
(the version exists, the ref has not moved), ``manifest.after_ref``.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    ItemsView,
    Iterator,
    List,
    Mapping,
    MutableMapping,
    Optional,
    Sequence,
    Tuple,
    Type,
    Union,
    ValuesView,
)

import msgpack

from .._faults import fault
from .._gclock import commit_lock
from .._lock import DEFAULT_TIMEOUT
from ..digest import Digest
from ..errors import (
    AmbiguousDigestError,
    CasstoreError,
    FrozenError,
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ManifestNotFoundError,
    MissingNodeError,
    NameExistsError,
    ObjectNotFoundError,
    StoreFormatError,
)
from ..refs import Ref, validate_name
from .model import (
    Entry,
    EntryMap,
    ManifestDoc,
    canonical_map,
    entry_from_raw,
    load_manifest,
    looks_like_version,
    put_version,
    read_parent,
    refuse_big_non_manifest,
    validate_key,
)
from .provenance import derive_params, input_labels

if TYPE_CHECKING:
    from ..objects.base import ObjectInfo
    from ..objects.local import StagedObject
    from ..store import Store

__all__ = [
    "Manifest",
    "ManifestEditor",
    "EditTransaction",
    "Diff",
    "MetaDiff",
    "meta_diff",
    "same_meta",
    "resolve_target",
    "check_new_name",
    "read_manifest",
    "remove",
    "rename",
    "NameInfo",
    "list_names",
    "is_internal",
    "public_url",
    "history",
    "freeze",
    "pin",
    "unpin",
    "diff",
]

Target = Union[str, Digest]


def _name(name: object) -> str:
    """A head or pin name (:func:`casstore.refs.validate_name`: the key rules, and no ':')."""
    return validate_name(name)


def check_new_name(name: str) -> str:
    """Refuse ``~`` and ``@`` in a name about to be created: they address versions (``NAME~N``,
    ``NAME@<hex>``), so such a name could be misread.  Existing names keep working (a literal name wins)."""
    for c in "~@":
        if c in name:
            base = name[:max(name.rfind("~"), name.rfind("@"))] or "NAME"
            raise InvalidInputError(
                f"invalid new name {name!r:.200}: {c!r} addresses a version ({base}~N, {base}@<hex>) and "
                "cannot be part of a new name; a version is read-only: edit the name itself, "
                "or pin the version under a new name"
            )
    return name


def _timeout(timeout: object) -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InvalidTypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
    if not timeout >= 0:  # also NaN
        raise InvalidInputError(f"timeout must be >= 0 seconds (or None to wait forever), not {timeout!r}")
    return float(timeout)


class Manifest(Mapping[str, Entry]):
    """An immutable manifest version: ``Mapping[str, Entry]`` plus ``.meta`` and ``.parent``.

    Entries are decoded on access, so opening a 100,000-entry manifest costs
    little more than unpacking its bytes.
    """

    __slots__ = ("digest", "doc", "name", "frozen")

    def __init__(self, digest: Digest, doc: ManifestDoc, *, name: Optional[str] = None,
                 frozen: bool = False) -> None:
        self.digest = digest
        """The version's digest (its identity; ``store.get(digest)`` is its bytes)."""
        self.doc = doc
        """The decoded version (:class:`~casstore.manifests.model.ManifestDoc`)."""
        self.name = name
        """The head or pin it was read through, if any."""
        self.frozen = frozen
        """True when read through a pin or by digest (it can never change)."""

    @property
    def meta(self) -> Mapping[str, Any]:
        """Manifest-level metadata (read-only)."""
        return self.doc.meta

    @property
    def parent(self) -> Optional[Digest]:
        """Digest of the previous version, or ``None`` for the first one."""
        return self.doc.parent

    @property
    def entries(self) -> EntryMap:
        """The entries (this manifest is also that mapping)."""
        return self.doc.entries

    def __getitem__(self, key: str) -> Entry:
        return self.doc.entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.doc.entries)

    def __len__(self) -> int:
        return len(self.doc.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.doc.entries

    def items(self) -> ItemsView[str, Entry]:
        """Entries in key order, streamed (a tree-shaped version reads each leaf once)."""
        return self.doc.entries.items()

    def values(self) -> ValuesView[Entry]:
        """Entries in key order, streamed."""
        return self.doc.entries.values()

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Manifest{label} {self.digest.short()} {len(self)} entries{' frozen' if self.frozen else ''}>"


_EMPTY_ENTRIES = EntryMap()


class ManifestEditor(MutableMapping[str, Entry]):
    """The mutable view handed out by ``store.edit(name)``.

    Values may be :class:`~casstore.Digest`, digest strings or
    :class:`~casstore.Entry`; sizes are filled from the store at commit.
    Keys are checked when set (:func:`~casstore.manifests.model.validate_key`).
    ``.meta`` is a plain dict of msgpack-able values, checked at commit.
    """

    def __init__(self, store: Store, name: str, base: Optional[Manifest], allow_missing: bool) -> None:
        self._store = store
        self.name = name
        """The name being edited."""
        self.base = base
        """The version the edit started from (``None`` for a new name)."""
        self._allow_missing = allow_missing
        self._base_entries: EntryMap = base.entries if base is not None else _EMPTY_ENTRIES
        self._changes: Dict[str, Optional[Entry]] = {}  # key -> new entry, or None: deleted
        # A deep copy (canonical_meta copies): nested values (m.meta["cfg"]["lr"] = 2) must not
        # alias the base version's, or the change would compare equal to the base and be dropped.
        self.meta: Dict[str, Any] = canonical_map(base.meta) if base is not None else {}
        """Manifest-level metadata to commit (a plain, mutable dict): the base version's, without its
        ``"message"`` (a message describes one version, as ``add -m`` sets it)."""
        # Hazard (found by a bug hunt): every later version (a `manifest set`, a pull's merge) carried
        # the message of the last `add -m`, and `casstore log` showed it on each of them.
        self.meta.pop(MESSAGE_KEY, None)
        self._dirty = False
        self.result: Optional[Manifest] = base
        """The committed version after the ``with`` block (or the base if nothing changed)."""
        self._head: Optional[Ref] = None  # the head as read at the start: what the commit's claim expects
        self._staged: List[StagedObject] = []  # published with the version (publish_with)
        self._staged_sizes: Dict[Digest, int] = {}

    def publish_with(self, staged: Sequence[StagedObject], sizes: Mapping[Digest, int]) -> None:
        """Objects staged in this store but not yet published (``LocalObjects.stage_fd``, absent
        from the store) that this edit's entries may name, with their sizes: the commit publishes
        them durably in the same batch as the new version's tree nodes, before the version
        (a folder ``add``: one pair of ``syncfs`` for its last files and its nodes instead of two).
        Whatever the commit does not publish (nothing changed, an error) is removed.
        A size that is not an int >= 0, or that a raw staged file's length contradicts, is an
        :class:`~casstore.errors.InvalidInputError` (the version would record it).
        """
        for it in staged:
            size = sizes.get(it.digest)
            if type(size) is not int or size < 0:
                raise InvalidInputError(f"publish_with: no valid size for staged object {it.digest} ({size!r:.40})")
            held = os.fstat(it.staging.fd).st_size if it.codec.byte_exact else size
            if held != size:
                raise InvalidInputError(f"publish_with: staged object {it.digest} holds {held} bytes, not {size}")
        self._staged.extend(staged)
        self._staged_sizes.update((it.digest, sizes[it.digest]) for it in staged)

    def discard_staged(self) -> None:
        """Remove the staged objects :meth:`publish_with` handed over that were not published."""
        staged, self._staged = self._staged, []
        for it in staged:
            it.staging.abort()

    def __getitem__(self, key: str) -> Entry:
        if key in self._changes:
            e = self._changes[key]
            if e is None:
                raise KeyError(key)
            return e
        return self._base_entries[key]

    def __setitem__(self, key: str, value: Union[Entry, Digest, str]) -> None:
        validate_key(key)
        if isinstance(value, (Digest, str)):
            value = Entry(Digest.parse(value) if isinstance(value, str) else value)
        elif not isinstance(value, Entry):
            raise InvalidTypeError(
                f"manifest values are Digest or Entry, not {type(value).__name__}; "
                f"use m[{key!r}] = store.put(...)"
            )
        self._changes[key] = value
        self._dirty = True

    def __delitem__(self, key: str) -> None:
        if key not in self:
            raise KeyError(key)
        if key in self._base_entries:
            self._changes[key] = None
        else:
            del self._changes[key]
        self._dirty = True

    def __iter__(self) -> Iterator[str]:
        changes = self._changes
        for k in self._base_entries:
            if k not in changes or changes[k] is not None:
                yield k
        for k, e in changes.items():
            if e is not None and k not in self._base_entries:
                yield k

    def __len__(self) -> int:
        n = len(self._base_entries)
        for k, e in self._changes.items():
            n += (e is not None) - (k in self._base_entries)
        return n

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and key in self._changes:
            return self._changes[key] is not None
        return key in self._base_entries

    def _completed(self) -> Dict[str, Optional[Entry]]:
        """The changes with sizes filled in; refuses entries whose objects are missing (unless allowed)."""
        out: Dict[str, Optional[Entry]] = {}
        # One stat per distinct object: a folder-sized edit often names one object many times
        # (1,000,000 entries of one object were 1,000,000 stats).
        infos: Dict[Digest, ObjectInfo] = {}
        for key, e in self._changes.items():
            if e is None:
                out[key] = None
                continue
            # allow_missing allows *missing* objects; a local one is still checked against its size.
            size = self._staged_sizes.get(e.digest)
            if size is not None:  # staged with this edit (publish_with): published with the version
                if e.size is not None and e.size != size:
                    raise InvalidInputError(f"manifest {self.name!r}: entry {key!r} says size {e.size} but "
                                            f"object {e.digest} has {size} bytes")
                out[key] = e if e.size is not None else Entry(e.digest, size, e.meta)
                continue
            try:
                info = infos.get(e.digest)
                if info is None:
                    info = infos[e.digest] = self._store.objects.stat(e.digest)
            except ObjectNotFoundError:
                if self._allow_missing:
                    out[key] = e
                    continue
                raise ObjectNotFoundError(
                    f"manifest {self.name!r}: entry {key!r} refers to {e.digest}, which is not in the store; "
                    "put the object first (or edit(..., allow_missing=True) for remote-only objects)"
                ) from None
            if e.size is not None and e.size != info.size:
                raise InvalidInputError(
                    f"manifest {self.name!r}: entry {key!r} says size {e.size} but object {e.digest} "
                    f"has {info.size} bytes"
                )
            out[key] = e if e.size is not None else Entry(e.digest, info.size, e.meta)
        return out

    def _check_key_conflicts(self, entries: EntryMap, base: Optional[EntryMap]) -> None:
        """Refuse a key that is also a directory of another key ("a" and "a/b"):
        such a manifest could never be checked out.

        Only keys new to ``base`` (the parent's entries) are checked: every writer refuses a
        conflict when it adds a key, so a key the parent already has can only come into one
        through a key added now ("a" added beside an existing "a/b" is caught at "a"; "a/b"
        added under an existing "a" at "a/b").  A re-add of a folder with 100 modified files of
        a tree-shaped version spent 8 ms here, most of it reading leaves for the prefix lookups.
        """
        if base is not None:
            # Keys new to the base, counted without a lookup: len(entries) = len(base) - deleted + new, where
            # every deletion named a base key (or, after a rebase, maybe none: the count then only errs high).
            # A folder's modified files add none (100 lookups of a tree: ~0.8 ms of a 1% add).
            deleted = sum(1 for e in self._changes.values() if e is None)
            if len(entries) - len(base) + deleted <= 0:
                return
        changed = [k for k, e in self._changes.items() if e is not None and (base is None or base.raw(k) is None)]
        if not changed:
            return
        # Point and range lookups only: O(changed keys x depth) on a tree-shaped version, never a scan
        # of every key (a 1,000,000-entry folder must not pay a full listing per one-key edit).
        for key in changed:
            parts = key.split("/")
            for i in range(1, len(parts)):
                prefix = "/".join(parts[:i])
                if prefix in entries:
                    raise InvalidInputError(
                        f"manifest {self.name!r}: key {key!r} needs {prefix!r} to be a directory, "
                        f"but {prefix!r} is also a key; rename one of them"
                    )
            under = entries.ceiling(key + "/")
            if under is not None and under.startswith(key + "/"):
                raise InvalidInputError(
                    f"manifest {self.name!r}: key {key!r} is also the directory of {under!r}; rename one of them"
                )

    def _commit(self) -> Optional[Manifest]:
        meta = canonical_map(self.meta, "manifest metadata")  # bad metadata fails here, before anything is written
        # Compared encoded: 1 == 1.0 == True in Python, but they are different metadata.
        # (A message alone is not a change; nor is the base's message left out.)
        if not self._dirty and (self.base is None and not meta or self.base is not None
                                and _packed_meta(_no_message(meta)) == _packed_meta(_no_message(self.base.meta))):
            return self.base
        completed = self._completed()
        base, head = self.base, self._head
        for attempt in range(_MAX_REBASES):
            entries = (base.entries if base is not None else _EMPTY_ENTRIES).with_changes(completed)
            self._check_key_conflicts(entries, base.entries if base is not None else None)
            doc = ManifestDoc.build(entries, meta, base.digest if base is not None else None)
            fault("manifest.before_object")
            staged, self._staged = self._staged, []  # (published by the first try, or removed)
            digest = put_version(self._store.objects, doc, staged)
            fault("manifest.after_object")  # the version exists; the ref has not moved yet
            # A claim of the head's next position (refs/local.py): under a lock that works it never
            # loses; where locks are granted to everyone another writer may have moved the head since
            # we read it, and then our changes are re-applied on its version (docs/manifests.md).
            if self._store.refs.swap("heads", self.name, digest, head):
                fault("manifest.after_ref")
                return Manifest(digest, doc, name=self.name)
            import random  # (on use: only a writer that lost a race needs it)

            time.sleep(random.random() * 0.0005 * min(attempt + 1, 20))  # losers spread out, not in lockstep
            base, head, meta = self._rebase(meta)
        raise LockTimeout(
            f"manifest {self.name!r}: other writers moved it {_MAX_REBASES} times while this edit was being "
            "committed; nothing was committed -- run the edit again"
        )

    def _rebase(self, meta: Dict[str, Any]) -> Tuple[Optional[Manifest], Optional[Ref], Dict[str, Any]]:
        """The head another writer just made, its ref, and our metadata changes re-applied on it.

        Blind: our entry changes and top-level metadata changes win over theirs, key by key;
        a value we computed from the old base is not recomputed (docs/manifests.md).
        """
        refs = self._store.refs
        if refs.get("pins", self.name) is not None:
            raise FrozenError(f"{self.name!r} was frozen by another process while this edit was open; "
                              "nothing was committed -- edit a new name")
        head = refs.read("heads", self.name)
        if head is None:
            if self.base is not None:
                raise ManifestNotFoundError(
                    f"manifest {self.name!r} was removed or renamed by another process while this edit was "
                    "open; nothing was committed -- edit it again to make it anew"
                )
            return None, None, meta
        base = _load(self._store, head.digest, name=self.name)
        ours = meta_diff(self.base.meta if self.base is not None else {}, meta)
        merged = {k: v for k, v in base.meta.items() if k not in ours.removed}
        merged.update(ours.added)
        merged.update({k: new for k, (_old, new) in ours.changed.items()})
        return base, head, canonical_map(merged, "manifest metadata")


_MAX_REBASES = 1000
"""Lost claims an edit re-applies before giving up: each loss means another edit of the name
committed, so only a name edited by many others without pause can run an edit out of tries."""


MESSAGE_KEY = "message"
"""The metadata key of a version's message (``casstore add -m``, ``casstore log``): never inherited by an edit."""


def _no_message(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    return {k: v for k, v in meta.items() if k != MESSAGE_KEY} if MESSAGE_KEY in meta else meta


def _packed_meta(meta: Mapping[str, Any]) -> bytes:
    return ManifestDoc.build(_EMPTY_ENTRIES, meta, None).encode()


class EditTransaction:
    """Context manager returned by ``store.edit``: lock, yield an editor, commit or discard."""

    def __init__(self, store: Store, name: str, *, timeout: Optional[float], allow_missing: bool) -> None:
        self._store = store
        self._name = _name(name)
        self._timeout = _timeout(timeout)
        self._lock = store.refs.lock(self._name, timeout=self._timeout, what=f"manifest {self._name!r}")
        self._allow_missing = bool(allow_missing)
        self.editor: Optional[ManifestEditor] = None
        """The editor, while the transaction is open."""

    def __enter__(self) -> ManifestEditor:
        self._lock.acquire()
        try:
            refs = self._store.refs
            if refs.get("pins", self._name) is not None:
                raise FrozenError(
                    f"{self._name!r} is frozen (a pin) and can never change; "
                    f"edit a new name, e.g. store.edit({self._name + '-v2'!r})"
                )
            head = refs.read("heads", self._name)
            if head is None:
                check_new_name(self._name)
            base = _load(self._store, head.digest, name=self._name) if head is not None else None
            self.editor = ManifestEditor(self._store, self._name, base, self._allow_missing)
            self.editor._head = head
            return self.editor
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        try:
            if et is None and self.editor is not None:
                # Lock order: the name lock (held), then the GC lock shared: gc cannot delete
                # between our existence checks and the ref landing (docs/maintenance.md).
                with commit_lock(self._store, timeout=self._timeout):
                    self.editor.result = self.editor._commit()
        finally:
            try:
                if self.editor is not None:
                    self.editor.discard_staged()
            finally:
                self._lock.release()


# -- store-level operations (exposed as Store methods) -------------------------


def _load(store: Store, digest: Digest, *, name: Optional[str] = None, frozen: bool = False) -> Manifest:
    try:
        doc = load_manifest(store.objects, digest)
    except MissingNodeError:
        raise  # the version is here, its tree's root node (or bundle) is not: that message says so
    except ObjectNotFoundError:
        where = f" (named {name!r})" if name else ""
        raise ObjectNotFoundError(
            f"manifest version {digest}{where} is missing from the store at {store.root}; "
            "pull it from a remote, or re-point the name"
        ) from None
    return Manifest(digest, doc, name=name, frozen=frozen)


def _is_digest_ref(target: object) -> bool:
    return isinstance(target, Digest) or (isinstance(target, str) and target.startswith("blake3:"))


def _resolve_name(store: Store, name: str) -> Optional[Tuple[Digest, bool]]:
    """(digest, frozen?) of a plain name, pins first; ``None`` if there is no such name."""
    refs = store.refs
    pin_d = refs.get("pins", name)
    if pin_d is not None:
        return pin_d, True
    head = refs.get("heads", name)
    if head is not None:
        return head, False
    # freeze() writes the pin, then removes the head: a reader that looked for the pin
    # just before a freeze and for the head just after it must find the new pin.
    pin_d = refs.get("pins", name)
    if pin_d is not None:
        return pin_d, True
    return None


_MAX_BACK_DIGITS = 18
"""``NAME~N`` with more digits than this is farther back than any history (and int() of a
4,000-digit string is quadratic): it is refused before parsing."""
_HEX = frozenset("0123456789abcdef")


def _version_problem(op: str, arg: str) -> Optional[str]:
    """Why ``op + arg`` (``~N`` or ``@HEX``) is not a version suffix, or ``None``."""
    shown = (op + arg)[:24] + ("..." if len(arg) > 23 else "")
    if op == "~":
        if not arg:
            return "'~' needs a number of versions back (NAME~N, N >= 0)"
        if not (arg.isascii() and arg.isdigit()):
            return f"{shown!r} is not a whole number of versions back (NAME~N, N >= 0)"
        if len(arg) > _MAX_BACK_DIGITS:
            return f"{shown!r} is farther back than any history"
        return None
    hexpart = arg[len("blake3:"):] if arg.startswith("blake3:") else arg
    if not hexpart:
        return "'@' needs a digest prefix (NAME@<hex>, e.g. from `casstore log NAME`)"
    if len(hexpart) > 64 or not set(hexpart.lower()) <= _HEX:
        return f"{shown!r} is not a digest prefix (NAME@<hex>: 1 to 64 hex digits)"
    return None


def _split_version(target: str) -> Optional[Tuple[str, str, str]]:
    """``(name, "~" | "@", suffix)`` split at the last ``~`` or ``@``, or ``None`` if there is neither."""
    i = max(target.rfind("~"), target.rfind("@"))
    if i < 0:
        return None
    return target[:i], target[i], target[i + 1:]


def _parent(store: Store, d: Digest) -> Optional[Digest]:
    """The parent link of version ``d`` (read verified, not decoded); ``None`` at the first
    version, or where older versions were collected by gc."""
    try:
        refuse_big_non_manifest(store.objects, d)
        data = store.objects.read(d, verify=True)
    except (ObjectNotFoundError, StoreFormatError):
        return None
    p = read_parent(data) if looks_like_version(data) else None
    if p is None:
        return None
    # A parent link names anything its writer chose.  Hazard (found by a bug hunt): NAME~N and NAME@HEX
    # read a parent that is 400 MiB of zeros stored compressed whole (846 MB) and counted it as a
    # version.  Only an object that begins as a version is one (its first bytes, read unverified: the
    # version itself is read verified when it is the one asked for).
    try:
        with store.objects.open(p, verify=False) as f:
            head = f.read(32)
    except (ObjectNotFoundError, IntegrityError):  # collected by gc; not a regular file (planted)
        return None
    return p if looks_like_version(head) else None


def _version_of(store: Store, name: str, head: Digest, op: str, arg: str, target: str) -> Digest:
    """The version of ``name`` (current version ``head``) that ``~N`` / ``@HEX`` addresses."""
    if op == "~":
        n = int(arg)
        cur = head
        for i in range(n):
            p = _parent(store, cur)
            if p is None:
                raise ManifestNotFoundError(
                    f"{target!r:.200}: {name!r} has {i + 1} version(s) in this store ({name}~0 .. {name}~{i}; "
                    f"older ones were never made or were collected by gc); see `casstore log {name}`"
                )
            cur = p
        return cur
    prefix = arg[len("blake3:"):].lower() if arg.startswith("blake3:") else arg.lower()
    found: List[Digest] = []
    seen = set()
    walk: Optional[Digest] = head
    while walk is not None and walk not in seen:  # a digest cannot repeat in a real chain; a hostile one ends here
        seen.add(walk)
        if walk.hex.startswith(prefix):
            found.append(walk)
            if len(found) > 1:
                raise AmbiguousDigestError(
                    f"{target!r:.200}: several versions of {name!r} start with {prefix} "
                    f"({found[0].short()}, {found[1].short()}, ...); give more hex digits"
                )
        walk = _parent(store, walk)
    if not found:
        raise ManifestNotFoundError(
            f"{target!r:.200}: no version of {name!r} in this store has a digest starting with {prefix} "
            f"({len(seen)} version(s) checked); see `casstore log {name}`"
        )
    return found[0]


def resolve_target(store: Store, target: Target) -> Tuple[Digest, Optional[str], bool]:
    """Name, version or digest -> (version digest, name, frozen?).  Pins win over heads.

    A ``"blake3:..."`` string (or a unique prefix of one) is a version digest.
    ``NAME~N`` is the version N steps back along NAME's parent chain
    (``NAME~0`` is ``NAME``), ``NAME@<hex>`` the version of NAME's history
    whose digest starts with those hex digits (:class:`AmbiguousDigestError`
    when several do); both are frozen (a version never changes).  A name that
    exists literally wins over that reading.  Anything else is a name;
    :class:`ManifestNotFoundError` when none matches.
    """
    if isinstance(target, Digest):
        return target, None, True
    if not isinstance(target, str):
        raise InvalidTypeError(f"a manifest is named by a str or a Digest, not {type(target).__name__}")
    if _is_digest_ref(target):
        return store.objects.resolve(target), None, True
    literal: Optional[InvalidInputError] = None
    try:
        name = _name(target)
    except InvalidInputError as e:
        literal = e
    else:
        hit = _resolve_name(store, name)
        if hit is not None:
            return hit[0], name, hit[1]
    missing = f"no manifest named {target!r:.200} in the store at {store.root}; see `casstore ls` and `casstore log`"
    split = _split_version(target)
    if split is None:
        if literal is not None:
            raise literal
        raise ManifestNotFoundError(missing)
    base, op, arg = split
    problem = _version_problem(op, arg)
    try:
        base = _name(base)
    except InvalidInputError:
        problem = problem or f"{base!r:.200} is not a valid name"
    if problem is not None:
        if literal is not None:  # not a name, not a version: malformed input
            raise InvalidInputError(f"invalid name or version {target!r:.200}: {problem}") from None
        raise ManifestNotFoundError(f"{missing}; read as a version: {problem}")
    hit = _resolve_name(store, base)
    if hit is None:
        raise ManifestNotFoundError(
            f"no manifest named {base!r:.200} (asked for version {target!r:.200}) in the store at {store.root}; "
            "see `casstore ls`"
        )
    if op == "~" and int(arg) == 0:
        return hit[0], base, hit[1]  # NAME~0 is NAME
    return _version_of(store, base, hit[0], op, arg, target), base, True


def read_manifest(store: Store, target: Target) -> Manifest:
    """Lock-free read of a name's current version (pins first), or of a version by digest."""
    d, name, frozen = resolve_target(store, target)
    return _load(store, d, name=name, frozen=frozen)


def history(store: Store, target: Target, limit: Optional[int] = None) -> List[Manifest]:
    """Versions newest first, following parent links (as far as they are in the store)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise InvalidTypeError(f"limit must be an int or None, not {type(limit).__name__}")
    if limit is not None and limit < 0:
        raise InvalidInputError(f"limit must be >= 0, not {limit}")
    d: Optional[Digest]
    d, name, _frozen = resolve_target(store, target)
    out: List[Manifest] = []
    seen = set()
    while d is not None and d not in seen and (limit is None or len(out) < limit):
        seen.add(d)
        try:
            m = _load(store, d, name=name)
        except ObjectNotFoundError:
            break  # older versions may have been collected by GC
        out.append(m)
        d = m.parent
    return out


def freeze(store: Store, name: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT) -> Digest:
    """Turn head ``name`` into a pin (idempotent); return the frozen version's digest.

    The version is read (verified and decoded) first: a damaged or hostile
    version is never frozen.
    """
    name = _name(name)
    timeout = _timeout(timeout)
    refs = store.refs
    with refs.lock(name, timeout=timeout, what=f"manifest {name!r}"), commit_lock(store, timeout=timeout):
        head = refs.get("heads", name)
        pin_d = refs.get("pins", name)
        if head is None:
            if pin_d is not None:
                return pin_d
            raise ManifestNotFoundError(f"no manifest named {name!r} to freeze")
        if pin_d is None:
            _load(store, head, name=name)
            # Pin first, then drop the head: a crash in between leaves both,
            # and readers and editors already treat the pin as authoritative.
            refs.write("pins", name, head)
        refs.remove("heads", name)
        return pin_d if pin_d is not None else head


def pin(store: Store, name: str, target: Target, *, force: bool = False,
        timeout: Optional[float] = DEFAULT_TIMEOUT, allow_missing: bool = False) -> Digest:
    """Pin a version (by digest or by another name) under ``name``.

    The version must be a valid manifest in the store, and every object it
    names must be there too (invariant 2: nothing refers to a missing object)
    unless ``allow_missing`` (remote-only objects).  GC cannot delete them
    meanwhile: the check runs under the store's commit lock.  The derive inputs
    its provenance record names need not be here; gc keeps those that are
    (docs/maintenance.md, "Provenance": why there is no ``with_inputs``).
    """
    name = _name(name)
    timeout = _timeout(timeout)
    d = resolve_target(store, target)[0]
    refs = store.refs
    with refs.lock(name, timeout=timeout, what=f"pin {name!r}"), commit_lock(store, timeout=timeout):
        man = _load(store, d)  # must exist and be a valid manifest; gc cannot delete it while we hold commit_lock
        if not allow_missing:
            has = store.objects.has
            for key, e in man.entries.items():
                if not has(e.digest):
                    raise ObjectNotFoundError(
                        f"cannot pin {d} as {name!r}: its entry {key!r} refers to {e.digest}, which is "
                        "not in the store (collected by gc or limit?); put it again, or pin with "
                        "allow_missing=True if it lives on a remote"
                    )
        if refs.get("heads", name) is not None:
            raise InvalidInputError(
                f"{name!r} is a head (editable manifest): a pin of that name would hide it; pin the version under "
                f"another name, or pin the head's current version itself with store.freeze({name!r})")
        old = refs.get("pins", name)
        if old is None:
            check_new_name(name)
        if old is not None and old != d and not force:
            raise FrozenError(f"pin {name!r} already points to {old}; pass force=True to move it to {d}")
        if old != d:
            refs.write("pins", name, d)
    return d


def unpin(store: Store, name: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT) -> Digest:
    """Remove a pin's name (its objects stay until garbage collection)."""
    name = _name(name)
    refs = store.refs
    with refs.lock(name, timeout=_timeout(timeout), what=f"pin {name!r}"):
        d = refs.get("pins", name)
        if d is None:
            raise ManifestNotFoundError(f"no pin named {name!r}")
        refs.remove("pins", name)
        return d


def remove(store: Store, name: str, *, force: bool = False,
           timeout: Optional[float] = DEFAULT_TIMEOUT) -> Digest:
    """Delete name ``name`` (a head; a pin only with ``force``); return the version it named.

    Only the name goes: its versions stay as unreferenced objects, and the next
    gc collects them once they are older than its grace period (like any
    unreferenced object; ``keep_history`` counts versions behind *existing*
    heads only).  Until then ``store.pin(NEW, digest)`` brings the version back.
    Serialized with edits on the name's lock: an edit either commits before the
    removal (and is removed with the head) or starts after it, as the first
    version of a fresh head.
    """
    name = _name(name)
    force = _flag(force, "force")
    refs = store.refs
    with refs.lock(name, timeout=_timeout(timeout), what=f"manifest {name!r}"):
        pin_d, head = refs.get("pins", name), refs.get("heads", name)
        if pin_d is None and head is None:
            raise ManifestNotFoundError(f"no head or pin named {name!r} to remove in the store at {store.root}")
        if pin_d is not None and not force:
            raise FrozenError(
                f"{name!r} is a pin (frozen); remove it with force=True (CLI: --force), "
                f"or unpin it first (store.unpin({name!r}) / `casstore unpin {name}`)"
            )
        if head is not None:
            refs.remove("heads", name)  # the head first: a crash leaves the pin, which readers already prefer
        if pin_d is not None:
            refs.remove("pins", name)
        d = pin_d if pin_d is not None else head
        assert d is not None
        return d


def rename(store: Store, old: str, new: str, *, force: bool = False,
           timeout: Optional[float] = DEFAULT_TIMEOUT) -> Digest:
    """Give head (or, with ``force``, pin) ``old`` the name ``new``, history and all; return its version.

    Each ref moves by one ``rename(2)``: a lock-free reader sees the name under
    ``old`` or under ``new``.  An existing ``new`` (head or pin) is refused with
    :class:`NameExistsError` unless ``force``, which replaces it: the moved ref
    lands first and what else ``new`` had is removed after, so a reader of
    ``new`` sees its old version, then the moved one, and never nothing.  Both
    names' locks are held (in sorted order), and the store's GC lock shared, so
    a gc never sees the name under neither.
    """
    old, new = _name(old), _name(new)
    force = _flag(force, "force")
    if old == new:
        raise InvalidInputError(f"rename {old!r} to itself: give another new name")
    if new.startswith(old + "/") or old.startswith(new + "/"):
        # `t/x` -> `t` (or back): one name's ref is a directory the other needs as a file, so no single
        # move can do it (found by a bug hunt: "'t' is a prefix of other names" with none left).  Two
        # moves through an internal name, each whole: a crash between leaves the version under it
        # (`casstore ls --all`), never under no name.
        via = f"_rename/{os.urandom(8).hex()}"
        got = rename(store, old, via, force=force, timeout=timeout)
        try:
            rename(store, via, new, force=force, timeout=timeout)
        except BaseException:
            rename(store, via, old, force=True, timeout=timeout)  # put it back where it was
            raise
        return got
    check_new_name(new)
    timeout = _timeout(timeout)
    refs = store.refs
    with ExitStack() as stack:
        for n in sorted((old, new)):
            stack.enter_context(refs.lock(n, timeout=timeout, what=f"manifest {n!r}"))
        stack.enter_context(commit_lock(store, timeout=timeout))
        src = {k: refs.get(k, old) for k in ("pins", "heads")}
        dst = {k: refs.get(k, new) for k in ("pins", "heads")}
        if src["pins"] is None and src["heads"] is None:
            raise ManifestNotFoundError(f"no head or pin named {old!r} to rename in the store at {store.root}")
        if src["pins"] is not None and not force:
            raise FrozenError(
                f"{old!r} is a pin (frozen); rename it with force=True (CLI: --force), "
                f"or unpin it first (store.unpin({old!r}) / `casstore unpin {old}`)"
            )
        if (dst["pins"] is not None or dst["heads"] is not None) and not force:
            what = "a pin" if dst["pins"] is not None else "a head"
            raise NameExistsError(
                f"{new!r} already exists ({what}); replace it with force=True (CLI: --force), "
                "or choose another name"
            )
        moved: List[str] = []
        try:
            for kind in ("pins", "heads"):  # moves first, removals after: a reader of `new` never finds nothing
                if src[kind] is not None:
                    refs.rename(kind, old, new)
                    moved.append(kind)
        except BaseException:
            # A name left both head and pin by a crashed freeze can clash under `new` in one tree
            # only: put back what moved, so `old` stays whole (the refused `new` had nothing replaced).
            for kind in reversed(moved):
                refs.rename(kind, new, old)
                prior = dst[kind]
                if prior is not None:
                    refs.write(kind, new, prior)
            raise
        for kind in ("heads", "pins"):
            if src[kind] is None and dst[kind] is not None:
                refs.remove(kind, new)
        d = src["pins"] if src["pins"] is not None else src["heads"]
        assert d is not None
        return d


def _flag(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be True or False, not {type(value).__name__}")
    return value


INTERNAL_PREFIX = "_"
"""Names starting with this are internal records (``_fetch/...``): hidden from listings unless asked."""


def is_internal(name: str) -> bool:
    """Whether ``name`` is an internal record (``_fetch/...``), hidden from listings by default."""
    return name.startswith(INTERNAL_PREFIX)


_AUTHORITY = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:)?//([^/]*)(.*)$", re.DOTALL)


def public_url(url: str) -> str:
    """``url`` without user info (``user:token@``), query string and fragment: safe to print.

    Never raises, on any string (fetch records are stored data, possibly hostile).
    """
    s = url.split("#", 1)[0].split("?", 1)[0]
    m = _AUTHORITY.match(s)
    if m is None:
        return s
    return f"{m.group(1) or ''}//{m.group(2).rpartition('@')[2]}{m.group(3)}"


@dataclass(frozen=True, slots=True)
class NameInfo:
    """One name as listed by ``store.names()``."""

    name: str
    kind: str
    """``"head"`` (editable) or ``"pin"`` (frozen)."""
    digest: Digest
    """The version it names (a pin's, where a crash left both a head and a pin)."""
    internal: bool
    """An internal record (``_fetch/...``): listed only with ``include_internal=True``."""
    url: Optional[str] = None
    """For a fetch record: the URL it downloaded, without user info, query or fragment."""


def _record_url(store: Store, d: Digest) -> Optional[str]:
    try:
        meta = load_manifest(store.objects, d).meta
    except (CasstoreError, OSError):  # a listing never fails on one damaged or collected record
        return None
    url = meta.get("url")
    return public_url(url) if meta.get("kind") == "casstore.fetch" and isinstance(url, str) else None


def list_names(store: Store, *, include_internal: bool = False) -> List[NameInfo]:
    """Every head and pin, sorted by name; internal records (``_fetch/...``) only if asked.

    Internal ones are shown with their URL (read from their metadata).
    """
    include_internal = _flag(include_internal, "include_internal")
    pins, heads = store.refs.readable("pins", "listed"), store.refs.readable("heads", "listed")
    out: List[NameInfo] = []
    for name in sorted(set(pins) | set(heads)):
        internal = is_internal(name)
        if internal and not include_internal:
            continue
        kind, d = ("pin", pins[name]) if name in pins else ("head", heads[name])
        out.append(NameInfo(name, kind, d, internal, _record_url(store, d) if internal else None))
    return out


@dataclass(frozen=True, slots=True)
class MetaDiff:
    """Top-level keys of a metadata map added, removed and changed (``a`` -> ``b``).

    Values are compared encoded, as manifests store them: ``1``, ``1.0`` and
    ``True`` are different values.
    """

    added: Mapping[str, Any] = field(default_factory=dict)
    removed: Mapping[str, Any] = field(default_factory=dict)
    changed: Mapping[str, Tuple[Any, Any]] = field(default_factory=dict)
    """key -> (value in ``a``, value in ``b``)."""

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def _packed(value: object) -> bytes:
    # Decoded metadata is canonical (maps sorted), so equal values pack to equal bytes.
    return bytes(msgpack.packb(value, use_bin_type=True))


def same_meta(a: object, b: object) -> bool:
    """Whether two metadata values are the same as stored (``1``, ``1.0`` and ``True`` differ)."""
    return _packed(a) == _packed(b)


def meta_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> MetaDiff:
    """Compare two metadata maps key by key (see :class:`MetaDiff`)."""
    return MetaDiff({k: b[k] for k in b if k not in a}, {k: a[k] for k in a if k not in b},
                    {k: (a[k], b[k]) for k in a if k in b and _packed(a[k]) != _packed(b[k])})


_NO_DIFF = MetaDiff()


@dataclass(frozen=True, slots=True)
class Diff:
    """What changed between two versions (``a`` -> ``b``): entries, metadata, derive params and inputs.

    ``added``/``removed``/``changed`` are the entries (``changed`` includes
    entries whose only change is their metadata; ``entry_meta`` says how).
    ``meta`` compares the manifest-level metadata; ``params`` and ``inputs``
    compare what a derive result records (``meta["derive"]["params"]`` and the
    provenance record ``meta["casstore.inputs"]``, input name -> ``"blake3:..."``
    or ``"manifest blake3:..."``), empty when neither side is a derive result.
    """

    added: Mapping[str, Entry]
    removed: Mapping[str, Entry]
    changed: Mapping[str, Tuple[Entry, Entry]]
    meta: MetaDiff = _NO_DIFF
    """Manifest-level metadata keys added, removed and changed."""
    entry_meta: Mapping[str, MetaDiff] = field(default_factory=dict)
    """For keys in both versions whose entry metadata differs: how."""
    params: MetaDiff = _NO_DIFF
    """Derive params added, removed and changed."""
    inputs: MetaDiff = _NO_DIFF
    """Derive inputs (provenance) added, removed and changed."""
    a: Optional[Digest] = None
    """The version compared from."""
    b: Optional[Digest] = None
    """The version compared to."""

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.meta)


def diff(store: Store, a: Union[Target, Manifest], b: Union[Target, Manifest]) -> Diff:
    """Compare two manifests (names, digests or Manifest objects): entries, metadata, params, inputs."""
    ma = a if isinstance(a, Manifest) else read_manifest(store, a)
    mb = b if isinstance(b, Manifest) else read_manifest(store, b)
    added: Dict[str, Entry] = {}
    removed: Dict[str, Entry] = {}
    changed: Dict[str, Tuple[Entry, Entry]] = {}
    # One merge of both sorted streams; tree-shaped versions skip the subtrees they share unread.
    for k, x, y in ma.entries.diff_raw(mb.entries):
        if x is None:
            assert y is not None
            added[k] = entry_from_raw(y)
        elif y is None:
            removed[k] = entry_from_raw(x)
        else:
            changed[k] = (entry_from_raw(x), entry_from_raw(y))
    entry_meta = {}
    for k, (ex, ey) in changed.items():
        md = meta_diff(ex.meta, ey.meta)
        if md:
            entry_meta[k] = md
    return Diff(added, removed, changed, meta_diff(ma.meta, mb.meta), entry_meta,
                meta_diff(derive_params(ma.meta) or {}, derive_params(mb.meta) or {}),
                meta_diff(input_labels(ma.meta), input_labels(mb.meta)), ma.digest, mb.digest)
