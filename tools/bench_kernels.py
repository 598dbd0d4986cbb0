#!/usr/bin/env python
"""Throughput of flodl_shm's numba kernels next to their torch equivalents.

Every kernel runs on the same buffers as its torch counterpart (torch tensors
are views of the numpy arrays), at each size, interleaved rep by rep: ours
(always one thread), torch at one thread, torch at its default thread count.
GB/s counts the bytes a kernel must move (each input read once, each output
written once), the same figure for both sides, so the ratios are time ratios.
The "bits" column says whether our result equals torch's bit for bit (checked
once per row on fresh inputs): "=" identical, "~" different rounding by design
(noted under the table).

    python tools/bench_kernels.py                 # 4 MiB and 64 MiB (~30 s; a minute on 2 cores)
    python tools/bench_kernels.py --sizes 1,16 --reps 5
    python tools/bench_kernels.py --sizes 256KiB,4MiB --only reduce

Sizes are the f32 tensor's bytes (n = size / 4 elements); bf16 buffers of the
same n are half that.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numba  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from _bench_common import (byte_size, comma_list, human, parser, positive_int,  # noqa: E402
                           run_main)
from flodl_shm import kernels as K  # noqa: E402

W = 0.8349217
INV = 1.0 / 3.0
CHUNK = 4096  # f32 scratch of the reduce: 16 KiB, L1-resident


@dataclass
class Row:
    name: str
    torch_desc: str
    bytes_per_elem: int
    ours: Callable[[], object]
    theirs: Callable[[], object]


class Buffers:
    """All arrays for one size, as numpy arrays and torch views of them."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.n = n
        self.x = rng.standard_normal(n, dtype=np.float32)
        self.y = np.zeros(n, np.float32)
        self.acc = rng.standard_normal(n, dtype=np.float32)
        self.through = np.zeros(n, np.float32)  # torch's f32 intermediate of a bf16 reduce
        self.h = np.empty(n, np.uint16)
        K.f32_to_bf16(self.x, self.h)
        self.h_out = np.zeros(n, np.uint16)
        self.h_inplace = self.h.copy()
        self.f_inplace = self.x.copy()
        self.srcs32 = tuple(rng.standard_normal(n, dtype=np.float32) for _ in range(4))
        self.srcs16 = tuple(np.empty(n, np.uint16) for _ in range(4))
        for s32, s16 in zip(self.srcs32, self.srcs16):
            K.f32_to_bf16(s32, s16)
        self.scratch = np.empty(CHUNK, np.float32)
        self.tmp = np.empty(CHUNK, np.float32)

    @staticmethod
    def t(a: np.ndarray) -> torch.Tensor:
        """torch view of a numpy array (uint16 arrays viewed as bfloat16)."""
        if a.dtype == np.uint16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def rows(b: Buffers) -> list[Row]:
    t = Buffers.t
    x, y, acc, h, through = t(b.x), t(b.y), t(b.acc), t(b.h), t(b.through)
    h_out, h_in, f_in = t(b.h_out), t(b.h_inplace), t(b.f_inplace)
    s32 = [t(s) for s in b.srcs32]
    s16 = [t(s) for s in b.srcs16]
    flip = [2.0]

    def alternate() -> float:  # in-place scaling by 2, 1/2, 2, ...: values never drift
        flip[0] = 1.0 / flip[0]
        return flip[0]

    def torch_reduce(srcs, out, through_f32: torch.Tensor | None) -> None:
        dst = out if through_f32 is None else through_f32
        if srcs[0].dtype == torch.float32 and len(srcs) >= 2:
            torch.add(srcs[0], srcs[1], out=dst)
            rest = srcs[2:]
        else:
            dst.copy_(srcs[0])
            rest = srcs[1:]
        for s in rest:
            dst.add_(s)
        if through_f32 is None:
            dst.mul_(INV)
        else:
            torch.mul(dst, INV, out=out)

    out = [
        Row("memcpy f32 (the floor)", "f32.copy_(f32)  [ours: np.copyto]", 8,
            lambda: np.copyto(b.y, b.x), lambda: y.copy_(x)),
        Row("f32_to_bf16", "bf16.copy_(f32)  [= .to(bfloat16)]", 6,
            lambda: K.f32_to_bf16(b.x, b.h_out), lambda: h_out.copy_(x)),
        Row("bf16_to_f32", "f32.copy_(bf16)  [= .float()]", 6,
            lambda: K.bf16_to_f32(b.h, b.y), lambda: y.copy_(h)),
        Row("scale_payload_bytes f32", "f32.mul_(w)", 8,
            lambda: K.scale_payload_bytes(b.f_inplace, 0, alternate()),
            lambda: f_in.mul_(alternate())),
        Row("scale_payload_bytes bf16", "bf16.mul_(w)", 4,
            lambda: K.scale_payload_bytes(b.h_inplace, 1, alternate()),
            lambda: h_in.mul_(alternate())),
        Row("f32_to_bf16_scaled", "torch.mul(f32, w, out=bf16)", 6,
            lambda: K.f32_to_bf16_scaled(b.x, b.h_out, W, b.scratch),
            lambda: torch.mul(x, W, out=h_out)),
        Row("accumulate_f32", "acc.add_(f32, alpha=w)", 12,
            lambda: K.accumulate_f32(b.acc, b.x, W), lambda: acc.add_(x, alpha=W)),
        Row("accumulate_bf16", "acc.add_(bf16, alpha=w)", 10,
            lambda: K.accumulate_bf16(b.acc, b.h, W, b.scratch), lambda: acc.add_(h, alpha=W)),
        Row("finalize_f32", "torch.mul(acc, inv, out=f32)", 8,
            lambda: K.finalize_f32(b.acc, b.y, INV), lambda: torch.mul(acc, INV, out=y)),
        Row("finalize_bf16", "torch.mul(acc, inv, out=bf16)", 6,
            lambda: K.finalize_bf16(b.acc, b.h_out, INV, b.scratch),
            lambda: torch.mul(acc, INV, out=h_out)),
    ]
    for p in (2, 4):
        out += [
            Row(f"reduce_f32 P={p}", "add(out=) + add_ x(P-2) + mul_", 4 * (p + 1),
                lambda p=p: K.reduce_f32(b.srcs32[:p], b.y, 0, b.n, INV, b.scratch),
                lambda p=p: torch_reduce(s32[:p], y, None)),
            Row(f"reduce_bf16 P={p}", "f32.copy_ + add_ x(P-1) + mul(out=bf16)", 2 * (p + 1),
                lambda p=p: K.reduce_bf16(b.srcs16[:p], b.h_out, 0, b.n, INV, b.scratch, b.tmp),
                lambda p=p: torch_reduce(s16[:p], h_out, through)),
            Row(f"reduce_bf16_to_f32 P={p}", "f32.copy_ + add_ x(P-1) + mul_", 2 * p + 4,
                lambda p=p: K.reduce_bf16_to_f32(b.srcs16[:p], b.y, 0, b.n, INV, b.scratch,
                                                 b.tmp),
                lambda p=p: torch_reduce(s16[:p], y, None)),
        ]
    return out


def bit_check(n: int = 1 << 16) -> dict[str, bool]:
    """Row name -> whether ours equals torch bit for bit, on fresh small buffers."""
    result = {}
    names = [r.name for r in rows(Buffers(16))]
    for i, name in enumerate(names):
        mine, theirs = Buffers(n, seed=1), Buffers(n, seed=1)
        rows(mine)[i].ours()
        rows(theirs)[i].theirs()
        same = all(np.array_equal(a.view(np.uint8), c.view(np.uint8)) for a, c in (
            (mine.y, theirs.y), (mine.acc, theirs.acc), (mine.h_out, theirs.h_out),
            (mine.h_inplace, theirs.h_inplace), (mine.f_inplace, theirs.f_inplace)))
        result[name] = same
    return result


def measure(row: Row, reps: int, default_threads: int) -> tuple[float, float, float]:
    """Best seconds of (ours, torch 1 thread, torch default), interleaved rep by rep.

    The minimum, not the median: on a shared machine other processes only ever
    add time, so the fastest rep is the closest to what the code itself costs.

    Each timed call follows an untimed call of the same variant, so it finds the
    caches as a repeated call of that variant leaves them: timing a one-thread
    kernel straight after a two-thread run would charge it for pulling half the
    buffer out of the other core's cache (at 4 MiB that alone cost us 20-25%).
    """
    variants = ((row.ours, 1), (row.theirs, 1), (row.theirs, default_threads))
    times: tuple[list[float], ...] = ([], [], [])
    for fn, threads in variants:  # compile / load, fault the pages in
        torch.set_num_threads(threads)
        fn()
    for _ in range(reps):
        for k, (fn, threads) in enumerate(variants):
            torch.set_num_threads(threads)
            fn()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    torch.set_num_threads(default_threads)
    return tuple(min(t) for t in times)  # type: ignore[return-value]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def kernel_size(text: str) -> int:
    """argparse item type of --sizes: the f32 tensor's bytes, a plain number being MiB
    (``4``, ``0.5``) or a size with its unit (``4MiB``, ``256KiB``, ``4MB``); at least one
    float32, a whole number of them."""
    try:
        mib = float(text)
    except ValueError:
        nbytes = byte_size(text)
    else:
        if not mib > 0 or mib != mib or mib == float("inf"):
            raise argparse.ArgumentTypeError(f"{text} MiB is not above 0; give a size > 0 "
                                             f"(a plain number is MiB)")
        nbytes = int(mib * (1 << 20))
    if nbytes < 4 or nbytes % 4:
        raise argparse.ArgumentTypeError(
            f"{text} is {nbytes} bytes, not a whole number of float32 (4 bytes each, at "
            f"least one); give a multiple of 4 bytes")
    return nbytes


def row_names() -> list[str]:
    return [r.name for r in rows(Buffers(16))]


def main(argv=None) -> int:
    ap = parser(__doc__.split("\n\n")[0] + "\n\nThe default run (4 MiB and 64 MiB) takes "
                "about 30 s, a minute on 2 busy cores.")
    ap.add_argument("--sizes", type=comma_list(kernel_size, "size"), default="4,64",
                    help="comma-separated sizes of the f32 tensor: a plain number is MiB "
                         "(0.5, 4), or give a unit (256KiB, 4MiB, 4MB)")
    ap.add_argument("--reps", type=positive_int, default=None,
                    help="timed reps per variant (default: 40 at <= 4 MiB, 12 above)")
    ap.add_argument("--only", default="",
                    help="run only the rows whose name contains this (e.g. reduce, bf16)")
    args = ap.parse_args(argv)
    if args.only and not any(args.only in name for name in row_names()):
        ap.error(f"--only {args.only!r} matches no row; the rows are: "
                 f"{', '.join(row_names())}")
    t_start = time.perf_counter()
    default_threads = torch.get_num_threads()
    K.warm_up()
    print(f"# {cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__} "
          f"(default {default_threads} threads), numba {numba.__version__}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    checks = bit_check()
    print("| kernel | torch equivalent | size | ours GB/s | torch 1T GB/s | torch "
          f"{default_threads}T GB/s | ours / 1T | ours / {default_threads}T | bits |")
    print("|---|---|---:|---:|---:|---:|---:|---:|:---:|")
    for nbytes in args.sizes:
        mib = nbytes / (1 << 20)
        n = nbytes // 4
        bufs = Buffers(n)
        reps = args.reps or (40 if mib <= 4 else 12)
        for row in rows(bufs):
            if args.only not in row.name:
                continue
            ours, one, many = measure(row, reps, default_threads)
            gb = row.bytes_per_elem * n / 1e9
            print(f"| {row.name} | {row.torch_desc} | {_size(nbytes)} | {gb / ours:.1f} | "
                  f"{gb / one:.1f} | {gb / many:.1f} | {one / ours:.2f} | {many / ours:.2f} | "
                  f"{'=' if checks[row.name] else '~'} |", flush=True)
        del bufs
    print(f"# {time.perf_counter() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} at end")
    return 0


def _size(nbytes: int) -> str:
    """The size column: "4 MiB", "0.5 MiB" as before for whole KiB; else exact bytes."""
    return f"{nbytes / (1 << 20):g} MiB" if nbytes % 1024 == 0 else human(nbytes)


if __name__ == "__main__":
    run_main(main)
