"""Run several "hosts" (spawn groups, each with its own arena and relay) on loopback."""
from __future__ import annotations

import os
import pickle
import select
import signal
import time

import torch

from flodl_shm import ClusterController, RoundKind, spawn
from flodl_shm.cluster.link import Link, client_handshake, connect

from forked import drop_inherited_sockets, leave

SALT = bytes(range(16))


def join_raw(port: int, hello: dict, salt=SALT, on_ack=None) -> Link:
    """A hand-driven relay: the real handshake (``on_ack`` gets the controller's
    ``hello_ack``), then the test sends what it likes."""
    sock = connect(("127.0.0.1", port), attempts=5, delay=0.1)
    return client_handshake(sock, salt, hello, f"127.0.0.1:{port}", on_ack=on_ack)


def quick_average(ctx):
    return ctx.comm.all_reduce_tensors([torch.full((3,), float(ctx.rank))])[0].tolist()


def survivor_rounds(ctx):
    """Rounds until the cohort's mass is 2 (host 1 excluded): (value, mass)."""
    for _ in range(5000):
        (t,), mass = ctx.comm.all_reduce_scaled([torch.full((1000,), float(ctx.rank))], 1.0,
                                               RoundKind.MODEL, 1.0)
        if mass == 2.0:
            return float(t[0]), mass
    raise AssertionError("host 1 was never excluded")


def one_dies_then_host_1_lingers(ctx):
    """Layout [2, 1]: rank 1 exits after its second round (tolerated), the survivors go on;
    rank 2 (host 1) then stays up 2 s after its last round, as in an evaluation."""
    for i in range(3):
        ctx.comm.all_reduce_scaled([torch.full((4,), 1.0)], 1.0, RoundKind.MODEL, 1.0)
        if ctx.rank == 1 and i == 1:
            os._exit(3)
    if ctx.rank == 2:
        time.sleep(2.0)
    return ctx.rank


def root_dies_before_broadcast(ctx):
    """Rank 0 exits before a broadcast from it; the others' broadcast must not return."""
    ctx.comm.barrier()
    if ctx.rank == 0:
        os._exit(3)
    return ctx.comm.broadcast_from_root([torch.full((4,), 7.0)], root=0)[0].tolist()


def loop_forever(ctx, ready: str):
    """Host 1's rank of ``kill_a_host_mid_run``: all-reduces until killed, touching
    ``ready`` after a few rounds."""
    i = 0
    while True:
        ctx.comm.all_reduce_scaled([torch.full((1000,), float(ctx.rank))], 1.0, RoundKind.MODEL,
                                   1.0)
        if i == 3:
            open(ready, "w").close()
        i += 1
        time.sleep(0.01)


def kill_a_host_mid_run(tmp_path, max_failures):
    """Host 1 (rank 2 of 3, its own launcher process) is SIGKILLed mid-run while host 0
    (ranks 0-1) runs ``survivor_rounds``. Returns ({"out": host 0's results} or
    {"error": its exception}, and "dead": the launcher's cohort-wide ``dead_ranks()``;
    the controller)."""
    ctl = ClusterController.start("127.0.0.1:0", 3, SALT)
    ready = tmp_path / "ready"

    def host0():
        ctx = spawn(survivor_rounds, 2, controller=f"127.0.0.1:{ctl.port}", world_size=3,
                    first_rank=0, salt=SALT, timeout=120, max_failures=max_failures, join=False)
        box = {}
        try:
            box["out"] = ctx.join()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            box["error"] = e
        box["dead"] = ctx.dead_ranks()
        return box

    def host1():
        spawn(loop_forever, 1, (str(ready),), controller=f"127.0.0.1:{ctl.port}", world_size=3,
              first_rank=2, salt=SALT, timeout=120)

    hosts = [HostProcess(host0, "host0"), HostProcess(host1, "host1")]
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "host 1 never ran its rounds"
        hosts[1].kill()  # SIGKILL: its rank server and rank follow (PDEATHSIG)
        ok, box = hosts[0].join(120)
    finally:
        for h in hosts:
            h.kill()
        ctl.shutdown()
    assert ok, box
    return box, ctl


def run_hosts(fn, layout, *, args=(), salt=SALT, round_timeout=60.0, timeout=60.0,
              max_failures=0, controller_kwargs=None, join_timeout=150.0):
    """Start a controller and one spawn group per entry of ``layout`` (local rank counts),
    each in a host process of its own (``run_host_processes``); return (results by
    host, exceptions by host, controller)."""
    world = sum(layout)
    ctl = ClusterController.start("127.0.0.1:0", world, salt, round_timeout=round_timeout,
                                  **(controller_kwargs or {}))
    firsts = [sum(layout[:i]) for i in range(len(layout))]

    def host(i: int):
        mf = max_failures[i] if isinstance(max_failures, (list, tuple)) else max_failures
        return spawn(fn, layout[i], args, controller=f"127.0.0.1:{ctl.port}",
                     world_size=world, first_rank=firsts[i], salt=salt, timeout=timeout,
                     max_failures=mf)

    results, errors = run_host_processes(ctl, host, len(layout), join_timeout)
    return results, errors, ctl


class HostProcess:
    """``fn()`` run in a host process of its own, forked from this test process at once
    (``forked.py``: a host is a launcher process of its own; a spawn from a thread of
    the test would start a fresh interpreter for its rank server). The child drops the
    sockets it inherited and sends its outcome back pickled; ``join`` returns it."""

    def __init__(self, fn, name: str = "host") -> None:
        self.name = name
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the host: never returns into the test
            os.close(r)
            _host_child(fn, w)
        os.close(w)
        self._r = r
        self._chunks: list[bytes] = []
        self.exit_code: int | None = None

    def join(self, timeout: float):
        """(True, fn's result) or (False, its exception); AssertionError naming the host
        when it has not finished within ``timeout`` s (it is then killed)."""
        return join_hosts([self], time.monotonic() + timeout)[0]

    def kill(self) -> None:
        """SIGKILL the host (its rank server and ranks follow it) and reap it; once."""
        if self._r < 0:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)  # a no-op on a host that already finished
        except ProcessLookupError:
            pass
        self.exit_code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        os.close(self._r)
        self._r = -1

    def outcome(self) -> tuple[bool, object]:
        """What the host sent back, once it is reaped: (ok, result or exception)."""
        if not self._chunks:
            return False, RuntimeError(f"{self.name} ended without sending its outcome "
                                       f"(exit code {self.exit_code})")
        return pickle.loads(b"".join(self._chunks))


def join_hosts(procs: list[HostProcess], deadline: float) -> list[tuple[bool, object]]:
    """Every host's (ok, result or exception), read until each closes its pipe; the hosts
    are reaped (and killed past ``deadline``: AssertionError naming them)."""
    pending = {p._r: p for p in procs}
    try:
        while pending and time.monotonic() < deadline:
            ready, _, _ = select.select(list(pending), [], [],
                                        max(0.0, deadline - time.monotonic()))
            for fd in ready:
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    pending[fd]._chunks.append(chunk)
                else:
                    del pending[fd]
    finally:
        for p in procs:
            p.kill()
    stuck = [p.name for p in pending.values()]
    assert not stuck, f"hosts {stuck} did not finish"
    return [p.outcome() for p in procs]


def run_host_processes(ctl, host, hosts: int, join_timeout: float = 150.0):
    """Run ``host(i)`` for each host i in a ``HostProcess``, then shut ``ctl`` down;
    return (results by host, exceptions by host). Fails if a host does not finish."""
    try:
        procs = [HostProcess(lambda i=i: host(i), f"host{i}") for i in range(hosts)]
        outcomes = join_hosts(procs, time.monotonic() + join_timeout)
    finally:
        ctl.shutdown()
    results = [value if ok else None for ok, value in outcomes]
    errors = {i: value for i, (ok, value) in enumerate(outcomes) if not ok}
    return results, errors


def _host_child(fn, w: int) -> None:
    """The forked host: run ``fn()``, write (ok, result or exception) pickled to ``w``,
    and leave without running the test process's exit handlers."""
    code = 1
    try:
        drop_inherited_sockets()
        try:
            out = (True, fn())
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out = (False, e)
        try:
            data = pickle.dumps(out)
        except Exception as e:  # noqa: BLE001
            data = pickle.dumps((False, RuntimeError(f"the host's outcome does not pickle "
                                                     f"({e}): {out[1]!r}")))
        with os.fdopen(w, "wb") as f:
            f.write(data)
        code = 0
    finally:
        leave(code)
