"""force_download / regenerate at job scale (issue 13): once per job, not once per process; per step.

Eight real processes ("ranks", started together with a barrier) ask for the
same forced step; the work must happen exactly once, and every rank must get
that one fresh result.  "Job" means: processes started before the forced work
finished.  A process started afterwards forces it again.
"""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest
from _fetch_helpers import (
    SPAWN,
    Server,
    b3,
    clean_settings_env,
    counting_fn,
    derive_job_worker,
    fetch_job_worker,
    results,
    serve,
)

import casstore
from casstore.errors import InvalidInputError, InvalidTypeError
from casstore.pipelines import fetch_name
from casstore.settings import load_settings

RANKS = 8


@pytest.fixture(autouse=True)
def _clean_settings_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_settings_env(monkeypatch, tmp_path)


@pytest.fixture
def server() -> Any:
    with serve() as s:
        yield s


def runs(counter: Path) -> List[str]:
    return counter.read_text().split()


def _ranks(target: Any, args: Any, n: int = RANKS) -> List[Any]:
    barrier = SPAWN.Barrier(n)
    q = SPAWN.Queue()
    procs = [SPAWN.Process(target=target, args=(*args[:-1], barrier, q, args[-1])) for _ in range(n)]
    # args: everything before (barrier, q) and the env dict last; workers take (..., barrier, q, env).
    for p in procs:
        p.start()
    out = results(q, n, timeout=120)
    for p in procs:
        p.join(30)
    return out


def test_eight_ranks_regenerate_once(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = casstore.open(root, durable=False)
    src = str(store.put(os.urandom(50_000)))
    counter = tmp_path / "runs.txt"
    counter.touch()
    fn = functools.partial(counting_fn, str(counter), 0.5)
    stale = store.derive("job/step", inputs={"src": src}, fn=fn)  # yesterday's result
    assert len(runs(counter)) == 1
    out = _ranks(derive_job_worker, (str(root), "job/step", src, fn, {"CASSTORE_REGENERATE": "1"}))
    # Eight ranks with CASSTORE_REGENERATE=1: fn ran once more, not eight times ...
    assert len(runs(counter)) == 2, runs(counter)
    digests = {r[2][0] for r in out}
    # ... and every rank got that one fresh result, not the stale one.
    assert len(digests) == 1 and digests != {str(stale.digest)}
    head = store.manifest("job/step")
    assert {str(head.digest)} == digests
    assert head.meta["derive"]["by"].split(".")[0] == runs(counter)[1]  # made by the rank that ran fn
    # This (pytest) process started before that regeneration finished: it is part of the job, so
    # regenerate=True here takes the fresh result too.
    assert store.derive("job/step", inputs={"src": src}, fn=fn, regenerate=True).digest == head.digest
    assert len(runs(counter)) == 2
    # A process started after it finished is another job: it regenerates again (once, for its job).
    (_, _, (d2, _)), = _ranks(derive_job_worker, (str(root), "job/step", src, fn, {"CASSTORE_REGENERATE": "1"}), 1)
    assert len(runs(counter)) == 3 and d2 != str(head.digest)
    # Without regenerate, nobody runs fn.
    _ranks(derive_job_worker, (str(root), "job/step", src, fn, {}), 4)
    assert len(runs(counter)) == 3


def test_eight_ranks_force_download_once(tmp_path: Path, server: Server) -> None:
    root = tmp_path / "store"
    store = casstore.open(root, durable=False)
    data = os.urandom(2_000_000)
    url = server.add("/job.bin", data, delay=0.002)
    assert str(store.fetch(url)) == b3(data)
    assert server.count("/job.bin") == 1
    out = _ranks(fetch_job_worker, (str(root), url, {"CASSTORE_FORCE_DOWNLOAD": "1"}))
    assert server.count("/job.bin") == 2  # one forced download for the whole job
    assert {r[2] for r in out} == {b3(data)}
    assert len(store.history(fetch_name(url))) == 2
    # Scoped to other URLs: no download at all.
    _ranks(fetch_job_worker, (str(root), url, {"CASSTORE_FORCE_DOWNLOAD": "https://elsewhere/x.gz"}), 3)
    assert server.count("/job.bin") == 2
    # Scoped to this URL (by its record name): one more download, from a new job.
    _ranks(fetch_job_worker, (str(root), url, {"CASSTORE_FORCE_DOWNLOAD": fetch_name(url)}), 3)
    assert server.count("/job.bin") == 3


# -- per-step scope -----------------------------------------------------------------------


def gunzip(calls: List[str], inputs: Dict[str, Path], out: Path) -> None:
    calls.append("unzip")
    (out / "data.txt").write_bytes(gzip.decompress(inputs["raw.txt.gz"].read_bytes()))


def process(calls: List[str], inputs: Dict[str, Path], out: Path) -> None:
    calls.append("process")
    (out / "processed.txt").write_bytes(inputs["txt"].read_bytes().upper())


def _pipeline(store: casstore.Store, url: str, calls: List[str], **kw: Any) -> casstore.Manifest:
    gz = store.fetch(url, force=kw.get("force"))
    txt = store.derive("qm9/unzipped", inputs={"raw.txt.gz": gz}, fn=functools.partial(gunzip, calls),
                       regenerate=kw.get("regenerate"))
    return store.derive("qm9/processed", inputs={"txt": txt}, fn=functools.partial(process, calls),
                        regenerate=kw.get("regenerate"))


def test_regenerate_names_only_the_listed_steps(tmp_path: Path, server: Server,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    store = casstore.open(tmp_path / "store", durable=False)
    url = server.add("/qm9.txt.gz", gzip.compress(b"molecules\n" * 100))
    calls: List[str] = []
    first = _pipeline(store, url, calls)
    assert calls == ["unzip", "process"] and server.count("/qm9.txt.gz") == 1
    # The setting (an environment comma list) names one step: only it is rebuilt.
    monkeypatch.setenv("CASSTORE_REGENERATE", "qm9/processed, other/step")
    assert _pipeline(store, url, calls).digest != first.digest
    assert calls == ["unzip", "process", "process"] and server.count("/qm9.txt.gz") == 1
    monkeypatch.delenv("CASSTORE_REGENERATE")
    # The per-call argument, with a pattern: both derive steps, never the download.
    _pipeline(store, url, calls, regenerate=["qm9/*"])
    assert calls[3:] == ["unzip", "process"] and server.count("/qm9.txt.gz") == 1
    # The settings file: an array of names.
    (tmp_path / "casstore.toml").write_text('regenerate = ["qm9/unzipped"]\nforce_download = ["' + url + '"]\n')
    monkeypatch.chdir(tmp_path)
    _pipeline(store, url, calls)
    # The forced download brought the same bytes (the same object: unzip is not rerun for that); the
    # regenerated unzip step made the same files, so the step after it (keyed on its files) is a hit.
    assert calls[5:] == ["unzip"] and server.count("/qm9.txt.gz") == 2
    # force_download by URL pattern, per call; a list that names nothing forces nothing.
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # settings are cached per directory: leave the file's reach
    (tmp_path / "casstore.toml").unlink()
    _pipeline(store, url, calls, force=["http://127.0.0.1:*/qm9.*"])
    assert server.count("/qm9.txt.gz") == 3 and len(calls) == 6
    _pipeline(store, url, calls, force=["http://elsewhere/*"], regenerate=[])
    assert server.count("/qm9.txt.gz") == 3 and len(calls) == 6


def test_scope_settings_are_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "casstore.toml"
    cfg.write_text('regenerate = ["a/b", "c/*", "a/b"]\nforce_download = ["https://h/x.gz", "_fetch/abc"]\n')
    s = load_settings()
    assert s.regenerate == ("a/b", "c/*") and s.force_download == ("https://h/x.gz", "_fetch/abc")
    cfg.write_text("regenerate = []\n")
    assert load_settings().regenerate is False
    for bad in ('regenerate = "a/b"\n', "regenerate = [1]\n", 'regenerate = [""]\n', 'regenerate = [" a"]\n',
                'force_download = ["not-a-url"]\n', "force_download = [[\"x\"]]\n"):
        cfg.write_text(bad)
        with pytest.raises(InvalidInputError, match="regenerate|force_download"):
            load_settings()
    cfg.unlink()
    monkeypatch.setenv("CASSTORE_REGENERATE", "a/b,,c ")
    assert load_settings().regenerate == ("a/b", "c")
    for var, value in (("CASSTORE_REGENERATE", "ture"), ("CASSTORE_REGENERATE", "a,flase"),
                       ("CASSTORE_FORCE_DOWNLOAD", "perhaps")):
        monkeypatch.setenv(var, value)
        with pytest.raises(InvalidInputError, match=var):
            load_settings()
        monkeypatch.delenv(var)
    store = casstore.open(tmp_path / "store", durable=False)
    d = store.put(b"x")
    for bad_arg in ("qm9/processed", 1, [1], [""]):
        with pytest.raises(InvalidTypeError, match="regenerate"):
            store.derive("s", inputs={"x": d}, fn=lambda i, o: None, regenerate=bad_arg)  # type: ignore[arg-type]


_HIT = r"""
import sys
import casstore, casstore.pipelines
s = casstore.open(sys.argv[1])
before = {m for m in sys.modules if m.startswith("casstore.sync")}
assert not before, before  # opening a store needs no remote machinery
gz = s.fetch(sys.argv[2])
m = s.derive("size", inputs={"gz": gz}, fn=lambda ins, out: (out / "n").write_text(str(ins["gz"].stat().st_size)))
print(sorted(m for m in sys.modules if m.startswith("casstore.sync")))
"""


def test_a_hit_without_a_remote_imports_no_remote_machinery(tmp_path: Path) -> None:
    # Every rank of a job pays its cache hits' imports (issue 13's warm job: 8 forked ranks on
    # 2 cores); casstore.sync (remotes, S3, pull, read-through) is ~20 ms that a hit without
    # remote= never uses.
    import subprocess
    import sys

    src = tmp_path / "data.bin"
    src.write_bytes(b"x" * 1000)
    url = src.resolve().as_uri()
    store = tmp_path / "s"
    for _ in range(2):  # the first run fetches and derives; the second is all hits
        out = subprocess.run([sys.executable, "-c", _HIT, str(store), url], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]"
