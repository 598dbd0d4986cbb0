"""The command-line tools (``python -m flodl_shm <command>``, ``flodl-shm <command>``)."""
from __future__ import annotations

import os
import sys


def invoked_as() -> str:
    """How the tools were invoked, for usage lines and errors: the console script's name
    (``flodl-shm``), else ``python -m flodl_shm``."""
    name = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "")
    if name.startswith("flodl") and not name.endswith(".py"):
        return name
    return "python -m flodl_shm"


