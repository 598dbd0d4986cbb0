"""Startup: from launching a 2-rank ``flodl_shm.spawn`` script to its first collective,
against one ``python -c "import torch"``.

    python tools/bench_startup.py               # 5 interleaved repeats, every start method
    python tools/bench_startup.py --repeats 9 --nprocs 4 --start-methods forkserver,spawn

Each repeat starts, in a fresh interpreter each time:

  import torch       ``python -c "import torch"``: the floor every rank pays at least once
  spawn to barrier   a script that imports flodl_shm and torch, then ``spawn(fn, nprocs)``
                     where ``fn`` calls ``ctx.comm.barrier()`` once

and records wall-clock stamps (``time.time()``, one clock for every process):
  launch          the parent's stamp right before starting the interpreter
  imported        the launcher after ``import torch, flodl_shm``
  spawn called    the launcher right before ``spawn``
  rank entered    each rank when ``fn`` starts (after its own interpreter start and imports;
                  the latest rank)
  first barrier   each rank after its first collective returned (the latest rank)

Prints the phases (median over the repeats) and the ratio launch -> first barrier over
one ``import torch`` for each start method ("default" is ``spawn(fn, nprocs)`` without
``start_method``, what a user gets: here a rank server forked from the launcher;
"forkserver-fresh" is "forkserver" with ``FLODL_SHM_FORK_SERVER=0``: a fresh server;
"default-again" times the script's second ``spawn``, as a sweep over settings makes it:
read its "spawn called -> first collective" row),
then the start-up's components, each timed in a fresh interpreter in the same repeats
(where a rank's, or the rank server's, seconds go).
The machine's load is printed too: on a busy host, compare ratios.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (choices, comma_list, parser, positive_int, run_child,  # noqa: E402
                           run_main)
from flodl_shm.engine.hostcpu import available_cores  # noqa: E402

#: what --start-methods accepts (the module docstring says what each is)
START_METHODS = ["default", "default-again", "forkserver", "forkserver-fresh", "spawn", "fork"]

_SCRIPT = r"""
import json, sys, time
try:
    import torch
    import flodl_shm
except KeyboardInterrupt:  # the tool was interrupted: it says so, once
    sys.exit(130)
imported = time.time()


def fn(ctx):
    entered = time.time()
    ctx.comm.barrier()
    return entered, time.time()


def main():
    method = sys.argv[3]
    kw = ({} if method.startswith("default")
          else {"start_method": method.replace("-fresh", "")})
    if method.endswith("-again"):  # the timed spawn is this script's second one
        flodl_shm.spawn(fn, int(sys.argv[2]), **kw)
        time.sleep(0.2)
    called = time.time()
    out = flodl_shm.spawn(fn, int(sys.argv[2]), **kw)
    with open(sys.argv[1], "w") as f:
        json.dump({"imported": imported, "called": called,
                   "entered": max(e for e, _ in out), "barrier": max(b for _, b in out)}, f)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # spawn stopped its ranks; the tool says it was interrupted
        sys.exit(130)
"""


# what a fresh interpreter pays for each piece of a rank's start-up (cumulative)
_COMPONENTS = {
    "interpreter (python -c pass)": "pass",
    "+ import torch": "import torch",
    "+ import numba": "import torch, numba",
    "+ flodl_shm launcher and engine modules": "import torch, numba, flodl_shm.launch",
    "+ kernels loaded from numba's cache": ("import torch, numba; "
                                            "from flodl_shm.launch import rank_server as L; "
                                            "L._warm_kernels(2)"),
}


def _run(cmd, stop_signal=signal.SIGTERM, **kw) -> None:
    """``cmd`` to its end (``run_child``: on Ctrl-C it gets one ``stop_signal``, not the
    terminal's SIGINT, so it prints no traceback of its own); CalledProcessError if it
    failed."""
    proc = run_child(cmd, stop_signal=stop_signal, **kw)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _run_s(code: str) -> float:
    t0 = time.time()
    _run([sys.executable, "-c", code])
    return time.time() - t0


def _import_torch_s() -> float:
    return _run_s("import torch")


def _spawn_phases(script: str, nprocs: int, method: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="flodl_bench_startup_") as d:
        out = os.path.join(d, "stamps.json")
        t0 = time.time()
        env = dict(os.environ)
        if method.endswith("-fresh"):  # a fresh rank server, never one forked from us
            env["FLODL_SHM_FORK_SERVER"] = "0"
        # SIGINT on Ctrl-C: the script's spawn stops its ranks and unlinks its segments
        _run([sys.executable, script, out, str(nprocs), method], signal.SIGINT, env=env)
        end = time.time()
        with open(out) as f:
            st = json.load(f)
    return {"imported": st["imported"] - t0, "called": st["called"] - t0,
            "entered": st["entered"] - t0, "barrier": st["barrier"] - t0, "exit": end - t0}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--repeats", type=positive_int, default=5,
                    help="interleaved repeats of every measurement (the median is printed)")
    ap.add_argument("--nprocs", type=positive_int, default=2, help="ranks of each spawn")
    ap.add_argument("--start-methods", type=comma_list(choices(START_METHODS), "start method"),
                    default="default,default-again,forkserver-fresh,spawn,fork",
                    help="spawn()'s start_method values to compare (comma-separated; "
                         "'default' passes none; 'default-again' times a second spawn of "
                         "the same launcher; 'forkserver-fresh' is 'forkserver' with "
                         "FLODL_SHM_FORK_SERVER=0: a fresh rank server, not one forked from "
                         "the launcher)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flodl_bench_startup_") as d:
        script = os.path.join(d, "startup_probe.py")
        with open(script, "w") as f:
            f.write(_SCRIPT)
        methods = list(dict.fromkeys(args.start_methods))
        _spawn_phases(script, args.nprocs, methods[0])      # warm: numba cache, page cache
        torch_s, phases = [], {m: [] for m in methods}
        parts: dict[str, list[float]] = {k: [] for k in _COMPONENTS}
        for _ in range(args.repeats):
            torch_s.append(_import_torch_s())
            for m in methods:
                phases[m].append(_spawn_phases(script, args.nprocs, m))
            for k, code in _COMPONENTS.items():
                parts[k].append(_run_s(code))
    print(f"# {available_cores()} cores, load average {os.getloadavg()[0]:.2f}; {args.nprocs} "
          f"ranks; {args.repeats} interleaved repeats (median)")
    floor = statistics.median(torch_s)
    print(f"python -c 'import torch': {floor:.2f} s\n")
    labels = {"imported": "launcher imported torch+flodl_shm", "called": "spawn called",
              "entered": "last rank entered fn", "barrier": "first barrier done (last rank)",
              "exit": "launcher exited"}
    print("| phase (s since launch) | " + " | ".join(methods) + " |")
    print("|---|" + "---:|" * len(methods))
    for k, label in labels.items():
        meds = [statistics.median(p[k] for p in phases[m]) for m in methods]
        print(f"| {label} | " + " | ".join(f"{v:.2f}" for v in meds) + " |")
    ratios = [statistics.median(p["barrier"] / t for p, t in zip(phases[m], torch_s))
              for m in methods]
    print("| launch -> first collective / import torch | "
          + " | ".join("—" if m.endswith("-again") else f"{r:.2f}x"
                       for m, r in zip(methods, ratios)) + " |")
    spans = [statistics.median(p["barrier"] - p["called"] for p in phases[m]) for m in methods]
    print("| spawn called -> first collective (s) | "
          + " | ".join(f"{v:.2f}" for v in spans) + " |")
    print("\n| component, in a fresh interpreter (cumulative) | s | step |")
    print("|---|---:|---:|")
    prev = 0.0
    for k, v in parts.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.2f} | {med - prev:+.2f} |")
        prev = med
    return 0


if __name__ == "__main__":
    run_main(main)
