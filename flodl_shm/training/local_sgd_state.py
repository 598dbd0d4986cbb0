"""A ``LocalSGD``'s full state: ``state_dict`` / ``load_state_dict`` (one rank's resume
state) and the checkpoint bundles of ``save`` / ``load`` (docs/local_sgd.md).

``LocalSGDState`` is a part of :class:`flodl_shm.training.local_sgd.LocalSGD`, which
holds the attributes these methods read and write (the model, the counters, the
outer optimizer and ElChe, the series it saves into).

``save(stem)`` (a collective, at a sync boundary) writes one bundle per save,
``<stem>-r<sync round>`` (the Trainer's series, ``checkpoint/series.py``): the model's
names, the consensus ``.fdl``, ``.outer.fdl`` for outer momentum, ``.meta.json`` last as
the commit marker, and one ``.rank<N>.optim`` per rank with everything a bit-exact
resume needs: the rank's model state, inner optimizer and LR scheduler, step counters,
outer and ElChe state, RNG states. Older bundles go only once the new one is complete,
so a crash mid-save leaves the previous one whole. ``load(stem)`` restores the newest
complete bundle; without the rank file it loads the consensus and the outer momentum
and restarts the inner state fresh.

Every method here that exchanges anything is a collective: each rank calls it at the
same point, and a rank that could not write or read its part is named to the others
(small per-rank rounds before and after the files), so no rank is left waiting at
another collective.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import random
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ..checkpoint._atomic import atomic_write
from ..checkpoint.meta import (CheckpointBundle, CheckpointMeta, ElCheState, SaveReason,
                               checkpoint_path)
from ..errors import SchemaMismatchError, SeriesInUse, StartRefused, plural
from ..frame import DTYPE_F32, tensors_to_round_frame
from .agreement import check_same_start, per_rank_ints
from .convergence import resumed_guard
from .inner_state import (check_optimizer_state, check_rank_checksum, check_rank_file,
                          read_rank_state, restore_inner, seal_rank_state)
from .outer import OuterOptimizer

logger = logging.getLogger("flodl_shm")

#: Format tag of ``LocalSGD.state_dict()`` (and of the ``.rank<N>.optim`` files).
STATE_FORMAT = "flodl_shm.LocalSGD/1"

#: A rank's resume state in a bundle: ``<bundle stem>.rank<N>.optim``.
rank_state_path = CheckpointBundle.rank_state_path

#: a host lead's verdict on a series at the first save into it (``_claim_series``)
_SERIES_OK, _SERIES_IN_USE, _SERIES_STALE = 0, 1, 2
#: how many series' run locks a LocalSGD keeps (those it saved into last)
SERIES_LOCKS_KEPT = 8

#: what ``load()`` finds of a rank's own state in a bundle (``_agree_on_state``'s values;
#: a dead rank's slot reads 0)
_STATE_UNREADABLE, _STATE_MISSING, _STATE_FOREIGN, _STATE_OTHER_WORLD, _STATE_OWN = 1, 2, 3, 4, 5


@contextlib.contextmanager
def _as_collective(what: str):
    """A schema mismatch met in ``what`` (a collective method) re-raised with its likely
    cause: a rank that did not call it, and met it with another collective."""
    try:
        yield
    except SchemaMismatchError as e:
        raise SchemaMismatchError(
            f"{e}\n{what} is a collective: a rank whose collective differs did not call it "
            f"(call {what} on every rank at the same point, not under `if rank == 0`)"
        ) from None


def _why_not_exact(kinds: Sequence[int], state: Optional[dict], world_size: int) -> str:
    """Why a ``load()`` is not exact, from every rank's ``_STATE_*``, in words."""
    def ranks(kind: int) -> list[int]:
        return [r for r, k in enumerate(kinds) if k == kind]

    other = ranks(_STATE_OTHER_WORLD)
    if other:
        saved = state.get("world_size") if isinstance(state, dict) else None
        return (f"it was saved by {plural(saved, 'rank')} and this run has {world_size}"
                if saved is not None and saved != world_size
                else f"ranks {other} hold the state of a run on another number of ranks")
    if ranks(_STATE_FOREIGN):
        return (f"the state files of ranks {ranks(_STATE_FOREIGN)} are not LocalSGD's "
                f"(a Trainer's bundle?)")
    return f"it holds no state file for ranks {ranks(_STATE_MISSING)}"


def _fresh_words(model: torch.nn.Module, elche: Optional[str]) -> str:
    """What a resume from the consensus alone starts fresh, for its warning (``elche``:
    how ElChe restarts, when there is one)."""
    ints = [k for k, b in model.named_buffers() if not b.is_floating_point()]
    return "the inner optimizer and the scheduler start fresh" + (
        f", ElChe restarts {elche}" if elche else "") + (
        f"; integer buffers ({', '.join(ints[:3])}{', ...' if len(ints) > 3 else ''}) keep "
        f"each model's own values" if ints else "")


def _elche_snapshot_fits(meta: CheckpointMeta, world_size: int) -> bool:
    """Whether the bundle's ElChe snapshot (its ``.meta.json``) is of this many ranks."""
    state = meta.elche_state
    return state is not None and len(state.smoothed_ms_per_batch) == world_size


def _elche_restart_words(meta: CheckpointMeta, world_size: int) -> str:
    """How a resume's ElChe restarts when the ranks have no ElChe state of their own."""
    return ("from the bundle's ElChe snapshot (its .meta.json)"
            if _elche_snapshot_fits(meta, world_size)
            else "fresh (the bundle holds no ElChe snapshot for this many ranks)")


def _warn_if_damaged(bundle: Path, rank_path: Path) -> None:
    """Say so when the bundle's consensus ``.fdl`` or outer ``.outer.fdl`` is damaged
    (truncated, cut, or not a ``.fdl``: its headers are read, not its payloads) while
    this rank's exact state came from ``rank_path``. The resume does not need them, but
    ``fdl convert``, a resume on another number of ranks and the Trainer do."""
    from ..checkpoint.fdl import read_fdl
    from ..errors import CheckpointError

    outer = CheckpointBundle.outer_path(bundle)
    for path in (CheckpointBundle.model_path(bundle), outer):
        if path == outer and not path.exists():
            continue  # (no outer momentum: none written)
        try:
            read_fdl(path, with_data=False)  # its headers: truncation is still detected
        except (CheckpointError, OSError) as e:
            logger.warning("%s is damaged (%s): this resume is exact all the same (from "
                           "%s and the other ranks' state files), but that bundle cannot "
                           "be converted or resumed on another number of ranks: restore the "
                           "file from a copy (this run's next save() writes a whole bundle)",
                           path, e,
                           rank_path.name)


def _resolve_bundle(path: "str | os.PathLike[str]") -> Path:
    """The model path of the bundle :meth:`LocalSGD.load` restores: the newest complete
    one of the series ``path`` names, else the single bundle at ``path`` (its stem,
    ``.fdl`` or ``.meta.json``: a Trainer's bundle, or an earlier release's save)."""
    from ..checkpoint.series import latest_checkpoint, resolve_checkpoint

    p = checkpoint_path(path)
    if (not p.name.endswith((".fdl", ".meta.json")) and latest_checkpoint(p) is None
            and CheckpointBundle.meta_path(p).exists()):
        return CheckpointBundle.model_path(p)
    return resolve_checkpoint(p)


class LocalSGDState:
    """The state half of a ``LocalSGD`` (a part of it: see the module doc)."""

    def state_dict(self) -> dict:
        """This rank's full resume state (a dict of tensors and plain objects, picklable):
        the model's ``state_dict`` (integer buffers included), step counters, the previous
        global and the outer optimizer, the inner optimizer and LR scheduler, ElChe and
        the guard, and the RNG states (torch, Python, NumPy)."""
        outer = None
        prev_global, momentum = self.outer_state()
        if isinstance(self.outer, OuterOptimizer):
            outer = {"kind": "flodl_shm", "object": copy.deepcopy(self.outer),
                     "momentum": momentum}
        elif self.outer is not None:
            outer = {"kind": "torch", "state": self.outer.state_dict()}
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return {
            "format": STATE_FORMAT,
            "rank": self.rank,
            "world_size": self.world_size,
            "cadence": self.cadence,
            "counters": {"sync_round": self.sync_round, "total_steps": self.total_steps,
                         "total_samples": self.total_samples,
                         "realized_mass": self.realized_mass, "steps": self._steps,
                         "samples": self._samples, "target": self._target,
                         "prev_sync_ms": self._prev_sync_ms,
                         "prev_divergence": self._prev_divergence},
            "model": model,
            # buffers registered with persistent=False: not in the model's state_dict, but
            # they are this rank's state (an averaged float one is in the consensus too)
            "unsaved_buffers": {k: b.detach().clone() for k, b in self.model.named_buffers()
                                if k not in model},
            "prev_global": prev_global,
            "outer": outer,
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "el_che": copy.deepcopy(self.el_che),
            "guard": copy.deepcopy(self.guard),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (on the same rank of a cohort of the
        same size for an ElChe cadence); the next step continues exactly where it was
        saved.

        Args:
            state: a ``LocalSGD.state_dict()``.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a LocalSGD state (format {STATE_FORMAT!r} expected, got "
                             f"{state.get('format') if isinstance(state, dict) else state!r})")
        cadence_kept = self._cadence_resumes(state)
        if (state["outer"] is None) != (self.outer is None):
            raise ValueError(
                "the state was saved without an outer optimizer: build a plain LocalSGD (no "
                "outer=, not DiLoCo) to load it" if state["outer"] is None else
                "the state was saved with an outer optimizer: build LocalSGD with the outer= "
                "it was saved with (DiLoCo for OuterNesterov) to load it")
        outer = state["outer"]
        if outer is not None and (outer["kind"] == "flodl_shm") != isinstance(
                self.outer, OuterOptimizer):  # refused before anything is applied
            kind = "a flodl_shm one" if outer["kind"] == "flodl_shm" else "a torch.optim one"
            raise ValueError(f"the state's outer optimizer is {kind}; this LocalSGD's is "
                             f"{type(self.outer).__name__}: build it with the same kind")
        if self.optimizer is not None and state["optimizer"] is not None:
            check_optimizer_state(self.optimizer, state["optimizer"],  # refused up front
                                  f"the LocalSGD state of rank {state['rank']}")
        unsaved = self._unsaved_buffers(state)  # refused up front too
        try:
            self.model.load_state_dict(state["model"])
        except RuntimeError as e:  # torch's first line names no tensor: say them in one
            lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
            raise ValueError(f"the state of rank {state['rank']} does not fit this model: "
                             + " ".join(lines)) from e
        with torch.no_grad():
            for buf, value in unsaved:
                buf.copy_(value)
        c = state["counters"]
        self.sync_round, self.total_steps = int(c["sync_round"]), int(c["total_steps"])
        self.total_samples, self.realized_mass = int(c["total_samples"]), float(c["realized_mass"])
        self._steps, self._samples = int(c["steps"]), int(c["samples"])
        if cadence_kept:  # the window in progress ends where it would have
            self._target = None if c["target"] is None else int(c["target"])
        else:
            self._target = self._next_target()
        self._prev_sync_ms, self._prev_divergence = c["prev_sync_ms"], c["prev_divergence"]
        if outer is not None:
            if outer["kind"] == "flodl_shm":
                saved = outer["object"]
                momentum = outer.get("momentum", saved.checkpoint_state())
                self.outer.__dict__.update(copy.deepcopy(saved.__dict__))
            else:
                momentum = None
                self.outer.load_state_dict(outer["state"])
            self._load_outer_state(state["prev_global"], momentum)
        restore_inner(self.optimizer, self.scheduler, state["optimizer"], state["scheduler"],
                      f"the LocalSGD state of rank {state['rank']}",
                      "set them after load() / load_state_dict() (optimizer.param_groups)",
                      say=self.rank == 0)  # the ranks' settings agree: one line, not one a rank
        for name, obj in (("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            if obj is not None and state[name] is None:
                logger.warning("the LocalSGD state holds no %s state: it starts fresh", name)
        self._cadence_restored = self.el_che is not None and cadence_kept
        if self._cadence_restored:
            self.el_che.__dict__.update(copy.deepcopy(state["el_che"].__dict__))
            if state["guard"] is not None:
                self.guard = copy.deepcopy(state["guard"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        self._window_t0 = time.perf_counter()

    def _unsaved_buffers(self, state: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(this model's buffer, its saved value) for each ``persistent=False`` buffer in
        ``state``; a ValueError naming the buffers that do not fit. (A state saved before
        they were kept has none: they keep their values.)"""
        mine = dict(self.model.named_buffers())
        saved = state.get("unsaved_buffers", {})
        bad = [f"{k} (saved {tuple(v.shape)} {v.dtype}, model "
               + (f"{tuple(mine[k].shape)} {mine[k].dtype})" if k in mine else "has none)")
               for k, v in saved.items()
               if k not in mine or mine[k].shape != v.shape or mine[k].dtype != v.dtype]
        if bad:
            raise ValueError(f"the state of rank {state['rank']} does not fit this model: its "
                             f"non-persistent buffer(s) {'; '.join(bad)}")
        return [(mine[k], v) for k, v in saved.items()]

    def _cadence_resumes(self, state: dict) -> bool:
        """Whether ``state``'s cadence (its ElChe, the window in progress) carries on
        here: the same cadence, ElChe on as many ranks, the same ``sync_every``. Else
        this LocalSGD's own settings decide from the next window on (the one in
        progress ends at their target; ElChe starts fresh), and rank 0 says why."""
        saved_elche, c = state["el_che"], state["counters"]
        if saved_elche is not None and self.el_che is not None:
            if state["world_size"] == self.world_size:
                return True
            why = (f"its ElChe balanced {state['world_size']} ranks and this cohort has "
                   f"{self.world_size}: ElChe starts fresh (its batch counts are per rank)")
        elif saved_elche is not None:
            alone = " (one rank: ElChe has nothing to balance)" if self.world_size == 1 else ""
            why = (f"it ran cadence='elche' on {state['world_size']} ranks and this LocalSGD "
                   f"runs a fixed cadence{alone}: windows of sync_every={self.sync_every} "
                   f"steps from now")
        elif self.el_che is not None:
            why = "it ran a fixed cadence: ElChe starts fresh"
        elif c["target"] == self.sync_every:
            return True
        else:
            saved = "no sync_every" if c["target"] is None else f"sync_every={c['target']}"
            now = ("sync_every=None (syncs on sync() calls only)" if self.sync_every is None
                   else f"sync_every={self.sync_every}")
            why = (f"it ran with {saved} and this LocalSGD has {now}: the window in "
                   f"progress ends by the new setting ({c['steps']} of its steps taken)")
        if self.rank == 0:
            logger.warning("the LocalSGD state of rank %s is resumed with another cadence: %s",
                           state["rank"], why)
        return False

    def checkpoint_meta(self, reason: SaveReason = SaveReason.CHECKPOINT) -> CheckpointMeta:
        """The bundle's ``CheckpointMeta``: ``global_step`` is the optimizer steps each rank
        took (this rank's count), ``sync_round`` the syncs so far, ``world_size_at_save``
        the ranks whose work the last sync accepted, plus ElChe's state (cadence runs)."""
        meta = CheckpointMeta.new(0, self.total_steps, self.sync_round,
                                  len(self.live_ranks), reason)
        if self.el_che is not None:
            st: ElCheState = self.el_che.to_state()
            st.trend_history = self.guard.trend_history() if self.guard is not None else None
            meta = meta.with_elche_state(st)
        return meta

    def save(self, path: "str | os.PathLike[str]", *, keep: int = 2,
             overwrite: bool = False) -> Path:
        """Write a full-state checkpoint bundle (a collective: every rank calls it, right
        after a sync). Returns the bundle's model path.

        Each save is a bundle of its own, named by the sync round: ``save("runs/exp/ckpt")``
        at sync round 8 writes ``runs/exp/ckpt-r00000008.*``, the series the Trainer
        writes too. Every rank writes its ``.rank<N>.optim`` (:meth:`state_dict`); then
        the lowest live rank of each host writes the model's names (``.names.json``),
        the consensus ``.fdl``, the outer momentum ``.outer.fdl`` (``OuterNesterov``)
        and ``.meta.json`` last (its presence marks the bundle complete), and only then
        deletes the series' older bundles beyond the newest ``keep`` complete ones. So
        a crash in the middle of a save leaves the previous bundle whole, and
        :meth:`load` of the stem takes the newest complete one. Files are written
        atomically.

        The first save into a series takes its run lock (``checkpoint/run_lock.py``:
        each host's lead rank holds it until its process's work ends), so another job
        saving into the same stem is refused before it writes anything. It also refuses
        a series that holds complete bundles this run does not continue (an earlier
        run's, or newer than the bundle :meth:`load` took): the pruning would keep
        those and delete this run's saves. ``overwrite=True`` deletes them instead.

        Args:
            path: the series' stem (``runs/exp/ckpt``; ``runs/exp/ckpt.fdl`` names the
                same series).
            keep: complete bundles kept (at least 1).
            overwrite: at the first save into the series, delete its bundles that this
                run does not continue.

        Raises:
            ValueError: called mid-window (the replicas differ from the consensus then):
                save right after ``step()`` returned True, or after ``sync()``; ``keep``
                below 1; a consensus that holds NaN or inf (a diverged run: it is not
                written, so the series' finite bundles stay); or a ``path`` that is a folder,
                or whose checkpoint files' names would pass the file system's limits
                (``check_series_stem``: nothing is written).
            SeriesInUse: another job holds the series (on every rank of this one).
            RuntimeError: another rank could not write its part (a full disk, say: that
                rank raises its own error, every other one this, naming it; nothing of
                this bundle is committed, the previous one stands).
            FileExistsError: the series holds another run's bundles (on every rank; at
                the first save into it, before anything is written).
        """
        with _as_collective("save()"):
            return self._save(path, keep, overwrite)

    def _save(self, path, keep: int, overwrite: bool) -> Path:
        if self._steps:
            raise ValueError(
                f"save() mid-window ({self._steps} steps since the last sync): the replicas "
                f"are not the consensus yet; save right after step() returned True, or call "
                f"sync() first")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (complete bundles kept), got {keep!r}")
        from ..checkpoint.series import (check_series_stem, latest_checkpoint, prune_series,
                                         remove_other_rank_states, round_model_path)

        if not self.consensus_is_finite():  # (every rank refuses alike, before any round)
            last = latest_checkpoint(path)
            raise ValueError(
                f"the consensus holds NaN or inf (training diverged): save() refuses to write "
                f"it, which would prune the series' finite bundles ("
                f"{'the newest: ' + str(last) if last is not None else 'none yet'}). Lower "
                f"the learning rate or clip the gradients, and load() the last finite bundle")

        check_series_stem(path)
        model_path = round_model_path(path, self.sync_round)
        self._claim_series(path, overwrite)
        model_path.parent.mkdir(parents=True, exist_ok=True)
        state = seal_rank_state(self.state_dict(), self._agree_on_save_id())
        failed = None
        try:
            atomic_write(rank_state_path(model_path, self.rank),
                         lambda fh: torch.save(state, fh))
        except Exception as e:  # a full disk, say: every rank hears of it, not a stall
            failed = e
        self._all_wrote(failed, "its state file")
        writers = self.comm.last_accepted_ranks()
        failed = None
        if writers and self.rank == min(writers):
            try:
                # a cut-short save's files of this round: of this host's ranks that did not
                # write, or of no rank of this cohort (other hosts' leads see to theirs)
                first = self.rank - self.comm.local_rank
                remote = [r for r in range(self.world_size)
                          if not first <= r < first + self.comm.local_world_size]
                remove_other_rank_states(model_path, writers + remote)
                self._write_consensus_bundle(model_path)
                prune_series(path, keep)  # after the commit: the previous one outlives a crash
            except Exception as e:
                failed = e
        self._all_wrote(failed, "the bundle's model and metadata")
        return model_path

    def _agree_on_save_id(self) -> int:
        """One small round: the id of this save, the same on every rank (from each rank's
        random draw), written into every rank's state file so that ``load`` can tell a
        file of another save of the same sync round (:meth:`_agree_on_save`)."""
        drawn = per_rank_ints(self.comm, random.SystemRandom().randrange(1, 1 << 24))
        return sum(drawn) % ((1 << 24) - 1) + 1  # (exact on the round's float32 wire)

    def _agree_on_save(self, bundle, state: dict) -> None:
        """``load()``'s check that every rank's state file comes from the same save (a
        collective, before any rank changes its model): a file copied in from another run
        saved at the same sync round would start its rank from other weights than the
        others, silently. Files written before save ids pass when every rank's is one."""
        if len({v for v in per_rank_ints(self.comm, state["counters"]["sync_round"] + 1)
                if v}) > 1:
            return  # bundles of different rounds: the closing check names them
        saves: dict[int, list[int]] = {}
        for r, v in enumerate(per_rank_ints(self.comm, state.get("save_id") or -1)):
            if v:  # (a dead rank reads 0; files written before save ids, -1, go together)
                saves.setdefault(v, []).append(r)
        if len(saves) > 1:
            groups = "; ".join(f"ranks {ranks}" for ranks in saves.values())
            raise StartRefused(
                f"the rank state files of {bundle} come from {len(saves)} different saves of "
                f"sync round {state['counters']['sync_round']} ({groups}, each from its "
                f"own): a file copied in from another run? Load a "
                f"bundle whose files were written together, or delete the files of the ranks "
                f"not of this save to load the consensus with every rank's inner state fresh")

    def _all_wrote(self, failed: Optional[Exception], what: str) -> None:
        """``save``'s barriers: one small round in which every rank learns whether one
        could not write ``what``. The rank that failed raises its own error; the others
        raise naming it (a rank that caught its error and went on would otherwise meet
        the others at another collective: a schema error about no disk at all)."""
        bad = [r for r, f in enumerate(per_rank_ints(self.comm, failed is not None)) if f > 0]
        if failed is not None:
            raise failed
        if bad:
            raise RuntimeError(
                f"save(): rank(s) {bad} could not write {what} (see their error, e.g. a full "
                f"disk); the bundle of sync round {self.sync_round} was not committed, and "
                f"the previous one stands")

    def _claim_series(self, path, overwrite: bool) -> None:
        """At the first save into a series, before any rank writes a file: each host's
        lead rank takes the series' run lock (``checkpoint/run_lock.py``) and keeps it,
        and looks for complete bundles this run does not continue (``save``); one small
        collective tells every rank whether a host found the series held by another
        job (then every rank raises ``SeriesInUse``) or such bundles (FileExistsError,
        unless ``overwrite``: the lead deletes them).

        The locks of the ``SERIES_LOCKS_KEPT`` series saved into last are kept; a save
        into another series releases the oldest (a run that saves each epoch under a
        stem of its own held one open file per stem, and failed at the process's file
        limit). A save into a released series takes its lock again, and its bundles,
        this run's own, are not refused. Every rank saves into the same series in the
        same order, so every rank keeps and releases the same ones."""
        from ..checkpoint.run_lock import RunLock, lock_holder, run_lock_path
        from ..checkpoint.series import delete_rounds, not_continued, series_base

        key = os.fspath(run_lock_path(path))
        if key in self._series_locks:
            self._series_locks[key] = self._series_locks.pop(key)  # the newest now
            return
        if len(self._series_locks) >= SERIES_LOCKS_KEPT:
            oldest = self._series_locks.pop(next(iter(self._series_locks)))
            if oldest is not None:
                oldest.__exit__(None, None, None)
        ours = key in self._series_saved
        job = None
        if self.comm.spans_hosts:
            # hosts may share one file system: the lock is this job's on all of them
            token = random.SystemRandom().randrange(1, 1 << 24) if self.rank == 0 else 0
            job = f"local_sgd-{per_rank_ints(self.comm, token)[0]}"  # (exact as f32)
        base = series_base(path)
        writers = self.comm.last_accepted_ranks()
        verdict = _SERIES_OK
        if writers and self.rank == min(writers):
            lock = RunLock(path, job)
            try:
                lock.__enter__()
                self._series_locks[key] = lock
                after, stale = (None, []) if ours else not_continued(path,
                                                                       self._resumed_from)
                if stale and overwrite:
                    delete_rounds(path, after)
                elif stale:
                    verdict = _SERIES_STALE
            except SeriesInUse:
                verdict = _SERIES_IN_USE
        votes = per_rank_ints(self.comm, verdict)
        if any(votes):
            if key in self._series_locks:
                self._series_locks.pop(key).__exit__(None, None, None)
            if _SERIES_IN_USE in votes:
                raise SeriesInUse(key, lock_holder(key))
            stale = not_continued(path, self._resumed_from)[1]
            newest = f" (newest: {stale[-1].name})" if stale else ""
            raise FileExistsError(
                f"{base} already holds checkpoints this run does not continue{newest}: "
                f"saving beside them would keep those and prune this run's. Continue that "
                f"run with load({os.fspath(base)!r}) before the first save, pass another "
                f"stem, or save(..., overwrite=True) to delete them")
        self._series_locks.setdefault(key, None)  # claimed (held by this host's lead)
        self._series_saved.add(key)

    def _write_consensus_bundle(self, path) -> None:
        from ..checkpoint.forge import write_consensus_fdl, write_outer_momentum_fdl

        tensors = [p.detach().to(torch.float32) for p in self.params]
        tensors += [b.detach().to(torch.float32) for b in self.buffers]
        # the names first, as the forge writes them: a present .fdl implies its .names.json
        self.schema.write_to_file(CheckpointBundle.names_path(path))
        write_consensus_fdl(self.schema, tensors_to_round_frame(tensors, DTYPE_F32).tensors,
                            CheckpointBundle.model_path(path))
        _, momentum = self.outer_state()
        if momentum is not None:
            write_outer_momentum_fdl(tensors_to_round_frame(momentum, DTYPE_F32).tensors,
                                     CheckpointBundle.outer_path(path))
        self.checkpoint_meta().write_to_file(CheckpointBundle.meta_path(path))

    def load(self, path: "str | os.PathLike[str]") -> CheckpointMeta:
        """Restore the newest complete bundle of the series :meth:`save` wrote under the
        stem ``path``, or the bundle ``path`` names (its ``.fdl`` or ``.meta.json``, a
        Trainer's included). A collective: every rank calls it.

        When every rank finds its own ``<stem>.rank<N>.optim``, saved by a run of this
        many ranks, the resume is exact (:meth:`load_state_dict`). Otherwise (another
        number of ranks, a bundle from the Trainer, a rank file gone) every rank loads
        the consensus and the outer momentum, takes the counters from the
        ``.meta.json``, and starts its inner optimizer and scheduler fresh (ElChe from
        the bundle's snapshot), so the ranks go on alike; its host's first rank says
        why. Returns the bundle's metadata.

        It starts with one small round in which the ranks tell what they found, and
        ends with one that checks every rank loaded the same sync round (on several
        hosts each host loads its own copy of the bundle). A rank that could not read
        its bundle's ``.meta.json`` or its own state file is named to the others before
        any rank changes its model; one whose consensus ``.fdl`` turns out damaged as it
        loads it is named after the others have loaded theirs.

        Args:
            path: the series' stem, or a bundle's ``.fdl`` / ``.meta.json``.

        Raises:
            FileNotFoundError: no complete bundle is there.
            StartRefused: (a ``ValueError``) the ranks loaded bundles of different sync
                rounds, or another rank could not load (every rank raises, naming which
                ranks start from where; the rank that could not load raises its own
                error).
        """
        failed: Optional[Exception] = None
        meta = state = None
        try:
            bundle = _resolve_bundle(path)
            meta, state, kind = self._read_bundle(bundle)
        except Exception as e:  # the peers hear of it now, not as a stall at their next sync
            failed, kind = e, _STATE_UNREADABLE
        kinds = self._agree_on_state(kind)
        if _STATE_UNREADABLE in kinds:  # (raises on every rank, before any changes its model)
            self._agree_on_start(failed=failed, start_round=getattr(meta, "sync_round", None))
        exact = all(k == _STATE_OWN for k in kinds if k)  # (a dead rank's slot reads 0)
        if exact:  # (raises on every rank alike, before any changes its model)
            self._agree_on_save(bundle, state)
        try:
            if exact:
                self._resume_exactly(bundle, state)
            else:
                self._resume_from_consensus(bundle, meta, kinds, state)
        except Exception as e:
            self._agree_on_start(failed=e)
            raise
        self._agree_on_start()
        self._agree_on_cadence(meta, bundle, told=not exact)
        self._resumed_from = bundle
        return meta

    def _agree_on_state(self, kind: int) -> list[int]:
        """``load()``'s first round: what each rank found of its own state in the bundle
        (``_STATE_*``; 0 for a dead rank). The resume is exact only when every rank found
        its own: a rank that starts fresh beside ranks that resume their optimizer and
        scheduler trains at another learning rate, so then every rank starts fresh."""
        with _as_collective("load()"):
            return per_rank_ints(self.comm, kind)

    def _agree_on_start(self, failed: Optional[Exception] = None,
                        start_round: Optional[int] = None) -> None:
        """``load()``'s closing round (``check_same_start``), on the sync round this rank
        loaded (default: the one it holds now)."""
        with _as_collective("load()"):
            check_same_start(self.comm, self.sync_round if start_round is None else start_round,
                             "call load() with the same bundle on every rank (on several "
                             "hosts, give every host a copy of it)", failed=failed)

    def _agree_on_cadence(self, meta: CheckpointMeta, bundle, told: bool) -> None:
        """``load()``'s ElChe: each rank plans the cohort's windows with its own ElChe,
        from the same reports, so the ranks' ElChes must be equal. When a rank found no
        LocalSGD state of its own in the bundle (its ElChe starts fresh), every rank
        restarts from the bundle's shared snapshot (``meta.elche_state``), as a Trainer
        resume does (``told``: the load's warning said so already). A collective: one
        small per-rank round."""
        if self.el_che is None:
            return
        got = per_rank_ints(self.comm, 2 if self._cadence_restored else 1)
        fresh = [r for r, v in enumerate(got) if v == 1]  # (a dead rank's slot reads 0)
        if not fresh:
            return
        el_che, guard = copy.deepcopy(self._fresh_cadence)
        self.el_che.__dict__.update(el_che.__dict__)  # (the caller's ElChe stays the one)
        self.guard = guard
        state = meta.elche_state
        if _elche_snapshot_fits(meta, self.world_size):
            self.el_che.restore_from_state(state)
            self.guard = resumed_guard(self.guard, state.trend_history)
        self._target = self._next_target()
        if self.rank == 0 and not told:
            logger.warning("%s holds no LocalSGD state for ranks %s: every rank's ElChe "
                           "restarts %s, so the ranks plan the same windows", bundle, fresh,
                           _elche_restart_words(meta, self.world_size))

    def _read_bundle(self, path) -> tuple[CheckpointMeta, Optional[dict], int]:
        """``load()``'s reading: the bundle's metadata, this rank's state file (None when
        there is none) and what it holds for this rank (``_STATE_*``). Raises when the
        bundle is incomplete or the state file belongs to another rank or save."""
        meta_path = CheckpointBundle.meta_path(path)
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path} not found: {os.fspath(path)} is not a "
                                    f"complete checkpoint bundle (the .meta.json is written last)")
        meta = CheckpointMeta.read_from_file(meta_path)
        rank_path = rank_state_path(path, self.rank)
        if not rank_path.exists():
            return meta, None, _STATE_MISSING
        state = read_rank_state(rank_path)
        if not (isinstance(state, dict) and state.get("format") == STATE_FORMAT):
            return meta, state, _STATE_FOREIGN  # e.g. a Trainer's bundle: its own state
        check_rank_file(rank_path, meta_path, state.get("rank"), self.rank,
                        state["counters"]["sync_round"], meta.sync_round)
        check_rank_checksum(rank_path, state)
        if state.get("world_size") != self.world_size:
            return meta, state, _STATE_OTHER_WORLD
        return meta, state, _STATE_OWN

    def _resume_exactly(self, path, state: dict) -> None:
        """Every rank found its own state: restore it whole (:meth:`load_state_dict`; its
        refusals name the file here)."""
        try:
            self.load_state_dict(state)
        except ValueError as e:
            raise ValueError(f"{rank_state_path(path, self.rank)}: {e}") from e
        if self.comm.local_rank == 0:  # one line a host (each host reads its own copy)
            _warn_if_damaged(path, rank_state_path(path, self.rank))

    def _resume_from_consensus(self, path, meta: CheckpointMeta, kinds: Sequence[int],
                               state: Optional[dict]) -> None:
        """Some rank has no state of its own here (another number of ranks, a Trainer's
        bundle, a state file gone): every rank loads the consensus and the outer momentum,
        takes the counters from the ``.meta.json`` and starts its inner optimizer,
        scheduler and cadence fresh."""
        from ..checkpoint.forge import load_consensus_checkpoint, load_outer_momentum
        from .resume_rules import checkpoint_mismatch

        self._cadence_restored = False
        if self.comm.local_rank == 0:  # one line a host (each host reads its own copy)
            logger.warning("%s: %s; every rank loads the consensus only (%s)", path,
                           _why_not_exact(kinds, state, self.world_size),
                           _fresh_words(self.model, None if self.el_che is None else
                                        _elche_restart_words(meta, self.world_size)))
        model_path = CheckpointBundle.model_path(path)
        why = checkpoint_mismatch(model_path, self.model)
        if why is not None:
            raise ValueError(f"{model_path} is not a checkpoint of this model: {why}")
        report = load_consensus_checkpoint(self.model, model_path)
        if report.missing or report.unexpected:
            raise ValueError(f"{model_path} does not match the model: "
                             f"missing {report.missing}, unexpected {report.unexpected}")
        momentum = None
        if isinstance(self.outer, OuterOptimizer) and self.outer.has_momentum:
            opath = CheckpointBundle.outer_path(path)
            if opath.exists():
                momentum = load_outer_momentum(self.model, opath)
        if self.outer is not None:
            self._load_outer_state([p.detach().to(torch.float32) for p in self.params],
                                   momentum)
        self.sync_round, self.total_steps = int(meta.sync_round), int(meta.global_step)
        self._steps = self._samples = 0
        self._window_t0 = time.perf_counter()
