"""The benchmark harness's contracts: the limit formula, rows and the table, and module isolation.

The benchmarks themselves are too slow for the suite (run ``benchmarks/run.py --quick``);
these tests pin what the numbers mean and that a run in a child process returns its rows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _harness as h  # noqa: E402


def test_read_limit_is_the_read_or_the_work_spread_over_two_cores() -> None:
    # Hashing faster than reading: the read alone bounds a verified read.
    assert h.read_limit_s(1.0, 0.5) == 1.0
    assert h.read_limit_s(1.0, 1.0) == 1.0
    # Hashing slower than reading: read + hash shared by both cores.
    assert h.read_limit_s(1.0, 3.0) == 2.0
    assert h.read_limit_s(0.2, 0.6) == pytest.approx(0.4)


def test_ratio_row_limit_and_targets() -> None:
    r = h.ratio_row("x", 80.0, 100.0, "MB/s", limit=90.0, min_of_limit=0.8)
    assert r.ratio == pytest.approx(0.8) and r.of_limit == pytest.approx(80 / 90)
    assert r.target == ">= 0.8x limit" and r.met is True
    r = h.ratio_row("x", 70.0, 100.0, "MB/s", limit=90.0, min_of_limit=0.8)
    assert r.met is False
    # Both targets must hold.
    r = h.ratio_row("x", 80.0, 100.0, "MB/s", min_ratio=0.9, limit=90.0, min_of_limit=0.8)
    assert r.target == ">= 0.9x, >= 0.8x limit" and r.met is False
    # The old call shape still works and has no limit.
    r = h.ratio_row("x", 1.0, 2.0, "ops/s", min_ratio=0.4)
    assert (r.limit, r.of_limit, r.met, r.target) == (None, None, True, ">= 0.4x")
    # Lower-is-better times: ratio = ref / cas.
    t = h.time_row("t", 0.0002, 0.0001, "ms", min_ratio=0.8)
    assert t.casstore == pytest.approx(0.2) and t.ratio == pytest.approx(0.5) and t.met is False


def test_table_shows_limit_and_fraction() -> None:
    rows = [h.ratio_row("verified read", 800.0, 1000.0, "MB/s", limit=950.0, min_of_limit=0.8),
            h.Row("info row", 3.0, None, "s")]
    text = h.format_table(rows)
    head = text.splitlines()[0]
    assert [c.strip() for c in head.strip("|").split("|")] == \
        ["operation", "casstore", "reference", "ratio", "limit", "of limit", "target", "met?"]
    line = text.splitlines()[2]
    assert "950 MB/s" in line and "0.84x" in line and "0.80x" in line and "yes" in line
    assert h.rows_from_json(h.rows_to_json(rows)) == rows


def test_hash_pool_hashes_as_many_bytes_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = h.HashPool(size=1 << 20)
    seen = []
    real = blake3.blake3

    class Spy:
        def __init__(self, max_threads: int = 1) -> None:
            self.h, self.n = real(max_threads=max_threads), 0
            seen.append(self)

        def update(self, b: memoryview) -> None:
            self.n += len(b)
            self.h.update(b)

        def digest(self) -> bytes:
            return bytes(self.h.digest())

    Spy.AUTO = real.AUTO  # type: ignore[attr-defined]
    monkeypatch.setattr(blake3, "blake3", Spy)
    pool.hash(3 * (1 << 20) + 5, piece=1 << 20)  # wraps around the 1 MiB pool
    assert [s.n for s in seen] == [1 << 20, 1 << 20, 1 << 20, 5]


def test_read_and_write_cases(tmp_path: Path) -> None:
    files = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(10_000))
        files.append(p)
    h.readinto_case("r", files, bytearray(4096)).run(0)  # reads to EOF in buffer-sized steps
    out = tmp_path / "out"
    out.mkdir()
    for durable in (False, True):
        c = h.write_case("w", [b"abc" * 1000, memoryview(b"xyz")], out, durable=durable)
        assert c.setup is not None and c.teardown is not None
        c.setup(0)
        c.run(0)
        assert sorted(x.stat().st_size for x in out.iterdir()) == [3, 3000]
        c.teardown(0)
        assert not list(out.iterdir())
    assert isinstance(h.malloc_trim(), bool)


_FAKE = '''
from _harness import Row, ratio_row, run_scenarios

def bench_ok(quick):
    return [ratio_row("fake verified read", 90.0, 100.0, "MB/s", limit=100.0, min_of_limit=0.8,
                      details={"quick": quick, "pid": __import__("os").getpid()})]

def bench_broken(quick):
    raise ValueError("boom")

def run(quick):
    return run_scenarios([bench_ok, bench_broken], quick)
'''


@pytest.fixture
def bench_copy(tmp_path: Path) -> Path:
    """run.py and _harness.py beside one fake benchmark module (run.py discovers its own directory)."""
    d = tmp_path / "benchmarks"
    d.mkdir()
    for name in ("run.py", "_harness.py"):
        shutil.copy(BENCH / name, d / name)
    (d / "bench_fake.py").write_text(_FAKE)
    return d


def test_module_runs_in_a_fresh_process_and_returns_its_rows(bench_copy: Path) -> None:
    import run

    rows = run.run_isolated("fake", True, script=bench_copy / "run.py")
    assert [r.operation for r in rows][0] == "fake verified read"
    assert rows[0].of_limit == pytest.approx(0.9) and rows[0].met is True
    assert rows[0].details["quick"] is True and rows[0].details["pid"] != os.getpid()
    assert rows[1].operation.startswith("broken: FAILED (ValueError: boom)") and rows[1].met is False


def test_run_prints_the_table_from_child_processes(bench_copy: Path, tmp_path: Path) -> None:
    env = {**os.environ, h.TMP_ENV: str(tmp_path / "tmp")}
    r = subprocess.run([sys.executable, str(bench_copy / "run.py"), "--quick", "--no-save"], capture_output=True,
                       text=True, timeout=120, env=env)
    # A scenario that raised is a FAILED row and makes the exit status 1; the rest of the table is printed.
    assert r.returncode == 1, r.stderr
    assert "fake verified read" in r.stdout and "of limit" in r.stdout and "0.90x" in r.stdout
    assert "broken: FAILED" in r.stdout


def test_interleave_rotates_and_reports_usage() -> None:
    order = []
    usage: dict = {}
    res = h.interleave([h.Case("a", lambda r: order.append(("a", r)) and None),
                        h.Case("b", lambda r: {"x": 0.5} if order.append(("b", r)) is None else None)],
                       reps=2, usage=usage)
    assert order == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]  # warm-up round 0 not recorded
    assert len(res["a"]["total"]) == 2 and res["b"] == {"x": [0.5, 0.5]}
    assert set(usage) == {"a", "b"} and {"cpu_s", "minflt", "nivcsw"} <= set(usage["a"])
    assert len(usage["b"]["nivcsw"]) == 2
