"""Flat outer-optimizer steps over float32 slices, in place and allocation-free.

The training layer's outer optimizers (``training/outer.py``) step tensor lists
with these; the single-host engine steps the slice each rank reduces.

Arithmetic (bit-exact contract)
-------------------------------
Every element is computed in IEEE float32, one rounding per operation, in this
order, with ``lr32 = float32(lr)`` and ``mu32 = float32(mu)``::

    g   = prev - consensus
    v   = g                      (fresh momentum)
        | (mu32 * v) + g          (otherwise; v is updated in place)
    la  = (mu32 * v) + g          (Nesterov look-ahead, uses the NEW v)
    new = prev - (lr32 * la)

No fused multiply-add, no reassociation. This is exactly the sequence of torch
ops ``sub, mul, add, mul, add, mul, sub`` on float32 CPU tensors, so the flat
kernel, the tensor-list ``outer_step`` and a literal torch formulation agree
bit for bit - and an element's result depends on that element alone, so
stepping a vector slice by slice (each rank stepping the slice it reduces, as
the single-host engine does) equals stepping it whole.

The flat form :func:`nesterov_step_flat` works in place on float32 numpy arrays
of any length - a slice of a shared-memory parameter vector, with its momentum
slice also in shared memory - and allocates nothing.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["avg_step_flat", "nesterov_step_flat", "warm_up"]




@njit(cache=True, nogil=True)
def _nesterov_kernel(prev, consensus, momentum, lr, mu, fresh, out):
    lr32 = np.float32(lr)
    mu32 = np.float32(mu)
    n = prev.shape[0]
    if fresh:
        for i in range(n):
            p = prev[i]
            g = p - consensus[i]
            momentum[i] = g
            la = mu32 * g
            la = la + g
            out[i] = p - lr32 * la
    else:
        for i in range(n):
            p = prev[i]
            g = p - consensus[i]
            v = mu32 * momentum[i]
            v = v + g
            momentum[i] = v
            la = mu32 * v
            la = la + g
            out[i] = p - lr32 * la


def _check_flat(name: str, arr: np.ndarray, n: int) -> None:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != 1:
        got = f"{type(arr).__name__} dtype={getattr(arr, 'dtype', None)} ndim={getattr(arr, 'ndim', None)}"
        raise ValueError(
            f"{name} must be a 1-D float32 numpy array, got {got}; pass "
            f"np.asarray(x, dtype=np.float32).reshape(-1) (or a float32 tensor's .numpy())"
        )
    if arr.shape[0] != n:
        raise ValueError(
            f"{name} has {arr.shape[0]} elements but prev has {n}; every array of one outer "
            f"step must cover the same slice of the parameter vector"
        )


def nesterov_step_flat(
    prev: np.ndarray,
    consensus: np.ndarray,
    momentum: np.ndarray,
    lr: float,
    mu: float,
    fresh: bool,
    out: np.ndarray,
) -> None:
    """One DiLoCo outer step over a flat float32 slice, in place, allocation-free.

    Computes, per element and in the float32 order documented in the module
    docstring, ``g = prev - consensus``; ``momentum = g`` when ``fresh`` else
    ``momentum = mu*momentum + g``; ``out = prev - lr*(mu*momentum + g)``.

    Args:
        prev: the previous global (read).
        consensus: this window's consensus (read).
        momentum: the outer momentum (read unless ``fresh``; always written).
        lr: outer learning rate.
        mu: outer momentum coefficient.
        fresh: start the momentum from ``g`` (first step, or after a parameter-count
            change) instead of reading it.
        out: receives the new global. It may be the very same array as ``prev`` or
            ``consensus`` (each element is read before it is written) but must
            not partially overlap any input.

    All five arrays are 1-D float32 of one length (any length, 0 included);
    anything else raises ``ValueError`` before a byte is touched.
    """
    n = prev.shape[0] if isinstance(prev, np.ndarray) else -1
    _check_flat("prev", prev, n)
    _check_flat("consensus", consensus, n)
    _check_flat("momentum", momentum, n)
    _check_flat("out", out, n)
    _nesterov_kernel(prev, consensus, momentum, float(lr), float(mu), bool(fresh), out)


def avg_step_flat(prev: np.ndarray, consensus: np.ndarray, out: np.ndarray) -> None:
    """The identity outer step over a flat slice: ``out[:] = consensus``.

    A no-op when ``out`` is ``consensus`` (the usual single-host case: the
    consensus already is the new global). ``prev`` is accepted for a uniform
    signature and not read.
    """
    n = consensus.shape[0] if isinstance(consensus, np.ndarray) else -1
    _check_flat("consensus", consensus, n)
    _check_flat("out", out, n)
    if out is consensus or (
        out.__array_interface__["data"][0] == consensus.__array_interface__["data"][0]
        and out.strides == consensus.strides
    ):
        return
    np.copyto(out, consensus)


def warm_up() -> None:
    """Compile (or load from numba's cache) the outer kernels at the signature the
    engine uses, so no rank pays JIT latency inside its first reduce."""
    a = np.zeros(4, np.float32)
    b = np.zeros(4, np.float32)
    m = np.zeros(4, np.float32)
    o = np.zeros(4, np.float32)
    nesterov_step_flat(a, b, m, 0.7, 0.9, True, o)
    nesterov_step_flat(a, b, m, 0.7, 0.9, False, o)
