"""ChunkPool and epoch permutations (spec §9.2): dispatch order, forfeits, rollbacks,
coverage export/import, and property tests that every sample is trained exactly once."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flodl_shm import ChunkPool, CoverageBlock, EpochCoverage
from flodl_shm.training.coverage import (
    SHUFFLE_BASE_SEED,
    coverage_block,
    epoch_permutation,
    merge_ranges,
    pools_from_coverage,
)


# --- dispatch order --------------------------------------------------------------------------


def test_equal_spans_and_own_span_front():
    pool = ChunkPool(0, 1000, 2)
    assert pool.remaining() == 1000 and not pool.is_epoch_done()
    assert pool.take_chunk(300, 0) == (0, 300)
    assert pool.take_chunk(200, 1) == (500, 200)
    assert pool.remaining() == 500
    assert pool.reservation(0) == (300, 200)
    assert pool.reservation(1) == (700, 300)


def test_remainder_goes_to_the_last_span():
    pool = ChunkPool(0, 10, 3)
    assert [pool.reservation(r) for r in range(3)] == [(0, 3), (3, 3), (6, 4)]


def test_takes_are_clamped_to_the_span_then_exhaust():
    pool = ChunkPool(0, 100, 2)
    assert pool.take_chunk(80, 0) == (0, 50)
    assert pool.take_chunk(50, 1) == (50, 50)
    assert pool.take_chunk(10, 0) is None
    assert pool.remaining() == 0


def test_steal_from_the_tail_of_the_largest_residue():
    pool = ChunkPool.with_spans(0, 100, [70, 30])
    assert pool.take_chunk(30, 1) == (70, 30)
    assert pool.take_chunk(20, 1) == (50, 20)  # peeled off rank 0's tail
    assert pool.reservation(0) == (0, 50)
    assert pool.take_chunk(60, 0) == (0, 50)
    assert pool.take_chunk(10, 0) is None
    pool.mark_completed(0, 50)
    pool.mark_completed(1, 50)
    assert pool.is_epoch_done()


def test_steal_picks_the_largest_residue_among_several():
    pool = ChunkPool.with_spans(0, 60, [10, 20, 30])
    assert pool.take_chunk(10, 0) == (0, 10)
    assert pool.take_chunk(5, 0) == (55, 5)  # rank 2 has the largest residue (30)
    assert pool.take_chunk(100, 1) == (10, 20)
    # rank 1 out of span: donors rank 2 (25 left); rank 0 has nothing
    assert pool.take_chunk(100, 1) == (30, 25)


def test_empty_pool_is_done_and_takes_nothing():
    pool = ChunkPool(0, 0, 2)
    assert pool.remaining() == 0 and pool.is_epoch_done()
    assert pool.take_chunk(10, 0) is None
    assert pool.uncovered_ranges() == []


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="size must be >= 1"):
        ChunkPool(0, 10, 2).take_chunk(0, 0)
    with pytest.raises(ValueError, match="rank 2 must be < world_size 2"):
        ChunkPool(0, 10, 2).take_chunk(1, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ChunkPool(0, 10, 0)
    with pytest.raises(ValueError, match="sum to total_samples 10"):
        ChunkPool.with_spans(0, 10, [3, 3])
    with pytest.raises(ValueError, match="samples must be >= 0"):
        ChunkPool(0, 10, 2).mark_completed(0, -1)


# --- completions, forfeits, rollbacks ---------------------------------------------------------


def test_incremental_completion():
    pool = ChunkPool(0, 200, 2)
    assert pool.take_chunk(50, 0) == (0, 50)
    assert pool.take_chunk(50, 1) == (100, 50)
    assert pool.take_chunk(50, 0) == (50, 50)
    assert pool.take_chunk(50, 1) == (150, 50)
    pool.mark_completed(0, 50)
    pool.mark_completed(1, 50)
    assert not pool.is_epoch_done() and pool.in_flight(0) == 50
    pool.mark_completed(0, 50)
    pool.mark_completed(1, 50)
    assert pool.is_epoch_done()
    assert pool.dispatched == (100, 100) and pool.completed == (100, 100)
    assert pool.chunks_sent == (2, 2)


def test_partial_completion_shrinks_the_front_chunk():
    pool = ChunkPool(0, 100, 1)
    pool.take_chunk(30, 0)
    pool.take_chunk(30, 0)
    pool.mark_completed(0, 40)  # first chunk done, 10 of the second
    assert pool.uncovered_ranges() == [(40, 60)]


def test_forfeit_reclaims_in_flight_and_is_idempotent():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(50, 0)
    pool.take_chunk(50, 1)
    pool.mark_completed(1, 50)
    assert pool.forfeit(1) == 0
    assert pool.forfeit(0) == 50
    assert pool.forfeit(0) == 0
    assert pool.remaining() == 50 and pool.in_flight(0) == 0
    assert not pool.is_epoch_done()
    assert pool.take_chunk(50, 1) == (0, 50)
    pool.mark_completed(1, 50)
    assert pool.is_epoch_done()


def test_reclaimed_ranges_come_back_in_dispatch_order_and_split():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(30, 0)
    pool.take_chunk(20, 0)
    assert pool.forfeit(0) == 50
    assert pool.take_chunk(25, 1) == (0, 25)
    assert pool.take_chunk(25, 1) == (25, 5)
    assert pool.take_chunk(25, 1) == (30, 20)
    assert pool.take_chunk(25, 1) == (50, 25)  # back to its own span
    assert pool.remaining() == 25


def test_completion_after_forfeit_clamps_and_the_epoch_still_completes():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(40, 0)
    pool.forfeit(0)
    pool.mark_completed(0, 40)  # the "dead" rank reports anyway
    assert pool.in_flight(0) == 0 and pool.completed[0] == 0
    assert pool.take_chunk(40, 1) == (0, 40)
    pool.mark_completed(1, 40)
    assert pool.take_chunk(60, 1) == (50, 50)
    pool.mark_completed(1, 50)
    assert pool.take_chunk(60, 1) == (40, 10)  # the dead rank's span residue, by tail steal
    pool.mark_completed(1, 10)
    assert pool.is_epoch_done()


def test_rollback_rewinds_the_cursor():
    pool = ChunkPool(0, 100, 2)
    off, n = pool.take_chunk(40, 0)
    pool.rollback_take(0, off, n)
    assert pool.remaining() == 100 and pool.in_flight(0) == 0 and pool.chunks_sent[0] == 0
    assert pool.take_chunk(40, 0) == (0, 40)


def test_rollback_after_a_later_take_reclaims():
    pool = ChunkPool(0, 100, 2)
    off, n = pool.take_chunk(20, 0)
    pool.take_chunk(20, 0)
    pool.rollback_take(0, off, n)  # not the newest: cursor cannot rewind past (20, 20)
    assert pool.remaining() == 80
    assert pool.in_flight(0) == 20 and pool.chunks_sent[0] == 1
    assert pool.take_chunk(20, 1) == (0, 20)


def test_rollback_of_an_unknown_chunk_changes_nothing():
    pool = ChunkPool(0, 100, 2)
    pool.take_chunk(40, 0)
    pool.rollback_take(0, 50, 10)
    assert pool.in_flight(0) == 40 and pool.remaining() == 60 and pool.chunks_sent[0] == 1


# --- coverage export / import ----------------------------------------------------------------


def test_uncovered_counts_in_flight_and_merges():
    pool = ChunkPool(0, 100, 2)
    assert pool.uncovered_ranges() == [(0, 100)]
    pool.take_chunk(20, 0)  # (0, 20) in flight
    pool.take_chunk(10, 1)  # (50, 10) in flight
    pool.mark_completed(1, 10)
    # rank 0: in flight (0,20) + residue (20,30) -> (0,50); rank 1 residue (60,40)
    assert pool.uncovered_ranges() == [(0, 50), (60, 40)]
    pool.mark_completed(0, 20)
    assert pool.uncovered_ranges() == [(20, 30), (60, 40)]


def test_from_coverage_serves_exactly_the_holes_in_order():
    pool = ChunkPool.from_coverage(7, 1024, 3, [(320, 64), (640, 384), (900, 0)])
    assert pool.remaining() == 448
    assert pool.uncovered_ranges() == [(320, 64), (640, 384)]
    got = []
    while (c := pool.take_chunk(100, len(got) % 3)) is not None:
        got.append(c)
    assert got == [(320, 64), (640, 100), (740, 100), (840, 100), (940, 84)]
    for r in range(3):
        pool.mark_completed(r, pool.in_flight(r))
    assert pool.is_epoch_done()


def test_from_coverage_rejects_corrupt_records():
    with pytest.raises(ValueError, match="outside"):
        ChunkPool.from_coverage(0, 100, 2, [(90, 20)])
    with pytest.raises(ValueError, match="overlap"):
        ChunkPool.from_coverage(0, 100, 2, [(0, 20), (10, 5)])


def test_meta_type_roundtrip():
    a = ChunkPool(7, 1024, 2)
    a.take_chunk(320, 0)
    a.mark_completed(0, 320)
    b = ChunkPool(8, 1024, 2)
    block = coverage_block([b, a], seed=SHUFFLE_BASE_SEED, batch_size=32)
    assert block == CoverageBlock(seed=42, batch_size=32, per_epoch=[
        EpochCoverage(7, 1024, [(320, 704)]),
        EpochCoverage(8, 1024, [(0, 1024)]),
    ])
    pools = pools_from_coverage(block, world_size=3, batch_size=32)
    assert sorted(pools) == [7, 8]
    assert pools[7].uncovered_ranges() == [(320, 704)]
    assert pools[7].remaining() == 704 and pools[8].remaining() == 1024
    with pytest.raises(ValueError, match="batch_size 32 but this run uses 64"):
        pools_from_coverage(block, 3, batch_size=64)


def test_a_coverage_record_of_partial_batches_is_refused_not_trained_forever():
    """The pool hands out whole batches: a hand-edited record whose range is not whole
    batches (offset 5 of batches of 32) was planned as empty windows over and over, and
    the resume never ended."""
    for ranges in ([(5, 95)], [(32, 40)]):
        block = CoverageBlock(seed=42, batch_size=32, per_epoch=[EpochCoverage(0, 1024, ranges)])
        with pytest.raises(ValueError, match=r"not a whole number of batches of 32.*edited"):
            pools_from_coverage(block, 2, batch_size=32)
    ok = CoverageBlock(seed=42, batch_size=32, per_epoch=[EpochCoverage(0, 1024, [(64, 96)])])
    assert pools_from_coverage(ok, 2, batch_size=32)[0].remaining() == 96


def test_merge_ranges():
    assert merge_ranges([(10, 5), (0, 10), (20, 0), (15, 1), (30, 2)]) == [(0, 16), (30, 2)]


# --- permutation ------------------------------------------------------------------------------


def test_permutation_is_a_deterministic_permutation():
    p = epoch_permutation(42, 3, 1000)
    assert p.dtype == np.int64
    assert np.array_equal(np.sort(p), np.arange(1000))
    assert np.array_equal(p, epoch_permutation(42, 3, 1000))
    assert np.array_equal(p, epoch_permutation(40, 5, 1000))  # depends on seed + epoch only
    assert not np.array_equal(p, epoch_permutation(42, 4, 1000))
    assert not np.array_equal(p, np.arange(1000))


def test_permutation_follows_the_documented_algorithm():
    """Re-derive the shuffle from PCG64's raw stream in plain Python."""
    n = 257
    raw = np.random.PCG64(42 + 1).random_raw(n - 1)
    perm = list(range(n))
    for k, i in enumerate(range(n - 1, 0, -1)):
        u = int(raw[k] >> np.uint64(11)) * 2.0 ** -53
        j = min(int(u * (i + 1)), i)
        perm[i], perm[j] = perm[j], perm[i]
    assert epoch_permutation(42, 1, n).tolist() == perm


def test_permutation_edges():
    assert epoch_permutation(0, 0, 0).tolist() == []
    assert epoch_permutation(0, 0, 1).tolist() == [0]
    with pytest.raises(ValueError, match="seed \\+ epoch must be >= 0"):
        epoch_permutation(-5, 1, 10)


def test_permutation_is_roughly_uniform():
    # position of element 0 over many seeds: no index is strongly favoured
    n, trials = 8, 4000
    counts = np.zeros(n, int)
    for s in range(trials):
        counts[int(np.argmax(epoch_permutation(s, 0, n) == 0))] += 1
    assert counts.min() > trials / n * 0.8 and counts.max() < trials / n * 1.2


# --- properties -----------------------------------------------------------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["take", "take", "take", "complete", "forfeit", "rollback",
                               "late", "snapshot"]),
               st.integers(0, 3), st.integers(1, 40)),
    max_size=60,
)


class Model:
    """Per-sample truth: 'free' (never dispatched or given back), 'flight' (on one rank),
    'done' (trained into the consensus). Chunks mirror the pool's FIFOs."""

    def __init__(self, total, world):
        self.state = ["free"] * total
        self.owner = [-1] * total
        self.trained = [0] * total
        self.fifo = [[] for _ in range(world)]  # [offset, size] per rank

    def take(self, rank, off, n):
        for i in range(off, off + n):
            assert self.state[i] == "free", f"sample {i} dispatched while {self.state[i]}"
            self.state[i], self.owner[i] = "flight", rank
        self.fifo[rank].append([off, n])

    def complete(self, rank, n):
        q = self.fifo[rank]
        while n > 0 and q:
            off, size = q[0]
            k = min(n, size)
            for i in range(off, off + k):
                assert self.state[i] == "flight" and self.owner[i] == rank
                self.state[i] = "done"
                self.trained[i] += 1
            n -= k
            if k == size:
                q.pop(0)
            else:
                q[0] = [off + k, size - k]

    def release(self, off, n):
        for i in range(off, off + n):
            assert self.state[i] == "flight"
            self.state[i] = "free"

    def uncovered(self):
        return merge_ranges((i, 1) for i, s in enumerate(self.state) if s != "done")


def run_ops(pool, model, ops, world):
    for kind, rank, size in ops:
        rank %= world
        if kind == "take":
            got = pool.take_chunk(size, rank)
            if got is None:
                assert model.state.count("free") == 0
            else:
                off, n = got
                assert 1 <= n <= size
                model.take(rank, off, n)
        elif kind == "complete":
            n = min(size, pool.in_flight(rank))
            pool.mark_completed(rank, n)
            model.complete(rank, n)
        elif kind == "forfeit":
            expect = sum(s for _, s in model.fifo[rank])
            assert pool.forfeit(rank) == expect
            for off, n in model.fifo[rank]:
                model.release(off, n)
            model.fifo[rank] = []
        elif kind == "rollback":
            q = model.fifo[rank]
            if q:
                off, n = q.pop(size % len(q))
                pool.rollback_take(rank, off, n)
                model.release(off, n)
        elif kind == "late":
            if not model.fifo[rank]:  # a falsely-dead rank reporting: must change nothing
                pool.mark_completed(rank, size)
        elif kind == "snapshot":
            assert pool.uncovered_ranges() == model.uncovered()
        # books agree with the truth after every step
        assert pool.remaining() == model.state.count("free")
        for r in range(world):
            assert pool.in_flight(r) == sum(s for _, s in model.fifo[r])
            assert pool.in_flight(r) == sum(1 for i, s in enumerate(model.state)
                                            if s == "flight" and model.owner[i] == r)


def drain(pool, model, world):
    """Survivors take and complete until the pool is exhausted."""
    for r in range(world):
        pool.mark_completed(r, pool.in_flight(r))
        model.complete(r, 10**9)
    r = 0
    while (got := pool.take_chunk(17, r)) is not None:
        model.take(r, *got)
        pool.mark_completed(r, got[1])
        model.complete(r, got[1])
        r = (r + 1) % world


@st.composite
def pools(draw):
    world = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(0, 60), min_size=world, max_size=world))
    return ChunkPool.with_spans(draw(st.integers(0, 5)), sum(sizes), sizes), world


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools(), OPS)
def test_every_sample_is_trained_exactly_once(pool_world, ops):
    pool, world = pool_world
    model = Model(pool.total_samples, world)
    run_ops(pool, model, ops, world)
    drain(pool, model, world)
    assert pool.is_epoch_done()
    assert pool.remaining() == 0 and pool.uncovered_ranges() == []
    assert model.trained == [1] * pool.total_samples


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pools(), OPS, st.integers(1, 4))
def test_resume_redispatches_exactly_the_uncovered_samples(pool_world, ops, new_world):
    pool, world = pool_world
    model = Model(pool.total_samples, world)
    run_ops(pool, model, ops, world)
    holes = pool.uncovered_ranges()
    assert holes == model.uncovered()

    # resume (any world size): the snapshot's in-flight work is first coverage again
    resumed = ChunkPool.from_coverage(pool.epoch, pool.total_samples, new_world, holes)
    assert resumed.uncovered_ranges() == holes
    expected = {i for off, n in holes for i in range(off, off + n)}
    assert resumed.remaining() == len(expected)
    seen: list[int] = []
    r = 0
    while (got := resumed.take_chunk(13, r)) is not None:
        off, n = got
        seen.extend(range(off, off + n))
        resumed.mark_completed(r, n)
        r = (r + 1) % new_world
    assert sorted(seen) == sorted(expected)
    assert len(seen) == len(set(seen)), "a sample was re-dispatched twice"
    assert not expected & {i for i, s in enumerate(model.state) if s == "done"}
    assert resumed.is_epoch_done()
