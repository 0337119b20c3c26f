"""TRANSITIONAL shim (replaced by the sync package)."""
from ..remote import Remote, TransferReport, fetch_object, pull, push  # noqa: F401
