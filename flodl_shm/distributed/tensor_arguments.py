"""The tensors a collective of the ``"flodl_shm"`` process group is given: checks and
stand-ins.

A rank that refuses its arguments must still take part in the collective's rounds, or
its peers' next call would pair with its next one. So the checks here return a problem
(a text) rather than raise: the collective runs its round, then raises it on every rank
that has one (``raise_problem``, inside the round's ``consume``), and the group stays
usable. Outputs that cannot be written through a flat view get contiguous stand-ins,
copied back once the round is done (``dense_outputs``); an in-place collective's tensor
whose elements share memory (an ``expand()``ed view) runs with a copy and raises
afterwards (``writable``).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..engine.tensor_codec import elements_share_memory
from .reduce_ops import check_dtype, check_layout


def checked_inputs(tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    """``tensors`` as a list, each checked (CPU, supported dtype) for collective ``what``."""
    tensors = list(tensors)
    for t in tensors:
        check_dtype(t, what)
    return tensors


def misfit(out: torch.Tensor, like: torch.Tensor, what: str) -> str | None:
    """Why ``out`` cannot receive a copy of ``like`` (a sparse, mkldnn or nested tensor
    on either side, another dtype or element count), or None. A caller raises it on every
    rank once its round completed (a root's, through its status word): the group stays
    in step, where a root that failed copying its list alone left the others a call
    behind."""
    for t, side in ((out, "output"), (like, "input")):
        try:
            check_layout(t, f"{what} ({side})")
        except RuntimeError as e:
            return str(e)
    if out.dtype != like.dtype or out.numel() != like.numel():
        return (f"flodl_shm {what}: an output of {out.numel()} {out.dtype} elements for "
                f"{like.numel()} {like.dtype} elements; pass outputs of the inputs' dtype "
                f"and size")
    return None


def raise_problem(problem: str | None) -> None:
    """Raise ``problem`` (a caller's argument error) inside a byte round's ``consume``:
    the round completes on every rank, so the group stays usable, and nothing is
    written."""
    if problem is not None:
        raise RuntimeError(problem)


def dense_outputs(outputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Callable]:
    """Outputs a collective can write through a flat view: each of ``outputs`` itself
    when contiguous, else a contiguous stand-in; and the function that copies the
    stand-ins back into the caller's tensors once the collective is done."""
    dense = [o if o.is_contiguous() else torch.empty(o.shape, dtype=o.dtype) for o in outputs]

    def copy_back() -> None:
        with torch.no_grad():
            for o, d in zip(outputs, dense):
                if d is not o:
                    o.copy_(d)

    return dense, copy_back


def writable(tensors: list[torch.Tensor], what: str
              ) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """The tensors an in-place collective writes its result into: ``tensors``, except
    that one whose elements share memory (an ``expand()``ed view, which no result can be
    written into) is replaced by a copy; and the function to call once the round is
    done, which then raises naming it. The rank still takes part in the round with its
    values, so a layout only some ranks pass never puts the group out of step."""
    shared = [i for i, t in enumerate(tensors) if elements_share_memory(t)]
    if not shared:
        return tensors, nothing_to_refuse
    i = shared[0]
    t = tensors[i]
    problem = (f"flodl_shm {what}: tensor[{i}] of shape {tuple(t.shape)} and stride "
               f"{t.stride()} has elements that share memory (an expand()ed view), so the "
               f"result cannot be written into it; the collective ran with a copy (the "
               f"group stays usable): pass t.contiguous() and use that tensor")
    return ([t.contiguous() if k in shared else t for k, t in enumerate(tensors)],
            lambda: raise_problem(problem))


def nothing_to_refuse() -> None:
    pass
