"""Terminal behaviour in a real pseudo-terminal (issue 12): progress only on a TTY, no binary onto a TTY.

The child's stdout and/or stderr are the slave side of ``os.openpty()``; what it
writes there is read back from the master side, exactly as a terminal would
receive it.  The same commands run with pipes show that nothing leaks there.
"""

from __future__ import annotations

import errno
import os
import select
import subprocess
from pathlib import Path
from typing import Dict, Tuple

from conftest import PYTHON

import casstore


def _env(tmp_path: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_") and not k.startswith("XDG_")}
    env.update(HOME=str(tmp_path), TERM="xterm", COLUMNS="120")
    return env


def run_on_pty(tmp_path: Path, *args: str, stdout_tty: bool, stderr_tty: bool) -> Tuple[int, bytes, bytes, bytes]:
    """Run ``casstore ARGS``; return (exit code, bytes the terminal got, piped stdout, piped stderr)."""
    master, slave = os.openpty()
    p = subprocess.Popen([PYTHON, "-m", "casstore", *args], stdin=subprocess.DEVNULL,
                         stdout=slave if stdout_tty else subprocess.PIPE,
                         stderr=slave if stderr_tty else subprocess.PIPE,
                         env=_env(tmp_path), cwd=tmp_path)
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
