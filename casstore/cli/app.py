"""The parser and :func:`main`: error lines, exit codes and the ``--debug`` switch.

Exit codes: 0 ok, 1 an error (one line on stderr), 2 bad usage (argparse),
130 interrupted, 141 output cut short.  Without ``--debug`` no traceback is ever printed:

* a :class:`~casstore.CasstoreError` prints ``casstore: error: MESSAGE [Kind]``;
* anything else (an ``OSError`` the store did not type, a bug) prints one line
  naming the command and the exception, and asks for ``--debug``;
* Ctrl-C prints ``casstore COMMAND: interrupted`` and exits 130;
* a reader that went away (``casstore ls | head``) ends the command quietly,
  with exit 141, as a tool killed by SIGPIPE (``cat``, ``git``) ends: the
  command did not finish.  Hazard (found by a bug hunt): with exit 0,
  ``casstore verify | head -1`` passed a damaged store under ``set -o
  pipefail``, and ``casstore put f1 ... f5 | head -1`` stored two of five
  files "successfully";
* stdout on a full disk (``> /dev/full``) is a typed one-line error, exit 1.

``--debug`` re-raises instead, so the traceback shows.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import gc
import importlib
import logging
import os
import select
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, NoReturn, Optional, Sequence, Tuple

from .. import __version__
from .._fs import reserve_fds
from ..errors import CasstoreError
from .common import JSON_HELP, Command, Parser, UnusedParser, add_global_options, cli_words, print_help

__all__ = ["main", "build_parser", "COMMANDS"]

# One module per feature; each defines register(add).  The order is the order in --help.
_COMMAND_MODULES = ("objects", "folders", "manifests", "config", "pipelines", "remote", "maintenance", "cache",
                    "doctor")

COMMANDS: Dict[str, str] = {
    "init": "objects", "put": "objects", "get": "objects", "stat": "objects", "ls": "objects", "demo": "objects",
    "add": "folders", "status": "folders",
    "manifest": "manifests", "freeze": "manifests", "pin": "manifests", "unpin": "manifests", "pins": "manifests",
    "diff": "manifests", "checkout": "manifests", "log": "manifests", "rm": "manifests", "mv": "manifests",
    "config": "config", "fetch": "pipelines", "remote": "remote", "push": "remote", "pull": "remote",
    "gc": "maintenance", "verify": "maintenance", "du": "maintenance", "stats": "maintenance",
    "cache": "cache", "doctor": "doctor",
}
"""Each command word -> the ``casstore.cli`` module that registers it (``completion`` is this module's).

Only the module of the command being run is imported (:func:`build_parser`).  Hazard: importing every
command module (and what each imports: ``tempfile``, ``json``, the feature packages' neighbours) was
paid by every ``casstore status``, a command people run in a loop.  tests/test_cli_global.py checks
this table against what each module registers (a new command cannot be missed) and what a command imports.
"""


def _command_modules(command: Optional[str]) -> Tuple[ModuleType, ...]:
    """The command modules :func:`_build` registers: the one of ``command``, or all (in --help order)."""
    if command is None:
        names: Sequence[str] = _COMMAND_MODULES
    else:
        names = (COMMANDS[command],) if command in COMMANDS else ()  # ("completion" and "" need none)
    return tuple(importlib.import_module(f"{__package__}.{n}") for n in names)


def _command_in(argv: Sequence[str]) -> Optional[str]:
    """The command word of ``argv`` (the first word that is not a global option or its value); ``""``
    for ``--version`` before any command (answered without one), ``None`` for help or no command."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--store":
            i += 2
            continue
        if a.startswith("-"):
            if a in ("-h", "--help"):
                return None  # the whole parser answers these
            if a == "--version":
                return ""
            i += 1
            continue
        return a
    return None


def build_parser(command: Optional[str] = None) -> Parser:
    """The ``casstore`` argument parser with every command module's subcommands.

    ``command``: build only that command's parser (what ``main`` runs); the others are
    not built (nor their modules imported).  A name that is no command gets the whole parser
    (and its error); ``""`` gets the global options alone (``casstore --version``: building every
    command's parser was a third of its 0.1 s).
    """
    if command == "":
        return _build("")
    if command is not None:
        p = _build(command)
        if p.subcommands():
            return p
    return _build(None)


def _build(command: Optional[str]) -> Parser:
    p = Parser(prog="casstore", description="Content-addressed artifact store.")
    p.add_argument("--store", metavar="DIR", help="store directory (default: $CASSTORE_DIR or ~/.cache/casstore)")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    p.add_argument("--version", action="version", version=f"casstore {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, fn: Optional[Command], help: str) -> argparse.ArgumentParser:
        if command is not None and name != command:
            return UnusedParser()
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(func=fn or (lambda _args: print_help(sp)), command_name=name)
        add_global_options(sp)
        return sp

    for module in _command_modules(command):
        module.register(add)
    sp = add("completion", cmd_completion, "print a shell completion script (bash, zsh or fish)")
    sp.add_argument("shell", choices=("bash", "zsh", "fish"),
                    help="the shell; e.g. `casstore completion bash > ~/.local/share/bash-completion/"
                         "completions/casstore`, or `eval \"$(casstore completion zsh)\"` in ~/.zshrc")
    for _path, parser in p.walk():
        for action in parser.options():
            if action.help is None and action.option_strings == ["--json"]:
                action.help = JSON_HELP  # one wording for every command's --json
    return p


def cmd_completion(args: argparse.Namespace) -> int:
    """``casstore completion bash|zsh|fish``: the completion script on stdout (bash, zsh: shtab; fish: ours)."""
    parser = build_parser()
    if args.shell == "fish":
        print(_fish_script(parser))
        return 0
    import shtab

    _mark_paths(parser, shtab.FILE, shtab.DIR)
    print(shtab.complete(parser, shell=args.shell))
    return 0


# Arguments that name files or folders (by metavar or dest): completed from the filesystem.  Hazard (found by
# a bug hunt): without these marks `casstore put comp.<TAB>`, `add exp d<TAB>` and `--store sto<TAB>` only
# beeped, worse than no completion script at all.
_FILE_ARGS = frozenset({"FILE", "FILE|DIGEST", "files", "output", "path"})
_DIR_ARGS = frozenset({"DIR", "dir", "store", "folder", "outdir"})


def _mark_paths(parser: Parser, file: object, folder: object) -> None:
    """Set shtab's ``complete`` on every argument of ``parser``'s tree that names a file or a folder."""
    for _path, p in parser.walk():
        for a in p.options():
            names = {a.dest, a.metavar if isinstance(a.metavar, str) else ""}
            if names & _DIR_ARGS:
                a.complete = folder  # type: ignore[attr-defined]
            elif names & _FILE_ARGS:
                a.complete = file  # type: ignore[attr-defined]


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_script(parser: Parser) -> str:
    """Fish completions (shtab has none): commands, their actions and options, with their help."""
    lines = ["# casstore completions for fish: casstore completion fish > ~/.config/fish/completions/casstore.fish",
             "complete -c casstore -f"]
    for path, p in parser.walk():
        # Inside `casstore A B`: every word of the path seen (a loose but standard fish idiom).
        cond = "; and ".join(f"__fish_seen_subcommand_from {w}" for w in path) or "true"
        subs = p.subcommands()
        names = " ".join(n for n, _ in subs)
        for name, sp in subs:
            here = f"{cond}; and not __fish_seen_subcommand_from {names}"
            lines.append(f"complete -c casstore -n {_fish_quote(here)} -a {name}"
                         f" -d {_fish_quote((sp.description or '')[:80])}")
        for a in p.options():
            if not a.option_strings or a.help == argparse.SUPPRESS:
                continue
            flags = " ".join(f"-l {o[2:]}" if o.startswith("--") else f"-s {o[1:]}" for o in a.option_strings)
            takes = " -r" if a.nargs != 0 else ""
            choices = f" -a {_fish_quote(' '.join(map(str, a.choices)))}" if a.choices else ""
            lines.append(f"complete -c casstore -n {_fish_quote(cond)} {flags}{takes}{choices}"
                         f" -d {_fish_quote((a.help or '').partition(chr(10))[0][:80])}")
    return "\n".join(lines)


def _say(line: str) -> None:
    """One line on stderr; a closed stderr is not worth a second error."""
    if sys.stderr is None:  # started with stderr closed: print(file=None) would write to stdout
        return
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else type(e).__name__
    # A message may quote a file name from disk: its escape sequences never reach the terminal raw
    # (found by a bug hunt: `nofile\x1b[31mRED: no such file` coloured the terminal).
    return line if line.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in line)


def _stdout_reader_gone() -> bool:
    """True if stdout is a pipe or socket whose reading end was closed.

    A ``BrokenPipeError`` can also come from a socket the command itself opened
    (a remote); only a broken stdout is the quiet ``| head`` case.  poll()
    reports POLLERR on a pipe's write end once no reader is left.
    """
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
        events = poller.poll(0)
    except (AttributeError, ValueError, OSError):  # no real stdout (in-process capture) or closed
        return False
    return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in events)


CUT_SHORT = 141
"""Exit code when stdout's reader went away: 128 + SIGPIPE, as the shell reports a tool SIGPIPE killed."""


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null: what is still buffered must not fail again at interpreter exit
    (that prints "Exception ignored ... BrokenPipeError", the traceback we promised not to show)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (AttributeError, ValueError, OSError):
        pass


def _reserve_std_fds() -> None:
    """Open /dev/null on fds 0-2 where the process started with them closed (``casstore get ... >&-``).

    Otherwise the first files the store opens take those numbers, and whatever
    then writes to "stdout" writes into them: ``get -o /dev/stdout >&-`` (that
    is /proc/self/fd/1) truncated the very object it was reading.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself, as lower ones are open
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``casstore`` console script; returns the exit code."""
    _reserve_std_fds()
    reserve_fds()  # while the process has one thread (see reserve_fds)
    # Until arguments are parsed, --debug is known only from the raw list (an
    # interrupt can come while the feature modules import).
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    command = ""
    try:
        raw = sys.argv[1:] if argv is None else list(argv)
        word = _command_in(raw)
        if word == "":
            # --version before any command: answered here, not by argparse's version action, whose
            # SystemExit takes the interpreter's full teardown (20-40 ms on a slow machine) instead of
            # the console script's quick exit.
            print(f"casstore {__version__}")
            return 0
        args = build_parser(word).parse_args(raw)
        debug = bool(args.debug)
        command = str(args.command_name)
        rc: int = args.func(args)
        # Flush here, inside the handlers: a reader that went away is then a
        # BrokenPipeError below, not an "Exception ignored" message at exit.
        # (sys.stdout is None when the script was started with stdout closed.)
        if sys.stdout is not None:
            sys.stdout.flush()
        return rc
    except KeyboardInterrupt:
        if debug:
            raise
        _say(f"casstore {command}: interrupted" if command else "casstore: interrupted")
        return 130
    except BrokenPipeError as e:
        if _stdout_reader_gone():
            _silence_stdout()
            return CUT_SHORT
        if debug:
            raise
        _say(_unexpected(command, e))
        return 1
    except CasstoreError as e:
        if debug:
            raise
        _say(f"casstore: error: {cli_words(_first_line(e))} [{type(e).__name__}]")
        return 1
    except Exception as e:
        if debug:
            raise
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            # The store types its own full disks (DiskFullError); what is left is the output: standard
            # output on a full disk (`> /dev/full`; found by a bug hunt: "failed unexpectedly").
            _silence_stdout()
            _say(f"casstore {command}: error: no space left writing its output ({e.strerror}); write it where "
                 "there is room (-o FILE where the command takes one) [DiskFullError]")
            return 1
        _say(_unexpected(command, e))
        return 1


def entry() -> NoReturn:
    """The ``casstore`` console script and ``python -m casstore``: :func:`main`, then a quick exit.

    Hazard: freeing every module and object at exit took 15-20 ms of every command here
    (``casstore status`` of an unchanged 10,000-file folder, interleaved medians: 134 -> 117 ms),
    a seventh of what a user waits for.  So the exit skips that teardown, and only that: the interpreter still
    waits for non-daemon threads and runs the ``atexit`` handlers registered while the command
    ran (``weakref.finalize`` hooks such as an index cache's, h5py's close, ...) in its normal
    order; the last of them, registered here before the command starts, flushes stdout and
    stderr, runs ``logging.shutdown`` (the one handler registered before it, when logging was
    imported; tests/test_cli_global.py checks there is no other) and ends the process with
    ``os._exit``.  Usage errors and ``--help`` (argparse's ``SystemExit``) and
    output that cannot be flushed take the normal exit.  :func:`main` itself just returns
    (tests call it in-process).
    """
    quick = _QuickExit()
    atexit.register(quick)
    if _command_in(sys.argv[1:]) in NO_COLLECTOR:
        gc.disable()  # (for the rest of this process: see NO_COLLECTOR)
    quick.rc = main()  # (argparse's SystemExit passes through: rc stays None, the normal exit)
    sys.exit(quick.rc)


NO_COLLECTOR = frozenset({"add", "status"})
"""Commands the console script runs without Python's cyclic garbage collector, to the quick exit.

Hazard (measured, issue 12): the collector is paused while a folder is walked and compared
(``collector_paused``), but once it resumed, its passes over what the comparison and the commit left
alive (the version's decoded tree nodes, the node bundles' lists) cost 2-3 ms of every ``add`` of a
folder of 10,000 files with 1% changed, against 0.3 ms after an unchanged one.  These commands make
no reference cycles to speak of, their memory is what they hold (bounded by the folder), and the
process ends right after them: the passes would only free what the exit drops anyway.  Commands that
run user code or may run for long (``derive``, ``gc``, ``push``, ...) keep the collector.
"""


@dataclass(slots=True)
class _QuickExit:
    """The last ``atexit`` handler of :func:`entry`: ends the process once :func:`main` returned ``rc``."""

    rc: Optional[int] = None

    def __call__(self) -> None:
        if self.rc is None:
            return
        logging.shutdown()
        if _flushed():
            os._exit(self.rc)


def _flushed() -> bool:
    """Flush stdout and stderr; False if either could not be (the normal exit then reports it)."""
    for stream in (sys.stdout, sys.stderr):
        if stream is None:
            continue
        try:
            stream.flush()
        except (OSError, ValueError):
            return False
    return True


def _unexpected(command: str, e: BaseException) -> str:
    """The one line for an exception casstore did not type: the command, the exception, and --debug."""
    return (f"casstore: error: {command or 'casstore'} failed unexpectedly: {_first_line(e)} "
            f"[{type(e).__name__}]; re-run as `casstore --debug {command or '...'} ...` to see the traceback")
