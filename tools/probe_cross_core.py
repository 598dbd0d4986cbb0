#!/usr/bin/env python
"""What an eager round's copies cost on this machine, between two cores: why a round's
copy into its shared-memory slot costs several times a private copy of the same bytes.

Two processes on two cores take turns, as the ranks of an eager round do: each copies a
buffer into its slot of a shared segment, then copies its peer's slot out. Per size it
prints the median of each step, the slower process's (µs):

  private copy      a copy between two private buffers (the floor)
  into a read slot  a copy into the slot the peer copied out in the turn before: the
                    lines the peer's cache holds must first be taken back from it
  into a fresh slot the same copy into a slot nobody else reads
  peer's slot out   a copy of the peer's slot (just written on the other core) out

    python tools/probe_cross_core.py                     # 32 KiB, 128 KiB, 512 KiB
    python tools/probe_cross_core.py --sizes 256KiB --iters 5000

It needs two cores it may run on. The segment is named ``fshm_probe_<pid>`` and removed
at the end, however the probe ends.
"""
from __future__ import annotations

import os
import queue
import statistics
import sys
import time
from multiprocessing import get_context, shared_memory

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from _bench_common import byte_size, comma_list, human, parser, positive_int, run_main  # noqa: E402

STEPS = ("private copy", "into a read slot", "into a fresh slot", "peer's slot out")
# int64 words at the head of the segment: the two processes' turn counters
_TURN, _WORDS = 0, 16


def _probe(shm, me: int, core: int, n: int, iters: int, results) -> None:
    """One of the two forked processes (``me`` 0 or 1, pinned to ``core``; ``shm`` the
    segment its parent mapped): ``iters`` turns of every step; puts ``(me, {step: median
    µs})`` on ``results``."""
    os.sched_setaffinity(0, {core})
    words = np.ndarray((_WORDS,), np.int64, shm.buf, 0)
    base = 8 * _WORDS + 4096
    read_slots = [np.ndarray((n,), np.uint8, shm.buf, base + r * n) for r in range(2)]
    fresh = np.ndarray((n,), np.uint8, shm.buf, base + (2 + me) * n)
    src = np.full(n, me + 1, np.uint8)
    out = np.empty(n, np.uint8)
    turn = 0

    def together():  # both processes at the same point (a two-rank barrier)
        nonlocal turn
        turn += 1
        words[_TURN + me] = turn
        while words[_TURN + 1 - me] < turn:
            pass

    clock = time.perf_counter_ns
    times: dict[str, list[int]] = {s: [] for s in STEPS}
    together()
    # one step at a time, each its own loop, so that no step's lines crowd another's
    private = np.empty(n, np.uint8)
    for _ in range(iters):
        t0 = clock()
        np.copyto(private, src)
        times["private copy"].append(clock() - t0)
        together()
    for _ in range(iters):  # an eager round's copies: into a slot the peer reads, and out
        t0 = clock()
        np.copyto(read_slots[me], src)
        times["into a read slot"].append(clock() - t0)
        together()
        t0 = clock()
        np.copyto(out, read_slots[1 - me])
        times["peer's slot out"].append(clock() - t0)
        together()
    for _ in range(iters):  # the same copy into a slot nobody else reads
        t0 = clock()
        np.copyto(fresh, src)
        times["into a fresh slot"].append(clock() - t0)
        together()
    results.put((me, {s: statistics.median(v) / 1e3 for s, v in times.items()}))


def measure(n: int, iters: int, cores: list[int]) -> dict[str, float]:
    """Every step's median at ``n`` bytes, the slower process's."""
    ctx = get_context("fork")
    shm = shared_memory.SharedMemory(name=f"fshm_probe_{os.getpid()}", create=True,
                                     size=8 * _WORDS + 4096 + 4 * n)
    procs = []
    try:
        shm.buf[:8 * _WORDS] = bytes(8 * _WORDS)
        results = ctx.Queue()
        procs = [ctx.Process(target=_probe, args=(shm, me, cores[me], n, iters, results),
                             daemon=True) for me in range(2)]
        for p in procs:
            p.start()
        got = {}
        while len(got) < 2:
            try:
                me, medians = results.get(timeout=1.0)
                got[me] = medians
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a probe process failed at {human(n)} (exit "
                                       f"{[p.exitcode for p in procs]}); see its output "
                                       f"above") from None
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shm.close()
        shm.unlink()
    return {s: max(got[0][s], got[1][s]) for s in STEPS}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--sizes", type=comma_list(byte_size, "size"), default="32KiB,128KiB,512KiB",
                    help="bytes a process copies each step (default 32KiB,128KiB,512KiB)")
    ap.add_argument("--iters", type=positive_int, default=2000,
                    help="turns per size (default 2000)")
    args = ap.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print(f"probe_cross_core: this process may run on {len(cores)} core only "
              f"({cores}); the probe needs two (run it outside taskset, or on a larger "
              f"machine)", file=sys.stderr)
        return 2
    print(f"# two processes on cores {cores[0]} and {cores[1]}; median of {args.iters} turns, "
          f"the slower process's (µs)\n")
    print("| step | " + " | ".join(human(n) for n in args.sizes) + " |")
    print("|---|" + "---:|" * len(args.sizes))
    rows = {s: [] for s in STEPS}
    for n in args.sizes:
        try:
            medians = measure(n, args.iters, cores)
        except RuntimeError as e:  # (a probe process failed: its own output says why)
            print(f"probe_cross_core: {e}", file=sys.stderr)
            return 1
        for step, v in medians.items():
            rows[step].append(f"{v:.1f}")
    for step in STEPS:
        print(f"| {step} | " + " | ".join(rows[step]) + " |")
    return 0


if __name__ == "__main__":
    run_main(main)
