"""Direct rounds (engine/direct.py): large reduces between the ranks' private tensors.

Each result is compared bit for bit with the shared-memory path on the same inputs:
the two paths must be indistinguishable to a caller.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

import flodl_shm
from flodl_shm import RankFailed, spawn
from flodl_shm.engine import arena as A
from flodl_shm.engine import direct as D
from flodl_shm.kernels import cma
from flodl_shm.testing import FakeCohort

from engine_util import assert_no_leaks, refused_in_flight

pytestmark = pytest.mark.timeout(180)

N = 70_000  # f32 elements of the big tensor: 280 KB, over the lowered threshold below
EAGER = 64 << 10  # eager slot bytes: rounds above it take the bulk (or direct) path


@pytest.fixture
def low_threshold(monkeypatch):
    """Direct reduces from 256 KiB, so thread-rank tests stay small; broadcasts from
    64 KiB, at world 3 too (where ranks outnumber this machine's cores, the owner would
    write 1 MiB)."""
    monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(256 << 10))
    monkeypatch.setenv("FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES", str(64 << 10))


def _inputs(rank: int, i: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + i)
    big = torch.randn(N, generator=g) * (rank + 1)
    mat = torch.randn(300, 40, generator=g)
    odd = torch.randn(7, generator=g)
    return [big, mat, odd]


def _session(comm) -> list:
    """Every direct-capable call, with weights, scales, kinds and awkward tensors."""
    out = []
    r = comm.rank
    for i in range(3):  # the first settles the direct path, then runs direct
        ts = _inputs(r, i)
        mass = comm.all_reduce_(ts, weight=1.0 + r, scale=0.5 + r)
        out.append(("inplace", [t.clone() for t in ts], mass, comm._engine.direct.state))
    ts = _inputs(r, 7)
    mass = comm.all_reduce_(ts, kind=flodl_shm.RoundKind.CONTROL)
    out.append(("control", [t.clone() for t in ts], mass, None))
    # a transposed (non-contiguous) tensor and a bfloat16 one go through staging copies
    ts = _inputs(r, 8)
    ts[1] = ts[1].t()
    ts.append(torch.randn(N // 2, generator=torch.Generator().manual_seed(r)).bfloat16())
    mass = comm.all_reduce_(ts)
    out.append(("staged", [t.clone() for t in ts], mass, None))
    # a bfloat16 tensor scaled by other than a power of two: ``mul(scale)`` rounds it to
    # bfloat16 once, where the round's float32 scale would not (the direct round scaled
    # its float32 copy: other bits than the shared path's)
    ts = _inputs(r, 31)
    ts[0] = ts[0].bfloat16()
    mass = comm.all_reduce_(ts, weight=1.0 + r, scale=1.5 + r)
    out.append(("staged_scaled", [t.clone() for t in ts], mass, None))
    res, mass = comm.all_reduce_scaled([_inputs(r, 32)[0].bfloat16()], 0.3, weight=2.0)
    out.append(("scaled_bf16", [t.clone() for t in res], mass, None))
    # a tensor listed twice (a tied weight in a state_dict's values) and overlapping views
    # of one buffer: in place, each rank writes its slice while the others still read
    # theirs, so these go through copies too (they used to average what another slice
    # had already written)
    big = _inputs(r, 14)[0]
    flat = torch.randn(N + N // 2, generator=torch.Generator().manual_seed(50 + r))
    mass = comm.all_reduce_([big, big, flat[:N], flat[N // 2:]])
    out.append(("aliased", [big.clone(), flat.clone()], mass, None))
    res, mass = comm.all_reduce_scaled(_inputs(r, 9), 0.25, weight=2.0 + r)
    out.append(("scaled", [t.clone() for t in res], mass, None))
    (res,) = comm.all_reduce_tensors([_inputs(r, 10)[0]])
    out.append(("tensors", [res.clone()], 1.0, None))
    ts = _inputs(r, 12)
    ts[1] = ts[1].t()  # the root's non-contiguous tensor is staged
    # a root in the middle at world 3: readers on both sides of it
    res = comm.broadcast_from_root(ts, root=1)
    out.append(("broadcast", [t.clone() for t in res], 0.0, None))
    ts = _inputs(r, 13)
    ts[1] = ts[1].t()  # staged on every rank, written back on the readers
    comm.broadcast_(ts, root=0)  # in place: the root copies nothing
    out.append(("broadcast_", [t.clone() for t in ts], 0.0, None))
    # one tensor (rank 1's not contiguous): into the root's own result, copied whole by
    # the root (which then delivers a lighter slice) or, past cma.ROOT_WHOLE_MAX, in
    # equal slices, and in place
    for name, i, n, root in ONE_BROADCASTS + (SLICED_BROADCAST,):
        if name.endswith("_"):
            t = _one(r, i, n)
            comm.broadcast_([t], root=root % comm.world_size)
        else:
            (t,) = comm.broadcast_from_root([_one(r, i, n)], root=root % comm.world_size)
        out.append((name, [t.clone()], 0.0, None))
    # a frame whose payloads carry w * T, one of them read-only (bytes: copied)
    big, mat, odd = _inputs(r, 15)
    w = 1.0 + r
    frame = flodl_shm.RoundFrame(
        [flodl_shm.TensorPayload(0, (N,), (big * w).numpy()),
         flodl_shm.TensorPayload(0, (300, 40), bytes((mat * w).numpy().data)),
         flodl_shm.TensorPayload(0, (7,), (odd * w).numpy())], w, flodl_shm.RoundKind.MODEL)
    reply = comm.all_reduce(frame)
    out.append(("frame", [torch.from_numpy(np.frombuffer(p.data, np.float32).copy())
                          for p in reply.tensors], reply.weight, None))
    # a window in which nobody realized work: the in-place call keeps local tensors
    ts = _inputs(r, 11)
    mass = comm.all_reduce_(ts, weight=0.0)
    out.append(("empty", [t.clone() for t in ts], mass, None))
    return out


def _one(rank: int, i: int, n: int) -> torch.Tensor:
    """``n`` random float32s with a signaling NaN (its payload must arrive as it is);
    rank 1's are a strided view (not contiguous)."""
    v = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + i))
    v.view(torch.int32)[5] = 0x7F800001
    return v.repeat_interleave(2)[::2] if rank == 1 else v


#: (step name, seed, elements, root; -1: the last rank): into a result, then in place
ONE_BROADCASTS = (("one16", 16, 20_000, 1), ("one16_", 26, 20_000, -1),
                  ("one17", 17, 100_000, -1), ("one17_", 27, 100_000, 1))
#: a result too large for its root to copy whole: every rank delivers an equal slice
SLICED_BROADCAST = ("one18", 18, cma.ROOT_WHOLE_MAX + 1000, -1)


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy())


def _run(world: int, direct: bool) -> list:
    with FakeCohort(world, direct=direct, eager_bytes=EAGER) as cohort:
        return cohort.run(_session)


@pytest.mark.parametrize("world", [2, 3])
def test_direct_rounds_match_the_shared_path_bit_for_bit(low_threshold, world):
    shared = _run(world, direct=False)
    direct = _run(world, direct=True)
    assert [step[3] for step in shared[0][:3]] == ["unavailable"] * 3
    assert [step[3] for step in direct[0][:3]] == ["ready"] * 3  # settled by the first
    for rank in range(world):
        for a, b in zip(shared[rank], direct[rank]):
            assert a[0] == b[0] and a[2] == b[2], (a[0], a[2], b[2])
            for x, y in zip(a[1], b[1]):
                assert x.dtype == y.dtype and x.shape == y.shape
                assert _bits(x) == _bits(y), (a[0], rank)
    for step in range(len(direct[0])):  # every rank holds the same consensus
        for rank in range(1, world):
            for x, y in zip(direct[0][step][1], direct[rank][step][1]):
                if direct[0][step][0] != "empty":
                    assert _bits(x) == _bits(y)
    for name, root_rank, i in (("broadcast", 1, 12), ("broadcast_", 0, 13)):
        root = _inputs(root_rank, i)
        for rank in range(world):
            got = next(step for step in direct[rank] if step[0] == name)[1]
            assert [_bits(t) for t in got] == [_bits(root[0]), _bits(root[1].t()),
                                               _bits(root[2])], (name, rank)
    for name, i, n, root_rank in ONE_BROADCASTS + (SLICED_BROADCAST,):
        want = _bits(_one(root_rank % world, i, n))
        for rank in range(world):
            got = next(step for step in direct[rank] if step[0] == name)[1]
            assert _bits(got[0]) == want, (name, rank)
    # nothing realized: every rank kept its own tensors
    for rank in range(world):
        empty = direct[rank][-1]
        assert empty[0] == "empty" and empty[2] == 0.0
        assert torch.equal(empty[1][0], _inputs(rank, 11)[0])


def _one_broadcasts(comm) -> list:
    """One-tensor broadcasts that fit the eager slots (1 MiB here): one compiled direct
    call on the ranks whose tensor is contiguous float32 (every rank but 1)."""
    out = []
    r = comm.rank
    for name, i, n, root in ONE_BROADCASTS:
        if name.endswith("_"):
            t = _one(r, i, n)
            comm.broadcast_([t], root=root % comm.world_size)
            out.append(t.clone())
        else:
            out.append(comm.broadcast_from_root([_one(r, i, n)],
                                                root=root % comm.world_size)[0].clone())
    out.append(comm._engine.direct.state)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_one_tensor_direct_broadcasts_in_one_call_match_the_eager_path(low_threshold, world):
    """From 32 KiB a broadcast is direct, eager-sized or not; a one-tensor one runs as
    one compiled call. Bit for bit what the eager slot delivers: every rank holds the
    root's bits (a signaling NaN's payload included), whether the root copies its own
    result whole (20,000 elements) or delivers a slice of it (100,000), and a rank
    whose tensor is not contiguous joins the same round through the general path."""
    got = {}
    for direct in (False, True):
        with FakeCohort(world, direct=direct, eager_bytes=1 << 20) as cohort:
            got[direct] = cohort.run(_one_broadcasts)
    assert [rank[-1] for rank in got[True]] == ["ready"] * world
    assert [rank[-1] for rank in got[False]] == ["unavailable"] * world
    for k, (name, i, n, root) in enumerate(ONE_BROADCASTS):
        want = _bits(_one(root % world, i, n))
        for rank in range(world):
            assert _bits(got[False][rank][k]) == want, (name, rank)
            assert _bits(got[True][rank][k]) == want, (name, rank)


def test_a_one_call_direct_broadcast_with_a_late_rank_finishes_the_blocking_way(
        low_threshold):
    """The root, then a reader, arrives 50 ms late: the other rank's compiled call runs
    out of spin and sleeps on the doorbell, and the late one finds sleepers when it
    publishes (WAKE). Each finishes the round the blocking way and delivers its slice:
    every rank holds the root's bits, into a result and in place."""
    def body(comm):
        out = []
        for i in range(4):
            late = i % 2  # rank 0 (the root) late, then rank 1
            if comm.rank == late:
                time.sleep(0.05)
            src = _one(comm.rank, 40 + i, 20_000).contiguous()  # (one call on both)
            if i < 2:
                out.append(_bits(comm.broadcast_from_root([src], root=0)[0]))
            else:
                comm.broadcast_([src], root=0)
                out.append(_bits(src))
        return out, comm._engine.waiter.sleeps

    with FakeCohort(2, direct=True, eager_bytes=1 << 20) as cohort:
        got = cohort.run(body)
    for rank in range(2):
        assert got[rank][0] == [_bits(_one(0, 40 + i, 20_000)) for i in range(4)]
    assert sum(sleeps for _, sleeps in got) >= 4  # (the waits did sleep)


def _one_reduces(comm) -> list:
    """One-tensor direct reduces (one compiled call each) down their slow paths: weight 0
    on every rank (in place: the tensor stays), a tensor in the shared parameter block
    (PEERS_MAPPED: the slice is reduced through this process's mappings), then a rank
    50 ms late (the other's call sleeps, the late one finds sleepers: WAKE), into a
    result and in place; with the counts of sleeps and mapped rounds."""
    r, out = comm.rank, []
    for i in range(2):
        t = torch.randn(N, generator=torch.Generator().manual_seed(50 + r + i))
        kept = t.clone()
        comm.barrier()
        out.append(torch.tensor([comm.all_reduce_([t], weight=0.0)]))
        assert torch.equal(t, kept)
    if comm._engine.direct.state == "ready":
        (t,) = comm.shared_tensors([torch.randn(N, generator=torch.Generator().manual_seed(
            60 + r))])
    else:
        t = torch.randn(N, generator=torch.Generator().manual_seed(60 + r))
    for i in range(2):
        comm.barrier()
        comm.all_reduce_([t], weight=2.0 + r)
        out.append(t.clone())
    for i in range(4):
        if r == i % 2:
            time.sleep(0.05)
        t = torch.randn(N, generator=torch.Generator().manual_seed(10 * r + i)) * (r + 1)
        if i < 2:
            out.append(comm.all_reduce_tensors([t])[0])
        else:
            comm.all_reduce_([t], weight=1.0 + r, scale=0.5 + r)
            out.append(t)
    return out, comm._engine.waiter.sleeps, comm._engine.direct.mapped_rounds


def test_one_tensor_direct_reduces_in_one_call_finish_their_slow_paths(low_threshold):
    got = {}
    for direct in (False, True):
        with FakeCohort(2, direct=direct, eager_bytes=EAGER) as cohort:
            got[direct] = cohort.run(_one_reduces)
    for rank in range(2):
        assert [_bits(t) for t in got[True][rank][0]] == \
            [_bits(t) for t in got[False][rank][0]], rank
    assert sum(sleeps for _, sleeps, _ in got[True]) >= 2  # (the waits did sleep)
    assert [mapped for _, _, mapped in got[True]] == [2, 2]


def _many(rank: int, i: int) -> list[torch.Tensor]:
    """310 tensors of 1-999 elements, one of 70,000 among them (~560 KB), and an empty one
    (its address is 0): a slice's chunks gather more pieces than one cross-memory call
    takes (``MAX_PIECES``), and the big one straddles chunks."""
    g = torch.Generator().manual_seed(1000 * rank + i)
    sizes = [1 + (37 * k) % 999 for k in range(310)]
    sizes[150] = N
    sizes[7] = 0
    return [torch.randn(n, generator=g) * (rank + 1) for n in sizes]


#: mapped rounds of ``_many_tensors``: the first maps the peers' blocks through the Python
#: steps, and the test needs one of the others to find every rank in time for the compiled
#: call (a peer late past the spin sends a round to the Python steps): seven chances, with
#: the test's longer spin (on a loaded machine two chances and the default spin failed 3
#: runs of 5, and so did eight without the longer spin)
MAPPED_ROUNDS = 8


def _many_tensors(comm) -> list:
    """Reduces of many small tensors, in place, into results and in the shared block
    (mapped), with the count of mapped rounds and of those the compiled call reduced;
    broadcasts of them, in place and into results."""
    direct, r, out = comm._engine.direct, comm.rank, []
    for i in range(2):
        ts = _many(r, i)
        mass = comm.all_reduce_(ts, weight=1.0 + r, scale=0.5 + r)
        out.append(("inplace", [t.clone() for t in ts], mass))
        res, mass = comm.all_reduce_weighted(_many(r, 10 + i), weight=2.0 + r)
        out.append(("weighted", res, mass))
        ts = _many(r, 30 + i)
        comm.broadcast_(ts, root=1)
        out.append(("broadcast_", [t.clone() for t in ts], 0.0))
        out.append(("broadcast", comm.broadcast_from_root(_many(r, 40 + i), root=0), 0.0))
    placed = (comm.shared_tensors([torch.zeros(t.shape) for t in _many(r, 0)])
              if direct.state == "ready" else [torch.zeros(t.shape) for t in _many(r, 0)])
    for i in range(MAPPED_ROUNDS):
        with torch.no_grad():
            for t, v in zip(placed, _many(r, 20 + i)):
                t.copy_(v)
        comm.barrier()  # (a late peer sends the call's round to the Python steps)
        mass = comm.all_reduce_(placed, weight=1.0 + r)
        out.append(("mapped", [t.clone() for t in placed], mass))
    return out, direct.mapped_rounds, direct.mapped_rounds - direct._mapped_here


@pytest.mark.parametrize("world", [2, 3])
def test_reduces_of_many_tensors_run_in_one_call_with_the_shared_path_s_bits(
        low_threshold, world, monkeypatch):
    """A direct reduce of several tensors is one compiled call too, mapped shared blocks
    included (the first mapped round maps them, through the Python steps; the compiled
    call reduces the next ones through the same mappings), and a chunk of many small
    tensors moves in one cross-memory call per peer, a broadcast's too: the results are
    the shared path's, bit for bit."""
    # a rank waits up to 50 ms in the compiled call for a peer a loaded machine
    # descheduled (a CFS turn or several), instead of 200 us
    monkeypatch.setenv("FLODL_SHM_SPIN_US", "50000")
    got = {}
    for direct in (False, True):
        with FakeCohort(world, direct=direct, eager_bytes=EAGER) as cohort:
            got[direct] = cohort.run(_many_tensors)
    for rank in range(world):
        for a, b in zip(got[False][rank][0], got[True][rank][0]):
            assert a[0] == b[0] and a[2] == b[2], (a[0], a[2], b[2])
            assert [_bits(x) for x in a[1]] == [_bits(y) for y in b[1]], (a[0], rank)
    assert [mapped for _, mapped, _ in got[True]] == [MAPPED_ROUNDS] * world
    if world == 2:  # (3 ranks on this machine's 2 cores: a rank is often late, every round)
        assert sum(compiled for _, _, compiled in got[True]) >= 1


def test_a_bfloat16_nan_is_written_back_with_the_shared_path_s_bits(low_threshold):
    """A probe: +inf on one rank and -inf on the other sum to a NaN, which the direct
    round wrote back into a bfloat16 tensor through torch's copy_ (0xFFFF) where the
    shared path writes its codec's NaN (0xFFC0); a transposed one too."""
    def body(comm):
        out = []
        for shape in ((N,), (350, 200)):
            t = torch.full(shape, 0.5 + comm.rank).bfloat16()
            t.view(-1)[3] = float("inf") if comm.rank == 0 else -float("inf")
            t = t if len(shape) == 1 else t.t()
            comm.all_reduce_([t], weight=1.0)
            out.append(t.contiguous().view(torch.int16).clone())
        return out

    got = {}
    for direct in (False, True):
        with FakeCohort(2, direct=direct, eager_bytes=EAGER) as cohort:
            got[direct] = cohort.run(body)
    for rank in range(2):
        for shared, direct in zip(got[False][rank], got[True][rank]):
            assert torch.equal(shared, direct), rank


def test_the_arena_owner_sets_every_rank_s_broadcast_threshold(monkeypatch):
    """Direct from 32 KiB where each rank has a core, from 1 MiB where ranks outnumber
    cores (the direct round's second wait costs a scheduling turn there), or what the
    environment says; decided once by the arena's owner, so every rank agrees."""
    from flodl_shm.engine import hostcpu

    var = "FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES"
    monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hostcpu, "available_cores", lambda root="/": 2)
    assert A.direct_broadcast_min_bytes(2) == 32 << 10
    assert A.direct_broadcast_min_bytes(3) == 1 << 20
    monkeypatch.setenv(var, "4096")
    assert A.direct_broadcast_min_bytes(3) == 4096
    monkeypatch.setenv(var, "64k")
    with pytest.raises(ValueError, match=f"{var}='64k' is not a whole number of bytes"):
        A.direct_broadcast_min_bytes(2)
    monkeypatch.setenv(var, "12345")
    with FakeCohort(2, direct=True) as cohort:
        assert cohort.run(lambda comm: comm._engine.direct.broadcast_min_bytes) == [12345] * 2


def test_the_arena_owner_sets_every_rank_s_reduce_threshold(monkeypatch):
    """256 KiB, or ``FLODL_SHM_DIRECT_MIN_BYTES`` as the arena's owner read it at
    creation: a rank that reads another value later still uses the owner's."""
    var = "FLODL_SHM_DIRECT_MIN_BYTES"
    monkeypatch.delenv(var, raising=False)
    assert A.direct_min_bytes() == A.DIRECT_MIN_BYTES == 256 << 10
    monkeypatch.setenv(var, "4 MiB")
    with pytest.raises(ValueError, match=f"{var}='4 MiB' is not a whole number of bytes"):
        A.direct_min_bytes()
    # refused before the arena makes a segment (its segments were left in /dev/shm)
    from engine_util import our_segments

    before = set(our_segments())
    for bad, words in (("4 MiB", "is not a whole number"), (str(1 << 70), "is out of range")):
        for name in (var, "FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES"):
            monkeypatch.setenv(var, "1024")
            monkeypatch.setenv(name, bad)
            with pytest.raises(ValueError, match=f"{name}='{bad}' {words}"):
                A.Arena.create(2)
    monkeypatch.delenv("FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES")
    assert set(our_segments()) == before
    monkeypatch.setenv(var, str(2 << 20))
    with FakeCohort(2, direct=True) as cohort:
        monkeypatch.setenv(var, "64")  # the ranks' Comms are made after this
        assert cohort.run(lambda comm: comm.direct_min_bytes) == [2 << 20] * 2


def test_rounds_below_the_threshold_and_outer_rounds_stay_shared(low_threshold):
    """Neither a small round nor an outer round (the outer step runs in the shared
    slice reduce) settles the direct path; the first large plain round does. The outer round still
    steps: its result differs from the plain average."""
    def body(comm):
        comm.all_reduce_([torch.ones(1000)])  # 4 KB: eager
        state_small = comm._engine.direct.state
        comm.set_outer(flodl_shm.OuterNesterov(lr=0.7, momentum=0.9))
        prev = torch.full((N,), 2.0)
        comm.load_outer_state(prev=[prev])
        t = torch.full((N,), float(comm.rank))  # consensus 0.5, stepped from prev 2.0
        comm.all_reduce_([t], outer=True)
        state_outer = comm._engine.direct.state
        comm.all_reduce_([torch.ones(N)])      # settles, then runs direct
        return state_small, state_outer, comm._engine.direct.state, float(t[0])

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        res = cohort.run(body)
    assert [r[:3] for r in res] == [("unprobed", "unprobed", "ready")] * 2
    assert res[0][3] == res[1][3] and res[0][3] != 0.5


def test_a_failed_probe_keeps_every_rank_on_the_shared_path(low_threshold):
    """Rank 1's probe word points at unmapped memory: rank 0 cannot reach it, so the
    verdict is 'unavailable' on every rank and later large rounds stay shared (and
    correct)."""
    def body(comm):
        if comm.rank == 1:
            comm.arena.ctl[A.rank_base(1) + A.R_PROBE] = 8  # the zero page: never mapped
        outs = []
        for i in range(3):
            t = torch.full((N,), float(comm.rank + 1) * (i + 1))
            comm.all_reduce_([t])
            outs.append((float(t[0]), float(t[-1]), comm._engine.direct.state))
        return outs

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        res = cohort.run(body)
    assert res[0] == res[1] == [(1.5 * (i + 1), 1.5 * (i + 1), "unavailable") for i in range(3)]


def _count_direct_rounds(comm) -> list:
    """A list that gains an item at each direct round this rank runs from now on
    (``DirectRounds.run`` or ``run_one``, counted on their way through)."""
    direct = comm._engine.direct
    runs: list = []

    def counted(real):
        def call(*args, **kwargs):
            runs.append(1)
            return real(*args, **kwargs)
        return call

    direct.run = counted(direct.run)
    return runs


def _eager_sized(comm) -> list:
    """Every reduce call over ~280 KB that fits the eager slots (1 MiB here), each
    twice (a loop's second call takes the hot paths), with how many direct rounds this
    rank had run after it (``DirectRounds.run`` or ``run_one``, counted on their way
    through)."""
    from flodl_shm.engine.gathered import GatheredTensors

    runs = _count_direct_rounds(comm)
    r, out = comm.rank, []
    gathered = GatheredTensors(_inputs(r, 30))
    for i in range(2):
        ts = _inputs(r, 20 + i)
        one = [ts[0]]
        mass = comm.all_reduce_(one, weight=1.0 + r, scale=0.5 + r)
        out.append(("one", [one[0].clone()], mass, len(runs)))
        mass = comm.all_reduce_(ts, weight=1.0 + r)
        out.append(("several", [t.clone() for t in ts], mass, len(runs)))
        mass = comm.all_reduce_(gathered, weight=2.0 + r, scale=0.25)
        out.append(("gathered", [t.clone() for t in gathered], mass, len(runs)))
        (res,) = comm.all_reduce_tensors([_inputs(r, 22 + i)[0]])
        out.append(("tensors", [res.clone()], 1.0, len(runs)))
        res, mass = comm.all_reduce_weighted(_inputs(r, 24 + i)[:2], weight=3.0 + r)
        out.append(("weighted", [t.clone() for t in res], mass, len(runs)))
        res, mass = comm.all_reduce_scaled(_inputs(r, 26 + i)[:1], 0.75, weight=1.0)
        out.append(("scaled", [t.clone() for t in res], mass, len(runs)))
        bf = [_inputs(r, 32 + i)[0].bfloat16() if r else _inputs(r, 32 + i)[0]]
        mass = comm.all_reduce_(bf, weight=1.0 + r, scale=1.5)  # (its own rounding)
        out.append(("bf16 scaled", [bf[0].clone()], mass, len(runs)))
        data = _inputs(r, 28 + i)[0].numpy() * (1.0 + r)
        reply = comm.all_reduce(flodl_shm.RoundFrame(
            [flodl_shm.TensorPayload(0, (N,), data)], 1.0 + r, flodl_shm.RoundKind.MODEL))
        out.append(("frame", [torch.from_numpy(np.frombuffer(reply.tensors[0].data,
                                                             np.float32).copy())],
                    reply.weight, len(runs)))
    return out


def test_reduces_that_fit_the_eager_slots_run_direct_from_the_threshold(low_threshold):
    """The threshold holds in the eager slots' sizes too (every rank reading every
    contribution costs more there than the direct round's slices: BENCHMARKS.md,
    "Forty-third session"). Each reduce call of ~280 KB, a loop's repeated call
    included, runs direct over 1 MiB eager slots, with the eager path's bits."""
    with FakeCohort(2, direct=False) as cohort:
        eager = cohort.run(_eager_sized)
    with FakeCohort(2, direct=True) as cohort:
        direct = cohort.run(_eager_sized)
    for rank in range(2):
        assert [step[3] for step in eager[rank]] == [0] * 16
        assert [step[3] for step in direct[rank]] == list(range(1, 17))
        for a, b in zip(eager[rank], direct[rank]):
            assert a[0] == b[0] and a[2] == b[2], (a[0], a[2], b[2])
            assert [_bits(x) for x in a[1]] == [_bits(y) for y in b[1]], (a[0], rank)


def test_reduces_of_one_tensor_or_several_run_direct_from_256_kib(monkeypatch):
    """Every direct reduce is one compiled call, which pays from the default threshold,
    256 KiB, for one tensor and for several of the same bytes alike (a round of several
    tensors, its steps in Python, stayed in the eager slots up to twice that)."""
    monkeypatch.delenv("FLODL_SHM_DIRECT_MIN_BYTES", raising=False)

    def body(comm):
        runs = _count_direct_rounds(comm)
        out = []
        for elements in ((64 << 10) - 16, 64 << 10, 75_000, 127_999):  # (256 KiB: 65,536)
            g = torch.Generator().manual_seed(comm.rank * 10 + elements % 7)
            one = [torch.randn(elements, generator=g)]
            comm.all_reduce_(one, weight=1.0 + comm.rank)
            (res,) = comm.all_reduce_tensors([one[0] * 2])
            two = [torch.randn(elements // 2, generator=g) for _ in range(2)]
            comm.all_reduce_(two)
            out.append(([one[0].clone(), res] + two, len(runs)))
        return comm.direct_min_bytes, out

    got = {}
    for direct in (False, True):
        with FakeCohort(2, direct=direct) as cohort:
            got[direct] = cohort.run(body)
    for rank in range(2):
        assert got[True][rank][0] == 256 << 10
        assert [runs for _, runs in got[True][rank][1]] == [0, 3, 6, 9]
        for (a, _), (b, _) in zip(got[False][rank][1], got[True][rank][1]):
            assert [_bits(x) for x in a] == [_bits(y) for y in b], rank


def test_a_failed_probe_gives_the_eager_sized_reduces_back_their_one_call(low_threshold):
    """A plan made while the direct path was unsettled holds its reduces off the fused
    eager call; once the probe fails, the engine's and a window's plans take it again."""
    from flodl_shm.engine.gathered import GatheredTensors

    def body(comm):
        if comm.rank == 1:
            comm.arena.ctl[A.rank_base(1) + A.R_PROBE] = 8  # the zero page: never mapped
        gathered = GatheredTensors([torch.full((N,), float(comm.rank + 1))])
        assert gathered.plan(comm._engine, int(flodl_shm.RoundKind.MODEL), 0) is None
        t = torch.full((N,), float(comm.rank + 1))
        comm.all_reduce_([t])  # settles the path: unavailable
        comm.all_reduce_(gathered)
        plan = comm._engine.plan(int(flodl_shm.RoundKind.MODEL), 0, ((N,),))
        return (comm._engine.direct.state, plan.fused, float(t[0]),
                gathered.plan(comm._engine, int(flodl_shm.RoundKind.MODEL), 0) is not None,
                float(gathered[0][-1]))

    with FakeCohort(2, direct=True) as cohort:
        res = cohort.run(body)
    assert res == [("unavailable", True, 1.5, True, 1.5)] * 2


def test_a_large_frame_round_runs_direct(low_threshold):
    """``all_reduce(frame)`` took the shared path at every size: 1.4x OpenMPI's
    ``Allreduce`` at 4 MiB, where the tensor calls run direct (0.8x). A float32 frame
    runs direct now (its result matches the shared path's bit for bit: the session
    above), settling the path itself, and leaves the bulk and result regions unused."""
    def body(comm):
        w = 1.0 + comm.rank
        frame = flodl_shm.RoundFrame(
            [flodl_shm.TensorPayload(0, (N,), np.full(N, 2.0 * w * (comm.rank + 1), np.float32))],
            w, flodl_shm.RoundKind.MODEL)
        reply = comm.all_reduce(frame)
        comm.barrier()
        grown = [os.stat(f"/dev/shm/{comm.arena.handle.name(what)}").st_size >= 4 * N
                 for what in ("d0", "d1", "res")]
        got = np.frombuffer(reply.tensors[0].data, np.float32)
        return comm._engine.direct.state, grown, reply.weight, float(got[0]), float(got[-1])

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        for state, grown, mass, first, last in cohort.run(body):
            # (1 * 2 + 2 * 4) / 3
            assert (state, grown, mass) == ("ready", [False] * 3, 3.0)
            assert first == last == np.float32(10.0) * np.float32(1 / 3.0)


@pytest.mark.parametrize("early", [True, False], ids=["settled-early", "by-the-round"])
@pytest.mark.parametrize("reachable", [True, False])
def test_settling_leaves_the_shared_regions_unused(low_threshold, reachable, early):
    """``settle_direct_rounds`` reaches the probe's verdict between two barriers, called
    early (as LocalSGD and the c10d backend do) or by the first large round itself (a
    raw ``all_reduce_``, which used to run the shared path to probe), so that round is
    already direct and no round grows the bulk or result regions; a peer that cannot
    be reached makes it 'unavailable' on every rank, and the rounds then take the
    shared path (and grow those regions)."""
    def body(comm):
        if not reachable and comm.rank == 1:
            comm.arena.ctl[A.rank_base(1) + A.R_PROBE] = 8  # the zero page: never mapped
        verdict = comm.settle_direct_rounds() if early else reachable
        t = torch.full((N,), float(comm.rank + 1))
        comm.all_reduce_([t])
        again = comm.settle_direct_rounds()  # settled: a no-op, no barrier
        comm.barrier()
        grown = [os.stat(f"/dev/shm/{comm.arena.handle.name(what)}").st_size >= 4 * N
                 for what in ("d0", "d1", "res")]
        return verdict, again, comm._engine.direct.state, float(t[0]), grown

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        res = cohort.run(body)
    state = "ready" if reachable else "unavailable"
    for verdict, again, got, value, grown in res:
        assert (verdict, again, got, value) == (reachable, reachable, state, 1.5)
    assert [grown for *_, grown in res] == [[not reachable] * 3] * 2


def test_a_second_thread_is_refused_while_the_first_large_round_settles_the_path(
        low_threshold):
    """A probe: rank 0's thread A made the Comm's first large round, which settles the
    direct path between two barriers first; its main thread's round meanwhile was not
    refused (the probe ran outside the one-round-at-a-time check) and slipped a round
    between A's barriers: 'ranks contributed different frame schemas ... CONTROL round
    without tensors', and the Comm broke. It is refused now, and A's round completes."""
    import threading

    refused = threading.Event()

    def round_of(comm, value: float) -> float:
        t = torch.full((N,), value)
        comm.all_reduce_([t])
        return float(t[0])

    def intrude(comm) -> None:
        assert comm._engine.direct.state == D.UNPROBED  # A waits in the probe's barrier
        comm.all_reduce_([torch.full((N,), 5.0)])

    def body(comm):
        if comm.rank == 1:
            assert refused.wait(30)
            return round_of(comm, 2.0)
        a, got = refused_in_flight(comm, lambda: round_of(comm, 1.0), lambda: intrude(comm))
        refused.set()
        a.join(30)
        return got[0]

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        assert cohort.run(body) == [1.5, 1.5]


def test_ranks_that_disagree_on_the_direct_path_get_a_schema_error(low_threshold):
    """A rank whose state says 'ready' meets one still 'unprobed': the agreed flags
    differ, so both raise a SchemaMismatchError naming the paths, before any data
    moves."""
    def body(comm):
        if comm.rank == 0:
            comm._engine.direct.state = D.READY
        try:
            comm.all_reduce_([torch.ones(N)])
        except flodl_shm.SchemaMismatchError as e:
            return str(e)
        return None

    with FakeCohort(2, direct=True, eager_bytes=EAGER) as cohort:
        errs = cohort.run(body)
    assert all(e is not None and "direct path" in e for e in errs), errs


def test_a_first_round_of_another_size_is_told_from_a_barrier(low_threshold):
    """A probe: the rank whose first round is direct-sized settles the direct path with
    two barriers first, which its peer (one element short) met with its reduce; the error
    named only a barrier, which neither rank had called."""
    def body(comm):
        try:
            comm.all_reduce_([torch.ones(65_536 - comm.rank)])  # (256 KiB on rank 0)
        except flodl_shm.SchemaMismatchError as e:
            return str(e)
        return None

    with FakeCohort(2, direct=True) as cohort:
        errs = cohort.run(body)
    assert all(e is not None and "first direct-sized float32 reduce sends two first" in e
               and "rank 1: MODEL round, 1 tensor f32 shapes [65535]" in e for e in errs), errs


# --- real processes ------------------------------------------------------------------------

BIG = (9 << 20) // 4  # f32 elements: 9 MiB, over the default threshold


def rounds(ctx, n_rounds):
    out = []
    for i in range(n_rounds):
        t = torch.full((BIG,), float(ctx.rank + 1) * (i + 1))
        u = torch.arange(1000, dtype=torch.float32) * (ctx.rank + 1)
        mass = ctx.comm.all_reduce_([t, u])
        out.append((float(t[0]), float(t[-1]), float(u[999]), mass))
    (b,) = ctx.comm.broadcast_from_root([torch.full((BIG,), float(ctx.rank + 7))], root=1)
    out.append((float(b[0]), float(b[-1])))
    b = torch.full((BIG,), float(ctx.rank + 20))
    ctx.comm.broadcast_([b], root=0)
    out.append((float(b[0]), float(b[-1])))
    # eager-sized broadcasts of one tensor: each one compiled direct call per rank
    for n in (30_000, 100_000):
        (c,) = ctx.comm.broadcast_from_root([torch.arange(n, dtype=torch.float32)
                                             * (ctx.rank + 1)], root=1)
        d = torch.arange(n, dtype=torch.float32) * (ctx.rank + 3)
        ctx.comm.broadcast_([d], root=0)
        out.append((torch.equal(c, torch.arange(n, dtype=torch.float32) * 2),
                    torch.equal(d, torch.arange(n, dtype=torch.float32) * 3)))
    return out, ctx.comm._engine.direct.state


def test_spawn_runs_large_rounds_direct_across_processes():
    out = spawn(rounds, 2, (3,))
    for res, state in out:
        assert state == "ready"
        assert res[:3] == [(1.5 * (i + 1), 1.5 * (i + 1), 1.5 * 999, 2.0) for i in range(3)]
        assert res[3] == (8.0, 8.0)  # rank 1's tensor, broadcast directly
        assert res[4] == (20.0, 20.0)  # rank 0's, in place
        assert res[5:] == [(True, True)] * 2
    assert_no_leaks()


def test_spawn_with_a_failure_budget_never_goes_direct():
    """With max_failures > 0 survivors must be able to re-reduce a dead rank's slice,
    which needs its contribution in shared memory."""
    out = spawn(rounds, 2, (2,), max_failures=1)
    assert [state for _, state in out] == ["unavailable"] * 2
    assert_no_leaks()


def killed_mid_direct_round(ctx, victim, at):
    if ctx.rank == victim:
        def hook(where, rnd):
            if where == "reduce" and rnd == at:
                os.kill(os.getpid(), signal.SIGKILL)

        ctx.comm.set_fault_hook(hook)
    return rounds(ctx, 4)


@pytest.mark.parametrize("at", [2, 5], ids=["reduce", "broadcast"])
def test_a_rank_killed_inside_a_direct_round_stops_the_cohort_naming_it(at):
    """Rank 1 dies before delivering its slice of a direct reduce (round 2), or of the
    in-place direct broadcast from rank 0 (round 5: rank 1 is a reader that owes the
    other reader its slice)."""
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn(killed_mid_direct_round, 3, (1, at), timeout=30)
    assert info.value.rank == 1 and info.value.signal == "SIGKILL"
    assert time.monotonic() - t0 < 60
    assert_no_leaks()


def gathers(ctx, parts: int, victim: int):
    """``parts`` all-gathers of parts of the direct band, each part's bits distinct per
    rank and round; rank ``victim`` is SIGKILLed before the last (-1: nobody)."""
    n = D.GATHER_PART_MIN // 4 + 16
    got = []
    for i in range(parts):
        if ctx.rank == victim and i == parts - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        part = torch.arange(n, dtype=torch.float32) * (i + 1) + 1000 * ctx.rank
        out = torch.zeros(ctx.world_size * n)
        ctx.comm.all_gather_into_tensor(out, part)
        got.append((out.view(torch.int32).clone(), ctx.comm._engine.direct.state))
    return got


def test_an_all_gather_of_the_direct_band_reads_the_peers_processes():
    """Across processes (not threads): every rank's output holds every part, bit for bit,
    from the first gather (which settles the direct path) on."""
    n = D.GATHER_PART_MIN // 4 + 16
    out = spawn(gathers, 2, (3, -1), timeout=60)
    for i in range(3):
        want = torch.cat([torch.arange(n, dtype=torch.float32) * (i + 1) + 1000 * r
                          for r in range(2)]).view(torch.int32)
        for rank in range(2):
            bits, state = out[rank][i]
            assert state == D.READY and bits.equal(want), (rank, i)
    assert_no_leaks()


def test_a_rank_killed_before_a_direct_all_gather_stops_the_cohort_naming_it():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        spawn(gathers, 2, (2, 1), timeout=30)
    assert info.value.rank == 1 and info.value.signal == "SIGKILL"
    assert time.monotonic() - t0 < 60
    assert_no_leaks()


def hung_in_direct_round(ctx, victim):
    if ctx.rank == victim:
        def hook(where, rnd):
            if where == "reduce" and rnd == 2:
                time.sleep(600)  # "forever"

        ctx.comm.set_fault_hook(hook)
    return rounds(ctx, 4)


def test_a_rank_hung_inside_a_direct_round_is_the_one_blamed():
    """Rank 2 hangs before reducing its slice of a direct round (it had arrived): the
    others' slice wait times out, the supervisor fences rank 2, and spawn raises
    RankStalled naming it, within the timeout plus the supervisor's grace."""
    t0 = time.monotonic()
    with pytest.raises(flodl_shm.RankStalled) as info:
        spawn(hung_in_direct_round, 3, (2,), timeout=2.0)
    err = info.value
    assert err.rank == 2 and err.round == 2 and 2 in err.missing, str(err)
    assert time.monotonic() - t0 < 60
    assert_no_leaks()


@pytest.mark.parametrize("env, want", [("0", 0), ("off", 0), ("1", 1), (None, 1)])
def test_arena_owner_can_turn_direct_rounds_off(monkeypatch, env, want):
    if env is None:
        monkeypatch.delenv("FLODL_SHM_DIRECT", raising=False)
    else:
        monkeypatch.setenv("FLODL_SHM_DIRECT", env)
    arena = A.Arena.create(2, direct=True)
    try:
        assert int(arena.ctl[A.G_DIRECT]) == want
    finally:
        arena.close()
        arena.unlink()
