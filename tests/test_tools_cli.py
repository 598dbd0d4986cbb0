"""The benchmark tools' command lines (tools/*.py), without running a benchmark.

Bad arguments end in argparse's usage and one error line naming the value (exit 2),
checked up front; output paths' folders are checked before any measuring; the shared
helpers (``tools/_bench_common.py``) write JSON Lines, find a cluster host's ranks at
any depth, and stop an interrupted mpirun with one signal and time to clean up.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
sys.path.insert(0, str(TOOLS))


def run_tool(tool: str, *args: str, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / tool), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def in_process(capsys, module: str, *args: str) -> tuple[int, str]:
    """``module.main(args)`` here (the fast way to reach its argument checks): its exit
    status and stderr."""
    mod = __import__(module)
    with pytest.raises(SystemExit) as exc:
        mod.main(list(args))
    return exc.value.code, capsys.readouterr().err


def assert_usage_error(code, err: str, *wanted: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert ": error: " in last, err
    for w in wanted:
        assert w in last, (w, last)


# --- bad arguments: one usage error naming the value and what is allowed -----------------

BAD = [
    # bench_allreduce
    ("bench_allreduce", ["--methods", "bogus"], ["'bogus'", "choose from"]),
    ("bench_allreduce", ["--methods", "memcpy"], ["memcpy", "add a method"]),
    ("bench_allreduce", ["--sizes", "0"], ["'0'", "above 0"]),
    ("bench_allreduce", ["--sizes", "6"], ["'6'", "multiple of 4"]),
    ("bench_allreduce", ["--sizes", "-4096"], ["'-4096'", "negative"]),
    ("bench_allreduce", ["--sizes", "4XB"], ["'4XB'", "KiB"]),
    ("bench_allreduce", ["--worlds", "0"], ["'0'", ">= 2"]),
    ("bench_allreduce", ["--worlds", "2x"], ["'2x'", ">= 2"]),
    ("bench_allreduce", ["--iter-scale", "-1"], ["-1", "> 0"]),
    ("bench_allreduce", ["--quick", "--iter-scale", "2"], ["--quick", "--iter-scale 2"]),
    ("bench_allreduce", ["--rounds", "0"], ["--rounds", "0 is below 1"]),
    # bench_kernels
    ("bench_kernels", ["--only", "bogus"], ["'bogus'", "reduce_f32"]),
    ("bench_kernels", ["--sizes", "0"], ["0", "above 0"]),
    ("bench_kernels", ["--reps", "-3"], ["-3", ">= 1"]),
    # bench_c10d
    ("bench_c10d", ["--worlds", "0"], ["'0'", ">= 1"]),
    ("bench_c10d", ["--max-size", "0"], ["'0'", "above 0"]),
    ("bench_c10d", ["--max-size", "4KB"], ["4000 B", "4 KiB"]),
    # bench_startup
    ("bench_startup", ["--repeats", "0"], ["0", ">= 1"]),
    ("bench_startup", ["--repeats", "-2"], ["-2", ">= 1"]),
    ("bench_startup", ["--start-methods", "bogus"], ["'bogus'", "forkserver"]),
    ("bench_startup", ["--nprocs", "0"], ["0", ">= 1"]),
    # bench_demo
    ("bench_demo", ["--repeats", "0"], ["0", ">= 1"]),
    ("bench_demo", ["--epochs", "0"], ["0", ">= 1"]),
    ("bench_demo", ["--big-model", "0"], ["--big-model", ">= 1"]),
    ("bench_demo", ["--big-model", "16", "--repeats", "-1"], ["--repeats", ">= 1"]),
    # bench_checkpoint
    ("bench_checkpoint", ["--repeats", "0"], ["--repeats", ">= 1"]),
    ("bench_checkpoint", ["--tensors", "0"], ["--tensors", ">= 1"]),
    ("bench_checkpoint", ["--size-mib", "0"], ["--size-mib", ">= 1"]),
    ("bench_checkpoint", ["--dir", "/nonexistent/flodl_bench"], ["/nonexistent/flodl_bench",
                                                                "does not exist"]),
    # bench_lm
    ("bench_lm", ["--heads", "7"], ["--heads 7", "--d-model 256"]),
    # bench_cluster
    ("bench_cluster", ["--hosts", "0"], ["'0'", ">= 1"]),
    ("bench_cluster", ["--wires", "f16"], ["'f16'", "f32, bf16"]),
    ("bench_cluster", ["--sizes", "4X"], ["'4X'", "KiB"]),
    ("bench_cluster", ["--quick", "--iter-scale", "0.5"], ["--quick", "--iter-scale 0.5"]),
    # probe_cross_core
    ("probe_cross_core", ["--sizes", "0"], ["'0'", "above 0"]),
    ("probe_cross_core", ["--iters", "0"], ["0", ">= 1"]),
]


@pytest.mark.parametrize("module,args,wanted", BAD, ids=[f"{m} {' '.join(a)}" for m, a, _ in BAD])
def test_bad_argument_is_one_usage_error(capsys, module, args, wanted):
    code, err = in_process(capsys, module, *args)
    assert_usage_error(code, err, *wanted)


@pytest.mark.parametrize("tool,args", [
    ("bench_allreduce.py", ["--sizes", "4KB,6"]),       # was: int() ValueError traceback
    ("bench_cluster.py", ["--wires", "f16"]),            # was: KeyError after measuring
    ("bench_kernels.py", ["--sizes", "4MiB", "--only", "bogus"]),   # 4MiB parses; --only refused
    ("bench_checkpoint.py", ["--dir", "/nonexistent/flodl_bench"]),
])
def test_bad_argument_from_the_command_line(tool, args):
    """The real command line: status 2, argparse's usage, no traceback."""
    proc = run_tool(tool, *args)
    assert_usage_error(proc.returncode, proc.stderr)
    assert proc.stderr.startswith("usage: "), proc.stderr


def test_sizes_accept_the_projects_units():
    """KB/MB/GB decimal and KiB/MiB/GiB binary, as ``flodl_shm ram`` reads them."""
    from _bench_common import comma_list, f32_size, human

    assert comma_list(f32_size, "size")("4KB,4KiB,1MB,4MiB") == [4000, 4096, 10 ** 6, 4 << 20]
    assert human(6) == "6 B" and human(4000) == "4000 B"   # not "0 KiB" / "3 KiB"
    assert human(4096) == "4 KiB" and human(256 << 20) == "256 MiB"


def test_kernel_sizes_take_units_or_mib():
    import bench_kernels

    assert bench_kernels.kernel_size("4") == 4 << 20          # a plain number is MiB
    assert bench_kernels.kernel_size("4MiB") == 4 << 20
    assert bench_kernels.kernel_size("256KiB") == 256 << 10


# --- output paths are checked before the measuring ----------------------------------------

@pytest.mark.parametrize("module,flag", [
    ("bench_allreduce", "--plot"), ("bench_allreduce", "--json"), ("bench_cluster", "--json"),
    ("bench_lm", "--plot"), ("bench_lm", "--json"), ("bench_demo", "--json"),
    ("bench_c10d", "--json"), ("bench_c10d_hosts", "--json"),
])
def test_output_into_a_missing_folder_is_refused_up_front(capsys, tmp_path, module, flag):
    target = tmp_path / "nodir" / "out.file"
    code, err = in_process(capsys, module, flag, str(target))
    assert_usage_error(code, err, flag, str(tmp_path / "nodir"), "does not exist")


# --- --help shows the defaults and how long a default run takes ---------------------------

def test_help_shows_defaults_and_durations():
    allreduce = " ".join(run_tool("bench_allreduce.py", "--help").stdout.split())
    assert "(default: 2,4)" in allreduce                          # --worlds
    assert "rank counts" in allreduce and "iteration counts" in allreduce
    for tool in ("bench_c10d.py", "bench_kernels.py", "bench_checkpoint.py"):
        text = " ".join(run_tool(tool, "--help").stdout.split())
        assert "takes about" in text, (tool, text)
        assert "(default: " in text, (tool, text)


# --- bench_allreduce's report ---------------------------------------------------------------

def _row(method, nbytes, us, world=2):
    from _bench_common import summarize

    return summarize(method, world, nbytes, [us * 1e3] * 5, True)


def test_main_table_without_memcpy_prints_no_nan():
    import bench_allreduce as B

    results = [_row("shm-copy", 4096, 5.0), _row("gloo", 4096, 50.0)]
    text = B.table(results, 2, ["shm-copy", "gloo"], {})
    assert "nan" not in text and "—" in text
    with_memcpy = B.table(results, 2, ["shm-copy", "gloo"], {4096: 1.0})
    assert "5.0×" in with_memcpy


def test_api_header_claims_a_peer_only_where_there_is_one():
    import bench_allreduce as B

    no_mpi = [_row("api-inplace", 4096, 5.0), _row("api-barrier", 4096, 2.0)]
    assert "× the OpenMPI peer" not in B.api_header(no_mpi, 2)
    some = no_mpi + [_row("mpi", 4096, 6.0)]
    assert "where there is one" in B.api_header(some, 2)
    every = some + [_row("mpi-barrier", 4096, 3.0)]
    assert B.api_header(every, 2) == "Cell = median µs (× the OpenMPI peer measured in this run)"


def test_interleaved_rounds_give_each_cell_its_median_and_each_ratio_its_rounds_own():
    """A round that ran in a slow stretch of the guest (ours 10 µs against the peer's 5)
    moves neither the cell nor its ratio: the ratio is the median of the rounds' own
    ratios (1.00×), not the ratio of the medians (6 / 5 = 1.20×)."""
    import bench_allreduce as B

    ours, peer = (5.0, 10.0, 6.0), (5.0, 5.0, 6.0)
    rounds = [[_row("api-inplace", 4096, a), _row("mpi", 4096, b)] for a, b in zip(ours, peer)]
    rounds[1][0]["slow_waits"] = [2.0, 1.0]
    rows = B.combine_rounds(rounds)
    cell = next(r for r in rows if r["method"] == "api-inplace")
    assert cell["median_us"] == 6.0 and cell["round_us"] == list(ours)
    assert cell["iters"] == 15 and cell["slow_waits"] == [2.0, 1.0]
    assert cell["algbw_GBps"] == pytest.approx(4096 / 6000.0)
    text = B.api_table(rows, 2)
    assert "| `all_reduce_([t])` | OpenMPI Allreduce (mpi4py) | 6.0 µs (1.00×) |" in text, text
    assert "over 3 interleaved rounds" in B.api_header(rows, 2)
    # one round: the ratio of the medians, as before
    single = [_row("api-inplace", 4096, 6.0), _row("mpi", 4096, 5.0)]
    assert "6.0 µs (1.20×)" in B.api_table(single, 2)
    assert "interleaved" not in B.api_header(single, 2)


def test_slow_waits_small_rates_keep_their_digits():
    import bench_allreduce as B

    assert B.slow_waits_text(0.033) == "0.033"
    assert B.slow_waits_text(0.0) == "0.0" and B.slow_waits_text(2.34) == "2.3"


def test_bench_lm_says_how_ranks_split_the_threads():
    import bench_lm

    assert "does not split evenly" in bench_lm.threads_note(2, 3)
    assert "3 ranks × 1 thread each" in bench_lm.threads_note(2, 3)
    assert "share cores" in bench_lm.threads_note(2, 3)
    assert bench_lm.threads_note(4, 2) == "# DiLoCo: 2 ranks × 2 threads each"


# --- JSON Lines ------------------------------------------------------------------------------

def test_json_file_is_json_lines(tmp_path):
    from _bench_common import append_jsonl

    path = tmp_path / "out.jsonl"
    append_jsonl(str(path), [{"method": "gloo", "bytes": 4096}, {"primitives": {"x": 1.5}}])
    append_jsonl(str(path), [{"method": "mpi"}])
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"method": "gloo", "bytes": 4096}, {"primitives": {"x": 1.5}}, {"method": "mpi"}]


# --- bench_cluster's CPU meter finds ranks at any depth --------------------------------------

_TREE = textwrap.dedent("""
    import subprocess, sys, time
    # a host: its child (the rank server) forks the ranks, which burn CPU
    burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 30: pass"
    server = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time\\n"
        f"r = subprocess.Popen([sys.executable, '-c', {burn!r}])\\n"
        "print(r.pid, flush=True)\\nr.wait()"], stdout=subprocess.PIPE, text=True)
    print(server.stdout.readline().strip(), flush=True)
    server.wait()
""")


def test_cpu_meter_counts_grandchild_ranks():
    import psutil

    from bench_cluster import CpuMeter

    host = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True)
    try:
        rank = int(host.stdout.readline())
        meter = CpuMeter(os.getpid(), [host.pid])
        assert rank in [p.pid for p in meter.procs["ranks"]]
        before = meter.snapshot()
        time.sleep(1.0)
        after = meter.snapshot()
        assert after["ranks"] - before["ranks"] > 0.3, (before, after)
    finally:
        for p in psutil.Process(host.pid).children(recursive=True):
            p.kill()
        host.kill()
        host.wait()


# --- mpirun: a Ctrl-C lets it clean up; a failed run is not a silent partial table -----------

_FAKE_MPIRUN = """#!{python}
import json, os, signal, sys, time
state = os.environ["FAKE_MPI_DIR"]


def on_signal(signum, frame):
    with open(os.path.join(state, "signals"), "a") as f:
        f.write(f"{{signum}}\\n")
    time.sleep(1.0)            # stopping its ranks, unlinking their segments
    with open(os.path.join(state, "cleaned"), "w") as f:
        f.write("yes")
    os._exit(1)


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
if os.environ["FAKE_MPI_MODE"] == "partial":
    row = {{"method": "mpi", "world": 2, "bytes": 4096, "iters": 3, "median_us": 9.0,
           "p10_us": 9.0, "p90_us": 9.0, "min_us": 9.0, "algbw_GBps": 0.4, "correct": True}}
    print("RESULT " + json.dumps(row), flush=True)
    print("fake mpirun: a rank died", file=sys.stderr)
    sys.exit(1)
parent = os.getppid()
open(os.path.join(state, "ready"), "w").close()
while os.getppid() == parent:  # (a test that failed killed the benchmark: go too)
    time.sleep(0.05)
"""


@pytest.fixture
def fake_mpi(tmp_path):
    """A ``mpirun`` on PATH (and an importable ``mpi4py``) that records the signals it
    gets and takes 1 s to clean up after the first; ``FAKE_MPI_MODE``: ``hang`` (until
    a signal) or ``partial`` (one row, then exit 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mpirun = bin_dir / "mpirun"
    mpirun.write_text(_FAKE_MPIRUN.format(python=sys.executable))
    mpirun.chmod(0o755)
    (tmp_path / "py" / "mpi4py").mkdir(parents=True)
    (tmp_path / "py" / "mpi4py" / "__init__.py").write_text("")
    state = tmp_path / "state"
    state.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               PYTHONPATH=str(tmp_path / "py"), FAKE_MPI_DIR=str(state))
    return env, state


def test_ctrl_c_lets_mpirun_clean_up(fake_mpi):
    env, state = fake_mpi
    env["FAKE_MPI_MODE"] = "hang"
    proc = subprocess.Popen([sys.executable, str(TOOLS / "bench_allreduce.py"), "--methods", "mpi",
                             "--worlds", "2", "--sizes", "4KiB"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (state / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)        # Ctrl-C at the terminal: the whole group
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (state / "cleaned").exists(), "mpirun was killed before it cleaned up"
    assert (state / "signals").read_text().split() == [str(int(signal.SIGINT))]
    assert proc.returncode == 130, err
    assert err.strip() == "bench_allreduce: interrupted", err


def test_failed_mpirun_is_named_and_exits_nonzero(fake_mpi, tmp_path):
    env, _ = fake_mpi
    env["FAKE_MPI_MODE"] = "partial"
    out = tmp_path / "out.jsonl"
    proc = run_tool("bench_allreduce.py", "--methods", "mpi", "--worlds", "2", "--sizes", "4KiB",
                    "--json", str(out), env=env)
    assert proc.returncode == 1, proc.stderr
    assert "status 1" in proc.stderr and "missing rows" in proc.stderr, proc.stderr
    for row in ("mpi-bcast 4 KiB", "mpi-small 4 KiB", "mpi-barrier 4 KiB"):
        assert row in proc.stderr, proc.stderr
    assert "a rank died" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]   # JSON Lines
    assert [r["method"] for r in rows] == ["mpi"]


# --- Ctrl-C: one line, status 130, nothing left behind -----------------------------------------

def test_ctrl_c_in_bench_startup_is_one_line(tmp_path):
    before = {f for f in os.listdir("/dev/shm") if f.startswith("fshm_")}
    proc = subprocess.Popen([sys.executable, str(TOOLS / "bench_startup.py"), "--repeats", "1",
                             "--start-methods", "default"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        time.sleep(3.0)       # inside the first spawn probe (its start-up alone takes longer)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip() == "bench_startup: interrupted", err
    assert list(tmp_path.iterdir()) == []                  # its temp folder is gone
    time.sleep(0.5)
    left = {f for f in os.listdir("/dev/shm") if f.startswith("fshm_")} - before
    assert not left, left


def test_the_cluster_benchmark_runs_with_its_phase_timers():
    """A probe found bench_cluster.py (and bench_c10d_hosts.py, which runs its cohort)
    failing every run: its timer wrapped Link.recv with the signature Link.recv had
    before it took idle= and abort=, the controller's reduce loop died on the new
    keywords, and a missing name left it half-wrapped. The smallest cohort, end to end."""
    done = run_tool("bench_cluster.py", "--sizes", "4KiB", "--hosts", "1", "--ranks", "1",
                    "--wires", "f32", "--no-gloo", "--iter-scale", "0.05", timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "phase timers disabled" not in done.stderr, done.stderr
    assert "## Where a round goes" in done.stdout, done.stdout
    phases = [line.split("|")[4:-1] for line in done.stdout.splitlines()
              if line.startswith("| 1 | 4 KiB | f32 |")]
    assert len(phases) == 1 and all(cell.strip() for cell in phases[0]), done.stdout


def test_the_cross_core_probe_prints_every_step_and_leaves_no_segment():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("fshm_")}
    done = run_tool("probe_cross_core.py", "--sizes", "4KiB,64KiB", "--iters", "50")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| step")]
    assert [r[0].strip() for r in rows] == ["private copy", "into a read slot",
                                            "into a fresh slot", "peer's slot out"]
    assert all(float(cell) > 0 for r in rows for cell in r[1:]), done.stdout
    left = {f for f in os.listdir("/dev/shm") if f.startswith("fshm_")} - before
    assert not left, left


def test_the_cross_core_probe_on_one_core_says_it_needs_two():
    done = subprocess.run([sys.executable, str(TOOLS / "probe_cross_core.py")],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          preexec_fn=lambda: os.sched_setaffinity(0, {0}))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "may run on 1 core only ([0]); the probe needs two" in done.stderr, done.stderr
