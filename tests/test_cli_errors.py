"""What a person sees from the CLI: when a command fails, one error line naming the cause
and the fix, an exit status, and no Python traceback (the README's commands, run wrong);
when its output goes to a file, whole lines."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flodl_shm.engine.segment import list_segments

pytest.importorskip("sklearn", reason="the demo needs scikit-learn (the demo/test extras)")


def _flodl(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m flodl_shm ARGS`` to its end (killed past ``timeout``); ``.args`` is
    its pid, to look for the segments it owned."""
    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    return subprocess.CompletedProcess(proc.pid, proc.returncode, out, err)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret.hex"
    _flodl(["controller", "--new-secret", str(path)], tmp_path, timeout=60).check_returncode()
    return path


def test_demo_with_a_missing_secret_file_is_a_usage_error(tmp_path):
    r = _flodl(["demo", "--controller", "127.0.0.1:29500", "--world-size", "4",
                "--secret-file", "missing.hex", "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "--secret-file: cannot read the session secret file missing.hex" in r.stderr
    assert "--new-secret missing.hex" in r.stderr  # the fix


def test_demo_resume_without_a_checkpoint_is_refused_before_anything_starts(tmp_path):
    r = _flodl(["demo", "--resume", "--run-dir", "nothing", "--no-progress"], tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr == ("python -m flodl_shm demo: error: --resume: no complete checkpoint "
                        "under nothing (run the demo without --resume first)\n")
    assert r.stdout == "", "no banner for a run that does not start"
    assert not (tmp_path / "nothing").exists()


def test_demo_resume_with_a_torn_options_file_is_a_usage_error(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "demo_config.json").write_text('{"epochs": 3')  # killed mid-write
    r = _flodl(["demo", "--resume", "--run-dir", "runs", "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "--resume: runs/demo_config.json is unreadable" in r.stderr
    assert "pass the run's options again" in r.stderr


def test_demo_with_a_batch_larger_than_the_data_is_refused_before_anything_starts(tmp_path):
    r = _flodl(["demo", "--batch-size", "100000", "--no-progress"], tmp_path)
    assert r.returncode == 1, r.stderr
    assert r.stderr == ("python -m flodl_shm demo: error: --batch-size 100000 is more than the "
                        "1347 training images; pass at most 1347\n")
    assert r.stdout == ""


def test_demo_with_a_controller_address_without_port_is_a_usage_error(tmp_path, secret):
    r = _flodl(["demo", "--controller", "127.0.0.1", "--world-size", "4",
                "--secret-file", str(secret), "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "--controller '127.0.0.1' must be HOST:PORT" in r.stderr


@pytest.mark.timeout(180)
def test_demo_that_fails_in_the_ranks_prints_the_reason_not_a_traceback(tmp_path, secret):
    # nothing listens at the controller's address: the relay gives up connecting while the
    # ranks still wait in their first round, and they report why (not a silent stall)
    r = _flodl(["demo", "--controller", f"127.0.0.1:{_closed_port()}", "--world-size", "4",
                "--secret-file", str(secret), "--timeout", "1", "--no-progress",
                "--no-plot"], tmp_path, timeout=150)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("python -m flodl_shm demo: error: ConnectionError: this host's relay failed: "
            "connect to 127.0.0.1:") in r.stderr, r.stderr
    assert "continuing on realized work" not in r.stderr, "a dead link is no rank death"
    assert r.stderr.count("connect to 127.0.0.1:") == 1, r.stderr  # said once, not three times
    assert "No checkpoint was written." in r.stderr
    assert not [s.name for s in list_segments() if s.owner_pid == r.args], "segments left"


def test_controller_with_a_port_out_of_range_is_one_line(tmp_path, secret):
    r = _flodl(["controller", "--bind", "127.0.0.1:99999", "--world-size", "2",
                "--secret-file", str(secret)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("controller: cannot start: address '127.0.0.1:99999': port 99999 is "
                        "outside 0-65535 (0: any free port when binding)\n")


@pytest.mark.parametrize("extra, said", [
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--world-size", "2", "--round-timeout", "0"], "--round-timeout must be > 0 seconds, got 0"),
    (["--world-size", "2", "--round-timeout", "-3"], "--round-timeout must be > 0 seconds"),
])
def test_controller_numbers_out_of_range_are_usage_errors(secret, capsys, extra, said):
    """They used to start a controller (a round timeout of 0 or less stalls every round
    at once) or fail naming the API's ClusterController."""
    from flodl_shm.cli.controller import main

    with pytest.raises(SystemExit) as info:
        main(["--bind", "127.0.0.1:0", "--secret-file", str(secret), *extra])
    assert info.value.code == 2
    assert said in capsys.readouterr().err
    from flodl_shm import ClusterController
    from flodl_shm.cluster.secret import read_secret_file

    with pytest.raises(ValueError, match="round_timeout must be > 0 seconds or None"):
        ClusterController.start("127.0.0.1:0", 2, read_secret_file(secret), round_timeout=0.0)


def test_controller_help_documents_every_option(tmp_path):
    r = _flodl(["controller", "--help"], tmp_path, timeout=60)
    assert r.returncode == 0
    assert "learning rate of --outer nesterov (default 0.7" in r.stdout
    assert "momentum of --outer nesterov (default 0.9" in r.stdout
    assert "(default 300)" in r.stdout  # --round-timeout


@pytest.mark.timeout(180)
def test_demo_output_to_a_file_has_no_progress_bar_redraws(tmp_path):
    # a log file or CI capture of the README's demo command: whole lines, no tqdm redraws
    r = _flodl(["demo", "--epochs", "2", "--log-every", "1", "--no-plot"], tmp_path,
               timeout=150)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    assert "batch/s" not in r.stderr, r.stderr[-2000:]
    assert "window    2 (epoch  1/2)" in r.stdout, r.stdout


def test_new_secret_in_a_missing_folder_is_one_line(tmp_path):
    r = _flodl(["controller", "--new-secret", str(tmp_path / "no" / "such" / "s.hex")],
               tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "controller: cannot write the secret file" in r.stderr


def test_new_secret_says_when_it_replaces_one(tmp_path, secret):
    old = secret.read_text()
    r = _flodl(["controller", "--new-secret", str(secret)], tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert secret.read_text() != old
    assert "it replaced the earlier secret" in r.stdout, r.stdout


def test_ram_with_a_root_without_meminfo_is_one_line(tmp_path):
    r = _flodl(["ram", "--root", str(tmp_path / "empty_root")], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "ram: error:" in r.stderr and "proc/meminfo is missing" in r.stderr


def _outer_state(folder: Path, sync_round: int, committed: bool) -> Path:
    """A controller's ``.outer.fdl`` of round ``sync_round``, with the bundle's
    ``.meta.json`` beside it when ``committed``."""
    import numpy as np

    from flodl_shm import TensorPayload
    from flodl_shm.checkpoint.forge import outer_sidecar_path, write_outer_momentum_fdl
    from flodl_shm.checkpoint.meta import CheckpointBundle, CheckpointMeta, SaveReason
    from flodl_shm.checkpoint.series import round_model_path
    from flodl_shm.frame import DTYPE_F32

    model = round_model_path(folder / "ckpt", sync_round)
    outer = outer_sidecar_path(model)
    write_outer_momentum_fdl([TensorPayload(DTYPE_F32, (3, 2), np.ones(6, np.float32))], outer)
    if committed:
        CheckpointMeta.new(1, 40, sync_round, 4, SaveReason.CHECKPOINT).write_to_file(
            CheckpointBundle.meta_path(model))
    return outer


def test_controller_outer_state_names_its_round_or_refuses_a_lone_file(tmp_path, secret):
    """``--outer-state`` takes the sync round from the bundle's .meta.json (hosts resuming
    another round are then refused); an .outer.fdl without it is refused at once."""
    lone = _outer_state(tmp_path, 4, committed=False)
    r = _flodl(["controller", "--bind", "127.0.0.1:0", "--world-size", "2", "--secret-file",
                str(secret), "--outer", "nesterov", "--outer-state", str(lone)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "ckpt-r00000004.meta.json is not beside it" in r.stderr, r.stderr
    good = _outer_state(tmp_path, 8, committed=True)
    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", "controller", "--bind",
                             "127.0.0.1:0", "--world-size", "2", "--secret-file", str(secret),
                             "--outer", "nesterov", "--outer-state", str(good)],
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert "controller listening on port" in line and "outer momentum of sync round 8" in line, \
        line


def test_a_rank_that_raised_is_reported_by_its_own_line_not_its_traceback():
    """A rank's exception names the cause and the fix (a refused start, say): the demo
    prints the rank and that line, not the remote traceback; a rank killed by a signal,
    or any other error, prints as the exception itself."""
    from flodl_shm.cli.demo import _reason
    from flodl_shm.errors import RankFailed

    tb = ('Traceback (most recent call last):\n  File "trainer.py", line 1, in run\n'
          '    check()\nValueError: the hosts resume from sync round 16, but the controller '
          'holds fresh outer momentum: restart the controller with --outer-state\n')
    said = _reason(RankFailed(1, "ValueError", tb))
    assert said == ("rank 1 raised ValueError: the hosts resume from sync round 16, but the "
                    "controller holds fresh outer momentum: restart the controller with "
                    "--outer-state")
    assert "Traceback" not in said
    qualified = tb.replace("\nValueError:", "\nflodl_shm.errors.StartRefused:")
    assert _reason(RankFailed(0, "StartRefused", qualified)).startswith(
        "rank 0 raised StartRefused: the hosts resume from sync round 16")
    killed = RankFailed(0, None, "", "SIGKILL", -9)
    assert _reason(killed) == f"RankFailed: {killed}"
    assert _reason(OSError("disk full")) == "OSError: disk full"


def test_too_many_deaths_print_what_was_saved_without_the_api_call():
    """The Trainer's TrainingAborted ends with the API call that continues; the demo
    prints what died and what was saved, and says --resume itself."""
    from pathlib import Path

    from flodl_shm.cli.demo import _reason
    from flodl_shm.errors import TrainingAborted
    from flodl_shm.training.trainer import TrainResult

    summary = ("1 rank(s) died ([1]), more than max_failures=0.\nThe survivors saved "
               "runs/demo/ckpt-r00000003.fdl (max_failure_exceeded).\nrank 1: killed by SIGKILL")
    result = TrainResult({}, [], None, Path("runs/demo/ckpt-r00000003.fdl"), (1,))
    err = TrainingAborted(summary, result, "Continue with trainer.resume('runs/demo/ckpt').")
    assert str(err) == summary + "\nContinue with trainer.resume('runs/demo/ckpt')."
    assert _reason(err) == f"TrainingAborted: {summary}"
    assert err.checkpoint == result.checkpoint and err.dead_ranks == (1,)
