"""A pfio-style training loop: 4 forked loader workers fill a per-sample cache, preserve, preload.

    python examples/pfio_loader.py                          # 5,000 samples, 3 epochs, a temp store
    python examples/pfio_loader.py --store /tmp/pfio-store  # run it twice: the 2nd run decodes nothing

The dataset is generated (sample ``i`` is 10-50 KB, deterministic) and "decoding" a sample
costs ``--decode-ms`` (default 0.5 ms, standing for a read from remote storage plus decoding).
A torch-free ``DataLoader`` forks ``--workers`` processes per epoch; each takes every
``workers``-th batch of a shuffled order and returns the batches in order, as torch's does.

* Epoch 1: every ``dataset[i]`` misses the cache, is decoded and ``put`` -- from 4 processes
  at once into one ``casstore.IndexCache`` (or, with ``--api pfio``, into casstore's drop-in
  for pfio, ``casstore.compat.pfio.MultiprocessFileCache``).
* End of epoch 1: ``preserve(name)`` keeps the cache as one object pinned under ``name``
  (no second copy; a crash leaves the name absent or complete).
* Epoch 2 and later: the preserved cache is opened (pfio's ``preload``) and mapped
  read-only by new workers: no decoding, no locks, each record still checked against its checksum
  (on its first read in each process, the default ``verify="once"``).
* A later run with the same ``--store`` finds the name and decodes nothing at all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import numpy as np

import casstore
from casstore.cache import IndexCache

POOL = 16 << 20


class Samples:
    """The expensive base dataset: ``samples[i]`` is 10-50 KB of deterministic bytes (``delay`` s each)."""

    def __init__(self, n: int, *, delay: float = 0.0, seed: int = 0) -> None:
        self.n = n
        self.delay = delay
        self.pool = np.random.default_rng(seed).bytes(POOL)

    def __len__(self) -> int:
        return self.n

    def size(self, i: int) -> int:
        """Length of sample ``i`` (10,000 .. 50,000 bytes)."""
        return 10_000 + (i * 2654435761) % 40_001

    def __call__(self, i: int) -> bytes:
        if self.delay:
            time.sleep(self.delay)
        size = self.size(i)
        start = (i * 40503) % (POOL - 50_001)
        return i.to_bytes(8, "little") + self.pool[start:start + size - 8]

    __getitem__ = __call__

    def total_bytes(self) -> int:
        """Sum of all sample sizes."""
        return sum(self.size(i) for i in range(self.n))

    def checksum(self) -> int:
        """What one epoch over every sample must add up to (see :func:`digest_sample`)."""
        return sum(digest_sample(self(i)) for i in range(self.n)) if not self.delay else -1


def digest_sample(x: bytes) -> int:
    """A cheap per-sample fingerprint summed over an epoch: equal sums, same data."""
    return len(x) + x[0] + x[-1]


class CacheLike(Protocol):
    """What the loop needs from a cache: pfio's and casstore's both fit."""

    def get(self, i: int) -> Optional[bytes]: ...

    def put(self, i: int, data: bytes) -> bool: ...


class CachedDataset:
    """``dataset[i]`` through the cache: decoded once per machine, later epochs and runs read the cache."""

    def __init__(self, base: Samples, cache: CacheLike) -> None:
        self.base, self.cache = base, cache
        self.misses = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> bytes:
        b = self.cache.get(i)
        if b is None:
            b = self.base[i]
            self.misses += 1
            self.cache.put(i, b)  # safe from every worker at once; False if another worker won
        return b


def _worker(ds: CachedDataset, batches: List[Tuple[int, List[int]]], q: Any) -> None:
    for k, idx in batches:
        ds.misses = 0
        q.put((k, [ds[i] for i in idx], ds.misses))
    q.put(None)


class DataLoader:
    """torch-free ``DataLoader(dataset, batch_size, shuffle=True, num_workers)`` with forked workers.

    Each epoch forks ``num_workers`` processes (torch's default, non-persistent workers);
    worker ``w`` builds batches ``w, w + num_workers, ...``; batches are yielded in order.
    ``misses`` counts the samples decoded (cache misses) during the last epoch.
    """

    def __init__(self, dataset: CachedDataset, *, batch_size: int = 32, num_workers: int = 4, seed: int = 0) -> None:
        self.dataset, self.batch_size, self.num_workers, self.seed = dataset, batch_size, num_workers, seed
        self.epoch = 0
        self.misses = 0

    def __iter__(self) -> Iterator[List[bytes]]:
        order = np.random.default_rng((self.seed, self.epoch)).permutation(len(self.dataset)).tolist()
        self.epoch += 1
        self.misses = 0
        batches = list(enumerate(order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)))
        ctx = mp.get_context("fork")
        q = ctx.Queue(maxsize=4 * self.num_workers)
        procs = [ctx.Process(target=_worker, args=(self.dataset, batches[w::self.num_workers], q), daemon=True)
                 for w in range(self.num_workers)]
        for p in procs:
            p.start()
        pending: Dict[int, List[bytes]] = {}
        nxt = done = 0
        try:
            while done < len(procs):
                item = q.get(timeout=600)
                if item is None:
                    done += 1
                    continue
                k, batch, misses = item
                self.misses += misses
                pending[k] = batch
                while nxt in pending:
                    yield pending.pop(nxt)
                    nxt += 1
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"loader workers failed with exit status {bad}")


def open_cache(store: casstore.Store, name: str, n: int, api: str) -> Tuple[Any, bool]:
    """The cache for this run: the preserved one if ``name`` exists (True), else a new live one (False)."""
    if api == "pfio":
        # pfio's own code, one import line changed. ``dir=D`` works as in pfio (the store is then
        # D/casstore); ``store=`` keeps this example's one store for both APIs.
        from casstore.compat.pfio import MultiprocessFileCache

        c = MultiprocessFileCache(n, store=store)
        return c, c.preload(name)
    try:
        return IndexCache.open(store, name), True
    except casstore.ObjectNotFoundError:
        return IndexCache(store, n), False


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--store", help="store directory (default: a temporary one, removed afterwards)")
    ap.add_argument("--samples", type=int, default=5000, help="dataset length (default 5,000)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--decode-ms", type=float, default=0.5, help="cost of decoding one sample (default 0.5 ms)")
    ap.add_argument("--api", choices=("indexcache", "pfio"), default="indexcache",
                    help="casstore.IndexCache, or the pfio drop-in casstore.compat.pfio.MultiprocessFileCache")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per epoch (for tests)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pfio-example-") as tmp:
        store = casstore.open(args.store or Path(tmp) / "store")
        base = Samples(args.samples, delay=args.decode_ms / 1000)
        name = f"examples/pfio-loader-{args.samples}"
        cache, preserved = open_cache(store, name, args.samples, args.api)
        print(f"{args.samples:,} samples ({base.total_bytes() / 1e6:.0f} MB), {args.workers} workers, "
              f"cache: {'the preserved ' + repr(name) if preserved else 'a new one'} "
              f"({'IndexCache' if isinstance(cache, IndexCache) else type(cache).__name__})")
        for epoch in range(1, args.epochs + 1):
            loader = DataLoader(CachedDataset(base, cache), num_workers=args.workers, seed=epoch)
            loader.epoch = epoch
            t0 = time.perf_counter()
            seen = checksum = 0
            for batch in loader:  # the training step would go here
                seen += len(batch)
                checksum += sum(digest_sample(x) for x in batch)
            secs = time.perf_counter() - t0
            print(f"epoch {epoch}: {seen:,} samples in {secs:.2f} s, decoded {loader.misses:,}")
            if args.json:
                print("JSON " + json.dumps({"epoch": epoch, "samples": seen, "decoded": loader.misses,
                                            "checksum": checksum, "seconds": secs, "preserved": preserved}))
            if not preserved:
                # End of epoch 1: keep the cache (pfio: preserve) and read it back (pfio: preload).
                t0 = time.perf_counter()
                cache.preserve(name)
                cache.close()
                cache, preserved = open_cache(store, name, args.samples, args.api)
                print(f"  preserved as {name!r} and reopened in {time.perf_counter() - t0:.2f} s")
        cache.close()


if __name__ == "__main__":
    main()
