"""Multi-host all-reduce on loopback: relays + controller against gloo, in one run.

    python tools/bench_cluster.py                    # 2 and 3 hosts, 4-256 MiB (~4 min)
    python tools/bench_cluster.py --quick            # 4 MiB, a few rounds: smoke run (< 1 min)
    python tools/bench_cluster.py --sizes 4MiB,64MiB --hosts 3 --json out.jsonl

A simulated host is its own process: a ``spawn`` supervisor (arena + relay thread)
with ``--ranks`` (2) rank processes. H such hosts and one controller process form a
cohort on 127.0.0.1; gloo runs the same 2H processes in one group over loopback.
One cohort per (hosts, size), so the controller's peak RSS belongs to one frame size.

What is measured (nothing is computed from a formula):
  time per round  ``comm.all_reduce_([t])``, an in-place average of a private f32
                  tensor of SIZE bytes per rank: per-iteration MAX over all 2H ranks,
                  median over iterations, after warm-up and a barrier. flodl_shm runs
                  with an f32 wire and with ``set_bf16_wire(True)`` (bf16 on the hop,
                  f32 accumulation). gloo: ``dist.all_reduce`` (SUM) + ``div_``, timed
                  the same way (tools/_bench_common.py).
  wire bytes      per host per round, up and down: the kernel's TCP counters
                  (``TCP_INFO`` bytes_sent / bytes_received) of the relay's socket, read
                  by the host's process before and after the timed rounds (everything
                  on the link counts: record headers, frame headers, tags; fresh bytes:
                  loopback here drops and retransmits a little under load, and the
                  retransmitted bytes go to the JSON). The relay's payload counters
                  (``SpawnContext.relay_stats()``) go to the JSON too.
  controller RSS  the controller runs in its own process (``ClusterController``, as
                  ``python -m flodl_shm controller`` runs it). Peak = the kernel's
                  high-water mark (VmHWM) read when a phase ends; "idle" = its RSS
                  once listening, kernels loaded, before any host joined; a psutil
                  sampler (20 ms) cross-checks the peak of each phase.
  CPU             CPU seconds per round (user + system, all threads) of the ranks,
                  the hosts' supervisors (relays) and the controller (psutil), and of
                  gloo's ranks (process time of the timed loop); gloo's fresh TCP bytes
                  sent per process per round (TCP_INFO) next to the relays' bytes.
  phases          where a round goes: timers wrapped around the relay's and the
                  controller's steps in their own processes (relay: local reduce,
                  encode, send = HMAC + TCP, wait for / read + verify the consensus;
                  controller: read + verify each partial, add, finish, tag, scatter),
                  medians over the same timed rounds. The wrappers patch private
                  methods of this run's processes only; if the names change, the
                  phase table is skipped and everything else still runs.
"""
from __future__ import annotations

import argparse
import functools
import json
import multiprocessing.connection as mpc
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from _bench_common import (MiB, append_jsonl, bench_gloo, choices, comma_list, exit_code,
                           f32_size, human, out_file, parser, positive_float, positive_int,
                           run_main, summarize, tcp_counters)
from flodl_shm.engine.hostcpu import available_cores

SIZES = [4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
SCHEDULE = {4 * MiB: (3, 30), 16 * MiB: (2, 15), 64 * MiB: (2, 8), 256 * MiB: (1, 5)}
VARIANTS = ["f32", "bf16"]   # f32 first: its phase sets the controller's high-water mark
LABELS = {"f32": "flodl_shm f32 wire", "bf16": "flodl_shm bf16 wire",
          "gloo": "torch.distributed gloo"}
START_TIMEOUT = 180.0        # a process must be up (imports, kernels) within this
PHASE_TIMEOUT = 900.0        # one phase (warm-up + timed rounds) must end within this
HERE = os.path.abspath(__file__)


def schedule(nbytes: int, scale: float) -> tuple[int, int]:
    warm, iters = SCHEDULE.get(nbytes, (2, 10))
    return max(1, round(warm * scale)), max(3, round(iters * scale))


# --- phase timers (in the controller's and the hosts' processes) -----------------------

EVENTS: list[tuple] = []


def _timed(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        t0 = time.monotonic()
        try:
            return fn(*a, **kw)
        finally:
            EVENTS.append((name, t0, time.monotonic()))
    return wrapper


def _instrument(role: str) -> bool:
    """Wrap the steps of a round with timers (this process only). False if the private
    names this relies on are gone (the benchmark then runs without a phase table, and
    nothing is wrapped: every name is looked up before any is replaced)."""
    from flodl_shm.cluster import controller as C
    from flodl_shm.cluster import link as mux
    from flodl_shm.cluster import relay as R
    from flodl_shm.engine import protocol

    if role == "controller":
        targets = [(C.ClusterController, "_round", "round"), (C.ClusterController, "_add", "add"),
                   (C.ClusterController, "_finish", "finish"), (mux, "frame_tag", "tag")]
    else:
        targets = [(R.Relay, "_partial_frame", "encode"),
                   (protocol.RoundEngine, "await_arrivals", "arrive"),
                   (protocol.RoundEngine, "await_slices", "slices")]
    targets.append((mux.Link, "send_frame", "send"))
    try:
        originals = [(owner, name, getattr(owner, name), label)
                     for owner, name, label in targets]
        orig_recv, ctrl = mux.Link.recv, mux.Kind.CTRL
    except AttributeError as e:
        print(f"# phase timers disabled: {e}", file=sys.stderr, flush=True)
        return False

    def recv(self, sink=None, **kw):  # (timeout, idle, abort: whatever Link.recv takes)
        t0 = time.monotonic()
        first: list[float] = []

        def marking(*a):
            if not first:
                first.append(time.monotonic())   # the frame's payload starts arriving
            return sink(*a)

        got = orig_recv(self, None if sink is None else marking, **kw)
        if got is not None and got[0] != ctrl:
            t1 = time.monotonic()
            EVENTS.append(("recv", t0, t1, first[0] if first else t0))
        return got

    mux.Link.recv = recv
    for owner, name, fn, label in originals:
        setattr(owner, name, _timed(fn, label))
    return True


def _window(events, t0: float, t1: float, name: str) -> list[tuple]:
    return [e for e in events if e[0] == name and e[1] >= t0 and e[2] <= t1]


def _med_ms(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) * 1e3 if xs else None


def relay_phases(events, t0: float, t1: float) -> dict:
    """Median ms per round on one host's relay (events of the timed rounds)."""
    recv = _window(events, t0, t1, "recv")
    local = [a[2] - a[1] + s[2] - s[1] for a, s in
             zip(_window(events, t0, t1, "arrive"), _window(events, t0, t1, "slices"))]
    return {"local": _med_ms(local),
            "encode": _med_ms(e[2] - e[1] for e in _window(events, t0, t1, "encode")),
            "send": _med_ms(e[2] - e[1] for e in _window(events, t0, t1, "send")),
            "down_wait": _med_ms(e[3] - e[1] for e in recv),
            "down_read": _med_ms(e[2] - e[3] for e in recv)}


def controller_phases(events, t0: float, t1: float) -> dict:
    """Median ms per round at the controller: each step summed within a round."""
    per: dict[str, list[float]] = {k: [] for k in
                                   ("round", "read", "add", "finish", "tag", "scatter", "wait")}
    for _, r0, r1 in _window(events, t0, t1, "round"):
        inside = [e for e in events if e[1] >= r0 and e[2] <= r1]
        read = sum(e[2] - e[3] for e in inside if e[0] == "recv")
        parts = {k: sum(e[2] - e[1] for e in inside if e[0] == n)
                 for k, n in (("add", "add"), ("finish", "finish"), ("tag", "tag"),
                              ("scatter", "send"))}
        per["round"].append(r1 - r0)
        per["read"].append(read)
        for k, v in parts.items():
            per[k].append(v)
        per["wait"].append(r1 - r0 - read - sum(parts.values()))
    return {k: _med_ms(v) for k, v in per.items()}


# --- the controller's process -----------------------------------------------------------

def _proc_status_kib(pid: int | str, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def controller_worker(d: Path) -> int:
    cfg = json.loads((d / "config.json").read_text())
    from flodl_shm import ClusterController, kernels
    from flodl_shm.cluster.secret import read_secret_file

    profiled = _instrument("controller")
    kernels.warm_up()  # what the first round would load anyway: part of the idle figure
    salt = read_secret_file(d / "secret")
    ctl = ClusterController.start("127.0.0.1:0", cfg["world"], salt, round_timeout=PHASE_TIMEOUT)
    idle = _proc_status_kib("self", "VmRSS")
    tmp = d / "port.tmp"
    tmp.write_text(str(ctl.port))
    tmp.rename(d / "port")
    ctl.join()
    ctl.shutdown()
    out = {"rounds": ctl.stats.rounds, "bytes_in": ctl.stats.bytes_in,
           "bytes_out": ctl.stats.bytes_out,
           "error": None if ctl.error is None else repr(ctl.error),
           "idle_rss": idle * 1024, "hwm": _proc_status_kib("self", "VmHWM") * 1024,
           "profiled": profiled, "events": EVENTS}
    (d / "controller.json").write_text(json.dumps(out))
    return 0 if ctl.error is None else 1


# --- a host's process and its ranks -------------------------------------------------------

def _expect(conn, want: str) -> None:
    msg = conn.recv()
    if msg != want:
        raise RuntimeError(f"bench coordinator sent {msg!r}, expected {want!r}")


def _rank_worker(ctx, address, authkey, nbytes, plan):
    """One rank: per variant, warm up, barrier, sync, timed rounds, report."""
    import torch

    conn = mpc.Client(tuple(address), authkey=authkey)
    try:
        conn.send(("rank", ctx.rank))
        comm = ctx.comm
        expected = (ctx.world_size + 1) / 2.0   # ranks contribute 1, 2, ..., world
        t = torch.empty(nbytes // 4)
        for k, (variant, warm, iters) in enumerate(plan):
            comm.set_bf16_wire(variant == "bf16")
            t.fill_(float(ctx.rank + 1))
            comm.all_reduce_([t])
            ok = bool(torch.all(t == expected))
            seen = [float(t[0]), float(t[-1])]
            for _ in range(warm):
                comm.all_reduce_([t])
            comm.barrier()
            conn.send(("ready", k))
            _expect(conn, "go")   # the coordinator releases every rank at once
            times = np.empty(iters, np.float64)
            for i in range(iters):
                t0 = time.perf_counter_ns()
                comm.all_reduce_([t])
                times[i] = time.perf_counter_ns() - t0
            ok = ok and bool(torch.all(t == expected))
            seen += [float(t[0]), float(t[-1])]
            conn.send(("done", k, times, ok, seen))
            _expect(conn, "go")   # counters are read while no round runs
    finally:
        conn.close()


def link_tcp_bytes(port: int) -> dict | None:
    """The kernel's byte counters of this process's connection to 127.0.0.1:port — the
    relay's link to the controller; None if TCP_INFO lacks them."""
    return tcp_counters(lambda c: c["raddr"][1] == port)


def host_worker(d: Path, index: int, port: int) -> int:
    cfg = json.loads((d / "config.json").read_text())
    from flodl_shm import spawn
    from flodl_shm.cluster.secret import read_secret_file

    _instrument("host")
    salt = read_secret_file(d / "secret")
    authkey = bytes.fromhex(cfg["authkey"])
    address = tuple(cfg["address"])
    conn = mpc.Client(address, authkey=authkey)
    lock = threading.Lock()
    joined = threading.Event()
    conn.send(("host", index))
    ranks = cfg["ranks"]
    stop = threading.Event()
    box: list = []

    def on_signal(signum, frame) -> None:   # stop the ranks, unlink the arena, exit
        stop.set()
        if box:
            box[0].terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    ctx = spawn(_rank_worker, ranks, (address, authkey, cfg["nbytes"], cfg["plan"]),
                controller=f"127.0.0.1:{port}", world_size=cfg["world"],
                first_rank=index * ranks, salt=salt, timeout=PHASE_TIMEOUT, join=False,
                shm_bytes_hint=cfg["nbytes"])
    box.append(ctx)
    if stop.is_set():   # the signal came while spawn was starting
        ctx.terminate()

    def serve() -> None:
        sent = 0
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if not joined.is_set():
                    ctx.terminate()   # the coordinator is gone
                return
            if msg == "stats":
                events, sent = EVENTS[sent:], len(EVENTS)
                with lock:
                    conn.send(("stats", {"relay": ctx.relay_stats(), "tcp": link_tcp_bytes(port),
                                         "events": events}))

    threading.Thread(target=serve, name="bench-host-serve", daemon=True).start()
    status = "ok"
    try:
        ctx.join()
    except BaseException as e:  # noqa: BLE001 - reported to the coordinator
        status = f"{type(e).__name__}: {e}"
    joined.set()
    with lock:
        conn.send(("exit", status))
    conn.close()
    return 0 if status == "ok" else 1


# --- the coordinator (this process) -------------------------------------------------------

class CohortFailed(RuntimeError):
    pass


class RssSampler:
    """psutil RSS of one process every ``period`` s, as (monotonic time, bytes)."""

    def __init__(self, pid: int, period: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process(pid)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(period,), daemon=True)
        self._thread.start()

    def _main(self, period: float) -> None:
        while not self._stop.wait(period):
            try:
                self.samples.append((time.monotonic(), self._proc.memory_info().rss))
            except Exception:
                return

    def peak(self, t0: float, t1: float) -> int | None:
        xs = [r for t, r in self.samples if t0 <= t <= t1]
        return max(xs) if xs else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class CpuMeter:
    """CPU seconds (user + system, all threads) of the cohort's processes by role:
    the controller, the hosts' supervisors (each runs its relay) and the ranks.

    "ranks" is every process under a host, at any depth (``children(recursive=True)``):
    a host's ranks are its grandchildren (host -> rank server -> ranks; its children
    with ``start_method="spawn"``), and the rank server, which only forks them and then
    waits, is counted with them (its CPU during the timed rounds is nil). multiprocessing's
    resource tracker is left out. Built once every rank is up (the processes are listed
    here, once)."""

    def __init__(self, ctl_pid: int, host_pids: list[int], ranks_per_host: int = 0) -> None:
        import psutil

        self.procs: dict[str, list] = {"controller": [psutil.Process(ctl_pid)], "supervisors": [],
                                       "ranks": []}
        for pid in host_pids:
            host = psutil.Process(pid)
            self.procs["supervisors"].append(host)
            under = []
            for child in host.children(recursive=True):
                try:
                    if "resource_tracker" not in " ".join(child.cmdline()):
                        under.append(child)
                except psutil.Error:   # gone since listed
                    pass
            if len(under) < ranks_per_host:
                print(f"# warning: CPU of host {pid}'s ranks: found {len(under)} processes "
                      f"under it, expected at least {ranks_per_host} ranks; its rank CPU "
                      f"figure is short", file=sys.stderr, flush=True)
            self.procs["ranks"] += under

    def snapshot(self) -> dict[str, float]:
        out = {}
        for role, procs in self.procs.items():
            total = 0.0
            for p in procs:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except Exception:
                    pass
            out[role] = total
        return out


class Cohort:
    """One controller process + ``hosts`` host processes, coordinated over a
    ``multiprocessing`` listener on 127.0.0.1 (authkey-protected)."""

    def __init__(self, hosts: int, ranks: int, nbytes: int, plan: list) -> None:
        from flodl_shm.cluster.secret import write_secret_file

        self.hosts, self.ranks, self.nbytes, self.plan = hosts, ranks, nbytes, plan
        self.world = hosts * ranks
        self.dir = Path(tempfile.mkdtemp(prefix="flodl_bench_cluster_"))
        write_secret_file(self.dir / "secret")
        authkey = os.urandom(16)
        self.listener = mpc.Listener(("127.0.0.1", 0), authkey=authkey)
        (self.dir / "config.json").write_text(json.dumps({
            "world": self.world, "ranks": ranks, "nbytes": nbytes, "plan": plan,
            "address": list(self.listener.address), "authkey": authkey.hex()}))
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.rank_conns: dict[int, mpc.Connection] = {}
        self.host_conns: dict[int, mpc.Connection] = {}
        self.sampler: RssSampler | None = None

    # -- processes ---------------------------------------------------------------------
    def _start(self, name: str, *argv: str) -> subprocess.Popen:
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        with open(log, "w") as f:
            p = subprocess.Popen([sys.executable, HERE, *argv], stdout=f, stderr=subprocess.STDOUT,
                                 cwd=os.getcwd())
        self.procs[name] = p
        return p

    def _tail(self, name: str, n: int = 25) -> str:
        try:
            return "\n".join(self.logs[name].read_text().splitlines()[-n:])
        except OSError:
            return ""

    def _check(self, expect_exit: bool = False) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None and (not expect_exit or p.returncode != 0):
                raise CohortFailed(f"{name} exited with code {p.returncode}:\n{self._tail(name)}")

    def _accept_all(self, n: int, deadline: float) -> None:
        got: list = []

        def accept() -> None:
            for _ in range(n):
                try:
                    c = self.listener.accept()
                except OSError:
                    return
                got.append((c, c.recv()))

        th = threading.Thread(target=accept, daemon=True)
        th.start()
        while th.is_alive():
            th.join(0.5)
            self._check()
            if time.monotonic() > deadline:
                raise CohortFailed(f"only {len(got)} of {n} processes connected within "
                                   f"{START_TIMEOUT:g} s")
        for c, (role, key) in got:
            (self.rank_conns if role == "rank" else self.host_conns)[int(key)] = c

    def _gather(self, conns: dict, want: str, timeout: float) -> dict:
        pending = dict(conns)
        by_conn = {id(c): k for k, c in pending.items()}
        got = {}
        deadline = time.monotonic() + timeout
        while pending:
            for c in mpc.wait(list(pending.values()), timeout=0.5):
                k = by_conn[id(c)]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    raise CohortFailed(f"{want}: the connection of {k} closed") from None
                if msg[0] != want:
                    raise CohortFailed(f"{want}: {k} sent {msg!r}")
                got[k] = msg
                del pending[k]
            self._check()
            if time.monotonic() > deadline:
                raise CohortFailed(f"{want}: no answer from {sorted(pending)} in {timeout:g} s")
        return got

    def _host_stats(self) -> dict:
        for c in self.host_conns.values():
            c.send("stats")
        return {k: m[1] for k, m in self._gather(self.host_conns, "stats", 60).items()}

    # -- the run -----------------------------------------------------------------------
    def run(self) -> list[dict]:
        deadline = time.monotonic() + START_TIMEOUT
        ctl = self._start("controller", "--controller-worker", str(self.dir))
        while not (self.dir / "port").exists():
            self._check()
            if time.monotonic() > deadline:
                raise CohortFailed(f"the controller did not listen within {START_TIMEOUT:g} s")
            time.sleep(0.05)
        port = int((self.dir / "port").read_text())
        self.sampler = RssSampler(ctl.pid)
        for i in range(self.hosts):
            self._start(f"host{i}", "--host-worker", str(self.dir), "--index", str(i),
                        "--port", str(port))
        self._accept_all(self.hosts + self.world, deadline)
        cpu = CpuMeter(ctl.pid, [p.pid for n, p in self.procs.items() if n.startswith("host")],
                       self.ranks)
        phases = []
        for k, (variant, _, iters) in enumerate(self.plan):
            self._gather(self.rank_conns, "ready", PHASE_TIMEOUT)
            before = self._host_stats()
            cpu0 = cpu.snapshot()
            t0 = time.monotonic()
            for c in self.rank_conns.values():
                c.send("go")
            done = self._gather(self.rank_conns, "done", PHASE_TIMEOUT)
            t1 = time.monotonic()
            cpu1 = cpu.snapshot()
            after = self._host_stats()
            hwm = _proc_status_kib(ctl.pid, "VmHWM")
            for c in self.rank_conns.values():
                c.send("go")
            phases.append({
                "variant": variant, "iters": iters, "t0": t0, "t1": t1, "before": before,
                "after": after, "done": done, "hwm": None if hwm is None else hwm * 1024,
                "sampled": self.sampler.peak(t0, t1),
                "cpu": {k: (cpu1[k] - cpu0[k]) * 1e3 / iters for k in cpu0}})
        exits = self._gather(self.host_conns, "exit", 120)
        bad = {k: m[1] for k, m in exits.items() if m[1] != "ok"}
        if bad:
            raise CohortFailed(f"hosts failed: {bad}")
        for name, p in self.procs.items():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                raise CohortFailed(f"{name} did not exit after the run") from None
        self._check(expect_exit=True)
        ctl_stats = json.loads((self.dir / "controller.json").read_text())
        return [self._result(ph, ctl_stats) for ph in phases]

    def _result(self, phase, ctl_stats) -> dict:
        variant, iters, t0, t1 = phase["variant"], phase["iters"], phase["t0"], phase["t1"]
        before, after, done = phase["before"], phase["after"], phase["done"]
        times = np.max(np.stack([done[r][2] for r in sorted(done)]), axis=0)
        ok = all(done[r][3] for r in done)
        res = summarize(variant, self.world, self.nbytes, times, ok)
        frame = self.nbytes // (2 if variant == "bf16" else 1)   # one frame on the wire
        up, down, relay_up, relay_down, retrans = [], [], [], [], []
        for h in sorted(after):
            a, b = after[h], before[h]
            relay_up.append((a["relay"]["bytes_up"] - b["relay"]["bytes_up"]) / iters)
            relay_down.append((a["relay"]["bytes_down"] - b["relay"]["bytes_down"]) / iters)
            if a["tcp"] and b["tcp"]:
                # fresh bytes only: loopback here does drop and retransmit under load
                up.append((a["tcp"]["bytes_sent"] - a["tcp"]["bytes_retrans"]
                           - b["tcp"]["bytes_sent"] + b["tcp"]["bytes_retrans"]) / iters)
                down.append((a["tcp"]["bytes_received"] - b["tcp"]["bytes_received"]) / iters)
                retrans.append(a["tcp"]["bytes_retrans"] - b["tcp"]["bytes_retrans"])
        events = {h: before[h]["events"] + after[h]["events"] for h in after}
        relay = [relay_phases(events[h], t0, t1) for h in sorted(events)]
        res.update({
            "hosts": self.hosts, "ranks_per_host": self.ranks, "wire": variant,
            "frame_bytes": frame, "wire_up_per_host_round": up,
            "wire_down_per_host_round": down, "tcp_retrans_bytes": retrans,
            "relay_payload_up_per_host_round": relay_up,
            "relay_payload_down_per_host_round": relay_down,
            "ctl_idle_rss": ctl_stats["idle_rss"], "ctl_hwm_at_phase_end": phase["hwm"],
            "ctl_sampled_peak_rss": phase["sampled"], "ctl_final_hwm": ctl_stats["hwm"],
            "cpu_ms_per_round": phase["cpu"],
            "relay_phases_ms": {key: _mean([r[key] for r in relay]) for key in relay[0]},
            "controller_phases_ms": (controller_phases([tuple(e) for e in ctl_stats["events"]],
                                                       t0, t1) if ctl_stats["profiled"] else {}),
        })
        if not ok:
            res["error"] = (f"expected {(self.world + 1) / 2} everywhere; ranks saw (first "
                            f"round, after the timed rounds) {[done[r][4] for r in sorted(done)]}")
        if any(x != frame for x in relay_up + relay_down):
            res["correct"] = False   # a round of another size slipped into the window
            res["error"] = (f"relay payload per round up {relay_up} / down {relay_down}, "
                            f"one frame is {frame} bytes")
        return res

    def close(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)   # a host stops its ranks and unlinks its arena
        for name, p in self.procs.items():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for c in [*self.rank_conns.values(), *self.host_conns.values()]:
            c.close()
        self.listener.close()
        if self.sampler is not None:
            self.sampler.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        hosts = [p.pid for n, p in self.procs.items() if n.startswith("host")]
        left = [f for pid in hosts for f in os.listdir("/dev/shm") if f.startswith(f"fshm_{pid}_")]
        if left:   # a host was killed before it could unlink its arena
            from flodl_shm.engine.segment import reap_dead_owner_segments

            reap_dead_owner_segments()
            print(f"# warning: reaped leftover segments {left}", file=sys.stderr, flush=True)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def bench_cohort(hosts: int, ranks: int, nbytes: int, scale: float, variants) -> list[dict]:
    warm, iters = schedule(nbytes, scale)
    cohort = Cohort(hosts, ranks, nbytes, [(v, warm, iters) for v in variants])
    try:
        return cohort.run()
    except KeyboardInterrupt:
        raise   # the processes were interrupted too: their logs say only that
    except BaseException:
        for name in cohort.logs:   # what each process said, before the folder goes
            print(f"# --- {name} log (tail) ---\n{cohort._tail(name, 40)}", file=sys.stderr)
        raise
    finally:
        cohort.close()


# --- primitives: what one hop costs on this machine -----------------------------------------

def measure_primitives(nbytes: int) -> dict:
    """HMAC-SHA256 and one loopback TCP stream over ``nbytes``, best of 3, this process."""
    import hashlib
    import hmac

    buf = np.ones(nbytes, np.uint8)
    best_h = best_t = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        hmac.new(b"k" * 16, buf, hashlib.sha256).digest()
        best_h = min(best_h, time.perf_counter() - t0)
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    cli.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer, _ = srv.accept()
    sink = bytearray(nbytes)
    view = memoryview(sink)
    try:
        for _ in range(3):
            th = threading.Thread(target=cli.sendall, args=(buf,))
            t0 = time.perf_counter()
            th.start()
            got = 0
            while got < nbytes:
                got += peer.recv_into(view[got:])
            th.join()
            best_t = min(best_t, time.perf_counter() - t0)
    finally:
        for s in (cli, peer, srv):
            s.close()
    return {"bytes": nbytes, "hmac_GBps": nbytes / best_h / 1e9, "tcp_GBps": nbytes / best_t / 1e9}


# --- report ---------------------------------------------------------------------------------

def _mib(x) -> str:
    return "—" if x is None else f"{x / MiB:,.2f}"


def _ms(x) -> str:
    return "—" if x is None else f"{x:,.1f}"


def size_table(results: list[dict], nbytes: int) -> str:
    rows = [r for r in results if r["bytes"] == nbytes]
    gloo = {r["world"]: r for r in rows if r["method"] == "gloo"}
    lines = ["| method | hosts × ranks | median ms/round (p10–p90) | × gloo | "
             "wire/host/round up · down (MiB) | ÷ one frame | controller peak RSS (MiB) | "
             "peak − idle (f32 frames) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    order = sorted(rows, key=lambda r: (r["world"], r["method"] == "gloo", r["method"]))
    for r in order:
        g = gloo.get(r["world"])
        ratio = f"{r['median_us'] / g['median_us']:.2f}" if g else "—"
        flag = "" if r["correct"] else " (WRONG)"
        ms = f"{r['median_us'] / 1e3:,.1f} ({r['p10_us'] / 1e3:,.1f}–{r['p90_us'] / 1e3:,.1f})"
        if r["method"] == "gloo":
            sent = r.get("sent_per_rank_round")
            wire = ("—" if not sent else
                    f"{_mib(_mean(sent))} sent per process ‡ | {max(sent) / r['bytes']:.2f}")
            lines.append(f"| {LABELS['gloo']}{flag} | {r['world']} processes | {ms} | 1.00 | "
                         f"{wire if sent else '— | —'} | — | — |")
            continue
        up, down = _mean(r["wire_up_per_host_round"]), _mean(r["wire_down_per_host_round"])
        frame = r["frame_bytes"]
        # f32 runs first: the high-water mark at its end is its peak; the bf16 rounds
        # that follow in the same process are sampled (†)
        peak = r["ctl_hwm_at_phase_end"] if r["wire"] == "f32" else r["ctl_sampled_peak_rss"]
        data = None if peak is None else (peak - r["ctl_idle_rss"]) / r["bytes"]
        share = "—" if up is None else f"{max(r['wire_up_per_host_round']) / frame:.4f}"
        lines.append(
            f"| {LABELS[r['method']]}{flag} | {r['hosts']} × {r['ranks_per_host']} | {ms} | "
            f"{ratio} | {_mib(up)} · {_mib(down)} | "
            f"{share} | "
            f"{_mib(peak)}{'' if r['wire'] == 'f32' else ' †'} | "
            f"{'—' if data is None else f'{data:.2f}'} |")
    return "\n".join(lines)


def phase_table(results: list[dict]) -> str:
    cols = [("relay", "local"), ("relay", "encode"), ("relay", "send"), ("relay", "down_wait"),
            ("relay", "down_read"), ("ctl", "round"), ("ctl", "read"), ("ctl", "add"),
            ("ctl", "finish"), ("ctl", "tag"), ("ctl", "scatter"), ("ctl", "wait")]
    head = ("| hosts | size | wire | round (ranks) | relay: local reduce | encode | "
            "send (HMAC+TCP) | wait consensus | read+verify | controller: round | "
            "read+verify Σ hosts | add Σ | finish | tag | scatter Σ | waiting for partials |")
    lines = [head, "|---:|---:|---|" + "---:|" * (len(cols) + 1)]
    for r in sorted((r for r in results if r["method"] != "gloo"),
                    key=lambda r: (r["hosts"], r["bytes"], r["wire"])):
        cp = r["controller_phases_ms"]
        rp = r["relay_phases_ms"]
        cells = [_ms((rp if side == "relay" else cp).get(k)) for side, k in cols]
        lines.append(f"| {r['hosts']} | {human(r['bytes'])} | {r['wire']} | "
                     f"{r['median_us'] / 1e3:,.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_table(results: list[dict]) -> str:
    cores = available_cores()
    lines = ["| hosts | size | method | round ms | ranks | supervisors (relays) | controller | "
             f"total | total ÷ {cores} cores ÷ round |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted((r for r in results if r.get("cpu_ms_per_round")),
                    key=lambda r: (r["hosts"], r["bytes"], r["method"])):
        c = r["cpu_ms_per_round"]
        total = sum(c.values())
        rnd = r["median_us"] / 1e3
        lines.append(f"| {r['hosts']} | {human(r['bytes'])} | {LABELS[r['method']]} | {rnd:,.1f} | "
                     f"{_ms(c.get('ranks'))} | {_ms(c.get('supervisors'))} | "
                     f"{_ms(c.get('controller'))} | {total:,.1f} | {total / cores / rnd:.2f} |")
    return "\n".join(lines)


def targets(results: list[dict]) -> list[str]:
    out = []
    shm = [r for r in results if r["method"] != "gloo"]
    ups = [max(r["wire_up_per_host_round"]) / r["frame_bytes"] for r in shm
           if r["wire_up_per_host_round"]]
    downs = [max(r["wire_down_per_host_round"]) / r["frame_bytes"] for r in shm
             if r["wire_down_per_host_round"]]
    if ups:
        ok = max(ups) < 1.01 and max(downs) < 1.01
        out.append(f"- wire bytes per host per round = one frame: {'HOLDS' if ok else 'MISSED'} "
                   f"(up {min(ups):.4f}–{max(ups):.4f}, down {min(downs):.4f}–{max(downs):.4f} "
                   f"frames, TCP counters; one per rank would be ×{shm[0]['ranks_per_host']})")
    f32 = [r for r in shm if r["wire"] == "f32" and r["ctl_hwm_at_phase_end"]]
    if f32:
        data = {(r["hosts"], r["bytes"]): r["ctl_hwm_at_phase_end"] - r["ctl_idle_rss"]
                for r in f32}
        sizes = sorted({s for _, s in data})
        extra = "; ".join(f"{h} hosts: " + ", ".join(f"{human(s)} {(d - 2 * s) / MiB:+.1f}"
                                                     for (h2, s), d in sorted(data.items())
                                                     if h2 == h)
                          for h in sorted({h for h, _ in data}))
        if len(sizes) > 1:
            slopes = [(data[(h, sizes[-1])] - data[(h, sizes[0])]) / (sizes[-1] - sizes[0])
                      for h in sorted({h for h, _ in data})
                      if (h, sizes[0]) in data and (h, sizes[-1]) in data]
            grows = max(slopes)
            ok = grows <= 2.05
            how = f"growth {', '.join(f'{x:.2f}' for x in slopes)} frames per frame of size"
        else:
            ok = all(d - 2 * s <= 16 * MiB for (_, s), d in data.items())
            how = "one size only"
        spread = [abs(data[(h2, s)] - data[(h1, s)]) / MiB for s in sizes
                  for h1 in {h for h, _ in data} for h2 in {h for h, _ in data}
                  if (h1, s) in data and (h2, s) in data]
        indep = max(spread) <= 8 + 0.05 * sizes[-1] / MiB
        out.append(f"- controller peak RSS ≤ 2 frames + a constant, whatever the host count: "
                   f"{'HOLDS' if ok and indep else 'MISSED'} (peak − idle − 2 frames, MiB: "
                   f"{extra}; {how}; host counts differ by ≤ {max(spread):.1f} MiB)")
    big = [r for r in shm if r["hosts"] == 3 and r["bytes"] >= 4 * MiB]
    gl = {(r["world"], r["bytes"]): r for r in results if r["method"] == "gloo"}
    if big:
        cells, ok = [], True
        for r in sorted(big, key=lambda r: (r["bytes"], r["wire"])):
            g = gl.get((r["world"], r["bytes"]))
            if g is None:
                continue
            ratio = r["median_us"] / g["median_us"]
            ok &= ratio < 1.0
            cells.append(f"{human(r['bytes'])} {r['wire']} {ratio:.2f}×")
        if cells:
            out.append(f"- 3-host round below gloo at every size ≥ 4 MiB: "
                       f"{'HOLDS' if ok else 'MISSED'} ({', '.join(cells)})")
    return out


QUICK_SCALE = 0.2


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--sizes", type=comma_list(f32_size, "size"),
                    help="comma-separated f32 bytes per rank (4MiB,16MiB,...; KiB/MiB/GiB "
                         "binary, KB/MB/GB decimal); default 4MiB,16MiB,64MiB,256MiB "
                         "(--quick: 4MiB)")
    ap.add_argument("--hosts", type=comma_list(positive_int, "host count"), default="2,3",
                    help="simulated host counts")
    ap.add_argument("--ranks", type=positive_int, default=2, help="ranks per host")
    ap.add_argument("--wires", type=comma_list(choices(VARIANTS), "wire"),
                    default=",".join(VARIANTS), help="flodl_shm's wire formats to measure")
    ap.add_argument("--iter-scale", type=positive_float, default=None,
                    help="multiply the warm-up and timed round counts by this (> 0); "
                         f"default 1, --quick: {QUICK_SCALE}")
    ap.add_argument("--quick", action="store_true",
                    help=f"4 MiB, few rounds (iteration scale {QUICK_SCALE}): smoke run")
    ap.add_argument("--no-gloo", action="store_true", help="skip the gloo peer")
    ap.add_argument("--json", type=out_file,
                    help="append the results to this file, one JSON object per line (JSONL; "
                         "the first: the run's primitives and load)")
    ap.add_argument("--controller-worker", help=argparse.SUPPRESS)
    ap.add_argument("--host-worker", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.controller_worker:
        return controller_worker(Path(args.controller_worker))
    if args.host_worker:
        return host_worker(Path(args.host_worker), args.index, args.port)
    if args.quick and args.iter_scale is not None:
        ap.error(f"--quick sets the iteration scale to {QUICK_SCALE}; give --quick or "
                 f"--iter-scale {args.iter_scale:g}, not both")
    sizes = args.sizes or ([4 * MiB] if args.quick else SIZES)
    scale = QUICK_SCALE if args.quick else 1.0 if args.iter_scale is None else args.iter_scale
    hosts = args.hosts
    variants = list(dict.fromkeys(args.wires))
    load = os.getloadavg()[0]
    print(f"# host: {available_cores()} cores, load {load:.2f}; sizes "
          f"{', '.join(human(s) for s in sizes)} f32 per rank; hosts {hosts} × {args.ranks} "
          f"ranks; wires {variants}; iteration scale {scale}", flush=True)
    prim = measure_primitives(min(max(sizes), 64 * MiB))
    print(f"# one hop's primitives here ({human(prim['bytes'])}, one thread): HMAC-SHA256 "
          f"{prim['hmac_GBps']:.2f} GB/s, loopback TCP {prim['tcp_GBps']:.2f} GB/s", flush=True)
    results: list[dict] = []
    for h in hosts:
        for nbytes in sizes:
            print(f"# flodl_shm: {h} hosts × {args.ranks} ranks, {human(nbytes)} ...", flush=True)
            results += bench_cohort(h, args.ranks, nbytes, scale, variants)
        if not args.no_gloo:
            world = h * args.ranks
            print(f"# gloo: {world} processes ...", flush=True)
            results += bench_gloo(world, [(n, *schedule(n, scale)) for n in sizes])
    for r in results:
        r.setdefault("hosts", r["world"] // args.ranks)
    for nbytes in sizes:
        print(f"\n## {human(nbytes)} f32 per rank (one frame: {human(nbytes)} f32, "
              f"{human(nbytes // 2)} bf16)\n")
        print(size_table(results, nbytes))
    if any(r.get("wire") == "bf16" for r in results):
        print("\n† the bf16 rounds run in the same controller process right after the f32 "
              "rounds: psutil's peak RSS sampled during them (VmHWM already holds the f32 peak).")
    if any(r.get("sent_per_rank_round") for r in results):
        print("‡ gloo: fresh TCP bytes each process sends per round over all its connections "
              "(TCP_INFO), mean over processes; ÷ one frame uses the largest.")
    if any(r.get("controller_phases_ms") for r in results):
        print("\n## Where a round goes (median ms per round; relay figures averaged over hosts)\n")
        print(phase_table(results))
    print("\n## CPU per round (ms, user + system, all threads; gloo: its ranks)\n")
    print(cpu_table(results))
    print("\n## Targets\n")
    print("\n".join(targets(results)))
    if args.json:
        append_jsonl(args.json, [{"primitives": prim, "loadavg": load}, *results])
    return exit_code(results)


if __name__ == "__main__":
    run_main(main, quiet="--controller-worker" in sys.argv or "--host-worker" in sys.argv)
