"""The dead-rank ledger: which ranks have been fenced out of the cohort for good."""
from __future__ import annotations

import operator
import threading


def _int(value, what: str) -> int:
    """``value`` as an int (numpy's too); TypeError naming ``what`` for anything else
    (a float was truncated: ``declare_dead(2.9)`` marked rank 2)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"DeadRanks: {what} must be an int, got {value!r}")


class DeadRanks:
    """A thread-safe, permanent record of dead ranks (flodl's DeadRanks).

    Ranks only ever shrink out: ``declare_dead`` is idempotent and there is no
    rejoin. Used by the cluster controller (round waits, scatter) and by tests.
    """

    def __init__(self, world_size: int) -> None:
        world_size = _int(world_size, "world_size")
        if world_size <= 0:
            raise ValueError(f"DeadRanks: world_size must be > 0, got {world_size}")
        self._world = world_size
        self._dead = [False] * self._world
        self._lock = threading.Lock()

    @property
    def world_size(self) -> int:
        return self._world

    def declare_dead(self, rank: int) -> bool:
        """Mark ``rank`` dead; returns True if it was alive. Out of range -> ValueError."""
        r = _int(rank, "rank")
        if not 0 <= r < self._world:
            raise ValueError(f"DeadRanks.declare_dead: rank {r} is out of range for "
                             f"world_size {self._world}")
        with self._lock:
            was_alive = not self._dead[r]
            self._dead[r] = True
            return was_alive

    def is_dead(self, rank: int) -> bool:
        """True if ``rank`` was declared dead (False for out-of-range ranks)."""
        r = _int(rank, "rank")
        return 0 <= r < self._world and self._dead[r]

    def alive(self) -> list[int]:
        """Sorted list of live ranks."""
        with self._lock:
            return [r for r, d in enumerate(self._dead) if not d]

    def dead(self) -> list[int]:
        with self._lock:
            return [r for r, d in enumerate(self._dead) if d]

    def dead_count(self) -> int:
        with self._lock:
            return sum(self._dead)

    def __repr__(self) -> str:
        return f"DeadRanks(world_size={self._world}, dead={self.dead()})"
