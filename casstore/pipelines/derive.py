"""Derive once: a function of stored inputs run by exactly one process, memoized and recorded.

``store.derive(name, inputs=..., fn=...)``: the result is memoized on (name,
input digests, canonical params, version) -- :func:`derive_key` -- and
recorded as the head ``name``, a manifest of the files ``fn`` wrote whose
``meta["derive"]`` says how it was made.  Concurrent callers with the same
name wait on the name's lock and then read the result; if the producer dies,
the kernel drops its lock and a waiter runs ``fn`` instead.

Hazards (issue 11) and the answer to each:

* **A hostile multi-file input.**  A manifest input is re-read by its digest
  through the one manifest decoder (never trusted from the caller's object),
  and every key is checked before anything is created: a key with ``..``, an
  absolute key or an empty segment is a :class:`StoreFormatError` and nothing
  is written, inside the work directory or out of it.
* **A planted link in the work directory.**  The work directory is created
  mode 0o700 under ``tmp/`` (a shared store's ``tmp/`` is group-writable),
  and inputs are laid out with directory file descriptors: each directory is
  opened ``O_DIRECTORY | O_NOFOLLOW`` relative to its parent and each link is
  created with ``dir_fd``, so a symbolic link found where casstore creates a
  directory or a file is refused (:class:`StoreFormatError`), never followed.
* **Partial results.**  The work directory is named like a staging file, so
  if this process dies ``sweep_stale`` removes it; outputs become objects and
  then one manifest version (ref moved by rename) only after ``fn`` returns.

At job scale (issue 13):

* **The memo remembers every result of a name**, not only the head's: a miss
  on the head walks the head's history (at most :data:`MEMO_DEPTH` versions,
  as far as gc kept them) for a version with the same key, the same code
  fingerprint and all its outputs present, and reuses it by recording a new
  head version with its entries (params A -> B -> A runs ``fn`` twice).
* **A changed ``fn`` is detected** by a fingerprint of its code
  (:func:`code_fingerprint`: bytecode, constants and names, nested code
  objects included; not the source text, so comments and line moves do not
  count) kept in ``meta["derive"]["code"]``.  A stored result whose
  fingerprint differs (same Python version) is not a hit: ``fn`` runs again
  and a warning says to bump ``version``.  Bytecode differs between Python
  versions, so a record from another Python version is trusted.
* **regenerate means once per job**: with ``regenerate`` in effect a result
  recorded by *another* process after this one started is taken as the
  regenerated one (:func:`~casstore.pipelines.common.fresh_for_job`).
* **Outputs are moved, not copied**: the work directory is under the store's
  ``tmp/``, so each output file is hashed once and renamed into ``objects/``
  (``LocalObjects.adopt``); only a compressed store copies (it must encode).
* **Inputs keep their names**: an input is a hard link named after it in
  ``in/`` (an object input: ``in/<input name>``; a manifest input:
  ``in/<input name>/<its keys>``), so tools that choose a format by suffix work.
* **Provenance**: every version records ``meta["casstore.inputs"]``
  (docs/pipelines.md, "Provenance metadata"), read by gc and diff.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import stat
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Tuple, Union

import msgpack

from .._faults import fault
from .._fs import process_token
from ..codecs import CompressArg
from ..digest import Digest, new_hasher
from ..errors import (
    IntegrityError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
    StoreFormatError,
)
from ..manifests import Entry, Manifest, canonical_meta, load_manifest, validate_key
from ..manifests.provenance import INPUTS_KEY
from ..refs import validate_name
from .common import (
    Scope,
    TreeFlusher,
    beat_every,
    check_scope,
    fresh_for_job,
    in_scope,
    lock_seconds,
    producer,
    refuse_pinned,
    write_head,
)
from .remote import RemoteShare, adopt_version, run_once_remote

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["derive", "derive_key", "code_fingerprint", "DeriveFn", "DeriveInput", "InputKey", "MEMO_DEPTH",
           "INPUTS_META"]

log = logging.getLogger("casstore.derive")

MEMO_DEPTH = 1000
"""Versions of a name's history searched for an earlier result with the same key (newest first)."""

INPUTS_META = INPUTS_KEY
"""Metadata key of the provenance record (docs/pipelines.md, "Provenance metadata"); one definition, read by gc."""

DeriveFn = Callable[[Dict[str, Path], Path], object]
"""``fn(inputs, out)``: ``inputs`` maps input names to read-only paths; write outputs under ``out``."""
DeriveInput = Union[Digest, str, Manifest]
"""An input: an object digest (or its string form) or a Manifest (an earlier fetch/derive result)."""
InputKey = Tuple[str, Digest]
"""An input: ``("object", digest)`` or ``("manifest", version digest)``; the memo key sees a manifest
as ``("files", blake3 of its [key, object digest] list)``, so equal files are an equal input."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PRIVATE = 0o700


def _input_key(value: object, what: str) -> InputKey:
    """(kind, digest) of an input: an object digest or a manifest (outputs of a fetch/derive)."""
    if isinstance(value, Manifest):
        return "manifest", value.digest
    if isinstance(value, (Digest, str)):
        return "object", Digest.coerce(value)
    raise InvalidTypeError(
        f"derive input {what!r:.80} must be a Digest or a Manifest (the result of fetch/derive), "
        f"not {type(value).__name__}"
    )


def derive_key(name: str, inputs: Mapping[str, InputKey], params: Mapping[str, object], version: object) -> str:
    """The memo key: BLAKE3 of canonical msgpack of name, input digests, params and version."""
    doc = {
        "inputs": {k: [kind, d.raw] for k, (kind, d) in sorted(inputs.items())},
        "name": name,
        "params": canonical_meta(dict(params), f"params of derive {name!r}"),
        "version": canonical_meta(version, f"version of derive {name!r}"),
    }
    h = new_hasher()
    h.update(msgpack.packb(doc, use_bin_type=True))
    return str(h.hexdigest())


def _code_of(fn: object) -> Optional[types.CodeType]:
    """The code object that runs for ``fn``: a function, a bound method, a partial, or an object's __call__."""
    for _ in range(16):  # partials of partials; bounded (a hostile object could be its own .func)
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif isinstance(fn, types.MethodType):
            fn = fn.__func__
        else:
            break
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        return code
    call = next((k.__dict__["__call__"] for k in type(fn).__mro__ if "__call__" in k.__dict__), None)
    code = getattr(call, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


def _const(c: object) -> object:
    if isinstance(c, types.CodeType):
        return _code_doc(c)
    if isinstance(c, (tuple, list)):
        return [type(c).__name__, [_const(x) for x in c]]
    if isinstance(c, frozenset):  # iteration order follows string hashing, which is randomized per process
        return ["frozenset", sorted(repr(_const(x)) for x in c)]
    return [type(c).__name__, repr(c)]


def _code_doc(code: types.CodeType) -> object:
    return ["code", code.co_code, list(code.co_names), [_const(c) for c in code.co_consts]]


@functools.lru_cache(maxsize=256)
def _fingerprint_of(code: types.CodeType) -> str:
    h = new_hasher()
    h.update(msgpack.packb(_code_doc(code), use_bin_type=True))
    return str(h.hexdigest())


def code_fingerprint(fn: object) -> Optional[Dict[str, str]]:
    """``{"python": "3.11", "blake3": hex}`` of ``fn``'s code, or ``None`` when it has no Python code.

    Hashes the bytecode (``co_code``), the names it uses (``co_names``) and its
    constants, recursively through nested code objects (inner functions,
    lambdas, comprehensions); not the source text, so a comment or a moved line
    changes nothing, while a changed expression, constant or docstring does.
    Functions it *calls* are not included (only their names).  Bytecode is
    specific to a Python version, which is recorded with it.
    """
    code = _code_of(fn)
    if code is None:
        return None
    return {"python": f"{sys.version_info[0]}.{sys.version_info[1]}", "blake3": _fingerprint_of(code)}


def _code_matches(rec: Mapping[str, object], code: Optional[Dict[str, str]]) -> bool:
    """Does a stored record's fingerprint allow reuse with ``code``?  Unknown either side: yes."""
    stored = rec.get("code")
    if code is None or not isinstance(stored, (dict, Mapping)) or stored.get("python") != code["python"]:
        return True  # no fingerprint then or now, or another Python's bytecode: nothing to compare
    return stored.get("blake3") == code["blake3"]


def derive(store: Store, name: str, *, inputs: Mapping[str, DeriveInput], fn: DeriveFn,
           params: Optional[Mapping[str, object]] = None, version: object = None,
           regenerate: Optional[Scope] = None, timeout: Optional[float] = None,
           compress: CompressArg = None, remote: Optional[RemoteShare] = None) -> Manifest:
    """Run ``fn(inputs, out)`` once for this (name, inputs, params, version); return its outputs.

    ``inputs`` maps names to object digests or Manifests (earlier results);
    ``fn`` receives read-only paths named after its inputs (an object input is
    ``in/<input name>``; a Manifest with one file is that file, under its key's
    name; with several, a directory of them) and an empty output directory;
    every regular file it writes there becomes an output (moved into the
    store, not copied: ``fn`` must have finished writing when it returns).
    The result is the head ``name``: a Manifest of relative path -> Entry whose
    ``meta["derive"]`` records the key, inputs, params, version, times, who
    made it and ``fn``'s code fingerprint, and whose
    ``meta["casstore.inputs"]`` records the input digests (provenance).

    Same key (and unchanged code) -> the stored result, no work, also for an
    older result in the name's history.  A changed ``fn`` (its code
    fingerprint differs and ``version`` was not bumped) runs again, with a
    warning.  ``regenerate=True`` -- or a list of names/patterns that matches
    ``name``; default the setting ``regenerate`` -- runs ``fn`` again *once
    per job*: a result another process recorded after this one started is
    taken as the regenerated one.  Concurrent callers with the same name wait
    (logging every ~10 s) while the producer works and beats its heartbeat;
    ``timeout`` (default the setting ``lock_timeout``) applies only once the
    producer shows no sign of life for that long (stalled or dead), and the
    :class:`LockTimeout` says which.  If the producer dies, a waiter runs
    ``fn`` instead.  ``fn`` runs holding the name's lock: it must not edit
    ``name`` itself.  A manifest input whose keys are not safe relative paths
    is a :class:`StoreFormatError` before anything is created.

    ``remote`` (a :class:`~casstore.pipelines.remote.RemoteShare`; the facade
    makes one from ``remote="origin"``): once across machines sharing only
    that remote.  On a local miss, a usable result on the remote (its head
    of ``name``, same key) is pulled, not computed; otherwise one process
    takes the name's lease on the remote, runs ``fn``, pushes the result and
    releases it, while the others wait and pull (docs/pipelines.md, "Across
    machines").  The inputs must be in the local store.
    """
    from ..settings import current

    name = validate_name(name)
    if not callable(fn):
        raise InvalidTypeError(f"derive fn must be callable, not {type(fn).__name__}")
    params = {} if params is None else params
    # dict before Mapping: the first isinstance(x, Mapping) of a type in a fresh process walks every
    # Mapping subclass loaded (~1 ms, measured in forked ranks); isinstance stops at the first match.
    if not isinstance(params, (dict, Mapping)) or not isinstance(inputs, (dict, Mapping)):
        raise InvalidTypeError("derive inputs and params must be mappings")
    scope = check_scope(regenerate, "regenerate")
    # Input names become paths under the work dir (a several-file Manifest is a directory named
    # after its input): they must be normalized relative paths, never '..' or absolute.
    keyed = {validate_key(k, "derive input name"): _input_key(v, k) for k, v in inputs.items()}
    _check_input_names(keyed)
    key = derive_key(name, _content_keys(store, keyed), params, version)
    cfg = current()
    force = in_scope(cfg.regenerate if scope is None else scope, name)
    code = code_fingerprint(fn)
    lock_timeout = lock_seconds(timeout, cfg.lock_timeout, "timeout")
    hit, _head = _lookup(store, name, key, code, force=force, history=False, warn=False)
    if hit is not None:
        return hit
    with store.refs.lock(name, timeout=lock_timeout, what=f"derive {name!r} (key {key[:12]})",
                         heartbeat=beat_every(lock_timeout)):
        hit, head = _lookup(store, name, key, code, force=force, history=not force, warn=True)
        if hit is not None:
            if head is None or hit.digest == head.digest or hit.frozen:
                return hit
            return _reuse(store, name, hit, head, lock_timeout)
        refuse_pinned(store, name, f"derive {name!r}")
        if remote is None:
            return _run_derive(store, name, key, keyed, params, version, fn, code, compress, lock_timeout)

        def ready() -> Optional[Manifest]:
            return _remote_hit(store, remote, name, key, code, force=force, timeout=lock_timeout)

        def work() -> Manifest:
            return _run_derive(store, name, key, keyed, params, version, fn, code, compress, lock_timeout)

        return run_once_remote(remote, name, what=f"derive {name!r} (key {key[:12]})", ready=ready, work=work,
                               lock_timeout=lock_timeout)


def _remote_hit(store: Store, share: RemoteShare, name: str, key: str, code: Optional[Dict[str, str]], *,
                force: bool, timeout: Optional[float]) -> Optional[Manifest]:
    """A usable result of this key on the remote, brought home and made the local head; ``None`` if none.

    Only the remote version's metadata is judged (read size-bounded, hashed,
    decoded); its objects are pulled only when it is the result wanted.
    """
    d = share.head(name)
    if d is None:
        return None
    doc = share.read_version(d)
    if not _record_usable(doc.meta, key, code, force=force, warn=False, name=name, digest=d):
        return None
    share.bring_home(d)
    man = adopt_version(store, name, d, share, timeout=timeout)
    log.info("derive %r: pulled the result %s from %s (made elsewhere; fn not run)", name, d, share.describe())
    return man


def _content_keys(store: Store, keyed: Mapping[str, InputKey]) -> Dict[str, InputKey]:
    """The memo key's view of the inputs: a manifest input counts by its files, not its version.

    ``("files", blake3 of [[key, object digest], ...])``: what ``fn`` sees is
    file names and bytes, so a new version with the same files -- a memo
    reuse (A -> B -> A), or an upstream step regenerated to identical
    outputs -- keeps the steps after it hits.  The version is read by its
    digest (verified, decoded), never taken from the caller's object.
    """
    out: Dict[str, InputKey] = {}
    for k, (kind, d) in keyed.items():
        if kind == "manifest":
            entries = load_manifest(store.objects, d).entries
            h = new_hasher()
            h.update(msgpack.packb([[rel, e.digest.raw] for rel, e in entries.items()], use_bin_type=True))
            out[k] = ("files", Digest(h.hexdigest()))
        else:
            out[k] = (kind, d)
    return out


def _check_input_names(keyed: Mapping[str, InputKey]) -> None:
    """No input name may be a directory of another (``a`` and ``a/b``): both are laid out under ``in/``."""
    for b in keyed:
        segs = b.split("/")
        for i in range(1, len(segs)):
            a = "/".join(segs[:i])
            if a in keyed:
                raise InvalidInputError(f"derive input names {a!r} and {b!r} collide: {a!r} would be both a "
                                        "file and a directory; rename one")


def _usable(store: Store, man: Manifest, key: str, code: Optional[Dict[str, str]], *, force: bool,
            warn: bool) -> bool:
    if not _record_usable(man.meta, key, code, force=force, warn=warn, name=man.name, digest=man.digest):
        return False
    return all(store.objects.has(e.digest) for e in man.values())


def _record_usable(meta: Mapping[str, object], key: str, code: Optional[Dict[str, str]], *, force: bool,
                   warn: bool, name: Optional[str], digest: Digest) -> bool:
    """Does a version's derive record allow reuse (same key, fresh for the job if forced, same code)?"""
    rec = meta.get("derive")
    if not isinstance(rec, (dict, Mapping)) or rec.get("key") != key:
        return False
    if force and not fresh_for_job(rec.get("recorded"), rec.get("by")):
        return False
    if not _code_matches(rec, code):
        if warn:  # once per call: the search under the lock (the lock-free look first is silent)
            log.warning("derive %r: fn %s changed since the stored result %s was made (its code "
                        "fingerprint differs) but version= was not bumped; running it again -- bump version= "
                        "when fn changes", name, rec.get("fn", "?"), digest)
        return False
    return True


def _lookup(store: Store, name: str, key: str, code: Optional[Dict[str, str]], *, force: bool,
            history: bool, warn: bool) -> Tuple[Optional[Manifest], Optional[Manifest]]:
    """(a usable stored result, the current head).  ``history``: also search the head's older versions."""
    pin = store.refs.get("pins", name)
    if pin is not None:
        try:
            man = Manifest(pin, load_manifest(store.objects, pin), name=name, frozen=True)
        except ObjectNotFoundError:  # a pin whose version is gone: refuse_pinned says what to do
            return None, None
        return (man if _usable(store, man, key, code, force=force, warn=warn) else None), None
    d = store.refs.get("heads", name)
    head: Optional[Manifest] = None
    seen: set[Digest] = set()
    while d is not None and d not in seen and len(seen) < (MEMO_DEPTH if history else 1):
        seen.add(d)
        try:
            man = Manifest(d, load_manifest(store.objects, d), name=name)
        except (ObjectNotFoundError, IntegrityError, StoreFormatError):
            break  # removed meanwhile, or older versions collected (or damaged): the memo ends here
        if head is None:
            head = man
        if _usable(store, man, key, code, force=force, warn=warn):
            return man, head
        d = man.parent
    return None, head


def _reuse(store: Store, name: str, old: Manifest, head: Manifest, timeout: Optional[float]) -> Manifest:
    """Record an earlier result again as the head (its entries, its derive record and provenance)."""
    meta = dict(head.meta)
    for k in ("derive", INPUTS_META):
        if k in old.meta:
            meta[k] = old.meta[k]
        else:
            meta.pop(k, None)
    meta["derive.reused"] = {"from": str(old.digest), "at": time.time()}
    log.info("derive %r: reusing the earlier result %s (same key)", name, old.digest)
    return write_head(store, name, dict(old), meta, timeout=timeout)


@dataclass(frozen=True, slots=True)
class _Planned:
    """How one input reaches ``fn``: a file to link as ``in/<name>/<leaf>`` (or ``in/<name>``), or a tree."""

    files: Tuple[Tuple[Tuple[str, ...], Path], ...]
    """(path segments under ``in/<name>``, object file) -- ``()`` segments: the input itself is the file."""
    single: bool
    """``fn`` gets the one file's path, not the directory."""


def _plan(store: Store, keyed: Mapping[str, InputKey]) -> Dict[str, _Planned]:
    """Resolve every input before anything is created: objects exist, manifests decode (keys validated)."""
    plan: Dict[str, _Planned] = {}
    for k, (kind, d) in keyed.items():
        if kind == "object":
            plan[k] = _Planned((((), store.objects.raw_path(d)),), True)
            continue
        # Re-read by digest through THE decoder, which validates every key (StoreFormatError): the
        # caller's Manifest object is no evidence of what the digest holds, and the memo key names the digest.
        entries = load_manifest(store.objects, d).entries
        files = tuple((tuple(rel.split("/")), store.objects.raw_path(e.digest)) for rel, e in entries.items())
        plan[k] = _Planned(files, len(entries) == 1)
    return plan


def _provenance(keyed: Mapping[str, InputKey]) -> Dict[str, object]:
    """``meta["casstore.inputs"]``: input name -> "blake3:<hex>" (object) or {"manifest": "blake3:<hex>"}."""
    return {k: str(d) if kind == "object" else {"manifest": str(d)} for k, (kind, d) in sorted(keyed.items())}


def _run_derive(store: Store, name: str, key: str, keyed: Mapping[str, InputKey], params: Mapping[str, object],
                version: object, fn: DeriveFn, code: Optional[Dict[str, str]], compress: CompressArg,
                timeout: Optional[float]) -> Manifest:
    plan = _plan(store, keyed)
    # Named like a staging file: if this process dies, sweep_stale() removes it; nothing in it is ever named.
    work = store.objects.tmp / f"{process_token()}.{os.urandom(8).hex()}.derive"
    os.mkdir(work, _PRIVATE)
    try:
        wfd = os.open(work, _DIR_FLAGS)
        try:
            os.mkdir("in", _PRIVATE, dir_fd=wfd)
            os.mkdir("out", _PRIVATE, dir_fd=wfd)
            fault("derive.materialize")  # tests plant links in the work directory here
            in_fd = _open_dir(wfd, "in", work)
            try:
                paths = {k: _lay_out(in_fd, work / "in", k, p) for k, p in plan.items()}
            finally:
                os.close(in_fd)
        finally:
            os.close(wfd)
        out_dir = work / "out"
        made = {d: _dir_id(d) for d in (work, out_dir)}  # (what fn must leave in place: see _collect)
        started = time.time()
        t0 = time.monotonic()
        flusher = TreeFlusher(out_dir) if store.objects.durable else None
        try:
            fn(dict(paths), out_dir)
        finally:
            if flusher is not None:
                flusher.stop()
        seconds = time.monotonic() - t0
        for d, was in made.items():
            if _dir_id(d) != was:
                # Hazard (found by a bug hunt): fn replaced its output directory with a link to elsewhere,
                # and the walk below moved the files there into the store; or removed it, and an empty
                # result was recorded as the step's.  Nothing is collected from a directory that moved.
                raise InvalidInputError(
                    f"derive {name!r}: fn replaced or removed {d} (it is now {_dir_id(d)[2]}); write the "
                    "outputs under the output directory, never move, delete or link it; nothing was recorded")
        outputs = _collect(store, name, out_dir, compress)
        record: Dict[str, object] = {
            "key": key,
            "inputs": {k: str(d) for k, (_kind, d) in keyed.items()},
            "params": canonical_meta(dict(params), "params"),
            "version": version,
            "started": started,
            "seconds": round(seconds, 6),
            "fn": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}",
            "by": producer(),
        }
        if code is not None:
            record["code"] = code
        meta = _previous_meta(store, name)
        meta.pop("derive.reused", None)
        meta[INPUTS_META] = _provenance(keyed)
        meta["derive"] = record
        record["recorded"] = time.time()  # after the outputs are stored: "fresh for this job" compares it
        return write_head(store, name, outputs, meta, timeout=timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _previous_meta(store: Store, name: str) -> Dict[str, object]:
    """The current head's metadata (kept across reruns, as an edit keeps it), ``{}`` for a new name."""
    if store.refs.get("heads", name) is None:
        return {}
    return dict(store.manifest(name).meta)


def _open_dir(parent_fd: int, seg: str, where: Path) -> int:
    """Open an existing directory entry without following a link; StoreFormatError for anything else."""
    try:
        return os.open(seg, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            raise StoreFormatError(
                f"derive work directory: {where / seg} is not a directory casstore made (a planted symbolic "
                "link, or a manifest key that is both a file and a directory); nothing was followed"
            ) from None
        raise


def _make_dirs(fd: int, segs: Tuple[str, ...], where: Path) -> int:
    """``mkdir -p`` below ``fd`` one segment at a time with dir fds; returns a new fd of the last one."""
    cur = os.dup(fd)
    try:
        for seg in segs:
            if seg in ("", ".", "..") or "/" in seg or "\0" in seg:
                # The decoder refused such keys already; this is the last line where a path is made,
                # so no change elsewhere can ever make derive create anything outside its work directory.
                raise StoreFormatError(f"derive work directory: refusing the path segment {seg!r} under {where}")
            try:
                os.mkdir(seg, _PRIVATE, dir_fd=cur)
            except FileExistsError:
                pass  # ours from an earlier key, or planted: _open_dir refuses anything but a real directory
            nxt = _open_dir(cur, seg, where)
            os.close(cur)
            cur = nxt
            where = where / seg
        return cur
    except BaseException:
        os.close(cur)
        raise


def _lay_out(in_fd: int, in_dir: Path, key: str, planned: _Planned) -> Path:
    """Hard links to the (read-only) raw objects of one input under ``in/<key>``; the path ``fn`` gets."""
    segs = tuple(key.split("/"))
    if planned.files and not planned.files[0][0]:  # an object: the input itself is the file in/<key>
        dfd = _make_dirs(in_fd, segs[:-1], in_dir)
        try:
            _link(planned.files[0][1], segs[-1], dfd, in_dir / key)
        finally:
            os.close(dfd)
        return in_dir / key
    base_fd = _make_dirs(in_fd, segs, in_dir)  # exists even for an empty manifest
    try:
        for fsegs, src in planned.files:
            dfd = _make_dirs(base_fd, fsegs[:-1], in_dir / key)
            try:
                _link(src, fsegs[-1], dfd, in_dir / key / "/".join(fsegs))
            finally:
                os.close(dfd)
    finally:
        os.close(base_fd)
    if planned.single:
        return in_dir / key / "/".join(planned.files[0][0])
    return in_dir / key


def _link(src: Path, leaf: str, dir_fd: int, shown: Path) -> None:
    """Hard-link ``src`` as ``leaf`` in ``dir_fd`` (symlink where hard links are refused); never over an entry."""
    try:
        # follow_symlinks=False: if the object file was swapped for a link since raw_path checked it,
        # the link itself is linked (and refused below), not its target.
        os.link(src, leaf, dst_dir_fd=dir_fd, follow_symlinks=False)
    except FileExistsError:
        raise StoreFormatError(f"derive work directory: {shown} exists already (a planted entry, or a "
                               "duplicate manifest key); nothing was followed") from None
    except OSError as e:
        # EPERM: protected_hardlinks and another user's object in a shared store; EXDEV/EMLINK/EOPNOTSUPP:
        # no hard link possible here.  A symbolic link to the object is the read-only view instead.
        if e.errno not in (errno.EPERM, errno.EACCES, errno.EXDEV, errno.EMLINK, errno.EOPNOTSUPP):
            raise
        try:
            os.symlink(src, leaf, dir_fd=dir_fd)
        except FileExistsError:
            raise StoreFormatError(f"derive work directory: {shown} exists already; nothing was followed") from None
        return
    st = os.stat(leaf, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise StoreFormatError(f"object file {src} is not a regular file (replaced by a link?); "
                               "run `casstore verify --repair`")


def _dir_id(p: Path) -> Tuple[int, int, str]:
    """(device, inode, what it is) of ``p`` itself, never what a link there points to."""
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return (-1, -1, "gone")
    if stat.S_ISDIR(st.st_mode):
        return (st.st_dev, st.st_ino, "a directory")
    return (st.st_dev, st.st_ino, "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory")


def _collect(store: Store, name: str, out_dir: Path, compress: CompressArg) -> Dict[str, Entry]:
    """Every regular file under ``out_dir`` stored as an object: relative path -> Entry."""
    outputs: Dict[str, Entry] = {}
    raw = store.objects.level_for(compress) is None
    for dirpath, dirs, files in os.walk(out_dir):
        for f in sorted(dirs) + sorted(files):
            p = Path(dirpath) / f
            rel = p.relative_to(out_dir).as_posix()
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInputError(
                    f"derive {name!r}: output {rel!r} is not a regular file (a symbolic link, FIFO or device); "
                    "write real files under the output directory"
                )
            key = validate_key(rel, "output path")
            # Hazard (found by a bug hunt): an output hard-linked to a file outside the store (`os.link`
            # as a no-copy pass-through) was adopted: the user's own file became the object (mode 0444),
            # and a later edit of it corrupted the recorded result.  A file with another name is copied.
            if raw and st.st_nlink == 1:
                # Moved, not copied: the work directory is in the store's tmp/, so a rename (one hash,
                # one fsync) makes the object.  fn is done with the file (it returned).
                d = store.objects.adopt(p)
                outputs[key] = Entry(d, st.st_size, {})
            else:  # a compressed store encodes: that is a copy whatever we do
                d = store.objects.put_path(p, compress=compress)
                outputs[key] = Entry(d, store.objects.stat(d).size, {})
    return outputs
