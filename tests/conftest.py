"""Shared fixtures."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from flodl_shm.cluster import wire

# The test process is the launcher of most tests' ranks. A launcher whose torch has started
# its OpenMP pool is not safe to fork, so every spawn after the first multi-threaded torch
# operation here would start its rank server as a fresh interpreter (about 2 s more per test,
# docs/runtime.md "Start-up"). One intra-op thread keeps this process fork-safe, so the
# suite's spawns take the start-up a user's script gets; the fresh-server start-up keeps its
# own tests (test_spawn_startup.py). Ranks set their own thread counts.
torch.set_num_threads(1)

# A suite started in the background of a non-interactive shell (`pytest ... &` in a script,
# nohup, some CI runners) inherits SIGINT ignored, and so would every command a test starts:
# the tests that send Ctrl-C to a command then saw it run to its end, exit 0 (a command
# keeps an ignored SIGINT ignored, as nohup asks). The suite runs as a terminal's would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Every kernel module, in two groups of about equal compile time (each about 24 s here on a
# cold cache): _kernels_compiled_once compiles one group per process.
_KERNEL_GROUPS = ("rounds parts signals", "kernels cma tensorio outer_step permutation")
_WARM_GROUP = """
import sys, importlib
for name in sys.argv[1].split():
    package = importlib.import_module("flodl_shm.kernels")
    (package if name == "kernels" else importlib.import_module(package.__name__ + "." + name)
     ).warm_up()
"""


@pytest.fixture(scope="session", autouse=True)
def _kernels_compiled_once():
    """Before the first test: numba's cache holds every kernel. A fresh checkout (CI's)
    has none; its first tests compiled them one after another, about 50 s of one core,
    while the other core idled. Here two processes compile half each, at once, and the
    folder is marked complete (``kernels.cache_complete``): later runs skip this."""
    import subprocess
    import sys

    from flodl_shm.kernels import cache_complete, mark_cache_complete
    from flodl_shm.launch.rank_server import KERNEL_MODULES

    grouped = sorted(" ".join(_KERNEL_GROUPS).split())
    assert grouped == sorted(("kernels",) + KERNEL_MODULES), (
        f"_KERNEL_GROUPS lists {grouped}: give each kernel module a group")
    if cache_complete():
        yield
        return
    procs = [subprocess.Popen([sys.executable, "-c", _WARM_GROUP, group],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for group in _KERNEL_GROUPS]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for group, p, out in zip(_KERNEL_GROUPS, procs, outs):
        assert p.returncode == 0, f"compiling the kernels of {group} failed:\n{out}"
    mark_cache_complete()
    yield


@pytest.fixture
def payload_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of every payload buffer the frame reader allocates during the test.

    Wraps the real ``wire._alloc_payload`` (the reader's one allocation point);
    allocation itself is unchanged.
    """
    sizes: list[int] = []
    real = wire._alloc_payload

    def recording(nbytes: int):
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(wire, "_alloc_payload", recording)
    return sizes


def _rank_server_folders() -> set[Path]:
    from flodl_shm.launch.listener_folder import PREFIX, base

    return set(Path(base()).glob(f"{PREFIX}*"))


@pytest.fixture(scope="session", autouse=True)
def _no_rank_server_folder_left():
    """After the suite: no rank server's socket folder of this process left behind. Each
    ``spawn`` removes its own once every rank has started (``_RankServer.close_listener``);
    one left names a path that skips that. The folders of launchers that are gone (a
    test's launcher killed mid start-up) are the next start's to reap
    (``listener_folder.reap``): reaped here, as no later start may come."""
    import os
    import shutil

    from flodl_shm.engine.segment import pid_alive
    from flodl_shm.launch.listener_folder import launcher_pid

    before = _rank_server_folders()
    yield
    left = []
    for path in sorted(_rank_server_folders() - before):
        pid = launcher_pid(path.name)
        if pid is not None and pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
        else:
            left.append(path)
    assert not left, f"the suite left rank-server socket folders behind: {left}"
