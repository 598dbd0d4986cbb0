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
import copy
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from torch.nn.utils import clip_grad_norm_

from ..errors import RankFailed, StartRefused, TrainingAborted
from ..checkpoint.meta import (CheckpointBundle, CheckpointMeta, RankDeathRecord, SaveReason,
                               set_extension)
from .agreement import (check_controller_outer, check_same_settings, check_same_start,
                        outer_settings)
from .coordinator import Coordinator, CoordinatorConfig
from .coverage import SHUFFLE_BASE_SEED, epoch_permutation
from .data import fetch_batch, is_dataset_factory
from .hooks import (HOOK_METHODS, BatchInfo, Hook, LoggingHook, RankState, RankSummary,
                    WindowStats)
from .inner_state import restore_inner
from .local_sgd import LocalSGD
from .sync_window import (COUNT_ROWS, count_column, counts_from_reports, falls_short,
                          gather_counts)

logger = logging.getLogger("flodl_shm")

__all__ = ["Trainer", "TrainResult", "TrainingAborted"]

#: Format tag of a Trainer rank's ``<stem>.rank<N>.optim`` (its inner optimizer and LR
#: scheduler states and integer buffers at a checkpoint).
RANK_STATE_FORMAT = "flodl_shm.Trainer/1"


@dataclass
class TrainResult:
    """What ``Trainer.run`` / ``Trainer.resume`` return.

    Attributes:
        state_dict: the final model (the consensus of the last window; integer
            buffers are the reporting rank's own).
        history: the reporting rank's ``WindowStats`` of every window (without
            sample ids).
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
                 scheduler_fn: Optional[Callable] = None) -> None:
        if loss_fn is None and step_fn is None:
            raise ValueError("pass a loss_fn (output, target) -> loss, or a step_fn "
                             "(model, batch) -> loss")
        if scheduler_fn is not None and not callable(scheduler_fn):
            raise TypeError(f"scheduler_fn must be an optimizer -> LR scheduler callable, got "
                            f"{type(scheduler_fn).__name__}")
        # every integer argument is checked for its type first: a str batch_size would
        # otherwise fail on the arithmetic below with Python's own message
        for name, value in (("batch_size", batch_size), ("sync_every", sync_every),
                            ("keep_checkpoints", keep_checkpoints), ("accumulate", accumulate)):
            _check_int(name, value, 1)
        _check_int("epochs", epochs, 0)
        _check_int("max_failures", max_failures, 0)
        _check_int("seed", seed, 0)
        _check_int("checkpoint_every", checkpoint_every, 1, optional=True)
        _check_int("log_every", log_every, 1, optional=True)
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
            set_extension(self.save_path, "")  # a stem with a file name, or ValueError now
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
                (``nprocs``; a dataset that is not a factory, against ``batch_size``;
                the ElChe a cadence factory builds), naming the value and the fix.
            StartRefused: a rank's setup failed (a dataset factory's data, ``model_fn``
                ...): the run stops at once, saving nothing; the rank's error is the
                message, its ``RankFailed`` (with the traceback) the cause.
            SeriesInUse: another run is writing ``save_path``'s series.
            TrainingAborted: more than ``max_failures`` ranks died (with ``save_path``;
                the survivors saved first).
            RankFailed: a rank failed and no checkpoint could be saved.
        """
        from ..checkpoint.series import committed_checkpoints, delete_series

        _check_int("nprocs", nprocs, 1)
        cluster = _Cluster.of(controller, world_size, first_rank, salt, int(nprocs))
        with self._run_lock(controller, salt):
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
            return
        if not overwrite:
            raise FileExistsError(
                f"{self.save_path} holds checkpoints this resume from {model_path.name} would "
                f"not continue (newest: {beyond[-1].name}); they would outrank its own. "
                f"Resume from the newest (trainer.resume() with no path), or pass "
                f"overwrite=True to delete them")
        delete_rounds(self.save_path, after)

    def _run_lock(self, controller, salt):
        """The run lock of ``save_path``'s series, or nothing to hold without one. The
        hosts of one cluster share it (their save paths may be one shared folder): the
        job is a digest of the session salt, which they all hold."""
        if self.save_path is None:
            return contextlib.nullcontext()
        from ..checkpoint.run_lock import RunLock, cluster_job

        return RunLock(self.save_path,
                       None if controller is None else cluster_job(salt, controller))

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
        with self._run_lock(controller, salt):  # the series this run writes, as run() does
            return self._resume(target, nprocs, controller, world_size, first_rank, salt,
                                overwrite)

    def _resume(self, target, nprocs, controller, world_size, first_rank, salt,
                overwrite) -> TrainResult:
        from ..checkpoint.series import resolve_checkpoint

        model_path = resolve_checkpoint(target)
        meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(model_path))
        saved_world = (len(meta.elche_state.smoothed_ms_per_batch)
                       if meta.elche_state is not None else None)
        if nprocs is None:
            if controller is not None:
                raise ValueError("resume() on a cluster needs nprocs (this host's ranks)")
            nprocs = saved_world or max(meta.world_size_at_save, 1)
        _check_int("nprocs", nprocs, 1)
        cluster = _Cluster.of(controller, world_size, first_rank, salt, int(nprocs))
        world = int(nprocs) if cluster is None else cluster.world_size
        self._check_setup(world, meta, model_path)
        self._clear_beyond(model_path, overwrite)  # only once the resume can start
        if meta.epoch >= self.epochs:
            logger.info("%s finished %d epoch(s), and this Trainer has epochs=%d: nothing "
                        "left to train (pass a larger epochs to continue)", model_path,
                        meta.epoch, self.epochs)
        else:
            logger.info("resuming from %s: epoch %d, step %d, round %d (%s)", model_path,
                        meta.epoch, meta.global_step, meta.sync_round, meta.save_reason)
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
        n = self._dataset_len()
        if n is not None and n < self.batch_size:
            raise ValueError("the dataset is empty: pass one with samples" if n == 0 else
                             f"the dataset has {n} samples, fewer than one batch of "
                             f"batch_size={self.batch_size}; pass a batch_size of at most {n}")
        if callable(self.cadence) and world >= 2:
            from .el_che import ElChe

            el_che = self.cadence(world)
            if not isinstance(el_che, ElChe):
                raise TypeError(f"the cadence factory must return an ElChe, got "
                                f"{type(el_che).__name__}")
            if el_che.world_size != world:
                raise ValueError(f"the cadence factory built an ElChe for world_size "
                                 f"{el_che.world_size}, but the run has {world} ranks; build "
                                 f"it for the world_size it is called with")
        if meta is None:
            return
        for c in resume_conflicts(meta, seed=self.seed, batch_size=self.batch_size,
                                  epochs=self.epochs, dataset_len=n, world=world,
                                  elche=self.cadence != "fixed"):
            if c.setting == "dataset":
                raise ValueError(f"{model_path} was trained on epochs of {c.saved} samples, "
                                 f"and this Trainer's are {c.given} {c.why}: resume with the "
                                 f"dataset it was trained on")
            if c.setting == "world_size":
                raise ValueError(f"{model_path} holds an ElChe cadence state for {c.saved} "
                                 f"ranks and this run has {c.given}: resume an ElChe run "
                                 f"on {c.saved} ranks, or with cadence='fixed'")
            raise ValueError(f"{model_path} was trained with {c.setting} {c.saved} and this "
                             f"Trainer has {c.setting}={c.given}: resume with {c.setting}="
                             f"{c.saved} {c.why}")
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
        from .data import resolve_dataset

        ds = self.dataset
        if is_dataset_factory(ds):
            return None
        ds = resolve_dataset(ds)  # raises for a dataset of the wrong kind, as the ranks would
        if isinstance(ds, (tuple, list)) and ds:
            if self.step_fn is None and not isinstance(ds[0], (tuple, list)):
                raise TypeError(f"dataset item 0 is of type {type(ds[0]).__name__}: with a "
                                f"loss_fn, each item must be an (input..., target) tuple; "
                                f"pass a tuple of tensors (inputs..., targets), or a list of "
                                f"such items")
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
        try:
            results = spawn(_rank_main, nprocs, (job,), max_failures=self.max_failures,
                            survivors_save=bool(self.save_path),
                            timeout=self.timeout, save_path=self.save_path,
                            **(job.cluster.spawn_kwargs() if job.cluster else {}))
        except TypeError as e:  # spawn could not pickle the job: name the argument
            named = self._unpicklable()
            if named is None:
                raise
            raise named from e
        except RankFailed as e:
            if e.exc_type != "StartRefused":
                raise
            # a rank could not start (its setup failed, or the cohort's starts disagree):
            # the refusal's own message, with the rank's traceback as its cause
            raise StartRefused(_refusal(e)) from e
        finally:
            if self.save_path is not None:
                # every write has landed (spawn flushed the forge): prune exactly
                from ..checkpoint.series import prune_series

                prune_series(self.save_path, self.keep_checkpoints)
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
        result = TrainResult(_from_portable(reporting["state_dict"]), reporting["history"],
                             reporting["meta"],
                             None if ckpt is None else Path(ckpt), dead,
                             [None if r is None else r["summary"] for r in results])
        if result.reason == SaveReason.MAX_FAILURE_EXCEEDED:
            raise TrainingAborted(self._abort_message(result), result,
                                  f"Continue with trainer.resume({self.save_path!r})."
                                  if result.checkpoint is not None else "")
        late = [r for r in dead if r not in reporting["dead_ranks"]]
        if late and len(dead) > self.max_failures:
            # failed after the last window (e.g. in a hook's on_train_end), past
            # max_failures: raised as without a save_path, where spawn raises it
            record = CheckpointBundle.rank_death_path(self.save_path, late[0])
            try:
                why = RankDeathRecord.read_from_file(record).error
            except Exception:  # noqa: BLE001 - the record is the detail, not the news
                why = "see the log"
            raise RankFailed(late[0], message=(
                f"rank {late[0]} failed after the run's last window, past max_failures="
                f"{self.max_failures}; the run finished"
                f"{f' (its last checkpoint: {ckpt})' if ckpt else ''}.\n{why}"))
        return result

    def _abort_message(self, result: TrainResult) -> str:
        lines = [f"{len(result.dead_ranks)} rank(s) died ({list(result.dead_ranks)}), more "
                 f"than max_failures={self.max_failures}."]
        if result.checkpoint is not None:
            lines.append(f"The survivors saved {result.checkpoint} (max_failure_exceeded).")
        for r in result.dead_ranks:
            path = CheckpointBundle.rank_death_path(self.save_path, r)
            try:
                lines.append(f"rank {r}: " + RankDeathRecord.read_from_file(path).error)
            except Exception:
                pass
        return "\n".join(lines)


#: the Trainer's arguments that travel to every rank by pickling (besides ``hooks``)
_PICKLED_ARGS = ("model_fn", "optimizer_fn", "loss_fn", "step_fn", "scheduler_fn", "cadence",
                 "outer", "guard", "dataset")


@dataclass(frozen=True)
class ResumeConflict:
    """A setting of the resuming run that cannot continue a checkpoint: the checkpoint's
    value (``saved``) and the run's (``given``). ``setting`` is ``"seed"``,
    ``"batch_size"``, ``"world_size"`` (an ElChe cadence state is per rank) or
    ``"dataset"`` (its epoch size, in samples); ``why`` says, in parentheses, what binds
    the saved value (for the dataset: how the run's epoch size comes about)."""

    setting: str
    saved: Any
    given: Any
    why: str


def resume_conflicts(meta: CheckpointMeta, *, seed: int, batch_size: int, epochs: int,
                     dataset_len: Optional[int], world: int, elche: bool
                     ) -> list[ResumeConflict]:
    """What keeps a run with these settings from continuing the checkpoint ``meta``
    describes (empty: nothing), known before any rank starts: the shuffle seed and the
    batch size its record of the samples still to train refers to, the epoch size, and
    the world size of an ElChe cadence state. A finished checkpoint (``meta.epoch >=
    epochs``: nothing left to train) binds no seed, batch size or epoch size.

    Args:
        meta: the checkpoint's metadata.
        seed, batch_size, epochs: the resuming run's.
        dataset_len: its dataset's length (None: unknown, a factory).
        world: its number of ranks.
        elche: whether it runs the ElChe cadence.
    """
    out = []
    cov = meta.coverage
    if cov is not None and meta.epoch < epochs:  # what the ranks' coordinator reads
        if cov.seed != seed:
            out.append(ResumeConflict(
                "seed", cov.seed, seed, "(its record of the samples still to train refers "
                "to that seed's shuffle; another would train some samples twice and skip "
                "others)"))
        if cov.batch_size != batch_size:
            out.append(ResumeConflict(
                "batch_size", cov.batch_size, batch_size, f"(its record of the samples "
                f"still to train counts whole batches of {cov.batch_size})"))
        per_epoch = (None if dataset_len is None
                     else (dataset_len // batch_size) * batch_size)
        for ec in cov.per_epoch:
            if ec.epoch == meta.epoch and per_epoch not in (None, ec.total_samples):
                out.append(ResumeConflict(
                    "dataset", ec.total_samples, per_epoch, f"({dataset_len} samples in "
                    f"batches of {batch_size})"))
    if meta.elche_state is not None and elche:
        saved_world = len(meta.elche_state.smoothed_ms_per_batch)
        if saved_world != world:
            out.append(ResumeConflict(
                "world_size", saved_world, world, "(its ElChe cadence state is per rank)"))
    return out


def model_mismatch(model_path: "str | os.PathLike[str]", model_fn: Callable) -> Optional[str]:
    """Why the consensus checkpoint ``model_path`` cannot load into the model ``model_fn``
    builds (a parameter or averaged buffer missing, extra, or of another shape; the
    message calls them "the checkpoint" and "the model"), or None when it fits.

    Reads the ``.fdl``'s headers only, and the bundle's ``.names.json`` to name the
    tensors; ``model_fn`` is called once here, on torch's meta device (no memory, no
    draw from torch's RNG, no torch thread pool started in the launcher). A model that
    cannot be built there is left to the ranks' own load to check (None)."""
    import torch

    from ..checkpoint.fdl import FdlReader
    from ..checkpoint.forge import consensus_targets
    from ..checkpoint.meta import ModelSchema, names_sidecar_path
    from ..errors import CheckpointError

    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = model_fn()
    except Exception:  # model_fn needs real tensors: the ranks' load checks it
        return None
    if not isinstance(model, torch.nn.Module):
        return None  # the ranks raise the TypeError naming it
    mine = {t.key: (t.label, tuple(t.tensor.shape)) for t in consensus_targets(model)}
    with FdlReader(model_path) as reader:
        saved = {e.name: tuple(e.shape) for e in reader.entries(False)}
    try:
        names = ModelSchema.read_from_file(names_sidecar_path(model_path)).positional_names()
    except (CheckpointError, OSError):
        names = {}  # no names (an older bundle): the positions name them

    def kind(key: str) -> str:
        return "buffer" if key.startswith("b") else "parameter"

    problems = []
    for key, (label, shape) in mine.items():
        theirs = names.get(key, label)
        if key not in saved:
            problems.append(f"the model's {kind(key)} {label!r} {list(shape)} is not in the "
                            f"checkpoint")
        elif saved[key] != shape and theirs == label:
            problems.append(f"{kind(key)} {label!r} is {list(saved[key])} in the checkpoint "
                            f"and {list(shape)} in the model")
        elif saved[key] != shape:
            problems.append(f"{kind(key)} {key} is {theirs!r} {list(saved[key])} in the "
                            f"checkpoint and {label!r} {list(shape)} in the model")
    problems += [f"the checkpoint's {kind(key)} {names.get(key, key)!r} {list(shape)} has no "
                 f"place in the model" for key, shape in saved.items() if key not in mine]
    if not problems:
        return None
    more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
    counts = (f"{len(saved)} tensors in the checkpoint, {len(mine)} in the model; "
              if len(saved) != len(mine) else "")
    return counts + "; ".join(problems[:2]) + more


def _is_real(value) -> bool:
    """A real number, not a bool or a string."""
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int (numpy's too, not a bool
    or a str) of at least ``minimum`` (or None, when ``optional``)."""
    import numbers

    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}"
                         f"{' or None' if optional else ''}, got {value!r}")


def _log_level() -> Optional[int]:
    """The launcher's flodl_shm log level when logging is configured here (ranks then
    log the same way), else None."""
    lg = logging.getLogger("flodl_shm")
    if lg.handlers or logging.getLogger().handlers:
        return lg.getEffectiveLevel()
    return None


def _setup_rank_logging(level: Optional[int], rank: int) -> None:
    """A rank's own log handler, only where nothing forwards its records already: under
    ``spawn`` they reach the launcher's handlers (a second handler here printed every
    line twice)."""
    from ..launch import rank_logs_forwarded

    if level is None or logging.getLogger().handlers or rank_logs_forwarded():
        return
    lg = logging.getLogger("flodl_shm")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
    lg.addHandler(handler)
    lg.setLevel(level)


class _CohortDecisionFilter(logging.Filter):
    """ElChe's, the convergence guard's and the coordinator's decisions are computed
    identically on every rank from the same gathered numbers: only the reporting rank
    (the lowest live one) logs them, so each decision reads once in the launcher's log."""

    MODULES = frozenset({"el_che", "convergence", "coordinator"})

    def __init__(self, is_reporter: Callable[[], bool]) -> None:
        super().__init__()
        self.is_reporter = is_reporter

    def filter(self, record: logging.LogRecord) -> bool:
        return record.module not in self.MODULES or self.is_reporter()


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that spreads every input
    bit over the output."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def window_seed(seed: int, rank: int, window: int) -> int:
    """The torch RNG seed of ``rank``'s training in ``window`` (63 bits of a SplitMix64
    chain over the three), so stochastic layers replay identically after a resume.
    Integer arithmetic only: right after a window's books, a BLAKE2b hash of the same
    three cost ~15 us and ``numpy.random.SeedSequence`` ~50-80 us."""
    return _mix64(_mix64(_mix64(int(seed)) ^ int(rank)) ^ int(window)) >> 1


def _accelerators_present() -> bool:
    """Whether torch sees a device besides the CPU whose generator ``manual_seed`` seeds."""
    import torch

    for name in ("cuda", "xpu", "mtia"):
        mod = getattr(torch, name, None)
        try:
            if mod is not None and mod.is_available():
                return True
        except Exception:  # a backend that cannot even answer is not in use
            pass
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)``, minus the cost of queueing lazy seeds for devices this
    host does not have: on a CPU-only host each call records three stack traces for the
    CUDA, XPU and MTIA seeds (~0.5 ms a window in a rank); the CPU generator gets the
    same seed either way."""
    import torch

    global _ACCELERATORS
    if _ACCELERATORS is None:
        _ACCELERATORS = _accelerators_present()
    if _ACCELERATORS:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


_ACCELERATORS: Optional[bool] = None


# --- the rank side ----------------------------------------------------------------------


class _RankRun:
    """One rank's training: model, data, coordinator, and the window loop."""

    def __init__(self, ctx, job: _Job) -> None:
        import torch

        from ..checkpoint.meta import ModelSchema
        from .data import resolve_dataset

        self.ctx = ctx
        self.comm = ctx.comm
        self.rank = ctx.rank
        self.job = job
        tr = self.trainer = job.trainer
        torch.manual_seed(tr.seed)
        model = tr.model_fn()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.dataset = resolve_dataset(tr.dataset)
        self._on_batch_end = _hook_calls(tr.hooks, "on_batch_end")
        self.coord = self._coordinator(len(self.dataset))  # checks the data against the run
        self.schema = ModelSchema.from_module(model)
        # one host: a window is one round (its counts ride in it); several: a count
        # gather first (_window_cluster)
        self.one_round = ctx.local_world_size == ctx.world_size
        if job.model_path is not None:
            self._load_consensus(job.model_path)
        self.optimizer = tr.optimizer_fn(model.parameters())
        self.scheduler = None if tr.scheduler_fn is None else tr.scheduler_fn(self.optimizer)
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "scheduler_fn built a ReduceLROnPlateau, which steps on a metric; the Trainer "
                "steps its scheduler after every optimizer step, without one. Pass no "
                "scheduler_fn and drive it from a hook: build it in on_train_start "
                "(ReduceLROnPlateau(state.optimizer)) and step it in on_window_end with "
                "your metric (e.g. stats.cohort_loss)")
        if not self.one_round:
            self._check_same_trainer()
            self._check_same_start()
        # the window itself (counting, the realized-work rounds, the outer step, the
        # inner reset): a LocalSGD that syncs when the coordinator says so; it aligns
        # the replicas on rank 0's weights (on a resume they are the checkpoint's)
        self.sgd = _WindowSGD(model, sync_every=None, comm=self.comm, outer=tr.outer,
                              bf16_wire=tr.bf16_wire, optimizer=self.optimizer,
                              gamma=tr.gamma, buffers="movers", drift=True)
        if job.model_path is not None:
            self._load_outer_momentum(job.model_path)
            self._load_rank_state(job.model_path)
        logging.getLogger("flodl_shm").addFilter(_CohortDecisionFilter(
            lambda: bool(self.coord.alive) and self.coord.alive[0] == self.rank))
        self._perm_epoch = -1
        self._perm = None

    def _check_same_trainer(self) -> None:
        """Several hosts: every host built the same Trainer (``check_same_settings``).
        Hosts with another seed, batch size or epoch count plan other windows from the
        same books: samples trained twice or never, or a host that stops early taken for
        dead. (On one host every rank gets the same pickled Trainer.)"""
        tr = self.trainer
        cadence = tr.cadence if isinstance(tr.cadence, str) else type(tr.cadence).__name__
        check_same_settings(self.comm, {
            "seed": tr.seed, "batch_size": tr.batch_size, "epochs": tr.epochs,
            "sync_every": tr.sync_every, "cadence": cadence, "gamma": tr.gamma,
            "checkpoint_every": tr.checkpoint_every, "max_failures": tr.max_failures,
            "bf16_wire": tr.bf16_wire, "outer": outer_settings(tr.outer),
            "the dataset's length": len(self.dataset)},
            "build the same Trainer, with the same dataset, on every host")

    def _check_same_start(self) -> None:
        """Several hosts: every rank starts from the same checkpoint, or every rank from
        scratch (``check_same_start``). A host left with an older bundle would take rank
        0's weights at the alignment and keep its own books (data coverage, epoch,
        cadence), and the ranks would plan different windows. The controller must step
        this Trainer's outer optimizer, and with a stateful one its outer momentum must
        start from that round too (``check_controller_outer``)."""
        meta = self.job.resume_meta
        start = None if meta is None else meta.sync_round
        check_same_start(self.comm, start,
                         "resume every host from the same checkpoint round (each host "
                         "writes its own copy of every bundle; a host that lost its copy "
                         "can take the controller's .fdl and .meta.json of that round)")
        # the controller steps the outer optimizer: this one, from this round's momentum
        from ..checkpoint.forge import outer_sidecar_path

        check_controller_outer(self.comm, self.trainer.outer, start, None if start is None
                               else outer_sidecar_path(self.job.model_path).name)

    def _coordinator(self, dataset_len: int) -> Coordinator:
        tr = self.trainer
        cadence = "fixed" if tr.cadence == "fixed" else "elche"
        config = CoordinatorConfig(
            world_size=self.ctx.world_size, dataset_len=dataset_len, batch_size=tr.batch_size,
            epochs=tr.epochs, seed=tr.seed, sync_every=tr.sync_every, cadence=cadence,
            checkpoint_every=tr.checkpoint_every, max_failures=tr.max_failures)
        if self.job.resume_meta is not None:
            config = config.resume_from_meta(self.job.resume_meta)
        el_che = None
        if callable(tr.cadence) and self.ctx.world_size >= 2:
            el_che = tr.cadence(self.ctx.world_size)
        return Coordinator(config, el_che=el_che, guard=copy.deepcopy(tr.guard))

    def _load_consensus(self, path) -> None:
        """Resume: the checkpoint's consensus into this replica."""
        from ..checkpoint.forge import load_consensus_checkpoint

        report = load_consensus_checkpoint(self.model, path)
        if report.missing or report.unexpected:
            raise ValueError(f"{path} does not match the model built by model_fn: missing "
                             f"{report.missing}, unexpected {report.unexpected}")

    def _load_outer_momentum(self, path) -> None:
        """Resume: the outer momentum the next outer round continues from."""
        from ..checkpoint.forge import load_outer_momentum, outer_sidecar_path

        outer = self.trainer.outer
        if not self.one_round:
            return  # on a cluster the controller steps the outer optimizer (--outer-state)
        if outer is not None and getattr(outer, "has_momentum", False):
            opath = outer_sidecar_path(path)
            if opath.exists():
                self.comm.load_outer_momentum(load_outer_momentum(self.model, opath))
            else:
                logger.warning("%s not found: the outer momentum restarts from zero", opath)

    # -- each rank's own share of a checkpoint -------------------------------------------
    def _save_rank_state(self, model_path) -> None:
        """Write this rank's ``<stem>.rank<N>.optim`` next to the bundle: what the consensus
        does not hold and an exact resume needs, its inner optimizer's and LR scheduler's
        states and its integer buffers (``num_batches_tracked``). Atomic; on the training
        path, at checkpoint windows only (the optimizer state changes at the next step)."""
        import torch

        from ..checkpoint._atomic import atomic_write

        state = {
            "format": RANK_STATE_FORMAT, "rank": self.rank, "world_size": self.ctx.world_size,
            "sync_round": self.coord.sync_round,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "integer_buffers": {name: b.detach().clone()
                                for name, b in self.model.named_buffers()
                                if not b.is_floating_point()},
        }
        atomic_write(CheckpointBundle.rank_state_path(model_path, self.rank),
                     lambda fh: torch.save(state, fh))

    def _load_rank_state(self, model_path) -> None:
        """On resume: this rank's inner optimizer and LR scheduler states and integer
        buffers from the bundle's ``.rank<N>.optim``, when it is there and was written by a
        cohort of the same size; otherwise they start fresh (logged)."""
        import torch

        path = CheckpointBundle.rank_state_path(model_path, self.rank)
        if not path.exists():
            logger.info("%s not found: rank %d's inner optimizer, LR schedule and integer "
                        "buffers start fresh", path, self.rank)
            return
        state = torch.load(path, weights_only=False)
        if not isinstance(state, dict) or state.get("format") != RANK_STATE_FORMAT:
            raise ValueError(f"{path} is not a Trainer rank state (format "
                             f"{RANK_STATE_FORMAT!r} expected)")
        if state["world_size"] != self.ctx.world_size:
            logger.warning("%s was written by a cohort of %d ranks, this one has %d: rank %d's "
                           "inner optimizer, LR schedule and integer buffers start fresh", path,
                           state["world_size"], self.ctx.world_size, self.rank)
            return
        restore_inner(self.optimizer, self.scheduler, state["optimizer"],
                      state.get("scheduler"), str(path),
                      "set them in a hook's on_train_start (state.optimizer.param_groups, "
                      "state.scheduler)",
                      say=self.rank == self.coord.alive[0])  # the ranks' settings agree
        if self.scheduler is not None and state.get("scheduler") is None:
            logger.warning("%s holds no LR scheduler state: rank %d's schedule starts over",
                           path, self.rank)
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, value in state["integer_buffers"].items():
                if name in buffers:
                    buffers[name].copy_(value)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = epoch_permutation(self.trainer.seed, epoch, len(self.dataset))
            self._perm_epoch = epoch
        return self._perm

    def _train(self, plan, state: RankState) -> tuple[int, float, float, np.ndarray]:
        """Train this rank's chunks of the window; returns (batches, compute ms, loss
        sum, sample ids)."""
        tr = self.trainer
        bs = tr.batch_size
        perm = self._permutation(plan.epoch)
        mine = plan.chunks[self.rank]
        ids_all = (np.concatenate([perm[o:o + n] for o, n in mine]) if mine
                   else np.empty(0, np.int64))
        nb = plan.batches[self.rank]
        _seed_torch(window_seed(tr.seed, self.rank, plan.window))
        if not self.model.training:  # a hook evaluated it and left it in eval mode
            self.model.train()  # (~10-90 µs a window for nothing otherwise)
        t0 = time.perf_counter()
        loss_sum = 0.0
        for k in range(nb):
            tb = time.perf_counter()
            ids = ids_all[k * bs:(k + 1) * bs]
            batch = fetch_batch(self.dataset, ids)
            self.optimizer.zero_grad(set_to_none=True)
            value = self._backward(batch)
            if tr.clip_grad_norm is not None:
                clip_grad_norm_(self.model.parameters(), tr.clip_grad_norm)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.sgd.step(1)  # a batch's work (the params mass is gamma_mass(batches))
            loss_sum += value
            if self._on_batch_end:
                info = BatchInfo(plan.epoch, plan.window, k, ids, value,
                                 (time.perf_counter() - tb) * 1e3)
                for call in self._on_batch_end:
                    call(state, info)
        return nb, (time.perf_counter() - t0) * 1e3, loss_sum, ids_all

    def _loss(self, batch):
        tr = self.trainer
        if tr.step_fn is not None:
            return tr.step_fn(self.model, batch)
        *inputs, target = batch
        return tr.loss_fn(self.model(*inputs), target)

    def _backward(self, batch) -> float:
        """Back-propagate one batch's loss (in ``accumulate`` micro-batches); returns the
        batch's loss."""
        k = self.trainer.accumulate
        if k == 1:
            loss = self._loss(batch)
            loss.backward()
            return float(loss.detach())
        total = 0.0
        for part in zip(*(t.chunk(k) for t in batch)):
            loss = self._loss(part) / k
            loss.backward()
            total += float(loss.detach())
        return total

    # -- the window's sync ------------------------------------------------------------
    def _window_one_round(self, plan, nb: int, compute_ms: float, loss_sum: float,
                          state: RankState, prev_sync):
        """One host: the counts ride in the params round, the coordinator settles on
        exactly what that round accepted, and a checkpoint is posted afterwards from
        the lowest live rank's replica (which holds the consensus). One collective
        (two with floating-point buffers). Returns (counts, settlement, sync,
        checkpoint path or None)."""
        column = count_column(nb, compute_ms, loss_sum, state.stop_requested, prev_sync)
        sync = self.sgd.sync(report=column)
        counts = counts_from_reports(sync.report_rows)
        settled = self.coord.settle(plan, counts, undoable=False)
        ckpt = None
        if settled.save_reason is not None and self.trainer.save_path and sync.mass > 0:
            ckpt = self._checkpoint_path()
            self._write_bundle(ckpt, settled.save_reason, sync.mass)
        return counts, settled, sync, ckpt

    def _window_cluster(self, plan, counts):
        """Several hosts: the counts were gathered before the params round (the
        coordinator settles first, so a checkpoint can be armed for the controller's
        forge to capture); a rank that dies between the gather and the params round is
        caught by the realized-work check and the window settled again. Returns
        (counts, settlement, sync, checkpoint path or None)."""
        coord, comm = self.coord, self.comm
        settled = coord.settle(plan, counts)
        ckpt = reason = None
        if settled.save_reason is not None and self.trainer.save_path \
                and counts.total_batches > 0:
            ckpt, reason = self._checkpoint_path(), settled.save_reason
            # the lowest live rank arms the controller's forge (rank 0 may be gone)
            comm.arm_checkpoint(ckpt, self.schema, coord.checkpoint_meta(reason),
                                tells_controller=self.rank == coord.alive[0])
        sync = self.sgd.sync()
        if falls_short(sync.mass, counts, self.trainer.gamma):
            realized = sorted(r for r in sync.accepted if counts.batches[r] > 0)
            logger.warning(
                "window %d: the params round accepted less work than the count gather "
                "promised (a rank died in between); crediting ranks %s only%s", plan.window,
                realized, "; the checkpoint armed at this window overstates coverage and "
                "the next window is checkpointed again" if ckpt else "")
            settled = coord.resettle(plan, counts, realized)
        if ckpt is not None and sync.mass > 0:
            # each host keeps its own copy of the bundle, so it resumes from its own disk
            # (the controller's forge writes the controller's, with the outer momentum)
            self._write_bundle(ckpt, reason, sync.mass)
        return counts, settled, sync, ckpt

    def _write_bundle(self, ckpt, reason: SaveReason, mass: float) -> None:
        """This host's copy of the window's bundle: every rank writes its own
        ``.optim``, then, after a barrier, the host's lead rank posts its replica (the
        consensus) to this host's forge, so a bundle with a ``.meta.json`` has every
        live rank's ``.optim``. Right after the window's sync: the optimizer state
        changes at the next step."""
        self._save_rank_state(ckpt)
        self.comm.barrier()
        if self._is_host_lead():
            self._post_checkpoint(ckpt, reason, mass)

    def _is_host_lead(self) -> bool:
        """Whether this rank is the lowest live rank of its host (on one host: of the
        cohort): the one that prunes, posts and reports for its host."""
        first = self.rank - self.ctx.local_rank
        here = [r for r in self.coord.alive if first <= r < first + self.ctx.local_world_size]
        return bool(here) and self.rank == here[0]

    def _checkpoint_path(self):
        """This window's bundle path; each host's lead rank prunes its series first (the
        ``keep_checkpoints`` committed bundles survive until this one commits: a crash
        mid-write still leaves them all; the end of the run prunes exactly)."""
        from ..checkpoint.series import prune_series, round_model_path

        tr = self.trainer
        if self._is_host_lead():
            prune_series(tr.save_path, tr.keep_checkpoints)
        return round_model_path(tr.save_path, self.coord.sync_round)

    def _post_checkpoint(self, path, reason: SaveReason, mass: float) -> None:
        """Hand this replica (the consensus, right after the window's rounds) and, on one
        host, the outer momentum to this host's forge, with the settled metadata. (On a
        cluster the momentum lives in the controller, which writes it with its copy.)"""
        tensors = [t.detach() for t in (*self.sgd.params, *self.sgd.buffers)]
        self.comm.post_checkpoint(
            path, self.schema, tensors, mass=mass, meta=self.coord.checkpoint_meta(reason),
            momentum=self.comm.outer_momentum() if self.one_round else None)

    def start(self) -> RankState:
        """The rank's state at the start, handed to the hooks' ``on_train_start`` (the
        last step of the rank's setup)."""
        coord = self.coord
        state = RankState(self.rank, self.ctx.world_size, self.model, self.optimizer,
                          coord.epoch, coord.sync_round, coord.global_step, tuple(coord.alive),
                          scheduler=self.scheduler)
        for call in _hook_calls(self.trainer.hooks, "on_train_start"):
            call(state)
        return state

    def run(self, state: RankState) -> dict:
        tr, coord, comm = self.trainer, self.coord, self.comm
        count_bytes = COUNT_ROWS * self.ctx.world_size * 4  # a count gather's payload
        on_window_end = _hook_calls(tr.hooks, "on_window_end")
        history: list[WindowStats] = []
        dead: list[int] = []
        last_ckpt: Optional[str] = None
        reason: Optional[SaveReason] = None
        windows = 0
        prev_sync = None
        while True:
            plan = coord.plan_window()
            if plan is None:
                break
            state.epoch, state.window, state.global_step = plan.epoch, plan.window, \
                coord.global_step
            state.live_ranks = tuple(coord.alive)
            t_start = time.perf_counter()
            nb, compute_ms, loss_sum, ids = self._train(plan, state)
            t_trained = time.perf_counter()
            if self.one_round:
                counts, settled, sync, ckpt = self._window_one_round(plan, nb, compute_ms,
                                                                     loss_sum, state, prev_sync)
                gather_ms = 0.0
            else:
                t_gather = time.perf_counter()
                counts = gather_counts(comm, nb, compute_ms, loss_sum,
                                       stop=state.stop_requested, prev=prev_sync)
                gather_ms = (time.perf_counter() - t_gather) * 1e3
                counts, settled, sync, ckpt = self._window_cluster(plan, counts)
            dead += settled.newly_dead
            if ckpt is not None:
                last_ckpt = os.fspath(ckpt)
            prev_sync = sync
            ack = counts.prev_ack
            coord.report(counts, ack, settled.realized)
            windows += 1
            t_end = time.perf_counter()
            window_ms = (t_end - t_start) * 1e3
            total = counts.total_batches
            stats = WindowStats(
                rank=self.rank, epoch=plan.epoch, window=plan.window,
                global_step=coord.global_step, batches=nb, cohort_batches=counts.batches,
                sample_ids=ids if self.rank in settled.realized else ids[:0],
                loss=loss_sum / nb if nb else math.nan,
                cohort_loss=sum(counts.loss_sum) / total if total else math.nan,
                compute_ms=compute_ms, gather_ms=gather_ms, sync_ms=sync.sync_ms,
                window_ms=window_ms,
                samples_per_s=total * tr.batch_size / (window_ms / 1e3) if window_ms > 0 else 0.0,
                bytes_sent=sync.bytes_sent + (0 if self.one_round else count_bytes),
                divergence=sync.divergence,
                max_divergence=ack.max_divergence, live_ranks=tuple(coord.alive),
                skipped=total == 0, checkpoint=None if ckpt is None else os.fspath(ckpt),
                save_reason=None if ckpt is None else settled.save_reason.value,
                next_batches=() if settled.stop else tuple(coord.base_counts()),
                averaging_ms=(t_end - t_trained) * 1e3)
            state.global_step = coord.global_step
            state.live_ranks = tuple(coord.alive)
            for call in on_window_end:
                call(state, stats)
            history.append(dataclasses.replace(stats, sample_ids=None))
            if settled.stop:
                reason = settled.save_reason
                break
        summary = RankSummary(self.rank, windows, coord.global_step, coord.epoch,
                              None if reason is None else reason.value, tuple(dead), last_ckpt)
        for call in _hook_calls(tr.hooks, "on_train_end"):
            call(state, summary)
        # each host reports from its lowest live rank (on one host: the reporting rank)
        reporting = self._is_host_lead()
        return {
            "summary": summary,
            "dead_ranks": tuple(dead),
            "checkpoint": last_ckpt,
            "meta": coord.checkpoint_meta(reason or SaveReason.GRACEFUL_SHUTDOWN),
            "history": history if reporting else None,
            "state_dict": _to_portable(self.model.state_dict()) if reporting else None,
        }


class _WindowSGD(LocalSGD):
    """The Trainer's window: a :class:`LocalSGD` built with ``sync_every=None`` (the
    coordinator decides when every rank syncs), keeping the Trainer's (flodl's) outer
    rules. A stateful outer optimizer steps inside the params round on a cluster too,
    where the controller steps it and its forge writes the checkpoints; and the first
    outer step of a run or of a resume is a no-op (the previous global is that
    round's consensus), since a controller cannot know the initial weights."""

    _same_setup_fix = "make model_fn build the same model on every rank"

    def _round_steps_outer(self) -> bool:
        return True

    def _seed_outer_round(self) -> None:
        self.comm.load_outer_state()


def _to_portable(state: dict) -> dict:
    """A state_dict as numpy arrays: torch pickles tensors through a multiprocessing
    pipe as shared-memory handles that die with the rank process, so a rank's result
    carries plain bytes instead."""
    import torch

    out = {}
    for k, v in state.items():
        v = v.detach().cpu().contiguous()
        if v.dtype == torch.bfloat16:
            out[k] = ("bfloat16", v.view(torch.int16).numpy().copy())
        else:
            out[k] = (str(v.dtype).replace("torch.", ""), v.numpy().copy())
    return out


def _from_portable(state: dict) -> dict:
    import torch

    out = {}
    for k, (dtype, arr) in state.items():
        t = torch.from_numpy(arr)
        out[k] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return out


def _rank_main(ctx, job: _Job) -> dict:
    """The function ``spawn`` runs in every rank."""
    _setup_rank_logging(job.log_level, ctx.rank)
    with _refused_if_it_fails(ctx.rank):
        run = _RankRun(ctx, job)
        state = run.start()
    return run.run(state)


def _hook_calls(hooks: Sequence[Any], name: str) -> list[Callable]:
    """The hooks' ``name`` methods, in order (a hook may define any of them)."""
    return [m for m in (getattr(h, name, None) for h in hooks) if callable(m)]


@contextlib.contextmanager
def _refused_if_it_fails(rank: int):
    """A rank's setup (its model, data, checkpoint, optimizer, books: everything before
    its first window): an error there is raised as ``StartRefused``, which stops the
    cohort at once whatever ``max_failures`` allows (no death to tolerate, no death
    record, no survivors' checkpoint: nothing was trained), naming the error. What the
    setup's collectives raise (another rank's failure, a stall, a lost link) passes."""
    from ..errors import CohortAborted, PeerDied, ReduceStall

    try:
        yield
    except (StartRefused, CohortAborted, ReduceStall, PeerDied, ConnectionError):
        raise
    except Exception as e:
        raise StartRefused(f"rank {rank} could not start training: {type(e).__name__}: "
                           f"{e}") from e


def _refusal(err: RankFailed) -> str:
    """The message of the ``StartRefused`` a rank raised, from its remote traceback."""
    _, found, text = (err.traceback or "").rstrip().rpartition("StartRefused: ")
    return text if found else str(err)
