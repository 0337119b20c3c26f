"""numpy adapter: arrays stored as ``.npy`` objects; bundles as manifests.

An array object is exactly the ``.npy`` file ``np.save`` writes (format 1.0, or
3.0 for non-latin-1 field names; dtype, shape and C/Fortran order kept), so
``np.load(store.path(d))`` works on it too, and its data starts 64-byte
aligned.  ``get_array(d, mmap=True)`` memory-maps a raw object read-only with
no copy (and no verification: hashing would read it all; run
``store.verify()`` or ``get_array(d)`` for that).

``put_arrays({...})`` stores each array as an object and returns the digest of
a manifest version (not a named head) mapping each name to its array;
``get_arrays(d)`` reads it back as a dict.  Pin it (``store.pin(name, d)``) or
record it in a manifest to keep it from garbage collection.
"""

from __future__ import annotations

import io
import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

import numpy as np

from ..codecs import ZSTD
from ..digest import Digest, new_hasher
from ..errors import IntegrityError, InvalidInputError, InvalidTypeError, StoreFormatError
from ..manifest import Entry, encode_manifest

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["put_array", "get_array", "put_arrays", "get_arrays"]

ARRAYS_KIND = "casstore.arrays"


# Largest .npy header put_array writes and get_array reads (get_array parses the
# header from one 64 KiB pread; numpy's own default limit, 10,000, is too small
# for structured dtypes with a few hundred fields).
_MAX_HEADER = 60_000


def _npy_private(name: str) -> Any:
    """A private helper of numpy's .npy code (used by np.save/np.load for format 3.0).

    It lives in ``numpy.lib._format_impl`` in numpy 2 and ``numpy.lib.format`` in 1.x.
    """
    import importlib

    for mod in ("numpy.lib._format_impl", "numpy.lib.format"):
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            continue
    raise AttributeError(f"numpy has no {name}")  # pragma: no cover


def _header(a: np.ndarray[Any, Any]) -> bytes:
    buf = io.BytesIO()
    d = np.lib.format.header_data_from_array_1_0(a)
    try:
        np.lib.format.write_array_header_1_0(buf, d)
    except ValueError:  # header too large for 1.0 (huge structured dtypes), or non-latin-1 field names
        buf = io.BytesIO()
        try:
            np.lib.format.write_array_header_2_0(buf, d)
        except UnicodeEncodeError:  # non-latin-1 field names: format 3.0 (utf-8 header), as np.save writes
            buf = io.BytesIO()
            _npy_private("_write_array_header")(buf, d, (3, 0))
    if buf.tell() > _MAX_HEADER:
        raise InvalidInputError(
            f"put_array(): the .npy header of this dtype ({len(a.dtype.names or ())} fields) is {buf.tell()} "
            f"bytes, more than {_MAX_HEADER}; store such a table as several arrays (put_arrays)"
        )
    return buf.getvalue()


def put_array(store: Store, a: Any, *, compress: Any = None) -> Digest:
    """Store a numpy array as a ``.npy`` object; return its digest.

    Object arrays are refused (their pickles are neither portable nor safe to
    load).  No copy is made for C- or Fortran-contiguous arrays.
    """
    if not isinstance(a, np.ndarray):
        raise InvalidTypeError(f"put_array() takes a numpy array, not {type(a).__name__}")
    if a.dtype.hasobject:
        raise InvalidTypeError(
            f"put_array() refuses arrays of dtype {a.dtype} that hold Python objects; "
            "convert to a numeric, string or bytes dtype first"
        )
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        a = np.ascontiguousarray(a)
    header = _header(a)
    body = a.T if (a.flags.f_contiguous and not a.flags.c_contiguous) else a
    # A uint8 view, not memoryview(...).cast("B"): the buffer protocol has no format for
    # datetime64/timedelta64 (or some structured dtypes), a byte view of the same memory always works.
    data = memoryview(body.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")
    return store.put_parts([header, data], compress=compress)


def _read_header(f: Any, d: Digest) -> Any:
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=_MAX_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=_MAX_HEADER)
        else:  # 3.0 (utf-8 header) has no public reader; np.load uses this one
            shape, fortran, dtype = _npy_private("_read_array_header")(f, version, max_header_size=_MAX_HEADER)
    except (ValueError, OSError) as e:
        raise StoreFormatError(f"object {d} is not a .npy array ({e})") from None
    if dtype.hasobject:
        raise StoreFormatError(f"object {d} holds a Python-object array; casstore will not unpickle it")
    return shape, fortran, dtype


def _empty(shape: Any, fortran: bool, dtype: Any, data_bytes: int, d: Digest) -> np.ndarray[Any, Any]:
    """Allocate the array a header describes, after checking it against the object's size.

    A hostile or damaged header must not make us allocate terabytes or pass
    negative dimensions to numpy.
    """
    if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise StoreFormatError(f"object {d} has a .npy header with an invalid shape {shape!r}")
    want = dtype.itemsize
    for n in shape:
        want *= n
    if want != data_bytes:
        raise IntegrityError(
            f"object {d}: its .npy header describes {want} data bytes but the object holds {data_bytes}"
        )
    return np.empty(shape, dtype=dtype, order="F" if fortran else "C")


def get_array(store: Store, digest: Any, *, mmap: bool = False, verify: bool = True) -> np.ndarray[Any, Any]:
    """Read an array.  ``mmap=True``: a read-only memory map of a raw object, no copy.

    Otherwise the array is read into fresh memory while a helper thread
    re-hashes the object file; corrupt data raises :class:`IntegrityError`.
    A compressed object with ``mmap=True`` is first materialized raw (once).
    """
    from ..digest import hash_fd as _hash_fd  # TRANSITIONAL
    from ..objects.local import OVERLAP_MIN as _OVERLAP_MIN

    d = Digest.coerce(digest)
    if mmap:
        path = store.raw_path(d)
        try:
            arr: np.ndarray[Any, Any] = np.load(path, mmap_mode="r", allow_pickle=False, max_header_size=_MAX_HEADER)
        except ValueError as e:
            raise StoreFormatError(f"object {d} is not a .npy array ({e})") from None
        return arr
    info = store.stat(d)
    if info.codec == ZSTD.name:
        with store.open(d, verify=verify) as f:
            shape, fortran, dtype = _read_header(f, d)
            out = _empty(shape, fortran, dtype, info.size - f.tell(), d)
            _readinto_exact(f, out, d)
            if verify:
                f.read(1)  # reach EOF so the stream checks the digest
        return out
    path = store.path(d)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        overlap = verify and size >= _OVERLAP_MIN
        box: List[Any] = []
        th: Optional[threading.Thread] = None
        if overlap:
            # Large arrays: hash the file on a helper thread while this one reads.
            def work() -> None:
                try:
                    box.append(_hash_fd(f.fileno(), size, threaded=False))
                except BaseException as e:  # pragma: no cover - I/O error
                    box.append(e)

            th = threading.Thread(target=work, name="casstore-verify")
            th.start()
        try:
            # Parse the header from one pread, then read the data straight into the array.
            first = os.pread(f.fileno(), 1 << 16, 0)
            head = io.BytesIO(first)
            shape, fortran, dtype = _read_header(head, d)
            f.seek(head.tell())
            out = _empty(shape, fortran, dtype, size - head.tell(), d)
            _readinto_exact(f, out, d)
        finally:
            if th is not None:
                th.join()
        if verify:
            if th is not None:
                if isinstance(box[0], BaseException):
                    raise box[0]
                got = box[0]
            else:
                # Small arrays: hash what was read (header + the array's memory).
                h = new_hasher(threaded=size >= (1 << 20))
                h.update(first[: head.tell()])
                h.update(_data_view(out))
                if f.read(1):
                    raise IntegrityError(f"object {d} has bytes after the array data; file {path}")
                got = Digest(h.hexdigest())
            if got != d:
                raise IntegrityError(f"object {d} is corrupt: it hashes to {got}; file {path}")
    return out


def _data_view(out: np.ndarray[Any, Any]) -> memoryview:
    """The array's bytes in file order (C order, or the transpose's for Fortran arrays)."""
    if out.size == 0:
        return memoryview(b"")
    body = out.T if (out.flags.f_contiguous and not out.flags.c_contiguous) else out
    return memoryview(body.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # uint8: M8 has no buffer format


def _readinto_exact(f: Any, out: np.ndarray[Any, Any], d: Digest) -> None:
    if out.size == 0:
        return
    mv = _data_view(out)
    got = 0
    while got < len(mv):
        n = f.readinto(mv[got:])
        if not n:
            raise IntegrityError(f"object {d} is truncated: {got} of {len(mv)} data bytes")
        got += n


def put_arrays(store: Store, arrays: Mapping[str, Any], *, compress: Any = None) -> Digest:
    """Store several arrays; return the digest of a manifest version naming them."""
    if not isinstance(arrays, Mapping):
        raise InvalidTypeError(f"put_arrays() takes a mapping of name -> array, not {type(arrays).__name__}")
    entries: Dict[str, Entry] = {}
    from ..refs import validate_key

    for name, a in arrays.items():
        validate_key(name)
        d = put_array(store, a, compress=compress)
        entries[name] = Entry(d, store.stat(d).size, {"dtype": str(a.dtype), "shape": list(a.shape)})
    data = encode_manifest(entries, {"kind": ARRAYS_KIND}, None)
    return store.put(data, compress=False)


def get_arrays(store: Store, digest: Any, *, mmap: bool = False,
               verify: bool = True) -> Dict[str, np.ndarray[Any, Any]]:
    """Read a bundle written by :func:`put_arrays` as ``{name: array}``."""
    man = store.manifest(digest)  # a digest, or the name the bundle was pinned under
    if man.meta.get("kind") != ARRAYS_KIND:
        raise StoreFormatError(f"manifest {man.digest} is not an array bundle (put_arrays)")
    return {k: get_array(store, man[k].digest, mmap=mmap, verify=verify) for k in man}
