"""A tiny progress bar for long work (put, get, add, checkout, verify, gc, push, pull): stderr, terminals only.

No dependency: one line redrawn with ``\\r`` at most every ``interval`` seconds.
It is enabled automatically when stderr is a terminal and stays silent when
output is piped or redirected (so ``--json`` output and logs stay clean).

The ETA is an estimate only once it means something.  Hazards it avoids: at
the start the rate is 0 (an ETA of "0s", the old bug) or measured over a few
milliseconds of open and page-cache hits (an ETA of "0s" for a 100 GB job, or
of days when the first byte waits on a server).  So no ETA is shown ("ETA --")
until :data:`ETA_MIN_SECONDS` have passed and some work is done, and an
estimate beyond :data:`ETA_MAX_SECONDS` reads ``>99h`` instead of a number of
days nobody can act on.  A finished bar shows the time taken instead.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Callable, Optional, TextIO, Type

__all__ = ["Progress", "human_bytes", "human_age"]

_BAR = 24
ETA_MIN_SECONDS = 1.0
"""No ETA before this much time has passed (rates over less are startup noise)."""
ETA_MIN_FRACTION = 0.01
"""... nor before this fraction of the total is done, unless :data:`ETA_PATIENCE` seconds have passed."""
ETA_PATIENCE = 5.0
"""After this long an ETA is shown whatever the fraction done (a slow start still gets an estimate)."""
ETA_MAX_SECONDS = 99 * 3600
"""Longer estimates read ``>99h``."""


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_age(seconds: float) -> str:
    """``42`` -> ``"42s"``, ``720`` -> ``"12m"``, then hours and days: an age or a period in gc's messages."""
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"


def _eta(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress:
    """``with Progress(total, desc="verify") as p: p.update(n)``.

    ``unit="B"`` shows byte counts and rates in binary units; any other unit is
    shown as a plain count.  ``enabled=None`` means "only if the stream is a
    terminal".  ``total=None`` shows a count without a bar.  The ETA reads ``--`` until it is
    sound (see the module docstring); a finished bar shows the time taken.
    """

    def __init__(self, total: Optional[int], *, desc: str, unit: str = "B", enabled: Optional[bool] = None,
                 stream: Optional[TextIO] = None, interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream: TextIO = stream if stream is not None else sys.stderr
        if enabled is None:
            try:
                enabled = self.stream.isatty()
            except (AttributeError, ValueError):
                enabled = False
        self.enabled = enabled
        self.total = total
        self.desc = desc
        self.unit = unit
        self.done = 0
        self.interval = interval
        self.clock = clock
        """Seconds from an arbitrary start (``time.monotonic``; tests give their own to check the ETA)."""
        self._t0 = clock()
        self._last = self._t0 - interval  # the first update draws at once
        self._width = 0

    def _fmt(self, n: float) -> str:
        return human_bytes(n) if self.unit == "B" else f"{n:,.0f}"

    def eta(self) -> str:
        """The remaining time as shown: ``"--"`` until an estimate is sound, ``">99h"`` past the cap."""
        elapsed = self.clock() - self._t0
        if not self.total or self.done <= 0 or elapsed < ETA_MIN_SECONDS:
            return "--"
        if self.done < self.total * ETA_MIN_FRACTION and elapsed < ETA_PATIENCE:
            return "--"
        left = (self.total - self.done) * elapsed / self.done  # the average rate so far: steady, no jumps
        return ">99h" if left > ETA_MAX_SECONDS else _eta(left)

    def line(self) -> str:
        """The current progress line (without the leading carriage return)."""
        elapsed = max(self.clock() - self._t0, 1e-9)
        rate = self.done / elapsed
        rate_s = f"{self._fmt(rate)}/s" if self.unit == "B" else f"{rate:,.0f} {self.unit}/s"
        if self.total:
            frac = min(1.0, self.done / self.total)
            fill = int(frac * _BAR)
            bar = "#" * fill + "-" * (_BAR - fill)
            tail = f"in {_eta(elapsed)}" if self.done >= self.total else f"ETA {self.eta()}"
            return (f"{self.desc}: {frac * 100:5.1f}% [{bar}] {self._fmt(self.done)}/{self._fmt(self.total)}"
                    f" {rate_s} {tail}")
        return f"{self.desc}: {self._fmt(self.done)} {rate_s}"

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units; redraws at most every ``interval`` seconds."""
        self.done += n
        if not self.enabled:
            return
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            self._draw()

    def _draw(self) -> None:
        text = self.line()
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line (no-op when disabled)."""
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()
