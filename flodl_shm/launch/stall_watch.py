"""``StallWatch``: which live ranks leave the others waiting in a round, and when the
launcher names them.

The supervisor (``supervisor.py``) reads, at each poll, two words of every live rank
of this host from the control block (``engine/arena.py``): ``arrived``, the last round
it arrived at, and ``done``, the last round whose slice it reduced (bulk rounds). It
hands them here with the time and the moment each rank entered ``fn``; this module
decides. Nothing here reads shared memory, signals a process or reads a clock: it is
plain Python, a frozen value that each poll replaces, tested without processes.

A wait moves through these states:

::

    NO WAIT    fewer than two live ranks, or every live rank arrived at the front
       |       round and its slices are all done or none is: nobody waits on a live
       |       rank. The clock is cleared.
       v
    WAIT SEEN  live ranks are behind the front round: on arrivals (phase "arrive"),
       |       or, all arrived, on the slices of a bulk round some ranks published
       |       already (phase "reduce"). The clock starts at this poll, so within one
       |       poll of the waiters' own start. A wait of another phase or round
       |       starts the clock again.
       v
    VERDICT    a rank behind for ``timeout`` since the clock started, or since it
               entered ``fn`` when it entered later, is a culprit; a rank still
               starting up (not in ``fn``: importing torch on a busy host) is named
               after ``timeout + stall_grace(timeout) / 2``. The supervisor kills and
               fences the culprits (``Stall.why`` says what its log and the waiters'
               errors say).

The waiters' own deadline trails ``timeout`` by ``stall_grace(timeout)``: the launcher
names the culprit before any waiter gives up by itself. Ranks are this host's local
ranks (``first_rank`` turns them into global ones in the text).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["STALL_POLL_S", "Stall", "StallWatch", "stall_grace"]

STALL_POLL_S = 0.5    # the supervisor's longest look-away from the control block


def stall_grace(timeout: float) -> float:
    """Seconds a rank's own collective deadline trails the supervisor's stall verdict
    (``timeout``): time to notice, kill the culprit and fence it before any waiter
    gives up by itself. A rank still starting up (not yet in ``fn``: importing torch
    on a busy host) is given half of it on top of ``timeout`` before it is blamed."""
    return max(10.0, float(timeout))


@dataclass(frozen=True)
class Stall:
    """A verdict: ``culprits`` (local ranks) left ``waiters`` waiting in ``round`` past
    the timeout, in ``phase`` "arrive" (they did not arrive) or "reduce" (they did not
    reduce their slice of a bulk round)."""

    round: int
    phase: str
    culprits: tuple[int, ...]
    waiters: tuple[int, ...]

    def why(self, first_rank: int, timeout: float) -> str:
        """What the launcher says of this stall, in global ranks: the round, who did not
        do what, who waited, and the fix when the culprits were only slow."""
        missing = [first_rank + r for r in self.culprits]
        waiting = [first_rank + r for r in self.waiters]
        what = "arrive at" if self.phase == "arrive" else "reduce its slice of"
        return (f"round {self.round} stalled: rank(s) {missing} did not {what} the round "
                f"within the {timeout:g} s collective timeout while rank(s) {waiting} waited "
                f"for them; the launcher killed the missing rank(s) (alive but silent: stuck "
                f"outside the collective, or wedged; if they were only slow, e.g. a long first "
                f"batch, pass a larger timeout)")


@dataclass(frozen=True)
class StallWatch:
    """The stall check of one host's ranks (module doc): ``look`` at each poll, keep the
    watch it returns.

    Attributes:
        timeout: seconds a live rank may leave others waiting (spawn's ``timeout``).
        waiting: the wait seen so far, ``(phase, round)``, or None (NO WAIT).
        since: when the supervisor first saw that wait (its monotonic clock).
    """

    timeout: float
    waiting: Optional[tuple[str, int]] = None
    since: float = 0.0

    def look(self, arrived: Mapping[int, int], done: Mapping[int, int],
             entered: Mapping[int, float], now: float
             ) -> tuple["StallWatch", Optional[Stall]]:
        """One poll: the watch to keep and the verdict, if any.

        Args:
            arrived: per live rank (dead and fenced ones left out), its arrival word:
                the last round it arrived at.
            done: per live rank, its done word: the last round whose slice it reduced.
            entered: when each rank that entered ``fn`` did (ranks still starting up
                are absent).
            now: the time of the words' reading, on the clock of ``entered``.
        """
        if len(arrived) < 2:
            return self._cleared(), None
        front = max(arrived.values())
        behind = [r for r, a in arrived.items() if a < front]
        phase = "arrive"
        if not behind and max(done.values()) == front:  # a bulk round's slices under way
            behind = [r for r, d in done.items() if d < front]
            phase = "reduce"
        if not behind:
            return self._cleared(), None
        key = (phase, front)
        if self.waiting != key:
            return StallWatch(self.timeout, key, now), None
        since, timeout = self.since, self.timeout
        starting = since + timeout + stall_grace(timeout) / 2
        culprits = tuple(r for r in behind
                         if (r in entered and now - max(since, entered[r]) >= timeout)
                         or (r not in entered and now >= starting))
        if not culprits:
            return self, None
        waiters = tuple(r for r in arrived if r not in behind)
        return self, Stall(front, phase, culprits, waiters)

    def _cleared(self) -> "StallWatch":
        return self if self.waiting is None else StallWatch(self.timeout)
