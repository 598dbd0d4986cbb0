"""``LocalSGD`` / ``DiLoCo``: realized-work averaging inside your own training loop
(docs/local_sgd.md).

::

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sgd = flodl_shm.LocalSGD(model, sync_every=16, comm=ctx.comm, optimizer=opt)
    for x, y in my_batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        sgd.step(samples=len(x))      # True on the calls that synced

Construction aligns every replica on rank 0's parameters and floating-point buffers
(one broadcast). Every rank then trains on its own, and every ``sync_every``-th
``step()`` (or at ElChe's cadence) replaces the parameters and floating-point buffers
*in place* by the realized-work consensus Σ(wᵣ·Tᵣ)/Σwᵣ, where wᵣ is
``gamma_mass(samples since the last sync, gamma)``. Integer buffers
(``num_batches_tracked``) stay local.

**One collective per window.** With the fixed cadence a window is a single MODEL
round: the parameters and the floating-point buffers travel in one frame, scaled by
wᵣ on the copy into shared memory, with wᵣ as the frame's mass. The divisor Σwᵣ
comes back as the round's accepted mass, so nothing else needs exchanging: a dead
rank's work enters neither the sum nor the divisor, and the survivors continue.
``cadence="elche"`` needs each rank's steps and compute time (for ElChe's cadence)
plus the previous window's sync time and drift (for its overhead rule and the
convergence guard: those two arrive one window late). On one host they ride in the
same round, in its header (``Comm.all_reduce_(report=...)``): still one collective.
Across hosts they take one small CONTROL round before it.

**Outer step.** With ``outer`` set, the parameters' consensus is stepped from the
previous global (the weights adopted at the last sync, or the broadcast initial
weights before the first). An ``OuterNesterov`` (DiLoCo; it also clears the inner
optimizer's state after every sync, as in the Trainer) runs *inside the cooperative
reduce* on one host: each rank steps the slice of the parameters it reduces, with
the previous global and the momentum in shared memory (``Comm.set_outer``), so the
step costs one pass over the model in all, not one per rank. The window is then the
params round (stepped) plus, when the model has floating-point buffers, a buffers
round (averaged, never stepped). ``OuterAvg`` is the plain consensus. Any
``torch.optim.Optimizer`` built on the model's parameters is stepped by every rank
on its own replica with ``grad = prev_global - consensus`` (identical inputs and
arithmetic keep the replicas bit-identical); so is an ``OuterNesterov`` on a
cluster, where the rounds cross hosts through the relay.

**Large models.** Where the window's round is a direct round (one host,
``max_failures=0``, float32, at least 256 KiB: ``engine/direct.py``), construction moves
the round's tensors into the rank's shared parameter block (``shared_params``;
``param.data`` moves, the parameters keep their identity), and the slice reducers
read and write every rank's parameters in place with plain loads and stores.

**Checkpoints.** ``save(stem)`` (a collective, at a sync boundary) writes one bundle
per save, ``<stem>-r<sync round>`` (the Trainer's series, ``checkpoint/series.py``):
the model's names, the consensus ``.fdl``, ``.outer.fdl`` for outer momentum,
``.meta.json`` last as the commit marker, and one ``.rank<N>.optim`` per rank with
everything a bit-exact resume needs: the rank's model state, inner optimizer and LR
scheduler, step counters, outer and ElChe state, RNG states. Older bundles go only
once the new one is complete, so a crash mid-save leaves the previous one whole.
``load(stem)`` restores the newest complete bundle; without the rank file it loads the
consensus and the outer momentum and restarts the inner state fresh.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import numbers
import os
import random
import time
import weakref
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from ..checkpoint._atomic import atomic_write
from ..engine.comm import Comm
from ..errors import (SchemaMismatchError, SeriesInUse, ShmSpaceError, StartRefused, check_flag,
                      plural)
from ..checkpoint.meta import (CheckpointBundle, CheckpointMeta, ElCheState, ModelSchema,
                               SaveReason, averaged_buffers, checkpoint_path)
from ..frame import DTYPE_F32, tensors_to_round_frame
from .agreement import (check_controller_steps_none, check_same_model, check_same_settings,
                        check_same_start, outer_settings, per_rank_ints)
from .convergence import TrendGuard, resumed_guard
from .cohort_log import log_cohort_decisions_from
from .el_che import ElChe, check_anchor
from .inner_state import (check_optimizer_state, check_rank_checksum, check_rank_file,
                          read_rank_state, restore_inner, seal_rank_state)
from .outer import OuterOptimizer
from .realized_work import gamma_mass, is_realized, mover_mass
from .sync_window import ReplicaReduce, gather_columns, params_round_carries_buffers

logger = logging.getLogger("flodl_shm")

__all__ = ["DiLoCo", "LocalSGD", "SyncInfo", "rank_state_path"]

#: Format tag of ``LocalSGD.state_dict()`` (and of the ``.rank<N>.optim`` files).
STATE_FORMAT = "flodl_shm.LocalSGD/1"
#: the longest window sync_every asks for (checkpoint metadata holds it as an integer)
MAX_SYNC_EVERY = 2 ** 32 - 1

# rows of ElChe's numbers (a report in the params round on one host, else a control gather)
_G_STEPS, _G_COMPUTE_MS, _G_PRESENT, _G_PREV_SYNC_MS, _G_PREV_DIVERGENCE = range(5)


#: A rank's resume state in a bundle: ``<bundle stem>.rank<N>.optim``.
rank_state_path = CheckpointBundle.rank_state_path


class SyncInfo(NamedTuple):
    """What the last sync did (identical on every rank except ``local_*``, ``sync_ms`` and,
    with ElChe, ``next_steps``).

    Attributes:
        sync_round: syncs so far, this one included.
        mass: the accepted realized-work mass Σwᵣ (0: nobody trained, local state kept).
        accepted: ranks whose work is in the consensus (on a cluster: this host's only).
        local_samples: samples this rank contributed.
        local_steps: optimizer steps this rank took in the window.
        sync_ms: this rank's wall time in the sync (collectives, adoption, outer step).
        next_steps: steps this rank trains before the next sync (None with
            ``sync_every=None``).
        divergence: this rank's drift ``||pre - post|| / ||post||`` of the parameters
            (0 unless measured: ``drift=True`` or an ElChe cadence).
        bytes_sent: payload bytes this rank contributed to the sync's rounds.
        report_rows: with ``sync(report=...)``, every rank's report in the params
            round, one tuple of 8 floats per rank (zeros for a rank it did not accept);
            else None. ``reports`` makes them the ``[world, 8]`` float64 table.
    """

    sync_round: int
    mass: float
    accepted: tuple[int, ...]
    local_samples: int
    local_steps: int
    sync_ms: float
    next_steps: Optional[int]
    divergence: float = 0.0
    bytes_sent: int = 0
    report_rows: Optional[tuple[tuple[float, ...], ...]] = None

    @property
    def reports(self) -> Optional[np.ndarray]:
        """``report_rows`` as a ``[world, 8]`` float64 table (made on each access)."""
        return None if self.report_rows is None else np.array(self.report_rows, np.float64)


def _resolve_comm(comm, name: str = "LocalSGD"):
    """The engine ``Comm`` LocalSGD runs on: ``comm`` itself (``ctx.comm`` under
    ``flodl_shm.spawn``), the one of a torch.distributed process group whose CPU backend
    is "flodl_shm" (``None``: the default group), or a TypeError naming what was given.
    ``name``: the class the user made (``DiLoCo`` too), as errors name it."""
    if isinstance(comm, Comm):
        return comm
    import torch.distributed as dist

    if comm is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{name}(comm=None) uses the default torch.distributed process group, but "
                "none is initialized: call torch.distributed.init_process_group('flodl_shm', "
                "...) first (torchrun), or pass comm=ctx.comm in a function run by "
                "flodl_shm.spawn")
        return _group_comm(dist.distributed_c10d._get_default_group(), "the default process "
                           "group", "comm=None", name)
    if dist.is_available() and isinstance(comm, dist.ProcessGroup):
        return _group_comm(comm, "the process group", "comm=<a process group>", name)
    hint = (" (pass ctx.comm, the context's Comm, not the context)"
            if hasattr(comm, "comm") and hasattr(comm, "local_rank") else "")
    raise TypeError(f"comm must be None (the default process group), a torch.distributed "
                    f"process group of the 'flodl_shm' backend, or ctx.comm under "
                    f"flodl_shm.spawn; got {type(comm).__name__}{hint}")


def _group_comm(group, what: str, given: str, name: str):
    """The engine ``Comm`` of a single-host process group whose CPU backend is
    "flodl_shm" (``init_process_group("flodl_shm")``; a ``"cpu:flodl_shm,..."`` string
    gives the same group: torch builds a Python backend's group alone)."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if backend != "flodl_shm" and "cpu:flodl_shm" not in backend.split(","):
        raise ValueError(
            f"{name}({given}) needs {what} to use the 'flodl_shm' backend for CPU tensors, "
            f"got {backend!r}: init_process_group('flodl_shm'), or pass comm=ctx.comm "
            f"under flodl_shm.spawn")
    engine = group
    if not hasattr(engine, "comm"):
        try:
            engine = group._get_backend(torch.device("cpu"))
        except Exception:  # noqa: BLE001 - reported below with what to do
            pass
    if not hasattr(engine, "comm"):
        raise RuntimeError(
            f"{what}'s 'flodl_shm' backend ({type(engine).__name__}) does not expose its "
            f"engine Comm; pass comm=ctx.comm under flodl_shm.spawn")
    hosts = len(engine.topology.hosts)
    if hosts != 1:
        raise ValueError(
            f"{name}({given}) averages through the host's shared memory, but {what} "
            f"spans {hosts} hosts; for several hosts run the ranks with "
            f"flodl_shm.spawn(..., controller='host:port') and pass comm=ctx.comm")
    return engine.comm


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


def _listed(names: Sequence[str], one: str, many: str) -> str:
    """``names`` as the subject of verb ``one`` (or ``many``): "parameter 'w' is",
    "parameter 'w', buffer 'b' are" (the first three, then how many more)."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown} {one if len(names) == 1 else many}"


def _lowest_live_rank(ref: "weakref.ref[LocalSGD]") -> Callable[[], bool]:
    """Whether the LocalSGD ``ref`` names is its cohort's reporting rank (the lowest
    live one), which alone logs ElChe's decisions (``cohort_log``); once it is gone,
    every rank logs."""
    def is_reporter() -> bool:
        sgd = ref()
        return sgd is None or not sgd.live_ranks or sgd.live_ranks[0] == sgd.rank
    return is_reporter


def check_replica(model: torch.nn.Module, who: str = "LocalSGD",
                  build: str = "before building LocalSGD") -> None:
    """Raise what makes ``model`` a replica ``who`` cannot average: a parameter or
    floating-point buffer not yet initialized (lazy), of a dtype other than float32 and
    bfloat16, or off the CPU; nothing to average at all. ``build`` says when a lazy
    module's first forward pass must run."""
    named_buffers = averaged_buffers(model)
    for name, t in (*((f"parameter {n!r}", p) for n, p in model.named_parameters()),
                    *((f"buffer {n!r}", b) for n, b in named_buffers)):
        if torch.nn.parameter.is_lazy(t):
            raise ValueError(f"{name} is not initialized yet (a lazy module, such as "
                             f"nn.LazyLinear, gets its shape at its first forward pass): run "
                             f"the model once on a sample batch {build}")
        if t.dtype.is_complex:
            raise TypeError(f"{name} has dtype {t.dtype}; {who} averages float32 or bfloat16 "
                            f"tensors: keep its real and imaginary parts as a float tensor "
                            f"(torch.view_as_real) in the model (.float() would drop the "
                            f"imaginary part)")
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} has dtype {t.dtype}; {who} averages float32 or bfloat16 "
                            f"tensors (convert the model with .float() or .bfloat16())")
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}; {who} averages CPU tensors through "
                             f"shared memory (keep the model on the CPU: model.cpu())")
    if not named_buffers and next(model.parameters(), None) is None:
        raise ValueError(f"the model ({type(model).__name__}) has no parameters and no "
                         f"floating-point buffers: {who} would average nothing")


class LocalSGD:
    """Periodic realized-work averaging of one rank's replica (see the module doc).

    Args:
        model: this rank's replica; parameters and floating-point buffers must be
            float32 or bfloat16 and on the CPU.
        sync_every: optimizer steps per window (``cadence="fixed"``), or the slowest
            rank's initial steps per window (ElChe's anchor). ``None`` (fixed cadence
            only): ``step()`` never syncs; every rank calls ``sync()`` at the windows
            the caller decides (the Trainer's coordinator does).
        comm: this rank's ``Comm`` (``ctx.comm`` under ``flodl_shm.spawn``), or a
            torch.distributed process group whose CPU backend is "flodl_shm" (``None``:
            the default group).
        outer: ``None`` (adopt the consensus), an ``OuterAvg`` / ``OuterNesterov``, or a
            ``torch.optim.Optimizer`` over exactly ``model.parameters()``.
        bf16_wire: send the model frames as bfloat16 (half the bytes; sums in float32).
        cadence: ``"fixed"``, ``"elche"`` (faster ranks take proportionally more steps,
            from measured wall time), an ``ElChe`` or a ``world_size -> ElChe`` factory.
        optimizer: the inner optimizer; saved and restored by ``state_dict`` / ``save``,
            and cleared after each sync when the outer optimizer ``resets_inner()``.
        scheduler: an LR scheduler to save and restore with the state (optional).
        gamma: work exponent of the mass: wᵣ = samples**gamma (1: every sample counts).
        guard: the convergence guard advising ElChe (default ``TrendGuard()``).
        buffers: the floating-point buffers' mass: ``"work"`` (the params mass wᵣ) or
            ``"movers"`` (1 for every rank that trained since the last sync, else 0:
            flodl's rule, the Trainer's).
        drift: measure each sync's drift ``||pre - post|| / ||post||`` into
            ``SyncInfo.divergence`` (keeps one float32 copy of the parameters; always on
            with an ElChe cadence, whose convergence guard reads it).
        shared_params: move the averaged tensors into this rank's shared parameter
            block (``Comm.shared_tensors``), so a sync's direct round reads and writes
            them in place without copies. ``None`` (default): where it pays, that is
            when the window's round is a direct round (one host, ``spawn`` with
            ``max_failures=0`` or the c10d backend, float32 wire and tensors, no outer
            step in the round, at least ``Comm.direct_min_bytes``, 256 KiB, in few enough
            tensors for its address table: ``Comm.direct_round_holds``); ``True``: always
            (a ``ValueError`` says why it cannot); ``False``: never.
    """

    def __init__(self, model: torch.nn.Module, *, sync_every: Optional[int], comm=None,
                 outer=None, bf16_wire: bool = False,
                 cadence: Union[str, ElChe, Callable] = "fixed",
                 optimizer: Optional[torch.optim.Optimizer] = None, scheduler=None,
                 gamma: float = 1.0, guard=None, buffers: str = "work",
                 drift: bool = False, shared_params: Optional[bool] = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if sync_every is None:
            if cadence != "fixed":
                raise ValueError(f"sync_every=None (sync only when sync() is called) needs "
                                 f"cadence='fixed', got cadence={cadence!r}: ElChe needs "
                                 f"sync_every as its anchor (the slowest rank's steps)")
        elif not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1 (or None: sync only when "
                             f"sync() is called), got {sync_every!r}")
        elif sync_every > MAX_SYNC_EVERY:
            raise ValueError(f"sync_every must be at most {MAX_SYNC_EVERY} (2^32 - 1) steps, "
                             f"got {sync_every}; for a window that ends only when you say, "
                             f"pass sync_every=None and call sync()")
        if not isinstance(gamma, numbers.Real) or isinstance(gamma, bool):
            raise TypeError(f"gamma must be a real number, got {gamma!r}")
        if not math.isfinite(gamma):
            raise ValueError(f"gamma must be finite, got {gamma!r}")
        check_flag("bf16_wire", bf16_wire)
        check_flag("drift", drift)
        if guard is not None and not callable(getattr(guard, "check", None)):
            raise TypeError(f"guard must be a convergence guard (TrendGuard(), or an object "
                            f"with its check method), got {guard!r}")
        if not (cadence in ("fixed", "elche") or isinstance(cadence, ElChe) or callable(cadence)):
            raise ValueError(f"cadence must be 'fixed', 'elche', an ElChe or a world_size -> "
                             f"ElChe factory, got {cadence!r}")
        self.comm = _resolve_comm(comm, type(self).__name__)
        self._spans_hosts = self.comm.spans_hosts  # (fixed for the Comm's life)
        self.model = model
        self.sync_every = sync_every
        self.gamma = float(gamma)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.rank = int(self.comm.rank)
        self.world_size = int(self.comm.world_size)
        check_replica(model)
        self.params = [p for p in model.parameters()]
        self.buffers = [b for _, b in averaged_buffers(model)]
        _check_inner(optimizer, scheduler, self.params)
        self.schema = ModelSchema.from_module(model)
        # series lock file -> the RunLock this rank holds (None: its host's lead holds
        # it), the series saved into last at the end; at most SERIES_LOCKS_KEPT
        self._series_locks: dict[str, Any] = {}
        self._series_saved: set[str] = set()  # every series this LocalSGD saved into
        self._resumed_from: Optional[Path] = None  # the bundle load() took
        self.bf16_wire = bool(bf16_wire)
        self.outer = self._check_outer(outer)
        self.resets_inner = bool(isinstance(outer, OuterOptimizer) and outer.resets_inner())
        # where the outer step runs: in the params round (a stateful flodl_shm outer on
        # one host: the cooperative reduce), on every rank's replica (torch.optim, or
        # across hosts), or nowhere
        stateful = isinstance(outer, OuterOptimizer) and outer.has_momentum
        self._outer_in_reduce = stateful and self._round_steps_outer()
        self._outer_per_rank = outer is not None and (not isinstance(outer, OuterOptimizer)
                                                      or (stateful and not self._outer_in_reduce))
        self.comm.set_bf16_wire(self.bf16_wire)
        self.el_che: Optional[ElChe] = None
        self.guard = None
        if cadence != "fixed" and self.world_size >= 2:
            if cadence == "elche":
                self.el_che = ElChe(self.world_size, sync_every)
            elif isinstance(cadence, ElChe):
                self.el_che = cadence
            else:
                self.el_che = cadence(self.world_size)
                if not isinstance(self.el_che, ElChe):
                    raise TypeError(f"the cadence factory must return an ElChe for "
                                    f"world_size {self.world_size}, got "
                                    f"{type(self.el_che).__name__}")
            if self.el_che.world_size != self.world_size:
                raise ValueError(f"the ElChe was built for world_size {self.el_che.world_size} "
                                 f"but the cohort has world_size {self.world_size}")
            self.guard = guard if guard is not None else TrendGuard()
            log_cohort_decisions_from(_lowest_live_rank(weakref.ref(self)))
        self.cadence = "fixed" if self.el_che is None else "elche"
        # where a load() that cannot restore every rank's ElChe restarts them all from
        self._fresh_cadence = copy.deepcopy((self.el_che, self.guard))
        self._cadence_restored = False  # whether load() restored this rank's own ElChe
        self._check_same_settings(buffers, shared_params)
        if self.el_che is not None:  # (after the agreement: every rank raises alike)
            check_anchor(sync_every, self.el_che)
        if self.world_size >= 2:
            # the verdict first: the parameters go to shared blocks only where the
            # rounds run direct (elsewhere every round would copy through them)
            self.comm.settle_direct_rounds()
        #: whether the params round's tensors live in the shared parameter block
        self.shared_params = self._place_shared(shared_params, buffers)
        # the window's rounds (the drift: on request, and for ElChe's guard)
        self._replica = ReplicaReduce(model, outer=self._outer_in_reduce,
                                      drift=bool(drift) or self.guard is not None,
                                      buffers=buffers)
        # counters
        self.sync_round = 0
        self.total_steps = 0
        self.total_samples = 0
        self.realized_mass = 0.0
        self._steps = 0
        self._samples = 0
        self._target = self._next_target()
        self._prev_sync_ms = 0.0
        self._prev_divergence = 0.0
        self.last_sync: Optional[SyncInfo] = None
        self.live_ranks: tuple = tuple(range(self.world_size))
        self._replica.align_on(self.comm, 0)
        if self.comm.spans_hosts and not self._round_steps_outer():
            check_controller_steps_none(self.comm, self.outer)  # (known after that round)
        self._prev_global = ([p.detach().to(torch.float32).clone() for p in self.params]
                             if self._outer_per_rank else None)
        if self._outer_in_reduce:
            self.comm.set_outer(self.outer)
            self._outer_claim = self.comm.outer_claim()  # see sync()
            self._seed_outer_round()
        self._window_t0 = time.perf_counter()

    #: the fix a setting or model that differs between ranks is refused with
    _same_setup_fix = "build LocalSGD with the same arguments, on the same model, on every rank"

    def _check_same_settings(self, buffers: str, shared_params: Optional[bool]) -> None:
        """Every rank built its LocalSGD with the same settings, on the same tensors
        (``agreement.py``), before the broadcast that aligns the replicas."""
        fix = self._same_setup_fix
        check_same_settings(self.comm, {
            "sync_every": self.sync_every, "gamma": self.gamma,
            "cadence": self.cadence if self.el_che is None else self.el_che.settings(),
            "outer": outer_settings(self.outer), "bf16_wire": self.bf16_wire,
            "buffers": buffers, "shared_params": shared_params,
            "the LocalSGD subclass": type(self).__name__}, fix)
        check_same_model(self.comm, [
            (f"parameter {name!r}", f"shape {tuple(t.shape)} {t.dtype}")
            for name, t in self.model.named_parameters()] + [
            (f"buffer {name!r}", f"shape {tuple(t.shape)} {t.dtype}")
            for name, t in averaged_buffers(self.model)], fix)

    def _place_shared(self, want: Optional[bool], buffers: str) -> bool:
        """Move the params round's tensors (the parameters, and the floating-point
        buffers when they travel with them) into the shared parameter block, as
        ``shared_params`` asks; the model's tensors keep their identity (``.data``
        moves). Returns whether they were moved."""
        carries = params_round_carries_buffers(buffers, self._outer_in_reduce)
        if want is False:
            return False
        tensors = self.params + (self.buffers if carries else [])
        why = self._not_shareable(tensors, explicit=bool(want))
        if why is not None:
            if want:
                raise ValueError(f"shared_params=True, but {why}")
            return False
        try:
            placed = self.comm.shared_tensors([t.detach() for t in tensors])
        except (RuntimeError, ShmSpaceError) as e:
            if want:
                raise ValueError(f"shared_params=True, but {e}") from e
            if self.comm.local_rank == 0:  # one line a host: the sync runs ~2x slower
                logger.warning("parameters averaged with copies, not in place: %s", e)
            return False
        with torch.no_grad():
            for t, shared in zip(tensors, placed):
                t.data = shared
        return True

    def _not_shareable(self, tensors, explicit: bool) -> Optional[str]:
        """Why the params round cannot run in place in the shared parameter block (None:
        it can)."""
        comm = self.comm
        if self.world_size < 2:
            return "a single rank has nothing to average"
        if comm.spans_hosts:
            return "the rounds cross hosts (shared memory covers one host)"
        if not comm.direct_rounds_available:
            return ("direct rounds are off for this cohort (spawn(max_failures=k) with k > 0, "
                    "FLODL_SHM_DIRECT=0, or ranks that may not attach to each other)")
        if self.bf16_wire:
            return "bf16_wire=True (direct rounds carry a float32 wire)"
        if self._outer_in_reduce:
            return "the outer optimizer steps inside the params round (not a direct round)"
        names = self._round_names(tensors)
        bad = [f"{names[i]} ({str(t.dtype).removeprefix('torch.')})"
               for i, t in enumerate(tensors) if t.dtype != torch.float32]
        if bad:
            return (f"{_listed(bad, 'is', 'are')} not float32 (the shared block and its "
                    f"direct rounds hold float32)")
        strided = [names[i] for i, t in enumerate(tensors) if not t.is_contiguous()]
        if strided:
            return (f"{_listed(strided, 'is', 'are')} not contiguous (channels_last, a "
                    f"transposed view): the block holds each tensor contiguous, so their "
                    f"layout would change")
        shared = self._sharing_memory(tensors, names)
        if shared:
            return (f"{_listed(shared, 'shares', 'share')} memory with another tensor of the "
                    f"model (a view of it): each gets its own place in the block, so they "
                    f"would stop sharing it")
        if explicit:
            return None
        nbytes = 4 * sum(t.numel() for t in tensors)
        if nbytes < comm.direct_min_bytes:
            return (f"the params round's {nbytes} bytes are below the direct rounds' "
                    f"{comm.direct_min_bytes} (FLODL_SHM_DIRECT_MIN_BYTES)")
        if not comm.direct_round_holds(tensors):
            return (f"the params round's {len(tensors)} tensors are more than a direct "
                    f"round's address table holds (the round takes the shared path)")
        return None

    def _round_names(self, tensors) -> list[str]:
        """The model's names of ``tensors`` (the params round's: parameters, then the
        buffers that travel with them)."""
        named = {id(t): f"parameter {n!r}" for n, t in self.model.named_parameters()}
        named.update({id(t): f"buffer {n!r}" for n, t in self.model.named_buffers()})
        return [named.get(id(t), f"tensor {i}") for i, t in enumerate(tensors)]

    def _sharing_memory(self, tensors, names: list[str]) -> list[str]:
        """Names of ``tensors`` whose storage another of them, or any buffer of the
        model, also uses: moving each into its own place in the shared block would
        break the link."""
        def storage(t):
            return t.untyped_storage().data_ptr() if t.numel() else None

        users: dict[int, int] = {}
        for t in {id(t): t for t in [*tensors, *self.model.buffers()]}.values():
            key = storage(t)
            if key is not None:
                users[key] = users.get(key, 0) + 1
        return [names[i] for i, t in enumerate(tensors)
                if storage(t) is not None and users[storage(t)] > 1]

    def _round_steps_outer(self) -> bool:
        """Whether a stateful flodl_shm outer optimizer steps inside the params round:
        on one host (each rank steps the slice it reduces); across hosts every rank
        steps its own replica instead."""
        return not self.comm.spans_hosts

    def _seed_outer_round(self) -> None:
        """Seed the in-round outer optimizer: the first outer step starts from the
        broadcast initial weights (DiLoCo's first outer gradient is initial - consensus)."""
        self.comm.load_outer_state(prev=[p.detach() for p in self.params])

    def _check_outer(self, outer):
        if outer is None or isinstance(outer, OuterOptimizer):
            return outer
        if isinstance(outer, torch.optim.Optimizer):
            mine = {id(p) for p in self.params}
            theirs = {id(p) for g in outer.param_groups for p in g["params"]}
            if mine != theirs:
                raise ValueError(
                    f"the outer torch.optim optimizer must be built on exactly "
                    f"model.parameters() ({len(mine)} tensors), got {len(theirs)} tensors of "
                    f"which {len(theirs & mine)} are the model's")
            return outer
        raise TypeError(f"outer must be None, an OuterAvg / OuterNesterov, or a "
                        f"torch.optim.Optimizer, got {type(outer).__name__}")

    def _next_target(self) -> Optional[int]:
        return self.sync_every if self.el_che is None else max(1, self.el_che.batches(self.rank))

    # -- the loop ------------------------------------------------------------------------
    def consensus_is_finite(self) -> bool:
        """Whether the averaged tensors (parameters and floating-point buffers) hold no
        NaN or inf; right after a sync they are the consensus, the same on every rank,
        so every rank answers alike. A diverged consensus is not checkpointed."""
        return all(bool(torch.isfinite(t).all()) for t in (*self.params, *self.buffers))

    @property
    def steps_until_sync(self) -> Optional[int]:
        """Steps this rank takes before the next sync (None with ``sync_every=None``)."""
        return None if self._target is None else max(self._target - self._steps, 0)

    def step(self, samples: int = 1) -> bool:
        """Count one optimizer step of ``samples`` samples; sync on every window's last step.

        Call it after each ``optimizer.step()`` on every rank. Returns True on the calls
        that synced (the parameters and floating-point buffers are then the consensus).

        Args:
            samples: samples this step trained (its share of the realized work).
        """
        if type(samples) is not int or samples < 0:  # (a plain int: the common case, fast)
            if not isinstance(samples, (int, np.integer)) or isinstance(samples, bool) \
                    or samples < 0:
                raise ValueError(f"samples must be an int >= 0, got {samples!r}")
            samples = int(samples)
        self._steps = steps = self._steps + 1
        self._samples += samples
        self.total_steps += 1
        self.total_samples += samples
        target = self._target
        if target is not None and steps >= target:
            self.sync()
            return True
        return False

    def sync(self, report: Optional[Sequence[float]] = None) -> SyncInfo:
        """Sync now (a collective: every rank calls it at the same window).

        Replaces the parameters and floating-point buffers in place by the consensus
        of the work realized since the last sync (then the outer step); if no rank
        trained, every replica keeps its state.

        Args:
            report: up to 8 numbers of this rank that ride in the params round (one
                host, fixed cadence; every rank passes one or none does): every rank's
                come back in ``SyncInfo.report_rows`` (``SyncInfo.reports`` as a table),
                describing exactly the ranks whose work the consensus holds.
        """
        t0 = time.perf_counter()
        steps, samples = self._steps, self._samples
        comm, el_che = self.comm, self.el_che
        gathered = None
        if el_che is not None:
            if report is not None:
                raise ValueError("sync(report=...) needs cadence='fixed': with ElChe, its own "
                                 "numbers ride in the params round's report")
            column = (steps, (t0 - self._window_t0) * 1e3, 1.0, self._prev_sync_ms,
                      self._prev_divergence)
            if not self._spans_hosts:
                report = column  # one host: ElChe's numbers ride in the params round
            else:
                gathered = gather_columns(comm, column)
        # the Comm holds one wire setting and one in-reduce outer state for every window on
        # it: this window's wire, and its outer state unless a later window took it over
        comm.set_bf16_wire(self.bf16_wire)
        if self._outer_in_reduce and comm.outer_claim() != self._outer_claim:
            raise RuntimeError(
                "another LocalSGD built on this Comm since this one installed its outer "
                "optimizer: the Comm holds one outer state (previous global, momentum), now "
                "that one's. Keep one LocalSGD with an outer optimizer per Comm (wrap the "
                "models in one nn.ModuleList), or give each its own process group")
        # one MODEL round, in place: params and float buffers scaled by w, mass w; a round
        # that realized nothing (mass 0) leaves the tensors untouched. With the outer step
        # in the reduce, the params round is stepped and the buffers travel on their own.
        reduced = self._replica.reduce(comm, gamma_mass(samples, self.gamma),
                                       mover_mass(samples), report=report)
        mass, _, accepted, divergence, bytes_sent, reports = reduced
        if report is not None and el_che is not None:
            gathered = np.array(reports, np.float64)[:, :len(report)].T
            reports = None
        if is_realized(mass):
            if self._outer_per_rank:
                with torch.no_grad():
                    self._outer_step()
            if self.resets_inner and self.optimizer is not None:
                self.optimizer.state.clear()
            self.realized_mass += mass
        else:
            divergence = 0.0
        self.sync_round = sync_round = self.sync_round + 1
        if not self._spans_hosts:
            self.live_ranks = accepted
        if gathered is not None:
            self._report_elche(gathered)
        self._steps = 0
        self._samples = 0
        self._target = target = self._next_target()
        self._window_t0 = t1 = time.perf_counter()  # the next window starts now
        sync_ms = (t1 - t0) * 1e3
        self._prev_sync_ms, self._prev_divergence = sync_ms, divergence
        # (tuple.__new__: the NamedTuple's own __new__ is a Python frame)
        self.last_sync = info = tuple.__new__(SyncInfo, (sync_round, mass, accepted, samples,
                                                         steps, sync_ms, target, divergence,
                                                         bytes_sent, reports))
        return info

    def _outer_step(self) -> None:
        """The parameters hold the consensus: step them from the previous global (the
        per-rank path: a torch.optim outer, or an ``OuterNesterov`` across hosts)."""
        outer, prev = self.outer, self._prev_global
        if isinstance(outer, OuterOptimizer):
            new = outer.outer_step(prev, [p.detach().to(torch.float32) for p in self.params])
            for p, g, v in zip(self.params, prev, new):
                p.copy_(v)
                g.copy_(v)
            return
        for p, g in zip(self.params, prev):
            p.grad = (g - p.detach().to(torch.float32)).to(p.dtype)
            p.copy_(g)
        outer.step()
        for p, g in zip(self.params, prev):
            p.grad = None
            g.copy_(p)

    def outer_state(self) -> tuple[Optional[list], Optional[list]]:
        """Copies of the outer optimizer's state, one float32 tensor per parameter:
        ``(prev_global, momentum)`` — the global the next outer step starts from and the
        momentum (``None`` before the first step, or for a stateless / torch.optim outer,
        whose state is its own ``state_dict``). ``(None, None)`` without an outer."""
        if self._outer_in_reduce:
            return (self._unflatten(self.comm.outer_prev()),
                    self._unflatten(self.comm.outer_momentum()))
        prev = None if self._prev_global is None else [g.clone() for g in self._prev_global]
        momentum = (self.outer.checkpoint_state() if isinstance(self.outer, OuterOptimizer)
                    else None)
        return prev, momentum

    def _load_outer_state(self, prev: Optional[Sequence[torch.Tensor]],
                          momentum: Optional[Sequence[torch.Tensor]]) -> None:
        """Continue the outer optimizer from ``prev`` (the previous global; ``None``: the
        current parameters) and ``momentum`` (``None``: fresh)."""
        if prev is None:
            prev = [p.detach().to(torch.float32) for p in self.params]
        if self._outer_in_reduce:
            self.comm.load_outer_state(prev=prev, momentum=momentum)
            return
        if self._prev_global is not None:
            for g, src in zip(self._prev_global, prev):
                g.copy_(src)
        if isinstance(self.outer, OuterOptimizer) and self.outer.has_momentum:
            if momentum is None:
                self.outer.reset_state()
            else:
                self.outer.load_checkpoint_state(momentum)

    def _unflatten(self, flat: Optional[np.ndarray]) -> Optional[list]:
        """Split a flat float32 vector into tensors shaped like the parameters."""
        if flat is None:
            return None
        out, at = [], 0
        for p in self.params:
            n = p.numel()
            out.append(torch.from_numpy(flat[at:at + n]).reshape(p.shape).clone())
            at += n
        return out

    def _report_elche(self, m: np.ndarray) -> None:
        present = m[_G_PRESENT] > 0.5
        wall = [float(m[_G_COMPUTE_MS][r]) if present[r] else 0.0 for r in range(self.world_size)]
        ran = [int(round(m[_G_STEPS][r])) if present[r] else 0 for r in range(self.world_size)]
        if sum(ran) == 0:
            return
        # the previous sync's cost: the least time of the ranks present. Each rank's sync
        # time includes waiting there for the last one to finish its steps (imbalance,
        # which the cadence itself corrects); the last to arrive waited for nobody.
        prev_sync = m[_G_PREV_SYNC_MS][present]
        self.el_che.report_timing(wall, ran, float(prev_sync.min()) if prev_sync.size else 0.0)
        # the previous window's drift: none at the first sync of a run (every rank's
        # previous sync time is 0 then), whose zeros must not read as "no drift"
        if self.guard is not None and bool(np.any(m[_G_PREV_SYNC_MS] > 0.0)):
            action = self.guard.check([float(d) for d in m[_G_PREV_DIVERGENCE]], sum(ran),
                                      max(ran))
            self.el_che.apply_action(action)

    # -- state ---------------------------------------------------------------------------
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

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}/{self.world_size}, "
                f"sync_every={self.sync_every}, cadence={self.cadence!r}, outer={self.outer!r}, "
                f"bf16_wire={self.bf16_wire}, sync_round={self.sync_round})")


class DiLoCo(LocalSGD):
    """``LocalSGD`` with DiLoCo's outer optimizer: ``OuterNesterov(outer_lr,
    outer_momentum)`` (reference 0.7 / 0.9). Same arguments as :class:`LocalSGD`
    otherwise (``outer`` excluded).

    Args:
        model: this rank's replica.
        sync_every: inner steps per window (DiLoCo's H).
        outer_lr: the outer learning rate.
        outer_momentum: the outer Nesterov momentum.
        **kwargs: ``comm``, ``bf16_wire``, ``cadence``, ``optimizer``, ``scheduler``,
            ``gamma``, ``guard`` as for :class:`LocalSGD`.
    """

    def __init__(self, model: torch.nn.Module, *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, **kwargs: Any) -> None:
        from .outer import OuterNesterov

        if "outer" in kwargs:
            raise TypeError("DiLoCo sets its own outer optimizer (OuterNesterov(outer_lr, "
                            "outer_momentum)); use LocalSGD(outer=...) for another one")
        super().__init__(model, sync_every=sync_every,
                         outer=OuterNesterov(lr=outer_lr, momentum=outer_momentum), **kwargs)


def _check_inner(optimizer, scheduler, params: list) -> None:
    """Refuse an inner optimizer that does not train this model (one built on another
    model's parameters left this one untouched, silently) and objects that are not an
    optimizer or a scheduler (their state is saved with every checkpoint)."""
    if optimizer is not None:
        groups = getattr(optimizer, "param_groups", None)
        if groups is None or not callable(getattr(optimizer, "state_dict", None)):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or None), got "
                            f"{type(optimizer).__name__}")
        mine = {id(p) for p in params}
        theirs = [p for g in groups for p in g["params"]]
        foreign = sum(id(p) not in mine for p in theirs)
        if foreign:
            raise ValueError(f"the optimizer trains {foreign} of its {len(theirs)} tensors "
                             f"outside this model's parameters: build it on "
                             f"model.parameters() of the model given to LocalSGD")
    if scheduler is not None and not (callable(getattr(scheduler, "state_dict", None))
                                      and callable(getattr(scheduler, "step", None))):
        raise TypeError(f"scheduler must be an LR scheduler (with step and state_dict) or "
                        f"None, got {type(scheduler).__name__}")


#: a host lead's verdict on a series at the first save into it (``_claim_series``)
_SERIES_OK, _SERIES_IN_USE, _SERIES_STALE = 0, 1, 2
#: how many series' run locks a LocalSGD keeps (those it saved into last)
SERIES_LOCKS_KEPT = 8


#: what ``load()`` finds of a rank's own state in a bundle (``_agree_on_state``'s values;
#: a dead rank's slot reads 0)
_STATE_UNREADABLE, _STATE_MISSING, _STATE_FOREIGN, _STATE_OTHER_WORLD, _STATE_OWN = 1, 2, 3, 4, 5


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
