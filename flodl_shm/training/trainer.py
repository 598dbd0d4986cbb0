"""``Trainer``: data-parallel local-SGD / DiLoCo training on the ranks of this host.

::

    import functools, torch, flodl_shm

    trainer = flodl_shm.Trainer(
        model_fn=make_model,                                   # () -> nn.Module
        optimizer_fn=functools.partial(torch.optim.SGD, lr=0.05),  # params -> Optimizer
        dataset=(x, y),                                        # tensors or a map-style dataset
        loss_fn=torch.nn.functional.cross_entropy,             # (output, target) -> loss
        batch_size=32, epochs=2, sync_every=8,
        checkpoint_every=10, save_path="runs/demo")
    result = trainer.run(nprocs=2)          # or trainer.resume("runs/demo")

Each rank trains its own replica on its own chunks of every epoch's permutation;
at the end of each *window* the ranks replace their weights by the consensus
Σ(wᵣ·Tᵣ)/Σwᵣ over the work each realized (:mod:`flodl_shm.training.sync_window`). Which
samples each rank trains, how many batches per window (``sync_every``, or ElChe's
cadence), when to checkpoint and when to stop are decided identically on every
rank by the replicated :mod:`flodl_shm.training.coordinator`. Checkpoints are captured at a
reduce and written off the training path by the supervisor's forge, as a series
of bundles (:mod:`flodl_shm.checkpoint.series`); ``resume`` continues from the last
one without repeating or skipping a sample.

Everything handed to the Trainer is pickled to the rank processes: use
module-level functions (or ``functools.partial`` of them), not lambdas.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from ..errors import RankFailed, StartRefused, TrainingAborted, check_flag, check_int, plural
from ..checkpoint.meta import (CheckpointBundle, CheckpointMeta, RankDeathRecord, SaveReason,
                               set_extension)
from ..checkpoint.series import (committed_checkpoints, death_record_path, latest_checkpoint,
                                 series_of)
from .coverage import SHUFFLE_BASE_SEED
from .data import is_dataset_factory
from .hooks import HOOK_METHODS, Hook, LoggingHook
from .rank_run import _rank_main, plateau_refused
from .resume_rules import model_mismatch, resume_conflicts

logger = logging.getLogger("flodl_shm")

__all__ = ["Trainer", "TrainResult", "TrainingAborted"]

#: ``Trainer(keep_history=...)``'s default: the windows ``TrainResult.history`` keeps (the
#: last ones; about 1 KB each on every rank).
DEFAULT_KEEP_HISTORY = 10_000


@dataclass
class TrainResult:
    """What ``Trainer.run`` / ``Trainer.resume`` return.

    Attributes:
        state_dict: the final model (the consensus of the last window; integer
            buffers are the reporting rank's own).
        history: the reporting rank's ``WindowStats`` of the last ``keep_history``
            windows (without sample ids; every window with ``keep_history=None``).
        meta: where the run ended, as checkpoint metadata (epoch, global step,
            sync round, live ranks, reason, ElChe state, coverage).
        checkpoint: the model path of the last checkpoint armed (None without
            ``save_path``); it is on disk when ``run`` returns. A resume with nothing
            left to train: the bundle it resumed from.
        dead_ranks: ranks lost during the run.
        summaries: every rank's ``RankSummary`` (None for dead ranks).
    """

    state_dict: dict
    history: list
    meta: CheckpointMeta
    checkpoint: Optional[Path]
    dead_ranks: tuple
    summaries: list = field(default_factory=list)

    @property
    def reason(self) -> Optional[SaveReason]:
        return None if self.meta is None else SaveReason(self.meta.save_reason)


@dataclass
class _Job:
    trainer: "Trainer"
    nprocs: int                         # ranks on this host
    resume_meta: Optional[CheckpointMeta]
    model_path: Optional[str]
    log_level: Optional[int]
    cluster: Optional["_Cluster"] = None
    #: when this host's run began (wall clock): the death records it reads at its end
    #: are those written since (``Trainer._abort_message``)
    started: float = field(default_factory=time.time)


@dataclass(frozen=True)
class _Cluster:
    """Where this host sits in a multi-host cohort (``spawn``'s arguments)."""

    controller: Any
    world_size: int
    first_rank: int
    salt: Optional[bytes]

    @classmethod
    def of(cls, controller, world_size, first_rank, salt, nprocs: int) -> Optional["_Cluster"]:
        if controller is None:
            if world_size not in (None, nprocs) or first_rank != 0:
                raise ValueError(f"world_size={world_size} / first_rank={first_rank} need a "
                                 f"controller (one host carries all {nprocs} ranks)")
            return None
        if world_size is None:
            raise ValueError("a controller needs the cohort's world_size")
        return cls(controller, int(world_size), int(first_rank), salt)

    def spawn_kwargs(self) -> dict:
        return dict(controller=self.controller, world_size=self.world_size,
                    first_rank=self.first_rank, salt=self.salt)


def _builds_plateau(factory) -> bool:
    """Whether a ``scheduler_fn`` is ``ReduceLROnPlateau`` itself (or a subclass), bare or
    in ``functools.partial`` (a function that builds one is only found by the ranks)."""
    import functools

    import torch

    while isinstance(factory, functools.partial):
        factory = factory.func
    return isinstance(factory, type) and issubclass(
        factory, torch.optim.lr_scheduler.ReduceLROnPlateau)


class Trainer:
    """Local-SGD / DiLoCo data-parallel training over this host's ranks.

    Args:
        model_fn: ``() -> nn.Module``, called in every rank (after
            ``torch.manual_seed(seed)``); parameters and floating-point buffers must be
            float32 or bfloat16.
        optimizer_fn: ``params -> torch.optim.Optimizer`` (the inner optimizer), e.g.
            ``functools.partial(torch.optim.SGD, lr=0.1)``.
        dataset: a tuple of tensors with a common first dimension (the last one is the
            target), a map-style dataset whose items are ``(input..., target)``, or a
            zero-argument factory returning either (built in each rank).
        loss_fn: ``(model_output, target) -> scalar loss``; may be None with ``step_fn``.
        batch_size: samples per batch; every batch is full (the permutation's tail
            past the last full batch is not trained that epoch).
        epochs: passes over the dataset.
        sync_every: batches per window with the fixed cadence; with ElChe, the slowest
            rank's initial batches per window (the anchor).
        cadence: ``"fixed"`` (every rank ``sync_every`` batches per window),
            ``"elche"`` (ElChe: faster ranks run proportionally more batches, measured
            from real wall time), or a picklable ``world_size -> ElChe`` factory to set
            ElChe's knobs.
        gamma: work exponent of the params mass ``n**gamma`` (1: every batch counts).
        outer: an outer optimizer (``OuterNesterov(...)`` for DiLoCo) stepped on the
            consensus where it is formed; ``None`` or ``OuterAvg()`` adopt the plain
            consensus. ``OuterNesterov`` resets the inner optimizer's state at every sync.
        bf16_wire: send model frames as bf16 (half the bytes; sums stay f32).
        checkpoint_every: checkpoint every this many windows (needs ``save_path``); the
            last window is always checkpointed when ``save_path`` is set.
        save_path: checkpoint series stem (``runs/exp`` -> ``runs/exp-r00000012.fdl``...).
        keep_checkpoints: complete bundles kept; older ones are deleted only once a
            newer one has committed (so up to one more is on disk in between).
        max_failures: ranks that may die while the rest continue. One more and the
            survivors save a ``max_failure_exceeded`` checkpoint (with ``save_path``)
            and ``run`` raises ``TrainingAborted``.
        seed: seeds the model init, every epoch's permutation and, per (rank, window),
            torch's RNG (dropout...), so a resumed run replays the uninterrupted one.
        hooks: ``Hook`` objects called in every rank (see :mod:`flodl_shm.training.hooks`).
        guard: the convergence guard advising ElChe (default ``TrendGuard()``).
        log_every: add a ``LoggingHook(every=log_every)``; None for none.
        timeout: seconds any collective may wait for a live rank before failing
            with ``ReduceStall`` (a window's training counts: keep it above the
            longest window).
        step_fn: ``(model, batch) -> scalar loss`` in place of ``loss_fn(model(*inputs),
            target)``, for any other loss (``batch`` is the tuple of batch tensors; the
            Trainer calls ``backward`` and steps the optimizer).
        clip_grad_norm: clip the gradients' total L2 norm to this value before each
            optimizer step (``torch.nn.utils.clip_grad_norm_``); None: no clipping.
        accumulate: split each batch into this many equal micro-batches, each one's
            loss divided by ``accumulate`` and back-propagated before the single
            optimizer step (``batch_size`` must be a multiple of it).
        scheduler_fn: ``optimizer -> LR scheduler`` (e.g. ``functools.partial(
            torch.optim.lr_scheduler.CosineAnnealingLR, T_max=1000)``), built in every
            rank on its inner optimizer and stepped after each optimizer step (so its
            periods count this rank's batches); its state is in each checkpoint's rank
            files, so a resume continues the schedule.
        keep_history: keep only the last this many windows' ``WindowStats`` in
            ``TrainResult.history`` (0: none; default ``DEFAULT_KEEP_HISTORY``, 10,000:
            about 10 MB on every rank). None keeps every window, about 1 KB each on every
            rank and 2 KB in the launcher once pickled back (a million windows: GBs).
            Hooks (``on_window_end``) see every window either way.

    For AMP or a ``DataLoader`` with workers, write the loop yourself around
    :class:`flodl_shm.LocalSGD` (docs/local_sgd.md).
    """

    def __init__(self, model_fn: Callable, optimizer_fn: Callable, dataset: Any,
                 loss_fn: Optional[Callable], *, batch_size: int = 32, epochs: int = 1,
                 sync_every: int = 8, cadence: Union[str, Callable] = "fixed",
                 gamma: float = 1.0, outer=None, bf16_wire: bool = False,
                 checkpoint_every: Optional[int] = None,
                 save_path: "str | os.PathLike[str] | None" = None, keep_checkpoints: int = 2,
                 max_failures: int = 0, seed: int = SHUFFLE_BASE_SEED,
                 hooks: Sequence[Hook] = (), guard=None, log_every: Optional[int] = 1,
                 timeout: Optional[float] = 1800.0, step_fn: Optional[Callable] = None,
                 clip_grad_norm: Optional[float] = None, accumulate: int = 1,
                 scheduler_fn: Optional[Callable] = None,
                 keep_history: Optional[int] = DEFAULT_KEEP_HISTORY) -> None:
        if loss_fn is None and step_fn is None:
            raise ValueError("pass a loss_fn (output, target) -> loss, or a step_fn "
                             "(model, batch) -> loss")
        if loss_fn is not None and step_fn is not None:
            raise ValueError("pass a loss_fn or a step_fn, not both: a step_fn computes the "
                             "whole loss (the loss_fn would be ignored); pass None as the "
                             "loss_fn")
        import torch

        for name, fn, what, required in (
                ("model_fn", model_fn, "() -> model", True),
                ("optimizer_fn", optimizer_fn, "parameters -> optimizer", True),
                ("loss_fn", loss_fn, "(output, target) -> loss", False),
                ("step_fn", step_fn, "(model, batch) -> loss", False)):
            if name == "model_fn" and isinstance(fn, torch.nn.Module):
                raise TypeError(f"model_fn must build the model in each rank, got a "
                                f"{type(fn).__name__} instance: pass its class or a "
                                f"functools.partial(...) that builds it")
            if (required or fn is not None) and not callable(fn):
                raise TypeError(f"{name} must be a picklable {what} callable, got "
                                f"{type(fn).__name__}")
            if name in ("loss_fn", "step_fn") and isinstance(fn, type):
                # (a class is callable: nn.CrossEntropyLoss(output, target) failed in the
                # ranks with "Boolean value of Tensor ... is ambiguous")
                raise TypeError(f"{name} is the class {fn.__name__}: pass an instance, "
                                f"{fn.__name__}(), or a function {what}")
        if outer is not None and not callable(getattr(outer, "outer_step", None)):
            raise TypeError(f"outer must be None, OuterAvg() or OuterNesterov(...), got "
                            f"{type(outer).__name__}")
        if scheduler_fn is not None and not callable(scheduler_fn):
            raise TypeError(f"scheduler_fn must be an optimizer -> LR scheduler callable, got "
                            f"{type(scheduler_fn).__name__}")
        # every integer argument is checked for its type first: a str batch_size would
        # otherwise fail on the arithmetic below with Python's own message
        for name, value in (("batch_size", batch_size), ("sync_every", sync_every),
                            ("keep_checkpoints", keep_checkpoints), ("accumulate", accumulate)):
            check_int(name, value, 1)
        check_int("epochs", epochs, 0)
        check_int("max_failures", max_failures, 0)
        check_int("seed", seed, 0)
        if seed >= 1 << 63:
            raise ValueError(f"seed must be below 2**63 (torch's generators take a 64-bit "
                             f"seed), got {seed}")
        check_int("checkpoint_every", checkpoint_every, 1, optional=True)
        check_int("log_every", log_every, 1, optional=True)
        check_int("keep_history", keep_history, 0, optional=True)
        if batch_size % accumulate:
            raise ValueError(f"accumulate must be an int >= 1 dividing batch_size "
                             f"{batch_size}, got {accumulate!r}")
        if clip_grad_norm is not None and not (_is_real(clip_grad_norm)
                                               and math.isfinite(clip_grad_norm)
                                               and clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be a finite number > 0 or None, got "
                             f"{clip_grad_norm!r}")
        if timeout is not None and not (_is_real(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got "
                             f"{timeout!r}")
        if checkpoint_every is not None and save_path is None:
            raise ValueError("checkpoint_every needs a save_path to write the checkpoints to")
        if not (cadence in ("fixed", "elche") or callable(cadence)):
            raise ValueError(f"cadence must be 'fixed', 'elche' or a world_size -> ElChe "
                             f"factory, got {cadence!r}")
        if not (_is_real(gamma) and math.isfinite(gamma)):
            raise ValueError(f"gamma must be a finite number, got {gamma!r}")
        check_flag("bf16_wire", bf16_wire)
        self.model_fn = model_fn
        self.optimizer_fn = optimizer_fn
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.batch_size = int(batch_size)
        self.epochs = int(epochs)
        self.sync_every = int(sync_every)
        self.cadence = cadence
        self.gamma = float(gamma)
        self.outer = outer
        self.bf16_wire = bool(bf16_wire)
        self.checkpoint_every = None if checkpoint_every is None else int(checkpoint_every)
        self.save_path = None if save_path is None else os.fspath(save_path)
        if self.save_path is not None:
            from ..checkpoint.series import check_series_stem

            set_extension(self.save_path, "")  # a stem with a file name, or ValueError now
            check_series_stem(self.save_path)
        self.keep_checkpoints = int(keep_checkpoints)
        self.max_failures = int(max_failures)
        self.seed = int(seed)
        self.hooks = list(hooks)
        for i, h in enumerate(self.hooks):
            if not any(callable(getattr(h, name, None)) for name in HOOK_METHODS):
                raise TypeError(f"hooks[{i}] (a {type(h).__name__}) has none of the hook "
                                f"methods {', '.join(HOOK_METHODS)}: subclass flodl_shm."
                                f"training.hooks.Hook and override the ones you need")
        if log_every is not None:
            self.hooks.append(LoggingHook(every=log_every))
        self.guard = guard
        self.timeout = None if timeout is None else float(timeout)
        self.step_fn = step_fn
        self.clip_grad_norm = None if clip_grad_norm is None else float(clip_grad_norm)
        self.accumulate = int(accumulate)
        self.scheduler_fn = scheduler_fn
        self.keep_history = None if keep_history is None else int(keep_history)

    def __repr__(self) -> str:
        return (f"Trainer(batch_size={self.batch_size}, epochs={self.epochs}, "
                f"sync_every={self.sync_every}, cadence={self.cadence!r}, outer={self.outer!r}, "
                f"save_path={self.save_path!r})")

    # -- launch ------------------------------------------------------------------------
    def run(self, nprocs: int, *, overwrite: bool = False, controller=None,
            world_size: Optional[int] = None, first_rank: int = 0,
            salt: Optional[bytes] = None) -> TrainResult:
        """Train from scratch on ``nprocs`` rank processes of this host.

        With ``controller="host:port"`` this host joins a multi-host cohort as
        ``spawn`` does: it carries global ranks ``first_rank .. first_rank+nprocs-1``
        of ``world_size``, authenticated by the 16-byte session ``salt``; every host
        runs the same Trainer. Every host then writes its own copy of each checkpoint
        bundle under ``save_path`` (the consensus model, the metadata, its ranks'
        ``.optim``), and the controller's forge writes one more, with the outer
        momentum, at rank 0's path on the controller's machine. Each host's
        ``TrainResult`` comes from its lowest live rank (the consensus and the
        cohort-wide history are the same on every host).

        With ``save_path``, the run holds the series' run lock from here to its end
        (``checkpoint/run_lock.py``): a second run on the same save path is refused.

        A fresh run starts its series over: the rank death records and unfinished
        bundle files an earlier run left under ``save_path`` are deleted.

        Raises:
            FileExistsError: ``save_path`` already holds checkpoints (resume them, or
                pass ``overwrite=True`` to delete them first).
            ValueError, TypeError: before any rank starts, what the launcher can check
                (``nprocs``; ``epochs=0``; a dataset that is not a factory, against
                ``batch_size``; the ElChe a cadence factory builds), naming the value and
                the fix.
            StartRefused: a rank's setup failed (a dataset factory's data, ``model_fn``
                ...): the run stops at once, saving nothing; the rank's error is the
                message, its ``RankFailed`` (with the traceback) the cause.
            SeriesInUse: another run is writing ``save_path``'s series.
            TrainingAborted: more than ``max_failures`` ranks died (with ``save_path``;
                the survivors saved first).
            RankFailed: a rank failed and no checkpoint could be saved.
        """
        from ..checkpoint.series import committed_checkpoints, delete_series

        check_int("nprocs", nprocs, 1)
        if self.epochs == 0:  # (resume() takes it: a finished run has nothing left)
            raise ValueError("epochs=0: a fresh run would start its ranks and train nothing; "
                             "build the Trainer with epochs >= 1")
        cluster = _Cluster.of(controller, world_size, first_rank, salt, int(nprocs))
        with self._run_lock(controller, salt, first_rank):
            if self.save_path is not None and committed_checkpoints(self.save_path) \
                    and not overwrite:
                raise FileExistsError(
                    f"{self.save_path} already holds checkpoints of an earlier run; "
                    f"continue it with trainer.resume({self.save_path!r}), or pass "
                    f"overwrite=True to delete them and start over")
            self._check_setup(int(nprocs) if cluster is None else cluster.world_size)
            if self.save_path is not None:
                # a fresh run starts the series over: what an earlier run left there (its
                # bundles, with overwrite; a failed run's death records and unfinished
                # bundles) would read as this run's
                delete_series(self.save_path)
            return self._launch(_Job(self, int(nprocs), None, None, _log_level(), cluster))

    def _clear_beyond(self, model_path: Path, overwrite: bool) -> None:
        """Before resuming from ``model_path``: refuse (or, with ``overwrite``, delete)
        the complete bundles of ``save_path``'s series this run does not continue."""
        if self.save_path is None:
            return
        from ..checkpoint.series import delete_rounds, not_continued

        after, beyond = not_continued(self.save_path, model_path)
        if not beyond:
            # what lies beyond is failed writes (a full disk, a crash mid-write): gone, so
            # this run finds the space (no host writes yet: every round needs them all)
            delete_rounds(self.save_path, after)
            return
        if not overwrite:
            raise FileExistsError(
                f"{self.save_path} holds checkpoints this resume from {model_path.name} would "
                f"not continue (newest: {beyond[-1].name}); they would outrank its own. "
                f"Resume from the newest (trainer.resume() with no path), or pass "
                f"overwrite=True to delete them")
        delete_rounds(self.save_path, after)

    def _run_lock(self, controller, salt, first_rank: int):
        """The run lock of ``save_path``'s series, or nothing to hold without one. The
        hosts of one cluster share it (their save paths may be one shared folder): the
        job is a digest of the session salt, which they all hold, and each host is the
        member of its first rank (the same host launched twice is refused)."""
        if self.save_path is None:
            return contextlib.nullcontext()
        from ..checkpoint.run_lock import RunLock, cluster_job

        if controller is None:
            return RunLock(self.save_path)
        return RunLock(self.save_path, cluster_job(salt, controller), int(first_rank))

    def resume(self, save_path: "str | os.PathLike[str] | None" = None,
               nprocs: Optional[int] = None, *, controller=None,
               world_size: Optional[int] = None, first_rank: int = 0,
               salt: Optional[bytes] = None, overwrite: bool = False) -> TrainResult:
        """Continue from the last complete checkpoint of ``save_path`` (default: this
        trainer's), or from a bundle named by its ``.fdl`` / ``.meta.json``.

        Restores the consensus weights, the outer momentum, the epoch, global step and
        sync round, ElChe's state with the guard's history, and the data coverage:
        the resumed run trains exactly the samples the checkpoint had not yet
        realized. ``nprocs`` defaults to the ElChe world of the checkpoint (cadence
        runs must resume on as many ranks), else the ranks alive at the save. Each
        rank's inner optimizer, LR scheduler and integer buffers come from its
        ``<stem>.rank<N>.optim`` when the cohort has the same size (else they start
        fresh, logged).
        ``controller``, ``world_size``, ``first_rank`` and ``salt`` resume a multi-host
        cohort (see :meth:`run`; each host then needs ``nprocs``, and resumes from its
        own copy of the bundle; the outer momentum is the controller's to load).
        Like :meth:`run`, it holds the run lock of this trainer's ``save_path``
        (``SeriesInUse`` when another run holds it). It refuses a ``save_path`` that
        holds complete bundles this run does not continue (``FileExistsError``): newer
        ones than the bundle it resumes from (an abandoned branch, which would outrank
        this run's checkpoints), or any, when the bundle comes from another series.
        ``overwrite=True`` deletes them first, once the checks below have passed.

        Before any rank starts it checks, as :meth:`run` does, and against the
        checkpoint: a path that does not exist (``FileNotFoundError`` naming it), the
        model ``model_fn`` builds (``CheckpointError`` naming the tensors that differ;
        ``model_fn`` is called here on torch's meta device), ``batch_size`` and the
        epoch size (``ValueError``), ElChe's world size. A finished checkpoint (its
        epoch reached ``epochs``) trains nothing: logged, and the result's
        ``checkpoint`` is the bundle.
        """
        target = save_path if save_path is not None else self.save_path
        if target is None:
            raise ValueError("resume() needs a save_path (this Trainer has none)")
        # the series this run writes, as run() does
        with self._run_lock(controller, salt, first_rank):
            return self._resume(target, nprocs, controller, world_size, first_rank, salt,
                                overwrite)

    def _resume(self, target, nprocs, controller, world_size, first_rank, salt,
                overwrite) -> TrainResult:
        from ..checkpoint.series import resolve_checkpoint

        model_path = resolve_checkpoint(target)
        with _damage_named(model_path):
            meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(model_path))
        saved_world = (len(meta.elche_state.smoothed_ms_per_batch)
                       if meta.elche_state is not None else None)
        chosen = ""
        if nprocs is None:
            if controller is not None:
                raise ValueError("resume() on a cluster needs nprocs (this host's ranks)")
            nprocs = saved_world or max(meta.world_size_at_save, 1)
            chosen = (" (its ElChe's ranks)" if saved_world else
                      " (the ranks alive at its save; pass nprocs to choose)")
        check_int("nprocs", nprocs, 1)
        cluster = _Cluster.of(controller, world_size, first_rank, salt, int(nprocs))
        world = int(nprocs) if cluster is None else cluster.world_size
        self._check_setup(world, meta, model_path)
        self._clear_beyond(model_path, overwrite)  # only once the resume can start
        if meta.epoch >= self.epochs:
            logger.info("%s finished %s, and this Trainer has epochs=%d: nothing "
                        "left to train (pass a larger epochs to continue)", model_path,
                        plural(meta.epoch, "epoch"), self.epochs)
        else:
            logger.info("resuming from %s on %d rank%s%s: epoch %d, step %d, round %d (%s)",
                        model_path, world, "" if world == 1 else "s", chosen, meta.epoch,
                        meta.global_step, meta.sync_round, SaveReason(meta.save_reason).words)
            if self.save_path is None:
                logger.warning("this Trainer has no save_path: the resumed run writes no "
                               "checkpoint, so a crash loses all of it; build the Trainer "
                               "with save_path=%r to continue that series",
                               os.fspath(series_of(model_path)[0])
                               if series_of(model_path) else os.fspath(model_path))
        return self._launch(_Job(self, int(nprocs), meta, os.fspath(model_path), _log_level(),
                                 cluster))

    # -- what the ranks would find only at their start, checked before any starts --------
    def _check_setup(self, world: int, meta: Optional[CheckpointMeta] = None,
                     model_path: Optional[Path] = None) -> None:
        """Raise (``ValueError``, ``TypeError``) what a rank would otherwise find only in
        its setup, where the information is here: the dataset's kind and length against
        ``batch_size`` (unless it is a factory, which only the ranks call), the ElChe a
        cadence factory builds for ``world`` ranks and, on a resume, the checkpoint's
        batch size, epoch size and model against this Trainer's."""
        if _builds_plateau(self.scheduler_fn):
            raise plateau_refused()
        n = self._dataset_len()
        if n is not None and n < self.batch_size:
            raise ValueError("the dataset is empty: pass one with samples" if n == 0 else
                             f"the dataset has {n} samples, fewer than one batch of "
                             f"batch_size={self.batch_size}; pass a batch_size of at most {n}")
        if callable(self.cadence) and world >= 2:
            from .el_che import ElChe, check_anchor

            el_che = self.cadence(world)
            if not isinstance(el_che, ElChe):
                raise TypeError(f"the cadence factory must return an ElChe, got "
                                f"{type(el_che).__name__}")
            if el_che.world_size != world:
                raise ValueError(f"the cadence factory built an ElChe for world_size "
                                 f"{el_che.world_size}, but the run has {world} ranks; build "
                                 f"it for the world_size it is called with")
            check_anchor(self.sync_every, el_che)
        if meta is None:
            return
        for c in resume_conflicts(meta, seed=self.seed, batch_size=self.batch_size,
                                  epochs=self.epochs, dataset_len=n, world=world,
                                  elche=self.cadence != "fixed"):
            if c.setting == "dataset":
                raise ValueError(f"{model_path} was trained on epochs of {c.saved} samples, "
                                 f"and this Trainer's are {c.given} {c.why}: resume with the "
                                 f"dataset it was trained on")
            if c.setting == "dataset_len":
                raise ValueError(f"{model_path} was trained on a dataset of {c.saved} samples, "
                                 f"and this Trainer's has {c.given} {c.why}: resume with the "
                                 f"dataset it was trained on")
            if c.setting == "world_size":
                raise ValueError(f"{model_path} holds an ElChe cadence state for {c.saved} "
                                 f"ranks and this run has {c.given}: resume an ElChe run "
                                 f"on {c.saved} ranks, or with cadence='fixed'")
            raise ValueError(f"{model_path} was trained with {c.setting} {c.saved} and this "
                             f"Trainer has {c.setting}={c.given}: resume with {c.setting}="
                             f"{c.saved} {c.why}")
        with _damage_named(model_path):  # (the .fdl's headers are read)
            why = model_mismatch(model_path, self.model_fn)
        if why is not None:
            from ..errors import CheckpointError

            raise CheckpointError(
                f"{model_path} is not a checkpoint of the model model_fn builds: {why}. "
                f"Resume it with the model_fn that trained it, or resume this model from a "
                f"checkpoint of its own")

    def _dataset_len(self) -> Optional[int]:
        """The dataset's sample count, or None for a factory (called in the ranks only, so
        that a large dataset is never built here); raises for a dataset of the wrong
        kind as the ranks would."""
        from .data import check_samples_fit_loss_fn, resolve_dataset

        ds = self.dataset
        if is_dataset_factory(ds):
            return None  # (the ranks check what it builds)
        ds = resolve_dataset(ds)  # raises for a dataset of the wrong kind, as the ranks would
        if self.step_fn is None:  # loss_fn(model(*inputs), target)
            check_samples_fit_loss_fn(ds)
        return len(ds)

    def _launch(self, job: _Job) -> TrainResult:
        from ..launch import spawn

        nprocs = job.nprocs
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        if self.save_path is not None:
            from ..checkpoint.series import series_base

            series_base(self.save_path).parent.mkdir(parents=True, exist_ok=True)
        # With a save_path the survivors of too many deaths save before stopping, so
        # spawn must let them run; without one there is nothing to save and spawn's
        # own failure policy (RankFailed with the traceback) is the right answer.
        refused = False  # no rank trained: the run leaves the series as it found it
        try:
            results = spawn(_rank_main, nprocs, (job,), max_failures=self.max_failures,
                            survivors_save=bool(self.save_path),
                            timeout=self.timeout, save_path=self.save_path,
                            **(job.cluster.spawn_kwargs() if job.cluster else {}))
        except TypeError as e:  # spawn could not pickle the job: name the argument
            refused = True
            named = self._unpicklable()
            if named is None:
                raise
            raise named from e
        except RankFailed as e:
            if e.exc_type != "StartRefused":
                raise
            refused = True
            # a rank could not start (its setup failed, or the cohort's starts disagree):
            # the refusal's own message, with the rank's traceback as its cause
            raise StartRefused(_refusal(e)) from e
        finally:
            if self.save_path is not None and not refused:
                # every write has landed (spawn flushed the forge): prune exactly, on one
                # host failed writes too (other hosts may still write into a shared folder)
                from ..checkpoint.series import prune_series

                prune_series(self.save_path, self.keep_checkpoints, settled=job.cluster is None)
        return self._collect(results, job)

    def _unpicklable(self) -> Optional[TypeError]:
        """The error naming the first Trainer argument that cannot be pickled on its own
        (after spawn could not pickle the job), or None when each one can."""
        import pickle

        parts = [(name, getattr(self, name)) for name in _PICKLED_ARGS]
        parts += [(f"hooks[{i}]", h) for i, h in enumerate(self.hooks)]
        for name, value in parts:
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # pickle raises several types
                fix = ("pass a picklable dataset, or a module-level function that builds it "
                       "(each rank calls it)" if name == "dataset" else
                       "define it at module top level, or pass functools.partial of a "
                       "module-level function (lambdas and local functions cannot be "
                       "pickled)")
                return TypeError(f"Trainer: {name} cannot be pickled to the rank processes "
                                 f"({type(e).__name__}: {e}); {fix}")
        return None

    def _collect(self, results: list, job: _Job) -> TrainResult:
        reporting = next((r for r in results if r is not None and r["state_dict"] is not None),
                         None)
        if reporting is None:
            raise RuntimeError("no rank returned the final model (every rank failed)")
        # the coordinator's dead ranks are global; spawn's results are this host's ranks
        first = 0 if job.cluster is None else job.cluster.first_rank
        dead = tuple(sorted(set(reporting["dead_ranks"])
                            | {first + r for r, out in enumerate(results) if out is None}))
        ckpt = reporting["checkpoint"]
        if ckpt is None and job.model_path is not None and not reporting["summary"].windows:
            ckpt = job.model_path  # a resume with nothing left to train: its last checkpoint
        if ckpt is not None and not CheckpointBundle.meta_path(ckpt).exists():
            # its write failed (a full disk: the forge logged why): name what is on disk
            newest = None if self.save_path is None else latest_checkpoint(self.save_path)
            logger.error("the run's last checkpoint %s was not written (its write failed: see "
                         "the errors above); %s", ckpt,
                         "no checkpoint of this run is on disk" if newest is None else
                         f"the newest on disk is {newest}")
            ckpt = newest
        windows = reporting["summary"].windows
        if len(reporting["history"]) < windows and self.keep_history:
            logger.info("result.history holds the last %s of this run's %s windows "
                        "(keep_history=%s; keep_history=None keeps every one)",
                        f"{len(reporting['history']):,}", f"{windows:,}",
                        self.keep_history)
        result = TrainResult(_from_portable(reporting["state_dict"]), reporting["history"],
                             reporting["meta"],
                             None if ckpt is None else Path(ckpt), dead,
                             [None if r is None else r["summary"] for r in results])
        if result.reason == SaveReason.MAX_FAILURE_EXCEEDED:
            alive = max(result.meta.world_size_at_save, 1)  # resume()'s default nprocs
            raise TrainingAborted(
                self._abort_message(result, job.started), result,
                f"Continue with trainer.resume({self.save_path!r}) (on the {alive} "
                f"rank{'' if alive == 1 else 's'} alive at the save), or "
                f"trainer.resume({self.save_path!r}, nprocs={job.nprocs}) on {job.nprocs} again."
                if (result.checkpoint is not None and job.cluster is None
                    and self.cadence == "fixed" and alive < job.nprocs)
                else f"Continue with trainer.resume({self.save_path!r})."
                if result.checkpoint is not None else "")
        late = [r for r in dead if r not in reporting["dead_ranks"]]
        if late and len(dead) > self.max_failures:
            # failed after the last window (e.g. in a hook's on_train_end), past
            # max_failures: raised as without a save_path, where spawn raises it
            record = death_record_path(self.save_path, late[0])
            try:
                why = RankDeathRecord.read_from_file(record).error
            except Exception:  # noqa: BLE001 - the record is the detail, not the news
                why = "see the log"
            raise RankFailed(late[0], message=(
                f"rank {late[0]} failed after the run's last window, past max_failures="
                f"{self.max_failures}; the run finished"
                f"{f' (its last checkpoint: {ckpt})' if ckpt else ''}.\n{why}"))
        return result

    def _abort_message(self, result: TrainResult, since: float) -> str:
        """What ended the run: the ranks lost (they died, or on a cluster their host
        stopped or was lost), what the survivors saved, and each rank's death record
        written since ``since`` (this run's start: a resumed series holds the records of
        the run before; the ranks of one stopped host share one line)."""
        lines = [f"{plural(len(result.dead_ranks), 'rank')} lost ({list(result.dead_ranks)}), "
                 f"more than max_failures={self.max_failures}."]
        if result.checkpoint is not None:
            lines.append(f"The survivors saved {result.checkpoint} (max_failure_exceeded).")
        said: dict[str, list[int]] = {}
        for r in result.dead_ranks:
            path = death_record_path(self.save_path, r)
            try:
                record = RankDeathRecord.read_from_file(path)
            except Exception:
                continue
            if record.unix_time_secs >= int(since):
                said.setdefault(record.error, []).append(r)
        for error, ranks in said.items():
            if len(ranks) > 1:
                lines.append(f"ranks {ranks}: {error}")
            elif error.startswith(f"rank {ranks[0]} "):
                lines.append(error)  # (a killed rank's record holds spawn's whole line)
            else:
                lines.append(f"rank {ranks[0]}: {error}")
        return "\n".join(lines)


#: the Trainer's arguments that travel to every rank by pickling (besides ``hooks``)
_PICKLED_ARGS = ("model_fn", "optimizer_fn", "loss_fn", "step_fn", "scheduler_fn", "cadence",
                 "outer", "guard", "dataset")


def _is_real(value) -> bool:
    """A real number, not a bool or a string."""
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _log_level() -> Optional[int]:
    """The launcher's flodl_shm log level when logging is configured here (ranks then
    log the same way), else None."""
    lg = logging.getLogger("flodl_shm")
    if lg.handlers or logging.getLogger().handlers:
        return lg.getEffectiveLevel()
    return None


def _from_portable(state: dict) -> dict:
    import torch

    out = {}
    for k, (dtype, arr) in state.items():
        t = torch.from_numpy(arr)
        out[k] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


@contextlib.contextmanager
def _damage_named(model_path):
    """A ``CheckpointError`` reading the bundle of ``model_path`` (a damaged file) says
    which bundle to resume from instead (``_earlier_bundle``)."""
    from ..errors import CheckpointError

    try:
        yield
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_earlier_bundle(model_path)}") from e


def _earlier_bundle(model_path) -> str:
    """What to append to the error of a damaged bundle: the bundle before it in its
    series to resume from, or that there is none."""
    series = series_of(model_path)
    earlier = ([p for r, p in committed_checkpoints(series[0]) if r < series[1]]
               if series is not None else [])
    if earlier:
        return (f"; resume({os.fspath(earlier[-1])!r}) continues from the checkpoint before "
                f"it, or restore this one's files from a copy")
    return ("; no earlier checkpoint of its series is left: restore its files from a copy, or "
            "start over")


def _refusal(err: RankFailed) -> str:
    """The message of the ``StartRefused`` a rank raised, from its remote traceback."""
    _, found, text = (err.traceback or "").rstrip().rpartition("StartRefused: ")
    return text if found else str(err)
