"""The command-line tools (``python -m flodl_shm <command>``, ``flodl-shm <command>``)."""
from __future__ import annotations

import os
import signal
import sys


def invoked_as() -> str:
    """How the tools were invoked, for usage lines and errors: the console script's name
    (``flodl-shm``), else ``python -m flodl_shm``."""
    name = os.path.basename(sys.argv[0] if sys.argv and sys.argv[0] else "")
    if name.startswith("flodl") and not name.endswith(".py"):
        return name
    return "python -m flodl_shm"


def shortened(text: str, keep: int = 60) -> str:
    """``text`` itself, or its start and end around an ellipsis when longer than ``keep``
    (a path in an error line)."""
    return text if len(text) <= keep else f"{text[:keep // 2]}...{text[-keep // 2:]}"


def first_stop_signal_only() -> tuple[list, dict]:
    """Make the first SIGINT (Ctrl-C), or SIGTERM / SIGHUP / SIGUSR1 / SIGUSR2 (the latter
    while they have their default action: a scheduler's stop or warning, a closed
    terminal), raise ``KeyboardInterrupt``, and ignore any later one, which would
    interrupt the shutdown it started (or print a traceback as the interpreter exits).
    Inside ``spawn`` the signal first stops the ranks, then reaches this handler. Returns
    the list the handler appends the signal to, and the handlers it replaced."""
    from ..launch.stop_signals import take_stop_signals

    received: list = []
    replaced: dict = {}

    def handler(signum, frame):
        received.append(signum)
        for s in replaced:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt

    handler.stops_the_command = True
    replaced.update(take_stop_signals(handler))
    return received, replaced


def stopped_by(received: list) -> str:
    """How a command was stopped, for its last line: "interrupted" (Ctrl-C) or
    "stopped by SIGTERM"."""
    signum = received[0] if received else signal.SIGINT
    if signum == signal.SIGINT:
        return "interrupted"
    return f"stopped by {signal.Signals(signum).name}"
