"""Run several "hosts" (spawn groups, each with its own arena and relay) on loopback."""
from __future__ import annotations

import threading

from flodl_shm import ClusterController, spawn

SALT = bytes(range(16))


def run_hosts(fn, layout, *, args=(), salt=SALT, round_timeout=60.0, timeout=60.0,
              max_failures=0, controller_kwargs=None, join_timeout=150.0):
    """Start a controller and one spawn group per entry of ``layout`` (local rank counts),
    in threads; return (results by host, exceptions by host, controller)."""
    world = sum(layout)
    ctl = ClusterController.start("127.0.0.1:0", world, salt, round_timeout=round_timeout,
                                  **(controller_kwargs or {}))
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}
    firsts = [sum(layout[:i]) for i in range(len(layout))]

    def host(i: int) -> None:
        mf = max_failures[i] if isinstance(max_failures, (list, tuple)) else max_failures
        try:
            results[i] = spawn(fn, layout[i], args, controller=f"127.0.0.1:{ctl.port}",
                               world_size=world, first_rank=firsts[i], salt=salt,
                               timeout=timeout, max_failures=mf)
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errors[i] = e

    threads = [threading.Thread(target=host, args=(i,), name=f"host{i}") for i in range(len(layout))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    stuck = [t.name for t in threads if t.is_alive()]
    ctl.shutdown()
    assert not stuck, f"hosts {stuck} did not finish"
    return [results.get(i) for i in range(len(layout))], errors, ctl
