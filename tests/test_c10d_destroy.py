"""destroy_process_group on a "flodl_shm" group releases the rank's shared-memory mappings
and descriptors at once, not at the garbage collector's next pass (a sweep or a notebook
that creates groups in a loop kept one mapping and one descriptor per group), and a formed
group leaves one key in its store (torchrun's store lives as long as the job)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from c10d_driver import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

LOOP = """
import gc, os, sys, torch, torch.distributed as dist
import flodl_shm
gc.disable()  # as between two passes of the collector
def held():
    maps = sum("fshm_" in line for line in open("/proc/self/maps"))
    return maps, len(os.listdir("/proc/self/fd"))
start = held()
for i, port in enumerate(map(int, sys.argv[1:])):
    dist.init_process_group("flodl_shm", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    x = torch.ones(10)
    dist.all_reduce(x)
    g = dist.new_group([0], backend="flodl_shm")
    dist.all_reduce(x, group=g)
    dist.destroy_process_group()
    print(i, *held(), flush=True)
print("start", *start)
"""


def test_destroyed_groups_leave_no_mapping_or_descriptor_behind():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("FLODL_SHM_HOST", None)
    out = subprocess.run([sys.executable, "-c", LOOP, *(str(free_port()) for _ in range(4))],
                         env=env, capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    *rounds, start = [line.split() for line in out.stdout.splitlines()]
    assert start[0] == "start"
    fds_before = int(start[2])
    for i, maps, fds in rounds:
        assert int(maps) == 0, f"after group {i}: {maps} fshm_ mappings held"
        assert int(fds) <= fds_before + 2, f"after group {i}: {fds} descriptors"
    assert len({fds for _, _, fds in rounds}) == 1  # no growth from one group to the next


GROUPS = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
import flodl_shm
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
dist.init_process_group("flodl_shm", store=store, rank=rank, world_size=2)
x = torch.ones(4)
for i in range(4):
    g = dist.new_group([0, 1], backend="flodl_shm")
    dist.all_reduce(x, group=g)
    dist.destroy_process_group(g)
    dist.barrier()
    if rank == 0:
        print(store.num_keys(), flush=True)
    dist.barrier()
print(float(x[0]), flush=True)
dist.destroy_process_group()
"""


def test_groups_created_and_destroyed_leave_one_key_each_in_their_store():
    """A probe's torchrun job created and destroyed 2,828 groups: 10 keys stayed in the
    agent's store for each (gloo's leave 2), and the agent grew by 0.9 MB a minute."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("FLODL_SHM_HOST", None)
    with socket.socket() as s:  # the store's host binds it right away
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    ranks = [subprocess.Popen([sys.executable, "-c", GROUPS, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=100) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err for _, err in outs]
    *counts, value = outs[0][0].split()
    assert float(value) == 16.0  # the groups did reduce: 1 doubled four times
    # one key a group: its retired offer (gloo leaves two), none of its other keys
    assert counts == ["2", "3", "4", "5"], counts  # (the default group's offer among them)
    assert store.num_keys() == 5
