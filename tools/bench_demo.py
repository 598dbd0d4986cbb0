"""The demo's training loop: wall time and the share spent averaging, flodl_shm vs gloo.

    python tools/bench_demo.py                 # 3 repeats of every variant (~1-2 min)
    python tools/bench_demo.py --repeats 5 --json demo_bench.jsonl
    python tools/bench_demo.py --overhead      # LocalSGD.sync vs all_reduce_, one rank
    python tools/bench_demo.py --ranks 1 --only "flodl_shm demo,flodl_shm loop"
                                               # what the Trainer's window adds, no peer
    python tools/bench_demo.py --big-model     # LocalSGD sync of a 64 MiB model vs memcpy,
                                               # the parameters shared, private, copied

Every variant trains the demo's recipe (``flodl_shm.cli.demo``: MLP 64-128-10 on
scikit-learn digits, batch 32, SGD lr 0.05 momentum 0.9, 30 epochs, seed 42) on 2
ranks of this host (one thread each) that average their weights every 8 batches:

  one process        the same model, optimizer and samples in one process, no averaging
                     (``flodl_shm.cli.demo.train_one_process``): the floor
  flodl_shm demo     ``flodl_shm.cli.demo.run_demo`` as ``python -m flodl_shm demo`` runs it
                     (the Trainer: one params round per window that carries the
                     ranks' counts; checkpoints every 20 windows), without progress bar
                     and with the test accuracy evaluated at the end only
  flodl_shm loop     a plain local-SGD loop: each rank trains its 8 batches, then
                     ``comm.all_reduce_(params)`` (one shared-memory round per window)
  flodl_shm LocalSGD the same loop with ``flodl_shm.LocalSGD``: ``step(samples)`` after
                     every batch, ``sync()`` per window (the realized-work weighted
                     consensus: one round carrying the weights); the last line of
                     the output is its per-window time over the bare ``all_reduce_``'s
  gloo loop          the same loop with ``torch.distributed`` gloo over 127.0.0.1: one
                     ``dist.all_reduce`` of the flattened params, then ``div_``
  gloo per-param     the same with one ``dist.all_reduce`` per parameter tensor, as a
                     plain DDP-less script averages a model

The loops dispatch the data like the Trainer: each epoch a permutation shared by the
ranks, cut into windows of 2 x 8 batches (the epoch's tail window split evenly).

What is measured, per variant, median over the repeats (interleaved):
  total s      launch to results in the launcher (process start, imports, training)
  loop s       the ranks' training loop, first batch to last average (slowest rank)
  averaging s  the time the ranks spend in the averaging calls, waits for the peer
               included (mean over ranks); for the demo: each window's time outside
               the rank's own batches (the round and the coordinator's bookkeeping)
  share        averaging s / loop s
  per window   median time of one window's averaging
  accuracy     test accuracy of the final (averaged) model
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import out_file, parser, positive_int, run_main  # noqa: E402
from flodl_shm.engine.hostcpu import available_cores  # noqa: E402

EPOCHS, BATCH, SYNC_EVERY, SEED, WORLD = 30, 32, 8, 42, 2


# --- the shared loop ----------------------------------------------------------------------


def _windows(n_samples: int, epochs: int, batch: int, sync_every: int, world: int, seed: int):
    """Per window: each rank's list of sample-index batches (the Trainer's dispatch)."""
    nb = n_samples // batch
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        perm = rng.permutation(n_samples)
        batches = [perm[b * batch:(b + 1) * batch] for b in range(nb)]
        step = world * sync_every
        for w in range(0, nb, step):
            chunk = batches[w:w + step]
            yield [list(part) for part in np.array_split(np.arange(len(chunk)), world)], chunk


def _train_loop(rank: int, world: int, make_average, xtr, ytr, xte, yte, epochs: int):
    """Train ``rank``'s share of every window, then ``average(params)``; returns the
    loop's figures. ``make_average(model)`` returns ``(average, on_step)``: the window's
    averaging call and a callable run after every optimizer step (or None)."""
    import torch

    from flodl_shm.cli.demo import accuracy, cross_entropy, make_model, make_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    model = make_model()
    params = [p.detach() for p in model.parameters()]
    average, on_step = make_average(model)
    average(params)  # align the replicas (every rank built the same init anyway) and warm up
    opt = make_optimizer(model.parameters())
    sync_s, per_window = 0.0, []
    t0 = time.perf_counter()
    for parts, chunk in _windows(len(xtr), epochs, BATCH, SYNC_EVERY, world, SEED):
        for b in parts[rank]:
            idx = torch.from_numpy(chunk[b])
            opt.zero_grad(set_to_none=True)
            cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
            if on_step is not None:
                on_step()
        s = time.perf_counter()
        with torch.no_grad():
            average(params)
        dt = time.perf_counter() - s
        sync_s += dt
        per_window.append(dt)
    loop_s = time.perf_counter() - t0
    return {"loop_s": loop_s, "avg_s": sync_s, "window_ms": statistics.median(per_window) * 1e3,
            "windows": len(per_window),
            "accuracy": accuracy(model, xte, yte) if rank == 0 else None}


def _shm_worker(ctx, data, epochs):
    comm = ctx.comm

    def average(params):
        comm.all_reduce_(params)

    return _train_loop(ctx.rank, ctx.world_size, lambda model: (average, None), *data, epochs)


def _local_sgd_worker(ctx, data, epochs):
    from flodl_shm import LocalSGD

    def make_average(model):
        # construction aligns the replicas; the loop syncs once per window explicitly
        sgd = LocalSGD(model, sync_every=1 << 30, comm=ctx.comm)
        return (lambda params: sgd.sync()), (lambda: sgd.step(samples=BATCH))

    return _train_loop(ctx.rank, ctx.world_size, make_average, *data, epochs)


def _gloo_worker(rank, world, init, data, epochs, flat, queue):
    # a Ctrl-C is the launcher's to handle (it kills this process); no traceback here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    def average(params):
        if flat:
            buf = torch.cat([p.reshape(-1) for p in params])
            dist.all_reduce(buf)
            buf.div_(world)
            off = 0
            for p in params:
                p.copy_(buf[off:off + p.numel()].view_as(p))
                off += p.numel()
        else:
            for p in params:
                dist.all_reduce(p)
                p.div_(world)

    try:
        queue.put((rank, _train_loop(rank, world, lambda model: (average, None), *data,
                                     epochs)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --- variants -----------------------------------------------------------------------------


def run_one_process(data, epochs, world) -> dict:
    from flodl_shm.cli.demo import train_one_process

    t0 = time.perf_counter()
    acc, loop_s = train_one_process(epochs, BATCH, SEED)
    return {"total_s": time.perf_counter() - t0, "loop_s": loop_s, "avg_s": 0.0,
            "window_ms": 0.0, "accuracy": acc}


def run_demo_variant(data, epochs, world) -> dict:
    from flodl_shm.cli.demo import DemoConfig, run_demo

    with tempfile.TemporaryDirectory(prefix="flodl_bench_demo_") as d:
        cfg = DemoConfig(epochs=epochs, run_dir=d, progress=False, log_every=0, eval_every=0,
                         plot=False, seed=SEED, nprocs=world)
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            res = run_demo(cfg)
        total = time.perf_counter() - t0
    hist = res.train.history
    outside = [s.window_ms - s.compute_ms for s in hist]
    return {"total_s": total, "loop_s": sum(s.window_ms for s in hist) / 1e3,
            "avg_s": sum(outside) / 1e3, "window_ms": statistics.median(outside),
            "reduce_ms": statistics.median(s.sync_ms for s in hist),
            "averaging_ms": statistics.median(s.averaging_ms for s in hist),
            "accuracy": res.accuracy}


def _fold(per_rank: list[dict], total_s: float) -> dict:
    return {"total_s": total_s, "loop_s": max(r["loop_s"] for r in per_rank),
            "avg_s": statistics.mean(r["avg_s"] for r in per_rank),
            "window_ms": max(r["window_ms"] for r in per_rank),
            "window_ms_rank0": per_rank[0]["window_ms"],
            "accuracy": next(r["accuracy"] for r in per_rank if r["accuracy"] is not None)}


def _run_spawned(worker, data, epochs, world) -> dict:
    from flodl_shm import spawn

    t0 = time.perf_counter()
    per_rank = spawn(worker, world, (data, epochs), timeout=300)
    return _fold(per_rank, time.perf_counter() - t0)


def run_shm_loop(data, epochs, world) -> dict:
    return _run_spawned(_shm_worker, data, epochs, world)


def run_local_sgd(data, epochs, world) -> dict:
    return _run_spawned(_local_sgd_worker, data, epochs, world)


def _run_gloo(data, epochs, world, flat: bool) -> dict:
    import multiprocessing as mp

    from _bench_common import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, init, data, epochs, flat, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(60)
        total = time.perf_counter() - t0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"gloo workers exited with {[p.exitcode for p in procs]}")
    return _fold([got[r] for r in range(world)], total)


def run_gloo_flat(data, epochs, world) -> dict:
    return _run_gloo(data, epochs, world, True)


def run_gloo_per_param(data, epochs, world) -> dict:
    return _run_gloo(data, epochs, world, False)


VARIANTS = {
    "one process": run_one_process,
    "flodl_shm demo": run_demo_variant,
    "flodl_shm loop": run_shm_loop,
    "flodl_shm LocalSGD": run_local_sgd,
    "gloo loop": run_gloo_flat,
    "gloo per-param": run_gloo_per_param,
}


def window_overhead(calls: int = 2000, repeats: int = 5) -> tuple[float, float]:
    """Per-call cost with no peer to wait for (one rank, in this process): a LocalSGD sync
    of the demo's model against one ``comm.all_reduce_`` of the same parameters, in
    interleaved blocks of ``calls``; returns the fastest block of each (µs: the least
    disturbed by other load on the host)."""
    import torch

    from flodl_shm import LocalSGD
    from flodl_shm.cli.demo import make_model
    from flodl_shm.testing import FakeCohort

    torch.set_num_threads(1)
    with FakeCohort(1) as cohort:
        comm = cohort.comm(0)
        model = make_model()
        params = [p.detach() for p in model.parameters()]
        sgd = LocalSGD(model, sync_every=1 << 30, comm=comm)
        lsgd, bare = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                sgd.step(samples=BATCH)
                sgd.sync()
            lsgd.append((time.perf_counter() - t0) / calls * 1e6)
            t0 = time.perf_counter()
            with torch.no_grad():
                for _ in range(calls):
                    comm.all_reduce_(params)
            bare.append((time.perf_counter() - t0) / calls * 1e6)
    return min(lsgd), min(bare)


def _big_model_worker(ctx, nbytes: int, syncs: int, shared: bool):
    """One rank of ``big_model_sync``: per sync, the slowest rank's time comes from the
    launcher's fold; memcpy of the same bytes in this rank, same run."""
    import torch

    from flodl_shm import LocalSGD

    torch.set_num_threads(1)
    width = 2048
    layers = max(1, nbytes // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    sgd = LocalSGD(model, sync_every=1 << 30, comm=ctx.comm, shared_params=shared)
    params = sum(p.numel() for p in model.parameters()) * 4
    times, copies = [], []
    src = torch.ones(params // 4)
    dst = torch.empty_like(src)
    for _ in range(syncs + 2):
        ctx.comm.barrier()
        sgd.step(samples=BATCH)
        t0 = time.perf_counter()
        sgd.sync()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    return (params, times[2:], copies[2:], ctx.comm._engine.direct.state,
            ctx.comm._engine.direct.mapped_rounds)


#: the parameters' placement, as ``--big-model`` compares them
BIG_MODEL_PATHS = {
    "shared parameter block (default)": ({}, None),
    "private parameters, direct round": ({}, False),
    "private parameters, shared-memory copies": ({"FLODL_SHM_DIRECT": "0"}, False),
}


def big_model_sync(nbytes: int = 64 << 20, syncs: int = 15, shared=None) -> dict:
    """LocalSGD averaging of a ``nbytes`` model (2048 x 2048 Linear layers) on 2 ranks:
    median over syncs of the slowest rank's ``sync()``, against one memcpy (torch
    ``copy_``) of the same bytes in the same ranks (median over ranks and syncs)."""
    from flodl_shm import spawn

    out = spawn(_big_model_worker, WORLD, (nbytes, syncs, shared))
    params = out[0][0]
    sync = statistics.median(max(r[1][i] for r in out) for i in range(syncs))
    copy = statistics.median(c for r in out for c in r[2])
    return {"bytes": params, "sync_ms": sync * 1e3, "memcpy_ms": copy * 1e3,
            "path": out[0][3], "mapped": out[0][4]}


def big_model_table(nbytes: int, repeats: int) -> str:
    """Every placement of ``BIG_MODEL_PATHS``, ``repeats`` interleaved runs each: the
    median sync over one memcpy, per run."""
    rows: dict[str, list[dict]] = {name: [] for name in BIG_MODEL_PATHS}
    for rep in range(repeats):
        names = list(BIG_MODEL_PATHS)
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            env, shared = BIG_MODEL_PATHS[name]
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                r = big_model_sync(nbytes, shared=shared)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
            rows[name].append(r)
            print(f"  {name:<42} sync {r['sync_ms']:6.2f} ms  memcpy {r['memcpy_ms']:6.2f} ms"
                  f"  {r['sync_ms'] / r['memcpy_ms']:.2f}x  (direct: {r['path']}, mapped "
                  f"rounds: {r['mapped']})", flush=True)
    size = rows[next(iter(rows))][0]["bytes"] / 2**20
    lines = [f"LocalSGD sync of a {size:.0f} MiB model, {WORLD} ranks, over one memcpy of it "
             f"(median of {repeats} runs; per run):"]
    for name, rs in rows.items():
        ratios = [r["sync_ms"] / r["memcpy_ms"] for r in rs]
        lines.append(f"  {name:<42} {statistics.median(ratios):.2f}x  "
                     f"({', '.join(f'{x:.2f}' for x in ratios)}); sync "
                     f"{statistics.median(r['sync_ms'] for r in rs):.2f} ms")
    return "\n".join(lines)


def table(results: dict[str, list[dict]]) -> str:
    def med(rows, key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else math.nan

    lines = ["| variant | total s | loop s | averaging s | share | per window | accuracy % |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, rows in results.items():
        loop, avg = med(rows, "loop_s"), med(rows, "avg_s")
        share = statistics.median(r["avg_s"] / r["loop_s"] for r in rows)
        per_w = med(rows, "window_ms")
        per_w = "-" if name == "one process" else (
            f"{per_w * 1e3:.0f} µs" if per_w < 1 else f"{per_w:.2f} ms")
        accs = sorted({round(r["accuracy"], 2) for r in rows})
        lines.append(f"| {name} | {med(rows, 'total_s'):.2f} | {loop:.2f} | {avg:.3f} | "
                     f"{share:.1%} | {per_w} | {', '.join(f'{a:.2f}' for a in accs)} |")
    return "\n".join(lines)


def _print_ratio(what: str, variant: list, loop: list, loop_key: str,
                 key: str = "window_ms") -> None:
    """The per-repeat ratio of ``variant``'s median window (its ``key``) to the bare
    loop's (its ``loop_key``), and their median."""
    ratios = [a[key] / b[loop_key] for a, b in zip(variant, loop)]
    spread = max(ratios) / min(ratios) if min(ratios) > 0 else math.inf
    noisy = (f"; the repeats differ {spread:.0f}-fold: the peer's scheduling, not the "
             f"window, sets this median (--ranks 1, or more --repeats)" if spread > 3 else "")
    print(f"{what}: median {statistics.median(ratios):.2f}x (per repeat: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}){noisy}")


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="interleaved repeats of every variant (the median is printed)")
    ap.add_argument("--epochs", type=positive_int, default=EPOCHS, help="training epochs")
    ap.add_argument("--only", help="comma-separated variants (default: all)")
    ap.add_argument("--ranks", type=positive_int, default=WORLD,
                    help=f"ranks of the training variants (default {WORLD}); with 1 a window "
                         f"has no peer to wait for, so the Trainer's ratio to the bare loop is "
                         f"what its window adds, without the peer's scheduling")
    ap.add_argument("--json", type=out_file,
                    help="append one JSON record per run to this file (JSONL)")
    ap.add_argument("--overhead", action="store_true",
                    help="only the per-call cost on one rank: LocalSGD.sync vs all_reduce_")
    ap.add_argument("--big-model", metavar="MIB", type=positive_int, nargs="?", const=64,
                    help="only LocalSGD averaging of a model of about MIB MiB (default 64; "
                         "whole 16 MiB layers, at least one) on 2 ranks against one memcpy "
                         "of it")
    args = ap.parse_args(argv)
    if args.big_model is not None:
        print(big_model_table(args.big_model << 20, args.repeats))
        return 0
    if args.overhead:
        lsgd, bare = window_overhead()
        print(f"one rank, no peer to wait for: LocalSGD step+sync {lsgd:.1f} µs, bare "
              f"comm.all_reduce_ of the same params {bare:.1f} µs: {lsgd / bare:.2f}x")
        return 0
    names = list(VARIANTS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")

    from flodl_shm.cli.demo import digits_split

    data = digits_split()
    results: dict[str, list[dict]] = {n: [] for n in names}
    load = os.getloadavg()[0]
    print(f"# {available_cores()} cores, load average {load:.2f}; {args.epochs} epochs, batch "
          f"{BATCH}, {args.ranks} ranks averaging every {SYNC_EVERY} batches; {args.repeats} "
          f"repeats, interleaved", flush=True)
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            r = VARIANTS[name](data, args.epochs, args.ranks)
            r.update(variant=name, repeat=rep)
            results[name].append(r)
            print(f"  {name:<15} total {r['total_s']:6.2f} s  loop {r['loop_s']:6.3f} s  "
                  f"averaging {r['avg_s']:6.3f} s  accuracy {r['accuracy']:.2f}%", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(r) + "\n")
    print(f"# load average at the end {os.getloadavg()[0]:.2f}\n")
    print(table(results))
    loop = results.get("flodl_shm loop")
    if loop and "flodl_shm LocalSGD" in results:
        _print_ratio("LocalSGD window / one bare all_reduce_ of the same params",
                     results["flodl_shm LocalSGD"], loop, "window_ms")
    if loop and "flodl_shm demo" in results:
        # the Trainer's history is its reporting rank's (rank 0): compare with rank 0's
        # median window of the bare loop
        _print_ratio("Trainer window (rank 0) / one bare all_reduce_ of the same params "
                     "(rank 0)", results["flodl_shm demo"], loop, "window_ms_rank0")
        _print_ratio("  its averaging part alone (end of training to settled books)",
                     results["flodl_shm demo"], loop, "window_ms_rank0", key="averaging_ms")
        _print_ratio("    of which its round (the params, the counts riding as its report)",
                     results["flodl_shm demo"], loop, "window_ms_rank0", key="reduce_ms")
    return 0


if __name__ == "__main__":
    run_main(main)
