"""A one-rank "host" in its own launcher process, for tests that kill a whole host.

    DRIVER_READY_FILE=... CLUSTER_PORT=... CLUSTER_SALT=<hex> python tests/cluster_driver.py

Carries global rank 2 of a 3-rank cohort and loops all-reduces forever; writes the
ready file after a few rounds.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def loop_forever(ctx):
    import torch

    from flodl_shm import RoundKind

    i = 0
    while True:
        ctx.comm.all_reduce_scaled([torch.full((1000,), float(ctx.rank))], 1.0, RoundKind.MODEL,
                                   1.0)
        if i == 3:
            open(os.environ["DRIVER_READY_FILE"], "w").close()
        i += 1
        time.sleep(0.01)


def main() -> int:
    import flodl_shm

    port = int(os.environ["CLUSTER_PORT"])
    salt = bytes.fromhex(os.environ["CLUSTER_SALT"])
    flodl_shm.spawn(loop_forever, 1, controller=f"127.0.0.1:{port}", world_size=3, first_rank=2,
                    salt=salt, timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
