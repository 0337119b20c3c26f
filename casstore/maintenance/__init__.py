"""Maintenance: garbage collection, size limits, usage reports and verification.

Layer 4 (docs/design.md): built on the object layer (``store.objects``: the
one scanner, the codecs' recorded sizes and bounded decoders, the one
hasher), the refs layer (``store.refs``) and THE manifest decoder
(:mod:`casstore.manifests.model`), and the reference graph (what heads and
pins keep alive: :mod:`casstore.manifests.graph`, shared with remote gc).  Modules, one room each:

``durations``  ``"1h30m"``/``"10G"`` parsing shared by every pass
``files``      moving entries out of ``objects/`` without ever following a link
``gc``         plans (:class:`GCPlan`), execution, size limits (:func:`limit`)
``usage``      :func:`usage`: bytes, compression, dedupe, per head and pin
``verify``     :func:`verify`: re-hash every object, resolve every reference, repair
``listing``    :func:`name_rows`: each name's versions, size and last change (``casstore ls``)

A new maintenance pass goes in a module of its own here and reads the store
only through those layers' public APIs.
"""

from __future__ import annotations

from .durations import Duration, Size, parse_duration, parse_size
from .gc import GCPlan, GCResult, LimitResult, limit, plan_gc, plan_limit
from .listing import NameFilter, NameRow, name_rows, parse_filter, select_rows
from .usage import NameUsage, Usage, usage
from .verify import VerifyReport, verify

__all__ = [
    "Duration",
    "Size",
    "GCPlan",
    "GCResult",
    "LimitResult",
    "Usage",
    "NameUsage",
    "VerifyReport",
    "NameRow",
    "NameFilter",
    "name_rows",
    "parse_filter",
    "select_rows",
    "plan_gc",
    "plan_limit",
    "limit",
    "usage",
    "verify",
    "parse_duration",
    "parse_size",
]
