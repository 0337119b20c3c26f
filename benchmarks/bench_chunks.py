"""Content-defined chunks on remotes (issue 16) against a real SeaweedFS server on loopback.

What moves when a large file changes a little, chunked (the default) vs whole objects
(``chunking=None``, the layout before issue 16), in the same run:

* an HDF5 file (h5py, float32, 1 GiB; 256 MiB with --quick) with 1% of its rows rewritten in
  place, and the same file with 1% of rows appended: bytes pushed for version 2 after version 1,
  and bytes pulled into a store that holds version 1 (targets <= 5% of the file);
* a float32 "checkpoint" of 64 tensors of 16 MiB (``np.savez``) with 6 tensors changed
  (target <= 15%);
* fresh data (nothing shared): chunked push and pull of 1 GiB against the whole-object path
  (target >= 0.8x), and the chunker's own speed on 1 GiB in memory (target >= 1 GB/s), next
  to one core's BLAKE3 (the hash every chunk needs anyway) and the ``fastcdc`` package (peer).

Bytes are what push and pull report as transferred (chunk bytes for chunked objects); times
are medians of interleaved rounds, next to the whole-object push/pull of the same version.

    python benchmarks/bench_chunks.py [--quick]     # or: python benchmarks/run.py --only chunks
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, List, Tuple

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import numpy as np  # noqa: E402
from _harness import MiB, Row, bench_dir, log, median, rmtree, run_scenarios  # noqa: E402
from bench_remote import BUCKET, SharedServer, delete_prefix  # noqa: E402

import casstore  # noqa: E402


def _remote(prefix: str, chunked: bool) -> casstore.Remote:
    kw = {} if chunked else {"chunking": None}
    return casstore.Remote(f"s3://{BUCKET}/{prefix}", endpoint_url=SharedServer.get().endpoint, progress=False,
                           **kw)  # type: ignore[arg-type]


def _h5(path: Path, rows: int, cols: int = 256, seed: int = 0) -> None:
    import h5py

    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        ds = f.create_dataset("x", shape=(rows, cols), maxshape=(None, cols), dtype="f4", chunks=(1024, cols))
        step = 16384
        for i in range(0, rows, step):
            ds[i:i + step] = rng.standard_normal((min(step, rows - i), cols), dtype=np.float32)


def _rewrite_rows(path: Path, frac: float, seed: int) -> None:
    import h5py

    rng = np.random.default_rng(seed)
    with h5py.File(path, "r+") as f:
        ds = f["x"]
        n = max(1, int(ds.shape[0] * frac))
        start = int(rng.integers(0, ds.shape[0] - n))
        ds[start:start + n] = rng.standard_normal((n, ds.shape[1]), dtype=np.float32)


def _append_rows(path: Path, frac: float, seed: int) -> None:
    import h5py

    rng = np.random.default_rng(seed)
    with h5py.File(path, "r+") as f:
        ds = f["x"]
        n = max(1, int(ds.shape[0] * frac))
        old = ds.shape[0]
        ds.resize(old + n, axis=0)
        ds[old:] = rng.standard_normal((n, ds.shape[1]), dtype=np.float32)


def _checkpoint(path: Path, n: int, tensor_bytes: int, changed: Tuple[int, ...], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    tensors = {f"t{i:02d}": rng.standard_normal(tensor_bytes // 4, dtype=np.float32) for i in range(n)}
    other = np.random.default_rng(seed + 1000)
    for i in changed:
        tensors[f"t{i:02d}"] = other.standard_normal(tensor_bytes // 4, dtype=np.float32)
    with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a path
        np.savez(f, **tensors)


def _case(label: str, tmp: Path, make_v1: Callable[[Path], None], make_v2: Callable[[Path, Path], None],
          target: float, reps: int) -> List[Row]:
    """Push v1 then v2 (chunked and whole), pull v2 into a store holding v1; bytes and times."""
    v1, v2 = tmp / "v1.bin", tmp / "v2.bin"
    make_v1(v1)
    make_v2(v1, v2)
    size = v2.stat().st_size
    src = casstore.open(tmp / "src", durable=False)
    d1, d2 = src.put_path(v1), src.put_path(v2)
    client = SharedServer.client()
    pushed = {"chunked": [], "whole": []}  # type: ignore[var-annotated]
    pulled = {"chunked": [], "whole": []}  # type: ignore[var-annotated]
    times = {k: [] for k in ("push_chunked", "push_whole", "pull_chunked", "pull_whole")}  # type: ignore[var-annotated]
    for r in range(reps):
        for kind in (("chunked", "whole") if r % 2 == 0 else ("whole", "chunked")):
            prefix = f"chunks-{uuid.uuid4().hex[:8]}"
            rem = _remote(prefix, kind == "chunked")
            name = f"f-{uuid.uuid4().hex[:6]}"
            with src.edit(name) as m:
                m["file"] = d1
            src.push(rem, name)
            dst = casstore.open(tmp / f"dst-{prefix}", durable=False)
            dst.pull(rem, name)  # the store that holds version 1
            with src.edit(name) as m:
                m["file"] = d2
            t0 = time.perf_counter()
            rep = src.push(rem, name)
            times[f"push_{kind}"].append(time.perf_counter() - t0)
            pushed[kind].append(rep.bytes)
            t0 = time.perf_counter()
            rep = dst.pull(rem, name)
            times[f"pull_{kind}"].append(time.perf_counter() - t0)
            pulled[kind].append(rep.bytes)
            assert dst.objects.has(d2)
            rmtree(tmp / f"dst-{prefix}")
            delete_prefix(client, prefix + "/")
    rows: List[Row] = []
    for op, moved in (("push", pushed), ("pull", pulled)):
        frac = median(moved["chunked"]) / size
        rows.append(Row(f"{label}: {op} of version 2, bytes moved / file size", frac * 100, median(moved["whole"])
                        / size * 100, "%", ratio=median(moved["whole"]) / max(1.0, median(moved["chunked"])),
                        target=f"<= {target * 100:g}%", met=frac <= target,
                        details={"size": size, "chunked_bytes": moved["chunked"], "whole_bytes": moved["whole"]}))
        tc, tw = median(times[f"{op}_chunked"]), median(times[f"{op}_whole"])
        rows.append(Row(f"{label}: {op} of version 2, time chunked vs whole objects", tc * 1e3, tw * 1e3, "ms",
                        ratio=tw / tc, details={"chunked_s": times[f"{op}_chunked"], "whole_s": times[f"{op}_whole"]}))
    return rows


def _hdf5(quick: bool, what: str, edit: Callable[[Path], None]) -> List[Row]:
    rows_n = (256 if quick else 1024) * MiB // (256 * 4)
    label = f"HDF5 {rows_n * 1024 // MiB} MiB, 1% of rows {what}"
    with bench_dir(f"chunks-h5-{what}") as tmp:
        log(label)

        def v2(a: Path, b: Path) -> None:
            shutil.copyfile(a, b)
            edit(b)

        return _case(label, tmp, lambda p: _h5(p, rows_n), v2, 0.05, 2 if quick else 3)


def bench_hdf5_rewrite(quick: bool) -> List[Row]:
    """1 GiB HDF5, 1% of rows rewritten in place."""
    return _hdf5(quick, "rewritten", lambda p: _rewrite_rows(p, 0.01, 1))


def bench_hdf5_append(quick: bool) -> List[Row]:
    """1 GiB HDF5, 1% of rows appended."""
    return _hdf5(quick, "appended", lambda p: _append_rows(p, 0.01, 2))


def bench_checkpoint(quick: bool) -> List[Row]:
    """A checkpoint of 64 tensors of 16 MiB, 6 changed."""
    tensor = (4 if quick else 16) * MiB
    with bench_dir("chunks-ckpt") as tmp:
        log(f"checkpoint 64 x {tensor // MiB} MiB, 6 tensors changed")
        return _case(f"checkpoint 64 x {tensor // MiB} MiB, 6 tensors changed", tmp,
                     lambda p: _checkpoint(p, 64, tensor, ()),
                     lambda _a, b: _checkpoint(b, 64, tensor, (3, 17, 30, 41, 52, 60)), 0.15, 2 if quick else 3)


def bench_chunker_speed(quick: bool) -> List[Row]:
    """The chunker alone on fresh bytes in memory, next to one core's BLAKE3 and the fastcdc package."""
    import blake3

    from casstore.objects.chunking import DEFAULT_CHUNKING as C

    size = (256 if quick else 1024) * MiB
    buf = memoryview(np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8).tobytes())
    log(f"chunker on {size // MiB} MiB of fresh bytes")
    try:
        import fastcdc  # the peer; from pip (the bench extra)
    except ImportError:  # pragma: no cover - bench extra not installed
        fastcdc = None
    times: dict = {"pyfastcdc": [], "blake3": [], "fastcdc": []}  # type: ignore[type-arg]
    n_chunks = 0
    for r in range(4 if quick else 6):
        t0 = time.perf_counter()
        n_chunks = sum(1 for _ in C.cut(buf))
        t1 = time.perf_counter()
        blake3.blake3(buf).digest()  # one thread: the hash a push does per chunk anyway
        t2 = time.perf_counter()
        if fastcdc is not None:
            sum(1 for _ in fastcdc.fastcdc(buf, C.min_size, C.avg_size, C.max_size, fat=False))
        t3 = time.perf_counter()
        if r:  # round 0 warms up
            times["pyfastcdc"].append(t1 - t0)
            times["blake3"].append(t2 - t1)
            times["fastcdc"].append(t3 - t2)
    gbps = {k: size / median(v) / 1e9 for k, v in times.items() if v and median(v) > 0}
    rows = [Row("chunking fresh bytes (GB/s), pyfastcdc vs BLAKE3 on one core", gbps["pyfastcdc"], gbps["blake3"],
                "GB/s", ratio=gbps["pyfastcdc"] / gbps["blake3"], target=">= 1 GB/s",
                met=gbps["pyfastcdc"] >= 1.0, details={"chunks": n_chunks, "seconds": times})]
    if fastcdc is not None:
        rows.append(Row("chunking fresh bytes (GB/s), pyfastcdc vs the fastcdc package", gbps["pyfastcdc"],
                        gbps["fastcdc"], "GB/s", ratio=gbps["pyfastcdc"] / gbps["fastcdc"]))
    return rows


def bench_fresh(quick: bool) -> List[Row]:
    """Fresh 1 GiB (nothing shared): chunked push and pull against whole objects."""
    size = (256 if quick else 1024) * MiB
    reps = 2 if quick else 5  # single rounds swing 2x on this shared machine: a median of 5
    with bench_dir("chunks-fresh") as tmp:
        log(f"fresh {size // MiB} MiB push and pull, chunked vs whole")
        client = SharedServer.client()
        times = {k: [] for k in ("push_chunked", "push_whole", "pull_chunked", "pull_whole")}  # type: ignore[var-annotated]
        for r in range(reps + 1):  # round 0 warms up (server volumes, page cache)
            for kind in (("chunked", "whole") if r % 2 == 0 else ("whole", "chunked")):
                prefix = f"fresh-{uuid.uuid4().hex[:8]}"
                rem = _remote(prefix, kind == "chunked")
                f = tmp / "fresh.bin"
                with open(f, "wb") as out:  # new bytes every round: nothing to dedupe against
                    rng = np.random.default_rng(1000 + 2 * r + (kind == "whole"))
                    for _ in range(size // (64 * MiB)):
                        out.write(rng.integers(0, 256, 64 * MiB, dtype=np.uint8).tobytes())
                name = f"fresh-{uuid.uuid4().hex[:6]}"
                src = casstore.open(tmp / f"src-{prefix}", durable=False)
                with src.edit(name) as m:
                    m["file"] = d = src.put_path(f)
                t0 = time.perf_counter()
                src.push(rem, name)
                t1 = time.perf_counter()
                dst = casstore.open(tmp / f"dst-{prefix}", durable=False)
                t2 = time.perf_counter()
                dst.pull(rem, name)
                t3 = time.perf_counter()
                assert dst.objects.has(d)
                if r:
                    times[f"push_{kind}"].append(t1 - t0)
                    times[f"pull_{kind}"].append(t3 - t2)
                rmtree(tmp / f"dst-{prefix}")
                rmtree(tmp / f"src-{prefix}")
                delete_prefix(client, prefix + "/")
        rows = []
        for op in ("push", "pull"):
            tc, tw = median(times[f"{op}_chunked"]), median(times[f"{op}_whole"])
            rows.append(Row(f"fresh {size // MiB} MiB {op} (MiB/s), chunked vs whole objects", size / MiB / tc,
                            size / MiB / tw, "MiB/s", ratio=tw / tc, target=">= 0.8x", met=tw / tc >= 0.8,
                            details={"chunked_s": times[f"{op}_chunked"], "whole_s": times[f"{op}_whole"]}))
        return rows


SCENARIOS = [bench_chunker_speed, bench_fresh, bench_hdf5_rewrite, bench_hdf5_append, bench_checkpoint]


def run(quick: bool) -> List[Row]:
    """Entry point used by run.py."""
    try:
        return run_scenarios(SCENARIOS, quick)
    finally:
        SharedServer.stop()


if __name__ == "__main__":  # python benchmarks/bench_chunks.py [--quick]
    from run import main

    sys.exit(main(["--only", "chunks", *sys.argv[1:]]))
