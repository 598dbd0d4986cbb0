"""Round reports: a few numbers per rank that ride in a round's header.

A training window needs, besides the model's average, a handful of per-rank facts
(batches trained, compute time, a stop request...) that every rank must see
identically. Sending them in a round of their own costs a second synchronisation
per window; a *report* puts them in the header words this rank publishes anyway,
so they arrive with the round itself::

    mass = comm.all_reduce_(params, weight=w, scale=w, report=(batches, ms, stop))
    table = comm.last_reports()        # [local world, REPORT_VALUES] float64

Layout. Each round header (``kernels/control_block.py``) has ``REPORT_VALUES``
float32 slots at ``H_REPORT`` (two per int64 word) and a tag word
``H_REPORT_ROUND`` = round + 1 (0: no report yet). The rank writes both before the
round's publication, whose release store of ``R_ARRIVED`` orders them: a peer that
sees the arrival sees the report.

Lifetime. A header of round N is rewritten by its rank only at round N + 2, which
that rank cannot start before every rank arrived at N + 1. So between the end of
round N and this rank's next collective the reports of round N are stable:
:func:`read_reports` must run in that gap (``Comm.last_reports`` checks it).

Who is in the table. Every accepted rank of the round (the ranks that arrived,
whatever their mass); a rank that did not arrive (dead, fenced) reads as zeros: a
caller that must tell "dead" from "reported zeros" checks the round's accepted ranks
(``Comm.last_accepted_ranks``) or sends a 1.0 "present" value of its own. Values are
float32: integers are exact up to 2^24.
Reports cover the ranks of one arena; on a cluster (a relay completes the rounds)
they are refused, since the other hosts' ranks are not in this host's headers.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from . import arena as A

__all__ = ["REPORT_VALUES", "RoundReports"]

REPORT_VALUES = A.REPORT_VALUES
_F32_MAX = float(np.finfo(np.float32).max)


class RoundReports:
    """The report words of every rank's two round headers in one arena, as numpy views
    made once (a round's header is chosen by its parity), so a write or a read is a
    few vector operations.

    Args:
        arena: the arena whose headers carry the reports.
    """

    def __init__(self, arena: A.Arena) -> None:
        world = arena.world
        ranks = arena.ctl[A.rank_base(0):A.rank_base(world)].reshape(world, A.RANK_WORDS)
        f32 = ranks.view(np.float32)  # two float32 per word, rank by rank
        self._values, self._tags = [], []
        for parity in (0, 1):
            hdr = A.R_HDR + parity * A.HDR_WORDS
            self._values.append(f32[:, 2 * (hdr + A.H_REPORT):
                                    2 * (hdr + A.H_REPORT) + REPORT_VALUES])
            self._tags.append(ranks[:, hdr + A.H_REPORT_ROUND])

    def write(self, local_rank: int, rnd: int, values: Sequence[float]) -> None:
        """Write this rank's report for round ``rnd`` (before the round publishes).

        Raises:
            ValueError: more than ``REPORT_VALUES`` values, or a value that is not a
                finite float32.
        """
        n = len(values)
        if n > REPORT_VALUES:
            raise ValueError(f"a round report holds at most {REPORT_VALUES} values, got {n}: "
                             f"send the rest in a CONTROL round (comm.all_reduce_per_rank_f64)")
        for i, v in enumerate(values):
            if not -_F32_MAX <= v <= _F32_MAX:  # NaN fails both
                raise ValueError(f"report value {i} is {float(v)}: reports carry finite "
                                 f"float32 numbers only")
        slots = self._values[rnd & 1][local_rank]
        slots[:n] = values
        slots[n:] = 0.0
        self._tags[rnd & 1][local_rank] = rnd + 1

    def read(self, rnd: int, accepted_mask: int) -> np.ndarray:
        """Every rank's report of round ``rnd`` as a ``[world, REPORT_VALUES]`` float64
        table (zeros for ranks outside ``accepted_mask``).

        Raises:
            RuntimeError: an accepted rank sent no report with that round (every rank must
                pass ``report=`` to the same call).
        """
        out = self._values[rnd & 1].astype(np.float64)
        tags = self._tags[rnd & 1]
        for r, tag in enumerate(tags.tolist()):
            if not (accepted_mask >> r) & 1:
                out[r] = 0.0
            elif tag != rnd + 1:
                raise RuntimeError(
                    f"round {rnd}: rank {r} sent no report with it: every rank must pass "
                    f"report= to the same collective call")
        return out
