"""TRANSITIONAL shim."""
from ..arrays import get_array, get_arrays, put_array, put_arrays  # noqa: F401
