"""A host leader killed during rendezvous (its arena created, not yet mapped by every
host peer, so the segment names still exist) leaves named segments in /dev/shm; the
next "flodl_shm" group on the machine (e.g. torchrun's next attempt) reaps them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from c10d_driver import free_port  # noqa: E402

from flodl_shm.distributed.incarnation import incarnation_store  # noqa: E402
from flodl_shm.engine.segment import list_segments  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)

# rank 0 of a world of 2 through flodl_shm's rendezvous on the test's store; rank 1 is
# the test, which joins the group's incarnation and publishes its identity but never maps
# the arena
LEADER = """
import sys
from datetime import timedelta
import torch.distributed as dist
from flodl_shm.distributed.rendezvous import rendezvous
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timedelta(seconds=60))
rendezvous(store, 0, 2, timedelta(seconds=60))
"""

GROUP = """
import sys
import torch, torch.distributed as dist
import flodl_shm
dist.init_process_group("flodl_shm", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def _python(code: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLODL_SHM_HOST="stale")
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_the_next_group_reaps_a_killed_leaders_named_segments():
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=60),
                          wait_for_workers=False)
    leader = _python(LEADER, str(port))
    try:
        keys = incarnation_store(store, 1, 2, timedelta(seconds=60),
                                 "the test (rank 1 of 2)").keys
        keys.set("host/1", "stale")
        keys.set("pid/1", str(os.getpid()))
        deadline = time.monotonic() + 60
        while not keys.check(["arena/0"]):   # the leader created and published its arena
            assert leader.poll() is None, leader.communicate()[0].decode()
            assert time.monotonic() < deadline, "the leader never published its arena"
            time.sleep(0.05)
        leader.send_signal(signal.SIGKILL)    # waiting for mapped/1: names still exist
        leader.wait()
        stale = [s.name for s in list_segments() if s.owner_pid == leader.pid]
        assert stale, "the killed leader left no named segment: the scenario did not happen"

        group = _python(GROUP, str(free_port()))
        out, _ = group.communicate(timeout=90)
        assert group.returncode == 0, out.decode()
        assert [s.name for s in list_segments() if s.owner_pid == leader.pid] == []
        assert [s.name for s in list_segments() if s.owner_pid == group.pid] == []
    finally:
        if leader.poll() is None:
            leader.kill()
            leader.wait()


def test_a_rank_admitted_by_another_jobs_rank_0_says_to_give_each_job_its_port():
    """Two jobs on one host with one MASTER_PORT share a store: another job's rank 0 can
    admit a rank of this one, which then reads that job's arena, mapped and unlinked by
    its own ranks. It failed with a bare FileNotFoundError naming the other job's
    segment."""
    import pickle
    import threading

    from flodl_shm.distributed.rendezvous import host_identity, rendezvous
    from flodl_shm.engine.arena import Arena

    gone = Arena.create(2)  # the other job's arena: its ranks mapped it, the names went
    gone.unlink()
    gone.close()
    store = dist.HashStore()

    def other_jobs_rank_0() -> None:
        keys = incarnation_store(store, 0, 2, timedelta(seconds=5),
                                 "the other job's rank 0").keys
        keys.set("host/0", host_identity())
        keys.set("pid/0", str(os.getpid()))
        keys.set("arena/0", pickle.dumps(gone.handle))

    other = threading.Thread(target=other_jobs_rank_0)
    other.start()
    try:
        with pytest.raises(RuntimeError, match=rf"rank 1 of 2\): the group's store names host "
                                               rf"arena {gone.handle.name('ctl')} of leader "
                                               rf"pid {os.getpid()}, which is gone: .*another "
                                               rf"job's rank 0 admitted this rank: .*give each "
                                               rf"job its own port \(MASTER_PORT"):
            rendezvous(store, 1, 2, timedelta(seconds=5))
    finally:
        other.join()
