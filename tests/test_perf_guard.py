"""Performance regression guard: every public collective at 4 KiB stays within a
fixed ratio of the fused in-place path (``all_reduce_``), measured in the same run.

The goal (issue 15) is 1.5x, and the guard enforces it (``LIMIT``) for every API that
meets it on a quiet 2-core machine: the tensor-returning APIs on one f32 tensor run as
one compiled call (1.10-1.42x over ten quiet runs), and so does ``broadcast_from_root``
(1.27-1.39x); per-rank 0.99-1.18x, barrier 0.6-0.8x. Two are not there yet and keep a
limit of their own (``LIMITS``) a little above today's quiet figures, so a regression
past the present state fails: zero-copy 1.33-1.53x (limit 1.8x), the frame API
1.85-2.12x (2.5x: frame validation and payload copies). Under load (load average 6-9) every API measures 0.9-1.1x: the rounds then wait on futex
sleeps, not Python.

Ratios, never absolute times: the test runs on loaded 2-core machines. Two real
processes (``spawn``) run every API in interleaved batches (one batch of each API per
repetition, so load drift hits all of them alike); the per-call time of a batch is its
mean, the API's figure is the median over repetitions, on the rank that took longer.
The operations are the benchmark's own (``tools/bench_allreduce.py``'s ``api_ops``).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from engine_util import assert_no_leaks  # noqa: E402

pytestmark = pytest.mark.timeout(300)

LIMIT = 1.5  # issue 15's target, for every API that meets it on a quiet machine
# the APIs not there yet: a limit above today's quiet figures (see the module doc)
LIMITS = {"api-zero-copy": 1.8, "api-frame": 2.5}
NBYTES = 4 << 10
REPS = 25
BATCH = 40


def _measure(ctx, reps: int, batch: int) -> dict:
    from bench_allreduce import api_ops

    comm = ctx.comm
    ops = api_ops(comm, NBYTES // 4, ctx.rank)
    ok = {}
    for name, (op, check) in ops.items():  # warm every path (plans, numba dispatch)
        for _ in range(20):
            op()
        ok[name] = check()  # right after: zero-copy views live until the next call
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(reps):
        for name, (op, _) in ops.items():
            comm.barrier()
            t0 = time.perf_counter_ns()
            for _ in range(batch):
                op()
            times[name].append((time.perf_counter_ns() - t0) / batch)
    return {"times": times, "ok": ok}


def _ratios() -> tuple[dict, float]:
    from flodl_shm import spawn

    per_rank = spawn(_measure, 2, (REPS, BATCH), timeout=240)
    assert_no_leaks()
    assert all(all(r["ok"].values()) for r in per_rank), [r["ok"] for r in per_rank]
    names = list(per_rank[0]["times"])
    # per repetition, the slower rank's batch mean (the collective ends with the slowest)
    med = {n: statistics.median(max(r["times"][n][i] for r in per_rank) for i in range(REPS))
           for n in names}
    base = med["api-inplace"]
    return {n: med[n] / base for n in names}, base


def test_every_api_within_limit_of_the_inplace_path():
    reports = []
    for _attempt in range(2):  # a real regression fails twice; a burst of load rarely does
        ratios, base = _ratios()
        report = ", ".join(f"{n[4:]} {r:.2f}x" for n, r in ratios.items())
        print(f"\n4 KiB, world 2, x the in-place path ({base / 1e3:.1f} us): {report}")
        reports.append(f"in-place {base / 1e3:.1f} us: {report}")
        over = [n for n, r in ratios.items() if r > LIMITS.get(n, LIMIT)]
        if not over:
            return
    raise AssertionError(f"APIs over their limit ({LIMIT}x the in-place path at 4 KiB, "
                         f"else {LIMITS}) in two measurements: " + " | ".join(reports))
