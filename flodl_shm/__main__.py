"""``python -m flodl_shm <command>`` (also the ``flodl-shm`` console script).

Each command lives in its own module exposing ``main(argv) -> int``.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("flodl_shm.cli.demo", "train the demo MLP on scikit-learn digits with N ranks"),
    "controller": ("flodl_shm.cli.controller", "run a cluster controller for multi-host cohorts"),
    "ram": ("flodl_shm.cli.ram", "is this host big enough? RAM, cgroup, /dev/shm, segments"),
    "fdl": ("flodl_shm.cli.fdl", "inspect and convert .fdl checkpoints"),
}


def _usage() -> str:
    lines = ["usage: python -m flodl_shm <command> [options]", "", "commands:"]
    for name, (_, help_text) in COMMANDS.items():
        lines.append(f"  {name:<11} {help_text}")
    lines.append("")
    lines.append("Run `python -m flodl_shm <command> --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
