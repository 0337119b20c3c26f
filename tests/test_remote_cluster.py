"""A SeaweedFS cluster on loopback: ``weed mini`` (master, filer, S3, one volume server) with
replication 001 plus two extra ``weed volume`` servers.  Every volume has a copy on two servers, so
after one volume server dies, pulls of the replicated data still succeed, byte for byte.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator

import _seaweed
import pytest
from _seaweed import SeaweedServer, start_seaweed

import casstore

# Fixtures shared by every remote test module (one SeaweedFS server per session).
aws_credentials = _seaweed.aws_credentials


@pytest.fixture(scope="module")
def cluster(aws_credentials: Any) -> Iterator[SeaweedServer]:
    srv = start_seaweed(replication="001", extra_volumes=2)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_pull_survives_a_dead_volume_server(tmp_path: Path, cluster: Any) -> None:
    rem = casstore.Remote("s3://team/shared", endpoint_url=cluster.endpoint, name="cluster",
                          connect_timeout=2, read_timeout=10, progress=False, multipart_threshold=8 << 20,
                          multipart_chunksize=5 << 20)
    rem.create_bucket()
    a = casstore.open(tmp_path / "a", durable=False)
    blobs = {f"f{i}": os.urandom(1000 + 977 * i) for i in range(40)}
    blobs["large"] = os.urandom(12 << 20)  # several filer chunks (4 MiB) and a multipart upload
    with a.edit("data") as m:
        for k, v in blobs.items():
            m[k] = a.put(v)
    pin = a.freeze("data")
    a.push(rem, "data")

    # Which servers hold the data?  Replication 001: every volume on two servers.
    locs = cluster.volume_locations()
    extra = [f"127.0.0.1:{cluster.base + 2 + i}" for i in range(2)]
    holders = {v for vols in locs.values() for v in vols}
    assert holders, locs
    for vol in holders:
        assert sum(vol in vols for vols in locs.values()) == 2, locs  # two copies of every volume
    victim = max(range(2), key=lambda i: len(locs.get(extra[i], [])))
    assert locs.get(extra[victim]), f"no extra volume server holds data: {locs}"
    cluster.kill_volume(victim)
    time.sleep(0.5)

    b = casstore.open(tmp_path / "b")
    rep = b.pull(rem, "data")
    assert rep.refs == {"pins/data": "created"} and rep.objects == len(blobs)
    man = b.manifest("data")
    assert man.digest == pin
    for k, v in blobs.items():
        assert b.get(man[k].digest) == v
    # The remote still takes writes with one volume server gone (three were there, two remain).
    with a.edit("more") as m:
        m["x"] = a.put(os.urandom(5000))
    a.push(rem, "more")
    c = casstore.open(tmp_path / "c")
    c.pull(rem, "more")
    assert dict(c.manifest("more")) == dict(a.manifest("more"))
