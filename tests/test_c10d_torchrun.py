"""torchrun launches a plain DDP script on the "flodl_shm" backend: one host, and two
simulated hosts (two torchrun "nodes" told apart by FLODL_SHM_HOST) joined through
the host leaders' gloo group. Every launcher process is bounded and killed with its
process group at the deadline; no rank may leave a /dev/shm segment behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from c10d_driver import free_port  # noqa: E402

from flodl_shm.engine.segment import list_segments  # noqa: E402

HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
SCRIPT = HERE / "c10d_torchrun_script.py"

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")]


def torchrun_env(out: Path, host: str | None = None) -> dict[str, str]:
    """The environment of a torchrun launched by a test: this checkout importable, one
    thread a rank, ``host`` as FLODL_SHM_HOST, and TMPDIR a folder in ``out``: torchrun
    keeps its logs in a ``torchelastic_*`` folder of the temp dir that it never removes
    (a suite run left 12 in /tmp)."""
    temp = out / "torchrun-temp"
    temp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1", TMPDIR=str(temp))
    env.pop("FLODL_SHM_HOST", None)
    if host is not None:
        env["FLODL_SHM_HOST"] = host
    return env


def _launch(args: list[str], out: Path, host: str | None) -> subprocess.Popen:
    env = torchrun_env(out, host)
    return subprocess.Popen([str(TORCHRUN), *args, str(SCRIPT), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(procs: list[subprocess.Popen], timeout: float) -> None:
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher and its ranks
            out, _ = p.communicate()
        logs.append(out.decode(errors="replace"))
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    assert not bad, "torchrun failed:\n" + "\n".join(logs[i][-4000:] for i in bad)


def _results(out: Path, world: int) -> list[dict]:
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    pids = {r["pid"] for r in res}
    assert [s.name for s in list_segments() if s.owner_pid in pids] == []
    return res


def _check(res: list[dict]) -> None:
    world = len(res)
    total = float(sum(range(1, world + 1)))
    for r in res:
        assert r["world"] == world
        assert r["sum"].tolist() == [total] * 5
        assert r["again"].tolist() == [total] * 3, "a group created again after destroy"
        for p, q in zip(r["params"], res[0]["params"]):
            assert torch.equal(p, q)  # DDP kept every rank on the same bits


def test_torchrun_standalone(tmp_path):
    _finish([_launch(["--standalone", "--nproc-per-node", "2"], tmp_path, None)], 150)
    _check(_results(tmp_path, 2))


@pytest.mark.slow
def test_torchrun_two_nodes_on_two_simulated_hosts(tmp_path):
    port = free_port()
    procs = [_launch(["--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
                      "--master-addr", "127.0.0.1", "--master-port", str(port)],
                     tmp_path, f"node{n}") for n in range(2)]
    _finish(procs, 200)
    res = _results(tmp_path, 4)
    _check(res)
    assert [r["host"] for r in res] == ["node0", "node0", "node1", "node1"]


def test_ranks_that_exit_without_destroying_a_multi_host_group_exit_cleanly():
    """A probe: ranks of a two-host group that exited without
    ``dist.destroy_process_group()`` aborted now and then at the interpreter's teardown
    ('terminate called without an active exception', exit status -6; 2 of 6 runs, the
    lone rank of host "b"): its gloo group of host leaders was torn down with it. The
    backend now shuts down undestroyed groups at exit. Three runs of three ranks."""
    script = HERE / "c10d_exit_script.py"
    for _ in range(3):
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = []
        for rank, host in enumerate("aab"):
            env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1",
                       FLODL_SHM_HOST=host)
            procs.append(subprocess.Popen([sys.executable, str(script), init, str(rank), "3"],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        _finish(procs, 60)
