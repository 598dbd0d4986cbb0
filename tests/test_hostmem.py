"""host_memory(): memory figures that tell the truth in containers, on faked hosts
(a temp folder standing in for /proc, /sys/fs/cgroup and /dev/shm) and on this one."""
from __future__ import annotations

import os

import psutil
import pytest

from flodl_shm.engine.hostmem import UNLIMITED_V1, HostMemory, folder_used_bytes, host_memory

KB = 1 << 10
MB = 1 << 20
GB = 1 << 30
V1_NO_LIMIT = 9223372036854771712  # what the kernel writes for "no limit"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_host(root, *, total=24 * GB, avail=22 * GB, swap=(0, 0), proc_cgroup="0::/\n"):
    write(root / "proc/meminfo",
          f"MemTotal:       {total // KB} kB\nMemFree:        {avail // KB} kB\n"
          f"MemAvailable:   {avail // KB} kB\nSwapTotal:      {swap[0] // KB} kB\n"
          f"SwapFree:       {swap[1] // KB} kB\n")
    if proc_cgroup is not None:
        write(root / "proc/self/cgroup", proc_cgroup)
    (root / "dev/shm").mkdir(parents=True, exist_ok=True)
    return root


def v2(root, rel="", *, max="max", current=0, inactive_file=0, high=None):
    d = root / "sys/fs/cgroup" / rel
    write(d / "memory.max", f"{max}\n")
    write(d / "memory.current", f"{current}\n")
    write(d / "memory.stat", f"anon 1\nfile 2\ninactive_file {inactive_file}\nactive_file 3\n")
    if high is not None:
        write(d / "memory.high", f"{high}\n")
    return d


def v1(root, rel="", *, limit=V1_NO_LIMIT, usage=0, inactive_file=0):
    d = root / "sys/fs/cgroup/memory" / rel
    write(d / "memory.limit_in_bytes", f"{limit}\n")
    write(d / "memory.usage_in_bytes", f"{usage}\n")
    write(d / "memory.stat", f"cache 5\ninactive_file 7\ntotal_inactive_file {inactive_file}\n")
    return d


# -- cgroup v2 --------------------------------------------------------------------------


def test_a_2gib_container_on_a_24gib_host(tmp_path):
    fake_host(tmp_path, total=24 * GB, avail=22 * GB, swap=(4 * GB, 3 * GB))
    v2(tmp_path, max=2 * GB, current=700 * MB, inactive_file=200 * MB)
    m = host_memory(tmp_path)
    assert (m.host_total, m.host_available) == (24 * GB, 22 * GB)
    assert m.total == 2 * GB
    # reclaimable page cache counts as available, as MemAvailable counts it on the host
    assert m.available == 2 * GB - (700 * MB - 200 * MB) == m.cgroup_headroom
    assert (m.cgroup_version, m.cgroup_limit, m.cgroup_usage) == (2, 2 * GB, 700 * MB)
    assert m.cgroup_reclaimable == 200 * MB and m.limited_by_cgroup
    assert m.cgroup_path == str(tmp_path / "sys/fs/cgroup")
    assert (m.swap_total, m.swap_free) == (4 * GB, 3 * GB)
    assert m.sources["cgroup_limit"] == str(tmp_path / "sys/fs/cgroup/memory.max")
    assert m.sources["available"].startswith("cgroup v2 limit")
    assert m.sources["total"] == "cgroup v2 limit"


def test_v2_unlimited_keeps_host_figures(tmp_path):
    fake_host(tmp_path, total=24 * GB, avail=22 * GB)
    v2(tmp_path, max="max", current=300 * MB)
    m = host_memory(tmp_path)
    assert (m.total, m.available) == (24 * GB, 22 * GB)
    assert m.cgroup_version == 2 and m.cgroup_limit is None and m.cgroup_usage == 300 * MB
    assert m.cgroup_headroom is None and not m.limited_by_cgroup
    assert m.sources["available"] == "MemAvailable"


def test_v2_walks_up_to_the_tightest_ancestor(tmp_path):
    """A pod limit binds a container that has none of its own."""
    fake_host(tmp_path, proc_cgroup="0::/kubepods/pod1/ctr\n")
    v2(tmp_path, "kubepods", max=16 * GB, current=10 * GB)       # 6 GiB headroom
    v2(tmp_path, "kubepods/pod1", max=3 * GB, current=1 * GB)     # 2 GiB headroom: binds
    v2(tmp_path, "kubepods/pod1/ctr", max="max", current=1 * GB)
    m = host_memory(tmp_path)
    assert m.cgroup_limit == 3 * GB and m.available == 2 * GB and m.total == 3 * GB
    assert m.cgroup_path == str(tmp_path / "sys/fs/cgroup/kubepods/pod1")


def test_v2_headroom_not_limit_picks_the_level(tmp_path):
    """A parent with a bigger limit but siblings using most of it binds first."""
    fake_host(tmp_path, proc_cgroup="0::/a/b\n")
    v2(tmp_path, "a", max=8 * GB, current=7 * GB)            # 1 GiB headroom
    v2(tmp_path, "a/b", max=4 * GB, current=1 * GB)          # 3 GiB headroom
    m = host_memory(tmp_path)
    assert m.available == 1 * GB == m.cgroup_headroom and m.cgroup_limit == 4 * GB
    assert m.total == 4 * GB  # the tightest limit bounds what it can ever use
    assert m.cgroup_path == str(tmp_path / "sys/fs/cgroup/a") and m.cgroup_usage == 7 * GB


def test_v2_memory_high_counts_as_a_limit(tmp_path):
    fake_host(tmp_path)
    v2(tmp_path, max=4 * GB, high=3 * GB, current=1 * GB)
    m = host_memory(tmp_path)
    assert m.cgroup_limit == 3 * GB and m.available == 2 * GB
    assert m.sources["cgroup_limit"].endswith("memory.high")


def test_usage_above_the_limit_reads_zero_available(tmp_path):
    fake_host(tmp_path)
    v2(tmp_path, max=1 * GB, current=1 * GB + 4096)
    assert host_memory(tmp_path).available == 0


def test_host_memavailable_below_the_cgroup_headroom_wins(tmp_path):
    fake_host(tmp_path, total=8 * GB, avail=1 * GB)
    v2(tmp_path, max=6 * GB, current=1 * GB)
    m = host_memory(tmp_path)
    assert m.available == 1 * GB and m.total == 6 * GB and not m.limited_by_cgroup
    assert m.sources["available"] == "MemAvailable"


# -- cgroup v1 --------------------------------------------------------------------------


def test_v1_huge_limit_means_unlimited(tmp_path):
    """This machine's shape: hybrid hierarchy, memory on v1 with the kernel's 2^63−4096."""
    fake_host(tmp_path, total=24 * GB, avail=23 * GB,
              proc_cgroup="4:memory:/process_api/abc\n1:cpu:/\n0::/\n")
    (tmp_path / "sys/fs/cgroup/unified").mkdir(parents=True)   # v2 mount without memory
    v1(tmp_path, "")
    v1(tmp_path, "process_api/abc", usage=12 * MB, inactive_file=1 * MB)
    m = host_memory(tmp_path)
    assert V1_NO_LIMIT >= UNLIMITED_V1
    assert m.cgroup_version == 1 and m.cgroup_limit is None
    assert m.cgroup_usage == 12 * MB and m.cgroup_reclaimable == 1 * MB
    assert m.cgroup_path == str(tmp_path / "sys/fs/cgroup/memory/process_api/abc")
    assert (m.total, m.available) == (24 * GB, 23 * GB)


def test_v1_limit_binds(tmp_path):
    fake_host(tmp_path, proc_cgroup="9:cpuacct,cpu:/x\n4:memory:/x\n")
    v1(tmp_path, "x", limit=2 * GB, usage=1 * GB, inactive_file=256 * MB)
    m = host_memory(tmp_path)
    assert m.cgroup_version == 1 and m.cgroup_limit == 2 * GB
    assert m.available == 2 * GB - (1 * GB - 256 * MB) and m.total == 2 * GB


def test_v1_container_without_cgroup_namespace(tmp_path):
    """/proc/self/cgroup names the host's hierarchy (/docker/<id>) but the container's
    mount shows its own cgroup at the root: the walk up finds the limit there."""
    fake_host(tmp_path, proc_cgroup="4:memory:/docker/0123abcd\n")
    v1(tmp_path, "", limit=2 * GB, usage=512 * MB)
    m = host_memory(tmp_path)
    assert m.cgroup_limit == 2 * GB and m.available == 2 * GB - 512 * MB
    assert m.cgroup_path == str(tmp_path / "sys/fs/cgroup/memory")


def test_no_cgroup_at_all(tmp_path):
    fake_host(tmp_path, total=4 * GB, avail=3 * GB, proc_cgroup=None)
    m = host_memory(tmp_path)
    assert m.cgroup_version is None and m.cgroup_limit is None and m.cgroup_path is None
    assert (m.total, m.available) == (4 * GB, 3 * GB)
    assert m.sources["cgroup_limit"] == "no memory cgroup found"


# -- /proc/meminfo and /dev/shm ----------------------------------------------------------


def test_missing_meminfo_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "proc/meminfo")):
        host_memory(tmp_path)
    write(tmp_path / "proc/meminfo", "MemTotal: 100 kB\n")
    with pytest.raises(ValueError, match="no MemAvailable line"):
        host_memory(tmp_path)


def test_stated_shm_size_subtracts_the_files_like_tmpfs(tmp_path):
    fake_host(tmp_path)
    shm = tmp_path / "dev/shm"
    (shm / "fshm_1_ab_ctl").write_bytes(b"x" * (1 * MB))
    used = folder_used_bytes(shm)
    assert used >= 1 * MB
    m = host_memory(tmp_path, shm_total_bytes=64 * MB)
    assert m.shm_total == 64 * MB and m.shm_free == 64 * MB - used
    assert m.shm_dir == str(shm)
    (shm / "fshm_1_ab_ctl").unlink()
    assert host_memory(tmp_path, shm_total_bytes=64 * MB).shm_free == 64 * MB
    m = host_memory(tmp_path, shm_total_bytes=64 * MB, shm_free_bytes=5 * MB)
    assert (m.shm_total, m.shm_free) == (64 * MB, 5 * MB)
    with pytest.raises(ValueError, match="shm_total_bytes=-1 must be >= 0"):
        host_memory(tmp_path, shm_total_bytes=-1)


def test_missing_shm_dir_reads_zero(tmp_path):
    fake_host(tmp_path)
    m = host_memory(tmp_path, shm_dir=tmp_path / "nope")
    assert (m.shm_total, m.shm_free) == (0, 0) and "does not exist" in m.sources["shm"]


def test_this_host_matches_psutil_and_statvfs():
    m = host_memory()
    assert isinstance(m, HostMemory)
    assert m.host_total == psutil.virtual_memory().total
    assert m.swap_total == psutil.swap_memory().total
    st = os.statvfs("/dev/shm")
    assert m.shm_total == st.f_blocks * st.f_frsize and m.shm_dir == "/dev/shm"
    assert 0 < m.available <= m.total <= m.host_total
    if m.cgroup_limit is None:
        assert m.total == m.host_total
    d = m.to_dict()
    assert d["available"] == m.available and "cgroup_headroom" in d and d["sources"]
