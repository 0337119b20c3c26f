"""Property test: random sequences of store operations against a dict model."""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest
from conftest import assert_all_objects_valid, b3, tmp_files
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, rule

import casstore
from casstore import Digest
from casstore.errors import ObjectNotFoundError

payloads = st.one_of(
    st.binary(max_size=3000),
    # compressible: a short pattern repeated (crosses the 512-byte minimum for zstd)
    st.builds(lambda pat, n: (pat * n)[:40_000], st.binary(min_size=1, max_size=24), st.integers(1, 3000)),
    st.sampled_from([b"", b"\x00", b"a" * 511, b"a" * 512, b"\x28\xb5\x2f\xfd" + b"zstd magic inside raw data"]),
)
flags = st.sampled_from([None, False, True, 1, 7, "zstd", "raw"])


def _on(flag: Any) -> bool:
    return flag not in (None, False, "raw")


class StoreVsDict(RuleBasedStateMachine):
    digests = Bundle("digests")

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="casstore-props-"))
        self.root = self.dir / "store"
        self.model: Dict[Digest, bytes] = {}
        self.first_compressed: Dict[Digest, bool] = {}
        self.default: Any = None
        self.store: casstore.Store

    @initialize(default=st.sampled_from([None, True, 3]))
    def create(self, default: Any) -> None:
        self.default = default
        self.store = casstore.open(self.root, compress=default, durable=False)

    def _record(self, items: List[bytes], ds: List[Digest], flag: Any) -> None:
        assert [str(d) for d in ds] == [b3(x) for x in items]
        eff = self.default if flag is None else flag
        for x, d in zip(items, ds, strict=True):
            if d not in self.model:
                self.model[d] = x
                self.first_compressed[d] = _on(eff)

    @rule(target=digests, data=payloads, flag=flags)
    def put(self, data: bytes, flag: Any) -> Digest:
        d = self.store.put(data, compress=flag)
        self._record([data], [d], flag)
        return d

    @rule(target=digests, items=st.lists(payloads, max_size=6), flag=flags)
    def put_many(self, items: List[bytes], flag: Any) -> Any:
        ds = self.store.put_many(items, compress=flag)
        self._record(items, ds, flag)
        return multiple(*ds)

    @rule(target=digests, data=payloads, flag=flags)
    def put_stream(self, data: bytes, flag: Any) -> Digest:
        d = self.store.put_stream(io.BytesIO(data), compress=flag)
        self._record([data], [d], flag)
        return d

    @rule(target=digests, data=payloads, flag=flags)
    def put_path(self, data: bytes, flag: Any) -> Digest:
        src = self.dir / "src.bin"
        src.write_bytes(data)
        d = self.store.put_path(src, compress=flag)
        self._record([data], [d], flag)
        return d

    @rule(d=digests)
    def get(self, d: Digest) -> None:
        assert self.store.get(d) == self.model[d]
        assert self.store.get(str(d), verify=False) == self.model[d]

    @rule(d=digests, chunk=st.integers(1, 5000))
    def open_read(self, d: Digest, chunk: int) -> None:
        parts = []
        with self.store.open(d) as f:
            while b := f.read(chunk):
                parts.append(b)
        assert b"".join(parts) == self.model[d]

    @rule(d=digests)
    def stat(self, d: Digest) -> None:
        info = self.store.stat(d)
        assert info.digest == d and info.size == len(self.model[d])
        if not self.first_compressed[d]:
            assert info.codec == "raw"
        if info.codec == "zstd":
            assert info.stored_size < info.size
        else:
            assert info.stored_size == info.size

    @rule(data=payloads)
    def contains_and_missing(self, data: bytes) -> None:
        d = Digest.of(data)
        assert (d in self.store) == (d in self.model)
        assert self.store.contains(str(d)) == (d in self.model)
        if d not in self.model:
            with pytest.raises(ObjectNotFoundError):
                self.store.get(d)

    @rule()
    def reopen(self) -> None:
        self.store = casstore.open(self.root, create=False)

    @invariant()
    def listing_matches_model(self) -> None:
        if not hasattr(self, "store"):
            return
        assert list(self.store.iter_objects()) == sorted(self.model)
        assert tmp_files(self.root) == []

    def teardown(self) -> None:
        try:
            if hasattr(self, "store"):
                assert sorted(assert_all_objects_valid(self.root)) == sorted(str(d) for d in self.model)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


StoreVsDict.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestStoreVsDict = StoreVsDict.TestCase
