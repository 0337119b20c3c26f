"""TRANSITIONAL shim."""
from ..verify import VerifyReport, verify  # noqa: F401
