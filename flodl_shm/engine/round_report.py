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
reads must run in that gap (``Comm.last_reports`` checks it).

Who is in the table. Every accepted rank of the round (the ranks that arrived,
whatever their mass); a rank that did not arrive (dead, fenced) reads as zeros: a
caller that must tell "dead" from "reported zeros" checks the round's accepted ranks
(``Comm.last_accepted_ranks``) or sends a 1.0 "present" value of its own. Values are
float32: integers are exact up to 2^24.
Reports cover the ranks of one arena; on a cluster (a relay completes the rounds)
they are refused, since the other hosts' ranks are not in this host's headers.
"""
from __future__ import annotations

import math
import struct
from typing import Sequence

import numpy as np

from . import arena as A

__all__ = ["REPORT_VALUES", "RoundReports"]

REPORT_VALUES = A.REPORT_VALUES
_F32_MAX = float(np.finfo(np.float32).max)
#: one rank's report slots: REPORT_VALUES float32 (native order, as the kernels write)
_ROW = struct.Struct(f"={REPORT_VALUES}f")
#: the zeros that pad a report of n values to REPORT_VALUES
_PAD = tuple((0.0,) * (REPORT_VALUES - n) for n in range(REPORT_VALUES + 1))
_ZERO_ROW = (0.0,) * REPORT_VALUES


class RoundReports:
    """The report words of every rank's two round headers in one arena. Reads and writes
    go through ``struct`` on a memoryview of the control block, not numpy: a window
    runs them right after training has evicted the caches, where each numpy call costs
    15-30 µs and a ``struct`` call 5-10 µs.

    Args:
        arena: the arena whose headers carry the reports.
    """

    def __init__(self, arena: A.Arena) -> None:
        self._world = arena.world
        self._bytes = memoryview(arena.ctl).cast("B")
        self._words = self._bytes.cast("q")
        self._value_at: list[list[int]] = []  # [parity][rank]: byte offset of the slots
        self._tag_at: list[list[int]] = []  # [parity][rank]: word index of the tag
        for parity in (0, 1):
            hdr = A.R_HDR + parity * A.HDR_WORDS
            self._value_at.append([8 * (A.rank_base(r) + hdr + A.H_REPORT)
                                   for r in range(self._world)])
            self._tag_at.append([A.rank_base(r) + hdr + A.H_REPORT_ROUND
                                 for r in range(self._world)])

    def write(self, local_rank: int, rnd: int, values: Sequence[float]) -> None:
        """Write this rank's report for round ``rnd`` (before the round publishes).

        Raises:
            ValueError: more than ``REPORT_VALUES`` values, or a finite value beyond
                float32's range (NaN and ±inf pass as they are: a diverged loss reads
                as one).
        """
        n = len(values)
        if n > REPORT_VALUES:
            raise ValueError(f"a round report holds at most {REPORT_VALUES} values, got {n}: "
                             f"send the rest in a CONTROL round (comm.all_reduce_per_rank_f64)")
        for i, v in enumerate(values):
            if not -_F32_MAX <= v <= _F32_MAX and math.isfinite(v):  # (NaN fails both)
                raise ValueError(f"report value {i} is {float(v)}: reports carry float32 "
                                 f"numbers only (|value| <= {_F32_MAX:.4g}, NaN or inf)")
        parity = rnd & 1
        _ROW.pack_into(self._bytes, self._value_at[parity][local_rank], *values, *_PAD[n])
        self._words[self._tag_at[parity][local_rank]] = rnd + 1

    def rows(self, rnd: int, accepted_mask: int) -> tuple[tuple[float, ...], ...]:
        """Every rank's report of round ``rnd``: one tuple of ``REPORT_VALUES`` floats
        per rank (zeros for ranks outside ``accepted_mask``).

        Raises:
            RuntimeError: an accepted rank sent no report with that round (every rank must
                pass ``report=`` to the same call).
        """
        parity = rnd & 1
        value_at, tag_at, words = self._value_at[parity], self._tag_at[parity], self._words
        out = []
        for r in range(self._world):
            if not (accepted_mask >> r) & 1:
                out.append(_ZERO_ROW)
            elif words[tag_at[r]] != rnd + 1:
                raise RuntimeError(
                    f"round {rnd}: rank {r} sent no report with it: every rank must pass "
                    f"report= to the same collective call")
            else:
                out.append(_ROW.unpack_from(self._bytes, value_at[r]))
        return tuple(out)

    def read(self, rnd: int, accepted_mask: int) -> np.ndarray:
        """:meth:`rows` as a ``[world, REPORT_VALUES]`` float64 table."""
        return np.array(self.rows(rnd, accepted_mask), dtype=np.float64)
