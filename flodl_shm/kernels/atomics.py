"""Atomic memory operations on shared-memory arrays, as numba intrinsics.

The host engine's synchronisation words live in ``/dev/shm`` and are read and
written by several processes. Plain numpy element access is not enough inside a
compiled spin loop: LLVM may hoist a non-volatile load out of the loop (spinning
forever on a stale register) and may reorder a payload store after the flag
store that publishes it. These intrinsics emit LLVM atomic instructions with
explicit orderings:

- ``load_acquire(a, i)``: no later read of the payload can move before it;
- ``store_release(a, i, v)``: every earlier write (the payload) is visible before ``v``;
- ``fetch_add(a, i, v)``: sequentially consistent read-modify-write (a full fence);
- ``compare_exchange(a, i, expected, new)``: seq_cst CAS, returns the old value;
- ``fence()``: a sequentially consistent fence (store->load ordering, Dekker-style);
- ``cpu_relax()``: the spin-wait hint (``pause`` on x86-64; nothing elsewhere);
- ``os_yield()``: ``sched_yield(2)``, handing the core to another runnable process (a
  wait on a host whose ranks outnumber its cores), bound by symbol name (``bind_libc``).

On x86-64 acquire/release compile to plain ``mov`` (TSO gives them for free); the
point is to stop the *compiler* from reordering or caching. Arrays must be
naturally aligned (our control block aligns every word to its size).
"""
from __future__ import annotations

import ctypes
import platform

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_IS_ARM64 = platform.machine().lower() in ("aarch64", "arm64")


def bind_libc(*names: str) -> bool:
    """Tell the JIT linker where these C library calls live in this process, so compiled
    code calls them by symbol name (resolved when it is loaded, not baked in as an
    address: the kernels stay cacheable across processes); False when the C library
    lacks one of them (not Linux)."""
    try:
        libc = ctypes.CDLL(None)
        for name in names:
            llvm.add_symbol(name, ctypes.cast(getattr(libc, name), ctypes.c_void_p).value)
    except (OSError, AttributeError):
        return False
    return True


_HAVE_SCHED_YIELD = bind_libc("sched_yield")


def _element_pointer(context, builder, arrty, arr, idx):
    aryobj = context.make_array(arrty)(context, builder, arr)
    return builder.gep(aryobj.data, [idx])


@intrinsic
def load_acquire(typingctx, arr, idx):
    """Atomic acquire load of ``arr[idx]`` (integer arrays)."""
    if not isinstance(arr, types.Array) or not isinstance(arr.dtype, types.Integer):
        return None
    sig = arr.dtype(arr, idx)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ptr = _element_pointer(context, builder, arrty, args[0], args[1])
        return builder.load_atomic(ptr, "acquire", align=arrty.dtype.bitwidth // 8)

    return sig, codegen


@intrinsic
def store_release(typingctx, arr, idx, val):
    """Atomic release store ``arr[idx] = val`` (integer arrays)."""
    if not isinstance(arr, types.Array) or not isinstance(arr.dtype, types.Integer):
        return None
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ptr = _element_pointer(context, builder, arrty, args[0], args[1])
        v = context.cast(builder, args[2], signature.args[2], arrty.dtype)
        builder.store_atomic(v, ptr, "release", align=arrty.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fetch_add(typingctx, arr, idx, val):
    """Atomic ``old = arr[idx]; arr[idx] += val; return old`` (seq_cst)."""
    if not isinstance(arr, types.Array) or not isinstance(arr.dtype, types.Integer):
        return None
    sig = arr.dtype(arr, idx, val)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ptr = _element_pointer(context, builder, arrty, args[0], args[1])
        v = context.cast(builder, args[2], signature.args[2], arrty.dtype)
        return builder.atomic_rmw("add", ptr, v, "seq_cst")

    return sig, codegen


@intrinsic
def compare_exchange(typingctx, arr, idx, expected, new):
    """Atomic ``old = arr[idx]; if old == expected: arr[idx] = new; return old`` (seq_cst)."""
    if not isinstance(arr, types.Array) or not isinstance(arr.dtype, types.Integer):
        return None
    sig = arr.dtype(arr, idx, expected, new)

    def codegen(context, builder, signature, args):
        arrty = signature.args[0]
        ptr = _element_pointer(context, builder, arrty, args[0], args[1])
        exp = context.cast(builder, args[2], signature.args[2], arrty.dtype)
        val = context.cast(builder, args[3], signature.args[3], arrty.dtype)
        res = builder.cmpxchg(ptr, exp, val, "seq_cst", "seq_cst")
        return builder.extract_value(res, 0)

    return sig, codegen


@intrinsic
def fence(typingctx):
    """Sequentially consistent memory fence."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def cpu_relax(typingctx):
    """Spin-loop hint: lets the sibling hyperthread run and saves power."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _IS_X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse2.pause")
            builder.call(fn, [])
        elif _IS_ARM64:
            fnty = ir.FunctionType(ir.VoidType(), [ir.IntType(32)])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.aarch64.hint")
            builder.call(fn, [ir.Constant(ir.IntType(32), 1)])  # YIELD
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def os_yield(typingctx):
    """``sched_yield()``: give the core to another runnable process, if there is one
    (where the C library has no such call: ``pause`` on x86-64, nothing elsewhere)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _HAVE_SCHED_YIELD:
            fnty = ir.FunctionType(ir.IntType(32), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty, "sched_yield"), [])
        elif _IS_X86:
            fnty = ir.FunctionType(ir.VoidType(), [])
            builder.call(cgutils.get_or_insert_function(builder.module, fnty,
                                                        "llvm.x86.sse2.pause"), [])
        return context.get_dummy_value()

    return sig, codegen
