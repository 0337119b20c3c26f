"""The refs conformance suite (tests/_conformance.py) on every implementation.

``LocalRefs`` (a per-name lock and an atomic rename) on a store in a temp
directory; ``S3Refs`` (``If-Match`` / ``If-None-Match``, checked by the
server) on a fresh prefix of the shared SeaweedFS server.  The races run in
spawned processes.
"""

from __future__ import annotations

import functools
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


class TestLocalRefs(RefStoreTests):
    @pytest.fixture
    def refs(self, tmp_path: Path) -> RefStore:
        return open_local_refs(str(tmp_path / "store"))

    def opener(self, refs: RefStore) -> Callable[[], RefStore]:
        assert isinstance(refs, LocalRefs)
        return functools.partial(open_local_refs, str(refs.root))


class TestS3Refs(RefStoreTests):
    @pytest.fixture
    def refs(self, seaweed: Any, remote_url: str) -> RefStore:
        return open_s3_refs(remote_url, seaweed.endpoint)

    def opener(self, refs: RefStore) -> Callable[[], RefStore]:
        assert isinstance(refs, S3Refs)
        conn = refs.connection
        assert conn.endpoint_url is not None
        return functools.partial(open_s3_refs, f"s3://{conn.bucket}/{refs.prefix}", conn.endpoint_url)
