"""Long runs: do a rank's and the launcher's resources stay flat?

Users trust flodl_shm with days of compute, so whatever a round, a sync, a save or a
whole ``spawn`` leaves behind must not pile up. This tool runs three short phases and
samples each process's resources as it goes:

- ``collectives``: 2 ranks run a mix of every ``Comm`` collective (``all_reduce_``,
  ``all_reduce_tensors``, ``broadcast_from_root``, ``broadcast_``, ``barrier``,
  ``all_reduce_per_rank_f64``) at 4 KiB and 1 MiB;
- ``local_sgd``: 2 ranks train a small model with ``LocalSGD`` + ``OuterNesterov``,
  save after every few syncs into one series, and now and then into a stem of its own
  (a run that saves each epoch apart): the warm-up block makes as many stems as
  ``LocalSGD`` keeps series locks for, so the descriptors have reached their bound;
- ``spawns``: the launcher runs many short ``spawn`` jobs, one after another, and keeps
  their ``join=False`` contexts;
- ``c10d``: 3 processes in a ``torch.distributed`` group of the ``"flodl_shm"`` backend,
  as two simulated hosts (ranks 0 and 1 on host a, rank 2 on host b: shared memory
  within a host, gloo between them) run a mix of collectives (``all_reduce`` waited,
  async and through its future, a MAX; ``broadcast``, ``all_gather_single``,
  ``reduce_scatter_single``, ``all_to_all_single``, ``all_gather_object``, ``barrier``),
  DDP steps of a model with a sparse embedding, and now and then a subgroup made, used
  and destroyed.

Per process it prints the open descriptors, memory mappings, threads and resident
memory at the first and the last sample (after a warm-up block), and the
``/dev/shm/fshm_*`` entries left at the end by this tool's processes (segments of
other live processes, another job's, are not its own and are only counted).
Descriptors, mappings and threads must not grow at all; resident memory is printed
as a slope (allocators keep a little).
Exit status 1 when a count grew or a segment was left, else 0::

    python tools/soak.py                 # about a minute on 2 cores
    python tools/soak.py --scale 10      # ten times the rounds, syncs and jobs
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flodl_shm  # noqa: E402
from flodl_shm.engine.segment import list_segments  # noqa: E402
from flodl_shm.training.local_sgd_state import SERIES_LOCKS_KEPT  # noqa: E402

COUNTS = ("fds", "maps", "threads")


def sample() -> dict:
    """This process's open descriptors, mappings, threads and resident KiB."""
    out = {"fds": len(os.listdir("/proc/self/fd"))}
    with open("/proc/self/maps") as f:
        out["maps"] = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    return out


def settled_sample(pause_s: float = 0.02, tries: int = 50) -> dict:
    """``sample()`` once the thread count stops falling: a thread that a ``spawn``
    joined can still be in its native exit for a moment after ``join`` returns."""
    last = sample()
    for _ in range(tries):
        time.sleep(pause_s)
        now = sample()
        if now["threads"] >= last["threads"]:
            return now
        last = now
    return last


def collectives(ctx, blocks: int, per_block: int) -> list[dict]:
    import torch

    comm = ctx.comm
    small, big = torch.randn(1024), torch.randn(256 * 1024)
    rows = []
    for b in range(blocks + 1):  # block 0 warms up
        for i in range(per_block):
            t = big if i % 16 == 0 else small
            op = i % 6
            if op == 0:
                comm.all_reduce_([t])
            elif op == 1:
                comm.all_reduce_tensors([t])
            elif op == 2:
                comm.broadcast_from_root([t], 0)
            elif op == 3:
                comm.broadcast_([t], 1)
            elif op == 4:
                comm.barrier()
            else:
                comm.all_reduce_per_rank_f64([float(i)] * ctx.world_size)
        rows.append(sample())
    return rows


def local_sgd(ctx, blocks: int, per_block: int, folder: str) -> list[dict]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sgd = flodl_shm.LocalSGD(model, sync_every=2, comm=ctx.comm, optimizer=opt,
                             outer=flodl_shm.OuterNesterov())
    g = torch.Generator().manual_seed(ctx.rank)
    rows = []
    syncs = 0
    stem_every = max(1, per_block // SERIES_LOCKS_KEPT)
    for b in range(blocks + 1):
        for _ in range(per_block):
            for _ in range(2):
                opt.zero_grad()
                x = torch.randn(16, 32, generator=g)
                torch.nn.functional.mse_loss(model(x), torch.zeros(16, 4)).backward()
                opt.step()
                sgd.step(samples=16)
            syncs += 1
            if syncs % 5 == 0:
                sgd.save(os.path.join(folder, "series", "ck"))
            if syncs % stem_every == 0:
                sgd.save(os.path.join(folder, f"epoch{syncs}", "ck"))
        rows.append(sample())
    return rows


def short_job(ctx) -> int:
    ctx.comm.barrier()
    return ctx.rank


def spawns(jobs: int, start_method: str) -> list[dict]:
    rows, kept = [], []
    for j in range(jobs + 1):
        ctx = flodl_shm.spawn(short_job, 2, join=False, start_method=start_method)
        ctx.join()
        kept.append(ctx)  # a sweep that keeps its contexts
        if j == 0 or j % max(1, jobs // 4) == 0:
            rows.append(settled_sample())
    return rows


C10D_HOSTS = ("a", "a", "b")  # the c10d phase's simulated host of each rank


def c10d_rank(rank: int, port: int, blocks: int, per_block: int, queue) -> None:
    """One rank of the ``c10d`` phase (a process of its own): its samples go to ``queue``."""
    os.environ["FLODL_SHM_HOST"] = C10D_HOSTS[rank]
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = len(C10D_HOSTS)
    torch.set_num_threads(1)
    dist.init_process_group("flodl_shm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.EmbeddingBag(200, 8, sparse=True),
                                        torch.nn.Linear(8, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        small, big = torch.randn(1024), torch.randn(64 * 1024)
        gathered = torch.empty(1024 * world)
        slices, sliced = torch.randn(256 * world), torch.empty(256)
        spread = torch.empty(96 * world)
        counts = torch.arange(8, dtype=torch.int64)
        objects: list = [None] * world
        rows = []
        for b in range(blocks + 1):  # block 0 warms up
            for i in range(per_block):
                op = i % 12
                t = big if i % 24 == 0 else small
                if op == 0:
                    dist.all_reduce(t)
                elif op == 1:
                    dist.all_reduce(t, async_op=True).wait()
                elif op == 2:
                    dist.all_reduce(t, async_op=True).get_future().wait()
                elif op == 3:
                    dist.broadcast(small, src=i % world)
                elif op == 4:
                    dist.all_gather_single(gathered, small)
                elif op == 5:
                    dist.reduce_scatter_single(sliced, slices)
                elif op == 6:
                    dist.all_to_all_single(spread, torch.ones(96 * world))
                elif op == 7:
                    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
                elif op == 8:
                    dist.all_gather_object(objects, {"rank": rank, "i": i})
                elif op == 9:
                    dist.barrier()
                elif op == 10:
                    opt.zero_grad(set_to_none=True)
                    x = torch.randint(0, 200, (16, 4), generator=g)
                    model(x).square().mean().backward()  # (a sparse and a dense gradient)
                    opt.step()
                elif i % 60 == 11:
                    sub = dist.new_group([0, 2])  # (a collective of every rank)
                    if rank != 1:
                        dist.all_reduce(small, group=sub)
                    dist.destroy_process_group(sub)
                small.mul_(1.0 / world)  # (stays finite)
            rows.append(sample())
        queue.put((rank, rows))
    finally:
        dist.destroy_process_group()


def c10d(blocks: int, per_block: int, timeout: float) -> list[list[dict]]:
    """The ``c10d`` phase: its ranks' samples, by rank."""
    import multiprocessing as mp
    from queue import Empty

    from _bench_common import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=c10d_rank, args=(r, port, blocks, per_block, queue))
             for r in range(len(C10D_HOSTS))]
    for p in procs:
        p.start()
    got: dict[int, list[dict]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < len(procs):
            try:
                rank, rows = queue.get(timeout=2.0)
                got[rank] = rows
                continue
            except Empty:
                pass
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"c10d phase: rank(s) {dead or sorted(set(range(len(procs))) - set(got))} "
                    f"{'exited' if dead else f'still running after {timeout:.0f} s'} without "
                    f"their samples (their output is above)")
    finally:
        for p in procs:  # (on a failure the others wait for the lost rank: stopped at once)
            p.join(timeout=30 if len(got) == len(procs) else 0)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(len(procs))]


def _segments() -> dict[str, int]:
    """Every ``fshm_`` segment in /dev/shm, with its owner's pid."""
    return {s.name: s.owner_pid for s in list_segments()}


def _ours_left(before: dict[str, int]) -> tuple[list[str], int]:
    """Segments made during the run that this tool's processes left: owned by this
    process or by one that is gone (its ranks, its rank servers); and how many new ones
    belong to other live processes (another job's, not ours)."""
    import psutil

    ours, others = [], 0
    for name, owner in _segments().items():
        if name in before:
            continue
        if owner == os.getpid() or not psutil.pid_exists(owner):
            ours.append(name)
        else:
            others += 1
    return sorted(ours), others


def verdict(name: str, rows: list[dict], unit: str, per: float) -> bool:
    """Print one process's first and last sample; True when no count grew."""
    first, last = rows[1] if len(rows) > 2 else rows[0], rows[-1]
    grew = [k for k in COUNTS if last[k] > first[k]]
    slope = (last["rss_kib"] - first["rss_kib"]) / per
    cells = "  ".join(f"{k} {first[k]}->{last[k]}" for k in COUNTS)
    print(f"  {name:<28} {cells}  rss {first['rss_kib'] / 1024:.1f}->"
          f"{last['rss_kib'] / 1024:.1f} MiB ({slope:+.2f} KiB per {unit})"
          f"{'  GREW: ' + ', '.join(grew) if grew else ''}")
    return not grew


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply the rounds, syncs and jobs (default 1: about a minute)")
    ap.add_argument("--dir", default=None,
                    help="folder for the phase's checkpoints (default: a temporary one)")
    args = ap.parse_args(argv)
    if not args.scale > 0:
        ap.error(f"--scale must be > 0, got {args.scale}")
    import tempfile

    blocks = 4
    rounds = max(60, int(3000 * args.scale))
    syncs = max(25, int(100 * args.scale))
    jobs = max(4, int(12 * args.scale))
    calls = max(60, int(600 * args.scale))
    ok = True
    before = set(_segments())
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        t0 = time.time()
        print(f"collectives: 2 ranks, {blocks} x {rounds} calls after a warm-up block")
        for r, rows in enumerate(flodl_shm.spawn(collectives, 2, args=(blocks, rounds))):
            ok &= verdict(f"rank {r}", rows, "1k calls", blocks * rounds / 1000)
        print(f"local_sgd: 2 ranks, {blocks} x {syncs} syncs, a save every 5, a new stem "
              f"every {max(1, syncs // SERIES_LOCKS_KEPT)}")
        for r, rows in enumerate(flodl_shm.spawn(local_sgd, 2, args=(blocks, syncs, folder))):
            ok &= verdict(f"rank {r}", rows, "100 syncs", blocks * syncs / 100)
        print(f"spawns: {jobs} jobs of 2 ranks in this launcher, every context kept")
        for method in ("forkserver", "spawn"):
            ok &= verdict(f"launcher ({method})", spawns(jobs, method), "job", jobs)
        print(f"c10d: 3 ranks on hosts {', '.join(C10D_HOSTS)}, {blocks} x {calls} calls "
              f"after a warm-up block")
        for r, rows in enumerate(c10d(blocks, calls, timeout=max(300.0, 60 * args.scale))):
            ok &= verdict(f"rank {r} (host {C10D_HOSTS[r]})", rows, "1k calls",
                          blocks * calls / 1000)
        left, others = _ours_left(before)
        print(f"/dev/shm segments left: {len(left)} {left[:4] if left else ''}"
              f"{f' (and {others} of other live processes, not ours)' if others else ''}; "
              f"{time.time() - t0:.0f} s")
        ok &= not left
    print("flat" if ok else "GREW: see the lines marked above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _bench_common import run_main

    run_main(main)
