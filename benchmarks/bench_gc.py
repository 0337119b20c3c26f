"""Benchmarks of store maintenance: plan_gc over 100,000 objects, verify of 4 GiB.

* ``plan_gc`` over 100,000 objects and 1,000 manifest versions (10 heads x 100
  versions, pins, half the objects never referenced).  Target: report seconds;
  it must not read object contents (checked through atime here).  Reference:
  the floor of any plan -- ``scandir`` + ``lstat`` of every object file.
* ``verify`` of 4 GiB (64 x 64 MiB raw objects) against BLAKE3-hashing the
  same files directly in the same run (mmap + ``max_threads=AUTO``, one file
  after another), interleaved, medians.  Target: >= 0.7x.

Run with ``python benchmarks/run.py --only gc`` or ``python benchmarks/bench_gc.py [--quick]``.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path
from typing import List

import blake3
import numpy as np
from _harness import (
    MB,
    Case,
    GiB,
    MiB,
    Row,
    bench_dir,
    interleave,
    log,
    median,
    rate,
    ratio_row,
    run_scenarios,
    summary,
)

import casstore


def _object_paths(root: Path) -> List[str]:
    out = []
    with os.scandir(root / "objects") as fans:
        for fan in sorted(fans, key=lambda e: e.name):
            with os.scandir(fan.path) as it:
                out.extend(sorted(e.path for e in it))
    return out


# -- 1. plan_gc over 100,000 objects and 1,000 manifest versions ----------------------------------


def bench_plan_gc(quick: bool) -> List[Row]:
    n_objects = 20_000 if quick else 100_000
    heads, versions_per_head, keys, per_commit = (10, 20, 200, 50) if quick else (10, 100, 500, 50)
    reps = 3 if quick else 5
    rng = np.random.default_rng(7)
    with bench_dir("plan-gc") as tmp:
        store = casstore.open(tmp / "store", durable=False, compress=False)
        t0 = time.perf_counter()
        blob = rng.bytes(n_objects * 64)
        digests = store.put_many(blob[i * 64:(i + 1) * 64] + i.to_bytes(4, "little") for i in range(n_objects))
        nxt = 0
        for h in range(heads):
            for v in range(versions_per_head):
                with store.edit(f"team/head-{h}") as m:
                    for k in range(per_commit):
                        m[f"data/k{(v * per_commit + k) % keys:05d}"] = digests[nxt]
                        nxt += 1
                if v == versions_per_head // 2:
                    store.pin(f"paper-{h}", f"team/head-{h}")
        n_versions = heads * versions_per_head
        total_objects = sum(1 for _ in _object_paths(store.root))
        log(f"built {total_objects} objects ({nxt} referenced once, {n_versions} manifest versions) "
            f"in {time.perf_counter() - t0:.1f} s")
        # atime older than mtime: any read of a data object would move it (relatime)
        week = time.time() - 7 * 86400
        sample = [store.path(d) for d in digests[::997]]
        for p in sample:
            os.utime(p, (week, time.time() - 3600))
        plans: List[casstore.GCPlan] = []

        def floor(_r: int) -> None:
            n = 0
            with os.scandir(store.root / "objects") as fans:
                for fan in fans:
                    with os.scandir(fan.path) as it:
                        for e in it:
                            e.stat(follow_symlinks=False)
                            n += 1
            assert n == total_objects

        def cas(_r: int) -> None:
            plans.append(store.plan_gc(keep_history=5, grace=0))

        res = interleave([Case("floor", floor), Case("plan", cas)], reps)
        plan = plans[-1]
        unread = all(abs(os.stat(p).st_atime - week) < 2 for p in sample)
        assert unread, "plan_gc read object contents"
        t_plan, t_floor = res["plan"]["total"], res["floor"]["total"]
        t1 = time.perf_counter()
        result = plan.execute()
        t_exec = time.perf_counter() - t1
        assert len(result.deleted) == len(plan.objects)
        assert store.verify(fast=True).ok
    label = f"{n_objects // 1000}k objects, {n_versions} versions"
    return [
        Row(f"plan_gc: {label} (ref: scandir+lstat floor)", median(t_plan), median(t_floor), "s",
            ratio=median(t_floor) / median(t_plan), target="report s; reads no object", met=unread,
            details={"casstore": summary(t_plan), "reference": summary(t_floor), "objects": total_objects,
                     "planned": len(plan.objects), "freed_bytes": plan.freed_bytes,
                     "kept_referenced": len(plan.kept)}),
        Row(f"  execute that plan: delete {len(result.deleted)} objects (info, once)", t_exec, None, "s",
            details={"deleted": len(result.deleted), "seconds": t_exec}),
    ]


# -- 2. verify of 4 GiB vs blake3 over the same files -------------------------------------------


def _hash_direct(paths: List[str]) -> int:
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
            if size:
                with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
                    h.update(mm)
            h.digest()
            n += size
    return n


def bench_verify(quick: bool) -> List[Row]:
    file_size = 64 * MiB
    total = (512 * MiB) if quick else 4 * GiB
    reps = 3 if quick else 5
    rng = np.random.default_rng(11)
    with bench_dir("verify") as tmp:
        store = casstore.open(tmp / "store", durable=False, compress=False)
        t0 = time.perf_counter()
        for _ in range(total // file_size):
            store.put(rng.bytes(file_size))
        os.sync()
        paths = _object_paths(store.root)
        log(f"wrote {len(paths)} x {file_size // MiB} MiB in {time.perf_counter() - t0:.1f} s")
        _hash_direct(paths)  # warm the page cache for both sides
        seen: List[int] = []

        def ref(_r: int) -> None:
            seen.append(_hash_direct(paths))

        def cas(_r: int) -> None:
            rep = store.verify(progress=False)
            assert rep.ok and rep.checked == len(paths)
            seen.append(rep.bytes_checked)

        res = interleave([Case("ref", ref), Case("cas", cas)], reps)
        assert set(seen) == {total}
        t_ref, t_cas = res["ref"]["total"], res["cas"]["total"]

        t1 = time.perf_counter()
        fast = store.verify(fast=True, progress=False)
        t_fast = time.perf_counter() - t1
        t1 = time.perf_counter()
        inc = store.verify(incremental=True, progress=False)
        t_inc = time.perf_counter() - t1
        assert fast.ok and inc.skipped == len(paths)
        # many small objects: per-file cost (info; the reference is given the paths, reads and hashes)
        n_small, small = (5_000 if quick else 20_000), 16 << 10
        blob = rng.bytes(n_small * small)
        small_store = casstore.open(tmp / "small", durable=False, compress=False)
        small_store.put_many(blob[i * small:(i + 1) * small] for i in range(n_small))
        small_paths = _object_paths(small_store.root)

        def ref_small(_r: int) -> None:
            for p in small_paths:
                with open(p, "rb", buffering=0) as f:
                    blake3.blake3(f.read()).digest()

        def cas_small(_r: int) -> None:
            assert small_store.verify(progress=False).checked == n_small

        res = interleave([Case("ref", ref_small), Case("cas", cas_small)], reps)
        t_ref_s, t_cas_s = res["ref"]["total"], res["cas"]["total"]
    label = f"{total // GiB} GiB" if total >= GiB else f"{total // MiB} MiB"
    return [
        ratio_row(f"verify {label} ({len(paths)} x 64 MiB raw; ref: blake3 mmap AUTO over the same files)",
                  rate(total / MB, t_cas), rate(total / MB, t_ref), "MB/s", min_ratio=0.7,
                  details={"casstore": summary(t_cas), "reference": summary(t_ref), "bytes": total}),
        Row(f"  verify --fast {label} (info)", t_fast, None, "s", details={"seconds": t_fast}),
        Row(f"  verify --incremental {label}, nothing changed (info)", t_inc, None, "s", details={"seconds": t_inc}),
        ratio_row(f"  verify {n_small:,} x 16 KiB (info; ref: read + blake3 each, paths given)",
                  rate(n_small * small / MB, t_cas_s), rate(n_small * small / MB, t_ref_s), "MB/s",
                  details={"casstore": summary(t_cas_s), "reference": summary(t_ref_s), "files": n_small}),
    ]


SCENARIOS = [bench_plan_gc, bench_verify]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py: every maintenance benchmark, one list of rows."""
    return run_scenarios(SCENARIOS, quick)


if __name__ == "__main__":  # python benchmarks/bench_gc.py [--quick]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import main

    sys.exit(main(["--only", "gc", *sys.argv[1:]]))
