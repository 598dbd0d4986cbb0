"""Where a byte round of the ``"flodl_shm"`` process group puts each rank's tensors.

A byte round (``engine/byte_exchange.py``) hands every rank every rank's bytes. A
collective that carries tensors that way packs them one after another, each at an
offset aligned to ``ALIGN`` bytes (``packed_offsets``), writes them there
(``write_tensors``) and reads a peer's as tensors viewing the round's buffer
(``tensor_at``, no copy). Gathers and scatters put a status word in front of the bytes
(``put_status``): whether the root's list fits, which only the root can check. Every
round carries a signature of what it carries (``round_signature``), so ranks that pass
different collectives, dtypes or shapes get a schema mismatch instead of misreading
each other's bytes.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..frame import tensor_array

ALIGN = 64  # byte offset alignment of each tensor inside a byte round


def round_signature(what: str, *parts) -> int:
    """A stable 62-bit hash of what a byte round carries (collective, op, dtypes, shapes):
    ranks that disagree get a schema mismatch instead of misreading each other's bytes."""
    import hashlib

    def describe(x):
        if isinstance(x, torch.Tensor):
            return f"{x.dtype}{tuple(x.shape)}"
        if isinstance(x, (list, tuple)):
            return "[" + ",".join(describe(y) for y in x) + "]"
        return str(x)

    text = what + "|" + "|".join(describe(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def apart_or_own(t: torch.Tensor, out: torch.Tensor, n: int, rank: int) -> bool:
    """Whether the ``n`` bytes of ``t`` lie apart from ``out`` or exactly at ``rank``'s
    part of it (an all-gather's input the engine takes as it is)."""
    a, b = t.data_ptr(), out.data_ptr()
    return a + n <= b or b + out.numel() * out.element_size() <= a or a == b + n * rank


def put_status(dst: np.ndarray, problem: str | None) -> None:
    """The status word in front of a gather's or a scatter's bytes: whether the root's
    list fits, so that every rank refuses one that does not (only the root can check
    it); read by ``_refuse_root_list``."""
    dst[:8].view(np.int64)[0] = int(problem is not None)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def packed_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offs, total = [], 0
    for t in tensors:
        offs.append(total)
        total += aligned(nbytes_of(t))
    return offs, total


def bytes_of(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes as a uint8 array (a copy only for a tensor not at stride 1). Not
    through ``Tensor.numpy()``, which marks the storage not resizable for good: the
    caller's ``t.resize_()`` after a collective raised."""
    flat = t.detach().reshape(-1)
    if not flat.numel():
        return np.empty(0, np.uint8)
    if flat.stride(0) != 1:
        # torch counts a one-element tensor of any stride as contiguous, but its bytes
        # can only be viewed at stride 1
        flat = flat.clone(memory_format=torch.contiguous_format)
    return tensor_array(flat, np.uint8)


def write_tensors(dst: np.ndarray, tensors: Sequence[torch.Tensor], offs: Sequence[int]) -> None:
    for t, o in zip(tensors, offs):
        src = bytes_of(t)
        dst[o:o + src.shape[0]] = src


def tensor_at(buf: np.ndarray, off: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s dtype and shape reading ``buf[off:]`` (no copy)."""
    n = nbytes_of(like)
    raw = torch.from_numpy(buf[off:off + n])
    return raw.view(like.dtype).view(like.shape)


def copy_into(t: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(src.view(t.shape))
