"""Object codecs: raw bytes or a zstd frame, and the check that decides.

zstd never makes a put faster on this hardware; it is a space decision.  So
before compressing we compress a small sample at level 1 and keep the data
raw when the predicted ratio is below :data:`MIN_RATIO` (random bytes and
float32 weights score 1.0-1.08).  A 16 x 64 KiB sample predicted the ratio
within ~3% in ~1 ms here.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO, Optional, Union

import zstandard

from .errors import InvalidInputError

__all__ = [
    "MIN_RATIO", "normalize_compress", "sample_pays", "file_sample_pays", "compressor", "decompressor",
    "DecodeError",
]

MIN_RATIO = 1.1
FLUSH_FRAME = zstandard.FLUSH_FRAME
DecodeError = zstandard.ZstdError
"""Raised by the zstd decoder on damaged input (callers turn it into IntegrityError)."""
SAMPLE_CHUNKS = 16
SAMPLE_CHUNK = 64 * 1024
DEFAULT_LEVEL = 3

CompressArg = Union[None, bool, int, str]


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
    if isinstance(value, int) and 1 <= value <= 22:
        return value
    raise InvalidInputError(f"invalid compression level {value!r}; use 1-22, True/False or 'zstd'/'raw'")


def _ratio(sample: bytes) -> float:
    if not sample:
        return 1.0
    out = zstandard.ZstdCompressor(level=1).compress(sample)
    return len(sample) / max(1, len(out))


def sample_pays(data: Union[bytes, bytearray, memoryview]) -> bool:
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


def compressor(level: int) -> zstandard.ZstdCompressor:
    """A zstd compressor; multi-threaded frames, content size written when known."""
    return zstandard.ZstdCompressor(level=level, threads=-1, write_content_size=True)


def decompressor() -> zstandard.ZstdDecompressor:
    """A zstd decompressor."""
    return zstandard.ZstdDecompressor()


def open_decoded(f: BinaryIO) -> BinaryIO:
    """Wrap a compressed object file in a streaming decoder."""
    reader: BinaryIO = decompressor().stream_reader(f, read_across_frames=True)
    return reader


# zstd objects end with a skippable frame recording the uncompressed size, so
# stat() needs no decompression; every zstd decoder skips it (docs/format.md).
_TRAILER_MAGIC = 0x184D2A5E
_TRAILER_TAG = b"CSZ1"
_TRAILER = struct.Struct("<II4sQ")
TRAILER_SIZE = _TRAILER.size


def size_trailer(size: int) -> bytes:
    """The 20-byte skippable frame that ends every zstd object."""
    return _TRAILER.pack(_TRAILER_MAGIC, 12, _TRAILER_TAG, size)


def read_size_trailer(fd: int, file_size: int) -> Optional[int]:
    """The uncompressed size from a zstd object's trailer, or None if it has none."""
    if file_size < TRAILER_SIZE:
        return None
    tail = os.pread(fd, TRAILER_SIZE, file_size - TRAILER_SIZE)
    if len(tail) != TRAILER_SIZE:
        return None
    magic, ln, tag, size = _TRAILER.unpack(tail)
    if magic != _TRAILER_MAGIC or ln != 12 or tag != _TRAILER_TAG:
        return None
    return int(size)
