"""A modelforge-style dataset loader run by 8 ranks at once: fetch .hdf5.gz -> gunzip -> .npz.

    python examples/modelforge_loader.py                    # 8 ranks, 200 molecules, a temp store
    python examples/modelforge_loader.py --store /tmp/mf-store --molecules 2000 --ranks 8

What it does, step by step:

1. Generates a small modelforge-style curated dataset (one HDF5 group per molecule holding
   ragged arrays: ``atomic_numbers`` (n_atoms, 1), ``geometry`` and ``forces``
   (n_confs, n_atoms, 3), ``partial_charges`` (n_confs, n_atoms, 1),
   ``internal_energy`` (n_confs, 1), ``dipole_moment`` (n_confs, 3)), gzips it and serves it
   over HTTP on 127.0.0.1 (no internet needed).
2. Launches ``--ranks`` separate processes (as ``torchrun``/``srun`` would); every rank runs
   the same three steps on the same store::

       gz  = store.fetch(url)                                        # downloaded once
       h5  = store.derive("mf/unzipped", inputs={"gz": gz}, fn=gunzip)      # run once
       npz = store.derive("mf/processed", inputs={"h5": h5}, fn=process)     # run once
       data = load_npz(store.path(npz["processed.npz"].digest))      # every rank loads it

   and prints one JSON line with its timings and whether it did the work of a step.
3. Runs the job twice: cold (a new store: one rank downloads, one unzips, one processes, the
   others wait and read) and warm (everything is a cache hit).

The processing is modelforge's ``_from_hdf5`` in miniature: the per-molecule ragged arrays are
concatenated into flat per-atom and per-conformer arrays plus the counts that index them
(``atomic_subsystem_counts``, ``n_confs``), written with ``np.savez``.

benchmarks/bench_jobs.py imports this module (the dataset generator, the step functions and
:func:`cas_rank`) and compares it with a naive exists-check loader.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import h5py
import numpy as np

import casstore

HDF5_NAME = "mf_dataset.hdf5"
GZ_NAME = HDF5_NAME + ".gz"
NPZ_NAME = "processed.npz"
PER_ATOM = ("geometry", "forces", "partial_charges")
PER_CONF = ("internal_energy", "dipole_moment")
# What the .npz holds; the params of the processing step (a change means a new result).
PROCESS_PARAMS: Dict[str, object] = {"per_atom": list(PER_ATOM), "per_conf": list(PER_CONF), "dtype": "float32"}

# Time spent inside the step functions in *this* process (the rank that did the work); reset per run.
WORK: Dict[str, float] = {}


# -- 1. the dataset --------------------------------------------------------------------------------------


def generate_dataset(directory: Path, molecules: int, *, seed: int = 0, level: int = 1) -> Dict[str, int]:
    """Write ``<directory>/mf_dataset.hdf5`` and its gzip; return their sizes.

    ~84 KB of HDF5 per molecule (2,000 molecules: ~168 MB), 10-29 atoms and 40-120
    conformers each.  Coordinates are float32-precision values stored as float64 (as
    curated datasets converted from float32 sources are), forces full float64, so the file
    gzips to ~3/4 (2,000 molecules: ~125 MB), as the issue's dataset did.
    """
    rng = np.random.default_rng(seed)
    h5 = directory / HDF5_NAME
    with h5py.File(h5, "w") as f:
        f.attrs["format"] = "modelforge-style curated dataset (example)"
        for m in range(molecules):
            n_atoms = int(rng.integers(10, 30))
            n_confs = int(rng.integers(40, 121))
            g = f.create_group(f"mol{m:06d}")
            g.attrs["n_configs"] = n_confs
            g.create_dataset("atomic_numbers", data=rng.integers(1, 10, size=(n_atoms, 1), dtype=np.int8))
            base = rng.normal(0, 0.3, size=(1, n_atoms, 3))
            geom = (base + rng.normal(0, 0.01, size=(n_confs, n_atoms, 3))).astype(np.float32)
            g.create_dataset("geometry", data=geom.astype(np.float64)).attrs["u"] = "nanometer"
            forces = rng.normal(0, 50, size=(n_confs, n_atoms, 3))
            g.create_dataset("forces", data=forces).attrs["u"] = "kilojoule_per_mole / nanometer"
            g.create_dataset("partial_charges", data=rng.normal(0, 0.3, size=(n_confs, n_atoms, 1))
                             .astype(np.float32)).attrs["u"] = "elementary_charge"
            g.create_dataset("internal_energy", data=rng.normal(-1e6, 1e3, size=(n_confs, 1))
                             ).attrs["u"] = "kilojoule_per_mole"
            g.create_dataset("dipole_moment", data=rng.normal(0, 1, size=(n_confs, 3))
                             ).attrs["u"] = "elementary_charge * nanometer"
    gz = directory / GZ_NAME
    with open(h5, "rb") as src, gzip.GzipFile(gz, "wb", compresslevel=level, mtime=0) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return {"hdf5_bytes": h5.stat().st_size, "gz_bytes": gz.stat().st_size}


# -- 2. the steps (the same code for casstore and for a hand-written loader) --------------------------------


def gunzip_file(src: Path, dst: Path) -> None:
    """Stream-decompress ``src`` into ``dst`` (1 MiB at a time)."""
    d = zlib.decompressobj(wbits=31)  # gzip framing
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while chunk := fi.read(1 << 20):
            fo.write(d.decompress(chunk))
        fo.write(d.flush())


def process_file(src: Path, dst: Path) -> None:
    """modelforge's ``_from_hdf5`` in miniature: ragged per-molecule arrays -> flat arrays in one .npz."""
    atom_counts: List[int] = []
    conf_counts: List[int] = []
    numbers: List[np.ndarray] = []
    per_atom: Dict[str, List[np.ndarray]] = {k: [] for k in PER_ATOM}
    per_conf: Dict[str, List[np.ndarray]] = {k: [] for k in PER_CONF}
    # locking=False: the file is never written while it is read (a casstore object is immutable).
    with h5py.File(src, "r", locking=False) as f:
        for name in sorted(f):
            g = f[name]
            z = g["atomic_numbers"][()]
            n_confs = int(g.attrs["n_configs"])
            atom_counts.extend([z.shape[0]] * n_confs)
            conf_counts.append(n_confs)
            numbers.append(np.tile(z[:, 0], n_confs))
            for k in PER_ATOM:
                a = g[k][()]
                per_atom[k].append(a.reshape(n_confs * z.shape[0], -1).astype(np.float32))
            for k in PER_CONF:
                per_conf[k].append(g[k][()].astype(np.float32))
    arrays: Dict[str, np.ndarray] = {
        "atomic_subsystem_counts": np.asarray(atom_counts, dtype=np.int32),
        "n_confs": np.asarray(conf_counts, dtype=np.int32),
        "atomic_numbers": np.concatenate(numbers),
    }
    arrays.update({k: np.concatenate(v) for k, v in per_atom.items()})
    arrays.update({k: np.concatenate(v) for k, v in per_conf.items()})
    np.savez(dst, **arrays)  # type: ignore[arg-type]  # numpy stubs read ** as allow_pickle


def load_npz(path: Path) -> Dict[str, np.ndarray]:
    """Load every array of the .npz into memory (what a training dataset does with it)."""
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def summarize(data: Dict[str, np.ndarray]) -> Dict[str, int]:
    """A small fingerprint of a loaded result: sizes plus a checksum, equal across ranks."""
    return {"molecules": int(data["n_confs"].shape[0]), "conformers": int(data["atomic_subsystem_counts"].shape[0]),
            "atoms": int(data["atomic_numbers"].shape[0]),
            "crc32": zlib.crc32(data["geometry"].tobytes()) ^ zlib.crc32(data["internal_energy"].tobytes())}


def gunzip_step(inputs: Dict[str, Path], out: Path) -> None:
    """derive fn: ``inputs["gz"]`` -> ``out/mf_dataset.hdf5``."""
    t0 = time.perf_counter()
    gunzip_file(inputs["gz"], out / HDF5_NAME)
    WORK["gunzip"] = time.perf_counter() - t0


def process_step(inputs: Dict[str, Path], out: Path) -> None:
    """derive fn: ``inputs["h5"]`` -> ``out/processed.npz``."""
    t0 = time.perf_counter()
    process_file(inputs["h5"], out / NPZ_NAME)
    WORK["process"] = time.perf_counter() - t0


# -- 3. one rank ----------------------------------------------------------------------------------------


def cas_rank(store_dir: str, url: str) -> Dict[str, Any]:
    """One rank's job on the store at ``store_dir``: fetch, gunzip, process, load. Returns timings (s).

    ``fetch``/``gunzip``/``process``/``load`` are the wall time of each call in this rank
    (work, or waiting for the rank doing it, or a cache hit); ``work_gunzip`` and
    ``work_process`` appear only in the rank whose ``fn`` ran (its time inside ``fn``).
    """
    WORK.clear()
    t = [time.perf_counter()]
    store = casstore.open(store_dir)
    t.append(time.perf_counter())
    gz = store.fetch(url)
    t.append(time.perf_counter())
    h5 = store.derive("mf/unzipped", inputs={"gz": gz}, fn=gunzip_step, version=1)
    t.append(time.perf_counter())
    npz = store.derive("mf/processed", inputs={"h5": h5}, params=PROCESS_PARAMS, fn=process_step, version=1)
    t.append(time.perf_counter())
    data = load_npz(store.path(npz[NPZ_NAME].digest))
    t.append(time.perf_counter())
    out: Dict[str, Any] = {p: t[i + 1] - t[i] for i, p in enumerate(("open", "fetch", "gunzip", "process", "load"))}
    out.update({f"work_{k}": v for k, v in WORK.items()})
    out["result"] = summarize(data)
    out["npz"] = str(npz[NPZ_NAME].digest)
    return out


# -- the demo server and the launcher -------------------------------------------------------------------

_SERVER = r"""
import functools, http.server, sys
log = open(sys.argv[2], "a", buffering=1)
class H(http.server.SimpleHTTPRequestHandler):
    def log_message(self, fmt, *args):
        log.write(f"{self.command} {self.path}\n")
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(H, directory=sys.argv[1]))
print("PORT", srv.server_port, flush=True)
srv.serve_forever()
"""


class Server:
    """The demo HTTP server (a child process serving one directory on 127.0.0.1); see :func:`serve`."""

    def __init__(self, base: str, log: Path) -> None:
        self.base = base
        self.log = log

    def requests(self) -> List[str]:
        """Requests served so far, e.g. ``["GET /mf_dataset.hdf5.gz"]`` (logged after each response)."""
        return self.log.read_text().splitlines() if self.log.exists() else []


@contextlib.contextmanager
def serve(directory: Path) -> Iterator[Server]:
    """Serve ``directory`` over HTTP on 127.0.0.1 from a child process.

    A separate process, so rank processes may be forked without inheriting a server thread.
    """
    log = directory.parent / f".{directory.name}.requests.log"
    p = subprocess.Popen([sys.executable, "-c", _SERVER, str(directory), str(log)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    try:
        line = p.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"demo HTTP server did not start: {line!r}")
        yield Server(f"http://127.0.0.1:{int(line.split()[1])}", log)
    finally:
        p.terminate()
        p.communicate(timeout=30)


def run_job(store_dir: str, url: str, ranks: int) -> Tuple[float, List[Dict[str, Any]]]:
    """Start ``ranks`` processes of this script at once (``rank`` subcommand); wall time and their reports."""
    env = dict(os.environ, WORLD_SIZE=str(ranks))
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "rank", "--store", store_dir, "--url", url],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, text=True) for r in range(ranks)]
    outs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - t0
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise SystemExit(f"ranks {bad} failed (exit status {[procs[r].returncode for r in bad]})")
    return wall, [json.loads(o.strip().splitlines()[-1]) for o in outs]


def report(label: str, wall: float, reports: List[Dict[str, Any]], downloads: int) -> Dict[str, Any]:
    """Print a human summary of one job and return it as a dict."""
    results = {json.dumps(r["result"], sort_keys=True) for r in reports}
    did = {k: sum(1 for r in reports if f"work_{k}" in r) for k in ("gunzip", "process")}
    print(f"{label}: {len(reports)} ranks in {wall:.2f} s (interpreter start-up included); "
          f"downloads: {downloads}; ranks that unzipped: {did['gunzip']}, processed: {did['process']}; "
          f"distinct results: {len(results)}")
    for phase in ("fetch", "gunzip", "process", "load"):
        xs = [r[phase] for r in reports]
        work = [r[f"work_{phase}"] for r in reports if f"work_{phase}" in r]
        extra = f" (work in fn: {work[0]:.2f} s)" if work else ""
        print(f"  {phase:8s} per rank: min {min(xs):.2f} s, max {max(xs):.2f} s{extra}")
    print(f"  result: {reports[0]['result']}")
    return {"label": label, "wall_s": wall, "downloads": downloads, "ranks_did": did,
            "distinct_results": len(results), "result": reports[0]["result"], "npz": reports[0]["npz"]}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="cmd")
    rk = sub.add_parser("rank", help="(internal) one rank of the job; prints one JSON line")
    rk.add_argument("--store", required=True)
    rk.add_argument("--url", required=True)
    ap.add_argument("--store", help="store directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--molecules", type=int, default=200, help="molecules in the generated dataset (default 200)")
    ap.add_argument("--ranks", type=int, default=8, help="processes started at once (default 8)")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per job (for tests)")
    args = ap.parse_args(argv)
    if args.cmd == "rank":
        print(json.dumps(cas_rank(args.store, args.url)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="mf-example-") as tmp:
        data_dir = Path(tmp) / "served"
        data_dir.mkdir()
        t0 = time.perf_counter()
        sizes = generate_dataset(data_dir, args.molecules)
        print(f"generated {args.molecules} molecules: {sizes['hdf5_bytes'] / 1e6:.1f} MB HDF5, "
              f"{sizes['gz_bytes'] / 1e6:.1f} MB gzipped ({time.perf_counter() - t0:.1f} s)")
        store_dir = args.store or str(Path(tmp) / "store")
        out = []
        with serve(data_dir) as srv:
            url = f"{srv.base}/{GZ_NAME}"
            for label in ("cold", "warm"):
                before = len(srv.requests())
                wall, reports = run_job(store_dir, url, args.ranks)
                downloads = sum(1 for r in srv.requests()[before:] if r.startswith("GET "))
                out.append(report(label, wall, reports, downloads))
        man = casstore.open(store_dir).manifest("mf/processed")
        rec = man.meta["derive"]
        print(f"mf/processed = {man.digest.short()}: {rec['fn']} with params {rec['params']} in {rec['seconds']:.2f} s")
        if args.json:
            for o in out:
                print("JSON " + json.dumps(o, sort_keys=True))


if __name__ == "__main__":
    main()
