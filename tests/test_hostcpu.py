"""The CPUs a process here can keep busy: its affinity capped by its cgroup's CPU quota.

A container limited by a quota (``docker --cpus``, a Kubernetes ``limits.cpu``) sees
every core of its node in its affinity; spawn sized the ranks' torch threads by that
and the ranks spun as if each had a core. Fake hosts (folders standing for ``/``)
pin the file formats and the walk up the hierarchy; one test runs a real process in
a real cgroup where this machine lets it make one.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from flodl_shm.engine.hostcpu import CpuQuota, available_cores, cpu_quota

pytestmark = pytest.mark.timeout(120)

AFFINITY = len(os.sched_getaffinity(0))


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_host(root: Path, proc_cgroup: str) -> Path:
    write(root / "proc/self/cgroup", proc_cgroup)
    return root


def test_a_v2_quota_caps_the_cores(tmp_path):
    fake_host(tmp_path, "0::/\n")
    write(tmp_path / "sys/fs/cgroup/cpu.max", "50000 100000\n")
    assert cpu_quota(tmp_path) == CpuQuota(0.5, str(tmp_path / "sys/fs/cgroup/cpu.max"))
    assert available_cores(tmp_path) == 1  # half a CPU's time: one core busy at a time


def test_v2_walks_up_to_the_tightest_level_and_rounds_up(tmp_path):
    fake_host(tmp_path, "0::/kubepods/pod1/ctr\n")
    base = tmp_path / "sys/fs/cgroup"
    write(base / "cpu.max", "max 100000\n")
    write(base / "kubepods/cpu.max", "max 100000\n")
    write(base / "kubepods/pod1/cpu.max", "150000 100000\n")  # the pod's limit binds
    write(base / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    got = cpu_quota(tmp_path)
    assert got.cores == 1.5 and got.source.endswith("kubepods/pod1/cpu.max")
    assert available_cores(tmp_path) == min(AFFINITY, 2)


def test_no_quota_keeps_the_affinity(tmp_path):
    fake_host(tmp_path, "0::/a\n")
    write(tmp_path / "sys/fs/cgroup/cpu.max", "max 100000\n")
    write(tmp_path / "sys/fs/cgroup/a/cpu.max", "max 100000\n")
    assert cpu_quota(tmp_path) is None
    assert available_cores(tmp_path) == AFFINITY
    assert cpu_quota(tmp_path / "nowhere") is None  # no /proc/self/cgroup at all


def test_a_v1_quota_of_the_cpu_controller(tmp_path):
    fake_host(tmp_path, "12:memory:/docker/x\n4:cpu,cpuacct:/docker/x\n")
    mount = tmp_path / "sys/fs/cgroup/cpu"
    write(mount / "cpu.cfs_quota_us", "-1\n")  # the root: unlimited
    write(mount / "cpu.cfs_period_us", "100000\n")
    write(mount / "docker/x/cpu.cfs_quota_us", "100000\n")
    write(mount / "docker/x/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(tmp_path) == CpuQuota(1.0, str(mount / "docker/x/cpu.cfs_quota_us"))
    assert available_cores(tmp_path) == 1
    write(mount / "docker/x/cpu.cfs_quota_us", "-1\n")
    assert cpu_quota(tmp_path) is None


@pytest.mark.parametrize("text", ["", "garbage\n", "0 100000\n", "100000 0\n", "100000\n"])
def test_an_unreadable_quota_sets_none(tmp_path, text):
    fake_host(tmp_path, "0::/\n")
    write(tmp_path / "sys/fs/cgroup/cpu.max", text)
    assert cpu_quota(tmp_path) is None
    assert available_cores(tmp_path) == AFFINITY


_IN_A_CGROUP = """
from flodl_shm.engine.hostcpu import available_cores, cpu_quota
from flodl_shm.engine.waiting import oversubscribed
from flodl_shm.launch.supervisor import rank_threads
print(cpu_quota().cores, available_cores(), rank_threads(1), oversubscribed(2))
"""


def test_a_real_process_in_a_cgroup_with_half_a_cpu():
    """Where this machine lets the test make a cgroup v1 ``cpu`` group (root, a
    writable hierarchy): a process in it gets one core, one torch thread per rank,
    and two ranks are oversubscribed."""
    group = Path(f"/sys/fs/cgroup/cpu/fshm_test_{uuid.uuid4().hex[:8]}")
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"no cgroup v1 cpu group can be made here ({e.strerror})")
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("50000")
        env = dict(os.environ, OMP_NUM_THREADS="")
        out = subprocess.run(
            ["bash", "-c", f'echo $$ > {group}/cgroup.procs || exit 77; exec "$0" -c "$1"',
             sys.executable, _IN_A_CGROUP],
            capture_output=True, text=True, timeout=60, env=env,
            cwd=Path(__file__).resolve().parents[1])
        if out.returncode == 77:
            pytest.skip(f"no process can be moved into a cgroup here: {out.stderr.strip()}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["0.5", "1", "1", "True"]
    finally:
        group.rmdir()  # the process has exited: the group is empty
