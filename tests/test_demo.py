"""The demo on real data (scikit-learn digits): fidelity against one process, the bf16 wire,
ElChe under a slowed rank, resume, outputs (checkpoint, metrics, plot) and the command line.

Accuracies are measured on the 450-image test split, so one image is 0.22 points. The
one-process reference differs by up to ~1.1 points from seed to seed by itself, so the
demo-vs-one-process check compares the mean over three seeds (same seeds on both sides);
each run must still reach 95 % on its own.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import statistics
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("sklearn", reason="the demo needs scikit-learn (the demo/test extras)")

from flodl_shm import Trainer, load_consensus_checkpoint  # noqa: E402
from flodl_shm.checkpoint.meta import CheckpointBundle, CheckpointMeta  # noqa: E402
from flodl_shm.checkpoint.series import committed_checkpoints  # noqa: E402
from flodl_shm.cli.demo import (DemoConfig, _maybe_plot, accuracy, digits_split,  # noqa: E402
                            make_model, parse_args, run_demo, train_one_process)

from engine_util import live_children, our_segments  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SEEDS = (42, 1, 2)


def quiet(run_dir, **kw) -> DemoConfig:
    kw.setdefault("plot", False)
    return DemoConfig(run_dir=str(run_dir), progress=False, log_every=0, **kw)


def assert_clean() -> None:
    assert our_segments() == [], "the run left shared-memory segments behind"
    deadline = time.monotonic() + 5
    while live_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_children() == [], "the run left rank processes behind"


@pytest.fixture(scope="module")
def fidelity(tmp_path_factory):
    """Every seed's demo on the f32 and the bf16 wire, and the one-process reference."""
    base = tmp_path_factory.mktemp("demo_fidelity")
    runs, single = {}, {}
    try:
        for seed in SEEDS:
            for wire in ("f32", "bf16"):
                default = seed == SEEDS[0] and wire == "f32"
                cfg = quiet(base / f"{wire}-{seed}", seed=seed, bf16_wire=wire == "bf16",
                            plot=default, eval_every=1 if default else 0)
                runs[wire, seed] = run_demo(cfg)
                assert_clean()
            single[seed] = train_one_process(seed=seed)[0]
        yield runs, single
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_demo_reaches_95_and_matches_one_process(fidelity):
    runs, single = fidelity
    table = {seed: (runs["f32", seed].accuracy, single[seed]) for seed in SEEDS}
    print("seed: (demo %, one process %)", table)
    for seed, (demo, _) in table.items():
        assert demo >= 95.0, f"seed {seed}: demo test accuracy {demo:.2f}% < 95%"
        run = runs["f32", seed]
        assert sum(run.rank_batches) == 30 * (1347 // 32), "the same number of samples"
    gap = statistics.mean(d for d, _ in table.values()) - statistics.mean(
        s for _, s in table.values())
    assert abs(gap) <= 1.0, f"demo vs one process: {gap:+.2f} points on average ({table})"


def test_bf16_wire_within_half_a_point_of_f32(fidelity):
    runs, _ = fidelity
    for seed in SEEDS:
        f32, bf16 = runs["f32", seed].accuracy, runs["bf16", seed].accuracy
        assert bf16 >= 95.0
        assert abs(bf16 - f32) <= 0.5, f"seed {seed}: bf16 {bf16:.2f}% vs f32 {f32:.2f}%"
    assert runs["bf16", SEEDS[0]].train.history[-1].bytes_sent < \
        runs["f32", SEEDS[0]].train.history[-1].bytes_sent, "bf16 frames are smaller"


def test_demo_writes_checkpoint_metrics_and_plot(fidelity):
    run = fidelity[0]["f32", SEEDS[0]]
    res = run.train
    # the consensus checkpoint bundle is the final model
    assert res.checkpoint is not None and res.checkpoint.exists()
    assert res.checkpoint.parent == __import__("pathlib").Path(run.config.run_dir)
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(res.checkpoint))
    assert (meta.epoch, meta.global_step) == (30, 30 * 42)
    model = make_model()
    report = load_consensus_checkpoint(model, res.checkpoint)
    assert not report.missing and not report.unexpected
    _, _, xte, yte = digits_split()
    assert accuracy(model, xte, yte) == pytest.approx(run.accuracy, abs=1e-9)
    # one metrics row per window, with the consensus test accuracy and the sync figures
    rows = [json.loads(line) for line in
            (res.checkpoint.parent / "windows.jsonl").read_text().splitlines()]
    assert [r["window"] for r in rows] == [s.window for s in res.history]
    assert rows[-1]["test_acc"] == round(run.accuracy, 4)  # (a float32's noise: 36.2222224...)
    assert all(r["samples_per_s"] > 0 and r["allreduce_ms"] > 0 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    # the plot, when matplotlib is there
    pytest.importorskip("matplotlib")
    png = run.plot
    assert png is not None and png.name == "training.png" and png.parent == res.checkpoint.parent
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 300_000


def test_plot_is_skipped_with_a_note_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rows = [{"window": 1, "epoch": 0, "loss": 1.0, "test_acc": 50.0, "batches": [8, 8]}]
    assert _maybe_plot(rows, tmp_path / "training.png", DemoConfig()) is None
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "training.png").exists()


def test_slow_rank_under_elche_does_proportional_work(tmp_path):
    factor = 3.0
    cfg = quiet(tmp_path / "slow", slow_rank=(1, factor), plot=True)
    assert cfg.effective_cadence == "elche"
    run = run_demo(cfg)
    assert_clean()
    fast, slow = run.rank_batches
    print(f"slow rank 1:{factor:g}: accuracy {run.accuracy:.2f}%, batches fast {fast} / slow "
          f"{slow} = {fast / slow:.2f}; per window "
          f"{[s.cohort_batches for s in run.train.history]}")
    assert run.accuracy >= 95.0
    assert fast + slow == 30 * 42
    # calibrated windows (after ElChe's first timing reports) and the whole run
    late = run.train.history[len(run.train.history) // 2:]
    late_fast = sum(s.cohort_batches[0] for s in late)
    late_slow = sum(s.cohort_batches[1] for s in late)
    for ratio in (fast / slow, late_fast / late_slow):
        assert factor / 1.5 <= ratio <= factor * 1.5, \
            f"fast/slow batches {ratio:.2f}, expected about {factor:g}"
    if run.plot is not None:
        assert run.plot.exists()


def test_resume_continues_the_run(tmp_path, capsys):
    run_dir = tmp_path / "res"
    first = run_demo(quiet(run_dir, epochs=2, checkpoint_every=3))
    assert_clean()
    assert first.train.meta.global_step == 2 * 42
    windows = len(first.train.history)
    # a run killed in the middle of a metrics line left it torn: the resume goes on
    with open(run_dir / "windows.jsonl", "a") as f:
        f.write('{"window": 99, "loss": 0.1')
    # --resume inherits the saved options; --epochs raises the total
    cfg = parse_args(["--run-dir", str(run_dir), "--resume", "--epochs", "4", "--no-progress",
                      "--log-every", "0", "--no-plot"])
    assert (cfg.checkpoint_every, cfg.seed, cfg.epochs) == (3, 42, 4)
    second = run_demo(cfg)
    assert_clean()
    out = capsys.readouterr().out
    assert "resuming" in out and f"skipping line {windows + 1} of" in out
    # the whole run's rate beside the median window's (a probe read the window's as the
    # run's, 18 times the samples over the wall time)
    whole = re.findall(r"over the whole ([0-9.]+) s: ([0-9,]+) samples/s \(the ranks' start, "
                       r"test evaluations and checkpoints included\)", out)
    assert len(whole) == 2, out  # the first run's, then this one's
    assert int(whole[1][1].replace(",", "")) == pytest.approx(
        2 * 42 * 32 / second.wall_s, rel=0.01, abs=1)
    hist = second.train.history
    assert hist[0].window == windows + 1 and hist[0].epoch == 2
    assert second.train.meta.global_step == 4 * 42 and sum(second.rank_batches) == 2 * 42
    rows = [json.loads(line) for line in (run_dir / "windows.jsonl").read_text().splitlines()]
    assert [r["window"] for r in rows] == list(range(1, hist[-1].window + 1))
    assert second.accuracy >= first.accuracy - 1.0
    assert committed_checkpoints(run_dir / "ckpt")[-1][1] == second.train.checkpoint
    # a resume of the finished run trains nothing: its header states no options (it said
    # "4 epochs, batch 64, ..." for a run trained at batch 32, which --batch-size 64 did
    # not change)
    third = run_demo(parse_args(["--run-dir", str(run_dir), "--resume", "--batch-size", "64",
                                 "--no-progress", "--log-every", "0", "--no-plot"]))
    out = capsys.readouterr().out
    assert "nothing left to train" in out and "batch 64" not in out, out
    assert third.train.meta.global_step == 4 * 42


@pytest.mark.parametrize("damage", ["emptied", "a field edited"])
def test_a_newest_bundle_that_cannot_be_loaded_is_named_with_the_way_past_it(tmp_path, capsys,
                                                                            damage):
    """A probe emptied the newest bundle's .meta.json: --resume failed, then advised
    "Last checkpoint ...: continue with --resume", which loads the same bundle again. The
    advice names the bundle and the one a resume reaches once its files are moved out.
    A field edited by hand ("global_step": "x") gave that same advice, from an error that
    named no file."""
    from flodl_shm.cli.demo import main

    run_dir = tmp_path / "damaged"
    run_demo(quiet(run_dir, epochs=2, checkpoint_every=2))
    assert_clean()
    rounds = [p.name for _, p in committed_checkpoints(run_dir / "ckpt")]
    newest = run_dir / rounds[-1]
    meta = CheckpointBundle.meta_path(newest)
    if damage == "emptied":
        meta.write_text("")
    else:
        edited = json.loads(meta.read_text())
        edited["global_step"] = "x"
        meta.write_text(json.dumps(edited))
    capsys.readouterr()
    argv = ["--run-dir", str(run_dir), "--resume", "--epochs", "3", "--no-progress",
            "--log-every", "0", "--no-plot"]
    assert main(argv) == 1
    assert_clean()
    err = capsys.readouterr().err
    assert "continue with --resume" not in err, err
    if damage != "emptied":
        assert f"{meta}: global_step must be a non-negative integer, got 'x'" in err, err
    assert (f"The newest checkpoint, {newest}, could not be loaded. Restore its files from a "
            f"copy, or move them ({newest.name[:-4]}.*) out of {run_dir}: --resume then "
            f"continues from the one before, {rounds[-2]}.") in err
    moved = tmp_path / "aside"
    moved.mkdir()
    for f in run_dir.glob(newest.name[:-4] + ".*"):
        f.rename(moved / f.name)
    assert main(argv) == 0  # the advice, followed
    assert_clean()


def test_an_earlier_run_is_kept_unless_overwrite(tmp_path, capsys):
    run_dir = tmp_path / "again"
    first = run_demo(quiet(run_dir, epochs=1))
    assert_clean()

    def checkpoint_files():
        return {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name.startswith("ckpt")}

    kept = checkpoint_files()
    assert first.train.checkpoint.name in kept
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        run_demo(quiet(run_dir, epochs=1))
    assert refused.value.code == 2  # a usage error
    assert re.search("earlier run.*kept.*--resume.*--overwrite", capsys.readouterr().err)
    assert checkpoint_files() == kept, "the refused run touched the earlier checkpoints"
    assert_clean()
    with pytest.raises(SystemExit):
        parse_args(["--resume", "--overwrite"])
    assert parse_args(["--overwrite"]).overwrite and not parse_args([]).overwrite
    capsys.readouterr()
    second = run_demo(quiet(run_dir, epochs=1, overwrite=True))
    assert_clean()
    assert "--overwrite: deleting the earlier run's checkpoints" in capsys.readouterr().out
    assert committed_checkpoints(run_dir / "ckpt")[-1][1] == second.train.checkpoint


def test_command_line_checks(tmp_path):
    from flodl_shm.cluster.secret import write_secret_file

    secret = str(tmp_path / "s.hex")
    write_secret_file(secret)
    with pytest.raises(SystemExit):
        parse_args(["--slow-rank", "1"])
    for flag, bad in (("--checkpoint-every", "-1"), ("--timeout", "0")):  # were API errors
        with pytest.raises(SystemExit):                                  # after the banner
            parse_args([flag, bad])
    assert parse_args(["--checkpoint-every", "0"]).checkpoint_every is None  # at the end only
    with pytest.raises(SystemExit):
        parse_args(["--slow-rank", "2:3"])            # 2 ranks: ranks 0 and 1
    with pytest.raises(SystemExit):
        parse_args(["--controller", "127.0.0.1:1"])   # needs --world-size, --secret-file
    with pytest.raises(SystemExit):
        parse_args(["--world-size", "4"])             # needs --controller
    with pytest.raises(SystemExit):
        parse_args(["--controller", "127.0.0.1:1", "--world-size", "4", "--first-rank", "3",
                    "--secret-file", secret])         # ranks 3-4 of 4
    # on a cluster the outer step runs in the controller (`controller --outer nesterov`)
    assert parse_args(["--controller", "127.0.0.1:1", "--world-size", "4", "--secret-file",
                       secret, "--outer", "nesterov"]).outer == "nesterov"
    with pytest.raises(SystemExit):                   # an unreadable secret file
        parse_args(["--controller", "127.0.0.1:1", "--world-size", "4", "--secret-file",
                    str(tmp_path / "missing.hex")])
    cfg = parse_args(["--slow-rank", "1:2.5", "--bf16-wire", "--outer", "nesterov"])
    assert cfg.slow_rank == (1, 2.5) and cfg.bf16_wire and cfg.outer == "nesterov"
    assert cfg.effective_cadence == "elche"
    assert parse_args(["--slow-rank", "1:3", "--cadence", "fixed"]).effective_cadence == "fixed"
    assert parse_args([]).effective_cadence == "fixed"
    with pytest.raises(ValueError, match="need a controller"):
        Trainer(make_model, functools.partial(torch.optim.SGD, lr=0.1), None,
                lambda output, target: output.sum()).run(2, world_size=4)


def test_console_entry_points():
    out = subprocess.run([sys.executable, "-m", "flodl_shm", "demo", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--slow-rank" in out.stdout and "--controller" in out.stdout
    script = shutil.which("flodl-shm", path=str(__import__("pathlib").Path(sys.executable).parent))
    if script is None:
        pytest.skip("the flodl-shm console script is not installed (pip install -e .)")
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "demo" in out.stdout


def test_a_reader_that_stops_reading_does_not_stop_the_run(tmp_path):
    """``demo | head -3``: once the pipe's reader is gone, the output goes nowhere and the
    run trains on to its end. The ranks used to fail with BrokenPipeError: a
    max_failure_exceeded checkpoint, a death record, exit status 1."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flodl_shm", "demo", "--run-dir",
                             str(run_dir), "--no-plot", "--no-progress", "--epochs", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # as head does after its lines
    _, err = proc.communicate(timeout=240)
    assert first.startswith(b"flodl_shm demo:") and proc.returncode == 0, err.decode()
    assert not list(run_dir.glob("*.death.json")) and b"Error" not in err, err.decode()
    meta = json.loads(next(run_dir.glob("ckpt-r*.meta.json")).read_text())
    assert meta["save_reason"] != "max_failure_exceeded" and meta["epoch"] == 2, meta


def test_resume_refuses_what_it_cannot_continue_before_writing_anything(tmp_path, capsys):
    """--resume with another rank count on an ElChe run, another --batch-size, or a
    --run-dir whose checkpoint is not a demo's: a usage error (exit 2) naming the flag
    and the value that works, before the run writes its options or metrics (which would
    make the next --resume fail the same way) or starts a rank."""
    import torch

    from flodl_shm.checkpoint.fdl import save_tensors
    from flodl_shm.checkpoint.meta import ModelSchema, SaveReason, names_sidecar_path
    from flodl_shm.checkpoint.series import round_model_path

    run_dir = tmp_path / "elche"
    run_demo(quiet(run_dir, epochs=1, slow_rank=(1, 1.5)))
    assert_clean()
    files = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    def refused(*flags) -> str:
        capsys.readouterr()
        cfg = parse_args(["--resume", "--no-progress", "--log-every", "0", "--no-plot",
                          "--epochs", "2", *flags])
        with pytest.raises(SystemExit) as info:
            run_demo(cfg)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("python -m flodl_shm demo: error: ") and err.count("\n") == 1
        return err

    err = refused("--run-dir", str(run_dir), "--nprocs", "3")
    assert "ElChe cadence on 2 ranks" in err and "resume it with --nprocs 2" in err, err
    err = refused("--run-dir", str(run_dir), "--batch-size", "64")
    assert "--batch-size cannot change on --resume" in err and "pass --batch-size 32" in err, err
    err = refused("--run-dir", str(run_dir), "--seed", "7")
    assert "--seed cannot change on --resume" in err and "pass --seed 42" in err, err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == files, "the refusal wrote"

    other = tmp_path / "not_demo"  # a Trainer run of another model in a folder of its own
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    path = round_model_path(other / "ckpt", 40)
    other.mkdir()
    ModelSchema.from_module(model).write_to_file(names_sidecar_path(path))
    save_tensors(path, [(f"p{i}", p.detach()) for i, p in enumerate(model.parameters())])
    CheckpointMeta.new(3, 384, 40, 2, SaveReason.GRACEFUL_SHUTDOWN).write_to_file(
        CheckpointBundle.meta_path(path))
    before = sorted(p.name for p in other.iterdir())
    err = refused("--run-dir", str(other))
    assert f"{other} does not hold a demo run: its checkpoint ckpt-r00000040.fdl is of another " \
        "model (parameter '0.weight' is [64, 20] in the checkpoint and [128, 64] in the " \
        "model" in err, err
    # without --resume: the probe was told to continue another model's run with --resume
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        run_demo(parse_args(["--run-dir", str(other), "--no-progress", "--no-plot"]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{other} holds the checkpoints of another model, not of a demo run (last: " in err
    assert "Pass another --run-dir, or --overwrite to delete them" in err and "--resume" not in err
    assert sorted(p.name for p in other.iterdir()) == before, "the refusal wrote into it"
    assert_clean()


def test_a_run_stopped_after_its_last_window_is_not_told_to_resume(tmp_path):
    """A probe's Ctrl-C during the final evaluation of a finished run read 'Last
    checkpoint ...: continue with --resume', which trains nothing."""
    from flodl_shm.cli.demo import _continue_with

    run_dir = tmp_path / "done"
    result = run_demo(quiet(run_dir, epochs=1))
    assert_clean()
    last = result.train.checkpoint
    finished = parse_args(["--run-dir", str(run_dir), "--epochs", "1"])
    assert _continue_with(finished, last) == (
        f"Training had finished: its last checkpoint is {last}; --resume with a larger "
        f"--epochs trains on.")
    more = parse_args(["--run-dir", str(run_dir), "--epochs", "2"])
    assert _continue_with(more, last) == f"Last checkpoint {last}: continue with --resume."
    # a host of a cluster with the controller's outer optimizer: restart it with its state
    host = dataclasses.replace(more, controller="127.0.0.1:29500", world_size=2,
                               outer="nesterov")
    said = _continue_with(host, last)
    assert said.startswith(f"Last checkpoint {last}: continue with --resume on every host. "
                           f"Restart the controller first with --outer nesterov --outer-state "
                           f"{str(last)[:-3]}outer.fdl"), said
    # a resumed run stopped past max_failures names the bundle its survivors saved, which
    # loads (a probe read "The newest checkpoint ... could not be loaded" there)
    from flodl_shm.errors import TrainingAborted
    from flodl_shm.training.trainer import TrainResult

    resumed = parse_args(["--run-dir", str(run_dir), "--epochs", "2", "--resume"])
    aborted = TrainingAborted(f"1 rank lost ([1]), more than max_failures=0.\nThe survivors "
                              f"saved {last} (max_failure_exceeded).",
                              TrainResult({}, [], None, last, (1,)))
    assert _continue_with(resumed, last, aborted) == \
        f"Last checkpoint {last}: continue with --resume."
    unreadable = ValueError(f"{str(last)[:-3]}meta.json: not JSON")
    assert "could not be loaded" in _continue_with(resumed, last, unreadable)
