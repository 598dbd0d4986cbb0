"""Trainer hooks: per-batch and per-window callbacks, and the metrics they receive.

A hook is an object with any of these methods (subclass :class:`Hook` and override
what you need); the :class:`~flodl_shm.training.trainer.Trainer` calls them in every rank
process, in the order the hooks were given::

    on_train_start(state)             after the model is built, aligned or restored
    on_batch_end(state, info)         after each optimizer step (BatchInfo)
    on_window_end(state, stats)       after each sync (WindowStats)
    on_train_end(state, summary)      after the last window (RankSummary)

``state`` is the rank's :class:`RankState` (model, optimizer, counters) and
``state.request_stop()`` asks the cohort to stop: the request travels with the
window's counts, so every rank stops after the same window, which is then saved
as a ``graceful_shutdown`` checkpoint (a request from ``on_window_end``, made after
its window's sync, travels with the next window's).

Hooks are pickled to the rank processes: define them at module level, and keep
in mind that each rank works on its own copy (state a hook accumulates stays in
its rank; write files or log to get it out). ``state.is_reporting_rank`` is True
on exactly one live rank, for hooks that should log once per cohort.
"""
from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..checkpoint.meta import SaveReason
from ..errors import check_int

logger = logging.getLogger("flodl_shm")

__all__ = ["BatchInfo", "Hook", "LoggingHook", "RankState", "RankSummary", "SimulatedSlowdown",
           "WindowStats"]


@dataclass
class RankState:
    """What a hook sees of its rank.

    Attributes:
        rank: this rank; world_size: ranks at launch.
        model: the rank's replica (the consensus right after a sync).
        optimizer: the rank's inner optimizer; scheduler: its LR scheduler (or None).
        epoch: the epoch being trained.
        window: the window in progress (1-based; ``sync_round`` once it completes).
        global_step: batches realized cohort-wide before this window.
        live_ranks: ranks alive at the last window's sync.
    """

    rank: int
    world_size: int
    model: Any
    optimizer: Any
    epoch: int = 0
    window: int = 0
    global_step: int = 0
    live_ranks: tuple[int, ...] = ()
    stop_requested: bool = False
    scheduler: Any = None

    @property
    def is_reporting_rank(self) -> bool:
        """True on the lowest live rank: log cohort-wide metrics there, once."""
        return bool(self.live_ranks) and self.rank == self.live_ranks[0]

    def request_stop(self) -> None:
        """Ask the cohort to stop (saved as graceful): after the current window when
        asked during it (``on_batch_end``), after the next one when asked from
        ``on_window_end`` (the request travels with a window's sync)."""
        self.stop_requested = True


@dataclass(frozen=True)
class BatchInfo:
    """One optimizer step of this rank.

    Attributes:
        epoch, window: where the batch belongs; batch: its index in the window.
        sample_ids: the dataset indices of the batch (int64).
        loss: the batch loss; compute_ms: wall time of fetch + forward + backward + step.
    """

    epoch: int
    window: int
    batch: int
    sample_ids: np.ndarray
    loss: float
    compute_ms: float


@dataclass(frozen=True)
class WindowStats:
    """One completed sync window, seen from one rank (cohort values are identical on
    every rank).

    Attributes:
        rank: this rank. epoch: the epoch the window trained. window: its number.
        global_step: batches realized cohort-wide after this window.
        batches: this rank's batches; cohort_batches: every rank's (gathered).
        sample_ids: dataset indices this rank trained, realized in this window's
            consensus (None in ``TrainResult.history``).
        loss: this rank's mean batch loss (NaN when idle); cohort_loss: the mean over
            every batch the cohort trained.
        compute_ms: this rank's training wall time; gather_ms: its wait at the count
            gather (several hosts: time spent waiting for slower ranks; 0 on one host,
            where the counts ride in the params round); sync_ms: this rank's reduce (it
            ends when the slowest rank's contribution is in: on one host it includes
            the wait for slower ranks); window_ms: this rank's whole window.
        samples_per_s: samples the cohort trained per second of this window.
        bytes_sent: payload bytes this rank put into the window's collectives.
        divergence: this rank's ``||pre - post|| / ||post||``; max_divergence: the
            cohort's largest at the previous window (it travels in this window's count
            gather).
        live_ranks: ranks alive at the window's sync. skipped: every rank was idle
            (nothing averaged: every replica kept its state).
        checkpoint: the checkpoint taken at this window (its model path), or None.
        save_reason: its reason (a ``SaveReason`` value), or None.
        next_batches: per rank, the batches planned for the next window (the
            cadence decision; empty after the last window).
        averaging_ms: this rank's time from the end of its training to the window's
            settled books: the count gather (several hosts), the reduce (``sync_ms``),
            and the coordinator's settlement (coverage, cadence, checkpoint). The rest
            of ``window_ms - compute_ms`` is the window's data setup before training.
    """

    rank: int
    epoch: int
    window: int
    global_step: int
    batches: int
    cohort_batches: tuple[int, ...]
    sample_ids: Optional[np.ndarray]
    loss: float
    cohort_loss: float
    compute_ms: float
    gather_ms: float
    sync_ms: float
    window_ms: float
    samples_per_s: float
    bytes_sent: int
    divergence: float
    max_divergence: float
    live_ranks: tuple[int, ...]
    skipped: bool
    checkpoint: Optional[str] = None
    save_reason: Optional[str] = None
    next_batches: tuple[int, ...] = ()
    averaging_ms: float = 0.0


@dataclass(frozen=True)
class RankSummary:
    """How a rank's run ended.

    Attributes:
        rank: this rank. windows: windows this run completed. global_step: batches
        realized cohort-wide. epoch: the epoch reached (``epochs`` when finished).
        reason: the last save reason (``graceful_shutdown``, ``max_failure_exceeded``)
            or None when no window ran. dead_ranks: ranks lost during the run.
    """

    rank: int
    windows: int
    global_step: int
    epoch: int
    reason: Optional[str]
    dead_ranks: tuple[int, ...] = ()
    last_checkpoint: Optional[str] = None


#: the methods a hook may define (``Hook`` defines them all as no-ops)
HOOK_METHODS = ("on_train_start", "on_batch_end", "on_window_end", "on_train_end")


class Hook:
    """Base class: every callback is a no-op; override the ones you need."""

    def on_train_start(self, state: RankState) -> None:
        pass

    def on_batch_end(self, state: RankState, info: BatchInfo) -> None:
        pass

    def on_window_end(self, state: RankState, stats: WindowStats) -> None:
        pass

    def on_train_end(self, state: RankState, summary: RankSummary) -> None:
        pass


def _human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass
class LoggingHook(Hook):
    """Log one line per ``every`` windows on the reporting rank (``flodl_shm`` logger,
    INFO): epoch, window, step, losses, throughput, sync cost, bytes, divergence,
    live ranks and the next window's cadence.

    Args:
        every: log every this many windows (checkpoint windows and the last one are
            always logged).
        level: the logging level.
    """

    every: int = 1
    level: int = logging.INFO

    def __post_init__(self) -> None:
        # (checked here: the first window's line would raise, mid-run)
        check_int("LoggingHook every", self.every, 1)
        check_int("LoggingHook level", self.level, 0)

    def on_window_end(self, state: RankState, stats: WindowStats) -> None:
        if not state.is_reporting_rank:
            return
        if stats.window % self.every and stats.checkpoint is None and stats.next_batches:
            return
        loss = "-" if stats.skipped else f"{stats.cohort_loss:.4f}"  # (a diverged one: nan)
        # "wait": the count gather's, on several hosts (one host has none: gather_ms 0.0)
        wait = f", wait {stats.gather_ms:.1f} ms" if stats.gather_ms else ""
        line = (f"epoch {stats.epoch} window {stats.window} step {stats.global_step}: "
                f"loss {loss}, {stats.samples_per_s:,.0f} samples/s, compute "
                f"{stats.compute_ms:.1f} ms{wait}, sync "
                f"{stats.sync_ms:.1f} ms, sent {_human_bytes(stats.bytes_sent)}, divergence "
                f"{stats.max_divergence:.2e}, ranks {len(stats.live_ranks)}, batches "
                f"{list(stats.cohort_batches)}")
        if stats.checkpoint:
            why = SaveReason(stats.save_reason).words
            line += f", checkpoint {stats.checkpoint} ({why})"
        logger.log(self.level, "%s", line)


@dataclass
class SimulatedSlowdown(Hook):
    """Make one rank ``factor`` times slower per batch (it sleeps after each batch), to
    try the ElChe cadence on a homogeneous host.

    ``batch_ms`` pads every rank's batch to at least that much wall time, and the slowed
    rank's to ``factor`` times it. A floor above the model's own batch time makes the
    ratio hold on a busy machine: below the floor a rank's compute jitter is absorbed
    rather than multiplied by ``factor`` (docs/trainer.md, "Cadence: fixed or ElChe").
    A batch that outlasts the floor is stretched to ``factor`` times its own length.

    Args:
        rank: the rank to slow down.
        factor: its per-batch wall time multiplier (>= 1).
        batch_ms: every rank's per-batch wall time floor, in ms (0: none).
    """

    rank: int
    factor: float = 2.0
    batch_ms: float = 0.0

    def __post_init__(self) -> None:
        # (checked here: a rank of the wrong kind slowed nothing, a factor of the wrong
        # kind raised at the first batch, one below 1 was taken as 1)
        check_int("SimulatedSlowdown rank", self.rank, 0)
        for name, value, least in (("factor", self.factor, 1.0), ("batch_ms", self.batch_ms, 0.0)):
            if not (isinstance(value, numbers.Real) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= least):
                raise ValueError(f"SimulatedSlowdown {name} must be a finite number >= "
                                 f"{least:g}, got {value!r}")

    def on_batch_end(self, state: RankState, info: BatchInfo) -> None:
        length = max(info.compute_ms, self.batch_ms)
        if state.rank == self.rank:
            length *= self.factor
        sleep_ms = length - info.compute_ms
        if sleep_ms > 0:
            time.sleep(sleep_ms / 1e3)
