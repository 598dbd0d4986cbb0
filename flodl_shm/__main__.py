"""``python -m flodl_shm <command>`` (also the ``flodl-shm`` console script).

Each command lives in its own module exposing ``main(argv) -> int``.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys

from .cli import invoked_as

COMMANDS = {
    "demo": ("flodl_shm.cli.demo", "train the demo MLP on scikit-learn digits with N ranks"),
    "controller": ("flodl_shm.cli.controller", "run a cluster controller for multi-host cohorts"),
    "ram": ("flodl_shm.cli.ram", "is this host big enough? RAM, cgroup, /dev/shm, segments"),
    "fdl": ("flodl_shm.cli.fdl", "inspect and convert .fdl checkpoints"),
}


def _usage(prog: str) -> str:
    lines = [f"usage: {prog} <command> [options]", "", "commands:"]
    for name, (_, help_text) in COMMANDS.items():
        lines.append(f"  {name:<11} {help_text}")
    lines.append("")
    lines.append(f"Run `{prog} <command> --help` for a command's options, `{prog} --version` "
                 f"for the version.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns its exit status (2 for a usage error, as argparse)."""
    try:
        try:
            status = _dispatch(list(sys.argv[1:] if argv is None else argv))
            if argv is None:  # the program's command is done: a Ctrl-C or SIGTERM during
                # the interpreter's exit (a second or so after its last line) would turn it
                # into a signal death or print a traceback; it ends as it finished
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_IGN)
            return status
        finally:
            sys.stdout.flush()  # now, not at exit: a reader that left is handled below
    except KeyboardInterrupt:  # a Ctrl-C the command did not take itself (while it
        # imports torch, say, before it installs its handlers): a traceback says no more
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        print(f"\n{invoked_as()}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:  # `... | head`: the reader left before the output ended
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit does not fail
        return 1


def _dispatch(args: list[str]) -> int:
    prog = invoked_as()
    if args and args[0] in ("-h", "--help", "help"):
        print(_usage(prog))
        return 0
    if args and args[0] in ("-V", "--version", "version"):
        from . import __version__

        print(f"flodl_shm {__version__}")
        return 0
    if not args or args[0] not in COMMANDS:
        what = (f"unknown command {args[0]!r}" if args else "no command given")
        print(f"{_usage(prog)}\n\n{prog}: error: {what}; choose one of "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
