"""``python -m casstore``: the same as the ``casstore`` console script."""

from __future__ import annotations

from .cli import entry

if __name__ == "__main__":
    entry()
