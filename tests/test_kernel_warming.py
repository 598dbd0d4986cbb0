"""kernels.warming: a cold cache compiles half the kernels in a helper process, which
is gone when the warm-up returns, or dies with the process that started it. A copy of
the suite's cache without its ``complete`` mark and without one module's kernels
stands in for a cold cache (a real one takes about 25 s to compile)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_util import processes_gone  # noqa: E402
from test_spawn_startup import _cache_without  # noqa: E402

from flodl_shm.kernels._cache import COMPLETE_MARKER  # noqa: E402

pytestmark = pytest.mark.timeout(120)

_WARM_ALL = """
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
if sys.argv[1] == "one-core":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from flodl_shm.kernels import cache_complete
from flodl_shm.kernels.warming import warm_all
print("complete before:", cache_complete(), flush=True)
warm_all()
print("complete after:", cache_complete(), flush=True)
"""


def _warm_all(base: str, cores: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["FLODL_SHM_NUMBA_CACHE"] = base
    return subprocess.Popen([sys.executable, "-c", _WARM_ALL, cores], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _helper_pid(line: str) -> int | None:
    m = re.search(r"in a helper process \(pid (\d+)\)", line)
    return None if m is None else int(m.group(1))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("cores", ["all", "one-core"])
def test_a_cold_cache_is_compiled_with_a_helper_on_two_cores_and_marked_complete(
        tmp_path, cores):
    base = _cache_without(tmp_path / "numba", COMPLETE_MARKER, "permutation.")
    proc = _warm_all(base, cores)
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert lines[0] == "complete before: False" and lines[-1] == "complete after: True", out
    assert lines[1] == ("compiling flodl_shm's kernels for this machine, once: about "
                        f"{'a minute' if cores == 'one-core' else '30 s'} (later runs load "
                        "them in a second)"), out
    said = lines[2]
    assert said.startswith(f"compiling the kernels into {base}/flodl_shm-"), out
    pid = _helper_pid(said)
    if cores == "one-core":
        assert said.endswith(", once: all in this process") and pid is None, said
    else:
        assert pid is not None, said
        assert not psutil.pid_exists(pid), "the helper outlived the warm-up"
    folder = next(Path(base).iterdir())
    assert (folder / COMPLETE_MARKER).exists()
    assert any(folder.rglob("permutation.*.nbi")), "the missing kernels were not compiled"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_helper_dies_with_the_process_that_started_it(tmp_path):
    """A launcher killed (SIGKILL) while its helper compiles: the helper goes at once,
    not after its half of the compile."""
    base = _cache_without(tmp_path / "numba", COMPLETE_MARKER, "cma.")  # ~12 s in the helper
    proc = _warm_all(base, "all")
    try:
        assert proc.stdout.readline() == "complete before: False\n"
        proc.stdout.readline()  # (the warning: the test above reads it)
        pid = _helper_pid(proc.stdout.readline())
        assert pid is not None
        helper = psutil.Process(pid)
        while helper.cpu_times().user < 1.5:  # past its start-up checks, compiling
            assert helper.is_running() and proc.poll() is None, "the helper ended early"
            time.sleep(0.05)
        proc.kill()
        proc.wait(30)
        assert processes_gone([pid], timeout=10), "the helper outlived its starter"
    finally:
        proc.kill()
        proc.wait()
    assert not (next(Path(base).iterdir()) / COMPLETE_MARKER).exists()


_FIRST_SPAWN = """
import flodl_shm


def f(ctx):
    return ctx.rank


if __name__ == "__main__":
    print(flodl_shm.spawn(f, 2))
"""


def test_a_script_s_first_spawn_says_it_compiles_once(tmp_path):
    """A user's own script (no logging set up) spawning on a cold cache sat 30-50 s
    without a word, as if it hung: only the demo said why. The warm-up's warning now
    shows where a script's user sees it, once: the next spawn loads the kernels."""
    base = _cache_without(tmp_path / "numba", COMPLETE_MARKER)
    script = tmp_path / "first.py"
    script.write_text(_FIRST_SPAWN)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["FLODL_SHM_NUMBA_CACHE"] = base
    said = []
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                              text=True, timeout=100)
        assert (done.returncode, done.stdout) == (0, "[0, 1]\n"), done.stderr
        said.append(done.stderr.splitlines())
    cores = len(os.sched_getaffinity(0))
    assert said == [[f"compiling flodl_shm's kernels for this machine, once: about "
                     f"{'30 s' if cores > 1 else 'a minute'} (later runs load them in a "
                     f"second)"], []]
