"""Data coverage: progressive dispatch of an epoch and its resume record (docs/runtime.md, "Coverage and resume").

An epoch is a seeded permutation of the dataset; the engine dispatches *offsets*
into it. A :class:`ChunkPool` hands those offsets out in chunks, tracks what is
in flight on which rank, returns a dead rank's unfinished chunks to the pool,
and records what has NOT yet been trained into the consensus, so a resume
re-dispatches exactly that - no covered sample trained twice, no in-flight
sample dropped.

Reservations. ``[0, total)`` is split into contiguous per-rank *spans* in rank
order. A rank takes chunks from the front of its own span, so its upcoming data
is known for the whole epoch (the basis for staging it ahead). A rank that runs
out steals from the *tail* of the span with the largest residue: the owner eats
its span front to back and a thief peels it back to front, so they can meet but
never cross.

Books. Per rank: ``dispatched`` (samples handed out), ``completed`` (samples
reported done) and the FIFO of outstanding chunks, with the invariant
``sum(outstanding) == dispatched - completed``. Pool-wide: the ``reclaimed``
queue of ranges returned by :meth:`ChunkPool.forfeit` (served before anything
else: coverage holes close first).

Permutation. :func:`epoch_permutation` derives epoch ``e``'s order from
``seed + e`` with NumPy's PCG64 bit generator and a documented Fisher-Yates
shuffle, so only uncovered *ranges* ever need recording. flodl's own RNG is not
published, so coverage records are portable between flodl_shm runs,
not between flodl_shm and Rust flodl.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Iterable, Optional, Sequence


from ..kernels.permutation import epoch_permutation

if TYPE_CHECKING:
    from ..checkpoint.meta import CoverageBlock, EpochCoverage

logger = logging.getLogger("flodl_shm")

__all__ = [
    "SHUFFLE_BASE_SEED",
    "ChunkPool",
    "coverage_block",
    "epoch_permutation",
    "merge_ranges",
    "pools_from_coverage",
]

#: flodl's default shuffle base seed; epoch ``e`` is shuffled with ``seed + e``.
SHUFFLE_BASE_SEED = 42



# ---------------------------------------------------------------------------
# Ranges
# ---------------------------------------------------------------------------


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, size)`` ranges sorted by offset, empty ones dropped and abutting
    ones coalesced. Overlapping input is merged too (the pool never produces it)."""
    items = sorted((int(o), int(s)) for o, s in ranges if s > 0)
    out: list[tuple[int, int]] = []
    for off, size in items:
        if out and off <= out[-1][0] + out[-1][1]:
            last_off, last_size = out[-1]
            out[-1] = (last_off, max(last_off + last_size, off + size) - last_off)
        else:
            out.append((off, size))
    return out


# ---------------------------------------------------------------------------
# ChunkPool
# ---------------------------------------------------------------------------


class ChunkPool:
    """Progressive dispatch of one epoch's offsets, with per-rank reservations.

    Args:
        epoch: the epoch index (recorded in coverage).
        total_samples: the batch-aligned number of offsets, ``[0, total)``.
        world_size: number of ranks; spans are equal, the remainder going to the
            last rank. Use :meth:`with_spans` for throughput-proportional spans.

    Not thread-safe: one coordinator owns a pool.
    """

    def __init__(self, epoch: int, total_samples: int, world_size: int) -> None:
        total_samples, world_size = int(total_samples), int(world_size)
        if world_size < 1:
            raise ValueError(f"ChunkPool world_size must be >= 1, got {world_size}")
        if total_samples < 0:
            raise ValueError(f"ChunkPool total_samples must be >= 0, got {total_samples}")
        base = total_samples // world_size
        sizes = [base] * world_size
        sizes[-1] += total_samples - base * world_size
        self._init(int(epoch), total_samples, sizes)

    @classmethod
    def with_spans(cls, epoch: int, total_samples: int, span_sizes: Sequence[int]) -> "ChunkPool":
        """A pool whose rank ``r`` reserves ``span_sizes[r]`` offsets, laid out in rank
        order. The sizes must be non-negative and sum to ``total_samples``."""
        sizes = [int(s) for s in span_sizes]
        if not sizes:
            raise ValueError("ChunkPool needs at least one span (world_size >= 1)")
        if any(s < 0 for s in sizes) or sum(sizes) != int(total_samples):
            raise ValueError(
                f"span sizes {sizes} must be non-negative and sum to total_samples "
                f"{total_samples} (they sum to {sum(sizes)})"
            )
        pool = cls.__new__(cls)
        pool._init(int(epoch), int(total_samples), sizes)
        return pool

    @classmethod
    def from_coverage(cls, epoch: int, total_samples: int, world_size: int,
                      uncovered: Iterable[tuple[int, int]]) -> "ChunkPool":
        """Rebuild a pool whose only work is ``uncovered`` (from :meth:`uncovered_ranges`).

        Every span is parked at its end (no fresh samples); the uncovered ranges
        (size > 0) are staged in the reclaimed queue and served in offset order,
        each exactly once. Re-dispatching a range that was in flight at the
        snapshot is first coverage, not a repeat.

        Raises:
            ValueError: a range falls outside ``[0, total_samples)`` or two ranges
                overlap - the record is corrupt or belongs to another pool size.
        """
        pool = cls(epoch, total_samples, world_size)
        ranges = sorted((int(o), int(s)) for o, s in uncovered if int(s) > 0)
        end_prev = 0
        for off, size in ranges:
            if off < 0 or off + size > pool.total_samples:
                raise ValueError(
                    f"uncovered range (offset {off}, size {size}) of epoch {epoch} lies outside "
                    f"[0, {pool.total_samples}); the coverage record does not match this "
                    "epoch's total_samples"
                )
            if off < end_prev:
                raise ValueError(
                    f"uncovered ranges of epoch {epoch} overlap at offset {off}; the coverage "
                    "record is corrupt (ranges must be disjoint)"
                )
            end_prev = off + size
        for r in range(pool.world_size):
            pool._cursor[r] = pool._spans[r][1]
        pool._reclaimed = deque(ranges)
        return pool

    @classmethod
    def from_epoch_coverage(cls, coverage: "EpochCoverage", world_size: int) -> "ChunkPool":
        """:meth:`from_coverage` from a checkpoint's :class:`EpochCoverage`."""
        return cls.from_coverage(coverage.epoch, coverage.total_samples, world_size,
                                 coverage.uncovered_ranges)

    def _init(self, epoch: int, total_samples: int, sizes: list[int]) -> None:
        self.epoch = epoch
        self.total_samples = total_samples
        self._spans: list[list[int]] = []  # [start, end); end moves down when stolen from
        self._cursor: list[int] = []
        at = 0
        for s in sizes:
            self._spans.append([at, at + s])
            self._cursor.append(at)
            at += s
        w = len(sizes)
        self._dispatched = [0] * w
        self._completed = [0] * w
        self._chunks_sent = [0] * w
        self._outstanding: list[deque[list[int]]] = [deque() for _ in range(w)]
        self._reclaimed: deque[tuple[int, int]] = deque()

    def __repr__(self) -> str:
        return (
            f"ChunkPool(epoch={self.epoch}, total_samples={self.total_samples}, "
            f"world_size={self.world_size}, remaining={self.remaining()}, "
            f"in_flight={[self.in_flight(r) for r in range(self.world_size)]})"
        )

    # -- queries ----------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self._spans)

    @property
    def dispatched(self) -> tuple[int, ...]:
        """Per rank: samples handed out (forfeited and rolled-back chunks excluded)."""
        return tuple(self._dispatched)

    @property
    def completed(self) -> tuple[int, ...]:
        """Per rank: samples reported done."""
        return tuple(self._completed)

    @property
    def chunks_sent(self) -> tuple[int, ...]:
        """Per rank: chunks handed out (rollbacks excluded)."""
        return tuple(self._chunks_sent)

    def residue(self, rank: int) -> int:
        """Unassigned offsets left in ``rank``'s own span."""
        return self._residue(self._rank(rank))

    def _residue(self, r: int) -> int:
        # the pool's own queries call this with ranks they enumerate: a coordinator asks
        # several of them per window, right after training (no validation, no max())
        left = self._spans[r][1] - self._cursor[r]
        return left if left > 0 else 0

    def reservation(self, rank: int) -> tuple[int, int]:
        """``(next_offset, length)`` of the rank's unassigned span front: what it will
        train next unless someone steals the tail."""
        r = self._rank(rank)
        return self._cursor[r], self._residue(r)

    def in_flight(self, rank: int) -> int:
        """Samples dispatched to ``rank`` and not yet reported done."""
        r = self._rank(rank)
        return max(self._dispatched[r] - self._completed[r], 0)

    def remaining(self) -> int:
        """Samples not assigned to any rank: every span residue plus reclaimed ranges."""
        total = 0
        for r in range(len(self._spans)):
            total += self._residue(r)
        for _, size in self._reclaimed:
            total += size
        return total

    def is_epoch_done(self) -> bool:
        """All offsets dispatched, nothing reclaimed waiting, every rank's dispatch
        completed."""
        if self._reclaimed:
            return False
        for r in range(len(self._spans)):
            if self._residue(r) or self._completed[r] < self._dispatched[r]:
                return False
        return True

    def uncovered_ranges(self) -> list[tuple[int, int]]:
        """The offsets NOT trained into the consensus yet, sorted and coalesced.

        That is every span's unassigned remainder, every outstanding chunk and every
        reclaimed range. In-flight work counts as uncovered: its gradient is not in
        the consensus yet, so a resume must dispatch it again as first coverage.
        """
        ranges: list[tuple[int, int]] = []
        for r in range(self.world_size):
            res = self._residue(r)
            if res > 0:
                ranges.append((self._cursor[r], res))
        for q in self._outstanding:
            ranges.extend((o, s) for o, s in q if s > 0)
        ranges.extend(self._reclaimed)
        return merge_ranges(ranges)

    def to_epoch_coverage(self) -> "EpochCoverage":
        """This pool's resume record."""
        from ..checkpoint.meta import EpochCoverage

        return EpochCoverage(epoch=self.epoch, total_samples=self.total_samples,
                             uncovered_ranges=self.uncovered_ranges())

    # -- dispatch ---------------------------------------------------------------------

    def take_chunk(self, size: int, rank: int) -> Optional[tuple[int, int]]:
        """Hand ``rank`` up to ``size`` contiguous offsets: ``(offset, n)``, or ``None``
        when the pool is exhausted.

        Sources, in order: (1) the reclaimed queue (holes close first; a larger
        range is split and its tail kept for the next taker); (2) the front of the
        rank's own span; (3) the tail of the other rank's span with the largest
        residue (ties: the highest rank). ``n`` may be less than ``size``. The chunk
        joins the rank's outstanding FIFO.
        """
        r = self._rank(rank)
        size = int(size)
        if size < 1:
            raise ValueError(f"take_chunk size must be >= 1 sample, got {size}")
        if self._reclaimed:
            off, rsize = self._reclaimed.popleft()
            n = min(size, rsize)
            if n < rsize:
                self._reclaimed.appendleft((off + n, rsize - n))
            return self._dispatch(r, off, n)
        res = self._residue(r)
        if res > 0:
            n = min(size, res)
            off = self._cursor[r]
            self._cursor[r] += n
            return self._dispatch(r, off, n)
        donor, best = -1, 0
        for d in range(self.world_size):
            if d != r:
                dres = self._residue(d)
                if dres > 0 and dres >= best:  # ties: the highest rank, as flodl's max_by_key
                    donor, best = d, dres
        if donor < 0:
            return None
        n = min(size, best)
        self._spans[donor][1] -= n
        return self._dispatch(r, self._spans[donor][1], n)

    def _dispatch(self, r: int, off: int, n: int) -> tuple[int, int]:
        self._dispatched[r] += n
        self._chunks_sent[r] += 1
        self._outstanding[r].append([off, n])
        return off, n

    def rollback_take(self, rank: int, offset: int, size: int) -> None:
        """Undo a take whose send failed, so the samples are not stuck in flight.

        Meant for the rank's newest chunk; an older outstanding chunk with exactly
        this ``(offset, size)`` is rolled back too (logged as an anomaly). When the
        chunk came off the rank's own span front and nothing was taken after it,
        the cursor rewinds; otherwise the range goes to the front of the reclaimed
        queue. A range that is not outstanding is ignored (logged): reclaiming an
        unknown range could serve covered samples twice.
        """
        r = self._rank(rank)
        offset, size = int(offset), int(size)
        if size <= 0:
            return
        q = self._outstanding[r]
        if q and q[-1] == [offset, size]:
            q.pop()
        else:
            pos = next((i for i in range(len(q) - 1, -1, -1) if q[i] == [offset, size]), None)
            if pos is None:
                logger.warning(
                    "rollback_take(rank %d, offset %d, size %d) matches no outstanding chunk: "
                    "ignored (nothing to roll back)", r, offset, size,
                )
                return
            logger.warning(
                "rollback_take(rank %d, offset %d, size %d) was not the newest outstanding "
                "chunk: reclaiming it (dispatch-ordering anomaly)", r, offset, size,
            )
            del q[pos]
        self._dispatched[r] = max(self._dispatched[r] - size, 0)
        self._chunks_sent[r] = max(self._chunks_sent[r] - 1, 0)
        start, _ = self._spans[r]
        if self._cursor[r] == offset + size and offset >= start:
            self._cursor[r] = offset
        else:
            self._reclaimed.appendleft((offset, size))

    def mark_completed(self, rank: int, samples: int) -> None:
        """Credit ``samples`` completed by ``rank``, consuming its outstanding chunks
        front first (a partial credit shrinks the front chunk).

        A credit beyond what is in flight is clamped, with a log: the rank was
        falsely declared dead, its chunks were forfeited and re-dispatched, and it
        reported anyway. Those samples get trained twice (harmless); the books must
        not underflow.
        """
        r = self._rank(rank)
        samples = int(samples)
        if samples < 0:
            raise ValueError(f"mark_completed samples must be >= 0, got {samples} for rank {r}")
        self._completed[r] += samples
        if self._completed[r] > self._dispatched[r]:
            logger.info(
                "rank %d reported completion after its chunks were forfeited (completed %d > "
                "dispatched %d): clamping", r, self._completed[r], self._dispatched[r],
            )
            self._completed[r] = self._dispatched[r]
        left = samples
        q = self._outstanding[r]
        while left > 0 and q:
            front = q[0]
            if front[1] <= left:
                left -= front[1]
                q.popleft()
            else:
                front[0] += left
                front[1] -= left
                left = 0

    def forfeit(self, rank: int) -> int:
        """Return a dead rank's outstanding chunks to the pool (reclaimed, in dispatch
        order) and clear its in-flight count. Returns the samples reclaimed;
        idempotent (a second call returns 0)."""
        r = self._rank(rank)
        total = 0
        q = self._outstanding[r]
        while q:
            off, size = q.popleft()
            total += size
            self._reclaimed.append((off, size))
        self._dispatched[r] = max(self._dispatched[r] - total, 0)
        if total:
            logger.info("rank %d forfeited %d in-flight samples of epoch %d", r, total, self.epoch)
        return total

    def _rank(self, rank: int) -> int:
        rank = int(rank)
        if not 0 <= rank < len(self._spans):
            raise ValueError(f"rank {rank} must be < world_size {len(self._spans)}")
        return rank


# ---------------------------------------------------------------------------
# Checkpoint conversions
# ---------------------------------------------------------------------------


def coverage_block(pools: Iterable[ChunkPool], seed: int, batch_size: int,
                   dataset_len: Optional[int] = None) -> "CoverageBlock":
    """The checkpoint's coverage record: one :class:`EpochCoverage` per live pool,
    in epoch order, plus the shuffle seed, batch size and dataset length."""
    from ..checkpoint.meta import CoverageBlock

    per_epoch = [p.to_epoch_coverage() for p in sorted(pools, key=lambda p: p.epoch)]
    return CoverageBlock(seed=int(seed), batch_size=int(batch_size), per_epoch=per_epoch,
                         dataset_len=None if dataset_len is None else int(dataset_len))


def untouched(ec: "EpochCoverage") -> bool:
    """Whether the epoch coverage ``ec`` records an epoch none of whose samples was
    trained (saved at the end of the one before): a resume starts it afresh, with the
    dataset and epoch size the resuming run has."""
    return list(ec.uncovered_ranges) == [(0, ec.total_samples)]


def pools_from_coverage(block: "CoverageBlock", world_size: int,
                        batch_size: Optional[int] = None) -> dict[int, ChunkPool]:
    """Rebuild every in-progress epoch pool from a checkpoint's coverage record,
    keyed by epoch.

    Args:
        block: the record (``CheckpointMeta.coverage``).
        world_size: ranks of the resumed run (spans are rebuilt for it; only the
            uncovered ranges matter).
        batch_size: when given, must equal the record's: offsets were batch-aligned
            for that size.

    Raises:
        ValueError: the batch size differs, an epoch appears twice, a range is not
            whole batches, or a record is inconsistent (see
            :meth:`ChunkPool.from_coverage`).
    """
    if batch_size is not None and int(batch_size) != int(block.batch_size):
        raise ValueError(
            f"coverage was recorded with batch_size {block.batch_size} but this run uses "
            f"{batch_size}; resume with the saved batch size (offsets are batch-aligned to it)"
        )
    pools: dict[int, ChunkPool] = {}
    bs = int(block.batch_size)
    for ec in block.per_epoch:
        if ec.epoch in pools:
            raise ValueError(f"coverage record lists epoch {ec.epoch} twice; it is corrupt")
        unaligned = [(o, n) for o, n in [(0, ec.total_samples), *ec.uncovered_ranges]
                     if bs < 1 or o % bs or n % bs]
        if unaligned:  # the pool hands out whole batches: such a range would never drain
            o, n = unaligned[0]
            raise ValueError(
                f"coverage record of epoch {ec.epoch}: (offset {o}, size {n}) is not a whole "
                f"number of batches of {bs} (the record's batch_size); the record is corrupt "
                f"or was edited: resume from another checkpoint of the run")
        pools[ec.epoch] = ChunkPool.from_epoch_coverage(ec, world_size)
    return pools
