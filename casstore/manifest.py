"""Manifests: named, versioned maps from keys to object entries; freeze and pins.

Model (docs/manifests.md):

* A manifest *version* is an ordinary object: canonical msgpack of its
  entries, its metadata and its parent version's digest.  Same content and
  parent -> same bytes -> same digest, in any process.
* A *head* (``refs/heads/<name>``) names the current version of a mutable
  manifest.  ``store.edit(name)`` is a transaction: it takes the name's fcntl
  lock, writes the new version as an object, then moves the ref by rename.
* A *pin* (``refs/pins/<name>``) names a frozen version and never moves.
  ``freeze(name)`` turns a head into a pin.

Invariants kept here (docs/design.md): (2) a version is written as an object
before the ref moves; (3) refs move only by atomic rename, readers take no
lock; (5) a frozen manifest or pin never changes.
"""

from __future__ import annotations

import bisect
import copy
import errno
import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Mapping,
    MutableMapping,
    Optional,
    Tuple,
    Type,
    Union,
)

import msgpack

from ._fs import fsync_dir
from ._gclock import commit_lock
from ._lock import DEFAULT_TIMEOUT, FileLock
from .digest import Digest
from .errors import (
    FrozenError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
    StoreFormatError,
)
from .refs import lock_path, read_ref, ref_path, validate_key, validate_name, write_ref

if TYPE_CHECKING:
    from .store import Store

__all__ = [
    "Entry",
    "Manifest",
    "ManifestEditor",
    "Diff",
    "encode_manifest",
    "decode_manifest",
    "MANIFEST_FORMAT",
]

MANIFEST_FORMAT = 1
_KIND = "manifest"

# Test-only fault injection: a callable run at named points of a commit
# (tests SIGKILL the process there to prove crash safety).
_fault_hook: Optional[Callable[[str], None]] = None


def _fault(point: str) -> None:
    if _fault_hook is not None:
        _fault_hook(point)


def _canonical(value: Any, where: str) -> Any:
    """Return ``value`` with dicts key-sorted; refuse anything msgpack can't carry exactly."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        if isinstance(value, int) and not isinstance(value, bool) and not (-(2**63) <= value < 2**64):
            raise InvalidInputError(f"{where}: integer {value} does not fit in 64 bits")
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, where) for v in value]
    if isinstance(value, Mapping):
        out = {}
        for k in sorted(value, key=lambda k: (not isinstance(k, str), str(k))):
            if not isinstance(k, str):
                raise InvalidInputError(f"{where}: metadata keys must be str, got {k!r}")
            out[k] = _canonical(value[k], where)
        return out
    raise InvalidInputError(
        f"{where}: {type(value).__name__} is not msgpack-able; use None, bool, int, float, str, bytes, "
        "lists and str-keyed dicts"
    )


def _packed_meta(meta: Mapping[str, Any]) -> bytes:
    return msgpack.packb(_canonical(dict(meta), "manifest metadata"), use_bin_type=True)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class Entry:
    """One manifest entry: an object's digest, its size, and free-form metadata."""

    digest: Digest
    size: Optional[int] = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.digest, str):
            object.__setattr__(self, "digest", Digest.parse(self.digest))
        elif not isinstance(self.digest, Digest):
            raise InvalidTypeError(f"Entry.digest must be a Digest, not {type(self.digest).__name__}")
        if self.size is not None and (not isinstance(self.size, int) or isinstance(self.size, bool)
                                      or self.size < 0):
            raise InvalidInputError(f"Entry.size must be a non-negative int or None, not {self.size!r}")
        if not isinstance(self.meta, Mapping):
            raise InvalidTypeError(f"Entry.meta must be a mapping, not {type(self.meta).__name__}")

    def _encode(self, key: str) -> List[Any]:
        meta = _canonical(self.meta, f"metadata of {key!r}")
        return [self.digest.raw, self.size] + ([meta] if meta else [])


def _entry_from_raw(key: str, raw: Any, digest: Optional[Digest]) -> Entry:
    try:
        if not isinstance(raw, list) or not raw or not isinstance(raw[0], bytes):
            raise TypeError("entry")  # else Digest.from_bytes may fail with AttributeError
        d = Digest.from_bytes(raw[0])
        size = raw[1]
        meta = raw[2] if len(raw) > 2 else {}
        if size is not None and not isinstance(size, int):
            raise TypeError("size")
        if not isinstance(meta, dict):
            raise TypeError("meta")
        return Entry(d, size, MappingProxyType(meta))
    except (TypeError, IndexError, KeyError, InvalidDigestError, InvalidInputError):
        raise StoreFormatError(f"manifest {digest}: entry {key!r} is malformed ({raw!r:.80})") from None


def encode_manifest(entries: Mapping[str, Union[Entry, List[Any]]], meta: Mapping[str, Any],
                    parent: Optional[Digest]) -> bytes:
    """Canonical msgpack bytes of a manifest version (sorted keys, format field)."""
    return _pack(_manifest_doc(entries, meta, parent))


def _pack(doc: Dict[str, Any]) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)  # type: ignore[no-any-return]


def _manifest_doc(entries: Mapping[str, Union[Entry, List[Any]]], meta: Mapping[str, Any],
                  parent: Optional[Digest]) -> Dict[str, Any]:
    """The document :func:`encode_manifest` packs (what ``decode_manifest`` returns for it)."""
    enc: Dict[str, Any] = {}
    for k in sorted(entries):
        v = entries[k]
        enc[k] = v._encode(k) if isinstance(v, Entry) else v
    doc = {
        "casstore": _KIND,
        "entries": enc,
        "meta": _canonical(dict(meta), "manifest metadata"),
        "parent": parent.raw if parent is not None else None,
        "v": MANIFEST_FORMAT,
    }
    return doc


def decode_manifest(data: bytes, digest: Optional[Digest] = None) -> Dict[str, Any]:
    """Parse manifest bytes with msgpack limits; StoreFormatError on anything malformed."""
    n = len(data)
    try:
        doc = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True,
            max_str_len=n, max_bin_len=n, max_array_len=n,
            max_map_len=n, max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            msgpack.UnpackException) as e:
        raise StoreFormatError(f"object {digest} is not a valid manifest ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict) or doc.get("casstore") != _KIND:
        raise StoreFormatError(f"object {digest} is not a casstore manifest")
    v = doc.get("v")
    if type(v) is int and v > MANIFEST_FORMAT:
        raise StoreFormatError(f"manifest {digest} has format {v!r}, newer than this casstore; upgrade it")
    if type(v) is not int or v != MANIFEST_FORMAT:  # format.md: readers refuse versions they do not know
        raise StoreFormatError(f"manifest {digest} has unknown format {v!r} (expected {MANIFEST_FORMAT})")
    if not isinstance(doc.get("entries"), dict) or not isinstance(doc.get("meta"), dict):
        raise StoreFormatError(f"manifest {digest} lacks its entries or meta map")
    parent = doc.get("parent")
    if parent is not None and not (isinstance(parent, bytes) and len(parent) == 32):
        raise StoreFormatError(f"manifest {digest} has a malformed parent link")
    return doc


class Manifest(Mapping[str, Entry]):
    """An immutable manifest version: ``Mapping[str, Entry]`` plus ``.meta``.

    Entries are decoded lazily on access, so opening a 100,000-entry manifest
    costs little more than ``msgpack.unpackb`` of its bytes.
    """

    __slots__ = ("digest", "name", "frozen", "_entries", "_meta", "_parent")

    def __init__(self, digest: Digest, doc: Dict[str, Any], *, name: Optional[str] = None,
                 frozen: bool = False) -> None:
        self.digest = digest
        """The version's digest (its identity; ``store.get(digest)`` is its bytes)."""
        self.name = name
        """The head or pin it was read through, if any."""
        self.frozen = frozen
        """True when read through a pin (it can never change)."""
        self._entries: Dict[str, Any] = doc["entries"]
        self._meta: Dict[str, Any] = doc["meta"]
        p = doc.get("parent")
        self._parent = Digest.from_bytes(p) if p is not None else None

    @property
    def meta(self) -> Mapping[str, Any]:
        """Manifest-level metadata (read-only)."""
        return MappingProxyType(self._meta)

    @property
    def parent(self) -> Optional[Digest]:
        """Digest of the previous version, or ``None`` for the first one."""
        return self._parent

    def __getitem__(self, key: str) -> Entry:
        return _entry_from_raw(key, self._entries[key], self.digest)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def raw_entry(self, key: str) -> Any:
        """The encoded entry (for fast comparisons)."""
        return self._entries[key]

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Manifest{label} {self.digest.short()} {len(self)} entries{' frozen' if self.frozen else ''}>"


class ManifestEditor(MutableMapping[str, Entry]):
    """The mutable view handed out by ``store.edit(name)``.

    Values may be :class:`Digest`, digest strings or :class:`Entry`; sizes are
    filled from the store.  ``.meta`` is a plain dict of msgpack-able values.
    """

    def __init__(self, store: Store, name: str, base: Optional[Manifest], allow_missing: bool) -> None:
        self._store = store
        self.name = name
        self.base = base
        self._allow_missing = allow_missing
        self._entries: Dict[str, Any] = dict(base._entries) if base is not None else {}
        # A deep copy: nested values (m.meta["cfg"]["lr"] = 2) must not alias the base
        # version's, or the change would compare equal to the base and be dropped.
        self.meta: Dict[str, Any] = copy.deepcopy(base._meta) if base is not None else {}
        self._changed: Dict[str, Entry] = {}
        self._dirty = False
        self.result: Optional[Manifest] = base
        """The committed version after the ``with`` block (or the base if nothing changed)."""

    def __getitem__(self, key: str) -> Entry:
        v = self._entries[key]
        return v if isinstance(v, Entry) else _entry_from_raw(key, v, self.base.digest if self.base else None)

    def __setitem__(self, key: str, value: Union[Entry, Digest, str]) -> None:
        validate_key(key)
        if isinstance(value, (Digest, str)):
            value = Entry(Digest.parse(value) if isinstance(value, str) else value)
        elif not isinstance(value, Entry):
            raise InvalidTypeError(
                f"manifest values are Digest or Entry, not {type(value).__name__}; "
                f"use m[{key!r}] = store.put(...)"
            )
        _canonical(value.meta, f"metadata of {key!r}")  # refuse bad metadata now, not at commit
        self._entries[key] = value
        self._changed[key] = value
        self._dirty = True

    def __delitem__(self, key: str) -> None:
        del self._entries[key]
        self._changed.pop(key, None)
        self._dirty = True

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _complete_entries(self) -> None:
        """Fill sizes and refuse entries whose objects are missing (unless allowed)."""
        for key, e in self._changed.items():
            # allow_missing allows *missing* objects; a local one is still checked against its size.
            try:
                info = self._store.stat(e.digest)
            except ObjectNotFoundError:
                if self._allow_missing:
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
            if e.size is None:
                self._entries[key] = Entry(e.digest, info.size, e.meta)

    def _check_key_conflicts(self) -> None:
        """Refuse a key that is also a directory of another key ("a" and "a/b"):
        such a manifest could never be checked out."""
        changed = [k for k in self._changed if k in self._entries]
        if not changed:
            return
        ordered = sorted(self._entries)
        for key in changed:
            parts = key.split("/")
            for i in range(1, len(parts)):
                prefix = "/".join(parts[:i])
                if prefix in self._entries:
                    raise InvalidInputError(
                        f"manifest {self.name!r}: key {key!r} needs {prefix!r} to be a directory, "
                        f"but {prefix!r} is also a key; rename one of them"
                    )
            j = bisect.bisect_left(ordered, key + "/")
            if j < len(ordered) and ordered[j].startswith(key + "/"):
                raise InvalidInputError(
                    f"manifest {self.name!r}: key {key!r} is also the directory of {ordered[j]!r}; rename one of them"
                )

    def _commit(self) -> Optional[Manifest]:
        base_meta = self.base._meta if self.base is not None else {}
        # Compare encodings too: 1 == 1.0 == True in Python, but they are different metadata.
        if not self._dirty and self.meta == base_meta and _packed_meta(self.meta) == _packed_meta(base_meta):
            return self.base
        self._check_key_conflicts()
        self._complete_entries()
        parent = self.base.digest if self.base is not None else None
        doc = _manifest_doc(self._entries, self.meta, parent)
        data = _pack(doc)
        _fault("before-object")
        digest = self._store.put(data, compress=False)
        _fault("after-object")  # the version exists; the ref has not moved yet
        write_ref(self._store.root, "heads", self.name, digest, durable=self._store.durable)
        _fault("after-ref")
        # The document we packed is what decoding the bytes would give back.
        return Manifest(digest, doc, name=self.name)


class EditTransaction:
    """Context manager returned by ``store.edit``: lock, yield an editor, commit or discard."""

    def __init__(self, store: Store, name: str, *, timeout: Optional[float], allow_missing: bool) -> None:
        self._store = store
        self._name = validate_name(name)
        self._lock = FileLock(lock_path(store.root, "names", self._name), timeout=timeout,
                              what=f"manifest {self._name!r}")
        self._allow_missing = allow_missing
        self.editor: Optional[ManifestEditor] = None

    def __enter__(self) -> ManifestEditor:
        self._lock.acquire()
        try:
            root = self._store.root
            if read_ref(root, "pins", self._name) is not None:
                raise FrozenError(
                    f"{self._name!r} is frozen (a pin) and can never change; "
                    f"edit a new name, e.g. store.edit({self._name + '-v2'!r})"
                )
            head = read_ref(root, "heads", self._name)
            base = _load(self._store, head, name=self._name) if head is not None else None
            self.editor = ManifestEditor(self._store, self._name, base, self._allow_missing)
            return self.editor
        except BaseException:
            self._lock.release()
            raise

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        try:
            if et is None and self.editor is not None:
                # The store's GC lock, shared: gc cannot delete between our existence
                # checks and the ref landing (docs/maintenance.md).
                with commit_lock(self._store, timeout=self._lock.timeout):
                    self.editor.result = self.editor._commit()
        finally:
            self._lock.release()


# -- store-level operations (exposed as Store methods) -------------------------


def _load(store: Store, digest: Digest, *, name: Optional[str] = None, frozen: bool = False) -> Manifest:
    try:
        data = store.get(digest)
    except ObjectNotFoundError:
        where = f" (named {name!r})" if name else ""
        raise ObjectNotFoundError(f"manifest version {digest}{where} is missing from the store") from None
    return Manifest(digest, decode_manifest(data, digest), name=name, frozen=frozen)


def _is_digest_ref(target: Union[str, Digest]) -> bool:
    return isinstance(target, Digest) or (isinstance(target, str) and target.startswith("blake3:"))


def resolve_target(store: Store, target: Union[str, Digest]) -> Tuple[Digest, Optional[str], bool]:
    """Name or digest -> (version digest, name, frozen?).  Pins win over heads."""
    if _is_digest_ref(target):
        d = target if isinstance(target, Digest) else store.resolve(target)
        return d, None, True
    name = validate_name(target)
    pin = read_ref(store.root, "pins", name)
    if pin is not None:
        return pin, name, True
    head = read_ref(store.root, "heads", name)
    if head is not None:
        return head, name, False
    # freeze() writes the pin, then removes the head: a reader that looked for the pin
    # just before a freeze and for the head just after it must find the new pin.
    pin = read_ref(store.root, "pins", name)
    if pin is not None:
        return pin, name, True
    raise ObjectNotFoundError(
        f"no manifest named {name!r} in the store at {store.root}; see `casstore pins` and `casstore log`"
    )


def read_manifest(store: Store, target: Union[str, Digest]) -> Manifest:
    """Lock-free read of a name's current version, or of a version by digest."""
    d, name, frozen = resolve_target(store, target)
    return _load(store, d, name=name, frozen=frozen)


def history(store: Store, target: Union[str, Digest], limit: Optional[int] = None) -> List[Manifest]:
    """Versions newest first, following parent links."""
    out: List[Manifest] = []
    d: Optional[Digest] = resolve_target(store, target)[0]
    name = None if _is_digest_ref(target) else str(target)
    while d is not None and (limit is None or len(out) < limit):
        try:
            m = _load(store, d, name=name)
        except ObjectNotFoundError:
            break  # older versions may have been collected by GC
        out.append(m)
        d = m.parent
    return out


def freeze(store: Store, name: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT) -> Digest:
    """Turn head ``name`` into a pin (idempotent); return the frozen version's digest."""
    name = validate_name(name)
    with FileLock(lock_path(store.root, "names", name), timeout=timeout, what=f"manifest {name!r}"), \
            commit_lock(store, timeout=timeout):
        head = read_ref(store.root, "heads", name)
        pin = read_ref(store.root, "pins", name)
        if head is None:
            if pin is not None:
                return pin
            raise ObjectNotFoundError(f"no manifest named {name!r} to freeze")
        if pin is None:
            # Pin first, then drop the head: a crash in between leaves both,
            # and readers and editors already treat the pin as authoritative.
            write_ref(store.root, "pins", name, head, durable=store.durable)
        _remove_ref(store, "heads", name)
        return pin if pin is not None else head


def pin(store: Store, name: str, target: Union[str, Digest], *, force: bool = False,
        timeout: Optional[float] = DEFAULT_TIMEOUT, allow_missing: bool = False) -> Digest:
    """Pin a version (by digest or by another name) under ``name``.

    The version and every object it names must be in the store (invariant 2:
    nothing refers to a missing object) unless ``allow_missing`` (remote-only
    objects).  GC cannot delete them meanwhile: the check runs under the
    store's commit lock.
    """
    name = validate_name(name)
    d = resolve_target(store, target)[0]
    with FileLock(lock_path(store.root, "names", name), timeout=timeout, what=f"pin {name!r}"), \
            commit_lock(store, timeout=timeout):
        man = _load(store, d)  # must exist and be a manifest; gc cannot delete it while we hold commit_lock
        if not allow_missing:
            for key in man:
                if not store.objects.has(man[key].digest):
                    raise ObjectNotFoundError(
                        f"cannot pin {d} as {name!r}: its entry {key!r} refers to {man[key].digest}, which is "
                        "not in the store (collected by gc or limit?); put it again, or pin with "
                        "allow_missing=True if it lives on a remote"
                    )
        if read_ref(store.root, "heads", name) is not None:
            raise InvalidInputError(f"{name!r} is a head (editable manifest); use store.freeze({name!r}) instead")
        old = read_ref(store.root, "pins", name)
        if old is not None and old != d and not force:
            raise FrozenError(f"pin {name!r} already points to {old}; pass force=True to move it to {d}")
        if old != d:
            write_ref(store.root, "pins", name, d, durable=store.durable)
    return d


def unpin(store: Store, name: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT) -> Digest:
    """Remove a pin's name (its objects stay until garbage collection)."""
    name = validate_name(name)
    with FileLock(lock_path(store.root, "names", name), timeout=timeout, what=f"pin {name!r}"):
        d = read_ref(store.root, "pins", name)
        if d is None:
            raise ObjectNotFoundError(f"no pin named {name!r}")
        _remove_ref(store, "pins", name)
        return d


def _remove_ref(store: Store, kind: str, name: str) -> None:
    p = ref_path(store.root, kind, name)
    try:
        os.unlink(p)
    except FileNotFoundError:
        return
    if store.durable:
        fsync_dir(p.parent)


@dataclass(frozen=True, slots=True)
class Diff:
    """Keys added, removed and changed between two versions (``a`` -> ``b``)."""

    added: Mapping[str, Entry]
    removed: Mapping[str, Entry]
    changed: Mapping[str, Tuple[Entry, Entry]]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def diff(store: Store, a: Union[str, Digest, Manifest], b: Union[str, Digest, Manifest]) -> Diff:
    """Compare two manifests (names, digests or Manifest objects)."""
    ma = a if isinstance(a, Manifest) else read_manifest(store, a)
    mb = b if isinstance(b, Manifest) else read_manifest(store, b)
    added = {k: mb[k] for k in mb if k not in ma}
    removed = {k: ma[k] for k in ma if k not in mb}
    changed = {k: (ma[k], mb[k]) for k in ma if k in mb and ma.raw_entry(k) != mb.raw_entry(k)}
    return Diff(added, removed, changed)


def _reflink(src: int, dst: int) -> bool:
    FICLONE = 0x40049409  # linux/fs.h
    try:
        fcntl.ioctl(dst, FICLONE, src)
        return True
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EBADF,
                       errno.EPERM):
            return False
        raise


def checkout(store: Store, target: Union[str, Digest], outdir: Union[str, os.PathLike[str]], *,
             overwrite: bool = False) -> List[Path]:
    """Materialize a manifest's files under ``outdir``; return the paths written.

    Each file is written to a temp name beside its target, verified (its
    digest re-hashed), then renamed, so a failed checkout never leaves a
    partial file under a manifest key.  Files are reflinked where the
    filesystem can (btrfs, XFS), else copied.  An existing file with other
    content is an error unless ``overwrite``.
    """
    from ._fs import copy_exact as _copy_fd  # TRANSITIONAL
    from .digest import hash_fd as _hash_fd

    man = read_manifest(store, target)
    # Check every key (and entry) before writing anything: a hostile or malformed
    # manifest is refused as a whole, and nothing is ever written outside outdir.
    keys = set(man)
    for key in man:
        validate_key(key)
        man[key]  # decodes the entry: StoreFormatError now, before any file is written
        parent = key.rpartition("/")[0]
        while parent:
            if parent in keys:
                raise InvalidInputError(
                    f"manifest {man.digest}: keys {parent!r} and {key!r} conflict ({parent!r} would have to be "
                    "both a file and a directory); nothing was checked out"
                )
            parent = parent.rpartition("/")[0]
    out = Path(outdir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    written: List[Path] = []
    for key in man:
        e = man[key]
        dest = out / key
        if dest.exists():
            if dest.is_file() and dest.stat().st_size == (e.size if e.size is not None else -1):
                with open(dest, "rb") as f:
                    if _hash_fd(f.fileno(), dest.stat().st_size) == e.digest:
                        continue
            if not overwrite:
                raise InvalidInputError(f"{dest} exists with other content; pass overwrite=True to replace it")
        dest.parent.mkdir(parents=True, exist_ok=True)
        # Not derived from dest.name: a valid key segment may be 255 bytes, the limit for a file name.
        tmp = dest.parent / f".casstore-{os.getpid()}-{os.urandom(6).hex()}.part"
        try:
            info = store.stat(e.digest)
            with open(tmp, "w+b") as fo:
                done = False
                if info.codec == "raw":
                    with open(store.path(e.digest), "rb") as fi:
                        if not _reflink(fi.fileno(), fo.fileno()):
                            _copy_fd(fi.fileno(), fo.fileno(), info.size)
                        done = True
                        got = _hash_fd(fo.fileno(), info.size)
                    if got != e.digest:
                        raise IntegrityError(f"object {e.digest} is corrupt (hashes to {got}); not checked out")
                if not done:
                    with store.open(e.digest) as fi:
                        shutil.copyfileobj(fi, fo, 1 << 20)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        written.append(dest)
    return written

