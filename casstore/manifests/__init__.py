"""TRANSITIONAL shim (replaced by the manifests package)."""
from ..manifest import *  # noqa: F401,F403
from ..manifest import EditTransaction, checkout, diff, freeze, history, pin, read_manifest, unpin  # noqa: F401
