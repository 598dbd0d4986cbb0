"""Scalar bit casts between float32 and uint32, as numba intrinsics.

numba has no scalar bit-cast (``view`` exists only for arrays), so a kernel that
needs the bits of a *computed* f32 (``x * factor``, then round to bf16) would have
to stage the product through a scratch array and re-read it as uint32. These two
intrinsics emit a plain LLVM ``bitcast`` instead: no memory round trip, and the
whole convert-scale-round chain stays one vectorisable loop body.
"""
from __future__ import annotations

from numba import types
from numba.extending import intrinsic


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE-754 bits of a float32 scalar, as uint32 (a no-op reinterpretation)."""
    if x != types.float32:
        return None
    sig = types.uint32(x)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return sig, codegen


@intrinsic
def bits_f32(typingctx, b):
    """The float32 whose IEEE-754 bits are the uint32 ``b`` (a no-op reinterpretation)."""
    if b != types.uint32:
        return None
    sig = types.float32(b)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return sig, codegen
