"""Helpers shared by the all-reduce benchmarks (``bench_allreduce.py``, ``bench_cluster.py``).

One definition of a timed collective for every method: per iteration the time is
the MAX over ranks (the collective is done when the slowest rank is), then the
median over iterations. The gloo peer lives here so both benchmarks time it the
same way: ``dist.all_reduce`` (SUM) then ``div_(world)``, in one gloo group over
loopback, inside ``flodl_shm.spawn``.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import struct
import time

import numpy as np

KiB = 1 << 10
MiB = 1 << 20

#: the page kinds a run's buffers may sit on (``--pages``)
PAGES = ("4k", "huge")


def buffer(n: int, value: float, pages: str) -> np.ndarray:
    """``n`` float32 set to ``value``, in a mapping of its own on pages of the kind
    ``pages`` names (``flodl_shm.engine.tensor_codec.fresh_array``). Every peer of a run takes its buffers from here, so flodl_shm's
    tensors (``torch.from_numpy`` of one), OpenMPI's, gloo's and the memcpy's all sit on
    the same kind of page.

    It matters: a cross-memory copy (``process_vm_readv``, which OpenMPI's large
    messages and flodl_shm's direct rounds use) costs about twice as much on 4 KiB
    pages as on 2 MiB transparent huge pages, while a memcpy of resident memory barely
    changes. ``"4k"`` is what torch's allocator gives a tensor by default; ``"huge"`` is
    what numpy gives arrays of 4 MiB and more, and torch with ``THP_MEM_ALLOC_ENABLE=1``
    (where the kernel has huge pages to give)."""
    if pages not in PAGES:
        raise ValueError(f"pages must be one of {PAGES}, got {pages!r}")
    from flodl_shm.engine.tensor_codec import fresh_array

    a = fresh_array(n, np.float32, huge=pages == "huge")
    a.fill(value)  # faults the pages in, as advised
    return a


def tensor_buffer(n: int, value: float, pages: str):
    """:func:`buffer` as a torch tensor (sharing its memory)."""
    import torch

    return torch.from_numpy(buffer(n, value, pages))


def human(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def parse_size(s: str) -> int:
    """``"4MiB"``, ``"256KiB"``, ``"1GiB"`` or a plain byte count."""
    s = s.strip()
    for suf, mul in (("KiB", KiB), ("MiB", MiB), ("GiB", 1 << 30)):
        if s.endswith(suf):
            return int(float(s[:-len(suf)]) * mul)
    return int(s)


def summarize(method: str, world: int, nbytes: int, times_ns, ok: bool) -> dict:
    """Median / p10 / p90 / min (µs) and algorithmic bandwidth of per-iteration times."""
    t = sorted(float(x) for x in times_ns)
    med = statistics.median(t)
    return {"method": method, "world": world, "bytes": nbytes, "iters": len(t),
            "median_us": med / 1e3, "p10_us": t[int(0.1 * (len(t) - 1))] / 1e3,
            "p90_us": t[int(0.9 * (len(t) - 1))] / 1e3, "min_us": t[0] / 1e3,
            "algbw_GBps": nbytes / med, "correct": bool(ok)}


def collect(per_rank: list, world: int) -> list[dict]:
    """Fold rank results — each a list of ``(method, nbytes, times_ns, ok[, cpu_ns,
    tcp_bytes_sent])`` in the same order on every rank — into one summary per entry:
    per-iteration max over ranks; with the extras, ``cpu_ms_per_round`` sums the ranks'
    CPU time of the timed loop and ``sent_per_rank_round`` lists each rank's fresh TCP
    bytes sent per round."""
    out = []
    for i, (method, nbytes, times, *_) in enumerate(per_rank[0]):
        times = np.max(np.stack([np.asarray(r[i][2], np.float64) for r in per_rank]), axis=0)
        out.append(summarize(method, world, nbytes, times, all(r[i][3] for r in per_rank)))
        if len(per_rank[0][i]) > 4:
            cpu = sum(r[i][4] for r in per_rank) / 1e6 / len(times)
            out[-1]["cpu_ms_per_round"] = {"ranks": cpu}
        if len(per_rank[0][i]) > 5 and all(r[i][5] is not None for r in per_rank):
            out[-1]["sent_per_rank_round"] = [r[i][5] / len(times) for r in per_rank]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TCPI = {"bytes_acked": 120, "bytes_received": 128,   # struct tcp_info (linux/tcp.h): u64s
         "bytes_sent": 200, "bytes_retrans": 208}       # bytes_sent/_retrans: Linux >= 4.19


def tcp_connections() -> list[dict] | None:
    """The kernel's byte counters (TCP_INFO) of each of this process's established TCP
    connections: ``{"laddr": [ip, port], "raddr": [ip, port], **counters}``; None if
    TCP_INFO lacks the counters (Linux < 4.19). Two ends of one loopback connection
    pair up as ``a["laddr"] == b["raddr"] and a["raddr"] == b["laddr"]``."""
    import psutil

    out = []
    for c in psutil.Process().net_connections("tcp"):
        if not c.raddr or c.fd < 0 or c.status != psutil.CONN_ESTABLISHED:
            continue
        try:   # the fd may have closed (or been reused) since psutil listed it
            s = socket.socket(fileno=os.dup(c.fd))
        except OSError:
            continue
        try:
            if s.getsockname()[:2] != tuple(c.laddr) or s.getpeername()[:2] != tuple(c.raddr):
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        finally:
            s.close()
        if len(info) < max(_TCPI.values()) + 8:
            return None
        out.append({"laddr": list(c.laddr), "raddr": list(c.raddr),
                    **{k: struct.unpack_from("<Q", info, off)[0] for k, off in _TCPI.items()}})
    return out


def tcp_counters(match) -> dict | None:
    """The kernel's byte counters (TCP_INFO), summed over this process's established
    TCP connections ``c`` (``tcp_connections()``'s dicts) for which ``match(c)`` is true;
    None if there is none or TCP_INFO lacks the counters (Linux < 4.19)."""
    conns = tcp_connections()
    if conns is None:
        return None
    total, found = dict.fromkeys(_TCPI, 0), False
    for c in conns:
        if match(c):
            for k in _TCPI:
                total[k] += c[k]
            found = True
    return total if found else None


def gloo_worker(ctx, plan, init, pages="4k"):
    """A rank of the gloo peer. ``plan``: ``(nbytes, warm, iters)`` per size; buffers on
    ``pages`` (:func:`buffer`)."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init, rank=ctx.rank, world_size=ctx.world_size)
    world = ctx.world_size
    expected = (world + 1) / 2.0
    results = []
    try:
        for nbytes, warm, iters in plan:
            n = nbytes // 4
            t = tensor_buffer(n, float(ctx.rank + 1), pages)
            dist.all_reduce(t)
            t.div_(world)
            ok = bool(torch.all(t == expected))
            for _ in range(warm):
                dist.all_reduce(t)
                t.div_(world)
            times = np.empty(iters, np.float64)
            dist.barrier()
            tcp0 = tcp_counters(lambda c: True)   # every gloo connection of this rank
            cpu0 = time.process_time_ns()   # every thread of this rank, gloo's included
            for i in range(iters):
                t0 = time.perf_counter_ns()
                dist.all_reduce(t)
                t.div_(world)
                times[i] = time.perf_counter_ns() - t0
            cpu = time.process_time_ns() - cpu0
            tcp1 = tcp_counters(lambda c: True)
            sent = None if tcp0 is None or tcp1 is None else (
                tcp1["bytes_sent"] - tcp1["bytes_retrans"] - tcp0["bytes_sent"]
                + tcp0["bytes_retrans"])
            ok = ok and bool(torch.all(t == expected))
            results.append(("gloo", nbytes, times, ok, cpu, sent))
            del t
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return results


def bench_gloo(world: int, plan, pages: str = "4k") -> list[dict]:
    """gloo over loopback with ``world`` processes; one summary per ``plan`` entry."""
    from flodl_shm import spawn

    init = f"tcp://127.0.0.1:{free_port()}"
    per_rank = spawn(gloo_worker, world, (list(plan), init, pages), timeout=600)
    return collect(per_rank, world)


def append_json(path: str, records: list[dict]) -> None:
    """Append ``RESULT {json}`` lines (the format every benchmark here writes)."""
    with open(path, "a") as f:
        for r in records:
            f.write("RESULT " + json.dumps(r) + "\n")


def exit_code(results: list[dict]) -> int:
    """1 (after naming them) if any result is wrong, else 0."""
    bad = [(r["method"], r["world"], r["bytes"], *([r["error"]] if r.get("error") else []))
           for r in results if not r["correct"]]
    if bad:
        print(f"\nWRONG RESULTS: {bad}")
        return 1
    return 0
