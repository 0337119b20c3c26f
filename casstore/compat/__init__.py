"""Drop-in replacements for other libraries' APIs, built on casstore's own types.

* :mod:`casstore.compat.pfio`: pfio's ``FileCache``, ``MultiprocessFileCache`` and
  ``ReadOnlyFileCache`` on :class:`casstore.IndexCache` (switch with one import line).

Nothing here is imported by ``import casstore``.
"""

__all__: list[str] = []
