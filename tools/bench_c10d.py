"""torch.distributed on the "flodl_shm" backend against gloo and OpenMPI, in one run.

    python tools/bench_c10d.py                       # 4 KiB..256 MiB, world 2 and 4, DDP (~5-10 min)
    python tools/bench_c10d.py --max-size 16MiB --worlds 2 --iter-scale 0.5   # quick

Per (backend, world) one group of rank processes over ``tcp://127.0.0.1`` times
``dist.all_reduce`` (SUM, float32) at every size; on flodl_shm it also times the
engine call under it (``pg.comm.all_reduce_`` of the same tensor, CONTROL round: a
plain sum), so the wrapper's cost shows. OpenMPI ``Allreduce`` (mpi4py under mpirun,
``bench_allreduce.py``'s worker: SUM then a scale) runs when mpirun and mpi4py are
there, else it is skipped with a note. Then one DDP training step of a ~10 M-parameter
MLP, and ``dist.all_reduce`` of a sparse COO tensor (an embedding's gradient: a
10,000 x 64 float32 table, 2,000 rows per rank; OpenMPI has no sparse all-reduce), per
backend. Times: per iteration the max over ranks, then the median
(``_bench_common``). Prints markdown tables with ratios to gloo measured in the same run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (MiB, byte_size, collect, comma_list, human,  # noqa: E402
                           nonneg_int, out_file, parser, positive_float, positive_int,
                           run_main, stop_child, tcp_connections, tensor_buffer)
from bench_allreduce import bench_mpi, mpi_available, schedule  # noqa: E402
from flodl_shm.engine.hostcpu import available_cores  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = [4 << 10, 64 << 10, 256 << 10, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB,
                 256 * MiB]
#: the c10d ops of the ops table: (row name, its OpenMPI peer's method, the peer's label)
OPS = (("all_reduce", "mpi-sum", "Allreduce (SUM)"),
       ("broadcast", "mpi-bcast", "Bcast"),
       ("all_gather_into_tensor", "mpi-allgather", "Allgather"),
       ("reduce_scatter_tensor", "mpi-reduce-scatter", "Reduce_scatter_block"),
       ("barrier", "mpi-barrier", "Barrier"))


# --- rank side --------------------------------------------------------------------------

def _timed(fn, warm: int, iters: int, probe=None) -> list[float]:
    """Per-iteration ns of ``fn`` after ``warm`` calls and a barrier; ``probe`` (if
    given) is called right after the barrier and right after the last call."""
    import torch.distributed as dist

    for _ in range(warm):
        fn()
    dist.barrier()
    if probe is not None:
        probe()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    if probe is not None:
        probe()
    return out


def _worker(backend: str, rank: int, world: int, port: int, plan: list[tuple[int, int, int]],
            ddp_steps: int, out: str, flags: set[str]) -> None:
    """One rank: per size, dist.all_reduce (+ the engine call under it on flodl_shm unless
    ``"no-engine"`` in flags); with ``"tcp"``, every TCP connection's kernel counters
    before and after each timed loop go to the output (``"tcp"``: one pair per row)."""
    import torch
    import torch.distributed as dist

    importlib.import_module("flodl_shm")  # registers the backend
    from flodl_shm.frame import RoundKind

    torch.set_num_threads(next((int(f.split("=")[1]) for f in flags if f.startswith("threads=")),
                               1))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    rows, tcp = [], []
    probe = (lambda: tcp[-1].append(tcp_connections())) if "tcp" in flags else None
    for nbytes, warm, iters in plan:
        t = tensor_buffer(nbytes // 4, float(rank + 1), "4k")  # the MPI peer's pages too

        def reset_and_check() -> bool:
            t.fill_(float(rank + 1))
            dist.all_reduce(t)
            return bool((t == world * (world + 1) / 2).all())

        ok = reset_and_check()
        if backend == "flodl_shm" and "no-engine" not in flags:
            # the wrapper and the engine call under it in alternating blocks, so neither
            # is favoured by when it ran (the machine's state drifts within a run)
            comm = dist.group.WORLD.comm
            t.fill_(float(rank + 1))
            comm.all_reduce_([t], kind=RoundKind.CONTROL)
            ok_engine = bool((t == world * (world + 1) / 2).all())
            wrapped, bare = [], []
            blocks = max(1, min(4, iters // 5))
            for k in range(blocks):
                part = iters // blocks + (1 if k < iters % blocks else 0)
                wrapped += _timed(lambda: dist.all_reduce(t), warm if k == 0 else 1, part)
                bare += _timed(lambda: comm.all_reduce_([t], kind=RoundKind.CONTROL),
                               warm if k == 0 else 1, part)
            rows.append((f"{backend}", nbytes, wrapped, ok))
            rows.append(("engine", nbytes, bare, ok_engine))
        else:
            tcp.append([])
            times = _timed(lambda: dist.all_reduce(t), warm, iters, probe)
            rows.append((f"{backend}", nbytes, times, ok))
        t = None  # drop the buffer before the next size's
    ops_max = next((int(f.split("=")[1]) for f in flags if f.startswith("ops=")), 0)
    for nbytes, warm, iters in plan:
        if nbytes <= ops_max:
            rows += _op_rows(backend, rank, world, nbytes, warm, iters)
    if ops_max:
        warm, iters = plan[0][1:]
        rows.append((f"{backend} barrier", plan[0][0], _timed(dist.barrier, warm, iters), True))
    ddp = None
    if ddp_steps:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(), torch.nn.Linear(2048, 1024), torch.nn.ReLU(),
            torch.nn.Linear(1024, 1024))
        params = sum(p.numel() for p in model.parameters())
        model = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 1024), torch.randn(32, 1024)

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        times = _timed(step, 2, ddp_steps)
        # the same step without communication: what DDP adds on this backend
        with model.no_sync():
            local = _timed(step, 1, ddp_steps)
        ddp = {"params": params, "times": times, "local": local}
    sparse = None
    calls = next((int(f.split("=")[1]) for f in flags if f.startswith("sparse=")), 0)
    if calls:
        import warnings

        warnings.filterwarnings("ignore", message="Sparse invariant checks")  # (torch's note)
        g = torch.Generator().manual_seed(rank)
        touched = torch.randint(0, 10_000, (1, 2_000), generator=g)
        values = torch.randn(2_000, 64, generator=g)
        sparse = _timed(lambda: dist.all_reduce(
            torch.sparse_coo_tensor(touched, values, (10_000, 64))), 2, calls)
    with open(out, "w") as f:
        json.dump({"rows": rows, "ddp": ddp, "tcp": tcp if probe else None,
                   "sparse": sparse}, f)
    dist.destroy_process_group()


def _op_rows(backend: str, rank: int, world: int, nbytes: int, warm: int, iters: int
             ) -> list[tuple]:
    """The other c10d ops at ``nbytes``, each with a check of its result: ``broadcast``
    from rank 0, ``all_gather_into_tensor`` of ``nbytes / world`` a rank into ``nbytes``,
    ``reduce_scatter_tensor`` (SUM) of ``nbytes`` into ``nbytes / world`` a rank (the
    OpenMPI peers' shapes, ``bench_allreduce._mpi_op_rows``)."""
    import torch
    import torch.distributed as dist

    # (torch 2.13 names them all_gather_single / reduce_scatter_single, and warns at every
    # call of the older names)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    n = nbytes // 4
    part = n // world
    total = float(world * (world + 1) // 2)
    rows = []
    got = tensor_buffer(n, 1.0 if rank == 0 else 0.0, "4k")
    times = _timed(lambda: dist.broadcast(got, src=0), warm, iters)
    rows.append((f"{backend} broadcast", nbytes, times, bool((got == 1.0).all())))
    mine = tensor_buffer(part, float(rank + 1), "4k")
    gathered = tensor_buffer(part * world, 0.0, "4k")
    times = _timed(lambda: gather(gathered, mine), warm, iters)
    want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(part)
    rows.append((f"{backend} all_gather_into_tensor", nbytes, times,
                 bool(torch.equal(gathered, want))))
    whole = tensor_buffer(part * world, float(rank + 1), "4k")
    scattered = tensor_buffer(part, 0.0, "4k")
    times = _timed(lambda: scatter(scattered, whole), warm, iters)
    rows.append((f"{backend} reduce_scatter_tensor", nbytes, times,
                 bool((scattered == total).all())))
    return rows


# --- launcher side ------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(backend: str, world: int, plan: list[tuple[int, int, int]], ddp_steps: int,
              timeout: float, hosts: int = 1, flags: tuple[str, ...] = ()) -> list[dict] | None:
    """Start one group of ``world`` rank processes (``_worker``) over tcp://127.0.0.1 and
    return each rank's output, or None (after saying why on stderr) if a rank failed or
    the group outlived ``timeout`` s (then every rank is killed). ``plan``: (nbytes,
    warm, iters) per size. ``hosts`` > 1 splits the ranks into that many simulated hosts:
    consecutive ranks, ``FLODL_SHM_HOST=sim<h>`` (rank r is on host r * hosts // world)."""
    port = _free_port()
    spec = ",".join(f"{n}:{w}:{i}" for n, w, i in plan)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"r{r}.json") for r in range(world)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        env.pop("FLODL_SHM_HOST", None)
        # each rank in a session of its own: a Ctrl-C reaches this process only, which
        # then gives every rank one SIGINT and time to leave (stop_child)
        procs = []
        deadline = time.monotonic() + timeout
        try:
            for r in range(world):
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--worker", backend, str(r),
                     str(world), str(port), spec, str(ddp_steps), outs[r],
                     ",".join(flags) or "-"],
                    env=dict(env, FLODL_SHM_HOST=f"sim{r * hosts // world}") if hosts > 1
                    else env, start_new_session=True))
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException as e:
            # interrupted: one SIGINT each, then up to 30 s to leave; timed out: killed
            interrupted = not isinstance(e, subprocess.TimeoutExpired)
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGINT if interrupted else signal.SIGKILL)
            stop = time.monotonic() + 30
            for q in procs:
                stop_child(q, None, grace=max(0.1, stop - time.monotonic()))
            if interrupted:
                raise
            print(f"  {backend} world {world}: timed out after {timeout:.0f} s",
                  file=sys.stderr)
            return None
        if any(p.returncode for p in procs) or not all(os.path.exists(o) for o in outs):
            print(f"  {backend} world {world}: a rank failed", file=sys.stderr)
            return None
        return [json.load(open(o)) for o in outs]


def run_backend(backend: str, world: int, sizes: list[int], scale: float, ddp_steps: int,
                timeout: float, hosts: int = 1, sparse_calls: int = 0, threads: int = 1,
                ops_max: int = 0) -> tuple[list[dict], dict | None]:
    """One group of ``world`` ranks (``run_ranks``); ``hosts`` > 1 keeps only the
    flodl_shm rows, reported as ``flodl_shm/<hosts>h``. With ``sparse_calls``, the DDP
    figures (a dict even without DDP) carry the sparse all-reduce's median too. With
    ``ops_max``, the other ops' rows (``_op_rows``, a barrier) up to that many bytes."""
    plan = [(n, *schedule(n, world, scale)) for n in sizes]
    flags = ((f"threads={threads}",) + ((f"sparse={sparse_calls}",) if sparse_calls else ())
             + ((f"ops={ops_max}",) if ops_max else ()))
    per_rank = run_ranks(backend, world, plan, ddp_steps, timeout, hosts, flags)
    if per_rank is None:
        return [], None
    rows = collect([r["rows"] for r in per_rank], world)
    if hosts > 1:
        rows = [dict(r, method=f"{r['method']}/{hosts}h") for r in rows
                if r["method"] == "flodl_shm"]
    ddp = None
    if per_rank[0]["ddp"] is not None:
        step = np.max(np.stack([r["ddp"]["times"] for r in per_rank]), axis=0)
        local = np.max(np.stack([r["ddp"]["local"] for r in per_rank]), axis=0)
        ddp = {"backend": backend, "world": world, "params": per_rank[0]["ddp"]["params"],
               "step_ms": float(np.median(step)) / 1e6,
               "local_ms": float(np.median(local)) / 1e6}
    if per_rank[0].get("sparse"):
        ddp = ddp or {"backend": backend, "world": world}
        ddp["sparse_ms"] = float(np.median(np.max(np.stack(
            [r["sparse"] for r in per_rank]), axis=0))) / 1e6
    return rows, ddp


def _cell(r: dict | None, ref: dict | None) -> str:
    if r is None:
        return "—"
    s = f"{r['median_us']:,.0f} µs" if r["median_us"] >= 100 else f"{r['median_us']:,.1f} µs"
    if not r["correct"]:
        s += " (WRONG)"
    if ref is not None and r is not ref:
        s += f" ({r['median_us'] / ref['median_us']:.2f}×)"
    return s


def _op_row(results: list[dict], world: int, backend: str, op: str, nbytes: int
            ) -> dict | None:
    """The row of ``op`` on ``backend`` (``all_reduce``: the main table's row)."""
    method = backend if op == "all_reduce" else f"{backend} {op}"
    return next((r for r in results if r["world"] == world and r["method"] == method
                 and r["bytes"] == nbytes), None)


def ops_report(results: list[dict], worlds: list[int]) -> str:
    """The ops table of each world: every op of ``OPS`` on flodl_shm and gloo, with the
    ratio to its OpenMPI peer measured in the same run."""
    lines = []
    for world in worlds:
        rows = [r for r in results if r["world"] == world]
        if not any(r["method"].startswith("flodl_shm ") for r in rows):
            continue
        lines += [f"\n### world {world}: the collectives, float32 (median of max-over-ranks; "
                  f"× = ratio to the OpenMPI peer in the same run)\n",
                  "| op | size | flodl_shm | gloo | OpenMPI peer |", "|---|---:|---:|---:|---:|"]
        for op, peer, label in OPS:
            # (all_reduce: at the sizes of the others, from the main table's rows)
            mine = "flodl_shm broadcast" if op == "all_reduce" else f"flodl_shm {op}"
            sizes = sorted({r["bytes"] for r in rows if r["method"] == mine})
            for nbytes in sizes:
                ref = next((r for r in rows if r["method"] == peer and r["bytes"] == nbytes),
                           None)
                cells = [_cell(_op_row(results, world, b, op, nbytes), ref)
                         for b in ("flodl_shm", "gloo")]
                peer_cell = "—" if ref is None else f"{ref['median_us']:,.1f} µs {label}"
                size = "—" if op == "barrier" else human(nbytes)
                lines.append(f"| `{op}` | {size} | " + " | ".join(cells) + f" | {peer_cell} |")
    return "\n".join(lines)


def report(results: list[dict], ddps: list[dict], worlds: list[int]) -> str:
    lines = []
    for world in worlds:
        rows = [r for r in results if r["world"] == world]
        methods = [m for m in ("flodl_shm", "engine", "gloo", "mpi")
                   if any(r["method"] == m for r in rows)]
        methods += sorted({r["method"] for r in rows if "/" in r["method"]})
        lines += [f"\n### world {world}: dist.all_reduce, float32 SUM (median; × = ratio to "
                  f"gloo, engine column: ratio of flodl_shm to the bare engine)\n",
                  "| size | " + " | ".join(methods) + " |",
                  "|---:|" + "---:|" * len(methods)]
        for nbytes in sorted({r["bytes"] for r in rows}):
            by = {r["method"]: r for r in rows if r["bytes"] == nbytes}
            cells = []
            for m in methods:
                if m == "engine" and "engine" in by and "flodl_shm" in by:
                    e = by["engine"]
                    cells.append(f"{e['median_us']:,.0f} µs (flodl_shm "
                                 f"{by['flodl_shm']['median_us'] / e['median_us']:.2f}×)")
                else:
                    cells.append(_cell(by.get(m), by.get("gloo")))
            lines.append(f"| {human(nbytes)} | " + " | ".join(cells) + " |")
    sparse = [d for d in ddps if "sparse_ms" in d]
    if sparse:
        lines += ["\n### dist.all_reduce of a sparse COO tensor (an embedding's gradient: "
                  "10,000 x 64 float32, 2,000 rows per rank), median\n",
                  "| world | backend | all_reduce |", "|---:|---|---:|"]
        for d in sparse:
            gloo = next((g for g in sparse if g["backend"] == "gloo" and g["world"] == d["world"]),
                        None)
            ratio = (f" ({d['sparse_ms'] / gloo['sparse_ms']:.2f}× gloo)"
                     if gloo and d is not gloo else "")
            lines.append(f"| {d['world']} | {d['backend']} | {d['sparse_ms']:.2f} ms{ratio} |")
    ddps = [d for d in ddps if "step_ms" in d]
    if ddps:
        lines += ["\n### DDP step (forward + backward + all-reduce + SGD), median\n",
                  "| world | params | backend | step | same step without comm (no_sync) |",
                  "|---:|---:|---|---:|---:|"]
        for d in ddps:
            gloo = next((g for g in ddps if g["backend"] == "gloo" and g["world"] == d["world"]),
                        None)
            ratio = f" ({d['step_ms'] / gloo['step_ms']:.2f}× gloo)" if gloo and d is not gloo \
                else ""
            lines.append(f"| {d['world']} | {d['params'] / 1e6:.1f} M | {d['backend']} | "
                         f"{d['step_ms']:.1f} ms{ratio} | {d['local_ms']:.1f} ms |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__.split("\n\n")[0] + "\n\nThe default run (worlds 2 and 4, up to "
                "256 MiB, DDP) takes about 5-10 minutes on a 2-core host; --max-size 16MiB "
                "--worlds 2 --iter-scale 0.5 about one.")
    ap.add_argument("--worlds", type=comma_list(positive_int, "world"), default="2,4",
                    help="comma-separated world sizes")
    ap.add_argument("--max-size", type=byte_size, default="256MiB",
                    help="largest buffer of 4KiB, 64KiB, 1MiB, 4MiB, 16MiB, 64MiB, 256MiB "
                         "(KiB/MiB/GiB binary, KB/MB/GB decimal)")
    ap.add_argument("--iter-scale", type=positive_float, default=1.0,
                    help="scale the iteration counts")
    ap.add_argument("--ddp-steps", type=nonneg_int, default=10, help="timed DDP steps (0: skip)")
    ap.add_argument("--sparse-calls", type=nonneg_int, default=30,
                    help="timed sparse all_reduce calls (0: skip)")
    ap.add_argument("--threads", type=positive_int, default=1,
                    help="torch threads per rank (1: one core's worth each, as torchrun sets)")
    ap.add_argument("--ops-max-size", type=byte_size, default="4MiB",
                    help="time the other collectives (broadcast, all_gather_into_tensor, "
                         "reduce_scatter_tensor, barrier) against their OpenMPI peers at the "
                         "sizes up to this one")
    ap.add_argument("--no-ops", action="store_true", help="skip the other collectives")
    ap.add_argument("--no-mpi", action="store_true", help="skip OpenMPI")
    ap.add_argument("--hosts", type=positive_int, default=2,
                    help="also run flodl_shm split into this many simulated hosts (FLODL_SHM_HOST) "
                         "for worlds it divides, hierarchical through gloo (1: skip)")
    ap.add_argument("--json", type=out_file, help="also write the raw results here (one JSON)")
    ap.add_argument("--timeout", type=positive_float, default=1800, help="per group, seconds")
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        b, r, w, port, spec, steps, out, flags = args.worker
        plan = [tuple(int(x) for x in item.split(":")) for item in spec.split(",")]
        _worker(b, int(r), int(w), int(port), plan, int(steps), out, set(flags.split(",")))
        return 0
    worlds = args.worlds
    limit = args.max_size
    sizes = [s for s in DEFAULT_SIZES if s <= limit]
    if not sizes:
        ap.error(f"--max-size {human(limit)} is below the smallest size, "
                 f"{human(DEFAULT_SIZES[0])}; give {human(DEFAULT_SIZES[0])} or more")
    ops_max = 0 if args.no_ops else args.ops_max_size
    mpi_ok, why = (False, "--no-mpi") if args.no_mpi else mpi_available()
    if not mpi_ok:
        print(f"OpenMPI skipped: {why}", file=sys.stderr)
    results, ddps, failed = [], [], []
    for world in worlds:
        for backend in ("flodl_shm", "gloo"):
            print(f"running {backend}, world {world} ...", file=sys.stderr, flush=True)
            rows, ddp = run_backend(backend, world, sizes, args.iter_scale, args.ddp_steps,
                                    args.timeout, sparse_calls=args.sparse_calls,
                                    threads=args.threads, ops_max=ops_max)
            if not rows:
                failed.append(f"{backend} world {world}")
            results += rows
            if ddp is not None:
                ddps.append(ddp)
        if args.hosts > 1 and world % args.hosts == 0 and world > args.hosts:
            print(f"running flodl_shm as {args.hosts} hosts, world {world} ...", file=sys.stderr,
                  flush=True)
            results += run_backend("flodl_shm", world, sizes, args.iter_scale, 0, args.timeout,
                                   hosts=args.hosts)[0]
        if mpi_ok:
            print(f"running OpenMPI, world {world} ...", file=sys.stderr, flush=True)
            rows, why = bench_mpi(world, sizes, args.iter_scale, ops_max=ops_max)
            results += rows
            if why:
                failed.append(f"OpenMPI world {world} (rows missing)")
    print(f"cores: {available_cores()}, load average: {os.getloadavg()[0]:.1f}")
    print(report(results, ddps, worlds))
    if ops_max:
        print(ops_report(results, worlds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"allreduce": results, "ddp": ddps}, f, indent=1)
    if failed:
        print(f"bench_c10d: no figures for {', '.join(failed)} (see the messages above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_main(main, quiet="--worker" in sys.argv)
