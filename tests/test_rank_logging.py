"""What a newcomer reads in the launcher's log: every rank's line once, and no claim of
page-locked ("pinned") memory on a host without CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest

from flodl_shm.engine.staging import decide_pinned_decode

from engine_util import assert_no_leaks

pytestmark = pytest.mark.timeout(240)
HERE = os.path.dirname(os.path.abspath(__file__))

TRAIN_WITH_LOGGING = f"""
import logging, sys
sys.path.insert(0, {HERE!r})
if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from trainer_util import make_trainer
    make_trainer(epochs=1, log_every=2).run(2)
"""


@pytest.fixture(autouse=True)
def _no_leaks():
    yield
    assert_no_leaks()


def test_each_trainer_log_line_appears_once(tmp_path):
    """A Trainer run with logging configured in the launcher: each rank's record is
    printed once, by the launcher ("rank N: ..."), not also by a handler of the rank's
    own (it used to be printed twice)."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_LOGGING)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=200)
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    window = [ln for ln in lines if "rank 0: epoch 0 window" in ln]
    assert len(window) == 4, lines  # 8 windows, one line every 2
    assert not [ln for ln in lines if "[rank " in ln], "a rank printed through its own handler"
    bodies = Counter(ln.split("flodl_shm: ", 1)[1] for ln in lines if "flodl_shm: " in ln)
    assert [b for b, n in bodies.items() if n > 1] == [], run.stderr


TRAIN_ELCHE = f"""
import logging, sys
sys.path.insert(0, {HERE!r})
if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from trainer_util import make_trainer
    make_trainer(epochs=1, cadence="elche").run(2)
"""


def test_a_cohort_decision_is_logged_by_one_rank(tmp_path):
    """ElChe's phase changes are decided identically on every rank; the launcher's log
    shows each once (from the reporting rank), not once per rank."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_ELCHE)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=200)
    assert run.returncode == 0, run.stderr
    phases = [ln for ln in run.stderr.splitlines() if "ElChe phase" in ln]
    assert phases, run.stderr
    assert all("rank 0: " in ln for ln in phases), phases


@pytest.mark.parametrize("cuda", [False, True])
def test_staging_decision_claims_pinned_memory_only_with_cuda(cuda):
    on = decide_pinned_decode(1 << 20, 2, available_bytes=1 << 40, cuda=cuda, log=False)
    off = decide_pinned_decode(1 << 20, 2, available_bytes=1 << 20, cuda=cuda, log=False)
    assert on.enabled and not off.enabled
    if cuda:
        assert on.reason.startswith("pinned decode staging ON") and "page-locked" in on.reason
        assert off.reason.startswith("pinned decode staging OFF")
    else:
        assert on.reason.startswith("decode staging ON") and "pinned" not in on.reason
        assert "no CUDA" in on.reason and "page-locked" not in on.reason
        assert off.reason.startswith("decode staging OFF") and "pinned" not in off.reason
