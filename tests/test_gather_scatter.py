"""The part collectives. ``Comm.all_gather_into_tensor``: every rank's part, bit for bit,
into every rank's output; one compiled call a round on one host (``kernels/parts.py``),
parts larger than the eager slot in rounds of a slot each, each rank's part broadcast in
turn where a fault hook runs (as on a cluster). ``Comm.reduce_scatter_tensor``: each
rank's part of the sum (or mean), the bits ``all_reduce_`` gives that part, each rank
summing only its part where the input fits the slot.

Ranks are threads over a real arena (``FakeCohort``); dead ranks are fenced the way the
supervisor fences them.
"""
from __future__ import annotations

import time

import pytest
import torch

from flodl_shm import RoundKind, SchemaMismatchError
from flodl_shm.engine.direct import GATHER_PART_MAX, GATHER_PART_MIN
from flodl_shm.errors import PeerDied
from flodl_shm.testing import FakeCohort

from engine_util import our_segments

pytestmark = pytest.mark.timeout(120)

SLOT = 64 << 10  # a 64 KiB eager slot: parts from 16K float32 go in several rounds


@pytest.fixture(autouse=True)
def _no_leaked_segments():
    yield
    assert our_segments() == [], "a FakeCohort left shared-memory segments behind"


def _part(rank: int, n: int) -> torch.Tensor:
    """Rank ``rank``'s part: random bits (NaNs with payloads, signaling ones, -0.0,
    subnormals among them) read as float32."""
    g = torch.Generator().manual_seed(1000 + rank)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, generator=g)
    bits[:3] = torch.tensor([0x7F800001, -2 ** 31, 1], dtype=torch.int32)[:n]
    return bits.view(torch.float32)


def _want(world: int, n: int) -> torch.Tensor:
    return torch.cat([_part(r, n).view(torch.int32) for r in range(world)])


def _gather_fresh_and_in_place(comm, world: int, n: int) -> list[torch.Tensor]:
    """Every rank's part of ``n`` gathered into a fresh output, then in place (the
    input is this rank's part of the output, as FSDP passes it): both outputs' bits."""
    got = torch.full((world * n,), 7.0)
    comm.all_gather_into_tensor(got, _part(comm.rank, n))
    inside = torch.zeros(world * n)
    mine = inside[comm.rank * n:(comm.rank + 1) * n]
    mine.copy_(_part(comm.rank, n))
    comm.all_gather_into_tensor(inside, mine)
    return [got.view(torch.int32), inside.view(torch.int32)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 5, 1000, 40_000, 100_003],
                         ids=["1", "5", "1000", "two-rounds", "seven-rounds"])
@pytest.mark.parametrize("hooked", [False, True], ids=["compiled", "broadcasts"])
def test_every_rank_gets_every_part_bit_for_bit(world, n, hooked):
    """Into a fresh output and in place (the input is this rank's part of the output, as
    FSDP passes it), one round or many (a 64 KiB slot), compiled or one broadcast a rank
    (a fault hook)."""
    def body(comm):
        if hooked:
            comm._engine.fault_hook = lambda where, rnd: None
        return _gather_fresh_and_in_place(comm, world, n)

    with FakeCohort(world, eager_bytes=SLOT) as c:
        for got, inside in c.run(body):
            assert got.equal(_want(world, n)) and inside.equal(_want(world, n))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n", [GATHER_PART_MIN // 4, 40_000, GATHER_PART_MAX // 4],
                         ids=["least", "mid", "most"])
def test_parts_of_the_direct_band_are_read_from_the_peers_bit_for_bit(world, n, monkeypatch):
    """Parts of 64-256 KiB where ranks do not outnumber cores: a direct round, each rank
    reading its peers' inputs into its output (``kernels.parts.direct_gather_f32``). Into
    a fresh output, in place (FSDP's layout), and again with rank 0 late (the peers finish
    the round in ``read_parts``, after their blocking arrival wait)."""
    # (the owner's broadcast threshold, 1 MiB where ranks outnumber cores as 3 do on 2)
    monkeypatch.setenv("FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES", str(32 << 10))
    direct_rounds = []

    def body(comm):
        gather = comm._engine.direct.gather

        def counted(*args):
            direct_rounds.append(comm.rank)
            return gather(*args)

        comm._engine.direct.gather = counted
        again = torch.zeros(world * n)
        outputs = _gather_fresh_and_in_place(comm, world, n)
        if comm.rank == 0:  # late: its peers' spin misses, they read the parts the slow way
            time.sleep(0.3)
        comm.all_gather_into_tensor(again, _part(comm.rank, n))
        return [*outputs, again.view(torch.int32)]

    with FakeCohort(world, direct=True) as c:
        for outputs in c.run(body):
            assert all(t.equal(_want(world, n)) for t in outputs)
    assert sorted(direct_rounds) == sorted(list(range(world)) * 3)


@pytest.mark.parametrize("n", [GATHER_PART_MIN // 4 - 16, GATHER_PART_MAX // 4 + 16],
                         ids=["under", "over"])
def test_parts_outside_the_direct_band_go_through_the_slots(n):
    def body(comm):
        gather = comm._engine.direct.gather
        comm._engine.direct.gather = lambda *args: pytest.fail("a direct gather") or gather(*args)
        got = torch.zeros(2 * n)
        comm.all_gather_into_tensor(got, _part(comm.rank, n))
        return got.view(torch.int32)

    with FakeCohort(2, direct=True) as c:
        for got in c.run(body):
            assert got.equal(_want(2, n))


def test_input_shapes_are_the_schema_and_a_mismatch_leaves_every_rank_in_step():
    """Ranks whose inputs differ in shape (the c10d backend shapes a dtype's code into
    them), or that call another collective, all raise; the next gather works."""
    def body(comm):
        out = torch.zeros(8)
        with pytest.raises(SchemaMismatchError):
            comm.all_gather_into_tensor(out, torch.ones((1, 4) if comm.rank else (4,)))
        with pytest.raises(SchemaMismatchError):
            if comm.rank == 0:
                comm.all_gather_into_tensor(out, torch.ones(4))
            else:  # a broadcast of the same schema is not a gather
                comm.broadcast_([torch.ones(4)], 0)
        with pytest.raises(SchemaMismatchError):
            if comm.rank == 0:
                comm.all_gather_into_tensor(out, torch.ones(4))
            else:
                comm.all_reduce_weighted([torch.ones(4)], RoundKind.CONTROL, 0.0)
        comm.all_gather_into_tensor(out, torch.full((4,), float(comm.rank)))
        return out.tolist()

    with FakeCohort(2) as c:
        assert c.run(body) == [[0.0] * 4 + [1.0] * 4] * 2


@pytest.mark.parametrize("n", [4, 40_000], ids=["slot", "direct"])
def test_a_dead_rank_makes_the_others_raise_naming_it(n, monkeypatch):
    monkeypatch.setenv("FLODL_SHM_DIRECT_BROADCAST_MIN_BYTES", str(32 << 10))

    def body(comm):
        with pytest.raises(PeerDied, match=r"rank 2 \(pid \d+\) died before publishing its "
                                           r"part of the all-gather"):
            comm.all_gather_into_tensor(torch.zeros(3 * n), torch.ones(n))
        return True

    with FakeCohort(3, direct=n > 4) as c:
        c.declare_dead(2)
        assert c.run(body, ranks=[0, 1])[:2] == [True, True]


def test_an_input_overlapping_the_output_elsewhere_is_refused():
    def body(comm):
        out = torch.zeros(8)
        with pytest.raises(ValueError, match="input overlaps output other than as this "
                                             "rank's part"):
            comm.all_gather_into_tensor(out, out[1:5])
        return True

    with FakeCohort(2) as c:
        assert c.run(body) == [True, True]


# --- reduce_scatter_tensor -------------------------------------------------------------

def _values(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, generator=g) * 1e3
    x[:4] = torch.tensor([-0.0, float("inf"), 1e-40, float("nan")])[:n]  # -0, inf, subnormal
    return x


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("m", [1, 7, 1000, 30_003], ids=["1", "7", "1000", "over-the-slot"])
@pytest.mark.parametrize("kind", [RoundKind.CONTROL, RoundKind.MODEL], ids=["sum", "mean"])
@pytest.mark.parametrize("hooked", [False, True], ids=["compiled", "all-reduced"])
def test_each_rank_gets_the_all_reduce_s_bits_of_its_part(world, m, kind, hooked):
    """Against ``all_reduce_scaled`` of the same inputs, bit for bit: one round that fits
    the slot (each rank sums its part), an input over a 64 KiB slot or a fault hook (the
    all-reduce path); into a fresh output and into this rank's part of the input."""
    def body(comm):
        if hooked:
            comm._engine.fault_hook = lambda where, rnd: None
        x = _values(comm.rank, world * m)
        (ref,), _ = comm.all_reduce_scaled([x], 1.0, kind)
        want = ref[comm.rank * m:(comm.rank + 1) * m].view(torch.int32)
        got = torch.full((m,), 7.0)
        comm.reduce_scatter_tensor(got, x, kind)
        inside = x.clone()
        comm.reduce_scatter_tensor(inside[comm.rank * m:(comm.rank + 1) * m], inside, kind)
        return (got.view(torch.int32).equal(want),
                inside[comm.rank * m:(comm.rank + 1) * m].view(torch.int32).equal(want))

    with FakeCohort(world, eager_bytes=SLOT) as c:
        assert c.run(body) == [(True, True)] * world


def test_a_dead_rank_leaves_the_sum_and_mean_of_the_others():
    """As ``all_reduce_`` does: the survivors' contributions, the mean over their mass;
    the dead rank's part is nobody's to compute."""
    def body(comm):
        x = torch.full((12,), float(comm.rank + 1))
        s, mean = torch.zeros(4), torch.zeros(4)
        comm.reduce_scatter_tensor(s, x)
        comm.reduce_scatter_tensor(mean, x, RoundKind.MODEL)
        return s.tolist(), mean.tolist()

    with FakeCohort(3) as c:
        c.declare_dead(2)
        assert c.run(body, ranks=[0, 1])[:2] == [([3.0] * 4, [1.5] * 4)] * 2


def test_a_reduce_scatter_never_pairs_with_an_all_reduce_of_its_schema():
    def body(comm):
        x, out = torch.ones(8), torch.zeros(4)
        with pytest.raises(SchemaMismatchError):
            if comm.rank == 0:
                comm.reduce_scatter_tensor(out, x)
            else:
                comm.all_reduce_weighted([x], RoundKind.CONTROL, 1.0)
        # nor with an all-gather of its sizes; the message names each rank's collective
        with pytest.raises(SchemaMismatchError, match=r"(?s)rank 0: .*reduce-scatter, eager "
                                                      r"path.*rank 1: .*all-gather, eager"):
            if comm.rank == 0:
                comm.reduce_scatter_tensor(out, x)
            else:
                comm.all_gather_into_tensor(torch.zeros(16), x)
        comm.reduce_scatter_tensor(out, torch.full((8,), float(comm.rank)))
        return out.tolist()

    with FakeCohort(2) as c:
        assert c.run(body) == [[1.0] * 4] * 2


_GATHER = lambda comm, out, t: comm.all_gather_into_tensor(out, t)  # noqa: E731
_SCATTER = lambda kind: lambda comm, out, t: comm.reduce_scatter_tensor(out, t, kind)  # noqa: E731


@pytest.mark.parametrize("call, output, input, match", [
    (_GATHER, lambda: torch.zeros(7), lambda: torch.ones(4),
     "output has 7 elements, a world of 2 inputs of 4 needs 8"),
    (_GATHER, lambda: torch.zeros(8, dtype=torch.float64), lambda: torch.ones(4),
     "output must be a contiguous float32 CPU tensor, got torch.float64"),
    (_GATHER, lambda: torch.zeros(8), lambda: torch.ones(8)[::2], "input must be a contiguous"),
    (_GATHER, lambda: torch.zeros(8), lambda: [1.0], "input must be a torch.Tensor, got list"),
    (_SCATTER(RoundKind.CONTROL), lambda: torch.zeros(4), lambda: torch.ones(7),
     "input has 7 elements, a world of 2 parts of the output's 4 needs 8"),
    (_SCATTER(RoundKind.CONTROL), lambda: torch.zeros(4, dtype=torch.bfloat16),
     lambda: torch.ones(8), "output must be a contiguous float32 CPU tensor, got torch.bfloat16"),
    (_SCATTER(RoundKind.CONTROL), lambda: torch.zeros(4), lambda: torch.ones(16)[::2],
     "input must be a contiguous"),
    (_SCATTER(5), lambda: torch.zeros(4), lambda: torch.ones(8), "kind must be RoundKind.CONTROL"),
], ids=["gather-size", "gather-dtype", "gather-strided", "gather-list", "scatter-size",
        "scatter-dtype", "scatter-strided", "scatter-kind"])
def test_bad_arguments_are_refused_before_any_round(call, output, input, match):
    def body(comm):
        with pytest.raises((ValueError, TypeError), match=match):
            call(comm, output(), input())
        out = torch.zeros(8)  # nothing was published: the next calls pair up
        comm.all_gather_into_tensor(out, torch.full((4,), float(comm.rank)))
        part = torch.zeros(4)
        comm.reduce_scatter_tensor(part, torch.full((8,), float(comm.rank)))
        return out.tolist(), part.tolist()

    with FakeCohort(2) as c:
        assert c.run(body) == [([0.0] * 4 + [1.0] * 4, [1.0] * 4)] * 2


def test_ranks_whose_chunked_sizes_differ_mismatch_at_the_first_round():
    """Parts over the slot go in chunk rounds whose first chunks are alike; the schema
    names the whole part, so every rank raises at once instead of pairing chunk rounds
    of different calls."""
    def body(comm):
        # whole chunks: 2 rounds on rank 0, 3 on rank 1, alike but for the count
        chunk = comm._slot_words(RoundKind.CONTROL, 2)
        with pytest.raises(SchemaMismatchError):
            n = chunk * (2 + comm.rank)
            comm.all_gather_into_tensor(torch.zeros(2 * n), torch.ones(n))
        with pytest.raises(SchemaMismatchError):
            m = chunk // 2 // 16 * 16 * (2 + comm.rank)
            comm.reduce_scatter_tensor(torch.zeros(m), torch.ones(2 * m))
        out = torch.zeros(4)
        comm.reduce_scatter_tensor(out, torch.full((8,), float(comm.rank)))
        return out.tolist()

    with FakeCohort(2, eager_bytes=SLOT) as c:
        assert c.run(body) == [[1.0] * 4] * 2


def test_an_output_inside_the_input_off_its_parts_gets_the_right_sum_in_chunk_rounds():
    """Chunk rounds read the input after earlier rounds wrote the output: an output that
    lies in the input but not on a part's boundary goes through a stand-in."""
    m = 20_000  # 2 ranks: 160 KB of input, three chunk rounds of a 64 KiB slot

    def body(comm):
        x = _values(comm.rank, 2 * m)
        (ref,), _ = comm.all_reduce_scaled([x.clone()], 1.0, RoundKind.CONTROL)
        comm.reduce_scatter_tensor(x[m // 2:m // 2 + m], x)  # (half of each of two parts)
        return x[m // 2:m // 2 + m].view(torch.int32).equal(
            ref[comm.rank * m:(comm.rank + 1) * m].view(torch.int32))

    with FakeCohort(2, eager_bytes=SLOT) as c:
        assert c.run(body) == [True, True]


def test_reduce_scatter_input_shapes_are_the_schema_in_chunk_rounds_too():
    def body(comm):
        m = 20_000
        x = torch.ones((2, m) if comm.rank else (2 * m,))
        with pytest.raises(SchemaMismatchError):
            comm.reduce_scatter_tensor(torch.zeros(m), x)
        out = torch.zeros(4)
        comm.reduce_scatter_tensor(out, torch.full((8,), float(comm.rank)))
        return out.tolist()

    with FakeCohort(2, eager_bytes=SLOT) as c:
        assert c.run(body) == [[1.0] * 4] * 2
