"""The SUM all-reduce of sparse COO tensors in the ``"flodl_shm"`` backend.

What ``dist.all_reduce`` of a sparse COO tensor does, and what DDP sends for the
gradients of an ``nn.Embedding(sparse=True)`` (or any parameter with sparse
gradients), as gloo does it: SUM only, the result coalesced and copied into the
caller's tensor. Each rank's tensor holds the entries it touched, so the ranks'
bytes differ in length and cannot ride a reduce round; two byte rounds of the group
(``ProcessGroupFlodlShm._exchange``, across hosts too) carry them:

::

    DESCRIBE  every rank publishes a fixed-size record of its call: whether it can
              take part (a CPU tensor of a supported dtype, one sparse tensor or
              several to add first), the reduce op, dtype, sparse dimensions, number
              of entries (nnz) and sizes. Every rank reads all of them and checks that
              they describe one call; where they do not, every rank raises the same
              error, naming the ranks, after the round (the group stays in step: a
              rank that refused alone would leave the others waiting for it).
    ENTRIES   every rank publishes its coalesced indices (int64) and values, in a
              round sized for the largest; every rank builds each rank's sparse
              tensor and adds them in rank order (rank 0's + rank 1's + ...), then
              coalesces: the same torch operations on the same bytes on every rank,
              so every rank holds the same bits, gloo's too (it adds in that order).
    RESULT    the sum is copied into the caller's tensor (its nnz may grow), which
              the returned ``Work`` holds.

The ranks leave the ENTRIES round together and add at once: where their torch threads
outnumber the cores (two ranks of two threads on two cores), torch's OpenMP teams then
wait on each other's cores, and a sum that takes 0.2 ms alone took 6-8 ms. So the sums run
on this rank's share of the cores, as every collective of the group does (its
``collective_call.py``), torch's thread count restored after.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from .byte_layout import round_signature
from .reduce_ops import SUPPORTED_DTYPES, check_device_and_dtype, op_name, op_type

_ALIGN = 64  # the values start at this alignment after the indices
_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM", "BAND", "BOR", "BXOR")

# the record's int64 words; the sizes follow (as many as the tensor's dimensions,
# which the round's signature carries: ranks whose tensors differ in rank mismatch there)
_REFUSED, _OP, _DTYPE, _SPARSE_DIM, _NNZ, _SIZES = range(6)


def is_sparse_call(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an ``allreduce`` of ``tensors`` is this module's (any of them sparse COO)."""
    return any(t.layout is torch.sparse_coo for t in tensors)


def _local_sum(tensors: Sequence[torch.Tensor], what: str) -> tuple[torch.Tensor | None, str]:
    """This rank's one tensor to contribute (several are added first, as gloo does), or
    None and why it cannot take part."""
    for i, t in enumerate(tensors):
        if t.layout is not torch.sparse_coo:
            return None, (f"flodl_shm {what}: tensor[{i}] is {t.layout} among sparse COO "
                          f"tensors; pass the sparse tensors and the dense ones in separate "
                          f"calls")
        try:
            check_device_and_dtype(t, what)
        except RuntimeError as e:
            return None, str(e)
        if t.sparse_dim() != tensors[0].sparse_dim() or t.shape != tensors[0].shape \
                or t.dtype != tensors[0].dtype:
            return None, (f"flodl_shm {what}: the sparse tensors of one call must share "
                          f"their size, sparse dimensions and dtype; tensor[{i}] is "
                          f"{t.dtype}{list(t.shape)} with {t.sparse_dim()} sparse "
                          f"dimension(s), tensor[0] {tensors[0].dtype}{list(tensors[0].shape)}"
                          f" with {tensors[0].sparse_dim()}")
    with torch.no_grad():
        acc = tensors[0]
        for t in tensors[1:]:
            acc = acc + t
        return acc.coalesce(), ""


def _record(t: torch.Tensor | None, tensors: Sequence[torch.Tensor], op) -> np.ndarray:
    like = t if t is not None else tensors[0]
    ndim = like.dim()
    rec = np.zeros(_SIZES + ndim, np.int64)
    rec[_REFUSED] = int(t is None)
    name = op_name(op_type(op))
    rec[_OP] = _OPS.index(name) if name in _OPS else -1
    rec[_DTYPE] = SUPPORTED_DTYPES.index(like.dtype) if like.dtype in SUPPORTED_DTYPES else -1
    rec[_SPARSE_DIM] = like.sparse_dim() if like.layout is torch.sparse_coo else ndim
    rec[_NNZ] = t._nnz() if t is not None else 0
    rec[_SIZES:] = list(like.shape)
    return rec


def _verdict(records: np.ndarray, what: str) -> str | None:
    """What every rank raises for the DESCRIBE table ``records`` (one row per group
    rank), or None when the ranks may add their entries; the same text on every rank."""
    refused = [r for r in range(len(records)) if records[r, _REFUSED]]
    if refused:
        return (f"flodl_shm {what}: rank(s) {refused} could not take part in the sparse "
                f"all-reduce (their own error names why); no tensor was changed")
    ops = records[:, _OP]
    if (ops != _OPS.index("SUM")).any():
        asked = sorted({_OPS[k] if k >= 0 else "?" for k in ops if k != _OPS.index("SUM")})
        return (f"flodl_shm {what}: sparse COO tensors take ReduceOp.SUM only (as gloo's "
                f"do), asked for {', '.join(asked)}; reduce with SUM and divide by the world "
                f"size for a mean (DDP does), or pass t.to_dense() for other ops")
    for field, name in ((_DTYPE, "dtype"), (_SPARSE_DIM, "sparse dimensions")):
        if (records[:, field] != records[0, field]).any():
            seen = [SUPPORTED_DTYPES[k] if field == _DTYPE else int(k)
                    for k in records[:, field]]
            return (f"flodl_shm {what}: the ranks' sparse tensors differ in {name}: "
                    f"{', '.join(f'rank {r}: {v}' for r, v in enumerate(seen))}; every rank "
                    f"must pass a tensor of the same {name}")
    sizes = records[:, _SIZES:]
    if (sizes != sizes[0]).any():
        return (f"flodl_shm {what}: the ranks' sparse tensors differ in size: "
                f"{', '.join(f'rank {r}: {list(map(int, s))}' for r, s in enumerate(sizes))}; "
                f"every rank must pass a tensor of the same size")
    return None


def _entry_bytes(rec: np.ndarray, esize: int) -> tuple[int, int]:
    """(offset of the values, total bytes) of one rank's ENTRIES."""
    nnz, sparse_dim = int(rec[_NNZ]), int(rec[_SPARSE_DIM])
    dense = int(np.prod(rec[_SIZES + sparse_dim:], dtype=np.int64))
    at = -(-nnz * sparse_dim * 8 // _ALIGN) * _ALIGN
    return at, at + nnz * dense * esize


def _tensor_of(raw: np.ndarray, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A copy of the bytes ``raw`` as a tensor of ``dtype`` and ``shape``."""
    buf = torch.from_numpy(raw.copy()) if raw.size else torch.empty(0, dtype=torch.uint8)
    return buf.view(dtype).view(shape)


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def sparse_all_reduce(exchange: Callable, tensors: Sequence[torch.Tensor], op, world: int,
                      what: str = "allreduce") -> None:
    """SUM ``tensors`` (sparse COO, this rank's) over the group, in place (module
    docstring).

    Args:
        exchange: the group's byte round, ``exchange(nbytes, fill, consume, signature)``.
        tensors: this rank's sparse COO tensors (more than one: added first).
        op: the call's reduce op (``ReduceOp.SUM`` takes part; any other is refused on
            every rank).
        world: the group's size.
    Raises:
        RuntimeError: on every rank alike, when the ranks' calls do not describe one sum
        (an op but SUM, tensors of other dtypes or sizes, a rank that could not take
        part); nothing is written then.
    """
    mine, problem = _local_sum(tensors, what)
    rec = _record(mine, tensors, op)
    records = np.zeros((world, rec.shape[0]), np.int64)

    def read_records(views: list[np.ndarray]) -> None:
        for r, v in enumerate(views):
            records[r] = v.view(np.int64)

    exchange(rec.nbytes, lambda dst: np.copyto(dst, rec.view(np.uint8)), read_records,
             round_signature(f"{what} sparse describe", rec.shape[0]))
    if mine is None:
        raise RuntimeError(problem)  # this rank's own reason; the others name this rank
    verdict = _verdict(records, what)
    if verdict is not None:
        raise RuntimeError(verdict)
    dtype, shape = mine.dtype, tuple(mine.shape)
    esize = torch.empty(0, dtype=dtype).element_size()
    at, nbytes = _entry_bytes(rec, esize)
    total = max(_entry_bytes(r, esize)[1] for r in records)

    def fill(dst: np.ndarray) -> None:
        dst[:mine.sparse_dim() * mine._nnz() * 8] = _as_bytes(mine._indices())
        dst[at:nbytes] = _as_bytes(mine._values())

    parts: list[torch.Tensor] = []

    def consume(views: list[np.ndarray]) -> None:
        # copies only: the sum runs after the round, where no rank waits on another
        # (inside it, a rank done first spun beside the others' torch threads: 4x slower)
        sparse_dim = mine.sparse_dim()
        for r, v in enumerate(views):
            nnz = int(records[r, _NNZ])
            start, stop = _entry_bytes(records[r], esize)
            idx = _tensor_of(v[:nnz * sparse_dim * 8], torch.int64, (sparse_dim, nnz))
            val = _tensor_of(v[start:stop], dtype, (nnz, *shape[sparse_dim:]))
            # (the entries of a rank's coalesced tensor, whose size every rank agreed on:
            # no invariant to check, and torch warns when the choice is left to it)
            parts.append(torch.sparse_coo_tensor(idx, val, shape, check_invariants=False))

    exchange(total, fill, consume, round_signature(f"{what} sparse entries", total))
    out = parts[0]
    try:
        for part in parts[1:]:
            out = out + part
    except (RuntimeError, NotImplementedError) as e:  # (every rank alike)
        raise RuntimeError(f"flodl_shm {what}: torch cannot add sparse {dtype} tensors "
                           f"({e}); pass a sparse tensor of another dtype (float32, say), "
                           f"or t.to_dense()") from e
    out = out.coalesce()
    for t in tensors:  # (not under no_grad: a leaf that requires grad raises, as gloo)
        t.copy_(out)
