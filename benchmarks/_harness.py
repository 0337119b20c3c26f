"""Shared machinery for the casstore benchmarks: interleaved timing, rows, the table.

Rules every benchmark follows (the machines we run on are small, shared and noisy):

* casstore and its reference run in the *same* process and the *same* run,
  interleaved round by round (ref, cas, ref, cas ...; with three cases the
  order rotates each round so no case always runs right after another);
* the first round is a warm-up and is thrown away; results are the *median*
  of the remaining rounds (min and max go to the JSON file);
* setup and teardown (deleting the object so dedupe cannot short-circuit the
  next put, dropping a 1 GiB result) are never timed;
* files live on the real disk (a temp dir; see :func:`bench_dir`), never tmpfs.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

MB = 1_000_000  # throughput is reported in MB/s (10**6 bytes per second)
MiB = 1 << 20
GiB = 1 << 30

TMP_ENV = "CASSTORE_BENCH_TMP"


def log(msg: str) -> None:
    """Progress goes to stderr so stdout carries only the table."""
    print(f"  [bench] {msg}", file=sys.stderr, flush=True)


# -- rows -----------------------------------------------------------------


@dataclass
class Row:
    """One line of the results table.

    ``casstore`` and ``reference`` are numbers in ``unit``.  ``ratio`` is
    oriented so that higher is better for casstore (a throughput ratio, or
    time_ref / time_cas).  ``target`` is a human-readable goal and ``met``
    whether it was reached (``None``: informational row without a target).
    """

    operation: str
    casstore: Optional[float]
    reference: Optional[float]
    unit: str
    ratio: Optional[float] = None
    target: str = ""
    met: Optional[bool] = None
    group: str = ""
    details: Dict[str, Any] = field(default_factory=dict)


def ratio_row(operation: str, cas: float, ref: float, unit: str, *, min_ratio: Optional[float] = None,
              details: Optional[Dict[str, Any]] = None) -> Row:
    """A row comparing two higher-is-better numbers (throughput, ops/s)."""
    ratio = cas / ref if ref else None
    met = None if min_ratio is None or ratio is None else ratio >= min_ratio
    target = "" if min_ratio is None else f">= {min_ratio:g}x"
    return Row(operation, cas, ref, unit, ratio, target, met, details=details or {})


def limit_row(operation: str, value: float, unit: str, *, max_value: float, reference: Optional[float] = None,
              details: Optional[Dict[str, Any]] = None) -> Row:
    """A row with an absolute lower-is-better bound (peak memory)."""
    return Row(operation, value, reference, unit, None, f"<= {max_value:g} {unit}", value <= max_value,
               details=details or {})


# -- timing ---------------------------------------------------------------


@dataclass
class Case:
    """One contender in an interleaved comparison.

    ``run(round_index)`` is the timed work.  It returns ``None`` (the harness
    times the whole call as phase ``"total"``) or a dict of phase -> seconds
    it timed itself (e.g. ``{"put": ..., "get": ...}``).  ``setup`` and
    ``teardown`` run untimed before and after every call.
    """

    name: str
    run: Callable[[int], Optional[Dict[str, float]]]
    setup: Optional[Callable[[int], None]] = None
    teardown: Optional[Callable[[int], None]] = None


Samples = Dict[str, Dict[str, List[float]]]  # case -> phase -> seconds per measured round


def interleave(cases: Sequence[Case], reps: int, warmup: int = 1) -> Samples:
    """Run ``warmup + reps`` rounds; each round runs every case once, order rotating.

    Round ``r`` runs ``cases[r % n:] + cases[:r % n]``, so with two cases the
    order alternates ref/cas, cas/ref.  GC is collected before and disabled
    during each timed call.  Warm-up rounds are not recorded.
    """
    out: Samples = {c.name: {} for c in cases}
    n = len(cases)
    for r in range(warmup + reps):
        k = r % n
        for case in list(cases[k:]) + list(cases[:k]):
            if case.setup is not None:
                case.setup(r)
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                phases = case.run(r)
                dt = time.perf_counter() - t0
            finally:
                gc.enable()
            if case.teardown is not None:
                case.teardown(r)
            if r < warmup:
                continue
            for phase, secs in (phases if phases is not None else {"total": dt}).items():
                out[case.name].setdefault(phase, []).append(secs)
    return out


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def summary(xs: Sequence[float]) -> Dict[str, Any]:
    """What goes to the JSON file for one list of timings."""
    return {"median_s": median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs),
            "samples_s": [round(x, 6) for x in xs]}


def rate(amount: float, seconds: Sequence[float]) -> float:
    """``amount`` per second at the median of ``seconds``."""
    return amount / median(seconds)


# -- files ----------------------------------------------------------------


def bench_root() -> Path:
    """Parent of benchmark temp dirs: $CASSTORE_BENCH_TMP or the system temp dir.

    Must be a real disk (not tmpfs): fsync and page-cache behaviour are part
    of what is measured.
    """
    root = Path(os.environ.get(TMP_ENV) or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return root


def rmtree(path: Path) -> None:
    """Remove a tree that may hold read-only (0o444) objects and dirs."""
    def onexc(fn: Any, p: str, exc: Any) -> None:
        os.chmod(os.path.dirname(p) or ".", 0o755)
        fn(p)

    if path.exists():
        shutil.rmtree(path, onerror=onexc)  # onexc= is 3.12+; onerror= still works


@contextmanager
def bench_dir(tag: str) -> Iterator[Path]:
    """A fresh temp dir on the real disk, removed afterwards (even on error)."""
    d = Path(tempfile.mkdtemp(prefix=f"casstore-bench-{tag}-", dir=bench_root()))
    try:
        yield d
    finally:
        rmtree(d)


def write_random_file(path: Path, size: int, *, chunk: int = 64 * MiB, seed: int = 0) -> None:
    """Write ``size`` incompressible bytes, fsync them (so no dirty pages leak into timings)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(rng.bytes(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def fsync_path(path: os.PathLike[str] | str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def delete_objects(store_root: Path) -> int:
    """Unlink every object file under ``<store>/objects`` (fan-out dirs are kept).

    Objects are 0o444 files, but unlink only needs a writable directory.
    Keeping the 256 fan-out directories measures a store in steady state.
    """
    n = 0
    objdir = store_root / "objects"
    for fan in os.scandir(objdir):
        if fan.is_dir():
            for ent in os.scandir(fan.path):
                os.unlink(ent.path)
                n += 1
    return n


def peak_rss_subprocess(code: str, *args: str, timeout: float = 600) -> tuple[float, float, str]:
    """Run ``code`` in a fresh interpreter; return (its peak RSS in MiB, its ru_maxrss in MiB, its stdout).

    The peak is ``VmHWM`` from ``/proc/self/status``: the high-water RSS of the
    child's own address space.  ``getrusage(RUSAGE_SELF).ru_maxrss`` is
    returned too but is *not* used: Linux carries the pre-exec address space's
    high-water mark across ``execve`` (and subprocess spawns with vfork, whose
    pre-exec address space is this parent's), so ru_maxrss in the child is at
    least this benchmark process's own peak RSS.  The child must not print
    lines starting with ``MAXRSS``/``VMHWM``.
    """
    script = code + (
        "\nimport resource as _r\n"
        "print('MAXRSS', _r.getrusage(_r.RUSAGE_SELF).ru_maxrss)\n"
        "print('VMHWM', next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n"
    )
    # cwd: with ``-c`` the child puts its cwd first on sys.path; run it outside the repo so it imports
    # the same casstore as this process (the installed one, or the one PYTHONPATH points at).
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=bench_root())
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        last = (r.stderr.strip().splitlines() or ["no stderr"])[-1]
        raise RuntimeError(f"benchmark subprocess exited {r.returncode}: {last}")
    lines = r.stdout.splitlines()

    def kib(tag: str) -> int:
        return int(next(x for x in reversed(lines) if x.startswith(tag + " ")).split()[1])

    rest = "\n".join(x for x in lines if not x.startswith(("MAXRSS ", "VMHWM ")))
    return kib("VMHWM") / 1024, kib("MAXRSS") / 1024, rest


# -- output ---------------------------------------------------------------


def _fmt(v: Optional[float], unit: str) -> str:
    if v is None:
        return "-"
    if unit == "MiB":
        return f"{v:,.1f} MiB"
    return f"{v:,.0f} {unit}" if abs(v) >= 100 else f"{v:,.2f} {unit}"


def format_table(rows: Sequence[Row]) -> str:
    header = ["operation", "casstore", "reference", "ratio", "target", "met?"]
    body = []
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        body.append([
            r.operation,
            _fmt(r.casstore, r.unit),
            _fmt(r.reference, r.unit),
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            r.target or "(info)",
            met,
        ])
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]
    right = {1, 2, 3}

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(b) for b in body)])


def rows_to_json(rows: Sequence[Row]) -> List[Dict[str, Any]]:
    return [asdict(r) for r in rows]


def failure_label(name: str, exc: BaseException) -> str:
    """A one-line table label for a benchmark that raised (the traceback went to stderr)."""
    msg = " ".join(str(exc).split())
    return f"{name}: FAILED ({type(exc).__name__}: {msg})"[:110]


def run_scenarios(scenarios: Sequence[Callable[[bool], List[Row]]], quick: bool) -> List[Row]:
    """Run each scenario; one that raises becomes a failed row instead of killing the run."""
    import traceback

    rows: List[Row] = []
    for fn in scenarios:
        name = fn.__name__.removeprefix("bench_")
        log(f"{name} ...")
        t0 = time.perf_counter()
        try:
            rows.extend(fn(quick))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            rows.append(Row(failure_label(name, e), None, None, "", target="runs", met=False))
        log(f"{name} done in {time.perf_counter() - t0:.1f} s")
    return rows
