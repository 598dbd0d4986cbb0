"""A bulk ``broadcast_from_root`` with a rank SIGKILLed at each point of the round (real
processes, the supervisor fences the dead one): a root that dies before publishing makes
the survivors raise naming it; a root that dies after publishing, or a reader that dies
mid-copy, leaves the others with the root's tensors, bit for bit, and nobody hangs.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flodl_shm import spawn  # noqa: E402

from engine_util import assert_no_leaks  # noqa: E402

pytestmark = pytest.mark.timeout(180)

BIG = 1 << 19  # 2 MiB of f32: the bulk path


def _root_tensors(rank: int) -> list[torch.Tensor]:
    a = torch.arange(BIG, dtype=torch.float32) * (rank + 1) - 0.5
    return [a, torch.full((7, 3), -float(rank + 1))]


def broadcast_with_a_kill(ctx, victim: int, phase: str, root: int):
    """Round 0: a barrier; round 1: a bulk broadcast from ``root`` during which
    ``victim`` is SIGKILLed at ``phase``. Returns ("ok", bits) or ("raised", message)."""
    if ctx.rank == victim:
        def hook(where, rnd):
            if where == phase and rnd == 1:
                os.kill(os.getpid(), signal.SIGKILL)

        ctx.comm.set_fault_hook(hook)
    ctx.comm.barrier()
    mine = _root_tensors(ctx.rank)
    try:
        got = ctx.comm.broadcast_from_root(mine, root)
    except RuntimeError as e:
        return ("raised", str(e))
    return ("ok", [t.view(torch.int32).reshape(-1)[::997].tolist() for t in got])


@pytest.mark.parametrize("victim,phase,root,outcome", [
    (2, "before_copy_in", 2, "raised"),  # the root dies before publishing
    (2, "mid_copy_in", 2, "raised"),     # ... halfway through its copy-in
    (2, "arrived", 2, "ok"),             # the root published, then died: its region is read
    (1, "mid_copy_out", 0, "ok"),        # a reader dies mid-copy: the root does not wait on it
])
def test_broadcast_survives_or_names_a_killed_rank(victim, phase, root, outcome):
    out = spawn(broadcast_with_a_kill, 3, (victim, phase, root), max_failures=1, timeout=60)
    assert_no_leaks()
    assert out[victim] is None
    survivors = [out[r] for r in range(3) if r != victim]
    assert all(s[0] == outcome for s in survivors), survivors
    if outcome == "raised":
        assert all(f"the broadcast's root, rank {root} (pid " in s[1] and "died before "
                   "publishing" in s[1] for s in survivors), survivors
    else:
        want = [t.view(torch.int32).reshape(-1)[::997].tolist() for t in _root_tensors(root)]
        assert all(s[1] == want for s in survivors)
