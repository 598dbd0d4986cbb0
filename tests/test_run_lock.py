"""One run per checkpoint series: the run lock (``checkpoint/run_lock.py``).

Another process holds the lock here, as another run would: a real process, a real
``flock``, killed for real where the test needs the kernel to release it.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from flodl_shm import SeriesInUse
from flodl_shm.checkpoint.run_lock import RunLock, run_lock_path
from flodl_shm.cli.demo import DemoConfig, run_demo

pytestmark = pytest.mark.timeout(60)

_HOLDER = textwrap.dedent("""
    import sys
    from flodl_shm.checkpoint.run_lock import RunLock
    job = sys.argv[2] if len(sys.argv) > 2 and sys.argv[2] else None
    member = int(sys.argv[3]) if len(sys.argv) > 3 else None
    with RunLock(sys.argv[1], job, member):
        print("held", flush=True)
        sys.stdin.readline()
""")


class Holder:
    """Another process holding the run lock of ``save_path`` (for ``job``, as its
    ``member``) until released or killed."""

    def __init__(self, save_path, job: str | None = None, member: int | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, os.fspath(save_path), job or "",
             *([] if member is None else [str(member)])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def release(self) -> None:
        self.proc.communicate("\n", timeout=30)
        assert self.proc.returncode == 0

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


def test_the_lock_file_sits_beside_the_series():
    assert run_lock_path("runs/demo/ckpt") == run_lock_path("runs/demo/ckpt.fdl")
    assert str(run_lock_path("runs/demo/ckpt")) == "runs/demo/ckpt.lock"


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    stem = tmp_path / "ckpt"
    holder = Holder(stem)
    try:
        with pytest.raises(SeriesInUse, match=rf"pid {holder.proc.pid} on host .* since .*"
                                              rf"ckpt.lock.*another save path") as err:
            with RunLock(stem):
                pass
        assert err.value.lock == os.fspath(tmp_path / "ckpt.lock")
    finally:
        holder.release()
    with RunLock(stem):  # released: free again
        assert run_lock_path(stem).exists()
    assert not run_lock_path(stem).exists()  # removed by its holder at the end


def test_the_lock_is_reentrant_in_its_process(tmp_path):
    stem = tmp_path / "ckpt"
    with RunLock(stem):
        with RunLock(stem):  # the demo holds it, then its Trainer.run takes it again
            pass
        assert run_lock_path(stem).exists()
        holder = subprocess.run([sys.executable, "-c", _HOLDER, os.fspath(stem)], input="\n",
                                capture_output=True, text=True, timeout=30)
        assert holder.returncode != 0 and "SeriesInUse" in holder.stderr  # still held
    assert not run_lock_path(stem).exists()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    stem = tmp_path / "ckpt"
    Holder(stem).kill()
    assert run_lock_path(stem).exists()  # the file stays; the kernel dropped the lock
    with RunLock(stem):
        pass
    assert not run_lock_path(stem).exists()


_LEAVES_AN_HEIR = textwrap.dedent("""
    import os, sys, time
    from flodl_shm.checkpoint.run_lock import RunLock
    job = sys.argv[3] if len(sys.argv) > 3 else None
    lock = RunLock(sys.argv[1], job, int(sys.argv[4]) if len(sys.argv) > 4 else None)
    lock.__enter__()
    child = os.fork()
    if child == 0:  # inherits the open lock file, as a DataLoader worker does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # (the test reads the holder's output to its end)
        os.dup2(devnull, 2)
        time.sleep(float(sys.argv[2]))
        os._exit(0)
    print(child, flush=True)
    os._exit(0)  # the holder is gone (killed, say); its child holds the lock on
""")


def _holder_gone_heir_lingers(stem, linger: float, *job_member) -> int:
    """The pid of a child that holds the lock of ``stem`` for ``linger`` s after the
    process that took it (with ``job`` and ``member``, when given) exited."""
    out = subprocess.run([sys.executable, "-c", _LEAVES_AN_HEIR, os.fspath(stem), str(linger),
                          *map(str, job_member)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def test_a_holder_that_releases_while_its_children_run_gives_the_series_up(tmp_path):
    """Its children share its open lock file, so its exclusive lock for the removal is
    granted: the file goes, and the next run takes the series at once (a child still
    running holds a lock on the removed file only). The module doc said the children
    held it on."""
    stem = tmp_path / "ckpt"
    r, w = os.pipe()
    with RunLock(stem):
        child = os.fork()
        if child == 0:  # inherits the open lock file, as a DataLoader worker does
            os.close(w)
            os.read(r, 1)  # until the test is done with it
            os._exit(0)
    os.close(r)
    try:
        assert not run_lock_path(stem).exists()
        holder = subprocess.run([sys.executable, "-c", _HOLDER, os.fspath(stem)], input="\n",
                                capture_output=True, text=True, timeout=30)
        assert holder.returncode == 0 and holder.stdout.strip() == "held", holder.stderr
    finally:
        os.close(w)
        os.waitpid(child, 0)


def test_a_lock_held_on_by_a_gone_holder_s_children_is_waited_for(tmp_path, caplog):
    """A probe's torchrun restart failed with SeriesInUse naming the killed rank: its
    DataLoader worker had inherited the open lock file and lived on a few seconds,
    holding the lock. An acquirer whose holder is gone waits for such processes."""
    import logging

    caplog.set_level(logging.WARNING, logger="flodl_shm")
    stem = tmp_path / "ckpt"
    heir = _holder_gone_heir_lingers(stem, 1.5)
    with RunLock(stem):
        pass
    assert "held by processes that pid " in caplog.text and f"started ({heir})" in caplog.text
    assert "waiting up to 30 s for them to exit" in caplog.text


def test_a_lock_file_naming_no_possible_pid_is_refused_at_once(tmp_path):
    """A regression probe wrote a pid past the kernel's range into a held lock file:
    the check for a gone holder raised OverflowError."""
    import socket
    import time

    stem = tmp_path / "ckpt"
    holder = Holder(stem)
    try:
        for pid in (10 ** 20, 2 ** 31):
            run_lock_path(stem).write_text(json.dumps(
                {"pid": pid, "host": socket.gethostname(), "started": "then"}) + "\n")
            t0 = time.monotonic()
            with pytest.raises(SeriesInUse, match=f"pid {pid} on host"):
                with RunLock(stem):
                    pass
            assert time.monotonic() - t0 < 2
    finally:
        holder.release()


def test_a_gone_holder_s_lingering_children_are_named(tmp_path, monkeypatch):
    from flodl_shm.checkpoint import run_lock

    monkeypatch.setattr(run_lock, "INHERITED_LOCK_WAIT_S", 0.5)
    stem = tmp_path / "ckpt"
    heir = _holder_gone_heir_lingers(stem, 60)
    try:
        with pytest.raises(SeriesInUse, match=rf"since .*, which is no longer running; "
                                              rf"processes it started \(a DataLoader worker, "
                                              rf"say\) still hold the lock file open \(pids "
                                              rf"{heir}\)"):
            with RunLock(stem):
                pass
    finally:
        os.kill(heir, signal.SIGKILL)


_ACQUIRER = textwrap.dedent("""
    import sys
    from flodl_shm.checkpoint.run_lock import RunLock
    lock = RunLock(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    with lock:
        print("shared" if lock.shared else "held", flush=True)
        sys.stdin.readline()
""")


def test_a_waiter_beaten_to_a_gone_holder_s_lock_decides_on_the_new_holder(tmp_path):
    """A probe: two hosts of one job waited on a lock that another job's gone holder
    left to its child. When the child exited, one took the lock; the other polled on for
    the rest of the 30 s, then was refused naming the gone holder and calling the winner
    its DataLoader worker. It reads the winner's line now and goes on beside it."""
    import time

    stem = tmp_path / "ckpt"
    heir = _holder_gone_heir_lingers(stem, 4.0, "k", 0)
    other = subprocess.Popen([sys.executable, "-c", _ACQUIRER, os.fspath(stem), "j", "0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        said = other.stderr.readline()
        assert "waiting up to 30 s for them to exit" in said, said
        t0 = time.monotonic()
        lock = RunLock(stem, "j", 2)  # waits for the child too
        with lock:
            mine = "shared" if lock.shared else "held"
            theirs = other.stdout.readline().strip()
        took = time.monotonic() - t0
        other.communicate("\n", timeout=30)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(30)
        try:
            os.kill(heir, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert sorted([mine, theirs]) == ["held", "shared"], (mine, theirs)
    assert took < 15, took


def test_trainer_run_on_a_series_in_use_deletes_nothing(tmp_path):
    from trainer_util import make_trainer

    stem = tmp_path / "ckpt"
    (tmp_path / "ckpt-r00000004.fdl").write_bytes(b"the other run's")
    (tmp_path / "ckpt-r00000004.meta.json").write_text("{}")
    holder = Holder(stem)
    try:
        trainer = make_trainer(epochs=1, save_path=stem)
        with pytest.raises(SeriesInUse):
            trainer.run(2, overwrite=True)
        with pytest.raises(SeriesInUse):
            trainer.resume()
    finally:
        holder.release()
    assert (tmp_path / "ckpt-r00000004.fdl").read_bytes() == b"the other run's"


def test_a_second_demo_on_one_run_dir_is_a_usage_error(tmp_path, capsys):
    run_dir = tmp_path / "demo"
    holder = Holder(run_dir / "ckpt")
    try:
        with pytest.raises(SystemExit) as info:
            run_demo(DemoConfig(run_dir=os.fspath(run_dir), overwrite=True, plot=False,
                                progress=False))
    finally:
        holder.release()
    assert info.value.code == 2  # as the other usage errors (it was 1)
    out = capsys.readouterr()
    assert re.search(rf"--run-dir {run_dir} is in use by another run \(pid {holder.proc.pid}"
                     rf".*another --run-dir", out.err), out.err
    assert out.out == ""  # refused before its banner
    assert not run_dir.exists()  # the holder made it empty and took it away: nothing written


def test_folders_the_lock_made_go_with_it_when_empty(tmp_path):
    with RunLock(tmp_path / "a" / "b" / "ckpt"):
        assert (tmp_path / "a" / "b").is_dir()
    assert not (tmp_path / "a").exists()  # a run refused before writing leaves no trace
    with RunLock(tmp_path / "c" / "ckpt"):
        (tmp_path / "c" / "ckpt-r00000001.fdl").write_bytes(b"")
    assert (tmp_path / "c" / "ckpt-r00000001.fdl").exists()  # what the run wrote stays


def test_another_host_of_the_same_job_goes_on_without_holding(tmp_path):
    """Hosts of one cluster whose save paths are one shared folder: the same job shares
    the lock, another job (or none given) is refused."""
    stem = tmp_path / "ckpt"
    holder = Holder(stem, job="cafe")
    try:
        lock = RunLock(stem, "cafe")
        with lock:
            assert lock.shared
        assert run_lock_path(stem).exists()  # still the holder's
        for job in ("beef", None):
            with pytest.raises(SeriesInUse) as err:
                with RunLock(stem, job):
                    pass
            assert err.value.job == "cafe"
    finally:
        holder.release()
    assert not run_lock_path(stem).exists()


def test_the_same_member_of_a_job_is_refused_wherever_the_lock_is(tmp_path):
    """A host of a cluster launched twice (the same job, the same first rank) went on as
    "another host of the job": the demo's --overwrite then deleted the running host's
    checkpoints. It is refused, whether the running host holds the series' lock or
    shares it (another host holds it, on a shared folder) and holds its member's."""
    stem = tmp_path / "ckpt"
    first = Holder(stem, job="cafe", member=0)  # host A holds the series' lock
    try:
        with pytest.raises(SeriesInUse) as err:
            with RunLock(stem, "cafe", 0):  # host A again
                pass
        assert err.value.member == 0 and err.value.lock == os.fspath(run_lock_path(stem))
        assert "(this job's member 0 runs already: pid " in str(err.value)
        second = Holder(stem, job="cafe", member=2)  # host B goes on, holding its member's
        try:
            assert (tmp_path / "ckpt.member-2.lock").exists()
            with pytest.raises(SeriesInUse):
                with RunLock(stem, "cafe", 2):  # host B again
                    pass
            lock = RunLock(stem, "cafe", 4)  # a third host of the job
            with lock:
                assert lock.shared and (tmp_path / "ckpt.member-4.lock").exists()
            assert not (tmp_path / "ckpt.member-4.lock").exists()
        finally:
            second.release()
        assert not (tmp_path / "ckpt.member-2.lock").exists()
    finally:
        first.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_host_of_the_same_job_waits_for_the_holders_line(tmp_path):
    """The holder writes its line (pid, host, job) right after its flock: another host of
    the same job that found the lock taken in between read no job and was refused (a
    cluster whose hosts save into one shared folder failed about one run in three)."""
    stem = tmp_path / "ckpt"
    path = run_lock_path(stem)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def write_line_then_share():
        line = json.dumps({"pid": 1, "host": "h", "started": "t", "job": "cafe"}) + "\n"
        os.pwrite(fd, line.encode(), 0)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # as a holder of a job does

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, its line not written yet
        writer = threading.Timer(0.2, write_line_then_share)
        writer.start()
        lock = RunLock(stem, "cafe")
        with lock:
            assert lock.shared
            fcntl.flock(fd, fcntl.LOCK_UN)  # the holder lets go: this process holds it on
            with pytest.raises(BlockingIOError):
                other = os.open(path, os.O_RDWR)
                try:
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                finally:
                    os.close(other)
        writer.join()
        assert not path.exists()  # the last process to hold it removed it
    finally:
        os.close(fd)


def test_a_job_s_lock_holds_while_any_of_its_hosts_runs(tmp_path):
    """A probe: a host of a job went on beside the host that held the series' lock
    without a lock of its own. When the holder ended first, it removed the lock file,
    and another job took the series while the host still wrote there. The job's hosts
    share the lock now; the last to leave removes it."""
    import time

    stem = tmp_path / "ckpt"
    first = Holder(stem, job="cafe", member=0)
    second = Holder(stem, job="cafe", member=2)  # another host of the job, sharing
    try:
        first.release()
        assert run_lock_path(stem).exists()
        for job in ("beef", None):
            t0 = time.monotonic()
            with pytest.raises(SeriesInUse, match="in use by another run \\(the processes of "
                                                  "another run's job, which took it on host "
                                                  ".*: the process that took it has ended, "
                                                  "the others of its job hold it"):
                with RunLock(stem, job):
                    pass
            assert time.monotonic() - t0 < 1.5  # (no wait for a gone holder's children)
        lock = RunLock(stem, "cafe", 4)  # a host of the job may still join
        with lock:
            assert lock.shared
        assert run_lock_path(stem).exists()
    finally:
        second.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the last one removed it
    with RunLock(stem, "beef"):  # another job's turn
        pass


@pytest.mark.parametrize("other_job", ["beef", None])
def test_a_dead_holder_s_line_does_not_let_its_job_join_another_job_s_run(tmp_path,
                                                                          other_job):
    """A probe: a holder of job "cafe" was killed, its line left in the file; a run of
    another job locked the file and, before it wrote its own line, a process of "cafe"
    read the dead one's, joined, and shared the series with the other job. The line is
    read again under the lock (or, the lock still exclusive after the wait, before going
    on without one)."""
    import socket

    path = run_lock_path(tmp_path / "ckpt")
    path.write_text(json.dumps({"pid": 2 ** 22 + 1, "host": "elsewhere", "started": "t",
                                "job": "cafe", "member": 0}) + "\n")  # the dead one's
    fd = os.open(path, os.O_RDWR)

    def write_line():  # the other run, a moment after its flock
        os.pwrite(fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                   "started": "now", "job": other_job, "member": None})
                       + "\n").encode().ljust(200), 0)
        if other_job is not None:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other run's, line not written
        writer = threading.Timer(0.2, write_line)
        writer.start()
        with pytest.raises(SeriesInUse) as err:
            with RunLock(tmp_path / "ckpt", "cafe", 2):
                pass
        writer.join()
        assert err.value.job == other_job and f"pid {os.getpid()} on host" in str(err.value)
    finally:
        os.close(fd)


def test_the_folders_a_job_s_first_holder_made_go_with_its_last_sharer(tmp_path):
    stem = tmp_path / "new" / "deeper" / "ckpt"
    first = Holder(stem, job="cafe", member=0)
    with RunLock(stem, "cafe", 2) as lock:
        assert lock.shared
        first.release()
        assert (tmp_path / "new" / "deeper").is_dir()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_removed_by_a_run_that_ends_is_made_again(tmp_path, monkeypatch):
    """A probe: a run starting as the run that made the series' folder ended had the
    folder removed between its mkdir and its open of the lock file, and raised a bare
    FileNotFoundError."""
    from flodl_shm.checkpoint import run_lock

    stem = tmp_path / "new" / "ckpt"
    real_open = os.open
    removed = []

    def open_after_the_other_run_ended(path, *args, **kwargs):
        if not removed and os.fspath(path).endswith("ckpt.lock"):
            (tmp_path / "new").rmdir()  # the ending run removes the folder it made
            removed.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(run_lock.os, "open", open_after_the_other_run_ended)
    with RunLock(stem):
        assert removed and run_lock_path(stem).exists()
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


def test_a_killed_holder_s_job_hosts_hold_the_lock_on(tmp_path, monkeypatch):
    """The job's first holder is killed (no hand-over of its line): the host sharing the
    lock holds it on; a host of the job joins at once, the killed one relaunched too (a
    probe's waited 30 s, then was told to stop its own job's other host), and another job
    is refused, naming the processes that hold it, after the wait for a gone holder's
    children."""
    import time

    from flodl_shm.checkpoint import run_lock

    monkeypatch.setattr(run_lock, "INHERITED_LOCK_WAIT_S", 0.5)
    stem = tmp_path / "ckpt"
    first = Holder(stem, job="cafe", member=0)
    second = Holder(stem, job="cafe", member=2)
    try:
        first.kill()
        for member in (4, 0):
            t0 = time.monotonic()
            lock = RunLock(stem, "cafe", member)
            with lock:
                assert lock.shared
            assert time.monotonic() - t0 < 1.5
        with pytest.raises(SeriesInUse, match=rf"which is no longer running; the other "
                                              rf"processes of its job, or processes it "
                                              rf"started .* hold the lock on \(those holding "
                                              rf"the lock file open: pids "
                                              rf"{second.proc.pid}\): wait for them to end"):
            with RunLock(stem, "beef"):
                pass
    finally:
        second.release()
    with RunLock(stem, "beef"):  # (the killed holder's file, taken over)
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_host_of_the_job_beside_a_holder_that_does_not_share_goes_on(tmp_path, caplog):
    """A holder of the job that keeps its lock exclusive (an older version, which never
    shared it): this host goes on without a lock of its own, as those versions did, and
    says so."""
    import logging

    caplog.set_level(logging.WARNING, logger="flodl_shm")
    stem = tmp_path / "ckpt"
    path = run_lock_path(stem)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, (json.dumps({"pid": 1, "host": "h", "started": "t", "job": "cafe"})
                       + "\n").encode(), 0)
        lock = RunLock(stem, "cafe")
        with lock:
            assert lock.shared
        assert "which does not share it" in caplog.text and path.exists()
    finally:
        os.close(fd)


def test_a_demo_host_of_the_same_cluster_shares_the_folder(tmp_path, capsys):
    """Two demo hosts of one cluster on one shared folder: the lock's job is a digest
    of the session secret, so the second host gets past it (and here fails on to the
    controller nobody runs); a host with another secret is refused before its banner."""
    import socket

    from flodl_shm.checkpoint.run_lock import cluster_job
    from flodl_shm.cluster.secret import read_secret_file, write_secret_file

    secret, other = tmp_path / "s.hex", tmp_path / "other.hex"
    write_secret_file(os.fspath(secret))
    write_secret_file(os.fspath(other))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        controller = f"127.0.0.1:{s.getsockname()[1]}"  # closed once this block ends
    run_dir = tmp_path / "shared"
    holder = Holder(run_dir / "ckpt", job=cluster_job(read_secret_file(os.fspath(secret)),
                                                     controller))

    def host(secret_file):
        return DemoConfig(run_dir=os.fspath(run_dir), controller=controller, world_size=4,
                          first_rank=2, secret_file=os.fspath(secret_file), plot=False,
                          progress=False, timeout=5.0)

    def refused(cfg) -> None:
        with pytest.raises(SystemExit) as info:
            run_demo(cfg)
        out = capsys.readouterr()
        assert info.value.code == 2 and "in use by another run" in out.err, out.err
        assert out.out == ""  # before its banner

    try:
        refused(host(other))
        with pytest.raises(ConnectionError, match="connect to"):
            run_demo(host(secret))
        assert "ranks 2-3 of 4" in capsys.readouterr().out  # past the lock
    finally:
        holder.release()
    # the same host (first rank 2) running already: refused before its banner, even with
    # --overwrite, which deleted the running host's checkpoints
    holder = Holder(run_dir / "ckpt", job=cluster_job(read_secret_file(os.fspath(secret)),
                                                     controller), member=2)
    try:
        refused(dataclasses.replace(host(secret), overwrite=True))
    finally:
        holder.release()


@pytest.mark.parametrize("under", ["afile", "afile/sub"])
def test_a_save_path_under_a_file_is_refused_naming_the_file(tmp_path, under):
    """The lock's folder cannot be made under a file: the error names the file, not
    mkdir's FileExistsError / NotADirectoryError on the folder."""
    import re

    (tmp_path / "afile").write_text("mine\n")
    with pytest.raises(NotADirectoryError,
                       match=re.escape(f"{tmp_path / 'afile'} is a file, not a folder")):
        with RunLock(tmp_path / under / "ckpt"):
            pass
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_a_lock_that_cannot_be_written_or_removed_is_given_back(tmp_path, monkeypatch):
    """A full disk when the lock's line is written, or a folder made read-only before it
    is removed: the lock used to stay held by this process (its next run on the path:
    SeriesInUse naming itself), the write error named no file, and the removal error
    replaced the run's own error on its way out."""
    import flodl_shm.checkpoint.run_lock as run_lock

    stem = tmp_path / "ck"
    real_pwrite, real_unlink = os.pwrite, os.unlink

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_lock.os, "pwrite", full)
    with pytest.raises(OSError, match=rf"cannot write the run lock {stem}\.lock: No space left "
                                      r"on device \(the disk is full: free some space, or "
                                      r"save elsewhere\)"):
        RunLock(stem).__enter__()
    monkeypatch.setattr(run_lock.os, "pwrite", real_pwrite)

    def read_only(path, *a, **k):
        if str(path).endswith(".lock"):
            raise OSError(30, "Read-only file system")
        return real_unlink(path, *a, **k)

    with RunLock(stem):
        monkeypatch.setattr(run_lock.os, "unlink", read_only)
    monkeypatch.setattr(run_lock.os, "unlink", real_unlink)
    with RunLock(stem):  # taken again, by this process or another
        pass
    code = subprocess.run([sys.executable, "-c", f"from flodl_shm.checkpoint.run_lock import "
                           f"RunLock; RunLock({str(stem)!r}).__enter__()"], timeout=60).returncode
    assert code == 0


@pytest.fixture
def remountable(tmp_path):
    """A real tmpfs at ``tmp_path / "fs"``, with a function that remounts it read-only;
    skipped where this process may not mount (not root, or no mount namespace right)."""
    where = tmp_path / "fs"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", os.fspath(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")

    def read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", os.fspath(where)], check=True)

    try:
        yield where, read_only
    finally:
        subprocess.run(["umount", "-l", os.fspath(where)], check=True)


@pytest.mark.timeout(120)
def test_a_read_only_run_dir_is_named_with_its_fix(remountable, capsys):
    """A probe remounted a run's folder read-only and resumed: ``OSError: [Errno 30]
    Read-only file system: '.../ckpt.lock'``, then "continue with --resume", which fails
    the same way. It is a usage error of --run-dir now, naming the folder and the fix."""
    from flodl_shm.cli.demo import main

    where, read_only = remountable
    run_dir = where / "run"
    argv = ["--run-dir", os.fspath(run_dir), "--epochs", "1", "--no-progress",
            "--log-every", "0", "--no-plot"]
    assert main(argv) == 0
    read_only()
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main([*argv, "--resume", "--epochs", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"python -m flodl_shm demo: error: --run-dir {run_dir}: cannot create the run lock "
        f"{run_dir}/ckpt.lock: Read-only file system: the series' folder must be writable, "
        f"for the lock and the checkpoints a run writes there; make {run_dir} writable, or "
        f"save into another folder"), err
    assert "--resume." not in err, err
