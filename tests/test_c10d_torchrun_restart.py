"""torchrun --max-restarts on the "flodl_shm" backend: docs/c10d.md's restart recipe, run
verbatim (tests/c10d_restart_script.py), survives a rank SIGKILLed mid-training. torchrun
restarts both ranks, they resume from the last checkpoint and end on the same bits as an
uninterrupted run; no rank of either attempt and no /dev/shm segment outlives the job.

Once on one node (``--standalone``), once on two nodes: two torchrun agents on this
machine, joined through a c10d rendezvous on 127.0.0.1, each standing in for a host
(``FLODL_SHM_HOST``). There torchrun mostly counts the restart only on the node whose
rank died, so the new ranks' ``TORCHELASTIC_RESTART_COUNT`` differ between the nodes (the
group keyed its store by that count and hung)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from c10d_driver import free_port  # noqa: E402
from test_c10d_torchrun import _finish, torchrun_env  # noqa: E402

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


def _popen(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _torchrun(out: Path, kill: int) -> subprocess.Popen:
    out.mkdir()
    return _popen(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                   str(SCRIPT), str(out), str(STEPS), str(kill)], torchrun_env(out))


def _torchrun_two_nodes(out: Path, kill: int) -> list[subprocess.Popen]:
    """Two agents, one rank each, on a c10d rendezvous at 127.0.0.1 (every address the
    job uses is the loopback: ``--local-addr``)."""
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    return [_popen(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", endpoint, "--rdzv-id", out.name,
                    "--local-addr", "127.0.0.1", "--max-restarts", "1",
                    str(SCRIPT), str(out), str(STEPS), str(kill)],
                   torchrun_env(out, f"node-{node}"))
            for node in "ab"]


def _starts(out: Path) -> dict[int, list[dict]]:
    """Each rank's process records, in the order they started."""
    starts: dict[int, list[dict]] = {}
    for p in out.glob("rank*_pid*.json"):
        rank = int(re.fullmatch(r"rank(\d+)_pid\d+\.json", p.name)[1])
        starts.setdefault(rank, []).append(json.loads(p.read_text()))
    return {r: sorted(recs, key=lambda rec: rec["started"]) for r, recs in sorted(starts.items())}


def _check_resumed(crashed: Path, clean: Path) -> None:
    assert (crashed / "killed").exists()              # rank 1 did die once
    starts = _starts(crashed)
    assert sorted(starts) == [0, 1]
    assert [len(starts[r]) for r in (0, 1)] == [2, 2]  # one restart, both ranks
    last_ckpt = (KILL - 1) // EVERY * EVERY
    for r in (0, 1):
        assert [rec["first_step"] for rec in starts[r]] == [0, last_ckpt + 1]
    assert [len(recs) for recs in _starts(clean).values()] == [1, 1]

    final = [torch.load(crashed / f"rank{r}.pt") for r in (0, 1)]
    reference = torch.load(clean / "rank0.pt")
    for a, b, ref in zip(*final, reference):
        assert torch.equal(a, b)                      # the ranks agree bit for bit
        assert torch.equal(a, ref)                    # ... with the uninterrupted run

    pids = {rec["pid"] for out in (crashed, clean) for recs in _starts(out).values()
            for rec in recs}
    assert [p for p in pids if pid_alive(p)] == []
    assert [s.name for s in list_segments() if s.owner_pid in pids] == []


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_from_the_checkpoint(tmp_path):
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    _finish([_torchrun(crashed, KILL), _torchrun(clean, -1)], 240)
    _check_resumed(crashed, clean)
    assert [rec["attempt"] for rec in _starts(crashed)[1]] == [0, 1]


@pytest.mark.slow
def test_torchrun_two_nodes_restart_where_their_restart_counts_differ(tmp_path):
    crashed, clean = tmp_path / "crashed", tmp_path / "clean"
    _finish([*_torchrun_two_nodes(crashed, KILL), *_torchrun_two_nodes(clean, -1)], 240)
    _check_resumed(crashed, clean)
