"""A FUSE test filesystem that lies the way NFS, Lustre and FUSE mounts do (issue 17).

``tests/fusefs/casfs.c`` is a small passthrough daemon against libfuse3's
high-level API (multithreaded).  This module compiles it once per source
version into pytest's cache directory, mounts one instance per mode for the
whole test session (on first use) and unmounts every one at the end.  Modes:

``local``
    honest passthrough; flock and POSIX locks are the kernel's own (the control).
``grant``
    every flock and fcntl lock is granted to everyone: no exclusion at all.
``enosys``
    flock and fcntl locks fail with ENOSYS (Lustre without ``-o flock``).  The
    kernel hands the daemon's ENOSYS to the caller unchanged (it only keeps
    locks itself when the daemon offers no lock handlers at all), which
    ``tests/test_fs_lying.py`` checks.
``delay_rename=<ms>``
    a rename that replaces a file removes the target at once and puts the new
    file in place ``ms`` milliseconds later; an fsync of a directory waits for
    every pending rename.  See the comment in ``casfs.c`` for why a window
    inside the rename request itself could not be seen by anyone.

Fixtures (registered in ``conftest.py``): ``fuse_dir`` is a function that takes
a mode and returns a fresh, empty directory on that mode's mount.  Where FUSE
cannot work here -- not root, no ``/dev/fuse``, no fuse in the kernel, mount(2)
refused -- the test is skipped with that reason; missing user-space parts
(``fusermount3``, libfuse3's headers: ``apt-get install fuse3 libfuse3-dev``)
skip too, unless ``CASSTORE_REQUIRE_FUSE=1`` (set by ``.ci/run``), which turns
every such skip into a failure so CI can never silently skip these tests.

No stale mounts: the session finalizer unmounts with ``fusermount3 -u`` (lazy
``-z`` if the mount is busy) and reaps the daemon; an ``atexit`` hook does the
same if the finalizer never ran; and the daemon detaches its own mount when its
stdin (a pipe only this pytest process holds) reaches EOF, which covers a
pytest killed by SIGKILL.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple

import pytest

SOURCE = Path(__file__).resolve().parent / "fusefs" / "casfs.c"
REQUIRE_ENV = "CASSTORE_REQUIRE_FUSE"
MOUNT_TIMEOUT = 10.0
OPTIONS = "allow_other,default_permissions,fsname=casfs,subtype=casfs"
_BASE_MODES = ("local", "grant", "enosys")


def check_mode(mode: str) -> str:
    """``mode`` itself if the daemon knows it (``delay_rename=<ms>`` with 0 <= ms <= 60000), else ValueError."""
    if mode in _BASE_MODES:
        return mode
    if mode.startswith("delay_rename="):
        ms = mode.split("=", 1)[1]
        if ms.isdigit() and int(ms) <= 60000:
            return mode
    raise ValueError(f"unknown casfs mode {mode!r}: one of {', '.join(_BASE_MODES)}, delay_rename=<ms>")


def unavailable() -> Optional[str]:
    """Why FUSE mounts cannot be made here, or None if they can (as far as can be told before trying)."""
    if not os.path.exists("/proc/filesystems"):
        return "FUSE test filesystem needs Linux"
    if os.geteuid() != 0:
        return "FUSE test filesystem needs root (it mounts with allow_other)"
    if not os.path.exists("/dev/fuse"):
        return "FUSE test filesystem: no /dev/fuse on this machine"
    with open("/proc/filesystems") as f:
        if not any(line.split()[-1:] == ["fuse"] for line in f):
            return "FUSE test filesystem: the kernel has no fuse filesystem (modprobe fuse)"
    missing = [tool for tool in ("fusermount3", "pkg-config", "cc") if shutil.which(tool) is None]
    if missing:
        return f"FUSE test filesystem: {', '.join(missing)} not found (apt-get install -y fuse3 libfuse3-dev gcc)"
    r = subprocess.run(["pkg-config", "--exists", "fuse3"], capture_output=True)
    if r.returncode != 0:
        return "FUSE test filesystem: libfuse3's headers are missing (apt-get install -y libfuse3-dev)"
    return None


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``; fail instead where FUSE is required (CI sets CASSTORE_REQUIRE_FUSE=1)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: these tests must run here)", pytrace=False)
    pytest.skip(reason)


def build(cache_dir: Path) -> Path:
    """The daemon compiled from :data:`SOURCE` into ``cache_dir`` (once per source version; atomic)."""
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src).hexdigest()[:16]
    exe = cache_dir / f"casfs-{tag}"
    if exe.exists():
        return exe
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], capture_output=True, text=True,
                           check=True).stdout.split()
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".casfs-build-")
    os.close(fd)
    try:
        r = subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-o", tmp, str(SOURCE), *flags],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"building {SOURCE} failed:\n{r.stderr}")
        os.replace(tmp, exe)  # concurrent sessions: each renames a complete binary
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return exe


def _is_mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        # Field 5 is the mount point, with spaces etc. escaped as \040 (our paths have none).
        return any(line.split()[4] == target for line in f)


class FuseMount:
    """One running casfs daemon: ``mountpoint`` shows ``backing`` through ``mode``'s lies."""

    def __init__(self, exe: Path, mode: str, workdir: Path) -> None:
        """Mount ``mode`` under ``workdir`` (``backing/``, ``mnt/``, ``daemon.log``); raises on failure."""
        self.mode = check_mode(mode)
        self.backing = workdir / "backing"
        self.mountpoint = workdir / "mnt"
        self.log = workdir / "daemon.log"
        self.backing.mkdir(parents=True)
        self.mountpoint.mkdir()
        os.chmod(self.backing, 0o755)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(exe), self.mode, str(self.backing), str(self.mountpoint), "-o", OPTIONS],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not _is_mounted(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"casfs {self.mode} did not mount on {self.mountpoint}: "
                                   f"{self.log.read_text(errors='replace').strip()}")
            time.sleep(0.02)
        self._n = 0

    def fresh_dir(self, prefix: str = "t") -> Path:
        """A new, empty directory on this mount (0o755, so other users can traverse it)."""
        self._n += 1
        d = self.mountpoint / f"{prefix}{self._n:04d}"
        d.mkdir()
        os.chmod(d, 0o755)
        return d

    def stop(self) -> None:
        """Unmount (lazily if busy) and reap the daemon; idempotent."""
        if _is_mounted(self.mountpoint):
            r = subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
            if r.returncode != 0:  # busy (a test left a descriptor open): detach now, gone when closed
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the daemon's own backstop: EOF -> detach
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # Files hidden while open (see HIDDEN_PREFIX in casfs.c) and renames that never landed.
        for side in (".hidden", ".pending"):
            shutil.rmtree(str(self.backing) + side, ignore_errors=True)


class FuseMounts:
    """The session's mounts, one per mode, each made on first use."""

    def __init__(self, exe: Path, root: Path) -> None:
        """Mounts go under ``root`` (a pytest temp dir, so ``$TMPDIR`` is honoured)."""
        self.exe = exe
        self.root = root
        self.mounts: Dict[str, FuseMount] = {}

    def get(self, mode: str) -> FuseMount:
        """The mount of ``mode``, mounted now if it is not yet."""
        mode = check_mode(mode)
        if mode not in self.mounts:
            self.mounts[mode] = FuseMount(self.exe, mode, self.root / mode.replace("=", "-"))
        return self.mounts[mode]

    def stop(self) -> None:
        """Unmount everything; idempotent."""
        for m in self.mounts.values():
            m.stop()


@pytest.fixture(scope="session")
def fuse_mounts(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Iterator[FuseMounts]:
    """Every casfs mount of the session (skips -- or fails under CASSTORE_REQUIRE_FUSE=1 -- without FUSE)."""
    reason = unavailable()
    if reason:
        skip_or_fail(reason)
    cache = getattr(pytestconfig, "cache", None)  # None under -p no:cacheprovider
    if cache is not None:
        cache_dir = cache.mkdir("casstore-fusefs")
    else:
        cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "casstore-fusefs"
        cache_dir.mkdir(parents=True, exist_ok=True)
    exe = build(cache_dir)
    mounts = FuseMounts(exe, tmp_path_factory.mktemp("fuse"))
    atexit.register(mounts.stop)  # a session that dies before its finalizers still unmounts
    try:
        yield mounts
    finally:
        mounts.stop()
        atexit.unregister(mounts.stop)


@pytest.fixture
def fuse_dir(fuse_mounts: FuseMounts) -> Callable[[str], Path]:
    """``fuse_dir(mode)``: a fresh, empty directory on the casfs mount of ``mode``."""
    def make(mode: str) -> Path:
        try:
            m = fuse_mounts.get(mode)
        except RuntimeError as e:
            # mount(2) refused (a container without CAP_SYS_ADMIN, say): FUSE is missing in effect.
            skip_or_fail(f"FUSE test filesystem cannot mount here: {e}")
            raise
        d = m.fresh_dir()
        return d

    return make


def fsync_counts(path: Path) -> Tuple[int, int]:
    """(file fsyncs, directory fsyncs) the casfs daemon serving ``path`` has received so far.

    casfs writes one ``casfs: FSYNC`` / ``casfs: FSYNCDIR`` line per call to
    ``daemon.log`` beside its mount point (unbuffered stderr).
    """
    for d in [path, *path.parents]:
        log = d / "daemon.log"
        if log.is_file() and (d / "mnt").is_dir():
            lines = log.read_text(errors="replace").splitlines()
            return lines.count("casfs: FSYNC"), lines.count("casfs: FSYNCDIR")
    raise FileNotFoundError(f"no casfs daemon.log above {path}")
