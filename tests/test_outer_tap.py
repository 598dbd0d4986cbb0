"""The outer optimizer stepped per slice inside the reduce, and the checkpoint tap.

The single-host engine runs the outer step where the consensus is formed: each
rank steps the slice of the params frame it reduces, with the previous global and
the momentum in shared memory. These tests pin that it equals the tensor-level
``OuterNesterov.outer_step`` over the whole model bit for bit, and that a
checkpoint cycle armed on the ranks lands in the owner's forge as a loadable
``.fdl`` (+ ``.outer.fdl`` + ``.meta.json``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_shm import (DECODE_SLOT_BUFFERS, DECODE_SLOT_PARAMS, CheckpointMeta, ModelSchema,
                       OuterAvg, OuterNesterov, SaveReason, sumcount_reduce)
from flodl_shm.checkpoint.fdl import read_fdl
from flodl_shm.checkpoint.meta import CheckpointBundle
from flodl_shm.testing import FakeCohort

pytestmark = pytest.mark.timeout(120)

SHAPES = [(300, 7), (7,), (5000,)]


def rank_params(rank: int, window: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + window)
    return [torch.randn(s, generator=g) for s in SHAPES]


def reference(world: int, windows: int, weights, lr=0.7, mu=0.9, bf16=False):
    """The same windows through the tensor-level optimizer over the whole model."""
    opt = OuterNesterov(lr, mu)
    prev = None
    out = []
    for w in range(windows):
        contribs = []
        for r in range(world):
            scaled = [t * np.float32(weights[r]) for t in rank_params(r, w)]
            if bf16:
                scaled = [t.to(torch.bfloat16).float() for t in scaled]
            contribs.append(scaled)
        inv = np.float32(1.0 / sum(weights))
        cons = []
        for i in range(len(SHAPES)):
            acc = contribs[0][i] + contribs[1][i]
            for r in range(2, world):
                acc = acc + contribs[r][i]
            c = acc * inv
            cons.append(c.to(torch.bfloat16).float() if bf16 else c)
        new = opt.outer_step(cons if prev is None else prev, cons)
        prev = new
        out.append([t.to(torch.bfloat16).float() if bf16 else t for t in new])
    return out, opt


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_slice_steps_equal_the_whole_model_step(world, bf16):
    weights = [3.0, 5.0, 2.0][:world]
    windows = 4
    want, opt = reference(world, windows, weights, bf16=bf16)

    def body(comm):
        comm.set_bf16_wire(bf16)
        comm.set_outer(OuterNesterov(0.7, 0.9))
        got = []
        for w in range(windows):
            params = rank_params(comm.rank, w)
            got.append(sumcount_reduce(comm, params, weights[comm.rank], DECODE_SLOT_PARAMS,
                                       outer=True))
            got[-1] = [t.clone() for t in got[-1]]
        return got, comm.outer_momentum()

    with FakeCohort(world, eager_bytes=1 << 20) as c:  # small enough frames still go bulk
        out = c.run(body)
    ref_mom = np.concatenate([v.reshape(-1).numpy() for v in opt.checkpoint_state()])
    for got, mom in out:
        for w in range(windows):
            for g, r in zip(got[w], want[w]):
                assert torch.equal(g, r), f"window {w} differs"
        np.testing.assert_array_equal(mom, ref_mom)


def test_outer_avg_and_no_flag_are_plain_averages():
    def body(comm):
        comm.set_outer(OuterAvg())
        a = sumcount_reduce(comm, rank_params(comm.rank, 0), 1.0, DECODE_SLOT_PARAMS, outer=True)
        comm.set_outer(OuterNesterov())
        b = sumcount_reduce(comm, rank_params(comm.rank, 1), 1.0, DECODE_SLOT_PARAMS)
        return a, b

    with FakeCohort(2) as c:
        out = c.run(body)
    for w, got in enumerate(zip(*out)):
        for i in range(len(SHAPES)):
            want = (rank_params(0, w)[i] + rank_params(1, w)[i]) * np.float32(0.5)
            assert torch.equal(got[0][i], want) and torch.equal(got[1][i], want)


def test_restored_momentum_continues_the_trajectory():
    """Windows 0-3 in one run equal windows 0-1, a checkpoint of the momentum, and
    windows 2-3 in a fresh run restored from it (prev restarts from the consensus)."""
    weights = [1.0, 1.0]
    want, _ = reference(2, 4, weights)
    ref2 = OuterNesterov(0.7, 0.9)

    def first(comm):
        comm.set_outer(OuterNesterov(0.7, 0.9))
        for w in range(2):
            sumcount_reduce(comm, rank_params(comm.rank, w), 1.0, DECODE_SLOT_PARAMS, outer=True)
        return comm.outer_momentum()

    with FakeCohort(2) as c:
        mom = c.run(first)[0]
    offs = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])
    saved = [torch.from_numpy(mom[offs[i]:offs[i + 1]].reshape(s).copy())
             for i, s in enumerate(SHAPES)]

    def second(comm):
        comm.set_outer(OuterNesterov(0.7, 0.9))
        comm.load_outer_momentum(saved)
        return [sumcount_reduce(comm, rank_params(comm.rank, w), 1.0, DECODE_SLOT_PARAMS,
                                outer=True) for w in (2, 3)]

    with FakeCohort(2) as c:
        out = c.run(second)
    # the same continuation through the tensor-level optimizer: momentum restored,
    # prev = the first consensus after the resume
    ref2.load_checkpoint_state(saved)
    prev = None
    for k, w in enumerate((2, 3)):
        cons = [(a + b) * np.float32(0.5) for a, b in zip(rank_params(0, w), rank_params(1, w))]
        new = ref2.outer_step(cons if prev is None else prev, cons)
        prev = new
        for got in out:
            for g, r in zip(got[k], new):
                assert torch.equal(g, r)


@pytest.mark.parametrize("outer", [False, True])
def test_checkpoint_tap_writes_a_loadable_bundle(tmp_path, outer):
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.BatchNorm1d(4))
    schema = ModelSchema.from_module(model)
    assert schema.tensor_count() == 6  # 4 params + running_mean/var (no num_batches_tracked)
    path = tmp_path / "ckpt.fdl"

    def body(comm):
        comm.set_outer(OuterNesterov() if outer else None)
        g = torch.Generator().manual_seed(comm.rank)
        params = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        bufs = [torch.rand(b.shape, generator=g) for b in
                (model[1].running_mean, model[1].running_var)]
        # a plain window first, then the checkpointed one
        sumcount_reduce(comm, params, 1.0, DECODE_SLOT_PARAMS, outer=outer)
        meta = CheckpointMeta.new(1, 10, 2, comm.world_size, SaveReason.CHECKPOINT)
        comm.arm_checkpoint(path, schema, meta)
        p = sumcount_reduce(comm, params, 1.0, DECODE_SLOT_PARAMS, outer=outer)
        b = sumcount_reduce(comm, bufs, 1.0, DECODE_SLOT_BUFFERS)
        return [t.clone() for t in p], [t.clone() for t in b], comm.outer_momentum()

    with FakeCohort(2) as c:
        out = c.run(body)
        assert c.flush_checkpoints(60)
    params, bufs, mom = out[0]
    entries = read_fdl(path).by_name()
    assert sorted(entries) == ["b0", "b1", "p0", "p1", "p2", "p3"]
    for i, t in enumerate(params):
        assert np.array_equal(entries[f"p{i}"].to_numpy(), t.numpy())
    for j, t in enumerate(bufs):
        assert np.array_equal(entries[f"b{j}"].to_numpy(), t.numpy())
    meta = CheckpointMeta.read_from_file(CheckpointBundle.meta_path(path))
    assert (meta.epoch, meta.global_step, meta.sync_round) == (1, 10, 2)
    outer_path = tmp_path / "ckpt.outer.fdl"
    assert outer_path.exists() == outer
    if outer:
        got = np.concatenate([e.to_numpy().reshape(-1) for e in read_fdl(outer_path).entries])
        np.testing.assert_array_equal(got, mom)


def test_a_checkpoint_posted_just_before_the_end_is_written(tmp_path):
    """Closing the owner drains the mailbox first: nothing posted is lost."""
    model = torch.nn.Linear(3, 2)
    schema = ModelSchema.from_module(model)
    for i in range(5):
        path = tmp_path / f"c{i}.fdl"
        with FakeCohort(1) as c:
            comm = c.comm(0)
            comm.arm_checkpoint(path, schema, None)
            sumcount_reduce(comm, [p.detach() for p in model.parameters()], 1.0,
                            DECODE_SLOT_PARAMS)
        assert path.exists(), f"checkpoint {i} lost at close"


def test_the_tap_carries_a_tied_models_names_to_the_bundle(tmp_path):
    """A head that reuses the embedding: the bundle's names say so (the converters then
    emit both names), through the tap's mailbox to the host's forge."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    schema = ModelSchema.from_module(model)
    path = tmp_path / "tied.fdl"
    with FakeCohort(1) as c:
        comm = c.comm(0)
        comm.arm_checkpoint(path, schema, None)
        sumcount_reduce(comm, [p.detach() for p in model.parameters()], 1.0, DECODE_SLOT_PARAMS)
        assert c.flush_checkpoints(60)
    assert ModelSchema.read_from_file(tmp_path / "tied.names.json").tied == {"1.weight": "0.weight"}
