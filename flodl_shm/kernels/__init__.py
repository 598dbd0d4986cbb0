"""numba kernels: bf16 codec, fused scale, weighted sum / finalize, atomics.

Hot-path code: numpy and numba only, no torch. Importing this package first
points numba's on-disk cache at a writable directory (see ``_cache``).
"""
from __future__ import annotations

from ._cache import cache_complete, cache_dir, configure_numba_cache

configure_numba_cache()

from .codec import (  # noqa: E402
    bf16_scaled_copy,
    bf16_scaled_to_f32,
    bf16_to_f32,
    f32_scaled_copy,
    f32_to_bf16,
    f32_to_bf16_scaled,
)
from .reduce import (  # noqa: E402
    accumulate_bf16,
    accumulate_f32,
    drift_sums,
    finalize_bf16,
    finalize_f32,
    reduce_bf16,
    reduce_bf16_to_f32,
    reduce_f32,
)
from .scale import scale_payload_bytes  # noqa: E402

__all__ = [
    "accumulate_bf16",
    "accumulate_f32",
    "bf16_scaled_copy",
    "bf16_scaled_to_f32",
    "bf16_to_f32",
    "cache_complete",
    "cache_dir",
    "configure_numba_cache",
    "drift_sums",
    "f32_scaled_copy",
    "f32_to_bf16",
    "f32_to_bf16_scaled",
    "finalize_bf16",
    "finalize_f32",
    "reduce_bf16",
    "reduce_bf16_to_f32",
    "reduce_f32",
    "scale_payload_bytes",
    "warm_up",
]


def warm_up(max_sources: int = 4) -> None:
    """Compile (or load from the cache) every kernel at the signatures we use.

    ``spawn`` calls this in the parent before starting ranks, so ranks only ever
    read the cache (no concurrent compile-and-write races, no per-rank JIT
    latency on the first round).
    """
    import numpy as np

    f = np.zeros(8, np.float32)
    g = np.zeros(8, np.float32)
    h = np.zeros(8, np.uint16)
    k = np.zeros(8, np.uint16)
    s = np.zeros(4, np.float32)
    t = np.zeros(4, np.float32)
    f32_to_bf16(f, h)
    bf16_to_f32(h, f)
    f32_scaled_copy(f, g, 1.0)
    f32_to_bf16_scaled(f, h, 1.0, s)
    bf16_scaled_copy(h, k, 1.0, s)
    bf16_scaled_to_f32(h, f, 1.0)
    scale_payload_bytes(f.view(np.uint8), 0, 1.0)
    scale_payload_bytes(h.view(np.uint8), 1, 1.0)
    accumulate_f32(f, g, 1.0)
    accumulate_bf16(f, h, 1.0, s)
    finalize_f32(f, g, 1.0)
    finalize_bf16(f, h, 1.0, s)
    sums = np.zeros(3, np.float64)
    drift_sums(f, g, sums)
    drift_sums(f, h, sums)
    for n in range(1, max(1, max_sources) + 1):
        reduce_f32((f,) * n, g, 0, 8, 1.0, s)
        reduce_bf16((h,) * n, k, 0, 8, 1.0, s, t)
        reduce_bf16_to_f32((h,) * n, g, 0, 8, 1.0, s, t)
