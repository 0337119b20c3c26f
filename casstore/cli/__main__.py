"""``python -m casstore.cli``: the same as the ``casstore`` console script."""

from __future__ import annotations

import sys

from .app import main

sys.exit(main())
