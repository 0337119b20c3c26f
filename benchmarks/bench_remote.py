"""Benchmarks of remotes (casstore.sync) against a real SeaweedFS server on loopback.

Push and pull of 100 x 1 MiB and 1,000 x 4 KiB objects, next to the bare boto3
loop doing the same puts/gets against the same server (the floor): a sequential
loop (what the issue calls "the bare boto3 loop") and, for reference, the same
calls on a 16-thread pool.  casstore's push verifies each local object, lists
what the remote has and uploads create-only (``If-None-Match: *``), then moves the
ref by CAS; its pull verifies every object's BLAKE3 digest and publishes into a
durable local store (fsync batches).  The floors only move bytes.

A push of a closure the remote already has is counted in requests (botocore
event hooks): one listing round trip per 2-hex prefix at most, never one per object.

    python benchmarks/bench_remote.py [--quick]    # or: python benchmarks/run.py --only remote
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Tuple

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _harness import (  # noqa: E402
    Case,
    MiB,
    Row,
    bench_dir,
    interleave,
    log,
    median,
    ratio_row,
    rmtree,
    run_scenarios,
    summary,
)

import casstore  # noqa: E402

BUCKET = "casstore-bench"
WORKERS = 16


class SharedServer:
    """One SeaweedFS for the whole benchmark module (started lazily, stopped at the end)."""

    srv: Any = None
    aws_dir: Any = None

    @classmethod
    def get(cls) -> Any:
        """The server (started on first use)."""
        if cls.srv is None:
            import tempfile

            import _seaweed

            cls.aws_dir = Path(tempfile.mkdtemp(prefix="casstore-bench-aws-"))
            os.environ.update(_seaweed.aws_env(cls.aws_dir))
            cls.srv = _seaweed.start_seaweed()
            cls.srv.client().create_bucket(Bucket=BUCKET)
        return cls.srv

    @classmethod
    def client(cls) -> Any:
        """A boto3 client of the server."""
        import _seaweed

        return _seaweed.s3_client(cls.get().endpoint)

    @classmethod
    def reclaim(cls) -> None:
        """Give deleted objects' disk space back now (untimed).

        SeaweedFS keeps a deleted object's bytes in its volume until a vacuum, by default every
        14 minutes: the chunks module's 1 GiB rounds filled the mini server's volumes (one per GiB
        of free disk at start) and its later uploads failed with ``InternalError``.  The filer
        frees an object's chunks shortly after the delete, so vacuum twice, a second apart.
        """
        if cls.srv is None:
            return
        import urllib.request

        for _ in range(2):
            time.sleep(1.0)
            with urllib.request.urlopen(f"http://{cls.srv.master}/vol/vacuum?garbageThreshold=0.0001",
                                        timeout=300) as r:
                r.read()

    @classmethod
    def stop(cls) -> None:
        """Stop the server if it runs."""
        if cls.srv is not None:
            cls.srv.stop()
            cls.srv = None
        if cls.aws_dir is not None:
            rmtree(cls.aws_dir)
            cls.aws_dir = None


def _mk(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _client() -> Any:
    return SharedServer.client()


def delete_prefix(client: Any, prefix: str) -> None:
    """Untimed cleanup so the server's state does not grow round after round."""
    keys: List[Dict[str, str]] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys.extend({"Key": c["Key"]} for c in page.get("Contents", ()))
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys[i:i + 1000], "Quiet": True})
    SharedServer.reclaim()


def _remote(prefix: str) -> casstore.Remote:
    return casstore.Remote(f"s3://{BUCKET}/{prefix}", endpoint_url=SharedServer.get().endpoint, workers=WORKERS,
                           progress=False)


def _dataset(store: casstore.Store, n: int, size: int, name: str = "data") -> Tuple[List[casstore.Digest], List[bytes]]:
    blobs = [os.urandom(size) for _ in range(n)]
    with store.edit(name) as m:
        ds = []
        for i, b in enumerate(blobs):
            d = store.put(b)
            ds.append(d)
            m[f"k{i:05d}"] = d
    return ds, blobs


def _transfer_rows(label: str, n: int, size: int, reps: int, tmp: Path) -> List[Row]:
    client = _client()
    src = casstore.open(tmp / f"src-{label}", durable=False)
    ds, blobs = _dataset(src, n, size)
    keys = [f"{d.hex[:2]}/{d.hex[2:]}" for d in ds]
    total = n * size
    state: Dict[str, Any] = {}

    # -- push -------------------------------------------------------------
    def fresh(_r: int) -> None:
        state["prefix"] = f"push-{uuid.uuid4().hex[:10]}"

    def cleanup(_r: int) -> None:
        delete_prefix(client, state["prefix"] + "/")

    def cas_push(_r: int) -> None:
        rep = src.push(_remote(state["prefix"]), "data")
        assert rep.objects == n + 1, rep

    def floor_push_seq(_r: int) -> None:
        pre = state["prefix"]
        for k, b in zip(keys, blobs, strict=True):
            client.put_object(Bucket=BUCKET, Key=f"{pre}/objects/{k}", Body=b)

    def floor_push_par(_r: int) -> None:
        pre = state["prefix"]
        with ThreadPoolExecutor(WORKERS) as ex:
            list(ex.map(lambda kb: client.put_object(Bucket=BUCKET, Key=f"{pre}/objects/{kb[0]}", Body=kb[1]),
                        zip(keys, blobs, strict=True)))

    log(f"push {label}: {reps} rounds")
    push = interleave([Case("seq", floor_push_seq, fresh, cleanup), Case("cas", cas_push, fresh, cleanup),
                       Case("par", floor_push_par, fresh, cleanup)], reps)

    # -- pull -------------------------------------------------------------
    pull_prefix = f"pull-{uuid.uuid4().hex[:10]}"
    src.push(_remote(pull_prefix), "data")

    def fresh_store(r: int) -> None:
        state["dst"] = tmp / f"dst-{label}-{r}-{uuid.uuid4().hex[:6]}"

    def drop_store(_r: int) -> None:
        rmtree(state["dst"])

    def cas_pull(_r: int) -> None:
        dst = casstore.open(state["dst"])  # durable (the default): every object fsynced
        rep = dst.pull(_remote(pull_prefix), "data")
        assert rep.objects == n, rep

    def cas_pull_scratch(_r: int) -> None:
        dst = casstore.open(state["dst"], durable=False)
        rep = dst.pull(_remote(pull_prefix), "data")
        assert rep.objects == n, rep

    def floor_pull_write(_r: int) -> None:
        """The bare loop that also keeps what it gets: one file per object, written and fsynced."""
        out = _mk(state["dst"])
        for k in keys:
            data = client.get_object(Bucket=BUCKET, Key=f"{pull_prefix}/objects/{k}")["Body"].read()
            fd = os.open(out / k.replace("/", ""), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)

    def floor_pull_seq(_r: int) -> None:
        for k in keys:
            client.get_object(Bucket=BUCKET, Key=f"{pull_prefix}/objects/{k}")["Body"].read()

    def floor_pull_par(_r: int) -> None:
        with ThreadPoolExecutor(WORKERS) as ex:
            list(ex.map(lambda k: client.get_object(Bucket=BUCKET, Key=f"{pull_prefix}/objects/{k}")["Body"].read(),
                        keys))

    log(f"pull {label}: {reps} rounds")
    pull = interleave([Case("seq", floor_pull_seq, fresh_store, None), Case("cas", cas_pull, fresh_store, drop_store),
                       Case("par", floor_pull_par, fresh_store, None),
                       Case("seq_write", floor_pull_write, fresh_store, drop_store),
                       Case("cas_scratch", cas_pull_scratch, fresh_store, drop_store)], reps)
    delete_prefix(client, pull_prefix + "/")

    rows: List[Row] = []
    for op, res in (("push", push), ("pull", pull)):
        cas_t, seq_t, par_t = (median(res[c]["total"]) for c in ("cas", "seq", "par"))
        det = {"casstore": summary(res["cas"]["total"]), "boto3_seq": summary(res["seq"]["total"]),
               "boto3_threads": summary(res["par"]["total"]), "objects": n, "bytes": total,
               "casstore_obj_s": n / cas_t, "casstore_MiB_s": total / MiB / cas_t,
               "seq_obj_s": n / seq_t, "seq_MiB_s": total / MiB / seq_t,
               "threads_obj_s": n / par_t, "threads_MiB_s": total / MiB / par_t}
        rows.append(ratio_row(f"{op} {label} (objects/s) vs sequential boto3 loop", n / cas_t, n / seq_t, "obj/s",
                              min_ratio=0.8, details=det))
        rows.append(ratio_row(f"{op} {label} (MiB/s) vs sequential boto3 loop", total / MiB / cas_t,
                              total / MiB / seq_t, "MiB/s", min_ratio=0.8, details=det))
        rows.append(ratio_row(f"{op} {label} (objects/s) vs 16-thread boto3 pool", n / cas_t, n / par_t, "obj/s",
                              details=det))
        if op == "pull":
            wr_t, scr_t = median(res["seq_write"]["total"]), median(res["cas_scratch"]["total"])
            det = dict(det, boto3_seq_write_fsync=summary(res["seq_write"]["total"]),
                       casstore_scratch=summary(res["cas_scratch"]["total"]))
            rows.append(ratio_row(f"pull {label} (objects/s) vs boto3 loop + write + fsync per object", n / cas_t,
                                  n / wr_t, "obj/s", details=det))
            rows.append(ratio_row(f"pull {label} into a durable=False store (objects/s) vs sequential boto3 loop",
                                  n / scr_t, n / seq_t, "obj/s", details=det))
    return rows


def bench_transfer_1mib(quick: bool) -> List[Row]:
    """Push and pull of 100 x 1 MiB objects."""
    with bench_dir("remote-1m") as tmp:
        return _transfer_rows("100 x 1 MiB", 30 if quick else 100, MiB, 2 if quick else 5, tmp)


def bench_transfer_4kib(quick: bool) -> List[Row]:
    """Push and pull of 1,000 x 4 KiB objects."""
    with bench_dir("remote-4k") as tmp:
        return _transfer_rows("1,000 x 4 KiB", 300 if quick else 1000, 4096, 2 if quick else 5, tmp)


def bench_noop_push(quick: bool) -> List[Row]:
    """Push of a closure the remote already has: requests counted via botocore's before-send hook."""
    n = 300 if quick else 1000
    rows: List[Row] = []
    with bench_dir("remote-noop") as tmp:
        src = casstore.open(tmp / "src", durable=False)
        _dataset(src, n, 4096)
        client = _client()
        for label, page, extra in (("small remote (one listing page)", 1000, 0),
                                   ("remote > 1 page (listing per 2-hex prefix)", 1000, 1500)):
            prefix = f"noop-{uuid.uuid4().hex[:10]}"
            rem = _remote(prefix)
            rem.list_page_size = page
            src.push(rem, "data")
            if extra:  # other data on the remote, so one page cannot cover it
                filler = casstore.open(tmp / f"filler-{prefix}", durable=False)
                _dataset(filler, extra, 64, "filler")
                filler.push(rem, "filler")
            times = []
            for _ in range(3 if quick else 5):
                rem.requests.clear()
                t0 = time.perf_counter()
                rep = src.push(rem, "data")
                times.append(time.perf_counter() - t0)
                assert rep.objects == 0 and rep.present == n + 1, rep
            reqs = dict(rem.requests)
            total = sum(reqs.values())
            fans = len({d.hex[:2] for d in (e.digest for e in src.manifest("data").values())})
            lists = reqs.get("ListObjectsV2", 0)
            rows.append(Row(f"no-op push of {n} objects, {label}: requests", float(total), float(n + 1), "requests",
                            ratio=(n + 1) / total, target=f"ListObjectsV2 <= 1 + {fans} prefixes, 0 PUT",
                            met=lists <= 1 + fans and reqs.get("PutObject", 0) == 0 and reqs.get("HeadObject", 0) == 0,
                            details={"requests": reqs, "prefixes_needed": fans, "seconds": summary(times)}))
            rows.append(Row(f"no-op push of {n} objects, {label}: time", median(times) * 1e3, None, "ms",
                            details={"seconds": summary(times)}))
            delete_prefix(client, prefix + "/")
    return rows


SCENARIOS = [bench_transfer_1mib, bench_transfer_4kib, bench_noop_push]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py: every remote benchmark, one list of rows."""
    try:
        return run_scenarios(SCENARIOS, quick)
    finally:
        SharedServer.stop()


if __name__ == "__main__":  # python benchmarks/bench_remote.py [--quick]
    from run import main

    sys.exit(main(["--only", "remote", *sys.argv[1:]]))
