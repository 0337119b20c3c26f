"""``casstore config``: the effective runtime settings and where each came from."""

from __future__ import annotations

import argparse
import json

from .common import Add

__all__ = ["register"]


def cmd_config(args: argparse.Namespace) -> int:
    """Print every setting, its value and its source (a file, an environment variable, the default)."""
    from ..settings import load_settings

    st = load_settings()
    doc = {k: getattr(st, k) for k in st.sources}
    if args.json:
        print(json.dumps({"settings": doc, "sources": dict(st.sources), "file": st.file}, indent=2))
        return 0
    print(f"# settings file: {st.file or '(none found)'}")
    for k, v in doc.items():
        # None (compression, durable) means "as each store was made" (`casstore init --compress/--scratch`);
        # "None" read like a value (found by a bug hunt).
        shown = "(each store's own)" if v is None else repr(v)
        print(f"{k:15} = {shown:40} # {st.sources[k]}")
    return 0


def register(add: Add) -> None:
    """Add ``casstore config`` to the ``casstore`` parser."""
    sp = add("config", cmd_config, "print the effective runtime settings and where each came from")
    sp.add_argument("--json", action="store_true")
