"""Benchmarks of the numpy adapter and of derive/fetch cache hits (issues 4 and 15).

* ``get_array`` of 200 x 4 MiB float32 arrays vs ``np.load`` of the same arrays
  from ``.npy`` files, and vs the machine's limit for a verified read measured
  in the same interleave (``np.load`` as the read, one core's BLAKE3 of the
  same bytes; target >= 0.8x of the limit).  ``get_array`` verifies by default
  (it re-hashes the object while reading it); the ``verify=False`` row shows
  what the read alone costs.
* ``get_array(mmap=True)`` vs ``np.load(mmap_mode="r")`` of the same 200 arrays:
  opening only, nothing touched (target >= 0.5x).
* ``get_array(mmap=True, verify=True)``: the first map of each file (which
  hashes it) vs BLAKE3 of the files (>= 0.8x); later maps in ms vs
  ``verify=False`` maps (>= 0.8x).
* ``put_array`` vs ``np.save`` to a new file, + fsync of the file and its
  directory for a durable store (>= 0.9x each); the limit is ``os.write`` of the
  same bytes with the same fsyncs.
* ``derive`` cache hit for 10 inputs (key computation + manifest read), and a
  ``fetch`` cache hit: microseconds per call (derive target < 1 ms).

The store and the ``.npy`` files live side by side in one temp dir on the real
disk and are read from the page cache (both were just written and read in the
warm-up round).  casstore and the reference are interleaved round by round.
Each loaded array is dropped before the next one is loaded, for both sides, so
neither pays for keeping 800 MiB of fresh pages resident.

    python benchmarks/bench_arrays.py [--quick]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
from _harness import (
    MB,
    Case,
    HashPool,
    MiB,
    Row,
    bench_dir,
    delete_objects,
    fsync_path,
    interleave,
    limit_row,
    log,
    median,
    rate,
    ratio_row,
    read_limit_s,
    readinto_case,
    run_scenarios,
    summary,
    time_row,
    write_case,
)

import casstore

REPS = 5  # measured rounds (after one warm-up round); 3 with --quick
ARRAY_BYTES = 4 * MiB


def _arrays(n: int) -> List[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(4)
    return [rng.random(ARRAY_BYTES // 4, dtype=np.float32) for _ in range(n)]


# -- 1 + 2: get_array / get_array(mmap=True) vs np.load ------------------------------------------


def bench_get_array(quick: bool) -> List[Row]:
    n = 50 if quick else 200
    reps = 3 if quick else REPS
    total = n * ARRAY_BYTES
    rows: List[Row] = []
    with bench_dir("arrays") as tmp:
        store = casstore.open(tmp / "store", compress=False, durable=False)
        npy = tmp / "npy"
        npy.mkdir()
        arrays = _arrays(n)
        digests = [store.put_array(a) for a in arrays]
        paths = [npy / f"{i:03d}.npy" for i in range(n)]
        for p, a in zip(paths, arrays, strict=True):
            np.save(p, a)
        # Same bytes on both sides: each object is exactly the .npy file np.save wrote.
        assert all(store.stat(d).size == p.stat().st_size for d, p in zip(digests, paths, strict=True))
        check = [(d, p, float(a[:: 4099].sum())) for d, p, a in list(zip(digests, paths, arrays, strict=True))[:3]]
        del arrays
        os.sync()

        def ref_load(_r: int) -> None:
            for p in paths:
                a = np.load(p)
            del a

        def cas_get(_r: int) -> None:
            for d in digests:
                a = store.get_array(d)
            del a

        def cas_get_noverify(_r: int) -> None:
            for d in digests:
                a = store.get_array(d, verify=False)
            del a

        for d, p, s in check:  # untimed sanity check of what is timed
            assert float(store.get_array(d)[:: 4099].sum()) == s == float(np.load(p)[:: 4099].sum())

        # The machine, in the same interleave: one core's BLAKE3 of as many bytes (object by object),
        # and the plainest read of the same files (readinto one preallocated buffer).
        pool = HashPool()
        size = paths[0].stat().st_size
        log(f"get_array: {n} x 4 MiB, {reps} reps")
        res = interleave([Case("ref", ref_load), Case("cas", cas_get), Case("cas_nv", cas_get_noverify),
                          pool.case("hash1", n * size, piece=size), readinto_case("readinto", paths, bytearray(size))],
                         reps, usage=(usage := {}))
        t_ref, t_cas, t_nv = res["ref"]["total"], res["cas"]["total"], res["cas_nv"]["total"]
        t_h1, t_ri = res["hash1"]["total"], res["readinto"]["total"]
        # The limit: np.load is the read; the hash of the same bytes spread over the second core.
        lim = read_limit_s(median(t_ref), median(t_h1))
        mb = n * size / MB
        rows.append(ratio_row(f"get_array {n} x 4 MiB float32, verify=True (ref: np.load of .npy files)",
                              rate(total / MB, t_cas), rate(total / MB, t_ref), "MB/s", limit=mb / lim,
                              min_of_limit=0.8,
                              details={"casstore": summary(t_cas), "reference": summary(t_ref), "bytes": total,
                                       "blake3_1core": summary(t_h1), "limit_s": lim,
                                       "usage": {k: usage[k] for k in ("ref", "cas")}}))
        # Like for like: np.load does not verify either.
        rows.append(ratio_row(f"  get_array {n} x 4 MiB float32, verify=False (ref and limit: np.load)",
                              rate(total / MB, t_nv), rate(total / MB, t_ref), "MB/s", min_ratio=1.0,
                              limit=rate(total / MB, t_ref),
                              details={"casstore": summary(t_nv), "reference": summary(t_ref), "bytes": total}))
        rows.append(ratio_row("  machine: readinto 1 buffer (casstore col.), BLAKE3 1 core (ref col.), same files",
                              rate(mb, t_ri), rate(mb, t_h1), "MB/s",
                              details={"readinto": summary(t_ri), "blake3_1core": summary(t_h1)}))

        maps: List[Any] = []

        def ref_mmap(_r: int) -> None:
            for p in paths:
                maps.append(np.load(p, mmap_mode="r"))

        def cas_mmap(_r: int) -> None:
            for d in digests:
                maps.append(store.get_array(d, mmap=True))

        def drop(_r: int) -> None:
            assert len(maps) == n and all(isinstance(m, np.memmap) for m in maps)
            maps.clear()

        mreps = 5 if quick else 11  # cheap: more rounds
        log(f"get_array(mmap=True): {n} opens, {mreps} reps")
        res = interleave([Case("ref", ref_mmap, teardown=drop), Case("cas", cas_mmap, teardown=drop)], mreps)
        m_ref, m_cas = res["ref"]["total"], res["cas"]["total"]
        rows.append(ratio_row(f"get_array(mmap=True) open x {n} (ref: np.load(mmap_mode='r'))",
                              rate(n, m_cas), rate(n, m_ref), "ops/s", min_ratio=0.5,
                              details={"casstore": summary(m_cas), "reference": summary(m_ref),
                                       "us_per_open_casstore": 1e6 * median(m_cas) / n,
                                       "us_per_open_reference": 1e6 * median(m_ref) / n}))
    return rows


# -- 3: get_array(mmap=True, verify=True): hash once per file and process, then map --------------


def _probe_mmap_verify(tmp: Path) -> None:
    """Refuse to time get_array(mmap=True, verify=True) before it verifies (a corrupt map must raise)."""
    store = casstore.open(tmp / "probe", compress=False, durable=False)
    d = store.put_array(np.arange(1 << 16, dtype=np.float32))
    path = store.path(d)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:  # one data byte flipped, size unchanged: only a hash can tell
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    try:
        store.get_array(d, mmap=True, verify=True)
    except casstore.IntegrityError:
        return
    except TypeError as e:  # an older signature
        raise RuntimeError(f"get_array(mmap=True, verify=True) is not available yet ({e})") from None
    raise RuntimeError("get_array(mmap=True, verify=True) does not verify yet: it mapped a corrupt object")


def bench_mmap_verify(quick: bool) -> List[Row]:
    import blake3

    n = 50 if quick else 200
    reps = 3 if quick else REPS
    with bench_dir("mmap-verify") as tmp:
        _probe_mmap_verify(tmp)
        store = casstore.open(tmp / "store", compress=False, durable=False)
        digests = [store.put_array(a) for a in _arrays(n)]
        files = [str(store.path(d)) for d in digests]
        size = os.stat(files[0]).st_size
        maps: List[Any] = []
        os.sync()

        def hash_files(threads: int) -> Case:
            mt = blake3.blake3.AUTO if threads == 0 else threads

            def run(_r: int) -> None:
                for p in files:
                    blake3.blake3(max_threads=mt).update_mmap(p).digest()
            return Case(f"hash{threads}", run)

        def forget(_r: int) -> None:
            # A new mtime (and ctime) is a new (device, inode, size, mtime_ns) key: every map hashes again.
            for p in files:
                os.utime(p)

        def opens(verify: bool) -> Any:
            def run(_r: int) -> None:
                for d in digests:
                    maps.append(store.get_array(d, mmap=True, verify=verify))
            return run

        def warm(_r: int) -> None:
            for d in digests:
                store.get_array(d, mmap=True, verify=True)

        def drop(_r: int) -> None:
            assert len(maps) == n and all(isinstance(m, np.memmap) for m in maps)
            maps.clear()

        log(f"get_array(mmap=True, verify=True): {n} x 4 MiB, {reps} reps")
        res = interleave([hash_files(1), hash_files(0), Case("first", opens(True), forget, drop),
                          Case("later", opens(True), warm, drop), Case("nv", opens(False), teardown=drop)], reps)
    t_first, t_later, t_nv = res["first"]["total"], res["later"]["total"], res["nv"]["total"]
    t_h1, t_hmt = res["hash1"]["total"], res["hash0"]["total"]
    t_hash = t_h1 if median(t_h1) <= median(t_hmt) else t_hmt  # the faster way to hash the files
    mb = n * size / MB
    return [
        ratio_row(f"get_array(mmap=True, verify=True) first open x {n} 4 MiB (ref: BLAKE3 of the files)",
                  rate(mb, t_first), rate(mb, t_hash), "MB/s", min_ratio=0.8,
                  details={"casstore": summary(t_first), "blake3_1core_update_mmap": summary(t_h1),
                           "blake3_auto_update_mmap": summary(t_hmt), "files": n, "bytes_each": size}),
        time_row("  later opens (verified once): ms per open (ref: get_array(mmap=True, verify=False))",
                 median(t_later) / n, median(t_nv) / n, "ms", min_ratio=0.8,
                 details={"casstore": summary(t_later), "reference": summary(t_nv), "opens_per_round": n}),
    ]


# -- 4: put_array vs np.save (+ fsync of the file and its directory for a durable store) ----------


def bench_put_array(quick: bool) -> List[Row]:
    n = 50 if quick else 100
    reps = 3 if quick else REPS
    arrays = _arrays(n)
    with bench_dir("put-array") as tmp:
        durable = casstore.open(tmp / "durable", compress=False)
        scratch = casstore.open(tmp / "scratch", compress=False, durable=False)
        assert durable.durable and not scratch.durable
        npy = tmp / "npy"
        npy.mkdir()
        fsync_path(tmp)
        paths = [npy / f"{i:03d}.npy" for i in range(n)]

        def np_save(sync: bool) -> Any:
            def run(_r: int) -> None:
                dfd = os.open(npy, os.O_RDONLY | os.O_DIRECTORY) if sync else -1
                try:
                    for p, a in zip(paths, arrays, strict=True):
                        with open(p, "wb") as f:
                            np.save(f, a)
                            if sync:  # the same durability as a durable store: file, then its directory
                                f.flush()
                                os.fsync(f.fileno())
                        if sync:
                            os.fsync(dfd)
                finally:
                    if sync:
                        os.close(dfd)
            return run

        def unlink_npy(_r: int) -> None:
            for p in paths:
                p.unlink()

        def put(store: casstore.Store) -> Any:
            def run(_r: int) -> None:
                for a in arrays:
                    store.put_array(a)
            return run

        def empty(store: casstore.Store) -> Any:
            def down(_r: int) -> None:
                assert delete_objects(store.root) == n  # else the next round's puts would dedupe
            return down

        def sync(_r: int) -> None:
            os.sync()  # untimed: the previous case's dirty pages are not flushed on this one's clock

        # The machine: the same bytes (the array data) written to new files, with and without fsync.
        payloads = [memoryview(a).cast("B") for a in arrays]
        log(f"put_array: {n} x 4 MiB, {reps} reps")
        res = interleave([Case("save_sync", np_save(True), sync, unlink_npy),
                          Case("put_durable", put(durable), sync, empty(durable)),
                          write_case("write_sync", payloads, tmp, durable=True),
                          Case("save", np_save(False), sync, unlink_npy),
                          Case("put_scratch", put(scratch), sync, empty(scratch)),
                          write_case("write", payloads, tmp, durable=False)], reps)
    mb = sum(a.nbytes for a in arrays) / MB
    t = {k: v["total"] for k, v in res.items()}

    def det(cas: str, ref: str, lim: str) -> Dict[str, Any]:
        return {"casstore": summary(t[cas]), "reference": summary(t[ref]), "limit_write": summary(t[lim])}

    def lim(ref: str, write: str) -> float:
        # The plain write of the same bytes, or the reference if that measured faster (noise): a limit
        # is never below what a plain tool achieved in the same run.
        return max(rate(mb, t[ref]), rate(mb, t[write]))

    return [
        ratio_row(f"put_array {n} x 4 MiB float32, durable (ref: np.save + fsync file + dir)",
                  rate(mb, t["put_durable"]), rate(mb, t["save_sync"]), "MB/s", min_ratio=0.9,
                  limit=lim("save_sync", "write_sync"), details=det("put_durable", "save_sync", "write_sync")),
        ratio_row(f"put_array {n} x 4 MiB float32, durable=False (ref: np.save)",
                  rate(mb, t["put_scratch"]), rate(mb, t["save"]), "MB/s", min_ratio=0.9,
                  limit=lim("save", "write"), details=det("put_scratch", "save", "write")),
    ]


# -- 5: cache hits --------------------------------------------------------------------------------


_RUNS = [0]


def _noop_fn(inputs: Dict[str, Path], out: Path) -> None:
    _RUNS[0] += 1  # counted: a cache hit must not run fn (derive fingerprints fn's code, so hits reuse it)
    (out / "sum.bin").write_bytes(b"".join(p.read_bytes() for _, p in sorted(inputs.items())))


def bench_cache_hits(quick: bool) -> List[Row]:
    calls = 300 if quick else 2000
    reps = 3 if quick else 7
    rows: List[Row] = []
    with bench_dir("derive-hit") as tmp:
        store = casstore.open(tmp / "store", durable=False)
        inputs = {f"in{i}": store.put(b"input %d " % i * 100) for i in range(10)}
        params = {"keys": ["energy", "coords", "charges"], "min_energy": -3.5, "filter": {"max_atoms": 29}}
        _RUNS[0] = 0
        first = store.derive("bench/processed", inputs=inputs, params=params, fn=_noop_fn, version=1)
        src = tmp / "upstream.bin"
        src.write_bytes(os.urandom(1 << 16))
        url = src.as_uri()
        fetched = store.fetch(url)

        def cas_derive(_r: int) -> None:
            for _ in range(calls):
                m = store.derive("bench/processed", inputs=inputs, params=params, fn=_noop_fn, version=1)
            assert m.digest == first.digest and _RUNS[0] == 1, "a cache hit ran fn"

        def ref_manifest(_r: int) -> None:  # the manifest read alone (part of every hit)
            for _ in range(calls):
                m = store.manifest("bench/processed")
            assert m.digest == first.digest

        def cas_fetch(_r: int) -> None:
            for _ in range(calls):
                d = store.fetch(url)
            assert d == fetched

        log(f"cache hits: {calls} calls, {reps} reps")
        res = interleave([Case("manifest", ref_manifest), Case("derive", cas_derive), Case("fetch", cas_fetch)],
                         reps)
        us = {k: 1e6 * median(v["total"]) / calls for k, v in res.items()}
        rows.append(limit_row("derive cache hit, 10 inputs: key + manifest read (ref: store.manifest alone)",
                              us["derive"], "us", max_value=1000.0, reference=us["manifest"],
                              details={"casstore": summary(res["derive"]["total"]), "calls": calls,
                                       "reference": summary(res["manifest"]["total"])}))
        rows.append(Row("fetch cache hit (file:// URL already fetched)", us["fetch"], None, "us",
                        details={"casstore": summary(res["fetch"]["total"]), "calls": calls}))
    return rows


SCENARIOS = [bench_get_array, bench_mmap_verify, bench_put_array, bench_cache_hits]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py."""
    return run_scenarios(SCENARIOS, quick)


if __name__ == "__main__":  # python benchmarks/bench_arrays.py [--quick]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import main

    sys.exit(main(["--only", "arrays", *sys.argv[1:]]))
