"""One rank of a :class:`~flodl_shm.training.trainer.Trainer` run: what ``spawn`` runs
in every rank (``_rank_main``).

``_RankRun`` builds the rank's model, data, optimizer and replicated coordinator,
restores a resumed rank's state, then runs the window loop: train this rank's
batches of the window, average through the window's ``LocalSGD`` (``_WindowSGD``,
one round on one host), settle the coordinator's books, checkpoint when it says so.
The launcher side (arguments, resume checks, the result) is ``trainer.py``.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch
from torch.nn.utils import clip_grad_norm_

from ..errors import StartRefused, plural
from ..checkpoint.meta import CheckpointBundle, SaveReason
from .agreement import (check_controller_outer, check_same_settings, check_same_start,
                        outer_settings)
from .cohort_log import log_cohort_decisions_from
from .coordinator import Coordinator, CoordinatorConfig
from .coverage import epoch_permutation
from .data import check_samples_fit_loss_fn, fetch_batch, is_dataset_factory, micro_batches
from .hooks import BatchInfo, RankState, RankSummary, WindowStats
from .inner_state import (check_rank_checksum, check_rank_file, read_rank_state, restore_inner,
                          seal_rank_state)
from .local_sgd import LocalSGD, check_replica
from .sync_window import (COUNT_ROWS, accepted_across_hosts, count_column,
                          counts_from_reports, falls_short, gather_counts)

if TYPE_CHECKING:
    from .trainer import _Job

logger = logging.getLogger("flodl_shm")

#: Format tag of a Trainer rank's ``<stem>.rank<N>.optim`` (its inner optimizer and LR
#: scheduler states and integer buffers at a checkpoint).
RANK_STATE_FORMAT = "flodl_shm.Trainer/1"


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
    global _ACCELERATORS
    if _ACCELERATORS is None:
        _ACCELERATORS = _accelerators_present()
    if _ACCELERATORS:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


_ACCELERATORS: Optional[bool] = None


# --- the rank side ----------------------------------------------------------------------


def plateau_refused() -> TypeError:
    """The error for a ``scheduler_fn`` that builds a ``ReduceLROnPlateau`` (the launcher
    raises it when it can tell from the factory, a rank when it builds one)."""
    return TypeError(
        "scheduler_fn built a ReduceLROnPlateau, which steps on a metric; the Trainer "
        "steps its scheduler after every optimizer step, without one. Pass no "
        "scheduler_fn and drive it from a hook: build it in on_train_start "
        "(ReduceLROnPlateau(state.optimizer)) and step it in on_window_end with "
        "your metric (e.g. stats.cohort_loss)")


class _RankRun:
    """One rank's training: model, data, coordinator, and the window loop."""

    def __init__(self, ctx, job: _Job) -> None:
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
        _check_model(model)
        self.model = model
        self.dataset = resolve_dataset(tr.dataset)
        if is_dataset_factory(tr.dataset):  # (the launcher checked a dataset it was given)
            self._check_built_dataset()
        self._on_batch_end = _hook_calls(tr.hooks, "on_batch_end")
        self.coord = self._coordinator(len(self.dataset))  # checks the data against the run
        self.schema = ModelSchema.from_module(model)
        # one host: a window is one round (its counts ride in it); through a controller
        # (several hosts, or one joined to a controller): a count gather first
        # (_window_cluster)
        self.one_round = not ctx.comm.spans_hosts
        if job.model_path is not None:
            self._load_consensus(job.model_path)
        self.optimizer = tr.optimizer_fn(model.parameters())
        self.scheduler = None if tr.scheduler_fn is None else tr.scheduler_fn(self.optimizer)
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise plateau_refused()
        if self.scheduler is not None and not callable(getattr(self.scheduler, "step", None)):
            raise TypeError(f"scheduler_fn must return an LR scheduler (one with step()), got "
                            f"{type(self.scheduler).__name__} {self.scheduler!r:.60}; e.g. "
                            f"functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100)")
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
        log_cohort_decisions_from(
            lambda: bool(self.coord.alive) and self.coord.alive[0] == self.rank)
        self._perm_epoch = -1
        self._perm = None
        self._said_diverged = False
        self._last_bundle = None  # the last bundle this rank wrote its share of

    def _check_built_dataset(self) -> None:
        """What a dataset factory built, checked as the launcher checks a dataset it is
        given: samples ``loss_fn`` can unpack, and on one host (across hosts
        ``_check_same_trainer`` does it) the same length on every rank, whose shuffles
        must be one permutation for no two ranks to train a sample twice."""
        if self.trainer.step_fn is None:
            check_samples_fit_loss_fn(self.dataset)
        if not self.ctx.comm.spans_hosts:
            check_same_settings(self.comm, {"the dataset's length": len(self.dataset)},
                                "make the dataset factory build the same dataset on every "
                                "rank (each rank trains its share of one shuffle of it)")

    def _check_same_trainer(self) -> None:
        """Several hosts: every host built the same Trainer (``check_same_settings``).
        Hosts with another seed, batch size or epoch count plan other windows from the
        same books: samples trained twice or never, or a host that stops early taken for
        dead. (On one host every rank gets the same pickled Trainer.)"""
        tr = self.trainer
        cadence = (tr.cadence if isinstance(tr.cadence, str)  # (several hosts: world >= 2)
                   else tr.cadence(self.ctx.world_size).settings())
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
                         "writes its own copy of every bundle): give a host without the "
                         "newer round its .fdl and .meta.json (another host's copy or the "
                         "controller's; its ranks then start their inner optimizers fresh), "
                         "or, when every host holds the older round whole, move the newer "
                         "round's files out of the hosts that have it (every rank then "
                         "resumes exactly, with its own .rank<N>.optim)")
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
            elif self._is_host_lead():  # (every rank's momentum restarts: said once)
                logger.warning("%s not found: the outer momentum restarts from zero", opath)

    # -- each rank's own share of a checkpoint -------------------------------------------
    def _save_rank_state(self, model_path) -> None:
        """Write this rank's ``<stem>.rank<N>.optim`` next to the bundle: what the consensus
        does not hold and an exact resume needs, its inner optimizer's and LR scheduler's
        states and its integer buffers (``num_batches_tracked``). Atomic; on the training
        path, at checkpoint windows only (the optimizer state changes at the next step)."""
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
                     lambda fh: torch.save(seal_rank_state(state), fh))

    def _load_rank_state(self, model_path) -> None:
        """On resume: this rank's inner optimizer and LR scheduler states and integer
        buffers from the bundle's ``.rank<N>.optim``, when it is there and was written by a
        cohort of the same size; otherwise they start fresh (logged)."""
        path = CheckpointBundle.rank_state_path(model_path, self.rank)
        meta = self.job.resume_meta
        if not path.exists():
            self._say_rank_state_missing(path, model_path, meta)
            return
        state = read_rank_state(path)
        if not isinstance(state, dict) or state.get("format") != RANK_STATE_FORMAT:
            raise ValueError(f"{path} is not a Trainer rank state (format "
                             f"{RANK_STATE_FORMAT!r} expected)")
        if meta is not None:
            check_rank_file(path, CheckpointBundle.meta_path(model_path), state.get("rank"),
                            self.rank, state.get("sync_round"), meta.sync_round)
        check_rank_checksum(path, state)
        if state["world_size"] != self.ctx.world_size:
            if self._is_host_lead():  # one line for every rank of the host, not one each
                logger.warning("%s was written by a cohort of %s, this one has %d: every "
                               "rank's inner optimizer, LR schedule and integer buffers start "
                               "fresh", path, plural(state["world_size"], "rank"),
                               self.ctx.world_size)
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

    def _say_rank_state_missing(self, path, model_path, meta) -> None:
        """This rank's state file is not in the bundle: its inner state starts fresh and
        its resume is not exact, which is said, unless the cohort only grew (a rank
        beyond the saving cohort's world, which another rank's file names: the host
        lead's line says it for every rank). A rank of the saving cohort lost its file (a
        partial copy of the bundle) or was dead at the save; a host's copy may hold no
        rank's file at all (one copied from another host)."""
        saved_world = None
        for r in range(self.ctx.world_size):
            other = CheckpointBundle.rank_state_path(model_path, r)
            if r != self.rank and other.exists():
                try:
                    saved_world = int(read_rank_state(other, lazy=True)["world_size"])
                except Exception:  # noqa: BLE001 - its own load names what is wrong with it
                    pass
                break
        if saved_world is not None and self.rank >= saved_world:
            logger.debug("%s not found: rank %d is beyond the saving cohort's %d ranks",
                         path, self.rank, saved_world)
            return
        how = (f"the bundle was saved by {plural(meta.world_size_at_save, 'live rank')} and "
               f"holds none of rank {self.rank}'s state: a partial copy, or a rank dead at the "
               f"save"
               if meta is not None else "the bundle holds none of its state")
        logger.warning("%s not found: rank %d's inner optimizer, LR schedule and integer "
                       "buffers start fresh (%s; this rank does not resume exactly)", path,
                       self.rank, how)

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
            loss = self._checked_loss(self._loss(batch))
            loss.backward()
            return float(loss.detach())
        total = 0.0
        for part in micro_batches(batch, k):
            loss = self._checked_loss(self._loss(part)) / k
            loss.backward()
            total += float(loss.detach())
        return total

    def _checked_loss(self, value):
        """``value`` when it is a loss to back-propagate (a one-value tensor that requires
        grad); else ``TypeError`` naming what it is (a Python number, a tuple, None,
        per-sample losses, a detached tensor) and the fix."""
        if isinstance(value, torch.Tensor) and value.requires_grad and value.numel() == 1:
            return value
        who = ("step_fn(model, batch)" if self.trainer.step_fn is not None
               else "loss_fn(model(*inputs), target)")
        if not isinstance(value, torch.Tensor):
            what = f"{type(value).__name__} {value!r:.60}"
        elif value.numel() != 1:
            what = f"a tensor of shape {list(value.shape)} (a loss per sample? reduce it)"
        else:
            what = ("a tensor that does not require grad (computed under torch.no_grad, "
                    "detached, or from .item())")
        raise TypeError(f"{who} returned {what}: it must return the batch's loss, a "
                        f"one-value tensor that requires grad, e.g. "
                        f"F.cross_entropy(model(x), y)")

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
        if settled.save_reason is not None and self.trainer.save_path and sync.mass > 0 \
                and self._finite_consensus(plan.window):
            ckpt = self._checkpoint_path()
            self._write_bundle(ckpt, settled.save_reason, sync.mass)
        return counts, settled, sync, ckpt

    def _finite_consensus(self, window: int) -> bool:
        """Whether the consensus (this replica, right after the window's sync) is finite.
        A diverged model (NaN or inf) is not checkpointed: the bundles of the run before
        it stay the newest, where a resume can go on from. Every rank holds the same
        consensus, so every rank decides alike."""
        if self.sgd.consensus_is_finite():
            return True
        if not self._said_diverged and self._is_host_lead():
            from ..checkpoint.series import latest_checkpoint

            self._said_diverged = True
            last = self._last_bundle or latest_checkpoint(self.trainer.save_path)
            logger.warning(
                "window %d: the consensus holds NaN or inf (training diverged): it is not "
                "checkpointed, %s. Lower the learning rate, %sor find the batch that "
                "diverged (a NaN or inf input or target, a loss of log(0)); said once", window,
                f"so {last} stays the newest checkpoint" if last is not None
                else "and no earlier checkpoint exists",
                "clip the gradients (clip_grad_norm=...), " if self.trainer.clip_grad_norm is None
                else "")
        return False

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
            # (every host the same: sync.accepted names this host's ranks only)
            accepted = accepted_across_hosts(comm, sync.accepted)
            realized = [r for r in accepted if counts.batches[r] > 0]
            if self._is_host_lead(accepted):  # one line per host
                logger.warning(
                    "window %d: the params round accepted less work than the count gather "
                    "promised (a rank died in between); crediting ranks %s only%s",
                    plan.window, realized, "; the checkpoint armed at this window overstates "
                    "coverage and the next window is checkpointed again" if ckpt else "")
            settled = coord.resettle(plan, counts, realized)
        if ckpt is not None and sync.mass > 0 and self._finite_consensus(plan.window):
            # each host keeps its own copy of the bundle, so it resumes from its own disk
            # (the controller's forge writes the controller's, with the outer momentum)
            self._write_bundle(ckpt, reason, sync.mass)
        elif ckpt is not None:
            ckpt = None  # not written on this host
        return counts, settled, sync, ckpt

    def _write_bundle(self, ckpt, reason: SaveReason, mass: float) -> None:
        """This host's copy of the window's bundle: every rank writes its own
        ``.optim``, then, after a barrier, the host's lead rank posts its replica (the
        consensus) to this host's forge, so a bundle with a ``.meta.json`` has every
        live rank's ``.optim`` (and no other's: a fresh run starts its series over, and
        a resume clears the failed writes beyond its bundle). Right after the window's
        sync: the optimizer state changes at the next step."""
        self._save_rank_state(ckpt)
        self._last_bundle = ckpt
        self.comm.barrier()
        if self._is_host_lead(self.comm.last_accepted()):
            self._post_checkpoint(ckpt, reason, mass)

    def _is_host_lead(self, live=None) -> bool:
        """Whether this rank is the lowest of its host's ranks in ``live`` (default: the
        coordinator's live ranks; on one host, of the cohort): the one that prunes,
        posts and reports for its host. Right after a collective, ``live`` is better
        the ranks it accepted (``Comm.last_accepted``): a rank that died since the
        window's books (writing its state file, say) is still in the coordinator's."""
        first = self.rank - self.ctx.local_rank
        here = [r for r in (self.coord.alive if live is None else live)
                if first <= r < first + self.ctx.local_world_size]
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
        history: collections.deque[WindowStats] = collections.deque(maxlen=tr.keep_history)
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
            history.append(_without_ids(stats))
            if settled.stop:
                reason = settled.save_reason
                break
        # each host reports from its lowest live rank (on one host: the reporting rank),
        # as a last barrier finds them: one may have died since the last window's books
        # (writing its state file on a full disk, say)
        comm.barrier()
        reporting = self._is_host_lead(comm.last_accepted())
        summary = RankSummary(self.rank, windows, coord.global_step, coord.epoch,
                              None if reason is None else reason.value, tuple(dead), last_ckpt)
        for call in _hook_calls(tr.hooks, "on_train_end"):
            call(state, summary)
        return {
            "summary": summary,
            "dead_ranks": tuple(dead),
            "checkpoint": last_ckpt,
            "meta": coord.checkpoint_meta(reason or SaveReason.GRACEFUL_SHUTDOWN),
            "history": list(history) if reporting else None,
            "state_dict": _to_portable(self.model.state_dict()) if reporting else None,
        }


def _without_ids(stats: WindowStats) -> WindowStats:
    """``stats`` without its sample ids (what ``TrainResult.history`` keeps): a shallow
    copy, a quarter of what ``dataclasses.replace`` costs on its 23 fields, each window."""
    kept = copy.copy(stats)
    object.__setattr__(kept, "sample_ids", None)
    return kept


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


def _check_model(model) -> None:
    """Raise what the model ``model_fn`` built lacks before anything is set up for it: a
    replica the Trainer can average (its LocalSGD checks it too, in LocalSGD's words),
    and parameters for the optimizer to train."""
    check_replica(model, "the Trainer", "in model_fn, before it returns the model")
    if next(model.parameters(), None) is None:
        raise ValueError(f"model_fn built a model ({type(model).__name__}) without parameters: "
                         f"the optimizer would have nothing to train; give it a trainable layer")


def _to_portable(state: dict) -> dict:
    """A state_dict as numpy arrays: torch pickles tensors through a multiprocessing
    pipe as shared-memory handles that die with the rank process, so a rank's result
    carries plain bytes instead."""
    out = {}
    for k, v in state.items():
        v = v.detach().cpu().contiguous()
        if v.dtype == torch.bfloat16:
            out[k] = ("bfloat16", v.clone().view(torch.int16).numpy())
        else:  # (a copy first: numpy() would mark the model's own storage not resizable)
            out[k] = (str(v.dtype).replace("torch.", ""), v.clone().numpy())
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
