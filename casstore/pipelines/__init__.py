"""Pipelines: fetch once, derive once -- across processes, memoized, recorded as heads.

:func:`fetch` downloads a URL into the store exactly once (the record is the
head :func:`fetch_name`); :func:`derive` runs a function of stored inputs
exactly once per (name, inputs, params, version) (:func:`derive_key`) and
records its output files as the head ``name``.  Both hold the result name's
lock while they work (``store.refs.lock``), so other processes wait and then
read the result; a producer killed at any point leaves nothing named.
With ``remote=`` (a :class:`RemoteShare`) they work once across machines
too, through a lease on the remote (:mod:`casstore.pipelines.remote`).

Layer 4 (docs/design.md): uses only the public layers below it --
``store.objects`` (stage, publish, touch, put_path, raw_path), ``store.refs``
(lock, get, write) and the manifest model (:mod:`casstore.manifests`).
"""

from ..errors import NetworkTimeout
from .derive import DeriveFn, DeriveInput, InputKey, code_fingerprint, derive, derive_key
from .fetch import fetch, fetch_name
from .http import MAX_REDIRECTS, redact
from .remote import RemoteLease, RemoteShare, run_once_remote

__all__ = [
    "fetch",
    "fetch_name",
    "derive",
    "derive_key",
    "code_fingerprint",
    "DeriveFn",
    "DeriveInput",
    "InputKey",
    "NetworkTimeout",
    "redact",
    "MAX_REDIRECTS",
    "RemoteShare",
    "RemoteLease",
    "run_once_remote",
]
