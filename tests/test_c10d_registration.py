"""Registering the "flodl_shm" c10d backend: cheap on ``import flodl_shm`` (no torch),
effective whichever of flodl_shm and torch is imported first; host grouping."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flodl_shm.distributed.rendezvous import host_identity, topology_from_identities

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(150)
def test_import_flodl_shm_loads_no_torch_and_registers_when_torch_loads():
    got = _python("import sys, flodl_shm; print('torch' in sys.modules); "
                  "import torch.distributed as dist; "
                  "print('flodl_shm' in dist.Backend.backend_list, "
                  "dist.Backend.default_device_backend_map['cpu'])")
    assert got.splitlines() == ["False", "True gloo"]  # gloo stays the CPU default


@pytest.mark.timeout(150)
def test_registers_when_torch_was_imported_first():
    got = _python("import torch.distributed as dist, flodl_shm; "
                  "print(dist.Backend('flodl_shm'), dist.Backend.FLODL_SHM)")
    assert got == "flodl_shm flodl_shm"


def test_hosts_are_ordered_by_lowest_rank_and_may_interleave():
    topo = topology_from_identities(1, ["b", "a", "b", "c", "a"])
    assert topo.hosts == ((0, 2), (1, 4), (3,))
    assert topo.local_ranks == (1, 4) and topo.local_rank == 0 and topo.is_leader
    assert topo.leaders == (0, 1, 3) and topo.multi_host and topo.host_of(3) == 2
    other = topology_from_identities(4, ["b", "a", "b", "c", "a"])
    assert other.local_rank == 1 and not other.is_leader
    assert not topology_from_identities(0, ["h", "h"]).multi_host


def test_host_identity_prefers_the_environment(monkeypatch):
    monkeypatch.setenv("FLODL_SHM_HOST", "rack7-node3")
    assert host_identity() == "rack7-node3"
    monkeypatch.delenv("FLODL_SHM_HOST")
    import socket

    assert host_identity() == socket.gethostname()
