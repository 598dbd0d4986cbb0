"""Outer optimizers (spec §9.1): OuterAvg identity, DiLoCo Nesterov's worked example,
the flat in-place kernel, and the bit-exact agreement between all forms."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flodl_shm import OuterAvg, OuterNesterov
from flodl_shm.training.outer import avg_step_flat, nesterov_step_flat


def t(*xs):
    return torch.tensor(xs, dtype=torch.float32)


def bits(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.numpy()
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def torch_reference(prev, cons, v, lr, mu, fresh):
    """The step as literal float32 torch ops, in the documented order."""
    g = prev.sub(cons)
    v = g.clone() if fresh else v.mul(mu).add(g)
    la = v.mul(mu).add(g)
    return prev.sub(la.mul(lr)), v


def numpy_reference(prev, cons, v, lr, mu, fresh):
    """The same arithmetic with numpy float32 scalars, element by element."""
    lr32, mu32 = np.float32(lr), np.float32(mu)
    out = np.empty_like(prev)
    v = v.copy()
    for i in range(prev.shape[0]):
        g = np.float32(prev[i] - cons[i])
        vi = g if fresh else np.float32(np.float32(mu32 * v[i]) + g)
        v[i] = vi
        la = np.float32(np.float32(mu32 * vi) + g)
        out[i] = np.float32(prev[i] - np.float32(lr32 * la))
    return out, v


# --- OuterAvg -----------------------------------------------------------------------


def test_outer_avg_returns_the_consensus_unchanged():
    opt = OuterAvg()
    prev = [t(9.0, 9.0), t(1.0)]
    cons = [t(1.0, 2.0), t(-3.5)]
    out = opt.outer_step(prev, cons)
    assert len(out) == 2
    for o, c in zip(out, cons):
        assert o is c  # byte-identical: the very same tensors
    assert opt.checkpoint_state() is None
    assert opt.resets_inner() is False
    assert opt.has_momentum is False


def test_outer_avg_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="prev_global has 1 tensors but consensus has 2"):
        OuterAvg().outer_step([t(1.0)], [t(1.0), t(2.0)])


def test_avg_step_flat_copies_the_consensus():
    prev = np.array([5, 6, 7], np.float32)
    cons = np.array([1, 2, 3], np.float32)
    out = np.zeros(3, np.float32)
    avg_step_flat(prev, cons, out)
    assert out.tolist() == [1, 2, 3]
    avg_step_flat(prev, cons, cons)  # out is the consensus itself: nothing to do
    assert cons.tolist() == [1, 2, 3]


# --- OuterNesterov: the spec's worked example --------------------------------------------


def test_nesterov_worked_example_lr_half_mu_0_9():
    opt = OuterNesterov(lr=0.5, momentum=0.9)
    # Window 1: prev = consensus -> g = 0 -> unchanged.
    out = opt.outer_step([t(1.0, 2.0)], [t(1.0, 2.0)])
    assert out[0].tolist() == [1.0, 2.0]
    # Window 2: g = [0.5, 1]; v = g; new = prev - 0.5*(0.9*v + g).
    out = opt.outer_step([t(1.0, 2.0)], [t(0.5, 1.0)])
    assert out[0].tolist() == pytest.approx([0.525, 1.05], abs=1e-6)
    # Window 3: g = [0.025, 0.05]; v = 0.9*[0.5,1] + g = [0.475, 0.95].
    out = opt.outer_step([out[0]], [t(0.5, 1.0)])
    assert out[0].tolist() == pytest.approx([0.29875, 0.5975], abs=1e-6)
    mom = opt.checkpoint_state()
    assert mom[0].tolist() == pytest.approx([0.475, 0.95], abs=1e-6)


def test_nesterov_contract_flags_and_state():
    opt = OuterNesterov()
    assert (opt.lr, opt.mu) == (0.7, 0.9)
    assert opt.resets_inner() is True
    assert opt.has_momentum is True
    assert opt.checkpoint_state() is None  # nothing to save before the first step
    opt.outer_step([t(1.0)], [t(1.0)])
    state = opt.checkpoint_state()
    assert [s.tolist() for s in state] == [[0.0]]


def test_checkpoint_state_is_a_copy():
    opt = OuterNesterov(0.5, 0.9)
    opt.outer_step([t(1.0, 2.0)], [t(0.5, 1.0)])
    snap = opt.checkpoint_state()
    opt.outer_step([t(1.0, 2.0)], [t(0.5, 1.0)])
    assert snap[0].tolist() == [0.5, 1.0]


def test_resume_from_checkpoint_continues_bit_identically():
    """Saving the momentum mid-run and loading it into a fresh optimizer must give the
    same next global as never stopping."""
    rng = np.random.default_rng(3)
    shapes = [(3, 4), (5,)]
    seq = [[torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in shapes]
           for _ in range(4)]
    a = OuterNesterov(0.7, 0.9)
    g = a.outer_step(seq[0], seq[0])
    g = a.outer_step(g, seq[1])
    b = OuterNesterov(0.7, 0.9)
    b.load_checkpoint_state(a.checkpoint_state())
    ga = a.outer_step(g, seq[2])
    gb = b.outer_step(g, seq[2])
    for x, y in zip(ga, gb):
        assert np.array_equal(bits(x), bits(y))


def test_parameter_count_change_restarts_momentum():
    opt = OuterNesterov(0.5, 0.9)
    opt.outer_step([t(1.0, 2.0)], [t(0.5, 1.0)])  # momentum [0.5, 1]
    out = opt.outer_step([t(1.0), t(2.0)], [t(0.5), t(1.0)])  # 2 params now: fresh
    assert [o.tolist() for o in out] == [pytest.approx([0.525]), pytest.approx([1.05])]


def test_shape_mismatches_are_named():
    opt = OuterNesterov()
    with pytest.raises(ValueError, match=r"parameter 0: prev_global shape \(2,\) != consensus shape \(3,\)"):
        opt.outer_step([t(1.0, 2.0)], [t(1.0, 2.0, 3.0)])
    opt.load_checkpoint_state([t(0.0, 0.0)])
    with pytest.raises(ValueError, match="outer momentum shape"):
        opt.outer_step([t(1.0, 2.0, 3.0)], [t(1.0, 2.0, 3.0)])
    with pytest.raises(ValueError, match="dtype torch.float64"):
        opt.outer_step([torch.zeros(2, dtype=torch.float64)], [torch.zeros(2, dtype=torch.float64)])


def test_non_finite_or_out_of_range_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="lr must be finite"):
        OuterNesterov(lr=float("nan"))
    with pytest.raises(ValueError, match="lr must be >= 0, got -0.7"):
        OuterNesterov(lr=-0.7)
    for mu in (1.0, 1.5, -0.1):  # from 1 up the velocity grows without bound
        with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
            OuterNesterov(lr=0.7, momentum=mu)
    OuterNesterov(lr=0.0, momentum=0.0)  # the edges: no outer movement, no momentum


# --- the flat kernel: bit-exact forms -------------------------------------------------------


@pytest.mark.parametrize("fresh", [True, False])
def test_flat_kernel_matches_torch_ops_and_numpy_scalars_bitwise(fresh):
    rng = np.random.default_rng(11)
    n = 1031  # not a multiple of any vector width: exercises the loop tails
    prev = (rng.standard_normal(n) * 3).astype(np.float32)
    cons = (prev + rng.standard_normal(n).astype(np.float32) * 0.1).astype(np.float32)
    v0 = rng.standard_normal(n).astype(np.float32)
    lr, mu = 0.7, 0.9

    mom = v0.copy()
    out = np.empty(n, np.float32)
    nesterov_step_flat(prev, cons, mom, lr, mu, fresh, out)

    t_out, t_v = torch_reference(torch.from_numpy(prev), torch.from_numpy(cons),
                                 torch.from_numpy(v0), lr, mu, fresh)
    n_out, n_v = numpy_reference(prev, cons, v0, lr, mu, fresh)
    assert np.array_equal(bits(out), bits(t_out))
    assert np.array_equal(bits(mom), bits(t_v))
    assert np.array_equal(bits(out), bits(n_out))
    assert np.array_equal(bits(mom), bits(n_v))


def test_stepping_two_halves_equals_stepping_whole():
    """The single-host engine steps each rank's slice separately: results must be
    bit-identical to one whole-vector step, over several windows."""
    rng = np.random.default_rng(5)
    n = 997
    cut = 413
    whole_prev = rng.standard_normal(n).astype(np.float32)
    split_prev = whole_prev.copy()
    whole_mom = np.zeros(n, np.float32)
    split_mom = np.zeros(n, np.float32)
    for window in range(4):
        cons = (whole_prev + rng.standard_normal(n).astype(np.float32) * 0.05).astype(np.float32)
        fresh = window == 0
        out_w = np.empty(n, np.float32)
        nesterov_step_flat(whole_prev, cons, whole_mom, 0.7, 0.9, fresh, out_w)
        # split: each "rank" steps its own slice, writing the new global in place of prev
        for lo, hi in ((0, cut), (cut, n)):
            nesterov_step_flat(split_prev[lo:hi], cons[lo:hi], split_mom[lo:hi], 0.7, 0.9,
                               fresh, split_prev[lo:hi])
        whole_prev = out_w
        assert np.array_equal(bits(whole_prev), bits(split_prev)), f"window {window}"
        assert np.array_equal(bits(whole_mom), bits(split_mom)), f"window {window}"


def test_tensor_outer_step_equals_flat_step_on_the_concatenation():
    rng = np.random.default_rng(8)
    shapes = [(4, 3), (7,), (2, 2, 2)]
    sizes = [int(np.prod(s)) for s in shapes]
    opt = OuterNesterov(0.7, 0.9)
    flat_prev = rng.standard_normal(sum(sizes)).astype(np.float32)
    flat_mom = np.zeros(sum(sizes), np.float32)

    def split(vec):
        out, at = [], 0
        for s, k in zip(shapes, sizes):
            out.append(torch.from_numpy(vec[at:at + k].copy()).reshape(s))
            at += k
        return out

    prev_list = split(flat_prev)
    for window in range(3):
        flat_cons = (flat_prev + rng.standard_normal(flat_prev.size).astype(np.float32) * 0.1
                     ).astype(np.float32)
        new_list = opt.outer_step(prev_list, split(flat_cons))
        out = np.empty_like(flat_prev)
        nesterov_step_flat(flat_prev, flat_cons, flat_mom, 0.7, 0.9, window == 0, out)
        flat_prev = out
        got = np.concatenate([x.reshape(-1).numpy() for x in new_list])
        assert np.array_equal(bits(got), bits(flat_prev)), f"window {window}"
        prev_list = new_list
    mom = np.concatenate([m.reshape(-1).numpy() for m in opt.checkpoint_state()])
    assert np.array_equal(bits(mom), bits(flat_mom))


def test_step_flat_method_and_empty_slice():
    opt = OuterNesterov(0.5, 0.9)
    prev = np.array([1.0, 2.0], np.float32)
    cons = np.array([0.5, 1.0], np.float32)
    mom = np.zeros(2, np.float32)
    opt.step_flat(prev, cons, mom, True, prev)  # in place over prev
    assert prev.tolist() == pytest.approx([0.525, 1.05], abs=1e-6)
    e = np.zeros(0, np.float32)
    nesterov_step_flat(e, e, e.copy(), 0.7, 0.9, False, e)  # a rank with an empty slice
    with pytest.raises(ValueError, match="momentum slice"):
        opt.step_flat(prev, cons, None, False, prev)


def test_flat_kernel_validates_before_touching_memory():
    a = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="consensus must be a 1-D float32"):
        nesterov_step_flat(a, np.zeros(4, np.float64), a.copy(), 0.7, 0.9, True, a.copy())
    with pytest.raises(ValueError, match="out has 3 elements but prev has 4"):
        nesterov_step_flat(a, a.copy(), a.copy(), 0.7, 0.9, True, np.zeros(3, np.float32))
