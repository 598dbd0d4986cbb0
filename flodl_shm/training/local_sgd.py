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

**Checkpoints.** ``save(stem)`` / ``load(stem)`` and ``state_dict()`` /
``load_state_dict()`` (a rank's full resume state) are in
:mod:`flodl_shm.training.local_sgd_state`.
"""
from __future__ import annotations

import copy
import logging
import math
import numbers
import time
import weakref
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from ..engine.comm import Comm
from ..errors import ShmSpaceError, check_flag
from ..checkpoint.meta import ModelSchema, averaged_buffers
from .agreement import (check_controller_steps_none, check_same_model, check_same_settings,
                        outer_settings)
from .convergence import TrendGuard
from .cohort_log import log_cohort_decisions_from
from .el_che import ElChe, check_anchor
from .local_sgd_state import LocalSGDState, rank_state_path
from .outer import OuterOptimizer
from .realized_work import gamma_mass, is_realized, mover_mass
from .sync_window import ReplicaReduce, gather_columns, params_round_carries_buffers

logger = logging.getLogger("flodl_shm")

__all__ = ["DiLoCo", "LocalSGD", "SyncInfo", "rank_state_path"]

#: the longest window sync_every asks for (checkpoint metadata holds it as an integer)
MAX_SYNC_EVERY = 2 ** 32 - 1

# rows of ElChe's numbers (a report in the params round on one host, else a control gather)
_G_STEPS, _G_COMPUTE_MS, _G_PRESENT, _G_PREV_SYNC_MS, _G_PREV_DIVERGENCE = range(5)


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


class LocalSGD(LocalSGDState):
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
        # (local_sgd_state.py)
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


