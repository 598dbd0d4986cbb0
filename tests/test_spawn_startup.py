"""The launcher interrupted or killed while its ranks are still starting up (here: held
in the import of the launcher's main module, as a heavy ``import torch`` would).

Ctrl-C reaches the whole foreground process group, ranks included: they must not die
of it mid-import ("Fatal Python error: init_import_site", exit code 1, ``RankFailed``);
the launcher stops them at once and raises ``KeyboardInterrupt``. A SIGKILLed launcher
takes its starting ranks down at once (they follow it from their first line of
Python, not after their imports).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from flodl_shm.engine.segment import list_segments, reap_dead_owner_segments

from engine_util import assert_no_leaks, processes_gone, start_spawn_driver

pytestmark = pytest.mark.timeout(180)
HERE = os.path.dirname(os.path.abspath(__file__))
IMPORT_S = 600  # how long each rank would stay in its import: far beyond every bound here
BOUND_S = 30.0  # what "at once" must beat on a busy 2-core host


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    assert_no_leaks()


@pytest.fixture(autouse=True, params=["forkserver", "spawn"])
def start_method(request, monkeypatch):
    """Every test runs under "forkserver" with a fresh rank server (ranks forked by a
    server that imported torch itself, then importing the launcher's main module) and
    "spawn": the start-ups in which ranks import the launcher's main module. (The rank
    server forked from a single-threaded launcher, the default for a script, has its
    own tests at the end: its ranks import nothing.)"""
    monkeypatch.setenv("DRIVER_START_METHOD", request.param)
    monkeypatch.setenv("FLODL_SHM_FORK_SERVER", "0")
    return request.param


def _start_importing_driver(tmp_path, nprocs=2):
    """The driver, once all its ranks are inside their import; (process, rank pids)."""
    return start_spawn_driver(tmp_path, nprocs, wait_for="importing", env={
        "DRIVER_SLOW_IMPORT_FILE": str(tmp_path / "importing"),
        "DRIVER_SLOW_IMPORT_S": str(IMPORT_S)})


def _segments_of(pid: int) -> list[str]:
    return [s.name for s in list_segments() if s.owner_pid == pid]


def _ctrl_c(proc) -> str:
    """A terminal's Ctrl-C (SIGINT to the driver's whole process group); the driver's
    stderr once it exits within ``BOUND_S`` (else its group is SIGKILLed)."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=BOUND_S)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_ctrl_c_while_ranks_import_is_a_clean_keyboard_interrupt(tmp_path):
    proc, ranks = _start_importing_driver(tmp_path)
    assert _segments_of(proc.pid)
    err = _ctrl_c(proc)
    assert proc.returncode == -signal.SIGINT, err  # the shell's 130
    assert "KeyboardInterrupt" in err and "every rank was stopped" in err, err
    assert "Fatal Python error" not in err and "RankFailed" not in err, err
    # the launcher's own traceback only: no rank died of the Ctrl-C mid-import
    assert err.count("Traceback (most recent call last)") == 1, err
    assert processes_gone(ranks, BOUND_S), "ranks outlived the interrupted launcher"
    assert _segments_of(proc.pid) == []


_SLOW_SERVER = """
import os, time
if b"_rank_server_main" in open("/proc/self/cmdline", "rb").read():
    with open(os.environ["SLOW_SERVER_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(600)
"""


def _ctrl_c_stops_the_server(proc, server: int) -> None:
    """Ctrl-C the launcher whose rank server ``server`` is still preloading: a clean
    KeyboardInterrupt at once, the server gone, no segment left."""
    err = _ctrl_c(proc)
    assert proc.returncode == -signal.SIGINT, err
    assert "KeyboardInterrupt" in err and "every rank was stopped" in err, err
    assert "RankFailed" not in err and "rank server exited" not in err, err
    assert processes_gone([server], BOUND_S), "the rank server outlived the interrupt"
    assert _segments_of(proc.pid) == []


def test_ctrl_c_while_the_rank_server_preloads(tmp_path, start_method):
    """Ctrl-C while the rank server is still importing (held there by a sitecustomize
    that only the server runs): the launcher stops at once with KeyboardInterrupt
    instead of waiting for the server's first fork, and the server is gone."""
    if start_method != "forkserver":
        pytest.skip("only the forkserver start method has a rank server")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_SERVER)
    marker = tmp_path / "server"
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "spawn_driver.py"), "2"],
                            env=dict(os.environ, PYTHONPATH=path, SLOW_SERVER_FILE=str(marker),
                                     DRIVER_READY_FILE=str(tmp_path / "ready")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text().split()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the rank server never started: {_ctrl_c(proc)}")
        time.sleep(0.05)
    server = int(marker.read_text().split()[0])
    _ctrl_c_stops_the_server(proc, server)


def test_launcher_killed_while_ranks_import_takes_them_down(tmp_path):
    proc, ranks = _start_importing_driver(tmp_path)
    family = set(ranks) | set(_ranks_of(proc.pid))  # with the rank server, if any
    try:
        proc.kill()
        proc.wait(BOUND_S)
        assert processes_gone(ranks, BOUND_S), \
            "starting ranks outlived their SIGKILLed launcher"
        assert processes_gone(family, BOUND_S), "the rank server outlived its launcher"
    finally:
        for pid in family:  # never leave them behind, whatever the verdict
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    left = _segments_of(proc.pid)
    assert left, "expected the dead launcher's segments to still be there"
    assert set(left) <= {s.name for s in reap_dead_owner_segments()}
    assert _segments_of(proc.pid) == []


def test_sigint_storm_through_rank_start_up_kills_no_rank(tmp_path, start_method):
    """SIGINT sent to the ranks again and again from the instant each is forked, through
    its interpreter's start-up (where it used to die, or end with "Fatal Python error:
    init_import_site") and its imports, until it runs: no rank dies of it (a Ctrl-C is
    the launcher's to handle), and the run goes on."""
    ready = tmp_path / "ready"
    env = dict(os.environ, DRIVER_READY_FILE=str(ready))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "spawn_driver.py"), "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    hit: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if ready.exists() and len(ready.read_text().split()) >= 2:
                break
            for pid in _ranks_of(proc.pid):
                try:
                    os.kill(pid, signal.SIGINT)
                    hit.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        assert proc.poll() is None, f"the launcher stopped: {proc.communicate()}"
        assert len(ready.read_text().split()) == 2, "the ranks never ran"
        assert len(hit) >= (3 if start_method == "forkserver" else 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, err
    assert "Fatal Python error" not in err and "RankFailed" not in err, err
    assert processes_gone(hit, BOUND_S), "ranks outlived the launcher"
    assert _segments_of(proc.pid) == []


def _ranks_of(pid: int) -> list[int]:
    """Descendants of ``pid`` other than multiprocessing's resource tracker, from the
    instant each is forked: the ranks (under "forkserver" also the rank server that
    forks them, which must shrug off SIGINT as well)."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if not any("resource_tracker" in part for part in k.cmdline()):
                out.append(k.pid)
        except psutil.Error:
            pass
    return out




# --- the rank server forked from the launcher ---------------------------------------------

_FORKED_SCRIPT = """
import os, sys, threading, time
import torch
import flodl_shm

STARTED_IN = os.getpid()  # the launcher's pid, or a rank's when it runs this file again


def fn(ctx):
    ctx.comm.barrier()
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().decode().replace("\\0", " ").strip()
    return os.getppid(), parent, sys.modules["__main__"].STARTED_IN == os.getpid()


if __name__ == "__main__":
    if sys.argv[1] == "torch-threads":
        torch.set_num_threads(2)
        x = torch.randn(512, 512)
        (x @ x).sum().item()          # torch's OpenMP pool now runs
    elif sys.argv[1] == "user-thread":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    elif sys.argv[1] == "second-spawn":
        flodl_shm.spawn(fn, 2)        # loads the kernels here, then forks past OpenBLAS
        time.sleep(0.2)               # its threads' native exits are over
    elif sys.argv[1].startswith("interrupted-"):
        import signal
        from flodl_shm.engine.segment import list_segments

        class Alarm(Exception):
            pass

        def alarm(signum, frame):
            signal.signal(signal.SIGALRM, signal.SIG_IGN)  # once
            raise Alarm()

        def once_the_ranks_start():
            while not ([g for g in list_segments() if g.owner_pid == os.getpid()]
                       and multiprocessing.active_children()):
                time.sleep(0.001)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)

        import multiprocessing
        signal.signal(signal.SIGALRM, alarm)
        ringer = None
        if sys.argv[1] == "interrupted-compile":  # (on an empty cache: a long compile)
            signal.setitimer(signal.ITIMER_REAL, 1.0)
        else:
            ringer = threading.Thread(target=once_the_ranks_start, daemon=True)
            ringer.start()
        try:
            flodl_shm.spawn(fn, 2, start_method="spawn")
        except Alarm:
            pass
        else:
            sys.exit("the alarm did not interrupt the first spawn")
        if ringer is not None:
            ringer.join()
    print("said once before spawn", end="")  # left in stdout's buffer
    out = flodl_shm.spawn(fn, 2)
    print()
    for ppid, parent, reimported in out:
        print(ppid != os.getpid(), parent, reimported, sep="|")
"""


def _cache_without(base, *prefixes: str) -> str:
    """A numba cache folder under ``base`` holding a copy of this process's kernel cache
    without the files that start with any of ``prefixes`` (a kernels module's, the
    folder's ``complete`` mark)."""
    from flodl_shm.kernels._cache import cache_dir

    src = cache_dir()
    shutil.copytree(src, base / src.name,
                    ignore=lambda _, names: [n for n in names if n.startswith(prefixes)])
    return str(base)


def _run_forked_script(tmp_path, mode: str, env: dict | None = None) -> tuple[str, list]:
    script = tmp_path / "launcher.py"
    script.write_text(_FORKED_SCRIPT)
    run_env = {k: v for k, v in os.environ.items() if k != "FLODL_SHM_FORK_SERVER"}
    run_env.update(env or {})
    done = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True,
                          timeout=120, env=run_env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return lines[0], [line.split("|") for line in lines[1:]]


@pytest.mark.parametrize("start_method", ["default"])  # the launcher's own start-up
@pytest.mark.parametrize("mode", ["plain", "second-spawn"])
def test_a_single_threaded_launcher_forks_its_rank_server(tmp_path, start_method, mode):
    """A script that imported torch and flodl_shm and ran no torch operation: the rank
    server is a fork of the launcher (its command line), so its ranks import nothing
    again; what the launcher left in its stdout buffer is printed once, not per rank.
    So is a second ``spawn`` of the same script: the first one's threads are gone, and
    the OpenBLAS pools that loading the kernels started were stopped by the first fork
    (a stopped pool has no thread to fork past)."""
    first, ranks = _run_forked_script(tmp_path, mode)
    assert first == "said once before spawn"
    script = str(tmp_path / "launcher.py")
    for not_launcher, parent, reimported in ranks:
        assert not_launcher == "True", "ranks fork from the server, not the launcher"
        assert script in parent and "_rank_server_main" not in parent, parent
        assert reimported == "False", "a forked rank has the launcher's main module"


@pytest.mark.parametrize("start_method", ["default"])
@pytest.mark.parametrize("mode", ["interrupted-compile", "interrupted-start-up"])
def test_a_spawn_after_one_an_exception_stopped_forks_its_rank_server(tmp_path, start_method,
                                                                      mode):
    """An alarm's exception raised into a ``spawn``'s compile of the kernels (the
    "spawn" start method, a numba cache without some of them) or into its wait for the
    ranks to start: it propagated, but the compile's thread (or the supervisor's, still
    on its way out) ran on, and the next ``spawn`` found a second thread in the launcher
    and started a fresh interpreter as its rank server (1.8 s against 0.1). It waits for
    them now (the compile is one it needs too) and forks the server from the launcher."""
    env = {}
    if mode == "interrupted-compile":
        # the suite's own cache but the part collectives' kernels: the compile thread
        # compiles those for seconds (4-6 s here; the cross-memory kernels, which this
        # test left out before, 11-35 s)
        env["NUMBA_CACHE_DIR"] = _cache_without(tmp_path / "numba", "parts.")
    first, ranks = _run_forked_script(tmp_path, mode, env)
    assert first == "said once before spawn"
    for not_launcher, parent, reimported in ranks:
        assert not_launcher == "True" and "_rank_server_main" not in parent, parent
        assert reimported == "False", "a forked rank has the launcher's main module"


@pytest.mark.parametrize("start_method", ["default"])
@pytest.mark.parametrize("mode, env", [("torch-threads", {}), ("user-thread", {}),
                                       ("plain", {"FLODL_SHM_FORK_SERVER": "0"})])
def test_a_launcher_that_runs_threads_gets_a_fresh_rank_server(tmp_path, start_method, mode,
                                                               env):
    """Forking a process with torch's OpenMP pool or a thread of its own is not safe: the
    rank server is then a fresh interpreter (as it is with FLODL_SHM_FORK_SERVER=0)."""
    first, ranks = _run_forked_script(tmp_path, mode, env)
    assert first == "said once before spawn"
    for not_launcher, parent, reimported in ranks:
        assert not_launcher == "True" and "_rank_server_main" in parent, parent
        assert reimported == "True", "a fresh server's ranks import the main module"


_UNGUARDED_SCRIPT = """
import torch
import flodl_shm

torch.randn(256, 256) @ torch.randn(256, 256)  # a fresh rank server: ranks import this file


def fn(ctx):
    return ctx.rank


print(flodl_shm.spawn(fn, 2))  # no __main__ guard: every rank runs this line again
"""


@pytest.mark.parametrize("start_method", ["default"])
def test_a_script_without_a_main_guard_is_told_what_to_guard(tmp_path, start_method):
    """The classic first mistake: ranks import the launcher's script, and an unguarded
    spawn there fails them while they start. spawn said only 'rank 0 exited with code 1
    without a result'; it now says the rank died starting, where its traceback went and
    what to put under ``if __name__ == "__main__":``."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "exited with code 1 while starting, before it ran fn" in last, done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last, last


_FEW_DESCRIPTORS_SCRIPT = """
import os, resource
import flodl_shm


def fn(ctx):
    return ctx.rank


if __name__ == "__main__":
    held = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 3, resource.getrlimit(
        resource.RLIMIT_NOFILE)[1]))
    try:
        flodl_shm.spawn(fn, 2)
    except OSError as e:
        print(e)
"""


@pytest.mark.parametrize("start_method", ["default"])
def test_a_launcher_out_of_descriptors_is_told_the_limit(tmp_path, start_method):
    """A probe under `ulimit -n 20` read multiprocessing's traceback ending in
    `OSError: [Errno 24] Too many open files` from os.pipe()."""
    script = tmp_path / "few_descriptors.py"
    script.write_text(_FEW_DESCRIPTORS_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout.strip()
    assert said.startswith("[Errno 24] spawn ran out of file descriptors starting 2 ranks: "
                           "this process may hold "), said
    assert "(`ulimit -n`, RLIMIT_NOFILE)" in said and "`ulimit -n 4096`" in said, said
    assert_no_leaks(10)


@pytest.mark.parametrize("start_method", ["default"])
def test_ctrl_c_while_the_forked_rank_server_loads_kernels(tmp_path, start_method):
    """Ctrl-C while the forked server is still loading the kernels (here: compiling them
    into an empty numba cache, which takes long): the launcher stops at once with
    KeyboardInterrupt, and the server is gone."""
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "spawn_driver.py"), "2"],
                            env=dict({k: v for k, v in os.environ.items()
                                      if k not in ("FLODL_SHM_FORK_SERVER",
                                                   "DRIVER_START_METHOD")},
                                     NUMBA_CACHE_DIR=str(tmp_path / "cold-cache"),
                                     DRIVER_READY_FILE=str(tmp_path / "ready")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    server = None
    while server is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the rank server never started: {_ctrl_c(proc)}")
        for pid in _ranks_of(proc.pid):  # the forked server: the launcher's command line
            if "spawn_driver.py" in " ".join(psutil.Process(pid).cmdline()):
                server = pid
        time.sleep(0.05)
    time.sleep(0.5)
    assert not (tmp_path / "ready").exists(), "the kernels compiled before the Ctrl-C"
    _ctrl_c_stops_the_server(proc, server)


@pytest.mark.parametrize("start_method", ["default"])
def test_launcher_killed_takes_the_forked_server_and_its_ranks_down(tmp_path, start_method):
    env = {k: "" for k in ("DRIVER_START_METHOD",)}
    proc, ranks = start_spawn_driver(tmp_path, 2, env={**env, "FLODL_SHM_FORK_SERVER": "1"})
    family = set(ranks) | set(_ranks_of(proc.pid))
    assert len(family) == 3, "two ranks and their (forked) server"
    try:
        proc.kill()
        proc.wait(BOUND_S)
        assert processes_gone(family, BOUND_S), "the server or a rank outlived the launcher"
    finally:
        for pid in family:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert set(_segments_of(proc.pid)) <= {s.name for s in reap_dead_owner_segments()}


@pytest.mark.parametrize("start_method", ["default"])
def test_a_rank_s_exit_code_read_from_several_threads_at_once_is_the_real_one(start_method):
    """A full suite failed once on a rank stopped with the cohort that read "failed too
    (exit code 255)", with a death record. multiprocessing's forkserver ``poll`` reads the
    exit code from the server's pipe unlocked; the supervisor polls from its monitor and
    its escalation thread, and the one that found the pipe already read set 255 over the
    real code (3 threads polling a forkserver process here: 91 of 200 read 255)."""
    import threading

    from flodl_shm.launch.rank_server import _RankServer, _ServedRankProcess

    server = _RankServer()
    server.start(1, 1)
    codes = []
    try:
        for _ in range(30):
            p = _ServedRankProcess(target=time.sleep, args=(0.02,))
            p._rank_server = server
            p.start()

            def poll():
                while p.is_alive():
                    pass

            pollers = [threading.Thread(target=poll) for _ in range(3)]
            for t in pollers:
                t.start()
            for t in pollers:
                t.join(30)
            codes.append(p.exitcode)
    finally:
        server.stop()
    assert codes == [0] * 30, codes
