"""``FailureBudget``: how many rank deaths a run survives, and what its log says of them.

The launcher's failure policy, as a pure value: no process, no shared memory, no clock.
The supervisor (``supervisor.py``) asks it at each death (a rank that raised or was
killed, a rank it fenced for a stall, other hosts' ranks the controller declared dead)
whether the cohort stops, and takes the reasons its log lines give from it.

- **Stop or go on.** A run started with ``max_failures=k`` goes on on realized work
  while at most ``k`` ranks of the cohort are dead, and while any rank is left; the
  ``k+1``-th death stops it.
- **Survivors that save.** With ``survivors_save`` (the Trainer's), past ``k`` the
  survivors see the deaths themselves, save a checkpoint of the realized work and stop:
  the launcher stops the host only once none of its own ranks is left.

Ranks are global ranks; this host runs ``first_rank ... first_rank + nprocs - 1`` of
``world_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import plural


@dataclass(frozen=True)
class FailureBudget:
    """The failure policy of one host's ranks (module doc).

    Attributes:
        first_rank: the global rank of this host's first rank.
        nprocs: this host's ranks.
        world_size: the cohort's ranks, every host's.
        max_failures: dead ranks the cohort goes on without.
        survivors_save: past ``max_failures`` the survivors save and stop on their own.
    """

    first_rank: int
    nprocs: int
    world_size: int
    max_failures: int
    survivors_save: bool = False

    def is_local(self, rank: int) -> bool:
        """Whether global rank ``rank`` runs on this host."""
        return self.first_rank <= rank < self.first_rank + self.nprocs

    def local(self, ranks: Sequence[int]) -> list[int]:
        """The global ranks of ``ranks`` that run on this host."""
        return [r for r in ranks if self.is_local(r)]

    def stops(self, dead: Sequence[int], local_more: int = 0) -> bool:
        """Whether the ``dead`` ranks (cohort-wide) and ``local_more`` ranks of this host
        about to be killed stop the cohort: past ``max_failures``, or once no rank of the
        cohort is left (nobody continues: the last failure is the news), or with
        ``survivors_save`` only once no rank of this host is left."""
        if self.survivors_save:
            return len(self.local(dead)) + local_more >= self.nprocs
        n = len(dead) + local_more
        return n > self.max_failures or n >= self.world_size

    def why_stop(self, failures: int) -> str:
        """Why ``failures`` failures stop the cohort (``stops`` said they do), for the log."""
        if failures > self.max_failures:
            return (f"{plural(failures, 'failure')} "
                    f"exceed{'s' if failures == 1 else ''} max_failures={self.max_failures}")
        return "no rank is left"

    def survivors_go_on(self, failures: int) -> str:
        """What the survivors of ``failures`` failures do when they do not stop the
        cohort, for the log line."""
        if failures > self.max_failures:  # only with survivors_save (``stops``)
            return (f"{plural(failures, 'failure')}, more than max_failures="
                    f"{self.max_failures}: the survivors save a checkpoint of the realized "
                    f"work, if any, and stop")
        return (f"continuing on realized work with the survivors ({failures} of "
                f"max_failures={self.max_failures} used)")
