"""LocalSGD / DiLoCo on thread ranks (FakeCohort): the consensus against a reference
computed here, replicas identical after a sync, outer optimizers, ElChe, errors."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re

import pytest
import torch

import flodl_shm
from flodl_shm import ElChe, LocalSGD, OuterNesterov
from flodl_shm.testing import FakeCohort
from flodl_shm.training.inner_state import seal_rank_state, state_checksum
from flodl_shm.training.local_sgd import rank_state_path

pytestmark = pytest.mark.timeout(120)


def make_model(seed: int) -> torch.nn.Module:
    """A small model with BatchNorm whose weights depend on ``seed`` only (thread ranks
    share torch's global generator, so the weights come from a private one)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _snapshot(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_steps(model, sgd, rank: int, n: int, samples: int, window: int, lr: float = 0.1):
    """``n`` SGD steps on data fixed by (rank, window, step); returns step()'s answers."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    answers = []
    for k in range(n):
        g = torch.Generator().manual_seed(1000 * rank + 100 * window + k)
        x = torch.randn(samples, 6, generator=g)
        y = torch.randint(0, 3, (samples,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        answers.append(sgd.step(samples=samples))
    return answers


def _weighted_mean(states: list, weights: list, keys) -> dict:
    total = sum(weights)
    return {k: sum(s[k] * w for s, w in zip(states, weights)) / total for k in keys}


def test_construction_aligns_every_replica_on_rank_0():
    with FakeCohort(3) as cohort:
        def body(comm):
            model = make_model(seed=comm.rank)          # different weights per rank
            LocalSGD(model, sync_every=4, comm=comm)
            return _snapshot(model)

        out = cohort.run(body)
    ref = _snapshot(make_model(seed=0))
    for state in out:
        for k in ref:
            assert torch.equal(state[k], ref[k]), k


def test_consensus_is_the_realized_work_weighted_mean_and_replicas_are_identical():
    samples = {0: 2, 1: 5, 2: 9}
    with FakeCohort(3) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=3, comm=comm)
            answers = _train_steps(model, sgd, comm.rank, 2, samples[comm.rank], 0)
            before = _snapshot(model)
            answers += _train_steps(model, sgd, comm.rank, 1, samples[comm.rank], 1, lr=0.0)
            return answers, before, _snapshot(model), sgd.last_sync

        out = cohort.run(body)
    for answers, *_ in out:
        assert answers == [False, False, True]
    floats = [k for k, v in out[0][1].items() if v.is_floating_point()]
    # the third step had lr 0: the params entering the sync are `before` (the BatchNorm
    # statistics moved once more in that step's forward, so take them after it)
    entering = []
    for _, before, after, _ in out:
        entering.append({k: (before[k] if "running" not in k else None) for k in floats})
    weights = [3.0 * samples[r] for r in range(3)]
    params = [k for k in floats if "running" not in k]
    ref = _weighted_mean([e for e in entering], weights, params)
    for k in params:
        torch.testing.assert_close(out[0][2][k], ref[k], rtol=1e-6, atol=1e-7)
    for _, _, after, info in out:
        for k, v in after.items():
            if v.is_floating_point():
                assert torch.equal(v, out[0][2][k]), k
        assert info.mass == sum(weights)
        assert info.accepted == (0, 1, 2)
    # integer buffers stay local (each rank counted its own forward passes)
    assert int(out[1][2]["1.num_batches_tracked"]) == 3


def test_float_buffers_are_averaged_with_the_parameters_mass():
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=1, comm=comm)
            bn = model[1]
            with torch.no_grad():
                bn.running_mean.fill_(float(comm.rank + 1))
            sgd.step(samples=1 + 2 * comm.rank)            # masses 1 and 3
            return bn.running_mean.clone()

        out = cohort.run(body)
    expected = torch.full((8,), (1.0 * 1 + 2.0 * 3) / 4)
    for t in out:
        torch.testing.assert_close(t, expected)


def test_an_idle_cohort_keeps_local_state():
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=1, comm=comm)
            with torch.no_grad():
                model[0].bias.fill_(float(comm.rank))
            info = sgd.sync()                       # nobody trained since construction
            return info.mass, model[0].bias.clone()

        out = cohort.run(body)
    assert [m for m, _ in out] == [0.0, 0.0]
    assert torch.equal(out[1][1], torch.full((8,), 1.0))


def test_sync_every_none_syncs_only_when_called_and_carries_each_rank_s_report():
    """The caller decides the windows (the Trainer's coordinator does): step() only
    counts; sync(report=...) brings every rank's numbers back with the consensus."""
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=None, comm=comm, drift=True)
            answers = _train_steps(model, sgd, comm.rank, 3 + comm.rank, 2, 0)
            before = comm.round
            info = sgd.sync(report=[10.0 + comm.rank, 0.5])
            return answers, sgd.steps_until_sync, info, comm.round - before

        out = cohort.run(body)
    for rank, (answers, until, info, rounds) in enumerate(out):
        assert answers == [False] * (3 + rank) and until is None
        assert rounds == 1, "params, buffers and reports in one round"
        assert info.mass == 2 * 3 + 2 * 4 and info.local_steps == 3 + rank
        assert info.reports.shape == (2, 8)
        assert info.reports[:, :2].tolist() == [[10.0, 0.5], [11.0, 0.5]]
        assert info.divergence > 0.0 and info.next_steps is None
    with FakeCohort(1) as cohort:
        sgd = LocalSGD(make_model(0), sync_every=2, comm=cohort.comm(0))
        assert sgd.sync().reports is None and sgd.sync().divergence == 0.0, "unmeasured"


def test_movers_buffers_take_the_plain_mean_of_the_ranks_that_trained():
    """buffers="movers" (the Trainer's rule): the BatchNorm statistics are the plain
    mean over the ranks that trained, whatever their work; an idle rank adopts them."""
    with FakeCohort(3) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=None, comm=comm, buffers="movers")
            with torch.no_grad():
                model[1].running_mean.fill_(float(comm.rank + 1))
            for _ in range((1, 5, 0)[comm.rank]):
                sgd.step(samples=3)
            before = comm.round
            info = sgd.sync()
            return info.mass, model[1].running_mean.clone(), comm.round - before

        out = cohort.run(body)
    for mass, mean, rounds in out:
        assert mass == 18.0 and rounds == 2, "the buffers take a round of their own"
        torch.testing.assert_close(mean, torch.full((8,), 1.5))


def _diloco_run(comm, outer_factory, windows: int = 3):
    model = make_model(seed=0)
    outer = outer_factory(model)
    sgd = LocalSGD(model, sync_every=2, comm=comm, outer=outer)
    trace = [[p.detach().clone() for p in model.parameters()]]
    locals_ = []
    for w in range(windows):
        _train_steps(model, sgd, comm.rank, 1, 4 + comm.rank, w)
        locals_.append([p.detach().clone() for p in model.parameters()])
        _train_steps(model, sgd, comm.rank, 1, 4 + comm.rank, w, lr=0.0)
        trace.append([p.detach().clone() for p in model.parameters()])
    return trace, locals_


def test_diloco_matches_the_outer_nesterov_math():
    with FakeCohort(2) as cohort:
        out = cohort.run(functools.partial(
            _diloco_run, outer_factory=lambda m: OuterNesterov(lr=0.7, momentum=0.9)))
    (trace0, loc0), (trace1, loc1) = out
    ref_outer = OuterNesterov(lr=0.7, momentum=0.9)
    prev = trace0[0]
    w0, w1 = 2.0 * 4, 2.0 * 5
    for w in range(3):
        cons = [(a * w0 + b * w1) / (w0 + w1) for a, b in zip(loc0[w], loc1[w])]
        expected = ref_outer.outer_step(prev, cons)
        for got0, got1, e in zip(trace0[w + 1], trace1[w + 1], expected):
            assert torch.equal(got0, got1)
            torch.testing.assert_close(got0, e, rtol=1e-5, atol=1e-6)
        prev = expected


def test_the_diloco_step_runs_in_the_reduce_once_and_leaves_the_buffers_averaged():
    """One host: the Nesterov step is the engine's (its momentum lives in shared memory,
    no rank keeps a private previous global), and the BatchNorm buffers are the plain
    realized-work mean, never stepped."""
    def body(comm):
        model = make_model(seed=0)
        sgd = LocalSGD(model, sync_every=2, comm=comm, outer=OuterNesterov(0.7, 0.9))
        init = [p.detach().clone() for p in model.parameters()]
        _train_steps(model, sgd, comm.rank, 1, 4 + comm.rank, 0)
        local = _snapshot(model)
        model.eval()                                 # the syncing step changes nothing
        _train_steps(model, sgd, comm.rank, 1, 4 + comm.rank, 0, lr=0.0)
        local_bufs = {k: local[k] for k in ("1.running_mean", "1.running_var")}
        return (init, local, local_bufs, _snapshot(model), sgd._prev_global,
                comm.outer_momentum(), sgd.outer_state())

    with FakeCohort(2) as cohort:
        out = cohort.run(body)
    w = [8.0, 10.0]
    init = out[0][0]
    names = [n for n, _ in make_model(0).named_parameters()]
    cons = [(out[0][1][n] * w[0] + out[1][1][n] * w[1]) / sum(w) for n in names]
    ref = OuterNesterov(0.7, 0.9)
    expected = ref.outer_step(init, cons)
    bufs = _weighted_mean([o[2] for o in out], w, ["1.running_mean", "1.running_var"])
    for _, _, _, after, prev_copy, momentum, (prev, mom) in out:
        assert prev_copy is None                     # no per-rank copy of the model
        assert momentum is not None                  # the engine stepped it
        flat_ref = torch.cat([m.reshape(-1) for m in ref.checkpoint_state()])
        torch.testing.assert_close(torch.from_numpy(momentum), flat_ref, rtol=1e-5, atol=1e-6)
        for n, e, pv in zip(names, expected, prev):
            torch.testing.assert_close(after[n], e, rtol=1e-5, atol=1e-6)
            assert torch.equal(pv, after[n])         # the next step starts from it
        for k, v in bufs.items():
            torch.testing.assert_close(after[k], v, rtol=1e-6, atol=1e-7)
        assert torch.equal(after["1.num_batches_tracked"], torch.tensor(1))
    for k in out[0][3]:
        assert torch.equal(out[0][3][k], out[1][3][k])


def test_diloco_shorthand_is_local_sgd_with_outer_nesterov_and_resets_the_inner_state():
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            sgd = flodl_shm.DiLoCo(model, sync_every=2, comm=comm, optimizer=opt,
                                   outer_lr=0.5, outer_momentum=0.8)
            x = torch.randn(4, 6)
            for k in range(2):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                had_state = len(opt.state) > 0
                synced = sgd.step(samples=4)
            return type(sgd.outer).__name__, sgd.outer.lr, had_state, synced, len(opt.state)

        out = cohort.run(body)
    for name, lr, had_state, synced, after in out:
        assert (name, lr, had_state, synced, after) == ("OuterNesterov", 0.5, True, True, 0)


def test_a_torch_optimizer_as_outer_optimizer_steps_on_the_pseudo_gradient():
    def torch_outer(model):
        return torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    with FakeCohort(2) as cohort:
        out = cohort.run(functools.partial(_diloco_run, outer_factory=torch_outer))
    (trace0, loc0), (trace1, loc1) = out
    ref_model = make_model(seed=0)
    ref = torch_outer(ref_model)
    w0, w1 = 8.0, 10.0
    for w in range(3):
        cons = [(a * w0 + b * w1) / (w0 + w1) for a, b in zip(loc0[w], loc1[w])]
        with torch.no_grad():
            for p, prev, c in zip(ref_model.parameters(), trace0[w], cons):
                p.copy_(prev)
                p.grad = prev - c
        ref.step()
        for got0, got1, e in zip(trace0[w + 1], trace1[w + 1], ref_model.parameters()):
            assert torch.equal(got0, got1)
            torch.testing.assert_close(got0, e.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_wire_consensus_is_identical_on_every_rank_and_close_to_f32():
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=2, comm=comm, bf16_wire=True)
            _train_steps(model, sgd, comm.rank, 1, 4, 0)
            local = [p.detach().clone() for p in model.parameters()]
            _train_steps(model, sgd, comm.rank, 1, 4, 0, lr=0.0)
            return local, [p.detach().clone() for p in model.parameters()]

        out = cohort.run(body)
    for a, b, l0, l1 in zip(out[0][1], out[1][1], out[0][0], out[1][0]):
        assert torch.equal(a, b)
        ref = (l0 + l1) / 2
        torch.testing.assert_close(a, ref, rtol=2e-2, atol=1e-2)
        # every element went through bf16: the consensus is bf16-representable
        assert torch.equal(a, a.to(torch.bfloat16).to(torch.float32))


def test_elche_cadence_keeps_every_rank_on_the_same_schedule():
    import time

    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            seen = []

            class Recording(flodl_shm.TrendGuard):
                def check(self, deltas, k_used=0, k_max=0):
                    seen.append(tuple(deltas))
                    return super().check(deltas, k_used, k_max)

            sgd = LocalSGD(model, sync_every=2, comm=comm, cadence="elche", guard=Recording())
            first_round = comm.round
            syncs, windows, n = 0, [], 0
            while syncs < 8:
                if comm.rank == 1:
                    time.sleep(0.004)                  # the slow rank
                n += 1
                if sgd.step(samples=1):
                    syncs += 1
                    windows.append(n)
                    n = 0
            # one host: ElChe's numbers ride in the params round, one collective a sync
            assert comm.round - first_round == syncs
            return windows, sgd.el_che.batch_counts(), sgd.cadence, seen

        out = cohort.run(body)
    (w0, counts0, cad0, hist0), (w1, counts1, _, hist1) = out
    assert cad0 == "elche"
    # the drift travels one sync late: the first sync has none to give the guard
    assert len(hist0) == len(hist1) == 7 and hist0 == hist1
    assert counts0 == counts1                            # one schedule on every rank
    assert len(w0) == len(w1) == 8
    assert w0[0] == w1[0] == 2                           # the anchor before calibration
    assert sum(w0[-3:]) > sum(w1[-3:])                   # the fast rank trains more


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")  # torch's, on .to()
def test_errors_name_the_value_and_the_fix():
    with FakeCohort(1) as cohort:
        comm = cohort.comm(0)
        with pytest.raises(ValueError, match=r"sync_every must be an int >= 1 \(or None: sync "
                                             r"only when sync\(\) is called\), got 0"):
            LocalSGD(make_model(0), sync_every=0, comm=comm)
        with pytest.raises(ValueError, match="sync_every=None .* needs cadence='fixed'"):
            LocalSGD(make_model(0), sync_every=None, comm=comm, cadence="elche")
        with pytest.raises(ValueError, match="buffers must be 'work' or 'movers', got 'all'"):
            LocalSGD(make_model(0), sync_every=2, comm=comm, buffers="all")
        with pytest.raises(ValueError, match="cadence must be"):
            LocalSGD(make_model(0), sync_every=2, comm=comm, cadence="fast")
        with pytest.raises(TypeError, match="torch.float64"):
            LocalSGD(make_model(0).double(), sync_every=2, comm=comm)
        # (a probe: .float() on a complex tensor drops its imaginary part, and a lazy
        # module's parameter failed in torch's shape check, unnamed)
        with pytest.raises(TypeError, match=r"parameter 'weight' has dtype torch.complex64; "
                                            r".* \(torch.view_as_real\)"):
            LocalSGD(torch.nn.Linear(2, 2).to(torch.complex64), sync_every=2, comm=comm)
        with pytest.raises(ValueError, match=r"parameter '0.weight' is not initialized yet "
                                             r".* run the model once on a sample batch"):
            LocalSGD(torch.nn.Sequential(torch.nn.LazyLinear(4)), sync_every=2, comm=comm)
        other = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match="exactly model.parameters"):
            LocalSGD(make_model(0), sync_every=2, comm=comm,
                     outer=torch.optim.SGD(other.parameters(), lr=0.1))
        with pytest.raises(ValueError, match="is on meta; LocalSGD averages CPU tensors"):
            LocalSGD(torch.nn.Linear(2, 2, device="meta"), sync_every=2, comm=comm)
        # arguments that were taken for true, or failed deep inside (a user probe)
        for kwargs, error, says in [
            ({"bf16_wire": "False"}, TypeError, "bf16_wire must be True or False, got 'False'"),
            ({"drift": "no"}, TypeError, "drift must be True or False, got 'no'"),
            ({"gamma": "1"}, TypeError, "gamma must be a real number, got '1'"),
            ({"sync_every": 10 ** 30, "cadence": "elche"}, ValueError,
             r"sync_every must be at most 4294967295 \(2\^32 - 1\) steps"),
            ({"comm": "x"}, TypeError, "comm must be None .* got str"),
            ({"comm": cohort}, TypeError, "comm must be None .* got FakeCohort"),
        ]:
            with pytest.raises(error, match=says):
                LocalSGD(make_model(0), **{"sync_every": 2, "comm": comm, **kwargs})
        with pytest.raises(TypeError, match="OuterNesterov lr must be a number, got '0.7'"):
            flodl_shm.DiLoCo(make_model(0), sync_every=2, comm=comm, outer_lr="0.7")
        sgd = LocalSGD(make_model(0), sync_every=4, comm=comm)
        with pytest.raises(ValueError, match="samples must be an int >= 0"):
            sgd.step(samples=-1)
        sgd.step(samples=1)
        with pytest.raises(ValueError, match="mid-window"):
            sgd.save("unused")


@pytest.mark.parametrize("change, named", [
    (lambda m: m.bfloat16(), "parameter '0.weight', parameter '0.bias', parameter '1.weight' "
                             "and 5 more of the model were replaced"),
    (lambda m: setattr(m[0].weight, "data", torch.zeros(8, 6)), "parameter '0.weight' of the "
                                                               "model was replaced"),
    (lambda m: setattr(m[3], "bias", torch.nn.Parameter(torch.zeros(3))),
     "parameter '3.bias' of the model was replaced"),
    (lambda m: setattr(m[1], "running_mean", torch.zeros(8)),
     "buffer '1.running_mean' of the model was replaced"),
    (lambda m: m.__setitem__(3, torch.nn.Linear(8, 3)),
     "parameter '3.weight', parameter '3.bias' of the model were replaced"),
    (lambda m: m.add_module("extra", torch.nn.Linear(2, 2)),
     "parameter 'extra.weight', parameter 'extra.bias' of the model were added"),
    # a removal is seen at the next registration anywhere (here: a module built)
    (lambda m: (m._modules.pop("3"), torch.nn.Linear(1, 1)),
     "parameter '3.weight', parameter '3.bias' of the model were removed"),
], ids=["bfloat16", "data", "new-parameter", "new-buffer", "new-submodule", "added-submodule",
        "removed-submodule"])
def test_tensors_replaced_after_construction_are_refused_not_left_out(change, named):
    """A sync used to average the tensors LocalSGD was built on and report success while
    the model, holding other tensors, kept its own weights on every rank."""
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=comm.rank)
            sgd = LocalSGD(model, sync_every=1, comm=comm)
            change(model)
            with pytest.raises(RuntimeError, match=named + r" after LocalSGD was built on it"):
                sgd.sync()
            return True

        assert cohort.run(body) == [True, True]


@pytest.mark.parametrize("synced_first", [False, True], ids=["fresh", "after-a-sync"])
def test_values_changed_in_place_after_construction_are_averaged(synced_first):
    """In place, or with the storage moved under the tensors (share_memory: their
    addresses change, the window's views follow) is no replacement. After a sync too,
    whose rounds gathered the old addresses (``engine/gathered.py``): they are gathered
    again (kept, the rounds wrote into freed memory and left the model as it was)."""
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=1, comm=comm)
            if synced_first:
                assert sgd.step(samples=1)
            model.share_memory()
            with torch.no_grad():
                model[0].weight.fill_(float(comm.rank))
                model[1].running_mean.fill_(2.0 * comm.rank)
            assert sgd.step(samples=1)
            return model[0].weight[0, 0].item(), model[1].running_mean[0].item()

        assert cohort.run(body) == [(0.5, 1.0), (0.5, 1.0)]


def test_ranks_built_with_different_settings_or_models_are_refused_naming_them():
    """Ranks built with another sync_every paired their k-th syncs over different amounts
    of work, silently; other differences failed in the engine's terms (frame schemas) or
    not at all. Construction now compares the settings and the averaged tensors."""
    def build(comm, **kw):
        try:
            LocalSGD(kw.pop("model", None) or make_model(0), comm=comm, **kw)
        except ValueError as e:
            return str(e)
        return None

    with FakeCohort(3) as cohort:
        out = cohort.run(lambda comm: build(comm, sync_every=4 if comm.rank < 2 else 5,
                                            gamma=0.5 if comm.rank == 1 else 1.0))
        # every rank says the same, with every rank's value (each rank named only its
        # own: "sync_every (rank 0 (as on ranks [0, 1]): 4; ranks [2] passed another)")
        assert out == [("the ranks differ in sync_every (4 on ranks [0, 1]; 5 on ranks [2]); "
                        "gamma (1.0 on ranks [0, 2]; 0.5 on ranks [1]): build LocalSGD with "
                        "the same arguments, on the same model, on every rank")] * 3, out
        out = cohort.run(lambda comm: build(
            comm, sync_every=4, outer=OuterNesterov(lr=0.7 if comm.rank else 0.5),
            bf16_wire=comm.rank == 2))
        assert out[0].startswith("the ranks differ in outer (('OuterNesterov', 0.5, 0.9) on "
                                 "ranks [0]; ('OuterNesterov', 0.7, 0.9) on ranks [1, 2]); "
                                 "bf16_wire (False on ranks [0, 1]; True on ranks [2])"), out[0]
        # (a probe: ElChes of other knobs passed, and the ranks planned other windows); a
        # long value is quoted up to its first 240 bytes
        out = cohort.run(lambda comm: build(
            comm, sync_every=4, cadence=ElChe(3, 4).with_overhead_target(
                0.3 if comm.rank == 1 else 0.05)))
        assert out[0].startswith("the ranks differ in cadence ((('world_size', 3), "
                                 "('anchor', 4)"), out[0]
        assert "('overhead_target', 0.05)" in out[0] and "... on ranks [0, 2]; " in out[0]
        assert "('overhead_target', 0.3)" in out[1] and "... on ranks [1])" in out[1]

        def other_model(comm):
            model = make_model(0)
            if comm.rank == 2:
                model[3] = torch.nn.Linear(8, 4)
            return build(comm, sync_every=4, model=model)

        out = cohort.run(other_model)
        assert out[0].startswith("the ranks' models differ: on rank 0 (as on ranks [0, 1]), "
                                 "tensor 4 is parameter '3.weight', shape (3, 8) "
                                 "torch.float32; ranks [2] have another")
        assert "on rank 2, tensor 4 is parameter '3.weight', shape (4, 8)" in out[2]

        def fewer(comm):
            model = make_model(0)
            if comm.rank == 1:
                model[1] = torch.nn.Identity()
            return build(comm, sync_every=4, model=model)

        out = cohort.run(fewer)
        assert "on rank 1, tensor 2 is parameter '3.weight'" in out[1], out[1]
        assert "tensor 2 is parameter '1.weight', shape (8,)" in out[0]
        assert cohort.run(lambda comm: build(comm, sync_every=4)) == [None] * 3
    with FakeCohort(2) as cohort:  # (checked where the ElChe is given, before any round)
        out = cohort.run(lambda comm: build(comm, sync_every=4, cadence=ElChe(2, 8)))
        assert out == ["sync_every=4 is the slowest rank's batches in the first window with "
                       "ElChe, and the cadence's ElChe starts at anchor 8: pass sync_every=8, "
                       "or build the ElChe with anchor=4"] * 2


def test_comm_none_without_a_process_group_names_what_to_pass():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a default process group is initialized in this process")
    with pytest.raises(RuntimeError, match=r"^LocalSGD\(comm=None\) .*comm=ctx.comm"):
        LocalSGD(make_model(0), sync_every=2)
    # the class the user made names itself (a probe read 'LocalSGD(comm=None)' from DiLoCo)
    with pytest.raises(RuntimeError, match=r"^DiLoCo\(comm=None\) uses the default"):
        flodl_shm.DiLoCo(make_model(0), sync_every=2)


def test_a_state_of_another_cadence_resumes_by_this_local_sgd_s_settings(caplog):
    """A state resumed with another cadence, ElChe on another number of ranks or
    another ``sync_every`` was refused with a message naming the wrong cause (ElChe on
    one rank is a fixed cadence), or silently kept the saved window's length: now this
    LocalSGD's settings decide, and rank 0 says why."""
    def saved(world, cadence, sync_every=4, steps=1):
        def body(comm):
            sgd = LocalSGD(make_model(0), sync_every=sync_every, comm=comm, cadence=cadence)
            for _ in range(steps):
                sgd.step(samples=2)
            return sgd.state_dict()

        with FakeCohort(world) as cohort:
            return cohort.run(body)

    def resumed(states, world, cadence, sync_every):
        def body(comm):
            sgd = LocalSGD(make_model(0), sync_every=sync_every, comm=comm, cadence=cadence)
            sgd.load_state_dict(states[comm.rank % len(states)])
            return sgd.steps_until_sync, sgd.total_steps

        with FakeCohort(world) as cohort:
            return cohort.run(body)

    two_elche, two_fixed = saved(2, "elche"), saved(2, "fixed")
    cases = [  # (states, world, cadence, sync_every, until the sync, what rank 0 says)
        (two_fixed, 2, "fixed", 4, 3, None),  # the same: exact, nothing said
        (two_fixed, 2, "fixed", 8, 7, r"sync_every=4 and this LocalSGD has sync_every=8: "
                                   r"the window in progress ends by the new setting "
                                   r"\(1 of its steps taken\)"),
        (two_fixed, 2, "elche", 4, None, "it ran a fixed cadence: ElChe starts fresh"),
        (two_elche, 2, "fixed", 4, 3, "it ran cadence='elche' on 2 ranks and this LocalSGD runs "
                                   "a fixed cadence: windows of sync_every=4"),
        (two_elche, 3, "elche", 4, None, "its ElChe balanced 2 ranks and this cohort has 3: "
                                      "ElChe starts fresh"),
    ]
    for states, world, cadence, sync_every, until, said in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="flodl_shm"):
            got = resumed(states, world, cadence, sync_every)
        assert all(steps == 1 for _, steps in got)
        if until is not None:
            assert {u for u, _ in got} == {until}
        warned = [r.getMessage() for r in caplog.records if "another cadence" in r.getMessage()]
        if said is None:
            assert not warned
        else:
            assert len(warned) == 1 and re.search(said, warned[0]), warned
    with FakeCohort(1) as cohort:  # ElChe on one rank is a fixed cadence: said so
        with caplog.at_level("WARNING", logger="flodl_shm"):
            caplog.clear()
            sgd = LocalSGD(make_model(0), sync_every=4, comm=cohort.comm(0), cadence="elche")
            sgd.load_state_dict(two_elche[0])
        assert "(one rank: ElChe has nothing to balance)" in caplog.text
        with pytest.raises(ValueError, match="not a LocalSGD state"):
            sgd.load_state_dict({"format": "x"})


def test_a_state_of_another_model_names_its_tensors_on_one_line():
    """torch's load_state_dict error starts 'Error(s) in loading state_dict for
    Sequential:' and names the tensors on the lines after, which a RankFailed (its
    first line) lost: the message says them on one line."""
    with FakeCohort(1) as cohort:
        state = LocalSGD(make_model(0), sync_every=2, comm=cohort.comm(0)).state_dict()
        wide = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 2))
        with pytest.raises(ValueError, match=r"^the state of rank 0 does not fit this model: "
                                             r".*size mismatch for 0\.weight") as info:
            LocalSGD(wide, sync_every=2, comm=cohort.comm(0)).load_state_dict(state)
        assert "\n" not in str(info.value)


def test_a_bundle_that_does_not_fit_this_local_sgd_names_its_file(tmp_path):
    """A probe loaded a plain LocalSGD's bundle into a DiLoCo: 'the state was saved
    without an outer optimizer; build LocalSGD with the same outer argument', naming no
    file (a job that loads one of several series cannot tell which)."""
    with FakeCohort(1) as cohort:
        sgd = LocalSGD(make_model(0), sync_every=1, comm=cohort.comm(0))
        sgd.sync()
        bundle = sgd.save(tmp_path / "ck")
        with pytest.raises(ValueError) as info:
            LocalSGD(make_model(0), sync_every=1, comm=cohort.comm(0),
                     outer=OuterNesterov()).load(tmp_path / "ck")
    assert str(info.value) == (f"{rank_state_path(bundle, 0)}: the state was saved without an "
                               f"outer optimizer: build a plain LocalSGD (no outer=, not "
                               f"DiLoCo) to load it")


def test_a_rank_that_cannot_write_its_state_fails_the_save_on_every_rank(tmp_path,
                                                                         monkeypatch):
    """Rank 1's disk is full: it raises its own OSError and rank 0 raises naming rank 1,
    with no bundle committed; both are still in step (a rank that caught its error and
    went on used to meet the others at another collective: a schema error). """
    import errno

    import flodl_shm.training.local_sgd_state as local_sgd_state
    from flodl_shm.checkpoint.series import committed_checkpoints

    real = local_sgd_state.atomic_write

    def full_for_rank_1(path, write):
        if str(path).endswith(".rank1.optim"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, write)

    monkeypatch.setattr(local_sgd_state, "atomic_write", full_for_rank_1)

    def body(comm):
        sgd = LocalSGD(make_model(0), sync_every=1, comm=comm)
        sgd.sync()
        try:
            sgd.save(tmp_path / "ck")
            said = None
        except Exception as e:  # noqa: BLE001 - the test reads it
            said = f"{type(e).__name__}: {e}"
        return said, sgd.sync().mass  # still in step

    with FakeCohort(2) as cohort:
        (said0, mass0), (said1, mass1) = cohort.run(body)
    assert said1 == "OSError: [Errno 28] No space left on device", said1
    assert said0.startswith("RuntimeError: save(): rank(s) [1] could not write its state file"), \
        said0
    assert mass0 == mass1 == 0.0 and committed_checkpoints(tmp_path / "ck") == []


def _save_two_ranks(folder, seed: int):
    """Two ranks train 2 windows from ``seed`` and save (sync round 2); the bundle path."""
    def body(comm):
        model = make_model(seed)
        sgd = LocalSGD(model, sync_every=1, comm=comm)
        for w in range(2):
            _train_steps(model, sgd, comm.rank, 1, samples=4, window=w + 10 * seed)
        return sgd.save(folder / "ck")

    with FakeCohort(2) as cohort:
        return cohort.run(body)[0]


def _load_two_ranks(bundle) -> list:
    def body(comm):
        try:
            LocalSGD(make_model(5), sync_every=1, comm=comm).load(bundle)
            return None
        except Exception as e:  # noqa: BLE001 - the test reads it
            return f"{type(e).__name__}: {e}"

    with FakeCohort(2) as cohort:
        return cohort.run(body)


def test_a_rank_file_of_another_save_of_the_same_round_is_refused_on_every_rank(tmp_path):
    """A probe copied rank 0's state file of another run saved at the same sync round into
    a bundle: the round check passed, and rank 0 resumed from other weights than rank 1,
    silently. Each save's files carry its id now."""
    import shutil

    bundle = _save_two_ranks(tmp_path / "a", seed=1)
    other = _save_two_ranks(tmp_path / "b", seed=2)
    shutil.copy(rank_state_path(other, 0), rank_state_path(bundle, 0))
    said = _load_two_ranks(bundle)
    for msg in said:
        assert msg is not None and msg.startswith(
            f"StartRefused: the rank state files of {bundle} come from 2 different saves of "
            f"sync round 2 (ranks [0]; ranks [1], each from its own)"), msg
    assert _load_two_ranks(other) == [None, None]  # (its own files: whole)
    state = torch.load(rank_state_path(other, 0), weights_only=False)
    del state["save_id"]  # (as a file written before save ids: with others that have one)
    torch.save(seal_rank_state(state), rank_state_path(bundle, 0))
    assert all(m is not None and "come from 2 different saves" in m
               for m in _load_two_ranks(bundle))


def test_a_rank_file_damaged_on_disk_is_named_not_loaded(tmp_path):
    """A probe wrote a NaN into the tensor bytes of a rank's state file: it loaded
    silently, and the NaN reached every rank at the next sync. The file's tensors carry
    their checksum now: the damaged rank raises naming its file, the other that it could
    not start."""
    bundle = _save_two_ranks(tmp_path, seed=1)
    path = rank_state_path(bundle, 0)
    raw = bytearray(path.read_bytes())
    weight = torch.load(path, weights_only=False)["model"]["0.weight"]
    at = bytes(raw).find(weight.numpy().tobytes())
    assert at > 0
    raw[at:at + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    path.write_bytes(bytes(raw))
    said = _load_two_ranks(bundle)
    assert said[0] == (f"CheckpointError: {path} is damaged: its values do not match the "
                       f"checksum written with them. Resume from the bundle before this one, "
                       f"or delete this file to load the consensus with the inner optimizer, "
                       f"schedule and counters fresh (this rank's under the Trainer, every "
                       f"rank's under LocalSGD)"), said[0]
    assert said[1].startswith("StartRefused: ") and "ranks [0]" in said[1], said[1]
    path.unlink()  # the way on it names: the consensus, every rank's inner state fresh
    assert _load_two_ranks(bundle) == [None, None]
    path = rank_state_path(bundle, 1)  # (the checksum covers the RNG states too)
    state = torch.load(path, weights_only=False)
    state["rng"]["numpy"][1][0] ^= 1
    torch.save(state, path)
    said = _load_two_ranks(bundle)
    assert said[1].startswith(f"CheckpointError: {path} is damaged"), said[1]


def test_a_damaged_save_id_is_named_as_damage_and_older_checksums_still_load(tmp_path):
    """The checksum left the save id out: a file whose id was damaged on disk read as a
    file of another save (every rank refused, blaming a copy). Files written before the
    checksum covered the id still load."""
    bundle = _save_two_ranks(tmp_path, seed=1)
    path = rank_state_path(bundle, 0)
    state = torch.load(path, weights_only=False)
    state["save_id"] ^= 1 << 3
    torch.save(state, path)
    said = _load_two_ranks(bundle)
    assert said[0].startswith(f"CheckpointError: {path} is damaged: its values do not "
                              f"match the checksum"), said[0]
    state["save_id"] ^= 1 << 3  # as the versions before wrote it: the id not covered
    rest = {k: v for k, v in state.items() if k not in ("checksum", "save_id")}
    torch.save({**rest, "checksum": state_checksum(rest), "save_id": state["save_id"]}, path)
    assert _load_two_ranks(bundle) == [None, None]


def test_a_diverged_consensus_is_not_saved_and_the_finite_bundles_stay(tmp_path):
    """A NaN consensus saved with keep=2 pruned the run's finite bundles (a diverged run
    checkpointing every few windows loses every model worth resuming from)."""
    from flodl_shm.checkpoint.series import committed_checkpoints

    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(0)
            sgd = LocalSGD(model, sync_every=1, comm=comm)
            sgd.step(samples=4)
            first = sgd.save(tmp_path / "ck", keep=1)
            with torch.no_grad():
                model[0].weight[0, 0] = float("nan") if comm.rank == 1 else 1.0
            sgd.step(samples=4)  # the NaN reaches the consensus of both ranks
            try:
                sgd.save(tmp_path / "ck", keep=1)
            except ValueError as e:
                return first, str(e), sgd.sync().mass  # still in step
        out = cohort.run(body)
    for first, said, mass in out:
        assert said.startswith("the consensus holds NaN or inf (training diverged): save() "
                               f"refuses to write it, which would prune the series' finite "
                               f"bundles (the newest: {first})"), said
        assert mass == 0.0
    assert [p for _, p in committed_checkpoints(tmp_path / "ck")] == [out[0][0]]


class _Renamed(torch.nn.Module):
    """make_model's tensors, shapes and order under other names."""

    def __init__(self) -> None:
        super().__init__()
        ref = make_model(0)
        self.a = torch.nn.Linear(6, 8)
        self.b = torch.nn.BatchNorm1d(8)
        self.c = torch.nn.Linear(8, 3)
        self.load_state_dict({k.replace("0.", "a.").replace("1.", "b.").replace("3.", "c."): v
                              for k, v in ref.state_dict().items()})


def test_a_consensus_of_another_model_with_the_same_shapes_is_refused(tmp_path):
    """load() without a rank state loads the consensus by position: a bundle of another
    model whose tensors have the same shapes used to load silently. With the bundle's
    names it is refused, naming the first tensors that differ."""
    from flodl_shm.checkpoint.series import latest_checkpoint

    with _synced_one_rank() as sgd:
        bundle = sgd.save(tmp_path / "ck")
    rank_state_path(bundle, 0).unlink()  # the consensus only
    with FakeCohort(1) as cohort:
        with pytest.raises(ValueError, match=r"is not a checkpoint of this model: parameter p0 "
                                             r"\[8, 6\] is '0\.weight' in the checkpoint and "
                                             r"'a\.weight' in the model"):
            LocalSGD(_Renamed(), sync_every=1, comm=cohort.comm(0)).load(tmp_path / "ck")
        again = LocalSGD(make_model(0), sync_every=1, comm=cohort.comm(0))
        assert again.load(latest_checkpoint(tmp_path / "ck")).sync_round == 1


@pytest.mark.parametrize("damaged", ["fdl", "outer.fdl"])
def test_an_exact_resume_says_when_its_bundle_s_model_files_are_damaged(tmp_path, caplog,
                                                                       damaged):
    """load() with a rank state of its own reads nothing of the bundle's .fdl and
    .outer.fdl: a probe truncated each and loaded without a word, leaving a "complete"
    bundle that neither converts nor resumes on another number of ranks. The resume
    stays exact; the damage is named."""
    from flodl_shm import OuterNesterov

    with FakeCohort(1) as cohort:
        sgd = LocalSGD(make_model(0), sync_every=1, comm=cohort.comm(0), outer=OuterNesterov())
        for _ in range(3):
            with torch.no_grad():
                for p in sgd.model.parameters():
                    p.add_(0.1)
            sgd.step()  # (a sync: sync_every=1)
        bundle = sgd.save(tmp_path / "ck")
        want = [t.clone() for t in sgd.model.state_dict().values()]
    with FakeCohort(1) as cohort, caplog.at_level(logging.WARNING, logger="flodl_shm"):
        LocalSGD(make_model(1), sync_every=1, comm=cohort.comm(0), outer=OuterNesterov()
                 ).load(tmp_path / "ck")
        assert not caplog.records  # an intact bundle: nothing to say
        target = bundle.with_name(bundle.name[:-len("fdl")] + damaged)
        with open(target, "r+b") as fh:
            fh.truncate(100)
        again = LocalSGD(make_model(1), sync_every=1, comm=cohort.comm(0),
                         outer=OuterNesterov())
        again.load(tmp_path / "ck")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"{target} is damaged (") \
        and f"this resume is exact all the same (from {rank_state_path(bundle, 0).name}" in \
        said[0], said
    assert all(torch.equal(a, b) for a, b in zip(again.model.state_dict().values(), want))


def test_a_state_of_sync_every_none_loads_and_a_refused_one_changes_nothing():
    """A LocalSGD whose caller decides when to sync (``sync_every=None``) has no target:
    its state loads; a state whose outer optimizer is of another kind is refused before
    the model or the counters are touched."""
    with FakeCohort(2) as cohort:
        def body(comm):
            sgd = LocalSGD(make_model(0), sync_every=None, comm=comm)
            sgd.step(samples=2)
            state = sgd.state_dict()
            again = LocalSGD(make_model(0), sync_every=None, comm=comm)
            again.load_state_dict(state)
            loaded = (again.total_steps, again.sync_round)
            model = make_model(0)
            flodl_outer = LocalSGD(model, sync_every=2, comm=comm, outer=OuterNesterov(0.7, 0.9))
            flodl_outer.step(samples=1)
            flodl_outer.step(samples=1)  # a sync: the outer state is set
            plain = make_model(0)
            torch_outer = LocalSGD(plain, sync_every=2, comm=comm,
                                   outer=torch.optim.SGD(plain.parameters(), lr=0.7))
            before = [p.detach().clone() for p in torch_outer.model.parameters()]
            with pytest.raises(ValueError, match="a flodl_shm one; this LocalSGD's is SGD"):
                torch_outer.load_state_dict(flodl_outer.state_dict())
            after = [p.detach().clone() for p in torch_outer.model.parameters()]
            return loaded, all(torch.equal(a, b) for a, b in zip(before, after)), \
                torch_outer.total_steps

        for loaded, untouched, steps in cohort.run(body):
            assert loaded == (1, 0) and untouched and steps == 0


def test_a_state_of_another_inner_optimizer_kind_is_refused_before_anything_loads():
    with FakeCohort(1) as cohort:
        comm = cohort.comm(0)
        model = make_model(0)
        sgd = LocalSGD(model, sync_every=1, comm=comm,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        _train_steps(model, sgd, 0, 2, samples=4, window=0)
        state = sgd.state_dict()
        other = make_model(1)
        adam = LocalSGD(other, sync_every=1, comm=comm,
                        optimizer=torch.optim.Adam(other.parameters(), lr=0.01))
        before = _snapshot(other)
        with pytest.raises(ValueError, match="another kind of optimizer than the Adam built now"):
            adam.load_state_dict(state)
        assert all(torch.equal(before[k], v) for k, v in _snapshot(other).items())
        assert adam.total_steps == 0


def test_windows_sharing_a_comm_keep_their_own_wire_and_refuse_a_lost_outer_state():
    """A Comm holds one wire setting and one in-reduce outer state: each window syncs
    on its own wire whatever a later one set, and a DiLoCo whose outer state a later
    DiLoCo on the same Comm took over refuses to sync (it would step the other's
    model) instead of averaging garbage."""
    with FakeCohort(2) as cohort:
        def body(comm):
            exact = make_model(0)
            f32 = LocalSGD(exact, sync_every=1, comm=comm)
            LocalSGD(make_model(0), sync_every=1, comm=comm, bf16_wire=True)  # set it on
            with torch.no_grad():
                for p in exact.parameters():
                    p.fill_(0.1005 * (comm.rank + 1))
            f32.step(samples=1)
            mean = [p.detach().clone() for p in exact.parameters()]
            first = flodl_shm.DiLoCo(make_model(0), sync_every=1, comm=comm)
            second = flodl_shm.DiLoCo(make_model(0), sync_every=1, comm=comm)
            with pytest.raises(RuntimeError, match="another LocalSGD built on this Comm"):
                first.step(samples=1)
            return mean, second.step(samples=1)

        for mean, synced in cohort.run(body):
            a, b = (torch.tensor(0.1005 * k, dtype=torch.float32) for k in (1, 2))
            want = (a + b) * 0.5  # the float32 mean, not its bfloat16 rounding
            assert all(torch.equal(m, torch.full_like(m, want)) for m in mean), mean
            assert synced is True


def test_saving_under_a_stem_per_epoch_keeps_a_bounded_number_of_series_locks(tmp_path):
    """Each series' run lock stayed held (one open file and one .lock file per stem)
    until the rank function returned: a run saving under a stem per epoch failed at the
    process's file limit. The locks of the last SERIES_LOCKS_KEPT series are kept; a
    save into an older series takes its lock again and is not refused for holding this
    run's own bundles."""
    from flodl_shm.checkpoint.run_lock import run_lock_path
    from flodl_shm.training.local_sgd_state import SERIES_LOCKS_KEPT

    def fds() -> int:  # the descriptors open on this test's lock files
        def target(fd):
            try:
                return os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                return ""
        return sum(target(fd).startswith(str(tmp_path)) for fd in os.listdir("/proc/self/fd"))

    stems = [tmp_path / f"epoch{e}" / "ck" for e in range(SERIES_LOCKS_KEPT + 6)]

    def body(comm):
        sgd = LocalSGD(make_model(0), sync_every=1, comm=comm)
        before = None
        for i, stem in enumerate(stems):
            sgd.sync()
            sgd.save(stem)
            if i == SERIES_LOCKS_KEPT - 1 and comm.rank == 0:
                before = fds()
        after = fds() if comm.rank == 0 else None
        held = [run_lock_path(s).exists() for s in stems]
        sgd.sync()
        again = sgd.save(stems[0])  # released since: its lock is taken again
        return before, after, held, again.name, run_lock_path(stems[0]).exists()

    with FakeCohort(2) as cohort:
        (before, after, held, again, relocked), _ = cohort.run(body)
    assert after == before == SERIES_LOCKS_KEPT, "a lock per stem stayed open"
    assert held == [False] * 6 + [True] * SERIES_LOCKS_KEPT
    assert again.startswith("ck") and relocked


def test_an_optimizer_or_a_model_that_cannot_train_is_refused_at_construction():
    """An optimizer built on another model's parameters left the model untouched,
    silently (DiLoCo then averaged unchanged replicas); a model with nothing to average,
    and a string where the optimizer or the scheduler goes, were accepted too (the
    latter failing at the first save, after leaving a lock file)."""
    model, other = make_model(0), make_model(1)
    with FakeCohort(1) as cohort:
        comm = cohort.comm(0)
        with pytest.raises(ValueError, match=r"the optimizer trains \d+ of its \d+ tensors "
                                             r"outside this model's parameters"):
            LocalSGD(model, sync_every=2, comm=comm,
                     optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"the model \(ReLU\) has no parameters and no "
                                             r"floating-point buffers"):
            LocalSGD(torch.nn.ReLU(), sync_every=2, comm=comm)
        with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
            LocalSGD(model, sync_every=2, comm=comm, optimizer="sgd")
        with pytest.raises(TypeError, match="scheduler must be an LR scheduler"):
            LocalSGD(model, sync_every=2, comm=comm, scheduler="cosine")
        part = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)  # a part: fine
        assert LocalSGD(model, sync_every=2, comm=comm, optimizer=part).optimizer is part


@contextlib.contextmanager
def _synced_one_rank():
    """A one-rank LocalSGD right after its first sync (where save() may be called)."""
    with FakeCohort(1) as cohort:
        sgd = LocalSGD(make_model(0), sync_every=1, comm=cohort.comm(0))
        sgd.sync()
        yield sgd


def test_a_folder_given_as_the_stem_is_refused_before_anything_is_written(tmp_path):
    """sgd.save('checkpoints') with checkpoints/ a folder wrote checkpoints-r….fdl and a
    checkpoints.lock beside it."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    with _synced_one_rank() as sgd:
        with pytest.raises(ValueError, match=r"checkpoints is a folder: .* pass a stem inside "
                                             r"it, e.g. .*checkpoints/ckpt"):
            sgd.save(folder)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]
        assert sgd.save(folder / "ckpt").parent == folder
    with pytest.raises(ValueError, match=r"checkpoints is a folder"):
        flodl_shm.Trainer(make_model, torch.optim.SGD, (torch.zeros(4, 6), torch.zeros(4)),
                          torch.nn.functional.mse_loss, save_path=folder)


def test_a_stem_whose_checkpoint_names_pass_the_file_system_limits_is_refused_up_front(
        tmp_path):
    """A probe's Trainer with a 236-byte stem trained 10 windows, then its first checkpoint
    failed (OSError: File name too long, a rank's optimizer state ``<stem>-r00000010.
    rank1.optim`` plus its temp suffix): refused now at construction, and by save()
    before anything is written, naming the limit and the longest name that fits."""
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    fits = tmp_path / ("x" * (limit - 47))  # (47: what the longest file adds to the stem)
    over = tmp_path / ("x" * (limit - 46))
    deep = tmp_path.joinpath(*["d" * 200] * 21, "ckpt")  # (over PATH_MAX, 4096 here)
    with _synced_one_rank() as sgd:
        with pytest.raises(ValueError, match=rf"is {limit - 46} bytes, and a checkpoint's "
                                             rf"files add up to 47 to it .* limit of {limit} "
                                             rf"bytes on a file name. Shorten the name to at "
                                             rf"most {limit - 47} bytes"):
            sgd.save(over)
        with pytest.raises(ValueError, match=r"limit of 4095 bytes on a path. Save in a "
                                             r"folder with a shorter path"):
            sgd.save(deep)
        assert sorted(p.name for p in tmp_path.iterdir()) == []
        assert sgd.save(fits).name == fits.name + "-r00000001.fdl"  # (its longest fits too)
    for stem in (over, deep):
        with pytest.raises(ValueError, match=r"Shorten the name|shorter path"):
            flodl_shm.Trainer(make_model, torch.optim.SGD, (torch.zeros(4, 6), torch.zeros(4)),
                              torch.nn.functional.mse_loss, save_path=stem)


def test_a_stem_under_an_unexpanded_tilde_or_given_as_bytes_is_refused_naming_it(
        tmp_path, monkeypatch):
    """A checkpoint probe: save('~/tx/ckpt'), Trainer(save_path='~/tx/ckpt') and the demo's
    --run-dir=~/tx made a folder named ~ in the current one (the demo then printed its
    checkpoint as ~/tx/..., which a shell reads as the home folder); bytes paths raised
    pathlib's TypeError, which names no path."""
    monkeypatch.chdir(tmp_path)
    with _synced_one_rank() as sgd:
        with pytest.raises(ValueError, match=r"'~/tx/ckpt' starts with ~, which is not "
                                             r"expanded here .* pass os.path.expanduser\("
                                             r"'~/tx/ckpt'\) for your home folder, or "
                                             r"'./~/tx/ckpt' for a folder named ~"):
            sgd.save("~/tx/ckpt")
        for call in (sgd.save, sgd.load):
            with pytest.raises(TypeError, match=r"checkpoint path b'tx/ckpt' is bytes: pass a "
                                                r"str or a pathlib.Path"):
                call(b"tx/ckpt")
        assert list(tmp_path.iterdir()) == []
        sgd.save("./~/tx/ckpt")  # (a folder named ~, meant so: said so)
        assert (tmp_path / "~" / "tx" / "ckpt-r00000001.fdl").is_file()
    for stem, error in (("~/tx/ckpt", ValueError), (b"tx/ckpt", TypeError)):
        with pytest.raises(error, match=r"starts with ~|is bytes"):
            flodl_shm.Trainer(make_model, torch.optim.SGD, (torch.zeros(4, 6), torch.zeros(4)),
                              torch.nn.functional.mse_loss, save_path=stem)


class _WithRunningMean(torch.nn.Module):
    """A float buffer registered with persistent=False (averaged, but not in the model's
    state_dict) and an integer one, both changed by every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)
        self.register_buffer("ema", torch.zeros(4), persistent=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
            self.calls += 1
        return self.lin(x - self.ema)


def test_a_state_restores_the_buffers_the_models_state_dict_leaves_out():
    """A resume from a full-state bundle left persistent=False buffers at their fresh
    values (the model's state_dict does not hold them), so the resumed run differed."""
    with FakeCohort(1) as cohort:
        def body(comm):
            model = _WithRunningMean()
            sgd = LocalSGD(model, sync_every=2, comm=comm)
            for k in range(3):
                model(torch.full((2, 4), float(k + 1)))
                sgd.step(samples=2)
            state = sgd.state_dict()
            fresh = _WithRunningMean()
            LocalSGD(fresh, sync_every=2, comm=comm).load_state_dict(state)
            other = torch.nn.Module()  # a model without them: refused, naming them
            other.lin = torch.nn.Linear(4, 2)
            other.register_buffer("ema", torch.zeros(5), persistent=False)
            with pytest.raises(ValueError, match=r"non-persistent buffer\(s\) ema \(saved \(4,\) "
                                                 r"torch.float32, model \(5,\) torch.float32\); "
                                                 r"calls \(saved \(\) torch.int64, model has "
                                                 r"none\)"):
                LocalSGD(other, sync_every=2, comm=comm).load_state_dict(state)
            return model, fresh

        [(model, fresh)] = cohort.run(body)
    assert int(model.calls) == 3 and float(model.ema[0]) != 0.0
    assert torch.equal(fresh.ema, model.ema) and torch.equal(fresh.calls, model.calls)


def test_a_guard_or_cadence_factory_of_the_wrong_kind_is_refused_at_construction():
    """guard="trend" failed at the second sync (AttributeError: no check); a factory
    returning an int failed deep in ElChe's first use."""
    with FakeCohort(2) as cohort:
        def body(comm):
            with pytest.raises(TypeError, match="guard must be a convergence guard .* got "
                                                "'trend'"):
                LocalSGD(make_model(0), sync_every=2, comm=comm, cadence="elche", guard="trend")
            with pytest.raises(TypeError, match="the cadence factory must return an ElChe for "
                                                "world_size 2, got int"):
                LocalSGD(make_model(0), sync_every=2, comm=comm, cadence=lambda ws: 5)
            return True

        assert cohort.run(body) == [True, True]


def test_one_rank_whose_elche_starts_elsewhere_is_named_on_every_rank():
    """The probe's case: rank 0's ElChe at anchor 4, rank 1's at 8, sync_every=4. Refusing
    rank 1's alone before the settings round would leave rank 0 waiting in it (under
    torchrun until the group's timeout); every rank names the difference instead."""
    def body(comm):
        try:
            LocalSGD(make_model(0), sync_every=4, comm=comm,
                     cadence=ElChe(2, 4 if comm.rank == 0 else 8))
        except ValueError as e:
            return str(e)
        return None

    with FakeCohort(2, timeout=20) as cohort:
        out = cohort.run(body)
    assert all(o is not None and o.startswith("the ranks differ in cadence") for o in out), out


@pytest.mark.parametrize("keep", [0, 0.5], ids=["freed", "shrunk"])
def test_a_storage_freed_or_shrunk_after_a_sync_is_refused_not_written(keep):
    """A regression probe: a parameter's storage freed (FSDP-style,
    ``untyped_storage().resize_(0)``) or shrunk after a sync crashed the next sync (the
    rounds wrote every element through the storage's new address). It raises now,
    naming the parameter, before any round; with the storage's size given back and
    refilled, the sync goes on."""
    with FakeCohort(2) as cohort:
        def body(comm):
            model = make_model(seed=0)
            sgd = LocalSGD(model, sync_every=1, comm=comm)
            assert sgd.step(samples=1)
            storage = model[0].weight.untyped_storage()
            size = storage.nbytes()
            storage.resize_(int(size * keep))
            with pytest.raises(RuntimeError, match=r"parameter '0.weight' of the model no "
                               r"longer has storage for all its elements \(freed or shrunk"):
                sgd.step(samples=1)
            storage.resize_(size)
            with torch.no_grad():
                model[0].weight.fill_(float(comm.rank))
            assert sgd.step(samples=1)
            return model[0].weight[0, 0].item()

        assert cohort.run(body) == [0.5, 0.5]
