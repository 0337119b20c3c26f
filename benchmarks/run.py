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

from _harness import TMP_ENV, Row, bench_root, failure_label, format_table, log, rows_to_json  # noqa: E402


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
    args = ap.parse_args(argv)

    only = [x.strip() for item in args.only for x in item.split(",") if x.strip()]
    unknown = [x for x in only if x not in found]
    if unknown:
        ap.error(f"unknown benchmark(s) {', '.join(unknown)}; have: {', '.join(found)}")
    selected = only or list(found)
    if args.tmpdir:
        os.environ[TMP_ENV] = args.tmpdir
    name = args.name or "-".join(selected) + ("-quick" if args.quick else "")

    rows: List[Row] = []
    failed = False
    t0 = time.perf_counter()
    for mod_name in selected:
        log(f"== {mod_name} ({'quick' if args.quick else 'full'}), temp files under {bench_root()}")
        try:
            mod_rows = list(load(mod_name, found[mod_name]).run(args.quick))
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            mod_rows = [Row(failure_label(mod_name, e), None, None, "", target="runs", met=False)]
        for r in mod_rows:
            r.group = r.group or mod_name
        failed = failed or any(r.casstore is None and r.met is False for r in mod_rows)
        rows.extend(mod_rows)
    elapsed = time.perf_counter() - t0

    print(f"casstore benchmarks [{', '.join(selected)}]{' --quick' if args.quick else ''}: "
          f"medians of interleaved reps, {os.cpu_count()} CPUs, {elapsed:.0f} s")
    print(format_table(rows))

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
