"""The ``casstore`` command line (console script ``casstore = "casstore.cli:entry"``: :func:`main`, then a quick exit).

Store selection: ``--store DIR`` (before or after the command; it must be a
store: ``casstore init DIR``), else ``$CASSTORE_DIR``, else the per-user
default cache directory (``$XDG_CACHE_HOME/casstore`` or ``~/.cache/casstore``),
made on first use.  Every command but ``get`` and ``completion`` takes
``--json`` (one JSON document on stdout); tests/test_cli_global.py enforces it.
Exit codes: 0 ok, 1 an error (one line on stderr), 2 bad usage, 130 interrupted;
``--debug`` shows tracebacks (see :mod:`casstore.cli.app`).

One module per feature, each with ``register(add)`` adding its subcommands:

=================  ==============================================================
``app``            the parser, :func:`main`, error lines and exit codes, completion
``common``         store opening, argument types, JSON and help helpers, the Parser walk
``objects``        init, put, get, stat, ls, demo
``manifests``      manifest show/set/rm, freeze, pin, unpin, pins, diff, checkout, log
``config``         config
``pipelines``      fetch
``remote``         remote add/ls/check/rm, push, pull
``maintenance``    gc, verify, du, stats
``cache``          cache info/verify
=================  ==============================================================

A new command goes into its feature's module (or a new module, listed in
app.py); it uses the :class:`~casstore.Store` facade where the
facade has the operation, and imports a feature module only at the top of the
one function that needs it.
"""

from __future__ import annotations

from .app import entry, main

__all__ = ["entry", "main"]
