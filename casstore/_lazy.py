"""Package attributes imported on first use (PEP 562), so a CLI command pays only for what it runs.

Hazard: ``import casstore`` imported every feature (remotes, gc, the index
cache, the S3 transport) and their standard-library neighbours: ~60 ms of a
0.15 s ``casstore status``.  A package lists ``name -> (module, attribute)``
and gets a module ``__getattr__`` and ``__dir__``; type checkers still see the
names through the package's ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, MutableMapping, Tuple

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, namespace: MutableMapping[str, object], table: Dict[str, Tuple[str, str]]
                    ) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose module dict is ``namespace``.

    ``table``: attribute -> (module relative to ``package``, name in that module).  The first
    access imports the module and keeps the value in ``namespace`` (later accesses are plain).
    """

    def getattr_(name: str) -> object:
        try:
            module, attr = table[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(module, package), attr)
        namespace[name] = value
        return value

    def dir_() -> List[str]:
        return sorted(set(namespace) | set(table))

    return getattr_, dir_
