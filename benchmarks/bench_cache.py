"""Benchmarks of casstore.IndexCache against pfio's caches (issue 5's speed targets).

    python benchmarks/run.py --only cache [--quick]
    python benchmarks/bench_cache.py [--quick]        # the same, standalone

Scenarios (each interleaves casstore and pfio round by round, drops a warm-up
round and reports medians; setup such as building a cache to read is untimed):

* 100,000 x 1 KiB: put ops/s vs pfio ``FileCache`` (>= 1.0x) and ``MultiprocessFileCache``
  (>= 5x; it fsyncs every put, so it is timed on fewer records); frozen get ops/s vs
  ``FileCache.get`` (>= 3x) and vs ``ReadOnlyFileCache`` after ``preload`` (>= 1.0x), for
  ``verify="full"`` (the default: every get checks its record's XXH3-64 checksum) and
  ``verify="open"`` (checked once; reads unchecked, like pfio's).  Loops discard results,
  as a training loop consumes each sample.
* 200 x 4 MiB: put and frozen get MiB/s vs ``FileCache`` (>= 0.8x).
* 1 and 2 reader processes over one frozen cache: aggregate get ops/s (2 readers >= 1.6x).
* ``preserve`` of a 1 GiB cache (durable store: hash + fsync + hard link; freeze included)
  next to ``shutil.copyfile`` of the same bytes, with and without fsync.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (  # noqa: E402
    Case,
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

import casstore  # noqa: E402
from casstore.cache import IndexCache  # noqa: E402


def _sync(_r: int = 0) -> None:
    """Untimed: flush dirty pages so one case's writeback does not bill the next."""
    os.sync()


def _records(n: int, size: int) -> List[bytes]:
    import numpy as np

    rng = np.random.default_rng(5)
    return [rng.bytes(size) for _ in range(n)]


def _det(cas: List[float], ref: List[float], **extra: Any) -> Dict[str, Any]:
    return {"casstore": summary(cas), "pfio": summary(ref), **extra}


# -- 1. 100,000 x 1 KiB ----------------------------------------------------------------


def bench_small(quick: bool) -> List[Row]:
    from pfio.cache import FileCache, MultiprocessFileCache, ReadOnlyFileCache

    n = 20_000 if quick else 100_000
    reps = 3 if quick else 9
    recs = _records(n, 1024)
    rows: List[Row] = []
    with bench_dir("cache-small") as tmp:
        store = casstore.open(tmp / "store")
        pdir = tmp / "pfio"
        pdir.mkdir()
        live: Dict[str, Any] = {}

        def cas_setup(_r: int) -> None:
            live["cas"] = IndexCache(store, n)

        def cas_put(_r: int) -> None:
            put = live["cas"].put
            for i in range(n):
                put(i, recs[i])

        def cas_down(_r: int) -> None:
            c = live.pop("cas")
            assert c.count == n and c.get(n - 1) == recs[-1]
            c.close()

        def pfio_setup(_r: int) -> None:
            live["pfio"] = FileCache(n, dir=str(pdir))

        def pfio_put(_r: int) -> None:
            put = live["pfio"].put
            for i in range(n):
                put(i, recs[i])

        def pfio_down(_r: int) -> None:
            live.pop("pfio").close()

        log(f"put {n:,} x 1 KiB")
        res = interleave([Case("pfio", pfio_put, pfio_setup, pfio_down), Case("cas", cas_put, cas_setup, cas_down)],
                         reps)
        cas_ops = rate(n, res["cas"]["total"])
        rows.append(ratio_row(f"put 1 KiB x {n:,} ops/s (ref: pfio FileCache.put)", cas_ops,
                              rate(n, res["pfio"]["total"]), "ops/s", min_ratio=1.0,
                              details=_det(res["cas"]["total"], res["pfio"]["total"])))

        m = 500 if quick else 2_000
        log(f"put {m:,} x 1 KiB into MultiprocessFileCache (fsync per put)")
        mp_times: List[float] = []
        for _ in range(3):
            mc = MultiprocessFileCache(m, dir=str(pdir))
            t0 = time.perf_counter()
            for i in range(m):
                mc.put(i, recs[i])
            mp_times.append(time.perf_counter() - t0)
            mc.close()
        rows.append(ratio_row(f"put 1 KiB ops/s (ref: pfio MultiprocessFileCache.put, {m:,} records)", cas_ops,
                              rate(m, mp_times), "ops/s", min_ratio=5.0,
                              details={"pfio": summary(mp_times), "records": m}))

        # Readers: one frozen casstore cache read three ways; pfio FileCache and ReadOnlyFileCache.
        log("frozen get")
        c = IndexCache(store, n)
        for i in range(n):
            c.put(i, recs[i])
        t0 = time.perf_counter()
        c.freeze()
        freeze_s = time.perf_counter() - t0
        c.preserve("bench-small")
        full = IndexCache.open(store, "bench-small")  # verify="full": whole digest, then a checksum per get
        fast = IndexCache.open(store, "bench-small", verify="open")  # checked once, reads unchecked
        live_c = IndexCache(store, n)
        for i in range(n):
            live_c.put(i, recs[i])
        f = FileCache(n, dir=str(pdir))
        for i in range(n):
            f.put(i, recs[i])
        f.preserve("bench-small")
        ro = ReadOnlyFileCache(n, dir=str(pdir))
        ro.preload("bench-small")
        f2 = FileCache(n, dir=str(pdir))
        for i in range(n):
            f2.put(i, recs[i])
        assert full.get(7) == fast.get(7) == f2.get(7) == ro.get(7) == recs[7]

        def loop(get: Any) -> Any:
            def run(_r: int) -> None:
                for i in range(n):
                    get(i)
            return run

        # Head-to-head pairs (two cases per interleave, so no third case's working set sits between them).
        res = interleave([Case("pfio", loop(f2.get)), Case("full", loop(full.get)), Case("live", loop(live_c.get))],
                         reps)
        res_ro = interleave([Case("rofc", loop(ro.get)), Case("full", loop(full.get))], reps)
        res_open = interleave([Case("rofc", loop(ro.get)), Case("open", loop(fast.get))], reps)
        res_open_pfio = interleave([Case("pfio", loop(f2.get)), Case("open", loop(fast.get))], reps)

        def open_case(verify: str) -> Any:
            def run(_r: int) -> None:
                IndexCache.open(store, "bench-small", verify=verify).close()
            return run

        def preload(_r: int) -> None:
            r = ReadOnlyFileCache(n, dir=str(pdir))
            r.preload("bench-small")
            r.close()

        opens = interleave([Case("rofc", preload), Case("record", open_case("record")),
                            Case("full", open_case("full"))], reps)
        def pair(what: str, r: Any, a: str, b: str, target: Any) -> Row:
            return ratio_row(what, rate(n, r[a]["total"]), rate(n, r[b]["total"]), "ops/s", min_ratio=target,
                             details=_det(r[a]["total"], r[b]["total"]))

        rows += [
            pair("frozen get 1 KiB ops/s, verify=full/XXH3 per get (ref: pfio FileCache.get)", res, "full", "pfio",
                 3.0),
            pair("frozen get 1 KiB ops/s, verify=full/XXH3 per get (ref: pfio ReadOnlyFileCache)", res_ro, "full",
                 "rofc", 1.0),
            pair("frozen get 1 KiB ops/s, verify=open/checked once (ref: pfio ReadOnlyFileCache)", res_open, "open",
                 "rofc", 1.0),
            pair("frozen get 1 KiB ops/s, verify=open/checked once (ref: pfio FileCache.get)", res_open_pfio, "open",
                 "pfio", 3.0),
            pair("  live (unfrozen) get 1 KiB ops/s, XXH3 (info; ref: pfio FileCache.get)", res, "live", "pfio",
                 None),
            Row(f"  freeze of {n:,} x 1 KiB written in index order (in place, no copy)", freeze_s, None, "s"),
            Row("  IndexCache.open, verify=record: seconds (ref: ReadOnlyFileCache.preload)",
                median(opens["record"]["total"]), median(opens["rofc"]["total"]), "s",
                median(opens["rofc"]["total"]) / median(opens["record"]["total"]), "info", None,
                details=_det(opens["record"]["total"], opens["rofc"]["total"])),
            Row("  IndexCache.open, verify=full (whole BLAKE3): seconds (ref: ReadOnlyFileCache.preload)",
                median(opens["full"]["total"]), median(opens["rofc"]["total"]), "s",
                median(opens["rofc"]["total"]) / median(opens["full"]["total"]), "info", None,
                details=_det(opens["full"]["total"], opens["rofc"]["total"])),
        ]
        for x in (c, full, fast, live_c):
            x.close()
        for y in (f, f2, ro):
            y.close()
    return rows


# -- 2. 200 x 4 MiB ----------------------------------------------------------------------


def bench_large(quick: bool) -> List[Row]:
    from pfio.cache import FileCache

    n = 50 if quick else 200
    reps = 3 if quick else 5
    size = 4 * MiB
    recs = _records(n, size)
    total_mib = n * size / MiB
    with bench_dir("cache-large") as tmp:
        store = casstore.open(tmp / "store")
        pdir = tmp / "pfio"
        pdir.mkdir()
        live: Dict[str, Any] = {}

        def cas_setup(r: int) -> None:
            _sync(r)
            live["cas"] = IndexCache(store, n)

        def cas_put(_r: int) -> None:
            c = live["cas"]
            for i in range(n):
                c.put(i, recs[i])

        def cas_down(_r: int) -> None:
            c = live.pop("cas")
            assert c.get(n - 1) == recs[-1]
            c.close()

        def pfio_setup(r: int) -> None:
            _sync(r)
            live["pfio"] = FileCache(n, dir=str(pdir))

        def pfio_put(_r: int) -> None:
            c = live["pfio"]
            for i in range(n):
                c.put(i, recs[i])

        def pfio_down(_r: int) -> None:
            live.pop("pfio").close()

        raw = tmp / "raw.bin"

        def raw_put(_r: int) -> None:
            """The machine: the same records appended to one new file (no fsync, like pfio)."""
            fd = os.open(raw, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                for i in range(n):
                    mv = memoryview(recs[i])
                    off = 0
                    while off < len(mv):
                        off += os.write(fd, mv[off:])
            finally:
                os.close(fd)

        def raw_down(_r: int) -> None:
            os.unlink(raw)

        log(f"put {n} x 4 MiB")
        res = interleave([Case("pfio", pfio_put, pfio_setup, pfio_down), Case("cas", cas_put, cas_setup, cas_down),
                          Case("write", raw_put, _sync, raw_down)], reps)
        put_c, put_p, put_w = res["cas"]["total"], res["pfio"]["total"], res["write"]["total"]

        # Reads: one frozen cache and one filled FileCache, read through handles that live across
        # rounds (as in a training run); plus a fresh handle per round (a new worker's first epoch).
        c = IndexCache(store, n)
        for i in range(n):
            c.put(i, recs[i])
        t0 = time.perf_counter()
        c.freeze()
        freeze_s = time.perf_counter() - t0
        c.preserve("bench-large")
        full = IndexCache.open(store, "bench-large", verify="record")
        fast = IndexCache.open(store, "bench-large", verify="open")
        f = FileCache(n, dir=str(pdir))
        for i in range(n):
            f.put(i, recs[i])
        assert full.get(3) == fast.get(3) == f.get(3) == recs[3]

        def loop(get: Any) -> Any:
            def run(_r: int) -> None:
                for i in range(n):
                    get(i)
            return run

        def fresh(_r: int) -> None:
            h = IndexCache.open(store, "bench-large", verify="record")  # untimed part is tiny: no whole hash
            for i in range(n):
                h.get(i)
            h.close()

        log(f"get {n} x 4 MiB")
        res = interleave([Case("pfio", loop(f.get)), Case("full", loop(full.get)), Case("fast", loop(fast.get)),
                          Case("fresh", fresh)], reps)
        for x in (c, full, fast):
            x.close()
        f.close()
    g = {k: v["total"] for k, v in res.items()}
    return [
        ratio_row(f"IndexCache.put 4 MiB x {n} MiB/s (ref: pfio FileCache.put; limit: os.write, one file)",
                  rate(total_mib, put_c), rate(total_mib, put_p), "MiB/s", min_ratio=0.8,
                  limit=max(rate(total_mib, put_w), rate(total_mib, put_p)),  # never below what pfio achieved
                  details=_det(put_c, put_p, write=summary(put_w))),
        ratio_row(f"frozen get 4 MiB x {n} MiB/s, verify=full/XXH3 per get (ref: pfio FileCache.get)",
                  rate(total_mib, g["full"]), rate(total_mib, g["pfio"]), "MiB/s", min_ratio=0.8,
                  details=_det(g["full"], g["pfio"])),
        ratio_row(f"frozen get 4 MiB x {n} MiB/s, verify=open/checked once (ref: pfio FileCache.get)",
                  rate(total_mib, g["fast"]), rate(total_mib, g["pfio"]), "MiB/s", min_ratio=0.8,
                  details=_det(g["fast"], g["pfio"])),
        ratio_row("  same, verify=full, new handle each pass: first epoch of a new worker (info)",
                  rate(total_mib, g["fresh"]), rate(total_mib, g["pfio"]), "MiB/s",
                  details=_det(g["fresh"], g["pfio"])),
        Row(f"  freeze of {n} x 4 MiB written in index order (in place, no copy)", freeze_s, None, "s"),
    ]


# -- 3. one vs two reader processes --------------------------------------------------------


def _reader(cache: IndexCache, n: int, passes: int, barrier: Any, out: Any) -> None:
    get = cache.get
    barrier.wait(60)
    t0 = time.perf_counter()
    for _ in range(passes):
        for i in range(n):
            get(i)
    out.put((t0, time.perf_counter()))


def bench_readers(quick: bool) -> List[Row]:
    n = 20_000 if quick else 100_000
    passes = 2 if quick else 3
    reps = 3 if quick else 5
    recs = _records(n, 1024)
    ctx = mp.get_context("fork")
    with bench_dir("cache-readers") as tmp:
        store = casstore.open(tmp / "store")
        c = IndexCache(store, n)
        for i in range(n):
            c.put(i, recs[i])
        c.freeze()

        def readers(k: int) -> Any:
            def run(_r: int) -> Dict[str, float]:
                barrier = ctx.Barrier(k)
                out = ctx.Queue()
                ps = [ctx.Process(target=_reader, args=(c, n, passes, barrier, out)) for _ in range(k)]
                for p in ps:
                    p.start()
                spans = [out.get(timeout=300) for _ in ps]
                for p in ps:
                    p.join(60)
                wall = max(e for _, e in spans) - min(s for s, _ in spans)
                return {"wall": wall}
            return run

        log(f"1 vs 2 reader processes, {passes} passes over {n:,} x 1 KiB")
        res = interleave([Case("one", readers(1)), Case("two", readers(2))], reps)
        c.close()
    one = rate(n * passes, res["one"]["wall"])
    two = rate(2 * n * passes, res["two"]["wall"])
    return [ratio_row("2 reader processes, aggregate frozen get ops/s (ref: 1 reader process)", two, one, "ops/s",
                      min_ratio=1.6, details={"one": summary(res["one"]["wall"]),
                                              "two": summary(res["two"]["wall"])})]


# -- 4. preserve of a 1 GiB cache ---------------------------------------------------------


def bench_preserve(quick: bool) -> List[Row]:
    size = 4 * MiB
    n = 64 if quick else 256
    total = n * size
    label = f"{total // MiB} MiB" if quick else "1 GiB"
    reps = 2 if quick else 3
    recs = _records(n, size)
    with bench_dir("cache-preserve") as tmp:
        store = casstore.open(tmp / "store")
        assert store.durable
        src = tmp / "src.bin"
        with open(src, "wb") as fh:
            for r in recs:
                fh.write(r)
        live: Dict[str, Any] = {}

        def build(order: List[int]) -> Any:
            def setup(r: int) -> None:
                _sync(r)  # earlier cases' dirty pages; this cache's own stay dirty: preserve must flush them
                c = IndexCache(store, n)
                for i in order:
                    c.put(i, recs[i] if r % 2 == 0 else recs[i][::-1])  # new bytes each round: no dedupe
                live["c"] = c
            return setup

        def preserve(r: int) -> Dict[str, float]:
            c = live["c"]
            t0 = time.perf_counter()
            c.freeze()
            t1 = time.perf_counter()
            c.preserve(f"p{r}-{time.monotonic_ns()}")
            return {"total": time.perf_counter() - t0, "freeze": t1 - t0}

        def down(_r: int) -> None:
            c = live.pop("c")
            c.close()
            for name in list(store.pins()):
                store.unpin(name)
            store.plan_gc(grace=0).execute()

        def copy(r: int) -> Dict[str, float]:
            dst = tmp / f"copy{r}.bin"
            t0 = time.perf_counter()
            shutil.copyfile(src, dst)
            t1 = time.perf_counter()
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            t2 = time.perf_counter()
            os.unlink(dst)
            return {"copy": t1 - t0, "copy_fsync": t2 - t0}

        log(f"preserve of a {label} cache")
        res = interleave([Case("copy", copy, _sync), Case("inorder", preserve, build(list(range(n))), down),
                          Case("shuffled", preserve, build(list(range(n))[::-1]), down)], reps)
    cp, io_, sh = res["copy"], res["inorder"], res["shuffled"]
    ct, cft = median(cp["copy"]), median(cp["copy_fsync"])
    return [
        Row(f"preserve {label}, written in index order: seconds (ref: shutil.copyfile)", median(io_["total"]), ct,
            "s", ct / median(io_["total"]), "info (no copy: hash+fsync+link)", None,
            details={"casstore": summary(io_["total"]), "freeze": summary(io_["freeze"]), "copy": summary(cp["copy"])}),
        Row(f"preserve {label}, written in index order: seconds (ref: copyfile + fsync)", median(io_["total"]), cft,
            "s", cft / median(io_["total"]), "info", None, details={"copy_fsync": summary(cp["copy_fsync"])}),
        Row(f"preserve {label}, written out of order (compacted once): seconds (ref: copyfile + fsync)",
            median(sh["total"]), cft, "s", cft / median(sh["total"]), "info", None,
            details={"casstore": summary(sh["total"]), "freeze": summary(sh["freeze"])}),
    ]


SCENARIOS = [bench_small, bench_large, bench_readers, bench_preserve]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py: every index-cache benchmark, one list of rows."""
    return run_scenarios(SCENARIOS, quick)


if __name__ == "__main__":  # python benchmarks/bench_cache.py [--quick]
    from run import main

    sys.exit(main(["--only", "cache", *sys.argv[1:]]))
