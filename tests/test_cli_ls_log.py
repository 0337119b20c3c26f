"""``casstore ls`` (names: versions, size, last change; --sort, --filter, --json/--jsonl, --all, --objects) and
``casstore log`` (time, message, changed keys) (issue 12).

In-process runs of ``main`` for speed; terminal-only behaviour (human sizes) runs in a real pty.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from _corrupt import flip_byte
from test_cli_pty import run_on_pty

import casstore
from casstore.cli import main

DAY = 86400.0


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> Tuple[int, str, str]:
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _ok(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    rc, out, err = _main(capsys, *args)
    assert rc == 0, err
    return out


def _error(capsys: pytest.CaptureFixture[str], kind: str, *args: str) -> str:
    rc, out, err = _main(capsys, *args)
    assert rc == 1 and out == "" and err.count("\n") == 1 and err.rstrip().endswith(f"[{kind}]"), (rc, out, err)
    return err


def _age(s: casstore.Store, name: str, days: float) -> None:
    """Make ``name``'s current version look written ``days`` ago (its object's mtime is its time)."""
    t = time.time() - days * DAY
    os.utime(s.path(s.manifest(name).digest), (t, t))


@pytest.fixture
def names(tmp_path: Path) -> Tuple[str, casstore.Store]:
    """exp-a: 3 versions, 3 MB, 2 days old; exp-b: 1 version, 10 bytes, now; big: 2 versions, 5 MiB + 1,
    30 days old; pin paper (exp-a~1, 2 versions); an internal fetch record."""
    root = tmp_path / "s"
    s = casstore.open(root)
    for i in range(3):
        with s.edit("exp-a") as m:
            m[f"part{i}.bin"] = s.put(os.urandom(1_000_000))
    with s.edit("exp-b") as m:
        m["tiny.txt"] = s.put(b"0123456789")
    for size in (100, (5 << 20) + 1):
        with s.edit("big") as m:
            m["w.bin"] = s.put(os.urandom(size))
    s.pin("paper", "exp-a~1")
    with s.edit("_fetch/00ff") as m:
        m["data"] = s.put(b"fetched")
        m.meta.update(kind="casstore.fetch", url="https://bob:pw@example.org/data.tar?token=SECRET")
    _age(s, "exp-a", 2)
    _age(s, "big", 30)
    _age(s, "paper", 3)
    return str(root), s


def _rows(capsys: pytest.CaptureFixture[str], store: str, *args: str) -> List[Dict[str, Any]]:
    doc = json.loads(_ok(capsys, "--store", store, "ls", "--json", *args))
    assert isinstance(doc, list)
    return doc


def test_ls_lists_names_with_versions_size_and_time(names: Tuple[str, casstore.Store],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    store, s = names
    rows = {r["name"]: r for r in _rows(capsys, store)}
    assert list(rows) == ["big", "exp-a", "exp-b", "paper"]  # internal records hidden, sorted by name
    assert {k: (r["kind"], r["versions"], r["size"], r["entries"]) for k, r in rows.items()} == {
        "big": ("head", 2, (5 << 20) + 1, 1), "exp-a": ("head", 3, 3_000_000, 3),
        "exp-b": ("head", 1, 10, 1), "paper": ("pin", 2, 2_000_000, 2)}
    assert rows["paper"]["digest"] == str(s.pins()["paper"]) and rows["big"]["digest"] == str(s.heads()["big"])
    assert rows["big"]["time"] == pytest.approx(time.time() - 30 * DAY, abs=60)
    assert rows["exp-b"]["time"] == pytest.approx(time.time(), abs=60)
    # piped text: exact bytes (scripts and `sort -n` read numbers), full digests, one line per name
    lines = [ln.split() for ln in _ok(capsys, "--store", store, "ls").splitlines()]
    assert [(ln[0], ln[1], ln[2], ln[3], ln[-1]) for ln in lines] == [
        (n, rows[n]["kind"], str(rows[n]["versions"]), str(rows[n]["size"]), rows[n]["digest"]) for n in rows]
    # --jsonl: the same rows, one document per line
    jl = [json.loads(ln) for ln in _ok(capsys, "--store", store, "ls", "--jsonl").splitlines()]
    assert jl == list(rows.values())


def test_ls_sort_and_reverse(names: Tuple[str, casstore.Store], capsys: pytest.CaptureFixture[str]) -> None:
    store, _s = names
    order = {key: [r["name"] for r in _rows(capsys, store, "--sort", key)]
             for key in ("name", "size", "time", "versions")}
    assert order == {"name": ["big", "exp-a", "exp-b", "paper"],
                     "size": ["big", "exp-a", "paper", "exp-b"],  # largest first
                     "time": ["exp-b", "exp-a", "paper", "big"],  # newest first
                     "versions": ["exp-a", "big", "paper", "exp-b"]}  # most first; ties by name
    assert [r["name"] for r in _rows(capsys, store, "--sort", "size", "--reverse")] == order["size"][::-1]
    assert [r["name"] for r in _rows(capsys, store, "-r")] == order["name"][::-1]
    with pytest.raises(SystemExit) as e:  # argparse: a usage error, exit 2
        main(["--store", store, "ls", "--sort", "colour"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_ls_filters_are_anded_and_bad_ones_name_the_forms(names: Tuple[str, casstore.Store],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    store, _s = names

    def pick(*filters: str) -> List[str]:
        args = [a for f in filters for a in ("--filter", f)]
        return [r["name"] for r in _rows(capsys, store, *args)]

    assert pick("size>1MB") == ["big", "exp-a", "paper"]  # 1 MB = 1 MiB here, as everywhere in casstore
    assert pick("size>=5MiB") == ["big"]
    assert pick("size<1k") == ["exp-b"]
    assert pick("time<1d") == ["exp-b"]  # changed within a day
    assert pick("time>7d") == ["big"]  # not changed for a week
    assert pick("name=exp-*") == ["exp-a", "exp-b"]
    assert pick("name!=exp-*") == ["big", "paper"]
    assert pick("kind=pin") == ["paper"]
    assert pick("versions>=2", "kind=head") == ["big", "exp-a"]
    assert pick("name=exp-*", "size>1M", "time<7d") == ["exp-a"]
    assert pick("entries==3") == ["exp-a"]
    assert pick("name=nothing*") == []
    for bad, why in (("size", "FIELD OP VALUE"), ("colour=red", "unknown field 'colour'"),
                     ("size>lots", "invalid size"), ("time<soon", "invalid age"), ("kind=tag", "head or pin"),
                     ("name>exp", "= or != only"), ("versions>two", "whole number"), ("size>", "no value")):
        err = _error(capsys, "InvalidInputError", "--store", store, "ls", "--filter", bad)
        assert why in err and "size>1GB" in err and "fields: name, kind" in err, err


def test_ls_caps_the_history_walk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    for i in range(6):
        with s.edit("long") as m:
            m["k"] = s.put(b"v%d" % i)
    [row] = _rows(capsys, store, "--max-versions", "4")
    assert (row["versions"], row["versions_capped"]) == (4, True)
    assert _ok(capsys, "--store", store, "ls", "--max-versions", "4").split()[2] == "4+"
    [row] = _rows(capsys, store)
    assert (row["versions"], row["versions_capped"]) == (6, False)
    # a capped count is a lower bound: "more than the cap" still matches versions>4
    assert [r["name"] for r in _rows(capsys, store, "--max-versions", "4", "--filter", "versions>4")] == ["long"]
    # versions collected by gc end the walk, as they end `casstore log`
    s.plan_gc(keep_history=1, grace=0).execute()
    [row] = _rows(capsys, store)
    assert (row["versions"], row["versions_capped"]) == (2, False)


def test_ls_all_shows_internal_records_with_their_url(names: Tuple[str, casstore.Store],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    store, s = names
    rows = _rows(capsys, store, "--all")
    assert [r["name"] for r in rows] == ["_fetch/00ff", "big", "exp-a", "exp-b", "paper"]
    assert rows[0]["internal"] is True and rows[0]["url"] == "https://example.org/data.tar"
    text = _ok(capsys, "--store", store, "ls", "--all")
    assert "https://example.org/data.tar" in text
    assert "SECRET" not in text and "pw" not in text and "bob" not in text
    assert "_fetch" not in _ok(capsys, "--store", store, "ls")
    # --names is the default listing, still accepted
    assert _ok(capsys, "--store", store, "ls", "--names") == _ok(capsys, "--store", store, "ls")


def test_ls_objects_is_the_old_listing(names: Tuple[str, casstore.Store], capsys: pytest.CaptureFixture[str]) -> None:
    store, s = names
    objs = [json.loads(ln) for ln in _ok(capsys, "--store", store, "ls", "--objects", "--jsonl").splitlines()]
    assert [o["digest"] for o in objs] == [str(d) for d in sorted(s.iter_objects())]
    for flag in (["--sort", "size"], ["--filter", "size>1"], ["--all"], ["--names"], ["--reverse"]):
        _error(capsys, "InvalidInputError", "--store", store, "ls", "--objects", *flag)


def test_ls_lists_a_damaged_version_instead_of_failing(names: Tuple[str, casstore.Store],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    store, s = names
    flip_byte(s.path(s.heads()["exp-b"]), 5)
    rows = {r["name"]: r for r in _rows(capsys, store)}
    assert rows["exp-b"]["problem"] and "IntegrityError" in rows["exp-b"]["problem"]
    assert rows["exp-a"]["problem"] is None and rows["exp-a"]["versions"] == 3
    assert "IntegrityError" in _ok(capsys, "--store", store, "ls")


def test_ls_human_sizes_on_a_terminal(names: Tuple[str, casstore.Store], tmp_path: Path) -> None:
    store, s = names
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", store, "ls", stdout_tty=True, stderr_tty=True)
    lines = tty.decode().replace("\r\n", "\n").splitlines()
    assert rc == 0 and lines[0].split() == ["NAME", "KIND", "VERSIONS", "SIZE", "LAST", "CHANGE", "DIGEST"], tty
    big = next(ln for ln in lines if ln.startswith("big "))
    assert "5.0 MiB" in big and str((5 << 20) + 1) not in big and s.heads()["big"].short() in big, big
    assert "2.9 MiB" in next(ln for ln in lines if ln.startswith("exp-a "))
    assert "10 B" in next(ln for ln in lines if ln.startswith("exp-b "))


# -- log -----------------------------------------------------------------------------------------


@pytest.fixture
def history(tmp_path: Path) -> Tuple[str, casstore.Store]:
    root = tmp_path / "s"
    s = casstore.open(root)
    run = tmp_path / "run"
    run.mkdir()
    for i in range(15):
        (run / f"f{i:02}.txt").write_text(f"{i}")
    s.add("exp", run, message="first run")
    for i in range(12):
        (run / f"f{i:02}.txt").write_text(f"{i} again")
    (run / "f14.txt").unlink()
    (run / "new.txt").write_text("new")
    s.add("exp", run, message="second run", meta={"lr": 0.1})
    return str(root), s


def test_log_shows_time_message_and_change_counts(history: Tuple[str, casstore.Store],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    store, s = history
    v2, v1 = [m.digest for m in s.history("exp")]
    lines = _ok(capsys, "--store", store, "log", "exp").splitlines()
    assert len(lines) == 2  # one line per version without --keys
    assert lines[0].startswith(f"{v2}  ") and lines[0].endswith("15 entries  +1 ~12 -1  second run"), lines
    assert lines[1].startswith(f"{v1}  ") and lines[1].endswith("15 entries  +15 ~0 -0  first run"), lines
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.path(v2).stat().st_mtime))
    assert when in lines[0]


def test_a_message_belongs_to_one_version(history: Tuple[str, casstore.Store],
                                          capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Found by a bug hunt: `manifest set` and `manifest rm` after `add -m` repeated its message in the log."""
    store, s = history
    f = tmp_path / "extra.txt"
    f.write_text("x")
    _ok(capsys, "--store", store, "manifest", "set", "exp", "extra.txt", str(f))
    _ok(capsys, "--store", store, "manifest", "rm", "exp", "new.txt")
    doc = json.loads(_ok(capsys, "--store", store, "log", "exp", "--json"))
    assert [d["message"] for d in doc] == [None, None, "second run", "first run"]
    assert doc[0]["meta"] == {"lr": 0.1}  # the rest of the metadata is inherited as before
    # A message alone is not a change (as for add); with a change, it is the new version's.
    with s.edit("exp") as m:
        m.meta["message"] = "only a message"
    assert m.result is not None and m.result.digest == s.manifest("exp").digest and len(s.history("exp")) == 4
    with s.edit("exp") as m:
        m["more.txt"] = s.put(b"more")
        m.meta["message"] = "one more file"
    assert s.manifest("exp").meta["message"] == "one more file"


def test_log_keys_are_listed_and_capped(history: Tuple[str, casstore.Store],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    store, _s = history
    out = _ok(capsys, "--store", store, "log", "exp", "-n", "1", "--keys", "--max-keys", "3")
    lines = out.splitlines()
    assert lines[1:] == ["    meta: lr", "    + new.txt", "    ~ f00.txt", "    ~ f01.txt", "    ~ f02.txt",
                         "    ~ ... 9 more", "    - f14.txt"], lines
    full = _ok(capsys, "--store", store, "log", "exp", "-n", "1", "-v", "--max-keys", "0").splitlines()
    assert sum(ln.startswith("    ~ f") for ln in full) == 12 and "more" not in "".join(full)


def test_log_json_is_the_same_as_one_document(history: Tuple[str, casstore.Store],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    store, s = history
    doc = json.loads(_ok(capsys, "--store", store, "log", "exp", "--json", "--max-keys", "2"))
    v2, v1 = s.history("exp")
    assert [d["digest"] for d in doc] == [str(v2.digest), str(v1.digest)]
    assert doc[0]["parent"] == str(v1.digest) and doc[1]["parent"] is None
    assert [d["message"] for d in doc] == ["second run", "first run"]
    assert doc[0]["time"] == pytest.approx(s.path(v2.digest).stat().st_mtime)
    ch = doc[0]["changes"]
    assert (ch["added"], ch["modified"], ch["removed"]) == (1, 12, 1)
    assert ch["added_keys"] == ["new.txt"] and ch["removed_keys"] == ["f14.txt"]
    assert ch["modified_keys"] == ["f00.txt", "f01.txt"] and ch["modified_more"] == 10
    assert ch["meta"] == ["lr", "message"] and doc[0]["meta"] == {"lr": 0.1, "message": "second run"}
    assert doc[1]["changes"]["added"] == 15


def test_log_escapes_hostile_messages_and_survives_collected_parents(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    for i in range(3):
        with s.edit("exp") as m:
            m["k"] = s.put(b"v%d" % i)
            m.meta["message"] = "evil\x1b[2J\rmessage"
    out = _ok(capsys, "--store", store, "log", "exp", "-n", "1")
    assert "\x1b" not in out and "\r" not in out and "'evil\\x1b[2J\\rmessage'" in out
    s.plan_gc(keep_history=1, grace=0).execute()  # the oldest version goes
    lines = _ok(capsys, "--store", store, "log", "exp").splitlines()
    assert len(lines) == 2 and "+0 ~1 -0" in lines[0] and "parent not in the store" in lines[1], lines
    doc = json.loads(_ok(capsys, "--store", store, "log", "exp", "--json"))
    assert doc[1]["changes"] is None and doc[1]["parent"] is not None
