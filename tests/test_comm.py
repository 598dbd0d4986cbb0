"""Collectives on one host through a real arena, ranks as threads (FakeCohort).

Ports of the seed's CpuReduceClient tests to the single-host engine, plus the
engine's own invariants: weighted realized-work semantics, a fixed f32 reduction
order identical on every rank, both reduce paths (eager and bulk), schema
mismatches raised on every rank, deadlines, dead ranks, zero-copy lifetimes.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

from flodl_shm import FrameError, ReduceStall, RoundFrame, RoundKind, SchemaMismatchError
from flodl_shm.errors import CohortAborted
from flodl_shm.frame import DTYPE_BF16, DTYPE_F32, TensorPayload
from flodl_shm.testing import FakeCohort

from engine_util import our_segments, refused_in_flight

pytestmark = pytest.mark.timeout(120)

SMALL = 1 << 10    # an eager round
BIG = 1 << 18      # 1 MiB of f32: a bulk round (reduce-scatter / all-gather)


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    yield
    assert our_segments() == [], "a FakeCohort left shared-memory segments behind"


def frame_with(values, weight=1.0) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, (len(values),), np.asarray(values, np.float32))],
                      weight)


# --- seed ports ------------------------------------------------------------------------

def test_two_rank_frame_average():
    with FakeCohort(2) as c:
        r0, r1 = c.run(lambda comm: comm.all_reduce(
            frame_with([2.0, 4.0, 6.0] if comm.rank == 0 else [4.0, 8.0, 12.0])))
    assert list(r0.tensors[0].as_array()) == [3.0, 6.0, 9.0]
    assert r0 == r1
    assert r0.weight == 2.0 and r0.kind == RoundKind.MODEL


def test_multi_round_persistence():
    rounds = {0: [1.0, 5.0, 9.0], 1: [3.0, 7.0, 11.0]}
    with FakeCohort(2) as c:
        out = c.run(lambda comm: [float(comm.all_reduce(frame_with([v])).tensors[0].as_array()[0])
                                  for v in rounds[comm.rank]])
    assert out == [[2.0, 6.0, 10.0], [2.0, 6.0, 10.0]]


@pytest.mark.parametrize("bf16", [False, True])
def test_two_rank_tensor_average(bf16):
    def body(comm):
        comm.set_bf16_wire(bf16)
        t = torch.tensor([2.0, 4.0, 6.0]) * (comm.rank + 1)
        return comm.all_reduce_tensors([t])

    with FakeCohort(2) as c:
        r0, r1 = c.run(body)
    for r in (r0, r1):
        assert r[0].dtype == torch.float32
        assert r[0].tolist() == [3.0, 6.0, 9.0]


def test_scaled_weighted_average_bf16_wire():
    # (3·[2,8] + 1·[4,16]) / 4 = [2.5, 10.0], every intermediate bf16-exact
    def body(comm):
        comm.set_bf16_wire(True)
        vals, w = ([2.0, 8.0], 3.0) if comm.rank == 0 else ([4.0, 16.0], 1.0)
        return comm.all_reduce_scaled([torch.tensor(vals)], w, RoundKind.MODEL, w)

    with FakeCohort(2) as c:
        for tensors, mass in c.run(body):
            assert mass == 4.0
            assert tensors[0].tolist() == [2.5, 10.0]


def test_three_rank_broadcast_from_root():
    vals = {0: [1.5, 2.5, 3.5], 1: [10.0, 20.0, 30.0], 2: [100.0, 200.0, 300.0]}
    with FakeCohort(3) as c:
        out = c.run(lambda comm: comm.broadcast_from_root([torch.tensor(vals[comm.rank])], 0))
    for r in out:
        assert len(r) == 1 and r[0].tolist() == vals[0]


def test_broadcast_multi_tensor_distinct_shapes():
    root_w = torch.arange(1.0, 7.0).reshape(2, 3)
    root_b = torch.tensor([-1.0, -2.0, -3.0, -4.0])

    def body(comm):
        if comm.rank == 0:
            return comm.broadcast_from_root([root_w, root_b], 0)
        return comm.broadcast_from_root([torch.full((2, 3), 9.0), torch.full((4,), 9.0)], 0)

    with FakeCohort(2) as c:
        for r in c.run(body):
            assert [tuple(t.shape) for t in r] == [(2, 3), (4,)]
            assert torch.equal(r[0], root_w) and torch.equal(r[1], root_b)


def test_broadcast_keeps_negative_zero_and_rejects_bad_root():
    def body(comm):
        out = comm.broadcast_from_root([torch.tensor([-0.0, 1.0]) * (comm.rank + 1)], 0)
        with pytest.raises(ValueError, match=r"broadcast root 7 is not a rank of this cohort "
                                             r"\(an int from 0 to 1\)"):
            comm.broadcast_from_root([torch.zeros(2)], 7)
        for root in (1.5, "1", True):  # int() of these named rank 1: a broadcast from it
            with pytest.raises(ValueError, match=rf"broadcast root {root!r} is not a rank"):
                comm.broadcast_from_root([torch.zeros(2)], root)
        assert comm.broadcast_from_root([torch.zeros(2) + comm.rank], np.int64(1))[0][0] == 1
        return out

    with FakeCohort(2) as c:
        for r in c.run(body):
            assert torch.signbit(r[0][0]) and r[0][1] == 1.0


def test_a_broadcast_of_another_dtype_is_refused_with_its_byte_exact_fix():
    """A broadcast averages nothing: its refusal of a float64 tensor said 'only Float32 /
    BFloat16 tensors can be averaged; cast it with .float()', which rounds. The fix it
    names now, a float32 view of the bytes, carries any dtype exactly (NaN payloads too)."""
    src = torch.tensor([1.0 / 3.0, -0.0, float("nan"), 2.0 ** -1074], dtype=torch.float64)
    src.view(torch.int64)[2] = 0x7FF8_0000_DEAD_BEEF  # a NaN with a payload

    def body(comm):
        t = src.clone() if comm.rank == 0 else torch.zeros(4, dtype=torch.float64)
        for call in (lambda: comm.broadcast_([t], 0),
                     lambda: comm.broadcast_from_root([t], 0)):
            with pytest.raises(FrameError, match=r"tensor\[0\] dtype Float64 \(torch.float64\) "
                               r"not supported: a broadcast carries Float32 / BFloat16 tensors"
                               r".*t\.view\(torch\.float32\)"):
                call()
        comm.broadcast_([t.view(torch.float32)], 0)
        got = comm.broadcast_from_root([src.view(torch.float32) if comm.rank == 0
                                        else torch.zeros(8)], 0)[0]
        return t.view(torch.int64).tolist(), got.view(torch.int64).tolist()

    with FakeCohort(2) as c:
        for in_place, returned in c.run(body):
            assert in_place == returned == src.view(torch.int64).tolist()


@pytest.mark.parametrize("bf16_wire", [False, True])
def test_returned_results_are_float32_and_round_to_what_in_place_writes(bf16_wire):
    """The tensor-returning calls give the f32 consensus for bfloat16 inputs (the README
    says so: a user saw float32 come back for bfloat16 in); rounded to bfloat16 it is,
    bit for bit, what ``all_reduce_`` writes into the same bfloat16 tensors."""
    gen = torch.Generator().manual_seed(5)
    data = [torch.randn(3, 1000, generator=gen).to(torch.bfloat16) for _ in range(3)]

    def body(comm):
        comm.set_bf16_wire(bf16_wire)
        mine = [data[comm.rank][i].clone() for i in range(3)]
        mean = comm.all_reduce_tensors([t.clone() for t in mine])
        weighted, _ = comm.all_reduce_weighted([t.clone() for t in mine])
        comm.all_reduce_(mine)
        return mean, weighted, mine

    with FakeCohort(3) as c:
        for mean, weighted, in_place in c.run(body):
            assert [t.dtype for t in mean + weighted] == [torch.float32] * 6
            assert [t.dtype for t in in_place] == [torch.bfloat16] * 3
            for m, w, t in zip(mean, weighted, in_place):
                assert torch.equal(m, w)
                assert torch.equal(m.to(torch.bfloat16).view(torch.int16), t.view(torch.int16))


def test_fake_cohort_validates_locally():
    with pytest.raises(ValueError, match="world_size"):
        FakeCohort(0)
    with FakeCohort(3) as c:
        with pytest.raises(ValueError, match="rank_id 5 must be < world_size 3"):
            c.comm(5)


# --- realized-work semantics --------------------------------------------------------------

@pytest.mark.parametrize("n", [SMALL, BIG])
@pytest.mark.parametrize("bf16", [False, True])
def test_weighted_consensus_matches_rank_order_reference(n, bf16):
    """Σ(wᵣ·Tᵣ)/Σwᵣ accumulated in f32 in rank order, bit-identical on every rank."""
    world = 3
    rng = np.random.default_rng(7)
    data = [rng.standard_normal(n).astype(np.float32) * 10 for _ in range(world)]
    weights = [3.0, 5.0, 2.0]

    def body(comm):
        comm.set_bf16_wire(bf16)
        t = torch.from_numpy(data[comm.rank].copy())
        return comm.all_reduce_scaled([t], weights[comm.rank], RoundKind.MODEL,
                                      weights[comm.rank])

    with FakeCohort(world) as c:
        out = c.run(body)
    # reference: scale in f32 (bf16 wire: round the f32 product once), sum in rank order,
    # one multiply by the f32 reciprocal (bf16: rounded once more)
    contribs = []
    for d, w in zip(data, weights):
        x = torch.from_numpy(d) * np.float32(w)
        contribs.append(x.to(torch.bfloat16).float().numpy() if bf16 else x.numpy())
    acc = contribs[0] + contribs[1]
    acc = acc + contribs[2]
    want = acc * np.float32(1.0 / sum(weights))
    if bf16:
        want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
    for tensors, mass in out:
        assert mass == sum(weights)
        np.testing.assert_array_equal(tensors[0].numpy(), want)
    first = out[0][0][0].numpy().view(np.uint32)
    for tensors, _ in out[1:]:
        assert np.array_equal(tensors[0].numpy().view(np.uint32), first)


def test_zero_mass_round_returns_weight_zero_and_keeps_local_in_place():
    def body(comm):
        t = torch.full((4,), float(comm.rank + 1))
        tensors, mass = comm.all_reduce_scaled([t], 0.0, RoundKind.MODEL, 0.0)
        keep = t.clone()
        m2 = comm.all_reduce_([t], weight=0.0, scale=0.0)
        return tensors[0].tolist(), mass, m2, torch.equal(t, keep)

    with FakeCohort(2) as c:
        for vals, mass, m2, kept in c.run(body):
            assert mass == 0.0 and m2 == 0.0
            assert vals == [0.0] * 4
            assert kept


def test_a_weight_where_the_kind_goes_is_refused_not_a_plain_sum():
    """``all_reduce_weighted([t], 1.0)`` (the weight by position) took 1.0 for the kind
    (``int(1.0)`` = CONTROL): a plain sum, reported with the summed mass, silently."""
    def body(comm):
        t = torch.full((4,), float(comm.rank + 1))
        for call in (lambda: comm.all_reduce_weighted([t], 1.0),
                     lambda: comm.all_reduce_weighted([t], True),
                     lambda: comm.all_reduce_scaled([t], 1.0, 1.0),
                     lambda: comm.all_reduce_([t], kind=1.0)):
            with pytest.raises(ValueError, match=r"kind must be a RoundKind .* got (1\.0|True) "
                                                 r"where the round kind goes .* weight=\.\.\. by "
                                                 r"name"):
                call()
        return comm.all_reduce_weighted([t * (comm.rank + 1)], weight=comm.rank + 1)[1]

    with FakeCohort(2) as c:
        assert c.run(body) == [3.0, 3.0]  # the Comm still works: nothing was sent


def test_a_second_thread_entering_a_round_in_flight_is_refused():
    """Rank 0's thread A is in a large round, waiting for rank 1; its main thread calls a
    collective on the same Comm. That call used to put a second round into the Comm's
    slots and mix the two rounds' results silently; it is refused, touching nothing,
    and A's round completes with the right consensus."""
    import threading

    n = 300_000  # a bulk round
    refused = threading.Event()

    def body(comm):
        if comm.rank == 1:
            assert refused.wait(30)
            return comm.all_reduce_tensors([torch.full((n,), 3.0)])[0].unique().tolist()
        a, got = refused_in_flight(
            comm, lambda: comm.all_reduce_tensors([torch.full((n,), 1.0)])[0].unique().tolist(),
            lambda: comm.all_reduce_tensors([torch.full((n,), 5.0)]))
        refused.set()
        a.join(30)
        return got[0]

    with FakeCohort(2) as c:
        assert c.run(body) == [[2.0], [2.0]]


def test_per_rank_f64_gather():
    def body(comm):
        v = np.zeros(comm.world_size)
        v[comm.rank] = [3, 5, 2][comm.rank]
        first = comm.all_reduce_per_rank_f64(v)
        again = comm.all_reduce_per_rank_f64(v)  # a result of its own; v is left as it was
        as_f32 = comm.all_reduce_per_rank_f64(v.astype(np.float32))
        strided = comm.all_reduce_per_rank_f64(np.repeat(v, 2)[::2])
        tensor = torch.from_numpy(v)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (numpy's copy= keyword warned for a tensor)
            from_tensor = comm.all_reduce_per_rank_f64(tensor)
        assert from_tensor.tolist() == first.tolist() and tensor.tolist() == v.tolist()
        return first, again is not first, v.tolist(), as_f32, strided

    with FakeCohort(3) as c:
        for rank, (got, fresh, mine, as_f32, strided) in enumerate(c.run(body)):
            assert got.dtype == np.float64 and got.tolist() == [3.0, 5.0, 2.0]
            assert fresh and mine == [[3.0, 5.0, 2.0][rank] if i == rank else 0.0
                                      for i in range(3)]
            assert as_f32.dtype == strided.dtype == np.float64
            assert as_f32.tolist() == strided.tolist() == [3.0, 5.0, 2.0]

        # (a probe passed its own value alone, [x], and was not told how to fix it; every
        # rank makes the call: one alone would wait in its refusal round for its peers)
        def too_short(comm):
            with pytest.raises(ValueError) as e:
                comm.all_reduce_per_rank_f64([1.0, 2.0])
            return str(e.value)

        for rank, text in enumerate(c.run(too_short)):
            assert re.search(rf"one slot per rank: 2 values, world_size 3\. Pass 3 numbers "
                            rf"with this rank's value at index {rank} and zeros elsewhere",
                            text), text


def test_control_rounds_are_plain_sums():
    with FakeCohort(2) as c:
        out = c.run(lambda comm: comm.all_reduce_weighted([torch.tensor([1.0, 2.0])],
                                                          RoundKind.CONTROL, 0.0))
    for tensors, _ in out:
        assert tensors[0].tolist() == [2.0, 4.0]


def test_dead_rank_is_excluded_and_reads_zero():
    """Rank 2 is fenced before the round: the survivors average over realized work."""
    def body(comm):
        v = np.zeros(3)
        v[comm.rank] = [3, 5, 2][comm.rank]
        counts = comm.all_reduce_per_rank_f64(v)
        w = counts[comm.rank]
        t = torch.tensor([float(comm.rank + 1)] * (BIG if comm.rank == 0 else BIG))
        (avg,), mass = comm.all_reduce_scaled([t], w, RoundKind.MODEL, w)
        return counts.tolist(), float(avg[0]), float(avg[-1]), mass

    with FakeCohort(3) as c:
        c.declare_dead(2)
        out = c.run(body, ranks=[0, 1])
    for counts, first, last, mass in out[:2]:
        assert counts == [3.0, 5.0, 0.0]
        assert abs(first - 13 / 8) < 1e-6 and first == last
        assert mass == 8.0


# --- paths, shapes, lifetimes --------------------------------------------------------------

@pytest.mark.parametrize("eager_bytes", [4096, 1 << 20])
def test_many_tensors_both_paths(eager_bytes):
    shapes = [(3,), (2, 5), (7, 1, 3), (1,), (400,), (0,), (33, 17)]
    rng = np.random.default_rng(1)
    data = {r: [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]
            for r in range(2)}
    with FakeCohort(2, eager_bytes=eager_bytes) as c:
        out = c.run(lambda comm: comm.all_reduce_tensors(data[comm.rank]))
    for got in out:
        for g, a, b, s in zip(got, data[0], data[1], shapes):
            assert tuple(g.shape) == s
            torch.testing.assert_close(g, (a + b) * 0.5, rtol=0, atol=0)


def test_returned_tensors_are_the_callers_to_keep():
    with FakeCohort(2) as c:
        def body(comm):
            first = comm.all_reduce_tensors([torch.full((BIG,), 1.0 + comm.rank)])
            snapshot = first[0].clone()
            comm.all_reduce_tensors([torch.full((BIG,), 100.0)])
            small = comm.all_reduce_tensors([torch.full((8,), 1.0 + comm.rank)])
            comm.all_reduce_tensors([torch.full((8,), 100.0)])
            return torch.equal(first[0], snapshot), small[0].tolist()

        for kept, small in c.run(body):
            assert kept
            assert small == [1.5] * 8


def test_in_place_all_reduce_writes_the_consensus_into_the_tensors():
    def body(comm):
        a = torch.full((5,), float(comm.rank))
        b = torch.full((BIG,), float(2 * comm.rank))
        bf = torch.full((3,), float(comm.rank), dtype=torch.bfloat16)
        mass = comm.all_reduce_([a, b, bf])
        return mass, a.tolist(), float(b[0]), float(b[-1]), bf.dtype, bf.tolist()

    with FakeCohort(2) as c:
        for mass, a, b0, b1, bfd, bf in c.run(body):
            assert mass == 2.0 and a == [0.5] * 5 and b0 == b1 == 1.0
            assert bfd == torch.bfloat16 and bf == [0.5] * 3


@pytest.mark.parametrize("bf16", [False, True])
def test_in_place_single_tensor_bulk_writes_own_slice_during_its_reduce(bf16):
    """The one-tensor bulk path writes a rank's own slice straight into the tensor and
    copies only the others: the result is the same, and a zero-mass round still keeps
    the local tensor."""
    n = 3 * BIG + 7
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]

    def body(comm):
        comm.set_bf16_wire(bf16)
        t = torch.from_numpy(data[comm.rank].copy())
        mass = comm.all_reduce_([t])
        keep = torch.full((n,), 5.0)
        zero = comm.all_reduce_([keep], weight=0.0, scale=0.0)
        return mass, t, zero, bool(torch.all(keep == 5.0))

    with FakeCohort(3) as c:
        out = c.run(body)
    first = out[0][1]
    for mass, t, zero, kept in out:
        assert mass == 3.0 and zero == 0.0 and kept
        assert torch.equal(t, first)
    if not bf16:
        want = (torch.from_numpy(data[0]) + torch.from_numpy(data[1]) + torch.from_numpy(data[2]))
        torch.testing.assert_close(first, want * np.float32(1 / 3), rtol=0, atol=0)


@pytest.mark.parametrize("bf16", [False, True])
def test_zero_copy_inputs_and_views(bf16):
    def body(comm):
        comm.set_bf16_wire(bf16)
        (x, y) = comm.zero_copy_inputs([(BIG,), (3, 4)])
        assert x.dtype == (torch.bfloat16 if bf16 else torch.float32)
        x.fill_(float(comm.rank + 1))
        y.fill_(2.0 * comm.rank)
        (vx, vy), mass = comm.all_reduce_zero_copy(weight=1.0)
        got = (float(vx[0]), float(vx[-1]), vy.float().tolist()[0], mass)
        # the views alias shared memory: the next round may overwrite them
        (x2,) = comm.zero_copy_inputs([(BIG,)])
        x2.fill_(10.0)
        (vx2,), _ = comm.all_reduce_zero_copy()
        return got, float(vx2[0]), vx.data_ptr() == vx2.data_ptr()

    with FakeCohort(2) as c:
        for (x0, x1, y, mass), second, aliased in c.run(body):
            assert (x0, x1, y, mass) == (1.5, 1.5, [1.0] * 4, 2.0)
            assert second == 10.0 and aliased


@pytest.mark.parametrize("world,eager_up_to", [(2, 256 << 10), (4, 128 << 10)])
def test_zero_copy_frames_whose_ranks_read_a_mib_together_take_the_bulk_region(
        world, eager_up_to):
    """In an eager round every rank reads every rank's frame: from 1 MiB read in all,
    a zero-copy frame lives in the bulk region instead, whose round reads each frame
    once (2-3x faster on 4 ranks at 256 KiB-1 MiB). Same bits either way."""
    sizes = [eager_up_to, 2 * eager_up_to]

    def body(comm):
        out = []
        for nbytes in sizes:
            data = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(comm.rank))
            (x,) = comm.zero_copy_inputs([(nbytes // 4,)])
            x.copy_(data)
            eager = comm._zero_copy[1]
            (v,), mass = comm.all_reduce_zero_copy()
            (want,) = comm.all_reduce_tensors([data])
            out.append((eager, mass, torch.equal(v, want)))
        return out

    with FakeCohort(world) as c:
        assert c.run(body) == [[(True, float(world), True), (False, float(world), True)]] * world


def test_zero_copy_requires_inputs_first():
    with FakeCohort(1) as c:
        with pytest.raises(RuntimeError, match="zero_copy_inputs"):
            c.comm(0).all_reduce_zero_copy()


def test_barrier_and_world_of_one():
    with FakeCohort(1) as c:
        comm = c.comm(0)
        comm.barrier()
        assert comm.all_reduce_tensors([torch.tensor([4.0])])[0].tolist() == [4.0]
        assert comm.all_reduce_per_rank_f64([7.0]).tolist() == [7.0]


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["shape", "count", "bf16_mix", "kind", "path", "barrier"])
def test_schema_mismatch_raises_on_every_rank_and_comm_stays_in_step(case):
    def body(comm):
        r = comm.rank
        try:
            if case == "shape":
                comm.all_reduce_tensors([torch.ones(3 + r)])
            elif case == "count":
                comm.all_reduce_tensors([torch.ones(3)] * (1 + r))
            elif case == "bf16_mix":
                comm.set_bf16_wire(r == 1)
                comm.all_reduce_tensors([torch.ones(3)])
            elif case == "kind":
                comm.all_reduce_weighted([torch.ones(3)], RoundKind.CONTROL if r else RoundKind.MODEL)
            elif case == "barrier":  # e.g. a save() that only rank 0 calls
                if r == 0:
                    comm.barrier()
                else:
                    comm.all_reduce_tensors([torch.ones(3)])
            else:  # a zero-copy (bulk) round against a copy (eager) round
                if r == 0:
                    comm.zero_copy_inputs([(3,)])[0].fill_(1.0)
                    comm.all_reduce_zero_copy()
                else:
                    comm.all_reduce_tensors([torch.ones(3)])
        except SchemaMismatchError as e:
            msg = str(e)
        else:
            msg = None
        comm.set_bf16_wire(False)
        after = comm.all_reduce_tensors([torch.full((2,), float(r))])[0].tolist()
        return msg, after

    with FakeCohort(2) as c:
        out = c.run(body)
    for msg, after in out:
        assert msg is not None and "different frame schemas" in msg
        assert "rank 0" in msg and "rank 1" in msg
        assert after == [0.5, 0.5], "the cohort stays usable after a mismatch"
        if case == "barrier":
            assert "rank 0: CONTROL round without tensors (as barrier() sends" in msg, msg


#: one rank's refused call of each collective (what rank 1 passes; rank 0 calls it well)
_REFUSED_CALLS = {
    "all_reduce_": lambda comm, bad: comm.all_reduce_(
        [torch.ones(4, dtype=torch.float64 if bad else torch.float32)]),
    "all_reduce_tensors": lambda comm, bad: comm.all_reduce_tensors(
        [torch.ones(4)] if not bad else torch.ones(4)),
    "all_reduce_weighted": lambda comm, bad: comm.all_reduce_weighted(
        [torch.ones(4)], RoundKind.MODEL, float("nan") if bad else 1.0),
    "all_reduce_scaled": lambda comm, bad: comm.all_reduce_scaled(
        [torch.ones(4)], float("inf") if bad else 2.0),
    "all_reduce": lambda comm, bad: comm.all_reduce(frame_with([1.0] * 4, -1.0 if bad else 1.0)),
    "all_reduce_per_rank_f64": lambda comm, bad: comm.all_reduce_per_rank_f64(
        [1.0] * (3 if bad else comm.world_size)),
    "broadcast_from_root": lambda comm, bad: comm.broadcast_from_root(
        [torch.ones(4)], root=7 if bad else 0),
    "broadcast_": lambda comm, bad: comm.broadcast_([torch.ones(4)], root=-1 if bad else 0),
    "all_gather_into_tensor": lambda comm, bad: comm.all_gather_into_tensor(
        torch.empty(8 if not bad else 9), torch.ones(4)),
    "reduce_scatter_tensor": lambda comm, bad: comm.reduce_scatter_tensor(
        torch.empty(4), torch.ones(8, dtype=torch.int32 if bad else torch.float32)),
    "all_reduce_zero_copy": lambda comm, bad: (
        None if bad else comm.zero_copy_inputs([(4,)])[0].fill_(1.0),
        comm.all_reduce_zero_copy()),
}


@pytest.mark.parametrize("call", sorted(_REFUSED_CALLS))
def test_a_call_one_rank_refuses_raises_on_every_rank_and_leaves_them_in_step(call):
    """A rank that refuses its arguments raised before any round, and its peers' round
    then paired with its next call (that call's data read as this one's where the
    schemas agreed, else a mismatch one call late). It now takes part in one refusal
    round: the peers' collective mismatches it, every rank raises at once (the refusing
    rank with its own reason first), and the next calls pair as written."""
    def body(comm):
        bad = comm.rank == 1
        try:
            _REFUSED_CALLS[call](comm, bad)
        except SchemaMismatchError as e:
            msg = str(e)
        else:
            msg = None
        after = comm.all_reduce_tensors([torch.full((2,), float(comm.rank))])[0].tolist()
        return msg, after, comm.round

    with FakeCohort(2) as c:
        (msg0, after0, rnd0), (msg1, after1, rnd1) = c.run(body)
    assert msg0 is not None and "rank 1: refused its call before the round" in msg0, msg0
    assert msg1 is not None and msg1.startswith("rank 1 refused its call before the round ("), msg1
    assert "rank 1: refused its call before the round" in msg1, msg1
    assert after0 == after1 == [0.5, 0.5], "the next call paired with the peer's next call"
    assert rnd0 == rnd1


def test_a_refused_call_whose_peers_call_late_is_logged_while_it_waits(monkeypatch, caplog):
    """Rank 1 refuses its call while rank 0 is busy outside the collectives: rank 1's
    refusal round waits for rank 0's next collective before anyone raises, so its
    error would show only then (never, with a peer that never calls again). It logs it
    while it waits; rank 0's late call then mismatches, and both raise."""
    import time

    monkeypatch.setenv("FLODL_SHM_WAIT_NOTICE_S", "0.2")  # (a refusal's: min of it and 5 s)

    def body(comm):
        try:
            if comm.rank == 0:
                time.sleep(0.8)
                comm.barrier()
            else:
                comm.all_reduce_([torch.ones(3, dtype=torch.int64)])
        except SchemaMismatchError as e:
            return str(e)

    with caplog.at_level("WARNING", logger="flodl_shm"), FakeCohort(2) as c:
        msg0, msg1 = c.run(body)
    assert "rank 1: refused its call before the round" in msg0, msg0
    assert msg1.startswith("rank 1 refused its call before the round (FrameError"), msg1
    said = [r.getMessage() for r in caplog.records]
    assert 1 <= len(said) <= 3, said  # at 0.2, 0.4 (and 0.8) s
    for line in said:
        assert line.startswith("rank 1 refused its call (FrameError: tensor[0] dtype Int64 "
                               "(torch.int64) not supported"), line
        assert ("and waits in a refusal round for its peers' next collective, so that every "
                "rank raises in step: ranks [0] have made no collective for") in line, line
        assert "The round fails at the 60 s collective timeout" in line, line


def test_a_long_wait_is_said_once_for_the_ranks_that_wait_together(monkeypatch, caplog):
    """Ranks 1, 2 and 3 wait in a barrier for rank 0: the lowest of them that is alive
    says so (rank 2, rank 1 being dead), not each of them."""
    import time

    monkeypatch.setenv("FLODL_SHM_WAIT_NOTICE_S", "0.2")

    def body(comm):
        if comm.rank == 0:
            time.sleep(0.7)
        comm.barrier()

    with caplog.at_level("WARNING", logger="flodl_shm"), FakeCohort(4) as c:
        c.declare_dead(1)
        c.run(body, ranks=[0, 2, 3])
    said = [r.getMessage() for r in caplog.records]
    assert 1 <= len(said) <= 2, said  # at 0.2 and 0.4 s
    for line in said:
        assert line.startswith("rank 2 has waited "), said
        assert "for ranks [0] in round 0 (waiting for ranks to arrive)" in line, line


def test_a_call_every_rank_refuses_raises_each_ranks_own_error_and_leaves_them_in_step():
    """Where every rank refused, the refusal round completes: each raises its own error,
    of its own type, and the ranks stay in step (a world of one runs no refusal round)."""
    def body(comm):
        errors = []
        for call in (lambda: comm.all_reduce_([torch.ones(4, dtype=torch.float64)]),
                     lambda: comm.all_reduce_tensors(None),
                     lambda: comm.broadcast_([torch.ones(2)], root="0")):
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the test names the types
                errors.append(type(e).__name__)
        after = comm.all_reduce_tensors([torch.full((2,), float(comm.rank))])[0].tolist()
        return errors, after, comm.round

    with FakeCohort(2) as c:
        for errors, after, rnd in c.run(body):
            assert errors == ["FrameError", "TypeError", "ValueError"]
            assert after == [0.5, 0.5] and rnd == 4
    with FakeCohort(1) as c:
        (errors, after, rnd), = c.run(body)
        assert errors == ["FrameError", "TypeError", "ValueError"] and rnd == 1


def test_bad_dtype_is_refused_before_publishing():
    with FakeCohort(1) as c:
        comm = c.comm(0)
        with pytest.raises(FrameError, match="Float64.*Float32"):
            comm.all_reduce_tensors([torch.ones(2, dtype=torch.float64)])
        with pytest.raises(FrameError, match="not a finite non-negative"):
            comm.all_reduce_weighted([torch.ones(2)], RoundKind.MODEL, float("nan"))
        assert comm.round == 0
        assert comm.all_reduce_tensors([torch.ones(2)])[0].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("path", ["single", "fused", "general", "frame"])
@pytest.mark.parametrize("weight", [1e-40, 5e-324, 1e39, 1e300])
def test_a_weight_outside_float32s_masses_is_refused_not_turned_into_inf_or_nan(path, weight):
    """The consensus is Σ(w·T) times float32(1/Σw): a mass below float32's smallest
    normal has no finite reciprocal (every element came out inf or NaN on every rank),
    one above float32's largest is inf as a scale (0·inf: NaN). Refused before the
    round on every path, naming the weight and the range."""
    n = {"single": 4, "fused": 4, "general": 300_000, "frame": 4}[path]
    with FakeCohort(1) as c:
        comm = c.comm(0)
        with pytest.raises(FrameError, match=r"outside the masses a float32 round carries"):
            if path == "single":
                # (a scale past float32's range is refused on its own: test_a_scale_...)
                comm.all_reduce_([torch.ones(n)], weight=weight, scale=min(weight, 1.0))
            elif path == "frame":
                comm.all_reduce(RoundFrame([TensorPayload(DTYPE_F32, (n,), bytes(4 * n))],
                                           weight=weight))
            else:
                comm.all_reduce_weighted([torch.ones(n), torch.ones(3)], weight=weight)
        assert comm.round == 0, "refused before publishing: the Comm stays in step"


@pytest.mark.parametrize("path", ["single", "fused", "general", "in place"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 1e39, -1e39])
def test_a_scale_that_is_not_finite_is_refused_before_the_round(path, scale):
    """A probe's all_reduce_scaled with a NaN scale returned an all-NaN consensus with
    its full mass and no error (a NaN weight is refused); 1e39, finite as a Python float,
    is inf in the float32 the kernels scale in."""
    n = 300_000 if path == "general" else 4
    with FakeCohort(1) as c:
        comm = c.comm(0)
        with pytest.raises(FrameError, match=rf"scale {re.escape(str(scale))} is not a finite "
                                             rf"float32 .* pass a finite scale in range"):
            if path == "in place":
                comm.all_reduce_([torch.ones(n)], scale=scale)
            elif path == "fused":
                comm.all_reduce_scaled([torch.ones(n), torch.ones(3)], scale)
            else:
                comm.all_reduce_scaled([torch.ones(n)], scale)
        assert comm.round == 0, "refused before publishing: the Comm stays in step"
        assert comm.all_reduce_scaled([torch.ones(2)], 0.5)[0][0].tolist() == [0.5, 0.5]


@pytest.mark.parametrize("path", ["single", "fused", "general"])
@pytest.mark.parametrize("bf16_wire", [False, True])
def test_a_scaled_nan_keeps_its_sign_and_payload(path, bf16_wire):
    """all_reduce_scaled is bit-identical to ``t.mul(scale)`` for every value but a NaN: a
    float32 NaN comes back as float32 arithmetic leaves it (``mul``'s bits on a float32
    wire, the codec's quiet NaN of its sign on a bfloat16 one), and a bfloat16 NaN stays
    itself, quieted, where torch's bfloat16 ``mul`` gives NaN bits of its own (0x7FC0 in
    its scalar loop, 0xFFFF in its vector one, here)."""
    n = 300_000 if path == "general" else 4
    words = np.full(n, 0x7FA00001, np.uint32)
    words[1::2] = 0xFFC00123  # a signalling NaN with a payload, a negative quiet one
    f32 = torch.from_numpy(words.view(np.float32))
    f16 = torch.from_numpy(np.full(n, 0xFFA1, np.uint16).view(np.int16)).view(torch.bfloat16)
    extra = [] if path != "fused" else [torch.ones(3)]
    with FakeCohort(1) as c:
        comm = c.comm(0)
        comm.set_bf16_wire(bf16_wire)
        (got32, *_), _ = comm.all_reduce_scaled([f32, *extra], 2.0)
        (got16, *_), _ = comm.all_reduce_scaled([f16, *extra], 2.0)
    bits32 = got32.numpy().view(np.uint32)
    want32 = f32.mul(2.0).numpy().view(np.uint32)  # (quieted: 0x7FE00001, 0xFFC00123)
    if bf16_wire:
        want32 = ((want32 >> 16) | 0x40).astype(np.uint32) << 16
    assert np.array_equal(bits32, want32)
    assert np.all(got16.numpy().view(np.uint32) == np.uint32(0xFFE10000))  # 0xFFA1 quieted


def test_the_extreme_masses_float32_carries_still_average_exactly():
    """At float32's smallest normal and at 1e38 the weighted mean is still right."""
    tiny = float(np.finfo(np.float32).tiny)

    def body(comm):
        t = torch.tensor([1.0, 2.0] if comm.rank == 0 else [3.0, 2.0])
        out = []
        for w in (tiny, 2.0 ** 100, 1e-30):
            x = t.clone()
            mass = comm.all_reduce_([x], weight=w, scale=w)
            out.append((x.tolist(), mass))
        return out

    with FakeCohort(2) as cohort:
        for got in cohort.run(body):
            assert [x for x, _ in got] == [[2.0, 2.0]] * 3
            assert got[0][1] == 2 * tiny and got[1][1] == 2.0 ** 101


@pytest.mark.parametrize("general", [False, True], ids=["fused", "general"])
def test_one_tensor_where_the_list_goes_is_refused_not_reduced_row_by_row(general):
    """``all_reduce_tensors(t)`` iterated ``t``: a list of its rows' means came back, and
    ``[0]`` read the mean of row 0, silently."""
    def body(comm):
        if general:
            comm.set_fault_hook(lambda phase, rnd: None)  # no fused round
        t = torch.full((3, 4), float(comm.rank + 1))
        for call in (lambda: comm.all_reduce_tensors(t),
                     lambda: comm.all_reduce_weighted(t, weight=1.0),
                     lambda: comm.all_reduce_(t),
                     lambda: comm.broadcast_from_root(torch.ones(5)),
                     lambda: comm.broadcast_(torch.ones(5))):
            with pytest.raises(TypeError, match=r"a list of tensors, got one tensor of shape "
                                                r"\((3, 4|5,)\): pass \[t\]"):
                call()
        # no tensor was sent: a refusal round each (none for a fault hook's Comm)
        assert comm.round == (0 if general else 5)
        # a tensor of one row reads as a list of one tensor, that row: on the paths of a
        # one-tensor list (its first call, then a loop's repeated one) as well
        row = torch.full((1, 4), float(comm.rank + 1))
        for cached in (False, True):
            if cached:
                comm.all_reduce_([row[0].clone()])  # (the plan of one (4,) tensor, cached)
                comm.broadcast_([row[0].clone()])
            for call in (lambda: comm.all_reduce_tensors(row),
                         lambda: comm.all_reduce_weighted(row, weight=1.0),
                         lambda: comm.all_reduce_scaled(row, 1.0),
                         lambda: comm.all_reduce_(row),
                         lambda: comm.broadcast_from_root(row),
                         lambda: comm.broadcast_(row)):
                with pytest.raises(TypeError, match=r"a list of tensors, got one tensor of "
                                                    r"shape \(1, 4\): pass \[t\]"):
                    call()
        assert comm.round == (2 if general else 5 + 2 + 12)  # (and 12 refusals)
        return comm.all_reduce_tensors([t])[0][0, 0].item()

    with FakeCohort(2) as c:
        assert c.run(body) == [1.5, 1.5]


def test_timeout_names_round_and_missing_ranks():
    with FakeCohort(3, timeout=0.3) as c:
        def body(comm):
            comm.barrier()
            if comm.rank == 2:
                return None  # never calls the second collective
            with pytest.raises(ReduceStall) as info:
                comm.all_reduce_tensors([torch.ones(4)])
            return info.value

        out = c.run(body)
    for err in out[:2]:
        assert err.round == 1 and err.missing == (2,)
        assert "round 1" in str(err) and "[2]" in str(err)
    # a stalled round leaves the Comm unusable, loudly
    with FakeCohort(1) as c:
        comm = c.comm(0)
        comm._broken = "round 3 failed with ReduceStall: ..."
        with pytest.raises(RuntimeError, match="unusable"):
            comm.barrier()


def test_abort_wakes_waiting_ranks():
    with FakeCohort(2, timeout=None) as c:
        def body(comm):
            if comm.rank == 1:
                raise KeyError("boom")  # FakeCohort aborts the cohort when a rank raises
            comm.barrier()

        with pytest.raises(KeyError, match="boom"):
            c.run(body)

    with FakeCohort(2, timeout=None) as c:
        import threading

        threading.Timer(0.2, c.abort).start()
        with pytest.raises(CohortAborted):
            c.comm(0).barrier()


def test_frame_level_reduce_validates_its_frame():
    with FakeCohort(1) as c:
        comm = c.comm(0)
        mixed = RoundFrame([TensorPayload(DTYPE_F32, (1,), np.ones(1, np.float32)),
                            TensorPayload(DTYPE_BF16, (1,), np.ones(1, np.uint16))])
        with pytest.raises(FrameError, match="share a wire dtype"):
            comm.all_reduce(mixed)
        bad = RoundFrame([TensorPayload(DTYPE_F32, (4,), np.ones(2, np.float32))])
        with pytest.raises(FrameError, match="numel"):
            comm.all_reduce(bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_frames_beyond_one_gib_grow_the_arena_on_demand():
    """No fixed cap: a 1.1 GiB frame grows each rank's bulk region and the result
    region in place (posix_fallocate), and reduces correctly."""
    from flodl_shm.engine.segment import shm_free_bytes

    n = (1 << 30) // 4 + (25 << 20)  # 1.1 GiB of f32
    need = 3 * 4 * n + (64 << 20)
    if shm_free_bytes() < need:
        pytest.skip(f"/dev/shm has {shm_free_bytes() >> 20} MiB free, this test needs "
                    f"{need >> 20} MiB")

    def body(comm):
        t = torch.full((n,), float(comm.rank + 1))
        mass = comm.all_reduce_([t])
        return mass, float(t[0]), float(t[n // 2]), float(t[-1])

    with FakeCohort(2) as c:
        out = c.run(body, join_timeout=500)
        assert c.arena._result_seg.nbytes >= 4 * n
    for mass, a, b, z in out:
        assert mass == 2.0 and a == b == z == 1.5


def test_a_comm_kept_past_its_cohort_raises_instead_of_reducing_alone():
    """A Comm used after its FakeCohort closed reduced on memory nobody read any more:
    alone, silently; with a peer, a ReduceStall that blamed a live rank."""
    with FakeCohort(2) as cohort:
        comms = [cohort.comm(0), cohort.comm(1)]
    for call in (lambda c: c.all_reduce_([torch.ones(4)]),
                 lambda c: c.all_reduce_tensors([torch.ones(300_000)]),
                 lambda c: c.barrier(),
                 lambda c: c.all_reduce_per_rank_f64([1.0, 0.0])):
        with pytest.raises(RuntimeError, match=r"this Comm is unusable: it was closed"):
            call(comms[0])


@pytest.mark.parametrize("what", ["expanded", "meta", "sparse"])
def test_a_tensor_that_cannot_take_part_is_refused_before_the_round(what):
    """An expand()ed tensor passed to all_reduce_ failed at the write-back, after the
    round had run: this rank raised while the others held the consensus, out of step.
    Meta and sparse tensors failed deep in torch, naming neither the tensor nor a fix."""
    t = {"expanded": lambda: torch.ones(1).expand(4),
         "meta": lambda: torch.ones(3, device="meta"),
         "sparse": lambda: torch.ones(3).to_sparse()}[what]()
    said = {"expanded": r"tensor\[1\] of shape \(4,\) and stride \(0,\) has elements that "
                        r"share memory .* pass t.contiguous\(\)",
            "meta": r"tensor\[1\] is on the meta device, which holds no data",
            "sparse": r"tensor\[1\] is a torch.sparse_coo tensor: .* pass t.to_dense\(\)"}[what]
    with FakeCohort(1) as c:
        comm = c.comm(0)
        with pytest.raises(FrameError, match=said):
            comm.all_reduce_([torch.ones(2), t])
        if what != "expanded":  # (a root's own tensors are only read)
            with pytest.raises(FrameError, match=said):
                comm.broadcast_([torch.ones(2), t], root=0)
        assert comm.round == 0
        if what == "expanded":  # a result of its own is fine
            assert comm.all_reduce_tensors([t])[0].tolist() == [1.0] * 4


@pytest.mark.parametrize("what", ["mkldnn", "sparse_csr", "nested", "jagged"])
def test_a_layout_with_no_address_or_strides_is_named_on_the_one_tensor_paths(what):
    """An mkldnn tensor passed every check of the one-tensor paths and failed at its
    address inside the round: the rank's Comm broke and its peer waited out the timeout.
    A sparse CSR or nested tensor failed in torch ('Sparse CSR tensors do not have
    is_contiguous'; a jagged one, torch's recommended layout, in our plan on its symbolic
    size). Each is named before the round now, by every path, a repeated call's included,
    and the ranks stay in step."""
    import warnings

    def make():
        with warnings.catch_warnings():  # (torch's beta/prototype notes)
            warnings.simplefilter("ignore")
            return {"mkldnn": lambda: torch.ones(256).to_mkldnn(),
                    "sparse_csr": lambda: torch.ones(16, 16).to_sparse_csr(),
                    "nested": lambda: torch.nested.nested_tensor([torch.ones(3)] * 2),
                    "jagged": lambda: torch.nested.nested_tensor(
                        [torch.ones(2), torch.ones(3)], layout=torch.jagged)}[what]()
    said = {"mkldnn": r"tensor\[0\] is a torch._mkldnn tensor: .* pass t.to_dense\(\)",
            "sparse_csr": r"tensor\[0\] is a torch.sparse_csr tensor: .* pass t.to_dense",
            "nested": r"tensor\[0\] is a nested tensor: .*t.unbind\(\)",
            "jagged": r"tensor\[0\] is a nested tensor: .*t.unbind\(\)"}[what]

    def body(comm):
        t = torch.full((256,), float(comm.rank))
        comm.all_reduce_([t])  # caches the one-tensor plan of this size
        calls = (lambda b: comm.all_reduce_([b]), lambda b: comm.all_reduce_tensors([b]),
                 lambda b: comm.all_reduce_scaled([b], 2.0),
                 lambda b: comm.broadcast_([b], root=0),
                 lambda b: comm.broadcast_from_root([b], root=0),
                 lambda b: comm.all_reduce_([b, torch.ones(2)]))
        for call in calls:
            with pytest.raises(FrameError, match=said):
                call(make())
        rnd = comm.round
        u = torch.full((256,), float(comm.rank))
        comm.all_reduce_([u])
        return rnd, u[0].item()

    with FakeCohort(2) as c:  # (each refusal took one round: both ranks refused)
        assert c.run(body) == [(7, 0.5), (7, 0.5)]


@pytest.mark.parametrize("bad, said", [
    (None, r"a collective takes a list \(or tuple\) of tensors, got NoneType"),
    ((t for t in [torch.ones(3)]), r"a collective takes a list \(or tuple\) of tensors, "
                                   r"got generator"),
    (np.ones(3), r"got ndarray: pass \[torch.from_numpy\(a\)\]"),
    ([[1.0, 2.0]], r"tensor\[0\] is a list, not a torch.Tensor"),
])
def test_what_is_not_a_list_of_tensors_is_named(bad, said):
    """None and generators failed on len() ('object of type NoneType has no len()'), a
    list in the list on an attribute ('list' object has no attribute 'dtype')."""
    with FakeCohort(1) as c:
        comm = c.comm(0)
        for call in (comm.all_reduce_tensors, comm.all_reduce_):
            with pytest.raises((TypeError, FrameError), match=said):
                call(bad)
        assert comm.round == 0


def test_a_cohort_never_closed_gives_its_segments_back_when_collected_or_at_exit(tmp_path):
    """A probe's FakeCohorts entered and dropped without close() kept 8 segments each
    for the process's life and after it (160 segments, 85 MB after 20), and a later
    FakeCohort did not reap a dead process's."""
    import gc
    import os
    import subprocess
    import sys

    from flodl_shm.engine.segment import list_segments

    c = FakeCohort(2).__enter__()
    c.run(lambda comm: comm.all_reduce_tensors([torch.ones(4)]))
    assert len(our_segments()) > 0
    del c
    gc.collect()
    assert our_segments() == []
    script = ("import os, torch\nfrom flodl_shm.testing import FakeCohort\n"
              "c = FakeCohort(2).__enter__()\n"
              "c.run(lambda comm: comm.all_reduce_tensors([torch.ones(4)]))\n"
              "print(os.getpid())\n")
    done = subprocess.run([sys.executable, "-c", script], text=True, capture_output=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    assert not [g.name for g in list_segments() if g.owner_pid == pid]
    # a dead process's segments (made here under a pid that no longer runs) are reaped
    # by the next cohort
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          text=True, capture_output=True, timeout=60)
    stale = f"/dev/shm/fshm_{int(dead.stdout)}_0badf00d_ctl"
    with open(stale, "wb") as fh:
        fh.write(bytes(4096))
    try:
        with FakeCohort(1):
            assert not os.path.exists(stale)
    finally:
        if os.path.exists(stale):
            os.unlink(stale)


def test_collectives_leave_the_callers_tensors_resizable(tmp_path):
    """A probe: after a 1.2 MB all_reduce or broadcast (the bulk path), the caller's
    tensor could not be resized ('Trying to resize storage that is not resizable'):
    Tensor.numpy() marks a storage so for good. DDP's batched PowerSGD hook resizes its
    bucket. gloo leaves the storage as it was; so does every path here now, a model
    saved to and loaded from a .fdl included."""
    from flodl_shm.checkpoint.fdl import load_module, save_module
    from flodl_shm.frame import payload_to_tensor, tensor_to_payload

    n = 300_000  # 1.2 MB: over the eager slot, under the direct rounds

    def body(comm):
        made = {
            "all_reduce_ f32": torch.ones(n), "all_reduce_ bf16": torch.ones(n).bfloat16(),
            "all_reduce_tensors": torch.ones(n), "broadcast_": torch.ones(n),
            "broadcast_from_root": torch.ones(n), "frame": torch.ones(n),
        }
        comm.all_reduce_([made["all_reduce_ f32"]])
        comm.all_reduce_([made["all_reduce_ bf16"]])
        comm.all_reduce_tensors([made["all_reduce_tensors"]])
        comm.broadcast_([made["broadcast_"]], 0)
        comm.broadcast_from_root([made["broadcast_from_root"]], 0)
        payload_to_tensor(tensor_to_payload(made["frame"], DTYPE_F32), out=made["frame"])
        bad = []
        for what, t in made.items():
            try:
                t.resize_(n + 1)
            except RuntimeError as e:
                bad.append(f"{what}: {e}")
        return bad

    with FakeCohort(2) as c:
        assert c.run(body) == [[], []]
    model = torch.nn.Linear(300, 1000)
    save_module(model, tmp_path / "m.fdl")
    load_module(model, tmp_path / "m.fdl")
    for p in model.parameters():
        p.data.resize_(p.numel() + 1)  # raised for a model saved or loaded before


@pytest.mark.parametrize("call, error, said", [
    (lambda c: c.shared_tensors(torch.ones(3)), TypeError, r"got one tensor of shape \(3,\)"),
    (lambda c: c.shared_tensors([[1.0, 2.0]]), TypeError, r"tensor 0 is a list"),
    (lambda c: c.all_reduce_per_rank_f64(None), TypeError, r"one number per rank \(1\)"),
    (lambda c: c.all_reduce_per_rank_f64(3), TypeError, r"got int 3"),
    (lambda c: c.zero_copy_inputs([(-1,)]), ValueError, r"shape 0 is \(-1,\): every dimension"),
    (lambda c: c.zero_copy_inputs([(2.5,)]), ValueError, r"shape 0 is \(2\.5,\)"),
    (lambda c: c.zero_copy_inputs(None), TypeError, r"a list of shapes"),
    (lambda c: c.broadcast_from_root(None), TypeError, r"list \(or tuple\) of tensors"),
    (lambda c: c.broadcast_(5), TypeError, r"list \(or tuple\) of tensors, got int"),
    (lambda c: c.all_reduce_([torch.ones(3)], weight=None), TypeError,
     r"weight must be a number .*got NoneType None"),
    (lambda c: c.all_reduce_([torch.ones(3)], kind=99), ValueError,
     r"kind 99 is not a RoundKind: pass RoundKind\.MODEL"),
    (lambda c: c.all_reduce_([torch.ones(3)], weight=10**400), FrameError,
     r"weight 1000\.\.\. \(401 digits\) is outside the masses"),
    (lambda c: c.all_reduce_tensors([torch.ones(3)] * 2) and
     c.all_reduce_weighted([torch.ones(3)], weight=-10**400), FrameError,
     r"weight -1000\.\.\. \(401 digits\) is not a finite non-negative"),
    (lambda c: c.all_reduce_([torch.ones(3)], scale=10**400), FrameError,
     r"scale 1000\.\.\. \(401 digits\) is not a finite float32"),
    (lambda c: c.all_reduce_([torch.ones(3), torch.ones(2)], scale=10**400), FrameError,
     r"scale 1000\.\.\. \(401 digits\) is not a finite float32"),
    (lambda c: c.all_reduce_scaled([torch.ones(3)], -10**400), FrameError,
     r"scale -1000\.\.\. \(401 digits\) is not a finite float32"),
    (lambda c: c.all_reduce_scaled([torch.ones(3)] * 2, "x"), TypeError,
     r"scale must be a number .*got str 'x'"),
    (lambda c: c.all_reduce_weighted([torch.ones(3)] * 2, weight="32"), TypeError,
     r"weight must be a number .*got str '32'"),
    (lambda c: c.zero_copy_inputs([(3,)]) and c.all_reduce_zero_copy(weight=b"1"), TypeError,
     r"weight must be a number .*got bytes b'1'"),
], ids=["shared-bare-tensor", "shared-list", "per-rank-None",
        "per-rank-scalar", "zc-negative", "zc-float", "zc-None", "bcast-None", "bcast_-int",
        "weight-None", "kind-99", "weight-huge-int", "weight-huge-negative-int",
        "scale-huge-int-hot", "scale-huge-int", "scale-huge-negative-int", "scale-str",
        "weight-text", "zc-weight-bytes"])
def test_an_api_probe_s_bad_inputs_are_named(call, error, said):
    """An API probe found these accepted with a wrong result (a generator placed nothing,
    a bare tensor became its rows, None gathered [nan], a shape of -1 an empty tensor,
    2.5 a tensor of 2) or refused from deep inside (len() of None, float() of None,
    enum's own message, float()'s OverflowError for an int past a float's range); text
    that float() parses ("32", a weight read from a config file) was taken as a number."""
    with FakeCohort(1) as c:
        with pytest.raises(error, match=said):
            call(c.comm(0))


def test_what_an_api_probe_s_checks_must_keep_taking():
    """A regression probe of those checks: a generator of tensors is placed (it was read
    twice: nothing placed), a ParameterList is broadcast as the reduces take it, an array
    of per-rank values of shape (world, 1) is flattened, a generator of shapes is read
    once."""
    with FakeCohort(1) as c:
        comm = c.comm(0)
        assert [t.shape for t in comm.shared_tensors(t for t in [torch.ones(3), torch.ones(2)])
                ] == [(3,), (2,)]
        params = torch.nn.ParameterList([torch.nn.Parameter(torch.full((3,), 2.0))])
        assert comm.broadcast_from_root(params, 0)[0].tolist() == [2.0, 2.0, 2.0]
        comm.broadcast_(params, 0)
        assert comm.all_reduce_per_rank_f64(np.full((1, 1), 4.0)).tolist() == [4.0]
        comm.zero_copy_inputs([(5, 2)])
        assert [t.shape for t in comm.zero_copy_inputs(s for s in [(5, 3)])] == [(5, 3)]
