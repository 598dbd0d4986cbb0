"""Across simulated hosts on loopback: flat gloo, hierarchical flodl_shm c10d, relay→controller.

    python tools/bench_c10d_hosts.py                              # 2 and 3 hosts × 2 ranks, 4-256 MiB
    python tools/bench_c10d_hosts.py --hosts 2 --max-size 16MiB   # quick

H simulated hosts × R ranks on 127.0.0.1 (consecutive ranks per host, ``FLODL_SHM_HOST=
sim<h>``); per size, an all-reduce of a float32 tensor of SIZE bytes per rank:

  gloo        ``dist.all_reduce`` (SUM) in one gloo group of all H·R ranks: flat, every
              rank talks to ranks of other hosts.
  flodl_shm   ``dist.all_reduce`` (SUM) on backend ``"flodl_shm"``: each host reduces through
              shared memory, the host leaders combine the partials in their gloo group,
              the result fans out (docs/c10d.md, "Hosts").
  controller  ``comm.all_reduce_`` (an average) in ``spawn(..., controller=...)`` hosts: each
              host's relay sends its host's partial to a ``ClusterController`` process and
              gets the consensus back (tools/bench_cluster.py's cohort, f32 wire; one
              cohort per size).

The gloo and flodl_shm rows come from tools/bench_c10d.py's rank worker. Every method
runs tools/bench_cluster.py's schedule (warm-up, iterations) times ``--iter-scale``.

Measured, nothing computed from a formula:
  round         per-iteration MAX over ranks, median over iterations (_bench_common).
  cross-host    bytes per host per round, up (sent) and down (received): the kernel's
                TCP counters (TCP_INFO bytes_sent − bytes_retrans, bytes_received) read
                in each process right after the barrier before the timed rounds and
                right after them, divided by the rounds. gloo / flodl_shm: each rank
                reads all its established connections; a connection whose other end
                (the mirrored address pair) is a rank of another host is cross-host
                traffic (the c10d store's connections included), summed over the host's
                ranks. controller: the relay's link to the controller (bench_cluster).
                The tables show the max over hosts and that ÷ SIZE.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import (MiB, byte_size, collect, comma_list, exit_code, human,  # noqa: E402
                           out_file, parser, positive_float, positive_int, run_main)
from bench_c10d import run_ranks  # noqa: E402
from bench_cluster import CohortFailed, bench_cohort, schedule  # noqa: E402
from flodl_shm.engine.hostcpu import available_cores  # noqa: E402

SIZES = [4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
METHODS = ["gloo", "flodl_shm", "controller"]
LABELS = {"gloo": "gloo, flat", "flodl_shm": "flodl_shm c10d, hierarchical",
          "controller": "relay → controller"}
_T0 = time.monotonic()


def _say(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:6.0f} s] {msg}", file=sys.stderr, flush=True)


def _key(c: dict) -> tuple:
    return tuple(c["laddr"]), tuple(c["raddr"])


def cross_host_bytes(per_rank: list[dict], row: int, hosts: int, iters: int) -> dict:
    """Fresh TCP bytes per round each host sent to / received from ranks of other hosts
    during row ``row``'s timed rounds, from the ranks' connection snapshots
    (bench_c10d's ``"tcp"``); rank r is on host r * hosts // world."""
    world = len(per_rank)
    owner = {}
    for r, out in enumerate(per_rank):
        for snap in out["tcp"][row]:
            for c in snap:
                owner[_key(c)] = r
    up, down, other = [0] * hosts, [0] * hosts, 0
    for r, out in enumerate(per_rank):
        before, after = out["tcp"][row]
        base = {_key(c): c for c in before}
        h = r * hosts // world
        for c in after:
            b = base.get(_key(c), dict.fromkeys(c, 0))
            sent = (c["bytes_sent"] - c["bytes_retrans"]) - (b["bytes_sent"] - b["bytes_retrans"])
            got = c["bytes_received"] - b["bytes_received"]
            laddr, raddr = _key(c)
            peer = owner.get((raddr, laddr))
            if peer is None:
                other += sent + got
            elif peer * hosts // world != h:
                up[h] += sent
                down[h] += got
    return {"up_per_host_round": [u / iters for u in up],
            "down_per_host_round": [d / iters for d in down],
            "unmatched_bytes": other}


def bench_c10d_hosts(backend: str, hosts: int, ranks: int, sizes: list[int], scale: float,
                     timeout: float) -> list[dict]:
    world = hosts * ranks
    plan = [(n, *schedule(n, scale)) for n in sizes]
    per_rank = run_ranks(backend, world, plan, 0, timeout, hosts=hosts,
                         flags=("tcp", "no-engine"))
    if per_rank is None:
        return [{"method": backend, "world": world, "hosts": hosts, "bytes": n,
                 "correct": False, "error": "the group failed (see stderr)"} for n in sizes]
    if any(out["tcp"] is None or None in (s for row in out["tcp"] for s in row)
           for out in per_rank):
        raise RuntimeError("TCP_INFO lacks the byte counters here (Linux >= 4.19 needed)")
    rows = collect([out["rows"] for out in per_rank], world)
    for i, (res, (_, _, iters)) in enumerate(zip(rows, plan)):
        res.update(hosts=hosts, **cross_host_bytes(per_rank, i, hosts, iters))
    return rows


def bench_controller(hosts: int, ranks: int, nbytes: int, scale: float) -> dict:
    try:
        res = bench_cohort(hosts, ranks, nbytes, scale, ["f32"])[0]
    except CohortFailed as e:
        return {"method": "controller", "world": hosts * ranks, "hosts": hosts, "bytes": nbytes,
                "correct": False, "error": str(e)}
    return dict(res, method="controller", up_per_host_round=res["wire_up_per_host_round"],
                down_per_host_round=res["wire_down_per_host_round"])


def table(results: list[dict], hosts: int, ranks: int) -> str:
    lines = [f"\n### {hosts} hosts × {ranks} ranks: float32 all-reduce of SIZE per rank\n",
             "| size | method | round (median) | × gloo | cross-host per host per round, "
             "up · down (MiB) | ÷ size |", "|---:|---|---:|---:|---:|---:|"]
    rows = [r for r in results if r["hosts"] == hosts]
    for nbytes in sorted({r["bytes"] for r in rows}):
        by = {r["method"]: r for r in rows if r["bytes"] == nbytes}
        gloo = by.get("gloo")
        for m in METHODS:
            r = by.get(m)
            if r is None:
                continue
            if "median_us" not in r:
                lines.append(f"| {human(nbytes)} | {LABELS[m]} | failed | | | |")
                continue
            ratio = (f"{r['median_us'] / gloo['median_us']:.2f}×"
                     if gloo and "median_us" in gloo and r is not gloo else "")
            up, down = max(r["up_per_host_round"]), max(r["down_per_host_round"])
            wrong = "" if r["correct"] else " (WRONG)"
            lines.append(f"| {human(nbytes)} | {LABELS[m]} | {r['median_us'] / 1e3:,.1f} ms"
                         f"{wrong} | {ratio} | {up / MiB:,.1f} · {down / MiB:,.1f} | "
                         f"{up / nbytes:.2f} · {down / nbytes:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--hosts", type=comma_list(positive_int, "host count"), default="2,3",
                    help="simulated host counts")
    ap.add_argument("--ranks", type=positive_int, default=2, help="ranks per host")
    ap.add_argument("--max-size", type=byte_size, default="256MiB",
                    help="largest size of 4, 16, 64, 256 MiB")
    ap.add_argument("--iter-scale", type=positive_float, default=0.5,
                    help="scale bench_cluster's iteration counts")
    ap.add_argument("--methods", default=",".join(METHODS), help="gloo,flodl_shm,controller")
    ap.add_argument("--timeout", type=positive_float, default=900,
                    help="per c10d group, seconds")
    ap.add_argument("--json", type=out_file, help="also write the raw results here (one JSON)")
    args = ap.parse_args(argv)
    limit = args.max_size
    sizes = [s for s in SIZES if s <= limit]
    if not sizes:
        ap.error(f"--max-size {human(limit)} is below the smallest size, 4 MiB; give 4MiB "
                 f"or more")
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {METHODS}")
    hosts_list = args.hosts
    load0 = os.getloadavg()
    results: list[dict] = []
    for hosts in hosts_list:
        for m in ("gloo", "flodl_shm"):
            if m in methods:
                _say(f"{LABELS[m]}: {hosts} hosts × {args.ranks} ranks, "
                     f"{', '.join(human(s) for s in sizes)} ...")
                results += bench_c10d_hosts(m, hosts, args.ranks, sizes, args.iter_scale,
                                            args.timeout)
        if "controller" in methods:
            for nbytes in sizes:
                _say(f"{LABELS['controller']}: {hosts} hosts × {args.ranks} ranks, "
                     f"{human(nbytes)} ...")
                results.append(bench_controller(hosts, args.ranks, nbytes, args.iter_scale))
    _say("done")
    load1 = os.getloadavg()
    print(f"cores: {available_cores()}; load average (1, 5, 15 min) at start "
          f"{' '.join(f'{x:.2f}' for x in load0)}, at end {' '.join(f'{x:.2f}' for x in load1)}; "
          f"iteration scale {args.iter_scale}")
    for hosts in hosts_list:
        print(table(results, hosts, args.ranks))
    print("\nround: per-iteration max over ranks, median. cross-host: fresh TCP bytes (TCP_INFO) "
          "on connections to other hosts' processes, per host per round, max over hosts "
          "(controller: the relay's link).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"loadavg": [load0, load1], "results": results}, f, indent=1)
    return exit_code(results)


if __name__ == "__main__":
    run_main(main)
