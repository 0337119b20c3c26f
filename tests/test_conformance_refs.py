"""The refs conformance suite (tests/_conformance.py) on every implementation.

``LocalRefs`` (a per-name lock, and an exclusive claim of the name's next
log position) on a store in a temp directory, and again with every lock
granted to everyone (as some NFS and FUSE mounts do: the claim alone must
give exactly one winner); ``S3Refs`` (``If-Match`` / ``If-None-Match``, checked by the
server) on a fresh prefix of the shared SeaweedFS server.  The races run in
spawned processes.
"""

from __future__ import annotations

import fcntl
import functools
import os
from pathlib import Path
from typing import Any, Callable

import _seaweed
import pytest
from _conformance import RefStoreTests

import casstore
from casstore.refs import LocalRefs
from casstore.refs.base import RefStore
from casstore.refs.s3 import S3Refs

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote_url = _seaweed.remote_url


def open_local_refs(root: str) -> RefStore:
    """The refs of the store at ``root`` (run in child processes)."""
    return casstore.open(root).refs


def open_s3_refs(url: str, endpoint: str) -> RefStore:
    """The refs of the remote at ``url`` (run in child processes; credentials from the environment)."""
    return casstore.Remote(url, endpoint_url=endpoint, progress=False).refs


def _granted(fd: object, op: int) -> None:
    """``flock`` on a filesystem that grants every lock to everyone."""


def open_local_refs_lying(root: str) -> RefStore:
    """The refs of the store at ``root`` in a child whose locks exclude nobody (lock_mode forced to
    flock, so no probe switches to lease files: the case of locks that hold only within each host)."""
    os.environ["CASSTORE_LOCK_MODE"] = "flock"
    fcntl.flock = _granted
    return casstore.open(root).refs


def _damage_local(refs: RefStore, kind: str, name: str) -> None:
    """The newest claim of ``name`` points at garbage and its ref file is gone (a crash between
    a claim and the ref write, then damage): only the log can say what the name holds."""
    assert isinstance(refs, LocalRefs)
    logs = [p for p in (refs.root / "refs" / "log" / kind).iterdir() if (p / "name").read_text() == name]
    assert len(logs) == 1
    newest = max((p for p in logs[0].iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    newest.unlink()
    newest.symlink_to("garbage")
    (refs.root / "refs" / kind / name).unlink()


class TestLocalRefs(RefStoreTests):
    @pytest.fixture
    def refs(self, tmp_path: Path) -> RefStore:
        return open_local_refs(str(tmp_path / "store"))

    def opener(self, refs: RefStore) -> Callable[[], RefStore]:
        assert isinstance(refs, LocalRefs)
        return functools.partial(open_local_refs, str(refs.root))

    def damage(self, refs: RefStore, kind: str, name: str) -> None:
        _damage_local(refs, kind, name)


class TestLocalRefsLyingLocks(RefStoreTests):
    @pytest.fixture
    def refs(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RefStore:
        monkeypatch.setenv("CASSTORE_LOCK_MODE", "flock")
        monkeypatch.setattr(fcntl, "flock", _granted)
        return open_local_refs(str(tmp_path / "store"))

    def opener(self, refs: RefStore) -> Callable[[], RefStore]:
        assert isinstance(refs, LocalRefs)
        return functools.partial(open_local_refs_lying, str(refs.root))

    def damage(self, refs: RefStore, kind: str, name: str) -> None:
        _damage_local(refs, kind, name)


class TestS3Refs(RefStoreTests):
    @pytest.fixture
    def refs(self, seaweed: Any, remote_url: str) -> RefStore:
        return open_s3_refs(remote_url, seaweed.endpoint)

    def opener(self, refs: RefStore) -> Callable[[], RefStore]:
        assert isinstance(refs, S3Refs)
        conn = refs.connection
        assert conn.endpoint_url is not None
        return functools.partial(open_s3_refs, f"s3://{conn.bucket}/{refs.prefix}", conn.endpoint_url)

    def damage(self, refs: RefStore, kind: str, name: str) -> None:
        assert isinstance(refs, S3Refs)
        assert refs.connection.put(refs.key(kind, name), b"garbage\n", action="damaging a ref") is not None
