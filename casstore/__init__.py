"""casstore: a content-addressed artifact store for Python data and ML work.

>>> import casstore
>>> store = casstore.open("~/.cache/casstore")
>>> d = store.put(b"hello")
>>> store.get(d)
b'hello'
"""

from __future__ import annotations

from . import errors
from ._lock import Filesystem
from .cache import IndexCache
from .digest import Digest
from .errors import (
    AmbiguousDigestError,
    BackendError,
    CacheIndexError,
    CasstoreError,
    CompressedObjectError,
    DiskFullError,
    FileChangedError,
    FrozenError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    InvalidTypeError,
    LockTimeout,
    ManifestNotFoundError,
    NameExistsError,
    NetworkTimeout,
    ObjectNotFoundError,
    ReadOnlyError,
    RemoteConflictError,
    StoreFormatError,
)
from .folders import AddResult, FolderStatus, Skipped
from .maintenance import GCPlan, GCResult, LimitResult, NameUsage, Usage, VerifyReport
from .manifests import Diff, EditTransaction, Entry, Manifest, ManifestEditor, MetaDiff, NameInfo
from .objects import LocalObjects, ObjectInfo, ObjectStore
from .objects.s3 import S3Objects
from .refs import LocalRefs, Ref, RefStore
from .refs.s3 import S3Refs
from .store import Store, open_store, remote_cache_dir
from .sync import Remote, RemoteGCPlan, RemoteGCResult, RemoteNameUsage, RemoteUsage, TransferReport

open = open_store  # noqa: A001 - ``casstore.open(path)`` is the documented entry point

__version__ = "0.1.0"

__all__ = [
    "open",
    "open_store",
    "remote_cache_dir",
    "Store",
    "Digest",
    "ObjectInfo",
    "ObjectStore",
    "LocalObjects",
    "S3Objects",
    "Ref",
    "RefStore",
    "LocalRefs",
    "S3Refs",
    "Entry",
    "Manifest",
    "ManifestEditor",
    "EditTransaction",
    "Diff",
    "MetaDiff",
    "NameInfo",
    "IndexCache",
    "AddResult",
    "FolderStatus",
    "Skipped",
    "FileChangedError",
    "Remote",
    "TransferReport",
    "RemoteGCPlan",
    "RemoteGCResult",
    "RemoteUsage",
    "RemoteNameUsage",
    "GCPlan",
    "GCResult",
    "LimitResult",
    "Usage",
    "NameUsage",
    "VerifyReport",
    "Filesystem",
    "errors",
    "CasstoreError",
    "ObjectNotFoundError",
    "ManifestNotFoundError",
    "NameExistsError",
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
    "DiskFullError",
    "NetworkTimeout",
    "__version__",
]
