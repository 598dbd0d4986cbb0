"""What a person sees from the CLI: when a command fails, one error line naming the cause
and the fix, an exit status, and no Python traceback (the README's commands, run wrong);
when its output goes to a file, whole lines."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flodl_shm
from flodl_shm.engine.segment import list_segments

pytest.importorskip("sklearn", reason="the demo needs scikit-learn (the demo/test extras)")


def _flodl(args: list[str], cwd: Path, timeout: float = 120,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m flodl_shm ARGS`` to its end (killed past ``timeout``); ``.args`` is
    its pid, to look for the segments it owned. ``env``: variables added to this one's."""
    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL,
                            env=None if env is None else {**os.environ, **env})
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
    assert "--secret-file: the session secret file missing.hex does not exist" in r.stderr
    assert "--new-secret missing.hex" in r.stderr  # the fix


def test_a_secret_file_that_is_a_folder_is_not_offered_to_be_overwritten(tmp_path):
    """It suggested `--new-secret <the folder>`, which cannot write there."""
    from flodl_shm.cluster.secret import read_secret_file

    with pytest.raises(ValueError, match=rf"the session secret file {tmp_path} is a folder; "
                                         rf"give the file in it, or create one with .*"
                                         rf"--new-secret {tmp_path / 'secret.hex'}`"):
        read_secret_file(tmp_path)


def test_controller_usage_shows_its_required_options(tmp_path):
    r = _flodl(["controller", "--help"], tmp_path, timeout=60)
    assert r.returncode == 0
    assert "controller --bind HOST:PORT --world-size N --secret-file FILE [options]" in r.stdout
    assert "controller --new-secret FILE" in r.stdout


def test_demo_resume_without_a_checkpoint_is_refused_before_anything_starts(tmp_path):
    r = _flodl(["demo", "--resume", "--run-dir", "nothing", "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr  # a usage error, as the others
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


@pytest.mark.parametrize("saved,said", [
    ('{"epochs": "x"}', "(epochs: 'x')"), ('{"epochs": null}', "(epochs: None)"),
    ('{"slow_rank": 5}', "(slow_rank: 5)"), ('{"bf16_wire": 1}', "(bf16_wire: 1)"),
])
def test_demo_resume_with_options_of_the_wrong_kind_is_a_usage_error(tmp_path, capsys,
                                                                      saved, said):
    """An options file whose values are of the wrong kind raised a TypeError traceback
    (or started a run that crashed); an option given again overrides the file's."""
    from flodl_shm.cli.demo import parse_args

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "demo_config.json").write_text(saved)
    with pytest.raises(SystemExit) as info:
        parse_args(["--resume", "--run-dir", str(tmp_path / "runs")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "demo_config.json does not hold the run's options " + said in err, err
    key = said[1:said.index(":")]
    again = {"epochs": ["--epochs", "3"], "slow_rank": ["--slow-rank", "1:2"],
             "bf16_wire": ["--bf16-wire"]}[key]
    cfg = parse_args(["--resume", "--run-dir", str(tmp_path / "runs"), *again])
    assert getattr(cfg, key) is not None


def test_demo_slow_rank_of_an_infinite_factor_is_a_usage_error(capsys):
    """`--slow-rank 0:inf` started a run whose rank 0 died in time.sleep (OverflowError)."""
    from flodl_shm.cli.demo import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--slow-rank", "0:inf"])
    assert info.value.code == 2
    assert "the factor must be a finite number >= 1" in capsys.readouterr().err


def test_what_a_newcomer_s_pass_over_the_commands_found(tmp_path, caplog, capsys):
    """A newcomer probe of every command: `--version` was an unknown command; an empty
    .fdl was 'corrupt ... ends inside the magic'; a binary secret file printed Python's
    'utf-8 codec can't decode'; a world-readable or all-zero secret was taken silently;
    `ram --nprocs 0` named --local-ranks only; `--slow-rank 1:0` blamed the rank too; a
    controller address without a port spoke of tuples; a converted file wrote '1 tensors';
    a torch file of several parts was 'not a flat state_dict (got dict)', naming no entry,
    and a wrapper's other entries were dropped silently."""
    from flodl_shm.cli.demo import parse_args
    from flodl_shm.cluster.link import parse_addr
    from flodl_shm.cluster.secret import read_secret_file

    r = _flodl(["--version"], tmp_path, timeout=60)
    assert (r.returncode, r.stdout) == (0, f"flodl_shm {flodl_shm.__version__}\n"), r.stderr
    (tmp_path / "empty.fdl").write_bytes(b"")
    r = _flodl(["fdl", "show", "empty.fdl"], tmp_path, timeout=60)
    assert r.returncode == 1 and "empty.fdl is empty: not a .fdl checkpoint" in r.stderr, r.stderr
    binary = tmp_path / "binary.hex"
    binary.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ValueError, match=r"binary.hex is not a session secret file \(it holds "
                                         r"binary data\): a secret is 32 hex digits"):
        read_secret_file(binary)
    nul = tmp_path / "nul.hex"  # (NUL bytes decode as text: it said "hex digits only")
    nul.write_bytes(bytes(32))
    with pytest.raises(ValueError, match=r"nul.hex is not a session secret file \(it holds "
                                         r"binary data\)"):
        read_secret_file(nul)
    spaced = tmp_path / "spaced.hex"  # (whitespace around it, a byte-order mark: still taken)
    spaced.write_bytes(b"\xef\xbb\xbf" + b"0123456789abcdef0f1e2d3c4b5a6978\v\f\r\n")
    spaced.chmod(0o600)
    assert read_secret_file(spaced) == bytes.fromhex("0123456789abcdef0f1e2d3c4b5a6978")
    zeros = tmp_path / "zeros.hex"
    zeros.write_text("0" * 32 + "\n")
    zeros.chmod(0o644)
    with caplog.at_level("WARNING", logger="flodl_shm"):
        for _ in range(3):  # (the demo reads it three times: said once)
            read_secret_file(zeros)
    said = [rec.getMessage() for rec in caplog.records]
    assert len(said) == 2, said
    assert "can be read by other users (mode 644)" in said[0] and "chmod 600" in said[0]
    assert "one byte repeated (00000000...): no secret" in said[1]
    r = _flodl(["ram", "--model-bytes", "1GiB", "--nprocs", "0"], tmp_path, timeout=60)
    assert r.returncode == 2 and "--local-ranks (--nprocs) 0 must be from 1 to" in r.stderr
    with pytest.raises(SystemExit):
        parse_args(["--slow-rank", "1:0"])
    err = capsys.readouterr().err
    assert "--slow-rank 1:0: the factor must be a finite number >= 1" in err
    assert "the rank must" not in err
    with pytest.raises(ValueError) as info:
        parse_addr("127.0.0.1")
    assert str(info.value) == "address '127.0.0.1' must be 'host:port'"
    torch.save({"w": torch.ones(2)}, tmp_path / "one.pt")
    r = _flodl(["fdl", "convert", "one.pt", "one.fdl"], tmp_path, timeout=60)
    assert r.returncode == 0 and "wrote one.fdl: 1 tensor from one.pt" in r.stdout, r.stdout
    r = _flodl(["fdl", "show", "one.fdl"], tmp_path, timeout=60)
    assert ", 1 entry, " in r.stdout, r.stdout
    # a torch file with more than tensors: the entry that is none is named; a wrapper's
    # other entries are said to be left out
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": {}}, tmp_path / "parts.pt")
    r = _flodl(["fdl", "convert", "parts.pt", "parts.fdl"], tmp_path, timeout=60)
    assert r.returncode == 1, r.stderr
    assert ("its entry 'model' is not a tensor (dict); a checkpoint of several parts? save the "
            "model's part alone, e.g. torch.save(ckpt['model'], ...)") in r.stderr, r.stderr
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, tmp_path / "nested.pt")
    r = _flodl(["fdl", "convert", "nested.pt", "nested.fdl"], tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "converting its 'state_dict' entry; its other entries ('epoch') are left out" \
        in r.stderr, r.stderr


def test_demo_with_a_batch_larger_than_the_data_is_refused_before_anything_starts(tmp_path):
    r = _flodl(["demo", "--batch-size", "100000", "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr  # a usage error, as the other numbers' checks
    assert r.stderr == ("python -m flodl_shm demo: error: --batch-size 100000 is more than the "
                        "1347 training images; pass at most 1347\n")
    assert r.stdout == ""


def test_demo_with_a_controller_address_without_port_is_a_usage_error(tmp_path, secret):
    r = _flodl(["demo", "--controller", "127.0.0.1", "--world-size", "4",
                "--secret-file", str(secret), "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("--controller: address '127.0.0.1' must be 'host:port'; "
            "e.g. 127.0.0.1:29500") in r.stderr


@pytest.mark.parametrize("addr, says, world", [
    ("127.0.0.1:99999", "--controller: address '127.0.0.1:99999': port 99999 is outside "
                        "0-65535", 4),
    ("127.0.0.1:0", "--controller '127.0.0.1:0': port 0 names no controller; give the port it "
                    "listens on (the port of its --bind, or the one it wrote to its "
                    "--port-file)", 4),
    ("127.0.0.1:29500", "--world-size 70000: a cohort holds at most 65,536 ranks", 70000),
])
def test_demo_with_a_controller_port_out_of_range_says_so(addr, says, world, secret, capsys):
    """Both said "must be HOST:PORT", which they were."""
    from flodl_shm.cli.demo import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["--controller", addr, "--world-size", str(world), "--secret-file",
                    str(secret)])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_a_failed_cluster_host_says_how_the_hosts_resume_together(tmp_path, secret):
    """After a host was lost, the others' newest checkpoint is a round it never got: the
    plain "continue with --resume" was refused on every host, and said again. A host of
    a cluster is told the hosts resume from one round and where a lost host gets it."""
    first = _flodl(["demo", "--epochs", "2", "--no-progress", "--no-plot"], tmp_path)
    assert first.returncode == 0, first.stderr
    r = _flodl(["demo", "--resume", "--epochs", "3", "--controller",
                f"127.0.0.1:{_closed_port()}", "--world-size", "2", "--secret-file",
                str(secret), "--timeout", "1", "--no-progress", "--no-plot"], tmp_path,
               timeout=150)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("Last checkpoint runs/demo/ckpt-r00000006.fdl: continue with --resume on every "
            "host. The hosts resume from one round") in r.stderr, r.stderr
    assert ("copied from another host's --run-dir or from the controller's copy (the "
            "controller writes it under the --run-dir path of the host with rank 0, taken from "
            "where the controller runs); its ranks then start their inner optimizers fresh. "
            "Or, when every host holds that older round's checkpoint whole, move the newer "
            "round's files") in r.stderr, r.stderr  # (a probe: the way that keeps every
    # rank's optimizer state was not said)
    assert "--outer-state" not in r.stderr  # (plain averaging: the controller holds nothing)


@pytest.mark.timeout(180)
def test_demo_that_fails_in_the_ranks_prints_the_reason_not_a_traceback(tmp_path, secret):
    # nothing listens at the controller's address: the relay gives up connecting while the
    # ranks still wait in their first round, and they report why (not a silent stall)
    r = _flodl(["demo", "--controller", f"127.0.0.1:{_closed_port()}", "--world-size", "4",
                "--secret-file", str(secret), "--timeout", "1", "--no-progress",
                "--no-plot"], tmp_path, timeout=150)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("python -m flodl_shm demo: error: this host's relay failed: "
            "could not connect to 127.0.0.1:") in r.stderr, r.stderr
    assert "continuing on realized work" not in r.stderr, "a dead link is no rank death"
    assert r.stderr.count("connect to 127.0.0.1:") == 1, r.stderr  # said once, not three times
    # the retries last as long as the warning said (it rounded 2.5 s to "2 s")
    assert "trying again for up to 2.5 s" in r.stderr and "within 2.5 s" in r.stderr, r.stderr
    assert "No checkpoint was written." in r.stderr
    assert not [s.name for s in list_segments() if s.owner_pid == r.args], "segments left"


def test_controller_with_a_port_out_of_range_is_one_line(tmp_path, secret):
    r = _flodl(["controller", "--bind", "127.0.0.1:99999", "--world-size", "2",
                "--secret-file", str(secret)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("controller: cannot start: address '127.0.0.1:99999': port 99999 is "
                        "outside 0-65535 (0: any free port when binding)\n")


def test_controller_on_a_port_in_use_says_how_to_go_on(tmp_path, secret):
    """A probe read '[Errno 98] Address already in use' and nothing it could do."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        addr = "127.0.0.1:%d" % held.getsockname()[1]
        r = _flodl(["controller", "--bind", addr, "--world-size", "2",
                    "--secret-file", str(secret)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("controller: cannot start: ")
    assert (f"another process holds {addr} (a controller already running?): stop it, or pick "
            f"another port with --bind HOST:PORT") in r.stderr


@pytest.mark.parametrize("extra, said", [
    (["--world-size", "0"], "--world-size must be from 1 to 65,536"),
    (["--world-size", "99999999999"], "--world-size must be from 1 to 65,536 (every rank of "
                                      "every host; the most a cohort holds), got 99999999999"),
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


def test_a_controller_address_that_is_no_host_of_this_machine_says_what_to_bind(
        secret, monkeypatch):
    """An API probe's ClusterController.start("nohost:1", ...) raised socket's own
    "Name or service not known (while attempting to bind on address ('nohost', 1))".
    (The lookup's failure is socket.create_server's, stood in for here: a real one would
    ask the network's name server, and the tests send nothing off this machine.)"""
    import socket

    from flodl_shm.cluster.controller import ClusterController
    from flodl_shm.cluster.secret import read_secret_file

    def unresolved(address, **kw):
        raise OSError(socket.EAI_NONAME, f"Name or service not known (while attempting to "
                                         f"bind on address {address!r})")

    monkeypatch.setattr(socket, "create_server", unresolved)
    with pytest.raises(OSError, match=r"cannot listen on nohost:1: Name or service not known; "
                                      r"bind an address of this machine \(0\.0\.0\.0:1 for every "
                                      r"interface, 127\.0\.0\.1:1 for this host alone\)"):
        ClusterController.start("nohost:1", 2, read_secret_file(secret))


@pytest.mark.parametrize("extra,said", [
    (["--outer-lr", "0.5"], "--outer-lr needs --outer nesterov"),
    (["--outer-momentum", "0.5"], "--outer-momentum needs --outer nesterov"),
    (["--port-file", "{tmp}"], "is a folder; pass a file path in an existing folder"),
    (["--port-file", "{tmp}/no/p.txt"], "does not exist; pass a file path in an existing"),
    # these named the API's class (OuterNesterov lr must be >= 0), not the option
    (["--outer", "nesterov", "--outer-lr", "-1"], "--outer-lr must be a number >= 0, got -1"),
    (["--outer", "nesterov", "--outer-momentum", "1"], "--outer-momentum must be in [0, 1), "
                                                       "got 1"),
])
def test_controller_options_it_would_ignore_or_fail_on_after_binding_are_usage_errors(
        tmp_path, secret, capsys, extra, said):
    """--outer-lr without --outer nesterov was silently ignored; a --port-file that cannot
    be written failed with a traceback after the controller said it was listening."""
    from flodl_shm.cli.controller import main

    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    with pytest.raises(SystemExit) as info:
        main(["--bind", "127.0.0.1:0", "--world-size", "2", "--secret-file", str(secret),
              *extra])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert said in captured.err, captured.err
    assert "listening" not in captured.out


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
    assert "compiling" not in r.stdout, r.stdout  # (the suite's cache holds every kernel)


def test_a_first_demo_says_it_compiles_the_kernels_once(tmp_path):
    """A newcomer's first demo sat 49 s after its header with nothing said (numba
    compiling the kernels), where the README promised 20 s in all. A demo that will
    compile says so first (37 s now: half the kernels compile in a helper process); the
    warm-up then marks the folder complete. (The suite's cache, copied without its mark,
    stands in for a cold one: a real compile takes 25-50 s.)"""
    from test_spawn_startup import _cache_without

    from flodl_shm.kernels import cache_dir
    from flodl_shm.kernels._cache import COMPLETE_MARKER

    base = _cache_without(tmp_path / "numba", COMPLETE_MARKER)
    folder = tmp_path / "numba" / cache_dir().name
    r = _flodl(["demo", "--epochs", "1", "--no-progress", "--no-plot"], tmp_path, timeout=150,
               env={"FLODL_SHM_NUMBA_CACHE": base})
    assert r.returncode == 0, r.stderr
    head = r.stdout.splitlines()[:3]
    assert head[2] == ("  compiling flodl_shm's kernels for this machine, once: about 40 s on "
                       "2 cores (later runs load them in a second)"), r.stdout
    assert "compiling" not in r.stderr, r.stderr  # (said once: not the warm-up's warning too)
    assert (folder / COMPLETE_MARKER).exists()


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
    (tmp_path / "empty_root").mkdir()
    r = _flodl(["ram", "--root", str(tmp_path / "empty_root")], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "ram: error:" in r.stderr and "proc/meminfo is missing" in r.stderr
    # in the command's terms, not the API's (host_memory(root=...), root='/')
    assert f"--root {tmp_path / 'empty_root'}:" in r.stderr, r.stderr
    assert "leave --root out" in r.stderr, r.stderr
    assert "host_memory" not in r.stderr and "root=" not in r.stderr, r.stderr


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

    summary = ("1 rank died ([1]), more than max_failures=0.\nThe survivors saved "
               "runs/demo/ckpt-r00000003.fdl (max_failure_exceeded).\nrank 1: killed by SIGKILL")
    result = TrainResult({}, [], None, Path("runs/demo/ckpt-r00000003.fdl"), (1,))
    err = TrainingAborted(summary, result, "Continue with trainer.resume('runs/demo/ckpt').")
    assert str(err) == summary + "\nContinue with trainer.resume('runs/demo/ckpt')."
    assert _reason(err) == f"TrainingAborted: {summary}"
    assert err.checkpoint == result.checkpoint and err.dead_ranks == (1,)


# --- usage errors found walking through the docs: one line in the command's terms, exit 2 ----


@pytest.mark.parametrize("run_dir, extra, said", [
    ("afile", [], "--run-dir afile is a file, not a folder"),
    ("afile/sub", [], "--run-dir afile/sub: afile is a file, not a folder"),
    ("afile", ["--resume"], "--run-dir afile is a file, not a folder"),
])
def test_demo_run_dir_that_is_a_file_is_a_usage_error(tmp_path, run_dir, extra, said):
    """It used to print the run lock's FileExistsError, then a NotADirectoryError."""
    (tmp_path / "afile").write_text("mine\n")
    r = _flodl(["demo", "--run-dir", run_dir, "--no-progress", *extra], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"python -m flodl_shm demo: error: {said}; pass a folder" in r.stderr, r.stderr
    assert r.stdout == ""
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_demo_run_dir_that_cannot_be_created_is_a_usage_error(tmp_path):
    """A probe's --run-dir under /proc printed a FileNotFoundError and exited 1 as a
    failed run."""
    r = _flodl(["demo", "--run-dir", "/proc/flodl-shm-test/run", "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("python -m flodl_shm demo: error: --run-dir /proc/flodl-shm-test/run: "
                        "cannot create the folder /proc/flodl-shm-test/run (No such file or "
                        "directory), where the run lock ckpt.lock and the series' checkpoints "
                        "go; save into a folder this user can write\n"), r.stderr
    assert r.stdout == ""


def test_demo_run_dir_too_long_for_the_filesystem_is_a_usage_error(tmp_path):
    """A probe's 300-character folder name printed a traceback (OSError: File name too
    long) from the check that looks for a file in the way."""
    name = "x" * 300
    r = _flodl(["demo", "--run-dir", name, "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("python -m flodl_shm demo: error: --run-dir " + "x" * 30 + "..." + "x" * 30
            + ": File name too long; pass a shorter path\n") in r.stderr, r.stderr


def test_demo_run_dir_whose_checkpoint_paths_pass_path_max_is_a_usage_error(tmp_path):
    """A --run-dir whose checkpoints' paths would pass PATH_MAX started the run and failed
    at its run lock (exit 1), or after training at the first checkpoint: a usage error."""
    run_dir = os.path.join(*["r" * 200] * 20, "z" * 60)
    r = _flodl(["demo", "--run-dir", run_dir, "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("python -m flodl_shm demo: error: --run-dir " + "r" * 30 + "..." + "z" * 30
            + ": checkpoint stem ") in r.stderr, r.stderr
    assert "limit of 4095 bytes on a path. Save in a folder with a shorter path" in r.stderr
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_demo_run_dir_with_an_unexpanded_tilde_is_a_usage_error(tmp_path):
    """A checkpoint probe's --run-dir=~/tx (no shell expands ~ after =) trained into a
    folder named ~ and printed its checkpoint as ~/tx/..., the home folder to a shell."""
    r = _flodl(["demo", "--run-dir=~/tx", "--no-progress"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.endswith(
        "python -m flodl_shm demo: error: --run-dir ~/tx: ~ was not expanded (a shell expands "
        "it at the start of a word only, not after --run-dir=): write --run-dir ~/tx, or "
        f"{os.path.expanduser('~/tx')}\n"), r.stderr
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_demo_without_scikit_learn_is_one_line(tmp_path):
    """A scikit-learn that cannot be imported (a stub package raising as a missing one
    does) is the one line that says how to install it, not its chained traceback."""
    stub = tmp_path / "stub" / "sklearn"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'sklearn'\", name='sklearn')\n")
    path = os.pathsep.join(filter(None, [str(stub.parent), os.environ.get("PYTHONPATH")]))
    r = _flodl(["demo", "--run-dir", "runs/x", "--no-progress"], tmp_path,
               env={"PYTHONPATH": path})
    assert r.returncode == 1, r.stderr
    assert r.stderr == ("python -m flodl_shm demo: error: the demo needs scikit-learn (its "
                        "digits dataset): pip install -e \".[demo]\"\n")
    assert r.stdout == ""
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("extra, said", [
    (["--log-every", "-1"], "--log-every must be >= 0 (0: none), got -1"),
    (["--eval-every", "-1"], "--eval-every must be >= 0 (0: only at the end), got -1"),
    (["--epochs", "0"], "--epochs must be >= 1, got 0"),
    # these three started, failed with exit 1 and left the run folder behind
    (["--nprocs", "100"], "--nprocs 100: one host runs at most 63 ranks"),
    (["--seed", "-1"], "--seed must be from 0 to 2**63 - 1, got -1"),
    (["--seed", str(1 << 70)], f"--seed must be from 0 to 2**63 - 1, got {1 << 70}"),
    # this one trained and wrote its checkpoints into the current folder
    (["--run-dir", ""], "--run-dir must name a folder (it is empty)"),
])
def test_demo_numbers_out_of_range_are_refused_before_anything_starts(tmp_path, extra, said):
    """--log-every/--eval-every -1 were taken as 0; --epochs 0 started the ranks, trained
    nothing and left demo_config.json and windows.jsonl behind."""
    r = _flodl(["demo", "--epochs", "1", "--no-progress", "--no-plot", *extra], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"python -m flodl_shm demo: error: {said}" in r.stderr, r.stderr
    assert r.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_controller_outer_state_that_does_not_exist_is_a_usage_error(tmp_path, secret):
    """It used to say the missing file's .meta.json was not beside it."""
    r = _flodl(["controller", "--bind", "127.0.0.1:0", "--world-size", "2", "--secret-file",
                str(secret), "--outer", "nesterov", "--outer-state", "nothere.outer.fdl"],
               tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert ("python -m flodl_shm controller: error: --outer-state nothere.outer.fdl: no such "
            "file") in r.stderr, r.stderr
    assert "meta.json" not in r.stderr, r.stderr


def _listening_controller(cwd: Path, secret: Path, *extra: str) -> subprocess.Popen:
    """A controller on a free loopback port, returned once it says it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", "controller", "--bind",
                             "127.0.0.1:0", "--world-size", "2", "--secret-file", str(secret),
                             *extra],
                            cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()
    if "controller listening on port" not in line:
        proc.kill()
        raise AssertionError(f"the controller did not start: {line!r} "
                             f"{proc.communicate(timeout=30)}")
    return proc


def _signalled(proc: subprocess.Popen, sig: int, timeout: float = 30) -> str:
    """Send ``sig`` to ``proc`` and read it to its end (killed past ``timeout``); its
    stderr."""
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return err


@pytest.mark.timeout(90)
@pytest.mark.parametrize("repeat", [False, True], ids=["once", "again_while_stopping"])
def test_controller_ctrl_c_says_interrupted_and_exits_130(tmp_path, secret, repeat):
    """Ctrl-C used to print "cohort finished" and exit 0; a second one during the shutdown
    printed a KeyboardInterrupt traceback from a thread join."""
    proc = _listening_controller(tmp_path, secret)
    try:
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while repeat and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
            proc.send_signal(signal.SIGINT)  # Ctrl-C again while it stops (no-op once gone)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "controller: interrupted after 0 rounds" in err, err
    assert "cohort finished" not in out, out
    # plain averaging: nothing of the controller's to restore (it said --outer-state); no
    # round, no checkpoint: nothing to --resume from (it said so)
    assert ("its hosts were told and stop; to continue, restart the controller, then every "
            "host (no checkpoint was taken yet: they start over)") in err, err


def test_a_stopped_controller_with_an_outer_optimizer_names_its_state_to_restart_with(
        tmp_path, secret):
    proc = _listening_controller(tmp_path, secret, "--outer", "nesterov")
    err = _signalled(proc, signal.SIGTERM)
    assert proc.returncode == 143, err
    assert ("restart the controller with --outer nesterov --outer-state <stem>.outer.fdl (of "
            "the round the hosts resume from), then every host (no checkpoint") in err, err


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_controller_stopped_by_a_signal_says_so(tmp_path, secret, sig):
    """A scheduler's SIGTERM (or a closed terminal's SIGHUP) killed the controller without a
    line, and could cut a checkpoint it was writing; it now stops as on Ctrl-C."""
    proc = _listening_controller(tmp_path, secret)
    err = _signalled(proc, sig)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"controller: stopped by {signal.Signals(sig).name} after 0 rounds" in err, err


@pytest.mark.parametrize("dst, said", [
    ("out", "out is a folder; name the file to write in it, e.g. out/model.pt"),
    ("nowhere/model.pt", "nowhere/model.pt: the folder nowhere does not exist; create it "
                         "first, or write elsewhere"),
])
@pytest.mark.parametrize("to", [[], ["--to", "torch"]])
def test_fdl_convert_into_a_folder_or_a_missing_one_is_a_usage_error(tmp_path, dst, said, to):
    """A probe's convert into a folder said '[Errno 21] Is a directory:
    'out.17868.17d9cd4e.tmp' -> 'out'' (the temporary file's name, exit 1), or without
    --to that the folder's format could not be told; into a missing folder, a bare
    '[Errno 2] No such file or directory'."""
    from flodl_shm.checkpoint.convert import state_dict_to_fdl

    import torch

    state_dict_to_fdl({"w": torch.ones(3)}, tmp_path / "m.fdl")
    (tmp_path / "out").mkdir()
    r = _flodl(["fdl", "convert", "m.fdl", dst, *to], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"python -m flodl_shm fdl convert: error: {said}\n", r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.fdl", "out"]
    assert not list((tmp_path / "out").iterdir())


def test_fdl_convert_to_a_name_too_long_with_its_temp_file_is_a_usage_error(tmp_path):
    """A checkpoint probe's 240-byte destination (legal) failed after the conversion with
    'File name too long' (its temp file's name, 21 bytes longer; exit 1, as for a corrupt
    file), and a 256-byte one with a traceback; an .fdl destination's .names.json made a
    232-byte one fail. Each is a usage error naming how long the name may be."""
    from flodl_shm.checkpoint.convert import state_dict_to_fdl

    import torch

    state_dict_to_fdl({"w": torch.ones(3)}, tmp_path / "m.fdl")
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    for name, fits in (("a" * (limit - 23) + ".pt", limit - 21),
                       ("b" * (limit - 3) + ".pt", limit - 21),
                       ("c" * (limit - 30) + ".fdl", limit - 28)):  # (.names.json: 7 more)
        r = _flodl(["fdl", "convert", "m.fdl", name], tmp_path, timeout=60)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert (f"the file name is {len(name)} bytes and the files written for it take up "
                f"to ") in r.stderr and f"name it with at most {fits} bytes\n" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.fdl"]
    for name in ("d" * (limit - 24) + ".pt", "e" * (limit - 32) + ".fdl"):
        r = _flodl(["fdl", "convert", "m.fdl", name], tmp_path, timeout=60)
        assert r.returncode == 0, r.stderr


def test_fdl_convert_to_an_unknown_format_is_a_usage_error_in_cli_terms(tmp_path):
    import torch

    from flodl_shm.checkpoint.convert import state_dict_to_fdl

    state_dict_to_fdl({"w": torch.ones(3)}, tmp_path / "m.fdl")
    r = _flodl(["fdl", "convert", "m.fdl", "model.txt"], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("python -m flodl_shm fdl convert: error: cannot tell the format "
                               "of model.txt from its name"), r.stderr
    assert "--to fdl|safetensors|torch" in r.stderr, r.stderr
    assert "convert(" not in r.stderr and "src_format" not in r.stderr, r.stderr
    assert not (tmp_path / "model.txt").exists()
    r = _flodl(["fdl", "convert", "m.fdl", "model.txt", "--to", "torch"], tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("flag", ["--shm-dir", "--root"])
def test_ram_with_a_folder_that_does_not_exist_is_a_usage_error(tmp_path, flag):
    """--shm-dir used to be measured as an empty /dev/shm (0 B, [FAIL] with Docker
    advice); --root, to name the API (host_memory(root=...))."""
    missing = tmp_path / "nonexistent"
    r = _flodl(["ram", flag, str(missing), "--params", "1M"], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert f"python -m flodl_shm ram: error: {flag} {missing} does not exist" in r.stderr, \
        r.stderr
    assert r.stdout == ""


def test_no_command_is_a_usage_error(tmp_path):
    r = _flodl([], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith("usage: python -m flodl_shm <command>"), r.stderr
    assert r.stderr.endswith("python -m flodl_shm: error: no command given; choose one of "
                             "demo, controller, ram, fdl\n"), r.stderr


def test_console_script_usage_names_the_script(tmp_path):
    import shutil

    script = shutil.which("flodl-shm", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the flodl-shm console script is not installed (pip install -e .)")
    r = subprocess.run([script, "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: flodl-shm <command>"), r.stdout
    assert "python -m" not in r.stdout, r.stdout
    for command in ("demo", "controller", "ram", "fdl"):  # each command's own usage too
        r = subprocess.run([script, command, "--help"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith(f"usage: flodl-shm {command} "), r.stdout


def test_help_into_a_closed_pipe_is_quiet(tmp_path):
    """`python -m flodl_shm -h | head -2`: a reader that left before the output ended is
    no error of ours (it used to print a BrokenPipeError traceback)."""
    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", "--help"], cwd=tmp_path,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    proc.stdout.close()  # the reader is gone before the command writes
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert err == "", err
    assert proc.returncode == 1  # as Python's own recipe: the output did not all go out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig,repeat", [(signal.SIGTERM, False), (signal.SIGHUP, False),
                                        (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT_twice"])
def test_demo_stopped_by_a_signal_says_so_in_one_line(tmp_path, sig, repeat):
    """A fuzz probe: SIGTERM or SIGHUP killed the demo without a line (no last checkpoint,
    no resume hint), and a second Ctrl-C printed a KeyboardInterrupt traceback as the
    interpreter exited. Each now stops the ranks, names the last checkpoint and exits
    128 + the signal; further signals are ignored."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", "demo", "--run-dir", "run",
                             "--no-plot", "--epochs", "200", "--checkpoint-every", "2",
                             "--slow-rank", "1:3"],
                            cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60  # until a checkpoint is written: ranks are training
        while not list((tmp_path / "run").glob("*.meta.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate(timeout=30)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(sig)
        while repeat and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
            proc.send_signal(sig)  # again while it stops (no-op once gone)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    how = "interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
    assert f"{how}; every rank was stopped. Last checkpoint " in err, err
    assert "--resume" in err, err
    # the ranks, the rank server and the resource tracker end with it (the last two on
    # their pipes' EOF, a moment after the launcher on a loaded machine)
    _, alive = psutil.wait_procs(ranks, timeout=20)
    assert not alive, alive


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["demo", "--run-dir", "run", "--no-plot"], ["ram"]])
def test_a_ctrl_c_while_a_command_loads_is_one_line(tmp_path, command):
    """A probe's Ctrl-C in a command's first second (while it imports torch, before it
    takes the signal itself) printed a KeyboardInterrupt traceback. The signal is sent
    once torch's library is mapped into the process: its import is under way."""
    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", *command], cwd=tmp_path,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            maps = Path(f"/proc/{proc.pid}/maps").read_text()
        except OSError:
            maps = ""
        if "libtorch" in maps:
            break
        time.sleep(0.002)
    err = _signalled(proc, signal.SIGINT, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, (proc.returncode, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "interrupted" in err, err


@pytest.mark.timeout(150)
def test_the_hosts_of_a_controller_stopped_by_its_operator_are_told_why(tmp_path, secret):
    """An operator probe: Ctrl-C on the controller ended its hosts with 'lost the
    connection to the controller ... (BrokenPipeError: [Errno 32] Broken pipe); it stopped
    or its host is unreachable' (a host mid-send), as if the controller had crashed."""
    ctl = subprocess.Popen([sys.executable, "-m", "flodl_shm", "controller", "--bind",
                            "127.0.0.1:0", "--world-size", "2", "--secret-file", str(secret)],
                           cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    host = None
    try:
        port = int(ctl.stdout.readline().split("on port ")[1].split()[0])
        host = subprocess.Popen(
            [sys.executable, "-m", "flodl_shm", "demo", "--controller", f"127.0.0.1:{port}",
             "--world-size", "2", "--secret-file", str(secret), "--epochs", "100000",
             "--log-every", "1", "--no-progress", "--no-plot", "--timeout", "60"],
            cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
        for line in host.stdout:  # training: a window's line
            if line.startswith("window"):
                break
        err = _signalled(ctl, signal.SIGINT)
        _, host_err = host.communicate(timeout=60)
    finally:
        for p in (ctl, host):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    assert ctl.returncode == 130, err
    assert host.returncode == 1, host_err
    assert ("this host's relay failed: the controller ended the cohort: the controller was "
            "interrupted after ") in host_err, host_err
    assert "; to continue, restart the controller, then every host" in host_err, host_err
    assert "Broken pipe" not in host_err and "Traceback" not in host_err, host_err
