"""The pieces of a sync window (flodl 0.7.0's "param bridge", docs/trainer.md, "What
happens in a window"): the window's counts and the realized-work reduce. The window
itself is ``LocalSGD.sync`` (:mod:`flodl_shm.training.local_sgd`); the Trainer runs
every window through a ``LocalSGD`` and adds its counts.

Every rank calls the same collectives in the same order. What a window exchanges:

- **Counts** (:func:`count_column`, the Trainer's). Each rank's column of a small
  ``[field, world]`` matrix - batches trained this window, compute wall time, loss
  sum, a *present* flag, a stop request, and the previous window's *ack* (this rank's
  drift and sync time). A dead rank's column reads 0, so ``present`` separates
  "dead" from "idle" (alive with 0 batches). Counts are exact in f32 up to 2^24
  batches per window. The ack rides one window late so that it costs no round of its
  own: all ranks still feed ElChe and the guard identical inputs (this window's
  compute times, the previous window's sync time and drift).
- **Reduce** (:class:`ReplicaReduce`). The parameters are averaged *in place*
  (``Comm.all_reduce_``, the scale fused into the copy into shared memory) with
  mass ``gamma_mass(n, gamma)`` (the window's params frame, stepped by the outer
  optimizer when one is installed); the floating-point buffers with the same mass
  or with the 0/1 ``mover_mass``; integer buffers (``num_batches_tracked``) never
  leave the rank. A round whose accepted mass is 0 leaves the tensors as they were.
  The rank's relative drift ``||pre - post|| / ||post||`` is measured for the
  convergence guard.

How the counts travel:

- **One host**: they ride in the params round as the rank's *report*
  (``LocalSGD.sync(report=...)``, :func:`counts_from_reports`), so a window is one
  round (two with floating-point buffers) and the counts describe exactly the ranks
  whose contribution the round accepted.
- **Several hosts** (:func:`gather_counts`, then the reduce): reports cover one host,
  so the counts go first in a CONTROL round of their own.

The module holds no cohort-level policy: what to train next, coverage and
checkpoints belong to :mod:`flodl_shm.training.coordinator`, which every rank runs
identically on these values.

**Realized-work check** (several hosts). The gather says which ranks were present
*before* the reduce; the params round's accepted mass says whose work is *in* the
consensus. They agree unless a rank died in between (after arriving at the gather,
before arriving at the params round): the accepted mass then falls short of
:func:`expected_params_mass`, and the coordinator settles coverage on the ranks
the params round accepted, which one more gather tells every host
(:func:`accepted_across_hosts`).
"""
from __future__ import annotations

import functools
import logging
import math
import operator
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..checkpoint.meta import averaged_buffers
from ..engine.gathered import GatheredTensors
from ..frame import RoundKind
from .agreement import per_rank_ints
from .realized_work import gamma_mass

if TYPE_CHECKING:
    from .local_sgd import SyncInfo

logger = logging.getLogger("flodl_shm")

__all__ = [
    "COUNT_ROWS",
    "CohortAck",
    "CohortCounts",
    "ReduceOutcome",
    "ReplicaReduce",
    "count_column",
    "counts_from",
    "counts_from_reports",
    "expected_params_mass",
    "falls_short",
    "params_round_carries_buffers",
    "gather_columns",
    "gather_counts",
]

# rows of the count gather's [field, world] matrix (the last three: the previous window's ack)
(_C_BATCHES, _C_COMPUTE_MS, _C_LOSS, _C_PRESENT, _C_STOP, _C_HAS_ACK, _C_DIVERGENCE,
 _C_REDUCE_MS) = range(8)
#: Numbers in a rank's count column (they fit a round report's 8 values).
COUNT_ROWS = 8


@dataclass(frozen=True)
class CohortAck:
    """A window's ack, identical on every rank (it travels in the next window's count
    gather).

    Attributes:
        divergence: per rank, ``||pre - post|| / ||post||`` (0 when skipped or dead).
        reduce_ms: per rank, wall time of its reduces (ms).
        present: per rank, whether it reported one (False for a dead rank, and for
            every rank at the first window of a run or of a resume: no ack yet).
    """

    divergence: tuple[float, ...]
    reduce_ms: tuple[float, ...]
    present: tuple[bool, ...]

    @property
    def reported(self) -> bool:
        """Whether any rank reported an ack (False: nothing to feed ElChe's overhead rule
        or the convergence guard)."""
        return any(self.present)

    @property
    def max_divergence(self) -> float:
        return max((d for d in self.divergence if d == d), default=0.0)

    @property
    def sync_ms(self) -> float:
        """The window's reduce cost: the least reduce time of the ranks that reported
        one. On one host the counts ride in the params round, so a rank's reduce time
        includes waiting there for the last rank to finish training (load imbalance,
        which ElChe's batch counts address, not sync overhead); the last rank to arrive
        waits for nobody, and its time is the collective's own cost. After a count
        gather (several hosts) the ranks start the reduce together and the times
        barely differ."""
        return min((t for t, p in zip(self.reduce_ms, self.present) if p), default=0.0)


@dataclass(frozen=True)
class CohortCounts:
    """The count gather of one window, identical on every rank.

    Attributes:
        batches: per rank, batches trained this window (0 for idle and dead ranks).
        compute_ms: per rank, wall time of the window's training (ms).
        loss_sum: per rank, the sum of its batch losses.
        present: per rank, whether it joined the gather (False: dead).
        stop: whether any rank asked to stop after this window.
        prev_ack: the previous window's ack (zeros before the first window; None when
            the counts were not gathered by :func:`gather_counts`).
    """

    batches: tuple[int, ...]
    compute_ms: tuple[float, ...]
    loss_sum: tuple[float, ...]
    present: tuple[bool, ...]
    stop: bool
    prev_ack: Optional[CohortAck] = None

    @property
    def world_size(self) -> int:
        return len(self.batches)

    @property
    def total_batches(self) -> int:
        """Batches trained cohort-wide; 0 means an all-idle window (reduces skipped)."""
        return sum(self.batches)

    def alive(self) -> list[int]:
        """Ranks present at the gather, ascending."""
        return [r for r, p in enumerate(self.present) if p]

    def movers(self) -> list[int]:
        """Present ranks that trained at least one batch."""
        return [r for r in range(self.world_size) if self.present[r] and self.batches[r] > 0]


def gather_columns(comm, column: Sequence[float]) -> np.ndarray:
    """Gather one column of small numbers per rank (one CONTROL round; every rank calls it
    with a column of the same length): returns the ``[len(column), world]`` float64 matrix
    whose column ``r`` is rank ``r``'s (zeros for a dead rank). Values travel as f32:
    integers are exact up to 2^24."""
    return _gather(comm, len(column), column)


def _gather(comm, rows: int, column: Sequence[float]) -> np.ndarray:
    mat = torch.zeros((rows, comm.world_size), dtype=torch.float32)
    mat[:, comm.rank] = torch.tensor([float(v) for v in column], dtype=torch.float32)
    (out,), _ = comm.all_reduce_weighted([mat], RoundKind.CONTROL, 0.0)
    return out.numpy().astype(np.float64)


def count_column(batches: int, compute_ms: float, loss_sum: float = 0.0, stop: bool = False,
                 prev: Optional["SyncInfo"] = None) -> tuple[float, ...]:
    """This rank's column of the window's counts (what :func:`gather_counts` gathers, or
    what rides in the params round as its report).

    Args:
        batches: batches this rank trained since the last sync.
        compute_ms: wall time of that training (ms), ElChe's timing signal.
        loss_sum: sum of this rank's batch losses (for metrics).
        stop: this rank asks the cohort to stop after this window.
        prev: what this rank's previous sync did (``LocalSGD.sync``'s ``SyncInfo``: its
            drift and sync time travel as that window's ack); None before the first
            window.
    """
    if batches < 0:
        raise ValueError(f"batches must be >= 0, got {batches}")
    loss = float(loss_sum)  # a NaN or inf stays one: the window's loss reads as it is
    div = 0.0 if prev is None or not math.isfinite(prev.divergence) else prev.divergence
    reduce_ms = 0.0 if prev is None else max(float(prev.sync_ms), 0.0)
    return (float(batches), max(float(compute_ms), 0.0), loss, 1.0, 1.0 if stop else 0.0,
            0.0 if prev is None else 1.0, div, reduce_ms)


def counts_from(m: np.ndarray) -> CohortCounts:
    """The :class:`CohortCounts` of a ``[field, world]`` matrix of :func:`count_column`
    columns (a dead rank's column all zeros)."""
    return _counts(m.tolist())  # Python floats: iterating numpy scalars costs ~10x more


def counts_from_reports(reports) -> CohortCounts:
    """The :class:`CohortCounts` of a params round that carried :func:`count_column` as
    every rank's report: its ``[world, 8]`` table (``SyncInfo.reports``) or, cheaper,
    its rows (``SyncInfo.report_rows``: one tuple per rank)."""
    rows = reports.tolist() if isinstance(reports, np.ndarray) else reports
    return _counts(list(zip(*rows)))


def _counts(fields: Sequence[Sequence[float]]) -> CohortCounts:
    """:class:`CohortCounts` of ``fields[k][r]``: field k of :func:`count_column` for rank r."""
    # (positional arguments and ``map`` where a builtin does it: a window builds these
    # right after training)
    return CohortCounts(
        tuple([int(round(v)) for v in fields[_C_BATCHES]]),  # (numpy 1 rounds a float32 to one)
        tuple(fields[_C_COMPUTE_MS]),
        tuple(fields[_C_LOSS]),
        tuple(map(_ABOVE_HALF, fields[_C_PRESENT])),
        max(fields[_C_STOP]) > 0.5,
        CohortAck(tuple(fields[_C_DIVERGENCE]), tuple(fields[_C_REDUCE_MS]),
                  tuple(map(_ABOVE_HALF, fields[_C_HAS_ACK]))),
    )


#: ``v > 0.5``: a flag of a count column (``operator.lt``, not ``float.__lt__``, which
#: answers NotImplemented, a true value, for a numpy float32)
_ABOVE_HALF = functools.partial(operator.lt, 0.5)


def gather_counts(comm, batches: int, compute_ms: float, loss_sum: float = 0.0,
                  stop: bool = False, prev: Optional["SyncInfo"] = None) -> CohortCounts:
    """The window's count gather (one CONTROL round; every rank must call it), with
    :func:`count_column`'s arguments."""
    column = count_column(batches, compute_ms, loss_sum, stop, prev)
    return counts_from(_gather(comm, COUNT_ROWS, column))


def expected_params_mass(counts: CohortCounts, gamma: float) -> float:
    """The params round's accepted mass if every present rank's work arrives:
    ``Σ gamma_mass(batches_r, gamma)`` over present ranks, in rank order (the
    order the engine sums masses in, so equality is exact on a single host)."""
    total = 0.0
    for r in range(counts.world_size):
        if counts.present[r]:
            total += gamma_mass(counts.batches[r], gamma)
    return total


def falls_short(mass: float, counts: CohortCounts, gamma: float) -> bool:
    """Whether a params round whose accepted mass is ``mass`` realized less work than the
    count gather ``counts`` promised (:func:`expected_params_mass`): a rank died between
    the gather and the round. Never for an all-idle window."""
    if counts.total_batches == 0:
        return False
    return mass < expected_params_mass(counts, gamma) * (1.0 - 1e-9)


def accepted_across_hosts(comm, accepted_here: Sequence[int]) -> tuple[int, ...]:
    """The ranks whose work a cluster's params round accepted, the same on every host.

    A host knows which of its own ranks the round accepted (``SyncInfo.accepted``), not
    the others': crediting those alone after a :func:`falls_short` window split the
    hosts' coverage and checkpoint metadata. One per-rank gather (a CONTROL round;
    every live rank of the window calls it, as every rank sees the same shortfall) puts
    each rank's own answer on every host; a rank that dies during it counts as not
    accepted (its samples are trained again)."""
    got = per_rank_ints(comm, comm.rank in accepted_here)
    return tuple(r for r in range(comm.world_size) if got[r] > 0)


def params_round_carries_buffers(buffers: str, outer: bool) -> bool:
    """Whether the floating-point buffers travel in the params round (``buffers="work"``
    without an outer step in the round) rather than in a round of their own.

    Raises:
        ValueError: ``buffers`` is neither ``"work"`` nor ``"movers"``.
    """
    if buffers not in ("work", "movers"):
        raise ValueError(f"buffers must be 'work' or 'movers', got {buffers!r}")
    return buffers == "work" and not outer


class ReplicaReduce:
    """The reduce half of a window, shared by the Trainer and ``LocalSGD``: average a
    replica's parameters and floating-point buffers in place, weighted by realized work.

    The parameters travel in one MODEL round, scaled by this rank's mass on the copy into
    shared memory (``Comm.all_reduce_``), the consensus written straight back into them.
    The floating-point buffers either carry the params mass (``buffers="work"``: they
    ride in the params round, or in a round of their own when an outer step applies to
    the params) or the 0/1 mover mass (``buffers="movers"``, flodl's rule: always a
    round of their own). The round structure depends only on these settings, never on
    the masses, so every rank runs the same rounds. A round whose accepted mass is 0
    leaves its tensors as they were. Integer buffers never leave the rank.

    Args:
        model: the rank's replica; parameters and floating-point buffers float32 or
            bfloat16, on the CPU.
        outer: send the params round with ``outer=True`` (the optimizer installed with
            ``Comm.set_outer`` steps the consensus into the new global).
        drift: measure ``||pre - post|| / ||post||`` of the parameters (the
            engine's drift sums, ``Comm.all_reduce_(drift=...)``).
        buffers: ``"work"`` or ``"movers"`` (see above).
    """

    def __init__(self, model: torch.nn.Module, *, outer: bool = False, drift: bool = True,
                 buffers: str = "work") -> None:
        carries = params_round_carries_buffers(buffers, bool(outer))
        self.params = [p for p in model.parameters()]
        self.buffers = [b for _, b in averaged_buffers(model)]
        self.outer = bool(outer)
        self.buffer_mass = buffers
        self._gather([p.detach() for p in self.params], [b.detach() for b in self.buffers])
        numel = sum(t.numel() for t in self.params + self.buffers)  # elements sent
        self._bytes_sent = (numel * 4, numel * 2)  # on the float32 wire, the bf16 one
        # the drift sums of the params round: one row per tensor it carries (the
        # parameters' rows first), filled by the engine while it writes the consensus
        self._drift = (np.zeros((len(self._live_params) + (len(self._live_buffers) if carries
                                                             else 0), 3))
                       if drift else None)
        if self._drift is not None:
            # zeroed and read through struct, not numpy: a window runs right after
            # training has evicted the caches, where a numpy call costs 15-30 µs
            self._drift_bytes = memoryview(self._drift).cast("B")
            self._drift_zeros = bytes(self._drift.nbytes)
            self._drift_params = struct.Struct(f"={3 * len(self._live_params)}d")
        self._together = bool(self._live_buffers) and carries
        # what each averaged tensor must still be at a sync: its module's entry, on this
        # storage (a model.bfloat16(), a `p.data = ...` or a new nn.Parameter after the
        # window was built would leave the rounds averaging stale copies)
        self._held = tuple(_held_entries(model, "parameter", model.named_parameters())
                           + _held_entries(model, "buffer", averaged_buffers(model)))
        # a module, parameter or buffer assigned anywhere in the process since then
        # (``model.head = nn.Linear(...)``): the slow check compares the model's tensors
        _watch_registrations()
        self._model = model
        self._registered = _registrations[0]

    def _gather(self, params: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        """The tensors the rounds write through (detached views), as ``GatheredTensors``:
        their rounds reuse the addresses gathered at the first, which
        ``_check_unchanged`` vouches for before each."""
        self._live_params = GatheredTensors(params)
        self._live_buffers = GatheredTensors(buffers)
        self._live_all = GatheredTensors(params + buffers)

    def tensors(self) -> list[torch.Tensor]:
        """The averaged tensors, detached: the parameters, then the floating-point
        buffers (a ``ModelSchema``'s order)."""
        return list(self._live_all)

    def align_on(self, comm, root: int = 0) -> None:
        """Overwrite this replica's parameters and floating-point buffers with rank
        ``root``'s (a collective: one in-place broadcast, ``Comm.broadcast_``; a no-op
        for a world of one)."""
        if comm.world_size > 1 and self._live_all:
            self._check_unchanged()
            comm.broadcast_(self._live_all, root)

    def reduce(self, comm, weight: float, movers_weight: float = 0.0,
               report: Optional[Sequence[float]] = None) -> "ReduceOutcome":
        """Average in place (a collective: every rank calls it with its own masses).

        Args:
            comm: this rank's ``Comm``.
            weight: this rank's params mass (its realized work, ``gamma_mass``).
            movers_weight: this rank's buffers mass with ``buffers="movers"`` (the 0/1
                ``mover_mass``); ignored with ``buffers="work"``.
            report: numbers of this rank that ride in the params round (one host):
                every rank's come back as ``ReduceOutcome.reports``.
        """
        self._check_unchanged()
        sums = self._drift
        if sums is not None:
            self._drift_bytes[:] = self._drift_zeros
        # the rounds write through detached views (no autograd involved)
        together = self._together
        params_mass = comm.all_reduce_(self._live_all if together else self._live_params,
                                       weight=weight, scale=weight, kind=RoundKind.MODEL,
                                       outer=self.outer, report=report, drift=sums)
        accepted = comm.last_accepted()
        reports = None if report is None else comm.last_report_rows()
        buffers_mass = params_mass if together else 0.0
        if self._live_buffers and not together:
            bw = weight if self.buffer_mass == "work" else movers_weight
            buffers_mass = comm.all_reduce_(self._live_buffers, weight=bw, scale=bw,
                                            kind=RoundKind.MODEL)
        divergence = (0.0 if sums is None
                      else _divergence(self._drift_params.unpack_from(self._drift_bytes)))
        # (tuple.__new__: the NamedTuple's own __new__ is a Python frame, a tenth of
        # what a window adds to its round)
        return tuple.__new__(ReduceOutcome, (params_mass, buffers_mass, accepted, divergence,
                                             self._bytes_sent[comm.bf16_wire], reports))

    def _check_unchanged(self) -> None:
        """Before a round over the window's tensors: the model still holds them, on the
        storage whose addresses the rounds reuse (``GatheredTensors``); raises naming a
        tensor replaced, added or removed since the window was built."""
        for entries, key, held, ptr, _ in self._held:
            if entries.get(key) is not held or held.data_ptr() != ptr:
                self._check_held()
                break
        if _registrations[0] != self._registered:
            self._check_tree()

    def _check_held(self) -> None:
        """The per-sync check's slow path, when a tensor's entry or address changed: a
        tensor whose storage moved under both it and the window's view of it (e.g.
        ``model.share_memory()``) is still the window's (its address is updated, and
        gathered again), unless its storage no longer holds all its elements (freed or
        shrunk); a tensor the model no longer holds raises, naming it."""
        gone, now, freed = [], [], []
        for (entries, key, held, ptr, (what, name)), live in zip(self._held, self._live_all):
            address = held.data_ptr()
            if entries.get(key) is not held or (address != ptr and live.data_ptr() != address):
                gone.append(f"{what} {name!r}")
            elif address != ptr and not _storage_holds(live):
                freed.append(f"{what} {name!r}")
            now.append((entries, key, held, address, (what, name)))
        if freed:  # (the rounds would write through a freed or too short storage)
            raise RuntimeError(
                f"{_first_names(freed)} of the model no longer "
                f"{'has' if len(freed) == 1 else 'have'} storage for "
                f"all {'its' if len(freed) == 1 else 'their'} elements (freed or shrunk with "
                f"untyped_storage().resize_()): a sync writes the consensus into every "
                f"element. Give the storage its size back (resize_ it, then refill it) before "
                f"the sync")
        if not gone:
            self._held = tuple(now)
            n = len(self._live_params)  # (their addresses moved: gathered again)
            self._gather(list(self._live_all[:n]), list(self._live_all[n:]))
            return
        raise _model_changed(gone, "replaced")

    def _check_tree(self) -> None:
        """The slow check after a module, parameter or buffer was registered somewhere in
        the process: the model's named tensors must still be the window's, by name and
        identity (a submodule assigned in place of one, or added, is not)."""
        held = {name: t for _, _, t, _, (_, name) in self._held}
        now = ([("parameter", n, t) for n, t in self._model.named_parameters()]
               + [("buffer", n, t) for n, t in averaged_buffers(self._model)])
        replaced = [f"{what} {n!r}" for what, n, t in now if n in held and held[n] is not t]
        names = {n for _, n, _ in now}
        added = [f"{what} {n!r}" for what, n, _ in now if n not in held]
        removed = [f"{what} {name!r}" for _, _, _, _, (what, name) in self._held
                   if name not in names]
        if replaced or added or removed:
            raise _model_changed(replaced + added + removed, " or ".join(
                verb for verb, part in (("replaced", replaced), ("added", added),
                                        ("removed", removed)) if part))
        self._registered = _registrations[0]


#: moves whenever a module anywhere in the process registers a submodule, parameter or
#: buffer (torch's global registration hooks; ``_watch_registrations``)
_registrations = [0]
_watching = [False]


def _count_registration(module, name, value) -> None:
    _registrations[0] += 1  # returns None: the registration goes on unchanged


def _watch_registrations() -> None:
    """Install the registration counter, once per process."""
    if not _watching[0]:
        from torch.nn.modules import module as torch_module

        torch_module.register_module_module_registration_hook(_count_registration)
        torch_module.register_module_parameter_registration_hook(_count_registration)
        torch_module.register_module_buffer_registration_hook(_count_registration)
        _watching[0] = True


def _storage_holds(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every element of ``t`` (a storage resized with
    ``untyped_storage().resize_()`` may not: torch's own ops then crash too)."""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr() != 0 and (last + 1) * t.element_size() <= t.untyped_storage().nbytes()


def _first_names(names: list) -> str:
    """The first three of ``names``, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _model_changed(changed: list, how: str) -> RuntimeError:
    """The error for tensors of the model ``how`` (replaced, added, ...) since the
    window was built on it, naming the first three."""
    return RuntimeError(
        f"{_first_names(changed)} of the model {'was' if len(changed) == 1 else 'were'} {how} "
        f"after LocalSGD was built on it (model.to(dtype), .bfloat16(), `p.data = ...`, a new "
        f"nn.Parameter, buffer or submodule assigned): syncs average the tensors LocalSGD was "
        f"built on, and would leave the model's new ones out. Give the model its final "
        f"modules, dtype, device and tensors before building LocalSGD (for a Trainer: in "
        f"model_fn), and change values in place (with torch.no_grad(): p.copy_(...))")


def _held_entries(model: torch.nn.Module, what: str, named) -> list:
    """``(module's dict, key, tensor, storage address, (what, qualified name))`` of each
    named tensor of ``model``: what :meth:`ReplicaReduce._check_unchanged` checks."""
    out = []
    for name, t in named:
        owner, _, key = name.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        entries = module._parameters if what == "parameter" else module._buffers
        out.append((entries, key, t, t.data_ptr(), (what, name)))
    return out


class ReduceOutcome(NamedTuple):
    """What :meth:`ReplicaReduce.reduce` did on this rank.

    Attributes:
        params_mass: the params round's accepted mass (0: nothing realized, kept local).
        buffers_mass: the buffers' accepted mass (0 without floating-point buffers).
        accepted: ranks whose contribution the params round accepted (on a cluster:
            this host's only).
        divergence: ``||pre - post|| / ||post||`` of the parameters (0 unmeasured).
        bytes_sent: payload bytes this rank contributed.
        reports: with ``report=``, every rank's report in the params round, one
            tuple of ``REPORT_VALUES`` floats per local rank (``Comm.last_report_rows``);
            else None.
    """

    params_mass: float
    buffers_mass: float
    accepted: tuple[int, ...]
    divergence: float
    bytes_sent: int
    reports: Optional[tuple[tuple[float, ...], ...]] = None


def _divergence(sums: Sequence[float]) -> float:
    """``||pre - post|| / ||post||`` over all tensors (0 for a zero ``post``) from
    ``all_reduce_``'s per-tensor drift sums, flat (three per tensor: pre², post², diff²)."""
    post_sq = diff_sq = 0.0
    for i in range(0, len(sums), 3):
        post_sq += sums[i + 1]
        diff_sq += sums[i + 2]
    post_norm = math.sqrt(post_sq)
    return math.sqrt(diff_sq) / post_norm if post_norm > 0.0 else 0.0