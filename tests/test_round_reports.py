"""Round reports (engine/round_report.py): per-rank numbers riding in a round's header.

Every reduce path carries them (the one-call in-place round, the multi-tensor eager
round, the shared bulk round, the direct round, bf16 wire), every rank reads the same
table, a rank the round did not accept reads zeros, and misuse is refused by name.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flodl_shm.engine import direct as D
from flodl_shm.engine.round_report import REPORT_VALUES
from flodl_shm.testing import FakeCohort

pytestmark = pytest.mark.timeout(120)

EAGER = 64 << 10


def _report(rank: int, i: int) -> tuple:
    # integers, a float, a negative, a flag: what a window reports
    return (rank + 10 * i, 1.5 * rank + 0.25, -float(rank), float(rank % 2), 2.0 ** 23 + rank)


def _expected(world: int, i: int) -> np.ndarray:
    out = np.zeros((world, REPORT_VALUES))
    for r in range(world):
        vals = _report(r, i)
        out[r, :len(vals)] = np.asarray(vals, np.float32)
    return out


SHAPES = {
    "one tensor, one call": [(96,)],
    "several tensors, eager": [(40, 3), (17,)],
    "bulk, shared memory": [(70_000,), (5,)],
}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("bf16", [False, True])
def test_every_rank_reads_every_ranks_report_on_every_path(world, bf16):
    def body(comm):
        comm.set_bf16_wire(bf16)
        got = []
        for i, shapes in enumerate(SHAPES.values()):
            ts = [torch.full(s, float(comm.rank + 1)) for s in shapes]
            mass = comm.all_reduce_(ts, weight=1.0 + comm.rank, scale=1.0,
                                    report=_report(comm.rank, i))
            got.append((mass, comm.last_reports(), ts[0].clone()))
        return got

    with FakeCohort(world, eager_bytes=EAGER) as cohort:
        results = cohort.run(body)
    mass = sum(1.0 + r for r in range(world))
    for rank_results in results:
        for i, (m, table, t) in enumerate(rank_results):
            assert m == mass
            np.testing.assert_array_equal(table, _expected(world, i))
            # the round itself is unchanged by what rides with it
            want = sum(float(r + 1) for r in range(world)) / mass
            assert torch.allclose(t, torch.full_like(t, want), rtol=1e-2 if bf16 else 1e-6)


def test_a_direct_round_carries_reports_too(monkeypatch):
    monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(256 << 10))

    def body(comm):
        got = []
        for i in range(3):  # the first settles the direct path (its report goes along)
            ts = [torch.full((70_000,), float(comm.rank))]
            comm.all_reduce_(ts, report=_report(comm.rank, i))
            got.append((comm._engine.direct.state, comm.last_reports()))
        return got

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        results = cohort.run(body)
    for rank_results in results:
        assert [state for state, _ in rank_results] == [D.READY] * 3  # every one direct
        for i, (_, table) in enumerate(rank_results):
            np.testing.assert_array_equal(table, _expected(2, i))


def test_a_rank_the_round_did_not_accept_reads_zeros():
    def body(comm):
        comm.all_reduce_([torch.ones(8)], report=(7.0, 8.0))
        return comm.last_reports(), comm.last_accepted_ranks()

    with FakeCohort(3) as cohort:
        cohort.declare_dead(1)
        results = cohort.run(body, ranks=[0, 2])
    for table, accepted in (results[0], results[2]):
        assert accepted == [0, 2]
        assert table[1].tolist() == [0.0] * REPORT_VALUES
        assert table[0, :2].tolist() == [7.0, 8.0] and table[2, :2].tolist() == [7.0, 8.0]


def test_a_rank_that_sends_no_report_is_named():
    def body(comm):
        report = None if comm.rank == 1 else (1.0,)
        comm.all_reduce_([torch.ones(8)], report=report)
        if comm.rank == 1:
            return None
        with pytest.raises(RuntimeError, match="rank 1 sent no report"):
            comm.last_reports()
        return True

    with FakeCohort(2) as cohort:
        assert cohort.run(body)[0] is True


def test_reports_are_read_before_the_next_collective():
    def body(comm):
        comm.all_reduce_([torch.ones(8)], report=(1.0,))
        comm.barrier()
        with pytest.raises(RuntimeError, match="before the next collective"):
            comm.last_reports()
        comm.all_reduce_([torch.ones(8)])
        with pytest.raises(RuntimeError, match="carried none"):
            comm.last_reports()
        return True

    with FakeCohort(2) as cohort:
        assert cohort.run(body) == [True, True]


def test_bad_reports_are_refused_before_the_round():
    with FakeCohort(1) as cohort:
        comm = cohort.comm(0)
        with pytest.raises(ValueError, match=f"at most {REPORT_VALUES} values"):
            comm.all_reduce_([torch.ones(4)], report=[0.0] * (REPORT_VALUES + 1))
        with pytest.raises(ValueError, match=r"value 1 is 1e\+39: reports carry float32"):
            comm.all_reduce_([torch.ones(4)], report=(1.0, 1e39))
        assert comm.round == 0  # nothing was published
        # NaN and inf pass as they are (a diverged loss reads as one, not as 0)
        comm.all_reduce_([torch.ones(4)], report=(float("nan"), float("-inf")))
        row = comm.last_reports()[0]
        assert math.isnan(row[0]) and row[1] == -math.inf
        comm.all_reduce_([torch.ones(4)], report=(3.0,))
        assert comm.last_reports()[0, 0] == 3.0
        # a call refused before its round (a bad weight) leaves no report behind for
        # a report-less call of the same round number to read
        with pytest.raises(ValueError, match="weight -1.0 is not a finite"):
            comm.all_reduce_([torch.ones(4)], weight=-1.0, report=(5.0,))
        comm.all_reduce_([torch.ones(4)])
        with pytest.raises(RuntimeError, match="carried none"):
            comm.last_reports()
