"""One fault-injection hook for crash tests (SIGKILL at a named point).

Tests set :data:`hook` in a child process to a callable that kills or raises
when :func:`fault` is called with a chosen point; production code calls
``fault("module.point")`` at the steps where a crash matters.  With no hook
set, a call costs one global lookup.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["hook", "fault"]

hook: Optional[Callable[[str], None]] = None
"""Called with the point name at every :func:`fault`; ``None`` in production."""


def fault(point: str) -> None:
    """Give an installed test hook the chance to crash here (``point``: ``"module.step"``)."""
    h = hook
    if h is not None:
        h(point)
