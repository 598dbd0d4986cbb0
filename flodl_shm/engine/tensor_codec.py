"""The torch <-> wire codec of ``Comm``: tensors into a round's wire slot, consensus out.

A round's contribution is a flat array in the wire dtype (float32, or bf16 bits as
uint16) laid out by ``protocol.frame_layout``; this module is the only place that
turns torch tensors into that layout and back:

- **encode**: a float32/bfloat16 tensor, times ``scale`` (fused, bit-identical to
  encoding ``t.mul(scale)``), into its slot. Small contiguous CPU tensors go by
  address in compiled code (no torch->numpy conversion); large ones through numpy,
  whose memcpy uses non-temporal stores;
- **gather**: the addresses of a whole frame of small tensors, for the fused round
  (``RoundEngine.eager_round`` encodes them in the same compiled call);
- **decode**: a consensus into float32 result memory the caller keeps (or into an
  armed staging slot: see ``staging.py``), returned as one tensor view per shape, or
  in place into existing tensors.

Result memory comes from a ``ResultPool``: a result buffer is handed out again only
once nothing of the previous result is alive any more (no tensor, view, storage,
numpy array or memoryview of it), so a returned tensor never aliases memory a later
round overwrites, and a loop that drops its results reuses warm memory instead of
paying a fresh allocation's page faults every call.
"""
from __future__ import annotations

import errno
import mmap
import sys
from typing import Sequence

import numpy as np
import torch

from ..errors import FrameError
from ..frame import DTYPE_BF16, DTYPE_F32, RoundKind, check_tensor_dtype, tensor_array
from ..kernels import codec as K
from ..kernels import reduce as RK
from .segment import map_error
from ..kernels import tensorio as TIO
from .hostmem import HostMemory, host_memory
from .protocol import RoundPlan
from .staging import DecodeStaging, StagingDecision, decide_pinned_decode

F32 = torch.float32
BF16 = torch.bfloat16
# Below this many bytes a tensor is copied by address in compiled code (no
# torch->numpy conversion, ~3 µs saved per tensor); above it through numpy, whose
# memcpy uses non-temporal stores for large buffers.
BY_ADDRESS_MAX = 256 << 10
# Result buffers from this size up are pooled (``ResultPool``): glibc serves larger
# allocations from fresh mmaps, whose first touch page-faults every 4 KiB.
POOL_MIN_BYTES = 128 << 10
_SCRATCH = 4096
NO_DRIFT = np.zeros((0, 3))  # decode_scatter's "no drift sums"
_HUGE_PAGE = 2 << 20


def _refcount_at(bucket: list, i: int) -> int:
    """``sys.getrefcount`` of ``bucket[i]`` (the same call site for the calibration
    below and every check, so the interpreter's own temporaries count alike)."""
    return sys.getrefcount(bucket[i])


#: the count of an array referenced by nothing but its pool bucket
_FREE_REFS = _refcount_at([np.empty(1, np.float32)], 0)


def fresh_array(nelem: int, dtype, huge: bool | None = None) -> np.ndarray:
    """A flat array of ``nelem`` elements of ``dtype`` (contents zero) in a private
    anonymous mapping of its own, advised (before any page is touched) onto transparent
    huge pages (``huge`` True: ``MADV_HUGEPAGE``), off them (False: ``MADV_NOHUGEPAGE``),
    or by default onto them from 2 MiB up. The mapping is freed with the array.

    Why the result pool does not use ``np.empty``: a large numpy allocation is a
    malloc'd mapping that numpy advises onto huge pages itself, and as the destination
    of a cross-memory copy (``process_vm_readv`` / ``_writev``, the direct rounds'
    reads and writes) it measured 2-3x slower than a mapping of its own, whatever the
    source's pages (64 MiB read from a 4 KiB-page tensor: 55 ms into ``np.empty``,
    16 ms into this, 17 ms into a 4 KiB mapping)."""
    nbytes = nelem * np.dtype(dtype).itemsize
    try:
        mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise map_error("a collective's result buffer", nbytes) from e
        raise
    if huge is None:
        huge = True if nbytes >= _HUGE_PAGE else None
    if huge is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mm, dtype, count=nelem)  # keeps the mapping alive


class ResultPool:
    """Reusable result buffers (flat numpy arrays) of the tensor-returning collectives.

    A buffer is handed out as the memory of a result (``torch.from_numpy``, or a
    memoryview of a reply frame); torch's storage, every view of it, ``.numpy()`` of it
    and every memoryview keep a reference to the array. ``take`` reuses a buffer only
    when its reference count is back to the pool's own (CPython refcounting: nothing
    of the earlier result can read it any more), else allocates a fresh one. Bounded:
    at most ``per_key`` buffers for each (element count, dtype), for the ``max_keys``
    most recently used keys; a buffer beyond the bound is a plain fresh allocation.
    Buffers under ``min_bytes`` are never pooled: malloc hands those out of memory the
    process already touched, cheaper than the pool's bookkeeping.

    Args:
        per_key: buffers kept per (element count, dtype).
        max_keys: (element count, dtype) keys kept.
        min_bytes: the smallest buffer pooled.
    """

    def __init__(self, per_key: int = 2, max_keys: int = 4,
                 min_bytes: int = POOL_MIN_BYTES) -> None:
        self.per_key = per_key
        self.max_keys = max_keys
        self.min_bytes = min_bytes
        self._buckets: dict[tuple, list[np.ndarray]] = {}
        self.allocations = 0  # fresh pooled-size buffers allocated (tests, profiling)

    def take(self, nelem: int, dtype) -> np.ndarray:
        """A flat array of ``nelem`` elements of ``dtype`` that nothing else references
        (contents undefined: the caller overwrites all of it).

        Args:
            nelem: elements.
            dtype: a numpy dtype (type or instance).
        """
        if nelem * (4 if dtype is np.float32 else np.dtype(dtype).itemsize) < self.min_bytes:
            return np.empty(nelem, dtype)
        key = (nelem, dtype)
        bucket = self._buckets.pop(key, None)
        if bucket is None:
            bucket = []
            if len(self._buckets) >= self.max_keys:
                self._buckets.pop(next(iter(self._buckets)))  # the least recently used
        self._buckets[key] = bucket  # most recently used last
        for i in range(len(bucket)):
            if _refcount_at(bucket, i) == _FREE_REFS:
                return bucket[i]
        arr = fresh_array(nelem, dtype)
        self.allocations += 1
        if len(bucket) < self.per_key:
            bucket.append(arr)
        return arr

    def clear(self) -> None:
        """Forget every buffer (results still referenced stay valid: they are the
        caller's)."""
        self._buckets.clear()


def wire_dtype(bf16_wire: bool, kind: int) -> int:
    """The wire dtype of a round: bf16 only for MODEL rounds with the bf16 wire on.

    Args:
        bf16_wire: the Comm's ``set_bf16_wire`` setting.
        kind: the round kind (``RoundKind`` or its int).
    """
    return DTYPE_BF16 if (bf16_wire and kind == RoundKind.MODEL) else DTYPE_F32


def refuse_one_tensor(tensors) -> None:
    """TypeError when a collective's list of tensors is one tensor (iterated, it would
    be taken row by row: ``all_reduce_tensors(t)[0]`` would be the mean of row 0), a
    numpy array, or not a list or tuple at all (None, a generator)."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(
            f"a collective takes a list of tensors, got one tensor of shape "
            f"{tuple(tensors.shape)}: pass [t] (a bare tensor would be reduced row by row, "
            f"each row a tensor of its own)")
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"a collective takes a list (or tuple) of tensors, got "
                        f"{type(tensors).__name__}"
                        + (": pass [torch.from_numpy(a)]" if isinstance(tensors, np.ndarray)
                           else ""))


def elements_share_memory(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` share memory (an ``expand()``ed view: a stride of 0
    along a dimension of more than one element), so no result can be written into it."""
    return any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))


def check_tensors(tensors: Sequence[torch.Tensor], in_place: bool = False,
                  broadcast: bool = False) -> list[tuple[int, ...]]:
    """The shapes of ``tensors``; FrameError naming the first that is not a dense
    float32 or bfloat16 tensor holding data (a sparse or a meta tensor), or, with
    ``in_place`` (the tensors receive the result), one whose elements share memory (an
    ``expand()``ed view: its write-back failed after the round, leaving this rank out
    of step); TypeError for one tensor passed where the list goes.

    Args:
        tensors: the tensors of one collective call.
        in_place: the call writes its result into ``tensors``.
        broadcast: the call is a broadcast (a wrong dtype's fix is another).
    """
    refuse_one_tensor(tensors)
    shapes = []
    for i, t in enumerate(tensors):
        try:
            dt = t.dtype
        except AttributeError:
            dt = None
        if dt is not F32 and dt is not BF16:
            check_tensor_dtype(t, i, broadcast)  # raises with the dtype named
        if t.is_nested:
            raise FrameError(f"tensor[{i}] is a nested tensor: only dense tensors can be "
                             f"reduced; pass its components (t.unbind()) or "
                             f"t.to_padded_tensor(0.0)")
        if t.is_meta:
            raise FrameError(f"tensor[{i}] is on the meta device, which holds no data: "
                             f"materialize it first (module.to_empty(device='cpu') and "
                             f"initialize, or load a state_dict)")
        if t.layout is not torch.strided:
            raise FrameError(f"tensor[{i}] is a {t.layout} tensor: only dense tensors can "
                             f"be reduced; pass t.to_dense()")
        if in_place and elements_share_memory(t):
            raise FrameError(
                f"tensor[{i}] of shape {tuple(t.shape)} and stride {t.stride()} has "
                f"elements that share memory (an expand()ed view): a result cannot be "
                f"written into it in place; pass t.contiguous() and use that copy")
        shapes.append(tuple(t.shape))
    return shapes


def _tensor_source(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """(flat numpy view of t's data, is_bf16) for a float32/bfloat16 tensor."""
    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == BF16:
        return tensor_array(t.reshape(-1), np.uint16), True
    return tensor_array(t.reshape(-1), np.float32), False


def encode_tensor(t: torch.Tensor, dst: np.ndarray, dtype: int, scale: float,
                  scratch: np.ndarray, scratch16: np.ndarray) -> None:
    """Copy one tensor into its wire slot, converting and scaling on the way.

    The result equals encoding ``t.mul(scale)`` (one rounding stage): f32 data is
    multiplied in f32 then rounded once to bf16 if the wire is bf16; bf16 data is
    scaled with one bf16 rounding, then upcast exactly on an f32 wire.

    Args:
        t: a float32/bfloat16 tensor of ``dst.shape[0]`` elements.
        dst: the slot (float32 for an f32 wire, uint16 bf16 bits for bf16).
        dtype: the wire dtype (``DTYPE_F32``/``DTYPE_BF16``).
        scale: multiplier fused into the copy.
        scratch, scratch16: f32/uint16 work buffers (any length > 0).
    """
    n = dst.shape[0]
    is_bf16 = t.dtype is BF16
    if t.is_cpu and n * (2 if is_bf16 else 4) <= BY_ADDRESS_MAX and t.is_contiguous():
        addr = t.data_ptr()
        if not is_bf16:
            if dtype == DTYPE_F32:
                TIO.encode_f32_to_f32(addr, n, dst, scale)
            else:
                TIO.encode_f32_to_bf16(addr, n, dst, scale, scratch)
        elif dtype == DTYPE_BF16:
            TIO.encode_bf16_to_bf16(addr, n, dst, scale, scratch)
        else:
            TIO.encode_bf16_to_f32(addr, n, dst, scale, scratch, scratch16)
        return
    src, is_bf16 = _tensor_source(t)
    one = scale == 1.0
    if not is_bf16:
        if dtype == DTYPE_F32:
            if one:
                np.copyto(dst, src)
            else:
                K.f32_scaled_copy(src, dst, scale)
        elif one:
            K.f32_to_bf16(src, dst)
        else:
            K.f32_to_bf16_scaled(src, dst, scale, scratch)
    elif dtype == DTYPE_BF16:
        if one:
            np.copyto(dst, src)
        else:
            K.bf16_scaled_copy(src, dst, scale, scratch)
    else:
        TIO.encode_bf16_to_f32(src.ctypes.data, n, dst, scale, scratch, scratch16)


def flat_part(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Elements [a, b) of a contiguous tensor, as a flat view."""
    return t.detach().view(-1)[a:b]


def decode_into_tensor(src: np.ndarray, dtype: int, t: torch.Tensor) -> None:
    """Write a consensus slice into an existing float32/bfloat16 tensor, in place.

    Args:
        src: the consensus slice in the wire dtype (float32, or uint16 bf16 bits).
        dtype: the wire dtype of ``src``.
        t: the destination, ``src.shape[0]`` elements.
    """
    if t.dtype is F32 and t.is_cpu and t.is_contiguous():
        n = src.shape[0]
        if n * 4 <= BY_ADDRESS_MAX:
            if dtype == DTYPE_F32:
                TIO.decode_f32_into(src, t.data_ptr())
            else:
                TIO.decode_bf16_into(src, t.data_ptr())
            return
        dst = tensor_array(t.detach().view(-1), np.float32)
        if dtype == DTYPE_F32:
            np.copyto(dst, src)
        else:
            K.bf16_to_f32(src, dst)
        return
    if dtype == DTYPE_F32 and t.dtype is torch.bfloat16:
        # narrowed by the engine's kernel, as the contiguous paths narrow (a NaN keeps its
        # sign; torch's copy_ would make every NaN +NaN): the same bits whatever the layout
        bits = np.empty(src.shape[0], np.uint16)
        K.f32_to_bf16(src, bits)
        tmp = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    elif dtype == DTYPE_F32:
        tmp = torch.from_numpy(src)
    else:
        tmp = torch.from_numpy(src.view(np.int16)).view(torch.bfloat16)
    with torch.no_grad():
        t.copy_(tmp.view(t.shape))


def flat_f32(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """One flat float32 copy of ``tensors``, in order (e.g. an outer optimizer's state
    in the params frame's layout).

    Args:
        tensors: CPU tensors of any floating dtype.
    """
    flat = [tensor_array(t.detach().to(torch.float32).contiguous().view(-1), np.float32)
            for t in tensors]
    return np.concatenate(flat) if flat else np.empty(0, np.float32)


def decode_gathered(cons: np.ndarray, dtype: int, plan: RoundPlan,
                    tensors: Sequence[torch.Tensor], drift: np.ndarray | None = None,
                    floats_done: bool = False) -> None:
    """Write a fused round's consensus into the tensors ``TensorCodec.gather`` recorded in
    ``plan.addrs``, in place: the float32 ones in one compiled call, the bfloat16 ones
    through :func:`decode_into_tensor` (torch's rounding).

    Args:
        cons: the consensus in the wire dtype (``plan.nelem`` elements from 0).
        dtype: the wire dtype.
        plan: the round's plan, its ``addrs`` filled by ``gather`` for ``tensors``.
        tensors: the destinations, in the plan's order.
        drift: a float64 ``[len(tensors), 3]`` array: row ``i`` gets tensor ``i``'s
            :func:`add_drift` sums, taken while the float32 ones are written.
        floats_done: the float32 tensors were written already (with their drift): only
            the bfloat16 ones are left.
    """
    if floats_done or TIO.decode_scatter(cons, plan.addrs, plan.ntensors,
                                         NO_DRIFT if drift is None else drift):
        for i, (t, off, k) in enumerate(zip(tensors, plan.offs, plan.numels)):
            if t.dtype is BF16:
                old = None if drift is None else t.detach().reshape(-1).float().numpy()
                decode_into_tensor(cons[off:off + k], dtype, t)
                if old is not None:
                    RK.drift_sums(old, flat_values(t), drift[i])


def flat_values(t: torch.Tensor) -> np.ndarray:
    """A float32 or bfloat16 tensor's values as a flat numpy array: float32, or the
    bfloat16 bits as uint16 (a view when ``t`` is contiguous, else a copy)."""
    t = t.detach().contiguous().view(-1)
    return tensor_array(t, np.uint16 if t.dtype is BF16 else np.float32)


def drift_snapshot(tensors: Sequence[torch.Tensor], nelem: int, pool: "ResultPool") -> np.ndarray:
    """The tensors' current values, one after the other, as ``nelem`` float32 (a pooled
    buffer): the "old" side of :func:`add_drift` for a round that writes in place."""
    buf = pool.take(nelem, np.float32)
    off = 0
    for t in tensors:
        n = t.numel()
        torch.from_numpy(buf[off:off + n]).copy_(t.detach().reshape(-1))
        off += n
    return buf


def add_drift(old: np.ndarray, tensors: Sequence[torch.Tensor], drift: np.ndarray) -> None:
    """Add ``(Σ old², Σ new², Σ (old - new)²)`` per tensor to the rows of ``drift``
    (float64 ``[len(tensors), 3]``): ``old`` from :func:`drift_snapshot`, new the
    tensors' values now."""
    off = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        RK.drift_sums(old[off:off + n], flat_values(t), drift[i])
        off += n


def wire_views(flat: np.ndarray, dtype: int, plan: RoundPlan) -> list[torch.Tensor]:
    """One tensor view per shape of ``plan`` over a flat array in the wire dtype
    (float32, or uint16 bits viewed as bfloat16)."""
    if dtype == DTYPE_F32:
        base = torch.from_numpy(flat)
    else:
        base = torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16)
    return flat_views(base[:plan.nelem], plan)


def flat_views(flat: torch.Tensor, plan: RoundPlan) -> list[torch.Tensor]:
    """The plan's tensors as views of ``flat`` (``plan.nelem`` elements, 1-D): new
    tensor objects over its memory, ``flat`` itself never (it may be a reused staging
    buffer). One ``split_with_sizes``, and ``view(*shape)`` where a tensor is not 1-D:
    a slice and ``view(shape)`` per tensor cost ~3 µs each, most of a small
    multi-tensor broadcast's time."""
    shapes = plan.shapes
    if len(shapes) == 1:
        return [flat.view(shapes[0])]
    return [p if len(s) == 1 else p.view(*s) if s else p.view(s)
            for p, s in zip(flat.split_with_sizes(plan.numels), shapes)]


class TensorCodec:
    """One rank's encoder/decoder state: scratch buffers, the armed-slot staging and
    its RAM gate.

    Args:
        local_world_size: ranks on this host (the RAM gate budgets per local rank).
        memory: host memory available at rank start (measured lazily when None).
    """

    def __init__(self, local_world_size: int, memory: HostMemory | None = None) -> None:
        self.local_world_size = local_world_size
        self.scratch = np.empty(_SCRATCH, np.float32)
        self.scratch16 = np.empty(_SCRATCH, np.uint16)
        self.staging = DecodeStaging()
        self.results = ResultPool()
        self.gate: StagingDecision | None = None
        # the RAM gate budgets against what was available at rank start, before the
        # run's own working set (docs/host_ram.md, "The checks")
        self._mem_at_start = memory

    def encode(self, tensors: Sequence[torch.Tensor], dst: np.ndarray, plan: RoundPlan,
               dtype: int, scale: float, hook=None, rnd: int = 0) -> None:
        """Encode every tensor into its slot of ``dst`` (the payload, wire-typed);
        ``hook("mid_copy_in", rnd)`` runs before the second tensor (tests)."""
        for i, (t, off, n) in enumerate(zip(tensors, plan.offs, plan.numels)):
            if hook is not None and i == 1:
                hook("mid_copy_in", rnd)
            encode_tensor(t, dst[off:off + n], dtype, scale, self.scratch, self.scratch16)

    @staticmethod
    def gather(tensors: Sequence[torch.Tensor], plan: RoundPlan) -> bool:
        """Fill ``plan.addrs`` with the tensors' addresses and source dtypes for the
        fused round (and ``plan.bf16_sources`` with how many are bfloat16); False
        (nothing usable) when a tensor is not a contiguous float32/bfloat16 CPU tensor:
        the general path then runs (and names a tensor it cannot reduce: a sparse CSR
        tensor has no contiguity, an mkldnn one no address of its data)."""
        addrs = plan.addr_words
        flag = 2 * plan.ntensors
        i = bf16 = 0
        try:  # (free in CPython 3.11 until something raises)
            for t in tensors:
                dt = t.dtype
                if dt is F32:
                    addrs[flag + i] = 0
                elif dt is BF16:
                    addrs[flag + i] = 1
                    bf16 += 1
                else:
                    return False
                if not t.is_cpu or not t.is_contiguous():
                    return False
                addrs[i] = t.data_ptr()
                i += 1
        except RuntimeError:
            return False
        plan.bf16_sources = bf16
        return True

    def flat_result(self, nelem: int, armed: int | None) -> torch.Tensor:
        """A flat f32 result buffer: memory no earlier result still references (the
        ``ResultPool``), or slot ``armed``'s reusable staging when the RAM gate allows
        it."""
        if armed is not None:
            if self.gate is None:
                if self._mem_at_start is None:
                    self._mem_at_start = host_memory()
                self.gate = decide_pinned_decode(nelem * 4, self.local_world_size,
                                                 self._mem_at_start)
            if self.gate.enabled:
                return self.staging.buffer(armed, nelem)
        return torch.from_numpy(self.results.take(nelem, np.float32))

    def fused_result(self, plan: RoundPlan, armed: int | None
                     ) -> tuple[list[torch.Tensor], np.ndarray | None, int]:
        """The result tensors of a fused round over ``plan`` and where the round
        reduces into: a flat f32 numpy array over their memory, or else its address."""
        if armed is None and len(plan.shapes) == 1:
            arr = self.results.take(plan.nelem, np.float32)
            t = torch.from_numpy(arr)
            shape = plan.shapes[0]
            return [t if len(shape) == 1 else t.view(shape)], arr, 0
        flat = self.flat_result(plan.nelem, armed)
        return self.views(flat, plan), None, flat.data_ptr()

    @staticmethod
    def views(flat: torch.Tensor, plan: RoundPlan) -> list[torch.Tensor]:
        """The plan's tensors as views of a flat f32 result (``flat_views``)."""
        return flat_views(flat, plan)

    def clear(self) -> None:
        """Drop the staging and pooled result buffers."""
        self.staging.clear()
        self.results.clear()
