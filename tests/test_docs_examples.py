"""Every ```python block of README.md and docs/*.md runs, so the docs cannot drift from the code.

Conventions for doc authors:

* Blocks of one page share one namespace, in page order, like a doctest: the test id of a block is
  ``page:line`` and it replays the page's earlier runnable blocks first (in the same temp store), so
  a failure names the block and ``-k`` on one id still works.
* ``<!-- setup: CODE -->`` (an HTML comment, invisible when rendered) on the line(s) right above a
  fence runs CODE first in the same namespace: create the files the example reads (``train.h5``),
  define the helper functions a fragment assumes.  Prefer this to exempting a block.
* ```` ```python no-run: REASON ```` exempts a block; the reason is required and shown as the
  skip reason (network, an S3 server, a GPU library the test extra does not install).
* Every ``casstore SUB ... --flag`` in a bare, ``sh`` or ``console`` block (synopsis tables too)
  must name a subcommand and flags the parser knows (``casstore SUB --help`` is checked).
* ```` ```sh ```` / ```` ```console ```` blocks whose commands all start with ``casstore `` run in
  a shell with the venv's ``casstore`` first on PATH (``$ `` prompts and ``#`` comments are fine);
  other shell blocks (installs, servers) are not collected.  ``no-run: REASON`` works there too.

Every block runs in a fresh temporary working directory with ``HOME`` and ``CASSTORE_DIR`` pointing
into it, so ``casstore.open("~/.cache/casstore")`` and ``casstore.open()`` never touch a real store.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(\S*)\s*(.*)$")
_SETUP = re.compile(r"<!--\s*setup:(.*?)-->", re.S)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its code, its hidden setup and its exemption."""

    page: str
    line: int
    lang: str
    code: str
    setup: str
    no_run: Optional[str]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(path: Path) -> List[Block]:
    lines = path.read_text(encoding="utf-8").split("\n")
    out: List[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, rest = m.group(1), m.group(2).strip()
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        no_run: Optional[str] = None
        if rest.startswith("no-run"):
            no_run = rest[len("no-run"):].lstrip(": ").strip()
            assert no_run, f"{path.name}:{i + 1}: no-run needs a reason (```{lang} no-run: why)"
        # A setup comment ends on the line right above the fence (it may span several lines).
        setup = ""
        k = i - 1
        if k >= 0 and lines[k].rstrip().endswith("-->"):
            while k > 0 and "<!--" not in lines[k]:
                k -= 1
            sm = _SETUP.search("\n".join(lines[k:i]))
            if sm:
                setup = textwrap.dedent(sm.group(1).strip("\n")).strip()
        rel = path.relative_to(ROOT).as_posix()
        out.append(Block(rel, i + 1, lang, "\n".join(lines[i + 1:j]), setup, no_run))
        i = j + 1
    return out


def _is_cli(block: Block) -> bool:
    if block.lang not in ("sh", "console"):
        return False
    cmds = [ln.strip().removeprefix("$ ") for ln in block.code.splitlines()
            if ln.strip() and not ln.strip().startswith("#")]
    # Continuation lines of a casstore command are fine; every command must be casstore's.
    return bool(cmds) and all(c.startswith("casstore ") for c in cmds if not c.startswith("-"))


ALL: Dict[str, List[Block]] = {p.relative_to(ROOT).as_posix(): _blocks(p) for p in PAGES}
PYTHON = [b for bs in ALL.values() for b in bs if b.lang == "python"]
CLI = [b for bs in ALL.values() for b in bs if _is_cli(b)]


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp cwd, HOME and default store; nothing reaches the user's real store or settings."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CASSTORE_DIR", str(tmp_path / "home" / ".cache" / "casstore"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    monkeypatch.delenv("CASSTORE_CONFIG", raising=False)
    monkeypatch.chdir(work)
    return work


def _run(block: Block, ns: Dict[str, object]) -> None:
    if block.setup:
        exec(compile(block.setup, f"{block.id} (setup)", "exec"), ns)
    # Pad so a traceback's line numbers are the page's own.
    exec(compile("\n" * block.line + block.code, block.page, "exec"), ns)


def _page_until(block: Block) -> Tuple[List[Block], Dict[str, object]]:
    earlier = [b for b in ALL[block.page] if b.lang == "python" and b.line < block.line and b.no_run is None]
    return earlier, {"__name__": "__docs__"}


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_python_block(block: Block, sandbox: Path) -> None:
    if block.no_run is not None:
        pytest.skip(block.no_run)
    earlier, ns = _page_until(block)
    for b in earlier:
        _run(b, ns)
    _run(block, ns)


def test_readme_tour_runs_twice(sandbox: Path) -> None:
    """Re-running the README tour (same store, same folder) is not an error: its steps are repeatable."""
    blocks = [b for b in ALL["README.md"] if b.lang == "python" and b.no_run is None]
    assert blocks
    for _ in range(2):
        ns: Dict[str, object] = {"__name__": "__docs__"}
        for b in blocks:
            _run(b, ns)


@pytest.mark.parametrize("block", CLI, ids=[b.id for b in CLI])
def test_cli_block(block: Block, sandbox: Path) -> None:
    if block.no_run is not None:
        pytest.skip(block.no_run)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    script = "set -e\n" + "\n".join(ln.strip().removeprefix("$ ") for ln in block.code.splitlines())
    if block.setup:
        script = block.setup + "\n" + script
    r = subprocess.run(["bash", "-c", script], cwd=sandbox, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, f"{block.id} failed:\n{r.stdout}\n{r.stderr}"


def _cli_mentions() -> List[Tuple[str, Tuple[str, ...], Tuple[str, ...]]]:
    """(page:line, subcommand words, --flags) for every ``casstore SUB ...`` in any fenced block,
    synopsis tables included: each segment from one ``casstore `` to the next is one command."""
    out: List[Tuple[str, Tuple[str, ...], Tuple[str, ...]]] = []
    for page, blocks in ALL.items():
        for b in blocks:
            if b.lang not in ("", "sh", "console"):  # python and toml mention casstore only in prose
                continue
            for n, line in enumerate(b.code.splitlines(), start=b.line + 1):
                line = line.split("#")[0]
                for seg in re.split(r"(?:^|(?<=[\s$`(]))casstore (?=[a-z])", line)[1:]:
                    words = re.match(r"([a-z][a-z-]*)(?: (ls|add|check|rm|show|set|info|verify)\b)?", seg)
                    assert words
                    sub = tuple(w for w in words.groups() if w)
                    flags = tuple(sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", seg))))
                    out.append((f"{page}:{n}", sub, flags))
    return out


MENTIONS = _cli_mentions()


@pytest.mark.parametrize("where,sub,flags", MENTIONS, ids=[f"{w}:{' '.join(s)}" for w, s, _ in MENTIONS])
def test_cli_mentions_exist(where: str, sub: Tuple[str, ...], flags: Tuple[str, ...],
                            capsys: pytest.CaptureFixture[str]) -> None:
    """Every subcommand and --flag the docs show for a command is one the parser knows."""
    from casstore.cli.app import build_parser

    def help_of(argv: List[str]) -> str:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([*argv, "--help"])
        assert e.value.code == 0, f"{where}: `casstore {' '.join(argv)}` is not a command"
        return capsys.readouterr().out

    known = help_of(list(sub)) + help_of([])
    missing = [f for f in flags if f not in known]
    assert not missing, f"{where}: `casstore {' '.join(sub)}` has no {missing}"
