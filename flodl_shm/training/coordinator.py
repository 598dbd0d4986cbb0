"""The replicated coordinator: what every rank trains next, and what a checkpoint says.

flodl runs a coordinator that tells each rank how many batches to train and which
samples. flodl_shm has no coordinator *process*: every rank runs this same
deterministic state machine on the same inputs (the window's counts and acks,
:mod:`flodl_shm.training.sync_window`), so all ranks reach identical decisions without
a message of their own. Nothing here touches a ``Comm``; it is plain Python, tested
without processes.

Per window, in this order, on every rank:

1. :meth:`Coordinator.plan_window` - the per-rank batch counts (``sync_every``
   each, or ElChe's cadence, where faster ranks run proportionally more) and the
   chunks of the epoch's permutation each rank trains, taken from the epoch's
   :class:`~flodl_shm.training.coverage.ChunkPool` in rank order. Every rank runs every
   rank's takes; each trains only its own chunks.
2. (ranks train, then exchange their counts: on one host inside the params round,
   on several hosts in a count gather before it)
3. :meth:`Coordinator.settle` - completions for the ranks whose work is realized in
   this window's consensus, forfeits for the rest (a dead rank's chunks return to
   the pool and are trained by survivors later), the global step and sync round,
   the epoch boundary, and the decision to stop and/or checkpoint, with the
   :class:`~flodl_shm.checkpoint.meta.SaveReason` (the checkpoint's metadata:
   :meth:`checkpoint_meta`). On one host this follows the reduce; on several hosts
   it precedes it (a checkpoint is armed for the controller's forge), and
   :meth:`resettle` books the window again if a rank died in between.
4. :meth:`Coordinator.report` - ElChe's timing report and the convergence guard's
   verdict, from the ack that travels with the counts.

Dispatch order. Each epoch's pool starts as "everything uncovered"
(``ChunkPool.from_coverage(epoch, total, world, [(0, total)])``), i.e. one front
cursor served in rank order. A resumed epoch is built the same way from the
checkpoint's uncovered ranges, so a resumed run dispatches exactly the chunks, in
the same order, to the same ranks as the uninterrupted run would have - the basis
of bit-reproducible resume. A dead rank's forfeited chunks join the back of the
pool and are trained once, later in the epoch.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from ..checkpoint.meta import CheckpointMeta, CoverageBlock, ElCheState, SaveReason
from ..errors import plural
from .convergence import ConvergenceGuard, TrendGuard, resumed_guard
from .coverage import (SHUFFLE_BASE_SEED, ChunkPool, coverage_block, pools_from_coverage,
                       untouched)
from .el_che import ElChe, fit_counts
from .sync_window import CohortAck, CohortCounts

logger = logging.getLogger("flodl_shm")

__all__ = ["Coordinator", "CoordinatorConfig", "Settlement", "WindowPlan"]

CADENCES = ("fixed", "elche")


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything the replicated coordinator needs; identical on every rank.

    Attributes:
        world_size: ranks at launch.
        dataset_len: samples in the dataset; an epoch trains the first
            ``(dataset_len // batch_size) * batch_size`` offsets of its permutation.
        batch_size: samples per batch (every batch is full).
        epochs: epochs to train.
        seed: shuffle base seed; epoch ``e``'s order is ``epoch_permutation(seed, e, n)``.
        sync_every: batches per window (``cadence="fixed"``), or ElChe's initial
            anchor - the slowest rank's batches per window (``cadence="elche"``).
        cadence: ``"fixed"`` or ``"elche"``.
        checkpoint_every: checkpoint every this many windows (None: only at the end).
        max_failures: dead ranks tolerated; one more and the survivors save a
            ``MAX_FAILURE_EXCEEDED`` checkpoint and stop.
        start_epoch, start_global_step, start_avg_count, start_elche_state,
        start_coverage: where a resumed run starts (:meth:`resume_from_meta`).
    """

    world_size: int
    dataset_len: int
    batch_size: int
    epochs: int = 1
    seed: int = SHUFFLE_BASE_SEED
    sync_every: int = 8
    cadence: str = "fixed"
    checkpoint_every: Optional[int] = None
    max_failures: int = 0
    start_epoch: int = 0
    start_global_step: int = 0
    start_avg_count: int = 0
    start_elche_state: Optional[ElCheState] = None
    start_coverage: Optional[CoverageBlock] = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.dataset_len < self.batch_size:
            raise ValueError(
                f"the dataset has {self.dataset_len} samples, fewer than one batch of "
                f"{self.batch_size}; use a smaller batch_size")
        if self.epochs < 0:
            raise ValueError(f"epochs must be >= 0, got {self.epochs}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 batch per window, got {self.sync_every}")
        if self.cadence not in CADENCES:
            raise ValueError(f"cadence must be one of {CADENCES}, got {self.cadence!r}")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(
                f"checkpoint_every must be >= 1 window or None, got {self.checkpoint_every}")
        if self.max_failures < 0:
            raise ValueError(f"max_failures must be >= 0, got {self.max_failures}")

    @property
    def samples_per_epoch(self) -> int:
        """Offsets trained per epoch (the batch-aligned pool size)."""
        return (self.dataset_len // self.batch_size) * self.batch_size

    def resume_from_meta(self, meta: CheckpointMeta) -> "CoordinatorConfig":
        """A copy that starts where ``meta`` left off: ``start_epoch = meta.epoch``,
        ``start_global_step = meta.global_step``, ``start_avg_count = meta.sync_round``,
        ``start_elche_state = meta.elche_state`` and ``start_coverage = meta.coverage``.
        The knobs stay this config's (a resume may change them)."""
        return dataclasses.replace(
            self, start_epoch=meta.epoch, start_global_step=meta.global_step,
            start_avg_count=meta.sync_round,
            start_elche_state=copy.deepcopy(meta.elche_state),
            start_coverage=copy.deepcopy(meta.coverage))


@dataclass(frozen=True)
class WindowPlan:
    """One window's dispatch, identical on every rank.

    Attributes:
        epoch: the epoch the chunks belong to (a window never spans two).
        window: the window's number (``sync_round`` after it completes).
        batches: per rank, batches to train (0 for dead ranks).
        chunks: per rank, ``(offset, size)`` ranges of the epoch's permutation, in
            training order; sizes are multiples of the batch size.
    """

    epoch: int
    window: int
    batches: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class Settlement:
    """What :meth:`Coordinator.settle` decided for a window.

    Attributes:
        realized: ranks whose work this window is credited (its chunks covered).
        forfeited: per rank, samples returned to the pool.
        newly_dead: ranks first seen dead at this window's gather.
        stop: this is the run's last window.
        save_reason: checkpoint this window with this reason (None: no checkpoint).
    """

    realized: tuple[int, ...]
    forfeited: tuple[int, ...]
    newly_dead: tuple[int, ...]
    stop: bool
    save_reason: Optional[SaveReason]


@dataclass
class _Books:
    """The coordinator's mutable trajectory (deep-copied to undo a settlement)."""

    epoch: int
    pool: Optional[ChunkPool]
    global_step: int
    sync_round: int
    finished: bool


class Coordinator:
    """The replicated per-window state machine (see the module doc).

    Args:
        config: the run's configuration.
        el_che: a prebuilt ElChe for ``cadence="elche"`` (to set knobs); default
            ``ElChe(world_size, sync_every)``. Capped to one epoch per window.
        guard: the convergence guard advising ElChe; default ``TrendGuard()``. On
            resume a TrendGuard is rebuilt with the saved ``trend_history``.
    """

    def __init__(self, config: CoordinatorConfig, *, el_che: Optional[ElChe] = None,
                 guard: Optional[ConvergenceGuard] = None) -> None:
        self.config = config
        world = config.world_size
        self.alive: list[int] = list(range(world))
        self.el_che: Optional[ElChe] = None
        self.guard: Optional[ConvergenceGuard] = None
        if config.cadence == "elche":
            if world < 2:
                logger.info("cadence='elche' with a single rank has nothing to balance: "
                            "training %d batches per window", config.sync_every)
            else:
                self.el_che = el_che if el_che is not None else ElChe(world, config.sync_every)
                if self.el_che.world_size != world:
                    raise ValueError(f"el_che was built for world_size {self.el_che.world_size}"
                                     f" but the run has world_size {world}")
                self.el_che.set_max_total_batches(config.samples_per_epoch // config.batch_size)
                self.guard = guard if guard is not None else TrendGuard()
                state = config.start_elche_state
                if state is not None:
                    self.el_che.restore_from_state(state)
                    self.guard = resumed_guard(self.guard, state.trend_history)
        pool = None
        start = config.start_epoch
        if config.start_coverage is not None and start < config.epochs:
            pools = pools_from_coverage(config.start_coverage, world, config.batch_size)
            later = sorted(e for e in pools if e > start)
            if later:
                logger.warning("coverage lists epochs %s after the start epoch %d; they are "
                               "retrained from scratch", later, start)
            pool = pools.get(start)
            if any(ec.epoch == start and untouched(ec) for ec in config.start_coverage.per_epoch):
                pool = None  # none of it trained: it starts afresh, on this run's dataset
            if pool is not None and pool.total_samples != config.samples_per_epoch:
                raise ValueError(
                    f"the checkpoint's epoch {start} has {pool.total_samples} samples but this "
                    f"run's epoch has {config.samples_per_epoch} (dataset_len "
                    f"{config.dataset_len}, batch_size {config.batch_size}); resume with the "
                    f"same dataset and batch size")
            saved_len = config.start_coverage.dataset_len
            if pool is not None and saved_len not in (None, config.dataset_len):
                raise ValueError(
                    f"the checkpoint's epoch {start} is a shuffle of a dataset of {saved_len} "
                    f"samples and this run's dataset has {config.dataset_len} (the same whole "
                    f"batches of {config.batch_size}, other samples in them); resume with the "
                    f"same dataset")
        elif config.start_global_step and start < config.epochs:
            logger.warning("the checkpoint carries no coverage: epoch %d restarts from its "
                           "first sample", start)
        self._books = _Books(start, pool, config.start_global_step, config.start_avg_count,
                             start >= config.epochs)
        if pool is None and not self._books.finished:
            self._books.pool = self._fresh_pool(start)
        self._undo: Optional[tuple[_Books, list[int]]] = None
        self._undo_saved = False
        self._force_checkpoint = False

    # -- state ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch being trained (``epochs`` once finished)."""
        return self._books.epoch

    @property
    def global_step(self) -> int:
        """Batches realized into the consensus, cohort-wide, since the run began."""
        return self._books.global_step

    @property
    def sync_round(self) -> int:
        """Windows completed."""
        return self._books.sync_round

    @property
    def finished(self) -> bool:
        return self._books.finished

    @property
    def pool(self) -> Optional[ChunkPool]:
        """The current epoch's pool (None once finished)."""
        return self._books.pool

    def _fresh_pool(self, epoch: int) -> ChunkPool:
        total = self.config.samples_per_epoch
        return ChunkPool.from_coverage(epoch, total, self.config.world_size, [(0, total)])

    def _advance_epochs(self) -> None:
        b = self._books
        while not b.finished and b.pool is not None and b.pool.is_epoch_done():
            b.epoch += 1
            if b.epoch >= self.config.epochs:
                b.finished = True
                b.pool = None
            else:
                b.pool = self._fresh_pool(b.epoch)

    # -- 1. plan ---------------------------------------------------------------------------
    def base_counts(self) -> list[int]:
        """Batches per rank before the epoch-end clamp (0 for dead ranks)."""
        world = self.config.world_size
        if self.el_che is not None:
            raw = self.el_che.batch_counts()
        else:
            raw = [self.config.sync_every] * world
        if len(self.alive) == world:
            return list(raw)
        alive = set(self.alive)
        return [raw[r] if r in alive else 0 for r in range(world)]

    def plan_window(self) -> Optional[WindowPlan]:
        """This window's per-rank batches and chunks; None when training is over."""
        self._advance_epochs()
        b = self._books
        if b.finished:
            return None
        bs = self.config.batch_size
        counts = fit_counts(self.base_counts(), b.pool.remaining() // bs, remainder="in_order")
        chunks: list[tuple[tuple[int, int], ...]] = []
        batches: list[int] = []
        for r in range(self.config.world_size):
            need = counts[r] * bs
            got: list[tuple[int, int]] = []
            while need > 0:
                c = b.pool.take_chunk(need, r)
                if c is None:
                    break
                got.append(c)
                need -= c[1]
            chunks.append(tuple(got))
            batches.append(sum(n for _, n in got) // bs)
        return WindowPlan(b.epoch, b.sync_round + 1, tuple(batches), tuple(chunks))

    # -- 3. settle -------------------------------------------------------------------------
    def settle(self, plan: WindowPlan, counts: CohortCounts,
               realized: Optional[Sequence[int]] = None, *, undoable: bool = True) -> Settlement:
        """Book the window: completions, forfeits, step, round, epoch, stop, checkpoint.

        Args:
            plan: this window's plan.
            counts: this window's counts.
            realized: ranks whose params are in the consensus; default: the movers of
                ``counts`` (what the reduce realizes unless a rank dies in between).
            undoable: keep a copy of the books for :meth:`resettle` (counts gathered
                before the reduce); False when the counts came with the reduce and
                describe what it realized (one host), which saves the copy.
        """
        self._undo = (copy.deepcopy(self._books), list(self.alive)) if undoable else None
        settled = self._settle(plan, counts, realized)
        self._undo_saved = settled.save_reason is not None
        return settled

    def resettle(self, plan: WindowPlan, counts: CohortCounts,
                 realized: Sequence[int]) -> Settlement:
        """Undo the last :meth:`settle` and book the window again with the ranks whose
        work the params round actually accepted (a rank died between the count gather
        and the params round). When the window was checkpointed, the next one is too,
        so the last checkpoint again matches what was realized."""
        if self._undo is None:
            raise RuntimeError("resettle() needs a settle(undoable=True) of the same window "
                               "first")
        books, alive = self._undo
        self._books, self.alive = copy.deepcopy(books), list(alive)
        settled = self._settle(plan, counts, realized, again=True)
        self._force_checkpoint = self._force_checkpoint or self._undo_saved
        return settled

    def _settle(self, plan: WindowPlan, counts: CohortCounts,
                realized: Optional[Sequence[int]], again: bool = False) -> Settlement:
        """The booking of :meth:`settle`; ``again``: :meth:`resettle`'s, of a window whose
        first booking logged what this one would (the same counts; fewer ranks credited),
        so it logs nothing."""
        cfg = self.config
        b = self._books
        world = cfg.world_size
        if counts.world_size != world:
            raise ValueError(f"count gather has {counts.world_size} ranks, expected {world}")
        present = counts.present
        # (each test is one C call where every rank is present and trained: a window's
        # books run right after training, where every Python frame costs several times
        # its warm cost)
        everyone = all(present)
        newly_dead = () if everyone else tuple([r for r in self.alive if not present[r]])
        if newly_dead:
            if not again:
                logger.warning("rank(s) %s left the cohort at window %d; %d of %d ranks "
                               "remain", list(newly_dead), plan.window, sum(present),
                               cfg.world_size)
            self.alive = [r for r in self.alive if present[r]]
        batches = counts.batches
        if realized is None:
            done = set(range(world)) if everyone and all(batches) else set(counts.movers())
        else:
            done = {r for r in realized if present[r]} if counts.total_batches else set()
        credited: list[int] = []
        forfeited = [0] * world
        pool = b.pool
        for r in range(world):
            if not plan.chunks[r]:
                continue
            if r in done:
                n = min(batches[r], plan.batches[r])
                if n != plan.batches[r] and not again:
                    logger.warning("rank %d trained %d of its %d planned batches at window %d",
                                   r, n, plan.batches[r], plan.window)
                pool.mark_completed(r, n * cfg.batch_size)
                b.global_step += n
                credited.append(r)
            forfeited[r] = pool.forfeit(r)
        b.sync_round += 1
        self._advance_epochs()
        dead = world - len(self.alive)
        stop, reason = False, None
        if dead > cfg.max_failures:
            stop, reason = True, SaveReason.MAX_FAILURE_EXCEEDED
            if not again:
                logger.error("%s lost, more than max_failures=%d: saving and stopping",
                             plural(dead, "rank"), cfg.max_failures)
        elif b.finished or counts.stop:
            stop, reason = True, SaveReason.GRACEFUL_SHUTDOWN
        elif self._force_checkpoint or (cfg.checkpoint_every is not None
                                        and b.sync_round % cfg.checkpoint_every == 0):
            reason = SaveReason.CHECKPOINT
        if reason is not None:
            # an all-idle window has no reduce to capture: the next realized one saves
            self._force_checkpoint = counts.total_batches == 0
        return Settlement(tuple(credited), tuple(forfeited), newly_dead, stop, reason)

    def checkpoint_meta(self, reason: SaveReason) -> CheckpointMeta:
        """The ``.meta.json`` of a checkpoint taken at the window just settled: epoch,
        global step, sync round, live ranks, reason, ElChe state with the guard's
        history, and the coverage (what is not yet in the consensus)."""
        b = self._books
        cfg = self.config
        meta = CheckpointMeta.new(b.epoch, b.global_step, b.sync_round, len(self.alive),
                                  reason)
        if self.el_che is not None:
            state = self.el_che.to_state()
            state.trend_history = self.guard.trend_history() if self.guard else None
            meta = meta.with_elche_state(state)
        pools = [] if b.pool is None else [b.pool]
        return meta.with_coverage(coverage_block(pools, cfg.seed, cfg.batch_size,
                                                 cfg.dataset_len))

    # -- 4. report -------------------------------------------------------------------------
    def report(self, counts: CohortCounts, ack: CohortAck,
               realized: Sequence[int]) -> None:
        """Feed ElChe the window's timings and the guard's verdict (cadence mode only;
        an all-idle window reports nothing). ``ack`` is the previous window's (it travels
        in this window's count gather); when no rank has one yet (the first window of a
        run or of a resume) the guard gets no verdict to give and ElChe no reduce time."""
        if self.el_che is None or counts.total_batches == 0:
            return
        world = self.config.world_size
        ok = set(realized)
        wall = [counts.compute_ms[r] if r in ok else 0.0 for r in range(world)]
        ran = [counts.batches[r] if r in ok else 0 for r in range(world)]
        self.el_che.report_timing(wall, ran, ack.sync_ms)
        if self.guard is not None and ack.reported:
            action = self.guard.check(list(ack.divergence), sum(ran), max(ran, default=0))
            self.el_che.apply_action(action)
