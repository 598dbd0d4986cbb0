"""CheckpointForge, load_consensus_checkpoint, load_outer_momentum.

Ports every test of flodl 0.7.0 ``checkpoint_forge.rs`` (seed 000), waiting on
``forge.flush()`` instead of polling for files, plus the DESIGN §4 contract:
zero-mass frames, gzip sidecars, positional loading of real torch modules,
logged (never raised) writer errors, a writer that survives a normal exit.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from flodl_shm import (
    DTYPE_BF16,
    DTYPE_F32,
    CheckpointError,
    CheckpointForge,
    ModelSchema,
    RoundFrame,
    RoundKind,
    TensorPayload,
    load_consensus_checkpoint,
    load_outer_momentum,
    tensors_to_round_frame,
)
from flodl_shm.checkpoint.fdl import load_checkpoint_file, read_fdl
from flodl_shm.checkpoint.forge import WRITER_THREAD_NAME, outer_sidecar_path, write_consensus_fdl

FLUSH_S = 30.0


def t(vals, shape):
    return torch.tensor(vals, dtype=torch.float32).reshape(shape)


def frame(*tensors, dtype=DTYPE_F32):
    return tensors_to_round_frame(list(tensors), dtype)


def zeros_like_slots(*shapes):
    return [torch.zeros(s) for s in shapes]


# --- seed 000 --------------------------------------------------------------------


def test_a_forge_given_something_else_than_a_schema_names_the_fix():
    with pytest.raises(TypeError, match=r"got str 'x'; build one with ModelSchema.from_module"):
        CheckpointForge("x")


def test_accumulate_params_then_buffers_round_trips_through_load(tmp_path):
    # Schema: 2 params (w, b) + 1 buffer (running_mean), in snapshot order.
    forge = CheckpointForge(ModelSchema(["w", "b"], ["running_mean"]))
    assert forge.can_write_model()
    w, b, rm = t([1, 2, 3, 4], (2, 2)), t([5, 6], (2,)), t([7, 8], (2,))
    path = tmp_path / "consensus.fdl"

    forge.arm(path)
    forge.accumulate(frame(w, b))  # params frame: 2 of 3, no write yet
    assert forge.flush(FLUSH_S)
    assert not path.exists(), "no write before all model frames arrive"
    assert forge.pending_tensor_count() == 2
    forge.accumulate(frame(rm))  # buffers frame completes 3/3 -> background write
    assert forge.flush(FLUSH_S)
    assert path.exists(), "completed accumulation produced the .fdl"
    assert not forge.is_armed()

    # Load by the positional keys the writer emits (p0, p1, b0), not the model's names.
    tw, tb, trm = zeros_like_slots((2, 2), (2,), (2,))
    report = load_checkpoint_file(path, [("p0", tw), ("p1", tb)], [("b0", trm)])
    assert report.loaded == ["p0", "p1", "b0"]
    assert tw.flatten().tolist() == [1, 2, 3, 4]
    assert tb.tolist() == [5, 6]
    assert trm.tolist() == [7, 8]


def test_bf16_frames_write_f32_checkpoint(tmp_path):
    # A bf16-wire run's consensus writes an EXACT f32 checkpoint (values bf16-representable).
    forge = CheckpointForge(ModelSchema(["w"], []))
    f = frame(t([1.5, -2.0, 0.25, 42.0], (4,)), dtype=DTYPE_BF16)
    assert f.tensors[0].dtype == DTYPE_BF16
    path = tmp_path / "consensus.fdl"
    forge.arm(path)
    forge.accumulate(f)
    assert forge.flush(FLUSH_S)
    entry = read_fdl(path).entries[0]
    assert entry.dtype_tag == 3  # f32 on disk
    tw = torch.zeros(4)
    load_checkpoint_file(path, [("p0", tw)])
    assert tw.dtype == torch.float32
    assert tw.tolist() == [1.5, -2.0, 0.25, 42.0]


def test_bf16_upcast_is_exact_for_every_bit_pattern(tmp_path):
    # All 65536 bf16 patterns, spanning several upcast chunks' worth of boundaries.
    bits = np.arange(1 << 16, dtype=np.uint16)
    payload = TensorPayload(DTYPE_BF16, (1 << 16,), bits)
    path = tmp_path / "all.fdl"
    write_consensus_fdl(ModelSchema(["w"], []), [payload], path)
    got = read_fdl(path).entries[0].to_numpy().view(np.uint32)
    want = bits.astype(np.uint32) << 16
    assert np.array_equal(got, want)


def test_bf16_upcast_streams_through_a_small_scratch(tmp_path):
    # 8 Mi bf16 elements become 32 MiB of f32 on disk without a model-sized buffer.
    import tracemalloc

    # Warm up first: numba's one-time load of the compiled kernel allocates on its own.
    write_consensus_fdl(ModelSchema(["w"], []), [TensorPayload(DTYPE_BF16, (1,), np.ones(1, np.uint16))],
                        tmp_path / "warm.fdl")
    n = 8 << 20
    payload = TensorPayload(DTYPE_BF16, (n,), np.full(n, 0x3F80, np.uint16))  # 1.0

    tracemalloc.start()
    try:
        write_consensus_fdl(ModelSchema(["w"], []), [payload], tmp_path / "u.fdl")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"upcasting 32 MiB allocated {peak} bytes"
    assert np.all(read_fdl(tmp_path / "u.fdl").entries[0].to_numpy() == 1.0)


def test_outer_momentum_writes_sidecar_and_round_trips(tmp_path):
    forge = CheckpointForge(ModelSchema(["w", "b"], ["running_mean"]))
    w, b, rm = t([1, 2, 3, 4], (2, 2)), t([5, 6], (2,)), t([7, 8], (2,))
    # Momentum is one tensor per PARAM (not buffers): 2 here.
    mw, mb = t([0.1, 0.2, 0.3, 0.4], (2, 2)), t([0.5, 0.6], (2,))
    path = tmp_path / "consensus.fdl"

    forge.arm(path)
    assert forge.is_armed()
    forge.stash_outer_momentum(frame(mw, mb).tensors)
    forge.accumulate(frame(w, b))
    forge.accumulate(frame(rm))  # completes
    assert forge.flush(FLUSH_S)

    outer_path = tmp_path / "consensus.outer.fdl"
    assert path.exists() and outer_path.exists(), "both .fdl and .outer.fdl written"
    t0, t1 = zeros_like_slots((2, 2), (2,))
    load_checkpoint_file(outer_path, [("p0", t0), ("p1", t1)])
    assert torch.equal(t0, mw) and torch.equal(t1, mb)


def test_no_outer_momentum_writes_no_sidecar(tmp_path):
    forge = CheckpointForge(ModelSchema(["w"], []))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    forge.accumulate(frame(t([1, 2], (2,))))  # completes, nothing stashed
    assert forge.flush(FLUSH_S)
    assert path.exists()
    assert sorted(os.listdir(tmp_path)) == ["c.fdl", "c.names.json"], "no .outer.fdl when no momentum stashed"


def test_unarmed_accumulate_is_noop(tmp_path):
    forge = CheckpointForge(ModelSchema(["w"], []))
    f = frame(t([1, 2], (2,)))
    forge.accumulate(f)  # no arm(): must not crash, write or start a writer
    assert forge.pending_writes() == 0 and forge.pending_tensor_count() == 0
    assert forge.flush(0.0)
    assert len(f.tensors) == 1, "an unarmed forge takes nothing"
    assert not any(th.name == WRITER_THREAD_NAME for th in threading.enumerate())


def test_arm_clears_partial_accumulation(tmp_path):
    # A new arm supersedes a missed one: a stale partial frame must not bleed into the
    # next cycle's model.
    forge = CheckpointForge(ModelSchema(["w", "b"], []))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    forge.accumulate(frame(t([9], (1,))))  # partial 1/2
    forge.arm(path)  # re-arm: stale partial dropped
    assert forge.pending_tensor_count() == 0
    forge.accumulate(frame(t([1, 2], (2,))))  # 1/2
    forge.accumulate(frame(t([3], (1,))))  # 2/2 -> write
    assert forge.flush(FLUSH_S)
    tw, tb = zeros_like_slots((2,), (1,))
    load_checkpoint_file(path, [("p0", tw), ("p1", tb)])
    assert tw.tolist() == [1, 2] and tb.tolist() == [3]


def test_write_consensus_fdl_rejects_tensor_count_mismatch(tmp_path):
    payloads = frame(t([1], (1,)), t([2], (1,))).tensors  # two payloads, schema expects 1
    path = tmp_path / "mismatch.fdl"
    with pytest.raises(CheckpointError, match="mismatch"):
        write_consensus_fdl(ModelSchema(["w"], []), payloads, path)
    assert not path.exists()


# --- DESIGN §4 and the issue ------------------------------------------------------


def test_overshoot_is_logged_and_skipped(tmp_path, caplog):
    forge = CheckpointForge(ModelSchema(["w"], ["rm"]))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    with caplog.at_level(logging.ERROR, logger="flodl_shm"):
        forge.accumulate(frame(t([1], (1,)), t([2], (1,)), t([3], (1,))))  # 3 > 2
    assert forge.flush(FLUSH_S)
    assert not path.exists()
    assert not forge.is_armed()
    assert "accumulated 3 tensors but schema expects 2 (1 params + 1 buffers)" in caplog.text
    assert ".fdl skipped" in caplog.text


def test_zero_mass_frame_is_never_written_and_stays_armed(tmp_path):
    forge = CheckpointForge(ModelSchema(["w"], ["rm"]))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    forge.accumulate(frame(t([1], (1,))))  # params 1/2
    idle = frame(t([0], (1,)))
    idle.weight = 0.0
    forge.accumulate(idle)  # nothing realized this cycle: no write, partial dropped
    assert forge.flush(FLUSH_S)
    assert not path.exists()
    assert forge.is_armed() and forge.pending_tensor_count() == 0
    forge.accumulate(frame(t([5], (1,))))
    forge.accumulate(frame(t([6], (1,))))
    assert forge.flush(FLUSH_S)
    tw, trm = zeros_like_slots((1,), (1,))
    load_checkpoint_file(path, [("p0", tw)], [("b0", trm)])
    assert (tw.item(), trm.item()) == (5.0, 6.0)


def test_control_frames_are_ignored(tmp_path):
    forge = CheckpointForge(ModelSchema(["w"], []))
    forge.arm(tmp_path / "c.fdl")
    forge.accumulate(RoundFrame(frame(t([3], (1,))).tensors, 1.0, RoundKind.CONTROL))
    assert forge.pending_tensor_count() == 0 and forge.is_armed()


def test_frames_are_moved_not_copied(tmp_path):
    forge = CheckpointForge(ModelSchema(["w", "b"], []))
    forge.arm(tmp_path / "c.fdl")
    f = frame(t([1, 2], (2,)))
    payload = f.tensors[0]
    forge.accumulate(f)
    assert f.tensors == [], "the frame's payloads now belong to the forge"
    assert forge._accumulated[0] is payload  # the same object, bytes not duplicated


def test_copy_detaches_payloads_from_reusable_buffers(tmp_path):
    # A tap reading the consensus out of a reusable (shared-memory) slot passes copy=True:
    # the next round overwriting the slot must not reach the pending checkpoint.
    slot = np.array([1.0, 2.0], np.float32)
    forge = CheckpointForge(ModelSchema(["w", "b"], []))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    forge.accumulate(RoundFrame([TensorPayload(DTYPE_F32, (2,), slot)]), copy=True)
    slot[:] = -1.0  # the slot is reused before the cycle completes
    forge.accumulate(frame(t([3], (1,))))
    assert forge.flush(FLUSH_S)
    tw, tb = zeros_like_slots((2,), (1,))
    load_checkpoint_file(path, [("p0", tw), ("p1", tb)])
    assert tw.tolist() == [1.0, 2.0]


def test_outer_count_mismatch_skips_only_the_sidecar(tmp_path, caplog):
    forge = CheckpointForge(ModelSchema(["w", "b"], []))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    forge.stash_outer_momentum(frame(t([1], (1,))).tensors)  # 1 tensor for 2 params
    with caplog.at_level(logging.ERROR, logger="flodl_shm"):
        forge.accumulate(frame(t([1], (1,)), t([2], (1,))))
        assert forge.flush(FLUSH_S)
    assert sorted(os.listdir(tmp_path)) == ["c.fdl", "c.names.json"]
    assert "outer momentum has 1 tensors but schema expects 2 params" in caplog.text


def test_bf16_outer_momentum_is_refused_and_logged(tmp_path, caplog):
    forge = CheckpointForge(ModelSchema(["w"], []))
    path = tmp_path / "c.fdl"
    forge.arm(path)
    forge.stash_outer_momentum(frame(t([1], (1,)), dtype=DTYPE_BF16).tensors)
    with caplog.at_level(logging.ERROR, logger="flodl_shm"):
        forge.accumulate(frame(t([1], (1,))))
        assert forge.flush(FLUSH_S)
    assert sorted(os.listdir(tmp_path)) == ["c.fdl", "c.names.json"]
    assert "v1 f32 only" in caplog.text
    assert forge.writes_failed == 1


def test_gzip_is_decided_by_the_final_path_and_the_sidecar_follows(tmp_path):
    assert outer_sidecar_path("r/x.fdl") == outer_sidecar_path(os.path.join("r", "x.fdl"))
    assert str(outer_sidecar_path("r/x.fdl")) == "r/x.outer.fdl"
    assert str(outer_sidecar_path("r/x.fdl.gz")) == "r/x.outer.fdl.gz"
    assert str(outer_sidecar_path("r/x")) == "r/x.outer.fdl"
    forge = CheckpointForge(ModelSchema(["w"], []))
    path = tmp_path / "x.fdl.gz"
    forge.arm(str(path))
    forge.stash_outer_momentum(frame(t([0.5], (1,))).tensors)
    forge.accumulate(frame(t([2], (1,))))
    assert forge.flush(FLUSH_S)
    assert sorted(os.listdir(tmp_path)) == ["x.fdl.gz", "x.names.json", "x.outer.fdl.gz"]
    for name in ("x.fdl.gz", "x.outer.fdl.gz"):
        raw = (tmp_path / name).read_bytes()
        assert raw[:2] == b"\x1f\x8b"
        parsed = read_fdl(tmp_path / name)
        assert parsed.structural_hash == bytes(32)


def test_a_missing_folder_is_created(tmp_path):
    """A controller on a machine of its own writes its copy under the path the ranks
    named (``runs/demo/...``, relative to where it runs): the folder is made."""
    forge = CheckpointForge(ModelSchema(["w"], []))
    path = tmp_path / "runs" / "demo" / "c.fdl"
    forge.arm(path)
    forge.accumulate(frame(t([1, 2], (2,))))
    assert forge.flush(FLUSH_S)
    assert forge.writes_completed == 1 and path.exists()


def test_writer_errors_are_logged_never_raised(tmp_path, caplog):
    forge = CheckpointForge(ModelSchema(["w"], []))
    (tmp_path / "a_file").write_text("not a folder")
    forge.arm(tmp_path / "a_file" / "c.fdl")
    with caplog.at_level(logging.ERROR, logger="flodl_shm"):
        forge.accumulate(frame(t([1], (1,))))  # returns: the failure happens off-thread
        assert forge.flush(FLUSH_S)
    assert forge.writes_failed == 1 and forge.writes_completed == 0
    assert "consensus checkpoint write to" in caplog.text and "failed" in caplog.text


def test_writes_run_off_the_callers_thread_on_a_joinable_non_daemon_worker(tmp_path):
    seen = []
    forge = CheckpointForge(ModelSchema(["w"], []))
    forge.arm(tmp_path / "c.fdl", on_complete=lambda p: seen.append(
        (p, threading.current_thread().name, threading.current_thread().daemon)))
    forge.accumulate(frame(t([1], (1,))))
    assert forge.flush(FLUSH_S)
    assert seen == [(tmp_path / "c.fdl", WRITER_THREAD_NAME, False)]
    assert forge.writes_completed == 1 and forge.last_written == tmp_path / "c.fdl"
    # The worker exits when idle: nothing keeps the interpreter alive.
    assert not any(th.name == WRITER_THREAD_NAME and th.is_alive() for th in threading.enumerate())


def test_back_to_back_cycles_are_all_written_in_order(tmp_path):
    forge = CheckpointForge(ModelSchema(["w"], []))
    done = []
    for i in range(5):
        forge.arm(tmp_path / f"c{i}.fdl", on_complete=done.append)
        forge.accumulate(frame(t([float(i)] * 1000, (1000,))))
    assert forge.flush(FLUSH_S)
    assert done == [tmp_path / f"c{i}.fdl" for i in range(5)]
    for i in range(5):
        assert read_fdl(tmp_path / f"c{i}.fdl").entries[0].to_numpy()[0] == i


def test_writes_falling_behind_are_said_once_per_spell(tmp_path, caplog, monkeypatch):
    """With a checkpoint every window of a fast model, every checkpoint used to log the
    'cadence outpaces the disk' warning."""
    import flodl_shm.checkpoint.forge as forge_module

    gate = threading.Event()
    write = forge_module.CheckpointForge._run_job
    monkeypatch.setattr(forge_module.CheckpointForge, "_run_job",
                        lambda self, job: (gate.wait(FLUSH_S), write(self, job)))
    caplog.set_level(logging.DEBUG, logger="flodl_shm")
    forge = CheckpointForge(ModelSchema(["w"], []))

    def cycle(i):
        forge.arm(tmp_path / f"c{i}.fdl")
        forge.accumulate(frame(t([float(i)] * 10, (10,))))

    def warnings():
        return [r for r in caplog.records if "outpaces the disk" in r.getMessage()
                and r.levelno == logging.WARNING]

    cycle(0)  # the first write blocks
    cycle(1)  # one queued behind the write in flight: keeping up (probes on tiny models
    assert warnings() == []  # saw this warned at every other checkpoint)
    for i in range(2, 5):  # a queue: said once
        cycle(i)
    assert len(warnings()) == 1
    gate.set()
    assert forge.flush(FLUSH_S)  # caught up
    gate.clear()
    for i in range(5, 8):
        cycle(i)  # behind again: news again
    gate.set()
    assert forge.flush(FLUSH_S)
    assert len(warnings()) == 2
    assert sorted(p.name for p in tmp_path.glob("c*.fdl")) == [f"c{i}.fdl" for i in range(8)]


def test_no_schema_means_no_model_write(tmp_path):
    forge = CheckpointForge(None)
    assert not forge.can_write_model()
    forge.arm(tmp_path / "c.fdl")
    forge.accumulate(frame(t([1], (1,))))
    assert forge.flush(FLUSH_S)
    assert not (tmp_path / "c.fdl").exists()


# --- loading into real modules ------------------------------------------------------


class Stack(torch.nn.Module):
    """Repeated layers with a BatchNorm: float buffers to average, an int buffer to keep."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.b = torch.nn.Linear(4, 4)
        self.c = torch.nn.Linear(4, 2)


def _consensus_of(model):
    params = [p.detach() for p in model.parameters()]
    buffers = [b for _, b in model.named_buffers() if b.is_floating_point()]
    return params, buffers


@pytest.mark.parametrize("name, wire", [("m.fdl", DTYPE_F32), ("m.fdl.gz", DTYPE_F32),
                                        ("m.fdl", DTYPE_BF16)])
def test_forge_checkpoint_loads_back_into_the_same_architecture(tmp_path, name, wire):
    torch.manual_seed(1)
    trained = Stack()
    with torch.no_grad():
        trained.bn.running_mean.uniform_()
        trained.bn.running_var.uniform_(1, 2)
        trained.bn.num_batches_tracked.fill_(11)
    params, buffers = _consensus_of(trained)
    forge = CheckpointForge(ModelSchema.from_module(trained))
    path = tmp_path / name
    forge.arm(path)
    momentum = [torch.full_like(p, 0.125 * i) for i, p in enumerate(params)]
    forge.stash_outer_momentum(tensors_to_round_frame(momentum, DTYPE_F32).tensors)
    forge.accumulate(tensors_to_round_frame(params, wire))
    forge.accumulate(tensors_to_round_frame(buffers, wire))
    assert forge.flush(FLUSH_S)

    torch.manual_seed(2)
    resumed = Stack()
    report = load_consensus_checkpoint(resumed, path)
    n_params = len(params)
    assert report.loaded == [f"p{i}" for i in range(n_params)] + ["b0", "b1"]
    assert report.missing == [] and report.unexpected == []
    cast = (lambda x: x.bfloat16().float()) if wire == DTYPE_BF16 else (lambda x: x)
    for (n, a), b in zip(trained.named_parameters(), resumed.parameters()):
        assert torch.equal(cast(a), b), n
    assert torch.equal(cast(trained.bn.running_mean), resumed.bn.running_mean)
    assert torch.equal(cast(trained.bn.running_var), resumed.bn.running_var)
    # The integer buffer is not part of the consensus: it keeps the resumed model's value.
    assert resumed.bn.num_batches_tracked.item() == 0

    got = load_outer_momentum(resumed, outer_sidecar_path(path))
    assert len(got) == n_params
    for g, m, p in zip(got, momentum, resumed.parameters()):
        assert g.shape == p.shape and not g.requires_grad
        assert torch.equal(g, m)


def test_consensus_load_rejects_another_architecture(tmp_path):
    model = torch.nn.Linear(3, 2)
    forge = CheckpointForge(ModelSchema.from_module(model))
    path = tmp_path / "m.fdl"
    forge.arm(path)
    forge.accumulate(tensors_to_round_frame([p.detach() for p in model.parameters()]))
    assert forge.flush(FLUSH_S)
    other = torch.nn.Linear(3, 5)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match=r"'p0' \(weight\): shape mismatch"):
        load_consensus_checkpoint(other, path)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    with pytest.raises(CheckpointError, match="missing"):
        load_outer_momentum(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)), path)


# --- processes --------------------------------------------------------------------

_EXIT_RIGHT_AFTER_ACCUMULATE = textwrap.dedent("""
    import sys
    import numpy as np
    from flodl_shm.checkpoint.meta import ModelSchema
    from flodl_shm.checkpoint.forge import CheckpointForge
    from flodl_shm.frame import DTYPE_BF16, DTYPE_F32, RoundFrame, TensorPayload

    n = 4 << 20  # 16 MiB of f32 + 8 MiB of bf16
    forge = CheckpointForge(ModelSchema(["w"], ["rm"]))
    forge.arm(sys.argv[1])
    forge.accumulate(RoundFrame([TensorPayload(DTYPE_F32, (n,), np.full(n, 3.0, np.float32))]))
    forge.accumulate(RoundFrame([TensorPayload(DTYPE_BF16, (n,), np.full(n, 0x4040, np.uint16))]))
    # The model went to disk without rebuilding tensors: torch was never imported.
    assert "torch" not in sys.modules, "the write path imported torch"
    # ...and the script ends here, with the write still in flight.
""")


def test_normal_exit_waits_for_the_in_flight_write_and_never_imports_torch(tmp_path):
    path = tmp_path / "exit.fdl"
    proc = subprocess.run([sys.executable, "-c", _EXIT_RIGHT_AFTER_ACCUMULATE, str(path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    parsed = read_fdl(path)
    assert [e.name for e in parsed.entries] == ["p0", "b0"]
    assert np.all(parsed.entries[0].to_numpy() == 3.0)
    assert np.all(parsed.entries[1].to_numpy() == 3.0)  # bf16 0x4040 == 3.0, upcast to f32
    assert sorted(os.listdir(tmp_path)) == ["exit.fdl", "exit.names.json"]


def test_a_by_name_file_loads_nothing_and_says_so(tmp_path):
    """An API probe loaded a save_module file (qualified names) with
    load_consensus_checkpoint: it returned an empty report and changed nothing, silently."""
    from flodl_shm.checkpoint.fdl import load_module, save_module

    save_module(torch.nn.Linear(3, 2), tmp_path / "lin.fdl")
    fresh = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match=r"holds none of a consensus checkpoint's keys .*"
                                              r"\['weight', 'bias'\].*load_module\(model, path\)"):
        load_consensus_checkpoint(fresh, tmp_path / "lin.fdl")
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    assert load_module(fresh, tmp_path / "lin.fdl").complete
    # a positional file with no slot in the model is a report, as before (a regression probe)
    from flodl_shm.checkpoint.fdl import save_tensors

    save_tensors(tmp_path / "pos.fdl", [("p0", torch.ones(2, 3)), ("p1", torch.ones(2))])
    assert load_consensus_checkpoint(torch.nn.ReLU(), tmp_path / "pos.fdl").unexpected == [
        "p0", "p1"]
