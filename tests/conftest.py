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


@pytest.fixture(scope="session", autouse=True)
def _kernels_compiled_once():
    """Before the first test: every kernel in numba's cache, as a ``spawn``'s warm-up
    leaves it. A fresh checkout (CI's) has none: its first tests compiled them one after
    another, about 50 s of one core; the warm-up compiles half of them in a helper
    process meanwhile (``kernels.warming``)."""
    from flodl_shm.kernels.warming import warm_all

    warm_all()
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
