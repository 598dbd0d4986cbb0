#!/usr/bin/env python3
"""Is this host big enough? Thin launcher for ``python -m flodl_shm ram``.

    python tools/host_ram.py --params 190M --local-ranks 2 [--wire bf16] [--json] [--reap]

See ``flodl_shm/cli/ram.py`` and docs/host_ram.md. Exit status 0 when everything
fits, 1 when not, 2 for a usage error.
"""
import sys
from pathlib import Path

try:
    from flodl_shm.cli.ram import main
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flodl_shm.cli.ram import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog="tools/host_ram.py"))
