"""Derive provenance in manifest metadata: which stored inputs a version was made from.

The format (docs/pipelines.md, "Provenance metadata"; written by
:func:`casstore.pipelines.derive`)::

    meta["casstore.inputs"] = {
        "<input name>": "blake3:<64 hex>",                 # an object
        "<input name>": {"manifest": "blake3:<64 hex>"},   # a manifest version (a fetch/derive result)
    }

Readers: gc keeps the inputs of pins and of heads' current versions alive
(docs/maintenance.md, "Provenance"), and ``diff`` shows changed inputs and
params.  They live here, below every feature, so the writer (pipelines) and
the readers (maintenance, manifests) share one definition.

Hazard: metadata comes from disk or a remote and is hostile.  The decoder has
already bounded it (msgpack types only, bounded depth), but its *shape* is
unchecked: :func:`read_provenance` never raises; every malformed entry
becomes a problem string and contributes nothing, and its well-formed
siblings still count (keeping more is the safe direction for gc).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..digest import Digest
from ..errors import CasstoreError

__all__ = ["INPUTS_KEY", "ProvenanceInput", "Provenance", "read_provenance", "input_labels", "derive_params"]

INPUTS_KEY = "casstore.inputs"
"""Manifest metadata key of the provenance record (input name -> object or manifest digest)."""

_MAX_PROBLEMS = 10  # per version: a hostile record with 100,000 bad entries must not flood a plan


@dataclass(frozen=True, slots=True)
class ProvenanceInput:
    """One input named by a version's provenance record."""

    name: str
    """The input's name as ``derive`` received it."""
    digest: Digest
    """The object, or the manifest version, it was."""
    manifest: bool
    """True for a manifest version (its entries and its own provenance count too)."""


@dataclass(frozen=True, slots=True)
class Provenance:
    """The well-formed inputs of a provenance record, and what was wrong with the rest."""

    inputs: Tuple[ProvenanceInput, ...]
    problems: Tuple[str, ...]
    """One line per malformed entry (or for a malformed record); empty when all is well."""


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _digest(value: object) -> Optional[Digest]:
    if not isinstance(value, str):
        return None
    try:
        return Digest.parse(value)  # full digests only: a prefix could resolve differently tomorrow
    except CasstoreError:
        return None


def read_provenance(meta: Mapping[str, Any]) -> Provenance:
    """The inputs recorded in ``meta[INPUTS_KEY]``; never raises, whatever the metadata holds.

    No record -> no inputs and no problems.  A record that is not a map, or an
    entry that is neither ``"blake3:<64 hex>"`` nor ``{"manifest":
    "blake3:<64 hex>"}``, is reported in ``problems`` and contributes nothing.
    """
    if not isinstance(meta, Mapping) or INPUTS_KEY not in meta:
        return Provenance((), ())
    rec = meta[INPUTS_KEY]
    if not isinstance(rec, Mapping):
        return Provenance((), (f"provenance record {INPUTS_KEY!r} is not a map of input names to digests "
                               f"(it is {type(rec).__name__}: {_short(rec)})",))
    inputs: List[ProvenanceInput] = []
    problems: List[str] = []
    bad = 0
    for name, value in rec.items():
        d: Optional[Digest] = None
        manifest = False
        if isinstance(value, Mapping) and len(value) == 1 and "manifest" in value:
            d, manifest = _digest(value["manifest"]), True
        elif isinstance(value, str):
            d = _digest(value)
        if isinstance(name, str) and d is not None:
            inputs.append(ProvenanceInput(name, d, manifest))
            continue
        bad += 1
        if bad <= _MAX_PROBLEMS:
            problems.append(f"provenance input {_short(name)} is malformed ({_short(value)}; expected "
                            "'blake3:<64 hex>' or {'manifest': 'blake3:<64 hex>'})")
    if bad > _MAX_PROBLEMS:
        problems.append(f"... and {bad - _MAX_PROBLEMS} more malformed provenance inputs")
    return Provenance(tuple(inputs), tuple(problems))


def input_labels(meta: Mapping[str, Any]) -> Dict[str, str]:
    """Input name -> ``"blake3:..."`` or ``"manifest blake3:..."`` (for diffs; malformed entries as their repr)."""
    rec = meta.get(INPUTS_KEY) if isinstance(meta, Mapping) else None
    if not isinstance(rec, Mapping):
        return {}
    good = {i.name: (f"manifest {i.digest}" if i.manifest else str(i.digest)) for i in read_provenance(meta).inputs}
    return {str(k): good.get(k, _short(v)) if isinstance(k, str) else _short(v) for k, v in rec.items()}


def derive_params(meta: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The ``params`` a derive result was made with (``meta["derive"]["params"]``), or ``None``."""
    rec = meta.get("derive") if isinstance(meta, Mapping) else None
    if not isinstance(rec, Mapping):
        return None
    params = rec.get("params")
    return params if isinstance(params, Mapping) else None
