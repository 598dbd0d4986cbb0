"""Crash safety, proven: SIGKILL a process that keeps rewriting a checkpoint.

A child process rewrites one ~24 MiB ``.fdl`` in a loop, every entry filled
with its generation number, through the same commit path every checkpoint
uses (temp + fsync + rename + dir fsync). The parent kills it with SIGKILL at
random moments — many of them in the middle of a write — and after every kill
checks the invariant DESIGN §6 promises:

- the checkpoint file loads intact: every entry present, full size, one
  generation throughout (never a mix, never torn);
- it is the last generation the child reported committed, or a newer one the
  child had begun (a write that finished renaming just before the kill);
- the directory holds nothing but the checkpoint and, at most, the killed writer's
  temp file (``ckpt.fdl.<pid>.<hex>.tmp``);

then that the next write removes the stale temp files.
"""
from __future__ import annotations

import os
import random
import re
import selectors
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from flodl_shm.checkpoint._atomic import STALE_TEMP_AGE_S
from flodl_shm.checkpoint.fdl import read_fdl, write_fdl_raw, RawEntry, FdlDtype

ENTRIES = 6
ELEMS = 1 << 20  # 6 x 4 MiB = 24 MiB
MIN_KILLS = 20
MIN_MID_WRITE_KILLS = 10
MAX_KILLS = 80
TIME_BUDGET_S = 25.0
TEMP = re.compile(r"ckpt\.fdl\.\d+\.[0-9a-f]+\.tmp$")

_WRITER = textwrap.dedent("""
    import sys
    import time
    import numpy as np
    from flodl_shm.checkpoint.fdl import FdlDtype, RawEntry, write_fdl_raw

    path, gen, entries, elems = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    bufs = [np.empty(elems, np.float32) for _ in range(entries)]
    print("ready", flush=True)
    while True:
        for b in bufs:
            b.fill(gen)
        print(f"begin {gen} {time.monotonic()}", flush=True)
        write_fdl_raw(path, [RawEntry(f"p{i}", (elems,), FdlDtype.F32, b)
                             for i, b in enumerate(bufs)])
        print(f"done {gen} {time.monotonic()}", flush=True)
        gen += 1
""")


class Writer:
    """One writer process and the progress lines it printed."""

    def __init__(self, path, first_gen: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(first_gen), str(ENTRIES), str(ELEMS)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.begun: list[int] = []
        self.done: list[int] = []
        self.times: dict[str, float] = {}

    def wait_for(self, word: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sel.select(left):
                raise AssertionError(f"writer printed no {word!r} within {timeout} s; stderr: "
                                     f"{self.proc.stderr.read1(4096)!r}")
            line = self.proc.stdout.readline().decode()
            if not line:
                raise AssertionError(f"writer exited early: {self.proc.stderr.read().decode()}")
            self._note(line)
            if line.startswith(word):
                return

    def _note(self, line: str) -> None:
        # "begin|done <gen> <the child's monotonic clock>": the write's duration comes
        # from the child's own stamps (the parent may read both lines at once)
        kind, *rest = line.split()
        value = rest[0] if rest else ""
        self.times[f"{kind} {value}".strip()] = float(rest[1]) if len(rest) > 1 \
            else time.monotonic()
        if kind == "begin":
            self.begun.append(int(value))
        elif kind == "done":
            self.done.append(int(value))

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        for line in self.proc.stdout.read().decode().splitlines():  # what it printed before dying
            self._note(line)
        self.close()

    def close(self) -> None:
        self.sel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.proc.stderr.close()


def generation_of(path) -> int:
    """The single generation a checkpoint holds; fails on any torn or mixed file."""
    parsed = read_fdl(path)
    assert [e.name for e in parsed.entries] == [f"p{i}" for i in range(ENTRIES)]
    gens = set()
    for e in parsed.entries:
        values = e.to_numpy()
        assert values.shape == (ELEMS,)
        lo, hi = values.min(), values.max()
        assert lo == hi, f"entry {e.name} mixes generations {lo} and {hi}"
        gens.add(int(lo))
    assert len(gens) == 1, f"entries from different generations: {sorted(gens)}"
    return gens.pop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_mid_write_never_tears_the_checkpoint(tmp_path):
    path = tmp_path / "ckpt.fdl"
    rng = random.Random(0x5EED)

    # Generation 0 lands completely; time a write to aim the kills inside the next ones.
    first = Writer(path, 0)
    try:
        first.wait_for("ready")
        first.wait_for("done 0")
        first.wait_for("done 1")
        write_s = first.times["done 1"] - first.times["begin 1"]
    finally:
        first.kill()
    last_gen = generation_of(path)
    next_gen = max(first.begun) + 1

    kills = mid_write = 0
    started = time.monotonic()
    while kills < MAX_KILLS and (kills < MIN_KILLS or mid_write < MIN_MID_WRITE_KILLS):
        if time.monotonic() - started > TIME_BUDGET_S and kills >= MIN_KILLS:
            break
        w = Writer(path, next_gen)
        try:
            w.wait_for("ready")
            time.sleep(rng.uniform(0.0, 2.5 * write_s))
        finally:
            w.kill()
        kills += 1
        temps = [n for n in os.listdir(tmp_path) if TEMP.match(n)]
        mid_write += bool(temps)

        assert set(os.listdir(tmp_path)) - set(temps) == {"ckpt.fdl"}
        # earlier killed writers' temps are gone (an empty one, of a writer killed between
        # its create and its first byte, waits until it is STALE_TEMP_AGE_S old)
        written = [n for n in temps if (tmp_path / n).stat().st_size > 0]
        assert len(written) <= 1, f"temps of earlier killed writers were left: {written}"
        gen = generation_of(path)  # loads intact, one generation throughout
        lowest = max([last_gen] + w.done)
        highest = max([last_gen] + w.begun)
        assert lowest <= gen <= highest, (
            f"kill {kills}: checkpoint holds generation {gen}; the previous one was {last_gen}, "
            f"this writer committed {w.done} and began {w.begun}")
        assert gen == last_gen or gen in w.begun
        last_gen = gen
        next_gen = max([next_gen] + w.begun) + 1

    print(f"{kills} kills, {mid_write} inside a write (one write takes {write_s * 1e3:.0f} ms)")
    assert kills >= MIN_KILLS
    assert mid_write >= 1, f"none of {kills} kills landed inside a write; the test proved nothing"

    # The next write removes stale temp files and leaves none behind.
    (tmp_path / "ckpt.fdl.1.deadbeef.tmp").write_bytes(b"torn bytes of a killed writer")
    past = time.time() - STALE_TEMP_AGE_S - 1
    for n in os.listdir(tmp_path):
        if TEMP.match(n):
            os.utime(tmp_path / n, (past, past))
    write_fdl_raw(path, [RawEntry(f"p{i}", (ELEMS,), FdlDtype.F32,
                                  np.full(ELEMS, next_gen, np.float32)) for i in range(ENTRIES)])
    assert os.listdir(tmp_path) == ["ckpt.fdl"]
    assert generation_of(path) == next_gen
