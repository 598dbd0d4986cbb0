"""Random programs of torch.distributed calls on the "flodl_shm" backend, each call run
on a gloo group of the same ranks too, as the reference.

``c10d_driver.sc_fuzz`` draws the calls from a seed (every rank the same): reduces of
every op, broadcasts, the all-gathers, reduce-scatters, all-to-all, gather, scatter,
barriers; eight dtypes; flat, 2-D, transposed and strided tensors (which the backend's
hot cases must leave to its general path); sizes past the eager slot and direct rounds;
a third of the calls asynchronous, their works waited for up to four calls later (later
calls issued meanwhile, as DDP's buckets are). Results must equal gloo's (exact for
integers, MIN, MAX and the data movers; within the dtype's rounding for float sums,
which may add in another order), and the ranks must hold the same bits where the call
gives every rank the same result.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from c10d_driver import fuzz_program, run_group  # noqa: E402

from flodl_shm.engine.segment import list_segments  # noqa: E402

#: the calls whose result is the same on every rank
SAME_ON_EVERY_RANK = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                      "barrier")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed, hosts", [(1, None), (2, ["a", "b", "a"])],
                         ids=["one-host", "two-hosts"])
def test_a_random_program_matches_gloo_on_every_rank(tmp_path, seed, hosts):
    steps = 120
    res = run_group("fuzz", 3, tmp_path, hosts=hosts, timeout=180,
                    extra_env={"C10D_FUZZ_SEED": str(seed), "C10D_FUZZ_STEPS": str(steps)})
    assert all(r is not None for r in res), [r and r["log"] for r in res]
    for r, out in enumerate(res):
        assert out["mismatches"] == [], f"rank {r}:\n" + "\n".join(out["mismatches"][:10])
    for k, st in enumerate(fuzz_program(seed, 3, steps)):
        if st["op"] in SAME_ON_EVERY_RANK:
            assert len({out["digests"][k] for out in res}) == 1, \
                f"step {k} {st['op']}: the ranks hold different bits"
    pids = {p for out in res for p in out["all_pids"]}
    assert [s.name for s in list_segments() if s.owner_pid in pids] == []
