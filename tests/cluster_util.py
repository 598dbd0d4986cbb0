"""Run several "hosts" (spawn groups, each with its own arena and relay) on loopback."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import torch

from flodl_shm import ClusterController, RoundKind, spawn
from flodl_shm.cluster.link import Link, client_handshake, connect

SALT = bytes(range(16))
HERE = os.path.dirname(os.path.abspath(__file__))


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


def kill_a_host_mid_run(tmp_path, max_failures):
    """Host 1 (rank 2 of 3, its own launcher process: ``cluster_driver.py``) is
    SIGKILLed mid-run while host 0 (ranks 0-1) runs ``survivor_rounds``. Returns
    ({"out": host 0's results} or {"error": its exception}, and "dead": the launcher's
    cohort-wide ``dead_ranks()``; the controller)."""
    ctl = ClusterController.start("127.0.0.1:0", 3, SALT)
    ready = tmp_path / "ready"
    env = dict(os.environ, DRIVER_READY_FILE=str(ready), CLUSTER_PORT=str(ctl.port),
               CLUSTER_SALT=SALT.hex())
    driver = subprocess.Popen([sys.executable, os.path.join(HERE, "cluster_driver.py")], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    box = {}

    def host0():
        ctx = spawn(survivor_rounds, 2, controller=f"127.0.0.1:{ctl.port}", world_size=3,
                    first_rank=0, salt=SALT, timeout=120, max_failures=max_failures, join=False)
        try:
            box["out"] = ctx.join()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            box["error"] = e
        box["dead"] = ctx.dead_ranks()

    t = threading.Thread(target=host0)
    t.start()
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), driver.communicate(timeout=5)
        driver.kill()
        driver.wait(30)
        t.join(120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(10)
        driver.stderr.close()
        ctl.shutdown()
    assert not t.is_alive(), "host 0 did not finish"
    return box, ctl


def run_hosts(fn, layout, *, args=(), salt=SALT, round_timeout=60.0, timeout=60.0,
              max_failures=0, controller_kwargs=None, join_timeout=150.0):
    """Start a controller and one spawn group per entry of ``layout`` (local rank counts),
    in threads; return (results by host, exceptions by host, controller)."""
    world = sum(layout)
    ctl = ClusterController.start("127.0.0.1:0", world, salt, round_timeout=round_timeout,
                                  **(controller_kwargs or {}))
    firsts = [sum(layout[:i]) for i in range(len(layout))]

    def host(i: int):
        mf = max_failures[i] if isinstance(max_failures, (list, tuple)) else max_failures
        return spawn(fn, layout[i], args, controller=f"127.0.0.1:{ctl.port}",
                     world_size=world, first_rank=firsts[i], salt=salt, timeout=timeout,
                     max_failures=mf)

    results, errors = run_host_threads(ctl, host, len(layout), join_timeout)
    return results, errors, ctl


def run_host_threads(ctl, host, hosts: int, join_timeout: float = 150.0):
    """Run ``host(i)`` for each host i in a thread of its own, then shut ``ctl`` down;
    return (results by host, exceptions by host). Fails if a host does not finish."""
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def run(i: int) -> None:
        try:
            results[i] = host(i)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"host{i}") for i in range(hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    stuck = [t.name for t in threads if t.is_alive()]
    ctl.shutdown()
    assert not stuck, f"hosts {stuck} did not finish"
    return [results.get(i) for i in range(hosts)], errors
