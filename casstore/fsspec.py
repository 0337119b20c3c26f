"""``casstore://NAME/KEY``: a read-only fsspec filesystem over a store's manifests.

pandas, xarray, zarr and anything else that speaks fsspec read stored files in
place, with no checkout::

    pandas.read_csv("casstore://exp-42/metrics.csv", storage_options={"store": "/data/store"})
    fsspec.filesystem("casstore", store=store).ls("exp-42")

Registered under the ``fsspec.specs`` entry point (``pip install 'casstore[fsspec]'``),
so ``fsspec.filesystem("casstore")`` works once casstore is installed; importing
:mod:`casstore` itself never imports fsspec.  This module sits above the
:class:`~casstore.Store` facade, beside the CLI (docs/design.md, "Layers"), and
reaches the store only through the facade's public methods.

Paths (docs/fsspec.md, "Paths"): the root lists names; a name is a directory of
its keys; keys with ``/`` are nested directories.  A path splits into name and
key by one rule:

* ``NAME//KEY`` -- explicit: everything before the (only) ``//`` is the name,
  everything after it the key.  Names and keys never hold an empty segment, so
  ``//`` cannot be part of either, and this form means the same thing whatever
  other names exist.  Programs that must never change meaning should use it.
* ``PATH`` (no ``//``) -- the name is the *longest* leading run of whole segments
  that names a head or pin (or a version of one: ``NAME~N``, ``NAME@HEX``); the
  rest is the key.  If a *shorter* prefix is also a name and that name has the
  rest as a key or directory, the path is ambiguous and refused
  (:class:`AmbiguousPathError`), rather than silently choosing one: a name created
  later can therefore make a path fail, never make it read other bytes.
* ``blake3:<hex>/KEY`` -- a manifest version by digest (or unique prefix).

Hazards: every path comes from a caller or a URL.  NUL, control characters,
backslashes, absolute paths and ``.``/``..`` segments are refused with
:class:`~casstore.errors.InvalidInputError` before any lookup; keys are only ever
looked up in a manifest (a ``Mapping``), never joined to a directory, so no path
can reach a file outside the store.  Unknown names and keys are
``FileNotFoundError``.  Nothing here writes: every write method raises
:class:`~casstore.errors.ReadOnlyError` (a ``PermissionError``).

Verification (docs/security.md): ``cat_file`` of a whole file is ``store.get``
(re-hashed, :class:`~casstore.errors.IntegrityError` on damage).  ``open`` hands out
``store.open``'s reader, which verifies a full sequential read at end of file;
a seek elsewhere turns verification off for that reader, so ranged and random
reads are *unverified* -- unless ``verify="full"`` (per filesystem or per
``open``), which hashes the whole object when the file is opened, before any
byte is returned.
"""

from __future__ import annotations

import errno
import io
import os
from typing import BinaryIO, Callable, Dict, List, Literal, Optional, Tuple, Union, cast

try:
    from fsspec.spec import AbstractFileSystem
except ImportError as e:  # pragma: no cover - exercised by tests/test_fsspec.py in a subprocess
    raise ImportError(
        "casstore:// needs fsspec, which is not installed: pip install 'casstore[fsspec]'"
    ) from e

from ._fs import seek_target
from ._paths import key_problem
from .digest import Digest
from .errors import InvalidInputError, InvalidTypeError, ManifestNotFoundError, ReadOnlyError
from .manifests import Manifest
from .store import PathLike, Store, open_store

__all__ = ["CasstoreFileSystem", "AmbiguousPathError", "Verify", "Info"]

Verify = Literal["read", "full"]
"""``"read"``: full sequential reads are verified (the default); ``"full"``: hash on open."""
Info = Dict[str, object]
"""An fsspec info dict: ``name``, ``size``, ``type`` and, for files, ``digest``, ``codec``."""

_VERIFY = ("read", "full")
_SKIP = 1 << 20  # scratch buffer for draining (verify="full") and skipping (compressed seeks)


class AmbiguousPathError(InvalidInputError):
    """A ``casstore://`` path that two names could claim; use the explicit ``NAME//KEY`` form."""


def _not_found(path: str, why: str) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"casstore://{path}: {why}", path)


def _readinto(f: BinaryIO, b: Union[bytearray, memoryview]) -> int:
    """``f.readinto(b)``: store.open's readers are buffered binary streams (typed BinaryIO, which lacks it)."""
    return cast(io.BufferedIOBase, f).readinto(b)


def _read_only(what: str) -> ReadOnlyError:
    return ReadOnlyError(
        f"casstore:// is read-only ({what} refused): store bytes with store.put / store.put_path and "
        "name them with store.edit(NAME) or `casstore add NAME DIR`"
    )


def _store_of(store: object) -> Store:
    """The store ``store=`` means: a Store as is, an existing store's path (never created), the default."""
    if store is None:
        return open_store()
    if isinstance(store, Store):
        return store
    if isinstance(store, (str, os.PathLike)):
        return open_store(store, create=False)
    raise InvalidTypeError(f"store must be a casstore.Store, a store path or None, not {type(store).__name__}")


class _Resolved:
    """A path split into the manifest it names, the key inside it, and how to spell children."""

    __slots__ = ("manifest", "key", "prefix")

    def __init__(self, manifest: Manifest, key: str, prefix: str) -> None:
        self.manifest = manifest
        self.key = key  # "" for the name itself
        self.prefix = prefix  # what a child path starts with: "NAME/" or "NAME//"


class _DecodedReader(io.RawIOBase):
    """A seekable reader over a *compressed* object (whose stream is sequential only).

    A forward seek reads and discards up to the target, so the underlying
    verifying reader still sees every byte in order (a full read stays
    verified); a backward seek reopens the object and does the same from the
    start.  Random access therefore costs re-decompression: objects meant for
    random access (HDF5, zarr shards) are best stored raw, the default.
    """

    def __init__(self, reopen: Callable[[], BinaryIO], size: int, name: str) -> None:
        super().__init__()
        self._reopen = reopen
        self._f = reopen()
        self._pos = 0
        self._size = size
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = seek_target(offset, whence, self._pos, self._size)
        if target < self._pos:
            self._f.close()
            self._f = self._reopen()
            self._pos = 0
        scratch = bytearray(min(_SKIP, max(target - self._pos, 0)))
        while self._pos < min(target, self._size):
            n = _readinto(self._f, memoryview(scratch)[:min(len(scratch), target - self._pos)])
            if not n:
                break
            self._pos += n
        self._pos = target
        return target

    def readinto(self, b: Union[bytearray, memoryview]) -> int:  # type: ignore[override]
        if self._pos >= self._size:
            return 0
        n = _readinto(self._f, b)
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


_COPY = 1 << 20  # get_file's read size


class CasstoreFileSystem(AbstractFileSystem):  # type: ignore[misc]  # fsspec ships no type hints
    """Read-only fsspec filesystem over a casstore store: ``casstore://NAME/KEY``.

    ``store``: a :class:`~casstore.Store`, the path of an existing store (never
    created here: a mistyped path is an error, not a new empty store), or
    ``None`` for the default store (``casstore.open()``).  ``verify``:
    ``"read"`` (full sequential reads and whole-file ``cat`` verified; seeks and
    ranges not) or ``"full"`` (every ``open`` and ranged ``cat`` hashes the
    whole object first).  ``asynchronous`` is accepted because zarr asks every
    filesystem for it; this one is synchronous, and zarr wraps it.  See the
    module docstring for how paths split.
    """

    protocol = "casstore"
    root_marker = ""
    # Instances are cheap, and fsspec's instance cache keys on the arguments only: with
    # store=None a cached instance would keep the default store of an earlier
    # CASSTORE_DIR (hazard: reading another store than the one configured now).
    cachable = False

    def __init__(self, store: Union[Store, PathLike, None] = None, *, verify: Verify = "read",
                 asynchronous: bool = False) -> None:
        if verify not in _VERIFY:
            raise InvalidInputError(f"verify must be one of {_VERIFY}, not {verify!r:.80}")
        self.store: Store = _store_of(store)
        """The store read."""
        self.verify: Verify = verify
        """The default ``verify=`` of :meth:`open` and ranged :meth:`cat_file`."""
        super().__init__()

    # -- paths -----------------------------------------------------------------------------

    @classmethod
    def _strip_protocol(cls, path: Union[str, os.PathLike[str], List[str]]) -> Union[str, List[str]]:
        """``casstore://a/b/`` -> ``a/b``; a trailing ``//`` (``NAME//``, a name's root) is kept."""
        if isinstance(path, list):
            return [str(cls._strip_protocol(p)) for p in path]
        p = os.fspath(path)
        if not isinstance(p, str):
            raise InvalidTypeError(f"a casstore:// path must be text, not {type(p).__name__}")
        for head in ("casstore://", "casstore::"):
            if p.startswith(head):
                p = p[len(head):]
                break
        core = p.rstrip("/")
        return core + "//" if p[len(core):] == "//" and core else core

    def _path(self, path: str) -> str:
        p = self._strip_protocol(path)
        assert isinstance(p, str)
        if "\x00" in p:
            raise InvalidInputError(f"invalid casstore:// path {p!r:.200}: it contains NUL")
        if p.startswith("/"):
            raise InvalidInputError(
                f"invalid casstore:// path {p!r:.200}: it is absolute; write casstore://NAME/KEY"
            )
        return p

    def _manifest(self, target: str) -> Optional[Manifest]:
        """The version ``target`` names, or ``None`` if it names none (not a name, malformed)."""
        if "~" not in target and "@" not in target and not target.startswith("blake3:"):
            # A plain name: two ref reads rule out most candidates before the facade's full
            # resolution.  Heads before pins: freeze() writes the pin before it drops the head,
            # so a name being frozen is seen in one or the other.
            refs = self.store.refs
            try:
                if refs.get("heads", target) is None and refs.get("pins", target) is None:
                    return None
            except InvalidInputError:
                return None
        try:
            return self.store.manifest(target)
        except ManifestNotFoundError:
            return None
        except InvalidInputError:  # not a valid name nor version spelling: names nothing
            return None

    @staticmethod
    def _after(m: Manifest, key: str) -> Optional[str]:
        """The first key of ``m`` that is ``>= key`` (a range lookup; one node per level of a tree)."""
        return m.entries.ceiling(key)

    def _has(self, m: Manifest, key: str) -> bool:
        """``key`` is a file or a directory of ``m``."""
        if key in m:
            return True
        nxt = self._after(m, key + "/")
        return nxt is not None and nxt.startswith(key + "/")

    def _resolve(self, p: str) -> Optional[_Resolved]:
        """Split a stripped path into (manifest, key) by the rule in the module docstring."""
        if not p:
            return None
        if "//" in p:
            name, key = p.split("//", 1)
            if "//" in key:
                raise InvalidInputError(f"invalid casstore:// path {p!r:.200}: '//' may appear once (NAME//KEY)")
            for part, what in ((name, "name"), (key, "key")):
                problem = key_problem(part) if part else None
                if problem is not None:
                    raise InvalidInputError(f"invalid casstore:// {what} in {p!r:.200}: {problem}")
            m = self._manifest(name)
            if m is None:
                raise _not_found(p, f"no name {name!r} in the store at {self.store.root}; fs.ls('') lists names")
            return _Resolved(m, key, name + "//")
        problem = key_problem(p)
        if problem is not None:
            raise InvalidInputError(f"invalid casstore:// path {p!r:.200}: {problem}")
        segs = p.split("/")
        if segs[0].startswith("blake3:"):  # a version by digest; digests hold no '/'
            m = self.store.manifest(segs[0])
            return _Resolved(m, "/".join(segs[1:]), segs[0] + "/")
        found: Optional[Tuple[int, Manifest]] = None
        for i in range(len(segs), 0, -1):
            m = self._manifest("/".join(segs[:i]))
            if m is None:
                continue
            if found is None:
                found = (i, m)
                continue
            # A shorter name also exists: refuse if it could claim the rest of the path too.
            rest = "/".join(segs[i:])
            if self._has(m, rest):
                long_name, short_name = "/".join(segs[:found[0]]), "/".join(segs[:i])
                raise AmbiguousPathError(
                    f"casstore://{p} is ambiguous: name {long_name!r} exists and so does key {rest!r} of "
                    f"name {short_name!r}; write casstore://{long_name}//{'/'.join(segs[found[0]:])} or "
                    f"casstore://{short_name}//{rest}"
                )
        if found is None:
            return None
        i, m = found
        return _Resolved(m, "/".join(segs[i:]), "/".join(segs[:i]) + "/")

    def _name_dirs(self, p: str) -> List[str]:
        """Children of ``p`` in the tree of names (each a name or a directory of names)."""
        if "//" in p:
            return []
        start = p + "/" if p else ""
        out = set()
        for info in self.store.names():
            if info.name.startswith(start):
                out.add(start + info.name[len(start):].split("/", 1)[0])
        return sorted(out)

    def _file(self, path: str) -> Tuple[str, Digest]:
        """(stripped path, object digest) of a file; FileNotFoundError or IsADirectoryError otherwise."""
        p = self._path(path)
        r = self._resolve(p)
        if r is None:
            if not p or self._name_dirs(p):
                raise IsADirectoryError(errno.EISDIR, f"casstore://{p} is a directory of names", p)
            raise _not_found(p, f"no such name in the store at {self.store.root}; fs.ls('') lists names")
        if r.key in r.manifest:
            return p, r.manifest[r.key].digest
        if r.key == "" or self._has(r.manifest, r.key):
            raise IsADirectoryError(errno.EISDIR, f"casstore://{p} is a directory, not a file", p)
        raise _not_found(p, f"no key {r.key!r} in {r.prefix.rstrip('/')!r} (version {r.manifest.digest.short()})")

    # -- reading ---------------------------------------------------------------------------

    def ls(self, path: str, detail: bool = True, **kwargs: object) -> Union[List[Info], List[str]]:
        """A directory's children: names at the root, a name's keys (``a/b`` keys as directories).

        ``kwargs`` are fsspec's listing options (``refresh``...), accepted and ignored: nothing is cached
        but sorted key indexes of immutable versions.
        """
        p = self._path(path)
        r = self._resolve(p)
        entries: Dict[str, Info] = {}
        for child in self._name_dirs(p):
            entries[child] = {"name": child, "size": 0, "type": "directory"}
        if r is not None:
            if r.key in r.manifest:  # a file lists itself, as fsspec expects
                return [self._file_info(p, r.manifest, r.key)] if detail else [p]
            if r.key and not self._has(r.manifest, r.key):
                raise _not_found(p, f"no key or directory {r.key!r} in {r.prefix.rstrip('/')!r}")
            base = r.key + "/" if r.key else ""
            # Walk the children by range lookups, skipping each subdirectory's contents: a
            # listing costs its children, not the manifest's size (versions can hold millions).
            key = self._after(r.manifest, base)
            while key is not None and key.startswith(base):
                head, sep, _ = key[len(base):].partition("/")
                child = r.prefix + base + head
                if sep:
                    entries.setdefault(child, {"name": child, "size": 0, "type": "directory"})
                    key = self._after(r.manifest, base + head + "0")  # past base/head/...: '0' follows '/'
                else:
                    entries[child] = self._file_info(child, r.manifest, key)
                    key = self._after(r.manifest, key + "\x00")  # the next key: keys never hold NUL
        elif not entries and p:
            raise _not_found(p, f"no such name in the store at {self.store.root}; fs.ls('') lists names")
        out = [entries[k] for k in sorted(entries)]
        return out if detail else [str(e["name"]) for e in out]

    def _file_info(self, name: str, m: Manifest, key: str) -> Info:
        entry = m[key]
        st = self.store.stat(entry.digest)
        return {"name": name, "size": st.size, "type": "file", "digest": str(entry.digest), "codec": st.codec,
                "stored_size": st.stored_size, "meta": dict(entry.meta), "version": str(m.digest)}

    def info(self, path: str, **kwargs: object) -> Info:
        """``name``, ``size``, ``type`` (``file``/``directory``); files add ``digest``, ``codec``,
        ``stored_size``, the entry's ``meta`` and the manifest ``version``.  ``kwargs`` are ignored."""
        p = self._path(path)
        if not p:
            return {"name": "", "size": 0, "type": "directory"}
        r = self._resolve(p)
        if r is not None:
            if r.key in r.manifest:
                return self._file_info(p, r.manifest, r.key)
            if r.key == "":
                return {"name": p, "size": 0, "type": "directory", "version": str(r.manifest.digest)}
            if self._has(r.manifest, r.key):
                return {"name": p, "size": 0, "type": "directory"}
        if self._name_dirs(p):
            return {"name": p, "size": 0, "type": "directory"}
        raise _not_found(p, f"no such name or key in the store at {self.store.root}; fs.ls('') lists names")

    def ukey(self, path: str) -> str:
        """A file's content digest: the same bytes, the same key, whatever path reaches them."""
        return str(self._file(path)[1])

    def _reader(self, d: Digest, name: str) -> BinaryIO:
        """A seekable reader that verifies a full sequential read (store.open; compressed: wrapped)."""
        st = self.store.stat(d)
        if st.codec == "raw":
            return self.store.open(d)
        raw = _DecodedReader(lambda: self.store.open(d), st.size, name)
        return io.BufferedReader(raw)

    def _check_verify(self, verify: Optional[Verify]) -> Verify:
        v = self.verify if verify is None else verify
        if v not in _VERIFY:
            raise InvalidInputError(f"verify must be one of {_VERIFY}, not {v!r:.80}")
        return v

    def get_file(self, rpath: str, lpath: Union[str, os.PathLike[str], BinaryIO, None] = None,
                 callback: object = None, outfile: Optional[BinaryIO] = None, **kwargs: object) -> None:
        """Copy one object to the local file ``lpath``: written beside it under a temp name, renamed
        into place only once the whole object verified.

        Hazard (found by a bug hunt): fsspec's ``get_file`` streamed into ``lpath`` and kept what it
        had on an error, so a corrupt object left its first 8 MiB behind, and ``simplecache::``
        (which fetches with this) then served them as the file without an error.  A file object
        given (``outfile``) is written as fsspec would: its caller owns what it holds.
        """
        if outfile is None and lpath is not None and not isinstance(lpath, (str, os.PathLike)):
            outfile, lpath = lpath, None
        if outfile is not None:
            with self.open(rpath, "rb", **kwargs) as f1:
                while True:
                    chunk = f1.read(_COPY)
                    if not chunk:
                        return
                    outfile.write(chunk)
        if not isinstance(lpath, (str, os.PathLike)):
            raise InvalidInputError("get_file needs a local path (lpath) or a file object (outfile)")
        dest = os.fspath(lpath)
        if self.isdir(rpath):
            os.makedirs(dest, exist_ok=True)
            return
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        tmp = f"{dest}.casstore-{os.getpid()}-{os.urandom(6).hex()}.part"
        try:
            with self.open(rpath, "rb", **kwargs) as f1, open(tmp, "wb") as out:
                while True:
                    chunk = f1.read(_COPY)  # the reader raises IntegrityError before handing out the last bytes
                    if not chunk:
                        break
                    out.write(chunk)
            os.replace(tmp, dest)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _open(self, path: str, mode: str = "rb", block_size: Optional[int] = None, autocommit: bool = True,
              cache_options: Optional[Dict[str, object]] = None, verify: Optional[Verify] = None,
              **layer_options: object) -> BinaryIO:
        """A binary reader (``rb`` only).  ``verify="full"`` hashes the whole object first
        (:class:`~casstore.errors.IntegrityError` before any byte is returned); otherwise a full
        sequential read is verified at its end and seeks turn verification off (a seek back to the
        start begins a new verified read).  Options fsspec's layers pass (``blockcache::``:
        ``cache_type``, ``size``, ...) are accepted and have no effect: the reader reads the local
        object file directly (they were a TypeError)."""
        if mode != "rb":
            raise _read_only(f"open({path!r:.200}, {mode!r})")
        v = self._check_verify(verify)
        p, d = self._file(path)
        f = self._reader(d, f"casstore://{p}")
        if v == "full":
            try:
                buf = bytearray(_SKIP)
                while _readinto(f, buf):  # the reader compares the digest at end of file
                    pass
                f.seek(0)
            except BaseException:
                f.close()
                raise
        return f

    def cat_file(self, path: str, start: Optional[int] = None, end: Optional[int] = None,
                 **kwargs: object) -> bytes:
        """A file's bytes; whole files are verified (``store.get``).  A range (``start``/``end``,
        negative from the end) is read unverified unless the filesystem has ``verify="full"``.
        ``kwargs`` are ignored."""
        p, d = self._file(path)
        if start is None and end is None:
            return self.store.get(d)
        with self._open(p, "rb") as f:
            size = self.store.stat(d).size
            lo = 0 if start is None else (max(size + start, 0) if start < 0 else start)
            hi = size if end is None else (max(size + end, 0) if end < 0 else min(end, size))
            if hi <= lo:
                return b""
            f.seek(lo)
            return f.read(hi - lo)

    # -- writing: refused ------------------------------------------------------------------

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: object) -> None:
        """Refused: read-only (:class:`~casstore.errors.ReadOnlyError`)."""
        raise _read_only(f"mkdir {path!r:.200}")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Refused: read-only."""
        raise _read_only(f"makedirs {path!r:.200}")

    def rmdir(self, path: str) -> None:
        """Refused: read-only."""
        raise _read_only(f"rmdir {path!r:.200}")

    def rm_file(self, path: str) -> None:
        """Refused: read-only."""
        raise _read_only(f"rm {path!r:.200}")

    def _rm(self, path: str) -> None:
        raise _read_only(f"rm {path!r:.200}")

    def rm(self, path: Union[str, List[str]], recursive: bool = False, maxdepth: Optional[int] = None) -> None:
        """Refused: read-only."""
        raise _read_only(f"rm {path!r:.200}")

    def cp_file(self, path1: str, path2: str, **kwargs: object) -> None:
        """Refused: read-only."""
        raise _read_only(f"copy to {path2!r:.200}")

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: Optional[int] = None,
           **kwargs: object) -> None:
        """Refused: read-only."""
        raise _read_only(f"move {path1!r:.200}")

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: object) -> None:
        """Refused: read-only."""
        raise _read_only(f"write {path!r:.200}")

    def touch(self, path: str, truncate: bool = True, **kwargs: object) -> None:
        """Refused: read-only."""
        raise _read_only(f"touch {path!r:.200}")

    def put_file(self, lpath: str, rpath: str, callback: object = None, mode: str = "overwrite",
                 **kwargs: object) -> None:
        """Refused: read-only."""
        raise _read_only(f"upload to {rpath!r:.200}")

