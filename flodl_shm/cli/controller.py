"""``python -m flodl_shm controller``: serve a multi-host cohort from the command line.

The controller itself is :class:`flodl_shm.cluster.controller.ClusterController`;
this module parses options, reads the session secret and prints one line per
event a person needs (listening, finished, or why it could not start).
"""
from __future__ import annotations

import argparse
import errno
import logging
import signal
import sys
from pathlib import Path

from ..checkpoint._atomic import atomic_write_bytes
from ..cluster.control import MAX_WORLD_SIZE
from ..cluster.controller import DEFAULT_ROUND_TIMEOUT, ClusterController
from ..cluster.secret import read_secret_file, write_secret_file
from ..errors import plural
from . import first_stop_signal_only, invoked_as, stopped_by


def _read_momentum(path: str) -> list:
    """The tensors of an ``.outer.fdl`` (keys p0, p1, ... in parameter order)."""
    from ..checkpoint.fdl import read_fdl

    entries = read_fdl(path).by_name()
    out = []
    while f"p{len(out)}" in entries:
        out.append(entries[f"p{len(out)}"].to_tensor())
    if not out:
        raise ValueError(f"{path} holds no p0, p1, ... entries: not an outer momentum file")
    return out


def _read_outer_state(path: str) -> tuple[list, int]:
    """``--outer-state``: the momentum of an ``.outer.fdl`` and the sync round of the
    checkpoint it was saved with (its bundle's ``.meta.json``, beside it). Hosts that
    resume from another round are refused at their start."""
    from ..checkpoint.meta import CheckpointBundle, CheckpointMeta

    p = Path(path)
    for suffix, model_suffix in ((".outer.fdl", ".fdl"), (".outer.fdl.gz", ".fdl.gz")):
        if p.name.endswith(suffix) and len(p.name) > len(suffix):
            model = p.with_name(p.name[:-len(suffix)] + model_suffix)
            break
    else:
        raise ValueError(f"--outer-state {path} is not a <stem>.outer.fdl: pass the outer "
                         f"momentum file a controller wrote with a checkpoint")
    meta = CheckpointBundle.meta_path(model)
    if not meta.exists():
        raise ValueError(f"--outer-state {path}: {meta.name} is not beside it, so the "
                         f"checkpoint it belongs to was not completed (or the file was "
                         f"copied alone); pass the .outer.fdl of a complete bundle, with its "
                         f".meta.json")
    return _read_momentum(path), CheckpointMeta.read_from_file(meta).sync_round


def _start(args) -> ClusterController:
    """Read the secret (and the momentum to resume), bind, serve."""
    salt = read_secret_file(args.secret_file)
    outer = momentum = sync_round = None
    if args.outer == "nesterov":
        from ..training.outer import OuterNesterov

        outer = OuterNesterov(args.outer_lr, args.outer_momentum)
    if args.outer_state:
        momentum, sync_round = _read_outer_state(args.outer_state)
    return ClusterController.start(args.bind, args.world_size, salt,
                                   round_timeout=args.round_timeout, outer=outer,
                                   outer_momentum=momentum, outer_round=sync_round)


def main(argv: list[str] | None = None) -> int:
    prog = f"{invoked_as()} controller"
    ap = argparse.ArgumentParser(
        prog=prog, description="Serve a multi-host flodl_shm cohort.",
        usage=f"{prog} --bind HOST:PORT --world-size N --secret-file FILE [options]\n"
              f"       {prog} --new-secret FILE")
    ap.add_argument("--bind", metavar="HOST:PORT",
                    help="required: HOST:PORT to listen on (port 0: any)")
    ap.add_argument("--world-size", type=int, metavar="N",
                    help="required: ranks in the whole cohort")
    ap.add_argument("--secret-file", metavar="FILE",
                    help="required: file holding the 32-hex-digit session secret (make one "
                         "with `python -m flodl_shm controller --new-secret FILE`)")
    ap.add_argument("--new-secret", metavar="FILE",
                    help="write a fresh random session secret to FILE (mode 0600) and exit")
    ap.add_argument("--round-timeout", type=float, default=DEFAULT_ROUND_TIMEOUT,
                    help="seconds a round may wait for live hosts before it is a stall "
                         f"(default {DEFAULT_ROUND_TIMEOUT:g})")
    ap.add_argument("--port-file", help="write the bound port here once listening")
    ap.add_argument("--outer", choices=("avg", "none", "nesterov"), default="avg",
                    help="the outer optimizer the ranks use: avg (or none: the plain "
                         "average, default) or nesterov (DiLoCo); it runs here")
    ap.add_argument("--outer-lr", type=float,
                    help="learning rate of --outer nesterov (default 0.7, the demo's)")
    ap.add_argument("--outer-momentum", type=float,
                    help="momentum of --outer nesterov (default 0.9, the demo's)")
    ap.add_argument("--outer-state", metavar="OUTER_FDL",
                    help="resume: the <stem>.outer.fdl momentum of the checkpoint the hosts "
                         "continue (its .meta.json beside it; hosts resuming another round "
                         "are refused)")
    args = ap.parse_args(argv)
    if args.new_secret:
        replaced = Path(args.new_secret).exists()
        try:
            write_secret_file(args.new_secret)
        except OSError as e:
            print(f"controller: cannot write the secret file {args.new_secret}: {e}",
                  file=sys.stderr)
            return 2
        print(f"wrote a new session secret to {args.new_secret}; copy it to every host"
              + (" (it replaced the earlier secret: hosts holding that one are refused)"
                 if replaced else ""))
        return 0
    missing = [f for f in ("bind", "world_size", "secret_file") if getattr(args, f) is None]
    if missing:
        ap.error("the following arguments are required: "
                 + ", ".join("--" + m.replace("_", "-") for m in missing))
    for given, flag in ((args.outer_state, "--outer-state"), (args.outer_lr, "--outer-lr"),
                        (args.outer_momentum, "--outer-momentum")):
        if given is not None and args.outer != "nesterov":
            ap.error(f"{flag} needs --outer nesterov")  # (it would be ignored)
    args.outer_lr = 0.7 if args.outer_lr is None else args.outer_lr
    args.outer_momentum = 0.9 if args.outer_momentum is None else args.outer_momentum
    if not 0 <= args.outer_lr < float("inf"):  # (NaN too)
        ap.error(f"--outer-lr must be a number >= 0, got {args.outer_lr:g}")
    if not 0 <= args.outer_momentum < 1:
        ap.error(f"--outer-momentum must be in [0, 1), got {args.outer_momentum:g}")
    if args.port_file is not None:
        port_file = Path(args.port_file)
        if args.port_file == "" or port_file.is_dir() or not port_file.parent.is_dir():
            ap.error(f"--port-file {args.port_file!r}: "
                     + ("is a folder" if args.port_file and port_file.is_dir() else
                        "no file name" if not args.port_file else
                        f"its folder {port_file.parent} does not exist")
                     + "; pass a file path in an existing folder")
    if args.outer_state and not Path(args.outer_state).is_file():
        ap.error(f"--outer-state {args.outer_state}"
                 + (" is a folder, not a file" if Path(args.outer_state).is_dir()
                    else ": no such file")
                 + "; pass the <stem>.outer.fdl written beside the checkpoint the hosts resume")
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        ap.error(f"--world-size must be from 1 to {MAX_WORLD_SIZE:,} (every rank of every "
                 f"host; the most a cohort holds), got {args.world_size}")
    if not args.round_timeout > 0:
        ap.error(f"--round-timeout must be > 0 seconds, got {args.round_timeout:g}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        ctl = _start(args)
    except (ValueError, OSError) as e:  # bad secret file, address in use, bad momentum file
        fix = ""
        if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
            fix = (f"; another process holds {args.bind} (a controller already running?): "
                   f"stop it, or pick another port with --bind HOST:PORT and give the hosts "
                   f"that address")
        print(f"controller: cannot start: {e}{fix}", file=sys.stderr)
        return 2
    resumes = ("" if ctl.outer_round is None
               else f"; outer momentum of sync round {ctl.outer_round}")
    interrupts, replaced = first_stop_signal_only()
    try:
        print(f"controller listening on port {ctl.port} for {plural(args.world_size, 'rank')}"
              f"{resumes}",
              flush=True)
        if args.port_file:  # whole or absent: a script polling for it never reads half a port
            atomic_write_bytes(args.port_file, f"{ctl.port}\n".encode())
        ctl.join()
    except KeyboardInterrupt:
        pass
    finally:
        # (a checkpoint being written is finished first; stopped by a signal, the hosts
        # are told why before their links close)
        how = stopped_by(interrupts) if interrupts else None
        try:
            ctl.shutdown(stopped=how)
        except KeyboardInterrupt:  # the first Ctrl-C came as it stopped: stop, uninterrupted
            ctl.shutdown(stopped=how)
    if not interrupts:
        for s, old in replaced.items():
            signal.signal(s, old)
    else:  # the signals stay ignored to the end: a late Ctrl-C is no traceback
        print(f"controller: {ctl.stopped_line(how, 'its hosts were told and stop; ')}",
              file=sys.stderr, flush=True)
        return 128 + int(interrupts[0])
    if ctl.error is not None:
        print(f"controller: the cohort ended with an error: {ctl.error}", file=sys.stderr)
        return 1
    dead = ctl.dead_ranks.dead()
    why = _why_hosts_stopped(ctl.stopped_hosts)
    if len(dead) >= args.world_size:
        print(f"controller: the cohort ended after {ctl.stats.rounds} rounds with no rank "
              + (f"left; {why}" if why else "left: every rank died or its host was lost "
                 "(see the hosts' output)"), file=sys.stderr)
        return 1
    if ctl.stopped_early:  # the hosts said done, but their ranks stopped before the end
        path, reason = ctl.last_armed
        wrote = ctl.forge is not None and str(ctl.forge.last_written) == str(path)
        print(f"controller: the cohort stopped early after {ctl.stats.rounds} rounds"
              f"{_without(dead, why)}. The ranks left saved {path} ({reason}) "
              f"and stopped, each on its host. Fix the cause, then restart the controller "
              f"and every host with --resume; a host that stopped before that round first "
              f"needs its .fdl and .meta.json in its run folder"
              + (" (this controller wrote a copy at that path)" if wrote else ""),
              file=sys.stderr)
        return 1
    print(f"controller: cohort finished after {ctl.stats.rounds} rounds{_without(dead, why)}",
          flush=True)
    return 0


def _without(dead: list[int], why: str) -> str:
    """The ending line's clause on the ranks lost on the way, ``dead``, and what the
    hosts that stopped said (``why``, from ``_why_hosts_stopped``): ", without ranks
    [2, 3]; host 'b' stopped: REASON", or a guess at how they left where no host said."""
    if not dead:
        return f"; {why}" if why else ""
    return f", without ranks {dead}" + (f"; {why}" if why else
                                        " (they died, or their host was lost)")


def _why_hosts_stopped(stopped: dict[str, tuple[int, str]]) -> str:
    """What the hosts that stopped on a failure said (``ClusterController.stopped_hosts``),
    one line per distinct reason ("" for none): every host of a cohort refuses a start
    the same way, which is one line, not one per host."""
    by_reason: dict[str, list[str]] = {}
    for host, (rank, reason) in stopped.items():
        by_reason.setdefault(reason, []).append(f"{host!r}" + (f" (rank {rank})" if rank >= 0
                                                                else ""))
    lines = [f"{'host' if len(hosts) == 1 else 'hosts'} {', '.join(hosts)} stopped: "
             f"{reason}" for reason, hosts in by_reason.items()]
    return "\n  ".join(lines)
