"""What a rank's exit means to the launcher: its outcome, whether it is a casualty of a
stop already under way, and the error ``spawn`` raises for it.

The supervisor (``supervisor.py``) sees a rank end one of three ways:

- **ok**: the rank sent ``("ok", result)`` down its pipe and exited with status 0;
- **error**: its function raised, and it sent ``("error", exc_type, traceback)``, with
  a fourth part (the round, the missing ranks, the text) when what it raised was its
  own collective deadline (``rank.py``);
- **died**: it exited without a message: killed by a signal, ``os._exit``, a crash.

These are plain functions of the exit's facts: nothing here touches a process or the
arena, and the failure policy (which deaths the cohort survives) is
``failure_budget.py``'s.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any, Optional

from ..engine import arena as A
from ..errors import RankFailed, RankStalled
from .stall_watch import stall_grace

__all__ = ["RankExit", "failure_error", "host_failure", "signal_name", "teardown_casualty"]

#: what a rank raises when a stop reaches it: the stop's consequence, not a failure
_STOP_ERRORS = ("CohortAborted", "_Terminated")


def signal_name(exitcode: Optional[int]) -> Optional[str]:
    """The name of the signal that ended a process of exit code ``exitcode``
    (multiprocessing's ``-signum``), or None when a signal did not."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclass(frozen=True)
class RankExit:
    """How one rank ended.

    Attributes:
        kind: ``"ok"``, ``"error"`` or ``"died"`` (module doc).
        value: the function's result (``"ok"``).
        exc_type: the name of the exception the function raised (``"error"``).
        tb: its traceback, as text.
        exitcode: the process's exit status (``-signum`` for a signal).
        signal: the name of the signal that killed it (``"died"``).
    """

    kind: str
    value: Any = None
    exc_type: Optional[str] = None
    tb: str = ""
    exitcode: Optional[int] = None
    signal: Optional[str] = None

    @classmethod
    def of(cls, msg: Optional[tuple], exitcode: Optional[int]) -> "RankExit":
        """The exit of a rank whose last message was ``msg`` (None: it sent none) and
        whose process ended with ``exitcode``."""
        if msg is not None and msg[0] == "ok" and exitcode == 0:
            return cls("ok", msg[1], exitcode=0)
        if msg is not None and msg[0] == "error":
            return cls("error", exc_type=msg[1], tb=msg[2], exitcode=exitcode)
        return cls("died", exitcode=exitcode, signal=signal_name(exitcode))

    @property
    def failed(self) -> bool:
        """Whether this exit counts against ``max_failures``: any but a success or an
        error the stop itself raised in the rank."""
        return self.kind != "ok" and self.exc_type not in _STOP_ERRORS


def teardown_casualty(out: RankExit, abort_reason: int, interrupted: bool) -> bool:
    """Whether a failed exit is a casualty of a stop already under way (the arena's abort
    word is ``abort_reason``, 0 when none; ``interrupted``: the user's interrupt stopped
    the run), not a cause: every exit after the user's interrupt, whatever the rank was
    doing; and, once the cohort is stopping, the stop's own error in the rank, or its
    SIGTERM or SIGKILL (a rank's SIGTERM handler exits with status 143)."""
    if abort_reason == A.ABORT_INTERRUPT and interrupted:
        return True
    if not abort_reason:
        return False
    return (out.exc_type in _STOP_ERRORS or out.exitcode == 143
            or (out.kind == "died" and out.signal in ("SIGTERM", "SIGKILL")))


def failure_error(global_rank: int, out: RankExit, msg: Optional[tuple],
                  started: bool = True, timeout: Optional[float] = None) -> RankFailed:
    """The error ``spawn`` raises for rank ``global_rank``'s failure: a ``RankStalled``
    when the rank gave up waiting on ranks that never came (its own backstop deadline,
    explained from spawn's ``timeout``), else a ``RankFailed``; one that exited with
    Python's error status before it ran ``fn`` (``started`` False) says where its
    traceback went and the usual cause."""
    stall = msg[3] if msg is not None and msg[0] == "error" and len(msg) > 3 else None
    # (a probe passed timeout=15 and read of "the 30 s collective timeout")
    deadline = ("" if not stall or timeout is None else
                f" (spawn's timeout={timeout:g} s; a rank's own deadline trails it by "
                f"{stall_grace(timeout):g} s, in which the launcher gives its own verdict)")
    if stall and stall["missing"] and all(isinstance(m, int) for m in stall["missing"]):
        return RankStalled(f"rank {global_rank} gave up waiting: {stall['text']}{deadline}",
                           round=int(stall["round"]), missing=tuple(stall["missing"]),
                           timeout=stall["timeout"], signal=None)
    if stall and deadline:
        # a stall that names no rank (a controller that went silent, with no other
        # host's ranks to suspect): the rank that gave up failed, its deadline explained
        return RankFailed(global_rank, out.exc_type, out.tb, out.signal, out.exitcode,
                          head=f"rank {global_rank} gave up waiting: {stall['text']}{deadline}")
    if not started and out.kind == "died" and out.exitcode == 1:
        return RankFailed(global_rank, None, "", None, 1, message=(
            f"rank {global_rank} exited with code 1 while starting, before it ran fn "
            f"(exc_type=None, signal=None); its Python traceback is on stderr. Each rank "
            f"imports the launcher's script: code there that runs at import (a spawn call, "
            f"torch work, reading files by relative path) runs in every rank; put it under "
            f"`if __name__ == \"__main__\":`"))
    return RankFailed(global_rank, out.exc_type, out.tb, out.signal, out.exitcode)


def host_failure(err: RankFailed) -> tuple[int, str]:
    """``(rank, one line)`` of a failure that stops this host, for the controller: the
    rank's error (``StartRefused: ...``), or the failure's own first line (how it died,
    or, for a ``RankStalled``, which carries no parsed error, what it waited for)."""
    # (the rank travels on its own: "rank 2 could not start ..." would make the same
    # refusal on every host a reason of its own at the controller)
    error = err.error.removeprefix(f"rank {err.rank} ")
    what = (f"{err.exc_type}: {error}" if error
            else (err.why if isinstance(err, RankStalled) else str(err)).split("\n", 1)[0])
    return err.rank, what
