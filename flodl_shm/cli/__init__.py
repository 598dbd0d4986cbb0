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


def plural(n: int, word: str) -> str:
    """``"1 rank"``, ``"2 ranks"``: a count and its noun, as a reader says them."""
    return f"{n} {word}" + ("" if n == 1 else "s")
