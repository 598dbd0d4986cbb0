"""The fused eager round (copy-in by address + round + reduce into the result, one
compiled call) gives exactly what the general round gives, for every tensor API.

Each case runs twice on the same FakeCohort: once fused, once with a no-op fault hook
installed (which keeps every call on the general round: ``Comm._run``), and the
results must agree bit for bit, including the accepted mass.
"""
from __future__ import annotations

from decimal import Decimal

import numpy as np
import pytest
import torch

from flodl_shm import RoundKind
from flodl_shm.testing import FakeCohort

from engine_util import our_segments

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    yield
    assert our_segments() == [], "a FakeCohort left shared-memory segments behind"


def _inputs(rank: int, dtypes):
    g = torch.Generator().manual_seed(100 + rank)
    shapes = [(3, 5), (7,), (1,), (2, 2, 2)]
    return [torch.randn(s, generator=g).to(dt) for s, dt in zip(shapes, dtypes)]


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().float().reshape(-1).view(torch.int32).tolist()


CASES = {
    "tensors": lambda c, xs: (c.all_reduce_tensors(xs), None),
    "scaled": lambda c, xs: c.all_reduce_scaled(xs, 0.3, weight=0.5 + c.rank),
    "weighted-control": lambda c, xs: c.all_reduce_weighted(xs, RoundKind.CONTROL, 2.0),
    "broadcast": lambda c, xs: (c.broadcast_from_root(xs, root=1), None),
    "inplace": lambda c, xs: (xs, c.all_reduce_(xs, weight=1.0 + c.rank, scale=0.7)),
    "inplace-one": lambda c, xs: (xs[:1], c.all_reduce_(xs[:1], weight=2.0)),
    "scaled-one": lambda c, xs: c.all_reduce_scaled(xs[:1], 0.3, weight=0.5 + c.rank),
    "scaled-one-no-mass": lambda c, xs: c.all_reduce_scaled(xs[:1], 0.3, weight=0.0),
    "tensors-one": lambda c, xs: (c.all_reduce_tensors(xs[:1]), None),
    "per-rank": lambda c, xs: ([torch.from_numpy(c.all_reduce_per_rank_f64(
        [float(c.rank + 3) if r == c.rank else 0.0 for r in range(c.world_size)]))], None),
}


@pytest.mark.parametrize("bf16_wire", [False, True])
@pytest.mark.parametrize("src", ["f32", "bf16", "mixed"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_general(case, src, bf16_wire):
    dtypes = {"f32": [torch.float32] * 4, "bf16": [torch.bfloat16] * 4,
              "mixed": [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]}[src]

    def body(comm):
        comm.set_bf16_wire(bf16_wire)
        got = []
        for general in (False, True):
            comm.set_fault_hook((lambda phase, rnd: None) if general else None)
            out, mass = CASES[case](comm, _inputs(comm.rank, dtypes))
            got.append(([_bits(t) for t in out], mass, [tuple(t.shape) for t in out]))
        comm.set_fault_hook(None)
        return got

    with FakeCohort(3) as cohort:
        results = cohort.run(body)
    for fused, general in results:
        assert fused == general
    assert results[0][0][0] == results[1][0][0] == results[2][0][0]  # same on every rank


def test_fused_results_are_fresh_memory():
    """Two calls never return aliasing tensors (the caller keeps them)."""
    def body(comm):
        x = [torch.full((4,), float(comm.rank)), torch.full((2, 3), 1.0)]
        a = comm.all_reduce_tensors(x)
        b = comm.all_reduce_tensors(x)
        c = comm.broadcast_from_root(x)
        ptrs = {t.data_ptr() for t in a} | {t.data_ptr() for t in b} | {t.data_ptr() for t in c}
        return len(ptrs), a[0].tolist(), b[1].shape

    with FakeCohort(2) as cohort:
        for n, a0, shape in cohort.run(body):
            assert n == 6 and a0 == [0.5] * 4 and shape == (2, 3)


def test_fused_round_refuses_bad_inputs_like_the_general_round():
    def body(comm):
        with pytest.raises(Exception, match="dtype|Int"):
            comm.all_reduce_tensors([torch.ones(3, dtype=torch.int32)])
        with pytest.raises(Exception, match="weight"):
            comm.all_reduce_weighted([torch.ones(3)], weight=-1.0)
        return comm.all_reduce_tensors([torch.ones(3)])[0].tolist()

    with FakeCohort(2) as cohort:
        assert cohort.run(body) == [[1.0] * 3] * 2


def test_a_repeated_one_tensor_call_keeps_every_check_of_the_first(tmp_path):
    """``all_reduce_``'s hot case (one float32 tensor whose plan an earlier call of the
    same shape cached) skips frames, not checks: after the plan is cached, each of these
    gets what a first call gets."""
    from flodl_shm.errors import FrameError

    def body(comm):
        odd = 1.0 + 2.0 ** -20  # not a bfloat16 value
        t = torch.full((1024,), odd)
        comm.all_reduce_([t])
        got = [comm.all_reduce_([t], weight=2.0, scale=2.0), t[0].item()]
        # a bad weight or scale is named, before the round
        for kwargs, err, words in (({"weight": "x"}, TypeError, "weight must be a number"),
                                   ({"weight": "2"}, TypeError, "got str '2'"),
                                   ({"scale": b"2"}, TypeError, "got bytes b'2'"),
                                   ({"weight": Decimal("NaN")}, FrameError, "weight nan is not"),
                                   ({"scale": Decimal("NaN")}, FrameError, "scale nan is not"),
                                   ({"weight": 1e39}, FrameError, "outside the masses"),
                                   ({"scale": float("nan")}, FrameError, "not a finite float32"),
                                   # (a float16 inf compared as given passed float32's bounds)
                                   ({"weight": np.float16("inf")}, FrameError, "weight inf is"),
                                   ({"scale": torch.tensor(float("inf"), dtype=torch.bfloat16)},
                                    FrameError, "scale inf is not")):
            with pytest.raises(err, match=words):
                comm.all_reduce_([t], **kwargs)
        # a bf16 wire rounds the contribution; a pinned arm is taken by the round
        t.fill_(odd)
        comm.set_bf16_wire(True)
        comm.all_reduce_([t])
        comm.set_bf16_wire(False)
        got.append(t[0].item())
        comm.set_pinned_decode(True)
        comm.arm_pinned_decode(0)
        comm.all_reduce_([t])
        got.append(comm._armed)
        # another dtype or shape of the same size takes its own plan
        b = torch.full((1024,), 2.0, dtype=torch.bfloat16)
        comm.all_reduce_([b])
        m = torch.full((2, 512), 3.0)
        comm.all_reduce_([m])
        comm.all_reduce_([t])
        u = torch.full((2048,), float(comm.rank))
        comm.all_reduce_([u])
        got += [b.dtype, float(b[0]), tuple(m.shape), float(m[1, 511]), float(u[-1])]
        # a fault hook sees the round
        comm.all_reduce_([t])
        phases = []
        comm.set_fault_hook(lambda phase, rnd: phases.append(phase))
        comm.all_reduce_([t])
        comm.set_fault_hook(None)
        got.append("before_copy_in" in phases)
        # a broadcast's plan of the same shape is a CONTROL round's: a MODEL round that
        # realized nothing still leaves the tensor untouched
        comm.broadcast_([t], 0)
        t.fill_(float(comm.rank))
        got += [comm.all_reduce_([t], weight=0.0), float(t[-1])]
        return got

    with FakeCohort(2) as cohort:
        for rank, got in enumerate(cohort.run(body)):
            # mass 2 + 2; (2·odd + 2·odd) / 4 = odd, exactly
            assert got[:2] == [4.0, 1.0 + 2.0 ** -20]
            assert got[2] == 1.0 and got[3] is None
            assert got[4:9] == [torch.bfloat16, 2.0, (2, 512), 3.0, 0.5]
            assert got[9] is True
            assert got[10:] == [0.0, float(rank)]
    # an armed checkpoint captures the round; a closed Comm refuses it
    from flodl_shm import ModelSchema

    model = torch.nn.Linear(32, 32, bias=False)
    with FakeCohort(1) as cohort:
        comm = cohort.comm(0)
        t = model.weight.detach()
        comm.all_reduce_([t])
        comm.all_reduce_([t])
        comm.arm_checkpoint(tmp_path / "hot.fdl", ModelSchema.from_module(model), None)
        comm.all_reduce_([t])
        assert cohort.flush_checkpoints(60)
        assert (tmp_path / "hot.fdl").exists()
        comm.close()
        with pytest.raises(RuntimeError, match="closed"):
            comm.all_reduce_([t])


def test_a_repeated_sum_gives_what_the_general_round_gives_and_the_kinds_never_cross():
    """A repeated CONTROL ``all_reduce_`` (the c10d backend's SUM) takes the hot case too
    (its plan cached by kind): the same sums and mass as the general round (a fault
    hook's) for any weight and scale, a MODEL call between switches the plan both ways,
    and a kind that is only equal to a RoundKind is still refused."""
    from flodl_shm import RoundKind

    ctrl = RoundKind.CONTROL

    def body(comm):
        r = comm.rank
        x = torch.linspace(-3.0, 5.0, 1024) * (r + 1.5)
        got = []
        for weight, scale in ((1.0, 1.0), (0.0, 2.0), (3.0, -0.5)):
            general = x.clone()
            comm.set_fault_hook(lambda phase, rnd: None)  # no fused or hot round
            m_general = comm.all_reduce_([general], weight=weight, scale=scale, kind=ctrl)
            comm.set_fault_hook(None)
            comm.all_reduce_([x.clone()], kind=ctrl)  # caches the CONTROL plan
            hot = x.clone()
            m_hot = comm.all_reduce_([hot], weight=weight, scale=scale, kind=ctrl)
            got.append((torch.equal(general, hot), m_general == m_hot))
        t = torch.full((1024,), float(r + 1))
        comm.all_reduce_([t], kind=ctrl)
        comm.all_reduce_([t], kind=ctrl)
        sums = t[0].item()
        comm.all_reduce_([t])
        t.fill_(float(r + 1))
        comm.all_reduce_([t])  # the MODEL plan, cached: the mean
        mean = t[0].item()
        t.fill_(float(r + 1))
        comm.all_reduce_([t], kind=ctrl)  # back to the CONTROL plan: the sum
        with pytest.raises(ValueError, match="kind must be a RoundKind"):
            comm.all_reduce_([t], kind=1.0)  # equal to CONTROL, and refused
        return got, sums, mean, t[0].item()

    with FakeCohort(2) as cohort:
        for got, sums, mean, summed in cohort.run(body):
            assert got == [(True, True)] * 3
            assert (sums, mean, summed) == (6.0, 1.5, 3.0)


@pytest.mark.parametrize("in_place", [True, False], ids=["broadcast_", "broadcast_from_root"])
def test_a_repeated_one_tensor_broadcast_keeps_every_check_of_the_first(in_place):
    """The small broadcasts' hot case (``Comm._hot_broadcast``: one float32 tensor whose
    CONTROL plan an earlier call cached) skips frames, not checks: after the plan is
    cached, each of these gets what a first call gets."""
    from flodl_shm.errors import FrameError, SchemaMismatchError

    def call(comm, t, root):
        if in_place:
            comm.broadcast_([t], root)
            return t
        return comm.broadcast_from_root([t], root)[0]

    def body(comm):
        r = comm.rank
        got = [float(call(comm, torch.full((1024,), r + 1.0), 1)[0])]
        got.append(float(call(comm, torch.full((1024,), r + 1.0), 0)[-1]))
        for root, words in ((2, "broadcast root 2 is not a rank"),
                            (-1, "broadcast root -1 is not a rank"),
                            ("1", "broadcast root '1' is not a rank")):
            with pytest.raises(ValueError, match=words):
                call(comm, torch.ones(1024), root)
        with pytest.raises(TypeError, match=r"got one tensor of shape \(1, 1024\)"):
            comm.broadcast_(torch.ones(1, 1024), 1) if in_place else \
                comm.broadcast_from_root(torch.ones(1, 1024), 1)
        with pytest.raises(FrameError, match="is a torch._mkldnn tensor"):
            call(comm, torch.ones(1024).to_mkldnn(), 1)  # (dense, contiguous, f32, CPU)
        # another dtype, shape or layout of the same size; a MODEL plan in between
        b = call(comm, torch.full((1024,), r + 1.0, dtype=torch.bfloat16), 1)
        m = call(comm, torch.full((2, 512), r + 1.0), 1)
        s = call(comm, torch.full((2048,), r + 1.0)[::2], 1)
        comm.all_reduce_([torch.ones(1024)])
        got += [b.dtype, float(b[0]), tuple(m.shape), float(m[1, 511]), float(s[-1]),
                float(call(comm, torch.full((1024,), r + 1.0), 1)[0])]
        # a fault hook sees the round
        phases = []
        comm.set_fault_hook(lambda phase, rnd: phases.append(phase))
        call(comm, torch.ones(1024), 0)
        comm.set_fault_hook(None)
        got.append("before_copy_in" in phases)
        # ranks that name different roots are told so, each
        with pytest.raises(SchemaMismatchError, match="disagree on the broadcast root"):
            call(comm, torch.ones(1024), r)
        return got

    with FakeCohort(2) as cohort:
        for got in cohort.run(body):
            # (broadcast_from_root's results are float32, as its first call's)
            assert got == [2.0, 1.0, torch.bfloat16 if in_place else torch.float32, 2.0,
                           (2, 512), 2.0, 2.0, 2.0, True]
        comm = cohort.comm(0)
    comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        call(comm, torch.ones(1024), 0)


@pytest.mark.parametrize("api", ["tensors", "weighted", "scaled"])
def test_a_repeated_one_tensor_result_call_keeps_every_check_of_the_first(api):
    """The tensor-returning reduces' hot case (``Comm._hot_result``: one small float32
    tensor whose plan an earlier call cached) skips frames, not checks: after the plan
    is cached, each of these gets what a first call gets."""
    from flodl_shm.errors import FrameError

    def call(comm, t, weight=1.0, scale=1.0, kind=RoundKind.MODEL):
        if api == "tensors":
            return comm.all_reduce_tensors([t])[0], None
        if api == "weighted":
            (r,), mass = comm.all_reduce_weighted([t], kind, weight)
        else:
            (r,), mass = comm.all_reduce_scaled([t], scale, kind, weight)
        return r, mass

    def body(comm):
        odd = 1.0 + 2.0 ** -20  # not a bfloat16 value
        t = torch.full((1024,), odd * (comm.rank + 1))
        first, _ = call(comm, t)
        kept = first.clone()
        again, mass = call(comm, t)
        got = [torch.equal(first, again), first.data_ptr() != again.data_ptr(),
               torch.equal(first, kept), float(again[0]), mass, again.requires_grad]
        heavier, mass = call(comm, t, weight=2.0)
        got += [float(heavier[0]), mass]
        if api != "tensors":  # a bad weight or scale is named, before the round
            bad = [({"weight": "x"}, TypeError, "weight must be a number"),
                   ({"weight": Decimal("NaN")}, FrameError, "weight nan is not"),
                   ({"weight": 1e39}, FrameError, "outside the masses"),
                   ({"weight": np.float16("inf")}, FrameError, "weight inf is not")]
            if api == "scaled":
                bad += [({"scale": b"2"}, TypeError, "got bytes b'2'"),
                        ({"scale": float("nan")}, FrameError, "not a finite float32"),
                        ({"scale": torch.tensor(float("inf"), dtype=torch.float16)},
                         FrameError, "scale inf is not")]
            for kwargs, err, words in bad:
                with pytest.raises(err, match=words):
                    call(comm, t, **kwargs)
            got.append(float(call(comm, t, scale=0.5)[0][0]))  # (weighted: no scale)
            # a CONTROL round of the same shape sums: not the MODEL round's plan
            got.append(float(call(comm, t, kind=RoundKind.CONTROL)[0][0]))
        # a bf16 wire rounds the contribution; a pinned arm is taken by the round
        comm.set_bf16_wire(True)
        got.append(float(call(comm, torch.full((1024,), odd))[0][0]))
        comm.set_bf16_wire(False)
        comm.set_pinned_decode(True)
        comm.arm_pinned_decode(0)
        call(comm, t)
        got.append(comm._armed)
        # a requires-grad tensor gives a result without grad, as a first call's
        got.append(call(comm, t.clone().requires_grad_())[0].requires_grad)
        return got

    with FakeCohort(2) as cohort:
        for got in cohort.run(body):
            mean = (1.0 + 2.0 ** -20) * 1.5
            assert got[:6] == [True, True, True, mean, None if api == "tensors" else 2.0,
                               False]
            if api == "tensors":  # (no weight to give)
                assert got[6:8] == [mean, None]
            else:  # each rank's values over the mass 2 + 2; a CONTROL round's sum
                assert got[6:10] == [mean / 2, 4.0, mean / 2 if api == "scaled" else mean,
                                     (1.0 + 2.0 ** -20) * 3]
            assert got[-3:] == [1.0, None, False]
        comm = cohort.comm(0)
    comm.close()
    with pytest.raises(RuntimeError, match="closed"):
        call(comm, torch.ones(1024))


@pytest.mark.parametrize("bf16_wire", [False, True])
def test_small_zero_copy_runs_in_the_eager_slot(bf16_wire):
    """A small zero-copy frame is filled in the eager slot of the next round's parity:
    alternating rounds (both parities) and a repeated schema reuse cached views and
    still reduce what was filled; the consensus equals the copy API's."""
    def body(comm):
        comm.set_bf16_wire(bf16_wire)
        got = []
        for i in range(5):
            x, y = comm.zero_copy_inputs([(6,), (2, 3)])
            x.fill_(float(comm.rank + i))
            y.fill_(float(2 * comm.rank))
            (vx, vy), mass = comm.all_reduce_zero_copy(weight=1.0)
            ref = comm.all_reduce_tensors([torch.full((6,), float(comm.rank + i)),
                                           torch.full((2, 3), float(2 * comm.rank))])
            got.append((vx.float().tolist(), vy.float().tolist(), mass,
                        ref[0].tolist(), ref[1].tolist()))
        return got

    with FakeCohort(2) as cohort:
        for rank_got in cohort.run(body):
            for i, (vx, vy, mass, rx, ry) in enumerate(rank_got):
                assert vx == rx == [0.5 + i] * 6 and vy == ry == [[1.0] * 3] * 2
                assert mass == 2.0


def test_zero_copy_inputs_must_be_reduced_by_the_next_collective():
    def body(comm):
        comm.zero_copy_inputs([(4,)])[0].fill_(1.0)
        comm.barrier()  # reuses the memory the inputs live in
        with pytest.raises(RuntimeError, match="another collective ran in between"):
            comm.all_reduce_zero_copy()
        (x,) = comm.zero_copy_inputs([(4,)])
        x.fill_(float(comm.rank))
        return comm.all_reduce_zero_copy()[0][0].tolist()

    with FakeCohort(2) as cohort:
        assert cohort.run(body) == [[0.5] * 4] * 2


def test_barrier_waits_for_a_late_rank_skips_a_dead_one_and_names_a_mismatch():
    """The barrier's one compiled call: a rank 50 ms late is waited for (the spin
    misses, the futex path finishes the round), a fenced dead rank is not, and a rank
    whose peer calls another collective at that round raises a schema mismatch there
    and stays in step."""
    import time

    from flodl_shm import SchemaMismatchError

    def late(comm):
        if comm.rank == 1:
            time.sleep(0.05)
        t0 = time.perf_counter()
        comm.barrier()
        return time.perf_counter() - t0, comm._engine.waiter.missed

    with FakeCohort(2) as c:
        (waited, missed), _ = c.run(late)
    assert waited >= 0.04 and missed >= 1

    with FakeCohort(3) as c:
        c.declare_dead(2)
        assert c.run(lambda comm: comm.barrier() or comm.round, ranks=[0, 1])[:2] == [1, 1]

    def mismatch(comm):
        with pytest.raises(SchemaMismatchError):
            if comm.rank == 0:
                comm.barrier()
            else:
                comm.all_reduce_weighted([torch.ones(3)], RoundKind.CONTROL, 1.0)
        comm.barrier()  # still in step
        return True

    with FakeCohort(2) as c:
        assert c.run(mismatch) == [True, True]


def test_per_rank_gather_finishes_late_dead_and_mismatched_rounds():
    """``all_reduce_per_rank_f64``'s one compiled call: a rank 50 ms late is waited for
    (the spin misses, the futex path finishes and reduces), a fenced dead rank reads 0,
    and a peer that calls a barrier at that round makes both raise a schema mismatch
    and stay in step."""
    import time

    import numpy as np

    from flodl_shm import SchemaMismatchError

    def values(comm):
        v = np.zeros(comm.world_size)
        v[comm.rank] = 10.0 + comm.rank
        return v

    def late(comm):
        if comm.rank == 1:
            time.sleep(0.05)
        got = comm.all_reduce_per_rank_f64(values(comm))
        return got.tolist(), comm._engine.waiter.missed

    with FakeCohort(2) as c:
        out = c.run(late)
    assert [got for got, _ in out] == [[10.0, 11.0]] * 2
    assert out[0][1] >= 1  # rank 0 finished on the blocking path

    with FakeCohort(3) as c:
        c.declare_dead(2)
        got = c.run(lambda comm: comm.all_reduce_per_rank_f64(values(comm)).tolist(),
                    ranks=[0, 1])
    assert got[:2] == [[10.0, 11.0, 0.0]] * 2

    def mismatch(comm):
        with pytest.raises(SchemaMismatchError):
            if comm.rank == 0:
                comm.all_reduce_per_rank_f64(values(comm))
            else:
                comm.barrier()
        return comm.all_reduce_per_rank_f64(values(comm)).tolist()  # still in step

    with FakeCohort(2) as c:
        assert c.run(mismatch) == [[10.0, 11.0]] * 2


def test_gathered_tensors_reduce_as_a_list_and_keep_their_own_plans():
    """A window's ``GatheredTensors`` (engine/gathered.py) take the fused round with the
    addresses gathered at their first: the same bits as the same tensors in a list, a
    plain call over other tensors of the same shapes in between (whose addresses refill
    the engine's shared plan) changes nothing of theirs, a bf16 wire and a broadcast
    take plans of their own, and a set too large for one call takes the general path."""
    from flodl_shm.engine.gathered import GatheredTensors

    with FakeCohort(2) as cohort:
        def body(comm):
            dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float32]
            mine, plain = _inputs(comm.rank, dtypes), _inputs(comm.rank, dtypes)
            gathered = GatheredTensors(mine)
            out = []
            for wire in (False, True, False):
                comm.set_bf16_wire(wire)
                m1 = comm.all_reduce_(gathered, weight=1.0 + comm.rank, scale=0.5)
                others = _inputs(comm.rank + 7, dtypes)
                comm.all_reduce_(others)  # the shared plan now holds these addresses
                m2 = comm.all_reduce_(plain, weight=1.0 + comm.rank, scale=0.5)
                out.append(m1 == m2 and all(_bits(a) == _bits(b) for a, b in zip(mine, plain)))
            with torch.no_grad():
                for t in gathered:
                    t.fill_(comm.rank + 1.0)
            comm.broadcast_(gathered, 1)
            out.append(all(bool(t.eq(2.0).all()) for t in gathered))
            plans = gathered._plans
            big = GatheredTensors([torch.full((1 << 20,), float(comm.rank))])
            comm.all_reduce_(big)
            return out, len([p for p in plans.values() if p]), big[0][0].item(), \
                [bool(p and p.fused) for p in big._plans.values()]

        for out, nplans, big, big_plans in cohort.run(body):
            # plans: MODEL on each wire, CONTROL (the broadcast)
            assert out == [True] * 4 and nplans == 3 and big == 0.5 and big_plans == [False]


def test_a_repeated_one_payload_frame_keeps_every_check_of_the_first(tmp_path):
    """``all_reduce(frame)``'s hot case (``Comm._hot_frame``: one float32 payload whose
    plan an earlier frame of that kind and shape cached) skips frames, not checks: after
    the plan is cached, each of these gets what a first frame gets."""
    from flodl_shm import RoundFrame, TensorPayload
    from flodl_shm.errors import FrameError

    def frame(values, weight=1.0, kind=RoundKind.MODEL, dtype=0):
        data = memoryview(np.ascontiguousarray(values).view(np.uint8).reshape(-1))
        return RoundFrame([TensorPayload(dtype, np.shape(values), data)], weight, kind)

    def body(comm):
        r = comm.rank
        mine = np.full(1024, r + 1.0, np.float32)
        f = frame(mine, weight=r + 1.0)
        first = comm.all_reduce(f)
        again = comm.all_reduce(f)  # the hot case: its own fresh reply
        got = [first.weight, again.weight, float(again.tensors[0].as_array()[0]),
               again.tensors[0].data.obj is not first.tensors[0].data.obj,
               again.kind is RoundKind.MODEL, again.tensors[0].shape]
        # a frame changed after construction is named, before the round
        for change, err, words in (
                (lambda g: setattr(g, "weight", float("nan")), FrameError, "frame weight nan"),
                (lambda g: setattr(g, "weight", -1.0), FrameError, "frame weight -1.0"),
                (lambda g: setattr(g, "weight", 1e39), FrameError, "outside the masses"),
                (lambda g: setattr(g, "kind", 99), Exception, "99"),
                # (equal to the cached kind, but a weight passed where the kind goes?)
                (lambda g: setattr(g, "kind", 0.0), ValueError, "kind must be a RoundKind"),
                (lambda g: setattr(g, "kind", False), ValueError, "kind must be a RoundKind"),
                (lambda g: setattr(g.tensors[0], "data", memoryview(bytearray(4092))),
                 FrameError, "4092"),
                (lambda g: setattr(g.tensors[0], "dtype", 7), FrameError, "7")):
            g = frame(mine)
            comm.all_reduce(g)
            change(g)
            with pytest.raises(err, match=words):
                comm.all_reduce(g)
        # what the hot case leaves to the general path still reduces
        ro = frame(mine)
        ro.tensors[0].data = memoryview(bytes(mine.view(np.uint8)))  # read-only
        odd = np.zeros(4097, np.uint8)
        odd[1:] = mine.view(np.uint8)
        unaligned = frame(mine)
        unaligned.tensors[0].data = memoryview(odd)[1:]
        as_int = frame(mine, weight=r + 1)
        as_tuple = frame(mine)
        as_tuple.tensors = tuple(as_tuple.tensors)
        shaped = frame(mine.reshape(2, 512))
        control = frame(mine, kind=RoundKind.CONTROL)
        for g in (ro, unaligned, as_int, as_tuple, shaped, control, frame(mine)):
            out = comm.all_reduce(g)
            got.append((out.weight, float(out.tensors[0].as_array()[-1]),
                        out.tensors[0].shape, int(out.kind)))
        bf = comm.all_reduce(frame(np.full(2048, 0x3F80 * (r + 1) // (r + 1), np.uint16),
                                   dtype=1))
        got.append((bf.tensors[0].dtype, bf.tensors[0].shape))
        # a weight of 0 is a mass like any other (the round realized nothing)
        got.append(comm.all_reduce(frame(mine, weight=0.0)).weight)
        # a fault hook sees the round
        phases = []
        comm.set_fault_hook(lambda phase, rnd: phases.append(phase))
        comm.all_reduce(frame(mine))
        comm.set_fault_hook(None)
        got.append("before_copy_in" in phases)
        return got

    with FakeCohort(2) as cohort:
        for got in cohort.run(body):
            # the payloads carry w·T: (1 + 2) / 3 with mass 3
            assert got[:6] == [3.0, 3.0, 1.0, True, True, (1024,)]
            assert got[6:13] == [(2.0, 1.5, (1024,), 0)] * 2 + [(3.0, 1.0, (1024,), 0)] + \
                [(2.0, 1.5, (1024,), 0), (2.0, 1.5, (2, 512), 0), (2.0, 3.0, (1024,), 1),
                 (2.0, 1.5, (1024,), 0)]
            assert got[13:] == [(1, (2048,)), 0.0, True]
    # an armed checkpoint captures a MODEL frame's round; a closed Comm refuses it
    from flodl_shm import ModelSchema

    model = torch.nn.Linear(32, 32, bias=False)
    with FakeCohort(1) as cohort:
        comm = cohort.comm(0)
        w = model.weight.detach().numpy().reshape(-1).copy()
        f = frame(w.reshape(32, 32))
        comm.all_reduce(f)
        comm.all_reduce(f)
        comm.arm_checkpoint(tmp_path / "hot.fdl", ModelSchema.from_module(model), None)
        comm.all_reduce(f)
        assert cohort.flush_checkpoints(60)
        assert (tmp_path / "hot.fdl").exists()
        comm.close()
        with pytest.raises(RuntimeError, match="closed"):
            comm.all_reduce(f)
