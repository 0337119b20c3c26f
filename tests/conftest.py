"""Shared fixtures and helpers for the object-store tests.

Everything here works on the real filesystem and real processes: no storage is
mocked.  Helpers are plain functions (``from conftest import ...``) so spawned
child processes can use them too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import blake3
import pytest
import zstandard

# The FUSE test filesystem's fixtures (fuse_mounts, fuse_dir): see tests/_fusefs.py.
from _fusefs import fuse_dir, fuse_mounts  # noqa: F401

import casstore

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534

BIG_FILE_SIZE = 256 << 20


# -- helpers ----------------------------------------------------------------


def b3(data: bytes) -> str:
    """Reference digest string, computed with the blake3 package directly."""
    return "blake3:" + blake3.blake3(data).hexdigest()


def object_files(root: Path | str) -> List[Path]:
    """Every file under ``<root>/objects`` (any name), sorted."""
    objdir = Path(root) / "objects"
    if not objdir.exists():
        return []
    return sorted(p for p in objdir.rglob("*") if p.is_file())


def tmp_files(root: Path | str) -> List[str]:
    """Names in ``<root>/tmp``."""
    return sorted(os.listdir(Path(root) / "tmp"))


def decode_object_file(path: Path) -> bytes:
    """Uncompressed content of an object file, read without casstore."""
    raw = path.read_bytes()
    if path.name.endswith(".zst"):
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True).read()
    return raw


def name_of(path: Path) -> str:
    """Digest string an object file's name claims: objects/ab/cdef...[.zst] -> blake3:abcdef..."""
    stem = path.name[: -len(".zst")] if path.name.endswith(".zst") else path.name
    return "blake3:" + path.parent.name + stem


def hash_file(path: Path, chunk: int = 8 << 20) -> str:
    """blake3 of a (possibly huge) object file's uncompressed content, streaming."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as f:
        src: Any = f
        if path.name.endswith(".zst"):
            src = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        while True:
            buf = src.read(chunk)
            if not buf:
                break
            h.update(buf)
    return "blake3:" + h.hexdigest()


def assert_all_objects_valid(root: Path | str) -> List[str]:
    """Every visible object file re-hashes to its own name; returns the names."""
    names = []
    for p in object_files(root):
        assert len(p.parent.name) == 2 and len(p.name.removesuffix(".zst")) == 62, f"stray file {p}"
        assert hash_file(p) == name_of(p), f"object file {p} does not hash to its name"
        names.append(name_of(p))
    return names


def run_py(code: str, *args: str, timeout: float = 120, check: bool = True,
           env: Dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (sys.argv[1:] = args), in the current directory."""
    r = subprocess.run([PYTHON, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if check:
        assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


# casstore imports its features on first use; uid 65534 cannot read this interpreter's files
# (root's pyenv), so everything the child may use is imported before the privileges go.
PRELOAD = """
import casstore
for _name in casstore.__all__:
    getattr(casstore, _name)
import difflib, zstandard
import casstore.maintenance.gc, casstore.maintenance.verify, casstore.sync.remotes
"""

DROP_PRIVILEGES = """
import os
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
assert os.geteuid() == 65534
"""


def run_as_nobody(code: str, *args: str, timeout: float = 60) -> Dict[str, Any]:
    """Run ``code`` as uid/gid 65534 after importing casstore; it must set ``out`` (a JSON-able dict)."""
    full = "import json, sys\n" + PRELOAD + DROP_PRIVILEGES + \
        textwrap.dedent(code) + "\nprint('RESULT ' + json.dumps(out))\n"
    r = run_py(full, *args, timeout=timeout)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout + r.stderr
    result: Dict[str, Any] = json.loads(line[-1][len("RESULT "):])
    return result


@contextmanager
def held_elsewhere(lock: Any) -> Iterator[Any]:
    """Hold ``lock`` (a casstore FileLock) on another thread for the ``with`` block: another holder.

    (This thread asking for a lock it holds itself is a ``LockCycleError`` at once, never a wait.)
    """
    taken, done = threading.Event(), threading.Event()
    errors: List[BaseException] = []

    def hold() -> None:
        try:
            with lock:
                taken.set()
                done.wait(120)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            taken.set()

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    assert taken.wait(30) and not errors, errors
    try:
        yield lock
    finally:
        done.set()
        t.join(30)


def counting_hash_fd(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Sizes of the object files the objects layer hashes (its ``hash_fd``: verify_file, verify_fd), in order."""
    import casstore.objects.local as local_mod

    calls: List[int] = []
    real = local_mod.hash_fd

    def counted(fd: int, size: int, **kw: Any) -> casstore.Digest:
        calls.append(size)
        return real(fd, size, **kw)

    monkeypatch.setattr(local_mod, "hash_fd", counted)
    return calls


def compressible(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that zstd shrinks a lot (repetitive text with some variation)."""
    words = [b"alpha", b"beta", b"gamma", b"delta", b"epsilon", b"zeta", b"eta", b"theta"]
    out = bytearray()
    i = seed
    while len(out) < n:
        out += words[(i * 7 + i // 3) % len(words)] + b" %d\n" % (i % 1000)
        i += 1
    return bytes(out[:n])


# -- fixtures ---------------------------------------------------------------


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(store_dir: Path) -> casstore.Store:
    return casstore.open(store_dir)


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A directory under ``$TMPDIR`` (default /tmp) that uid 65534 can traverse (pytest's tmp_path cannot be)."""
    d = Path(tempfile.mkdtemp(prefix="casstore-test-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def big_file() -> Iterator[Tuple[Path, str]]:
    """256 MiB of random bytes on disk, created once per session; yields (path, digest)."""
    d = Path(tempfile.mkdtemp(prefix="casstore-big-"))  # $TMPDIR, so the suite runs on any mount
    path = d / "big.bin"
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "wb") as f:
        for _ in range(BIG_FILE_SIZE // (16 << 20)):
            block = os.urandom(16 << 20)
            h.update(block)
            f.write(block)
    try:
        yield path, "blake3:" + h.hexdigest()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def child_json(r: subprocess.CompletedProcess[str]) -> Any:
    """Last stdout line of a child, parsed as JSON."""
    return json.loads(r.stdout.strip().splitlines()[-1])
