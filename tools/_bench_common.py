"""Helpers shared by the benchmarks in tools/.

The command line of every tool: argparse ``type=`` checks (``positive_int``,
``byte_size``, ``out_file``, ...) that refuse a bad value with one usage line naming the
value and what is allowed, a help formatter that shows the defaults, ``run_main`` (Ctrl-C
ends a tool with one line and status 130, after its cleanup ran) and ``run_child`` (a
child process that gets one signal and time to clean up when the tool is interrupted).

For the all-reduce benchmarks (``bench_allreduce.py``, ``bench_cluster.py``): one definition of a timed collective for every method: per iteration the time is
the MAX over ranks (the collective is done when the slowest rank is), then the
median over iterations. The gloo peer lives here so both benchmarks time it the
same way: ``dist.all_reduce`` (SUM) then ``div_(world)``, in one gloo group over
loopback, inside ``flodl_shm.spawn``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

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
    """``n`` bytes, exactly: "4 MiB", "256 KiB", or "6 B" when not whole KiB."""
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB} MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB} KiB"
    return f"{n} B"


def parse_size(s: str) -> int:
    """Bytes from ``"4MiB"``, ``"256KiB"``, ``"4MB"`` or a plain byte count: KiB/MiB/GiB
    binary, KB/MB/GB decimal (``flodl_shm.cli.ram.parse_size``, the project's one size
    parser). Raises ValueError naming the text and the accepted forms."""
    from flodl_shm.cli.ram import parse_size as _parse

    return _parse(s)


# --- the command line ----------------------------------------------------------------

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written; each option's help ends with its default, unless the
    help already says it or there is none to show (None, False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (not action.option_strings or action.default in (None, False, "", argparse.SUPPRESS)
                or "%(default)" in text or re.search(r"(^|[(;,] ?)default\b", text)):
            return text
        return f"{text} (default: %(default)s)"


def parser(description: str | None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with :class:`HelpFormatter` (every tool's)."""
    return argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)


def _int(text: str, least: int) -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; give an integer >= {least}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is below {least}; give an integer >= {least}")
    return value


def int_at_least(least: int, why: str = ""):
    """argparse type: an integer >= ``least``; ``why`` (if given) says why the limit."""
    def conv(text: str) -> int:
        try:
            return _int(text, least)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e}{' (' + why + ')' if why else ''}") from None
    conv.__name__ = f"integer >= {least}"
    return conv


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int(text, 1)


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a number > 0") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0; give a finite number > 0")
    return value


def byte_size(text: str) -> int:
    """argparse type: a size > 0 in bytes (``parse_size``: 4096, 4KiB, 4MiB, 4MB, ...)."""
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} is 0 bytes; give a size above 0")
    return value


def f32_size(text: str) -> int:
    """argparse type: a buffer of float32, in bytes: a ``byte_size`` that is a multiple of
    4 (whole elements)."""
    value = byte_size(text)
    if value % 4:
        raise argparse.ArgumentTypeError(
            f"{value} bytes is not a whole number of float32 (4 bytes each); give a "
            f"multiple of 4, e.g. {max(4, value - value % 4)}")
    return value


def comma_list(item, what: str = "value"):
    """argparse type: a comma-separated list of ``item`` (an argparse type); an item's
    error names it and its place in the list."""
    def conv(text: str) -> list:
        parts = [p.strip() for p in str(text).split(",")]
        if not any(parts):
            raise argparse.ArgumentTypeError(f"no {what} in {text!r}; give one or more, "
                                             f"comma-separated")
        out = []
        for p in parts:
            if not p:
                raise argparse.ArgumentTypeError(f"an empty {what} in {text!r}; separate "
                                                 f"{what}s with single commas")
            try:
                out.append(item(p))
            except argparse.ArgumentTypeError as e:
                named = repr(p) in str(e)   # the message names the item already
                raise argparse.ArgumentTypeError(str(e) if named else f"{what} {p!r}: {e}") \
                    from None
        return out
    conv.__name__ = f"{what} list"
    return conv


def choices(allowed):
    """argparse item type: one of ``allowed``."""
    allowed = list(allowed)

    def conv(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"unknown; choose from {', '.join(allowed)}")
        return text
    conv.__name__ = "choice"
    return conv


def out_file(text: str) -> str:
    """argparse type: a file to write at the end of a run, checked up front: its folder
    must exist (a missing one would fail only after the measuring)."""
    path = Path(text).expanduser()
    folder = path.parent.resolve()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"the folder of {text} ({folder}) does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder of {text} ({folder}) is not writable; "
                                         f"write elsewhere")
    return str(path)


def existing_dir(text: str) -> str:
    """argparse type: an existing, writable folder."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist; create it or pass an "
                                         f"existing folder")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder; pass a folder")
    if not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable; pass a writable folder")
    return str(path)


def run_main(main, quiet: bool = False) -> None:
    """``sys.exit(main())``, but Ctrl-C ends the tool with one line, "<tool>:
    interrupted", and status 130 (the cleanup in ``main``'s ``finally`` blocks has run
    by then). ``quiet``: no line (a tool's worker process, whose launcher says it)."""
    try:
        code = main()
    except KeyboardInterrupt:
        if not quiet:
            print(f"{Path(sys.argv[0]).stem}: interrupted", file=sys.stderr, flush=True)
        code = 130
    sys.exit(code)


def stop_child(proc: subprocess.Popen, sig: int | None = signal.SIGINT,
               grace: float = 30.0) -> None:
    """Stop a child started in a session of its own (:func:`run_child`): one ``sig`` to
    it (None: it was already sent one), up to ``grace`` s to clean up (an mpirun removes
    its ranks' shared-memory segments), then SIGKILL to its whole process group. A
    second Ctrl-C meanwhile skips the wait."""
    if proc.poll() is None:
        try:
            if sig is not None:
                proc.send_signal(sig)
            proc.communicate(timeout=grace)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # whatever is left of its session
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def run_child(cmd, *, timeout: float | None = None, capture: bool = False,
              stop_signal: int = signal.SIGINT, grace: float = 30.0,
              **popen) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` in a session of its own, so a Ctrl-C at the terminal
    reaches this process only: on KeyboardInterrupt (or ``timeout``) the child gets one
    ``stop_signal`` and ``grace`` s to clean up (``stop_child``), then the exception goes
    on. (``subprocess.run`` would SIGKILL it 0.25 s after the Ctrl-C, and a program that
    gets a second SIGINT meanwhile, as mpirun does, may abort its cleanup.) ``capture``:
    stdout and stderr as text."""
    if capture:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        stop_child(proc, stop_signal, grace)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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


def append_jsonl(path: str, records: list[dict]) -> None:
    """Append ``records`` to ``path`` as JSON Lines: one JSON object per line."""
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def exit_code(results: list[dict]) -> int:
    """1 (after naming them) if any result is wrong, else 0."""
    bad = [(r["method"], r["world"], r["bytes"], *([r["error"]] if r.get("error") else []))
           for r in results if not r["correct"]]
    if bad:
        print(f"\nWRONG RESULTS: {bad}")
        return 1
    return 0
