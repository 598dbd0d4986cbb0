"""Shared fixtures."""
from __future__ import annotations

import signal
import tempfile
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
    return set(Path(tempfile.gettempdir()).glob("fshm_rank_server_*"))


@pytest.fixture(scope="session", autouse=True)
def _no_rank_server_folder_left():
    """After the suite: no rank server's socket folder left in the temp dir. Each
    ``spawn`` removes its own once every rank has started (``_RankServer.close_listener``);
    one left names a path that skips that (a launcher killed mid start-up leaves one by
    design, and no test does that)."""
    before = _rank_server_folders()
    yield
    left = sorted(_rank_server_folders() - before)
    assert not left, f"the suite left rank-server socket folders behind: {left}"
