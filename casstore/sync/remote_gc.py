"""Remote garbage collection and usage: ``store.plan_gc(remote=...)``, ``casstore gc --remote``, ``du --remote``.

What stays on a remote (the same rule as local gc, :mod:`casstore.manifests.graph`):

* every remote pin's version and all its entries;
* every remote head's current version and its last ``keep_history`` versions
  (parent links), and their entries -- those the remote has (a push uploads a
  head's older versions but only the current version's entries);
* the derive inputs a pin or a head's current version records, transitively;
* every object whose ``LastModified`` (the server's clock) is within ``grace``
  of the server's time when the plan was made.

Everything else under ``objects/`` goes: objects no kept version names and
expired manifest versions (deleted first, before the objects only they name).

Refusals (a typed error, nothing deleted): a ref that names a missing,
corrupt or undecodable version; a kept version whose tree node is missing or
damaged; a current version (a pin's, a head's) whose entries are not all on
the remote.  A remote in that state has already broken the invariant that a
ref never names a missing object; what it references is not reliably known,
so nothing is called garbage until it is repaired (push the name again from a
machine that has it, or remove the ref).

Concurrent pushes (the full argument is in docs/remotes.md, "Remote gc"):
:meth:`RemoteGCPlan.execute` announces itself with a gc marker and waits
until no push is in progress (:mod:`casstore.sync.markers`), *then* re-reads
every root and deletes only planned objects that are still unreferenced.  A
push announces itself before it lists the remote and waits while a gc
marker is up, so no push can count on an object (uploaded, or already there
and skipped) that this gc is deleting.  The plan itself takes no marker and
writes nothing (a dry run needs only read and list permissions).

Hostile remote: versions and tree nodes are read verified and size-bounded
(:data:`casstore.sync.pull.MAX_MANIFEST_BYTES`), decoded by THE decoder; ref
keys that hold no digest are a StoreFormatError (refusal).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, BinaryIO, Dict, FrozenSet, Iterator, List, Mapping, Optional, Set, Tuple, Union

from .._progress import Progress, human_age, human_bytes
from ..digest import Digest, hash_bytes
from ..errors import (
    AmbiguousDigestError,
    CasstoreError,
    IntegrityError,
    InvalidDigestError,
    InvalidInputError,
    ObjectNotFoundError,
    ReadOnlyError,
    StoreFormatError,
)
from ..manifests.graph import Live, compute_live, version_refs
from ..manifests.model import SeenNodes, load_manifest, read_parent
from ..objects.base import Buffer, ObjectInfo, ObjectStore
from ..objects.s3 import CHUNKS, RECIPES, ListedObject, S3Objects
from .markers import Marker
from .pull import MAX_MANIFEST_BYTES

if TYPE_CHECKING:
    from .remotes import Remote

__all__ = ["RemoteGCPlan", "RemoteGCResult", "PlannedDelete", "RemoteUsage", "RemoteNameUsage",
           "plan_remote_gc", "remote_usage", "DELETE_BATCH"]

log = logging.getLogger("casstore.gc")

DELETE_BATCH = 1000
"""Keys per DeleteObjects request (the S3 maximum); the gc marker is checked before each batch."""


class RemoteVersions(ObjectStore):
    """A read-only view of a remote's objects for the reference graph: verified, size-bounded reads,
    with each version's history fetched ahead in the background.

    Hazards: a hostile or damaged remote may serve a 100 GB object under a
    version's digest; reads stop at :data:`MAX_MANIFEST_BYTES` (a
    StoreFormatError, so gc refuses) instead of filling memory.  Nothing is
    ever written or deleted through this view.

    Why the read-ahead: the graph walks each head's history one parent link at
    a time, and on a real network every link is a round trip (1,000 versions x
    30 ms = 30 s, ten times the listing of 100,000 objects).  So when a version
    arrives its parent is requested at once on a small pool; a walk then waits
    for one round trip per head rather than one per version, heads overlap, and
    the expired history is mostly here by the time the graph asks for it.  The
    bytes fetched ahead are bounded by ``ahead_bytes``; each is handed out once
    (the graph keeps the decoded versions it needs), and a read-ahead that
    failed is simply read again when asked for.
    """

    def __init__(self, rem: Remote, *, ahead_bytes: int = 256 << 20, workers: int = 8) -> None:
        self.rem = rem
        """The remote read from."""
        self.ahead_bytes = ahead_bytes
        """At most this many bytes fetched ahead and not yet asked for."""
        self._pool: Optional[ThreadPoolExecutor] = ThreadPoolExecutor(
            max(1, min(workers, rem.workers)), thread_name_prefix="casstore-gc-ahead")
        self._ahead: Dict[Digest, Future[bytes]] = {}
        self._requested: Set[Digest] = set()  # each digest is read ahead at most once (hostile parent cycles)
        self._held = 0
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop reading ahead and drop what was fetched ahead (reads keep working, one request each)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._ahead.clear()
            self._held = 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RemoteVersions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writable(self) -> bool:
        """Never: gc only reads versions."""
        return False

    @property
    def supports_delete(self) -> bool:
        """Never through this view (gc deletes through ``remote.objects`` after its checks)."""
        return False

    def has(self, digest: Digest) -> bool:
        """Is the object on the remote (one HEAD)?"""
        return self.rem.objects.has(digest)

    def stat(self, digest: Digest) -> ObjectInfo:
        """Size of the remote object (one HEAD); ObjectNotFoundError if absent."""
        return self.rem.objects.stat(digest)

    def _fetch(self, digest: Digest) -> bytes:
        try:
            data = self.rem.objects.read_at_most(digest, MAX_MANIFEST_BYTES, verify=True)
        except ObjectNotFoundError:
            data = self._fetch_chunked(digest)  # a version of 4 MiB and up may have been pushed as chunks
        if data is None:
            raise StoreFormatError(
                f"{self.rem.describe()}: {self.rem.objects.url(digest)} is named as a manifest version or tree "
                f"node but is larger than {MAX_MANIFEST_BYTES} bytes; not read"
            )
        self._read_ahead(read_parent(data))
        return data

    def _fetch_chunked(self, digest: Digest) -> Optional[bytes]:
        """The bytes of an object stored as a recipe of chunks (each chunk verified, then the whole);
        ``None`` if larger than :data:`MAX_MANIFEST_BYTES`; ObjectNotFoundError if there is no recipe either."""
        recipe = self.rem.objects.read_recipe(digest)
        if recipe is None:
            raise self.rem.objects.missing_error(digest)
        if recipe.size > MAX_MANIFEST_BYTES:
            return None
        data = b"".join(self.rem.objects.read_chunk(c) for c in recipe.chunks)
        got = hash_bytes(data)
        if got != digest:
            raise self.rem.objects.corrupt_error(digest, got, len(data))
        return data

    def _read_ahead(self, digest: Optional[Digest]) -> None:
        if digest is None:
            return
        with self._lock:
            if self._pool is None or digest in self._requested or self._held >= self.ahead_bytes:
                return
            self._requested.add(digest)
            fut = self._pool.submit(self._fetch_ahead, digest)
            self._ahead[digest] = fut

    def _fetch_ahead(self, digest: Digest) -> bytes:
        data = self._fetch(digest)
        with self._lock:
            self._held += len(data)  # until read() takes it (it waits for this future, so after this line)
        return data

    def read(self, digest: Digest, *, verify: bool = True) -> bytes:
        """The object's bytes, always hashed (even when ``verify=False`` is asked: nothing unverified is used)."""
        with self._lock:
            fut = self._ahead.pop(digest, None)
            self._requested.add(digest)
        if fut is not None:
            try:
                data = fut.result()
            except CancelledError:
                pass
            except (CasstoreError, OSError):
                pass  # read it again here, so the error (if it persists) is raised in the caller's context
            else:
                with self._lock:
                    self._held = max(0, self._held - len(data))
                return data
        return self._fetch(digest)

    def open(self, digest: Digest, *, verify: bool = True) -> BinaryIO:
        """The object's bytes as a stream (read whole first, bounded and verified: see :meth:`read`)."""
        return io.BytesIO(self.read(digest, verify=verify))

    def write(self, digest: Digest, data: Buffer) -> bool:
        """Refused: this view is read-only."""
        raise ReadOnlyError(f"{self.rem.describe()}: the gc's view of the remote is read-only")

    def delete(self, digest: Digest) -> bool:
        """Refused: this view is read-only."""
        raise ReadOnlyError(f"{self.rem.describe()}: the gc's view of the remote is read-only")

    def iter_digests(self) -> Iterator[Digest]:
        """Every object's digest on the remote, from the listing."""
        return self.rem.objects.iter_digests()


def _refused(rem: Remote, e: Exception) -> Exception:
    """The same error type, saying that remote gc stopped and what to do on a remote."""
    what = (f"remote gc of {rem.describe()} refused, nothing was deleted: {e}. (On a remote: push that "
            "name again from a machine that has a good copy, or delete the ref, then run gc again.)")
    return type(e)(what)


def _compute_live(rem: Remote, keep_history: int) -> Live:
    """The roots' closure on the remote; refuses (typed) when a root cannot be read."""
    with RemoteVersions(rem) as view:  # the read-ahead stops when the walk is done
        try:
            return compute_live(view, rem.refs, keep_history)
        except (ObjectNotFoundError, IntegrityError, StoreFormatError) as e:
            raise _refused(rem, e) from None


def _check_closures(rem: Remote, live: Live, present: Set[str]) -> None:
    """Every current version's entries must be on the remote (``present``: hex of listed objects;
    what the listing lacks is looked up again before it counts as missing).

    A push uploads them all before it writes the ref, so a gap means the
    remote is damaged (deleted by hand, or by a gc that did not honour push
    markers); gc refuses rather than work from a wrong picture.  A ref that
    moved since it was read is not held against the remote.
    """
    g = live.graph
    assert g is not None
    seen: SeenNodes = {}
    for label, d in live.roots.items():
        try:
            doc = g.doc(d, label, required=True)
            assert doc is not None
            lacking = [(key, h) for key, h, _size in version_refs(doc, seen) if key and h not in present]
        except (ObjectNotFoundError, IntegrityError, StoreFormatError) as e:
            raise _refused(rem, e) from None
        if lacking:  # not in the listing: uploaded after it passed their keys, or really gone?
            there = rem.objects.present({Digest(h) for _key, h in lacking})
            lacking = [(key, h) for key, h in lacking if Digest(h) not in there]
        if not lacking:
            continue
        kind, _, name = label.partition(":")
        now = rem.refs.read(f"{kind}s", name)
        if now is None or now.digest != d:
            continue  # moved meanwhile: judged again on the next run
        key, h = lacking[0]
        raise ObjectNotFoundError(
            f"remote gc of {rem.describe()} refused, nothing was deleted: {kind} {name!r} names version {d}, "
            f"but {len(lacking)} of its objects are missing on the remote (e.g. entry {key!r}, blake3:{h}); "
            f"push {name!r} again from a machine that has it (or delete the ref), then run gc again"
        )


# -- plans ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlannedDelete:
    """One remote object a plan would delete."""

    digest: Digest
    size: int
    modified: float
    """``LastModified`` (server clock, POSIX seconds)."""
    kind: str
    """``"version"`` (an expired manifest version, deleted first), ``"object"``, or ``"chunk"`` (a chunk no
    remaining recipe names, deleted last)."""
    form: str = "object"
    """Which key goes: ``"object"`` (``objects/``: a whole object), ``"recipe"`` (``recipes/``: a chunked
    object; its chunks go as ``"chunk"`` entries once no other recipe names them) or ``"chunk"``."""

    def key(self, objects: S3Objects) -> str:
        """The remote key this entry deletes."""
        if self.form == "recipe":
            return objects.recipe_key(self.digest)
        if self.form == "chunk":
            return objects.chunk_key(self.digest)
        return objects.key(self.digest)


@dataclass(frozen=True, slots=True)
class RemoteGCResult:
    """What :meth:`RemoteGCPlan.execute` did."""

    deleted: Tuple[Digest, ...]
    """Digests deleted, in deletion order."""
    freed_bytes: int
    skipped: Mapping[Digest, str]
    """Planned objects kept after all, and why (referenced since the plan)."""
    failed: Mapping[Digest, str]
    """Deletes the server refused, and its error (run gc again)."""
    waited_seconds: float
    """Time spent waiting for pushes in progress to finish."""
    stale_markers: Tuple[str, ...]
    """Push markers ignored as dead (no heartbeat for ``casstore.sync.markers.STALE_SECONDS``)."""
    seconds: float

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"deleted": len(self.deleted), "freed_bytes": self.freed_bytes,
                "skipped": {str(k): v for k, v in self.skipped.items()},
                "failed": {str(k): v for k, v in self.failed.items()},
                "waited_seconds": round(self.waited_seconds, 3), "stale_markers": list(self.stale_markers),
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True, slots=True)
class RemoteGCPlan:
    """A frozen remote gc plan; nothing is deleted until :meth:`execute` (see the module docstring).

    ``objects`` are the digests that would go (expired versions first),
    ``freed_bytes`` what that frees on the remote, :meth:`why` why any one
    digest stays or goes, ``kept`` the reason for every object that stays.
    """

    remote: Remote = field(repr=False, compare=False)
    keep_history: int
    grace: float
    """Seconds."""
    created: float
    """The server's clock when planned (POSIX seconds)."""
    files: Tuple[PlannedDelete, ...] = field(repr=False)
    """What would be deleted, in order."""
    freed_bytes: int
    total_objects: int
    total_bytes: int
    """Bytes of every object on the remote when planned."""
    roots: Mapping[str, Digest] = field(repr=False)
    """``"pin:<name>"`` / ``"head:<name>"`` -> version."""
    live: Live = field(repr=False, compare=False)
    """The roots' closure when planned (what is kept, and why)."""
    fresh: Mapping[str, float] = field(repr=False, compare=False)
    """hex -> LastModified of unreferenced objects kept because they are within the grace period."""
    present: FrozenSet[str] = field(repr=False, compare=False)
    """Hex digests of every object listed when planned (whole or as a recipe)."""
    kept_chunks: FrozenSet[str] = field(repr=False, compare=False, default=frozenset())
    """Hex digests of chunks that stay (named by a recipe that stays, or fresh)."""
    known_recipes: FrozenSet[str] = field(repr=False, compare=False, default=frozenset())
    """Recipes listed when planned (execute reads only recipes that appeared since)."""
    notes: Tuple[str, ...] = ()
    """Why some chunks were not considered (an unreadable recipe), beside the provenance warnings."""

    @property
    def objects(self) -> Tuple[Digest, ...]:
        """Digests of objects (and expired versions) that would be deleted, in deletion order; chunks apart."""
        return tuple(dict.fromkeys(f.digest for f in self.files if f.kind != "chunk"))

    @property
    def chunks(self) -> Tuple[Digest, ...]:
        """Chunks (of chunked objects) no remaining recipe names, that would be deleted last."""
        return tuple(f.digest for f in self.files if f.kind == "chunk")

    @property
    def warnings(self) -> Tuple[str, ...]:
        """Provenance records that were malformed or unreadable (each kept nothing extra), and unreadable
        recipes (no chunk is collected then)."""
        return tuple(self.live.warnings) + self.notes

    @property
    def kept(self) -> Mapping[Digest, str]:
        """Every remote object that stays, with the reason (only those the remote has)."""
        out: Dict[Digest, str] = {}
        planned = {f.digest.hex for f in self.files}
        for h in self.live.live:
            if h in self.present and h not in planned:
                out[Digest(h)] = self.live.describe(h)
        for h in self.fresh:
            out[Digest(h)] = self._fresh_reason(h)
        return MappingProxyType(out)

    def _fresh_reason(self, h: str) -> str:
        return (f"fresh: uploaded {human_age(self.created - self.fresh[h])} ago (server time), within the grace "
                f"period ({human_age(self.grace)}); a push in progress may still reference it")

    def resolve(self, prefix: str) -> Digest:
        """A full digest, or a unique prefix of a digest this plan deletes or keeps."""
        try:
            return Digest.parse(prefix)
        except InvalidDigestError:
            pass
        p = prefix[len("blake3:"):] if prefix.startswith("blake3:") else prefix
        if not p or any(c not in "0123456789abcdef" for c in p):
            raise InvalidDigestError(f"{prefix!r} is not a digest or a hex prefix of one")
        hits = {h for h in [*(f.digest.hex for f in self.files), *self.live.live, *self.fresh] if h.startswith(p)}
        if len(hits) > 1:
            raise AmbiguousDigestError(f"{prefix!r} matches {len(hits)} objects of the plan; give more digits")
        if not hits:
            raise ObjectNotFoundError(f"no object of {self.remote.describe()} starts with {prefix!r}")
        return Digest(hits.pop())

    def why(self, digest: Union[Digest, str]) -> str:
        """Why ``digest`` stays on the remote or goes, in words."""
        h = Digest.coerce(digest).hex
        for f in self.files:
            if f.digest.hex == h:
                what = {"version": "an expired manifest version", "chunk": "a chunk no remaining recipe names"}.get(
                    f.kind, "unreferenced")
                return (f"deleted: {what}, uploaded {human_age(self.created - f.modified)} ago "
                        f"({human_bytes(f.size)} on the remote)")
        if h in self.live.live:
            return "kept: " + self.live.describe(h)
        if h in self.fresh:
            return "kept: " + self._fresh_reason(h)
        if h in self.kept_chunks:
            return "kept: a chunk of a chunked object that stays (or uploaded within the grace period)"
        return "not on the remote when planned"

    def summary(self) -> str:
        """A few lines for humans."""
        n_versions = sum(1 for f in self.files if f.kind == "version")
        n_chunks = len(self.chunks)
        lines = [
            f"{self.remote.describe()}: {len(self.objects)} objects ({n_versions} expired manifest versions)"
            + (f" and {n_chunks} chunks" if n_chunks else "")
            + f" would be deleted, freeing {human_bytes(self.freed_bytes)} of {human_bytes(self.total_bytes)}",
            f"kept: {self.total_objects - len(self.objects) - len(self.fresh)} referenced by {len(self.roots)} roots "
            f"(pins, heads and their last {self.keep_history} versions), {len(self.fresh)} fresh "
            f"(grace {human_age(self.grace)}, by the server's LastModified)",
        ]
        lines += [f"warning: {w}" for w in self.warnings[:10]]
        return "\n".join(lines)

    def to_dict(self, *, objects: bool = False) -> Dict[str, Any]:
        """JSON-able form; ``objects=True`` lists every digest with its reason."""
        doc: Dict[str, Any] = {
            "remote": self.remote.describe(),
            "objects": len(self.objects),
            "chunks": len(self.chunks),
            "expired_versions": sum(1 for f in self.files if f.kind == "version"),
            "freed_bytes": self.freed_bytes,
            "total_objects": self.total_objects,
            "total_bytes": self.total_bytes,
            "kept_referenced": self.total_objects - len(self.objects) - len(self.fresh),
            "kept_fresh": len(self.fresh),
            "keep_history": self.keep_history,
            "grace_seconds": self.grace,
            "roots": {k: str(v) for k, v in self.roots.items()},
            "warnings": list(self.warnings),
        }
        if objects:
            doc["delete"] = [{"digest": str(f.digest), "bytes": f.size, "kind": f.kind, "form": f.form}
                             for f in self.files]
            doc["kept"] = {str(k): v for k, v in self.kept.items()}
        return doc

    def execute(self, *, timeout: Optional[float] = 600.0, progress: Optional[bool] = None) -> RemoteGCResult:
        """Delete the planned objects that are still garbage; return what was done.

        Writes a gc marker and waits (up to ``timeout`` seconds, then
        :class:`~casstore.errors.LockTimeout`) until no push is in progress;
        pushes that start meanwhile wait for this gc.  Then every root is read
        again and any planned object that has become referenced is skipped.
        """
        return _execute(self, timeout=timeout, progress=progress)


def _list_remote(rem: Remote) -> Tuple[List[ListedObject], List[ListedObject], List[ListedObject]]:
    """Whole objects, recipes (chunked objects) and chunks, each with LastModified."""
    objs = rem.objects
    return list(objs.iter_listed()), list(objs.iter_listed_under(RECIPES)), list(objs.iter_listed_under(CHUNKS))


def _recipe_chunks(rem: Remote, digests: List[Digest]) -> Tuple[Set[str], List[str]]:
    """Hex of every chunk the recipes of ``digests`` name, and problems (a recipe that cannot be read).

    Read in parallel (one GET each).  A recipe that vanished meanwhile names nothing.
    """
    if not digests:
        return set(), []
    out: Set[str] = set()
    problems: List[str] = []
    objs = S3Objects(rem.connection, rem.prefix)  # reads recipes whatever chunking this Remote object uses

    def one(d: Digest) -> Tuple[Digest, Optional[Set[str]], str]:
        try:
            recipe = objs.read_recipe(d)
        except (CasstoreError, OSError) as e:
            return d, None, f"{type(e).__name__}: {e}"
        return d, (set() if recipe is None else {c.digest.hex for c in recipe.chunks}), ""

    with ThreadPoolExecutor(min(16, rem.workers), thread_name_prefix="casstore-gc-recipes") as ex:
        for d, chunks, err in ex.map(one, digests):
            if chunks is None:
                problems.append(f"the recipe of {d} cannot be read ({err}); no chunk is collected this run")
            else:
                out |= chunks
    return out, problems


def plan_remote_gc(rem: Remote, *, keep_history: int, grace: float) -> RemoteGCPlan:
    """Plan a gc of remote ``rem`` (nothing deleted, nothing written); ``grace`` in seconds.

    The facade (``store.plan_gc(remote=...)``) parses durations like ``"1h"``.
    """
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or grace < 0:
        raise InvalidInputError(f"grace must be a non-negative number of seconds, not {grace!r}")
    # The server's clock, before anything is listed: an object uploaded after this is younger than
    # `now - grace` whatever the client's clock says.
    now = rem.connection.server_time(f"{rem.prefix}objects/")
    # The listing (100 pages for 100,000 objects) runs beside the graph walk (a GET per version):
    # a plan then costs about the longer of the two.  Objects uploaded during the listing may be
    # missed by it; they are simply not candidates, and the closure check confirms a gap before
    # refusing (an object a ref names may have gone up after the listing passed its key).
    with ThreadPoolExecutor(1, thread_name_prefix="casstore-gc-list") as ex:
        listing = ex.submit(_list_remote, rem)
        try:
            live = _compute_live(rem, keep_history)
        finally:
            whole, recipes, chunks = listing.result()
    for w in live.warnings:
        log.warning("remote gc: %s", w)
    _check_closures(rem, live, {o.digest.hex for o in whole} | {o.digest.hex for o in recipes})
    cutoff = now - grace
    expired = {d.hex for d in live.expired}
    fresh: Dict[str, float] = {}
    versions: Dict[str, List[PlannedDelete]] = {}
    garbage: List[PlannedDelete] = []
    total = 0
    for form, listed in (("object", whole), ("recipe", recipes)):
        for o in listed:
            total += o.size
            h = o.digest.hex
            if h in live.live:
                continue
            if o.modified > cutoff:
                fresh[h] = max(o.modified, fresh.get(h, 0.0))
                continue
            pd = PlannedDelete(o.digest, o.size, o.modified, "version" if h in expired else "object", form)
            if h in expired:
                versions.setdefault(h, []).append(pd)
            else:
                garbage.append(pd)
    # An object with a fresh form and an old one (whole and chunked) keeps both: it is in use.
    garbage = [f for f in garbage if f.digest.hex not in fresh]
    # Expired versions first, newest first along each chain (cut the history before what only it names).
    files = [pd for d in live.expired if d.hex not in fresh for pd in versions.get(d.hex, ())]
    files += garbage
    # Chunks last: a chunk goes when no recipe that stays names it (and it is not fresh itself).
    going = {f.digest.hex for f in files if f.form == "recipe"}
    staying = [o.digest for o in recipes if o.digest.hex not in going]
    kept_chunks, notes = _recipe_chunks(rem, staying)
    for n in notes:
        log.warning("remote gc: %s", n)
    for o in chunks:
        total += o.size
        if notes or o.digest.hex in kept_chunks or o.modified > cutoff:
            kept_chunks.add(o.digest.hex)
            continue
        files.append(PlannedDelete(o.digest, o.size, o.modified, "chunk", "chunk"))
    return RemoteGCPlan(
        remote=rem, keep_history=keep_history, grace=float(grace), created=now, files=tuple(files),
        freed_bytes=sum(f.size for f in files), total_objects=len({o.digest for o in [*whole, *recipes]}),
        total_bytes=total, roots=MappingProxyType(dict(live.roots)), live=live, fresh=MappingProxyType(fresh),
        present=frozenset(o.digest.hex for o in [*whole, *recipes]), kept_chunks=frozenset(kept_chunks),
        known_recipes=frozenset(o.digest.hex for o in recipes), notes=tuple(notes),
    )


def _execute(plan: RemoteGCPlan, *, timeout: Optional[float], progress: Optional[bool]) -> RemoteGCResult:
    rem = plan.remote
    t0 = time.monotonic()
    deleted: List[Digest] = []
    skipped: Dict[Digest, str] = {}
    failed: Dict[Digest, str] = {}
    freed = 0
    stale: Set[str] = set()
    waited = 0.0
    if not plan.files:
        return RemoteGCResult((), 0, MappingProxyType({}), MappingProxyType({}), 0.0, (), time.monotonic() - t0)
    enabled = rem.progress if progress is None else progress
    objs = S3Objects(rem.connection, rem.prefix)
    with Marker(rem, "gc", f"gc of {len(plan.files)} keys") as marker, \
            Progress(len(plan.files), desc=f"gc {rem.name or rem.url}", unit="keys", enabled=enabled) as bar:
        live: Optional[Live] = None
        protected: Optional[Set[str]] = None  # chunks named by recipes that stay, judged after the roots
        todo = list(plan.files)
        while todo:
            if live is None or not marker.held():
                # (Again) announced: wait out every push in progress, then read the roots afresh. A push
                # that finished before this point has its refs seen now; one that starts later waits for us.
                w0 = time.monotonic()
                stale.update(m.key for m in marker.wait_clear(timeout, back_off=False))
                waited += time.monotonic() - w0
                live = _compute_live(rem, plan.keep_history)
                protected = None
            kind = todo[0].kind == "chunk"
            n = 0
            while n < len(todo) and n < DELETE_BATCH and (todo[n].kind == "chunk") == kind:
                n += 1
            batch, todo = todo[:n], todo[n:]
            if kind and protected is None:
                # Recipes that appeared since the plan (a push's new chunked object) or that a root now
                # needs again name chunks that must stay; read them under our marker.
                spared_recipes = [f.digest for f in plan.files if f.form == "recipe" and f.digest.hex in live.live]
                now_listed = [o.digest for o in objs.iter_listed_under(RECIPES)]
                new = [d for d in now_listed if d.hex not in plan.known_recipes]
                protected, problems = _recipe_chunks(rem, spared_recipes + new)
                if problems:  # a recipe we cannot read may name any chunk: collect none this run
                    for f in [*batch, *todo]:
                        skipped[f.digest] = problems[0]
                    break
            go = [f for f in batch if f.digest.hex not in (protected if kind and protected is not None else
                                                            live.live)]
            if not marker.held():  # our marker may have lapsed meanwhile: announce and look again first
                todo = batch + todo
                continue
            for f in batch:
                if not kind and f.digest.hex in live.live:
                    skipped[f.digest] = "now referenced: " + live.describe(f.digest.hex)
                elif kind and protected is not None and f.digest.hex in protected:
                    skipped[f.digest] = "named by a recipe uploaded or needed again since the plan"
            errors = rem.connection.delete_many(f.key(objs) for f in go)
            for f in go:
                err = errors.get(f.key(objs))
                if err is not None:
                    failed[f.digest] = err
                else:
                    deleted.append(f.digest)
                    freed += f.size
            bar.update(len(batch))
    if failed:
        log.warning("remote gc: %d deletes failed (run gc again), e.g. %s", len(failed), next(iter(failed.values())))
    return RemoteGCResult(tuple(dict.fromkeys(deleted)), freed, MappingProxyType(skipped), MappingProxyType(failed),
                          waited, tuple(sorted(stale)), time.monotonic() - t0)


# -- usage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RemoteNameUsage:
    """One remote pin or head (its current version): what it references and what that takes on the remote."""

    name: str
    kind: str
    """``"pin"`` or ``"head"``."""
    version: Digest
    entries: int
    logical_bytes: int
    """Entry sizes summed (once per key: what the name would take as plain files)."""
    objects: int
    """Distinct objects its entries name."""
    stored_bytes: int
    """Those objects' bytes on the remote (each once)."""
    missing: int
    """Entry objects the remote lacks (a damaged remote: `casstore gc --remote` refuses)."""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"name": self.name, "kind": self.kind, "version": str(self.version), "entries": self.entries,
                "logical_bytes": self.logical_bytes, "objects": self.objects, "stored_bytes": self.stored_bytes,
                "missing": self.missing}


@dataclass(frozen=True, slots=True)
class RemoteUsage:
    """Bytes a remote stores against the bytes its live names reference (``casstore du --remote``)."""

    remote: str
    """The remote's description."""
    objects: int
    """Objects on the remote (every listed object key)."""
    stored_bytes: int
    """Their bytes."""
    live_logical_bytes: int
    """Entry sizes over every live name's current version, once per reference (as plain files)."""
    live_objects: int
    """Distinct objects those entries name (and the current versions themselves)."""
    live_stored_bytes: int
    """Those objects' bytes on the remote (each once): what the live names need."""
    live_missing: int
    """Objects live names need that the remote lacks."""
    other_bytes: int
    """``stored_bytes - live_stored_bytes``: history, expired versions, unreferenced objects
    (what `casstore gc --remote` may free, before keep_history and grace)."""
    by_name: Tuple[RemoteNameUsage, ...]

    @property
    def dedupe_ratio(self) -> float:
        """``live_logical_bytes / live_stored_bytes`` (1.0 when nothing is stored)."""
        return self.live_logical_bytes / self.live_stored_bytes if self.live_stored_bytes else 1.0

    def to_dict(self) -> Dict[str, Any]:
        """JSON-able form."""
        return {"remote": self.remote, "objects": self.objects, "stored_bytes": self.stored_bytes,
                "live_logical_bytes": self.live_logical_bytes, "live_objects": self.live_objects,
                "live_stored_bytes": self.live_stored_bytes, "live_missing": self.live_missing,
                "other_bytes": self.other_bytes, "dedupe_ratio": round(self.dedupe_ratio, 4),
                "names": [n.to_dict() for n in self.by_name]}


def remote_usage(rem: Remote) -> RemoteUsage:
    """What the remote stores against what its pins and heads (current versions) reference.

    Reads every ref, each current version (verified, bounded) and the recipe of
    each live chunked object, and lists the objects, recipes and chunks once;
    reads no data object.  A chunked object counts its recipe and its chunks
    (a chunk shared by several live objects once in the totals).
    """
    heads = rem.refs.list("heads")
    pins = rem.refs.list("pins")
    whole_l, recipes_l, chunks_l = _list_remote(rem)
    listed = {o.digest.hex: o.size for o in whole_l}
    recipe_size = {o.digest.hex: o.size for o in recipes_l if o.digest.hex not in listed}
    chunk_size = {o.digest.hex: o.size for o in chunks_l}
    names: List[Tuple[str, str, Digest, List[Tuple[str, str, Optional[int]]]]] = []
    for kind, named in (("pin", pins), ("head", heads)):
        for name, d in named.items():
            try:
                with RemoteVersions(rem, ahead_bytes=0) as view:  # current versions only: nothing to read ahead
                    names.append((name, kind, d, list(version_refs(load_manifest(view, d), {}))))
            except (ObjectNotFoundError, IntegrityError, StoreFormatError) as e:
                raise type(e)(f"{rem.describe()}: {kind} {name!r}: {e}") from None
    chunked = sorted({h for _n, _k, _d, items in names for _key, h, _s in items if h in recipe_size})
    chunks_of: Dict[str, Set[str]] = {}
    if chunked:
        objs = S3Objects(rem.connection, rem.prefix)
        with ThreadPoolExecutor(min(16, rem.workers), thread_name_prefix="casstore-du-recipes") as ex:
            for h, recipe in zip(chunked, ex.map(lambda x: objs.read_recipe(Digest(x)), chunked), strict=True):
                chunks_of[h] = set() if recipe is None else {c.digest.hex for c in recipe.chunks}

    def stored_of(hexes: Set[str]) -> Tuple[int, int]:
        """(bytes stored for these objects, each chunk once; how many are missing)."""
        total = missing = 0
        chunks: Set[str] = set()
        for h in hexes:
            if h in listed:
                total += listed[h]
            elif h in recipe_size:
                total += recipe_size[h]
                chunks |= chunks_of.get(h, set())
            else:
                missing += 1
        return total + sum(chunk_size.get(c, 0) for c in chunks), missing

    rows: List[RemoteNameUsage] = []
    live: Set[str] = set()
    logical_total = 0
    for name, kind, d, items in names:
        live.add(d.hex)
        objs_h: Set[str] = set()
        entries = logical = 0
        for key, h, size in items:
            live.add(h)
            if not key:  # a tree node: stored, not an entry
                continue
            entries += 1
            logical += size if size is not None else listed.get(h, 0)
            objs_h.add(h)
        stored_b, missing = stored_of(objs_h)
        logical_total += logical
        rows.append(RemoteNameUsage(name, kind, d, entries, logical, len(objs_h), stored_b, missing))
    live_stored, live_missing = stored_of(live)
    stored = sum(listed.values()) + sum(o.size for o in recipes_l) + sum(chunk_size.values())
    return RemoteUsage(rem.describe(), len(set(listed) | set(recipe_size)), stored, logical_total, len(live),
                       live_stored, live_missing, stored - live_stored, tuple(rows))
