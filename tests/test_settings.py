"""Runtime settings: casstore.toml / [tool.casstore], environment overrides, `casstore config`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest
from _fetch_helpers import Server, serve
from conftest import held_elsewhere

import casstore
from casstore.errors import InvalidInputError, StoreFormatError
from casstore.settings import KNOBS, current, load_settings

CLI = str(Path(sys.executable).with_name("casstore"))
ENV_VARS = [var for var, _, _ in KNOBS.values()] + ["CASSTORE_CONFIG"]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean environment: no CASSTORE_* variables, no user config, cwd in a fresh project dir."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    proj = tmp_path / "proj"
    (proj / "src" / "deep").mkdir(parents=True)
    monkeypatch.chdir(proj)
    return proj


def clean_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path, env: Dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


# -- defaults and files ------------------------------------------------------------------


def test_defaults(home: Path) -> None:
    s = load_settings()
    assert s.file is None
    assert s.store == str(home.parent / "cache" / "casstore")  # $XDG_CACHE_HOME/casstore
    assert (s.compression, s.lock_timeout, s.force_download, s.regenerate, s.durable) == (
        None, 600.0, False, False, None)
    assert set(s.sources.values()) == {"default"} and set(s.sources) == set(KNOBS)


def test_casstore_toml_found_from_a_subdirectory(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "casstore.toml").write_text(
        'store = "/data/store"\ncompression = "zstd"\nlock_timeout = 30\nforce_download = true\n'
        'regenerate = true\ndurable = false\nfetch_max_bytes = 1000000\nfetch_deadline = 60\nlock_mode = "none"\n')
    monkeypatch.chdir(home / "src" / "deep")
    s = load_settings()
    assert s.file == str(home / "casstore.toml")
    assert (s.store, s.compression, s.lock_timeout, s.force_download, s.regenerate, s.durable) == (
        "/data/store", "zstd", 30.0, True, True, False)
    assert (s.fetch_max_bytes, s.fetch_deadline, s.lock_mode) == (1_000_000, 60.0, "lease")
    assert set(s.sources.values()) == {str(home / "casstore.toml")}


def test_casstore_table_in_casstore_toml(home: Path) -> None:
    (home / "casstore.toml").write_text('[casstore]\nlock_timeout = 12.5\n')
    s = load_settings()
    assert s.lock_timeout == 12.5 and s.sources["lock_timeout"] == str(home / "casstore.toml")
    assert s.sources["regenerate"] == "default"


def test_pyproject_tool_casstore(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.casstore]\nregenerate = true\n'
                                         'compression = 7\n')
    monkeypatch.chdir(home / "src")
    s = load_settings()
    assert s.file == str(home / "pyproject.toml")
    assert s.regenerate is True and s.compression == "7"
    assert s.sources["regenerate"] == str(home / "pyproject.toml")


def test_nearest_file_wins_and_pyproject_without_table_is_skipped(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "casstore.toml").write_text("lock_timeout = 1\n")
    (home / "src" / "pyproject.toml").write_text('[project]\nname = "inner"\n')  # no [tool.casstore]
    monkeypatch.chdir(home / "src")
    assert load_settings().lock_timeout == 1.0  # the pyproject without a table is not a settings file
    (home / "src" / "casstore.toml").write_text("lock_timeout = 2\n")
    assert load_settings().lock_timeout == 2.0
    assert load_settings(cwd=home).lock_timeout == 1.0
    # casstore.toml beats pyproject.toml in the same directory
    (home / "src" / "pyproject.toml").write_text("[tool.casstore]\nlock_timeout = 3\n")
    assert load_settings().lock_timeout == 2.0


def test_user_config_file_is_the_fallback(home: Path) -> None:
    user = home.parent / "xdg" / "casstore" / "casstore.toml"
    user.parent.mkdir(parents=True)
    user.write_text("lock_timeout = 44\n")
    assert load_settings().lock_timeout == 44.0 and load_settings().file == str(user)
    (home / "casstore.toml").write_text("lock_timeout = 5\n")
    assert load_settings().lock_timeout == 5.0


def test_relative_store_path_is_relative_to_the_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "casstore.toml").write_text('store = "data/.casstore"\n')
    monkeypatch.chdir(home / "src" / "deep")
    assert Path(load_settings().store) == home / "data" / ".casstore"


def test_casstore_config_env_points_to_a_file(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (home / "casstore.toml").write_text("lock_timeout = 5\n")
    cfg = tmp_path / "elsewhere" / "my-settings.toml"
    cfg.parent.mkdir()
    cfg.write_text("lock_timeout = 77\nregenerate = true\n")
    monkeypatch.setenv("CASSTORE_CONFIG", str(cfg))
    s = load_settings()
    assert s.file == str(cfg) and s.lock_timeout == 77.0 and s.regenerate is True
    monkeypatch.setenv("CASSTORE_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(StoreFormatError, match="missing.toml"):
        load_settings()


# -- environment overrides ----------------------------------------------------------------


def test_environment_overrides_the_file(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "casstore.toml").write_text('store = "/from/file"\nlock_timeout = 30\nregenerate = true\n')
    monkeypatch.setenv("CASSTORE_DIR", "/from/env")
    monkeypatch.setenv("CASSTORE_LOCK_TIMEOUT", "2.5")
    monkeypatch.setenv("CASSTORE_REGENERATE", "0")
    monkeypatch.setenv("CASSTORE_FORCE_DOWNLOAD", "on")
    monkeypatch.setenv("CASSTORE_COMPRESSION", "raw")
    monkeypatch.setenv("CASSTORE_DURABLE", "false")
    s = load_settings()
    assert (s.store, s.lock_timeout, s.regenerate, s.force_download, s.compression, s.durable) == (
        "/from/env", 2.5, False, True, "raw", False)
    assert s.sources["store"] == "env CASSTORE_DIR"
    assert s.sources["lock_timeout"] == "env CASSTORE_LOCK_TIMEOUT"
    assert s.sources["regenerate"] == "env CASSTORE_REGENERATE"
    monkeypatch.setenv("CASSTORE_LOCK_TIMEOUT", "")  # empty means unset
    s = load_settings()
    assert s.lock_timeout == 30.0 and s.sources["lock_timeout"] == str(home / "casstore.toml")


def test_current_follows_cwd_and_environment(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "casstore.toml").write_text("lock_timeout = 9\n")
    assert current().lock_timeout == 600.0
    monkeypatch.chdir(other)
    assert current().lock_timeout == 9.0
    monkeypatch.setenv("CASSTORE_LOCK_TIMEOUT", "3")
    assert current().lock_timeout == 3.0
    monkeypatch.chdir(home)
    assert current().lock_timeout == 3.0
    monkeypatch.delenv("CASSTORE_LOCK_TIMEOUT")
    assert current().lock_timeout == 600.0


def test_open_without_a_path_uses_the_settings(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "casstore.toml").write_text('store = "/nonexistent/never-used"\ncompression = "zstd"\n')
    monkeypatch.setenv("CASSTORE_DIR", str(home / "env-store"))
    s = casstore.open()
    assert s.root == home / "env-store" and (home / "env-store" / "store.toml").exists()
    d = s.put(b"compressible " * 10_000)
    assert s.stat(d).codec == "zstd"  # the compression setting is the store's default for puts


# -- bad values ------------------------------------------------------------------------------


@pytest.mark.parametrize("text,match", [
    ('lock_timeout = "soon"\n', "lock_timeout"),
    ("lock_timeout = -1\n", "lock_timeout"),
    ('lock_timeout = nan\n', "lock_timeout"),
    ("lock_timeout = true\n", "lock_timeout"),
    ('force_download = "maybe"\n', "force_download"),
    ('regenerate = "yes"\n', "regenerate"),  # a TOML string is not a boolean, whatever it says
    ('lock_timeout = "30"\n', "lock_timeout"),
    ('regenerate = 2\n', "regenerate"),
    ('compression = "lz4"\n', "compression"),
    ("compression = 99\n", "compression"),
    ('colour = "blue"\n', "colour"),
])
def test_bad_values_in_the_file(home: Path, text: str, match: str) -> None:
    (home / "casstore.toml").write_text(text)
    with pytest.raises(InvalidInputError, match=match) as ei:
        load_settings()
    assert "casstore.toml" in str(ei.value)


@pytest.mark.parametrize("var,value", [("CASSTORE_LOCK_TIMEOUT", "ten"), ("CASSTORE_FORCE_DOWNLOAD", "perhaps"),
                                       ("CASSTORE_COMPRESSION", "gzip"), ("CASSTORE_DURABLE", "2"),
                                       ("CASSTORE_LOCK_TIMEOUT", "-3")])
def test_bad_values_in_the_environment(home: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(InvalidInputError, match=var):
        load_settings()


def test_bad_toml(home: Path) -> None:
    (home / "casstore.toml").write_text("lock_timeout = = 3\n")
    with pytest.raises(StoreFormatError, match="not valid TOML"):
        load_settings()
    (home / "casstore.toml").write_text("casstore = 3\n")
    with pytest.raises((StoreFormatError, InvalidInputError)):
        load_settings()


# -- `casstore config` -------------------------------------------------------------------------


def test_cli_config_prints_values_and_sources(home: Path, tmp_path: Path) -> None:
    (home / "casstore.toml").write_text('lock_timeout = 30\nregenerate = true\n')
    env = clean_env(XDG_CONFIG_HOME=str(tmp_path / "xdg"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                    CASSTORE_FORCE_DOWNLOAD="1")
    r = run_cli("config", cwd=home / "src", env=env)
    assert r.returncode == 0, r.stderr
    lines = {ln.split("=")[0].strip(): ln for ln in r.stdout.splitlines() if "=" in ln}
    assert str(home / "casstore.toml") in r.stdout.splitlines()[0]
    assert "30.0" in lines["lock_timeout"] and str(home / "casstore.toml") in lines["lock_timeout"]
    assert "True" in lines["force_download"] and "env CASSTORE_FORCE_DOWNLOAD" in lines["force_download"]
    assert "True" in lines["regenerate"]
    assert "default" in lines["compression"]
    assert "None" not in r.stdout and "(each store's own)" in lines["durable"]  # (None read like a value)
    assert str(tmp_path / "cache" / "casstore") in lines["store"]

    r = run_cli("config", "--json", cwd=home / "src", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["file"] == str(home / "casstore.toml")
    assert doc["settings"] == {"store": str(tmp_path / "cache" / "casstore"), "compression": None,
                               "lock_timeout": 30.0, "force_download": True, "regenerate": True, "durable": None,
                               "fetch_max_bytes": 64 << 30, "fetch_deadline": 86400.0,
                               "lock_mode": "auto"}
    assert doc["sources"]["force_download"] == "env CASSTORE_FORCE_DOWNLOAD"
    assert doc["sources"]["lock_timeout"] == str(home / "casstore.toml")
    assert doc["sources"]["durable"] == "default"


def test_cli_config_with_casstore_config_and_pyproject(home: Path, tmp_path: Path) -> None:
    (home / "pyproject.toml").write_text('[tool.casstore]\ncompression = "zstd"\n')
    env = clean_env(XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    doc = json.loads(run_cli("config", "--json", cwd=home, env=env).stdout)
    assert doc["file"] == str(home / "pyproject.toml") and doc["settings"]["compression"] == "zstd"
    cfg = tmp_path / "explicit.toml"
    cfg.write_text("lock_timeout = 8\n")
    doc = json.loads(run_cli("config", "--json", cwd=home, env={**env, "CASSTORE_CONFIG": str(cfg)}).stdout)
    assert doc["file"] == str(cfg) and doc["settings"]["lock_timeout"] == 8.0
    assert doc["settings"]["compression"] is None  # the explicit file replaces discovery


def test_cli_config_bad_value_is_a_clear_error(home: Path, tmp_path: Path) -> None:
    (home / "casstore.toml").write_text('lock_timeout = "never"\n')
    r = run_cli("config", cwd=home, env=clean_env(XDG_CONFIG_HOME=str(tmp_path / "xdg")))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "lock_timeout" in r.stderr and "casstore.toml" in r.stderr
    r = run_cli("config", cwd=home, env=clean_env(XDG_CONFIG_HOME=str(tmp_path / "xdg"),
                                                  CASSTORE_CONFIG=str(tmp_path / "nope.toml")))
    assert r.returncode != 0 and "nope.toml" in r.stderr and "Traceback" not in r.stderr


# -- the settings act on fetch and derive ----------------------------------------------------------


@pytest.fixture
def server() -> Iterator[Server]:
    with serve() as s:
        yield s


def test_force_download_and_regenerate_settings_from_a_file(home: Path, server: Server,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store = casstore.open(home / "store", durable=False)
    url = server.add("/s.bin", b"settings" * 100)
    calls = []

    def fn(inputs: Dict[str, Path], out: Path) -> None:
        calls.append(1)
        (out / "o").write_bytes(inputs["x"].read_bytes())

    d = store.fetch(url)
    store.derive("d", inputs={"x": d}, fn=fn)
    store.fetch(url)
    store.derive("d", inputs={"x": d}, fn=fn)
    assert server.count("/s.bin") == 1 and len(calls) == 1
    other = home / "src"
    (other / "casstore.toml").write_text("force_download = true\nregenerate = true\n")
    monkeypatch.chdir(other)
    store.fetch(url)
    store.derive("d", inputs={"x": d}, fn=fn)
    assert server.count("/s.bin") == 2 and len(calls) == 2
    monkeypatch.setenv("CASSTORE_FORCE_DOWNLOAD", "false")  # the environment overrides the file
    monkeypatch.setenv("CASSTORE_REGENERATE", "false")
    store.fetch(url)
    store.derive("d", inputs={"x": d}, fn=fn)
    assert server.count("/s.bin") == 2 and len(calls) == 2


def test_lock_timeout_setting_applies(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A derive waiting on a held lock gives up after the configured lock_timeout."""
    from casstore.errors import LockTimeout

    store = casstore.open(home / "store", durable=False)
    src = store.put(b"x")
    monkeypatch.setenv("CASSTORE_LOCK_TIMEOUT", "0.2")
    # The lock derive("busy") takes (the name's lock), held by another thread (this thread asking for a
    # lock it holds itself is a LockCycleError at once, whatever the timeout).
    with held_elsewhere(store.refs.lock("busy", timeout=1)):
        with pytest.raises(LockTimeout, match="0.2s"):
            store.derive("busy", inputs={"x": src}, fn=lambda i, o: None)
