"""torchrun --max-restarts on the "flodl_shm" backend: docs/c10d.md's restart recipe, run
verbatim (tests/c10d_restart_script.py), survives a rank SIGKILLed mid-training. torchrun
restarts both ranks, they resume from the last checkpoint and end on the same bits as an
uninterrupted run; no rank of either attempt and no /dev/shm segment outlives the job."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_c10d_torchrun import _finish  # noqa: E402

from flodl_shm.engine.segment import pid_alive  # noqa: E402
from flodl_shm.engine.segment import list_segments  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "c10d_restart_script.py"
DOC = HERE.parent / "docs" / "c10d.md"
STEPS, KILL, EVERY = 12, 6, 4   # checkpoints after steps 0, 4, 8; the kill enters step 6

pytestmark = pytest.mark.timeout(300)


def _recipe_in_script() -> str:
    text = SCRIPT.read_text()
    return text.split("# --- recipe (docs/c10d.md) ---\n")[1].split("# --- end of recipe ---")[0]


def _recipe_in_doc() -> str:
    section = DOC.read_text().split("### Restarting with `torchrun --max-restarts`")[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_script_runs_the_doc_recipe_verbatim():
    assert _recipe_in_doc().strip() == _recipe_in_script().strip()


def _torchrun(out: Path, kill: int) -> subprocess.Popen:
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    env.pop("FLODL_SHM_HOST", None)
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(SCRIPT), str(out), str(STEPS), str(kill)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _attempts(out: Path) -> dict[tuple[int, int], dict]:
    return {(int(m[1]), int(m[2])): json.loads(p.read_text())
            for p in out.glob("attempt*_rank*.json")
            for m in [re.fullmatch(r"attempt(\d+)_rank(\d+)\.json", p.name)]}


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_from_the_checkpoint(tmp_path):
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    _finish([_torchrun(crashed, KILL), _torchrun(clean, -1)], 240)

    assert (crashed / "killed").exists()              # rank 1 did die once
    att = _attempts(crashed)
    assert sorted(att) == [(0, 0), (0, 1), (1, 0), (1, 1)]   # one restart, both ranks
    assert [att[0, r]["first_step"] for r in (0, 1)] == [0, 0]
    last_ckpt = (KILL - 1) // EVERY * EVERY
    assert [att[1, r]["first_step"] for r in (0, 1)] == [last_ckpt + 1] * 2
    assert sorted(_attempts(clean)) == [(0, 0), (0, 1)]

    final = [torch.load(crashed / f"rank{r}.pt") for r in (0, 1)]
    reference = torch.load(clean / "rank0.pt")
    for a, b, ref in zip(*final, reference):
        assert torch.equal(a, b)                      # the ranks agree bit for bit
        assert torch.equal(a, ref)                    # ... with the uninterrupted run

    pids = {a["pid"] for a in [*att.values(), *_attempts(clean).values()]}
    assert [p for p in pids if pid_alive(p)] == []
    assert [s.name for s in list_segments() if s.owner_pid in pids] == []
