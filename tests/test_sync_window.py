"""One Trainer window on the real single-host engine (thread ranks): the count gather,
the realized-work reduce of params and buffers through the Trainer's LocalSGD
(``sync_every=None``, the movers' buffer mass, the drift measured), an all-idle window,
the ack (which travels in the next window's count gather).

The numbers are the seed's (spec §2.8): counts [3,5,2] with values [1,2,3] give 1.9;
rank 2 dead gives counts [3,5,0], params 13/8 = 1.625, buffers (mean of movers) 1.5.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flodl_shm import LocalSGD
from flodl_shm.training.sync_window import expected_params_mass, falls_short, gather_counts
from flodl_shm.testing import FakeCohort

pytestmark = pytest.mark.timeout(60)


class Tiny(torch.nn.Module):
    """One parameter, one float buffer (averaged), one integer buffer (kept local)."""

    def __init__(self, value: float, size: int = 3) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((size,), float(value)))
        self.register_buffer("stat", torch.full((2,), float(value)))
        self.register_buffer("steps", torch.tensor(int(value * 10), dtype=torch.long))


def window_sgd(comm, model, value=None, *, gamma=1.0):
    """The Trainer's window on ``model`` (a collective: it aligns the replicas on rank
    0's), then this rank's own ``value`` in its float tensors."""
    sgd = LocalSGD(model, sync_every=None, comm=comm, gamma=gamma, buffers="movers",
                   drift=True)
    if value is not None:
        with torch.no_grad():
            model.w.fill_(value)
            model.stat.fill_(value)
    return sgd


def trained(sgd, batches):
    for _ in range(batches):
        assert not sgd.step(1), "sync_every=None never syncs on its own"
    return sgd


def shortfall(sync, counts, gamma=1.0):
    return falls_short(sync.mass, counts, gamma)


def window(comm, model, batches, value, *, gamma=1.0, stop=False):
    """One window, then the next window's count gather (an idle one) for its ack."""
    sgd = window_sgd(comm, model, value, gamma=gamma)
    counts = gather_counts(comm, batches, compute_ms=10.0 * (comm.rank + 1),
                           loss_sum=0.5 * batches, stop=stop)
    sync = trained(sgd, batches).sync()
    ack = gather_counts(comm, 0, 0.0, prev=sync).prev_ack
    return counts, sync, ack


def test_seed_window_all_alive():
    plan = {0: (3, 1.0), 1: (5, 2.0), 2: (2, 3.0)}

    def body(comm):
        n, v = plan[comm.rank]
        model = Tiny(v)
        counts, sync, ack = window(comm, model, n, v)
        return counts, sync, ack, model.w.tolist(), model.stat.tolist(), int(model.steps)

    with FakeCohort(3) as c:
        out = c.run(body)
    for r, (counts, sync, ack, w, stat, steps) in enumerate(out):
        assert counts.batches == (3, 5, 2) and counts.present == (True, True, True)
        assert counts.compute_ms == (10.0, 20.0, 30.0)
        assert counts.loss_sum == (1.5, 2.5, 1.0) and not counts.stop
        assert not shortfall(sync, counts)
        assert sync.mass == 10.0 == expected_params_mass(counts, 1.0)
        assert sync.accepted == (0, 1, 2) and sync.local_steps == plan[r][0]
        assert all(abs(x - 1.9) < 1e-6 for x in w), "params: Σ n·v / Σ n"
        assert all(abs(x - 2.0) < 1e-6 for x in stat), "buffers: plain mean of the movers"
        assert steps == int(plan[r][1] * 10), "integer buffers stay local"
        want = abs(plan[r][1] - 1.9) / 1.9  # ||pre - post|| / ||post|| of a constant vector
        assert abs(sync.divergence - want) < 1e-6
        assert ack.divergence[r] == pytest.approx(want, rel=1e-6)
        assert ack.max_divergence == pytest.approx(1.1 / 1.9, rel=1e-6)
        assert counts.prev_ack.present == (False,) * 3, "no window before the first"
        assert ack.present == (True,) * 3
        # one param of 3 + one float buffer of 2, f32
        assert sync.bytes_sent == (3 + 2) * 4


def test_seed_window_with_a_dead_rank():
    plan = {0: (3, 1.0), 1: (5, 2.0)}
    want_half = (math.sqrt(3) + 2 * math.sqrt(5)) / (math.sqrt(3) + math.sqrt(5))

    def body(comm):
        n, v = plan[comm.rank]
        m1, m2 = Tiny(v), Tiny(v)
        counts, sync, _ = window(comm, m1, n, v)
        counts_half, sync_half, _ = window(comm, m2, n, v, gamma=0.5)
        return (counts, sync, m1.w.tolist(), m1.stat.tolist(), counts_half, sync_half,
                m2.w.tolist())

    with FakeCohort(3) as c:
        c.declare_dead(2)
        out = c.run(body, ranks=[0, 1])
    for counts, sync, w, stat, counts_half, sync_half, w_half in out[:2]:
        assert counts.batches == (3, 5, 0)
        assert counts.present == (True, True, False), "dead reads absent, not idle"
        assert counts.alive() == [0, 1] and counts.movers() == [0, 1]
        assert sync.mass == 8.0 and not shortfall(sync, counts)
        assert all(abs(x - 1.625) < 1e-6 for x in w)
        assert all(abs(x - 1.5) < 1e-6 for x in stat)
        assert sync_half.mass == pytest.approx(math.sqrt(3) + math.sqrt(5))
        assert expected_params_mass(counts_half, 0.5) == pytest.approx(sync_half.mass)
        assert all(abs(x - want_half) < 1e-5 for x in w_half)


def test_all_idle_window_keeps_every_replica_s_local_state():
    def body(comm):
        model = Tiny(comm.rank + 1.0)
        sgd = window_sgd(comm, model, comm.rank + 1.0)
        before = comm.round
        counts = gather_counts(comm, 0, 1.0)
        sync = sgd.sync()
        ack = gather_counts(comm, 0, 0.0, prev=sync).prev_ack
        return counts, sync, ack, comm.round - before, model.w.tolist(), model.stat.tolist()

    with FakeCohort(2) as c:
        out = c.run(body)
    for r, (counts, sync, ack, rounds, w, stat) in enumerate(out):
        assert counts.total_batches == 0 and counts.present == (True, True)
        assert sync.mass == 0.0 and not shortfall(sync, counts)
        assert rounds == 4, "the two count gathers, the params and the buffers rounds"
        assert w == [r + 1.0] * 3 and stat == [r + 1.0] * 2, "mass 0 keeps local state"
        assert ack.divergence == (0.0, 0.0)


def test_an_idle_rank_adopts_the_consensus_without_voting():
    def body(comm):
        value = 4.0 if comm.rank == 0 else 9.0
        model = Tiny(value)
        counts, sync, _ = window(comm, model, 6 if comm.rank == 0 else 0, value)
        return counts, sync, model.w.tolist(), model.stat.tolist()

    with FakeCohort(2) as c:
        out = c.run(body)
    for counts, sync, w, stat in out:
        assert counts.present == (True, True) and counts.movers() == [0]
        assert w == [4.0] * 3 and stat == [4.0] * 2, "mass 0 for params and buffers"
    assert out[1][1].divergence == pytest.approx(5.0 / 4.0)


def test_stop_request_reaches_every_rank():
    def body(comm):
        return window(comm, Tiny(1.0), 1, 1.0, stop=comm.rank == 1)[0].stop

    with FakeCohort(2) as c:
        assert c.run(body) == [True, True]


def test_shortfall_names_the_ranks_the_params_round_accepted():
    """Rank 2 joins the count gather, then dies before the params round: the reduce
    realizes ranks 0 and 1 only, and the window says so."""
    def body(cohort):
        def run(comm):
            model = Tiny(float(comm.rank + 1))
            sgd = trained(window_sgd(comm, model, float(comm.rank + 1)), 2)
            counts = gather_counts(comm, 2, 1.0)
            if comm.rank == 2:
                cohort.declare_dead(2)
                return None
            return counts, sgd.sync(), model.w.tolist()
        return run

    with FakeCohort(3) as c:
        out = c.run(body(c))
    for counts, sync, w in out[:2]:
        assert counts.present == (True, True, True)
        assert expected_params_mass(counts, 1.0) == 6.0 and sync.mass == 4.0
        assert shortfall(sync, counts) and sync.accepted == (0, 1)
        assert all(abs(x - 1.5) < 1e-6 for x in w)


def test_expected_mass_counts_present_ranks_only():
    from flodl_shm.training.sync_window import CohortCounts

    counts = CohortCounts((3, 0, 4), (1.0, 0.0, 1.0), (0.0, 0.0, 0.0), (True, False, True), False)
    assert expected_params_mass(counts, 1.0) == 7.0
    assert expected_params_mass(counts, 0.0) == 2.0


def test_counts_read_a_dead_rank_s_zero_column_in_any_float_type():
    """A dead rank's column is all zeros, whatever float type the table holds: a
    ``float.__lt__`` flag answered NotImplemented (true) for numpy float32 values, and
    counted the dead rank present."""
    from flodl_shm.training.sync_window import count_column, counts_from, counts_from_reports

    rows = (count_column(8, 12.0, 3.0, True), (0.0,) * 8, count_column(3, 5.0))
    for table in (rows, np.array(rows), np.array(rows, np.float32),
                  [tuple(np.float32(v) for v in row) for row in rows]):
        counts = counts_from_reports(table)
        assert counts.present == (True, False, True) and counts.batches == (8, 0, 3)
        assert all(type(b) is int for b in counts.batches)
        assert counts.stop and counts.prev_ack.present == (False, False, False)
        assert counts_from(np.array(table, np.float64).T) == counts


# --- one host: the counts ride in the params round ------------------------------------------

def test_one_round_window_gives_the_seed_numbers_and_the_counts_in_one_params_round():
    """The seed window again, with the counts in the params round's reports: the same
    consensus and counts; the params round plus the buffers round, nothing else."""
    from flodl_shm.training.sync_window import count_column, counts_from_reports

    plan = {0: (3, 1.0), 1: (5, 2.0), 2: (2, 3.0)}

    def body(comm):
        n, v = plan[comm.rank]
        model = Tiny(v)
        sgd = trained(window_sgd(comm, model, v), n)
        before = comm.round
        column = count_column(n, 10.0 * (comm.rank + 1), 0.5 * n, stop=comm.rank == 2)
        sync = sgd.sync(report=column)
        counts = counts_from_reports(sync.reports)
        return counts, sync, comm.round - before, model.w.tolist(), model.stat.tolist()

    with FakeCohort(3) as c:
        out = c.run(body)
    for counts, sync, rounds, w, stat in out:
        assert rounds == 2, "the params round (counts inside) and the buffers round"
        assert counts.batches == (3, 5, 2) and counts.present == (True, True, True)
        assert counts.compute_ms == (10.0, 20.0, 30.0) and counts.loss_sum == (1.5, 2.5, 1.0)
        assert counts.stop and not counts.prev_ack.reported
        assert sync.mass == 10.0 == expected_params_mass(counts, 1.0)
        assert all(abs(x - 1.9) < 1e-6 for x in w) and all(abs(x - 2.0) < 1e-6 for x in stat)


def test_one_round_window_reads_a_dead_rank_as_absent_and_an_idle_cohort_as_skipped():
    from flodl_shm.training.sync_window import count_column, counts_from_reports

    def body(comm):
        model = Tiny(float(comm.rank + 1), size=4)
        sgd = trained(window_sgd(comm, model, float(comm.rank + 1)), 2)
        s1 = sgd.sync(report=count_column(2, 1.0))
        # a window in which nobody trained: the round runs, every replica keeps its state
        model.w.data.fill_(7.0 + comm.rank)
        s2 = sgd.sync(report=count_column(0, 1.0, prev=s1))
        return ((s1, counts_from_reports(s1.reports)), (s2, counts_from_reports(s2.reports)),
                model.w.tolist())

    with FakeCohort(3) as c:
        c.declare_dead(1)
        out = c.run(body, ranks=[0, 2])
    for rank in (0, 2):
        (s1, c1), (s2, c2), w = out[rank]
        assert c1.present == (True, False, True) and c1.batches == (2, 0, 2)
        assert s1.mass == 4.0 == expected_params_mass(c1, 1.0) and s1.accepted == (0, 2)
        assert s2.mass == 0.0 and c2.total_batches == 0
        assert c2.prev_ack.present == (True, False, True)
        assert w == [7.0 + rank] * 4


def test_a_posted_checkpoint_is_the_bundle_the_tap_writes(tmp_path):
    """The same consensus reaches the forge armed (captured in the round) or posted (by
    one rank afterwards, from its replica): the two bundles hold the same bytes."""
    from flodl_shm.checkpoint.forge import load_consensus_checkpoint
    from flodl_shm.checkpoint.meta import CheckpointMeta, ModelSchema, SaveReason
    from flodl_shm.training.sync_window import ReplicaReduce

    def body(comm):
        model = Tiny(float(comm.rank + 1), size=5)
        comm.set_bf16_wire(True)
        schema = ModelSchema.from_module(model)
        meta = CheckpointMeta.new(0, 4, 1, 2, SaveReason.CHECKPOINT)
        replica = ReplicaReduce(model, buffers="work")
        comm.arm_checkpoint(tmp_path / "tapped.fdl", schema, meta)
        r = replica.reduce(comm, 1.0 + comm.rank)
        if comm.rank == 0:
            comm.post_checkpoint(tmp_path / "posted.fdl", schema, replica.tensors(),
                                 mass=r.params_mass, meta=meta)
        return model.w.tolist()

    with FakeCohort(2) as c:
        out = c.run(body)
        assert c.flush_checkpoints()
    for name in ("tapped", "posted"):
        model = Tiny(0.0, size=5)
        report = load_consensus_checkpoint(model, tmp_path / f"{name}.fdl")
        assert not report.missing and not report.unexpected
        assert model.w.tolist() == out[0] and model.stat.tolist() == out[0][:2]
        assert (tmp_path / f"{name}.meta.json").exists()
    assert (tmp_path / "tapped.fdl").read_bytes() == (tmp_path / "posted.fdl").read_bytes()


def test_post_checkpoint_refuses_what_it_cannot_save(tmp_path):
    from flodl_shm.checkpoint.meta import ModelSchema

    with FakeCohort(1) as c:
        comm = c.comm(0)
        model = Tiny(1.0)
        schema = ModelSchema.from_module(model)
        with pytest.raises(ValueError, match="schema has 2 tensors"):
            comm.post_checkpoint(tmp_path / "x.fdl", schema, [model.w], mass=1.0)
        with pytest.raises(ValueError, match="realized nothing"):
            comm.post_checkpoint(tmp_path / "x.fdl", schema, [model.w, model.stat], mass=0.0)
