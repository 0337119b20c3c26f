"""The manifests layer: named, versioned maps from keys to objects; heads, pins, checkout.

* :mod:`casstore.manifests.model`: :class:`Entry`, :class:`ManifestDoc` and THE
  manifest decoder (:func:`decode_manifest`, :func:`load_manifest`), which
  validates every key and entry of every version read from anywhere.
* :mod:`casstore.manifests.ops`: edit transactions, reads, history, freeze,
  pins, diff (through ``store.objects`` and ``store.refs``).
* :mod:`casstore.manifests.checkout`: writing a version's files into a
  directory without ever following a link planted there.
"""

from __future__ import annotations

from .checkout import CheckedOut, checkout
from .model import (
    MANIFEST_FORMAT,
    Entry,
    EntryMap,
    ManifestDoc,
    canonical_map,
    canonical_meta,
    decode_manifest,
    encode_manifest,
    load_manifest,
    looks_like_version,
    put_version,
    read_parent,
    refuse_big_non_manifest,
    validate_key,
)
from .ops import (
    Diff,
    EditTransaction,
    Manifest,
    ManifestEditor,
    MetaDiff,
    NameInfo,
    check_new_name,
    diff,
    freeze,
    history,
    is_internal,
    list_names,
    pin,
    public_url,
    read_manifest,
    remove,
    rename,
    resolve_target,
    unpin,
)

__all__ = [
    "MANIFEST_FORMAT",
    "Entry",
    "EntryMap",
    "ManifestDoc",
    "Manifest",
    "ManifestEditor",
    "EditTransaction",
    "Diff",
    "MetaDiff",
    "canonical_map",
    "canonical_meta",
    "decode_manifest",
    "encode_manifest",
    "load_manifest",
    "put_version",
    "looks_like_version",
    "read_parent",
    "refuse_big_non_manifest",
    "validate_key",
    "resolve_target",
    "check_new_name",
    "read_manifest",
    "remove",
    "rename",
    "NameInfo",
    "list_names",
    "is_internal",
    "public_url",
    "history",
    "freeze",
    "pin",
    "unpin",
    "diff",
    "CheckedOut",
    "checkout",
]
