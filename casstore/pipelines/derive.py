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
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Tuple, Union

import msgpack

from .._faults import fault
from .._fs import process_token
from ..codecs import CompressArg
from ..digest import Digest, new_hasher
from ..errors import InvalidInputError, InvalidTypeError, ObjectNotFoundError, StoreFormatError
from ..manifests import Entry, Manifest, canonical_meta, load_manifest, validate_key
from ..refs import validate_name
from .common import check_flag, lock_seconds, refuse_pinned, write_head

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["derive", "derive_key", "DeriveFn", "DeriveInput", "InputKey"]

DeriveFn = Callable[[Dict[str, Path], Path], object]
"""``fn(inputs, out)``: ``inputs`` maps input names to read-only paths; write outputs under ``out``."""
DeriveInput = Union[Digest, str, Manifest]
"""An input: an object digest (or its string form) or a Manifest (an earlier fetch/derive result)."""
InputKey = Tuple[str, Digest]
"""An input as the memo key sees it: ``("object", digest)`` or ``("manifest", version digest)``."""

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


def derive(store: Store, name: str, *, inputs: Mapping[str, DeriveInput], fn: DeriveFn,
           params: Optional[Mapping[str, object]] = None, version: object = None,
           regenerate: Optional[bool] = None, timeout: Optional[float] = None,
           compress: CompressArg = None) -> Manifest:
    """Run ``fn(inputs, out)`` once for this (name, inputs, params, version); return its outputs.

    ``inputs`` maps names to object digests or Manifests (earlier results);
    ``fn`` receives read-only paths (a Manifest with one file is passed as that
    file's path, with several as a directory of them) and an empty output
    directory; every regular file it writes there becomes an output.  The
    result is the head ``name``: a Manifest of relative path -> Entry whose
    ``meta["derive"]`` records the key, inputs, params, version, start time and
    duration.  Same key -> the stored result, no work; ``regenerate=True``
    forces a rerun.  Concurrent callers with the same name wait (logging every
    ~10 s, at most ``timeout`` seconds, default the setting ``lock_timeout``)
    and then get the same result; if the producer dies, a waiter runs ``fn``
    instead.  ``fn`` runs holding the name's lock: it must not edit ``name``
    itself.  A manifest input whose keys are not safe relative paths is a
    :class:`StoreFormatError` before anything is created.
    """
    from ..settings import current

    name = validate_name(name)
    if not callable(fn):
        raise InvalidTypeError(f"derive fn must be callable, not {type(fn).__name__}")
    params = {} if params is None else params
    if not isinstance(params, Mapping) or not isinstance(inputs, Mapping):
        raise InvalidTypeError("derive inputs and params must be mappings")
    regenerate = check_flag(regenerate, "regenerate")
    # Input names become paths under the work dir (a several-file Manifest is a directory named
    # after its input): they must be normalized relative paths, never '..' or absolute.
    keyed = {validate_key(k, "derive input name"): _input_key(v, k) for k, v in inputs.items()}
    key = derive_key(name, keyed, params, version)
    cfg = current()
    regenerate = cfg.regenerate if regenerate is None else regenerate
    lock_timeout = lock_seconds(timeout, cfg.lock_timeout, "timeout")
    if not regenerate:
        hit = _derive_hit(store, name, key)
        if hit is not None:
            return hit
    with store.refs.lock(name, timeout=lock_timeout, what=f"derive {name!r} (key {key[:12]})"):
        if not regenerate:
            hit = _derive_hit(store, name, key)
            if hit is not None:
                return hit
        refuse_pinned(store, name, f"derive {name!r}")
        return _run_derive(store, name, key, keyed, params, version, fn, compress, lock_timeout)


def _derive_hit(store: Store, name: str, key: str) -> Optional[Manifest]:
    if store.refs.get("heads", name) is None and store.refs.get("pins", name) is None:
        return None
    try:
        man = store.manifest(name)
    except ObjectNotFoundError:  # removed meanwhile
        return None
    rec = man.meta.get("derive")
    if isinstance(rec, Mapping) and rec.get("key") == key and all(store.objects.has(e.digest) for e in man.values()):
        return man
    return None


@dataclass(frozen=True, slots=True)
class _Planned:
    """How one input reaches ``fn``: an existing path, or a directory of ``files`` to lay out."""

    path: Optional[Path]
    files: Tuple[Tuple[Tuple[str, ...], Path], ...] = ()


def _plan(store: Store, keyed: Mapping[str, InputKey]) -> Dict[str, _Planned]:
    """Resolve every input before anything is created: objects exist, manifests decode (keys validated)."""
    plan: Dict[str, _Planned] = {}
    for k, (kind, d) in keyed.items():
        if kind == "object":
            plan[k] = _Planned(store.objects.raw_path(d))
            continue
        # Re-read by digest through THE decoder, which validates every key (StoreFormatError): the
        # caller's Manifest object is no evidence of what the digest holds, and the memo key names the digest.
        entries = load_manifest(store.objects, d).entries
        if len(entries) == 1:
            plan[k] = _Planned(store.objects.raw_path(next(iter(entries.values())).digest))
            continue
        files = tuple((tuple(rel.split("/")), store.objects.raw_path(e.digest)) for rel, e in entries.items())
        plan[k] = _Planned(None, files)
    return plan


def _run_derive(store: Store, name: str, key: str, keyed: Mapping[str, InputKey], params: Mapping[str, object],
                version: object, fn: DeriveFn, compress: CompressArg, timeout: Optional[float]) -> Manifest:
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
                paths = {k: p.path if p.path is not None else _lay_out(in_fd, work / "in", k, p.files)
                         for k, p in plan.items()}
            finally:
                os.close(in_fd)
        finally:
            os.close(wfd)
        out_dir = work / "out"
        started = time.time()
        t0 = time.monotonic()
        fn(dict(paths), out_dir)
        seconds = time.monotonic() - t0
        outputs = _collect(store, name, out_dir, compress)
        record = {
            "key": key,
            "inputs": {k: str(d) for k, (_kind, d) in keyed.items()},
            "params": canonical_meta(dict(params), "params"),
            "version": version,
            "started": started,
            "seconds": round(seconds, 6),
            "fn": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}",
        }
        meta = _previous_meta(store, name)
        meta["derive"] = record
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


def _lay_out(in_fd: int, in_dir: Path, key: str, files: Tuple[Tuple[Tuple[str, ...], Path], ...]) -> Path:
    """A directory ``in/<key>`` of links to the (read-only) raw objects of a several-file manifest."""
    base_fd = _make_dirs(in_fd, tuple(key.split("/")), in_dir)  # exists even for an empty manifest
    try:
        for segs, src in files:
            dfd = _make_dirs(base_fd, segs[:-1], in_dir / key)
            try:
                _link(src, segs[-1], dfd, in_dir / key / "/".join(segs))
            finally:
                os.close(dfd)
    finally:
        os.close(base_fd)
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


def _collect(store: Store, name: str, out_dir: Path, compress: CompressArg) -> Dict[str, Entry]:
    """Every regular file under ``out_dir`` stored as an object: relative path -> Entry."""
    outputs: Dict[str, Entry] = {}
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
            d = store.objects.put_path(p, compress=compress)
            outputs[key] = Entry(d, store.objects.stat(d).size, {})
    return outputs
