"""Shared parameter blocks: a model whose averaged tensors live in its rank's ``p<r>``
segment, so a direct round reads and writes them in place (engine/direct.py, MAPPED).

The averaged weights must be bit for bit what the private-parameter paths give (the
direct round through cross-memory calls, and the shared-memory copies), and a model's
tensors must really live in the block and keep training there.
"""
from __future__ import annotations

import os

import pytest
import torch

import flodl_shm
from flodl_shm import LocalSGD, spawn
from flodl_shm.testing import FakeCohort

from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(180)

EAGER = 64 << 10  # eager slot bytes: the window's round takes the bulk or direct path


@pytest.fixture
def low_threshold(monkeypatch):
    """Direct rounds (and shared parameters where it pays) from 256 KiB."""
    monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(256 << 10))


def make_model(rank: int) -> torch.nn.Module:
    """~85k f32 (340 KB) of parameters plus BatchNorm statistics, different per rank."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 1200), torch.nn.BatchNorm1d(1200),
                                torch.nn.ReLU(), torch.nn.Linear(1200, 7))
    g = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _windows(comm, shared, windows: int = 3):
    """Train with an optimizer built before LocalSGD; each window's replica after the
    sync (the model is re-seeded per rank after construction's alignment)."""
    model = make_model(comm.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    sgd = LocalSGD(model, sync_every=2, comm=comm, shared_params=shared)
    with torch.no_grad():
        for p, q in zip(model.parameters(), make_model(comm.rank).parameters()):
            p.copy_(q)
    moved = {n: p.data_ptr() != before[n] for n, p in model.named_parameters()}
    trace = []
    for w in range(windows):
        for k in range(2):
            g = torch.Generator().manual_seed(1000 * comm.rank + 10 * w + k)
            x = torch.randn(16 + comm.rank, 64, generator=g)
            y = torch.randint(0, 7, (16 + comm.rank,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sgd.step(samples=16 + comm.rank)
        trace.append([t.detach().clone() for t in model.state_dict().values()])
    block = comm._engine.arena.params_view(comm._engine.rank, 1)
    lo, hi = block.ctypes.data, block.ctypes.data + block.shape[0]
    inside = all(lo <= p.data_ptr() and p.data_ptr() + 4 * p.numel() <= hi
                 for p in model.parameters())
    return (sgd.shared_params, moved, inside, trace, comm._engine.direct.mapped_rounds,
            sgd.last_sync.mass)


def _run(world: int, direct: bool, shared) -> list:
    with FakeCohort(world, direct=direct, eager_bytes=EAGER) as cohort:
        return cohort.run(lambda comm: _windows(comm, shared))


@pytest.mark.parametrize("world", [2, 3])
def test_shared_parameters_average_in_place_bit_for_bit_like_the_copy_paths(low_threshold,
                                                                          world):
    mapped = _run(world, direct=True, shared=None)          # default: where it pays
    private = _run(world, direct=True, shared=False)        # direct round, private memory
    copies = _run(world, direct=False, shared=False)        # shared-memory copies
    for rank in range(world):
        placed, moved, inside, trace, rounds, mass = mapped[rank]
        assert placed and inside and all(moved.values()), "the parameters moved to p<r>"
        assert rounds == 3, "LocalSGD settles the probe first: every window reduces mapped"
        assert mass == sum(2 * (16 + r) for r in range(world))
        assert not private[rank][0] and private[rank][4] == 0
        for step in range(3):
            for a, b, c in zip(trace[step], private[rank][3][step], copies[rank][3][step]):
                assert _bits(a) == _bits(b) == _bits(c), (rank, step)
    for step in range(3):  # every replica holds the same consensus
        for rank in range(1, world):
            for a, b in zip(mapped[0][3][step], mapped[rank][3][step]):
                if a.is_floating_point():
                    assert _bits(a) == _bits(b)


def test_shared_params_only_where_the_round_is_direct(low_threshold):
    def body(comm):
        out = {}
        for what, kwargs, why in (("bf16", dict(bf16_wire=True), "bf16_wire=True"),
                                  ("diloco", dict(outer=flodl_shm.OuterNesterov()),
                                   "the outer optimizer steps inside the params round")):
            out[what] = LocalSGD(make_model(0), sync_every=2, comm=comm, **kwargs).shared_params
            with pytest.raises(ValueError, match=f"shared_params=True, but {why}"):
                LocalSGD(make_model(0), sync_every=2, comm=comm, shared_params=True, **kwargs)
        comm.set_outer(None)
        out["default"] = LocalSGD(make_model(0), sync_every=2, comm=comm).shared_params
        # (a probe was told "tensors [2, 3] of the params round are not float32")
        half = make_model(0)
        half[-1].to(torch.bfloat16)
        with pytest.raises(ValueError, match=r"shared_params=True, but parameter '3\.weight' "
                                             r"\(bfloat16\), parameter '3\.bias' "
                                             r"\(bfloat16\) are not float32"):
            LocalSGD(half, sync_every=2, comm=comm, shared_params=True)
        return out

    with FakeCohort(2, direct=True) as cohort:
        out = cohort.run(body)
    assert out == [{"bf16": False, "diloco": False, "default": True}] * 2

    def no_direct(comm):
        with pytest.raises(ValueError, match="direct rounds are off for this cohort"):
            LocalSGD(make_model(0), sync_every=2, comm=comm, shared_params=True)
        return LocalSGD(make_model(0), sync_every=2, comm=comm).shared_params

    with FakeCohort(2, direct=False) as cohort:
        assert cohort.run(no_direct) == [False, False]


def test_a_model_of_more_tensors_than_a_direct_round_holds_keeps_private_parameters(
        low_threshold):
    """A probe: the default moved a model into the shared block by its bytes alone. A
    model of more tensors than a direct round's address table holds (tens of thousands
    with the default eager slot; over 2,047 with this test's 64 KiB one) takes the
    shared path, where the block saves nothing."""
    def model_of(count: int, size: int) -> torch.nn.Module:
        g = torch.Generator().manual_seed(0)  # (not the global one: the ranks are threads)
        return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(size, generator=g))
                                       for _ in range(count)])

    def window(comm, count: int, size: int):
        model = model_of(count, size)
        sgd = LocalSGD(model, sync_every=1, comm=comm)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(comm.rank)
        sgd.step(samples=1)
        return (comm.direct_round_holds(list(model.parameters())), sgd.shared_params,
                float(model[0][0].detach()))

    start = float(model_of(1, 32)[0][0].detach())
    for count, size, placed in ((2040, 40, True), (2100, 32, False)):  # 319, 262 KiB
        with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:  # (a block per rank)
            got = cohort.run(lambda comm: window(comm, count, size))
        assert got == [(placed, placed, pytest.approx(start + 0.5))] * 2, count


class _Aliased(torch.nn.Module):
    """A parameter that is a view of another's memory (a user's own tying)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.full((300, 300), float(rank)))
        self.sub = torch.nn.Parameter(self.big.data[:10])


def test_layouts_and_shared_memory_the_block_cannot_keep_stay_private(low_threshold):
    """A probe saw channels_last weights come out contiguous and a parameter that views
    another's memory stop following it, once the model was large enough to be placed:
    such tensors now stay private (where the default decides), or are refused naming
    them (shared_params=True), and the averaging keeps both."""
    def body(comm):
        conv = torch.nn.Conv2d(64, 64, 5).to(memory_format=torch.channels_last)
        auto = LocalSGD(conv, sync_every=1, comm=comm)
        kept = conv.weight.is_contiguous(memory_format=torch.channels_last)
        with pytest.raises(ValueError, match=r"shared_params=True, but parameter 'weight' "
                                             r"is not contiguous \(channels_last"):
            LocalSGD(torch.nn.Conv2d(64, 64, 5).to(memory_format=torch.channels_last),
                     sync_every=1, comm=comm, shared_params=True)
        model = _Aliased(comm.rank)
        aliased = LocalSGD(model, sync_every=1, comm=comm)
        with pytest.raises(ValueError, match=r"shared_params=True, but parameter 'big', "
                                             r"parameter 'sub' share memory with another"):
            LocalSGD(_Aliased(0), sync_every=1, comm=comm, shared_params=True)
        with torch.no_grad():
            model.big.fill_(float(comm.rank))
        aliased.step(samples=1 + comm.rank)  # weights 1 and 2: the mean is 2/3
        linked = model.sub.data_ptr() == model.big.data_ptr()
        return auto.shared_params, kept, aliased.shared_params, linked, model.sub.clone()

    with FakeCohort(2, direct=True) as cohort:
        out = cohort.run(body)
    for placed, kept, aliased_placed, linked, sub in out:
        assert not placed and kept
        assert not aliased_placed and linked
        torch.testing.assert_close(sub, torch.full((10, 300), 2.0 / 3.0))


def test_a_small_model_is_placed_only_on_request_and_still_averages(monkeypatch):
    monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(8 << 20))

    def body(comm):
        auto = LocalSGD(make_model(comm.rank), sync_every=1, comm=comm)
        model = make_model(comm.rank)
        asked = LocalSGD(model, sync_every=1, comm=comm, shared_params=True)
        with torch.no_grad():
            model[0].bias.fill_(float(comm.rank))
        asked.step(samples=1 + comm.rank)
        return auto.shared_params, asked.shared_params, model[0].bias.clone()

    with FakeCohort(2, direct=True) as cohort:
        out = cohort.run(body)
    for auto, asked, bias in out:
        assert not auto and asked
        torch.testing.assert_close(bias, torch.full((1200,), 2.0 / 3.0))


def test_shared_tensors_are_placed_once_per_comm(low_threshold):
    """Rank 0's block already holds other tensors, so its LocalSGD averages private
    parameters while rank 1's are shared: each reducer maps what it can and calls
    across for the rest, and the consensus is the same."""
    def body(comm):
        if comm.rank == 0:
            with pytest.raises(ValueError, match="torch.float64 on cpu; shared tensors are "
                                                 "float32"):
                comm.shared_tensors([torch.zeros(3, dtype=torch.float64)])
            a, b = comm.shared_tensors([torch.arange(5.0), torch.ones(2, 3)])
            assert a.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and b.shape == (2, 3)
            assert b.data_ptr() - a.data_ptr() == 64, "each tensor starts on 64 bytes"
            with pytest.raises(RuntimeError, match="already holds the tensors of an earlier"):
                comm.shared_tensors([torch.zeros(1)])
        model = make_model(comm.rank)
        sgd = LocalSGD(model, sync_every=1, comm=comm)
        for _ in range(3):
            with torch.no_grad():
                model[0].bias.fill_(float(comm.rank))
            sgd.step(samples=1 + comm.rank)
        return sgd.shared_params, model[0].bias.clone()

    with FakeCohort(2, direct=True) as cohort:
        out = cohort.run(body)
    assert [placed for placed, _ in out] == [False, True]
    for _, bias in out:
        torch.testing.assert_close(bias, torch.full((1200,), 2.0 / 3.0))


def test_a_second_local_sgd_on_a_comm_says_it_averages_with_copies(low_threshold, caplog):
    """A probe's sweep built LocalSGD after LocalSGD on one Comm: the second and later
    synced ~1.8x slower (the block holds the first one's model for the Comm's life),
    said only at INFO; shared_params=True raised the Comm's RuntimeError where the docs
    promise a ValueError saying why."""
    def body(comm):
        first = LocalSGD(make_model(comm.rank), sync_every=1, comm=comm)
        second = LocalSGD(make_model(comm.rank), sync_every=1, comm=comm)
        with pytest.raises(ValueError, match=r"shared_params=True, but this rank's shared "
                                             r"parameter block already holds"):
            LocalSGD(make_model(comm.rank), sync_every=1, comm=comm, shared_params=True)
        return first.shared_params, second.shared_params

    with FakeCohort(2, direct=True) as cohort, caplog.at_level("INFO", logger="flodl_shm"):
        assert cohort.run(body) == [(True, False), (True, False)]
    said = [r for r in caplog.records if "averaged with copies" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING"], caplog.text  # one a host
    assert "one LocalSGD per Comm, the models in one nn.ModuleList" in said[0].getMessage()


def _shm_bytes(arena, what: str) -> int:
    """The bytes of /dev/shm that the arena's segment ``what`` holds (its pages)."""
    return os.stat(os.path.join("/dev/shm", arena.handle.name(what))).st_blocks * 512


def big_windows(ctx, shared):
    """A 9 MiB model over the default threshold, three windows, across processes; the
    /dev/shm bytes of each region of the arena after them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1536, 1536))
    sgd = LocalSGD(model, sync_every=1, comm=ctx.comm, shared_params=shared)
    out = []
    for w in range(3):
        with torch.no_grad():
            model[0].weight.fill_(float(ctx.rank + w))
        sgd.step(samples=1 + ctx.rank)
        out.append(float(model[0].weight[7, 9]))
    ctx.comm.barrier()
    arena = ctx.comm._engine.arena
    held = {what: _shm_bytes(arena, what) for what in ("d0", "d1", "res", "p0", "p1")}
    return sgd.shared_params, ctx.comm._engine.direct.mapped_rounds, out, held


@pytest.mark.parametrize("shared", [None, False])
def test_spawn_averages_shared_parameters_across_processes(shared):
    """Every window reduces in place, and the arena's regions stay empty: the shared
    blocks (or, with shared_params=False, the cross-memory calls) stand in for them. A
    probe found the first window's round, which settled the direct path, growing each
    rank's region and the result's to a model frame, idle for the rest of the run."""
    out = spawn(big_windows, 2, args=(shared,))
    want = [(1 * w + 2 * (w + 1)) / 3 for w in range(3)]
    model_bytes = 4 * (1536 * 1536 + 1536)
    for placed, rounds, got, held in out:
        assert placed == (shared is None) and rounds == (3 if shared is None else 0)
        assert got == pytest.approx(want, rel=1e-6)
        assert max(held["d0"], held["d1"], held["res"]) <= 4096, held  # as created
        assert all(held[p] >= model_bytes if shared is None else held[p] <= 4096
                   for p in ("p0", "p1")), held
    assert_no_leaks()
