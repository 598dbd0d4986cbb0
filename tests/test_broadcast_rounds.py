"""``broadcast_from_root`` is a real broadcast on one host (the root publishes its tensors
once, every rank copies them out; no reduce), and the tensor-returning collectives reuse
result memory only once the caller holds nothing of it (``tensor_codec.ResultPool``).

Ranks are threads over a real arena (``FakeCohort``); dead ranks are fenced the way the
supervisor fences them.
"""
from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from flodl_shm import RoundFrame, RoundKind, SchemaMismatchError, TensorPayload
from flodl_shm.errors import PeerDied
from flodl_shm.engine import arena as A
from flodl_shm.frame import DTYPE_F32
from flodl_shm.testing import FakeCohort

from engine_util import our_segments

pytestmark = pytest.mark.timeout(120)

BIG = 1 << 19  # 2 MiB of f32: beyond the default eager slot (the bulk path)
DIRECT_N = 70_000  # 280 KB of f32: a direct round with a lowered threshold and 64 KiB slots


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    yield
    assert our_segments() == [], "a FakeCohort left shared-memory segments behind"


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().reshape(-1).view(torch.int32).numpy().copy()


def _root_tensors(n: int, dtype: torch.dtype, contiguous: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    a = torch.randn(n, generator=g)
    a[:4] = torch.tensor([-0.0, float("inf"), -float("inf"), 1e-40])  # -0, infs, a subnormal
    b = torch.randn(3, 5, generator=g)
    if not contiguous:
        b = torch.randn(5, 3, generator=g).t()  # a transposed view
    return [a.to(dtype), b.to(dtype)]


@pytest.mark.parametrize("size", [64, BIG], ids=["eager", "bulk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("general", [False, True], ids=["fused", "hooked"])
def test_broadcast_is_bit_identical_to_the_root_on_every_path(size, dtype, contiguous, general):
    root = 1
    want = [_bits(t) for t in _root_tensors(size, dtype, contiguous)]

    def body(comm):
        comm.set_bf16_wire(True)  # a broadcast is a CONTROL round: always f32, bit-exact
        if general:
            comm.set_fault_hook(lambda phase, rnd: None)  # the general round
        mine = (_root_tensors(size, dtype, contiguous) if comm.rank == root
                else [torch.full((size,), 3.0, dtype=dtype), torch.zeros(3, 5, dtype=dtype)])
        out = comm.broadcast_from_root(mine, root=root)
        again = comm.broadcast_from_root(mine, root=root)  # the region reused next round
        return [(tuple(t.shape), t.dtype, _bits(t)) for t in out + again]

    with FakeCohort(3) as c:
        for got in c.run(body):
            assert [s for s, _, _ in got] == [(size,), (3, 5)] * 2
            assert all(dt == torch.float32 for _, dt, _ in got)
            for (_, _, bits), ref in zip(got, want * 2):
                assert np.array_equal(bits, ref)


@pytest.mark.parametrize("size", [64, BIG], ids=["eager", "bulk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("general", [False, True], ids=["fused", "hooked"])
def test_in_place_broadcast_gives_every_rank_the_roots_bits(size, dtype, contiguous, general):
    """``broadcast_`` writes the root's values into every reader's own tensors (whatever
    their dtype and layout) and leaves the root's tensors as they are, on every path:
    one compiled call (one tensor), the fused multi-tensor call, the general round."""
    root = 1
    want = [_bits(t) for t in _root_tensors(size, dtype, contiguous)]

    def body(comm):
        if general:
            comm.set_fault_hook(lambda phase, rnd: None)  # the general round
        if comm.rank == root:
            mine = _root_tensors(size, dtype, contiguous)
        else:  # the readers' own tensors: other values, same dtypes and layouts
            mine = [torch.full_like(t, 3.0) for t in _root_tensors(size, dtype, contiguous)]
        ptrs = [t.data_ptr() for t in mine]
        single = [mine[0]]  # one tensor alone: the one-call path when it is f32
        comm.broadcast_(single, root=root)
        comm.broadcast_(mine, root=root)
        comm.broadcast_(mine, root=root)  # the slot or region reused next round
        assert [t.data_ptr() for t in mine] == ptrs  # in place
        assert [t.dtype for t in mine] == [dtype, dtype]
        return [_bits(t) for t in mine]

    with FakeCohort(3) as c:
        for got in c.run(body):
            for bits, ref in zip(got, want):
                assert np.array_equal(bits, ref)


# a signaling NaN, a quiet one with a payload, and negative ones: a reduce times 1.0
# would quiet the first; a broadcast must copy them all as they are
NAN_BITS = np.array([0x7F800001, 0x7FC12345, 0xFFC00001, 0xFF800002], np.uint32)


@pytest.mark.parametrize("size, general", [(64, False), (64, True), (BIG, False), (BIG, True),
                                           (DIRECT_N, False)],
                         ids=["eager-fused", "eager-hooked", "bulk-fused", "bulk-hooked", "direct"])
def test_broadcasts_carry_nan_payloads_bit_for_bit(size, general, monkeypatch):
    """Every path copies the root's bits; the direct one (each rank delivers a slice of
    the frame, ``engine/direct.py``) has NaNs in both ranks' slices."""
    direct = size == DIRECT_N
    if direct:
        monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(256 << 10))

    def tensors(rank: int) -> list[torch.Tensor]:
        if rank != 0:
            return [torch.zeros(size), torch.zeros(6)]
        a = torch.arange(size, dtype=torch.float32)
        a.numpy().view(np.uint32)[:4] = NAN_BITS
        a.numpy().view(np.uint32)[-4:] = NAN_BITS
        b = torch.from_numpy(np.concatenate([NAN_BITS, NAN_BITS[:2]]).view(np.float32))
        return [a, b]

    want = [_bits(t) for t in tensors(0)]

    def body(comm):
        if general:
            comm.set_fault_hook(lambda phase, rnd: None)  # the general round
        if direct:  # (a reduce settles the direct path here; the broadcasts would too)
            comm.all_reduce_([torch.ones(DIRECT_N)])
        got = [comm.broadcast_from_root(tensors(comm.rank)[:1], root=0),
               comm.broadcast_from_root(tensors(comm.rank), root=0)]
        for mine in (tensors(comm.rank)[:1], tensors(comm.rank)):
            comm.broadcast_(mine, root=0)
            got.append(mine)
        return [[_bits(t) for t in ts] for ts in got], comm._engine.direct.state

    with FakeCohort(2, direct=direct, eager_bytes=64 << 10 if direct else None) as c:
        for per_call, state in c.run(body):
            assert state == ("ready" if direct else "unavailable")
            for bits in per_call:
                for b, ref in zip(bits, want):
                    assert np.array_equal(b, ref)


def _payload_of(root: int, rnd: int, n: int) -> torch.Tensor:
    """A payload of its own for each root and round, with NaN payloads, -0.0 and infs."""
    t = torch.arange(n, dtype=torch.float32) * (root + 1) + rnd * 0.25
    t.view(torch.int32)[-4:] = torch.from_numpy(NAN_BITS.view(np.int32))
    t[:3] = torch.tensor([-0.0, float("inf"), -float("inf")])
    return t


@pytest.mark.parametrize("n", [8191, 65_536 + 4099, 250_000], ids=["32K", "272K", "1M"])
def test_large_one_tensor_broadcasts_bring_every_rank_its_root_s_bits(n):
    """A one-tensor broadcast up to the eager slot's size is one compiled call per rank.
    Round after round, the root taking turns (each slot holds an earlier round's payload
    of another root when it is reused), in place and into fresh results, every rank
    gets the root's bits."""
    def body(comm):
        same = []
        for rnd in range(8):
            root = rnd % comm.world_size
            want = _bits(_payload_of(root, rnd, n))
            mine = _payload_of(root, rnd, n) if comm.rank == root else torch.full((n,), -7.0)
            comm.broadcast_([mine], root=root)
            (fresh,) = comm.broadcast_from_root(
                [_payload_of(root, rnd, n) if comm.rank == root else torch.zeros(n)], root=root)
            same.append(np.array_equal(_bits(mine), want) and np.array_equal(_bits(fresh), want))
        return same

    with FakeCohort(3) as c:
        assert c.run(body) == [[True] * 8] * 3


def broadcasts_until_the_root_dies(ctx, n: int):
    """Rank 0 broadcasts ``n`` floats again and again; a thread of its own SIGKILLs it
    0.3 s in, somewhere in a broadcast (often inside its compiled copy-in)."""
    import os
    import signal
    import threading

    if ctx.rank == 0:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    t = torch.full((n,), float(ctx.rank))
    calls = 0
    try:
        while True:
            ctx.comm.broadcast_([t], root=0)
            if float(t[-1]) != 0.0:
                return "wrong", calls
            t.fill_(float(ctx.rank))
            calls += 1
    except RuntimeError as e:
        return "raised", str(e)


def test_a_root_killed_in_a_one_call_broadcast_is_named_never_half_read():
    """A root SIGKILLed mid-broadcast (in the one compiled call of an eager broadcast):
    the readers raise naming it, none returns a half-copied tensor as the broadcast's,
    none hangs."""
    from flodl_shm import spawn

    from engine_util import assert_no_leaks

    out = spawn(broadcasts_until_the_root_dies, 3, (250_000,), max_failures=1, timeout=60)
    assert_no_leaks()
    assert out[0] is None
    for how, said in out[1:]:
        assert how == "raised", (how, said)
        assert "rank 0" in said, said


def test_in_place_broadcast_refuses_what_broadcast_from_root_refuses():
    def body(comm):
        with pytest.raises(ValueError, match="is not a rank of this cohort"):
            comm.broadcast_([torch.zeros(8)], root=-1)
        with pytest.raises(SchemaMismatchError, match="disagree on the broadcast root"):
            comm.broadcast_([torch.zeros(8)], root=comm.rank)  # each its own
        with pytest.raises(SchemaMismatchError, match="disagree on the broadcast root"):
            comm.broadcast_([torch.zeros(8), torch.zeros(2, 3)], root=comm.rank)
        t = torch.full((BIG,), float(comm.rank))
        comm.broadcast_([t], root=1)  # still in step
        return float(t[0]), float(t[-1])

    with FakeCohort(2) as c:
        assert c.run(body) == [(1.0, 1.0)] * 2


def test_bulk_broadcast_reads_the_roots_region_without_a_reduce():
    """Readers publish no payload (their bulk regions stay small) and nobody writes the
    result region: the root's copy-in and each rank's copy-out are the only copies."""
    def body(comm):
        t = torch.full((BIG,), 5.0 if comm.rank == 0 else -1.0)
        (got,) = comm.broadcast_from_root([t], 0)
        return got.tolist() == [5.0] * BIG

    with FakeCohort(3) as c:
        assert c.run(body) == [True] * 3
        caps = [int(c.arena.ctl[A.rank_base(r) + A.R_DATA_CAP]) for r in range(3)]
        result_cap = int(c.arena.ctl[A.G_RESULT_CAP])
    assert caps[0] >= 4 * BIG
    assert caps[1] < 4 * BIG and caps[2] < 4 * BIG, caps
    assert result_cap < 4 * BIG, result_cap


def test_a_dead_root_makes_every_other_rank_raise_naming_it():
    for size in (8, BIG):
        def body(comm, size=size):
            with pytest.raises(PeerDied, match=r"the broadcast's root, rank 2 \(pid \d+\), "
                                               r"died before publishing"):
                comm.broadcast_from_root([torch.zeros(size)], root=2)
            return True

        with FakeCohort(3) as c:
            c.declare_dead(2)
            assert c.run(body, ranks=[0, 1])[:2] == [True, True]


def test_a_dead_reader_does_not_hold_the_root_back():
    def body(comm):
        outs = []
        for size in (8, BIG):
            t = torch.full((size,), float(comm.rank + 1))
            outs.append(float(comm.broadcast_from_root([t], root=0)[0][-1]))
        # and the next bulk reduce (whose slice 2 a survivor takes over) still works
        (avg,) = comm.all_reduce_tensors([torch.full((BIG,), float(comm.rank))])
        return outs, float(avg[0])

    with FakeCohort(3) as c:
        c.declare_dead(2)
        out = c.run(body, ranks=[0, 1])
    assert out[0] == out[1] == ([1.0, 1.0], 0.5)


@pytest.mark.parametrize("size", [8, BIG], ids=["eager", "bulk"])
def test_ranks_disagreeing_on_the_root_raise_and_stay_in_step(size):
    def body(comm):
        with pytest.raises(SchemaMismatchError, match="disagree on the broadcast root"):
            comm.broadcast_from_root([torch.zeros(size)], root=comm.rank)  # each its own
        # a broadcast never validates against a reduce of the same schema
        with pytest.raises(SchemaMismatchError):
            if comm.rank == 0:
                comm.broadcast_from_root([torch.zeros(size)], root=0)
            else:
                comm.all_reduce_weighted([torch.zeros(size)], RoundKind.CONTROL, 0.0)
        return comm.broadcast_from_root([torch.full((size,), float(comm.rank))], root=1)

    with FakeCohort(2) as c:
        for (t,) in c.run(body):
            assert float(t[0]) == float(t[-1]) == 1.0


# --- result memory: reused only once the caller holds nothing of it ---------------------

KEEPERS = {
    "tensor": lambda res: res,
    "slice": lambda res: [res[0][1:3]],
    "view": lambda res: [res[0].view(2, -1)],
    "reshape": lambda res: [res[0].reshape(-1, 2)],
    "numpy": lambda res: [res[0].numpy()],
    "storage": lambda res: [res[0].untyped_storage()],
    "detach": lambda res: [res[0].detach()],
    "data": lambda res: [res[0].data],
    "autograd": lambda res: [_SavedForBackward(res[0])],
}


class _SavedForBackward:
    """Holds a result only through autograd: ``t * w`` saves ``t`` for ``w``'s grad."""

    def __init__(self, t: torch.Tensor) -> None:
        self.n = t.numel()
        self.w = torch.ones((), requires_grad=True)
        self.y = (t * self.w).sum()

    def values(self) -> np.ndarray:
        self.y.backward()  # w.grad = the sum of the saved t
        return np.full(self.n, float(self.w.grad) / self.n, np.float32)


def _values(kept) -> np.ndarray:
    """The float32 values a keeper holds (a tensor, a numpy array or a storage)."""
    obj = kept[0]
    if isinstance(obj, _SavedForBackward):
        return obj.values()
    if isinstance(obj, torch.UntypedStorage):
        return torch.tensor([], dtype=torch.float32).set_(obj).numpy().copy()
    if isinstance(obj, torch.Tensor):
        return obj.reshape(-1).numpy().copy()
    return np.asarray(obj).reshape(-1).copy()


@pytest.mark.parametrize("api", ["tensors", "scaled", "broadcast", "frame"])
@pytest.mark.parametrize("n", [1 << 16, BIG], ids=["eager", "bulk"])
def test_dropped_results_are_reused_kept_ones_never_overwritten(api, n):
    def call(comm, v):
        t = torch.full((n,), v)
        if api == "tensors":
            return comm.all_reduce_tensors([t])
        if api == "scaled":
            return comm.all_reduce_scaled([t], 1.0)[0]
        if api == "broadcast":
            return comm.broadcast_from_root([t], 0)
        f = comm.all_reduce(RoundFrame([TensorPayload(DTYPE_F32, (n,), t.numpy())], 1.0))
        return [torch.from_numpy(f.tensors[0].as_array())]  # holds the frame's memory

    want = 11.0 if api == "broadcast" else 11.5  # ranks send 11 and 12

    def body(comm):
        pool = comm._codec.results
        call(comm, 0.0)  # warm: the pool has a buffer of this size
        kept = {name: keep(call(comm, 11.0 + comm.rank)) for name, keep in KEEPERS.items()}
        for _ in range(6):  # later rounds with other values, their results dropped at once
            call(comm, -7.0)
        intact = {name: bool(np.all(_values(k) == want)) for name, k in kept.items()}
        del kept
        before = pool.allocations
        for _ in range(8):  # nothing kept any more: the pool's buffers come back
            call(comm, -7.0)
        return intact, pool.allocations - before

    with FakeCohort(2) as c:
        for intact, fresh in c.run(body):
            assert all(intact.values()), intact
            assert fresh == 0  # dropped results were reused: no new allocation


def test_pool_is_bounded_and_reuses_only_unreferenced_buffers():
    from flodl_shm.engine.tensor_codec import ResultPool

    pool = ResultPool(per_key=2, max_keys=2, min_bytes=0)
    a = pool.take(16, np.float32)
    b = pool.take(16, np.float32)
    assert a is not b
    c = pool.take(16, np.float32)  # both held: a fresh one, not kept
    assert c is not a and c is not b and pool.allocations == 3
    view = a[3:5]
    del a
    assert pool.take(16, np.float32) is not view.base  # the view keeps it referenced
    del view, c
    got = pool.take(16, np.float32)
    assert pool.allocations == 4  # a was free again: reused, no allocation
    del got, b
    pool.take(8, np.float32)
    pool.take(4, np.float32)  # a third key evicts the least recently used (16)
    assert (16, np.float32) not in pool._buckets and len(pool._buckets) == 2
    small = ResultPool()  # default: buffers under POOL_MIN_BYTES are plain allocations
    small.take(8, np.float32)
    assert small.allocations == 0 and not small._buckets


def _vma_flags(addr: int) -> list[str]:
    """The VmFlags of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_large_pooled_results_get_mappings_of_their_own_on_huge_pages():
    """A large result buffer is its own private mapping advised onto huge pages (a
    direct round's cross-memory copies into a malloc'd numpy array measured 2-3x
    slower); a small one is an ordinary allocation. Both start zeroed or are fully
    overwritten, and are writable."""
    from flodl_shm.engine.tensor_codec import ResultPool, fresh_array

    big = ResultPool().take(1 << 20, np.float32)  # 4 MiB
    assert big.flags.writeable and big.shape == (1 << 20,) and big.dtype == np.float32
    flags = _vma_flags(big.ctypes.data)
    assert "hg" in flags, flags
    assert isinstance(big.base.obj, mmap.mmap)  # a mapping of its own, not a malloc'd chunk
    small = fresh_array(1000, np.uint16)
    assert small.shape == (1000,) and not small.any() and small.flags.writeable


def test_broadcasts_alone_settle_direct_rounds_and_every_rank_writes_the_root_s_result(
        monkeypatch):
    """A program whose only large collectives are broadcasts ran them through shared
    memory for good: only a reduce settled the direct path (at 4 MiB a broadcast took
    2.6x as long). They settle it too now. In a direct ``broadcast_from_root`` every rank
    writes its slice of the root's result, as of every reader's (the root copied its
    whole result alone, after the round: 1.4x ``Bcast`` at 4 MiB)."""
    monkeypatch.setenv("FLODL_SHM_DIRECT_MIN_BYTES", str(256 << 10))
    # (3 ranks outnumber this machine's cores: the owner would write 1 MiB)
    monkeypatch.setenv("FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES", str(256 << 10))
    root = 1

    def tensors(rank: int, rnd: int) -> list[torch.Tensor]:
        if rank != root:
            return [torch.full((DIRECT_N,), -1.0), torch.full((3, 7), -1.0)]
        return [_payload_of(root, rnd, DIRECT_N), _payload_of(root, rnd + 1, 21).view(3, 7)]

    def body(comm):
        got = []
        for rnd in range(3):
            mine = tensors(comm.rank, rnd)
            res = comm.broadcast_from_root(mine, root=root)
            assert all(r.data_ptr() != t.data_ptr() for r, t in zip(res, mine))
            comm.broadcast_(mine, root=root)
            got.append([_bits(t) for t in res + mine])
        return got, comm._engine.direct.state

    with FakeCohort(3, direct=True, eager_bytes=64 << 10) as c:
        for got, state in c.run(body):
            assert state == "ready"
            for rnd, bits in enumerate(got):
                want = [_bits(t) for t in tensors(root, rnd)] * 2
                for b, ref in zip(bits, want):
                    assert np.array_equal(b, ref)
