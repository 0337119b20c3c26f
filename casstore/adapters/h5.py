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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from ..digest import Digest
from ..errors import InvalidInputError, InvalidTypeError, StoreFormatError

if TYPE_CHECKING:
    import h5py

    from ..store import Store

__all__ = ["open_hdf5"]


def open_hdf5(store: Store, digest: Union[Digest, str], *, verify: bool = True,
              rdcc_nbytes: int | None = None) -> h5py.File:
    """Return a read-only ``h5py.File`` on the object ``digest``.

    Any number of processes may hold the same object open at once.  A
    compressed object is first materialized once as a raw copy under the same
    digest (so later opens are free; materializing always verifies).  With
    ``verify=True`` the object is hashed before h5py reads it
    (:class:`~casstore.errors.IntegrityError` if it was damaged);
    ``verify=False`` hands h5py unverified bytes.  ``rdcc_nbytes`` sets h5py's
    raw data chunk cache size.
    """
    import h5py

    d = Digest.coerce(digest)
    if rdcc_nbytes is not None and (isinstance(rdcc_nbytes, bool) or not isinstance(rdcc_nbytes, int)):
        raise InvalidTypeError(f"rdcc_nbytes must be an int or None, not {type(rdcc_nbytes).__name__}")
    if rdcc_nbytes is not None and rdcc_nbytes < 0:
        raise InvalidInputError(f"rdcc_nbytes must be >= 0, not {rdcc_nbytes}")
    path = store.objects.raw_path(d)
    if verify:
        store.objects.verify_file(d)
    try:
        if rdcc_nbytes is None:
            return h5py.File(path, "r", locking=False)
        return h5py.File(path, "r", locking=False, rdcc_nbytes=rdcc_nbytes)
    except OSError as e:
        raise StoreFormatError(f"object {d} is not an HDF5 file h5py can open ({e})") from None
