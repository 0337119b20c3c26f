"""Benchmarks of tree-shaped manifests at scale (issue 12, "Scale"): cost grows with what changed.

One durable store, one manifest of N entries (N = 1,000,000; 50,000 with
``--quick``), every entry naming one tiny object (keys like
``train/c0123/f0012345.jpg``).  Rows, against the issue's targets:

* the first version (the whole tree written: seconds, nodes, bytes);
* a one-key edit commit (median of 20, durable): <= 50 ms;
* 100 one-key versions: bytes they add (object files' sizes, and blocks on
  disk) <= 1% of the first version's;
* opening the frozen version and looking up one key, in a fresh process
  (nothing cached): <= 0.2 s, with the number of objects read and peak RSS;
* iterating every entry (what ``status`` reads of the version when the folder
  changed), in a fresh process, against the first version's commit time (info),
  with peak RSS (ru_maxrss) and the tracemalloc peak.

And the issue's bar itself, on a real folder (``bench_folder_scale``): N files
(1,000,000; 20,000 with ``--quick``) of 16 bytes each in 1,000 directories,
1,000 distinct contents (the objects can be tiny; dedupe makes the first add
*cheaper*, so the ratio is conservative).  ``casstore add`` of it into a fresh
durable store, then ``casstore status`` of the unchanged folder, each a CLI
run: status <= 1/10 of the first add, with peak RSS of each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

from _harness import Row, bench_dir, limit_row, log, median, run_scenarios, summary, time_row

import casstore
from casstore.manifests.model import FANOUT, LEAF_TARGET, TREE_THRESHOLD


def _key(i: int) -> str:
    return f"train/c{i // 1000:04d}/f{i:07d}.jpg"


def _object_bytes(root: Path) -> Tuple[int, int, int]:
    """(files, apparent bytes, bytes on disk) of every object file."""
    n = size = disk = 0
    for sub in os.scandir(root / "objects"):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for f in os.scandir(sub.path):
            st = f.stat(follow_symlinks=False)
            n += 1
            size += st.st_size
            disk += st.st_blocks * 512
    return n, size, disk


_CHILD = r"""
import json, sys, time, tracemalloc
t0 = time.perf_counter()
import casstore
from casstore.objects.local import LocalObjects
reads = 0
orig = LocalObjects.read
def counted(self, d, *, verify=True):
    global reads
    reads += 1
    return orig(self, d, verify=verify)
LocalObjects.read = counted
root, digest, key, mode = sys.argv[1:5]
t_import = time.perf_counter() - t0
out = {}
if mode == "lookup":
    t = time.perf_counter()
    m = casstore.open(root).manifest(digest)
    e = m[key]
    out["seconds"] = time.perf_counter() - t
    out["size"] = e.size
else:
    if mode == "iterate-traced":
        tracemalloc.start()
    t = time.perf_counter()
    m = casstore.open(root).manifest(digest)
    n = 0
    for _k, _h, _s in m.entries.hex_items():
        n += 1
    out["seconds"] = time.perf_counter() - t
    out["entries"] = n
    if mode == "iterate-traced":
        out["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
out["reads"] = reads
# VmHWM, not ru_maxrss: ru_maxrss keeps the forking parent's peak across exec on Linux.
out["maxrss_kib"] = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps(out))
"""


def _child(root: Path, digest: str, key: str, mode: str) -> Dict[str, float]:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(root), digest, key, mode],
                       capture_output=True, text=True, check=True)
    data: Dict[str, float] = json.loads(r.stdout)
    return data


def bench_scale(quick: bool) -> List[Row]:
    n = 50_000 if quick else 1_000_000
    edits = 10 if quick else 20
    history = 100
    rows: List[Row] = []
    with bench_dir("manifest-scale") as tmp:
        root = tmp / "store"
        store = casstore.open(root)
        obj = store.put(b"x")
        before = _object_bytes(root)
        t = time.perf_counter()
        with store.edit("big") as m:
            for i in range(n):
                m[_key(i)] = casstore.Entry(obj, 1)
        t_first = time.perf_counter() - t
        first = store.manifest("big")
        after = _object_bytes(root)
        first_files, first_bytes, first_disk = (a - b for a, b in zip(after, before, strict=True))
        log(f"first version: {n} entries in {t_first:.2f} s, {first_files} objects, {first_bytes} bytes "
            f"({first_disk} on disk), depth {getattr(first.entries, 'depth', 1)}")
        rows.append(Row(f"first version of {n:,} entries (tree written)", t_first, None, "s",
                        details={"objects": first_files, "bytes": first_bytes, "disk_bytes": first_disk,
                                 "leaf_target": LEAF_TARGET, "fanout": FANOUT, "threshold": TREE_THRESHOLD}))
        # One-key edits (durable commits), each changing a different existing key's entry.
        other = store.put(b"y")
        times = []
        for r in range(edits):
            t = time.perf_counter()
            with store.edit("big") as m:
                m[_key((r * 7919) % n)] = casstore.Entry(other if r % 2 == 0 else obj, 1)
            times.append(time.perf_counter() - t)
        rows.append(limit_row("one-key edit commit, durable (median)", median(times) * 1e3, "ms", max_value=50,
                              details=summary(times)))
        # History: 100 more one-key versions (inserts, updates and deletes mixed).
        b0 = _object_bytes(root)
        for r in range(history):
            with store.edit("big") as m:
                k = _key((r * 104729) % n)
                if r % 3 == 0:
                    m[k + ".new"] = casstore.Entry(obj, 1)
                elif r % 3 == 1:
                    m[k] = casstore.Entry(other, 1)
                else:
                    del m[k]
        b1 = _object_bytes(root)
        added, added_disk = b1[1] - b0[1], b1[2] - b0[2]
        pct = 100.0 * added / first_bytes
        pct_disk = 100.0 * added_disk / first_disk
        rows.append(limit_row(f"{history} one-key versions: bytes added, % of first version", pct, "%",
                              max_value=1.0, details={"added_bytes": added, "first_bytes": first_bytes,
                                                      "added_disk": added_disk, "first_disk": first_disk,
                                                      "pct_on_disk": pct_disk, "objects_added": b1[0] - b0[0]}))
        log(f"history: +{added} bytes ({pct:.3f}%), +{added_disk} on disk ({pct_disk:.3f}%), "
            f"{b1[0] - b0[0]} objects")
        pin = store.freeze("big")
        lk = [_child(root, str(pin), _key(n // 2 + 1), "lookup") for _ in range(3)]
        best = min(lk, key=lambda x: x["seconds"])
        rows.append(limit_row("open frozen manifest + look up one key (fresh process)", best["seconds"], "s",
                              max_value=0.2, details={"object_reads": best["reads"],
                                                      "maxrss_kib": best["maxrss_kib"],
                                                      "all_s": [x["seconds"] for x in lk]}))
        log(f"lookup: {best}")
        it = _child(root, str(pin), "", "iterate")
        rows.append(time_row(f"iterate all {n:,} entries (a changed folder's status reads them) vs first "
                             "version commit (info)", it["seconds"], t_first, "s",
                             details={"object_reads": it["reads"], "maxrss_kib": it["maxrss_kib"]}))
        log(f"iterate: {it}")
        if quick:
            tr = _child(root, str(pin), "", "iterate-traced")
            rows.append(Row("iterate all entries: tracemalloc peak", tr["tracemalloc_peak"] / 2**20, None, "MiB",
                            details={"seconds_traced": tr["seconds"]}))
    return rows


def _cli(store: Path, *args: str) -> Tuple[float, float]:
    """Seconds and peak RSS (MiB) of one ``casstore`` CLI run."""
    code = ("import resource, runpy, sys, time; sys.argv = ['casstore'] + sys.argv[1:]; t = time.perf_counter()\n"
            "try:\n    runpy.run_module('casstore', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, "--store", str(store), *args], capture_output=True, text=True,
                       timeout=7200)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"casstore {' '.join(args)} exited {r.returncode}: {r.stderr[-2000:]}")
    rss_kib = float(r.stderr.split()[-1])
    return wall, rss_kib / 1024


def bench_folder_scale(quick: bool) -> List[Row]:
    n = 20_000 if quick else 1_000_000
    with bench_dir("folder-scale") as tmp:
        folder = tmp / "data"
        t = time.perf_counter()
        for d in range(1000):
            sub = folder / f"c{d:04d}"
            sub.mkdir(parents=True)
            for i in range(d, n, 1000):
                (sub / f"f{i:07d}.bin").write_bytes(f"{i % 1000:015d}\n".encode())
        os.sync()
        time.sleep(2.5)  # older than the racy window (folders.RACY_SECONDS), as a folder being tracked is
        log(f"folder: {n} files in {time.perf_counter() - t:.1f} s")
        store = tmp / "store"
        subprocess.run([sys.executable, "-m", "casstore", "init", str(store)], check=True, capture_output=True)
        t_add, rss_add = _cli(store, "add", "data", str(folder))
        log(f"first add: {t_add:.1f} s, peak RSS {rss_add:.0f} MiB")
        runs = [_cli(store, "status", "data", str(folder)) for _ in range(3)]
        t_st = median([r[0] for r in runs])
        rss_st = max(r[1] for r in runs)
        log(f"status: {[round(r[0], 2) for r in runs]} s, peak RSS {rss_st:.0f} MiB")
    return [
        time_row(f"status of the unchanged {n:,}-file folder vs its first add (CLI, s)", t_st, t_add, "s",
                 min_ratio=10.0, details={"status_s": [r[0] for r in runs], "status_peak_rss_mib": rss_st,
                                          "add_peak_rss_mib": rss_add}),
    ]


SCENARIOS = [bench_scale, bench_folder_scale]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py."""
    return run_scenarios(SCENARIOS, quick)


if __name__ == "__main__":  # python benchmarks/bench_manifest_scale.py [--quick]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import main

    sys.exit(main(["--only", "manifest_scale", *sys.argv[1:]]))
