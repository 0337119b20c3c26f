"""The object-store conformance suite (tests/_conformance.py) on every implementation.

``LocalObjects`` on a store in a temp directory, ``S3Objects`` on a fresh
prefix of the shared SeaweedFS server.  Tampering is real: the local object
file is rewritten in place (one byte flipped, same size), the S3 key is
overwritten with a plain PUT (no create-only condition).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import _seaweed
import pytest
from _conformance import ObjectStoreTests

import casstore
from casstore.digest import Digest
from casstore.objects.base import ObjectStore
from casstore.objects.local import LocalObjects
from casstore.objects.s3 import S3Objects

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote_url = _seaweed.remote_url


def open_local_objects(root: str) -> ObjectStore:
    """The objects of the (raw) store at ``root`` (run in child processes)."""
    return casstore.open(root, compress=False).objects


def open_s3_objects(url: str, endpoint: str) -> ObjectStore:
    """The objects of the remote at ``url`` (run in child processes; credentials from the environment)."""
    return casstore.Remote(url, endpoint_url=endpoint, progress=False).objects


class TestLocalObjects(ObjectStoreTests):
    @pytest.fixture
    def objects(self, tmp_path: Path) -> ObjectStore:
        return open_local_objects(str(tmp_path / "store"))

    def opener(self, objects: ObjectStore) -> Callable[[], ObjectStore]:
        assert isinstance(objects, LocalObjects)
        return functools.partial(open_local_objects, str(objects.root))

    def tamper(self, objects: ObjectStore, digest: Digest) -> None:
        assert isinstance(objects, LocalObjects)
        loc = objects.locate(digest)
        assert loc.codec.byte_exact, "the conformance store is raw"
        os.chmod(loc.path, 0o644)
        with open(loc.path, "r+b") as f:
            f.seek(len(f.read()) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x01]))
        os.chmod(loc.path, 0o444)


class TestS3Objects(ObjectStoreTests):
    @pytest.fixture
    def objects(self, seaweed: Any, remote_url: str) -> ObjectStore:
        return open_s3_objects(remote_url, seaweed.endpoint)

    def opener(self, objects: ObjectStore) -> Callable[[], ObjectStore]:
        assert isinstance(objects, S3Objects)
        conn = objects.connection
        assert conn.endpoint_url is not None
        return functools.partial(open_s3_objects, f"s3://{conn.bucket}/{objects.prefix}", conn.endpoint_url)

    def tamper(self, objects: ObjectStore, digest: Digest) -> None:
        assert isinstance(objects, S3Objects)
        client = _seaweed.s3_client(objects.connection.endpoint_url or "")
        key = objects.key(digest)
        good = bytearray(client.get_object(Bucket=objects.connection.bucket, Key=key)["Body"].read())
        good[len(good) // 2] ^= 0x01
        client.put_object(Bucket=objects.connection.bucket, Key=key, Body=bytes(good))  # no If-None-Match
