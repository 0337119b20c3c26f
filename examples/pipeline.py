"""Download -> unzip -> preprocess, run by 4 processes at once on one store.

    python examples/pipeline.py [--store DIR]

Serves a gzipped HDF5 file from 127.0.0.1 (no internet needed), then starts 4
worker processes that each run the same three steps.  Each step runs exactly
once; the other workers wait and read the result.  Run it twice with the same
--store: nothing is recomputed (the demo server gets a new port, so its URL is
new and is downloaded once more, but the bytes, their digest and so every
derive key are the same).
"""

from __future__ import annotations

import argparse
import functools
import gzip
import http.server
import multiprocessing as mp
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict

import h5py
import numpy as np

import casstore


def gunzip(inputs: Dict[str, Path], out: Path) -> None:
    print(f"  [pid {mp.current_process().pid}] unzipping", flush=True)
    (out / "qm9.h5").write_bytes(gzip.decompress(inputs["gz"].read_bytes()))


def build_npz(inputs: Dict[str, Path], out: Path, keys=("energy", "charges")) -> None:  # type: ignore[no-untyped-def]
    print(f"  [pid {mp.current_process().pid}] preprocessing", flush=True)
    with h5py.File(inputs["h5"], "r", locking=False) as f:
        arrays = {k: f[k][:] for k in keys}
    arrays["energy"] = arrays["energy"][arrays["energy"] < 0.9]
    np.savez(out / "processed.npz", **arrays)


def worker(store_dir: str, url: str, results: mp.Queue[str]) -> None:
    store = casstore.open(store_dir)
    gz = store.fetch(url)
    h5 = store.derive("qm9/unzipped", inputs={"gz": gz}, fn=gunzip)
    npz = store.derive("qm9/processed", inputs={"h5": h5}, params={"keys": ["energy", "charges"], "max": 0.9},
                       fn=build_npz)
    results.put(str(npz["processed.npz"].digest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", default=None, help="store directory (default: the casstore default)")
    args = ap.parse_args()
    store = casstore.open(args.store)
    with tempfile.TemporaryDirectory() as srv:
        rng = np.random.default_rng(0)
        with h5py.File(Path(srv) / "raw.h5", "w") as f:
            f["energy"] = rng.random(200_000)
            f["charges"] = rng.integers(0, 9, size=(200_000, 29), dtype=np.int8)
        (Path(srv) / "qm9.hdf5.gz").write_bytes(gzip.compress((Path(srv) / "raw.h5").read_bytes(), 1, mtime=0))
        counts: Dict[str, int] = {}

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                counts[self.path] = counts.get(self.path, 0) + 1

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=srv))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{httpd.server_port}/qm9.hdf5.gz"
        t0 = time.perf_counter()
        q: mp.Queue[str] = mp.Queue()
        procs = [mp.Process(target=worker, args=(str(store.root), url, q)) for _ in range(4)]
        for p in procs:
            p.start()
        digests = {q.get() for _ in procs}
        for p in procs:
            p.join()
        httpd.shutdown()
    print(f"4 workers finished in {time.perf_counter() - t0:.2f}s; downloads: {sum(counts.values())}; "
          f"distinct results: {len(digests)}")
    man = store.manifest("qm9/processed")
    rec = man.meta["derive"]
    print(f"qm9/processed = {man.digest.short()} made from {rec['inputs']} with params {rec['params']} "
          f"in {rec['seconds']:.3f}s")


if __name__ == "__main__":
    main()
