"""Static checks run as part of the suite, so the README's one test command covers them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_strict() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "--strict", "casstore"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "casstore", "tests", "benchmarks", "examples"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
