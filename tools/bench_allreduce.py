"""Intra-host all-reduce: flodl_shm against gloo, OpenMPI and one memcpy, in one run.

    python tools/bench_allreduce.py                      # full run (minutes)
    python tools/bench_allreduce.py --quick              # small schedule, smoke test
    python tools/bench_allreduce.py --plot bw.png        # also draw bandwidth vs size

Every method times the same operation: an in-place *average* of a float32 buffer
across the ranks (sum, then scale by 1/world, inside the timed region), as the
peers' own benchmarks do (BENCHMARKS.md). Per iteration the time is the MAX over ranks
(the collective is done when the slowest rank is), then the median over
iterations. GB/s is algorithmic bandwidth (buffer bytes / time); "x memcpy" divides
by one single-process ``np.copyto`` of the same buffer measured in the same run.

flodl_shm variants:
  shm-copy      ``comm.all_reduce_(t)``: copy in from a private tensor, copy out into it
  shm-zc        zero-copy: the data already sits in the rank's shared input region
                (``zero_copy_inputs``) and the consensus is read as a view
  shm-*-bf16    the same with ``set_bf16_wire(True)`` (half the bytes in shared memory)
  api-*         one row per public collective (``api_ops``: all_reduce_ of one tensor
                and of the same bytes in 16, _tensors, _weighted, _scaled,
                all_reduce(frame), zero-copy, broadcast_from_root, broadcast_,
                all_gather_into_tensor, reduce_scatter_tensor, all_reduce_per_rank_f64,
                barrier), printed as a second table with each
                row's ratio to the OpenMPI call doing the same job (``API_PEERS``)
Peers: torch.distributed gloo (TCP over loopback; gloo has no shared-memory
transport for CPU tensors), OpenMPI ``Allreduce`` (plus ``Bcast``, ``Allgather``,
``Reduce_scatter_block``, ``Barrier`` and a world-length ``Allreduce`` for the API table)
via mpi4py (run under mpirun; skipped with a note when mpirun or mpi4py is missing: the
API table then has no ratios).

    python tools/bench_allreduce.py --methods api --sizes 4KiB --worlds 2   # API rows only
    python tools/bench_allreduce.py --pages huge        # every buffer on huge pages
    python tools/bench_allreduce.py --rounds 3          # 3 interleaved rounds a world

With ``--rounds K`` each world is measured K times in turn, every flodl_shm row then its
peers, and a cell is the median of the K rounds' medians; a ratio to OpenMPI is the
median of each round's own ratio (ours and the peer measured in the same round, back to
back). This guest runs in stretches of a slow mode (every 4 KiB row, OpenMPI's too, about
twice as slow for minutes; BENCHMARKS.md): one round's ratios may pair a slow stretch
with a quick one, the rounds' median rarely does.

Every peer's buffers come from one allocator (``_bench_common.buffer``) on one kind of
page, ``--pages 4k`` (default: what torch gives a tensor) or ``huge`` (transparent
huge pages, as numpy gives arrays of 4 MiB and more): a cross-memory copy, which
OpenMPI's large messages and flodl_shm's direct rounds both use, costs about twice as
much on 4 KiB pages, so peers on different pages would not be compared like for like.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

from _bench_common import (PAGES, KiB, MiB, append_jsonl, buffer, choices, collect, comma_list,
                           exit_code, f32_size, human, int_at_least, out_file, parser,
                           positive_float, positive_int, run_child, run_main, summarize,
                           tensor_buffer)
from _bench_common import bench_gloo as _bench_gloo
from flodl_shm.engine.hostcpu import available_cores

# 1 MiB: the largest reduce the eager slots take (above it, a direct round or the bulk path)
SIZES = [4 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 64 * MiB, 256 * MiB]
#: (warm-up, timed) iterations by size; sizes between these are interpolated on a log scale
SCHEDULE = {4 * KiB: (200, 3000), 256 * KiB: (50, 600), 1 * MiB: (20, 250), 4 * MiB: (10, 100),
            64 * MiB: (3, 25), 256 * MiB: (2, 8)}
SHM_METHODS = ["shm-copy", "shm-zc", "shm-copy-bf16", "shm-zc-bf16"]
LABELS = {
    "memcpy": "numpy memcpy (1 process)",
    "shm-copy": "flodl_shm copy in/out",
    "shm-zc": "flodl_shm zero-copy",
    "shm-copy-bf16": "flodl_shm bf16 wire, copy",
    "shm-zc-bf16": "flodl_shm bf16 wire, zero-copy",
    "gloo": "torch.distributed gloo",
    "mpi": "OpenMPI Allreduce (mpi4py)",
    "mpi-bcast": "OpenMPI Bcast",
    "mpi-small": "OpenMPI Allreduce of world f64",
    "mpi-barrier": "OpenMPI Barrier",
    "api-inplace": "all_reduce_([t])",
    "api-inplace-16": "all_reduce_(16 tensors)",
    "api-inplace-sum": "all_reduce_([t], kind=CONTROL) (a sum: c10d's SUM)",
    "api-tensors": "all_reduce_tensors([t])",
    "api-weighted": "all_reduce_weighted([t], weight=1)",
    "api-scaled": "all_reduce_scaled([t], 1.0)",
    "api-frame": "all_reduce(RoundFrame)",
    "api-zero-copy": "zero_copy_inputs + all_reduce_zero_copy",
    "api-broadcast": "broadcast_from_root([t])",
    "api-broadcast-inplace": "broadcast_([t]) (in place)",
    "api-all-gather": "all_gather_into_tensor (size / world a rank)",
    "api-reduce-scatter": "reduce_scatter_tensor (SUM, size / world a rank)",
    "mpi-allgather": "OpenMPI Allgather",
    "mpi-sum": "OpenMPI Allreduce (SUM)",
    "mpi-reduce-scatter": "OpenMPI Reduce_scatter_block",
    "api-per-rank": "all_reduce_per_rank_f64 (world values)",
    "api-barrier": "barrier()",
}


def schedule(nbytes: int, world: int, scale: float) -> tuple[int, int]:
    if nbytes in SCHEDULE:
        warm, iters = SCHEDULE[nbytes]
    else:  # (the table's ends beyond it)
        sizes = sorted(SCHEDULE)
        at = math.log2(max(nbytes, 1))
        warm, iters = (float(np.interp(at, [math.log2(n) for n in sizes],
                                       [SCHEDULE[n][i] for n in sizes])) for i in (0, 1))
    if world > 2 and nbytes >= 64 * MiB:
        scale *= 0.6
    return max(1, round(warm * scale)), max(3, round(iters * scale))


# --- memcpy baseline ------------------------------------------------------------------

def bench_memcpy(sizes, scale, pages) -> list[dict]:
    out = []
    for nbytes in sizes:
        a = buffer(nbytes // 4, 1.0, pages)
        c = buffer(nbytes // 4, 0.0, pages)
        warm, iters = schedule(nbytes, 1, scale)
        for _ in range(max(warm, 3)):
            np.copyto(c, a)
        t0 = time.perf_counter_ns()
        np.copyto(c, a)
        k = max(1, math.ceil(100_000 / max(time.perf_counter_ns() - t0, 1)))
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            for _ in range(k):
                np.copyto(c, a)
            samples.append((time.perf_counter_ns() - t0) / k)
        out.append(summarize("memcpy", 1, nbytes, samples, bool(np.all(c == 1.0))))
        del a, c
    return out


# --- flodl_shm ------------------------------------------------------------------------

def _timed(comm, op, check, warm: int, iters: int) -> tuple:
    """The one timing loop of every flodl_shm row (main table and API table alike):
    one checked call, ``warm`` calls, a barrier, then ``iters`` timed calls, then the
    check again. Returns (times_ns, ok, waits): ``waits`` = (waits whose spin missed,
    futex sleeps) during the timed calls, from the rank's ``Waiter`` counters."""
    op()
    ok = check()
    for _ in range(warm):
        op()
    comm.barrier()
    waiter = comm._engine.waiter
    missed, sleeps = waiter.missed, waiter.sleeps
    times = np.empty(iters, np.float64)
    for i in range(iters):
        t0 = time.perf_counter_ns()
        op()
        times[i] = time.perf_counter_ns() - t0
    waits = (waiter.missed - missed, waiter.sleeps - sleeps)
    ok = ok and check()
    comm.barrier()
    return times, ok, waits


def _shm_worker(ctx, sizes, methods, scale, pages):
    """Every flodl_shm row of the run, in ONE cohort (so the main table's
    ``all_reduce_`` and the API table's in-place row share processes, core placement
    and spin calibration): per size, the main-table methods, then the API rows."""
    comm = ctx.comm
    results, waits = [], []
    shm = [m for m in methods if m in SHM_METHODS]
    apis = [m for m in methods if m in API_PEERS]
    for nbytes in sizes:
        for rows, fn in ((shm, _shm_rows), (apis, _api_rows)):
            if rows:
                r, w = fn(ctx, comm, nbytes, rows, scale, min(sizes), pages)
                results += r
                waits += w
    return results, waits


def _shm_rows(ctx, comm, nbytes, methods, scale, _smallest, pages):
    import torch

    world = ctx.world_size
    expected = (world + 1) / 2.0
    results, waits = [], []
    n = nbytes // 4
    warm, iters = schedule(nbytes, world, scale)
    for method in methods:
        comm.set_bf16_wire(method.endswith("bf16"))
        if method.startswith("shm-copy"):
            t = tensor_buffer(n, float(ctx.rank + 1), pages)

            def op(t=t):
                comm.all_reduce_([t])

            def check(t=t):
                return bool(torch.all(t == expected))
        else:
            last = {}
            for _ in range(2):  # fill both eager parities (or the bulk region) once
                comm.zero_copy_inputs([(n,)])[0].fill_(float(ctx.rank + 1))
                comm.all_reduce_zero_copy()

            def op(last=last):  # the data already sits in shared memory
                comm.zero_copy_inputs([(n,)])
                last["v"] = comm.all_reduce_zero_copy()[0]

            def check(last=last):
                return bool(torch.all(last["v"][0].float() == expected))
        times, ok, w = _timed(comm, op, check, warm, iters)
        results.append((method, nbytes, times, ok))
        waits.append(w)
        del op, check
    comm.set_bf16_wire(False)
    return results, waits


# --- every public collective, one row each ---------------------------------------------

#: API rows: name -> the OpenMPI call it is compared with ("mpi-*" methods)
API_PEERS = {
    "api-inplace": "mpi",        # comm.all_reduce_([t])
    "api-inplace-16": "mpi",     # comm.all_reduce_(ts): the same bytes in 16 tensors
    "api-inplace-sum": "mpi-sum",  # comm.all_reduce_([t], kind=CONTROL): c10d's SUM
    "api-tensors": "mpi",        # comm.all_reduce_tensors([t])
    "api-weighted": "mpi",       # comm.all_reduce_weighted([t], weight=w)
    "api-scaled": "mpi",         # comm.all_reduce_scaled([t], scale)
    "api-frame": "mpi",          # comm.all_reduce(RoundFrame)
    "api-zero-copy": "mpi",      # zero_copy_inputs + all_reduce_zero_copy
    "api-broadcast": "mpi-bcast",  # comm.broadcast_from_root([t])
    "api-broadcast-inplace": "mpi-bcast",  # comm.broadcast_([t])
    "api-all-gather": "mpi-allgather",  # comm.all_gather_into_tensor(out, part)
    "api-reduce-scatter": "mpi-reduce-scatter",  # comm.reduce_scatter_tensor(part, t)
    "api-per-rank": "mpi-small",  # comm.all_reduce_per_rank_f64 (world values)
    "api-barrier": "mpi-barrier",  # comm.barrier()
}
API_METHODS = list(API_PEERS)
#: size-independent rows: measured once, at the smallest size
API_FIXED = ("api-per-rank", "api-barrier")


def api_ops(comm, n: int, rank: int, pages: str = "4k") -> dict:
    """One callable per public collective over ``n`` float32 elements, each paired
    with a check of its last result (every rank contributes ``rank + 1`` with mass 1:
    the consensus is the mean); the tensors sit on ``pages`` (``_bench_common.buffer``).
    A call drops every result kept before it (``last.clear()``), as a loop that keeps
    only its latest result does: the result pool (``engine/tensor_codec.py``) then
    hands back warm memory, where results kept by the other rows would make it take
    fresh, page-faulting memory every call. Shared by the benchmark and
    tests/test_perf_guard.py."""
    import torch

    from flodl_shm import RoundFrame, RoundKind, TensorPayload

    world = comm.world_size
    mean = (world + 1) / 2.0
    val = float(rank + 1)
    t = tensor_buffer(n, val, pages)
    src = tensor_buffer(n, val, pages)
    frame = RoundFrame([TensorPayload(0, (n,), buffer(n, val, pages))], 1.0,
                       RoundKind.MODEL)
    last = {}

    def inplace():
        comm.all_reduce_([t])

    # the same bytes as 16 tensors, as a model's parameter list comes (n: a multiple of 16)
    parts = [tensor_buffer(n // 16, val, pages) for _ in range(16)]

    def inplace_16():
        comm.all_reduce_(parts)

    # a sum in place (the c10d backend's SUM), of every rank's tensor over world: it holds
    # the mean after the first call and stays there (exactly, for a power-of-two world)
    summed = tensor_buffer(n, val, pages)

    def inplace_sum():
        comm.all_reduce_([summed], scale=1.0 / world, kind=RoundKind.CONTROL)

    def tensors():
        last.clear()
        last["t"] = comm.all_reduce_tensors([src])

    def weighted():
        last.clear()
        last["w"] = comm.all_reduce_weighted([src], weight=1.0)

    def scaled():
        last.clear()
        last["s"] = comm.all_reduce_scaled([src], 1.0)

    def frame_op():
        last.clear()
        last["f"] = comm.all_reduce(frame)

    # The fill stands for the caller writing its data into the inputs; through a cached
    # numpy view it costs 0.6 us at 4 KiB, where torch's fill_ costs 1.6 us of dispatch,
    # a quarter of a whole round, that would be counted as the API's.
    views = {}

    def zero_copy():
        (buf,) = comm.zero_copy_inputs([(n,)])
        arr = views.get(buf)
        if arr is None:
            arr = views[buf] = buf.numpy()
        arr.fill(val)
        last.clear()
        last["z"] = comm.all_reduce_zero_copy()

    def broadcast():
        last.clear()
        last["b"] = comm.broadcast_from_root([src])

    dst = tensor_buffer(n, val, pages)  # rank 0's 1.0 after the first call, on every rank

    def broadcast_inplace():
        comm.broadcast_([dst])

    vec = np.zeros(world)
    vec[rank] = val

    # every rank's size / world into the size, FSDP's layout (the input is this rank's
    # part of the output); after the first call the output holds 1, 2, ... by part
    gathered = tensor_buffer(n // world * world, val, pages)
    mine = gathered[rank * (n // world):(rank + 1) * (n // world)]
    parts_want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n // world)

    def all_gather():
        comm.all_gather_into_tensor(gathered, mine)

    scattered = tensor_buffer(n // world, 0.0, pages)  # the sum of every rank's val
    total = float(world * (world + 1) // 2)

    def reduce_scatter():
        comm.reduce_scatter_tensor(scattered, src)

    def per_rank():
        last.clear()
        last["p"] = comm.all_reduce_per_rank_f64(vec)

    def barrier():
        comm.barrier()

    def same(x, want) -> bool:
        return bool(torch.all(x.float() == want))

    return {
        # in place: the tensor holds the mean after the first call, and stays there
        "api-inplace": (inplace, lambda: same(t, mean)),
        "api-inplace-16": (inplace_16, lambda: all(same(p, mean) for p in parts)),
        "api-inplace-sum": (inplace_sum, lambda: bool(torch.allclose(summed, torch.full_like(
            summed, mean), rtol=1e-6))),
        "api-tensors": (tensors, lambda: same(last["t"][0], mean)),
        "api-weighted": (weighted, lambda: same(last["w"][0][0], mean) and last["w"][1] == world),
        "api-scaled": (scaled, lambda: same(last["s"][0][0], mean)),
        "api-frame": (frame_op, lambda: bool(np.all(last["f"].tensors[0].as_array() == mean))),
        "api-zero-copy": (zero_copy, lambda: same(last["z"][0][0], mean)),
        "api-broadcast": (broadcast, lambda: same(last["b"][0], 1.0)),
        "api-broadcast-inplace": (broadcast_inplace, lambda: same(dst, 1.0)),
        "api-all-gather": (all_gather, lambda: bool(torch.equal(gathered, parts_want))),
        "api-reduce-scatter": (reduce_scatter, lambda: same(scattered, total)),
        "api-per-rank": (per_rank, lambda: last["p"].tolist() == [float(r + 1)
                                                                 for r in range(world)]),
        "api-barrier": (barrier, lambda: True),
    }


def _api_rows(ctx, comm, nbytes, methods, scale, smallest, pages):
    results, waits = [], []
    n = nbytes // 4
    warm, iters = schedule(nbytes, ctx.world_size, scale)
    ops = api_ops(comm, n, ctx.rank, pages)
    for method in methods:
        if method in API_FIXED and nbytes != smallest:
            continue
        op, check = ops[method]
        times, ok, w = _timed(comm, op, check, warm, iters)
        results.append((method, nbytes, times, ok))
        waits.append(w)
    return results, waits


def _collect_waits(per_rank, world) -> list[dict]:
    """``collect`` of (results, waits) workers; each summary gains ``slow_waits``: the
    most a rank had, per 100 timed rounds, of waits whose spin missed and of sleeps."""
    out = collect([r[0] for r in per_rank], world)
    for i, summary in enumerate(out):
        iters = len(per_rank[0][0][i][2])
        summary["slow_waits"] = [max(r[1][i][k] for r in per_rank) * 100.0 / iters
                                 for k in (0, 1)]
    return out


def bench_shm(world, sizes, methods, scale, pages) -> list[dict]:
    """The main-table methods and API rows in ``methods``, one cohort (``_shm_worker``)."""
    from flodl_shm import spawn

    per_rank = spawn(_shm_worker, world, (sizes, methods, scale, pages), timeout=1200)
    return _collect_waits(per_rank, world)


# --- gloo ---------------------------------------------------------------------------

def bench_gloo(world, sizes, scale, pages) -> list[dict]:
    return _bench_gloo(world, [(n, *schedule(n, world, scale)) for n in sizes], pages)


# --- OpenMPI ------------------------------------------------------------------------

def mpi_available() -> tuple[bool, str]:
    if shutil.which("mpirun") is None:
        return False, "mpirun not found (apt install openmpi-bin libopenmpi-dev)"
    probe = subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True)
    if probe.returncode != 0:
        return False, "mpi4py not installed (pip install mpi4py)"
    return True, ""


def _mpi_worker_main(sizes, scale, pages, ops_max: int = 0) -> None:
    """OpenMPI's rows (``mpi_expected``); at the sizes up to ``ops_max`` bytes also the
    peers of the c10d ops ``bench_c10d.py`` times: a plain SUM ``Allreduce``,
    ``Allgather`` and ``Reduce_scatter_block`` (each rank's input ``nbytes / world`` and
    ``nbytes``, so the gathered output and the scattered input are ``nbytes``)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    inv = np.float32(1.0 / world)
    expected = np.float32((world + 1) / 2.0)

    def measure(method, nbytes, op, check, warm, iters):
        op()
        ok = check()
        for _ in range(warm):
            op()
        times = np.empty(iters, np.float64)
        comm.Barrier()
        for i in range(iters):
            t0 = time.perf_counter_ns()
            op()
            times[i] = time.perf_counter_ns() - t0
        ok = ok and check()
        tmax = np.empty_like(times)
        comm.Reduce(times, tmax, op=MPI.MAX, root=0)
        allok = comm.allreduce(ok, op=MPI.LAND)
        if rank == 0:
            print("RESULT " + json.dumps(summarize(method, world, nbytes, tmax, allok)),
                  flush=True)

    for nbytes in sizes:
        buf = buffer(nbytes // 4, rank + 1, pages)
        warm, iters = schedule(nbytes, world, scale)

        def avg(buf=buf):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            np.multiply(buf, inv, out=buf)

        measure("mpi", nbytes, avg, lambda buf=buf: bool(np.all(buf == expected)), warm, iters)
        # the peer of broadcast_from_root: root's buffer to every rank
        got = buffer(nbytes // 4, 1.0 if rank == 0 else 0.0, pages)

        def bcast(got=got):
            comm.Bcast(got, root=0)

        measure("mpi-bcast", nbytes, bcast, lambda got=got: bool(np.all(got == 1.0)), warm,
                iters)
        del buf, got
        if nbytes <= ops_max:
            _mpi_op_rows(comm, MPI, measure, nbytes, pages, warm, iters)
    # size-independent peers, at the smallest size's schedule
    warm, iters = schedule(min(sizes), world, scale)
    vec = np.zeros(world, np.float64)
    vec[rank] = rank + 1
    out = np.empty_like(vec)

    def small():
        comm.Allreduce(vec, out, op=MPI.SUM)

    measure("mpi-small", min(sizes), small,
            lambda: out.tolist() == [float(r + 1) for r in range(world)], warm, iters)
    measure("mpi-barrier", min(sizes), comm.Barrier, lambda: True, warm, iters)
    comm.Barrier()


def _mpi_op_rows(comm, MPI, measure, nbytes: int, pages: str, warm: int, iters: int) -> None:
    """``_mpi_worker_main``'s peers of the c10d ops at ``nbytes`` (its docstring)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    n = nbytes // 4
    total = float(world * (world + 1) // 2)
    buf = buffer(n, rank + 1, pages)

    def plain_sum():  # (in place: a sum of sums after the first call; the check redoes one)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    def summed() -> bool:
        buf.fill(rank + 1)
        plain_sum()
        return bool(np.all(buf == total))

    measure("mpi-sum", nbytes, plain_sum, summed, warm, iters)
    part = buffer(n // world, rank + 1, pages)
    gathered = buffer(n // world * world, 0.0, pages)

    def allgather():
        comm.Allgather(part, gathered)

    want = np.repeat(np.arange(1, world + 1, dtype=np.float32), n // world)
    measure("mpi-allgather", nbytes, allgather,
            lambda: bool(np.array_equal(gathered, want)), warm, iters)
    scattered = buffer(n // world, 0.0, pages)

    def reduce_scatter():
        comm.Reduce_scatter_block(buf, scattered, op=MPI.SUM)

    buf.fill(rank + 1)
    measure("mpi-reduce-scatter", nbytes, reduce_scatter,
            lambda: bool(np.all(scattered == total)), warm, iters)


#: the rows ``_mpi_op_rows`` adds per size
MPI_OP_ROWS = ("mpi-sum", "mpi-allgather", "mpi-reduce-scatter")


def mpi_expected(sizes, ops_max: int = 0) -> list[tuple[str, int]]:
    """The (method, bytes) rows one ``_mpi_worker_main`` run prints, in its order."""
    return ([(m, n) for n in sizes
             for m in ("mpi", "mpi-bcast") + (MPI_OP_ROWS if n <= ops_max else ())]
            + [("mpi-small", min(sizes)), ("mpi-barrier", min(sizes))])


def bench_mpi(world, sizes, scale, pages="4k", ops_max: int = 0
              ) -> tuple[list[dict], str | None]:
    """OpenMPI's rows at ``world``, and None, or what went wrong (already said on stderr:
    mpirun's exit status, the rows missing, its stderr's tail): the caller exits non-zero.

    mpirun runs in a session of its own (``run_child``): on Ctrl-C it gets one SIGINT and
    time to stop its ranks, which remove their shared-memory segments
    (``/dev/shm/vader_segment.*``); a SIGKILL would leave them behind. ``ops_max``: the
    peers of the c10d ops too, up to that many bytes (``_mpi_op_rows``)."""
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
           str(world), sys.executable, os.path.abspath(__file__), "--mpi-worker",
           "--sizes", ",".join(map(str, sizes)), "--iter-scale", str(scale), "--pages", pages]
    if ops_max:
        cmd += ["--mpi-ops-max", str(ops_max)]
    env = dict(os.environ, OMPI_MCA_btl_vader_single_copy_mechanism="cma")
    proc = run_child(cmd, capture=True, timeout=1800, env=env)
    out = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    got = {(r["method"], r["bytes"]) for r in out}
    missing = [f"{m} {human(n)}" for m, n in mpi_expected(sizes, ops_max) if (m, n) not in got]
    if proc.returncode == 0 and not missing:
        return out, None
    why = (f"OpenMPI world {world}: mpirun exited with status {proc.returncode}; "
           f"{'missing rows: ' + ', '.join(missing) if missing else 'every row came back'}")
    tail = proc.stderr.strip()[-300:]
    print(f"  {why}{' (its stderr: ' + tail + ')' if tail else ''}", file=sys.stderr, flush=True)
    return out, why


# --- report -------------------------------------------------------------------------

def table(results: list[dict], world: int, methods: list[str], memcpy: dict) -> str:
    rows = [r for r in results if r["world"] == world]
    sizes = sorted({r["bytes"] for r in rows})
    present = [m for m in methods if any(r["method"] == m for r in rows)]
    head = "| size | " + " | ".join(LABELS[m] for m in present) + " |"
    lines = [head, "|---:|" + "---:|" * len(present)]
    for nbytes in sizes:
        cells = []
        for m in present:
            r = next((x for x in rows if x["method"] == m and x["bytes"] == nbytes), None)
            if r is None:
                cells.append("—")
                continue
            # no memcpy of this size in the run: nothing to compare with
            ratio = (f"{r['median_us'] / memcpy[nbytes]:,.1f}×" if nbytes in memcpy else "—")
            flag = "" if r["correct"] else " (WRONG)"
            cells.append(f"{r['median_us']:,.1f} µs / {r['algbw_GBps']:.2f} GB/s / "
                         f"{ratio}{flag}")
        lines.append(f"| {human(nbytes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """One row per cell (world, method, size) of ``--rounds`` interleaved rounds: the
    median over the rounds of each round's median time, with the rounds' medians kept in
    round order (``round_us``, for the ratios: :func:`api_table`); p10 the lowest of the
    rounds', p90 the highest, slow waits the most of any round."""
    cells: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for r in rows:
            cells.setdefault((r["world"], r["method"], r["bytes"]), []).append(r)
    out = []
    for rows in cells.values():
        us = [r["median_us"] for r in rows]
        med = statistics.median(us)
        row = {**rows[0], "median_us": med, "algbw_GBps": rows[0]["bytes"] / (med * 1e3),
               "p10_us": min(r["p10_us"] for r in rows),
               "p90_us": max(r["p90_us"] for r in rows),
               "min_us": min(r["min_us"] for r in rows),
               "iters": sum(r["iters"] for r in rows),
               "correct": all(r["correct"] for r in rows), "round_us": us}
        waits = [r["slow_waits"] for r in rows if r.get("slow_waits")]
        if waits:
            row["slow_waits"] = [max(w[k] for w in waits) for k in range(len(waits[0]))]
        out.append(row)
    return out


def ratio_to(r: dict, peer: dict) -> float:
    """``r``'s time over its ``peer``'s: the median of the rounds' own ratios when both
    come from the same interleaved rounds (:func:`combine_rounds`), else of the medians."""
    mine, theirs = r.get("round_us"), peer.get("round_us")
    if mine and theirs and len(mine) == len(theirs):
        return statistics.median(a / b for a, b in zip(mine, theirs))
    return r["median_us"] / peer["median_us"]


def api_peers(results: list[dict], world: int) -> tuple[int, int]:
    """(API cells with their OpenMPI peer measured in this run, API cells) at ``world``."""
    rows = {(r["method"], r["bytes"]) for r in results if r["world"] == world}
    cells = [(m, n) for m, n in rows if m in API_PEERS]
    return sum((API_PEERS[m], n) in rows for m, n in cells), len(cells)


def api_header(results: list[dict], world: int) -> str:
    """The API table's cell legend: it claims a ratio to the OpenMPI peer only for the
    cells that have one (none when OpenMPI was skipped or failed)."""
    with_peer, cells = api_peers(results, world)
    peer = ("× the OpenMPI peer measured in this run" if with_peer == cells else
            "× the OpenMPI peer measured in this run, where there is one" if with_peer else
            "no OpenMPI peer measured in this run: no ratio")
    rounds = max((len(r.get("round_us") or ()) for r in results if r["world"] == world),
                 default=0)
    if rounds > 1:
        return (f"Cell = median µs over {rounds} interleaved rounds ({peer}: the median of "
                f"the rounds' own ratios)")
    return f"Cell = median µs ({peer})"


def slow_waits_text(x: float) -> str:
    """A slow-wait rate: one decimal, or two significant digits below 0.05 (not 0.0)."""
    return f"{x:.1f}" if x == 0 or x >= 0.05 else f"{x:.2g}"


def api_table(results: list[dict], world: int) -> str:
    """One row per public collective: median µs and its ratio to the OpenMPI call
    that does the same job (``API_PEERS``), per size, all from this run."""
    rows = [r for r in results if r["world"] == world]
    apis = [m for m in API_METHODS if any(r["method"] == m for r in rows)]
    sizes = sorted({r["bytes"] for r in rows if r["method"] in apis})
    if not apis:
        return ""

    def get(m, nbytes):
        return next((x for x in rows if x["method"] == m and x["bytes"] == nbytes), None)

    lines = ["| API | OpenMPI peer | " + " | ".join(human(b) for b in sizes) + " |",
             "|---|---|" + "---:|" * len(sizes)]
    for m in apis:
        cells = []
        for nbytes in sizes:
            r = get(m, nbytes)
            if r is None:
                cells.append("—")
                continue
            peer = get(API_PEERS[m], nbytes)
            ratio = f" ({ratio_to(r, peer):.2f}×)" if peer else ""
            flag = "" if r["correct"] else " WRONG"
            cells.append(f"{r['median_us']:,.1f} µs{ratio}{flag}")
        lines.append(f"| `{LABELS[m]}` | {LABELS[API_PEERS[m]]} | " + " | ".join(cells) + " |")
    for peer in sorted({API_PEERS[m] for m in apis}):
        cells = []
        for nbytes in sizes:
            r = get(peer, nbytes)
            cells.append("—" if r is None else f"{r['median_us']:,.1f} µs")
        lines.append(f"| *{LABELS[peer]}* | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: str, note: str = "") -> None:
    """Algorithmic bandwidth against buffer size, one panel per world, every method
    measured; ``note`` (the run's conditions) goes under the panels. Saved as a
    64-colour palette PNG when Pillow is there (a quarter of the bytes, same look)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in results if r["world"] > 1})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6.5 * len(worlds), 4.8), squeeze=False)
    memcpy = sorted((r["bytes"], r["algbw_GBps"]) for r in results if r["method"] == "memcpy")
    for ax, world in zip(axes[0], worlds):
        for m in ["shm-zc", "shm-copy", "shm-zc-bf16", "shm-copy-bf16", "mpi", "gloo"]:
            pts = sorted((r["bytes"], r["algbw_GBps"]) for r in results
                         if r["method"] == m and r["world"] == world)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=LABELS[m],
                        linestyle="--" if m in ("mpi", "gloo") else "-")
        if memcpy:
            ax.plot([p[0] for p in memcpy], [p[1] for p in memcpy], color="grey", linestyle=":",
                    label=LABELS["memcpy"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([p[0] for p in memcpy] or SIZES)
        ax.set_xticklabels([human(p[0]) for p in memcpy] or [human(s) for s in SIZES])
        over = world > available_cores()
        title = f"world {world}" + (" (oversubscribed: > cores)" if over else "")
        ax.set_title(f"float32 all-reduce average, {title}")
        ax.set_xlabel("buffer size")
        ax.set_ylabel("algorithmic bandwidth (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if note:
        fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=8, color="0.35")
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


#: what --methods accepts
METHOD_NAMES = ["all", "memcpy", *SHM_METHODS, "gloo", "mpi", "api", *API_METHODS]
QUICK_SCALE = 0.05


def _measure_world(world: int, methods: list[str], sizes: list[int], scale: float,
                   pages: str, have_mpi: bool, why: str, failures: list[str],
                   which: str) -> list[dict]:
    """One round of ``world``: flodl_shm's rows (one cohort), then gloo, then OpenMPI;
    a failed OpenMPI run's reason goes to ``failures``."""
    results: list[dict] = []
    shm = [m for m in methods if m in SHM_METHODS or m in API_PEERS]
    if shm:
        print(f"# flodl_shm (main-table methods and API rows, one cohort), world {world}"
              f"{which} ...", flush=True)
        results += bench_shm(world, sizes, shm, scale, pages)
    if "gloo" in methods:
        print(f"# gloo, world {world}{which} ...", flush=True)
        results += bench_gloo(world, sizes, scale, pages)
    if "mpi" in methods:
        if have_mpi:
            print(f"# OpenMPI, world {world}{which} ...", flush=True)
            # (the sum's, all-gather's and reduce-scatter's peers are among the
            # c10d ops' peers: at every size)
            ops_max = max(sizes) if {"api-inplace-sum", "api-all-gather",
                                     "api-reduce-scatter"} & set(methods) else 0
            rows, failed = bench_mpi(world, sizes, scale, pages, ops_max)
            results += rows
            if failed:
                failures.append(failed)
        else:
            print(f"# OpenMPI skipped: {why}", flush=True)
    return results


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--sizes", type=comma_list(f32_size, "size"),
                    default=",".join(map(str, SIZES)),
                    help="comma-separated buffer sizes: bytes (a multiple of 4) or with a "
                         "suffix, KiB/MiB/GiB binary or KB/MB/GB decimal (4KiB,64MiB); "
                         "default 4KiB,256KiB,1MiB,4MiB,64MiB,256MiB")
    ap.add_argument("--worlds", type=comma_list(int_at_least(2, "an all-reduce needs 2 ranks "
                                                          "or more"), "world"), default="2,4",
                    help="comma-separated rank counts, each a cohort of its own (>= 2)")
    ap.add_argument("--methods", type=comma_list(choices(METHOD_NAMES), "method"),
                    default="all",
                    help="comma list of memcpy,shm-copy,shm-zc,shm-copy-bf16,shm-zc-bf16,gloo,"
                         "mpi, api (every public collective, one row each) or api-<name>; "
                         "memcpy is the baseline of the ratios, not a method on its own")
    ap.add_argument("--iter-scale", type=positive_float, default=None,
                    help="multiply every size's warm-up and timed iteration counts by this "
                         "(> 0; at least 1 warm-up and 3 timed iterations); default 1, "
                         f"--quick: {QUICK_SCALE}")
    ap.add_argument("--quick", action="store_true",
                    help=f"tiny schedule (smoke test): iteration scale {QUICK_SCALE}")
    ap.add_argument("--rounds", type=positive_int, default=1,
                    help="measure each world this many times in turn, flodl_shm's rows then "
                         "their peers; a cell is the median of the rounds (>= 1)")
    ap.add_argument("--pages", choices=PAGES, default="4k",
                    help="the page kind of every peer's buffers: 4k (torch's default for a "
                         "tensor) or huge (transparent huge pages, as numpy gives large "
                         "arrays and torch does with THP_MEM_ALLOC_ENABLE=1)")
    ap.add_argument("--json", type=out_file,
                    help="append the results to this file, one JSON object per line (JSONL)")
    ap.add_argument("--plot", type=out_file,
                    help="write a bandwidth-vs-size PNG (needs matplotlib)")
    ap.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mpi-ops-max", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick and args.iter_scale is not None:
        ap.error(f"--quick sets the iteration scale to {QUICK_SCALE}; give --quick or "
                 f"--iter-scale {args.iter_scale:g}, not both")
    if args.plot:
        try:
            importlib.import_module("matplotlib")  # checked before minutes of measuring
        except ImportError:
            ap.error("--plot needs matplotlib: pip install -e \".[plot]\"")
    sizes = args.sizes
    scale = QUICK_SCALE if args.quick else 1.0 if args.iter_scale is None else args.iter_scale
    if args.mpi_worker:
        _mpi_worker_main(sizes, scale, args.pages, args.mpi_ops_max)
        return 0
    worlds = args.worlds
    methods = (["memcpy", *SHM_METHODS, "api", "gloo", "mpi"] if "all" in args.methods
               else list(dict.fromkeys(args.methods)))
    if methods == ["memcpy"]:
        ap.error("--methods memcpy: memcpy is only the baseline of the ratios; add a method "
                 "to measure (e.g. memcpy,shm-copy,gloo, or all)")
    if "api" in methods:
        methods = [m for m in methods if m != "api"] + API_METHODS
    apis = [m for m in methods if m in API_PEERS]
    if apis and "mpi" not in methods:
        methods.append("mpi")  # the API table's ratio column
    print(f"# host: {available_cores()} cores; sizes {', '.join(human(s) for s in sizes)}; "
          f"worlds {worlds}; iteration scale {scale}; every buffer on {args.pages} pages",
          flush=True)
    results, failures = [], []
    if "memcpy" in methods:
        results += bench_memcpy(sizes, scale, args.pages)
    have_mpi, why = mpi_available()
    for world in worlds:
        rounds = [_measure_world(world, methods, sizes, scale, args.pages, have_mpi, why,
                                 failures, f" (round {k + 1} of {args.rounds})"
                                 if args.rounds > 1 else "")
                  for k in range(args.rounds)]
        results += combine_rounds(rounds) if args.rounds > 1 else rounds[0]
    memcpy = {r["bytes"]: r["median_us"] for r in results if r["method"] == "memcpy"}
    for world in worlds:
        over = " — OVERSUBSCRIBED (more ranks than cores)" if world > available_cores() else ""
        ratio = ("× one memcpy" if memcpy else
                 "— (no memcpy in --methods: no ratio to one memcpy)")
        main = [m for m in LABELS if m != "memcpy" and not m.startswith(("api-", "mpi-"))]
        if any(r["world"] == world and r["method"] in main for r in results):
            print(f"\n## world {world}{over}\nCell = median µs / algorithmic GB/s / {ratio}\n")
            print(table(results, world, main, memcpy))
        else:  # (e.g. only API rows asked for, and the OpenMPI peer skipped)
            print(f"\n## world {world}{over}")
        if apis:
            print(f"\n### every public collective, world {world}\n"
                  f"{api_header(results, world)}\n")
            print(api_table(results, world))
    slow = [r for r in results if any(r.get("slow_waits") or ())]
    if slow:
        print("\nslow waits per 100 timed rounds, the most of any rank (spin missed / futex "
              "sleeps; a round waits more than once, so a count can pass 100, and a missed "
              "spin need not sleep; the spin regime has none):")
        for r in slow:
            print(f"  world {r['world']} {human(r['bytes'])} {LABELS[r['method']]}: "
                  f"{slow_waits_text(r['slow_waits'][0])} / "
                  f"{slow_waits_text(r['slow_waits'][1])}")
    if memcpy:
        print("\nmemcpy: " + ", ".join(f"{human(b)} {us:,.2f} µs" for b, us in sorted(memcpy.items())))
    if args.json:
        append_jsonl(args.json, results)
    if args.plot:
        note = (f"{available_cores()} cores, {time.strftime('%Y-%m-%d')}, median of the timed "
                f"iterations (iteration scale {scale:g}"
                f"{', --quick: a smoke schedule, noisy' if args.quick else ''}); "
                f"tools/bench_allreduce.py")
        plot(results, args.plot, note)
        print(f"\nplot written to {args.plot}")
    code = exit_code(results)
    if failures:
        print("\nINCOMPLETE: " + "; ".join(failures), file=sys.stderr)
        code = code or 1
    return code


if __name__ == "__main__":
    run_main(main, quiet="--mpi-worker" in sys.argv)
