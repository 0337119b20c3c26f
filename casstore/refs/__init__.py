"""The refs layer: heads and pins, read lock-free, moved by compare-and-swap.

:class:`RefStore` is the protocol, :class:`LocalRefs` the files under
``<root>/refs``; ``casstore.refs.s3.S3Refs`` the refs on an S3 remote.
"""

from __future__ import annotations

from .base import KINDS, Ref, RefStore
from .local import LocalRefs, validate_name

__all__ = ["Ref", "RefStore", "KINDS", "LocalRefs", "validate_name"]
