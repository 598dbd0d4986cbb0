"""LocalSGD(comm=None) under torchrun: the default "flodl_shm" process group's Comm
carries the window; the consensus is the realized-work weighted mean on every rank."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_c10d_torchrun import TORCHRUN, _finish, torchrun_env  # noqa: E402

from flodl_shm.engine.segment import list_segments  # noqa: E402

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")]


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory) -> list[dict]:
    """One ``torchrun --standalone --nproc-per-node 2`` of the script, whose process group
    carries its three runs one after another (a torchrun costs about 7 s here): each
    rank's result by run name."""
    out = tmp_path_factory.mktemp("local_sgd_torchrun")
    env = torchrun_env(out)
    proc = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc-per-node", "2",
                             str(HERE / "local_sgd_torchrun_script.py"), str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    _finish([proc], 150)
    res = {name: [torch.load(out / f"rank{r}.{name}.pt", weights_only=False)
                  for r in range(2)] for name in ("small", "big", "diloco")}
    pids = {r["pid"] for r in res["small"]}
    assert [s.name for s in list_segments() if s.owner_pid in pids] == []
    return res


@pytest.mark.parametrize("size", ["small", "big", "diloco"])
def test_local_sgd_on_the_default_process_group_under_torchrun(torchrun_runs, size):
    """``big``: a 9 MiB model, whose parameters the group's direct rounds average in
    the ranks' shared parameter blocks (mapped by every rank at the rendezvous, before
    the segment names are unlinked). ``diloco``: the outer step in the reduce, whose
    state lives in the arena's outer segment (mapped at the rendezvous too). The three
    run one after another on the same process group."""
    res = torchrun_runs[size]
    w = [2.0 * (3 + r) for r in range(2)]
    for r in res:
        assert r["mass"] == sum(w) and r["accepted"] == (0, 1)
        assert (r["shared_params"], r["mapped_rounds"]) == ((True, 2) if size == "big"
                                                            else (False, 0))
        for a, b in zip(r["init"], res[0]["init"]):
            assert torch.equal(a, b)                   # rank 0's weights everywhere
        for a, b in zip(r["after"], res[0]["after"]):
            assert torch.equal(a, b)                   # identical replicas after the sync
    for got, init, l0, l1 in zip(res[0]["after"], res[0]["init"], res[0]["local"],
                                 res[1]["local"]):
        mean = (l0 * w[0] + l1 * w[1]) / sum(w)
        if size == "diloco":  # the first outer step from the initial global (0.7, 0.9)
            mean = _nesterov_first_step(init, mean, lr=0.7, mu=0.9)
        torch.testing.assert_close(got, mean, rtol=1e-6, atol=1e-6)


def _nesterov_first_step(prev: torch.Tensor, consensus: torch.Tensor, *, lr: float,
                         mu: float) -> torch.Tensor:
    """The outer Nesterov step from ``prev`` with a fresh momentum (kernels/outer_step.py)."""
    import numpy as np

    from flodl_shm.kernels.outer_step import nesterov_step_flat

    p = prev.reshape(-1).numpy().astype(np.float32)
    c = consensus.reshape(-1).numpy().astype(np.float32)
    out, momentum = np.empty_like(p), np.empty_like(p)
    nesterov_step_flat(p, c, momentum, lr, mu, True, out)
    return torch.from_numpy(out).reshape(prev.shape)


GROUPS = """
import sys, torch, torch.distributed as dist
import flodl_shm
port, backend = sys.argv[1], sys.argv[2]
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Linear(3, 2)
for comm in (None, dist.group.WORLD, dist.new_group([0], backend="flodl_shm")):
    sgd = flodl_shm.LocalSGD(model, sync_every=1, comm=comm)
    print("synced", sgd.step(samples=1), sgd.sync_round)
try:
    flodl_shm.LocalSGD(model, sync_every=1, comm=dist.new_group([0], backend="gloo"))
except ValueError as e:
    print("refused:", e)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["flodl_shm", "cpu:flodl_shm,cuda:nccl"])
def test_local_sgd_takes_a_process_group_and_the_mixed_device_backend_string(backend):
    """The mixed-device string docs/c10d.md recommends was refused by comm=None, and a
    process group passed as comm failed with "int() argument must be ... not 'method'"."""
    from c10d_driver import free_port

    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    env.pop("FLODL_SHM_HOST", None)
    out = subprocess.run([sys.executable, "-c", GROUPS, str(free_port()), backend], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "synced True 1", "synced True 1", "synced True 1",
        "refused: LocalSGD(comm=<a process group>) needs the process group to use the "
        "'flodl_shm' backend for CPU tensors, got 'gloo': init_process_group('flodl_shm'), "
        "or pass comm=ctx.comm under flodl_shm.spawn"]
    # a probe: the mixed string builds no nccl (torch gives a Python backend the whole
    # group); said once, by rank 0, at init
    said = [ln for ln in out.stderr.splitlines() if "builds" in ln or "no nccl" in ln]
    if backend == "flodl_shm":
        assert said == [], out.stderr
    else:
        assert said == ["cpu:flodl_shm,cuda:nccl: torch gives a Python backend such as "
                        "flodl_shm the whole process group, so no nccl backend is built "
                        "(collectives of cuda tensors on this group raise). Give them a group "
                        "of their own, e.g. dist.new_group(backend='nccl')"], out.stderr


def test_a_tensor_off_the_cpu_is_refused_with_a_way_that_works():
    """The refusal of a CUDA tensor recommended 'cpu:flodl_shm,cuda:nccl', which builds no
    nccl (a probe): a group of its own is the way."""
    from flodl_shm.distributed.reduce_ops import check_dtype

    with pytest.raises(RuntimeError, match=r"flodl_shm allreduce: tensor on device meta; the "
                                           r"flodl_shm backend handles CPU tensors only: give "
                                           r"meta tensors a group of their own, e\.g\. "
                                           r"dist\.new_group\(backend='nccl'\) for cuda"):
        check_dtype(torch.empty(2, device="meta"), "allreduce")
