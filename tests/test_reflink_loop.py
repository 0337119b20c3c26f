"""Checkout with ``link="reflink"`` on a real reflink filesystem: a loop-mounted XFS image (issue 17).

The other checkout tests run on whatever ``$TMPDIR`` is (ext4 or tmpfs: no FICLONE), so they only see the
copy fallback and the "cannot reflink" error.  Here a sparse image under pytest's tmp dir is formatted with
``mkfs.xfs -m reflink=1`` and loop-mounted, and we check what a clone promises: the checked-out file shares
the object's extents (FIEMAP through ``filefrag -v``), the filesystem's free space barely moves, and writing
to the checkout leaves the object alone (copy on write).

Needs root, a loop device and mkfs.xfs; without them the tests skip with the reason, except where
``CASSTORE_REQUIRE_LOOP=1`` (CI, .ci/run) makes that a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, List, Set, Tuple

import pytest
from _loopmount import loop_mount

import casstore
from casstore._fsprobe import probe

IMAGE_SIZE = 512 << 20  # sparse: costs only what XFS writes
OBJECT_SIZE = 64 << 20


@pytest.fixture(scope="session")
def xfs_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A freshly formatted XFS (reflink=1) loop mount, unmounted at the end of the session even on failure."""
    with loop_mount(tmp_path_factory.mktemp("xfsloop"), ["mkfs.xfs", "-q", "-f", "-m", "reflink=1"], IMAGE_SIZE,
                    tools=["filefrag"]) as mnt:
        yield mnt


def _extents(path: Path) -> List[Tuple[int, int, str]]:
    """(physical start block, length in blocks, flags) of each extent of ``path`` within its size (filefrag -v).

    Clipped to the file's size: XFS may report speculative preallocation past EOF, and trims it later.
    """
    out = subprocess.run(["filefrag", "-b4096", "-v", str(path)], capture_output=True, text=True,
                         check=True).stdout
    end = -(-path.stat().st_size // 4096)  # blocks the file's bytes occupy
    got = []
    # "   0:        0..   16383:         24..     16407:  16384:             shared,last,eof"
    for m in re.finditer(r"^\s*\d+:\s*(\d+)\.\.\s*\d+:\s*(\d+)\.\.\s*\d+:\s*(\d+):\s*(\S*)", out, re.M):
        logical, physical, n = int(m.group(1)), int(m.group(2)), int(m.group(3))
        n = min(n, end - logical)
        if n > 0:
            got.append((physical, n, m.group(4)))
    assert got, f"filefrag found no extents in {path}:\n{out}"
    return got


def _blocks(extents: List[Tuple[int, int, str]]) -> Set[int]:
    return {b for start, n, _ in extents for b in range(start, start + n)}


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


def test_probe_sees_reflink_on_xfs_and_not_on_the_tmp_dir(xfs_mount: Path, tmp_path: Path) -> None:
    d = xfs_mount / "probe"
    d.mkdir(exist_ok=True)
    assert probe(d, fresh=True).reflink == "yes"
    here = probe(tmp_path, fresh=True)
    if here.fstype not in ("ext4", "tmpfs", "overlay"):
        # $TMPDIR may itself clone (XFS, btrfs: the portability runs); btrfs subvolumes' st_dev is not in
        # mountinfo, so there the fstype reads "?".
        pytest.skip(f"$TMPDIR is on {here.fstype!r}, which may clone: no 'no' to check here")
    assert here.reflink == "no", here


def test_reflink_checkout_shares_extents_and_is_copy_on_write(xfs_mount: Path) -> None:
    root = xfs_mount / "reflink-checkout"
    src = root / "src"
    src.mkdir(parents=True)
    data = os.urandom(OBJECT_SIZE)  # incompressible: the object is stored raw, so it can be cloned
    (src / "big.bin").write_bytes(data)
    (src / "small.txt").write_bytes(b"hello\n")
    store = casstore.open(root / "store")
    store.add("exp", src)
    shutil.rmtree(src)
    digest = store.manifest("exp").entries["big.bin"].digest
    obj = Path(store.objects.path(digest))
    assert obj.stat().st_size == OBJECT_SIZE, "expected the incompressible object stored raw"
    os.sync()  # settle delayed allocation, so the free count and the extents are final
    free_before = _free_bytes(xfs_mount)

    out = root / "out"
    store.checkout("exp", out, link="reflink")
    os.sync()
    used = free_before - _free_bytes(xfs_mount)
    # A copy would take 64 MiB; a clone takes only metadata (the new inodes, the checkout record, the
    # refcount btree), a few blocks.
    assert used < 4 << 20, f"reflink checkout used {used} bytes of free space"
    got = out / "big.bin"
    assert got.read_bytes() == data
    assert (out / "small.txt").read_bytes() == b"hello\n"
    assert os.stat(got).st_ino != obj.stat().st_ino  # a clone, not a hard link

    theirs, ours = _extents(obj), _extents(got)
    assert _blocks(theirs) == _blocks(ours), f"extents differ:\nobject {theirs}\ncheckout {ours}"
    assert all("shared" in flags for _, _, flags in ours), ours

    # Copy on write: changing the checkout leaves the object's bytes (and blocks) alone.
    with open(got, "r+b") as f:
        f.seek(OBJECT_SIZE // 2)
        f.write(b"\xff" * 4096)
    os.sync()
    assert obj.read_bytes() == data
    assert _blocks(_extents(got)) != _blocks(theirs)  # the written range moved to new blocks
    assert store.verify().corrupt == ()  # the store still hashes clean


def test_copy_mode_also_clones_there(xfs_mount: Path) -> None:
    # link="copy" tries FICLONE first (docs/manifests.md): on XFS it should take no data blocks either.
    root = xfs_mount / "copy-checkout"
    src = root / "src"
    src.mkdir(parents=True)
    (src / "big.bin").write_bytes(os.urandom(16 << 20))
    store = casstore.open(root / "store")
    store.add("exp", src)
    os.sync()
    free_before = _free_bytes(xfs_mount)
    store.checkout("exp", root / "out", link="copy")
    os.sync()
    assert free_before - _free_bytes(xfs_mount) < 4 << 20
    assert (root / "out" / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
