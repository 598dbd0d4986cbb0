"""What each rank called, when the ranks of a group called different collectives.

A collective's round checks that every rank contributes the same schema (byte count and
signature, or the frame's tensors); when they differ, the engine raises ``FrameError``
on every rank at that round. Its text speaks of frames: a byte round's schema is a
marker and a hash, so "rank 1 passed float64 where rank 0 passed float32", or "rank 0
asked for SUM and rank 1 for MAX", cannot be read from it.

So the process group answers a mismatch with one more round, the **call round**: every
rank publishes a short description of the call it made (the collective, its tensors'
dtypes and shapes, the reduce op and root), reads everyone's, and raises one error that
lists them. The states, on every rank:

::

    MISMATCH   the collective's round raised FrameError on every rank (the group is
               still in step: that round completed as a failure everywhere)
    DESCRIBE   each rank writes ``describe_call(...)`` (UTF-8, at most
               ``CALL_TEXT_BYTES``) into a byte round of fixed size and signature
    EXPLAIN    the error lists every rank's call; where the texts are all the same (the
               difference lies in something not described), it keeps the engine's text

The call round cannot mismatch itself (fixed size, fixed signature). If it fails anyway
(a rank that did not take part, a death), the collective's own error is raised, chained.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np
import torch

from .reduce_ops import op_label

CALL_TEXT_BYTES = 480
"""The longest description a rank publishes (longer ones are cut, with "...")."""

_ROUND_BYTES = 512  # a 2-byte length, then the text, then padding
_LIST_SHOWN = 4     # tensors of a list described one by one; past that, the rest counted
CALL_ROUND_SIGNATURE = int.from_bytes(
    hashlib.blake2b(b"flodl_shm call round", digest_size=8).digest(), "little") >> 2


def _describe(x) -> str | None:
    if isinstance(x, torch.Tensor):
        dtype = str(x.dtype).removeprefix("torch.")
        layout = "" if x.layout is torch.strided else str(x.layout).removeprefix("torch.") + " "
        try:
            shape = ",".join(map(str, x.shape))
        except (RuntimeError, TypeError):  # (a nested tensor's ragged sizes)
            shape = "?"
        return f"{'nested ' if x.is_nested else layout}{dtype}[{shape}]"
    if isinstance(x, (list, tuple)):
        parts = [_describe(y) for y in x[:_LIST_SHOWN]]
        more = f", ... {len(x) - _LIST_SHOWN} more" if len(x) > _LIST_SHOWN else ""
        return "[" + ", ".join(p for p in parts if p is not None) + more + "]"
    if isinstance(x, (int, float, str)):
        return str(x)
    options = []  # torch's *Options objects: what of them the ranks must agree on
    if hasattr(x, "reduceOp"):
        options.append(f"op={op_label(x.reduceOp)}")
    if hasattr(x, "rootRank"):
        options.append(f"root={x.rootRank}")
    return ", ".join(options) or None


def describe_call(name: str, args: Sequence, kwargs: dict) -> str:
    """One rank's collective as its caller would name it, e.g.
    ``allreduce([float64[3]], op=MAX)``: tensors by dtype and shape, options by the
    fields the ranks must agree on (reduce op, root)."""
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    text = f"{name}({', '.join(p for p in parts if p)})"
    raw = text.encode()
    if len(raw) > CALL_TEXT_BYTES:
        text = raw[:CALL_TEXT_BYTES - 3].decode(errors="ignore") + "..."
    return text


def explain_mismatch(exchange: Callable, name: str, call: str, engine_error: Exception) -> str:
    """Run the call round and say what each rank called.

    Args:
        exchange: the group's byte round, ``exchange(nbytes, fill, consume, signature)``
            (``consume`` gets one view per group rank, in group-rank order).
        name: the collective, for the message's head.
        call: this rank's ``describe_call``.
        engine_error: the round's ``FrameError``; its text is kept when every rank's
            description reads the same.

    Returns: the message (the caller raises it). Raises what the call round raised,
    if it fails.
    """
    raw = call.encode()[:CALL_TEXT_BYTES]
    calls: list[str] = []

    def fill(dst: np.ndarray) -> None:
        dst[:2] = np.frombuffer(len(raw).to_bytes(2, "little"), np.uint8)
        dst[2:2 + len(raw)] = np.frombuffer(raw, np.uint8)

    def consume(views: list[np.ndarray]) -> None:
        for v in views:
            n = min(int.from_bytes(bytes(v[:2]), "little"), CALL_TEXT_BYTES)
            calls.append(bytes(v[2:2 + n]).decode(errors="replace"))

    exchange(_ROUND_BYTES, fill, consume, CALL_ROUND_SIGNATURE)
    if len(set(calls)) <= 1:
        return f"flodl_shm {name}: {engine_error}"
    lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(calls))
    return (f"flodl_shm {name}: the {len(calls)} ranks of this group made different calls; "
            f"every rank must call the same collective with tensors of the same dtypes and "
            f"shapes and the same options (reduce op, root):\n{lines}")
