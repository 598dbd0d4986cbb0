"""``flodl-shm demo`` (also ``python -m flodl_shm demo``): local SGD on real data.

Trains a small MLP (64-128-10) on scikit-learn's handwritten digits (1,797 8×8
images shipped inside scikit-learn; 75 % train / 25 % test, stratified) with the
:class:`~flodl_shm.training.trainer.Trainer` on ``--nprocs`` ranks of this host: each rank
trains its own share of every epoch and the ranks average their weights every
window. It shows a progress bar, per-window throughput and all-reduce time, the
final test accuracy of the consensus model, a consensus checkpoint bundle under
``runs/``, a per-window metrics file and, when matplotlib is installed, a plot.

::

    python -m flodl_shm demo                          # 2 ranks, 30 epochs, ~5 s
    python -m flodl_shm demo --slow-rank 1:3          # rank 1 3x slower: ElChe cadence
    python -m flodl_shm demo --bf16-wire --outer nesterov --baseline
    python -m flodl_shm demo --epochs 40 --resume     # continue the last run

As 2 "hosts" of a cluster (each command carries 2 of 4 ranks)::

    python -m flodl_shm controller --new-secret secret.hex
    python -m flodl_shm controller --bind 127.0.0.1:29500 --world-size 4 \\
        --secret-file secret.hex
    python -m flodl_shm demo --controller 127.0.0.1:29500 --world-size 4 --first-rank 0 \\
        --secret-file secret.hex
    python -m flodl_shm demo --controller 127.0.0.1:29500 --world-size 4 --first-rank 2 \\
        --secret-file secret.hex

Everything the ranks run (data, model, optimizer, hook) is defined at module
level here, because the Trainer pickles it to the rank processes. The command's
options and their checks are ``demo_options.py``.
:func:`train_one_process` is the same model and optimizer trained in one process
with a plain torch loop (no flodl_shm), the reference the fidelity tests hold the
demo to.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from flodl_shm.checkpoint._atomic import atomic_write_bytes
from flodl_shm.cli.demo_options import (CONFIG_FILE, DEFAULTS, DemoConfig, command_name,
                                         parse_args)
from flodl_shm.errors import plural
from flodl_shm.training.hooks import Hook

__all__ = ["DemoConfig", "DemoResult", "accuracy", "digits_split", "main", "make_model",
           "parse_args", "plot_training", "run_demo", "train_one_process"]

# The demo's fixed recipe, as the README's demo section states it.
HIDDEN = 128
LR = 0.05
MOMENTUM = 0.9
TEST_SIZE = 0.25
SPLIT_SEED = 0          # train/test split, as in the reference
METRICS_FILE = "windows.jsonl"
PLOT_FILE = "training.png"


# --- data and model (module level: pickled to the ranks) -------------------------------


@functools.lru_cache(maxsize=1)
def digits_split():
    """``(x_train, y_train, x_test, y_test)``: scikit-learn's digits scaled to [0, 1],
    split 75/25, stratified, with a fixed seed (the same split in every process)."""
    import numpy as np
    import torch
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - exercised by hand
        raise ImportError("the demo needs scikit-learn (its digits dataset): "
                          "pip install -e \".[demo]\"") from e
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=TEST_SIZE, random_state=SPLIT_SEED,
                                          stratify=y)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(),
            torch.from_numpy(xte), torch.from_numpy(yte).long())


def make_model():
    """The demo MLP: 64 pixels -> 128 ReLU -> 10 classes."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, 10))


def make_optimizer(params, lr: float = LR, momentum: float = MOMENTUM):
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def cross_entropy(output, target):
    import torch

    return torch.nn.functional.cross_entropy(output, target)


def accuracy(model, x, y) -> float:
    """Percent of ``x`` that ``model`` classifies as ``y``."""
    import torch

    was_training = model.training
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(dim=1) == y).float().mean().item() * 100.0
    model.train(was_training)
    return acc


def train_one_process(epochs: int = DEFAULTS["epochs"], batch_size: int = DEFAULTS["batch_size"],
                      seed: int = DEFAULTS["seed"], threads: int = 1) -> tuple[float, float]:
    """The one-process reference: the demo's model (same init seed), optimizer and
    batch size, trained with a plain torch loop (no flodl_shm) for ``epochs`` passes
    of ``len(train) // batch_size`` full batches, in a seeded random order.

    Returns ``(test accuracy %, training seconds)``.
    """
    import torch

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xtr, ytr, xte, yte = digits_split()
        torch.manual_seed(seed)
        model = make_model()
        opt = make_optimizer(model.parameters())
        g = torch.Generator().manual_seed(seed)
        nb = len(xtr) // batch_size
        t0 = time.perf_counter()
        for _ in range(epochs):
            perm = torch.randperm(len(xtr), generator=g)
            for b in range(nb):
                idx = perm[b * batch_size:(b + 1) * batch_size]
                opt.zero_grad(set_to_none=True)
                cross_entropy(model(xtr[idx]), ytr[idx]).backward()
                opt.step()
        seconds = time.perf_counter() - t0
        return accuracy(model, xte, yte), seconds
    finally:
        torch.set_num_threads(old_threads)


# --- the per-window hook -----------------------------------------------------------------


class DemoHook(Hook):
    """On the reporting rank: a tqdm progress bar, the consensus model's test accuracy
    every ``eval_every`` windows, a line every ``log_every`` windows, and one JSON line
    per window appended to ``metrics_path`` (the plot's data)."""

    def __init__(self, test_set, metrics_path: Optional[str], epochs: int, total_batches: int,
                 initial_batches: int, progress: bool, log_every: int, eval_every: int) -> None:
        self.test_set = test_set
        self.epochs = epochs
        self.metrics_path = metrics_path
        self.total_batches = total_batches
        self.initial_batches = initial_batches
        self.progress = progress
        self.log_every = log_every
        self.eval_every = eval_every
        self._started = False
        self._bar = None
        self._file = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_started=False, _bar=None, _file=None)
        return state

    def _start(self) -> None:
        self._started = True
        if self.metrics_path:
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        if self.progress:
            import threading

            from tqdm import tqdm

            # a thread lock: tqdm's default multiprocessing lock would register a
            # semaphore that this rank's hard exit leaves to the resource tracker
            tqdm.set_lock(threading.RLock())
            self._bar = tqdm(total=self.total_batches, initial=self.initial_batches,
                             unit="batch", dynamic_ncols=True, leave=True, file=sys.stderr)

    def on_window_end(self, state, stats) -> None:
        if not state.is_reporting_rank:
            return
        if not self._started:
            self._start()
        last = not stats.next_batches
        acc = None
        if last or (self.eval_every and stats.window % self.eval_every == 0):
            acc = accuracy(state.model, *self.test_set)
        row = {
            "window": stats.window, "epoch": stats.epoch, "global_step": stats.global_step,
            "loss": None if stats.skipped else stats.cohort_loss,  # (diverged: NaN)
            "test_acc": None if acc is None else round(acc, 4),  # (a float32's digits)
            "samples_per_s": stats.samples_per_s,
            "allreduce_ms": stats.sync_ms, "gather_ms": stats.gather_ms,
            "compute_ms": stats.compute_ms, "window_ms": stats.window_ms,
            "batches": list(stats.cohort_batches), "live_ranks": list(stats.live_ranks),
            "checkpoint": stats.checkpoint,
        }
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()
        if self._bar is not None:
            self._bar.update(sum(stats.cohort_batches))
            post = {"epoch": f"{stats.epoch + 1}/{self.epochs}",
                    "loss": f"{stats.cohort_loss:.3f}",
                    "samples/s": f"{stats.samples_per_s:,.0f}",
                    "all-reduce": f"{stats.sync_ms:.2f}ms"}
            if acc is not None:
                post["test acc"] = f"{acc:.1f}%"
            self._bar.set_postfix(post, refresh=False)
        if self.log_every and (stats.window % self.log_every == 0 or last):
            self._write(_window_line(row, self.epochs))

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            _out(line)

    def on_train_end(self, state, summary) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def _window_line(row: dict, epochs: int) -> str:
    """One window's log line; a column left empty keeps its width, so the columns of a
    run that evaluates every few windows stay aligned."""
    loss = "-" if row["loss"] is None else f"{row['loss']:.4f}"
    acc = ("  test acc " + " " * 6 if row["test_acc"] is None
           else f"  test acc {row['test_acc']:5.1f}%")
    return (f"window {row['window']:4d} (epoch {row['epoch'] + 1:2d}/{epochs}): loss "
            f"{loss:>6}{acc}  {row['samples_per_s']:9,.0f} samples/s  all-reduce "
            f"{row['allreduce_ms']:6.2f} ms  batches {row['batches']}")


# --- the run's result ---------------------------------------------------------------------


@dataclass
class DemoResult:
    """What :func:`run_demo` returns.

    Attributes:
        accuracy: test accuracy (%) of the final consensus model.
        train: the ``TrainResult`` (history, meta, checkpoint...).
        rows: the per-window metrics of this run (``windows.jsonl``, with test accuracy).
        wall_s: seconds from the launch of the ranks to their last result.
        rank_batches: batches each rank trained in this run (from the gathered counts).
        baseline: ``(accuracy %, seconds)`` of the one-process reference, if asked.
        plot: the plot's path, or None.
    """

    config: DemoConfig
    accuracy: Optional[float]
    train: Any
    rows: list = field(default_factory=list)
    wall_s: float = 0.0
    rank_batches: list = field(default_factory=list)
    baseline: Optional[tuple[float, float]] = None
    plot: Optional[Path] = None


# --- the run -----------------------------------------------------------------------------


def _trainer(cfg: DemoConfig, hook, train_set):
    import flodl_shm
    from flodl_shm.training.hooks import SimulatedSlowdown

    hooks = [hook]
    if cfg.slow_rank is not None:
        rank, factor = cfg.slow_rank
        # every batch lasts at least 2 ms (about twice a demo batch's own time here),
        # so the ranks' compute jitter does not skew the factor
        hooks.insert(0, SimulatedSlowdown(rank=rank, factor=factor, batch_ms=2.0))
    outer = flodl_shm.OuterNesterov(lr=0.7, momentum=0.9) if cfg.outer == "nesterov" else None
    return flodl_shm.Trainer(
        model_fn=make_model, optimizer_fn=make_optimizer, dataset=train_set,
        loss_fn=cross_entropy, batch_size=cfg.batch_size, epochs=cfg.epochs,
        sync_every=cfg.sync_every, cadence=cfg.effective_cadence, outer=outer,
        bf16_wire=cfg.bf16_wire, checkpoint_every=cfg.checkpoint_every,
        save_path=cfg.save_path, seed=cfg.seed, hooks=hooks, log_every=None,
        timeout=cfg.timeout, keep_history=None)  # (the summary counts every window)


_CADENCE = {"fixed": "fixed cadence", "elche": "ElChe cadence"}


def _out(text: str = "") -> None:
    """Print a line of the demo's output (launcher or rank). Once stdout's reader has
    gone (``demo | head``), the rest goes to /dev/null and the run goes on: a closed
    pipe is no reason to stop training (it used to fail the ranks with BrokenPipeError)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _say(cfg: DemoConfig, text: str = "") -> None:
    if cfg.summary_host:
        _out(text)


def _header(cfg: DemoConfig, n_train: int, n_test: int, options: bool = True) -> None:
    hosts = "" if cfg.controller is None else (
        f" ({cfg.host_ranks} of {cfg.total_world}, "
        f"controller {cfg.controller})")
    cadence = _CADENCE[cfg.effective_cadence]
    slow = "" if cfg.slow_rank is None else (f", rank {cfg.slow_rank[0]} slowed "
                                             f"{cfg.slow_rank[1]:g}x")
    _out(f"flodl_shm demo: MLP 64-{HIDDEN}-10 on scikit-learn digits ({n_train} train / "
         f"{n_test} test), {plural(cfg.nprocs, 'rank')} on this host{hosts}")
    if cfg.summary_host and options:
        _out(f"  {plural(cfg.epochs, 'epoch')}, batch {cfg.batch_size}, sync every "
             f"{cfg.sync_every} "
             f"batches ({cadence}{slow}), SGD lr {LR} momentum {MOMENTUM}, "
             f"{'bf16' if cfg.bf16_wire else 'f32'} wire, outer "
             f"{'Nesterov (DiLoCo)' if cfg.outer == 'nesterov' else 'average'}")


def _read_rows(path: Path) -> list[dict]:
    """The metrics file's window rows. A line that is not a whole row (a run killed in
    the middle of writing it) is skipped with a note: the file is a log, and a resume
    rewrites it from the checkpoint's windows anyway."""
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("window"), int):
            _out(f"  (skipping line {n} of {path}: not a whole window row, e.g. from a run "
                 f"stopped while writing it)")
            continue
        rows.append(row)
    return rows


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the demo as configured (prints as the command does) and return its figures.

    The run holds its checkpoint series' run lock from before it writes anything in
    ``run_dir`` to its end: a second demo on the same ``--run-dir`` is refused."""
    from flodl_shm import SeriesInUse
    from flodl_shm.checkpoint.run_lock import RunLock, cluster_job

    job = member = None
    if cfg.controller is not None:  # the hosts may share one folder: the job's lock
        from flodl_shm import read_secret_file

        job = cluster_job(read_secret_file(cfg.secret_file), cfg.controller)
        member = cfg.first_rank  # (this host launched twice is refused)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(RunLock(cfg.save_path, job, member))
        except SeriesInUse as e:
            print(f"{command_name()}: error: --run-dir {cfg.run_dir} is in use by another run "
                  f"({e.holder}); two runs in one folder would overwrite each other's "
                  f"checkpoints. Wait for it to end, or pass another --run-dir",
                  file=sys.stderr)
            raise SystemExit(2) from None  # a usage error, as parse_args' refusals
        except OSError as e:  # a folder it cannot create or write (read-only, /proc)
            print(f"{command_name()}: error: --run-dir {cfg.run_dir}: {e.strerror or e}",
                  file=sys.stderr)
            raise SystemExit(2) from None
        return _run_demo(cfg)


def _resume_problems(cfg: DemoConfig, ckpt: Path) -> list[str]:
    """Why ``--resume`` cannot continue ``ckpt``, the last checkpoint of ``--run-dir``, with
    these options: known from its model and metadata, so said before the run writes or
    starts anything (the ranks would find it only at their start, and the options file
    the run writes first would make the next ``--resume`` fail the same way)."""
    from flodl_shm import CheckpointBundle, CheckpointMeta
    from flodl_shm.training.resume_rules import model_mismatch, resume_conflicts

    why = model_mismatch(ckpt, make_model)
    if why is not None:
        return [f"--resume: {cfg.run_dir} does not hold a demo run: its checkpoint {ckpt.name} "
                f"is of another model ({why}); pass the --run-dir of a demo run"]
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(ckpt))
    out = []
    flag = "--nprocs" if cfg.controller is None else "--world-size"
    for c in resume_conflicts(meta, seed=cfg.seed, batch_size=cfg.batch_size,
                              epochs=cfg.epochs, dataset_len=None, world=cfg.total_world,
                              elche=cfg.effective_cadence == "elche"):
        if c.setting == "world_size":
            out.append(f"--resume: the run in {cfg.run_dir} trained with the ElChe cadence on "
                       f"{c.saved} ranks {c.why}, got {flag} {c.given}; resume it with "
                       f"{flag} {c.saved} (or with --cadence fixed on {c.given})")
        else:  # the seed or the batch size (the demo's dataset is fixed)
            name = "--" + c.setting.replace("_", "-")
            out.append(f"{name} cannot change on --resume: the run in {cfg.run_dir} trained "
                       f"with {name} {c.saved} {c.why}, got {c.given}; pass {name} {c.saved}")
    return out


def _of_another_model(ckpt) -> bool:
    """Whether the consensus checkpoint ``ckpt`` is of another model than the demo's (a
    damaged one is not known to be: ``--resume`` names what is wrong with it)."""
    from flodl_shm import CheckpointError
    from flodl_shm.training.resume_rules import model_mismatch

    try:
        return model_mismatch(ckpt, make_model) is not None
    except (CheckpointError, OSError):
        return False


def _run_demo(cfg: DemoConfig) -> DemoResult:
    from flodl_shm import latest_checkpoint

    # usage errors (exit 2), before anything is printed, written or started
    last = latest_checkpoint(cfg.save_path)
    problems = []
    if last is not None and not cfg.resume and not cfg.overwrite:
        if _of_another_model(last):  # a Trainer's or LocalSGD's own run
            problems.append(f"{cfg.run_dir} holds the checkpoints of another model, not of "
                            f"a demo run (last: {last}); they are kept. Pass another "
                            f"--run-dir, or --overwrite to delete them")
        else:
            problems.append(f"{cfg.run_dir} holds the checkpoints of an earlier run (last: "
                            f"{last}); they are kept. Continue that run with --resume, start "
                            f"over with --overwrite (deletes them), or pass another --run-dir")
    ckpt = last if cfg.resume else None
    if cfg.resume and ckpt is None:
        problems.append(f"--resume: no complete checkpoint under {cfg.run_dir} (run the demo "
                        f"without --resume first)")
    if ckpt is not None:
        problems += _resume_problems(cfg, ckpt)
    if problems:
        print(f"{command_name()}: error: " + "; ".join(problems), file=sys.stderr)
        raise SystemExit(2)
    xtr, ytr, xte, yte = digits_split()
    if cfg.batch_size > len(xtr):  # a usage error (exit 2), known once the data is
        print(f"{command_name()}: error: --batch-size {cfg.batch_size} is more than the {len(xtr)} "
              f"training images; pass at most {len(xtr)}", file=sys.stderr)
        raise SystemExit(2)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / METRICS_FILE
    meta = None
    if ckpt is not None:
        from flodl_shm import CheckpointBundle, CheckpointMeta

        meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(ckpt))
    # a finished run trains nothing: this command's options describe no training
    _header(cfg, len(xtr), len(xte), options=meta is None or meta.epoch < cfg.epochs)

    initial = 0
    if meta is not None:
        initial = meta.global_step
        if meta.epoch >= cfg.epochs:
            _say(cfg, f"  {ckpt} finished {plural(meta.epoch, 'epoch')}: nothing left to "
                      f"train (pass a "
                      f"larger --epochs to continue)")
        else:
            _say(cfg, f"  resuming {ckpt}: window {meta.sync_round}, {meta.global_step} "
                      f"batches done; continuing in epoch {meta.epoch + 1}")
        done_rows = [r for r in _read_rows(metrics) if r["window"] <= meta.sync_round]
    else:
        if last is not None:  # with --overwrite (refused above otherwise)
            _say(cfg, f"  --overwrite: deleting the earlier run's checkpoints in {run_dir} "
                      f"(last: {last.name}) and starting over")
        done_rows = []
    if cfg.summary_host:
        # the metrics file holds exactly the windows of the checkpoint's history
        atomic_write_bytes(metrics, "".join(json.dumps(r) + "\n" for r in done_rows).encode())
    # every host keeps its own bundles and the options they were trained with: --resume
    # on any host continues from its own run folder. A resume of a finished run trains
    # nothing: its options stay those it was trained with (else a --seed given there
    # would be taken for the run's and refuse the next --resume)
    if meta is None or meta.epoch < cfg.epochs:
        atomic_write_bytes(run_dir / CONFIG_FILE,
                           (json.dumps(cfg.recipe(), indent=1) + "\n").encode())

    # the bar redraws one line with carriage returns: on a terminal only, not in a log file
    progress = cfg.progress and sys.stderr.isatty()
    if progress:
        try:
            import tqdm  # noqa: F401 - the bar is drawn in a rank; check here
        except ImportError:
            _say(cfg, "  (no progress bar: tqdm is not installed; pip install -e \".[demo]\")")
            progress = False
    per_epoch = len(xtr) // cfg.batch_size
    # digits is small: the ranks get the tensors themselves (no scikit-learn import there)
    hook = DemoHook((xte, yte), os.fspath(metrics) if cfg.summary_host else None, cfg.epochs,
                    total_batches=cfg.epochs * per_epoch, initial_batches=initial,
                    progress=progress, log_every=cfg.log_every, eval_every=cfg.eval_every)
    trainer = _trainer(cfg, hook, (xtr, ytr))
    cluster = {}
    if cfg.controller is not None:
        from flodl_shm import read_secret_file

        cluster = dict(controller=cfg.controller, world_size=cfg.world_size,
                       first_rank=cfg.first_rank, salt=read_secret_file(cfg.secret_file))
    from flodl_shm.kernels import cache_complete

    if not cache_complete():  # (every host compiles its own: each says so)
        import logging

        # in the demo's words, instead of the warm-up's warning
        logging.getLogger("flodl_shm.kernels.warming").setLevel(logging.ERROR)
        _out("  compiling flodl_shm's kernels for this machine, once: about 40 s on 2 cores "
             "(later runs load them in a second)")
    t0 = time.perf_counter()
    if cfg.resume:
        result = trainer.resume(nprocs=cfg.nprocs, **cluster)
    else:
        result = trainer.run(cfg.nprocs, overwrite=cfg.overwrite, **cluster)
    wall = time.perf_counter() - t0

    model = make_model()
    model.load_state_dict(result.state_dict)
    acc = accuracy(model, xte, yte)
    rank_batches = [0] * cfg.total_world
    for st in result.history:
        for r, n in enumerate(st.cohort_batches):
            rank_batches[r] += n
    out = DemoResult(cfg, acc, result, wall_s=wall, rank_batches=rank_batches)
    if not cfg.summary_host:
        _out(f"host with {cfg.host_ranks}: done in "
             f"{wall:.1f} s ({len(result.history)} windows); the summary prints on the host "
             f"with rank 0")
        return out
    out.rows = [r for r in _read_rows(metrics) if r["window"] > (meta.sync_round if meta
                                                                   else 0)]
    if cfg.baseline:
        out.baseline = train_one_process(cfg.epochs, cfg.batch_size, cfg.seed)
    if cfg.plot:
        out.plot = _maybe_plot(_read_rows(metrics), run_dir / PLOT_FILE, cfg)
    _summary(out)
    return out


def _maybe_plot(rows: list[dict], path: Path, cfg: DemoConfig) -> Optional[Path]:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _out("  (no plot: matplotlib is not installed; pip install -e \".[plot]\")")
        return None
    if not rows:
        return None
    slow = "" if cfg.slow_rank is None else (f", rank {cfg.slow_rank[0]} slowed "
                                             f"{cfg.slow_rank[1]:g}x")
    subtitle = (f"{plural(cfg.total_world, 'rank')}, {_CADENCE[cfg.effective_cadence]}{slow}, "
                f"{'bf16' if cfg.bf16_wire else 'f32'} wire"
                f"{', outer Nesterov' if cfg.outer == 'nesterov' else ''}")
    return plot_training(rows, path, per_rank=cfg.effective_cadence == "elche",
                         subtitle=subtitle)


def _summary(out: DemoResult) -> None:
    cfg, res = out.config, out.train
    hist = res.history
    _out(f"done in {out.wall_s:.1f} s: {len(hist)} windows, "
         f"{sum(out.rank_batches)} batches; test accuracy {out.accuracy:.2f}% (consensus "
         f"model, {len(digits_split()[2])} test images)")
    if hist:
        sps = statistics.median(s.samples_per_s for s in hist)
        red = [s.sync_ms for s in hist]
        share = sum(red) / max(sum(s.window_ms for s in hist), 1e-9)
        _out(f"  throughput {sps:,.0f} samples/s (median window); all-reduce "
             f"{statistics.median(red):.2f} ms median, {share:.1%} of the windows' time")
        trained = sum(out.rank_batches) * cfg.batch_size
        _out(f"  over the whole {out.wall_s:.1f} s: {trained / max(out.wall_s, 1e-9):,.0f} "
             f"samples/s (the ranks' start, test evaluations and checkpoints included)")
    if cfg.effective_cadence == "elche" and cfg.total_world > 1:
        _out(f"  batches per rank: {out.rank_batches} (ElChe cadence)")
    if out.baseline is not None:
        b_acc, b_s = out.baseline
        _out(f"  one process, same model/optimizer/samples: test accuracy {b_acc:.2f}% "
             f"(difference {out.accuracy - b_acc:+.2f} points)")
    if res.checkpoint is not None:
        _out(f"  checkpoint: {res.checkpoint}; to train on, --resume with a larger "
             f"--epochs")
    _out(f"  metrics:    {Path(cfg.run_dir) / METRICS_FILE}")
    if out.plot is not None:
        _out(f"  plot:       {out.plot}")


# --- the plot ----------------------------------------------------------------------------


def plot_training(rows: Sequence[dict], path: "str | os.PathLike[str]", *,
                  per_rank: bool = False, subtitle: str = "") -> Path:
    """Draw the per-window loss and test accuracy (and, with ``per_rank``, each rank's
    batches per window) of ``rows`` (``windows.jsonl``) into ``path`` (PNG). Needs
    matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = 3 if per_rank else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.6 * panels + 0.6), sharex=True)
    w = [r["window"] for r in rows]
    loss = [math.nan if r["loss"] is None else r["loss"] for r in rows]
    ax = axes[0]
    ax.plot(w, loss, color="tab:blue", lw=1.5)
    ax.set_yscale("log")
    ax.set_ylabel("training loss\n(cohort mean)")
    ax.grid(True, which="both", alpha=0.3)
    acc = [(r["window"], r["test_acc"]) for r in rows if r.get("test_acc") is not None]
    ax = axes[1]
    if acc:
        ax.plot([a for a, _ in acc], [b for _, b in acc], color="tab:green", lw=1.5,
                marker="." if len(acc) < 40 else None)
        ax.annotate(f"{acc[-1][1]:.1f}%", xy=acc[-1], xytext=(-30, -18),
                    textcoords="offset points", fontsize=9)
        lo = min(b for _, b in acc)
        ax.set_ylim(max(0.0, min(lo, 90.0) - 2), 100.5)
    ax.set_ylabel("test accuracy (%)\n(consensus)")
    ax.grid(True, alpha=0.3)
    epochs = [r["window"] for a, r in zip(rows, rows[1:]) if r["epoch"] != a["epoch"]]
    for e in epochs:
        for a in axes:
            a.axvline(e - 0.5, color="0.55", ls=":", lw=0.8, zorder=0)
    if per_rank:
        ax = axes[2]
        nranks = max(len(r["batches"]) for r in rows)
        for k in range(nranks):
            ax.plot(w, [r["batches"][k] if k < len(r["batches"]) else 0 for r in rows],
                    lw=1.4, label=f"rank {k}")
        ax.set_ylabel("batches per window")
        ax.legend(loc="upper left", fontsize=8, ncol=min(nranks, 4))
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("window (sync round); dotted grey lines: epoch boundaries")
    axes[-1].xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    title = "flodl_shm demo: MLP on scikit-learn digits"
    fig.suptitle(title + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --- command line ------------------------------------------------------------------------


def _reason(e: BaseException) -> str:
    """What a failed run prints: the exception, and for a rank that raised, the rank and
    its exception's own line (its message names the cause and the fix), not the
    remote traceback; for too many deaths, what died and was saved, without the API
    call that continues (the caller says ``--resume``)."""
    from flodl_shm.errors import RankFailed, RankStalled, TrainingAborted

    if isinstance(e, TrainingAborted):
        return f"TrainingAborted: {e.summary}"
    if isinstance(e, RankStalled):
        return f"RankStalled: {e.why}"
    if isinstance(e, RankFailed) and e.error:
        return f"rank {e.rank} raised {e.exc_type}: {e.error}"
    if isinstance(e, ConnectionError):
        return str(e)  # (it says what failed: this host's link to the cohort)
    return f"{type(e).__name__}: {e}"


def _continue_with(cfg: DemoConfig, last, error: Optional[BaseException] = None) -> str:
    """The closing advice of a run stopped with ``last``, its newest checkpoint (by
    ``error`` when it raised)."""
    if error is not None and cfg.resume and _names_bundle(error, last):
        return _unloadable(cfg, last)
    if _finished(last, cfg.epochs):  # (stopped during the final evaluation or the plot)
        return (f"Training had finished: its last checkpoint is {last}; --resume with a "
                f"larger --epochs trains on.")
    advice = f"Last checkpoint {last}: continue with --resume."
    if cfg.controller is None:
        return advice
    # each host resumes from its own newest bundle, and they must be of one round: a
    # host lost mid-run misses the rounds the others saved after it (its --resume was
    # refused, and this advice repeated)
    from flodl_shm.checkpoint.forge import outer_sidecar_path

    # (only the controller writes the outer momentum, beside its own copy of the bundle,
    # which it puts under the --run-dir path of the host with rank 0)
    outer = outer_sidecar_path(last)
    state = (f"{outer}" if cfg.summary_host else
             f"RUN_DIR/{outer.name}, RUN_DIR being the --run-dir of the host with rank 0")
    restart = ("" if cfg.outer != "nesterov" else
               f" Restart the controller first with --outer nesterov --outer-state {state} "
               f"(the outer momentum of that round, beside the controller's copy of the "
               f"checkpoint).")
    return (advice[:-1] + " on every host." + restart + " The hosts resume from one round: a "
            "host whose newest checkpoint is older than the others' (a host that was lost) "
            "first needs the newer round's .fdl and .meta.json, copied from another host's "
            "--run-dir or from the controller's copy (the controller writes it under the "
            "--run-dir path of the host with rank 0, taken from where the controller runs); "
            "its ranks then start their inner optimizers fresh. Or, when every host holds "
            "that older round's checkpoint whole, move the newer round's files out of the "
            "other hosts' --run-dir: every rank then resumes exactly, with its own optimizer "
            "state, and trains the newer round's windows again.")


def _elsewhere(cfg: DemoConfig, error: Optional[BaseException] = None) -> str:
    """The end of "No checkpoint was written": on a cluster, where one may be yet (when
    this host stopped on an interrupt or a rank's failure, the hosts that go on save one
    as they stop; not when its link or its start failed: an OSError, a ValueError such as
    StartRefused)."""
    if cfg.controller is None or isinstance(error, (OSError, ValueError)):
        return "."
    return (" on this host. The other hosts may save one as they stop (their output and the "
            "controller's log name it): to resume, copy its .fdl and .meta.json into this "
            "host's --run-dir, then --resume on every host.")


def _finished(model_path, epochs: int) -> bool:
    """Whether the checkpoint ``model_path`` ends the run's ``epochs`` (False when its
    metadata cannot be read: the advice then stays the general one)."""
    from flodl_shm import CheckpointBundle, CheckpointMeta
    from flodl_shm.errors import CheckpointError

    try:
        meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(model_path))
    except (CheckpointError, OSError):
        return False
    return meta.epoch >= epochs


def _names_bundle(error: BaseException, model_path) -> bool:
    """Whether ``error`` names a file of the bundle whose model file is ``model_path``
    (every load error names the file it could not read; a ``TrainingAborted`` names the
    bundle the survivors saved, which loads)."""
    from flodl_shm.errors import TrainingAborted

    if isinstance(error, TrainingAborted):
        return False
    return os.fspath(model_path)[: -len("fdl")] in str(error)


def _unloadable(cfg: DemoConfig, last) -> str:
    """The advice when ``--resume`` could not load the newest bundle, ``last``: resuming
    again would load it again."""
    from flodl_shm.checkpoint.series import committed_checkpoints

    stem = Path(os.fspath(last)[: -len(".fdl")])
    earlier = [path for _, path in committed_checkpoints(cfg.save_path)][:-1]
    then = (f"--resume then continues from the one before, {earlier[-1].name}"
            if earlier else "it is the only one: start over with --overwrite")
    return (f"The newest checkpoint, {last}, could not be loaded. Restore its files from a "
            f"copy, or move them ({stem.name}.*) out of {stem.parent}: {then}.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    import logging

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    import signal

    from flodl_shm import latest_checkpoint
    from flodl_shm.cli import first_stop_signal_only, stopped_by
    from flodl_shm.errors import (CohortAborted, RankFailed, ShmSpaceError,
                                  TrainingAborted)

    # Ctrl-C, SIGTERM (a scheduler), SIGHUP (a closed terminal): the ranks stop, then one
    # line names the last checkpoint; a second signal is ignored (no traceback at exit)
    received, replaced = first_stop_signal_only()
    stopped = False
    try:
        digits_split()  # the data first: without scikit-learn, one line before anything starts
        run_demo(cfg)
    except ImportError as e:
        print(f"{command_name()}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (also while scikit-learn loads, before any rank exists)
        stopped = True
        signum = received[0] if received else signal.SIGINT  # (spawn takes a Ctrl-C itself)
        for s in replaced:  # the signals stay ignored to the end
            signal.signal(s, signal.SIG_IGN)
        last = latest_checkpoint(cfg.save_path)
        print(f"\n{stopped_by(received)}; every rank was stopped. "
              + (_continue_with(cfg, last) if last is not None
                 else "No checkpoint was written yet" + _elsewhere(cfg)), file=sys.stderr)
        return 128 + int(signum)
    except (RankFailed, CohortAborted, TrainingAborted, ShmSpaceError, OSError,
            ValueError) as e:
        # a failed run (a stall, a dead rank, a refused handshake, no /dev/shm space, a
        # checkpoint that does not match): the reason, not the launcher's stack
        last = latest_checkpoint(cfg.save_path)
        print(f"\n{command_name()}: error: {_reason(e)}\n"
              + (_continue_with(cfg, last, e) if last is not None
                 else "No checkpoint was written" + _elsewhere(cfg, e)), file=sys.stderr)
        return 1
    finally:
        if not stopped:
            for s, old in replaced.items():
                signal.signal(s, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
