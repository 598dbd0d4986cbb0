"""A child process that follows the thread that started it.

Some processes of ours are started by another of ours and must never outlive it:

- a rank, started by the launcher's supervisor thread (``spawn``), or forked by the rank
  server;
- the rank server, started by the supervisor thread;
- a process a rank forks from its main thread (a DataLoader's worker);
- the kernel warm-up's helper, started by the thread that warms up.

Each follows its starter from its first instructions:

- **It dies with the starter's thread.** The kernel sends it SIGKILL when the thread
  that started it ends (``PR_SET_PDEATHSIG``, Linux only: elsewhere there is no such
  signal, and only the next check runs).
- **It exits at once if its starter is already gone.** Its parent is then another
  process (the signal was set too late to come).
- **A fresh interpreter also ignores SIGINT.** A Ctrl-C at the terminal reaches the whole
  process group, and the launcher decides what it stops. (A forked child sets its own
  signal dispositions.)

``follow_starter_code`` is that prologue as the first line of a ``-c`` program: it runs
before any import of this package (seconds on a busy host) and needs none. ``follow``
does the first two in a forked child.
"""
from __future__ import annotations

import os
import signal
import sys


def follow_starter_code(starter_pid: int) -> str:
    """The first line of a ``-c`` program (Linux) whose process follows the thread of
    ``starter_pid`` that starts it (the module doc); it ends in ``"; "``."""
    return ("import os, signal, ctypes; signal.signal(signal.SIGINT, signal.SIG_IGN); "
            "ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0); "
            f"os.getppid() == {int(starter_pid)} or os._exit(1); ")


def set_parent_death_signal() -> None:
    """SIGKILL this process when the thread that started it ends (``PR_SET_PDEATHSIG``;
    nothing elsewhere than Linux)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def follow(parent_pid: int) -> None:
    """In a child forked by ``parent_pid``: die with the thread that forked it, or exit
    now if that process is gone already (the module doc)."""
    set_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the signal was set: it never comes
