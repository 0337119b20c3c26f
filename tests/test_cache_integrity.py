"""IndexCache integrity: a flipped byte anywhere is detected and never returned as data."""

from __future__ import annotations

import os
import struct
import tempfile
import tracemalloc
import zlib
from pathlib import Path
from typing import Dict, Optional

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casstore
from casstore.cache import VERIFY_MODES, IndexCache


def payload(i: int, n: int) -> bytes:
    return blake3.blake3(b"int%d" % i).digest(length=n)


def flip(path: Path, pos: int, bit: int = 0) -> None:
    """Flip one bit of the file at ``pos`` (object files are 0444: root writes them anyway, after chmod)."""
    os.chmod(path, 0o644)
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([b[0] ^ (1 << bit)]), pos)
    finally:
        os.close(fd)


def build(store: casstore.Store, recs: Dict[int, bytes], length: int, **kw: object) -> IndexCache:
    c = IndexCache(store, length, **kw)  # type: ignore[arg-type]
    for i, b in recs.items():
        assert c.put(i, b)
    return c


def test_every_single_byte_flip_of_a_preserved_cache_is_caught(store: casstore.Store) -> None:
    """Flip each byte of a small preserved cache in turn: open(full) always refuses it;
    open(record) either refuses it or every get returns the original bytes or raises."""
    recs = {0: payload(0, 40), 2: payload(2, 0), 3: payload(3, 17)}
    c = build(store, recs, 5)
    d = c.preserve("small")
    c.close()
    path = store.path(d)
    size = path.stat().st_size
    expect: Dict[int, Optional[bytes]] = {i: recs.get(i) for i in range(5)}
    caught_at_open = caught_at_get = silent = 0
    for pos in range(size):
        flip(path, pos, bit=pos % 8)
        try:
            with pytest.raises(casstore.IntegrityError):
                IndexCache.open(store, "small", verify="full")  # whole BLAKE3 digest
            for mode in ("record", "once"):  # once: the first get of each record checks it
                try:
                    o = IndexCache.open(store, "small", verify=mode)
                except (casstore.IntegrityError, casstore.StoreFormatError):
                    caught_at_open += 1
                    continue
                wrong = False
                for i, want in expect.items():
                    try:
                        got = o.get(i)
                    except casstore.IntegrityError:
                        caught_at_get += 1
                        wrong = True
                        continue
                    assert got == want, f"flip at byte {pos} returned damaged data for index {i} ({mode})"
                if not wrong:
                    silent += 1  # e.g. alignment padding: no record's bytes changed
                o.close()
        finally:
            flip(path, pos, bit=pos % 8)  # restore
    assert IndexCache.open(store, "small").get(0) == recs[0]
    assert caught_at_open > 200 and caught_at_get >= 114  # header/table/footer, and every data byte
    assert silent == 0  # header, padding, table and footer are all checked


def test_flip_in_a_frozen_but_unpreserved_cache(store: casstore.Store) -> None:
    recs = {i: payload(i, 100 + i) for i in range(10)}
    recs[10] = payload(10, 100_000)  # BLAKE3-64 record
    c = build(store, recs, 11)
    c.freeze()
    assert c.path is not None
    data_off = 64 + sum(len(recs[i]) for i in range(4))
    flip(c.path, data_off + 5)  # inside record 4
    with pytest.raises(casstore.IntegrityError, match="record 4 is corrupt"):
        c.get(4)
    assert c.get(3) == recs[3] and c.get(5) == recs[5]
    big_off = 64 + sum(len(recs[i]) for i in range(10))
    flip(c.path, big_off + 77_777)
    with pytest.raises(casstore.IntegrityError, match="record 10"):
        c.get(10)
    with pytest.raises(casstore.IntegrityError, match=r"records \[4, 10\]"):
        c.verify()


def test_flip_in_a_live_cache(store: casstore.Store) -> None:
    c = build(store, {0: b"a" * 50, 1: b"b" * 70_000}, 3)
    assert c._dir is not None
    data = c._dir / "data.0"
    flip(data, 64 + 10)
    with pytest.raises(casstore.IntegrityError, match="record 0 is corrupt"):
        c.get(0)
    flip(data, 64 + 50 + 60_000)
    with pytest.raises(casstore.IntegrityError, match="record 1 is corrupt"):
        c.get(1)
    with pytest.raises(casstore.IntegrityError):
        c.verify()


def test_verify_open_checks_every_record_at_freeze(store: casstore.Store) -> None:
    c = build(store, {i: payload(i, 300) for i in range(8)}, 8, verify="open")
    assert c._dir is not None
    flip(c._dir / "data.0", 64 + 3 * 300 + 1)
    with pytest.raises(casstore.IntegrityError, match=r"records \[3\] are corrupt"):
        c.freeze()
    assert not (c._dir / "frozen").exists()  # nothing unverified was published
    # Without the damage, "open" mode serves reads without per-record checks.
    flip(c._dir / "data.0", 64 + 3 * 300 + 1)
    c.freeze()
    assert c.get(3) == payload(3, 300)


def test_damaged_table_footer_or_truncation_is_refused(store: casstore.Store) -> None:
    c = build(store, {i: payload(i, 64) for i in range(6)}, 6)
    d = c.preserve("t")
    c.close()
    path = store.path(d)
    size = path.stat().st_size
    table_at = size - 64 - 6 * 32
    flip(path, table_at + 40)  # a table entry
    with pytest.raises(casstore.IntegrityError, match="index table .* is damaged"):
        IndexCache.open(store, "t", verify="record")
    flip(path, table_at + 40)
    flip(path, size - 10)  # the footer
    with pytest.raises(casstore.IntegrityError, match="footer"):
        IndexCache.open(store, "t", verify="record")
    flip(path, size - 10)
    assert IndexCache.open(store, "t").get(5) == payload(5, 64)
    os.truncate(path, size - 100)
    with pytest.raises(casstore.IntegrityError):
        IndexCache.open(store, "t", verify="record")
    with pytest.raises(casstore.IntegrityError, match="is corrupt: object"):
        IndexCache.open(store, "t", verify="full")
    with pytest.raises(casstore.IntegrityError, match="footer"):
        IndexCache.open(store, "t")  # verify="once" reads the footer at open


# -- fuzz: the frozen-file parser takes arbitrary bytes -----------------------------------
#
# IndexCache.open parses a file anyone with write access to a shared store could have
# stored (under its true digest, so the whole-object hash passes).  Whatever the bytes,
# open and every read give a result or a CasstoreError: never another exception, never a
# crash, never memory beyond the file's size (the file is mapped, not read).

_FOOTER = struct.Struct("<8sIIQQQQQII")  # docs/index-cache.md, "On-disk format"


def _valid_frozen_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as t:
        s = casstore.open(Path(t) / "s", durable=False)
        c = IndexCache(s, 7)
        for i, n in ((0, 40), (2, 0), (3, 70_000), (6, 5)):  # CRC-32 and BLAKE3-64 records, an empty one
            c.put(i, payload(i, n))
        d = c.preserve("x")
        c.close()
        return s.get(d)


VALID = _valid_frozen_bytes()


def _fix_crcs(b: bytearray) -> None:
    """Make the footer and table CRCs match again, so mutations reach the fields behind them."""
    if len(b) < 64 + _FOOTER.size:
        return
    fo = len(b) - _FOOTER.size
    f = list(_FOOTER.unpack_from(b, fo))
    table_off = f[4]
    if 0 <= table_off <= fo:
        f[8] = zlib.crc32(b[table_off:fo])
    body = _FOOTER.pack(*f[:-1], 0)[:-4]
    b[fo:] = body + struct.pack("<I", zlib.crc32(body))


@st.composite
def hostile_cache_files(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["mutated", "mutated-crcs-fixed", "footer-fields", "magic-then-noise"]))
    if kind == "magic-then-noise":
        return b"CSICACHE" + draw(st.binary(max_size=400))
    b = bytearray(VALID)
    if kind == "footer-fields":
        fo = len(b) - _FOOTER.size
        f = list(_FOOTER.unpack_from(b, fo))
        big = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, len(b) + 64))
        for k in draw(st.sets(st.integers(1, 7), min_size=1)):  # format, slot, length, offsets, counts
            f[k] = draw(big) if k >= 3 else draw(st.integers(0, 2**32 - 1))
        b[fo:] = _FOOTER.pack(*f)
        _fix_crcs(b)
        return bytes(b)
    for _ in range(draw(st.integers(1, 8))):
        pos = draw(st.integers(0, len(b) - 1))
        b[pos:pos + 8] = draw(st.binary(min_size=1, max_size=8))
    cut = draw(st.one_of(st.none(), st.integers(0, len(b))))
    if cut is not None:
        del b[cut:]
    b += draw(st.binary(max_size=64))
    if kind == "mutated-crcs-fixed":
        _fix_crcs(b)
    return bytes(b)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hostile_cache_files(), mode=st.sampled_from(["full", "record", "open"]))
def test_fuzz_frozen_file_parser(store: casstore.Store, data: bytes, mode: str) -> None:
    d = store.objects.put(data, compress=False)
    tracemalloc.start()
    try:
        try:
            c = IndexCache.open(store, d, verify=mode)
        except casstore.CasstoreError:
            return
        try:
            assert len(c) == c.length <= len(data) // 32
            c.info()
            for i in range(c.length):
                try:
                    got = c.get(i)
                except casstore.CasstoreError:
                    continue
                assert got is None or len(got) <= len(data)
            try:
                c.verify()
            except casstore.CasstoreError:
                pass
        finally:
            c.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20) + 2 * len(data), peak  # nothing beyond the input's bound


def test_verify_once_checks_each_record_on_its_first_read_and_only_then(store: casstore.Store) -> None:
    """The default mode: nothing is hashed at open beyond the table; a byte flipped on disk after
    open but before a record's first read is caught there; once a record was checked in this
    process it is not checked again (documented: a later flip is found by verify(), not by get)."""
    recs = {i: payload(i, 200 + 50 * i) for i in range(6)}
    recs[6] = payload(6, 300_000)  # a BLAKE3-64 record
    c = build(store, recs, 7)
    c.preserve("once")
    c.close()
    o = IndexCache.open(store, "once")
    assert o.verify_mode == "once"
    path = o.path
    assert path is not None
    offs = {}
    pos = 64
    for i in range(7):
        offs[i] = pos
        pos += len(recs[i])
    assert o.get(1) == recs[1]  # checked now, and remembered
    flip(path, offs[3] + 7)  # after open, before the first read of record 3
    flip(path, offs[6] + 250_000)  # and of the large record 6
    with pytest.raises(casstore.IntegrityError, match="record 3"):
        o.get(3)
    with pytest.raises(casstore.IntegrityError, match="record 3"):
        o.get(3)  # a failed check is not remembered as checked
    with pytest.raises(casstore.IntegrityError, match="record 6"):
        o.get(6)
    flip(path, offs[1] + 3)  # after record 1 was checked: get no longer re-checks it (documented)
    assert o.get(1) != recs[1]
    with pytest.raises(casstore.IntegrityError, match="is corrupt"):
        o.verify()  # the whole object's digest, then every record
    # Another open (another process, the next run) checks every record again on first read.
    o2 = IndexCache.open(store, "once")
    with pytest.raises(casstore.IntegrityError, match="record 1"):
        o2.get(1)
    for p_ in (offs[1] + 3, offs[3] + 7, offs[6] + 250_000):
        flip(path, p_)
    assert [o2.get(i) for i in range(7)] == [recs[i] for i in range(7)]
    o.close()
    o2.close()


def _format1_file(recs: Dict[int, bytes], length: int) -> bytes:
    """A frozen file exactly as casstore's format 1 wrote it: CRC-32 records up to 64 KiB, BLAKE3-64 above."""
    from casstore.cache import _tag

    data = bytearray()
    table = bytearray()
    for i in range(length):
        b = recs.get(i)
        if b is None:
            table += struct.pack("<QQQQ", 0, 0, (1 << 64) - 1, 0)
            continue
        off = 64 + len(data)
        data += b
        if len(b) <= 64 << 10:
            s, fl = zlib.crc32(b), 1
        else:
            s, fl = int.from_bytes(blake3.blake3(b).digest(length=8), "little"), 3
        table += struct.pack("<QQQQ", off, off + len(b), s, fl | _tag(i, off, off + len(b), s, fl) << 32)
    data_end = 64 + len(data)
    table_off = (data_end + 7) & ~7
    body = struct.pack("<8sIIQQQQQII", b"CSICFOOT", 1, 32, length, table_off, data_end, len(recs), len(data),
                       zlib.crc32(bytes(table)), 0)[:-4]
    return (struct.pack("<8sI52x", b"CSICACHE", 1) + bytes(data) + b"\0" * (table_off - data_end) + bytes(table)
            + body + struct.pack("<I", zlib.crc32(body)))


def test_format_1_caches_preserved_by_earlier_versions_still_open_and_check(store: casstore.Store) -> None:
    from casstore.cache import ENTRY_KEY, KIND
    from casstore.manifests.model import Entry, encode_manifest

    recs = {0: payload(0, 10), 2: payload(2, 100_000), 3: b""}
    blob = _format1_file(recs, 4)
    d = store.put(blob, compress=False)
    md = store.put(encode_manifest({ENTRY_KEY: Entry(d, len(blob))}, {"kind": KIND, "length": 4, "format": 1}, None),
                   compress=False)
    store.pin("old", md)
    for mode in ("once", "full", "record", "open"):
        o = IndexCache.open(store, "old", verify=mode)
        assert [o.get(i) for i in range(4)] == [recs[0], None, recs[2], b""]
        assert o.verify() == 3 and o.info()["format"] == 1
        o.close()
    path = store.path(d)
    flip(path, 64 + 10 + 5000)  # inside the BLAKE3-64 record
    o = IndexCache.open(store, "old")
    assert o.get(0) == recs[0]
    with pytest.raises(casstore.IntegrityError, match="record 2"):
        o.get(2)
    flip(path, 64 + 3)  # and the CRC-32 one
    with pytest.raises(casstore.IntegrityError, match="record 0"):
        IndexCache.open(store, "old", verify="record").get(0)


# -- a table entry that points outside the data region -------------------------------------
#
# Hazard (bug hunt): the table CRC and the footer CRC are only as good as whoever computed them.
# A hostile or buggy writer that rewrites a slot, recomputes the record checksum over what a
# get would return and fixes both CRCs made open, get and verify accept a record at offset
# 10**15 (the mmap slice is b'') or over the footer (b'CSICFOOT').  docs/index-cache.md: a
# present record lies in 64 <= offset <= end <= data_end; anything else is an IntegrityError.


def _with_slot(blob: bytes, i: int, off: int, end: int) -> bytes:
    """``blob`` (a valid frozen file) with slot ``i`` rewritten to ``[off, end)``, its checksum
    set to XXH3 of what ``file[off:end]`` gives, its tag right, and the table and footer CRCs fixed:
    every check but the bounds one passes."""
    from xxhash import xxh3_64_intdigest

    from casstore.cache import _tag

    b = bytearray(blob)
    fo = len(b) - _FOOTER.size
    table_off = _FOOTER.unpack_from(b, fo)[4]
    s = xxh3_64_intdigest(bytes(b[off:end]))
    fl = 1 | 4  # present, XXH3-64
    struct.pack_into("<QQQQ", b, table_off + 32 * i, off, end, s, fl | _tag(i, off, end, s, fl) << 32)
    _fix_crcs(b)
    return bytes(b)


def _preserve_bytes(store: casstore.Store, name: str, blob: bytes, length: int) -> None:
    from casstore.cache import ENTRY_KEY, KIND
    from casstore.manifests.model import Entry, encode_manifest

    d = store.put(blob, compress=False)
    md = store.put(encode_manifest({ENTRY_KEY: Entry(d, len(blob))}, {"kind": KIND, "length": length, "format": 2},
                                   None), compress=False)
    store.pin(name, md)


@pytest.mark.parametrize("engine", ["numpy", "plain"])
@pytest.mark.parametrize("where", ["far", "footer", "table", "straddles-data-end", "header", "reversed"])
def test_table_entry_outside_the_data_region_is_refused_at_open(store: casstore.Store, where: str, engine: str,
                                                                capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from casstore.cli import main

    recs = {i: payload(i, 100 + i) for i in range(4)}
    c = build(store, recs, 4)
    d = c.preserve("good")
    c.close()
    blob = store.get(d)
    fo = len(blob) - _FOOTER.size
    _m, _f, _s, _l, table_off, data_end, *_rest = _FOOTER.unpack_from(blob, fo)
    off, end = {
        "far": (10**15, 10**15 + 4),
        "footer": (fo, fo + 8),
        "table": (table_off, table_off + 32),
        "straddles-data-end": (data_end - 4, data_end + 4),
        "header": (0, 8),  # a present record starting inside the header
        "reversed": (200, 100),
    }[where]
    bad = _with_slot(blob, 1, off, end)
    _preserve_bytes(store, "bad", bad, 4)
    if engine == "plain":  # the entry-by-entry check of a process without numpy (a small table)
        monkeypatch.setitem(sys.modules, "numpy", None)  # type: ignore[arg-type]
    for mode in VERIFY_MODES:  # "full"/"open": the whole digest matches (it is the file's true digest)
        with pytest.raises(casstore.IntegrityError, match=r"record 1 lies outside the data region"):
            IndexCache.open(store, "bad", verify=mode)
    capsys.readouterr()
    assert main(["--store", str(store.root), "cache", "verify", "bad"]) == 1
    assert "record 1 lies outside the data region" in capsys.readouterr().err
    # The same bytes with the slot pointing back at its own record open and read as before.
    fine = _with_slot(blob, 1, 64 + len(recs[0]), 64 + len(recs[0]) + len(recs[1]))
    _preserve_bytes(store, "fine", fine, 4)
    o = IndexCache.open(store, "fine", verify="record")
    assert [o.get(i) for i in range(4)] == [recs[i] for i in range(4)] and o.verify() == 4
    o.close()


def test_empty_record_at_data_end_is_in_bounds(store: casstore.Store) -> None:
    """The edge the bounds check must keep: an empty record put last has offset == end == data_end."""
    c = build(store, {0: payload(0, 30), 1: b""}, 3)
    c.preserve("edge")
    c.close()
    o = IndexCache.open(store, "edge", verify="record")
    assert [o.get(i) for i in range(3)] == [payload(0, 30), b"", None] and o.verify() == 2
    o.close()
