"""``Comm.all_reduce_(drift=...)``: per tensor, ``(Σ old², Σ new², Σ (old - new)²)`` of
the values before and after the call, on every path: the small fused round (taken while
the consensus is written, or after it when a late peer sent the call to the blocking path), the single tensor, bfloat16 tensors, the bf16 wire, the
shared bulk round and the direct round (from a snapshot), a round that accepted no mass
(tensors untouched), non-contiguous tensors; and a bad array is refused by name.

Ranks are threads over a real arena (``FakeCohort``).
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from flodl_shm.engine import direct as D
from flodl_shm.testing import FakeCohort

pytestmark = pytest.mark.timeout(120)

EAGER = 64 << 10


def _tensors(rank: int, shapes, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _reference(old: list[torch.Tensor], new: list[torch.Tensor]) -> np.ndarray:
    rows = []
    for a, b in zip(old, new):
        x = a.double().reshape(-1).numpy()
        y = b.double().reshape(-1).numpy()
        rows.append([(x * x).sum(), (y * y).sum(), ((x - y) ** 2).sum()])
    return np.asarray(rows)


def _round(comm, ts, weight=None, **kw):
    old = [t.clone() for t in ts]
    drift = np.zeros((len(ts), 3))
    w = 1.0 + comm.rank if weight is None else weight
    comm.all_reduce_(ts, weight=w, scale=w, drift=drift, **kw)
    return drift, _reference(old, ts)


LATE = "several tensors, a late peer"  # the other rank's one-call round falls back
CASES = {
    "one tensor": [(96,)],
    "several tensors, eager": [(40, 3), (17,), (5,)],
    LATE: [(40, 3), (17,), (5,)],
    "bulk, shared memory": [(70_000,), (5,)],
}


@pytest.mark.parametrize("bf16_wire", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drift_sums_match_the_values_before_and_after_on_every_path(bf16_wire, dtype):
    def body(comm):
        comm.set_bf16_wire(bf16_wire)
        out = []
        for name, shapes in CASES.items():
            if name == LATE and comm.rank == 0:
                time.sleep(0.05)  # rank 1 sleeps on the doorbell: the blocking path
            out.append(_round(comm, _tensors(comm.rank, shapes, dtype)))
        return out

    with FakeCohort(2, eager_bytes=EAGER) as cohort:
        results = cohort.run(body)
    for rank_results in results:
        for (got, want), name in zip(rank_results, CASES):
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
            assert (got[:, 2] > 0).all(), name  # the replicas differed: every tensor moved


def test_drift_sums_of_a_direct_round(monkeypatch):
    monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(256 << 10))

    def body(comm):
        out = []
        for _ in range(3):  # the first settles the direct path: every round is direct
            out.append(_round(comm, _tensors(comm.rank, [(70_000,), (70_001,)])))
            out[-1] += (comm._engine.direct.state,)
        return out

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        results = cohort.run(body)
    for rank_results in results:
        assert [r[2] for r in rank_results] == [D.READY] * 3  # every one direct
        for got, want, _ in rank_results:
            np.testing.assert_allclose(got, want, rtol=1e-6)


def test_an_untouched_round_adds_each_norm_twice_and_no_difference():
    def body(comm):
        out = []
        for shapes in CASES.values():
            ts = _tensors(comm.rank, shapes)
            drift, want = _round(comm, ts, weight=0.0)  # no mass: keep local
            out.append((drift, want))
        return out

    with FakeCohort(2, eager_bytes=EAGER) as cohort:
        results = cohort.run(body)
    for rank_results in results:
        for got, want in rank_results:
            np.testing.assert_allclose(got, want, rtol=1e-6)
            assert (got[:, 2] == 0).all() and (got[:, 0] == got[:, 1]).all()


def test_non_contiguous_tensors_and_accumulation():
    def body(comm):
        base = _tensors(comm.rank, [(6, 9), (30,)])
        ts = [base[0].t(), base[1][::2]]  # a transposed view and a strided one
        old = [t.clone() for t in ts]
        drift = np.ones((2, 3))  # sums are added, not assigned
        comm.all_reduce_(ts, drift=drift)
        return drift - 1.0, _reference(old, ts)

    with FakeCohort(2, eager_bytes=EAGER) as cohort:
        for got, want in cohort.run(body):
            np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("bad", [np.zeros((1, 3)), np.zeros((2, 3), np.float32),
                                 np.zeros(6), [[0.0] * 3] * 2, np.zeros((2, 4))[:, :3]])
def test_a_bad_drift_array_is_refused_by_name(bad):
    def body(comm):
        with pytest.raises(ValueError, match=r"drift must be a writable, C-contiguous float64 "
                                             r"numpy array of shape \(len\(tensors\), 3\) = "
                                             r"\(2, 3\)"):
            comm.all_reduce_([torch.zeros(4), torch.zeros(5)], drift=bad)
        comm.all_reduce_([torch.zeros(4), torch.zeros(5)])  # still in step
        return True

    with FakeCohort(2) as cohort:
        assert cohort.run(body) == [True, True]


def test_a_small_round_takes_the_sums_without_a_snapshot(monkeypatch):
    from flodl_shm.engine import comm_reduces as C

    snapshots = []
    real = C.drift_snapshot
    monkeypatch.setattr(C, "drift_snapshot",
                        lambda *a: snapshots.append(a[1]) or real(*a))

    def body(comm):
        for shapes in CASES.values():
            _round(comm, _tensors(comm.rank, shapes))
        return True

    with FakeCohort(2, eager_bytes=EAGER) as cohort:
        cohort.run(body)
    assert snapshots == [70_005, 70_005]  # the bulk round's, on each rank; none else


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e17])
@pytest.mark.parametrize("n", [1, 1025, 5000])
def test_the_kernels_sum_in_f64_from_tiny_to_huge_values(n, scale):
    """The drift sums are f64 sums of the f32 values (their squares neither underflow
    at 1e-30 nor overflow past 1e19, as f32 squares would), alone and fused into the
    write-back of the consensus; a NaN is summed as f64 sums it."""
    from flodl_shm.kernels.codec import f32_to_bf16
    from flodl_shm.kernels.reduce import drift_sums
    from flodl_shm.kernels.tensorio import decode_scatter

    rng = np.random.default_rng(n)
    pre = (rng.standard_normal(n) * scale).astype(np.float32)
    post = (rng.standard_normal(n) * scale).astype(np.float32)
    for huge in (False, True):
        if huge:
            pre[n // 2] = np.float32(3e19)  # its square alone overflows f32
        want = _reference([torch.from_numpy(pre)], [torch.from_numpy(post)])[0]
        got = np.zeros(3)
        drift_sums(pre, post, got)
        np.testing.assert_allclose(got, want, rtol=1e-12)
        dst = pre.copy()  # the write-back: the old values' sums, the new ones written
        addrs = np.array([dst.ctypes.data, n, 0], np.int64)
        for wire in (post, np.zeros(n, np.uint16)):
            if wire.dtype == np.uint16:  # a bf16 consensus, widened exactly
                f32_to_bf16(post, wire)
                dst[:] = pre
                new = torch.from_numpy(wire.view(np.int16)).view(torch.bfloat16).float()
                want = _reference([torch.from_numpy(pre)], [new])[0]
            sums = np.zeros((1, 3))
            assert decode_scatter(wire, addrs, 1, sums) == 0
            np.testing.assert_allclose(sums[0], want, rtol=1e-12)
            if wire.dtype == np.float32:
                assert np.array_equal(dst, post)
    pre[0] = np.nan
    got = np.zeros(3)
    drift_sums(pre, post, got)
    assert np.isnan(got[0]) and np.isnan(got[2]) and np.isfinite(got[1])
