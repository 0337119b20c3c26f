"""Run the casstore benchmarks and print one table.

    python benchmarks/run.py                 # everything (a few minutes)
    python benchmarks/run.py --quick         # smaller sizes, fewer reps: a smoke run
    python benchmarks/run.py --only store    # just benchmarks/bench_store.py

Every ``benchmarks/bench_<name>.py`` is discovered automatically; it must
expose ``run(quick: bool) -> list[Row]`` (``Row`` from ``_harness``).  The
table also goes to ``benchmarks/results/<name>.json`` with the raw timings.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # bench modules import _harness as a top-level module
    sys.path.insert(0, str(HERE))

from _harness import (  # noqa: E402
    TMP_ENV,
    Row,
    bench_root,
    compile_bytecode,
    failure_label,
    format_table,
    log,
    pressure,
    pressure_since,
    rows_from_json,
    rows_to_json,
    settle,
)

BUSY = 0.25  # CPU stall time above this fraction of a module's wall time: the table says the machine was busy


def discover() -> Dict[str, Path]:
    """``{"store": benchmarks/bench_store.py, ...}`` in name order."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(HERE.glob("bench_*.py"))}


def load(name: str, path: Path) -> ModuleType:
    mod_name = f"bench_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    if not callable(getattr(mod, "run", None)):
        raise TypeError(f"{path.name} has no run(quick: bool) -> list[Row]")
    return mod


def _git_commit() -> Optional[str]:
    try:
        r = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=HERE,
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def _casstore_location() -> Optional[str]:
    """Which casstore was measured (PYTHONPATH can point at a clean checkout)."""
    mod = sys.modules.get("casstore")
    return None if mod is None else str(Path(mod.__file__ or "?").parent)


def run_in_process(name: str, path: Path, quick: bool) -> List[Row]:
    """Run one benchmark module here; a module that raises becomes one FAILED row."""
    try:
        return list(load(name, path).run(quick))
    except Exception as e:
        traceback.print_exc(file=sys.stderr)
        return [Row(failure_label(name, e), None, None, "", target="runs", met=False)]


def run_isolated(name: str, quick: bool, *, script: Optional[Path] = None) -> List[Row]:
    """Run one benchmark module in a fresh interpreter (``run.py --child``) and return its rows.

    Why: a module run after others in the same process inherits their heap
    (free lists, arenas, fragmentation), threads and address space; the 1 GiB
    get measured 0.72x of read_bytes in a full in-process run against 0.997x
    alone (README.md, "Fair runs").  A child starts from what a user's process
    would have.  Its progress goes to our stderr; its rows come back as JSON.
    """
    import tempfile

    fd, out = tempfile.mkstemp(prefix=f"casstore-bench-{name}-", suffix=".json")
    os.close(fd)
    try:
        cmd = [sys.executable, str(script or Path(__file__).resolve()), "--only", name, "--child", out]
        r = subprocess.run(cmd + (["--quick"] if quick else []), stdin=subprocess.DEVNULL, check=False)
        text = Path(out).read_text()
        if r.returncode == 0 and text:
            return rows_from_json(json.loads(text))
        return [Row(f"{name}: FAILED (child process exited {r.returncode}; traceback above)", None, None, "",
                    target="runs", met=False)]
    finally:
        os.unlink(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    found = discover()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help=f"run only these benchmark modules (repeat or comma-separate): {', '.join(found)}")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and fewer reps (smoke run, < 1 min)")
    ap.add_argument("--name", help="results file name (default: the module names, plus -quick)")
    ap.add_argument("--tmpdir", help=f"where temp files go (default ${TMP_ENV} or the system temp dir; "
                                     "must be a real disk, not tmpfs)")
    ap.add_argument("--no-save", action="store_true", help="do not write benchmarks/results/<name>.json")
    ap.add_argument("--in-process", action="store_true",
                    help="run every module in this process (default: each in a fresh child process, after "
                         "os.sync + gc + malloc_trim + a settle pause; see README 'Fair runs')")
    ap.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)  # internal: run --only here, rows to JSON
    args = ap.parse_args(argv)

    only = [x.strip() for item in args.only for x in item.split(",") if x.strip()]
    unknown = [x for x in only if x not in found]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; have: {', '.join(found)}")
    selected = only or list(found)
    if args.tmpdir:
        os.environ[TMP_ENV] = args.tmpdir
    name = args.name or "-".join(selected) + ("-quick" if args.quick else "")

    if args.child:  # a child of run_isolated: one module, rows to the JSON file, no table
        child_rows: List[Row] = []
        for mod_name in selected:
            child_rows.extend(run_in_process(mod_name, found[mod_name], args.quick))
        Path(args.child).write_text(json.dumps(rows_to_json(child_rows)))
        return 0

    compile_bytecode()  # as an installed casstore has it (see _harness.compile_bytecode)
    rows: List[Row] = []
    failed = False
    module_s: Dict[str, float] = {}
    stalls: Dict[str, Dict[str, float]] = {}
    t0 = time.perf_counter()
    for mod_name in selected:
        log(f"== {mod_name} ({'quick' if args.quick else 'full'}), temp files under {bench_root()}"
            f"{'' if args.in_process else ', in a fresh process'}")
        if not args.in_process:
            settle()  # the previous module's dirty pages, heap and kernel work do not bill this one
        t_mod = time.perf_counter()
        psi = pressure()
        if args.in_process:
            mod_rows = run_in_process(mod_name, found[mod_name], args.quick)
        else:
            mod_rows = run_isolated(mod_name, args.quick)
        module_s[mod_name] = round(time.perf_counter() - t_mod, 1)
        stalls[mod_name] = pressure_since(psi)
        for r in mod_rows:
            r.group = r.group or mod_name
        failed = failed or any(r.casstore is None and r.met is False for r in mod_rows)
        rows.extend(mod_rows)
    elapsed = time.perf_counter() - t0

    print(f"casstore benchmarks [{', '.join(selected)}]{' --quick' if args.quick else ''}: "
          f"medians of interleaved reps, {os.cpu_count()} CPUs, {elapsed:.0f} s; "
          "limit = the machine's bound measured in the same interleave")
    print(format_table(rows))
    busy = {m: st["cpu"] / module_s[m] for m, st in stalls.items() if "cpu" in st and module_s[m] > 0}
    noisy = [f"{m} {100 * f:.0f}%" for m, f in busy.items() if f > BUSY]
    if noisy:  # a 2-core verified read loses more to a busy machine than a 1-core plain read
        print(f"warning: the machine was busy (CPU stall time / wall time, Linux PSI): {', '.join(noisy)}; "
              "ratios of two-core paths (verified reads) are pessimistic in those modules; rerun on a quiet machine")

    if not args.no_save:
        out_dir = HERE / "results"
        out_dir.mkdir(exist_ok=True)
        out = out_dir / f"{name}.json"
        meta = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "git": _git_commit(),
            "quick": args.quick,
            "benchmarks": selected,
            "elapsed_s": round(elapsed, 1),
            "module_s": module_s,
            "psi_stall_s": stalls,
            "isolation": "in-process" if args.in_process else "a fresh process per module, after settle()",
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "tmpdir": str(bench_root()),
            "casstore": _casstore_location(),
        }
        out.write_text(json.dumps({"meta": meta, "rows": rows_to_json(rows)}, indent=2) + "\n")
        log(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
