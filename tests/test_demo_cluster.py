"""The README's cluster walk-through on loopback: a controller and two demo "hosts", each a
``python -m flodl_shm`` command of its own, carrying 2 of 4 ranks."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the demo needs scikit-learn (the demo/test extras)")

from flodl_shm.checkpoint.meta import CheckpointBundle, CheckpointMeta  # noqa: E402
from flodl_shm.checkpoint.series import committed_checkpoints  # noqa: E402
from flodl_shm.engine.segment import list_segments  # noqa: E402

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 200


def _start(args, cwd: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flodl_shm", *args], cwd=cwd,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"the controller did not write {path.name}")


def _cohort(tmp_path: Path, secret: Path, tag: str, extra=()) -> dict:
    """A controller in ``tmp_path`` and two demo hosts of 2 ranks, host A in ``tmp_path``
    (beside the controller) and host B in ``tmp_path/b`` (a folder of its own, as on a
    machine of its own), each given ``extra``; their logs, once all three exited 0."""
    procs: list[subprocess.Popen] = []
    logs = {name: tmp_path / f"{tag}_{name}.log" for name in ("controller", "host_a", "host_b")}
    port_file = tmp_path / f"{tag}_port.txt"
    try:
        ctl = _start(["controller", "--bind", "127.0.0.1:0", "--world-size", "4",
                      "--secret-file", str(secret), "--port-file", port_file.name], tmp_path,
                     logs["controller"])
        procs.append(ctl)
        port = _wait_for(port_file, ctl, 60)
        common = ["demo", "--controller", f"127.0.0.1:{port}", "--world-size", "4",
                  "--nprocs", "2", "--secret-file", str(secret), "--no-progress",
                  "--log-every", "0", "--timeout", "120", *extra]
        (tmp_path / "b").mkdir(exist_ok=True)
        procs.append(_start(common + ["--first-rank", "0"], tmp_path, logs["host_a"]))
        procs.append(_start(common + ["--first-rank", "2"], tmp_path / "b", logs["host_b"]))
        deadline = time.monotonic() + DEADLINE_S
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
        text = {k: v.read_text() for k, v in logs.items()}
        assert [p.returncode for p in procs] == [0, 0, 0], text
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    pids = {p.pid for p in procs}
    assert not [s.name for s in list_segments() if s.owner_pid in pids], "segments left behind"
    return text


def test_two_host_demo_on_loopback(tmp_path):
    secret = tmp_path / "secret.hex"
    subprocess.run([sys.executable, "-m", "flodl_shm", "controller", "--new-secret", str(secret)],
                   check=True, timeout=60, capture_output=True)
    text = _cohort(tmp_path, secret, "first")

    # only the host carrying rank 0 prints the summary, on the consensus model
    a, b = text["host_a"], text["host_b"]
    m = re.search(r"test accuracy ([\d.]+)%", a)
    assert m, a
    assert float(m.group(1)) >= 95.0, a
    assert "ranks 0-1 of 4" in a and "windows" in a
    assert "test accuracy" not in b and "the summary prints on the host with rank 0" in b
    assert "cohort finished" in text["controller"]
    # the checkpoints, relative to each process's working directory: the controller's
    # forge and host A share one folder; host B keeps its own copy of each bundle, with
    # its ranks' .optim, so each host resumes from its own disk
    done = committed_checkpoints(tmp_path / "runs" / "demo" / "ckpt")
    assert done, os.listdir(tmp_path / "runs" / "demo")
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(done[-1][1]))
    assert (meta.epoch, meta.global_step, meta.world_size_at_save) == (30, 30 * 42, 4)
    assert (tmp_path / "runs" / "demo" / "windows.jsonl").exists()
    theirs = committed_checkpoints(tmp_path / "b" / "runs" / "demo" / "ckpt")
    assert [r for r, _ in theirs] == [r for r, _ in done], os.listdir(tmp_path / "b" / "runs")
    last = theirs[-1][1]
    assert last.read_bytes() == done[-1][1].read_bytes()
    assert CheckpointMeta.read_from_file(CheckpointBundle.meta_path(last)) == meta
    assert sorted(p.name for p in last.parent.glob(f"{last.stem}.rank*.optim")) == \
        [f"{last.stem}.rank2.optim", f"{last.stem}.rank3.optim"]

    # --resume on each host continues from that host's own folder, nothing copied
    text = _cohort(tmp_path, secret, "again", ["--resume", "--epochs", "32"])
    assert "resuming runs/demo/ckpt-r" in text["host_a"], text["host_a"]
    for folder in (tmp_path, tmp_path / "b"):
        last = committed_checkpoints(folder / "runs" / "demo" / "ckpt")[-1][1]
        meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(last))
        assert (meta.epoch, meta.global_step) == (32, 32 * 42), folder


@pytest.mark.parametrize("first_rank", [0, 1])
def test_the_outer_state_to_restart_with_is_the_controllers_copy(tmp_path, first_rank):
    """An operator probe: the host without rank 0 said to restart the controller with
    --outer-state <its own --run-dir>/ckpt-r00000040.outer.fdl, a file only the
    controller writes, under the --run-dir of the host with rank 0."""
    from flodl_shm.cli.demo import DemoConfig, _continue_with

    run_dir = tmp_path / ("a" if first_rank == 0 else "b")
    cfg = DemoConfig(nprocs=1, world_size=2, first_rank=first_rank, outer="nesterov",
                     controller="127.0.0.1:1", run_dir=str(run_dir))
    said = _continue_with(cfg, run_dir / "ckpt-r00000040.fdl")
    if first_rank == 0:
        assert f"--outer-state {run_dir}/ckpt-r00000040.outer.fdl (" in said, said
    else:
        assert ("--outer-state RUN_DIR/ckpt-r00000040.outer.fdl, RUN_DIR being the --run-dir "
                "of the host with rank 0 (") in said, said
        assert f"{run_dir}/ckpt-r00000040.outer.fdl" not in said, said


@pytest.mark.parametrize("error, where", [
    (None, "The other hosts may save one as they stop"),
    (KeyboardInterrupt(), "The other hosts may save one as they stop"),
    (ConnectionError("this host's relay failed"), None),
])
def test_a_host_without_a_checkpoint_of_its_own_is_told_where_one_may_be(error, where):
    """An operator probe: a host interrupted before its first checkpoint said 'No
    checkpoint was written yet', while the other host saved one as the cohort stopped."""
    from flodl_shm.cli.demo import DemoConfig, _elsewhere

    cluster = DemoConfig(nprocs=1, world_size=2, first_rank=1, controller="127.0.0.1:1")
    said = _elsewhere(cluster, error if isinstance(error, Exception) else None)
    if where is None:
        assert said == "."  # (its link failed: no cohort to save anything)
    else:
        assert said.startswith(" on this host. " + where) and "copy its .fdl and .meta.json" \
            in said, said
    assert _elsewhere(DemoConfig()) == "."  # one host: nobody else
