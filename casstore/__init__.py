"""casstore: a content-addressed artifact store for Python data and ML work.

>>> import casstore
>>> store = casstore.open("~/.cache/casstore")
>>> d = store.put(b"hello")
>>> store.get(d)
b'hello'
"""

from __future__ import annotations

from . import errors
from .cache import IndexCache
from .digest import Digest
from .errors import (
    AmbiguousDigestError,
    BackendError,
    CacheIndexError,
    CasstoreError,
    CompressedObjectError,
    FrozenError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ObjectNotFoundError,
    ReadOnlyError,
    RemoteConflictError,
    StoreFormatError,
)
from .manifest import Diff, Entry, Manifest, ManifestEditor
from .remote import Remote
from .store import ObjectInfo, Store, open_store

open = open_store  # noqa: A001 - ``casstore.open(path)`` is the documented entry point

__version__ = "0.1.0"

__all__ = [
    "open",
    "open_store",
    "Store",
    "Digest",
    "ObjectInfo",
    "Entry",
    "Manifest",
    "ManifestEditor",
    "Diff",
    "IndexCache",
    "Remote",
    "errors",
    "CasstoreError",
    "ObjectNotFoundError",
    "InvalidDigestError",
    "AmbiguousDigestError",
    "InvalidInputError",
    "InvalidTypeError",
    "IntegrityError",
    "FrozenError",
    "LockTimeout",
    "StoreFormatError",
    "ReadOnlyError",
    "BackendError",
    "RemoteConflictError",
    "CacheIndexError",
    "CompressedObjectError",
    "__version__",
]
