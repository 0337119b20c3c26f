"""The refs layer: heads and pins, read lock-free, moved by compare-and-swap.

:class:`RefStore` is the protocol, :class:`LocalRefs` the files under
``<root>/refs``; ``casstore.refs.s3.S3Refs`` the refs on an S3 remote.
"""

from __future__ import annotations

from .base import KINDS, Ref, RefStore
from .local import (  # TRANSITIONAL: the function names are re-exported until every caller uses LocalRefs
    LocalRefs,
    list_refs,
    lock_path,
    read_ref,
    ref_path,
    remove_ref,
    validate_name,
    write_ref,
)

__all__ = ["Ref", "RefStore", "KINDS", "LocalRefs", "validate_name", "list_refs", "lock_path",
           "read_ref", "ref_path", "remove_ref", "write_ref"]
