"""Read-through (issue 14) against a real SeaweedFS server on loopback, next to bare boto3.

1. Cold read-through ``get`` of one 256 MiB object (a fresh local store whose upstream
   is the remote: download, verify, publish durably, return the bytes) against boto3's
   ``download_fileobj`` into a local file plus ``fsync`` of the file and its directory
   (the same durability, no verification).  Target >= 0.8x.
2. 1,000 x 64 KiB cold read-throughs from 4 processes (each ``get``s a quarter, one shared
   local store) against 4 processes fetching the same objects with bare boto3
   ``get_object`` (bytes read, not kept).  Target >= 0.8x.

Both run interleaved (order rotating), medians of several rounds; each round uses a fresh
local store, so every read is cold.

    python benchmarks/bench_readthrough.py [--quick]   # or: python benchmarks/run.py --only readthrough
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _harness import Case, MiB, Row, bench_dir, interleave, log, median, ratio_row, rmtree, run_scenarios, summary  # noqa: E402
from bench_remote import BUCKET, SharedServer, delete_prefix  # noqa: E402

import casstore  # noqa: E402

WORKERS = 16


def _remote(prefix: str, *, chunked: bool = False) -> casstore.Remote:
    """Whole objects unless ``chunked``: the boto3 reference reads the object's one key."""
    extra = {} if chunked else {"chunking": None}
    return casstore.Remote(f"s3://{BUCKET}/{prefix}", endpoint_url=SharedServer.get().endpoint, workers=WORKERS,
                           progress=False, **extra)  # type: ignore[arg-type]


def bench_cold_get_256mib(quick: bool) -> List[Row]:
    """One large object, read through cold vs boto3 download_fileobj + fsync."""
    size = (64 if quick else 256) * MiB
    reps = 3 if quick else 5
    with bench_dir("readthrough-big") as tmp:
        src = casstore.open(tmp / "src", durable=False)
        blob = os.urandom(size)
        d = src.put(blob)
        del blob
        with src.edit("big") as m:
            m["big"] = d
        prefix = f"rt-big-{uuid.uuid4().hex[:8]}"
        src.push(_remote(prefix), "big")
        cprefix = f"rt-bigc-{uuid.uuid4().hex[:8]}"
        src.push(_remote(cprefix, chunked=True), "big")  # the same object as content-defined chunks
        key = _remote(prefix).objects.key(d)
        client = SharedServer.client()
        state: Dict[str, Any] = {}

        def fresh(r: int) -> None:
            state["dir"] = tmp / f"dst-{r}-{uuid.uuid4().hex[:6]}"

        def drop(_r: int) -> None:
            rmtree(state["dir"])

        def cas(_r: int) -> None:
            store = casstore.open(state["dir"], upstream=_remote(prefix))  # durable (the default)
            assert len(store.get(d)) == size

        def cas_chunked(_r: int) -> None:
            store = casstore.open(state["dir"], upstream=_remote(cprefix, chunked=True))
            assert len(store.get(d)) == size

        def floor(_r: int) -> None:
            out = state["dir"]
            out.mkdir(parents=True)
            with open(out / "obj", "wb") as f:
                client.download_fileobj(BUCKET, key, f)
                f.flush()
                os.fsync(f.fileno())
            fd = os.open(out, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        log(f"cold read-through get of {size // MiB} MiB: {reps} rounds")
        res = interleave([Case("boto3", floor, fresh, drop), Case("cas", cas, fresh, drop),
                          Case("cas_chunked", cas_chunked, fresh, drop)], reps)
        delete_prefix(client, prefix + "/")
        delete_prefix(client, cprefix + "/")
    cas_t, ref_t, ch_t = (median(res[k]["total"]) for k in ("cas", "boto3", "cas_chunked"))
    det = {"casstore": summary(res["cas"]["total"]), "boto3": summary(res["boto3"]["total"]),
           "casstore_chunked": summary(res["cas_chunked"]["total"]), "bytes": size}
    return [ratio_row(f"cold read-through get of {size // MiB} MiB (MiB/s) vs boto3 download_fileobj + fsync",
                      size / MiB / cas_t, size / MiB / ref_t, "MiB/s", min_ratio=0.8, details=det),
            ratio_row(f"cold read-through get of {size // MiB} MiB stored as chunks (MiB/s) vs the same reference",
                      size / MiB / ch_t, size / MiB / ref_t, "MiB/s", details=det)]


_PROC = r"""
import json, os, sys, time
from pathlib import Path
sys.path[:0] = sys.argv[7:8]
mode, root, url, endpoint, go, out = sys.argv[1:7]
keys = json.loads(Path(out + ".in").read_text())
if mode == "cas":
    import casstore
    rem = casstore.Remote(url, endpoint_url=endpoint, progress=False)
    store = casstore.open(root, upstream=rem)
    rem.refs.list("heads")  # the boto3 client is made before the clock starts, as in the boto3 case
    ds = [casstore.Digest(k) for k in keys]
    read = lambda d: store.get(d)
else:
    import _seaweed
    client = _seaweed.s3_client(endpoint)
    bucket, _, prefix = url[len("s3://"):].partition("/")
    ds = [f"{prefix}/objects/{k[:2]}/{k[2:]}" for k in keys]
    read = lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read()
Path(out + ".ready").touch()
while not os.path.exists(go):
    time.sleep(0.001)
t0, c0 = time.time(), time.process_time()
n = sum(len(read(d)) for d in ds)
Path(out).write_text(json.dumps({"t0": t0, "t1": time.time(), "bytes": n, "cpu": time.process_time() - c0}))
"""


def bench_many_small_4procs(quick: bool) -> List[Row]:
    """1,000 x 64 KiB objects read through by 4 processes vs 4 processes of bare boto3 gets."""
    n = 200 if quick else 1000
    reps = 2 if quick else 4
    with bench_dir("readthrough-small") as tmp:
        src = casstore.open(tmp / "src", durable=False)
        ds = []
        with src.edit("small") as m:
            for i in range(n):
                ds.append(d := src.put(os.urandom(64 * 1024)))
                m[f"k{i:05d}"] = d
        prefix = f"rt-small-{uuid.uuid4().hex[:8]}"
        rem = _remote(prefix)
        src.push(rem, "small")
        hexes = [d.hex for d in ds]
        quarters = [hexes[i::4] for i in range(4)]
        state: Dict[str, Any] = {}
        endpoint = SharedServer.get().endpoint

        def fresh(r: int) -> None:
            state["dir"] = tmp / f"dst-{r}-{uuid.uuid4().hex[:6]}"
            casstore.open(state["dir"])

        def drop(_r: int) -> None:
            rmtree(state["dir"])

        def run4(mode: str) -> Dict[str, float]:
            go = state["dir"].parent / f"go-{uuid.uuid4().hex[:6]}"
            outs = [state["dir"].parent / f"out-{uuid.uuid4().hex[:6]}-{i}.json" for i in range(4)]
            for o, q in zip(outs, quarters, strict=True):
                Path(str(o) + ".in").write_text(json.dumps(q))
            procs = [subprocess.Popen([sys.executable, "-c", _PROC, mode, str(state["dir"]), rem.url, endpoint,
                                       str(go), str(o), str(HERE.parent / "tests")]) for o in outs]
            deadline = time.monotonic() + 120
            while not all(Path(str(o) + ".ready").exists() for o in outs):  # imports, clients: not timed
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"{mode} readers did not start")
                time.sleep(0.01)
            go.touch()
            for p in procs:
                if p.wait(600) != 0:
                    raise RuntimeError(f"{mode} reader failed")
            rs = [json.loads(o.read_text()) for o in outs]
            for o in outs:
                for extra in ("", ".in", ".ready"):
                    Path(str(o) + extra).unlink()
            go.unlink()
            assert sum(r["bytes"] for r in rs) == n * 64 * 1024
            return {"total": max(r["t1"] for r in rs) - min(r["t0"] for r in rs), "cpu": sum(r["cpu"] for r in rs)}

        log(f"{n} x 64 KiB cold read-throughs, 4 processes: {reps} rounds")
        res = interleave([Case("boto3", lambda _r: run4("boto3"), fresh, drop),
                          Case("cas", lambda _r: run4("cas"), fresh, drop)], reps)
        delete_prefix(SharedServer.client(), prefix + "/")
    cas_t, ref_t = median(res["cas"]["total"]), median(res["boto3"]["total"])
    det = {"casstore": summary(res["cas"]["total"]), "boto3": summary(res["boto3"]["total"]), "objects": n,
           "client_cpu_ms_per_object": {k: median(res[k]["cpu"]) / n * 1e3 for k in ("cas", "boto3")}}
    return [ratio_row(f"{n} x 64 KiB cold read-throughs, 4 processes (objects/s) vs 4 processes of boto3 gets",
                      n / cas_t, n / ref_t, "obj/s", min_ratio=0.8, details=det)]


SCENARIOS = [bench_cold_get_256mib, bench_many_small_4procs]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py."""
    try:
        return run_scenarios(SCENARIOS, quick)
    finally:
        SharedServer.stop()


if __name__ == "__main__":  # python benchmarks/bench_readthrough.py [--quick]
    from run import main

    sys.exit(main(["--only", "readthrough", *sys.argv[1:]]))
