"""The dead-rank ledger (``flodl_shm.DeadRanks``): idempotent, permanent, range-checked."""
from __future__ import annotations

import numpy as np
import pytest

from flodl_shm import DeadRanks


def test_declaring_a_rank_dead_is_idempotent_and_permanent():
    d = DeadRanks(4)
    assert d.alive() == [0, 1, 2, 3] and d.dead() == []
    assert d.declare_dead(2) is True
    assert d.declare_dead(np.int64(2)) is False  # already dead
    assert d.is_dead(2) and not d.is_dead(1) and not d.is_dead(7)
    assert d.alive() == [0, 1, 3] and d.dead() == [2] and d.dead_count() == 1


@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_out_of_range_is_refused(rank):
    with pytest.raises(ValueError, match=rf"rank {rank} is out of range for world_size 4"):
        DeadRanks(4).declare_dead(rank)


@pytest.mark.parametrize("call", ["world_size", "declare_dead", "is_dead"])
@pytest.mark.parametrize("bad", [2.9, "1", True])
def test_what_is_not_an_int_is_refused_not_truncated(call, bad):
    """``declare_dead(2.9)`` marked rank 2 and ``DeadRanks(2.5)`` made a world of 2."""
    what = "world_size" if call == "world_size" else "rank"
    with pytest.raises(TypeError, match=rf"DeadRanks: {what} must be an int, got {bad!r}"):
        DeadRanks(bad) if call == "world_size" else getattr(DeadRanks(4), call)(bad)
    with pytest.raises(ValueError, match="world_size must be > 0, got 0"):
        DeadRanks(0)
