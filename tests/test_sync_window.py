"""One sync window on the real single-host engine (thread ranks): the count gather,
the realized-work reduce of params and buffers, the all-idle skip, the ack (which
travels in the next window's count gather).

The numbers are the seed's (spec §2.8): counts [3,5,2] with values [1,2,3] give 1.9;
rank 2 dead gives counts [3,5,0], params 13/8 = 1.625, buffers (mean of movers) 1.5.
"""
from __future__ import annotations

import math

import pytest
import torch

from flodl_shm.training.sync_window import SyncWindow, expected_params_mass, gather_counts
from flodl_shm.testing import FakeCohort

pytestmark = pytest.mark.timeout(60)


class Tiny(torch.nn.Module):
    """One parameter, one float buffer (averaged), one integer buffer (kept local)."""

    def __init__(self, value: float, size: int = 3) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((size,), float(value)))
        self.register_buffer("stat", torch.full((2,), float(value)))
        self.register_buffer("steps", torch.tensor(int(value * 10), dtype=torch.long))


def window(comm, model, batches, *, gamma=1.0, stop=False):
    """One window, then the next window's count gather (an idle one) for its ack."""
    counts = gather_counts(comm, batches, compute_ms=10.0 * (comm.rank + 1),
                           loss_sum=0.5 * batches, stop=stop)
    sync = SyncWindow(model, gamma=gamma).sync(comm, batches, counts)
    ack = gather_counts(comm, 0, 0.0, prev=sync).prev_ack
    return counts, sync, ack


def test_seed_window_all_alive():
    plan = {0: (3, 1.0), 1: (5, 2.0), 2: (2, 3.0)}

    def body(comm):
        n, v = plan[comm.rank]
        model = Tiny(v)
        counts, sync, ack = window(comm, model, n)
        return counts, sync, ack, model.w.tolist(), model.stat.tolist(), int(model.steps)

    with FakeCohort(3) as c:
        out = c.run(body)
    for r, (counts, sync, ack, w, stat, steps) in enumerate(out):
        assert counts.batches == (3, 5, 2) and counts.present == (True, True, True)
        assert counts.compute_ms == (10.0, 20.0, 30.0)
        assert counts.loss_sum == (1.5, 2.5, 1.0) and not counts.stop
        assert not sync.skipped and not sync.shortfall
        assert sync.params_mass == 10.0 == sync.expected_mass
        assert all(abs(x - 1.9) < 1e-6 for x in w), "params: Σ n·v / Σ n"
        assert all(abs(x - 2.0) < 1e-6 for x in stat), "buffers: plain mean of the movers"
        assert steps == int(plan[r][1] * 10), "integer buffers stay local"
        want = abs(plan[r][1] - 1.9) / 1.9  # ||pre - post|| / ||post|| of a constant vector
        assert abs(sync.divergence - want) < 1e-6
        assert ack.divergence[r] == pytest.approx(want, rel=1e-6)
        assert ack.max_divergence == pytest.approx(1.1 / 1.9, rel=1e-6)
        assert counts.prev_ack.present == (False,) * 3, "no window before the first"
        assert ack.present == (True,) * 3
        # one param of 3 + one float buffer of 2, f32, plus the count gather
        assert sync.bytes_sent == (3 + 2) * 4 + 8 * 3 * 4


def test_seed_window_with_a_dead_rank():
    plan = {0: (3, 1.0), 1: (5, 2.0)}
    want_half = (math.sqrt(3) + 2 * math.sqrt(5)) / (math.sqrt(3) + math.sqrt(5))

    def body(comm):
        n, v = plan[comm.rank]
        m1, m2 = Tiny(v), Tiny(v)
        counts, sync, _ = window(comm, m1, n)
        _, sync_half, _ = window(comm, m2, n, gamma=0.5)
        return counts, sync, m1.w.tolist(), m1.stat.tolist(), sync_half, m2.w.tolist()

    with FakeCohort(3) as c:
        c.declare_dead(2)
        out = c.run(body, ranks=[0, 1])
    for counts, sync, w, stat, sync_half, w_half in out[:2]:
        assert counts.batches == (3, 5, 0)
        assert counts.present == (True, True, False), "dead reads absent, not idle"
        assert counts.alive() == [0, 1] and counts.movers() == [0, 1]
        assert sync.params_mass == 8.0 and not sync.shortfall
        assert all(abs(x - 1.625) < 1e-6 for x in w)
        assert all(abs(x - 1.5) < 1e-6 for x in stat)
        assert sync_half.expected_mass == pytest.approx(math.sqrt(3) + math.sqrt(5))
        assert all(abs(x - want_half) < 1e-5 for x in w_half)


def test_all_idle_window_skips_both_reduces_and_keeps_local_state():
    def body(comm):
        model = Tiny(comm.rank + 1.0)
        before = comm.round
        counts, sync, ack = window(comm, model, 0)
        return counts, sync, ack, comm.round - before, model.w.tolist(), model.stat.tolist()

    with FakeCohort(2) as c:
        out = c.run(body)
    for r, (counts, sync, ack, rounds, w, stat) in enumerate(out):
        assert counts.total_batches == 0 and counts.present == (True, True)
        assert sync.skipped and sync.params_mass == 0.0 and not sync.shortfall
        assert rounds == 2, "only the two count gathers ran (this window's, and the next carrying the ack)"
        assert w == [r + 1.0] * 3 and stat == [r + 1.0] * 2
        assert ack.divergence == (0.0, 0.0)


def test_an_idle_rank_adopts_the_consensus_without_voting():
    def body(comm):
        model = Tiny(4.0 if comm.rank == 0 else 9.0)
        counts, sync, _ = window(comm, model, 6 if comm.rank == 0 else 0)
        return counts, sync, model.w.tolist(), model.stat.tolist()

    with FakeCohort(2) as c:
        out = c.run(body)
    for counts, sync, w, stat in out:
        assert counts.present == (True, True) and counts.movers() == [0]
        assert w == [4.0] * 3 and stat == [4.0] * 2, "mass 0 for params and buffers"
    assert out[1][1].divergence == pytest.approx(5.0 / 4.0)


def test_stop_request_reaches_every_rank():
    def body(comm):
        return window(comm, Tiny(1.0), 1, stop=comm.rank == 1)[0].stop

    with FakeCohort(2) as c:
        assert c.run(body) == [True, True]


def test_shortfall_names_the_ranks_the_params_round_accepted():
    """Rank 2 joins the count gather, then dies before the params round: the reduce
    realizes ranks 0 and 1 only, and the window says so."""
    def body(cohort):
        def run(comm):
            model = Tiny(float(comm.rank + 1))
            counts = gather_counts(comm, 2, 1.0)
            if comm.rank == 2:
                cohort.declare_dead(2)
                return None
            return counts, SyncWindow(model).sync(comm, 2, counts), model.w.tolist()
        return run

    with FakeCohort(3) as c:
        out = c.run(body(c))
    for counts, sync, w in out[:2]:
        assert counts.present == (True, True, True)
        assert sync.expected_mass == 6.0 and sync.params_mass == 4.0
        assert sync.shortfall and sync.accepted == (0, 1)
        assert all(abs(x - 1.5) < 1e-6 for x in w)


def test_expected_mass_counts_present_ranks_only():
    from flodl_shm.training.sync_window import CohortCounts

    counts = CohortCounts((3, 0, 4), (1.0, 0.0, 1.0), (0.0, 0.0, 0.0), (True, False, True), False)
    assert expected_params_mass(counts, 1.0) == 7.0
    assert expected_params_mass(counts, 0.0) == 2.0
