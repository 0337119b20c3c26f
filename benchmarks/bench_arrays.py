"""Benchmarks of the numpy adapter and of derive/fetch cache hits (issue 4).

* ``get_array`` of 200 x 4 MiB float32 arrays vs ``np.load`` of the same arrays
  from ``.npy`` files (target >= 1.0x).  ``get_array`` verifies by default (it
  re-hashes the object while reading it); the ``verify=False`` row shows what
  the read alone costs.
* ``get_array(mmap=True)`` vs ``np.load(mmap_mode="r")`` of the same 200 arrays:
  opening only, nothing touched (target >= 0.5x).
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
    MiB,
    Row,
    bench_dir,
    interleave,
    limit_row,
    log,
    median,
    rate,
    ratio_row,
    run_scenarios,
    summary,
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

        log(f"get_array: {n} x 4 MiB, {reps} reps")
        res = interleave([Case("ref", ref_load), Case("cas", cas_get), Case("cas_nv", cas_get_noverify)], reps)
        t_ref, t_cas, t_nv = res["ref"]["total"], res["cas"]["total"], res["cas_nv"]["total"]
        rows.append(ratio_row(f"get_array {n} x 4 MiB float32, verify=True (ref: np.load of .npy files)",
                              rate(total / MB, t_cas), rate(total / MB, t_ref), "MB/s", min_ratio=1.0,
                              details={"casstore": summary(t_cas), "reference": summary(t_ref), "bytes": total}))
        # Like for like: np.load does not verify either.
        rows.append(ratio_row(f"get_array {n} x 4 MiB float32, verify=False (ref: np.load)",
                              rate(total / MB, t_nv), rate(total / MB, t_ref), "MB/s", min_ratio=1.0,
                              details={"casstore": summary(t_nv), "reference": summary(t_ref), "bytes": total}))

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


# -- 3: cache hits --------------------------------------------------------------------------------


def _noop_fn(inputs: Dict[str, Path], out: Path) -> None:
    (out / "sum.bin").write_bytes(b"".join(p.read_bytes() for _, p in sorted(inputs.items())))


def bench_cache_hits(quick: bool) -> List[Row]:
    calls = 300 if quick else 2000
    reps = 3 if quick else 7
    rows: List[Row] = []
    with bench_dir("derive-hit") as tmp:
        store = casstore.open(tmp / "store", durable=False)
        inputs = {f"in{i}": store.put(b"input %d " % i * 100) for i in range(10)}
        params = {"keys": ["energy", "coords", "charges"], "min_energy": -3.5, "filter": {"max_atoms": 29}}
        first = store.derive("bench/processed", inputs=inputs, params=params, fn=_noop_fn, version=1)
        src = tmp / "upstream.bin"
        src.write_bytes(os.urandom(1 << 16))
        url = src.as_uri()
        fetched = store.fetch(url)

        def cas_derive(_r: int) -> None:
            for _ in range(calls):
                m = store.derive("bench/processed", inputs=inputs, params=params, fn=_raise, version=1)
            assert m.digest == first.digest

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


def _raise(inputs: Dict[str, Path], out: Path) -> None:
    raise AssertionError("a cache hit must not run fn")


SCENARIOS = [bench_get_array, bench_cache_hits]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py."""
    return run_scenarios(SCENARIOS, quick)


if __name__ == "__main__":  # python benchmarks/bench_arrays.py [--quick]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import main

    sys.exit(main(["--only", "arrays", *sys.argv[1:]]))
