"""The ``casstore`` command line (core object commands): real subprocesses, real stores."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from conftest import PYTHON, b3, compressible, name_of, object_files

import casstore
from casstore.cli import main


def _env(tmp_path: Path, **extra: str) -> Dict[str, str]:
    """A clean environment: no CASSTORE_* variables, home and XDG dirs inside tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_") and not k.startswith("XDG_")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"))
    env.update(extra)
    return env


def cli(tmp_path: Path, *args: str, env: Optional[Dict[str, str]] = None, stdin: bytes = b"",
        cwd: Optional[Path] = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([PYTHON, "-m", "casstore.cli", *args], input=stdin, capture_output=True,
                          env=env if env is not None else _env(tmp_path), cwd=cwd or tmp_path, timeout=120)


def _ok(r: subprocess.CompletedProcess[bytes]) -> str:
    assert r.returncode == 0, r.stderr.decode()
    assert r.stderr == b"", r.stderr.decode()
    return r.stdout.decode()


def _one_line_error(r: subprocess.CompletedProcess[bytes], kind: str) -> str:
    err = r.stderr.decode()
    assert r.returncode == 1, (r.returncode, err)
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("casstore: error: "), err
    assert err.rstrip().endswith(f"[{kind}]"), err
    return err


@pytest.fixture
def files(tmp_path: Path) -> Dict[str, bytes]:
    data = {"a.bin": os.urandom(5000), "b.txt": compressible(200_000), "empty": b""}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    return data


def test_init(tmp_path: Path) -> None:
    out = _ok(cli(tmp_path, "init", str(tmp_path / "s1")))
    assert out == f"casstore store at {tmp_path / 's1'} (compression raw, durable true)\n"
    assert casstore.open(tmp_path / "s1", create=False).config.compression == "raw"

    out = _ok(cli(tmp_path, "init", "--compress", "zstd", "--scratch", str(tmp_path / "s2")))
    assert "compression zstd" in out and "durable false" in out
    cfg = casstore.open(tmp_path / "s2", create=False).config
    assert (cfg.compression, cfg.durable) == ("zstd", False)

    _ok(cli(tmp_path, "init", "--compress", "9", str(tmp_path / "s3")))  # a level, given as digits
    cfg = casstore.open(tmp_path / "s3", create=False).config
    assert (cfg.compression, cfg.level) == ("zstd", 9)

    # init of an existing store is harmless and keeps its settings
    _ok(cli(tmp_path, "init", str(tmp_path / "s2")))
    assert casstore.open(tmp_path / "s2").config.compression == "zstd"

    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "file").write_text("x")
    _one_line_error(cli(tmp_path, "init", str(tmp_path / "occupied")), "StoreFormatError")
    _one_line_error(cli(tmp_path, "init", "--compress", "lz4", str(tmp_path / "s4")), "InvalidInputError")


def test_put_prints_digests(tmp_path: Path, files: Dict[str, bytes]) -> None:
    store = str(tmp_path / "s")
    out = _ok(cli(tmp_path, "--store", store, "put", "a.bin"))
    assert out == b3(files["a.bin"]) + "\n"
    out = _ok(cli(tmp_path, "--store", store, "put", "a.bin", "b.txt", "empty"))
    assert out.splitlines() == [f"{b3(files[n])}  {n}" for n in ("a.bin", "b.txt", "empty")]
    out = _ok(cli(tmp_path, "--store", store, "put", "--names", "b.txt"))
    assert out == f"{b3(files['b.txt'])}  b.txt\n"
    # stdin
    out = _ok(cli(tmp_path, "--store", store, "put", "-", stdin=b"from stdin"))
    assert out == b3(b"from stdin") + "\n"
    s = casstore.open(store)
    assert sorted(str(d) for d in s.iter_objects()) == sorted(
        {b3(files["a.bin"]), b3(files["b.txt"]), b3(b""), b3(b"from stdin")})
    assert s.stat(b3(files["b.txt"])).codec == "raw"  # the store's default
    # --compress: a codec name or a level; the digest never changes
    text = compressible(100_000, seed=4)
    (tmp_path / "c.txt").write_bytes(text)
    (tmp_path / "d.txt").write_bytes(text + b"!")
    assert _ok(cli(tmp_path, "--store", store, "put", "--compress", "zstd", "c.txt")) == b3(text) + "\n"
    assert _ok(cli(tmp_path, "--store", store, "put", "--compress", "19", "d.txt")) == b3(text + b"!") + "\n"
    assert s.stat(b3(text)).codec == "zstd" and s.stat(b3(text + b"!")).codec == "zstd"


def test_get_to_stdout_and_file(tmp_path: Path, files: Dict[str, bytes]) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    d_raw = s.put(files["a.bin"])
    d_z = s.put(files["b.txt"], compress=True)
    for d, data in ((d_raw, files["a.bin"]), (d_z, files["b.txt"])):
        r = cli(tmp_path, "--store", store, "get", str(d))
        assert r.returncode == 0 and r.stdout == data and r.stderr == b""
        # a unique prefix is enough
        r = cli(tmp_path, "--store", store, "get", d.hex[:16])
        assert r.returncode == 0 and r.stdout == data
        out = tmp_path / f"out-{d.hex[:8]}"
        assert _ok(cli(tmp_path, "--store", store, "get", str(d), "-o", str(out))) == ""
        assert out.read_bytes() == data
    r = cli(tmp_path, "--store", store, "get", str(d_raw), "-o", "-")
    assert r.stdout == files["a.bin"]


def test_get_of_a_corrupt_object_fails_and_writes_no_file(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    data = os.urandom(3 << 20)
    d = s.put(data)
    with open(s.path(d), "r+b") as f:
        f.seek(len(data) - 1)
        f.write(bytes([data[-1] ^ 1]))
    out = tmp_path / "out.bin"
    err = _one_line_error(cli(tmp_path, "--store", store, "get", str(d), "-o", str(out)), "IntegrityError")
    assert str(d) in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
    r = cli(tmp_path, "--store", store, "get", str(d))
    _one_line_error(r, "IntegrityError")
    assert len(r.stdout) < len(data)  # the last chunk is never written
    # --no-verify hands out the stored bytes
    r = cli(tmp_path, "--store", store, "get", "--no-verify", str(d))
    assert r.returncode == 0 and r.stdout[:-1] == data[:-1] and r.stdout[-1] == data[-1] ^ 1


def test_stat_and_ls(tmp_path: Path, files: Dict[str, bytes]) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    assert _ok(cli(tmp_path, "--store", store, "ls")) == ""
    d_raw = s.put(files["a.bin"])
    d_z = s.put(files["b.txt"], compress=True)
    doc = json.loads(_ok(cli(tmp_path, "--store", store, "stat", "--json", str(d_z))))
    info = s.stat(d_z)
    assert doc == {"digest": str(d_z), "size": len(files["b.txt"]), "stored_size": info.stored_size, "codec": "zstd"}
    text = _ok(cli(tmp_path, "--store", store, "stat", d_raw.hex[:12]))
    fields = dict(line.split(None, 1) for line in text.splitlines())
    assert fields == {"digest": str(d_raw), "size": "5000", "stored_size": "5000", "codec": "raw"}

    lines = _ok(cli(tmp_path, "--store", store, "ls")).splitlines()
    assert [ln.split() for ln in lines] == [
        [str(d), str(s.stat(d).size), s.stat(d).codec] for d in sorted([d_raw, d_z])]
    docs = [json.loads(ln) for ln in _ok(cli(tmp_path, "--store", store, "ls", "--json")).splitlines()]
    assert [x["digest"] for x in docs] == [str(d) for d in sorted([d_raw, d_z])]
    assert {x["codec"] for x in docs} == {"raw", "zstd"}


def test_demo(tmp_path: Path) -> None:
    store = tmp_path / "demo"
    out = _ok(cli(tmp_path, "--store", str(store), "demo"))
    assert f"store: {store}" in out
    assert "both times: True" in out
    assert "stored zstd" in out and "the digest is that of the uncompressed bytes: True" in out
    assert "codec raw (compression skipped" in out
    assert "returned identical bytes: True" in out
    assert "objects in store: 0 before, 4 after" in out
    s = casstore.open(store, create=False)
    assert len(list(s.iter_objects())) == 4
    assert sorted(s.manifest("demo")) == ["payload.txt", "train.log", "weights.bin"]
    assert all(name_of(p) == b3(casstore.open(store).get(name_of(p))) for p in object_files(store))


def _where(tmp_path: Path, env: Dict[str, str], *pre: str) -> List[Path]:
    """Put a unique file through the CLI; return every directory under tmp_path holding that object."""
    data = os.urandom(100)
    (tmp_path / "u.bin").write_bytes(data)
    r = cli(tmp_path, *pre, "put", "u.bin", env=env)
    assert _ok(r).strip() == b3(data)
    hits = []
    for cfg in tmp_path.rglob("store.toml"):
        if casstore.open(cfg.parent, create=False).contains(b3(data)):
            hits.append(cfg.parent)
    return hits


def test_store_selection_precedence(tmp_path: Path) -> None:
    a, b = tmp_path / "env-store", tmp_path / "flag-store"
    home = tmp_path / "home"
    # --store beats $CASSTORE_DIR
    assert _where(tmp_path, _env(tmp_path, CASSTORE_DIR=str(a)), "--store", str(b)) == [b]
    # $CASSTORE_DIR when there is no --store
    assert _where(tmp_path, _env(tmp_path, CASSTORE_DIR=str(a))) == [a]
    # then $XDG_CACHE_HOME/casstore
    assert _where(tmp_path, _env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"))) == [tmp_path / "xdg" / "casstore"]
    # then ~/.cache/casstore
    assert _where(tmp_path, _env(tmp_path)) == [home / ".cache" / "casstore"]


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    ds = [s.put(os.urandom(20)) for _ in range(40)]
    missing = casstore.Digest.of(b"missing")
    err = _one_line_error(cli(tmp_path, "--store", store, "get", str(missing)), "ObjectNotFoundError")
    assert str(missing) in err
    _one_line_error(cli(tmp_path, "--store", store, "stat", "blake3:xyz"), "InvalidDigestError")
    first = [d.hex[0] for d in ds]
    amb = next(c for c in "0123456789abcdef" if first.count(c) > 1)
    _one_line_error(cli(tmp_path, "--store", store, "get", amb), "AmbiguousDigestError")
    _one_line_error(cli(tmp_path, "--store", store, "put", "no-such-file"), "ObjectNotFoundError")
    # reading commands never create a store
    _one_line_error(cli(tmp_path, "--store", str(tmp_path / "nostore"), "ls"), "StoreFormatError")
    _one_line_error(cli(tmp_path, "--store", str(tmp_path / "nostore"), "get", str(missing)), "StoreFormatError")
    assert not (tmp_path / "nostore").exists()
    # a file given as the store
    (tmp_path / "plainfile").write_text("x")
    _one_line_error(cli(tmp_path, "--store", str(tmp_path / "plainfile"), "ls"), "StoreFormatError")
    _one_line_error(cli(tmp_path, "--store", str(tmp_path / "plainfile"), "put", "plainfile"), "StoreFormatError")


def test_debug_shows_traceback(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    casstore.open(store)
    missing = str(casstore.Digest.of(b"missing"))
    r = cli(tmp_path, "--store", store, "--debug", "get", missing)
    err = r.stderr.decode()
    assert r.returncode != 0
    assert "Traceback (most recent call last)" in err
    assert "casstore.errors.ObjectNotFoundError" in err


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    r = cli(tmp_path)
    assert r.returncode == 2 and b"usage:" in r.stderr
    r = cli(tmp_path, "get")
    assert r.returncode == 2 and b"usage:" in r.stderr
    r = cli(tmp_path, "frobnicate")
    assert r.returncode == 2


def test_main_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CASSTORE_DIR", raising=False)
    store = str(tmp_path / "s")
    (tmp_path / "f.bin").write_bytes(b"in process")
    assert main(["init", store]) == 0
    assert main(["--store", store, "put", "f.bin"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == b3(b"in process")
    assert main(["--store", store, "stat", "--json", b3(b"in process")]) == 0
    assert json.loads(capsys.readouterr().out)["size"] == len(b"in process")
    assert main(["--store", store, "get", "blake3:" + "0" * 64]) == 1
    cap = capsys.readouterr()
    assert cap.err.startswith("casstore: error: ") and cap.err.count("\n") == 1 and cap.out == ""
    with pytest.raises(casstore.ObjectNotFoundError):
        main(["--store", store, "--debug", "get", "blake3:" + "0" * 64])
    monkeypatch.setenv("CASSTORE_DIR", str(tmp_path / "envstore"))
    assert main(["put", "f.bin"]) == 0
    assert casstore.open(tmp_path / "envstore", create=False).contains(b3(b"in process"))
