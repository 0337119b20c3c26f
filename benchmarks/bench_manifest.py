"""Benchmarks of manifests (issue 3): commit latency, frozen reads, contended edits.

Rows:

* ``edit`` commit of a 10-entry change to a 10,000-entry manifest, next to the
  bare floor of rewriting the same msgpack document (pack + write + fsync +
  rename + fsync dir);
* reading a frozen 100,000-entry manifest whole (``store.manifest(pin)``, lock-free,
  verified, every entry iterated) against ``msgpack.unpackb`` of the same entries as
  one flat document read from a plain file (target >= 0.8x).  Since 2026-12-02 a
  manifest this large is tree-shaped (issue 12: docs/format.md), so a whole read is
  ~14,000 verified node reads, not one document; until 2026-12-03 this row compared
  ``store.manifest`` (which now reads only the version object and root) with
  ``unpackb`` of the version object, which measured neither;
* 4 processes x 500 one-key edits on one name, commits/s, next to a bare
  ``filelock`` + temp file + ``os.replace`` loop doing the same updates of one
  msgpack file (target >= 0.5x), both durable (fsync) and both scratch.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Dict, List

import filelock
import msgpack
from _harness import Case, Row, bench_dir, interleave, log, median, ratio_row, run_scenarios, summary

import casstore
from casstore.manifests.model import clear_node_cache

REPS = 7


def _fill(store: casstore.Store, name: str, n: int) -> None:
    ds = store.put_many([i.to_bytes(4, "little") for i in range(1000)])
    with store.edit(name) as m:
        for i in range(n):
            m[f"data/{i:07d}.bin"] = casstore.Entry(ds[i % 1000], 4)


def bench_commit(quick: bool) -> List[Row]:
    n = 10_000
    with bench_dir("manifest-commit") as tmp:
        store = casstore.open(tmp / "store")
        _fill(store, "big", n)
        d = store.put(b"payload")
        plain = tmp / "plain.msgpack"
        # The reference rewrites a plain one-document manifest of the same entries (10,000 entries
        # is above the tree threshold, so the stored version itself is a tree root: no "entries").
        doc = {"entries": {k: [e.digest.raw, e.size] for k, e in store.manifest("big").items()}}

        def cas(r: int) -> None:
            with store.edit("big") as m:
                for j in range(10):
                    m[f"new/{r}/{j}"] = d

        def ref(r: int) -> None:
            for j in range(10):
                doc["entries"][f"new/{r}/{j}"] = [d.raw, 7]
            data = msgpack.packb(doc, use_bin_type=True)
            tmpf = tmp / f"plain.{r}.tmp"
            with open(tmpf, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmpf, plain)
            fd = os.open(tmp, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)

        s = interleave([Case("ref", ref), Case("cas", cas)], REPS)
    cas_ms = median(s["cas"]["total"]) * 1e3
    ref_ms = median(s["ref"]["total"]) * 1e3
    return [Row("edit commit, 10 changes to a 10,000-entry manifest, durable (ref: msgpack rewrite+fsync+rename)",
                cas_ms, ref_ms, "ms", ref_ms / cas_ms, "report ms", None,
                details={"cas": summary(s["cas"]["total"]), "ref": summary(s["ref"]["total"])})]


def bench_frozen_read(quick: bool) -> List[Row]:
    n = 20_000 if quick else 100_000
    with bench_dir("manifest-read") as tmp:
        store = casstore.open(tmp / "store")
        _fill(store, "big", n)
        pin = store.freeze("big")
        frozen = store.manifest(pin)
        # The same entries as one flat document (format 1), what the reference reads and decodes.
        flat = {"casstore": "manifest", "entries": dict(frozen.entries.raw_items()), "meta": {}, "parent": None,
                "v": 1}
        plain = tmp / "plain.msgpack"
        plain.write_bytes(msgpack.packb(flat, use_bin_type=True))

        def ref(_r: int) -> None:
            assert len(msgpack.unpackb(plain.read_bytes(), raw=False)["entries"]) == n

        def cas(_r: int) -> None:
            clear_node_cache()  # a fresh reader: no node decoded before
            m = casstore.open(tmp / "store").manifest("big")
            assert sum(1 for _ in m.entries.raw_items()) == n

        s = interleave([Case("ref", ref), Case("cas", cas)], REPS)
    rc = median(s["ref"]["total"]) / median(s["cas"]["total"])
    return [ratio_row(f"read frozen {n:,}-entry manifest whole, verified (ref: read flat file + msgpack.unpackb)",
                      1 / median(s["cas"]["total"]), 1 / median(s["ref"]["total"]), "reads/s", min_ratio=0.8,
                      details={"cas": summary(s["cas"]["total"]), "ref": summary(s["ref"]["total"]),
                               "ratio": rc})]


def _cas_worker(root: str, proc: int, n: int, durable: bool, start: mp.synchronize.Event) -> None:
    store = casstore.open(root, durable=durable)
    d = store.put(b"x")
    start.wait()
    for i in range(n):
        with store.edit("shared") as m:
            m[f"p{proc}/k{i}"] = d


def _bare_worker(path: str, proc: int, n: int, durable: bool, start: mp.synchronize.Event) -> None:
    lock = filelock.FileLock(path + ".lock")
    digest = os.urandom(32)
    start.wait()
    for i in range(n):
        with lock:
            try:
                with open(path, "rb") as f:
                    doc = msgpack.unpackb(f.read(), raw=False)
            except FileNotFoundError:
                doc = {"entries": {}}
            doc["entries"][f"p{proc}/k{i}"] = [digest, 1]
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(msgpack.packb(doc, use_bin_type=True))
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            if durable:
                fd = os.open(os.path.dirname(path), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)


def _run_procs(target: object, arg: str, procs: int, n: int, durable: bool) -> float:
    ctx = mp.get_context("fork")
    start = ctx.Event()
    ps = [ctx.Process(target=target, args=(arg, p, n, durable, start)) for p in range(procs)]  # type: ignore[arg-type]
    for p in ps:
        p.start()
    time.sleep(0.3)  # let every worker open its store and reach the start line
    t0 = time.perf_counter()
    start.set()
    for p in ps:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"worker exited with {p.exitcode}")
    return time.perf_counter() - t0


def _contended(procs: int, n: int, reps: int, durable: bool) -> Row:
    with bench_dir("manifest-contended") as tmp:
        counter = [0]
        last: List[Path] = []

        def cas(_r: int) -> Dict[str, float]:
            counter[0] += 1
            root = tmp / f"store{counter[0]}"
            casstore.open(root, durable=durable)
            last[:] = [root]
            return {"total": _run_procs(_cas_worker, str(root), procs, n, durable)}

        def ref(_r: int) -> Dict[str, float]:
            counter[0] += 1
            d = tmp / f"bare{counter[0]}"
            d.mkdir()
            return {"total": _run_procs(_bare_worker, str(d / "manifest.msgpack"), procs, n, durable)}

        s = interleave([Case("ref", ref), Case("cas", cas)], reps)
        keys = len(casstore.open(last[0]).manifest("shared"))
    total = procs * n
    label = "durable" if durable else "scratch (no fsync)"
    log(f"contended {label}: keys in last casstore run {keys} (expected {total})")
    return ratio_row(
        f"{procs} procs x {n} one-key edits, {label} (ref: filelock + tmp + os.replace)",
        total / median(s["cas"]["total"]), total / median(s["ref"]["total"]), "commits/s", min_ratio=0.5,
        details={"cas": summary(s["cas"]["total"]), "ref": summary(s["ref"]["total"]), "keys_last": keys})


def bench_contended(quick: bool) -> List[Row]:
    procs, n = 4, (100 if quick else 500)
    reps = 3 if quick else 5
    return [_contended(procs, n, reps, durable) for durable in (True, False)]


SCENARIOS = [bench_commit, bench_frozen_read, bench_contended]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py."""
    return run_scenarios(SCENARIOS, quick)


if __name__ == "__main__":  # python benchmarks/bench_manifest.py [--quick]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import main

    sys.exit(main(["--only", "manifest", *sys.argv[1:]]))
