"""The object layer: where immutable, content-addressed objects live.

:class:`ObjectStore` is the protocol; :class:`LocalObjects` keeps objects in a
local directory; ``casstore.objects.s3.S3Objects`` on an S3-compatible object
store (needs the ``s3`` extra, so it is imported from its module).
"""

from __future__ import annotations

from .base import Buffer, ObjectInfo, ObjectStore
from .local import HashRecord, LocalObjects, Located, ObjFile, StagedObject
from .reader import ObjectReader

__all__ = ["ObjectStore", "ObjectInfo", "Buffer", "LocalObjects", "Located", "ObjFile", "StagedObject",
           "ObjectReader", "HashRecord"]
