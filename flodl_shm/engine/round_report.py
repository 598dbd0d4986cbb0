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

import math
from typing import Sequence

import numpy as np

from . import arena as A

__all__ = ["REPORT_VALUES", "read_reports", "write_report"]

REPORT_VALUES = A.REPORT_VALUES


def write_report(arena: A.Arena, local_rank: int, rnd: int, values: Sequence[float]) -> None:
    """Write this rank's report for round ``rnd`` (before the round publishes).

    Raises:
        ValueError: more than ``REPORT_VALUES`` values, or a value that is not finite.
    """
    n = len(values)
    if n > REPORT_VALUES:
        raise ValueError(f"a round report holds at most {REPORT_VALUES} values, got {n}: "
                         f"send the rest in a CONTROL round (comm.all_reduce_per_rank_f64)")
    slots = np.zeros(REPORT_VALUES, np.float32)
    for i, v in enumerate(values):
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"report value {i} is {v}: reports carry finite numbers only")
        slots[i] = v
    base = A.header_base(local_rank, rnd)
    words = arena.ctl[base + A.H_REPORT:base + A.H_REPORT + REPORT_VALUES // 2]
    words.view(np.float32)[:] = slots
    arena.ctl[base + A.H_REPORT_ROUND] = rnd + 1


def read_reports(arena: A.Arena, rnd: int, accepted_mask: int) -> np.ndarray:
    """Every rank's report of round ``rnd`` as a ``[world, REPORT_VALUES]`` float64
    table (zeros for ranks outside ``accepted_mask``).

    Raises:
        RuntimeError: an accepted rank sent no report with that round (every rank must
            pass ``report=`` to the same call).
    """
    world = arena.world
    out = np.zeros((world, REPORT_VALUES), np.float64)
    ctl = arena.ctl
    for r in range(world):
        if not (accepted_mask >> r) & 1:
            continue
        base = A.header_base(r, rnd)
        if int(ctl[base + A.H_REPORT_ROUND]) != rnd + 1:
            raise RuntimeError(
                f"round {rnd}: rank {r} sent no report with it: every rank must pass "
                f"report= to the same collective call")
        out[r] = ctl[base + A.H_REPORT:base + A.H_REPORT + REPORT_VALUES // 2].view(np.float32)
    return out
