"""Adapters: numpy arrays as ``.npy`` objects, HDF5 objects opened read-only with h5py.

Layer 4 (docs/design.md): built on the object layer (``store.objects``) and the
manifests model.  The facade imports this package lazily, so ``import casstore``
stays free of numpy; h5py is imported at the first ``open_hdf5`` call.
"""

from __future__ import annotations

from .arrays import get_array, get_arrays, put_array, put_arrays
from .h5 import open_hdf5

__all__ = ["put_array", "get_array", "put_arrays", "get_arrays", "open_hdf5"]
