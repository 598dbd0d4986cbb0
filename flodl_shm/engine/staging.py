"""Decode staging: slot-tagged reusable f32 buffers for consensus replies, and the
RAM gate that decides whether a rank can afford them (flodl 0.7.0; docs/host_ram.md, "The checks").

Why: a rank that decodes every consensus into fresh pageable memory pays a
model-sized allocation per window, and on a CUDA rank the following
``copy_(non_blocking=True)`` silently degrades to a synchronous bounce copy. Two
properties matter: the buffers are **reused** for the whole run and, in a rank
that uses CUDA, **page-locked**, so the host-to-device copy is truly asynchronous.

"Uses CUDA" means the rank has initialized it (``torch.cuda.is_initialized()``):
page-locking memory creates a CUDA context (0.4 s for the first page-locked tensor
on an H200 host, and memory on the host and the GPU, per process), and only a
host-to-device copy repays it. A rank that trains on the CPU - every LocalSGD and
Trainer rank, even on a GPU host - gets plain reusable memory and never touches the
GPU.

Contract (what ``Comm`` implements on top of this module):

- ``set_pinned_decode(True)`` enables the mode; ``arm_pinned_decode(slot)`` arms
  the NEXT MODEL reply, one shot. The armed reply decodes into that slot's f32
  staging — a bf16 payload is upcast straight into it, with no intermediate f32
  buffer — and the returned tensors alias the staging.
- **Slots are caller-tagged** (``DECODE_SLOT_PARAMS``, ``DECODE_SLOT_BUFFERS``),
  never looked up from the schema: a BatchNorm-style model's buffers frame can
  have exactly the params frame's shape list, and a schema-keyed cache would
  deliver buffer values as params.
- **Single consumer.** A slot's staging is overwritten by the next armed decode
  into that slot: finish with round N's tensors (including any in-flight
  host-to-device copy) before the next armed round of the same slot.
- Staging is allocated from the reply's size on the first armed use of a slot
  and re-allocated only when that size changes.

The gate, ``pinned_decode_affordable``, budgets the whole host (every local rank
reads ``MemAvailable`` at about the same time during formation, so per-rank reads
race) at six model copies per rank: the locked decode staging; the pinned
snapshot staging, the pre-sync divergence scratch and the streamed wire
transient (locked pages are unswappable, so these three, re-touched every
window, must not be evicted); and 2× for runtime overhead (CUDA host context,
allocator arenas, data staging). Calibrated on the rig: two 190M-parameter ranks
(727 MiB f32 staging each) on a 9.4 GB VM reading ~7.3 GB available at rank
start swapped 2 GB and lost 6–8 % epoch wall ungated; factor 6 needs 8.5 GB and
refuses, a first-cut factor 4 passed and reproduced the regression.
"""
from __future__ import annotations

import logging
import math
import operator
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .hostmem import HostMemory, host_memory
from .segment import fmt_bytes

if TYPE_CHECKING:  # torch is imported where a tensor is made, so the gate and the
    import torch   # host-RAM tool stay cheap to import

logger = logging.getLogger("flodl_shm")

DECODE_SLOT_PARAMS = 0
"""Staging slot for the parameters frame."""
DECODE_SLOT_BUFFERS = 1
"""Staging slot for the (floating-point) buffers frame; never shares the params staging."""

GATE_FACTOR = 6
"""Model-sized copies budgeted per local rank (see the module doc)."""

U64_MAX = (1 << 64) - 1

_pin_warned = False
_pin_lock = threading.Lock()


def pinned_decode_affordable(staging_bytes: int, local_ranks: int, available_bytes: float) -> bool:
    """The RAM gate: may each rank of this host hold pinned decode staging?

    ``need = staging_bytes × max(local_ranks, 1) × 6`` (saturating at 2^64 − 1, as
    the u64 arithmetic of flodl does); returns ``available_bytes > need``
    (strictly greater).

    Args:
        staging_bytes: the f32 model wire size, Σ numel × 4 (staging is f32 whatever
            the wire dtype).
        local_ranks: ranks sharing this host; 0 behaves exactly like 1 (a zero need
            would enable staging everywhere).
        available_bytes: ``MemAvailable`` (container-bounded, see ``host_memory``)
            as read at rank start, before the run's own working set is allocated.

    Raises:
        TypeError: ``staging_bytes`` or ``local_ranks`` is not an integer.
        ValueError: any argument is negative (or ``available_bytes`` is NaN).
    """
    return available_bytes > _gate_need(staging_bytes, local_ranks, available_bytes)


def gate_need_bytes(staging_bytes: int, local_ranks: int) -> int:
    """The gate's need: ``staging_bytes × max(local_ranks, 1) × 6``, saturating."""
    return _gate_need(staging_bytes, local_ranks, 0)


def _gate_need(staging_bytes, local_ranks, available_bytes) -> int:
    staging = operator.index(staging_bytes)
    ranks = operator.index(local_ranks)
    if staging < 0:
        raise ValueError(f"staging_bytes={staging} must be >= 0 (the f32 model size, "
                         f"Σ numel × 4)")
    if ranks < 0:
        raise ValueError(f"local_ranks={ranks} must be >= 0 (ranks sharing this host)")
    if (isinstance(available_bytes, float) and math.isnan(available_bytes)) or available_bytes < 0:
        raise ValueError(f"available_bytes={available_bytes} must be a byte count >= 0 "
                         f"(MemAvailable at rank start)")
    return min(staging * max(ranks, 1) * GATE_FACTOR, U64_MAX)


@dataclass(frozen=True)
class StagingDecision:
    """Whether a rank decodes armed replies into reusable staging, and why.

    Attributes:
        enabled: the gate passed; armed replies use slot staging.
        pinned: staging would be page-locked (the rank uses CUDA); else pageable.
        staging_bytes: f32 size of one slot's staging (Σ numel × 4).
        local_ranks: ranks on this host the gate budgeted for.
        need_bytes: the gate's need (``staging_bytes × max(local_ranks, 1) × 6``).
        available_bytes: the figure the need was compared with.
        available_source: where ``available_bytes`` came from.
        reason: one line saying which way the gate went and the numbers behind it
            (what the rank logs at INFO).
    """

    enabled: bool
    pinned: bool
    staging_bytes: int
    local_ranks: int
    need_bytes: int
    available_bytes: int
    available_source: str
    reason: str


def decide_pinned_decode(staging_bytes: int, local_ranks: int,
                         snapshot: HostMemory | None = None, *,
                         available_bytes: int | None = None, cuda: bool | None = None,
                         log: bool = True, moment: str = "at rank start") -> StagingDecision:
    """Apply the gate for this host and say why (logged at INFO unless ``log=False``).

    Args:
        staging_bytes: f32 staging size of the model frame (Σ numel × 4).
        local_ranks: ranks on this host (``Comm.local_world_size``).
        snapshot: the ``host_memory()`` read at rank start; read now when omitted.
        available_bytes: use this figure instead of ``snapshot.available``.
        cuda: whether staging would be page-locked; default: whether this
            process has initialized CUDA (``torch.cuda.is_initialized()``).
        log: log the decision (one INFO line on ``flodl_shm``).
        moment: when the available figure was read, for the reason text.
    """
    if available_bytes is None:
        if snapshot is None:
            snapshot = host_memory()
        avail = int(snapshot.available)
        src = snapshot.sources.get("available", "MemAvailable")
    else:
        avail = int(available_bytes)
        src = "given"
    pinned = _cuda_in_use() if cuda is None else bool(cuda)
    need = gate_need_bytes(staging_bytes, local_ranks)
    enabled = pinned_decode_affordable(staging_bytes, local_ranks, avail)
    ranks = max(int(local_ranks), 1)
    formula = (f"{fmt_bytes(staging_bytes)} f32 staging × {ranks} local rank"
               f"{'s' if ranks != 1 else ''} × {GATE_FACTOR} = {fmt_bytes(need)}")
    have = f"{fmt_bytes(avail)} available {moment} ({src})"
    # "pinned" only where staging would be page-locked: a CPU host's is plain memory
    what = "pinned decode staging" if pinned else "decode staging"
    if enabled:
        kind = ("page-locked, for an asynchronous copy to the GPU" if pinned
                else "plain memory: this process uses no CUDA")
        reason = (f"{what} ON: {have} > need {formula}; each rank receives the consensus "
                  f"into float32 buffers it keeps for the run ({kind})")
    else:
        reason = (f"{what} OFF: {have} <= need {formula}; each rank receives each "
                  f"consensus into new memory (the same values, an allocation per round). "
                  f"To enable it the host (or container memory limit) needs more than "
                  f"{fmt_bytes(need)} available, or run fewer local ranks")
    if log:
        logger.info("%s", reason)
    return StagingDecision(enabled, pinned, int(staging_bytes), int(local_ranks), need, avail,
                           src, reason)


def check_slot(slot: int) -> int:
    """A valid slot tag (an int >= 0, e.g. ``DECODE_SLOT_PARAMS``), as an int.

    Raises:
        TypeError / ValueError: naming the bad slot and the valid constants.
    """
    try:
        s = operator.index(slot)
    except TypeError:
        raise TypeError(f"decode slot {slot!r} must be an int such as DECODE_SLOT_PARAMS (0) "
                        f"or DECODE_SLOT_BUFFERS (1)") from None
    if s < 0:
        raise ValueError(f"decode slot {s} must be >= 0; use DECODE_SLOT_PARAMS (0) or "
                         f"DECODE_SLOT_BUFFERS (1)")
    return s


def _cuda_in_use() -> bool:
    """Whether this process has initialized CUDA: asking never initializes it (where
    ``torch.cuda.is_available()`` would start the driver)."""
    import torch

    return torch.cuda.is_initialized()


def alloc_staging(nelem: int, *, pin: bool | None = None) -> "torch.Tensor":
    """A flat f32 CPU buffer of ``nelem`` elements for decode staging.

    Page-locked when ``pin`` (default: this process has initialized CUDA), so a later
    ``.to(device, non_blocking=True)`` is truly asynchronous; plain memory
    otherwise. If page-locking fails (memlock limits, no driver) the buffer is
    pageable and a WARNING says so once per process.
    """
    global _pin_warned
    import torch

    n = operator.index(nelem)
    if n < 0:
        raise ValueError(f"staging size {n} elements must be >= 0")
    if pin is None:
        pin = _cuda_in_use()
    if pin:
        try:
            return torch.empty(n, dtype=torch.float32, pin_memory=True)
        except RuntimeError as e:
            with _pin_lock:
                first = not _pin_warned
                _pin_warned = True
            if first:
                logger.warning("pinned decode staging: page-locking %s failed (%s); using "
                               "reusable pageable memory (host-to-device copies from it are "
                               "synchronous). Raise the memlock limit (ulimit -l / docker "
                               "--ulimit memlock=-1) to pin", fmt_bytes(n * 4),
                               str(e).splitlines()[0] if str(e) else type(e).__name__)
    return torch.empty(n, dtype=torch.float32)


class DecodeStaging:
    """The staging buffers of one rank: one flat f32 tensor per slot.

    ``buffer(slot, nelem)`` returns that slot's buffer, allocating it on first use
    and re-allocating it when ``nelem`` changes; slots never share memory.
    ``clear()`` drops every buffer (tensors already handed out keep theirs alive).
    Not thread-safe: one rank, one caller.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        self._pin = pin
        self._slots: dict[int, "torch.Tensor"] = {}

    def buffer(self, slot: int, nelem: int) -> "torch.Tensor":
        """Slot ``slot``'s flat f32 buffer of exactly ``nelem`` elements."""
        s = check_slot(slot)
        flat = self._slots.get(s)
        if flat is None or flat.numel() != nelem:
            if flat is not None:
                logger.debug("decode staging slot %d: %d -> %d elements (schema changed)",
                             s, flat.numel(), nelem)
            flat = alloc_staging(nelem, pin=self._pin)
            self._slots[s] = flat
        return flat

    def nbytes(self) -> int:
        """Bytes held across all slots."""
        return sum(t.numel() * 4 for t in self._slots.values())

    def slots(self) -> list[int]:
        """Slots that hold a buffer, sorted."""
        return sorted(self._slots)

    def clear(self) -> None:
        self._slots.clear()

    def __len__(self) -> int:
        return len(self._slots)

    def __repr__(self) -> str:
        return f"DecodeStaging(slots={self.slots()}, {fmt_bytes(self.nbytes())})"
