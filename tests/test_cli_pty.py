"""Terminal behaviour in a real pseudo-terminal (issue 12): progress only on a TTY, no binary onto a TTY.

The child's stdout and/or stderr are the slave side of ``os.openpty()``; what it
writes there is read back from the master side, exactly as a terminal would
receive it.  The same commands run with pipes show that nothing leaks there.
"""

from __future__ import annotations

import errno
import json
import os
import select
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import _seaweed
import pytest
from conftest import PYTHON

import casstore
from casstore._progress import Progress

aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote_url = _seaweed.remote_url


def _env(tmp_path: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_") and not k.startswith("XDG_")}
    env.update(HOME=str(tmp_path), TERM="xterm", COLUMNS="120")
    return env


def run_on_pty(tmp_path: Path, *args: str, stdout_tty: bool, stderr_tty: bool,
               stdout_file: Optional[Path] = None) -> Tuple[int, bytes, bytes, bytes]:
    """Run ``casstore ARGS``; return (exit code, bytes the terminal got, piped stdout, piped stderr).

    ``stdout_file``: stdout redirected to that file (``casstore ... > FILE``) instead of a pipe.
    """
    master, slave = os.openpty()
    out_file = open(stdout_file, "wb") if stdout_file is not None else None
    try:
        p = subprocess.Popen([PYTHON, "-m", "casstore", *args], stdin=subprocess.DEVNULL,
                             stdout=slave if stdout_tty else (out_file or subprocess.PIPE),
                             stderr=slave if stderr_tty else subprocess.PIPE,
                             env=_env(tmp_path), cwd=tmp_path)
    finally:
        if out_file is not None:
            out_file.close()
    os.close(slave)
    tty = bytearray()
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            assert ready, "no output and no exit within 60 s"
            try:
                chunk = os.read(master, 65536)
            except OSError as e:  # EIO: every slave fd is closed (the child exited)
                if e.errno != errno.EIO:
                    raise
                break
            if not chunk:
                break
            tty += chunk
    finally:
        os.close(master)
    out, err = p.communicate(timeout=60)
    return p.returncode, bytes(tty), out or b"", err or b""


def _store(tmp_path: Path) -> Tuple[Path, casstore.Store]:
    root = tmp_path / "s"
    return root, casstore.open(root)


def test_put_progress_on_a_terminal_and_not_in_a_pipe(tmp_path: Path) -> None:
    root, s = _store(tmp_path)
    (tmp_path / "big.bin").write_bytes(os.urandom(3 << 20))
    rc, tty, out, err = run_on_pty(tmp_path, "--store", str(root), "put", "big.bin", stdout_tty=False,
                                   stderr_tty=True)
    assert rc == 0, tty
    assert b"put: 100.0% [" in tty and b"3.0 MiB/3.0 MiB" in tty, tty
    assert out.decode().strip() == str(casstore.Digest.of((tmp_path / "big.bin").read_bytes()))
    # piped: the same command writes no progress at all
    (tmp_path / "big2.bin").write_bytes(os.urandom(3 << 20))
    p = subprocess.run([PYTHON, "-m", "casstore", "--store", str(root), "put", "big2.bin"], capture_output=True,
                       env=_env(tmp_path), cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    assert len(list(s.iter_objects())) == 2


def test_add_progress_on_a_terminal_and_not_in_a_pipe(tmp_path: Path) -> None:
    root, _s = _store(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    for i in range(5):
        (folder / f"f{i}.bin").write_bytes(os.urandom(200_000))
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(root), "add", "run", str(folder), stdout_tty=False,
                                     stderr_tty=True)
    assert rc == 0, tty
    assert b"add: " in tty and b"100.0%" in tty, tty
    (folder / "new.bin").write_bytes(os.urandom(1000))
    p = subprocess.run([PYTHON, "-m", "casstore", "--store", str(root), "add", "run", str(folder)],
                       capture_output=True, env=_env(tmp_path), cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    assert b"add: " not in p.stderr and b"\r" not in p.stderr, p.stderr


def test_get_refuses_binary_on_a_terminal(tmp_path: Path) -> None:
    root, s = _store(tmp_path)
    binary = bytes(range(256)) * 64
    d = s.put(binary)
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(root), "get", str(d), stdout_tty=True,
                                     stderr_tty=True)
    assert rc == 1, tty
    text = tty.decode("utf-8", "replace")
    assert "looks binary and stdout is a terminal" in text and "-o -" in text, text
    assert "\x00" not in text and "\x01" not in text  # none of the object reached the terminal
    # -o - insists: the bytes go to the terminal (the pty's line discipline maps \n to \r\n)
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(root), "get", str(d), "-o", "-", stdout_tty=True,
                                     stderr_tty=False)
    assert rc == 0
    assert tty.replace(b"\r\n", b"\n").count(b"\x00") == binary.count(b"\x00")
    # text is shown on a terminal as it is
    t = s.put(b"lr = 0.1\nepochs = 3\n")
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(root), "get", str(t), stdout_tty=True, stderr_tty=True)
    assert rc == 0 and tty.replace(b"\r\n", b"\n") == b"lr = 0.1\nepochs = 3\n", tty
    # and a pipe gets binary without -o -
    p = subprocess.run([PYTHON, "-m", "casstore", "--store", str(root), "get", str(d)], capture_output=True,
                       env=_env(tmp_path), cwd=tmp_path, timeout=60)
    assert p.returncode == 0 and p.stdout == binary and p.stderr == b""


def _frames(tty: bytes, desc: str) -> List[str]:
    """The progress lines ``desc: ...`` a terminal was sent (each redraw starts with a carriage return)."""
    text = tty.decode("utf-8", "replace").replace("\n", "\r")
    return [f.strip() for f in text.split("\r") if f.startswith(f"{desc}: ")]


def _piped(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([PYTHON, "-m", "casstore", *args], capture_output=True, env=_env(tmp_path), cwd=tmp_path,
                          timeout=120)


def test_eta_is_withheld_until_sound_and_never_absurd() -> None:
    now = [100.0]
    clock = lambda: now[0]  # noqa: E731 - a settable clock: the ETA rules depend only on elapsed time
    bar = Progress(1000, desc="x", enabled=False, clock=clock)
    assert bar.eta() == "--" and "ETA --" in bar.line()  # nothing done: no "0s" at the start
    bar.update(500)
    now[0] += 0.05
    assert bar.eta() == "--"  # half done in 50 ms: too early to extrapolate (open, page cache)
    now[0] += 1.95
    assert bar.eta() == "2s" and bar.line().endswith("ETA 2s")  # 500 in 2 s, 500 left
    slow = Progress(10**12, desc="x", enabled=False, clock=clock)
    slow.update(1)
    now[0] += 2
    assert slow.eta() == "--"  # 2 s in and a millionth done: not yet a sound estimate
    now[0] += 4
    assert slow.eta() == ">99h"  # after the patience period an estimate, capped rather than absurd
    bar.update(500)
    assert bar.line().endswith("in 8s") and "ETA" not in bar.line()  # finished: the time taken


def test_get_progress_to_a_file_on_a_terminal_and_not_in_a_pipe(tmp_path: Path) -> None:
    root, s = _store(tmp_path)
    data = os.urandom(24 << 20)
    d = s.put(data)
    rc, tty, out, _err = run_on_pty(tmp_path, "--store", str(root), "get", str(d), "-o", "out.bin",
                                    stdout_tty=False, stderr_tty=True)
    assert rc == 0, tty
    frames = _frames(tty, "get")
    assert frames and "100.0%" in frames[-1] and "24.0 MiB/24.0 MiB" in frames[-1], tty
    assert frames[0].endswith("ETA --"), frames  # the first frame never guesses
    assert all("ETA 0s" not in f for f in frames if "100.0%" not in f), frames
    assert (tmp_path / "out.bin").read_bytes() == data and out == b""
    # `get D > FILE`: stdout is a file, so the bar goes to the terminal too
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(root), "get", str(d), stdout_tty=False,
                                     stderr_tty=True, stdout_file=tmp_path / "redirected.bin")
    assert rc == 0 and _frames(tty, "get"), tty
    assert (tmp_path / "redirected.bin").read_bytes() == data
    # piped stderr: no bar at all
    p = _piped(tmp_path, "--store", str(root), "get", str(d), "-o", "out2.bin")
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    # bytes going to a pipe get no bar beside them (less than a pipe holds: run_on_pty reads the pipe last)
    small = s.put(os.urandom(32 << 10))
    rc, tty, out, _err = run_on_pty(tmp_path, "--store", str(root), "get", str(small), stdout_tty=False,
                                    stderr_tty=True)
    assert rc == 0 and out == s.get(small) and b"get: " not in tty, tty[:200]


def test_verify_and_gc_progress_on_a_terminal_and_not_in_a_pipe(tmp_path: Path) -> None:
    root, s = _store(tmp_path)
    for _i in range(4):
        s.put(os.urandom(2 << 20))
    rc, tty, out, _err = run_on_pty(tmp_path, "--store", str(root), "verify", stdout_tty=False, stderr_tty=True)
    assert rc == 0, tty
    frames = _frames(tty, "verify")
    assert frames and "100.0%" in frames[-1] and "8.0 MiB/8.0 MiB" in frames[-1], tty
    assert b"verify: " not in out  # the summary on stdout is not a bar
    p = _piped(tmp_path, "--store", str(root), "verify")
    assert p.returncode == 0 and p.stderr == b"", p.stderr
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(root), "gc", "--yes", "--grace", "0",
                                     stdout_tty=False, stderr_tty=True)
    assert rc == 0, tty
    frames = _frames(tty, "gc")
    assert frames and "100.0%" in frames[-1] and "4/4" in frames[-1], tty
    assert list(s.iter_objects()) == []
    for _i in range(2):
        s.put(os.urandom(1000))
    p = _piped(tmp_path, "--store", str(root), "gc", "--yes", "--grace", "0")
    assert p.returncode == 0 and p.stderr == b"" and list(s.iter_objects()) == [], p.stderr


@pytest.mark.slow
def test_push_and_pull_progress_on_a_terminal_and_not_in_a_pipe(tmp_path: Path, remote_url: str,
                                                                 seaweed: Any) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    sa, sb = casstore.open(a), casstore.open(b)
    with sa.edit("exp") as m:
        for i in range(3):
            m[f"w{i}.bin"] = sa.put(os.urandom(3 << 20))
    for root in (a, b):
        p = _piped(tmp_path, "--store", str(root), "remote", "add", "origin", remote_url, "--endpoint-url",
                   str(seaweed.endpoint))
        assert p.returncode == 0, p.stderr
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(a), "push", "origin", stdout_tty=False,
                                     stderr_tty=True)
    assert rc == 0, tty
    frames = _frames(tty, "push origin")
    assert frames and "100.0%" in frames[-1] and frames[0].endswith("ETA --"), tty
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(b), "pull", "origin", stdout_tty=False,
                                     stderr_tty=True)
    assert rc == 0, tty
    frames = _frames(tty, "pull origin")
    assert frames and (frames[0].endswith("ETA --") or "ETA" not in frames[0]), tty  # no total: a count
    assert sb.heads() == sa.heads()
    # piped: the same transfers print their summary on stderr, but no bar
    with sa.edit("exp") as m:
        m["more.bin"] = sa.put(os.urandom(1 << 20))
    for root, cmd in ((a, "push"), (b, "pull")):
        p = _piped(tmp_path, "--store", str(root), cmd, "origin")
        assert p.returncode == 0, p.stderr
        assert b"\r" not in p.stderr and f"{cmd} origin: ".encode() not in p.stderr, p.stderr
    assert casstore.open(b).heads() == sa.heads()


def test_checkout_progress_on_a_terminal_and_not_in_a_pipe_or_with_json(tmp_path: Path) -> None:
    root, s = _store(tmp_path)
    with s.edit("exp") as m:
        for i in range(4):
            m[f"w{i}.bin"] = s.put(os.urandom(3 << 20))
    rc, tty, _out, _err = run_on_pty(tmp_path, "--store", str(root), "checkout", "exp", "co", stdout_tty=False,
                                     stderr_tty=True)
    assert rc == 0, tty
    frames = _frames(tty, "checkout")
    assert frames and "100.0%" in frames[-1] and "12.0 MiB/12.0 MiB" in frames[-1], tty
    assert frames[0].endswith("ETA --") and all("ETA 0s" not in f for f in frames if "100.0%" not in f), frames
    assert (tmp_path / "co" / "w3.bin").read_bytes() == s.get(s.manifest("exp")["w3.bin"].digest)
    # --json: scripts get one document and no bar, even on a terminal
    rc, tty, out, _err = run_on_pty(tmp_path, "--store", str(root), "checkout", "exp", "co2", "--json",
                                    stdout_tty=False, stderr_tty=True)
    assert rc == 0 and tty == b"" and len(json.loads(out)["written"]) == 4, tty
    p = _piped(tmp_path, "--store", str(root), "checkout", "exp", "co3")
    assert p.returncode == 0 and p.stderr == b"", p.stderr
