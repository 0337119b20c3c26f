"""A freshly formatted filesystem image, loop-mounted for one test session (root only).

Used where ``$TMPDIR``'s filesystem cannot show a behaviour: reflinks (XFS ``reflink=1``,
tests/test_reflink_loop.py) and timestamps that keep only whole seconds (ext4 with 128-byte
inodes, tests/test_coarse_timestamps.py).  Without root, a loop device or the mkfs tool the
tests skip with the reason, except where ``CASSTORE_REQUIRE_LOOP=1`` (CI, .ci/run) makes that
a failure: there a skip would hide a broken setup.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, Sequence

import pytest


def unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail where CI requires loop mounts."""
    if os.environ.get("CASSTORE_REQUIRE_LOOP") == "1":
        pytest.fail(f"CASSTORE_REQUIRE_LOOP=1 but {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def loop_mount(base: Path, mkfs: Sequence[str], size: int, *, tools: Sequence[str] = ()) -> Iterator[Path]:
    """Format a sparse image of ``size`` bytes under ``base`` with ``mkfs`` (the image path is appended),
    mount it, yield the mount point; unmounted (lazily if a straggler holds a file) and deleted on exit."""
    if os.geteuid() != 0:
        unavailable("loop-mounting an image needs root")
    for tool in (mkfs[0], "losetup", "mount", "umount", *tools):
        if shutil.which(tool) is None:
            unavailable(f"{tool} not found (apt-get install xfsprogs e2fsprogs util-linux mount)")
    image, mnt = base / "fs.img", base / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size)
    mk = subprocess.run([*mkfs, str(image)], capture_output=True, text=True)
    if mk.returncode != 0:
        unavailable(f"{' '.join(mkfs)} failed: {mk.stderr.strip()[:300]}")
    mt = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True, text=True)
    if mt.returncode != 0:
        unavailable(f"mount -o loop failed (no loop device? try modprobe loop): {mt.stderr.strip()[:300]}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        image.unlink(missing_ok=True)
