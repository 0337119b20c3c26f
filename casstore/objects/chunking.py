"""Content-defined chunks of large objects on remotes (issue 16): the chunker, recipes, the local chunk index.

On a remote, an object of at least :attr:`Chunking.min_object` bytes is stored as
content-defined chunks (``<prefix>chunks/<2 hex>/<62 hex>``, each named by the BLAKE3
of its own bytes, create-only like objects) plus a *recipe*
(``<prefix>recipes/<2 hex>/<62 hex>``, named by the whole object's digest) listing
them in order.  Addresses do not change: an object is still named by the BLAKE3 of
its whole content, and local objects stay whole files.

Boundaries come from FastCDC (``pyfastcdc``, a compiled Cython implementation:
1.9 GB/s here, a third of one core's BLAKE3 and 1.3x the ``fastcdc``
package), so an insertion moves only the chunks around it.  Average 1 MiB
(256 KiB - 4 MiB): fewer, larger chunks cost fewer requests per GiB; the dedupe
lost to larger chunks is measured in benchmarks/bench_chunks.py.

Hazards this is built around:

* **A hostile recipe** (a remote is hostile until checked): :func:`decode_recipe`
  caps its size, checks every field's type, that chunk lengths are positive and at
  most :data:`MAX_CHUNK`, and that they add up to the size it claims; a recipe that
  fails is a :class:`StoreFormatError`.  Every chunk is hashed against its name
  before it is used, and the reassembled whole against the object's digest before
  anything is published: a tampered chunk or recipe stores nothing.
* **A recipe naming a missing chunk**: a push uploads every chunk (create-only)
  before the recipe, so a crash midway leaves chunks without a recipe (harmless,
  a rerun skips them), never a recipe without its chunks.
* **The local chunk index is only a hint**: it says where a chunk's bytes were
  seen locally (object, offset, length); the bytes read from there are hashed
  against the chunk's name before use, so a stale, damaged or hostile index entry
  costs a download, never a wrong byte.  It lives in ``state/chunks.sqlite``
  (SQLite: atomic, concurrent readers and writers on a local filesystem); any
  error opening or using it makes it empty for that call.
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple

import msgpack

from .._fs import run_beside
from .._shared import STATE
from ..digest import Digest, hash_bytes, new_hasher
from ..errors import IntegrityError, StoreFormatError

__all__ = ["Chunking", "Recipe", "ChunkRef", "decode_recipe", "ChunkIndex", "MAX_CHUNK", "MAX_RECIPE_BYTES",
           "RECIPE_FORMAT", "DEFAULT_CHUNKING"]

MiB = 1 << 20
MAX_CHUNK = 64 * MiB
"""No chunk of a recipe may be larger (ours are at most :attr:`Chunking.max_size`)."""
MAX_RECIPE_BYTES = 64 * MiB
"""A recipe larger than this is refused (a 1 TiB object in 1 MiB chunks needs about 40 MiB)."""
RECIPE_WINDOW = 64 * MiB
"""Bytes :meth:`Chunking.recipe_of` reads and cuts at a time (its memory while a push cuts an object)."""
RECIPE_FORMAT = "casstore-recipe"
RECIPE_VERSION = 1


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk of a recipe: its digest, its offset in the object and its length."""

    digest: Digest
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Recipe:
    """How an object is made of chunks, in order."""

    digest: Digest
    """The whole object's digest."""
    size: int
    chunks: Tuple[ChunkRef, ...]

    def encode(self) -> bytes:
        """The msgpack form stored on a remote."""
        packed: bytes = msgpack.packb({"format": RECIPE_FORMAT, "v": RECIPE_VERSION, "object": self.digest.raw,
                                       "size": self.size,
                                       "chunks": [[c.digest.raw, c.length] for c in self.chunks]},
                                      use_bin_type=True)
        return packed


def decode_recipe(data: bytes, digest: Digest, where: str) -> Recipe:
    """Parse and check a recipe read from ``where``; :class:`StoreFormatError` if it is not one for ``digest``."""

    def bad(why: str) -> StoreFormatError:
        return StoreFormatError(f"{where}: the recipe of object {digest} is invalid ({why}); nothing was stored. "
                                "Push the object again from a good copy")

    if len(data) > MAX_RECIPE_BYTES:
        raise bad(f"{len(data)} bytes, more than {MAX_RECIPE_BYTES}")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=64, max_str_len=64,
                              max_array_len=MAX_RECIPE_BYTES // 8, max_map_len=16)
    except Exception as e:  # noqa: BLE001 - any decoder failure is a malformed recipe
        raise bad(f"not msgpack: {type(e).__name__}") from None
    if not isinstance(doc, dict) or doc.get("format") != RECIPE_FORMAT:
        raise bad("not a casstore recipe")
    if doc.get("v") != RECIPE_VERSION:
        raise bad(f"format version {doc.get('v')!r}; this casstore reads version {RECIPE_VERSION}: upgrade casstore")
    if doc.get("object") != digest.raw:
        raise bad("it names another object")
    size, items = doc.get("size"), doc.get("chunks")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(items, list):
        raise bad("size or chunk list missing")
    chunks: List[ChunkRef] = []
    off = 0
    for item in items:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], bytes) or len(item[0]) != 32
                or not isinstance(item[1], int) or isinstance(item[1], bool) or not 0 < item[1] <= MAX_CHUNK):
            raise bad("a malformed chunk entry")
        chunks.append(ChunkRef(Digest(item[0].hex()), off, item[1]))
        off += item[1]
    if off != size:
        raise bad(f"its chunks add up to {off} bytes, not the {size} it claims")
    return Recipe(digest, size, tuple(chunks))


@dataclass(frozen=True, slots=True)
class Chunking:
    """Which objects are chunked on a remote, and how (a strategy object of :class:`~casstore.objects.s3.S3Objects`)."""

    min_object: int = 4 * MiB
    """Objects at least this large are stored as chunks; smaller ones whole."""
    avg_size: int = 1 * MiB
    min_size: int = 256 * 1024
    max_size: int = 4 * MiB

    def chunks_of(self, size: int) -> bool:
        """Is an object of ``size`` bytes stored as chunks?"""
        return size >= self.min_object

    def _cdc(self) -> Any:
        import pyfastcdc

        return pyfastcdc.FastCDC(avg_size=self.avg_size, min_size=self.min_size, max_size=self.max_size)

    def cut(self, buf: memoryview) -> Iterator[Tuple[int, int]]:
        """``(offset, length)`` of each content-defined chunk of ``buf``, in order."""
        for c in self._cdc().cut_buf(buf):
            yield int(c.offset), int(c.length)

    def recipe(self, digest: Digest, buf: memoryview) -> Recipe:
        """Cut and hash ``buf`` (the object ``digest``'s bytes) into a recipe.

        :class:`IntegrityError` if they do not hash to ``digest`` (see :meth:`recipe_of`).
        """
        return self.recipe_of(digest, _BufferReader(buf), len(buf))

    def recipe_of(self, digest: Digest, f: _ReadInto, size: int) -> Recipe:
        """Cut and hash the object ``digest`` of ``size`` bytes, read once in order from ``f``, into
        a recipe, in bounded memory (one window of :data:`RECIPE_WINDOW` bytes).

        The chunk boundaries are those :meth:`cut` finds in the same bytes: each window is cut
        whole, and its last chunk, which the window's end may have cut, is carried to the front
        of the next (a FastCDC boundary depends only on the bytes from its chunk's start).  The
        chunks' bytes, as read, are hashed as chunks here while a helper feeds the same window
        to the object's hash, so the recipe's chunks join into bytes that hash to ``digest``:
        :class:`IntegrityError` otherwise, or when ``f`` ends before or after ``size`` bytes.
        Hazard: hashing a map of the file whole and then cutting it read each byte twice, and a
        file rewritten in between gave a recipe (create-only on a remote, for good) whose chunks
        join into other bytes; a map of a file truncated meanwhile kills the process (SIGBUS),
        where a read just ends early.
        """
        cdc = self._cdc()
        buf = bytearray(min(max(RECIPE_WINDOW, 4 * self.max_size), size + 1))  # (size + 1: one window, eof)
        mv = memoryview(buf)
        whole = new_hasher()
        chunks: List[ChunkRef] = []
        base = have = 0  # file offset of buf[0]; bytes of buf filled
        eof = False
        while True:
            while have < len(buf) and not eof:
                # At most one byte past ``size`` in all: a file that keeps growing is refused (base ends
                # past size), not read forever.
                limit = size + 1 - base
                n = f.readinto(mv[have:min(len(buf), limit)]) or 0
                have += n
                eof = not n or have >= limit
            if not have:
                break
            cuts = [(int(c.offset), int(c.length)) for c in cdc.cut_buf(mv[:have])]
            if not eof:
                cuts.pop()  # (a full window holds >= 4 chunks: max_size cuts at the latest)
            done = cuts[-1][0] + cuts[-1][1]
            # The object's hash of this window's final chunks on the other core, the chunks' here.
            job = run_beside(functools.partial(whole.update, mv[:done]), "casstore-recipe")
            try:
                chunks.extend(ChunkRef(hash_bytes(mv[off:off + n], threaded=False), base + off, n)
                              for off, n in cuts)
            finally:
                job.join()
            buf[:have - done] = buf[done:have]  # the carried chunk to the front (a copy: overlap-safe)
            base, have = base + done, have - done
            if eof and not have:
                break
        got = Digest(whole.hexdigest())
        if got != digest or base != size:
            raise IntegrityError(f"object {digest} is corrupt: its {base} bytes (of {size}) hash to {got}")
        return Recipe(digest, size, tuple(chunks))


class _ReadInto(Protocol):
    def readinto(self, b: memoryview, /) -> int: ...


class _BufferReader:
    """``readinto`` over an in-memory buffer (for :meth:`Chunking.recipe`)."""

    __slots__ = ("_mv", "_pos")

    def __init__(self, buf: memoryview) -> None:
        self._mv = memoryview(buf).cast("B")
        self._pos = 0

    def readinto(self, b: memoryview, /) -> int:
        n = min(len(b), len(self._mv) - self._pos)
        b[:n] = self._mv[self._pos:self._pos + n]
        self._pos += n
        return n


DEFAULT_CHUNKING = Chunking()


class ChunkIndex:
    """Where chunk bytes were seen in this store: chunk digest -> (object, offset, length). A hint only."""

    def __init__(self, root: Path) -> None:
        self.path = root / STATE / "chunks.sqlite"
        """The SQLite file."""

    @contextlib.contextmanager
    def _db(self) -> Iterator[Optional[sqlite3.Connection]]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            con = sqlite3.connect(self.path, timeout=30.0)
        except (OSError, sqlite3.Error):
            yield None
            return
        try:
            con.execute("CREATE TABLE IF NOT EXISTS chunks (chunk BLOB PRIMARY KEY, object BLOB NOT NULL, "
                        "off INTEGER NOT NULL, len INTEGER NOT NULL) WITHOUT ROWID")
            yield con
            con.commit()
        except sqlite3.Error:
            con.rollback()
        finally:
            con.close()

    def add(self, recipe: Recipe) -> None:
        """Record that ``recipe.digest``'s local copy holds each of its chunks."""
        with self._db() as con:
            if con is not None:
                con.executemany("INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?)",
                                [(c.digest.raw, recipe.digest.raw, c.offset, c.length) for c in recipe.chunks])

    def forget(self, objects: Iterable[Digest]) -> int:
        """Drop the rows naming ``objects`` (gc deleted them); returns how many went.

        A row naming a deleted object only costs a download (it is a hint), but without this
        the index would grow with every object ever pushed or pulled.  One pass over the table
        (sqlite joins it with the deleted set), under gc's lock; an index never created is left so.
        """
        gone = [(d.raw,) for d in objects]
        if not gone or not self.path.is_file():
            return 0
        with self._db() as con:
            if con is None:
                return 0
            con.execute("CREATE TEMP TABLE gone (object BLOB PRIMARY KEY) WITHOUT ROWID")
            con.executemany("INSERT OR IGNORE INTO gone VALUES (?)", gone)
            return int(con.execute("DELETE FROM chunks WHERE object IN (SELECT object FROM gone)").rowcount)
        return 0  # an sqlite error (rolled back by _db): nothing went

    def recipes(self, sizes: Mapping[Digest, int]) -> Dict[Digest, Recipe]:
        """The recipes of the objects of ``sizes`` (digest -> size) that the index holds whole: every row
        naming the object, in offset order, covering exactly ``[0, size)``.  An object whose chunks are
        partly recorded under another object (a chunk shared, or repeated within it) is left out.

        A hint like every row: a push compares the encoded length with the listed recipe's
        (:meth:`~casstore.objects.s3.S3Objects.present`) and reads the recipe when they differ.
        """
        rows: Dict[Digest, List[Tuple[int, int, bytes]]] = {}
        todo = [d for d, n in sizes.items() if n > 0]
        if not todo or not self.path.is_file():
            return {}
        with self._db() as con:
            if con is None:
                return {}
            for chunk, o, off, n in _rows_where(con, "object", todo):
                rows.setdefault(o, []).append((off, n, chunk.raw))
        out: Dict[Digest, Recipe] = {}
        for d, parts in rows.items():
            parts.sort()
            at = 0
            chunks: List[ChunkRef] = []
            for off, n, raw in parts:
                if off != at or not 0 < n <= MAX_CHUNK:
                    break
                chunks.append(ChunkRef(Digest(raw.hex()), off, n))
                at += n
            if at == sizes[d] and len(chunks) == len(parts):
                out[d] = Recipe(d, at, tuple(chunks))
        return out

    def find(self, chunks: Iterable[Digest]) -> Dict[Digest, Tuple[Digest, int, int]]:
        """Where each of ``chunks`` (those known) was seen: ``(object, offset, length)``."""
        out: Dict[Digest, Tuple[Digest, int, int]] = {}
        with self._db() as con:
            if con is None:
                return out
            for c, o, off, n in _rows_where(con, "chunk", list(chunks)):
                out[c] = (o, off, n)
        return out


def _rows_where(con: sqlite3.Connection, column: str, digests: Sequence[Digest]
                ) -> Iterator[Tuple[Digest, Digest, int, int]]:
    """``(chunk, object, offset, length)`` of the index rows whose ``column`` ("chunk" or "object") is one of
    ``digests``, 500 per query (SQLite's variable limit); malformed rows (hostile or damaged) skipped."""
    assert column in ("chunk", "object")
    for i in range(0, len(digests), 500):
        part = digests[i:i + 500]
        got = con.execute(f"SELECT chunk, object, off, len FROM chunks WHERE {column} IN "
                          f"({','.join('?' * len(part))})", [d.raw for d in part]).fetchall()
        for c, o, off, n in got:
            if isinstance(c, bytes) and isinstance(o, bytes) and len(c) == 32 and len(o) == 32:
                yield Digest(c.hex()), Digest(o.hex()), int(off), int(n)
