"""The epoch permutation: a reproducible dataset order from a documented raw stream.

Numpy and numba only. The training layer's coverage tracking (``training/coverage.py``)
builds on it; ``launch`` warms it before ranks start.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["epoch_permutation", "warm_up"]

_RAW_BLOCK = 1 << 20  # PCG64 outputs drawn per block (8 MiB), bounding the transient




@njit(cache=True, nogil=True)
def _fisher_yates_block(perm, raw, i_start):
    """Swap steps i = i_start, i_start-1, ... (one per raw word), Durstenfeld order."""
    scale = 1.0 / 9007199254740992.0  # 2**-53
    i = i_start
    for k in range(raw.shape[0]):
        u = np.float64(raw[k] >> np.uint64(11)) * scale
        j = np.int64(u * np.float64(i + 1))
        if j > i:
            j = i
        tmp = perm[i]
        perm[i] = perm[j]
        perm[j] = tmp
        i -= 1


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The dataset order of ``epoch``: a permutation of ``range(n)`` (int64).

    Algorithm (fixed; part of the resume format):

    * ``bg = numpy.random.PCG64(seed + epoch)`` - a BitGenerator, whose raw
      stream NumPy keeps stable across versions (unlike ``Generator`` methods);
    * Durstenfeld's Fisher-Yates: for ``i = n-1`` down to ``1`` draw one raw
      64-bit word ``r``, ``u = (r >> 11) * 2**-53``, ``j = min(floor(u * (i+1)), i)``,
      swap ``perm[i]`` and ``perm[j]``.

    The bias of the float draw is below ``n / 2**53`` per index - irrelevant for a
    data order, and it keeps the shuffle reproducible from the documented raw
    stream alone. Same ``(seed, epoch, n)``, same permutation, in any process.

    Raises:
        ValueError: ``seed + epoch`` or ``n`` is negative.
    """
    n = int(n)
    base = int(seed) + int(epoch)
    if n < 0:
        raise ValueError(f"permutation length must be >= 0, got {n}")
    if base < 0:
        raise ValueError(
            f"seed + epoch must be >= 0 for PCG64, got {seed} + {epoch} = {base}; use a "
            "non-negative seed (flodl's default is 42)"
        )
    perm = np.arange(n, dtype=np.int64)
    if n < 2:
        return perm
    bg = np.random.PCG64(base)
    i = n - 1
    while i >= 1:
        take = min(_RAW_BLOCK, i)
        raw = bg.random_raw(take)
        _fisher_yates_block(perm, raw, i)
        i -= take
    return perm


def warm_up() -> None:
    """Compile (or load from numba's cache) the shuffle kernel."""
    epoch_permutation(0, 0, 8)
