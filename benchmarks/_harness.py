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
    limit: Optional[float] = None
    """The machine's limit for this figure, in ``unit`` (measured in the same interleave; see :func:`read_limit_s`)."""
    of_limit: Optional[float] = None
    """casstore's fraction of ``limit`` (higher is better; 1.0 = at the limit)."""


def ratio_row(operation: str, cas: float, ref: float, unit: str, *, min_ratio: Optional[float] = None,
              details: Optional[Dict[str, Any]] = None, limit: Optional[float] = None,
              min_of_limit: Optional[float] = None) -> Row:
    """A row comparing two higher-is-better numbers (throughput, ops/s).

    ``limit`` is the machine's limit in the same unit (e.g. the rate at
    :func:`read_limit_s`); the row then also shows casstore's fraction of it.
    The target is on the ratio (``min_ratio``), on the fraction of the limit
    (``min_of_limit``), or on both (both must hold).
    """
    ratio = cas / ref if ref else None
    of_limit = cas / limit if limit else None
    checks: List[Optional[bool]] = []
    targets: List[str] = []
    if min_ratio is not None:
        targets.append(f">= {min_ratio:g}x")
        checks.append(None if ratio is None else ratio >= min_ratio)
    if min_of_limit is not None:
        targets.append(f">= {min_of_limit:g}x limit")
        checks.append(None if of_limit is None else of_limit >= min_of_limit)
    met = None if not checks or any(c is None for c in checks) else all(checks)
    return Row(operation, cas, ref, unit, ratio, ", ".join(targets), met, details=details or {}, limit=limit,
               of_limit=of_limit)


def time_row(operation: str, cas_s: float, ref_s: float, unit: str = "ms", *, min_ratio: Optional[float] = None,
             details: Optional[Dict[str, Any]] = None) -> Row:
    """A row of two lower-is-better times (seconds in, shown in ``unit``: "ms" or "us"); ratio = ref / cas."""
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    ratio = ref_s / cas_s if cas_s else None
    met = None if min_ratio is None or ratio is None else ratio >= min_ratio
    target = "" if min_ratio is None else f">= {min_ratio:g}x"
    return Row(operation, cas_s * scale, ref_s * scale, unit, ratio, target, met, details=details or {})


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


def interleave(cases: Sequence[Case], reps: int, warmup: int = 1, *, usage: Optional[Samples] = None) -> Samples:
    """Run ``warmup + reps`` rounds; each round runs every case once, order rotating.

    Round ``r`` runs ``cases[r % n:] + cases[:r % n]``, so with two cases the
    order alternates ref/cas, cas/ref.  GC is collected before and disabled
    during each timed call.  Warm-up rounds are not recorded.

    ``usage``, if given, receives per case and measured round what the call
    cost this process (``getrusage``, all threads): ``cpu_s`` (user + system
    CPU seconds), ``minflt`` (page faults) and ``nivcsw`` (times a thread was
    preempted), plus the machine-wide :func:`vmstat` deltas.  CPU seconds above
    the wall time mean both cores worked; many preemptions mean other processes
    took a core meanwhile; compaction stalls mean fresh huge pages were costly.
    """
    import resource

    vm0: Dict[str, int] = {}
    out: Samples = {c.name: {} for c in cases}
    n = len(cases)
    for r in range(warmup + reps):
        k = r % n
        for case in list(cases[k:]) + list(cases[:k]):
            if case.setup is not None:
                case.setup(r)
            gc.collect()
            gc.disable()
            if usage is not None:
                vm0 = vmstat()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            try:
                t0 = time.perf_counter()
                phases = case.run(r)
                dt = time.perf_counter() - t0
            finally:
                gc.enable()
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            if case.teardown is not None:
                case.teardown(r)
            if r < warmup:
                continue
            for phase, secs in (phases if phases is not None else {"total": dt}).items():
                out[case.name].setdefault(phase, []).append(secs)
            if usage is not None:
                u = usage.setdefault(case.name, {})
                u.setdefault("cpu_s", []).append(round(ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime, 4))
                u.setdefault("minflt", []).append(ru1.ru_minflt - ru0.ru_minflt)
                u.setdefault("nivcsw", []).append(ru1.ru_nivcsw - ru0.ru_nivcsw)
                for key, count in vmstat().items():  # machine-wide: compaction stalls, huge-page faults
                    u.setdefault(key, []).append(count - vm0.get(key, count))
    return out


VMSTAT_KEYS = ("compact_stall", "thp_fault_alloc", "thp_fault_fallback", "pgscan_direct")


def vmstat() -> Dict[str, int]:
    """Machine-wide counters from ``/proc/vmstat`` that explain slow first touches of memory; ``{}`` elsewhere.

    ``compact_stall``: an allocation waited while the kernel compacted memory
    (huge pages asked for with ``MADV_HUGEPAGE`` on fragmented free memory);
    ``thp_fault_alloc``/``thp_fault_fallback``: huge pages given / refused at a
    fault; ``pgscan_direct``: pages an allocation had to reclaim itself;
    ``reported_kib`` (where the guest reports free pages to its host): free
    memory given back to the host, which costs a host fault when touched again.
    """
    out: Dict[str, int] = {}
    try:
        with open("/proc/vmstat") as f:
            out = {k: int(v) for k, v in (line.split() for line in f) if k in VMSTAT_KEYS}
    except OSError:
        pass
    try:  # free page reporting (virtio-balloon): KiB of free 2 MiB blocks handed back to the host so far
        with open(REPORTED_KIB) as f:
            out["reported_kib"] = int(f.read())
    except (OSError, ValueError):
        pass
    return out


REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def summary(xs: Sequence[float]) -> Dict[str, Any]:
    """What goes to the JSON file for one list of timings."""
    return {"median_s": median(xs), "min_s": min(xs), "max_s": max(xs), "n": len(xs),
            "samples_s": [round(x, 6) for x in xs]}


def rate(amount: float, seconds: Sequence[float]) -> float:
    """``amount`` per second at the median of ``seconds``."""
    return amount / median(seconds)


# -- the machine's limits (microbenchmarks run inside the same interleave) --------


def read_limit_s(t_read: float, t_hash_1core: float) -> float:
    """The fastest a verified read can be on this 2-core machine, in seconds.

    The plain read and one core's BLAKE3 of the same bytes, spread perfectly
    over both cores, and never faster than the plain read alone:
    ``max(t_read, (t_read + t_hash_1core) / 2)`` (issue 15).  Pass medians
    measured in the same interleave as the figure they bound.
    """
    return max(t_read, (t_read + t_hash_1core) / 2)


# The bytes a verified read hashes come from the page cache, i.e. from DRAM: a 1 GiB object or 200
# x 4 MiB of files do not fit in this machine's caches.  A hash pool that does fit overstates the
# machine: one core's BLAKE3 of 1 GiB took 146 ms from a 64 MiB pool (16 passes) against 165-181 ms
# from pools of 256 MiB to 1 GiB (2026-12-06 06:35 UTC, interleaved, medians of 7; the machine reports
# a 300 MiB L3).  An earlier measurement (5,029-5,096 MB/s from 64 MiB to 1 GiB, the same day at
# night) saw no difference while the memory ran at its slower speed; so the pool is as large as the
# largest read it bounds, and each hash walks it from DRAM as the page cache would be read.
HASH_POOL_BYTES = 1024 * MiB


class HashPool:
    """Incompressible bytes to hash "the same number of bytes" without holding a second copy of them.

    BLAKE3's speed does not depend on the values, only on the length, and the
    pool is too large for the caches (see :data:`HASH_POOL_BYTES`), so a hash of
    ``nbytes`` taken from the pool in turn runs like a hash of the page cache
    (DRAM), minus the page faults of mapping a file (those are a cost of the
    implementation, not of the machine).
    """

    def __init__(self, size: int = HASH_POOL_BYTES, seed: int = 7) -> None:
        import numpy as np

        self.buf = memoryview(np.random.default_rng(seed).bytes(size))

    def hash(self, nbytes: int, *, piece: int, threads: int = 1) -> None:
        """Hash ``nbytes`` as objects of ``piece`` bytes (a new hasher per piece), on ``threads`` threads.

        ``threads=0`` means blake3's AUTO (one per core).
        """
        import blake3

        mt = blake3.blake3.AUTO if threads == 0 else threads
        pool, size, off, left = self.buf, len(self.buf), 0, nbytes
        while left:
            n = min(piece, left)
            h = blake3.blake3(max_threads=mt)
            rest = n
            while rest:
                k = min(rest, size - off)
                h.update(pool[off:off + k])
                off = (off + k) % size
                rest -= k
            h.digest()
            left -= n

    def case(self, name: str, nbytes: int, *, piece: int, threads: int = 1) -> Case:
        """An interleave :class:`Case` hashing ``nbytes`` (see :meth:`hash`)."""
        def run(_r: int) -> None:
            self.hash(nbytes, piece=piece, threads=threads)

        return Case(name, run)


def readinto_case(name: str, paths: Sequence[Path], buf: bytearray) -> Case:
    """The plain read: each file ``readinto`` the preallocated ``buf`` (whole, or reused in buffer-sized steps)."""
    view = memoryview(buf)

    def run(_r: int) -> None:
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass

    return Case(name, run)


def write_case(name: str, payloads: Sequence[bytes | memoryview], out_dir: Path, *, durable: bool) -> Case:
    """The plain write: each payload to a new file in ``out_dir`` (+ fsync of the file and the dir if durable).

    The files are unlinked (untimed) after each round; ``os.sync()`` runs
    (untimed) before each round so earlier dirty pages are not flushed on this
    case's clock.
    """
    made: List[str] = []

    def setup(_r: int) -> None:
        os.sync()

    def run(r: int) -> None:
        dfd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, data in enumerate(payloads):
                path = os.path.join(out_dir, f"{name}-{r}-{i}")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    mv = memoryview(data).cast("B")
                    off = 0
                    while off < len(mv):
                        off += os.write(fd, mv[off:])
                    if durable:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                made.append(path)
                if durable:
                    os.fsync(dfd)
        finally:
            os.close(dfd)

    def teardown(_r: int) -> None:
        for p in made:
            os.unlink(p)
        made.clear()

    return Case(name, run, setup, teardown)


def malloc_trim() -> bool:
    """Return the C heap's free memory to the kernel (glibc ``malloc_trim(0)``); False where unavailable."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def pressure() -> Dict[str, float]:
    """Cumulative seconds some task stalled on CPU, memory and I/O (Linux PSI); ``{}`` where unavailable.

    The difference over a measurement says whether the machine was busy
    meanwhile: a verified read uses both cores, so CPU stalls from other
    processes (or from kernel writeback and reclaim) cost it more than a
    one-core plain read, and its ratio drops (see README "Fair runs").
    """
    out: Dict[str, float] = {}
    for res in ("cpu", "memory", "io"):
        try:
            with open(f"/proc/pressure/{res}") as f:
                some = f.readline().split()
        except OSError:
            continue
        out[res] = int(some[-1].partition("=")[2]) / 1e6
    return out


def pressure_since(before: Dict[str, float]) -> Dict[str, float]:
    """Stall seconds per resource since ``before`` (from :func:`pressure`)."""
    now = pressure()
    return {k: round(now[k] - v, 3) for k, v in before.items() if k in now}


SETTLE_S = 2.0


def settle(seconds: float = SETTLE_S) -> None:
    """Untimed, before a module or a big-memory scenario: leave the machine as a fresh run would find it.

    ``os.sync()`` (earlier writes' dirty pages are flushed now, not on the next
    figure's clock), ``gc.collect()`` + ``malloc_trim(0)`` (freed heap goes back
    to the kernel instead of lingering in free lists), then a short sleep so
    writeback and the kernel's reclaim threads finish before timing starts.
    """
    os.sync()
    gc.collect()
    malloc_trim()
    time.sleep(seconds)


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
    """The results table: casstore, reference, ratio, the machine's limit and casstore's fraction of it."""
    header = ["operation", "casstore", "reference", "ratio", "limit", "of limit", "target", "met?"]
    body = []
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        body.append([
            r.operation,
            _fmt(r.casstore, r.unit),
            _fmt(r.reference, r.unit),
            "-" if r.ratio is None else f"{r.ratio:.2f}x",
            _fmt(r.limit, r.unit),
            "-" if r.of_limit is None else f"{r.of_limit:.2f}x",
            r.target or "(info)",
            met,
        ])
    widths = [max(len(str(x[i])) for x in [header, *body]) for i in range(len(header))]
    right = {1, 2, 3, 4, 5}

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(b) for b in body)])


def rows_to_json(rows: Sequence[Row]) -> List[Dict[str, Any]]:
    return [asdict(r) for r in rows]


def rows_from_json(items: Sequence[Dict[str, Any]]) -> List[Row]:
    """Inverse of :func:`rows_to_json` (rows coming back from a module run in a child process)."""
    names = set(Row.__dataclass_fields__)
    return [Row(**{k: v for k, v in item.items() if k in names}) for item in items]


def failure_label(name: str, exc: BaseException) -> str:
    """A one-line table label for a benchmark that raised (the traceback went to stderr)."""
    msg = " ".join(str(exc).split())
    return f"{name}: FAILED ({type(exc).__name__}: {msg})"[:110]


def compile_bytecode() -> None:
    """Compile casstore's bytecode, as ``pip install`` of a wheel does (untimed setup).

    Hazard: this machine sets ``PYTHONDONTWRITEBYTECODE=1`` and the repository is an
    editable install, so without this every process that imports casstore (each CLI
    run, each worker) compiles ~90 modules again: ~0.1 s billed to casstore that no
    installed casstore pays, while the peers (dvc, pfio) come with their ``.pyc``
    from pip.  ``compileall`` writes ``__pycache__`` whatever that variable says.
    """
    import compileall

    import casstore

    compileall.compile_dir(str(Path(casstore.__file__).parent), quiet=1)


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
