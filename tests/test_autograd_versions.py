"""The in-place collectives move autograd's version counter of the tensors they write,
as torch's own in-place ops do: a tensor saved for backward, then reduced or broadcast
in place, makes backward raise (it fed backward the new values silently). Every path:
the hot one-tensor call, the fused several-tensor round, drift and report rounds, the
shared bulk round, the direct round; ``broadcast_`` small and large; a ``LocalSGD`` sync
between forward and backward.

Ranks are threads over a real arena (``FakeCohort``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_shm import LocalSGD
from flodl_shm.engine import direct as D
from flodl_shm.testing import FakeCohort

pytestmark = pytest.mark.timeout(120)

EAGER = 64 << 10
INPLACE = "modified by an inplace operation"


def _saved(shape, rank: int):
    """``(w, y)``: ``y = (x * w).sum()`` saved ``w`` for backward."""
    w = torch.full(shape, 1.0 + rank)
    x = torch.ones(shape, requires_grad=True)
    return w, (x * w).sum()


def _backward_refused(y) -> bool:
    try:
        y.backward()
    except RuntimeError as e:
        assert INPLACE in str(e), e
        return True
    return False


CALLS = {
    "one tensor (hot)": lambda comm, ts: comm.all_reduce_(ts[:1]),
    "several tensors": lambda comm, ts: comm.all_reduce_(ts),
    "weighted, no mass": lambda comm, ts: comm.all_reduce_(ts, weight=0.0),
    "drift": lambda comm, ts: comm.all_reduce_(ts, drift=np.zeros((len(ts), 3))),
    "report": lambda comm, ts: comm.all_reduce_(ts, report=[1.0]),
    "broadcast_": lambda comm, ts: comm.broadcast_(ts, 0),
    "broadcast_, one tensor": lambda comm, ts: comm.broadcast_(ts[:1], 0),
}


@pytest.mark.parametrize("size", [8, 70_000])  # a fused eager round, the shared bulk one
def test_every_in_place_collective_moves_the_version_of_what_it_wrote(size):
    def body(comm):
        out = {}
        for name, call in CALLS.items():
            (a, ya), (b, yb) = _saved((size,), comm.rank), _saved((3,), comm.rank)
            before = (a._version, b._version)
            call(comm, [a, b])
            both = "one" not in name  # (the one-tensor calls are passed [a] alone)
            out[name] = (a._version > before[0], _backward_refused(ya),
                         (b._version > before[1]) == both, _backward_refused(yb) == both)
        return out

    with FakeCohort(2, eager_bytes=EAGER) as cohort:
        for rank_results in cohort.run(body):
            for name, checks in rank_results.items():
                assert checks == (True, True, True, True), (name, checks)


def test_a_direct_round_moves_the_version_too(monkeypatch):
    monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(256 << 10))

    def body(comm):
        out = []
        for _ in range(2):  # the first settles the direct path
            w, y = _saved((100_000,), comm.rank)
            comm.all_reduce_([w])
            out.append((comm._engine.direct.state, _backward_refused(y)))
            w, y = _saved((100_000,), comm.rank)
            comm.broadcast_([w], 0)
            out.append((comm._engine.direct.state, _backward_refused(y)))
        return out

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        for rank_results in cohort.run(body):
            assert rank_results[-1][0] == D.READY
            assert all(refused for _, refused in rank_results), rank_results


def test_a_local_sgd_sync_between_forward_and_backward_makes_backward_raise():
    """The parameters a forward saved are the consensus after the sync: backward on
    them would mix the old activations with the new weights."""
    def body(comm):
        torch.manual_seed(comm.rank)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(),
                                    torch.nn.Linear(3, 1))
        sgd = LocalSGD(model, sync_every=1, comm=comm)
        loss = model(torch.randn(5, 4)).square().mean()
        sgd.step(samples=5)  # syncs: the second Linear's weight, saved, is replaced
        refused = _backward_refused(loss)
        loss = model(torch.randn(5, 4)).square().mean()
        loss.backward()  # a fresh forward after the sync trains as usual
        return refused

    with FakeCohort(2) as cohort:
        assert cohort.run(body) == [True, True]
