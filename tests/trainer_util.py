"""Shared setup of the Trainer tests (imported, not a conftest): a small model and
dataset, hooks that record every realized sample or kill a process at a precise
batch, and a driver that runs a Trainer in a subprocess (so a test can lose the
whole launcher).

Everything here is module level: it is pickled to the rank processes.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from flodl_shm.training.coverage import epoch_permutation
from flodl_shm.training.hooks import Hook

from engine_util import assert_no_leaks

N_SAMPLES = 256
FEATURES = 6


@pytest.fixture(autouse=True)
def no_leaks():
    """After each test: no shared-memory segment of ours and no rank process left."""
    yield
    assert_no_leaks()


def make_model() -> torch.nn.Module:
    """Params plus BatchNorm (float buffers averaged, num_batches_tracked kept local)."""
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 12), torch.nn.BatchNorm1d(12),
                               torch.nn.ReLU(), torch.nn.Linear(12, 3))


def make_data(n: int = N_SAMPLES):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, FEATURES, generator=g)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())
    return x, y


sgd = functools.partial(torch.optim.SGD, lr=0.05)
sgd_momentum = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)  # has state
step_lr = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=5, gamma=0.7)
loss_fn = torch.nn.functional.cross_entropy


class RecordSamples(Hook):
    """Appends ``window epoch id,id,...`` to ``<folder>/rank<r>.txt`` after each window:
    exactly the samples realized in that window's consensus (a rank that dies
    mid-window never reaches its window end)."""

    def __init__(self, folder) -> None:
        self.folder = os.fspath(folder)

    def on_window_end(self, state, stats) -> None:
        if stats.sample_ids is None or not len(stats.sample_ids):
            return
        with open(os.path.join(self.folder, f"rank{state.rank}.txt"), "a") as f:
            ids = ",".join(str(int(i)) for i in stats.sample_ids)
            f.write(f"{stats.window} {stats.epoch} {ids}\n")
            f.flush()


class RecordLR(Hook):
    """Appends ``window lr`` (the inner optimizer's first learning rate) to
    ``<folder>/lr<r>.txt`` after each window."""

    def __init__(self, folder) -> None:
        self.folder = os.fspath(folder)

    def on_window_end(self, state, stats) -> None:
        with open(os.path.join(self.folder, f"lr{state.rank}.txt"), "a") as f:
            f.write(f"{stats.window} {state.optimizer.param_groups[0]['lr']!r}\n")


class KillAt(Hook):
    """SIGKILL this rank (``target="self"``) or the launcher (``"launcher"``) when
    ``rank`` reaches batch ``batch`` of window ``window``; with ``wait_for``, first
    wait (up to 30 s) until that file exists. ``signum``: another signal (e.g. SIGINT,
    an operator's Ctrl-C at the launcher), after which the rank goes on."""

    def __init__(self, rank: int, window: int, batch: int = 0, target: str = "self",
                 wait_for=None, signum: int = signal.SIGKILL) -> None:
        self.rank, self.window, self.batch = rank, window, batch
        self.target = target
        self.signum = signum
        self.wait_for = None if wait_for is None else os.fspath(wait_for)
        # built in the launcher: its pid (a rank's parent is the rank server by default)
        self.launcher_pid = os.getpid()

    def on_batch_end(self, state, info) -> None:
        if state.rank != self.rank or info.window != self.window or info.batch != self.batch:
            return
        if self.wait_for is not None:
            deadline = time.monotonic() + 30
            while not os.path.exists(self.wait_for) and time.monotonic() < deadline:
                time.sleep(0.01)
        pid = self.launcher_pid if self.target == "launcher" else os.getpid()
        os.kill(pid, self.signum)
        if self.signum == signal.SIGKILL:
            time.sleep(30)  # the launcher's death takes this rank down (PDEATHSIG)


class DieAtWindowEnd(Hook):
    """``rank`` raises at the end of window ``window`` (after its sync and its part of
    that window's checkpoint)."""

    def __init__(self, rank: int, window: int) -> None:
        self.rank, self.window = rank, window

    def on_window_end(self, state, stats) -> None:
        if state.rank == self.rank and stats.window == self.window:
            raise OSError(28, "No space left on device (injected)")


class StopAt(Hook):
    """Request a cohort stop at the end of ``window`` (from rank ``rank``)."""

    def __init__(self, rank: int, window: int) -> None:
        self.rank, self.window = rank, window

    def on_batch_end(self, state, info) -> None:
        if state.rank == self.rank and info.window == self.window:
            state.request_stop()


def read_samples(folder) -> list[tuple[int, int, int, list[int]]]:
    """Every record of RecordSamples: (window, epoch, rank, ids)."""
    out = []
    for p in sorted(Path(folder).glob("rank*.txt")):
        rank = int(p.stem[4:])
        for line in p.read_text().splitlines():
            window, epoch, ids = line.split(" ")
            out.append((int(window), int(epoch), rank, [int(i) for i in ids.split(",")]))
    return out


def assert_each_epoch_once(records, epochs: int, batch_size: int, seed: int = 42,
                           n: int = N_SAMPLES) -> None:
    """Every epoch's realized samples are exactly its permutation's trained prefix,
    each once."""
    total = (n // batch_size) * batch_size
    for e in range(epochs):
        got = sorted(i for _, ep, _, ids in records if ep == e for i in ids)
        want = sorted(epoch_permutation(seed, e, n)[:total].tolist())
        assert got == want, (f"epoch {e}: {len(got)} realized samples, "
                             f"{len(set(got))} distinct, want each of {len(want)} once")


def float_state(state: dict) -> dict:
    """Params and float buffers (integer counters are per rank and not checkpointed)."""
    return {k: v for k, v in state.items() if v.is_floating_point()}


def make_trainer(optimizer_fn=sgd, **kw):
    from flodl_shm.training.trainer import Trainer

    args = dict(batch_size=8, epochs=2, sync_every=2, log_every=None, timeout=120.0)
    args.update(kw)
    return Trainer(make_model, optimizer_fn, make_data(), loss_fn, **args)


def drive(spec_json: str) -> None:
    """Driver entry (a subprocess): run ``make_trainer(**spec)`` with hooks built from
    the spec (``"momentum": true``: SGD with momentum, an optimizer with state;
    ``"scheduler": true``: a StepLR stepped per batch) and write
    the result's state (integer buffers included) to ``spec["out"]``."""
    spec = json.loads(spec_json)
    hooks = [RecordSamples(spec["records"])]
    if spec.get("kill"):
        hooks.append(KillAt(**spec["kill"]))
    trainer = make_trainer(sgd_momentum if spec.get("momentum") else sgd,
                           scheduler_fn=step_lr if spec.get("scheduler") else None,
                           save_path=spec["save_path"], checkpoint_every=spec["every"],
                           hooks=hooks)
    result = trainer.run(spec["nprocs"])
    torch.save(result.state_dict, spec["out"])


if __name__ == "__main__":
    drive(sys.argv[1])


class RecordModes(Hook):
    """Appends ``<model.training> <model[1].training>`` to ``<folder>/mode<r>.txt`` at
    every batch; with ``evaluate``, leaves the model in eval mode after every window (as
    a careless validation hook would)."""

    def __init__(self, folder, evaluate: bool) -> None:
        self.folder = os.fspath(folder)
        self.evaluate = evaluate

    def on_batch_end(self, state, info) -> None:
        with open(os.path.join(self.folder, f"mode{state.rank}.txt"), "a") as f:
            f.write(f"{state.model.training} {state.model[1].training}\n")

    def on_window_end(self, state, stats) -> None:
        if self.evaluate:
            state.model.eval()
