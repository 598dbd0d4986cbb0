"""In-place scaling of a raw wire payload: flodl's ``scale_payload_bytes``.

Used for the reducer's divide-once (factor = f32(1/Σw)) and a rank's fused
pre-scale (factor = f32(w)): the payload's own bytes are scaled where they lie,
with no model-sized scratch copy.
"""
from __future__ import annotations

import numpy as np

from ..errors import FrameError
from .codec import bf16_scaled_copy, f32_scaled_copy

_F32_TAG = 0
_BF16_TAG = 1
_UNUSED_SCRATCH = np.empty(1, np.float32)


def scale_payload_bytes(buf, dtype_tag: int, factor: float) -> None:
    """Scale every element of a raw little-endian payload in place.

    Args:
        buf: a writable contiguous buffer holding the payload bytes (bytearray,
            numpy array, writable memoryview).
        dtype_tag: the wire dtype, 0 (f32: ``x * f32(factor)``) or 1 (bf16:
            ``RNE(f32(x) * f32(factor))``, one rounding). Both are bit-identical to
            torch's ``tensor.mul(factor)`` in that dtype.
        factor: the scale; cast to f32 first.

    Raises:
        FrameError: an unknown dtype tag (named), a read-only or non-contiguous
            buffer, or a byte count that is not a whole number of elements.
    """
    if dtype_tag not in (_F32_TAG, _BF16_TAG):
        raise FrameError(f"scale_payload: unsupported wire dtype tag {dtype_tag} (0 = f32, 1 = bf16)")
    try:
        raw = np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise FrameError(f"scale_payload: payload must be a contiguous byte buffer ({e})") from None
    if not raw.flags.writeable:
        raise FrameError(
            "scale_payload: payload buffer is read-only; pass a bytearray or a writable array"
        )
    esize = 4 if dtype_tag == _F32_TAG else 2
    if raw.nbytes % esize:
        raise FrameError(
            f"scale_payload: {raw.nbytes} bytes is not a whole number of "
            f"{'f32' if esize == 4 else 'bf16'} elements ({esize} bytes each)"
        )
    if dtype_tag == _F32_TAG:
        a = raw.view(np.float32)
        f32_scaled_copy(a, a, factor)
    else:
        b = raw.view(np.uint16)
        bf16_scaled_copy(b, b, factor, _UNUSED_SCRATCH)
