"""casstore: a content-addressed artifact store for Python data and ML work.

>>> import casstore
>>> store = casstore.open("~/.cache/casstore")
>>> d = store.put(b"hello")
>>> store.get(d)
b'hello'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

from . import errors
from ._lazy import lazy_attributes
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
    LockCycleError,
    LockTimeout,
    ManifestNotFoundError,
    MissingNodeError,
    NameExistsError,
    NetworkTimeout,
    ObjectNotFoundError,
    ReadOnlyError,
    RemoteConflictError,
    StoreFormatError,
)

if TYPE_CHECKING:
    from ._lock import Filesystem
    from .cache import IndexCache
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

# Everything else is imported on first use (PEP 562): ``casstore status`` of an
# unchanged folder takes ~0.1 s, and importing every feature (remotes, gc,
# the index cache, boto3's neighbours) would be most of it.  name -> (module, attribute).
_LAZY: Dict[str, Tuple[str, str]] = {
    "Filesystem": ("._lock", "Filesystem"),
    "IndexCache": (".cache", "IndexCache"),
    "AddResult": (".folders", "AddResult"),
    "FolderStatus": (".folders", "FolderStatus"),
    "Skipped": (".folders", "Skipped"),
    "GCPlan": (".maintenance", "GCPlan"),
    "GCResult": (".maintenance", "GCResult"),
    "LimitResult": (".maintenance", "LimitResult"),
    "NameUsage": (".maintenance", "NameUsage"),
    "Usage": (".maintenance", "Usage"),
    "VerifyReport": (".maintenance", "VerifyReport"),
    "Diff": (".manifests", "Diff"),
    "EditTransaction": (".manifests", "EditTransaction"),
    "Entry": (".manifests", "Entry"),
    "Manifest": (".manifests", "Manifest"),
    "ManifestEditor": (".manifests", "ManifestEditor"),
    "MetaDiff": (".manifests", "MetaDiff"),
    "NameInfo": (".manifests", "NameInfo"),
    "LocalObjects": (".objects", "LocalObjects"),
    "ObjectInfo": (".objects", "ObjectInfo"),
    "ObjectStore": (".objects", "ObjectStore"),
    "S3Objects": (".objects.s3", "S3Objects"),
    "LocalRefs": (".refs", "LocalRefs"),
    "Ref": (".refs", "Ref"),
    "RefStore": (".refs", "RefStore"),
    "S3Refs": (".refs.s3", "S3Refs"),
    "Store": (".store", "Store"),
    "open_store": (".store", "open_store"),
    "remote_cache_dir": (".store", "remote_cache_dir"),
    "Remote": (".sync", "Remote"),
    "RemoteGCPlan": (".sync", "RemoteGCPlan"),
    "RemoteGCResult": (".sync", "RemoteGCResult"),
    "RemoteNameUsage": (".sync", "RemoteNameUsage"),
    "RemoteUsage": (".sync", "RemoteUsage"),
    "TransferReport": (".sync", "TransferReport"),
    "open": (".store", "open_store"),
}


__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)

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
    "MissingNodeError",
    "NameExistsError",
    "InvalidDigestError",
    "AmbiguousDigestError",
    "InvalidInputError",
    "InvalidTypeError",
    "IntegrityError",
    "FrozenError",
    "LockCycleError",
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
