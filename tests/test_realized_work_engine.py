"""The seed's realized-work window math through the real single-host engine.

One window on a rank: a CONTROL count gather, then γ-weighted params through
``sumcount_reduce``, then buffers with the 0/1 mover indicator. The numbers are
the seed's (counts [3,5,2], values [1,2,3] -> 1.9; rank 2 dead -> counts [3,5,0],
params 13/8 = 1.625, buffers 1.5, γ=0.5 -> (√3·1 + √5·2)/(√3+√5)).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flodl_shm import (DECODE_SLOT_BUFFERS, DECODE_SLOT_PARAMS, RoundKind, gamma_mass,
                       mover_mass, sumcount_reduce)
from flodl_shm.testing import FakeCohort

pytestmark = pytest.mark.timeout(120)


def window_round(comm, n_i: int, value: float, gamma: float, size: int = 1):
    counts = np.zeros(comm.world_size)
    counts[comm.rank] = n_i
    counts = comm.all_reduce_per_rank_f64(counts)
    w = gamma_mass(n_i, gamma)
    t = torch.full((size,), value)
    adopted = sumcount_reduce(comm, [t], w, DECODE_SLOT_PARAMS)[0]
    # the raw reduce output: what the checkpoint forge and the outer step consume
    (raw,), _ = comm.all_reduce_weighted([t * w], RoundKind.MODEL, w)
    return counts.tolist(), float(adopted[0]), float(raw[0]), float(adopted[-1])


@pytest.mark.parametrize("size", [1, 1 << 18])  # eager and bulk rounds
def test_all_alive_consensus_is_1_9(size):
    plan = {0: (3, 1.0), 1: (5, 2.0), 2: (2, 3.0)}
    with FakeCohort(3) as c:
        out = c.run(lambda comm: window_round(comm, *plan[comm.rank], 1.0, size))
    for counts, adopted, raw, last in out:
        assert counts == [3.0, 5.0, 2.0]
        assert abs(adopted - 1.9) < 1e-6 and abs(raw - 1.9) < 1e-6 and adopted == last


@pytest.mark.parametrize("pinned", [False, True])
def test_after_a_death(pinned):
    want_half = (math.sqrt(3) + 2 * math.sqrt(5)) / (math.sqrt(3) + math.sqrt(5))
    plan = {0: (3, 1.0, 1.0), 1: (5, 2.0, 2.0)}

    def body(comm):
        comm.set_pinned_decode(pinned)
        n, v, b = plan[comm.rank]
        g1 = window_round(comm, n, v, 1.0)
        buf = sumcount_reduce(comm, [torch.tensor([b])], mover_mass(n), DECODE_SLOT_BUFFERS)[0]
        g_half = window_round(comm, n, v, 0.5)
        return g1, float(buf[0]), g_half

    with FakeCohort(3) as c:
        c.declare_dead(2)
        out = c.run(body, ranks=[0, 1])
    for (counts, adopted, raw, _), buf, (_, adopted_h, _, _) in out[:2]:
        assert counts == [3.0, 5.0, 0.0], "the gather reports realized counts only"
        assert abs(adopted - 1.625) < 1e-6 and abs(raw - 1.625) < 1e-6
        assert abs(buf - 1.5) < 1e-6, "buffers: mean of movers"
        assert abs(adopted_h - want_half) < 1e-5


def test_idle_cohort_keeps_local_state():
    def body(comm):
        t = torch.full((3,), float(comm.rank + 7))
        out = sumcount_reduce(comm, [t], gamma_mass(0, 1.0), DECODE_SLOT_PARAMS)
        return out[0] is t

    with FakeCohort(2) as c:
        assert c.run(body) == [True, True]


def test_an_idle_rank_does_not_vote():
    """Rank 1 took no steps (mass 0): the consensus is rank 0's alone."""
    def body(comm):
        n = 4 if comm.rank == 0 else 0
        t = torch.full((2,), float(comm.rank + 1))
        return sumcount_reduce(comm, [t], gamma_mass(n, 0.0), DECODE_SLOT_PARAMS)[0].tolist()

    with FakeCohort(2) as c:
        assert c.run(body) == [[1.0, 1.0], [1.0, 1.0]]
