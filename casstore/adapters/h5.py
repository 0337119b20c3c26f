"""HDF5 adapter: open stored ``.h5`` objects read-only with h5py.

HDF5's own file locking exists to stop a writer and readers from meeting in
one mutable file.  A casstore object never changes (mode 0o444, replaced only
by a rename that readers never see half of), so that hazard cannot occur and
the lock only causes harm: h5py aborts with "unable to lock file" when
another process holds the same file open in a conflicting mode, and on some
network filesystems locking is not supported at all.  We therefore open
objects with ``locking=False``.

Hazards (issue 11): h5py trusts the bytes it reads and reads them lazily,
long after the open, so the object is verified **before** h5py sees it
(``verify=True``, the default; the object layer remembers a verified file
while it is unchanged, so later opens in the process cost nothing).  The
path is handed out by the object layer, which opens it with ``O_NOFOLLOW |
O_NONBLOCK`` and requires a regular file: a planted FIFO, device or link is
an :class:`~casstore.errors.IntegrityError` at once.  (h5py then opens the
path by name; an entry swapped in during the microseconds in between is
beyond what a path-based library allows us to close.)

Hazard (docs/security.md, classes 2 and 4): a verified HDF5 file can still
point *outside* the store, and h5py follows it on read: a dataset with
external raw storage (``create_dataset(..., external=[("/etc/passwd", 0, 64)])``)
reads another file's bytes, an external link opens another HDF5 file, a
virtual dataset reads its source files.  The hash covers only the pointer, not
what it points at, and a FIFO as the target blocks the read forever.  HDF5's
access-property prefixes (``set_efile_prefix``, ``set_virtual_prefix``,
``set_elink_prefix``) are no defence: an absolute name is opened as it is,
and a relative one is also looked up beside the file and in the current
directory (checked with h5py 3.16 / HDF5 2.0).  So ``open_hdf5`` walks the
file's links and datasets, and the objects its references point at, before handing
it out (:func:`_refuse_outside`) and refuses any of these with a
:class:`~casstore.errors.StoreFormatError`.  The walk reads metadata and
references only (never a target's data) and costs ~30 us per dataset plus ~10 us
per attribute (its type is checked for references): 0.5-0.8 s for 10,000
datasets with two attributes each, against 0.27 s before references were
followed.  A verified object that passed is remembered while the file h5py
opened is unchanged, so later opens in the process skip it.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Optional, Tuple, Union

from ..digest import Digest
from ..errors import InvalidInputError, InvalidTypeError, StoreFormatError

if TYPE_CHECKING:
    import h5py

    from ..store import Store

__all__ = ["open_hdf5"]

# Verified objects whose walk found nothing outside the file, keyed by the digest and the
# identity of the file h5py opened (device, inode, size, mtime_ns, ctime_ns): a file swapped
# in after the verify has another inode, so it is walked.  Only verified opens are kept
# (the bytes are then the digest's, so the walk's answer is too).  Bounded: cleared when full.
_WalkKey = Tuple[Digest, int, int, int, int, int]
_WALKED: set[_WalkKey] = set()
_WALKED_MAX = 65536
_WALKED_LOCK = threading.Lock()
_NAME_MAX = 200  # characters of a (hostile) name or target quoted in an error


def _quote(name: Union[bytes, str]) -> str:
    text = name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else name
    r = repr(text)
    return r if len(r) <= _NAME_MAX else r[:_NAME_MAX] + "..."


def _refuse_outside(f: h5py.File, d: Digest) -> None:
    """Raise StoreFormatError if anything in ``f`` makes h5py read a file other than ``f``.

    Links are listed with H5Lvisit, which reports external and user-defined links
    without following them (nor soft links); every object reached by a hard link is
    opened once (by its first name) and a dataset's creation properties are read: external
    raw storage or a virtual layout with a source other than ``"."`` (the same file)
    is refused.  Object references are followed too (:func:`_ref_targets`): an object
    no link names (its header's reference count raised by hand, then unlinked) is still
    read through a reference in a dataset or an attribute, and was a way around the walk.
    Only metadata and references are read: no target is opened, so a FIFO cannot hang it.
    """
    from h5py import h5d, h5g, h5l, h5o

    outside: list[str] = []
    seen: set[int] = set()  # object header addresses queued (each object is checked once)
    todo: list[tuple[h5py.h5o.ObjectID, bytes]] = []

    def visit_links(gid: h5py.h5g.GroupID, at: bytes) -> None:
        hard: dict[int, bytes] = {}

        def on_link(name: bytes, info: h5py.h5l.LinkInfo) -> Optional[bool]:
            if info.type == h5l.TYPE_HARD:
                hard.setdefault(info.u, name)
            elif info.type == h5l.TYPE_EXTERNAL:
                try:
                    filename, target = gid.links.get_val(name)
                    to = f" to {_quote(filename)}:{_quote(target)}"
                except Exception:  # the name is what matters; the target is a courtesy
                    to = ""
                outside.append(f"external link {_quote(at + name)}{to} (opens another file)")
                return True
            elif info.type != h5l.TYPE_SOFT:  # user-defined link class: HDF5 may resolve it anywhere
                outside.append(f"link {_quote(at + name)} of user-defined class {int(info.type)}")
                return True
            return None

        gid.links.visit(on_link, info=True)
        for addr, name in hard.items():
            if addr not in seen and not outside:
                seen.add(addr)
                todo.append((h5o.open(gid, name), at + name))

    try:
        root = f.id
        seen.add(h5o.get_info(root).addr)
        visit_links(root, b"/")
        todo.append((root, b"/"))
        while todo and not outside:
            oid, name = todo.pop()
            if isinstance(oid, h5d.DatasetID):
                dcpl = oid.get_create_plist()
                if dcpl.get_external_count() > 0:
                    ext = dcpl.get_external(0)[0]
                    outside.append(f"dataset {_quote(name)} with external raw storage in {_quote(ext)}")
                    break
                if dcpl.get_layout() == h5d.VIRTUAL:
                    sources = {dcpl.get_virtual_filename(i) for i in range(dcpl.get_virtual_count())}
                    sources.discard(".")  # "." is this very file: HDF5 opens nothing for it
                    if sources:
                        outside.append(f"virtual dataset {_quote(name)} with source file {_quote(min(sources))}")
                        break
            for target in _ref_targets(oid, f):
                addr = h5o.get_info(target).addr
                if addr in seen:
                    continue
                seen.add(addr)
                there = name + b" -> (referenced object)"
                if isinstance(target, h5g.GroupID):
                    visit_links(target, there + b"/")
                todo.append((target, there))
    except (OSError, KeyError, ValueError, RuntimeError, TypeError) as e:
        raise StoreFormatError(f"object {d}: its HDF5 metadata could not be listed ({e})") from None
    if outside:
        raise StoreFormatError(
            f"object {d} is an HDF5 file that reads outside the store: {outside[0]}; open_hdf5 refuses "
            "external links, external raw storage and virtual datasets with other source files "
            "(docs/security.md, class 2); copy the data itself into the file and put that instead")


_REF_STEP = 1 << 16  # references read per step from a dataset of them (bounded memory)


def _ref_targets(oid: h5py.h5o.ObjectID, f: h5py.File) -> list[h5py.h5o.ObjectID]:
    """The objects the references stored in ``oid`` (its data if a dataset, and its attributes) point at.

    HDF5 types are checked by class (a few us each; a numpy dtype costs 4x that): only data
    whose type can hold a reference is read.
    """
    import h5py  # (module attributes below, not `from h5py import ...`: ~1 us per call for 10,000s of calls)

    h5a, h5d, h5r = h5py.h5a, h5py.h5d, h5py.h5r
    values: list[tuple[object, object]] = []
    if isinstance(oid, h5d.DatasetID) and _type_has_refs(oid.get_type()):
        ds = h5py.Dataset(oid)
        if ds.ndim == 0 or ds.size == 0:
            values.append((ds.dtype, ds[()] if ds.size else None))
        else:
            step = max(1, _REF_STEP // max(1, ds.size // ds.shape[0]))
            for i in range(0, ds.shape[0], step):
                values.append((ds.dtype, ds[i:i + step]))
    for i in range(h5a.get_num_attrs(oid)):
        if _type_has_refs(h5a.open(oid, index=i).get_type()):
            attrs = h5py.AttributeManager(h5py.Group(oid) if isinstance(oid, h5py.h5g.GroupID) else
                                          h5py.Dataset(oid) if isinstance(oid, h5d.DatasetID) else
                                          h5py.Datatype(oid))
            for an in attrs:
                dt = attrs.get_id(an).dtype
                if _has_refs(dt):
                    values.append((dt, attrs[an]))
            break
    out: list[h5py.h5o.ObjectID] = []
    for dt, v in values:
        for ref in _refs_in(dt, v):
            if ref:  # a null reference points nowhere
                out.append(h5r.dereference(ref, f.id))
    return out


def _type_has_refs(tid: h5py.h5t.TypeID) -> bool:
    """Whether an HDF5 type is, or contains, a reference type."""
    import h5py

    h5t = h5py.h5t
    c = tid.get_class()
    if c == h5t.REFERENCE:
        return True
    if c == h5t.COMPOUND:
        assert isinstance(tid, h5t.TypeCompoundID)
        return any(_type_has_refs(tid.get_member_type(i)) for i in range(tid.get_nmembers()))
    if c in (h5t.ARRAY, h5t.VLEN):
        return _type_has_refs(tid.get_super())
    return False


def _has_refs(dt: object) -> bool:
    """Whether values of numpy dtype ``dt`` (as h5py maps HDF5 types) can hold object or region references."""
    import h5py
    import numpy as np

    if not isinstance(dt, np.dtype):
        return False
    if h5py.check_dtype(ref=dt) is not None:
        return True
    if dt.fields:
        return any(_has_refs(fdt[0]) for fdt in dt.fields.values())
    if dt.subdtype is not None:
        return _has_refs(dt.subdtype[0])
    base = h5py.check_dtype(vlen=dt)
    return base is not None and _has_refs(np.dtype(base) if not isinstance(base, np.dtype) else base)


def _refs_in(dt: object, value: object) -> list[object]:
    """Every reference in ``value`` (read with dtype ``dt``), flattened."""
    import h5py
    import numpy as np

    assert isinstance(dt, np.dtype)
    if value is None:
        return []
    if h5py.check_dtype(ref=dt) is not None:
        arr = np.asarray(value, dtype=object)
        return [r for r in arr.flat if isinstance(r, (h5py.Reference, h5py.RegionReference))]
    out: list[object] = []
    if dt.fields:
        arr = np.asarray(value)
        for fname, fdt in dt.fields.items():
            if _has_refs(fdt[0]):
                out += _refs_in(fdt[0], arr[fname])
        return out
    if dt.subdtype is not None:
        return _refs_in(dt.subdtype[0], value)
    base = h5py.check_dtype(vlen=dt)
    if base is not None:
        bdt = np.dtype(base)
        for item in np.asarray(value, dtype=object).flat:
            out += _refs_in(bdt, item)
    return out


def _walk_key(f: h5py.File, d: Digest) -> Optional[_WalkKey]:
    """The memo key of the file h5py has open (fstat of its own descriptor), or None if h5py gives none."""
    try:
        st = os.fstat(int(f.id.get_vfd_handle()))
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return (d, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def open_hdf5(store: Store, digest: Union[Digest, str], *, verify: Optional[bool] = True,
              rdcc_nbytes: int | None = None) -> h5py.File:
    """Return a read-only ``h5py.File`` on the object ``digest``.

    Any number of processes may hold the same object open at once.  A
    compressed object is first materialized once as a raw copy under the same
    digest (so later opens are free; materializing always verifies).  With
    ``verify=True`` the object is hashed before h5py reads it
    (:class:`~casstore.errors.IntegrityError` if it was damaged);
    ``verify=False`` hands h5py unverified bytes; ``None`` means the default
    (True), as for ``get_array``; anything but a bool or None is an
    :class:`~casstore.errors.InvalidTypeError`.  ``rdcc_nbytes`` sets h5py's
    raw data chunk cache size.

    A file that makes h5py read another file (an external link, external raw
    storage, a virtual dataset with other source files) is refused with
    :class:`~casstore.errors.StoreFormatError`, verified or not.
    """
    import h5py

    d = Digest.coerce(digest)
    # A bare ``if verify:`` made None, 0 and "" skip the hash silently (get_array takes None
    # as "the default"): only a real bool chooses, None is the default.
    if verify is None:
        verify = True
    elif not isinstance(verify, bool):
        raise InvalidTypeError(f"verify must be a bool or None, not {type(verify).__name__}")
    if rdcc_nbytes is not None and (isinstance(rdcc_nbytes, bool) or not isinstance(rdcc_nbytes, int)):
        raise InvalidTypeError(f"rdcc_nbytes must be an int or None, not {type(rdcc_nbytes).__name__}")
    if rdcc_nbytes is not None and rdcc_nbytes < 0:
        raise InvalidInputError(f"rdcc_nbytes must be >= 0, not {rdcc_nbytes}")
    path = store.objects.raw_path(d)
    if verify:
        store.objects.verify_file(d)
    try:
        if rdcc_nbytes is None:
            f = h5py.File(path, "r", locking=False)
        else:
            f = h5py.File(path, "r", locking=False, rdcc_nbytes=rdcc_nbytes)
    except OSError as e:
        raise StoreFormatError(f"object {d} is not an HDF5 file h5py can open ({e})") from None
    try:
        key = _walk_key(f, d) if verify else None
        if key is None or key not in _WALKED:
            _refuse_outside(f, d)
            if key is not None:
                with _WALKED_LOCK:
                    if len(_WALKED) >= _WALKED_MAX:
                        _WALKED.clear()
                    _WALKED.add(key)
    except BaseException:
        f.close()
        raise
    return f
