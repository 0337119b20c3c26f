"""The ``casstore`` command line (core object commands): real subprocesses, real stores."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from conftest import DROP_PRIVILEGES, PRELOAD, PYTHON, b3, compressible, name_of, object_files

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


def test_init_takes_the_store_option_as_its_directory(tmp_path: Path) -> None:
    _ok(cli(tmp_path, "--store", str(tmp_path / "s5"), "init"))
    assert casstore.open(tmp_path / "s5", create=False).config.compression == "raw"
    _ok(cli(tmp_path, "init", "--store", str(tmp_path / "s6")))  # after the subcommand too
    assert (tmp_path / "s6" / "store.toml").exists()
    _ok(cli(tmp_path, "--store", str(tmp_path / "s5"), "init", str(tmp_path / "s5")))  # the same one twice
    err = _one_line_error(cli(tmp_path, "init"), "InvalidInputError")
    assert "casstore init DIR" in err
    _ok(cli(tmp_path, "--store", str(tmp_path / "s7"), "init", str(tmp_path / "s8")))  # DIR wins
    assert (tmp_path / "s8" / "store.toml").exists() and not (tmp_path / "s7").exists()


def test_put_prints_digests(tmp_path: Path, files: Dict[str, bytes]) -> None:
    store = str(tmp_path / "s")
    _ok(cli(tmp_path, "init", store))  # an explicit --store must exist (issue 12: a typo never makes a store)
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
    assert _ok(cli(tmp_path, "--store", store, "ls", "--objects")) == ""
    assert _ok(cli(tmp_path, "--store", store, "ls")) == ""  # no names yet
    d_raw = s.put(files["a.bin"])
    d_z = s.put(files["b.txt"], compress=True)
    doc = json.loads(_ok(cli(tmp_path, "--store", store, "stat", "--json", str(d_z))))
    info = s.stat(d_z)
    assert doc == {"digest": str(d_z), "size": len(files["b.txt"]), "stored_size": info.stored_size, "codec": "zstd"}
    text = _ok(cli(tmp_path, "--store", store, "stat", d_raw.hex[:12]))
    fields = dict(line.split(None, 1) for line in text.splitlines())
    assert fields == {"digest": str(d_raw), "size": "5000", "stored_size": "5000", "codec": "raw"}

    lines = _ok(cli(tmp_path, "--store", store, "ls", "--objects")).splitlines()
    assert [ln.split() for ln in lines] == [
        [str(d), str(s.stat(d).size), s.stat(d).codec] for d in sorted([d_raw, d_z])]
    docs = [json.loads(ln) for ln in _ok(cli(tmp_path, "--store", store, "ls", "--objects", "--jsonl")).splitlines()]
    assert json.loads(_ok(cli(tmp_path, "--store", store, "ls", "--objects", "--json"))) == docs
    assert [x["digest"] for x in docs] == [str(d) for d in sorted([d_raw, d_z])]
    assert {x["codec"] for x in docs} == {"raw", "zstd"}


def test_demo(tmp_path: Path) -> None:
    store = tmp_path / "demo"
    casstore.open(store)  # with --store the demo runs (and stays) in that existing store
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
    # --store beats $CASSTORE_DIR (an explicit --store must already be a store)
    casstore.open(b)
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


@pytest.mark.parametrize("command", [["ls"], ["stats"], ["pins"], ["verify"], ["ls", "--objects"], ["gc"]])
def test_a_new_users_first_read_command_lists_an_empty_default_store(tmp_path: Path, command: List[str]) -> None:
    """Found by a bug hunt: the README says the default store is made on first use, but a new user's
    first `casstore ls` failed with "not a casstore store"."""
    default = tmp_path / "home" / ".cache" / "casstore"
    _ok(cli(tmp_path, *command))
    assert (default / "store.toml").is_file()
    # An explicit --store that is not a store is still refused (a typo never starts a new store).
    r = cli(tmp_path, "--store", str(tmp_path / "sotre"), *command)
    assert r.returncode == 1 and b"casstore init" in r.stderr
    assert not (tmp_path / "sotre").exists()


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


# -- robustness: never a traceback without --debug (issue 11, class 10) -------------------------------------


def _no_traceback(r: subprocess.CompletedProcess[bytes], rc: int) -> str:
    err = r.stderr.decode()
    assert r.returncode == rc, (r.returncode, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    return err


def _unexpected_line(r: subprocess.CompletedProcess[bytes], command: str, kind: str) -> str:
    err = _no_traceback(r, 1)
    assert err.count("\n") == 1, err
    assert err.startswith(f"casstore: error: {command} failed unexpectedly: "), err
    assert f"[{kind}]" in err and f"casstore --debug {command}" in err, err
    return err


def _sh(tmp_path: Path, redirect: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI started by a shell with ``redirect`` applied (``>&-`` closes stdout, ``>/dev/full`` ...)."""
    return subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", PYTHON, "-m", "casstore.cli", *args],
                          capture_output=True, env=_env(tmp_path), cwd=tmp_path, timeout=120)


def test_bad_argument_values_are_usage_errors(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    casstore.open(store)
    cases = [
        (("log", "-n", "x", "h"), "-n/--limit: expected a whole number >= 0, got 'x'"),
        (("log", "-n", "-1", "h"), "-n/--limit: expected a whole number >= 0, got '-1'"),
        (("gc", "--keep-history", "-1"), "--keep-history: expected a whole number >= 0"),
        (("gc", "--keep-history", "2.5"), "--keep-history: expected a whole number >= 0"),
        (("gc", "--timeout", "-1"), "--timeout: expected a number of seconds >= 0"),
        (("gc", "--timeout", "nan"), "--timeout: expected a number of seconds >= 0"),
        (("gc", "--dry-run", "--yes"), "not allowed with argument"),
        (("manifest", "set", "--timeout", "soon", "m", "k", "v"), "--timeout: expected a number of seconds"),
        (("push", "origin", "--workers", "0"), "--workers: expected a whole number >= 1"),
        (("pull", "origin", "--workers", "many"), "--workers: expected a whole number >= 1"),
        (("pull", "origin", "--merge", "mine"), "invalid choice: 'mine'"),
        (("du", "--by", "tag"), "invalid choice: 'tag'"),
    ]
    for args, message in cases:
        err = _no_traceback(cli(tmp_path, "--store", store, *args), 2)
        assert err.startswith("usage: casstore ") and message in err, (args, err)
    for args in (("manifest",), ("remote",), ("cache",)):  # a command without its action: its help
        err = _no_traceback(cli(tmp_path, "--store", store, *args), 2)
        assert "ACTION" in err and "usage:" in err


def test_bad_values_reaching_the_store_are_one_line_errors(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    d = s.put(b"some bytes")
    for args, kind in [
        (("get", "not-a-digest!"), "InvalidDigestError"),
        (("stat", "sha256:" + "0" * 64), "InvalidDigestError"),
        (("gc", "--grace", "soon"), "InvalidInputError"),
        (("gc", "--grace", "-5"), "InvalidInputError"),
        (("gc", "--max-size", "-5"), "InvalidInputError"),
        (("gc", "--max-size", "lots"), "InvalidInputError"),
        (("init", "--compress", "-3", str(tmp_path / "s2")), "InvalidInputError"),
        (("init", "--compress", "99", str(tmp_path / "s2")), "InvalidInputError"),
        (("put", "no-such-file"), "ObjectNotFoundError"),
        (("get", str(d), "-o", str(tmp_path / "no-such-dir" / "out")), "InvalidInputError"),
        (("get", str(d), "-o", str(tmp_path)), "InvalidInputError"),
        (("get", str(d), "-o", str(tmp_path / ("x" * 300))), "InvalidInputError"),
    ]:
        _one_line_error(cli(tmp_path, "--store", store, *args), kind)
    # FILE|DIGEST: a missing file is named as such, not as a "malformed digest"
    err = _one_line_error(cli(tmp_path, "--store", store, "manifest", "set", "m", "k", "no-such-file"),
                          "ObjectNotFoundError")
    assert "'no-such-file' is neither a file nor a digest" in err
    assert s.heads() == {}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stdout_is_one_typed_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    d = s.put(os.urandom(3 << 20))
    # A full disk under stdout (was "failed unexpectedly": typed now, found by a bug hunt).
    for args in (("get", str(d)), ("ls", "--objects")):  # (ls: the final flush)
        r = _sh(tmp_path, ">/dev/full", "--store", store, *args)
        err = r.stderr.decode()
        assert r.returncode == 1 and err.count("\n") == 1 and err.rstrip().endswith("[DiskFullError]"), err
    r = _sh(tmp_path, ">/dev/full", "--store", store, "--debug", "get", str(d))
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback (most recent call last)" in err and "No space left on device" in err


def test_a_broken_store_never_prints_a_traceback(tmp_path: Path) -> None:
    # Damage an object directory and the settings file by hand: whether the store types
    # these errors or not, the CLI prints one line, and a traceback only with --debug.
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    casstore.open(s1)
    shutil.rmtree(s1 / "objects")
    (s1 / "objects").write_bytes(b"not a directory")
    casstore.open(s2)
    (s2 / "store.toml").unlink()
    (s2 / "store.toml").symlink_to("store.toml")  # a loop
    for root in (s1, s2):
        for args in (("ls", "--objects"), ("put", "a.bin"), ("verify",), ("gc",), ("stats",)):
            (tmp_path / "a.bin").write_bytes(b"a")
            err = _no_traceback(cli(tmp_path, "--store", str(root), *args), 1)
            assert err.count("\n") == 1 and err.startswith("casstore: error: "), (root, args, err)
        r = cli(tmp_path, "--store", str(root), "--debug", "ls", "--objects")
        assert r.returncode == 1 and b"Traceback (most recent call last)" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the CLI as another user")
def test_a_store_the_user_cannot_read_is_one_line(world_dir: Path) -> None:
    root = world_dir / "private"
    casstore.open(root)
    os.chmod(root / "store.toml", 0o600)  # root's; uid 65534 may not read it
    # The interpreter and casstore load as root (the venv may be closed to others), then drop to 65534.
    code = "import sys\nfrom casstore.cli import main\n" + PRELOAD + DROP_PRIVILEGES + "sys.exit(main(sys.argv[1:]))\n"
    for debug in ((), ("--debug",)):
        r = subprocess.run([PYTHON, "-c", code, "--store", str(root), *debug, "ls"], capture_output=True,
                           env=_env(world_dir), cwd=world_dir, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 1, err
        if debug:
            assert "Traceback (most recent call last)" in err
        else:
            assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("casstore: error: "), err


def test_interrupt_exits_130_with_one_line(tmp_path: Path) -> None:
    store = tmp_path / "s"
    s = casstore.open(store)
    d = s.put(b"value")
    locks = os.path.realpath(store / "locks")
    with s.edit("m"):  # held here: the CLI waits for the name lock until interrupted
        p = subprocess.Popen([PYTHON, "-m", "casstore.cli", "--store", str(store), "manifest", "set", "m", "k", str(d)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path), cwd=tmp_path)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until it has the lock file open, i.e. it is waiting
                try:
                    fds = [os.readlink(f"/proc/{p.pid}/fd/{n}") for n in os.listdir(f"/proc/{p.pid}/fd")]
                except OSError:
                    fds = []
                if any(f.startswith(locks + os.sep) for f in fds):
                    break
                assert p.poll() is None, p.communicate()
                time.sleep(0.01)
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 130, err
    assert err == b"casstore manifest set: interrupted\n" and out == b""
    assert "m" not in s.heads()


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    store = tmp_path / "s"
    s = casstore.open(store)
    s.put_many([b"object %d" % i for i in range(3000)])  # `ls` prints ~250 KB: more than a pipe holds
    big = s.put(os.urandom(8 << 20))
    for args in (("ls", "--objects"), ("ls", "--objects", "--json"), ("get", str(big))):
        p = subprocess.Popen([PYTHON, "-m", "casstore.cli", "--store", str(store), *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=_env(tmp_path), cwd=tmp_path)
        assert p.stdout is not None and p.stderr is not None
        assert len(p.stdout.read(100)) == 100  # like `| head -c 100`
        p.stdout.close()
        err = p.stderr.read()
        # Quietly, but not "success" (found by a bug hunt: `verify | head -1` passed a damaged store
        # under pipefail): 141, as for a tool SIGPIPE killed.
        assert p.wait(timeout=120) == 141, err
        assert err == b"", err.decode()


def test_output_to_a_full_disk_is_a_one_line_error(tmp_path: Path) -> None:
    """Found by a bug hunt: `casstore get D > /dev/full` and `ls --json > /dev/full` "failed unexpectedly"."""
    store = tmp_path / "s"
    s = casstore.open(store)
    d = s.put(os.urandom(100_000))
    for args in (("get", str(d)), ("ls", "--objects", "--json")):
        with open("/dev/full", "wb") as full:
            r = subprocess.run([PYTHON, "-m", "casstore.cli", "--store", str(store), *args], stdout=full,
                               stderr=subprocess.PIPE, env=_env(tmp_path), cwd=tmp_path, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 1 and "no space left writing its output" in err and err.count("\n") == 1, err


def test_closed_standard_streams(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    data = os.urandom(1 << 20)
    d = s.put(data)
    _one_line_error(_sh(tmp_path, "<&-", "--store", store, "put", "-"), "InvalidInputError")
    _one_line_error(_sh(tmp_path, ">&-", "--store", store, "get", str(d)), "InvalidInputError")
    # With stdout closed, /dev/stdout (/proc/self/fd/1) must not become the next file the
    # store opens: that once truncated the object being read.
    r = _sh(tmp_path, ">&-", "--store", store, "get", str(d), "-o", "/dev/stdout")
    assert r.returncode == 0, r.stderr.decode()
    assert s.get(d) == data and s.verify().ok
    assert _sh(tmp_path, ">&-", "--store", store, "ls").returncode == 0


def test_get_output_keeps_devices_pipes_and_links(tmp_path: Path) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    data = os.urandom(300_000)
    d = s.put(data)
    # a new file: the permissions any new file gets (mkstemp's 0600 is not kept)
    umask = os.umask(0o022)
    os.umask(umask)
    _ok(cli(tmp_path, "--store", store, "get", str(d), "-o", "new.bin"))
    assert (tmp_path / "new.bin").read_bytes() == data
    assert stat.S_IMODE(os.stat(tmp_path / "new.bin").st_mode) == 0o666 & ~umask
    # an existing file keeps its permissions
    (tmp_path / "old.bin").write_bytes(b"old")
    os.chmod(tmp_path / "old.bin", 0o640)
    _ok(cli(tmp_path, "--store", store, "get", str(d), "-o", "old.bin"))
    assert (tmp_path / "old.bin").read_bytes() == data and stat.S_IMODE(os.stat(tmp_path / "old.bin").st_mode) == 0o640
    # a symlink: the file it names gets the bytes, the link stays
    (tmp_path / "target.bin").write_bytes(b"old")
    (tmp_path / "link.bin").symlink_to("target.bin")
    _ok(cli(tmp_path, "--store", store, "get", str(d), "-o", "link.bin"))
    assert (tmp_path / "link.bin").is_symlink() and (tmp_path / "target.bin").read_bytes() == data
    # a named pipe is written into, not replaced
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: List[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    _ok(cli(tmp_path, "--store", store, "get", str(d), "-o", str(fifo)))
    reader.join(60)
    assert got == [data] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    # /dev/stdout appends where the shell points stdout (reopening it would truncate the file)
    (tmp_path / "log").write_bytes(b"header\n")
    r = _sh(tmp_path, f">>{tmp_path / 'log'}", "--store", store, "get", str(d), "-o", "/dev/stdout")
    assert r.returncode == 0, r.stderr.decode()
    assert (tmp_path / "log").read_bytes() == b"header\n" + data


# -- name lifecycle and version addressing (issue 12): rm, mv, NAME~N / NAME@HEX, ls --names --all --


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process (fast); returns (exit code, stdout, stderr)."""
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def _cli_error(capsys: pytest.CaptureFixture[str], kind: str, *args: str) -> str:
    rc, out, err = _main(capsys, *args)
    assert rc == 1 and out == "" and err.count("\n") == 1 and err.rstrip().endswith(f"[{kind}]"), (rc, out, err)
    assert "force=True" not in err and "store." not in err  # the CLI speaks flags, not Python keywords
    return err


def test_empty_and_impossible_arguments_are_one_line_errors(tmp_path: Path) -> None:
    """Found by a bug hunt: each of these was a traceback-free but untyped "failed unexpectedly", or worse
    (``--store ""`` used and made the default store; ``-o ""`` wrote binary to stdout)."""
    store = tmp_path / "s"
    _ok(cli(tmp_path, "init", str(store)))
    d = _ok(cli(tmp_path, "--store", str(store), "put", "-", stdin=b"bytes")).split()[0]
    (tmp_path / "a.txt").write_bytes(b"x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    long_name = "z" * 300
    long_path = "/".join(["d" * 200] * 25)
    cases = [
        (["--store", "", "ls"], "InvalidInputError", "--store is empty"),
        (["ls", "--store", ""], "InvalidInputError", "--store is empty"),
        (["--store", str(store), "get", ""], "InvalidInputError", "empty OBJECT"),
        (["--store", str(store), "get", d, "-o", ""], "InvalidInputError", "-o is empty"),
        (["init", ""], "InvalidInputError", "empty argument"),
        (["init", str(tmp_path / "a.txt" / "sub")], "InvalidInputError", "a part of the path is a file"),
        (["init", str(tmp_path / "dangling")], "InvalidInputError", "symbolic link to a missing directory"),
        (["init", str(tmp_path / long_name)], "InvalidInputError", "longer than the filesystem allows"),
        (["--store", str(tmp_path / long_name), "ls"], "StoreFormatError", "no casstore store there"),
        (["--store", long_path, "ls"], "StoreFormatError", "no casstore store there"),
        (["--store", str(store), "add", "n", str(tmp_path / long_name)], "InvalidInputError", "cannot open the folder"),
    ]
    for args, kind, words in cases:
        err = _one_line_error(cli(tmp_path, *args), kind)
        assert words in err, (args, err)
    assert not (tmp_path / "home" / ".cache").exists()  # no default store was made


def test_manifest_set_takes_what_is_at_the_path_and_checkout_hints_speak_cli(tmp_path: Path) -> None:
    """Found by a bug hunt: a directory named like a hex prefix was taken for a digest prefix; checkout's
    hints named Python keywords."""
    store = tmp_path / "s"
    _ok(cli(tmp_path, "init", str(store)))
    (tmp_path / "file.bin").write_bytes(b"x")
    _ok(cli(tmp_path, "--store", str(store), "manifest", "set", "e", "k", "file.bin"))
    version = _ok(cli(tmp_path, "--store", str(store), "manifest", "show", "e")).split()[1]
    prefix = version.split(":")[1][:2]
    (tmp_path / prefix).mkdir()
    err = _one_line_error(cli(tmp_path, "--store", str(store), "manifest", "set", "e", "k2", prefix),
                          "InvalidInputError")
    assert "is a directory" in err
    out = tmp_path / "out"
    out.mkdir()
    (out / "k").write_bytes(b"mine")
    err = _one_line_error(cli(tmp_path, "--store", str(store), "checkout", "e", str(out)), "InvalidInputError")
    assert "--overwrite" in err and "overwrite=True" not in err


def test_names_from_disk_never_reach_the_terminal_raw(tmp_path: Path) -> None:
    """Found by a bug hunt: a file name or metadata key holding an escape sequence or a newline was
    printed raw (it could clear the screen or forge a line such as "deleted   a")."""
    store = tmp_path / "s"
    _ok(cli(tmp_path, "init", str(store)))
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a").write_bytes(b"a")
    evil = "x\x1b[2J\x1b[31mFAKE"
    (folder / evil).symlink_to("/etc/passwd")  # skipped (a link), and named in the output
    for args in (["add", "n", str(folder), "--meta", "k\x1b[31m=v"], ["status", "n", str(folder)],
                 ["manifest", "show", "n"]):
        r = cli(tmp_path, "--store", str(store), *args)
        assert r.returncode == 0, r.stderr
        assert b"\x1b" not in r.stdout + r.stderr, (args, r.stdout, r.stderr)
    out = _ok(cli(tmp_path, "--store", str(store), "manifest", "show", "n"))
    assert "meta 'k\\x1b[31m' = 'v'" in out
    (folder / "evil\ndeleted   a").write_bytes(b"z")
    r = cli(tmp_path, "--store", str(store), "status", "n", str(folder))
    err = _one_line_error(r, "InvalidInputError")  # refused as add refuses it, in CLI words
    assert "--exclude GLOB" in err and b"\ndeleted" not in r.stdout


def test_rm_and_mv_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    with s.edit("exp") as m:
        m["k"] = s.put(b"v1")
    with s.edit("exp") as m:
        m["k"] = s.put(b"v2")
    first, head = [v.digest for v in s.history("exp")][::-1]
    rc, out, _ = _main(capsys, "--store", store, "mv", "exp", "team/exp")
    assert rc == 0 and "team/exp" in out and s.heads() == {"team/exp": head}
    assert s.manifest("team/exp~1").digest == first
    with s.edit("other") as m:
        m["k"] = s.put(b"o")
    err = _cli_error(capsys, "NameExistsError", "--store", store, "mv", "team/exp", "other")
    assert "--force" in err
    rc, out, _ = _main(capsys, "--store", store, "mv", "--force", "team/exp", "other")
    assert rc == 0 and s.heads() == {"other": head}

    s.freeze("other")
    for args in (("rm", "other"), ("mv", "other", "x")):
        err = _cli_error(capsys, "FrozenError", "--store", store, *args)
        assert "--force" in err and "casstore unpin other" in err
    rc, out, _ = _main(capsys, "--store", store, "rm", "--force", "other")
    assert rc == 0 and f"was {head}" in out and s.pins() == {} and s.heads() == {}
    _cli_error(capsys, "ManifestNotFoundError", "--store", store, "rm", "other")
    _cli_error(capsys, "InvalidInputError", "--store", store, "mv", "nothing", "bad~1")
    # the removed name's versions stay until gc: the printed digest brings one back
    rc, out, _ = _main(capsys, "--store", store, "pin", "back", str(head))
    assert rc == 0 and s.pins() == {"back": head}
    # pin's own refusal also names the flag
    assert "--force" in _cli_error(capsys, "FrozenError", "--store", store, "pin", "back", str(first))
    # one line, no traceback, from a real process too
    _one_line_error(cli(tmp_path, "--store", store, "rm", "back"), "FrozenError")


def test_versions_are_accepted_by_show_diff_checkout_log_and_pin(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    for i in range(3):
        with s.edit("exp") as m:
            m["k"] = s.put(b"content %d" % i)
            m.meta["i"] = i
    vs = [v.digest for v in s.history("exp")]  # newest first: exp~0, exp~1, exp~2
    rc, out, _ = _main(capsys, "--store", store, "manifest", "show", "--json", "exp~2")
    assert rc == 0 and json.loads(out)["digest"] == str(vs[2]) and json.loads(out)["meta"] == {"i": 0}
    rc, out, _ = _main(capsys, "--store", store, "manifest", "show", f"exp@{vs[1].hex[:10]}")
    assert rc == 0 and out.startswith(f"exp@{vs[1].hex[:10]}  {vs[1]}  [version]")
    rc, out, _ = _main(capsys, "--store", store, "manifest", "show", "exp~0")
    assert rc == 0 and f"{vs[0]}  [head]" in out
    rc, out, _ = _main(capsys, "--store", store, "diff", "--json", "exp~2", "exp")
    doc = json.loads(out)
    assert rc == 0 and (doc["a"], doc["b"]) == (str(vs[2]), str(vs[0])) and list(doc["changed"]) == ["k"]
    rc, out, _ = _main(capsys, "--store", store, "checkout", "exp~1", str(tmp_path / "co"))
    assert rc == 0 and (tmp_path / "co" / "k").read_bytes() == b"content 1"
    rc, out, _ = _main(capsys, "--store", store, "log", "exp~1")
    assert rc == 0 and [ln.split()[0] for ln in out.splitlines()] == [str(vs[1]), str(vs[2])]
    rc, out, _ = _main(capsys, "--store", store, "pin", "best", f"exp@{vs[2].hex[:12]}")
    assert rc == 0 and out.strip() == str(vs[2]) and s.pins() == {"best": vs[2]}
    rc, out, _ = _main(capsys, "--store", store, "manifest", "show", "best")
    assert rc == 0 and "[pin (frozen)]" in out
    for bad in ("exp~3", "exp~-1", "exp~x", "exp@", "exp@zz", "exp~" + "9" * 30):
        _cli_error(capsys, "ManifestNotFoundError", "--store", store, "manifest", "show", bad)
    _cli_error(capsys, "InvalidInputError", "--store", store, "log", "exp@blake3:zz")


def test_ls_names_hides_internal_records_unless_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = str(tmp_path / "s")
    s = casstore.open(store)
    d = s.put(b"x")
    with s.edit("exp") as m:
        m["k"] = d
    s.pin("paper", "exp")
    with s.edit("_fetch/0123") as m:
        m["k"] = d
        m.meta.update(kind="casstore.fetch", url="https://alice:s3cret@example.org/data.tar?sig=TOKEN")
    rc, out, _ = _main(capsys, "--store", store, "ls", "--names")  # the default listing, flag kept for scripts
    assert rc == 0 and [ln.split()[:2] + ln.split()[-1:] for ln in out.splitlines()] == [
        ["exp", "head", str(s.heads()["exp"])], ["paper", "pin", str(s.pins()["paper"])]]
    assert _main(capsys, "--store", store, "ls")[1] == out
    rc, out, _ = _main(capsys, "--store", store, "ls", "--all")
    assert rc == 0 and "_fetch/0123" in out and f"{s.heads()['_fetch/0123']}  https://example.org/data.tar\n" in out
    assert "s3cret" not in out and "TOKEN" not in out and "alice" not in out
    rc, out, _ = _main(capsys, "--store", store, "ls", "--names", "--all", "--json")
    doc = json.loads(out)
    assert rc == 0 and [x["name"] for x in doc] == ["_fetch/0123", "exp", "paper"]
    assert {k: doc[0][k] for k in ("name", "kind", "digest", "internal", "url")} == {
        "name": "_fetch/0123", "kind": "head", "digest": str(s.heads()["_fetch/0123"]),
        "internal": True, "url": "https://example.org/data.tar"}
    rc, out, _ = _main(capsys, "--store", store, "pins", "--heads")
    assert rc == 0 and "_fetch" not in out and "exp" in out
    rc, out, _ = _main(capsys, "--store", store, "pins", "--heads", "--all")
    assert rc == 0 and "_fetch/0123" in out
    _cli_error(capsys, "InvalidInputError", "--store", store, "ls", "--objects", "--all")
    rc, out, _ = _main(capsys, "--store", store, "ls", "--objects")  # objects only with --objects
    assert rc == 0 and str(d) in out and "exp" not in out
