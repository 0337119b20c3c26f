"""Benchmark of remote gc planning against a real SeaweedFS server on loopback (issue 14, "Speed").

A remote with 100,000 objects (``--quick``: 20,000): 10 heads x 100 versions of 500 keys (50
changed per version; every version's entries uploaded, as if pushed after each commit), the
rest unreferenced.  ``store.plan_gc(remote=..., keep_history=5, grace=0)`` -- read every ref,
every kept version and the parent links of the expired ones, list every object with its
LastModified, check the current closures -- next to the floor of any plan: listing every
object key with the bare boto3 paginator.  Target: the plan takes <= 1.5x the listing
(ratio = listing / plan >= 0.67).

    python benchmarks/bench_remote_gc.py [--quick]    # or: python benchmarks/run.py --only remote_gc
"""

from __future__ import annotations

import os
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _harness import Case, Row, bench_dir, interleave, log, median, run_scenarios, summary, time_row  # noqa: E402
from bench_remote import BUCKET, SharedServer  # noqa: E402

import casstore  # noqa: E402

WORKERS = 16


def bench_plan_remote_gc(quick: bool) -> List[Row]:
    """plan_gc(remote=...) over a remote of 100,000 objects vs listing them."""
    import _seaweed

    n_objects = 20_000 if quick else 100_000
    heads, versions, keys, per_commit = (10, 20, 500, 50) if quick else (10, 100, 500, 50)
    reps = 2 if quick else 3
    srv = SharedServer.get()
    client = _seaweed.s3_client(srv.endpoint)
    prefix = f"rgc-{uuid.uuid4().hex[:10]}"
    rem = casstore.Remote(f"s3://{BUCKET}/{prefix}", endpoint_url=srv.endpoint, workers=WORKERS, progress=False)
    with bench_dir("remote-gc") as tmp:
        store = casstore.open(tmp / "s", durable=False)
        log(f"remote gc: {heads} heads x {versions} versions")
        for h in range(heads):
            for v in range(versions):
                with store.edit(f"head{h}") as m:
                    for k in range(keys if v == 0 else per_commit):
                        key = f"k{(k + v * 7) % keys:04d}"
                        m[key] = store.put(os.urandom(32))
        referenced = [d for d in store.iter_objects()]
        orphans = max(0, n_objects - len(referenced))
        log(f"remote gc: uploading {len(referenced)} objects and {orphans} orphans (untimed)")

        def up(d: casstore.Digest) -> None:
            rem.objects.write(d, store.get(d))

        def orphan(_i: int) -> None:
            data = os.urandom(32)
            rem.objects.write(casstore.Digest.of(data), data)

        with ThreadPoolExecutor(WORKERS) as ex:
            list(ex.map(up, referenced))
            list(ex.map(orphan, range(orphans)))
        for h in range(heads):
            store.push(rem, f"head{h}")
        total = sum(1 for _ in rem.objects.iter_digests())
        state: Dict[str, Any] = {}

        def floor_list(_r: int) -> None:
            n = 0
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/objects/"):
                n += len(page.get("Contents", ()))
            assert n == total, (n, total)

        def cas_plan(_r: int) -> None:
            state["plan"] = store.plan_gc(keep_history=5, grace=0, remote=rem)

        log(f"remote gc: {reps} rounds over {total} objects")
        res = interleave([Case("list", floor_list), Case("plan", cas_plan)], reps)
        plan = state["plan"]
        det = {"objects": total, "planned_deletions": len(plan.objects), "expired_versions":
               sum(1 for f in plan.files if f.kind == "version"), "plan": summary(res["plan"]["total"]),
               "listing": summary(res["list"]["total"])}
        # Untimed cleanup: the plan itself deletes nothing.
        keys_all: List[Dict[str, str]] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"{prefix}/"):
            keys_all.extend({"Key": c["Key"]} for c in page.get("Contents", ()))
        for i in range(0, len(keys_all), 1000):
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys_all[i:i + 1000], "Quiet": True})
    return [time_row(f"remote plan_gc over {total} objects ({heads * versions} versions) vs listing them",
                     median(res["plan"]["total"]), median(res["list"]["total"]), "s", min_ratio=1 / 1.5,
                     details=det)]


SCENARIOS = [bench_plan_remote_gc]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py."""
    try:
        return run_scenarios(SCENARIOS, quick)
    finally:
        SharedServer.stop()


if __name__ == "__main__":  # python benchmarks/bench_remote_gc.py [--quick]
    from run import main

    sys.exit(main(["--only", "remote_gc", *sys.argv[1:]]))
