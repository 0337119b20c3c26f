"""push: upload pins and heads with their closures, objects first, refs last by compare-and-swap.

Order is the consistency argument (docs/remotes.md): every object of a
closure goes up before the ref that names it, and a head's older versions
oldest first, so the remote never has a ref to a missing object nor a
version without its ancestors; a killed push is simply run again, and a
listing (never one request per object) tells it what is already there.
Refs move by compare-and-swap on the ETag read at planning time: of two
machines pushing one head at once exactly one wins, the other gets
:class:`~casstore.errors.RemoteConflictError` (pull, which merges, then push
again).  Pins are only ever created.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from .._faults import fault
from .._progress import Progress
from ..digest import Digest
from ..errors import NameExistsError, ObjectNotFoundError, RemoteConflictError, StoreFormatError
from ..manifests.model import SeenNodes, load_manifest, walk_tree
from ..objects.chunking import ChunkIndex
from ..refs import validate_name
from ..refs.base import Ref
from ..refs.s3 import DamagedRef
from .markers import Marker
from .merge import is_ancestor, local_chain
from .remotes import Remote, resolve_remote
from .transfer import TransferReport, run_parallel, upload_object

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["push"]


@dataclass(frozen=True, slots=True)
class _RefPlan:
    kind: str
    name: str
    digest: Digest
    expected: Optional[Ref]
    """The remote ref as read when planning (the compare-and-swap's token)."""
    action: str
    write: bool
    damaged: Optional[DamagedRef] = None
    """The damaged remote ref a forced push replaces (``If-Match`` on its ETag), if any."""


_REPAIRED = "forced (replaced a damaged ref)"


def _damaged_error(bad: DamagedRef, name: str) -> StoreFormatError:
    """The refusal of a push without force over a damaged ref: says how to replace it."""
    return StoreFormatError(
        f"{bad.what}; to replace it with your version push with force (store.push(remote, {name!r}, force=True), "
        f"`casstore push REMOTE {name} --force`), or delete the key"
    )


def _repair_plan(kind: str, name: str, d: Digest, bad: DamagedRef) -> _RefPlan:
    """The plan of a push with force over a damaged ref (refused up front if it cannot be conditional)."""
    if not bad.token:  # If-Match needs the ETag; an unconditional PUT could overwrite a repair made meanwhile
        raise StoreFormatError(f"{bad.what}; the server sent no ETag for it, so it cannot be replaced "
                               "conditionally: delete the key, then push again")
    return _RefPlan(kind, name, d, None, _REPAIRED, True, damaged=bad)


def _resolve_local(store: Store, names: Sequence[str]) -> List[Tuple[str, str, Digest]]:
    if not names:
        pins = store.refs.list("pins")
        out = [("pins", n, d) for n, d in pins.items()]
        out += [("heads", n, d) for n, d in store.refs.list("heads").items() if n not in pins]
        return out
    res = []
    for name in names:
        name = validate_name(name)
        pin = store.refs.get("pins", name)
        if pin is not None:
            res.append(("pins", name, pin))
            continue
        head = store.refs.get("heads", name)
        if head is None:
            raise ObjectNotFoundError(
                f"no pin or head named {name!r} in the store at {store.root}; see `casstore pins --heads`"
            )
        res.append(("heads", name, head))
    return res


def _plan_ref(store: Store, rem: Remote, kind: str, name: str, d: Digest, force: bool) -> _RefPlan:
    where = rem.describe()
    # A ref key holding no digest (a hand edit, another tool, a torn write of some server) names a
    # version nobody can know.  Its error says "push the name again with force": with force it is
    # replaced, by If-Match on the ETag of the damaged bytes read here, so a repair someone else made
    # meanwhile is never overwritten (bug hunt: force gave the same error, so the advice was a dead end).
    rpin = rem.refs.inspect("pins", name)
    if kind == "pins":
        if isinstance(rpin, DamagedRef):
            if force:
                return _repair_plan(kind, name, d, rpin)
            raise _damaged_error(rpin, name)
        if rpin is None:
            return _created(rem, kind, name, d)
        if rpin.digest == d:
            return _RefPlan(kind, name, d, rpin, "up to date", False)
        raise RemoteConflictError(
            f"{where}: pin {name!r} there names {rpin.digest}, not {d}; pins never move -- "
            "pin this version under another name and push that"
        )
    if isinstance(rpin, DamagedRef):
        # Not ours to replace: a head push never writes the pin key, and whether a pin was there is unknown.
        raise StoreFormatError(f"{rpin.what}, so head {name!r} cannot be pushed beside it: delete that key "
                               f"(or push a pin {name!r} with force to replace it), then push again")
    if rpin is not None:
        raise RemoteConflictError(
            f"{where}: {name!r} is a pin there ({rpin.digest}), so head {name!r} cannot be pushed; "
            f"pull the pin (store.pull(remote, {name!r})) or push the head under another name"
        )
    rstate = rem.refs.inspect("heads", name)
    if isinstance(rstate, DamagedRef):
        if force:
            return _repair_plan(kind, name, d, rstate)
        raise _damaged_error(rstate, name)
    rhead = rstate
    if rhead is None:
        return _created(rem, kind, name, d)
    r = rhead.digest
    if r == d:
        return _RefPlan(kind, name, d, rhead, "up to date", False)
    if is_ancestor(store.objects, r, of=d):
        return _RefPlan(kind, name, d, rhead, "fast-forward", True)
    if store.objects.has(r) and is_ancestor(store.objects, d, of=r):
        return _RefPlan(kind, name, d, rhead, "remote is ahead (pull to update)", False)
    if force:
        return _RefPlan(kind, name, d, rhead, "forced", True)
    raise RemoteConflictError(
        f"{where}: head {name!r} there is at {r}, which is not in the history of your {d}; "
        f"pull it (store.pull(remote, {name!r}) merges), then push again -- or push with force=True "
        "to overwrite it"
    )


def _created(rem: Remote, kind: str, name: str, d: Digest) -> _RefPlan:
    """The plan of a name new on the remote; :class:`NameExistsError` if a name there clashes with it by
    prefix (``x`` and ``x/y``: no store could pull both; see :meth:`S3Refs.clashing`)."""
    other = rem.refs.clashing(kind, name)
    if other is not None:
        what = kind[:-1]
        raise NameExistsError(
            f"{rem.describe()}: {what} {other!r} there and your {what} {name!r} cannot both exist in one store (a "
            "name cannot also be the folder of another name), so it was not pushed; rename yours "
            f"(`casstore mv {name} NEW`) and push that"
        )
    return _RefPlan(kind, name, d, None, "created", True)


def push(store: Store, remote: Union[Remote, str], *names: str, force: bool = False,
         timeout: Optional[float] = 600.0) -> TransferReport:
    """Upload pins/heads (all of them if no names) with their closures; see :meth:`Store.push`.

    ``timeout``: seconds to wait while a remote gc is deleting (then :class:`~casstore.errors.LockTimeout`).
    """
    t0 = time.perf_counter()
    rem = resolve_remote(store, remote)
    targets = _resolve_local(store, names)
    if not targets:
        return TransferReport(rem.describe(), seconds=time.perf_counter() - t0)
    objects = store.objects
    n_objects = n_bytes = 0
    with ThreadPoolExecutor(rem.workers, thread_name_prefix="casstore-push") as ex, ExitStack() as held:
        # 1. Which refs can move, and how (early conflict detection; the CAS at the end decides).
        plans = list(ex.map(lambda t: _plan_ref(store, rem, t[0], t[1], t[2], force), targets))
        # A push that will move a ref announces itself *before* it lists what the remote has: from
        # then until its last ref write, a remote gc waits, so no object this push counts on (uploaded,
        # or already there and skipped -- old, so no grace period protects it) can be deleted under it.
        # While a gc runs, it waits (sync/markers.py; docs/remotes.md, "Remote gc").
        marker: Optional[Marker] = None
        if any(p.write for p in plans):
            marker = held.enter_context(Marker(rem, "push", ", ".join(f"{p.kind}/{p.name}" for p in plans)))
            marker.wait_clear(timeout, back_off=True)
        # 2. The closures: version chains (heads carry their history) and entry objects.
        chains: Dict[Digest, List[Digest]] = {}
        content: Set[Digest] = set()
        expected: Dict[Digest, int] = {}  # sizes the entries record: a remote key of another size is damaged
        nodes_seen: SeenNodes = {}
        for p in plans:
            chain = local_chain(objects, p.digest) if p.kind == "heads" else [p.digest]
            if not chain or not objects.has(p.digest):
                raise ObjectNotFoundError(f"manifest version {p.digest} of {p.kind[:-1]} {p.name!r} is "
                                          f"missing from the store at {store.root}; nothing was pushed")
            chains[p.digest] = chain
            # Entries of the version pushed, and the tree nodes of every version of its chain: nodes
            # travel with their versions (a remote version never names a missing node).  A node
            # shared with one already walked is skipped with its subtree (history costs its changes).
            for _key, h, size in walk_tree(load_manifest(objects, p.digest).entries, nodes_seen):
                d = Digest(h)
                content.add(d)
                if size is not None:
                    expected[d] = size
            for v in chain[1:]:
                entries = load_manifest(objects, v).entries
                if entries.is_tree:
                    for key, h, _size in walk_tree(entries, nodes_seen):
                        if not key:
                            content.add(Digest(h))
        versions = {v for c in chains.values() for v in c}
        content -= versions
        # 3. What the remote already has: a listing, never one request per object.
        for v in versions:
            expected[v] = objects.stat(v).size
        # A listed recipe is read only if its length is not that of the recipe this store pushed or
        # pulled (the chunk index): a cut-off one is found and replaced, at no GET in the usual case.
        def known(recipes: Set[Digest]) -> Dict[Digest, int]:
            got = ChunkIndex(store.root).recipes({d: expected[d] for d in recipes if d in expected})
            return {d: len(r.encode()) for d, r in got.items()}

        remote_has = rem.objects.present(content | versions, executor=ex, sizes=expected, recipes_known=known)
        missing = [d for d in content if d not in remote_has]
        absent = [d for d in missing if not objects.has(d)]
        if absent:
            raise ObjectNotFoundError(
                f"cannot push: {len(absent)} object(s) of the closure are neither in the store at {store.root} "
                f"nor on {rem.describe()} (first: {absent[0]}); pull or put them first. Nothing was pushed"
            )
        present = len(content) - len(missing) + len(versions & remote_has)
        sizes = {d: objects.stat(d).size for d in missing}
        bar = Progress(sum(sizes.values()), desc=f"push {rem.name or rem.url}", unit="B", enabled=rem.progress)
        try:
            # 4. Objects first (parallel, create-only) ...
            def sent(d: Digest, n: int) -> None:
                nonlocal n_objects, n_bytes
                n_objects += 1
                n_bytes += n  # bytes sent: a chunked object sends only the chunks the remote lacks
                bar.update(sizes[d])
                fault("remote.object-uploaded")

            run_parallel(lambda d: upload_object(objects, rem.objects, d, sizes[d]),
                         sorted(missing, key=lambda d: -sizes[d]), sent, ex)
            # ... then manifest versions, oldest first, so a version on the remote implies its ancestors.
            done_versions: Set[Digest] = set()
            for chain in chains.values():
                for v in reversed(chain):
                    if v in remote_has or v in done_versions:
                        continue
                    size = expected[v]  # stat-ed above, for the listing's size check
                    n_bytes += upload_object(objects, rem.objects, v, size)
                    done_versions.add(v)
                    n_objects += 1
                    bar.update(size)
                    fault("remote.object-uploaded")
        finally:
            bar.close()
        # 5. Refs last, by compare-and-swap (still announced: the marker is removed on leaving this block).
        fault("remote.before-refs")

        def still_announced() -> None:
            nonlocal n_objects, n_bytes
            if marker is None or marker.held():
                return
            # Paused or cut off for so long that a gc may have judged our marker dead and deleted
            # what we counted on: announce again (waiting out any gc), then make sure the closure is there.
            marker.wait_clear(timeout, back_off=True)
            n, b = _reupload(store, rem, content | versions, ex)
            n_objects += n
            n_bytes += b

        refs = _move_refs(rem, plans, still_announced)
    return TransferReport(rem.describe(), refs, n_objects, n_bytes, present, time.perf_counter() - t0)


def _reupload(store: Store, rem: Remote, closure: Set[Digest], ex: ThreadPoolExecutor) -> Tuple[int, int]:
    """Upload whatever of ``closure`` the remote lacks now (after our marker may have lapsed); (objects, bytes)."""
    now_has = rem.objects.present(closure, executor=ex)
    gone = [d for d in closure if d not in now_has]
    absent = [d for d in gone if not store.objects.has(d)]
    if absent:
        raise ObjectNotFoundError(
            f"push to {rem.describe()} stalled long enough for a remote gc to run, and {len(absent)} object(s) "
            f"it relied on are gone there and not in the store at {store.root} (first: {absent[0]}); no ref "
            "was moved. Pull or put them, then push again"
        )
    sizes = {d: store.objects.stat(d).size for d in gone}
    # Versions last, oldest first is not needed here: no ref has moved yet, and every one goes up before the refs.
    run_parallel(lambda d: upload_object(store.objects, rem.objects, d, sizes[d]),
                 sorted(gone, key=lambda d: -sizes[d]), lambda d, _: None, ex)
    return len(gone), sum(sizes.values())


def _move_refs(rem: Remote, plans: List[_RefPlan], still_announced: Callable[[], None]) -> Dict[str, str]:
    """Compare-and-swap each planned ref (each right after ``still_announced()``); what happened to each."""
    refs: Dict[str, str] = {}
    for p in plans:
        label = f"{p.kind}/{p.name}"
        if not p.write:
            refs[label] = p.action
            continue
        fault("remote.before-ref-cas")
        still_announced()
        if p.damaged is not None:
            if rem.refs.replace_damaged(p.kind, p.name, p.digest, p.damaged):
                refs[label] = p.action
                continue
        elif rem.refs.compare_and_swap(p.kind, p.name, p.digest, p.expected):
            refs[label] = p.action
            continue
        state = rem.refs.inspect(p.kind, p.name)
        if isinstance(state, DamagedRef):  # rewritten meanwhile, and still (or newly) no digest
            raise RemoteConflictError(
                f"{state.what} -- it changed there while pushing, so nothing was written to it; "
                f"look at it, then push again with force=True (or delete the key)"
            )
        now = state
        if now is not None and now.digest == p.digest:
            refs[label] = "up to date"  # someone pushed the same version meanwhile
            continue
        if p.damaged is not None:
            raise RemoteConflictError(
                f"{rem.describe()}: {p.kind[:-1]} {p.name!r} was damaged, but someone else "
                f"{'set it to ' + str(now.digest) if now else 'deleted it'} while pushing, so your force push did not "
                f"overwrite it; pull it (store.pull(remote, {p.name!r})), then push again"
            )
        if p.kind == "pins":
            raise RemoteConflictError(
                f"{rem.describe()}: pin {p.name!r} was created there by someone else meanwhile "
                f"({now.digest if now else 'gone'}); pins never move -- pull it or pin under another name"
            )
        raise RemoteConflictError(
            f"{rem.describe()}: head {p.name!r} moved there while pushing "
            f"(now {now.digest if now else 'deleted'}); another push won. "
            f"Pull it (store.pull(remote, {p.name!r}) merges), then push again"
        )
    return refs
