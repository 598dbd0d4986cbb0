"""Stop signals while ``spawn`` runs: the cohort stops first, then the signal acts.

SIGINT (Ctrl-C) and the signals whose default action ends the process (``TERMINATING``:
SIGTERM, a closed terminal's SIGHUP, a scheduler's SIGUSR1/SIGUSR2 warning) would kill
the launcher with its ranks still running and its shared-memory segments in /dev/shm.
``InterruptGate`` takes them on the main thread while ``spawn`` waits: it stops the
cohort through the ``SpawnContext`` it guards (its ``_stop``; ``_gated`` tells a nested
``join`` that a gate already guards the wait), and re-delivers the signal once every
rank is reaped, so the process ends of it as it would have, with nothing left behind. A
handler of the program's own stays in charge of its signal. ``take_stop_signals`` is
the same taking for the commands of ``flodl_shm.cli``; ``signals_deferred`` keeps a
signal handler's exception out of a block that must not be cut in half.
"""
from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any, Callable

from ..engine import arena as A

if TYPE_CHECKING:
    from .supervisor import SpawnContext


#: signals whose default action ends the process: the gate stops the cohort first (its
#: segments unlinked), then re-delivers them. SIGHUP is a closed terminal or SSH
#: session, SIGUSR1/SIGUSR2 a scheduler's warning; those three only while their
#: disposition is the default (a handler of the program's own stays in charge).
TERMINATING = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def stops_the_process(handler) -> bool:
    """Whether a signal whose handler is ``handler`` stops the process: its default
    action, or a command's stop handler (marked ``stops_the_command``, as the CLI's
    ``first_stop_signal_only`` makes them). Such a signal stops a spawned cohort first,
    then reaches the process (``InterruptGate``)."""
    return handler in (signal.SIG_DFL, None) or getattr(handler, "stops_the_command", False)


def take_stop_signals(handler: Callable) -> dict:
    """Install ``handler`` for SIGINT, SIGTERM and the other ``TERMINATING`` signals
    that stop the process (``stops_the_process``); returns the handlers it replaced, by
    signal."""
    old = {signal.SIGINT: signal.signal(signal.SIGINT, handler)}
    for sig in TERMINATING:
        if sig == signal.SIGTERM or stops_the_process(signal.getsignal(sig)):
            old[sig] = signal.signal(sig, handler)
    return old


class InterruptGate:
    """``spawn``'s handling of SIGINT and the terminating signals (``TERMINATING``)
    on the main thread, from before the arena exists until every rank is reaped.

    Before a ``SpawnContext`` owns an arena the signal acts as it would have (nothing
    to clean up): a terminating signal of default disposition ends the process at once
    (raised as ``KeyboardInterrupt`` instead, it could land in a finalizer or a numba
    callback compiling the kernels, which prints it as "Exception ignored" and goes
    on), a script's own handler runs, a command's stop handler
    (``stops_the_process``) gets ``KeyboardInterrupt`` here and the signal again as
    ``spawn`` returns. From then on it stops the cohort
    (``terminate``) and ``spawn`` raises ``KeyboardInterrupt`` once every rank is gone.
    A terminating signal is re-delivered at the end when its disposition was the
    default (the process then dies of it, as it would have, with nothing left in
    /dev/shm); when the program has a handler of its own for it, that handler runs then.
    """

    def __init__(self) -> None:
        self.ctx: "SpawnContext | None" = None
        self.received: list[int] = []
        self._replaced: dict = {}  # the handlers this gate replaced, by signal

    def _handler(self, signum, frame) -> None:
        self.received.append(signum)
        if self.ctx is None:
            old = self._replaced.get(signum)
            if signum != signal.SIGINT and old in (signal.SIG_DFL, None):
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)  # its default action, now
            if callable(old) and not stops_the_process(old):
                return old(signum, frame)  # the script's own handler, as without spawn
            raise KeyboardInterrupt
        how = ("interrupted (Ctrl-C)" if signum == signal.SIGINT
               else f"stopped by {signal.Signals(signum).name}")
        self.ctx._stop(A.ABORT_INTERRUPT, f"its launcher was {how}",
                       said=None if signum == signal.SIGINT else how)

    def guard(self, ctx: "SpawnContext") -> "SpawnContext":
        """From now on a signal stops ``ctx``'s cohort (its ``join`` then raises)."""
        self.ctx = ctx
        ctx._gated = True
        return ctx

    def run(self, wait: Callable[["InterruptGate"], Any]) -> Any:
        """``wait(self)`` with the stop signals taken; a signal that would have ended
        the process is delivered again once it returns or raises."""
        old = self._replaced = take_stop_signals(self._handler)
        try:
            return wait(self)
        finally:
            if self.ctx is not None:
                self.ctx._gated = False
            self.ctx = None  # the run is over (and a raised error's traceback holds self)
            for sig, handler in old.items():
                signal.signal(sig, handler)
            for sig in TERMINATING:
                if sig in self.received:  # delivered again, now that the ranks are gone:
                    handler = old.get(sig, signal.SIG_DFL)
                    if stops_the_process(handler):
                        os.kill(os.getpid(), sig)  # its default action, or a command's stop
                    elif callable(handler):
                        # the program's own handler; no frame: the one the signal
                        # interrupted has finished by now
                        handler(sig, None)
                    break


#: the signals a program may raise from (SIGINT, the terminating ones, an alarm, ...):
#: all but those a fault raises synchronously, which cannot wait
_ASYNCHRONOUS = signal.valid_signals() - {
    signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
    signal.SIGILL, signal.SIGTRAP, signal.SIGSYS, signal.SIGABRT}


class signals_deferred:
    """Block the asynchronous signals for this thread inside the block (they are
    delivered, and their Python handlers run, right after it): no handler's exception
    lands half-way through it."""

    def __enter__(self) -> None:
        #: the thread's mask before the block
        self.old = signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNCHRONOUS)

    def __exit__(self, *exc) -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, self.old)
