"""pull and fetch_object: download pins, heads and objects, each verified before it is stored.

Order and checks (docs/remotes.md, docs/security.md):

1. The manifest versions named (a head with its history, for merges) are
   downloaded, hashed and decoded by THE manifest decoder
   (:func:`casstore.manifests.model.decode_manifest`, which validates every
   key and entry) -- all of them before any is stored.  A hostile manifest
   (a ``../``, absolute, empty, NUL or non-string key, a malformed entry)
   is a :class:`~casstore.errors.StoreFormatError` and nothing of the pull
   is stored: no version, no object, no ref.
2. The entry objects the store lacks, in parallel, each hashed before it is
   published (:func:`casstore.sync.transfer.download_object`), in batches
   with one filesystem sync each.  What arrived stays when a later object
   fails (verified, so a rerun transfers only the rest).
   With ``lazy`` nothing is downloaded; instead, before anything of step 1
   is stored, the remote must hold every entry object the store lacks, or
   the pull is an ObjectNotFoundError naming them (``_require_on_remote``).
3. Local refs last, under the name's lock and the GC lock shared (a gc
   cannot delete the pulled objects between the closure check and the ref).
"""

from __future__ import annotations

import bisect
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Set, Tuple, Union

from .._faults import fault
from .._gclock import commit_lock
from .._layout import OBJECTS
from .._progress import Progress
from ..digest import Digest
from ..errors import (
    BackendError,
    FrozenError,
    InvalidInputError,
    NameExistsError,
    ObjectNotFoundError,
    RemoteConflictError,
    StoreFormatError,
)
from ..manifests.model import (
    ManifestDoc,
    SeenNodes,
    decode_manifest,
    file_dir_clash,
    load_manifest,
    seen_objects,
    walk_tree,
)
from ..refs import validate_name
from .merge import is_ancestor, merge_versions
from .readthrough import RemoteUpstream
from .remotes import Remote, load_remotes, resolve_remote
from .transfer import Publisher, TransferReport, download_object, run_parallel

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["pull", "pull_closure", "fetch_object", "MAX_MANIFEST_BYTES"]

MAX_MANIFEST_BYTES = 1 << 30
"""A manifest version larger than this is refused (a 100,000-entry manifest is about 10 MB)."""


MAX_NODE_BYTES = 64 << 20
"""A tree node larger than this is refused (a real one holds a few dozen entries: a few KiB)."""


class _PullNodes:
    """Where a pull reads tree nodes: local objects first, else the remote (verified, size-bounded).

    Nodes fetched are only remembered here; they are stored (one batch,
    children first) after every version and node of the pull was validated by
    THE decoder, so a hostile remote leaves nothing behind.
    """

    def __init__(self, store: Store, rem: Remote) -> None:
        self.local = store.objects
        self.rem = rem
        self.fetched: Dict[Digest, bytes] = {}
        self.seen: SeenNodes = {}  # nodes walked: a node shared by several versions is walked once

    def prefetch(self, digests: Iterable[Digest]) -> None:
        """Nothing: only a commit announces nodes, and a pull walks trees through this view, never commits."""

    def read(self, digest: Digest, *, verify: bool = True) -> bytes:
        """The node's bytes (a remote read is always verified)."""
        got = self.fetched.get(digest)
        if got is not None:
            return got
        if self.local.has(digest):
            return self.local.read(digest, verify=verify)
        data = self.rem.objects.read_at_most(digest, MAX_NODE_BYTES, chunked=True)  # hashed before it is returned
        if data is None:
            raise StoreFormatError(
                f"{self.rem.describe()}: manifest tree node {self.rem.objects.url(digest)} is larger than "
                f"{MAX_NODE_BYTES} bytes; refused (nothing of this pull was stored)"
            )
        self.fetched[digest] = data
        return data


def _remote_versions(store: Store, rem: Remote, d: Digest, *, history: bool,
                     into: Dict[Digest, Tuple[bytes, ManifestDoc]], nodes: _PullNodes) -> ManifestDoc:
    """Download and decode version ``d`` (and, with ``history``, its ancestors the remote has) into ``into``.

    Versions already local are read locally (and not added).  Nothing is
    stored here.  Returns the decoded version ``d``.
    """
    objects = store.objects
    top: Optional[ManifestDoc] = None
    cur: Optional[Digest] = d
    first = True
    while cur is not None:
        if cur in into:
            doc = into[cur][1]
        elif objects.has(cur):
            if not first or not history:
                if top is None:
                    top = load_manifest(objects, cur)
                break
            doc = load_manifest(objects, cur)
        else:
            try:
                data = rem.objects.read_at_most(cur, MAX_MANIFEST_BYTES, chunked=True)  # hashed before it is returned
            except ObjectNotFoundError:
                if first:
                    raise
                break  # older history is not on the remote (collected, or never pushed)
            if data is None:
                raise StoreFormatError(
                    f"{rem.describe()}: manifest version {rem.objects.url(cur)} is larger than "
                    f"{MAX_MANIFEST_BYTES} bytes; refused (nothing of this pull was stored)"
                )
            doc = decode_manifest(data, cur, nodes)  # StoreFormatError on any hostile key or entry
            into[cur] = (data, doc)
            if doc.entries.is_tree:
                # Every node of a fetched version is fetched (unless local) and validated now, before
                # anything is stored; nodes shared with a version already walked are skipped.
                for _ in walk_tree(doc.entries, nodes.seen):
                    pass
            if first:
                # Hazard (found by a bug hunt): a version with keys "a" and "a/b" (edit refuses the pair;
                # a remote may hold anything) was pulled as a head that could never be checked out.
                clash = file_dir_clash(doc.entries.keys())
                if clash is not None:
                    raise StoreFormatError(
                        f"{rem.describe()}: manifest version {rem.objects.url(cur)} has the key {clash[0]!r} "
                        f"and the key {clash[1]!r} under it (a file and a directory at once): it could never be "
                        "checked out; refused (nothing of this pull was stored). Fix it where it was made and "
                        "push again"
                    )
        if top is None:
            top = doc
        if not history:
            break
        cur = doc.parent
        first = False
    assert top is not None
    return top


def _require_closure(store: Store, d: Digest, name: str, rem: Remote, lazy: bool) -> None:
    """The pulled version and its entries (unless ``lazy``) must all be here before a ref names them."""
    doc = load_manifest(store.objects, d)
    if lazy:
        # The entries arrive through the store's upstream as they are read; that the remote has every
        # one the store lacks was checked before anything was stored (_require_on_remote).
        return
    missing = [k for k, e in doc.entries.items() if not store.objects.has(e.digest)]
    if missing:
        raise ObjectNotFoundError(
            f"pull of {name!r} from {rem.describe()}: {len(missing)} object(s) of {d.short()} vanished locally "
            f"before the ref was written (a gc ran meanwhile?), e.g. {missing[0]!r}; pull again"
        )


def _update_local_ref(store: Store, rem: Remote, kind: str, name: str, d: Digest,
                      merge: Union[bool, str], lazy: bool) -> str:
    refs = store.refs
    where = rem.describe()
    # The name's lock, then the GC lock shared, as for any commit (docs/maintenance.md).
    with refs.lock(name, what=f"manifest {name!r}"), commit_lock(store):
        _require_closure(store, d, name, rem, lazy)
        pin = refs.get("pins", name)
        head = refs.get("heads", name)
        if kind == "pins":
            if pin == d:
                return "up to date"
            if pin is not None:
                raise FrozenError(
                    f"local pin {name!r} names {pin}, but on {where} it names {d}; pins never move. "
                    f"Pull nothing, or pin {d} under another name locally (store.pin('other', '{d}'))"
                )
            if head is not None and not is_ancestor(store.objects, head, of=d):
                raise FrozenError(
                    f"{name!r} was frozen on {where} at {d}, but the local head {head} has changes "
                    f"that version lacks; save them under another name (store.pin('{name}-local', '{head}')), "
                    "then pull again"
                )
            refs.write("pins", name, d)
            if head is not None:
                refs.remove("heads", name)
            return "created"
        if pin is not None:
            raise FrozenError(
                f"{name!r} is a pin in the store at {store.root} ({pin}) but a head on {where}; "
                "pins never change -- pull the head under another name"
            )
        if head is None:
            refs.write("heads", name, d)
            return "created"
        if head == d:
            return "up to date"
        if is_ancestor(store.objects, head, of=d):
            refs.write("heads", name, d)
            return "fast-forward"
        if is_ancestor(store.objects, d, of=head):
            return "local is ahead (push it)"
        if merge is False:
            raise RemoteConflictError(
                f"local head {name!r} ({head}) and the one on {where} ({d}) have diverged; "
                "pull with merge=True (or 'ours'/'theirs') to merge them"
            )
        merged = merge_versions(store, head, d, prefer=merge if isinstance(merge, str) else None)
        refs.write("heads", name, merged)
        return f"merged ({merged.short()})"


def _targets(rem: Remote, names: Tuple[str, ...]) -> List[Tuple[str, str, Digest]]:
    if not names:
        pins = rem.refs.list("pins")
        out = [("pins", n, d) for n, d in pins.items()]
        out += [("heads", n, d) for n, d in rem.refs.list("heads").items() if n not in pins]
        return out
    targets: List[Tuple[str, str, Digest]] = []
    for name in names:
        name = validate_name(name)
        kind = "pins"
        got = rem.refs.read("pins", name)
        if got is None:
            got, kind = rem.refs.read("heads", name), "heads"
        if got is None:
            raise ObjectNotFoundError(f"{rem.describe()} has no pin or head named {name!r}; "
                                      f"see `casstore remote ls {rem.name or rem.url}`")
        targets.append((kind, name, got.digest))
    return targets


def pull(store: Store, remote: Union[Remote, str], *names: str, merge: Union[bool, str] = True,
         lazy: bool = False) -> TransferReport:
    """Download pins/heads (all the remote has if no names); see :meth:`Store.pull`.

    ``merge``: ``True`` merges a diverged head three-way (conflicting keys
    raise :class:`RemoteConflictError`), ``"ours"``/``"theirs"`` settle
    conflicts for that side, ``False`` refuses to merge (conflict error).
    ``lazy``: refs and manifest versions only; the entries' objects arrive
    through the store's upstream as they are read (the store must read
    through this remote: :class:`InvalidInputError` otherwise).
    """
    t0 = time.perf_counter()
    rem = resolve_remote(store, remote)
    if merge not in (True, False, "ours", "theirs"):
        raise InvalidInputError(f"merge must be True, False, 'ours' or 'theirs', not {merge!r}")
    if lazy and not _reads_through(store, rem):
        raise InvalidInputError(
            f"pull --lazy from {rem.describe()} brings no data objects, so the store must fetch them from that "
            f"remote as they are read: make it the upstream first (store.set_upstream('{rem.name or 'NAME'}'), "
            f"`casstore remote upstream {rem.name or 'NAME'}`, or casstore.open(path, upstream=...))"
        )
    targets = _targets(rem, names)
    _refuse_name_clashes(store, rem, targets)
    n_objects, n_bytes, present = _bring_closures(store, rem, targets, lazy=lazy)
    # 3. Local refs last.
    fault("remote.before-refs")
    refs: Dict[str, str] = {}
    for kind, name, d in targets:
        refs[f"{kind}/{name}"] = _update_local_ref(store, rem, kind, name, d, merge, lazy)
    return TransferReport(rem.describe(), refs, n_objects, n_bytes, present, time.perf_counter() - t0)


def _refuse_name_clashes(store: Store, rem: Remote, targets: List[Tuple[str, str, Digest]]) -> None:
    """:class:`NameExistsError`, before anything is pulled, if a target name and another name of its kind
    (pulled too, or local) cannot both exist in a store: one is a prefix folder of the other (``x``, ``x/y``).

    Hazard (found by a bug hunt): remote names may clash so (two machines pushed ``x`` and ``x/y``); a
    full pull moved some refs, then stopped at the clash with "choose another" (no advice a pull can
    take), the remaining names were never pulled and the report was lost.
    """
    where = rem.describe()
    # Names of both kinds: a head cannot be the folder of a pin either (refs/local.py: a head becomes the
    # pin of its own name, which is not a clash).
    both: Set[str] = set()
    kind_of: Dict[str, str] = {}
    for kind in ("pins", "heads"):
        listing = store.refs.scan(kind)
        for n in (*listing.refs, *listing.damaged):
            kind_of.setdefault(n, kind[:-1])
            both.add(n)
    both |= {n for _k, n, _d in targets}
    for kind in ("pins", "heads"):
        wanted = sorted({n for k, n, _ in targets if k == kind})
        if not wanted:
            continue
        every = sorted(both)
        present = both
        for name in wanted:
            parts = name.split("/")
            clash = [p for i in range(1, len(parts)) if (p := "/".join(parts[:i])) in present]
            at = bisect.bisect_left(every, name + "/")  # names under the folder 'name/' sort together here
            if at < len(every) and every[at].startswith(name + "/"):
                clash.append(every[at])
            for other in clash[:1]:
                what = kind[:-1]
                top, sub = (name, other) if other.startswith(name + "/") else (other, name)
                if other in wanted:
                    raise NameExistsError(
                        f"pull from {where}: {what}s {top!r} and {sub!r} there cannot both exist in one store (a name "
                        f"cannot also be the folder of another name); nothing was pulled. Pull the other names one "
                        f"by one and only one of these two (`casstore pull {rem.name or 'REMOTE'} {top}`), or rename "
                        f"one on the store that pushed it (`casstore mv {sub} NEW`) and push it again"
                    )
                raise NameExistsError(
                    f"pull from {where}: {what} {name!r} there clashes with the local {kind_of.get(other, what)} "
                    f"{other!r} in the store "
                    f"at {store.root} (a name cannot also be the folder of another name); nothing was pulled. "
                    f"Rename the local one (`casstore mv {other} NEW`) and pull again, or rename {name!r} on the "
                    "store that pushed it and push it again"
                )


def pull_closure(store: Store, remote: Union[Remote, str], digest: Digest) -> TransferReport:
    """Download version ``digest`` (with its history, as a head's pull does) and every object it names that
    the store lacks, each verified before it is stored; **no local ref moves** (the caller decides).

    For callers that hold the name's lock already (a derive or fetch bringing home a result made on
    another machine): :func:`pull` would take that lock again.
    """
    t0 = time.perf_counter()
    rem = resolve_remote(store, remote)
    n_objects, n_bytes, present = _bring_closures(store, rem, [("heads", "", Digest.coerce(digest))], lazy=False)
    return TransferReport(rem.describe(), {}, n_objects, n_bytes, present, time.perf_counter() - t0)


def _bring_closures(store: Store, rem: Remote, targets: List[Tuple[str, str, Digest]], *,
                    lazy: bool) -> Tuple[int, int, int]:
    """Steps 1 and 2 of a pull: versions (validated before any is stored), then objects (verified;
    none with ``lazy``).  Returns (objects transferred, bytes, objects already here)."""
    objects = store.objects
    # 1. Manifest versions (heads with their history, for merges): every one verified and decoded
    #    before any is stored, so a hostile manifest leaves nothing behind.
    fetched: Dict[Digest, Tuple[bytes, ManifestDoc]] = {}
    content: Dict[Digest, Optional[int]] = {}
    nodes = _PullNodes(store, rem)
    where: Dict[Digest, Tuple[str, str]] = {}  # an entry object -> (name, key) naming it, for messages
    for kind, name, d in targets:
        doc = _remote_versions(store, rem, d, history=kind == "heads", into=fetched, nodes=nodes)
        for key, h, size in doc.entries.hex_items():
            content[Digest(h)] = size
            where.setdefault(Digest(h), (name, key))
    # A node decoded earlier in this process is served from the decoded-node cache without a read:
    # fetch every walked node that is not here yet (verified by its hash; its content was validated).
    for nd in seen_objects(nodes.seen):
        if nd not in nodes.fetched and not objects.has(nd):
            nodes.read(nd)
    versions = set(fetched) | {d for _, _, d in targets}
    for v in versions:
        content.pop(v, None)
    if lazy:
        # Before anything is stored: a lazy pull leaves the entries to the upstream, so each one the
        # store lacks must be on the remote now, or the ref would name objects no one can have.
        _require_on_remote(store, rem, content, where)
    # Tree nodes first (one durable batch; reversed fetch order puts children before parents), then
    # versions oldest first: a local version implies its nodes and ancestors are here too.
    if nodes.fetched:
        objects.put_many(list(reversed(nodes.fetched.values())), compress=False)
    for v in reversed(list(fetched)):
        objects.put(fetched[v][0], compress=False)
    missing = [] if lazy else [d for d in content if not objects.has(d)]
    present = len(content) - len(missing) if not lazy else sum(1 for d in content if objects.has(d))
    # 2. Objects, in parallel, each verified before it is published in a batch.
    n_objects = n_bytes = 0
    known = sum(s for d in missing if (s := content[d]) is not None)
    bar = Progress(known, desc=f"pull {rem.name or rem.url}", unit="B", enabled=rem.progress)
    publisher = Publisher(objects)
    try:
        with ThreadPoolExecutor(rem.workers, thread_name_prefix="casstore-pull") as ex:
            def stored(d: Digest, n: int) -> None:
                nonlocal n_objects, n_bytes
                n_objects += 1
                n_bytes += n
                bar.update(n)
                fault("remote.object-downloaded")
                if publisher.due():
                    publisher.flush()

            try:
                # The window bounds the staged files (open fds) waiting for a batch.
                run_parallel(lambda d: download_object(rem.objects, objects, d, content[d], publisher),
                             sorted(missing, key=lambda d: -(content[d] or 0)), stored, ex, window=2 * rem.workers)
            except BaseException:
                try:
                    publisher.finish()  # what did arrive (verified) stays, durably
                except Exception:  # noqa: S110 - the first error is the one to report
                    pass
                raise
            publisher.finish()
    finally:
        publisher.discard()
        bar.close()
    return n_objects, n_bytes, present


def _require_on_remote(store: Store, rem: Remote, content: Dict[Digest, Optional[int]],
                       where: Dict[Digest, Tuple[str, str]]) -> None:
    """A lazy pull's closure check: every entry object the store lacks is on ``rem``, at the size its entry
    records; else :class:`ObjectNotFoundError` naming them (the caller has stored nothing yet).

    Hazard (bug hunt, defect B): ``pull(lazy=True)`` of a remote version naming an object the remote
    never had created the head, then checkout raised ObjectNotFoundError and verify reported it LOST.
    The cost stays proportional to the entries asked, whatever the remote's size (:func:`_remote_has`);
    a key of another size than the entry records is a damaged copy (a client died mid-PUT) and cannot
    be had either.
    """
    objects = store.objects
    want = [d for d in content if not objects.has(d)]
    if not want:
        return
    sizes = {d: n for d in want if (n := content[d]) is not None}
    with ThreadPoolExecutor(rem.workers, thread_name_prefix="casstore-pull-check") as ex:
        there = _remote_has(rem, want, sizes, ex)
    lost = sorted(((where[d], d) for d in want if d not in there), key=lambda t: t[0])
    if not lost:
        return
    shown = "; ".join(f"{name!r} key {key!r}: {d} ({rem.objects.url(d)})" for (name, key), d in lost[:5])
    more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
    raise ObjectNotFoundError(
        f"pull --lazy from {rem.describe()}: {len(lost)} object(s) named by the version(s) pulled are neither "
        f"in the store at {store.root} nor on the remote (or are there at another size than recorded): "
        f"{shown}{more}; nothing was pulled (no ref moved). Push them from a machine that has them, then pull again"
    )


_KEYS_PER_HEAD = 8
"""About how many listed keys cost one ``HeadObject`` (measured against SeaweedFS with botocore on 2
cores: 1,000 parallel HEADs 1.3 s; a listing reading ~12,600 keys in 241 pages 1.8 s)."""

def _none_known(_recipes: Set[Digest]) -> Dict[Digest, int]:
    """No recipe is known good: a lazy pull reads every recipe it counts on (see :func:`_remote_has`)."""
    return {}


def _remote_has(rem: Remote, want: List[Digest], sizes: Dict[Digest, int], ex: ThreadPoolExecutor) -> Set[Digest]:
    """Which of ``want`` ``rem`` has (whole at the size ``sizes`` records, or as a non-empty recipe).

    Listing (``S3Objects.present``, what push uses) costs what the remote holds between the
    smallest and largest digest asked in each fan-out prefix: one page on a small remote, but on a
    remote of 10^6 objects a 1,000-entry version would read most of it.  HEADs cost one request per
    object.  So: one listing page from the smallest digest asked (on a remote of up to a page of
    keys past it, that is the whole answer); otherwise the page's span estimates the remote's key
    density (digests are uniform), and the rest is listed when that reads at most ~``_KEYS_PER_HEAD``
    keys per object asked, else asked by HEADs in parallel.  Either way: proportional to ``want``.

    A chunked object's recipe is read (one GET each) and counts only if it decodes to the size the
    entry records.  Hazard (found by a bug hunt): a non-empty recipe key counted, so a hostile recipe
    of a 7-byte entry claiming 500 MiB (one chunk repeated) was accepted, and the first read-through
    wrote 500 MiB locally before its hash check failed.
    """
    objs = rem.objects
    conn = objs.connection
    base = f"{objs.prefix}{OBJECTS}/"
    order = sorted(want, key=lambda d: d.hex)
    by_hex = {d.hex: d for d in order}
    page, truncated = conn.list_page(base, start_after=objs.key(order[0])[:-1])
    listed: List[int] = []
    found: Set[Digest] = set()
    for key, size in page:
        rest = key[len(base):]
        if not key.startswith(base) or len(rest) != 65 or rest[2] != "/":
            continue  # not a casstore object key (ignored, as every listing does)
        h = rest[:2] + rest[3:]
        try:
            listed.append(int(h, 16))
        except ValueError:
            continue
        d = by_hex.get(h)
        if d is not None and sizes.get(d, size) == size:
            found.add(d)
    rest_d = [d for d in order if d not in found]
    if not rest_d:
        return found
    if not truncated or len(listed) < 2 or listed[-1] <= listed[0]:
        # The remote's object keys past the first asked are all in that page: what is left is absent
        # as a whole object (or damaged); only recipes (chunked objects) remain to be listed.
        return found | objs.present(rest_d, executor=ex, sizes=sizes, recipes_known=_none_known)
    density = (len(listed) - 1) / (listed[-1] - listed[0])  # keys per unit of digest space
    spans: Dict[str, Tuple[int, int]] = {}
    for d in rest_d:
        v = int(d.hex, 16)
        lo, hi = spans.get(d.hex[:2], (v, v))
        spans[d.hex[:2]] = (min(lo, v), max(hi, v))
    keys = density * sum(hi - lo for lo, hi in spans.values())
    if keys / _KEYS_PER_HEAD + len(spans) <= len(rest_d):
        return found | objs.present(rest_d, executor=ex, sizes=sizes, recipes_known=_none_known)

    def head(d: Digest) -> bool:
        got = conn.head(objs.key(d))
        if got is not None and sizes.get(d, got[0]) == got[0]:
            return True
        return objs.recipe_fits(d, sizes.get(d))  # a chunked object: its recipe, of the size recorded

    return found | {d for d, ok in zip(rest_d, ex.map(head, rest_d), strict=True) if ok}


def _reads_through(store: Store, rem: Remote) -> bool:
    """Is ``rem`` (the same bucket and prefix) the store's upstream?"""
    up = store.objects.upstream
    if not isinstance(up, RemoteUpstream):
        return False
    mine = up.remote
    return ((mine.objects.connection.bucket, mine.objects.prefix, mine.endpoint_url)
            == (rem.objects.connection.bucket, rem.objects.prefix, rem.endpoint_url))


def fetch_object(store: Store, digest: Union[Digest, str], *,
                 remotes: Optional[Iterable[Union[Remote, str]]] = None, verify: bool = True) -> bytes:
    """``store.get(digest)``; on a local miss, download it (verified) from the first remote that has it.

    ``remotes=None`` tries the store's configured remotes (``remotes.toml``) in name order.
    """
    d = Digest.coerce(digest)
    if store.objects.has(d):
        return store.objects.read(d, verify=verify)
    rems = [resolve_remote(store, r) for r in (remotes if remotes is not None else sorted(load_remotes(store)))]
    errors: List[str] = []
    for rem in rems:
        try:
            download_object(rem.objects, store.objects, d, None)
        except ObjectNotFoundError:
            errors.append(f"not on {rem.describe()}")
            continue
        except BackendError as e:
            errors.append(str(e))
            continue
        return store.objects.read(d, verify=verify)
    tried = "; ".join(errors) or "no remotes configured"
    raise ObjectNotFoundError(f"object {d} is not in the store at {store.root} and no remote has it ({tried})")
