"""The examples run as a user runs them (subprocesses, small generated data) and do what they say.

examples/modelforge_loader.py: 8 rank processes, one download, one unzip, one processing,
every rank loading the same result; the warm job does no work at all.
examples/pfio_loader.py: 4 forked workers fill the cache in epoch 1, preserve, epoch 2 reads the
preserved cache (nothing decoded); a second run with the same store decodes nothing -- with
IndexCache and with the pfio drop-in (casstore.compat.pfio.MultiprocessFileCache).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

import casstore

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, *args: str, cwd: Path) -> List[Dict[str, Any]]:
    r = subprocess.run([sys.executable, str(EXAMPLES / script), *args, "--json"], capture_output=True, text=True,
                       timeout=300, cwd=cwd, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line[5:]) for line in r.stdout.splitlines() if line.startswith("JSON ")]


def test_modelforge_loader_8_ranks(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    cold, warm = _run("modelforge_loader.py", "--molecules", "30", "--ranks", "8", "--store", str(store_dir),
                      cwd=tmp_path)
    assert cold["label"] == "cold" and warm["label"] == "warm"
    # Cold: 8 ranks at once, and still each step ran exactly once; every rank loaded the same arrays.
    assert cold["downloads"] == 1
    assert cold["ranks_did"] == {"gunzip": 1, "process": 1}
    assert cold["distinct_results"] == 1
    assert cold["result"]["molecules"] == 30
    assert cold["result"]["conformers"] > 30 * 39 and cold["result"]["atoms"] > cold["result"]["conformers"]
    # Warm: no download, no step function ran, the same result.
    assert warm["downloads"] == 0
    assert warm["ranks_did"] == {"gunzip": 0, "process": 0}
    assert warm["distinct_results"] == 1 and warm["result"] == cold["result"] and warm["npz"] == cold["npz"]
    # The store records how the .npz was made.
    store = casstore.open(store_dir)
    man = store.manifest("mf/processed")
    assert str(man["processed.npz"].digest) == cold["npz"]
    assert man.meta["derive"]["params"]["per_atom"] == ["geometry", "forces", "partial_charges"]


@pytest.mark.parametrize("api", ["indexcache", "pfio"])
def test_pfio_loader_preserve_preload(tmp_path: Path, api: str) -> None:
    store_dir = str(tmp_path / "store")
    common = ("--samples", "600", "--workers", "4", "--decode-ms", "0", "--store", store_dir, "--api", api)
    e1, e2 = _run("pfio_loader.py", *common, "--epochs", "2", cwd=tmp_path)
    assert (e1["epoch"], e1["samples"], e1["decoded"], e1["preserved"]) == (1, 600, 600, False)
    assert (e2["epoch"], e2["samples"], e2["decoded"], e2["preserved"]) == (2, 600, 0, True)
    assert e1["checksum"] == e2["checksum"] > 0
    # A new run (a new job) finds the preserved cache by name: nothing is decoded in its first epoch.
    (again,) = _run("pfio_loader.py", *common, "--epochs", "1", cwd=tmp_path)
    assert (again["decoded"], again["preserved"], again["checksum"]) == (0, True, e1["checksum"])
    pins = casstore.open(store_dir).refs
    assert pins.get("pins", "examples/pfio-loader-600") is not None
