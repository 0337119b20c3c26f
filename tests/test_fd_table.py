"""The descriptor table is grown before threads hold many files open (casstore._fs.reserve_fds).

Hazard: the kernel grows a multi-threaded process's table of open files only after an RCU grace
period, and every thread opening a file waits with it: 10-15 ms of a 1% ``add`` of 10,000 files
here, off the CPU with both cores idle.  Each test runs its probe in a process started by a process
holding no high descriptor, as a shell's commands are: a child's table is sized at the fork to its
parent's highest open descriptor (pytest's may be high), and a fresh one has 64 slots.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

from casstore._fs import FD_RESERVE

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(),
                                reason="reads a process's descriptor table size from Linux's /proc")

_PRELUDE = r'''
import os, resource, sys

def table():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("FDSize:")).split()[1])

start = table()
if os.environ.get("FD_LIMIT"):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(int(os.environ["FD_LIMIT"]), hard), hard))
soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
'''


def _probe(code: str, *args: str, limit: Optional[int] = None) -> List[int]:
    """Run ``_PRELUDE + code`` in a grandchild; the integers it prints."""
    env = None if limit is None else dict(os.environ, FD_LIMIT=str(limit))
    cmd = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)",
           sys.executable, "-c", _PRELUDE + code, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return [int(x) for x in out.split()]


def _folder(tmp_path: Path) -> Path:
    f = tmp_path / "f"
    for i in range(3):
        (f / f"d{i}").mkdir(parents=True)
        (f / f"d{i}" / "x.bin").write_bytes(bytes([i]) * 3000)
    return f


@pytest.mark.parametrize("limit", [None, 100])
def test_add_grows_the_table_before_its_pool_opens_files(tmp_path: Path, limit: Optional[int]) -> None:
    code = r'''
import casstore
from casstore import _faults
seen = []
_faults.hook = lambda point: seen.append(table()) if point == "folders.staged" else None
r = casstore.open(sys.argv[1]).add("exp", sys.argv[2])
print(start, min(seen), soft, len(r.manifest))
'''
    start, during, soft, n = _probe(code, str(tmp_path / "store"), str(_folder(tmp_path)), limit=limit)
    assert n == 3
    assert start == 64  # (a fresh process's table: else this test could not fail)
    assert during >= min(FD_RESERVE, soft)  # already grown when the pool staged its first file
    if limit is not None:
        assert during < FD_RESERVE  # a lower limit is kept to, and the add works


def test_the_cli_grows_the_table_at_its_start(tmp_path: Path) -> None:
    # Every command: its pools (add, pull, checkout) then never grow it while their threads run.
    code = r'''
import casstore
from casstore.cli import app
casstore.open(sys.argv[1])
seen = []
real = app.build_parser
def probe(*a):
    seen.append(table())
    return real(*a)
app.build_parser = probe
import contextlib, io
with contextlib.redirect_stdout(io.StringIO()):
    rc = app.main(["--store", sys.argv[1], "ls", "--json"])
print(start, seen[0], soft, rc)
'''
    start, at_parse, soft, rc = _probe(code, str(tmp_path / "store"))
    assert rc == 0 and start == 64
    assert at_parse >= min(FD_RESERVE, soft)


def test_a_pull_publisher_grows_the_table(tmp_path: Path) -> None:
    code = r'''
import casstore
from casstore.sync.transfer import Publisher
s = casstore.open(sys.argv[1])
before = table()
Publisher(s.objects).finish()
print(start, before, table(), soft)
'''
    start, before, after, soft = _probe(code, str(tmp_path / "store"))
    assert start == before == 64  # (opening a store does not grow it: else this test could not fail)
    assert after >= min(FD_RESERVE, soft)


def test_reserve_never_replaces_an_open_descriptor(tmp_path: Path) -> None:
    # The copy goes to the lowest *free* descriptor at or above the reserve's top: one already open
    # there (the top itself) is left as it is.
    code = r'''
from casstore._fs import reserve_fds, FD_RESERVE
top = min(FD_RESERVE, soft)
fd = os.open(sys.argv[1], os.O_RDONLY)
os.dup2(fd, top - 1)
os.close(fd)
reserve_fds()
print(os.fstat(top - 1).st_ino, os.stat(sys.argv[1]).st_ino)
'''
    p = tmp_path / "held"
    p.write_bytes(b"x")
    ino_fd, ino_file = _probe(code, str(p), limit=FD_RESERVE + 16)
    assert ino_fd == ino_file
