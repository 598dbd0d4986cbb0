"""Compile (or load) every kernel once, before any rank starts: ``spawn``'s warm-up.

Ranks then only read numba's cache (``_cache``): no rank compiles, and none writes a
cache file another is reading.

**A warm cache** (``cache_complete``) loads every kernel in this process, in about 2 s
here.

**A cold cache** (a fresh install, a new version) compiles for about 50 s of one core
on a 2-core machine. On a machine with more than one core, the work is cut in two
halves of about equal compile time (``HERE``, ``HELPER``):

- a helper process compiles ``HELPER``'s modules while this process compiles
  ``HERE``'s (about 25 s in all);
- this process then waits for the helper and loads what it compiled. Whatever the
  helper did not compile (it failed, or took past ``HELPER_WAIT_S``) is compiled here,
  as on one core.

Who owns the helper: the thread that started it. The helper follows that thread
(``flodl_shm.lifeline``: it dies with it, and ignores Ctrl-C, which the launcher decides
on) and is killed and reaped before ``warm_all`` returns or raises. Off Linux, where no
parent-death signal exists, there is no helper. Its output goes nowhere:
a compile that fails there fails again here, where it is raised.
"""
from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from typing import Sequence

from ..lifeline import follow_starter_code
from ._cache import cache_complete, cache_dir, mark_cache_complete

#: (a child of the "flodl_shm" logger: the demo says its own line instead of the warning)
logger = logging.getLogger(__name__)

#: The kernel modules compiled here on a cold cache (about 25 s of one core, here).
HERE = ("rounds", "parts", "signals")
#: The modules a helper compiles meanwhile (about 24 s): ``""`` is the package's own
#: ``warm_up`` (the reduces).
HELPER = ("", "cma", "tensorio", "outer_step", "permutation")
#: Every module whose ``warm_up`` runs (``""``: the package's own).
MODULES = HERE + HELPER

#: How long this process waits for the helper once its own half is done, before it
#: compiles the rest itself.
HELPER_WAIT_S = 300.0

#: The helper's program, after its first line (``lifeline.follow_starter_code``).
_HELPER_SCRIPT = """import sys
from flodl_shm.kernels import warming
warming.warm(sys.argv[2:], int(sys.argv[1]))
"""


def warm(modules: Sequence[str], max_sources: int) -> None:
    """Compile (or load) the kernels of ``modules`` (``""``: the package's own, the
    reduces for up to ``max_sources`` sources) in this process."""
    package = importlib.import_module(__package__)
    for name in modules:
        if name:
            importlib.import_module(f"{__package__}.{name}").warm_up()
        else:
            package.warm_up(max_sources=max_sources)


def warm_all(max_sources: int = 4) -> None:
    """Compile (or load) every kernel; on a cold cache and more than one core, half of
    them in a helper process (the module doc). Marks the cache complete."""
    if cache_complete():
        warm(MODULES, max_sources)
        return
    helper = _start_helper(max_sources)
    # said where a script's user sees it (a logger without handlers shows warnings): a
    # first spawn was silent for 30-50 s, as if it hung
    logger.warning("compiling flodl_shm's kernels for this machine, once: about %s (later "
                   "runs load them in a second)", "a minute" if helper is None else "30 s")
    logger.info("compiling the kernels into %s, once: %s", cache_dir(),
                "all in this process" if helper is None
                else f"half of them in a helper process (pid {helper.pid})")
    try:
        warm(HERE, max_sources)
        if helper is not None:
            try:
                helper.wait(HELPER_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if helper is not None:
            helper.kill()
            helper.wait()
    warm(HELPER, max_sources)  # loads what the helper compiled; compiles what it did not
    mark_cache_complete()


def _start_helper(max_sources: int) -> "subprocess.Popen | None":
    """The helper compiling ``HELPER``'s modules, or None off Linux, on one core, or
    when no interpreter can be started: this process compiles them all then."""
    if not sys.platform.startswith("linux"):
        return None  # (no parent-death signal: the helper could outlive a killed starter)
    try:
        cores = len(os.sched_getaffinity(0))
    except OSError:
        cores = os.cpu_count() or 1
    if cores < 2:
        return None
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)  # (the cache folder this process chose is exported in it)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    try:
        return subprocess.Popen(
            [sys.executable, "-c", follow_starter_code(os.getpid()) + _HELPER_SCRIPT,
             str(max_sources), *HELPER], env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:
        return None
