"""Which reduce operators the ``"flodl_shm"`` backend applies to which dtypes, and how.

Every rank reduces the same contributions in the same (rank) order with the same
torch kernels, so every rank computes the same bits. The table (docs/c10d.md):

========================  ====================================================
op                        dtypes
========================  ====================================================
SUM                       every supported dtype (bool: logical or)
AVG                       every supported dtype but bool (integers: the sum divided by
                          the world, truncated toward zero, as NCCL's AVG does)
PRODUCT                   every supported dtype (bool: logical and)
MIN, MAX                  every supported dtype
PREMUL_SUM                floating dtypes (factor applied before the sum)
========================  ====================================================

Supported dtypes: float32, float64, bfloat16, float16, int8, int16, int32, int64,
uint8, bool. BAND/BOR/BXOR and other dtypes raise ``RuntimeError`` naming the op or
dtype and the supported set.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8,
                    torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_SUPPORTED = frozenset(SUPPORTED_DTYPES)  # (a lookup: the tuple's scan cost 0.5 µs a call)
_HALF_DTYPES = (torch.bfloat16, torch.float16)
_F32_SUMMED = (torch.float32, torch.bfloat16, torch.float16)
_R = dist.ReduceOp.RedOpType
SUPPORTED_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM")


class RefusedCall(RuntimeError):
    """A collective this rank refused before any of its rounds: a tensor, dtype, layout or
    op the backend cannot reduce. The process group has every rank agree on it
    (``ProcessGroupFlodlShm``'s refusal round), so ranks that called something else are
    told at once, not left a call behind. ``said``: that round ran already."""

    said = False


def op_name(op) -> str:
    """The name of a ``ReduceOp`` (or its ``RedOpType``), e.g. ``"SUM"``."""
    return getattr(op, "name", None) or str(op).split(".")[-1]


def op_type(op):
    """The ``RedOpType`` of a ``ReduceOp`` option (PREMUL_SUM ops carry a factor)."""
    return op.op if hasattr(op, "op") else op


def check_dtype(t: torch.Tensor, what: str) -> None:
    """Raise ``RefusedCall`` unless ``t`` is a dense CPU tensor of a supported dtype
    (every rank checks its own tensors before any round; the process group's refusal
    round keeps a rank that refused alone in step with the others)."""
    check_device_and_dtype(t, what)
    check_layout(t, what)


def check_device_and_dtype(t: torch.Tensor, what: str) -> None:
    """Raise ``RefusedCall`` unless ``t`` is a CPU tensor of a supported dtype (of any
    layout)."""
    if not t.is_cpu:  # (t.device builds a device object: 0.3 µs)
        raise RefusedCall(f"flodl_shm {what}: tensor on device {t.device}; the flodl_shm "
                          f"backend handles CPU tensors only: give {t.device.type} tensors a "
                          f"group of their own, e.g. dist.new_group(backend='nccl') for cuda "
                          f"(a 'cpu:flodl_shm,cuda:nccl' group builds no nccl backend: torch "
                          f"gives a Python backend the whole group)")
    if t.dtype not in _SUPPORTED:
        raise RefusedCall(f"flodl_shm {what}: dtype {t.dtype} is not supported; supported: "
                          f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED_DTYPES)}")


def check_layout(t: torch.Tensor, what: str) -> None:
    """Raise ``RefusedCall`` for a sparse, mkldnn or nested tensor (whose bytes no
    collective can copy), naming its layout."""
    if t.layout is not torch.strided or t.is_nested:
        kind = "a nested" if t.is_nested else f"a {t.layout}"
        raise RefusedCall(f"flodl_shm {what}: {kind} tensor; the flodl_shm backend handles "
                          f"dense tensors only: pass t.to_dense()"
                          + (" (a nested tensor: its components, t.unbind())"
                             if t.is_nested else "")
                          + ("; of the collectives, all_reduce with ReduceOp.SUM takes "
                             "sparse COO tensors (as gloo's does)"
                             if t.layout is torch.sparse_coo else ""))


def check_op(op, dtype: torch.dtype, what: str) -> None:
    """Raise ``RefusedCall`` unless ``op`` applies to ``dtype`` (the table above)."""
    kind = op_type(op)
    name = op_name(kind)
    if name not in SUPPORTED_OPS:
        raise RefusedCall(f"flodl_shm {what}: reduce op {name} is not supported; supported: "
                          f"{', '.join(SUPPORTED_OPS)}")
    if name == "PREMUL_SUM" and dtype not in FLOAT_DTYPES:
        raise RefusedCall(f"flodl_shm {what}: reduce op PREMUL_SUM needs a floating dtype, "
                          f"got {dtype}; use SUM and multiply, or a float tensor")
    if name == "AVG" and dtype is torch.bool:
        raise RefusedCall(f"flodl_shm {what}: reduce op AVG has no meaning for torch.bool; "
                          f"use SUM (logical or), MIN (logical and), or a numeric tensor")
    if name == "PREMUL_SUM" and getattr(op, "factor", None) is None:
        raise RefusedCall(_FACTORLESS.format(what=what, version=torch.__version__))


# A Python backend reads a PREMUL_SUM op's factor through ``ReduceOp.factor``, which
# torch 2.13 has and earlier releases (2.11, seen on a GPU host) lack: there the op
# reaches the backend without it. (torch 2.13 cannot build a PREMUL_SUM without one; a
# bare ``ReduceOp.PREMUL_SUM`` type, given to the backend's methods directly, has none.)
_FACTORLESS = ("flodl_shm {what}: reduce op PREMUL_SUM reached the backend without its "
               "factor" + ("; build it with torch.distributed._make_nccl_premul_sum(factor)"
                           if hasattr(dist.ReduceOp, "factor") else
                           ": torch {version} does not let a Python backend read a "
                           "PREMUL_SUM's factor (torch 2.13 does); multiply the tensor by "
                           "the factor and use ReduceOp.SUM, or upgrade torch"))


def premul_factor(op) -> float | None:
    """The factor of a PREMUL_SUM op (None for other ops; ``check_op`` refused a
    PREMUL_SUM without one)."""
    if op_name(op_type(op)) != "PREMUL_SUM":
        return None
    f = op.factor
    return float(f.item() if isinstance(f, torch.Tensor) else f)


def op_label(op) -> str:
    """A reduce op as the ranks must agree on it, in call signatures and in what each rank
    called: its name, and a PREMUL_SUM's factor (``PREMUL_SUM(0.5)``). Each rank applies
    the factor to every contribution, so ranks that passed different factors (NCCL's
    PREMUL_SUM scales each rank's own input by its own) are told they called different
    collectives, rather than each computing a different result."""
    name = op_name(op_type(op))
    if name != "PREMUL_SUM" or getattr(op, "factor", None) is None:
        return name
    return f"PREMUL_SUM({premul_factor(op)!r})"


def reduce_in_order(parts: Sequence[torch.Tensor], op, out: torch.Tensor) -> None:
    """``out`` = parts[0] (op) parts[1] (op) ... in this order (AVG: the sum, then
    ``average_``; PREMUL_SUM multiplies each part by its factor first),
    computed in a contiguous tensor of its own and then copied into ``out``.

    bfloat16 and float16 sums (SUM, AVG, PREMUL_SUM) start from the first part and
    accumulate in float32, rounding once at the end, as the engine's reduce rounds do:
    the same data gives the same bits whichever transport a collective takes (the
    sign of an all-negative-zero sum included)."""
    name = op_name(op_type(op))
    factor = premul_factor(op)
    if name in ("SUM", "AVG", "PREMUL_SUM") and out.dtype in _HALF_DTYPES:
        with torch.no_grad():
            acc = None
            for p in parts:
                p = p.view(out.shape).to(torch.float32, copy=True)
                if factor is not None:
                    p.mul_(factor)
                if acc is None:
                    acc = p
                else:
                    acc.add_(p)
            if name == "AVG":
                average_(acc, len(parts), out.dtype)
            out.copy_(acc)
        return
    if factor is not None:
        parts = [p * factor for p in parts]
    # accumulated in a contiguous tensor of its own, then copied: torch's kernels for
    # strided outputs may keep the other operand of a tie (MIN/MAX of -0.0 and 0.0),
    # and every rank must get the same bits whatever its tensor's layout
    acc = torch.empty(out.shape, dtype=out.dtype)
    with torch.no_grad():
        acc.copy_(parts[0].view(out.shape))
        for p in parts[1:]:
            p = p.view(out.shape)
            if name in ("SUM", "AVG", "PREMUL_SUM"):
                if acc.dtype is torch.bool:
                    acc.logical_or_(p)
                else:
                    acc.add_(p)
            elif name == "PRODUCT":
                if acc.dtype is torch.bool:
                    acc.logical_and_(p)
                else:
                    acc.mul_(p)
            elif name == "MIN":
                torch.minimum(acc, p, out=acc)
            elif name == "MAX":
                torch.maximum(acc, p, out=acc)
        if name == "AVG":
            average_(acc, len(parts), acc.dtype)
        out.copy_(acc)


def average_(acc: torch.Tensor, n: int, dtype: torch.dtype) -> None:
    """AVG's last step on ``acc``, the sum over ``n`` ranks of tensors of ``dtype``:
    times float32's 1/n for float32, bfloat16 and float16 (whose sums are float32), as
    the engine's mean Σ·float32(1/Σw) does, so every transport gives the same bits;
    divided by ``n`` for float64; for integers divided by ``n`` and truncated toward
    zero (NCCL's AVG of integers; Lightning's ``sync_dist`` averages an int64 count so
    on every backend but gloo)."""
    if dtype in _F32_SUMMED:
        acc.mul_(float(np.float32(1.0 / n)))
    elif dtype.is_floating_point:
        acc.div_(n)
    else:
        acc.div_(n, rounding_mode="trunc")


def float_view(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor's float view (``torch.view_as_real``: the same memory); any
    other tensor as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def real_views(tensors: Sequence[torch.Tensor], op, what: str) -> list[torch.Tensor]:
    """``tensors`` with each complex one replaced by its float view
    (``torch.view_as_real``, same memory), as torch itself passes complex tensors to
    ``all_reduce``; its other reduces (``reduce``, ``reduce_scatter``) hand them over
    as they are. Complex tensors take SUM, AVG and PREMUL_SUM, as torch's ``all_reduce``
    does (elementwise on the real and imaginary parts); other ops raise ``RuntimeError``
    naming them."""
    out = []
    for t in tensors:
        if t.is_complex():
            name = op_name(op_type(op))
            if name not in ("SUM", "AVG", "PREMUL_SUM"):
                raise RefusedCall(f"flodl_shm {what}: reduce op {name} on the complex dtype "
                                  f"{t.dtype}; complex tensors take SUM, AVG or PREMUL_SUM")
        out.append(float_view(t))
    return out
