"""``flodl_shm.spawn`` offers torch.distributed's env:// rendezvous to its ranks, so
``dist.init_process_group("flodl_shm")`` runs unchanged under spawn and torchrun."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import c10d_driver  # noqa: E402
from engine_util import assert_no_leaks  # noqa: E402

import flodl_shm  # noqa: E402
from flodl_shm.engine.segment import list_segments  # noqa: E402


@pytest.mark.timeout(180)
def test_init_process_group_inside_spawn():
    results = flodl_shm.spawn(c10d_driver.spawn_rank, 2, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2 and r["engine_rank"] == r["rank"]
        assert r["sum"] == [3.0, 3.0, 3.0]
    pids = {r["pid"] for r in results}
    assert [s.name for s in list_segments() if s.owner_pid in pids] == []
    assert_no_leaks()
