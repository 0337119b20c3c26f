"""HDF5 adapter: open stored ``.h5`` objects read-only with h5py.

HDF5's own file locking exists to stop a writer and readers from meeting in
one mutable file.  A casstore object never changes (mode 0o444, replaced only
by a rename that readers never see half of), so that hazard cannot occur and
the lock only causes harm: h5py aborts with "unable to lock file" when
another process holds the same file open in a conflicting mode, and on some
network filesystems locking is not supported at all.  We therefore open
objects with ``locking=False``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..digest import Digest
from ..errors import StoreFormatError

if TYPE_CHECKING:
    from ..store import Store

__all__ = ["open_hdf5"]


def open_hdf5(store: Store, digest: Any, *, verify: bool = True, rdcc_nbytes: Any = None) -> Any:
    """Return a read-only ``h5py.File`` on the object ``digest``.

    Any number of processes may hold the same object open at once.  A
    compressed object is first materialized once as a raw copy under the same
    digest (so later opens are free).  Extra keyword arguments go to
    ``h5py.File`` (``mode`` and ``locking`` are fixed).
    """
    import h5py

    d = Digest.coerce(digest)
    path = store.raw_path(d, verify=verify)
    try:
        kw = {} if rdcc_nbytes is None else {"rdcc_nbytes": rdcc_nbytes}
        return h5py.File(path, "r", locking=False, **kw)
    except OSError as e:
        raise StoreFormatError(f"object {d} is not an HDF5 file h5py can open ({e})") from None
