"""Run a subset of the test suite on XFS (reflink=1), btrfs, tmpfs and overlayfs mounts (issue 17).

As root: each filesystem is made fresh (sparse loop images under --workdir for XFS and btrfs, a tmpfs,
and an overlay whose lower layer is a directory holding a store, with upper and work on a tmpfs), the
tests run with ``TMPDIR`` on that mount (the fixtures honour it), one filesystem at a time, and every
mount is taken down afterwards, even on failure.  Prints a table and writes
benchmarks/results/portability.json (pass/fail/skip counts and failing test names per filesystem).

    apt-get install -y xfsprogs btrfs-progs
    sudo .venv/bin/python benchmarks/portability.py                 # all four, the default subset
    sudo .venv/bin/python benchmarks/portability.py --fs xfs tmpfs  # some of them
    sudo .venv/bin/python benchmarks/portability.py --tests tests/test_store_basic.py -- -m "not slow"

The default subset (DEFAULT_TESTS) covers the store, manifest concurrency, checkout (incl. the reflink
loop test) and fetch; ``--tests`` picks others, and arguments after ``--`` go to pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, Iterator, List

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "portability.json"
FILESYSTEMS = ("xfs", "btrfs", "tmpfs", "overlay")
DEFAULT_TESTS = [
    "tests/test_store_basic.py",
    "tests/test_manifest_concurrency.py",
    "tests/test_checkout_link.py",
    "tests/test_reflink_loop.py",
    "tests/test_fetch.py",
]
IMAGE_SIZE = 3 << 30  # sparse; room for the 256 MiB big_file fixture and the stores
TMPFS_SIZE = "3g"


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)  # a straggler holds a file: lazily


@contextlib.contextmanager
def _mounted(kind: str, work: Path) -> Iterator[Path]:
    """A fresh filesystem of ``kind``; yields the directory to use as TMPDIR."""
    base = work / kind
    base.mkdir(parents=True)
    mnt = base / "mnt"
    mnt.mkdir()
    mounts: List[Path] = []
    try:
        if kind in ("xfs", "btrfs"):
            image = base / f"{kind}.img"
            with open(image, "wb") as f:
                f.truncate(IMAGE_SIZE)
            _run(*(["mkfs.xfs", "-q", "-f", "-m", "reflink=1"] if kind == "xfs" else ["mkfs.btrfs", "-q", "-f"]),
                 str(image))
            _run("mount", "-o", "loop", str(image), str(mnt))
            mounts.append(mnt)
            tmp = mnt
        elif kind == "tmpfs":
            _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mnt))
            mounts.append(mnt)
            tmp = mnt
        else:
            # lower: a directory holding a store with a manifest (as an image layer would); upper and work
            # on a tmpfs.  The tests run in the merged tree, beside that read-only-layer store.
            lower, rw = base / "lower", base / "rw"
            lower.mkdir()
            rw.mkdir()
            _run(sys.executable, "-c", "import casstore, pathlib, sys; d = pathlib.Path(sys.argv[1]);"
                 "(d / 'src').mkdir(); (d / 'src' / 'a.txt').write_bytes(b'lower layer\\n');"
                 "casstore.open(d / 'store').add('baked', d / 'src')", str(lower))
            _run("mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(rw))
            mounts.append(rw)
            (rw / "upper").mkdir()
            (rw / "work").mkdir()
            _run("mount", "-t", "overlay", "overlay", "-o",
                 f"lowerdir={lower},upperdir={rw / 'upper'},workdir={rw / 'work'}", str(mnt))
            mounts.append(mnt)
            tmp = mnt / "tmp"
            tmp.mkdir()
        os.chmod(tmp, 0o1777)  # like /tmp: tests drop to uid 65534 and need to traverse it
        yield tmp
    finally:
        for m in reversed(mounts):
            _umount(m)


def _overlay_smoke(tmp: Path) -> str:
    """Open the lower layer's store through the overlay and read its manifest (a check beside the tests)."""
    code = "import casstore, sys; assert 'a.txt' in casstore.open(sys.argv[1]).manifest('baked').entries"
    r = subprocess.run([sys.executable, "-c", code, str(tmp.parent / "store")], capture_output=True, text=True)
    return "ok" if r.returncode == 0 else f"failed: {r.stderr.strip().splitlines()[-1:]}"


def _pytest(tmp: Path, tests: List[str], extra: List[str], timeout: float) -> Dict[str, object]:
    xml = tmp / "junit.xml"
    env = dict(os.environ, TMPDIR=str(tmp))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *extra, *tests]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        tail = r.stdout.strip().splitlines()[-1:] if r.stdout.strip() else []
    except subprocess.TimeoutExpired:
        tail = [f"timed out after {timeout:.0f}s"]
    took = time.monotonic() - t0
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: List[str] = []
    skips: List[str] = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None:
                counts["failed"] += 1
                failing.append(name)
            elif case.find("error") is not None:
                counts["errors"] += 1
                failing.append(name)
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
                sk = case.find("skipped")
                skips.append(f"{name}: {sk.get('message', '') if sk is not None else ''}"[:200])
            else:
                counts["passed"] += 1
    return {**counts, "seconds": round(took, 1), "failing": failing, "skips": skips, "summary": " ".join(tail)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fs", nargs="+", choices=FILESYSTEMS, default=list(FILESYSTEMS))
    ap.add_argument("--tests", nargs="+", default=DEFAULT_TESTS)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per filesystem")
    ap.add_argument("--workdir", type=Path, default=None, help="where the images go (default: a new dir in /var/tmp)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("portability.py needs root (loop devices and mounts)", file=sys.stderr)
        return 2
    work = a.workdir or Path(tempfile.mkdtemp(prefix="casstore-portability-", dir="/var/tmp"))
    results: Dict[str, object] = {}
    try:
        for kind in a.fs:
            print(f"== {kind}", flush=True)
            try:
                with _mounted(kind, work) as tmp:
                    res = _pytest(tmp, a.tests, a.pytest_args, a.timeout)
                    if kind == "overlay":
                        res["lower_store_read"] = _overlay_smoke(tmp)
            except (subprocess.CalledProcessError, OSError) as e:
                err = getattr(e, "stderr", "") or str(e)
                res = {"setup_error": f"{e}: {str(err).strip()[:300]}"}
            results[kind] = res
            print(f"   {res}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "kernel": os.uname().release, "tests": a.tests, "pytest_args": a.pytest_args, "results": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n| filesystem | passed | failed | errors | skipped | seconds |\n|---|---|---|---|---|---|")
    for kind, r in results.items():
        assert isinstance(r, dict)
        if "setup_error" in r:
            print(f"| {kind} | setup failed: {r['setup_error']} | | | | |")
        else:
            print(f"| {kind} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} | {r['seconds']} |")
    for kind, r in results.items():
        assert isinstance(r, dict)
        for name in r.get("failing", []):
            print(f"  {kind}: FAILED {name}")
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
