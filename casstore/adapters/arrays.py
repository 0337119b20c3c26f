"""numpy adapter: arrays stored as ``.npy`` objects; bundles as manifests.

An array object is exactly the ``.npy`` file ``np.save`` writes (format 1.0, or
3.0 for non-latin-1 field names; dtype, shape and C/Fortran order kept), so
``np.load(store.path(d))`` works on it too, and its data starts 64-byte
aligned.  ``get_array(d)`` reads into fresh memory (from 2 MiB while a helper hashes
the object file from the same page cache), and returns the array only once it matched.
``get_array(d, mmap=True)`` memory-maps a raw object read-only with no copy and,
by default, no verification; ``verify=True`` hashes the file first, once per
process while it is unchanged (later maps cost a lookup).

``put_arrays({...})`` stores each array as an object and returns the digest of
a manifest version (not a named head) mapping each name to its array;
``get_arrays(d)`` reads it back as a dict.  Pin it (``store.pin(name, d)``) or
record it in a manifest to keep it from garbage collection.

Hazards (issue 11), each answered here:

* Object files are opened only through the object layer
  (:func:`~casstore.objects.reader.open_object_file`: ``O_NOFOLLOW | O_NONBLOCK``,
  regular files only), so a FIFO, directory, device or symlink planted at an
  object's name is an :class:`~casstore.errors.IntegrityError` at once, never a
  hang or a read outside the store; an object evicted meanwhile is an
  :class:`~casstore.errors.ObjectNotFoundError`.
* The ``.npy`` header is untrusted input.  numpy's parser runs on at most
  :data:`_PREFIX` bytes, every failure of it is a
  :class:`~casstore.errors.StoreFormatError`, and the array is allocated only
  after the shape, dtype and order it describes account exactly for the bytes
  the object holds: nothing beyond the object's (recorded) size is allocated.
* A compressed object is decoded by the codec's bounded reader: a frame that
  decodes to more than the object records is an ``IntegrityError``.
"""

from __future__ import annotations

import importlib
import io
import os
import threading
import tokenize
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Literal,
    Mapping,
    NoReturn,
    Optional,
    Protocol,
    Tuple,
    Union,
    cast,
)

import numpy as np
import numpy.typing as npt

from .._fs import Beside, pread_into, read_up_to, run_beside, stamp_floor_ns
from .._fsprobe import settled
from ..codecs import CompressArg
from ..digest import Digest, hash_fd, new_hasher
from ..errors import IntegrityError, InvalidInputError, InvalidTypeError, StoreFormatError
from ..manifests import read_manifest
from ..manifests.model import Entry, encode_manifest, validate_key
from ..objects.reader import open_object_file

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["put_array", "get_array", "put_arrays", "get_arrays", "ARRAYS_KIND", "DigestLike"]

ARRAYS_KIND = "casstore.arrays"
"""``meta["kind"]`` of a bundle manifest written by :func:`put_arrays`."""

DigestLike = Union[Digest, str]
"""A :class:`~casstore.digest.Digest` or its ``"blake3:<hex>"`` form."""

# Largest .npy header put_array writes and get_array reads (numpy's own default
# limit, 10,000, is too small for structured dtypes with a few hundred fields).
_MAX_HEADER = 60_000
# get_array parses the header from this many leading bytes (one pread): the
# 12-byte preamble of format 2.0/3.0 plus the largest header we accept.
_PREFIX = 1 << 16
# get_array(verify=True) hashes the object file beside the read from this size up.
# Below it, reading the whole array and then hashing it on the same thread is
# faster (a 1 MiB array stays in this core's cache: 0.63x of np.load against 0.50x
# with a helper); from 2 MiB the helper wins (2026-12-03).
_PIPE_MIN = 2 << 20
# numpy refuses more dimensions than this (64 in numpy 2, 32 in numpy 1).
_MAX_DIMS = 64
# Everything numpy's header parser (ast.literal_eval on untrusted text, then
# dtype construction) is known to raise on malformed input.  The input is at
# most _PREFIX bytes, so MemoryError/RecursionError here are the parser's own
# nesting limits, not the process running out of memory.
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, SyntaxError, RecursionError,
                 MemoryError, OverflowError, UnicodeError, EOFError, OSError, tokenize.TokenError)


def _npy_private(name: str) -> Callable[..., Any]:
    """A private helper of numpy's .npy code (used by np.save/np.load for format 3.0).

    It lives in ``numpy.lib._format_impl`` in numpy 2 and ``numpy.lib.format`` in 1.x.
    """
    for mod in ("numpy.lib._format_impl", "numpy.lib.format"):
        try:
            fn: Callable[..., Any] = getattr(importlib.import_module(mod), name)
            return fn
        except (ImportError, AttributeError):
            continue
    raise AttributeError(f"numpy has no {name}")  # pragma: no cover


def _header(a: npt.NDArray[Any]) -> bytes:
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


def _data_view(a: npt.NDArray[Any]) -> memoryview:
    """The array's bytes in file order (C order, or the transpose's for Fortran arrays), no copy."""
    if a.nbytes == 0:
        return memoryview(bytearray())  # writable, like every other array's view
    body = a.T if (a.flags.f_contiguous and not a.flags.c_contiguous) else a
    # A uint8 view, not memoryview(...).cast("B"): the buffer protocol has no format for
    # datetime64/timedelta64 (or some structured dtypes); a byte view of the same memory always works.
    return memoryview(body.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy's stubs lack __buffer__


def put_array(store: Store, a: npt.NDArray[Any], *, compress: CompressArg = None) -> Digest:
    """Store a numpy array as a ``.npy`` object; return its digest.

    Object arrays are refused (their pickles are neither portable nor safe to
    load).  No copy is made for C- or Fortran-contiguous arrays.  An ndarray
    subclass whose buffer is all of its data (``np.matrix``, ``np.recarray``,
    ``np.memmap``) is stored as its base ndarray (``get_array`` returns an
    ndarray); a masked array is refused (:class:`InvalidTypeError`): its data
    alone would silently drop the mask.
    """
    return _put_array(store, a, compress)[0]


def _put_array(store: Store, a: object, compress: CompressArg) -> Tuple[Digest, int]:
    """:func:`put_array`, also returning the object's size (header plus data)."""
    if type(a) is not np.ndarray:  # one cheap test on the hot path; subclasses and non-arrays below
        a = _base_ndarray(a)
    if a.dtype.hasobject:
        raise InvalidTypeError(
            f"put_array() refuses arrays of dtype {a.dtype} that hold Python objects; "
            "convert to a numeric, string or bytes dtype first"
        )
    if not (a.flags.c_contiguous or a.flags.f_contiguous):
        a = np.ascontiguousarray(a)
    header = _header(a)
    data = _data_view(a)
    # nbytes, not len(): len() of a memoryview counts items of its first dimension, which is
    # the byte count only for a 1-D byte view (issue: np.matrix recorded 129 bytes for 176).
    return store.objects.put_parts([header, data], compress=compress), len(header) + data.nbytes


def _base_ndarray(a: object) -> npt.NDArray[Any]:
    """``a`` as a plain ndarray (a view, no copy), or :class:`InvalidTypeError` if that would lose data.

    Hazard: a subclass may keep its shape or data outside the buffer's plain ndarray view.
    ``np.matrix`` reshapes to 2-D whatever it is given, so ``reshape(-1)`` stayed 2-D and the
    recorded size counted rows instead of bytes; a masked array's mask is not in the buffer at
    all (numpy.ma's byte view raised a bare ValueError; stored, its data would drop the mask).
    """
    if not isinstance(a, np.ndarray):
        raise InvalidTypeError(f"put_array() takes a numpy array, not {type(a).__name__}")
    if isinstance(a, np.ma.MaskedArray):
        raise InvalidTypeError(
            "put_array() refuses masked arrays: storing the data alone would silently drop the mask; "
            "store a.data and np.ma.getmaskarray(a) as two arrays (put_arrays), or a.filled(fill_value)"
        )
    # np.matrix, np.recarray, np.memmap, np.char.chararray: the buffer is all the data (same dtype,
    # shape and bytes as np.save writes for them), so their base ndarray view is stored exactly.
    return np.asarray(a)


@dataclass(frozen=True, slots=True)
class _Npy:
    """A parsed, size-checked ``.npy`` header."""

    shape: Tuple[int, ...]
    fortran: bool
    dtype: np.dtype[Any]
    offset: int
    """Where the array data starts in the object."""

    def empty(self, d: Digest, intact: Callable[[], bool]) -> npt.NDArray[Any]:
        """Fresh, uninitialized memory for the array (its size was checked against the object)."""
        try:
            return np.empty(self.shape, dtype=self.dtype, order="F" if self.fortran else "C")
        except (ValueError, TypeError, OverflowError) as e:  # shapes numpy itself refuses
            _refuse(d, f"has a .npy header numpy cannot allocate ({e})", intact)


def _refuse(d: Digest, problem: str, intact: Callable[[], bool]) -> NoReturn:
    """Refuse an object whose ``.npy`` header is unusable: damage or a well-stored lie?

    If the object no longer hashes to its name, the header was damaged on disk
    (or the file was truncated or appended to): :class:`IntegrityError`.  An
    intact object whose header does not describe its bytes was stored that way:
    :class:`StoreFormatError`.  ``intact`` hashes the object; it runs only here,
    on the error path.
    """
    if not intact():
        raise IntegrityError(
            f"object {d} is corrupt: it {problem}, and it no longer hashes to its name. "
            "Run `casstore verify --repair` and put the array again"
        )
    raise StoreFormatError(f"object {d} is not a readable .npy array: it {problem}")


# Parsed headers by (exact header bytes, object size): a dataset's arrays share a few headers, and
# numpy's parser (an ast.literal_eval) was a fifth of a verified 4 MiB map's cost beyond its hash.
# The parse is a function of exactly these, so a hit is the same answer; only successes are kept.
_HEADERS: Dict[Tuple[bytes, int], _Npy] = {}
_HEADERS_MAX = 1024


def _header_len(first: bytes) -> int:
    """Length of the ``.npy`` magic and header at the start of ``first``, 0 if not all there (or not one)."""
    if len(first) < 12 or first[:6] != b"\x93NUMPY":
        return 0
    n = 10 + int.from_bytes(first[8:10], "little") if first[6] == 1 else \
        12 + int.from_bytes(first[8:12], "little") if first[6] in (2, 3) else 0
    return n if n <= len(first) else 0


def _parse_header(first: bytes, size: int, d: Digest, intact: Callable[[], bool]) -> _Npy:
    """Parse the ``.npy`` header at the start of ``first`` for an object of ``size`` bytes.

    The header must describe exactly ``size - offset`` data bytes; anything
    else (a lying or damaged header, object dtypes, absurd shapes) is refused
    (see :func:`_refuse`) before anything is allocated.
    """
    n = _header_len(first)
    key = (first[:n], size)
    hit = _HEADERS.get(key) if n else None
    if hit is not None:
        return hit
    got = _parse_header_bytes(first, size, d, intact)
    if n == got.offset:
        if len(_HEADERS) >= _HEADERS_MAX:
            _HEADERS.clear()
        _HEADERS[key] = got
    return got


def _parse_header_bytes(first: bytes, size: int, d: Digest, intact: Callable[[], bool]) -> _Npy:
    """:func:`_parse_header` without its memo: numpy's parser and casstore's checks."""
    f = io.BytesIO(first)
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f, max_header_size=_MAX_HEADER)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f, max_header_size=_MAX_HEADER)
        else:  # 3.0 (utf-8 header) has no public reader; np.load uses this one
            shape, fortran, dtype = _npy_private("_read_array_header")(f, version, max_header_size=_MAX_HEADER)
    except _PARSE_ERRORS as e:
        _refuse(d, f"has no valid .npy header ({type(e).__name__}: {e!s:.200})", intact)
    if not isinstance(dtype, np.dtype):  # pragma: no cover - numpy always returns a dtype
        _refuse(d, "has a .npy header without a dtype", intact)
    if dtype.hasobject:
        # Refused whatever the hash says: casstore never unpickles.
        raise StoreFormatError(f"object {d} holds a Python-object array; casstore will not unpickle it")
    if (not isinstance(shape, tuple) or len(shape) > _MAX_DIMS
            or not all(type(n) is int and n >= 0 for n in shape)):
        _refuse(d, f"has a .npy header with an invalid shape {shape!r:.200}", intact)
    if type(fortran) is not bool:  # pragma: no cover - numpy checks it
        _refuse(d, f"has a .npy header with an invalid fortran_order {fortran!r:.50}", intact)
    offset = f.tell()
    want = dtype.itemsize
    for n in shape:
        want *= n
    if want != size - offset:
        _refuse(d, f"has a .npy header describing {want} data bytes ({shape!r:.100} x {dtype.itemsize}-byte "
                   f"{dtype.str}) but holds {size - offset}", intact)
    return _Npy(shape, fortran, dtype, offset)


def get_array(store: Store, digest: DigestLike, *, mmap: bool = False,
              verify: Optional[bool] = None) -> npt.NDArray[Any]:
    """Read an array: into fresh memory (verified), or ``mmap=True`` as a read-only memory map.

    ``verify`` defaults to ``True`` for reads and ``False`` for maps.  A read
    (``mmap=False``) fills fresh memory (from 2 MiB while a helper hashes the
    object file; the array's own memory if the file's stat moved meanwhile, or if
    the file changed within the clock's current tick); the
    array is returned only after the object hashed to its name
    (:class:`IntegrityError` otherwise, and no array).  ``mmap=True`` maps a raw
    object with no copy; with ``verify=True`` the file is hashed first, once
    per process while it is unchanged (device, inode, size, mtime and ctime:
    later maps cost a lookup), and the map that was hashed is the one handed
    out.  A map hands out the file's pages as they are *when touched*: only
    the hash at map time is checked.  A compressed object with ``mmap=True``
    is first materialized raw (once, verified).  A header that does not
    describe exactly the object's bytes is refused before anything is
    allocated: :class:`StoreFormatError` if the object is intact (it was stored
    that way), :class:`IntegrityError` if it was damaged.  A missing object (even
    one evicted while this runs) raises :class:`~casstore.errors.ObjectNotFoundError`.
    """
    d = Digest.coerce(digest)
    _check_read_flags("get_array", mmap, verify)
    loc = store.objects.locate(d)
    if mmap:
        path = loc.path if loc.codec.byte_exact else str(store.objects.raw_path(d))
        return _map(store, path, d, bool(verify))
    check = True if verify is None else verify
    if not loc.codec.byte_exact:
        return _read_decoded(store, d, check)
    return _read_raw(loc.path, d, check)


def _check_read_flags(fn: str, mmap: object, verify: object) -> None:
    """InvalidTypeError unless ``mmap`` is a bool and ``verify`` a bool or None.

    Hazard: a truthy non-bool (``mmap="no"``, ``mmap=1``) would silently pick the other read
    path (a map handed out unverified instead of a verified copy).
    """
    if not isinstance(mmap, bool):
        raise InvalidTypeError(f"{fn}(mmap=) takes True or False, not {type(mmap).__name__} {mmap!r:.40}")
    if verify is not None and not isinstance(verify, bool):
        raise InvalidTypeError(f"{fn}(verify=) takes True, False or None, not {type(verify).__name__}")


def _hashes_to(fd: int, size: int, d: Digest) -> Callable[[], bool]:
    """The ``intact`` check of :func:`_refuse` for an open raw object file."""
    return lambda: hash_fd(fd, size) == d


def _map(store: Store, path: str, d: Digest, verify: bool) -> np.memmap[Any, Any]:
    fd, st = open_object_file(path, d)  # a regular file, not a planted link or FIFO; gone: ObjectNotFoundError
    m: np.memmap[Any, Any]
    with open(fd, "rb", buffering=0) as f:  # np.memmap maps its own descriptor: ours closes on return
        h = _parse_header(os.pread(fd, _PREFIX, 0), st.st_size, d, _hashes_to(fd, st.st_size, d))
        order: Literal["C", "F"] = "F" if h.fortran else "C"
        try:
            if verify and h.offset < st.st_size and not store.objects.verified_once(d, st):
                # The map handed out is the one hashed (memoized per process while the file is
                # unchanged): the whole file mapped once, as one buffer (blake3's pool splits one
                # contiguous update over both cores; a header fed first made it run mostly on one),
                # then the array is a view of its data bytes.  Hashing through a map of our own and
                # letting numpy map the file again cost a map, an unmap and its TLB shoot-down per
                # call: 4 MiB arrays went from 0.72x to 0.91x of BLAKE3 of the files in one experiment.
                whole: np.memmap[Any, Any] = np.memmap(f, dtype=np.uint8, mode="r")
                store.objects.verify_mapped(d, st, whole.data, path)
                # (slices and views of a memmap are memmaps that keep its mapping alive)
                m = cast("np.memmap[Any, Any]", whole[h.offset:].view(h.dtype).reshape(h.shape, order=order))
                m.offset = h.offset
            else:
                # Verified before while unchanged (a lookup, then the map of the array alone, as for
                # verify=False: later opens 0.03 against 0.02 ms when the whole file was mapped and
                # sliced), or no data bytes: the header alone (numpy maps nothing for an empty array).
                if verify:
                    store.objects.verify_fd(d, fd, st, path)
                m = np.memmap(f, dtype=h.dtype, mode="r", offset=h.offset, shape=h.shape, order=order)
        except (ValueError, TypeError, OverflowError) as e:
            raise StoreFormatError(f"object {d} cannot be memory-mapped as the array its header describes ({e})") \
                from None
    m.filename = os.path.abspath(path)  # a map of the object file (numpy cannot know it from a descriptor)
    return m


def _read_raw(path: str, d: Digest, verify: bool) -> npt.NDArray[Any]:
    """A raw object: header from one pread, data straight into the array.

    Verified reads of :data:`_PIPE_MIN` bytes and up hash the object *file* on a
    helper (blake3's pool over a map of its pages) while this thread copies the
    same pages into the array; the array is returned only after the hash
    matched.  The copy and the hash read the same page cache, so damage at rest
    is seen by both; they could differ only if the file were written in place
    during the read, and that moves its ctime (it takes a chmod and a write; a
    hard link made or removed moves it too).  So if the file's metadata moved
    meanwhile, the bytes handed out are hashed themselves instead (:func:`_unmoved`).
    A file changed within the clock's current tick (just put, linked or touched) could
    change again without a new ctime (before Linux 6.13): its array is hashed too.
    """
    floor = stamp_floor_ns()  # before the open's fstat: see _fsprobe.settled
    fd, st = open_object_file(path, d)
    stop = threading.Event()
    beside: Optional[Beside[Digest]] = None
    try:
        size = st.st_size
        if verify and size >= _PIPE_MIN and settled(st, floor):
            # Started first: the hash (about 1.3-1.5x the read on one core) is the longer leg.
            # Hazard (docs/security.md): a file truncated under the helper's map raises SIGBUS;
            # hash_fd checks the size before mapping, and object files are read-only.
            beside = run_beside(lambda: hash_fd(fd, size, stop=stop), "casstore-verify")
        first = os.pread(fd, _PREFIX, 0)
        intact = _hashes_to(fd, size, d)
        h = _parse_header(first, size, d, intact)
        out = h.empty(d, intact)
        view = _data_view(out)
        n = min(len(view), len(first) - h.offset)
        view[:n] = first[h.offset:h.offset + n]
        _pread_exact(fd, view[n:], h.offset + n, d)
        extra = os.pread(fd, 1, size)
        got: Optional[Digest] = None
        if beside is not None:
            got = beside.join()
            if not _unmoved(fd, st):
                got = None  # hash what was handed out, below
        if verify and got is None:  # small (or moved): hash what was read, the header and the array's memory
            hh = new_hasher(threaded=len(view) >= _PIPE_MIN)
            hh.update(memoryview(first)[:h.offset])
            hh.update(view)
            got = Digest(hh.hexdigest())
    finally:
        if beside is not None:  # never leave the helper reading a closed (or reused) descriptor
            stop.set()
            beside.wait()
        os.close(fd)
    if extra:
        raise IntegrityError(f"object {d} grew while being read; file {path}")
    if verify and got != d:
        raise IntegrityError(
            f"object {d} is corrupt: it hashes to {got}; file {path}. "
            "Run `casstore verify --repair` and put the array again"
        )
    return out


def _unmoved(fd: int, before: os.stat_result) -> bool:
    """True if the open file's size, mtime and ctime are still those of ``before``.

    A write in place moves mtime and ctime (and the chmod it needs moves ctime).
    The caller asks only about a file that was settled at the open (its ctime
    below a floor read before it: :func:`~casstore._fsprobe.settled`), so any
    change since gets a later ctime, on every kernel (before Linux 6.13 a second
    change within one clock tick keeps the ctime it had: docs/security.md).
    """
    now = os.fstat(fd)
    return (now.st_size, now.st_mtime_ns, now.st_ctime_ns) == (before.st_size, before.st_mtime_ns,
                                                               before.st_ctime_ns)


def _pread_exact(fd: int, view: memoryview, off: int, d: Digest) -> None:
    """Fill ``view`` from ``off`` (looping over short reads); a file ending early is truncated."""
    got = pread_into(fd, view, off)
    if got < len(view):
        raise IntegrityError(f"object {d} is truncated: {got} of {len(view)} bytes at offset {off}")


def _read_decoded(store: Store, d: Digest, verify: bool) -> npt.NDArray[Any]:
    """A compressed object: decoded by the codec's bounded stream (the stream verifies at its end)."""
    size = store.objects.stat(d).size
    with store.objects.open(d, verify=verify) as stream:
        f = cast(_Reader, stream)  # an io.BufferedReader over the object layer's verifying reader
        first = read_up_to(f, min(_PREFIX, size))

        def intact() -> bool:
            try:
                store.objects.verify_file(d)  # decodes (bounded) and hashes
            except IntegrityError:
                return False
            return True

        h = _parse_header(first, size, d, intact)
        out = h.empty(d, intact)
        view = _data_view(out)
        n = len(first) - h.offset
        view[:n] = first[h.offset:]
        _readinto_exact(f, view, n, d)
        # Read past the end, verify or not: the verifying stream compares the hash
        # there, and the bounded decoder refuses output beyond the recorded size.
        if f.read(1):
            raise IntegrityError(f"object {d} decodes to more than its recorded {size} bytes")
    return out


class _Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...

    def readinto(self, b: memoryview, /) -> Optional[int]: ...




def _readinto_exact(f: _Reader, view: memoryview, start: int, d: Digest) -> None:
    got = start
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise IntegrityError(f"object {d} is truncated: {got} of {len(view)} data bytes")
        got += n


def put_arrays(store: Store, arrays: Mapping[str, npt.NDArray[Any]], *, compress: CompressArg = None) -> Digest:
    """Store several arrays; return the digest of a manifest version naming them."""
    if not isinstance(arrays, Mapping):
        raise InvalidTypeError(f"put_arrays() takes a mapping of name -> array, not {type(arrays).__name__}")
    entries: Dict[str, Entry] = {}
    for name, a in arrays.items():
        validate_key(name)
        d, size = _put_array(store, a, compress)
        entries[name] = Entry(d, size, {"dtype": str(a.dtype), "shape": list(a.shape)})
    data = encode_manifest(entries, {"kind": ARRAYS_KIND}, None)
    return store.objects.put(data, compress=False)


def get_arrays(store: Store, digest: DigestLike, *, mmap: bool = False,
               verify: Optional[bool] = None) -> Dict[str, npt.NDArray[Any]]:
    """Read a bundle written by :func:`put_arrays` as ``{name: array}`` (a digest or the name it is pinned under)."""
    _check_read_flags("get_arrays", mmap, verify)  # before any read (an empty bundle would never check)
    man = read_manifest(store, digest)
    if man.meta.get("kind") != ARRAYS_KIND:
        raise StoreFormatError(f"manifest {man.digest} is not an array bundle (put_arrays)")
    return {k: get_array(store, e.digest, mmap=mmap, verify=verify) for k, e in man.items()}
