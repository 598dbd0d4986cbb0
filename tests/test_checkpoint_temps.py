"""Checkpoint hygiene: unique temp files, stale temps of killed writers, pruning order.

- Two writers of one path each write a temp file of their own (``<name>.<pid>.<hex>.tmp``)
  and each commits a whole file: no writer truncates or renames the other's bytes.
- A writer SIGKILLed mid-write leaves its temp; the next commit of that path removes it,
  while a live writer's temp is never removed.
- A Trainer with ``keep_checkpoints=2`` whose launcher (the checkpoint writer) is
  SIGKILLed in the middle of a checkpoint write still has 2 complete bundles.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from flodl_shm.checkpoint._atomic import STALE_TEMP_AGE_S, remove_stale_temps
from flodl_shm.checkpoint.fdl import FdlDtype, RawEntry, read_fdl, write_fdl_raw, write_fdl_stream
from flodl_shm.training.hooks import Hook

HERE = os.path.dirname(os.path.abspath(__file__))
N = 1 << 19  # 2 MiB of f32 per entry: written straight to the OS, not held in a buffer
TEMP = re.compile(r"\.\d+\.[0-9a-f]+\.tmp$")


def generation(path) -> int:
    """The one value every element of the checkpoint holds; fails on a torn or mixed file."""
    values = {float(v) for e in read_fdl(path).entries for v in np.unique(e.to_numpy())}
    assert len(values) == 1, f"{path} mixes generations {sorted(values)}"
    return int(values.pop())


def entry(name: str, gen: int) -> RawEntry:
    return RawEntry(name, (N,), FdlDtype.F32, np.full(N, gen, np.float32))


def test_two_writers_of_one_path_never_share_a_temp_file(tmp_path):
    # Writer 1 stops half way through its file; writer 2 writes and commits the whole
    # path; writer 1 then finishes. Both commit whole files: the last rename wins.
    path = tmp_path / "ckpt.fdl"
    half_written, other_done = threading.Event(), threading.Event()
    errors = []

    def slow_body(w):
        w.write_entry("p0", (N,), FdlDtype.F32, np.full(N, 1, np.float32))
        half_written.set()
        assert other_done.wait(20)
        w.write_entry("p1", (N,), FdlDtype.F32, np.full(N, 1, np.float32))

    def slow_writer():
        try:
            write_fdl_stream(path, 2, slow_body)
        except Exception as e:
            errors.append(e)

    t = threading.Thread(target=slow_writer)
    t.start()
    try:
        assert half_written.wait(20)
        temps = [n for n in os.listdir(tmp_path) if TEMP.search(n)]
        assert len(temps) == 1 and f".{os.getpid()}." in temps[0]
        write_fdl_raw(path, [entry("p0", 2), entry("p1", 2)])
        assert generation(path) == 2
        assert temps[0] in os.listdir(tmp_path), "the live writer's temp file was removed"
    finally:
        other_done.set()
        t.join(30)
    assert errors == []
    assert generation(path) == 1
    assert os.listdir(tmp_path) == ["ckpt.fdl"]


_STALLED_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from flodl_shm.checkpoint.fdl import FdlDtype, write_fdl_stream

    def body(w):
        w.write_entry("p0", ({n},), FdlDtype.F32, np.full({n}, 7, np.float32))
        print("mid", flush=True)
        time.sleep(60)

    write_fdl_stream(sys.argv[1], 2, body)
""")


@pytest.mark.timeout(60)
def test_a_killed_writers_temp_is_removed_by_the_next_write_a_live_ones_is_not(tmp_path):
    path = tmp_path / "ckpt.fdl"
    write_fdl_raw(path, [entry("p0", 1), entry("p1", 1)])
    proc = subprocess.Popen([sys.executable, "-c", _STALLED_WRITER.format(n=N), str(path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "mid"
        temps = [n for n in os.listdir(tmp_path) if TEMP.search(n)]
        assert len(temps) == 1 and f".{proc.pid}." in temps[0]
        assert (tmp_path / temps[0]).stat().st_size > 0
        # a live writer's temp survives another writer's commit and an explicit sweep
        write_fdl_raw(path, [entry("p0", 2), entry("p1", 2)])
        assert remove_stale_temps(path) == []
        assert temps[0] in os.listdir(tmp_path)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
    assert temps[0] in os.listdir(tmp_path), "a kill leaves the temp behind"
    assert generation(path) == 2, "the killed write never reached the checkpoint"
    write_fdl_raw(path, [entry("p0", 3), entry("p1", 3)])
    assert os.listdir(tmp_path) == ["ckpt.fdl"]
    assert generation(path) == 3


def test_an_unlocked_empty_temp_is_stale_only_once_old(tmp_path):
    # An empty unlocked temp may be a writer between its create and its lock.
    path = tmp_path / "m.fdl"
    young = tmp_path / f"m.fdl.{os.getpid()}.0badf00d.tmp"  # this live process's pid
    young.touch()
    assert remove_stale_temps(path) == []
    past = time.time() - STALE_TEMP_AGE_S - 5
    os.utime(young, (past, past))
    assert remove_stale_temps(path) == [young]
    legacy = tmp_path / "m.fdl.tmp"  # the fixed temp name of earlier releases
    legacy.write_bytes(b"torn")
    other = tmp_path / "m.fdl.gz.123.abc.tmp"  # another file's temp: not ours to touch
    other.write_bytes(b"x")
    assert remove_stale_temps(path) == [legacy]
    assert sorted(os.listdir(tmp_path)) == ["m.fdl.gz.123.abc.tmp"]


def test_pruning_removes_the_stale_temp_of_a_rank_state_never_committed(tmp_path):
    """A probe SIGKILLed a run while a rank wrote its .optim: its empty temp stayed for
    good, since pruning swept only the temps of files that exist, and that file never
    did. The round is older than the newest complete bundle, so pruning removes it."""
    from flodl_shm.checkpoint.series import prune_series

    stem = tmp_path / "ckpt"
    for name in ("ckpt-r00000005.fdl", "ckpt-r00000005.meta.json"):  # the newest bundle
        (tmp_path / name).write_bytes(b"x")
    orphan = tmp_path / f"ckpt-r00000003.rank1.optim.{os.getpid()}.0badf00d.tmp"
    orphan.touch()
    assert prune_series(stem, 2) == [3] and orphan.exists()  # young, its pid alive
    past = time.time() - STALE_TEMP_AGE_S - 5
    os.utime(orphan, (past, past))
    assert prune_series(stem, 2) == [3] and not orphan.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-r00000005.fdl", "ckpt-r00000005.meta.json"]


# --- the Trainer: pruning waits for the new bundle ----------------------------------------

FEATURES, OUTPUTS = 1024, 2048  # ~8 MiB of parameters: a checkpoint write takes a while


def big_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, OUTPUTS)


class KillLauncherMidWrite(Hook):
    """On rank 0, once ``min_committed`` bundles exist: SIGKILL the launcher (where the
    checkpoint forge writes) while a consensus model's temp file is on disk. A thread
    watches the folder, so the kill lands whenever the write happens."""

    def __init__(self, stem: str, min_committed: int) -> None:
        self.stem, self.min_committed = stem, min_committed
        # built in the launcher: its pid (a rank's parent is the rank server by default)
        self.launcher_pid = os.getpid()

    def on_train_start(self, state) -> None:
        if state.rank == 0:
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        from flodl_shm.checkpoint.series import committed_checkpoints

        folder, base = os.path.split(self.stem)
        in_flight = re.compile(re.escape(base) + r"-r\d+\.fdl(\.\d+\.[0-9a-f]+)?\.tmp$")
        while len(committed_checkpoints(self.stem)) < self.min_committed:
            time.sleep(0.01)
        while True:
            if any(in_flight.match(n) for n in os.listdir(folder)):
                os.kill(self.launcher_pid, signal.SIGKILL)
                return  # the launcher's death takes this rank down
            time.sleep(0.0002)


def drive_until_killed(stem: str) -> None:
    """Driver entry (a subprocess, the launcher): checkpoint every window, keep 2."""
    from flodl_shm.training.trainer import Trainer

    g = torch.Generator().manual_seed(1)
    data = (torch.randn(64, FEATURES, generator=g), torch.randn(64, OUTPUTS, generator=g))
    trainer = Trainer(big_model, functools.partial(torch.optim.SGD, lr=0.01), data,
                      torch.nn.functional.mse_loss, batch_size=8, epochs=50, sync_every=1,
                      checkpoint_every=1, save_path=stem, keep_checkpoints=2, log_every=None,
                      hooks=[KillLauncherMidWrite(stem, min_committed=3)], timeout=60.0)
    trainer.run(2)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launcher_killed_mid_checkpoint_write_keeps_keep_checkpoints_bundles(tmp_path):
    from flodl_shm import load_consensus_checkpoint
    from flodl_shm.checkpoint.series import committed_checkpoints
    from flodl_shm.engine.segment import list_segments, unlink_name

    from engine_util import assert_no_leaks

    stem = tmp_path / "run"
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import test_checkpoint_temps as t; "
            f"t.drive_until_killed({str(stem)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    try:
        assert proc.returncode == -signal.SIGKILL, err[-3000:]
        in_flight = [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
        assert in_flight, "the launcher was killed outside a checkpoint write"
        done = committed_checkpoints(stem)
        assert len(done) >= 2, (
            f"keep_checkpoints=2 but a kill mid-write left {[r for r, _ in done]} "
            f"(files: {sorted(os.listdir(tmp_path))})")
        for _, model_path in done:
            report = load_consensus_checkpoint(big_model(), model_path)
            assert report.complete
            assert model_path.with_name(model_path.name[:-4] + ".names.json").exists()
    finally:
        # the killed launcher could not unlink its shared memory: do it for it
        for seg in list_segments():
            if seg.owner_pid == proc.pid:
                unlink_name(seg.name)
    assert_no_leaks()


def test_a_write_that_fails_names_its_file_once_and_leaves_no_temp(tmp_path):
    """A full disk fails the write: the error named no file ('[Errno 28] No space left on
    device', from a rank, a demo's metrics, a checkpoint) and came twice, chained, as
    the buffered file's close flushed again. It names the file once, with the fix; the
    old file and the folder are as they were."""
    import errno

    from flodl_shm.checkpoint._atomic import atomic_write, atomic_write_bytes

    target = tmp_path / "model.rank0.optim"
    atomic_write_bytes(target, b"old")

    def full_disk(fh):
        fh.write(b"x" * 100)  # buffered: the failure comes at the flush
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        atomic_write(target, full_disk)
    assert info.value.errno == errno.ENOSPC
    assert str(info.value) == (f"[Errno 28] No space left on device while writing {target} "
                               f"(the disk is full: free some space, or save elsewhere)")
    assert info.value.__cause__ is not None and info.value.__cause__.__context__ is None
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == [
        target.name]


_SAVE_PAST_A_FILE_SIZE_LIMIT = """
import resource, sys, torch
from flodl_shm.checkpoint._atomic import atomic_write
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # files of 1 MiB at most
try:
    atomic_write(sys.argv[1], lambda fh: torch.save({"w": torch.zeros(3_000_000)}, fh))
except OSError as e:
    print("OSError", e.errno, e)
"""


def test_a_torch_save_the_os_refuses_fails_as_the_os_error_naming_the_file(tmp_path):
    """A probe's 12 MB rank state past a file-size limit raised torch's zip writer's own
    'RuntimeError: [enforce fail ...] unexpected pos' (the OSError only in its context):
    no file named, and callers that keep training on an OSError (docs/local_sgd.md) missed
    it. A real torch.save under a real RLIMIT_FSIZE, in a process of its own."""
    import errno

    target = tmp_path / "big.rank0.optim"
    out = subprocess.run([sys.executable, "-c", _SAVE_PAST_A_FILE_SIZE_LIMIT, str(target)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"OSError {errno.EFBIG} [Errno {errno.EFBIG}] File too large "
                                  f"while writing {target}")
    assert list(tmp_path.iterdir()) == [], "no temp file and nothing committed"


def test_an_empty_temp_of_a_dead_writer_is_stale_at_once(tmp_path):
    """A probe's runs that ended within 30 s of a rank killed mid-save kept its empty
    .optim temp for good: young and unlocked, it could have been a live writer's. Its
    name carries the writer's pid: a writer that no longer runs is not coming back."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=60)
    pid = int(dead.stdout)  # a process that has exited
    path = tmp_path / "ckpt-r00000012.rank0.optim"
    orphan = tmp_path / f"{path.name}.{pid}.f4e20186.tmp"
    orphan.touch()
    assert remove_stale_temps(path) == [orphan]
