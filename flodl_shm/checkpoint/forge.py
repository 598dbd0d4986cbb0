"""The consensus-checkpoint forge: a loadable ``.fdl`` from the reduce's frames,
written off the reduce thread (flodl 0.7.0 ``checkpoint_forge.rs``; docs/checkpoints.md).

The consensus is formed as name-less, ordered ``RoundFrame`` s: in one sync
cycle a params ``MODEL`` frame, then (when the model has floating-point
buffers) a buffers ``MODEL`` frame — or several frames each when the engine
splits a large model. No single frame is the whole model. The coordinator
**arms** the forge before the cycle it wants captured; the reduce hands every
``MODEL`` frame to :meth:`CheckpointForge.accumulate`, which gathers tensors
(params, then buffers) until it holds ``schema.tensor_count()`` of them, then
queues the write and returns at once.

Two properties matter:

- **Async**: the ``.fdl`` is serialized by a background writer thread; the
  reduce never waits on the disk.
- **Zero extra copy**: the frame's payloads are *moved* into the accumulator
  (the frame's tensor list is emptied, the payload buffers are kept, not
  copied), and the writer streams their raw bytes straight to the file. bf16
  payloads are upcast to f32 through a small fixed scratch buffer, so the
  writer never holds a second copy of the model.

**Positional keys.** The i-th parameter (``module.parameters()`` order) is
stored as ``p{i}``, the j-th *averaged* buffer (the floating-point
``named_buffers()``, see ``meta.averaged_buffers``) as ``b{j}``. A model's own
names repeat across a layer stack (flodl's bare ``weight`` / ``bias``), and a
by-name map keeps only the last of duplicates; positional keys are unique by
construction. ``ModelSchema.from_module``, the forge and
:func:`load_consensus_checkpoint` share this one definition, so a checkpoint
loads back into a model built by the same factory. Integer buffers (BatchNorm's
``num_batches_tracked``) are never averaged, so they are not in the consensus
checkpoint; they keep the values the resumed model was built with.

Consensus checkpoints are always f32 on disk (dtype tag 3) with an all-zero
structural hash, so resume never depends on the wire dtype the run used.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import numpy as np

from ..errors import CheckpointError, FrameError, plural
from ..frame import DTYPE_BF16, DTYPE_F32, RoundFrame, RoundKind, TensorPayload, dtype_name
from .fdl import FdlDtype, FdlWriter, LoadReport, _Target, load_targets, write_fdl_stream
from .meta import (CheckpointBundle, CheckpointMeta, ModelSchema, averaged_buffers,
                   consensus_buffer_key, consensus_param_key, names_sidecar_path,
                   set_extension)
from .tap_head import TapHead

if TYPE_CHECKING:  # (the controller writes checkpoints without importing torch)
    import torch

logger = logging.getLogger("flodl_shm")

#: Name of the background writer thread.
WRITER_THREAD_NAME = "flodl-ckpt-writer"
#: Elements per bf16 -> f32 upcast chunk (4 MiB of f32 scratch).
_UPCAST_CHUNK_ELEMS = 1 << 20


def outer_sidecar_path(model_path: "str | os.PathLike[str]") -> Path:
    """The outer-momentum sidecar of a consensus model path.

    ``x.fdl`` -> ``x.outer.fdl``; ``x.fdl.gz`` -> ``x.outer.fdl.gz`` (the sidecar
    is compressed like the model); any other name gets its extension replaced
    by ``outer.fdl`` (``x`` -> ``x.outer.fdl``).
    """
    p = Path(os.fspath(model_path))
    if p.name.endswith(".fdl.gz") and len(p.name) > len(".fdl.gz"):
        return p.with_name(p.name[: -len(".fdl.gz")] + ".outer.fdl.gz")
    return set_extension(p, "outer.fdl")


# --- writing ----------------------------------------------------------------------


def _payload_f32_chunks(p: TensorPayload, index: int, scratch: np.ndarray) -> Iterator[memoryview]:
    """The payload's values as f32 bytes: an f32 payload's own buffer (no copy), or
    a bf16 payload upcast exactly, chunk by chunk, through ``scratch``."""
    if p.dtype == DTYPE_F32:
        yield p.data
        return
    from .. import kernels

    bits = p.as_array(index)
    for start in range(0, bits.shape[0], scratch.shape[0]):
        part = bits[start:start + scratch.shape[0]]
        out = scratch[: part.shape[0]]
        kernels.bf16_to_f32(part, out)
        yield memoryview(out).cast("B")


def _check_payload(p: TensorPayload, index: int, what: str) -> None:
    if p.dtype not in (DTYPE_F32, DTYPE_BF16):
        raise CheckpointError(
            f"{what} payload[{index}] has wire dtype {dtype_name(p.dtype)} (tag {p.dtype}); "
            f"only f32 and bf16 payloads can be checkpointed"
        )
    try:
        p.check(index)
    except FrameError as e:
        raise CheckpointError(f"{what}: {e}") from None


def write_consensus_fdl(schema: ModelSchema, payloads: Sequence[TensorPayload],
                        path: "str | os.PathLike[str]") -> int:
    """Commit the consensus ``payloads`` (params then averaged buffers) to ``path``.

    Keys are positional (``p{i}`` for the first ``len(schema.param_names)``,
    ``b{j}`` after); every entry is f32 (bf16 upcast exactly, f32 written from
    the payload's own bytes); the structural hash is zero; gzip when ``path``
    ends in ``.gz``; temp + fsync + atomic rename. ``CheckpointError`` (with
    "schema/accumulation mismatch") when the payload count is not the schema's.
    Returns the uncompressed size.
    """
    if len(payloads) != schema.tensor_count():
        raise CheckpointError(
            f"checkpoint_forge: accumulated {len(payloads)} tensors but schema expects "
            f"{schema.tensor_count()} ({len(schema.param_names)} params + "
            f"{len(schema.buffer_names)} buffers) - schema/accumulation mismatch; {path} "
            f"not written"
        )
    for i, p in enumerate(payloads):
        _check_payload(p, i, "consensus")
    n_params = len(schema.param_names)
    keys = [consensus_param_key(i) if i < n_params else consensus_buffer_key(i - n_params)
            for i in range(len(payloads))]
    need_scratch = any(p.dtype == DTYPE_BF16 for p in payloads)
    scratch = np.empty(_UPCAST_CHUNK_ELEMS if need_scratch else 0, np.float32)

    def body(w: FdlWriter) -> None:
        for i, (key, p) in enumerate(zip(keys, payloads)):
            w.write_entry_chunks(key, p.shape, FdlDtype.F32, p.numel * 4,
                                 _payload_f32_chunks(p, i, scratch))

    return write_fdl_stream(path, len(payloads), body, None)


def write_outer_momentum_fdl(payloads: Sequence[TensorPayload],
                             path: "str | os.PathLike[str]") -> int:
    """Commit outer-optimizer momentum (one f32 payload per parameter, keys ``p{i}``)
    to ``path`` atomically. A non-f32 payload is a ``CheckpointError`` (momentum
    is kept in f32; "v1 f32 only")."""
    for i, p in enumerate(payloads):
        if p.dtype != DTYPE_F32:
            raise CheckpointError(
                f"checkpoint_forge: outer payload[{i}] dtype {dtype_name(p.dtype)} (tag "
                f"{p.dtype}) not supported (v1 f32 only); stash the momentum as f32 payloads"
            )
        _check_payload(p, i, "outer momentum")

    def body(w: FdlWriter) -> None:
        for i, p in enumerate(payloads):
            w.write_entry(consensus_param_key(i), p.shape, FdlDtype.F32, p.data)

    return write_fdl_stream(path, len(payloads), body, None)


@dataclass
class _WriteJob:
    schema: ModelSchema
    payloads: list
    path: Path
    outer: Optional[list]
    on_complete: Optional[Callable[[Path], None]]


# --- the forge ----------------------------------------------------------------------


class CheckpointForge:
    """Arms, accumulates and writes consensus checkpoints off the reduce thread.

    Shared between the coordinator (``arm``, ``stash_outer_momentum``,
    ``flush``) and the reduce (``accumulate``); every method is thread-safe.

    Writes run on one background thread (``flodl-ckpt-writer``) that exists only
    while writes are pending and is *not* a daemon: a process that exits
    normally waits for an in-flight checkpoint instead of leaving it behind as
    a stale ``.tmp``. Writes run in the order their cycles completed. Writer
    errors are logged on ``logging.getLogger("flodl_shm")`` and never raised
    into the reduce; :attr:`writes_failed` counts them.

    Args:
        schema: the model's ``ModelSchema`` (params + averaged buffers), or
            ``None`` when none could be captured: then no model is ever
            written (``can_write_model()`` is False) and the caller falls back
            to a meta-only checkpoint.
    """

    def __init__(self, schema: Optional[ModelSchema]) -> None:
        if schema is not None and not isinstance(schema, ModelSchema):
            raise TypeError(f"CheckpointForge takes a ModelSchema or None, got "
                            f"{type(schema).__name__} {schema!r:.60}; build one with "
                            f"ModelSchema.from_module(model)")
        self._schema = schema
        self._lock = threading.Lock()
        # accumulation state (under _lock)
        self._pending_path: Optional[Path] = None
        self._on_complete: Optional[Callable[[Path], None]] = None
        self._accumulated: list[TensorPayload] = []
        self._pending_outer: Optional[list[TensorPayload]] = None
        # writer state (under _writer_cond)
        self._writer_cond = threading.Condition(threading.Lock())
        self._jobs: collections.deque[_WriteJob] = collections.deque()
        self._outstanding = 0  # queued + running
        self._lag_said = False  # the writes fell behind since the queue last drained
        self._worker: Optional[threading.Thread] = None
        #: Checkpoints committed / failed since construction.
        self.writes_completed = 0
        self.writes_failed = 0
        #: Path of the last model committed, or None.
        self.last_written: Optional[Path] = None

    @property
    def schema(self) -> Optional[ModelSchema]:
        return self._schema

    def can_write_model(self) -> bool:
        """Whether a model write is possible at all (a schema was captured)."""
        return self._schema is not None

    def arm(self, path: "str | os.PathLike[str]",
            on_complete: Optional[Callable[[Path], None]] = None) -> None:
        """Arm a consensus save to ``path`` (``<stem>.fdl`` or ``<stem>.fdl.gz``) for the
        next cycle.

        Clears any partial accumulation and outer stash: a new checkpoint
        supersedes a missed one, and a stale partial frame never bleeds into the
        next cycle's model. ``on_complete(path)`` runs on the writer thread after
        the model (and its outer sidecar) is committed — the place to write the
        bundle's ``.meta.json`` commit marker; its exceptions are logged.
        """
        with self._lock:
            self._reset_cycle(Path(os.fspath(path)), on_complete)

    def is_armed(self) -> bool:
        """Whether a checkpoint path is pending (so the caller knows to snapshot the
        outer momentum this window)."""
        with self._lock:
            return self._pending_path is not None

    def disarm(self) -> None:
        """Drop the armed path, the partial accumulation and the outer stash."""
        with self._lock:
            self._reset_cycle(None, None)

    def _reset_cycle(self, path: Optional[Path], on_complete) -> None:
        """Start a cycle toward ``path`` (``None``: disarmed) with nothing gathered. Holds _lock."""
        self._pending_path = path
        self._on_complete = on_complete
        self._accumulated = []
        self._pending_outer = None

    def pending_tensor_count(self) -> int:
        """Tensors gathered toward the armed checkpoint so far."""
        with self._lock:
            return len(self._accumulated)

    def stash_outer_momentum(self, payloads: Sequence[TensorPayload]) -> None:
        """Stash this cycle's outer-optimizer momentum (one f32 payload per parameter).

        Written to the model's outer sidecar (``x.outer.fdl``) after the model
        when the cycle completes. Call only for stateful outer optimizers:
        without a stash no sidecar is written. The payloads are moved (kept, not
        copied): don't mutate their buffers afterwards.
        """
        with self._lock:
            self._pending_outer = list(payloads)

    def accumulate(self, frame: RoundFrame, *, copy: bool = False) -> None:
        """Fold one ``MODEL`` consensus frame into the armed cycle; never blocks on I/O.

        The frame's payloads are **moved** in: ``frame.tensors`` is emptied and
        the forge keeps the payload objects; their buffers must not be reused by
        the caller afterwards. Pass ``copy=True`` when they alias reusable memory
        (a shared-memory slot the next round overwrites): the bytes are copied
        once, here.

        No-op when no schema was captured or nothing is armed. A frame of weight
        0 (no accepted mass: nothing was realized) is never written: the partial
        accumulation is dropped and the forge stays armed for the next cycle. A
        ``CONTROL`` frame is ignored (logged). When the gathered count reaches
        ``schema.tensor_count()`` the write is queued for the writer thread; an
        overshoot (more tensors than the schema — a wiring bug) is logged and
        the cycle is skipped rather than written misaligned.
        """
        schema = self._schema
        if schema is None:
            return
        if frame.kind != RoundKind.MODEL:
            logger.warning("checkpoint writer: ignoring a %s frame (only MODEL frames carry "
                           "the consensus)", RoundKind(frame.kind).name)
            return
        want = schema.tensor_count()
        with self._lock:
            if self._pending_path is None:
                return  # not armed: this cycle's frame is not captured
            if frame.weight == 0.0:
                if self._accumulated:
                    logger.info("checkpoint writer: zero-mass frame; dropping %d partial tensors, "
                                "still armed for %s", len(self._accumulated), self._pending_path)
                self._accumulated = []
                return
            payloads = frame.tensors
            frame.tensors = []
            if copy:
                payloads = [TensorPayload(p.dtype, p.shape, bytearray(p.data)) for p in payloads]
            self._accumulated.extend(payloads)
            if len(self._accumulated) < want:
                return  # more model frames to come this cycle
            path, on_complete = self._pending_path, self._on_complete
            gathered, outer = self._accumulated, self._pending_outer
            self._reset_cycle(None, None)
        if len(gathered) != want:
            logger.error(
                "checkpoint writer: consensus checkpoint accumulated %d tensors but schema "
                "expects %d (%d params + %d buffers); .fdl skipped for %s",
                len(gathered), want, len(schema.param_names), len(schema.buffer_names), path)
            return
        if outer is not None and len(outer) != len(schema.param_names):
            logger.error(
                "checkpoint writer: outer momentum has %d tensors but schema expects %d params; "
                "%s skipped (the model is still written)",
                len(outer), len(schema.param_names), outer_sidecar_path(path))
            outer = None
        self._submit(_WriteJob(schema, gathered, path, outer, on_complete))

    # --- the writer thread --------------------------------------------------------

    def _submit(self, job: _WriteJob) -> None:
        with self._writer_cond:
            if self._outstanding >= 2:
                # one write queued behind the one in flight is the writer keeping up (a
                # small model checkpointed every window does that on any disk); a longer
                # queue is said once per spell (until it drains), not at every checkpoint
                logger.log(logging.DEBUG if self._lag_said else logging.WARNING,
                           "checkpoint writer: %s still in flight; %s "
                           "queued behind them (the checkpoint cadence outpaces the disk; "
                           "said once until the writes catch up)",
                           plural(self._outstanding, "checkpoint write"), job.path)
                self._lag_said = True
            self._jobs.append(job)
            self._outstanding += 1
            if self._worker is not None:
                return
            worker = threading.Thread(target=self._drain, name=WRITER_THREAD_NAME, daemon=False)
            self._worker = worker
            try:
                worker.start()
                return
            except RuntimeError as e:  # interpreter shutting down / no threads left
                self._worker = None
                self._jobs.remove(job)
                start_error = e
        logger.warning("checkpoint writer: cannot start the writer thread (%s); writing %s on "
                       "the caller's thread", start_error, job.path)
        try:
            self._run_job(job)
        finally:
            with self._writer_cond:
                self._outstanding -= 1
                self._writer_cond.notify_all()

    def _drain(self) -> None:
        while True:
            with self._writer_cond:
                if not self._jobs:
                    self._worker = None
                    self._lag_said = False  # caught up: a later lag is news again
                    self._writer_cond.notify_all()
                    return
                job = self._jobs.popleft()
            try:
                self._run_job(job)
            except BaseException:  # never let the worker die with jobs queued
                logger.exception("checkpoint writer crashed on %s", job.path)
            finally:
                with self._writer_cond:
                    self._outstanding -= 1
                    self._writer_cond.notify_all()

    def _run_job(self, job: _WriteJob) -> None:
        try:
            # the bundle's folder may not exist where this forge runs: a controller on a
            # machine of its own writes its copy under the path the ranks named
            Path(job.path).parent.mkdir(parents=True, exist_ok=True)
            # the names first: a present .fdl implies its .names.json (for converters)
            job.schema.write_to_file(names_sidecar_path(job.path))
            write_consensus_fdl(job.schema, job.payloads, job.path)
        except Exception as e:
            self.writes_failed += 1
            logger.error("checkpoint writer: consensus checkpoint write to %s failed: %s",
                         job.path, e)
            return
        finally:
            job.payloads = []  # release the model's bytes as soon as they are on disk
        if job.outer is not None:
            # Written after the model: a present sidecar implies a present model.
            outer_path = outer_sidecar_path(job.path)
            try:
                write_outer_momentum_fdl(job.outer, outer_path)
            except Exception as e:
                self.writes_failed += 1
                logger.error("checkpoint writer: outer-momentum checkpoint write to %s failed: %s",
                             outer_path, e)
                return
            finally:
                job.outer = None
        self.writes_completed += 1
        self.last_written = job.path
        logger.info("wrote consensus checkpoint %s", job.path)
        if job.on_complete is not None:
            try:
                job.on_complete(job.path)
            except Exception:
                logger.exception("checkpoint writer: on_complete callback for %s failed",
                                 job.path)

    def pending_writes(self) -> int:
        """Writes queued or running."""
        with self._writer_cond:
            return self._outstanding

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write has finished (committed or failed).

        Returns True when the writer is idle, False if ``timeout`` seconds passed
        first. Does not wait for a cycle that is armed but not yet complete.
        """
        with self._writer_cond:
            return self._writer_cond.wait_for(
                lambda: self._outstanding == 0 and self._worker is None, timeout)

    def close(self, timeout: Optional[float] = None) -> bool:
        """Disarm, then :meth:`flush` (returns its result). The forge stays usable."""
        self.disarm()
        return self.flush(timeout)

    def __enter__(self) -> "CheckpointForge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- loading ----------------------------------------------------------------------


def arm_from_head(forge: Optional[CheckpointForge], head: TapHead) -> CheckpointForge:
    """Arm a forge for the checkpoint cycle ``head`` describes; returns the forge to keep.

    The one place a tap reader (the single-host tap server, the cluster controller)
    turns an arm into forge state: a forge whose schema differs from the head's names
    (or none yet) is flushed and replaced by one for the head's ``ModelSchema``; the
    forge is armed toward ``head.path`` and, once the model (and its outer sidecar) is
    committed, writes ``head.meta`` as the bundle's ``.meta.json`` commit marker.

    Args:
        forge: the reader's current forge, or None.
        head: the arm (``TapHead``; its frame fields are not used).
    """
    schema = ModelSchema(list(head.param_names), list(head.buffer_names), dict(head.tied),
                         list(head.non_persistent))
    if forge is None or forge.schema != schema:
        if forge is not None:
            forge.flush(60)
        forge = CheckpointForge(schema)
    meta = head.meta

    def write_meta(model_path: Path, meta=meta) -> None:
        if meta is not None:
            CheckpointMeta.from_dict(meta).write_to_file(CheckpointBundle.meta_path(model_path))

    forge.arm(head.path, on_complete=write_meta)
    return forge


def consensus_targets(model) -> list[_Target]:
    """The positional load slots of ``model``: ``p{i}`` per parameter, ``b{j}`` per
    averaged (floating-point) buffer, labelled with the qualified names."""
    targets = [_Target(consensus_param_key(i), p, "parameter", n)
               for i, (n, p) in enumerate(model.named_parameters())]
    targets += [_Target(consensus_buffer_key(j), b, "buffer", n)
                for j, (n, b) in enumerate(averaged_buffers(model))]
    return targets


def load_consensus_checkpoint(model: "torch.nn.Module", path: "str | os.PathLike[str]"
                              ) -> LoadReport:
    """Load a consensus checkpoint into ``model``, positionally.

    ``p{i}`` goes to the i-th of ``model.parameters()``, ``b{j}`` to the j-th
    floating-point buffer of ``model.named_buffers()`` — the order
    ``ModelSchema.from_module`` records and the forge writes — so the model
    must come from the same factory as the one that trained. Values are copied
    in place (cast to each tensor's dtype, kept on its device). A shape mismatch
    raises ``CheckpointError`` before anything is modified; no structural hash
    is checked. Integer buffers are not in the checkpoint and are left as they
    are. Returns a ``LoadReport`` of positional keys. A file none of whose keys is
    positional (a state_dict saved as ``.fdl``, qualified names) loads nothing: that
    raises ``CheckpointError`` (an empty report read as a load).
    """
    report = load_targets(path, consensus_targets(model))
    if report.unexpected and not report.loaded and not any(
            re.fullmatch(r"[pb]\d+", k) for k in report.unexpected):
        raise CheckpointError(
            f"{os.fspath(path)} holds none of a consensus checkpoint's keys (p0, p1, ..., "
            f"b0, ...): its tensors are named {report.unexpected[:3]}"
            f"{' ...' if len(report.unexpected) > 3 else ''}, as a state_dict's (a "
            f"save_module file); load it by name with flodl_shm.checkpoint.fdl.load_module"
            f"(model, path)")
    return report


def load_outer_momentum(model: "torch.nn.Module", outer_path: "str | os.PathLike[str]"
                        ) -> "list[torch.Tensor]":
    """Load an outer-momentum sidecar (the ``.outer.fdl`` file itself) as one tensor per
    parameter, in ``model.parameters()`` order.

    Each tensor is shaped, typed and placed like its parameter. Raises
    ``CheckpointError`` when the file does not hold exactly one matching
    ``p{i}`` entry per parameter (a sidecar from another model).
    """
    torch = __import__("torch")
    params = list(model.parameters())
    targets = [_Target(consensus_param_key(i), torch.zeros_like(p, requires_grad=False),
                       "outer momentum", f"parameter {i}")
               for i, p in enumerate(params)]
    report = load_targets(outer_path, targets)
    if report.missing or report.unexpected:
        raise CheckpointError(
            f"outer momentum {os.fspath(outer_path)} does not match the model's "
            f"{len(params)} parameters: missing {report.missing}, unexpected "
            f"{report.unexpected}; load the sidecar written with this model's consensus"
        )
    return [t.tensor for t in targets]


__all__ = [
    "CheckpointForge",
    "WRITER_THREAD_NAME",
    "consensus_buffer_key",
    "consensus_param_key",
    "consensus_targets",
    "load_consensus_checkpoint",
    "load_outer_momentum",
    "outer_sidecar_path",
    "write_consensus_fdl",
    "write_outer_momentum_fdl",
]
