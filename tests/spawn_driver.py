"""A launcher process for tests that signal or kill the launcher itself.

    DRIVER_READY_FILE=/tmp/x python tests/spawn_driver.py <nprocs>

Runs ``spawn`` on the main thread (so its signal handlers are installed) with
``nprocs`` ranks that loop on barriers forever. Each rank appends its pid to
``$DRIVER_READY_FILE`` once it is inside the loop.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def spin_forever(ctx):
    ctx.comm.barrier()
    with open(os.environ["DRIVER_READY_FILE"], "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        ctx.comm.barrier()
        time.sleep(0.001)


def main() -> int:
    import flodl_shm

    flodl_shm.spawn(spin_forever, int(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
