"""Global CLI behaviour (issue 12): --json everywhere, help everywhere, --store anywhere, init/put/get rules.

Every subcommand is found by walking the real parser, so a new command without
``--json`` (or an argument without help) fails here unless it is listed, with a
reason, in an exemption below.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Tuple

import _seaweed
import pytest
from conftest import PYTHON

import casstore
from casstore.cli.app import build_parser

# SeaweedFS fixtures (one server per session), as the remote tests share them.
aws_credentials = _seaweed.aws_credentials
seaweed = _seaweed.seaweed
remote_url = _seaweed.remote_url

# Commands whose stdout is not a report, so --json has no meaning there.
NO_JSON = {
    ("get",): "stdout is the object's bytes (binary), not a report",
    ("completion",): "stdout is a shell script to be sourced",
}
# Commands that need an S3 server; their --json runs in test_remote_commands_json (SeaweedFS).
NEEDS_SERVER = {("remote", "check"), ("push",), ("pull",)}


def _env(tmp_path: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASSTORE_") and not k.startswith("XDG_")}
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_CACHE_HOME=str(home / ".cache"))
    return env


def cli(tmp_path: Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "casstore", *args], input=stdin.decode(), capture_output=True, text=True,
                          env=_env(tmp_path), cwd=tmp_path, timeout=120)


def _commands() -> List[Tuple[Tuple[str, ...], object]]:
    """Every runnable command path (leaves of the parser tree) with its parser."""
    return [(path, p) for path, p in build_parser().walk() if path and not p.subcommands()]


def test_every_argument_and_option_has_help() -> None:
    missing = [(" ".join(path), a.dest) for path, p in build_parser().walk() for a in p.options() if not a.help]
    assert missing == []


def test_every_command_has_json_or_a_reason() -> None:
    no_json = [path for path, p in _commands() if "--json" not in {o for a in p.options()  # type: ignore[attr-defined]
                                                                    for o in a.option_strings}]
    assert sorted(no_json) == sorted(NO_JSON), "a new command needs --json (or a justified NO_JSON entry)"


def _shape(p: object) -> List[Tuple[Tuple[str, ...], List[Tuple[Tuple[str, ...], str, object]]]]:
    return [(path, [(tuple(a.option_strings), a.dest, a.help) for a in q.options()])  # type: ignore[attr-defined]
            for path, q in p.walk()]  # type: ignore[attr-defined]


def test_main_builds_only_the_command_it_runs_and_the_same_one() -> None:
    # main() builds the parser of the command on the command line only (argparse costs ~10 ms for
    # all of them): each command's parser must come out exactly as in the whole parser.
    from casstore.cli.app import _command_in

    full = dict((path, q) for path, q in build_parser().walk())
    for (name,), _q in [(path, q) for path, q in full.items() if len(path) == 1]:
        alone = build_parser(name)
        assert [path for path, _ in alone.walk() if path] == [path for path in full if path and path[0] == name]
        assert _shape(alone)[1:] == [(path, s) for path, s in _shape(build_parser()) if path and path[0] == name]
    assert _command_in(["--store", "x", "status", "a"]) == "status"
    assert _command_in(["--store=x", "--debug", "ls"]) == "ls"
    assert _command_in(["-h"]) is None and _command_in([]) is None and _command_in(["--debug", "-h", "ls"]) is None
    assert _command_in(["--version"]) == "" and _command_in(["--store", "x", "--version"]) == ""
    assert _command_in(["status", "--version", "v"]) == "status"  # (status's own --version TARGET)
    names = [n for n, _ in build_parser().subcommands()]
    assert [n for n, _ in build_parser("no-such-command").subcommands()] == names  # (and its error lists them)
    assert [n for n, _ in build_parser("status").subcommands()] == ["status"]
    assert build_parser("").subcommands() == []


def test_the_command_table_names_the_module_of_every_command() -> None:
    # main() imports only the module of the command it runs, found in COMMANDS: a command missing from
    # the table, or filed under a module that does not register it, gets no parser of its own.
    from casstore.cli.app import COMMANDS

    names = [n for n, _ in build_parser().subcommands()]
    assert sorted(COMMANDS) == sorted(set(names) - {"completion"})
    for name in names:
        assert [n for n, _ in build_parser(name).subcommands()] == [name]


_STARTUP = """
import sys
from casstore.cli.app import main
try:
    rc = main(sys.argv[1:])
except SystemExit as e:
    rc = e.code
print(*sorted(sys.modules), file=sys.stderr)
"""


def _modules_after(tmp_path: Path, *args: str) -> List[str]:
    r = subprocess.run([PYTHON, "-c", _STARTUP, *args], capture_output=True, text=True, env=_env(tmp_path),
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r
    return r.stderr.split()


@pytest.mark.parametrize("args", [("add", "exp"), ("status", "exp"), ("--version",)])
def test_a_command_imports_only_what_it_runs(tmp_path: Path, args: Tuple[str, ...]) -> None:
    # Every start of `casstore status` paid for importing every command module, their stdlib
    # neighbours (json, tempfile, random) and compiling the CLI's 22 hint patterns, and
    # `--version` built every command's parser (~30 ms of its ~0.1 s).  The unchanged folder's
    # status and re-add are what people run in a loop (issue 12: >= 5x faster than `dvc status`).
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    store = casstore.open(tmp_path / "s")
    store.add("exp", folder)
    cmd = ["--store", str(tmp_path / "s"), *args] + ([str(folder)] if args[0] != "--version" else [])
    loaded = _modules_after(tmp_path, *cmd)
    cli_modules = {m for m in loaded if m.startswith("casstore.cli.")}
    expected = {"casstore.cli.app", "casstore.cli.common"} | ({"casstore.cli.folders"} if args[0] != "--version"
                                                             else set())
    assert cli_modules == expected
    assert not {"json", "random", "tempfile"} & set(loaded)
    assert not [m for m in loaded if m.startswith(("casstore.maintenance", "casstore.sync", "casstore.pipelines"))]


def test_store_option_before_or_after_every_command() -> None:
    for path, p in _commands():
        flags = {o for a in p.options() for o in a.option_strings}  # type: ignore[attr-defined]
        assert "--store" in flags, path
    parser = build_parser()
    assert parser.parse_args(["--store", "A", "ls"]).store == "A"
    assert parser.parse_args(["ls", "--store", "B"]).store == "B"
    assert parser.parse_args(["--store", "A", "manifest", "show", "x", "--store", "B"]).store == "B"
    assert parser.parse_args(["manifest", "show", "x"]).store is None


@pytest.fixture
def small_store(tmp_path: Path) -> Tuple[Path, Dict[str, str]]:
    """A store with a head, a pin, a preserved index cache, a file and a folder to add; returns names used."""
    root = tmp_path / "s"
    s = casstore.open(root)
    (tmp_path / "f.txt").write_bytes(b"hello json\n")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    d = s.put(b"object one")
    with s.edit("exp") as m:
        m["one"] = d
    with s.edit("exp") as m:
        m["two"] = s.put(b"object two")
    with s.edit("tofreeze") as m:
        m["x"] = d
    with s.edit("tomove") as m:
        m["x"] = d
    with s.edit("torm") as m:
        m["x"] = d
    s.pin("p", "exp")
    s.pin("tounpin", "exp")
    cache = casstore.IndexCache(s, 4)
    for i in range(4):
        cache.put(i, b"rec %d" % i)
    cache.preserve("cache1")
    cache.close()
    return root, {"digest": str(d)}


def _json_args(path: Tuple[str, ...], tmp_path: Path, names: Dict[str, str]) -> List[str]:
    """Arguments that make ``path`` succeed against ``small_store``."""
    d = names["digest"]
    return {
        ("init",): [str(tmp_path / "new-store")],
        ("put",): [str(tmp_path / "f.txt")],
        ("stat",): [d[:20]],
        ("ls",): [],
        ("demo",): [],
        ("add",): ["folder-exp", str(tmp_path / "folder")],
        ("status",): ["exp", str(tmp_path / "folder")],
        ("manifest", "show"): ["exp"],
        ("manifest", "set"): ["exp", "three", str(tmp_path / "f.txt")],
        ("manifest", "rm"): ["exp", "one"],
        ("freeze",): ["tofreeze"],
        ("pin",): ["p2", "exp~1"],
        ("unpin",): ["tounpin"],
        ("pins",): [],
        ("diff",): ["exp~1", "exp"],
        ("checkout",): ["exp", str(tmp_path / "out")],
        ("log",): ["exp"],
        ("rm",): ["torm"],
        ("mv",): ["tomove", "moved"],
        ("config",): [],
        ("fetch",): [(tmp_path / "f.txt").as_uri()],
        ("remote", "add"): ["origin", "s3://bucket/prefix", "--endpoint-url", "http://127.0.0.1:9"],
        ("remote", "ls"): [],
        ("remote", "upstream"): ["origin"],
        ("remote", "rm"): ["origin"],
        ("gc",): [],
        ("verify",): [],
        ("du",): [],
        ("stats",): [],
        ("doctor",): [],
        ("cache", "info"): ["cache1"],
        ("cache", "verify"): ["cache1"],
    }[path]


def test_every_command_prints_one_json_document(tmp_path: Path, small_store: Tuple[Path, Dict[str, str]]) -> None:
    root, names = small_store
    order = [path for path, _p in _commands() if path not in NO_JSON and path not in NEEDS_SERVER]
    # remote rm after remote add; everything else in parser order
    order.sort(key=lambda p: p == ("remote", "rm"))
    seen = []
    for path in order:
        args = _json_args(path, tmp_path, names)
        r = cli(tmp_path, *path, *args, "--json", "--store", str(root))
        assert r.returncode == 0, (path, r.stderr)
        try:
            json.loads(r.stdout)
        except json.JSONDecodeError as e:
            raise AssertionError(f"casstore {' '.join(path)} --json printed no single JSON document: "
                                 f"{e}\n{r.stdout[:500]}") from None
        seen.append(path)
    assert len(seen) >= 25


@pytest.mark.slow
def test_remote_commands_json(tmp_path: Path, remote_url: str, seaweed: Any) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    sa = casstore.open(a)
    casstore.open(b)
    with sa.edit("exp") as m:
        m["k"] = sa.put(b"remote json")
    endpoint = str(seaweed.endpoint)
    for root in (a, b):
        r = cli(tmp_path, "--store", str(root), "remote", "add", "origin", remote_url, "--endpoint-url", endpoint,
                "--json")
        assert json.loads(r.stdout)["name"] == "origin", r.stderr
    r = cli(tmp_path, "--store", str(a), "remote", "check", "origin", "--json")
    assert json.loads(r.stdout)["compare_and_swap"] is True, r.stderr
    r = cli(tmp_path, "push", "origin", "--store", str(a), "--json")
    assert json.loads(r.stdout)["objects"] >= 2, r.stderr
    r = cli(tmp_path, "pull", "origin", "exp", "--json", "--store", str(b))
    assert json.loads(r.stdout)["refs"] == {"heads/exp": "created"}, r.stderr


def test_python_dash_m_casstore_and_version(tmp_path: Path) -> None:
    r = cli(tmp_path, "--version")
    assert r.returncode == 0 and r.stdout.strip() == f"casstore {casstore.__version__}"
    for args in (["--store", "x", "--version"], ["--version", "--no-such-flag"], ["--debug", "--version", "ls"]):
        r = cli(tmp_path, *args)
        assert (r.returncode, r.stdout.strip(), r.stderr) == (0, f"casstore {casstore.__version__}", ""), args
    # ... answered before argparse, so the console script's quick exit applies (no teardown).
    code = ("import sys\nclass Noisy:\n    def __del__(self):\n        sys.stdout.write('torn down')\n"
            "keep = Noisy()\nsys.argv = ['casstore', '--version']\nfrom casstore.cli import entry\nentry()\n")
    r = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, env=_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == f"casstore {casstore.__version__}", r
    r = cli(tmp_path, "--help")
    assert r.returncode == 0 and "completion" in r.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts(tmp_path: Path, shell: str) -> None:
    r = cli(tmp_path, "completion", shell)
    assert r.returncode == 0, r.stderr
    for word in ("checkout", "manifest", "-l store" if shell == "fish" else "--store"):
        assert word in r.stdout, (shell, word)
    if shell == "bash":  # the script parses and defines the completion function
        b = subprocess.run(["bash", "-c", 'eval "$1" && complete -p casstore', "_", r.stdout],
                           capture_output=True, text=True, timeout=30)
        assert b.returncode == 0 and "casstore" in b.stdout, b.stderr
        # ... and it completes file and folder names where a command takes them (found by a bug hunt:
        # `casstore put comp.<TAB>` and `add exp d<TAB>` only beeped).
        (tmp_path / "comp.alpha").write_text("x")
        (tmp_path / "dd1").mkdir()
        ask = ('eval "$1"; f=$(complete -p casstore | sed "s/.*-F \\([^ ]*\\).*/\\1/"); '
               'read -ra COMP_WORDS <<< "$2"; COMP_CWORD=$((${#COMP_WORDS[@]}-1)); COMP_LINE="$2"; '
               'COMP_POINT=${#COMP_LINE}; COMPREPLY=(); $f casstore "${COMP_WORDS[-1]}" "${COMP_WORDS[-2]}"; '
               'echo "${COMPREPLY[*]}"')
        for line, want in (("casstore put comp.", "comp.alpha"), ("casstore add exp d", "dd1"),
                           ("casstore --store d", "dd1"), ("casstore get abc -o comp.", "comp.alpha")):
            c = subprocess.run(["bash", "-c", ask, "_", r.stdout, line], capture_output=True, text=True,
                               timeout=30, cwd=tmp_path)
            assert c.stdout.split() == [want], (line, c.stdout, c.stderr)


def _err(r: subprocess.CompletedProcess[str], kind: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and r.stderr.rstrip().endswith(f"[{kind}]"), r.stderr
    return r.stderr


def test_a_missing_store_is_not_created_but_the_default_one_is(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    missing = tmp_path / "typo-store"
    for cmd in (["put", "f"], ["manifest", "set", "n", "k", "f"], ["add", "n", "."], ["demo"]):
        err = _err(cli(tmp_path, "--store", str(missing), *cmd), "StoreFormatError")
        assert f"casstore init {missing}" in err, err
        assert not missing.exists()
    # the per-user default store is still made on first use
    r = cli(tmp_path, "put", "f")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "home" / ".cache" / "casstore" / "store.toml").exists()
    # and `init` then lets --store write
    assert cli(tmp_path, "init", str(missing)).returncode == 0
    assert cli(tmp_path, "--store", str(missing), "put", "f").returncode == 0


def test_init_on_an_existing_store_says_what_differs(tmp_path: Path) -> None:
    root = tmp_path / "s"
    r = cli(tmp_path, "init", str(root), "--compress", "5", "--json")
    assert json.loads(r.stdout) == {"store": str(root), "created": True, "compression": "zstd", "level": 5,
                                    "durable": True, "shared": False}
    before = (root / "store.toml").read_bytes()
    r = cli(tmp_path, "init", str(root))  # same (or no) options: fine, and says it existed
    assert r.returncode == 0 and "already existed" in r.stdout
    assert cli(tmp_path, "init", str(root), "--compress", "5").returncode == 0
    err = _err(cli(tmp_path, "init", str(root), "--compress", "raw", "--scratch", "--shared"), "StoreFormatError")
    assert "compression zstd level 5 (asked: raw)" in err
    assert "durable (asked: --scratch)" in err and "not shared (asked: --shared)" in err
    err = _err(cli(tmp_path, "init", str(root), "--compress", "9"), "StoreFormatError")
    assert "compression zstd level 5 (asked: zstd level 9)" in err
    assert (root / "store.toml").read_bytes() == before


def test_put_checks_every_argument_before_storing(tmp_path: Path) -> None:
    root = tmp_path / "s"
    s = casstore.open(root)
    (tmp_path / "ok1").write_bytes(b"first")
    (tmp_path / "ok2").write_bytes(b"second")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    cases: List[Tuple[List[str], str, str]] = [
        (["ok1", "ok2", "missing.bin"], "missing.bin: no such file", "ObjectNotFoundError"),
        (["ok1", "dir", "ok2"], "dir is a directory", "InvalidInputError"),
        (["ok1", "fifo"], "fifo is not a regular file", "InvalidInputError"),
        (["-", "ok1", "-"], "more than once", "InvalidInputError"),
    ]
    for args, text, kind in cases:
        err = _err(cli(tmp_path, "--store", str(root), "put", *args), kind)
        assert text in err and "nothing was stored" in err or kind == "InvalidInputError" and text in err, err
        assert list(s.iter_objects()) == [], args
    r = cli(tmp_path, "--store", str(root), "put", "ok1", "-", "ok2", "--json", stdin=b"from stdin")
    doc = json.loads(r.stdout)
    assert [x["file"] for x in doc] == ["ok1", "-", "ok2"]
    assert s.get(doc[1]["digest"]) == b"from stdin"


@pytest.mark.parametrize("cmd", ["get", "stat"])
def test_a_missing_file_is_not_called_a_malformed_digest(tmp_path: Path, cmd: str) -> None:
    root = tmp_path / "s"
    casstore.open(root)
    (tmp_path / "model.bin").write_bytes(b"weights")
    err = _err(cli(tmp_path, "--store", str(root), cmd, "model.bin"), "ObjectNotFoundError")
    assert "is a file, not a digest" in err and "casstore put model.bin" in err, err
    err = _err(cli(tmp_path, "--store", str(root), cmd, "data/missing.npy"), "ObjectNotFoundError")
    assert "no such file" in err and "malformed" not in err, err
    # a plain bad digest is still a digest error
    _err(cli(tmp_path, "--store", str(root), cmd, "zzzz"), "InvalidDigestError")
    # longer than a file name may be (ENAMETOOLONG): still one typed line, not "failed unexpectedly"
    _err(cli(tmp_path, "--store", str(root), cmd, "a" * 300), "InvalidDigestError")
    err = _err(cli(tmp_path, "--store", str(root), cmd, "a." * 150), "ObjectNotFoundError")
    assert "no such file" in err, err


def test_get_and_stat_take_a_file_of_a_version_as_name_colon_key(tmp_path: Path) -> None:
    root = tmp_path / "s"
    s = casstore.open(root)
    with s.edit("exp") as m:
        m["out/model.bin"] = s.put(b"weights v1")
    with s.edit("exp") as m:
        m["out/model.bin"] = s.put(b"weights v2")
    old = s.history("exp")[1].digest

    def get(target: str) -> str:
        r = cli(tmp_path, "--store", str(root), "get", target, "-o", "-")
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert get("exp:out/model.bin") == "weights v2"
    assert get("exp~1:out/model.bin") == "weights v1"
    assert get(f"exp@{old.hex[:8]}:out/model.bin") == "weights v1"
    assert get(f"{old}:out/model.bin") == "weights v1"  # a version digest's own colon is not the split
    r = cli(tmp_path, "--store", str(root), "stat", "exp:out/model.bin", "--json")
    assert json.loads(r.stdout)["digest"] == str(casstore.Digest.of(b"weights v2")), r.stderr
    # A digest (or unique prefix) is always a digest, even with a name "blake3" holding a matching key.
    data = casstore.Digest.of(b"weights v2")
    with s.edit("blake3") as m:
        m[data.hex[:10]] = s.put(b"not this")
    assert get(f"blake3:{data.hex[:10]}") == "weights v2"
    # Keys may hold ':' (names may not): the first colon that ends a version splits.
    with s.edit("a") as m:
        m["b:c"] = s.put(b"name a, key b:c")
    assert get("a:b:c") == "name a, key b:c"
    assert get(f"a@blake3:{s.manifest('a').digest.hex[:8]}:b:c") == "name a, key b:c"
    # What is not there says what is not there, in CLI terms.
    err = _err(cli(tmp_path, "--store", str(root), "get", "exp:out/missing.bin"), "ObjectNotFoundError")
    assert "has no key 'out/missing.bin'" in err and "casstore manifest show exp" in err, err
    err = _err(cli(tmp_path, "--store", str(root), "get", "exp~5:out/model.bin"), "ManifestNotFoundError")
    assert "has 2 version(s)" in err, err
    _err(cli(tmp_path, "--store", str(root), "get", "nope:out/model.bin"), "ManifestNotFoundError")
    # A key is only looked up, never joined to a path; a data object is not taken for a version.
    _err(cli(tmp_path, "--store", str(root), "get", "exp:../../etc/passwd"), "ObjectNotFoundError")
    err = _err(cli(tmp_path, "--store", str(root), "get", f"{data}:x"), "StoreFormatError")
    assert "not a valid manifest" in err, err


def test_name_colon_key_with_a_hostile_number_of_colons_costs_two_lookups(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from casstore.cli.common import resolve_digest

    s = casstore.open(tmp_path / "s")
    with s.edit("exp") as m:
        m["a:" * 3 + "b"] = s.put(b"a key with colons")
    calls: List[str] = []
    real = casstore.Store.manifest

    def counting(self: casstore.Store, target: Any) -> Any:
        calls.append(target)
        return real(self, target)

    monkeypatch.setattr(casstore.Store, "manifest", counting)
    with pytest.raises(casstore.ManifestNotFoundError):
        resolve_digest(s, "nope" + ":" * 100_000 + "x")
    assert len(calls) <= 2, len(calls)
    calls.clear()
    assert resolve_digest(s, "exp:" + "a:" * 3 + "b") == casstore.Digest.of(b"a key with colons")
    assert calls == ["exp"]


def test_demo_runs_in_a_temporary_store_and_explains_itself(tmp_path: Path) -> None:
    r = cli(tmp_path, "demo")
    assert r.returncode == 0, r.stderr
    assert "temporary store, deleted when the demo ends" in r.stdout
    assert "equal bytes are stored once" in r.stdout
    assert not (tmp_path / "home" / ".cache" / "casstore").exists()  # the default store was not touched
    tmp_root = r.stdout.split("store: ", 1)[1].split(" ", 1)[0]
    assert not Path(tmp_root).exists()
    # It never suggests a command on the store it has deleted (found by a bug hunt).
    assert "see `casstore manifest show demo`" not in r.stdout and "`casstore --store DIR demo` keeps it" in r.stdout
    root = tmp_path / "kept"
    casstore.open(root)
    r = cli(tmp_path, "--store", str(root), "demo", "--json")
    doc = json.loads(r.stdout)
    assert doc["temporary"] is False and doc["dedupe"]["same_digest"] is True
    assert "demo" in casstore.open(root).heads()


# -- the console script's exit: quick, but owing nothing --------------------------------------

_QUICK = """
import atexit, sys, threading, time
from casstore.cli import app

class Noisy:
    def __del__(self):
        sys.stdout.write("torn down\\n")

keep = Noisy()  # freed only by a full interpreter teardown

def command(argv=None):
    atexit.register(lambda: sys.stdout.write("atexit ran\\n"))  # as a command's finalizers do
    sys.stdout.write("x" * 200_000 + "\\n")  # buffered: a pipe
    if sys.argv[1] == "thread":
        threading.Thread(target=lambda: (time.sleep(0.3), sys.stdout.write("late thread done\\n"))).start()
    if sys.argv[1] == "usage":
        raise SystemExit(2)  # what argparse does for a usage error
    return 3

app.main = command
app.entry()
"""


@pytest.mark.parametrize("case", ["plain", "thread", "usage"])
def test_quick_exit_skips_teardown_but_owes_nothing(case: str) -> None:
    # Tearing the interpreter down cost 15-20 ms of every command; the console script skips it, but
    # only after flushing output, waiting for non-daemon threads and running the atexit handlers.
    r = subprocess.run([PYTHON, "-c", _QUICK, case], capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert lines[0] == "x" * 200_000 and "atexit ran" in lines, r.stderr
    if case == "usage":
        assert r.returncode == 2 and "torn down" in lines  # argparse's exits take the normal way
        return
    assert r.returncode == 3, r.stderr
    assert "torn down" not in lines  # the teardown was skipped
    if case == "thread":
        assert lines.index("late thread done") < lines.index("atexit ran")  # the thread was waited for


_COLLECTOR = """
import gc, sys
from casstore.cli import app

def command(argv=None):
    sys.stdout.write(f"collector {'on' if gc.isenabled() else 'off'}\\n")
    return 0

app.main = command
sys.argv = ["casstore", *sys.argv[1:]]
app.entry()
"""


@pytest.mark.parametrize("argv, want", [(["add", "x", "d"], "off"), (["--store", "s", "status", "x", "d"], "off"),
                                        (["ls"], "on"), (["derive", "x"], "on"), (["gc"], "on"),
                                        (["--version"], "on")])
def test_only_add_and_status_run_without_the_cyclic_collector(argv: List[str], want: str) -> None:
    # The collector's passes after a folder add cost it 2-3 ms (app.NO_COLLECTOR); every other command,
    # which may run user code or for long, keeps the collector.
    r = subprocess.run([PYTHON, "-c", _COLLECTOR, *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"collector {want}"


def test_importing_the_cli_registers_no_exit_handler() -> None:
    # The quick exit runs logging.shutdown itself and skips any other atexit handler registered
    # before the command started: there must be none (a library imported by the CLI that
    # registered one would have it skipped; run it from app._QuickExit then).
    code = ("import atexit, logging; n = atexit._ncallbacks(); import casstore.cli, casstore.store; "
            "print(atexit._ncallbacks() - n)")
    r = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "0"


def test_console_script_and_module_use_the_quick_exit(tmp_path: Path) -> None:
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "casstore"]
    assert script.value == "casstore.cli:entry"
    store = tmp_path / "s"
    env = _env(tmp_path)
    subprocess.run([PYTHON, "-m", "casstore", "init", str(store)], env=env, check=True, capture_output=True)
    f = tmp_path / "f.bin"
    f.write_bytes(b"payload")
    r = subprocess.run([PYTHON, "-m", "casstore", "--store", str(store), "put", str(f)], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith(str(casstore.open(store).put(b"payload"))), r
    r = subprocess.run([PYTHON, "-m", "casstore", "--store", str(store), "stat", "blake3:" + "0" * 64], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "casstore: error:" in r.stderr  # error lines and codes are unchanged


# -- errors speak CLI: hints name flags, not the Python API's keywords (issue 12) -------------------


def test_cli_words_turn_every_python_hint_into_a_flag() -> None:
    from casstore.cli.common import cli_words

    cases = {
        "remote 'o' already exists (u); remove it first or pass replace=True":
            "remote 'o' already exists (u); remove it first or pass --replace",
        "pull it (store.pull(remote, 'n') merges), then push again -- or push with force=True":
            "pull it (`casstore pull REMOTE n` merges), then push again -- or push with --force",
        "push with force (store.push(remote, 'n', force=True), ...":
            "push with force (`casstore push REMOTE n --force`, ...",
        "pull with merge=True (or 'ours'/'theirs') to merge them":
            "pull without --no-merge (or with --merge ours|theirs) to merge them",
        "pull with merge='ours' or merge='theirs'": "pull with --merge ours or --merge theirs",
        "unpin or remove names, lower keep_history, or raise the limit":
            "unpin or remove names, lower --keep-history, or raise the limit",
        "d is not a directory; add snapshots a folder (put_path stores a file)":
            "d is not a directory; add snapshots a folder (`casstore put` stores a file)",
        "create one with `casstore init r` or casstore.open(path)": "create one with `casstore init r`",
        "Use link='symlink' or link='copy'; pass overwrite=True, sync=True": "Use --link symlink or --link copy; "
                                                                             "pass --overwrite, --sync",
        "'exp' is a head (editable manifest): ...; or pin the head's current version itself with "
        "store.freeze('exp')": "'exp' is a head (editable manifest): ...; or pin the head's current version "
                               "itself with `casstore freeze exp`",
        "edit a new name, e.g. store.edit('p-v2')": "edit a new name, e.g. `casstore add p-v2 DIR` or "
                                                    "`casstore manifest set p-v2 KEY FILE`",
        "pin it under another name locally (store.pin('other', 'blake3:ab'))":
            "pin it under another name locally (`casstore pin other blake3:ab`)",
        "put it again, or pin with allow_missing=True if it lives on a remote":
            "put it again, or pull it from the remote that holds it",
        "sha256='00' is not a SHA-256": "--sha256 '00' is not a SHA-256",
        "invalid max_bytes 'abc'": "invalid --max-size 'abc'",
        "invalid endpoint_url 'x'": "invalid --endpoint-url 'x'",
        "invalid compression level 0; use 1-22, True/False or 'zstd'/'raw'":
            "invalid compression level 0; use raw, zstd or a level 1-22",
        "a plain message": "a plain message",
    }
    for text, want in cases.items():
        assert cli_words(text) == want


def test_cli_errors_name_flags_not_python_keywords(tmp_path: Path) -> None:
    """Found by a bug hunt: "pass replace=True", "lower keep_history", "(put_path stores a file)"."""
    root = tmp_path / "s"
    casstore.open(root)
    (tmp_path / "f.bin").write_bytes(b"x" * 5000)
    runs = [
        (["remote", "add", "o", "s3://bucket-a/p"], 0),
        (["remote", "add", "o", "s3://bucket-b/p"], 1),
        (["add", "exp", str(tmp_path / "f.bin")], 1),
        (["manifest", "set", "kept", "f", str(tmp_path / "f.bin")], 0),
        (["freeze", "kept"], 0),
        (["gc", "--max-size", "1", "--yes"], 1),
    ]
    errors = []
    for args, rc in runs:
        r = cli(tmp_path, "--store", str(root), *args)
        assert r.returncode == rc, (args, r.stderr)
        errors.append(r.stderr + r.stdout)  # (gc's plan says why a limit cannot be met on stdout)
    text = "".join(errors)
    assert "--replace" in errors[1] and "`casstore put`" in errors[2] and "--keep-history" in errors[5], errors
    for python in ("replace=True", "put_path", "keep_history", "=True"):
        assert python not in text, text


def test_status_against_a_name_that_does_not_exist_says_so(tmp_path: Path) -> None:
    """Found by a bug hunt: a mistyped name listed every file as "added", silently (exit 0 stays: it is a
    valid comparison with nothing)."""
    root = tmp_path / "s"
    casstore.open(root).add("real", _folder(tmp_path))
    r = cli(tmp_path, "--store", str(root), "status", "raal", str(tmp_path / "d"))
    assert r.returncode == 0 and r.stdout.startswith("added") and "no head or pin named 'raal'" in r.stderr
    r = cli(tmp_path, "--store", str(root), "status", "real", str(tmp_path / "d"))
    assert r.returncode == 0 and r.stdout.startswith("clean") and r.stderr == ""


def _folder(tmp_path: Path) -> Path:
    d = tmp_path / "d"
    d.mkdir(exist_ok=True)
    (d / "f.txt").write_text("x")
    return d


def test_add_and_status_report_each_skipped_file_once(tmp_path: Path) -> None:
    """Found by a bug hunt: the library's warning and the command's own line both reached the terminal."""
    root = tmp_path / "s"
    casstore.open(root)
    d = _folder(tmp_path)
    os.symlink("/etc/hostname", d / "link")
    for args in (["add", "x", str(d)], ["status", "x", str(d)]):
        r = cli(tmp_path, "--store", str(root), *args)
        assert r.returncode == 0, r.stderr
        assert (r.stdout + r.stderr).count("skipped") == 1 and "skipped" in r.stdout, (r.stdout, r.stderr)


def test_json_output_is_strict_json_even_for_nan_and_infinite_metadata(tmp_path: Path) -> None:
    """Found by a bug hunt: `manifest show/log/diff --json` printed NaN and Infinity, which are not JSON."""
    root = tmp_path / "s"
    s = casstore.open(root)
    with s.edit("m") as m:
        m["k"] = casstore.Entry(s.put(b"x"), meta={"w": float("-inf")})
        m.meta["loss"] = float("nan")
    with s.edit("m") as m:
        m.meta["loss"] = float("inf")

    def strict(text: str) -> Any:
        def refuse(name: str) -> None:
            raise ValueError(f"not JSON: {name}")
        return json.loads(text, parse_constant=refuse)

    for args in (["manifest", "show", "m", "--json"], ["log", "m", "--json"], ["diff", "m~1", "m", "--json"]):
        r = cli(tmp_path, "--store", str(root), *args)
        assert r.returncode == 0, r.stderr
        doc = strict(r.stdout)
        assert "Infinity" in r.stdout or "NaN" in r.stdout, (args, doc)


def test_put_never_prints_file_names_raw(tmp_path: Path) -> None:
    """Found by a bug hunt: a file named "a\\nblake3:000...0  model.bin" made `put *` print a forged line, and
    an escape sequence in a missing file's name coloured the terminal from the error line."""
    root = tmp_path / "s"
    casstore.open(root)
    forged = tmp_path / ("a\nblake3:" + "0" * 64 + "  model.bin")
    forged.write_bytes(b"x")
    (tmp_path / "b.bin").write_bytes(b"y")
    r = cli(tmp_path, "--store", str(root), "put", str(forged), str(tmp_path / "b.bin"))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2 and "0" * 64 not in r.stdout.splitlines()[1], r.stdout
    r = cli(tmp_path, "--store", str(root), "put", str(tmp_path / "nofile\x1b[31mRED"))
    assert r.returncode == 1 and "\x1b" not in r.stderr and "no such file" in r.stderr and r.stderr.count("\n") == 1


def test_get_never_writes_into_the_store(tmp_path: Path) -> None:
    """Found by a bug hunt: `get A -o <store>/objects/<B's file>` replaced B (corrupt), `-o <store>/store.toml`
    broke every later command."""
    root = tmp_path / "s"
    s = casstore.open(root)
    a, b = s.put(b"aaaa"), s.put(b"bbbb")
    b_file = next(p for p in (root / "objects").rglob("*") if p.is_file() and p.name == b.hex[2:])
    os.symlink(root, tmp_path / "alias")
    for target in (b_file, root / "store.toml", root / "new-file", tmp_path / "alias" / "x"):
        r = cli(tmp_path, "--store", str(root), "get", str(a), "-o", str(target))
        assert r.returncode == 1 and "inside the store" in r.stderr, (target, r.stderr)
    assert s.get(b) == b"bbbb" and casstore.open(root).verify().ok
    r = cli(tmp_path, "--store", str(root), "get", str(a), "-o", str(tmp_path / "out.bin"))
    assert r.returncode == 0 and (tmp_path / "out.bin").read_bytes() == b"aaaa"


def test_mv_onto_a_pin_says_it_is_one_and_what_it_held(tmp_path: Path) -> None:
    """Found by a bug hunt: `mv X PIN --force` replaced a pin silently; the refusal said only "already exists"."""
    root = tmp_path / "s"
    s = casstore.open(root)
    with s.edit("release") as m:
        m["a"] = s.put(b"1")
    old = s.freeze("release")
    with s.edit("scratch") as m:
        m["a"] = s.put(b"2")
    r = cli(tmp_path, "--store", str(root), "mv", "scratch", "release")
    assert r.returncode == 1 and f"(a pin of {old.short()})" in r.stderr, r.stderr
    r = cli(tmp_path, "--store", str(root), "mv", "scratch", "release", "--force")
    assert r.returncode == 0 and f"replaced a pin release (was {old}" in r.stdout, r.stdout
