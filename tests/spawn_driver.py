"""A launcher process for tests that signal or kill the launcher itself.

    DRIVER_READY_FILE=/tmp/x python tests/spawn_driver.py <nprocs>

Runs ``spawn`` on the main thread (so its signal handlers are installed) with
``nprocs`` ranks that loop on barriers forever. Each rank appends its pid to
``$DRIVER_READY_FILE`` once it is inside the loop.

With ``DRIVER_SLOW_IMPORT_FILE`` set, each rank instead appends its pid to that file
while multiprocessing imports this script in it (as ``__mp_main__``), then stays in
that import for ``DRIVER_SLOW_IMPORT_S`` seconds: a rank still importing its
launcher's heavy modules. With ``DRIVER_SPAWNING_FILE`` set, that file is created
right before ``spawn`` is called. ``DRIVER_START_METHOD`` picks ``spawn``'s
``start_method`` (default: spawn's own default).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__mp_main__" and os.environ.get("DRIVER_SLOW_IMPORT_FILE"):
    with open(os.environ["DRIVER_SLOW_IMPORT_FILE"], "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(float(os.environ.get("DRIVER_SLOW_IMPORT_S", "600")))


def spin_forever(ctx):
    ctx.comm.barrier()
    with open(os.environ["DRIVER_READY_FILE"], "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        ctx.comm.barrier()
        time.sleep(0.001)


def main() -> int:
    import signal

    import flodl_shm

    # as in a terminal, whatever the test runner's shell left ignored (ranks inherit it)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("DRIVER_SPAWNING_FILE"):
        open(os.environ["DRIVER_SPAWNING_FILE"], "w").close()

    method = os.environ.get("DRIVER_START_METHOD")  # else spawn()'s default
    flodl_shm.spawn(spin_forever, int(sys.argv[1]),
                    **({"start_method": method} if method else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
