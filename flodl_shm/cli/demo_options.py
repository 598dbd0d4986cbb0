"""The demo command's options: ``DemoConfig`` and the command line that sets it.

``parse_args`` reads a command line into a :class:`DemoConfig`; with ``--resume`` the
training options not given fall back to the resumed run's (its ``demo_config.json``,
checked to be of the kinds the options take), then to ``DEFAULTS``. Every option is
checked at once (``_check``), before anything starts: each problem names the option,
the value and the fix, and the command exits with argparse's usage error.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from flodl_shm.cli import invoked_as, shortened

CONFIG_FILE = "demo_config.json"  # a run's options, in its --run-dir (for --resume)
CKPT_STEM = "ckpt"


def command_name() -> str:
    """How the command names itself in usage and errors."""
    return f"{invoked_as()} demo"


#: the training options a run takes when neither the command line nor, with --resume,
#: the resumed run's demo_config.json gives them
DEFAULTS = {
    "nprocs": 2, "epochs": 30, "batch_size": 32, "sync_every": 8, "cadence": None,
    "bf16_wire": False, "outer": "none", "slow_rank": None, "seed": 42,
    "checkpoint_every": 20,
}


@dataclass
class DemoConfig:
    """One demo run (what the command-line options set)."""

    nprocs: int = DEFAULTS["nprocs"]
    epochs: int = DEFAULTS["epochs"]
    batch_size: int = DEFAULTS["batch_size"]
    sync_every: int = DEFAULTS["sync_every"]
    cadence: Optional[str] = None          # None: "elche" with a slow rank, else "fixed"
    bf16_wire: bool = False
    outer: str = "none"                    # "none" | "nesterov"
    slow_rank: Optional[tuple[int, float]] = None
    seed: int = DEFAULTS["seed"]
    checkpoint_every: Optional[int] = DEFAULTS["checkpoint_every"]
    run_dir: str = "runs/demo"
    resume: bool = False
    overwrite: bool = False                # delete an earlier run's checkpoints in run_dir
    progress: bool = True
    log_every: int = 10
    eval_every: int = 1
    plot: bool = True
    baseline: bool = False
    controller: Optional[str] = None
    world_size: Optional[int] = None
    first_rank: int = 0
    secret_file: Optional[str] = None
    timeout: float = 300.0

    @property
    def effective_cadence(self) -> str:
        if self.cadence is not None:
            return self.cadence
        return "elche" if self.slow_rank is not None else "fixed"

    @property
    def total_world(self) -> int:
        return self.world_size if self.world_size is not None else self.nprocs

    @property
    def save_path(self) -> str:
        return os.path.join(self.run_dir, CKPT_STEM)

    @property
    def host_ranks(self) -> str:
        """This host's ranks, as a reader says them: "ranks 2-3", "rank 1"."""
        last = self.first_rank + self.nprocs - 1
        return f"rank {last}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"

    @property
    def summary_host(self) -> bool:
        """Whether this launcher prints the summary (the host carrying rank 0)."""
        return self.first_rank == 0

    def recipe(self) -> dict:
        """The options a resumed run inherits from the run it continues."""
        return {"nprocs": self.nprocs, "epochs": self.epochs, "batch_size": self.batch_size,
                "sync_every": self.sync_every, "cadence": self.cadence,
                "bf16_wire": self.bf16_wire, "outer": self.outer,
                "slow_rank": None if self.slow_rank is None else list(self.slow_rank),
                "seed": self.seed, "checkpoint_every": self.checkpoint_every}


def _saved_fits(key: str, value) -> bool:
    """Whether ``value``, read from a run's ``demo_config.json`` for option ``key``, is
    of the kind the option takes (its range is checked with the others')."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if key == "slow_rank":
        return value is None or (
            isinstance(value, list) and len(value) == 2 and is_int(value[0])
            and value[0] >= 0 and (is_int(value[1]) or isinstance(value[1], float))
            and math.isfinite(value[1]) and value[1] >= 1.0)
    if key in ("cadence", "checkpoint_every") and value is None:
        return True
    default = DEFAULTS[key]
    if key == "cadence" or isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, bool):
        return isinstance(value, bool)
    return is_int(value)


def _slow_rank(text: str) -> tuple[int, float]:
    try:
        r, f = text.split(":")
        rank, factor = int(r), float(f)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--slow-rank takes RANK:FACTOR, e.g. 1:3 (rank 1 three times slower); got {text!r}")
    if rank < 0:
        raise argparse.ArgumentTypeError(f"--slow-rank {text}: the rank must be >= 0")
    if not 1.0 <= factor < math.inf:
        raise argparse.ArgumentTypeError(f"--slow-rank {text}: the factor must be a finite "
                                         f"number >= 1 (how many times slower the rank runs)")
    return rank, factor


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=command_name(),
        description="Train an MLP on scikit-learn's digits with local SGD on N ranks "
                    "(flodl_shm.Trainer): progress, per-window throughput and all-reduce "
                    "time, test accuracy of the consensus, checkpoints under --run-dir.")
    d = DEFAULTS
    g = ap.add_argument_group("training")
    g.add_argument("--nprocs", type=int, help=f"ranks on this host (default {d['nprocs']})")
    g.add_argument("--epochs", type=int, help=f"passes over the training set (default "
                                              f"{d['epochs']}; with --resume: the new total)")
    g.add_argument("--batch-size", type=int, help=f"samples per batch (default {d['batch_size']})")
    g.add_argument("--sync-every", type=int,
                   help=f"batches per rank between averagings (default {d['sync_every']}; "
                        f"ElChe: the slowest rank's initial count)")
    g.add_argument("--cadence", choices=("fixed", "elche"),
                   help="fixed: every rank trains --sync-every batches per window; elche: "
                        "faster ranks train proportionally more (default: elche with "
                        "--slow-rank, else fixed)")
    g.add_argument("--bf16-wire", action="store_true", default=None,
                   help="average in bf16 on the wire (half the bytes, f32 sums)")
    g.add_argument("--outer", choices=("none", "nesterov"),
                   help="outer optimizer: none (plain average) or nesterov (DiLoCo, lr 0.7, "
                        "momentum 0.9)")
    g.add_argument("--slow-rank", type=_slow_rank, metavar="R:FACTOR",
                   help="make rank R FACTOR times slower per batch (shows ElChe)")
    g.add_argument("--seed", type=int, help=f"model init and data order (default {d['seed']})")
    g.add_argument("--checkpoint-every", type=int,
                   help=f"checkpoint every N windows; 0: only at the end (default "
                        f"{d['checkpoint_every']})")
    o = ap.add_argument_group("run")
    o.add_argument("--run-dir", default="runs/demo",
                   help="checkpoints, metrics and plot go here (default runs/demo)")
    o.add_argument("--resume", action="store_true",
                   help="continue the last checkpoint of --run-dir (its options, unless given)")
    o.add_argument("--overwrite", action="store_true",
                   help="start over in a --run-dir that holds an earlier run, deleting its "
                        "checkpoints (without it the demo refuses and keeps them)")
    o.add_argument("--baseline", action="store_true",
                   help="also train the same model in one process and compare")
    o.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is one only when stderr is a terminal)")
    o.add_argument("--log-every", type=int, default=10,
                   help="print a line every N windows; 0: none (default 10)")
    o.add_argument("--eval-every", type=int, default=1,
                   help="test accuracy every N windows; 0: only at the end (default 1)")
    o.add_argument("--no-plot", action="store_true", help="do not draw training.png")
    o.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for a live peer (default 300)")
    c = ap.add_argument_group("cluster (several hosts; see the README's walk-through)")
    c.add_argument("--controller", metavar="HOST:PORT",
                   help="join the cohort served by this controller")
    c.add_argument("--world-size", type=int, help="ranks in the whole cohort")
    c.add_argument("--first-rank", type=int, default=0,
                   help="global rank of this host's first rank (default 0)")
    c.add_argument("--secret-file", help="the session secret shared with the controller")
    return ap


def parse_args(argv: Sequence[str]) -> DemoConfig:
    """The :class:`DemoConfig` of a command line. With ``--resume``, training options not
    given fall back to the resumed run's (``demo_config.json``), then to the defaults."""
    ap = _build_parser()
    a = ap.parse_args(list(argv))
    given = {k: getattr(a, k) for k in DEFAULTS if getattr(a, k, None) is not None}
    if a.checkpoint_every == 0:
        given["checkpoint_every"] = None
    saved: dict = {}
    if a.resume:
        path = Path(a.run_dir) / CONFIG_FILE
        if path.exists():
            try:
                saved = json.loads(path.read_text())
            except (ValueError, OSError) as e:
                ap.error(f"--resume: {path} is unreadable ({e}); pass the run's options "
                         f"again (e.g. --epochs, --sync-every), or delete the file to take "
                         f"the defaults")
            if not isinstance(saved, dict):
                ap.error(f"--resume: {path} does not hold the run's options; delete it to "
                         f"take the defaults")
            wrong = [k for k, v in saved.items()
                     if k in DEFAULTS and k not in given and not _saved_fits(k, v)]
            if wrong:
                ap.error(f"--resume: {path} does not hold the run's options ({wrong[0]}: "
                         f"{saved[wrong[0]]!r}); pass the run's options again (e.g. --epochs, "
                         f"--sync-every), or delete the file to take the defaults")
    values = dict(DEFAULTS)
    values.update({k: v for k, v in saved.items() if k in DEFAULTS})
    values.update(given)
    if values.get("slow_rank") is not None:
        values["slow_rank"] = tuple(values["slow_rank"])
    cfg = DemoConfig(**values, run_dir=a.run_dir, resume=a.resume, overwrite=a.overwrite,
                     progress=not a.no_progress, log_every=a.log_every,
                     eval_every=a.eval_every, plot=not a.no_plot,
                     baseline=a.baseline, controller=a.controller, world_size=a.world_size,
                     first_rank=a.first_rank, secret_file=a.secret_file, timeout=a.timeout)
    problems = _check(cfg)
    if problems:
        ap.error("; ".join(problems))
    return cfg


def _check(cfg: DemoConfig) -> list[str]:
    out = []
    if cfg.resume and cfg.overwrite:
        out.append("--resume continues the run in --run-dir and --overwrite deletes it: pass one")
    for name in ("nprocs", "batch_size", "sync_every"):
        if getattr(cfg, name) < 1:
            out.append(f"--{name.replace('_', '-')} must be >= 1")
    from flodl_shm.engine.arena import MAX_LOCAL_RANKS

    if cfg.nprocs > MAX_LOCAL_RANKS:
        out.append(f"--nprocs {cfg.nprocs}: one host runs at most {MAX_LOCAL_RANKS} ranks")
    if not 0 <= cfg.seed < 1 << 63:
        out.append(f"--seed must be from 0 to 2**63 - 1, got {cfg.seed}")
    if not str(cfg.run_dir).strip():
        out.append("--run-dir must name a folder (it is empty)")
    if cfg.resume and cfg.epochs < 0:  # the new total: one already reached trains nothing
        out.append("--epochs must be >= 0")
    elif not cfg.resume and cfg.epochs < 1:
        out.append(f"--epochs must be >= 1, got {cfg.epochs}")
    for name, zero in (("log_every", "none"), ("eval_every", "only at the end")):
        if getattr(cfg, name) < 0:
            out.append(f"--{name.replace('_', '-')} must be >= 0 (0: {zero}), got "
                       f"{getattr(cfg, name)}")
    from flodl_shm.checkpoint.run_lock import file_in_the_way
    from flodl_shm.checkpoint.series import check_series_stem, names_a_home

    try:  # (the run lock would refuse it too, past the banner)
        bad_dir = file_in_the_way(cfg.run_dir)
    except OSError as e:  # a name too long for the filesystem, say
        out.append(f"--run-dir {shortened(cfg.run_dir)}: {e.strerror}; pass a shorter path")
    else:
        if bad_dir is not None:
            out.append(f"--run-dir {cfg.run_dir} is a file, not a folder"
                       if bad_dir == Path(cfg.run_dir)
                       else f"--run-dir {cfg.run_dir}: {bad_dir} is a file, not a folder")
            out[-1] += "; pass a folder (one that does not exist yet is created)"
        elif names_a_home(cfg.run_dir):  # (--run-dir=~/x: no shell expands it there)
            out.append(f"--run-dir {cfg.run_dir}: ~ was not expanded (a shell expands it at the "
                       f"start of a word only, not after --run-dir=): write --run-dir "
                       f"{cfg.run_dir}, or {os.path.expanduser(cfg.run_dir)}")
        else:

            try:  # (its checkpoints' names must fit the file system: refused before training)
                check_series_stem(cfg.save_path)
            except ValueError as e:
                out.append(f"--run-dir {shortened(cfg.run_dir)}: {e}")
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 1:
        out.append("--checkpoint-every must be >= 0 (0: only at the end)")
    if not cfg.timeout > 0:
        out.append(f"--timeout must be > 0 seconds, got {cfg.timeout:g}")
    if cfg.slow_rank is not None and cfg.slow_rank[0] >= cfg.total_world:
        out.append(f"--slow-rank {cfg.slow_rank[0]} is not a rank of a {cfg.total_world}-rank "
                   f"run")
    if cfg.controller is None:
        if cfg.world_size not in (None, cfg.nprocs) or cfg.first_rank != 0:
            out.append("--world-size / --first-rank need --controller (one host carries "
                       "every rank)")
    else:
        from flodl_shm.cluster.control import MAX_WORLD_SIZE

        if cfg.world_size is None or cfg.secret_file is None:
            out.append("--controller needs --world-size and --secret-file")
        elif cfg.world_size > MAX_WORLD_SIZE:
            out.append(f"--world-size {cfg.world_size}: a cohort holds at most "
                       f"{MAX_WORLD_SIZE:,} ranks")
        elif not 0 <= cfg.first_rank <= cfg.world_size - cfg.nprocs:
            out.append(f"--first-rank {cfg.first_rank} with --nprocs {cfg.nprocs} does not fit "
                       f"--world-size {cfg.world_size}")
        from flodl_shm.cluster.link import parse_addr
        from flodl_shm.cluster.secret import read_secret_file

        try:
            port = parse_addr(cfg.controller)[1]
        except ValueError as e:
            out.append(f"--controller: {e}; e.g. 127.0.0.1:29500")
        else:
            if port == 0:
                out.append(f"--controller {cfg.controller!r}: port 0 names no controller; "
                           f"give the port it listens on (the port of its --bind, or the one "
                           f"it wrote to its --port-file), e.g. 127.0.0.1:29500")
        if cfg.secret_file is not None:
            try:
                read_secret_file(cfg.secret_file)
            except ValueError as e:
                out.append(f"--secret-file: {e}")
    return out
