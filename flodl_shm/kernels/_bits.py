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


def _bitcast(src, dst, name: str, doc: str):
    """An intrinsic reinterpreting a ``src`` scalar as ``dst`` (same width)."""

    def typer(typingctx, x):
        if x != src:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(x), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


f32_bits = _bitcast(types.float32, types.uint32, "f32_bits",
                    "The IEEE-754 bits of a float32 scalar, as uint32 (a no-op reinterpretation).")
bits_f32 = _bitcast(types.uint32, types.float32, "bits_f32",
                    "The float32 whose IEEE-754 bits are the uint32 ``b`` (a no-op reinterpretation).")
