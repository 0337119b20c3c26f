"""TRANSITIONAL shim."""
from ..h5 import open_hdf5  # noqa: F401
