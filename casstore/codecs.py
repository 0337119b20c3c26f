"""Object codecs as a small strategy: how an object's bytes are stored on disk.

A codec knows its file-name suffix, how to encode a buffer, how to read back
the uncompressed size without decoding, and how to open a decoding stream
whose output is **bounded by the size the object records** (a decompression
bomb, or a frame that claims more than the recorded size, is an
:class:`~casstore.errors.IntegrityError`, never an allocation beyond the bound).
Adding a codec means one new :class:`Codec` subclass here and an entry in
:data:`CODECS`; nothing else branches on codec names.

zstd never makes a put faster on this hardware; it is a space decision.  So
before compressing we compress a small sample at level 1 and keep the data
raw when the predicted ratio is below :data:`MIN_RATIO` (random bytes and
float32 weights score 1.0-1.08).  A 16 x 64 KiB sample predicted the ratio
within ~3% in ~1 ms here.
"""

from __future__ import annotations

import io
import os
import struct
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, BinaryIO, Dict, List, Optional, Tuple, Union

from .errors import IntegrityError, InvalidInputError

if TYPE_CHECKING:
    import zstandard

# zstandard is imported where a zstd object is made or read (3 ms of every CLI start otherwise,
# and most stores are raw).

__all__ = [
    "Codec", "RawCodec", "ZstdCodec", "RAW", "ZSTD", "CODECS", "by_name", "by_suffix",
    "MIN_RATIO", "DEFAULT_LEVEL", "CompressArg", "normalize_compress", "sample_pays", "file_sample_pays",
]

MIN_RATIO = 1.1
SAMPLE_CHUNKS = 16
SAMPLE_CHUNK = 64 * 1024
DEFAULT_LEVEL = 3

Buffer = Union[bytes, bytearray, memoryview]
CompressArg = Union[None, bool, int, str]


class Codec(ABC):
    """How one kind of object file stores its bytes (see docs/format.md)."""

    name: str
    """``"raw"`` or ``"zstd"``: the value of ``ObjectInfo.codec``."""
    suffix: str
    """File-name suffix under ``objects/`` (the codec is known from the name, never guessed
    from the content: raw content may itself begin with zstd's magic number)."""
    byte_exact: bool
    """The file holds exactly the object's bytes (a path or memory map of it is the object)."""

    @abstractmethod
    def size_of(self, fd: int, file_size: int) -> Optional[int]:
        """The uncompressed size recorded in an open object file; ``None`` if it records none (damaged)."""

    @abstractmethod
    def encode(self, data: Buffer, level: int) -> Buffer:
        """The stored form of ``data`` (a complete object file)."""

    @abstractmethod
    def open_decoder(self, f: BinaryIO, size: int, *, what: str) -> BinaryIO:
        """A stream of the uncompressed bytes of object file ``f``, at most ``size`` of them.

        More output than ``size`` (or undecodable data) raises :class:`IntegrityError`
        naming ``what``; nothing beyond ``size`` is ever buffered.
        """

    def header_problem(self, fd: int, file_size: int) -> Optional[str]:
        """Why an open object file cannot be of this codec, from its framing alone (``None``: it can be).

        Cheap checks only (a magic number, a trailer): ``verify --fast`` relies on them.
        """
        return None

    def decode(self, stored: Buffer, size: int, *, what: str) -> bytes:
        """The uncompressed bytes of a whole stored object held in memory (bounded by ``size``)."""
        parts: List[bytes] = []
        n = 0
        # Chunked, never one read(size): a damaged size field must not allocate
        # what it claims; memory grows only with output actually produced.
        with self.open_decoder(io.BytesIO(stored), size, what=what) as r:
            while True:
                chunk = r.read(1 << 20)
                if not chunk:
                    break
                parts.append(chunk)
                n += len(chunk)
        out = b"".join(parts)
        if n != size:
            raise IntegrityError(f"{what} decodes to {len(out)} bytes, not its recorded {size}")
        return out

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class RawCodec(Codec):
    """The bytes as they are: the file is the object."""

    name = "raw"
    suffix = ""
    byte_exact = True

    def size_of(self, fd: int, file_size: int) -> Optional[int]:
        """A raw file's size is the object's size."""
        return file_size

    def encode(self, data: Buffer, level: int) -> Buffer:
        """Raw objects are stored as they are."""
        return data

    def open_decoder(self, f: BinaryIO, size: int, *, what: str) -> BinaryIO:
        """The file itself (its size is checked by whoever hashes it)."""
        return f


# zstd objects end with a skippable frame recording the uncompressed size, so
# stat() needs no decompression; every zstd decoder skips it (docs/format.md).
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # every zstd frame starts with it (RFC 8878)
_TRAILER_MAGIC = 0x184D2A5E
_TRAILER_TAG = b"CSZ1"
_TRAILER = struct.Struct("<II4sQ")
TRAILER_SIZE = _TRAILER.size


class _Bounded(io.RawIOBase):
    """A zstd stream reader that refuses to produce more than ``size`` bytes.

    Hazard: a hostile or damaged object may decode to far more than it records
    (a decompression bomb).  Reads are capped at ``size + 1`` in total; the
    extra byte proves the bound was broken and raises before being returned.
    """

    def __init__(self, f: BinaryIO, size: int, what: str) -> None:
        super().__init__()
        import zstandard

        self._src = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True, closefd=False)
        self._error = zstandard.ZstdError  # (kept: readinto is called per block)
        self._left = size
        self._size = size
        self._what = what

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview | bytearray) -> int:  # type: ignore[override]
        mv = memoryview(b).cast("B")
        want = min(len(mv), self._left + 1)
        if want == 0:
            return 0
        try:
            n: int = self._src.readinto(mv[:want])
        except self._error as e:
            raise IntegrityError(f"{self._what} is corrupt: its zstd data cannot be decoded ({e})") from None
        if n > self._left:
            raise IntegrityError(
                f"{self._what} is corrupt: it decodes to more than its recorded {self._size} bytes "
                "(refused before reading further: a damaged or hostile zstd frame)"
            )
        self._left -= n
        return n

    def tell(self) -> int:
        return self._size - self._left

    def close(self) -> None:
        if not self.closed:
            self._src.close()  # type: ignore[no-untyped-call]
        super().close()


class ZstdCodec(Codec):
    """A zstd frame followed by a 20-byte skippable frame holding the uncompressed size."""

    name = "zstd"
    suffix = ".zst"
    byte_exact = False

    def size_of(self, fd: int, file_size: int) -> Optional[int]:
        """The uncompressed size from the trailer, or ``None`` if the file has none."""
        if file_size < TRAILER_SIZE:
            return None
        tail = os.pread(fd, TRAILER_SIZE, file_size - TRAILER_SIZE)
        if len(tail) != TRAILER_SIZE:
            return None
        magic, ln, tag, size = _TRAILER.unpack(tail)
        if magic != _TRAILER_MAGIC or ln != 12 or tag != _TRAILER_TAG:
            return None
        return int(size)

    def header_problem(self, fd: int, file_size: int) -> Optional[str]:
        """A zstd object starts with a zstd frame's magic number and ends with the size trailer."""
        if self.size_of(fd, file_size) is None:
            return "has no size trailer (truncated or damaged)"
        if os.pread(fd, 4, 0) != _ZSTD_MAGIC:
            return "does not start with a zstd frame"
        return None

    def encode(self, data: Buffer, level: int) -> bytes:
        """One zstd frame (content size recorded) plus the size trailer."""
        return bytes(self.compressor(level).compress(data)) + self.trailer(len(data))

    def open_decoder(self, f: BinaryIO, size: int, *, what: str) -> BinaryIO:
        """A bounded decoding stream (see :class:`_Bounded`)."""
        return _Bounded(f, size, what)  # type: ignore[return-value]

    @staticmethod
    def compressor(level: int) -> zstandard.ZstdCompressor:
        """A zstd compressor; multi-threaded frames, content size written when known."""
        import zstandard

        return zstandard.ZstdCompressor(level=level, threads=-1, write_content_size=True)

    @staticmethod
    def trailer(size: int) -> bytes:
        """The 20-byte skippable frame that ends every zstd object."""
        return _TRAILER.pack(_TRAILER_MAGIC, 12, _TRAILER_TAG, size)

    @property
    def FLUSH_FRAME(self) -> int:  # noqa: N802 - zstandard's constant, under its own name
        """The flush mode that ends a frame (for stream writers)."""
        import zstandard

        return int(zstandard.FLUSH_FRAME)


RAW: Codec = RawCodec()
ZSTD: ZstdCodec = ZstdCodec()
CODECS: Tuple[Codec, ...] = (RAW, ZSTD)
"""Every codec, in the order readers prefer them (raw first: it needs no decoding)."""
_BY_NAME: Dict[str, Codec] = {c.name: c for c in CODECS}


def by_name(name: str) -> Codec:
    """The codec called ``name`` (``"raw"``, ``"zstd"``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise InvalidInputError(f"unknown codec {name!r}; known: {', '.join(_BY_NAME)}") from None


def by_suffix(filename: str) -> Tuple[Codec, str]:
    """``(codec, stem)`` of an object file name (longest suffix wins)."""
    for c in sorted(CODECS, key=lambda c: -len(c.suffix)):
        if c.suffix and filename.endswith(c.suffix):
            return c, filename[: -len(c.suffix)]
    return RAW, filename


def normalize_compress(value: CompressArg, default_level: int) -> Optional[int]:
    """Turn a user's ``compress=`` into a zstd level, or ``None`` for raw.

    Accepts ``False``/``None``/``"raw"``/``"none"`` (raw), ``True``/``"zstd"``
    (the store's level), or an ``int`` level (1..22).
    """
    if value is None or value is False:
        return None
    if value is True:
        return default_level
    if isinstance(value, str):
        v = value.lower()
        if v in ("raw", "none", "off"):
            return None
        if v in ("zstd", "auto", "on"):
            return default_level
        raise InvalidInputError(f"unknown compression {value!r}; use 'raw', 'zstd' or a zstd level 1-22")
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 22:
        return value
    raise InvalidInputError(f"invalid compression level {value!r}; use 1-22, True/False or 'zstd'/'raw'")


def _ratio(sample: bytes) -> float:
    if not sample:
        return 1.0
    import zstandard

    out = zstandard.ZstdCompressor(level=1).compress(sample)
    return len(sample) / max(1, len(out))


def sample_pays(data: Buffer) -> bool:
    """Would compressing ``data`` save at least ~10%?  Looks at a spread sample."""
    n = len(data)
    if n < 512:
        return False  # a zstd frame header alone eats most of the gain
    mv = memoryview(data)
    total = SAMPLE_CHUNKS * SAMPLE_CHUNK
    if n <= total:
        return _ratio(bytes(mv)) >= MIN_RATIO
    step = (n - SAMPLE_CHUNK) // (SAMPLE_CHUNKS - 1)
    parts = [bytes(mv[i * step : i * step + SAMPLE_CHUNK]) for i in range(SAMPLE_CHUNKS)]
    return _ratio(b"".join(parts)) >= MIN_RATIO


def file_sample_pays(fd: int, size: int) -> bool:
    """:func:`sample_pays` for an open file, reading only the sample with ``pread``."""
    if size < 512:
        return False
    total = SAMPLE_CHUNKS * SAMPLE_CHUNK
    if size <= total:
        return _ratio(os.pread(fd, size, 0)) >= MIN_RATIO
    step = (size - SAMPLE_CHUNK) // (SAMPLE_CHUNKS - 1)
    parts = [os.pread(fd, SAMPLE_CHUNK, i * step) for i in range(SAMPLE_CHUNKS)]
    return _ratio(b"".join(parts)) >= MIN_RATIO
