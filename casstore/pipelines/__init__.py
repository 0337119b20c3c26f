"""TRANSITIONAL shim (replaced by the pipelines package)."""
from ..fetch import derive, fetch  # noqa: F401
