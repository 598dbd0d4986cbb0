"""Realized-work mass algebra (spec §4): the idle guard, the γ=1 fast path, movers."""
from __future__ import annotations

import math

import pytest

from flodl_shm.training.realized_work import gamma_mass, is_realized, mover_mass


@pytest.mark.parametrize("gamma", [1.0, 0.0, 0.5, 2.0, -1.0, -0.5])
@pytest.mark.parametrize("n", [0, -1, -7])
def test_idle_rank_has_zero_mass_for_every_gamma(n, gamma):
    # Raw powf would give 0**0 == 1 (idle rank votes) and 0**-1 == inf (NaN cohort).
    assert gamma_mass(n, gamma) == 0.0


def test_gamma_one_is_the_count_exactly():
    for n in (1, 2, 3, 17, 2**40 + 1):
        m = gamma_mass(n, 1.0)
        assert type(m) is float
        assert m == float(n)


def test_gamma_general_is_power():
    assert gamma_mass(4, 0.5) == 2.0
    assert gamma_mass(3, 2.0) == 9.0
    assert gamma_mass(4, -1.0) == 0.25
    assert gamma_mass(5, 0.0) == 1.0  # unweighted average over movers
    assert math.isclose(gamma_mass(10, 0.3), 10 ** 0.3, rel_tol=0, abs_tol=0)
    assert gamma_mass(2 ** 64, 1.0) == 2.0 ** 64  # the largest work mass


@pytest.mark.parametrize("n, gamma", [(100, 20.0), (10_000, -10.0), (10 ** 6, 100.0),
                                      (10 ** 40, 1.0), (float("inf"), 1.0), (6000, 10.0),
                                      (3 * 10 ** 38, 1.0), (2 ** 64 + 2 ** 20, 1.0)])
def test_a_mass_no_round_can_carry_is_refused_naming_n_and_gamma(n, gamma):
    """n**gamma outside float32's normal range would make every rank's consensus inf
    or NaN (the round's divisor 1/Σw, or the scale w, is not a finite float32); above
    2^64 the float32 sum of w·T overflows for ordinary parameters (6000**10 = 6e37, under
    float32's largest, turned weights of 100 into inf silently)."""
    with pytest.raises(ValueError, match=rf"n\*\*gamma = {n}\*\*{gamma:g} = .* outside"):
        gamma_mass(n, gamma)


def test_mover_mass_is_an_indicator():
    assert mover_mass(0) == 0.0
    assert mover_mass(-3) == 0.0
    assert mover_mass(1) == 1.0
    assert mover_mass(1000) == 1.0


def test_is_realized_only_for_positive_mass():
    assert is_realized(1e-30)
    assert is_realized(3.0)
    assert not is_realized(0.0)
    assert not is_realized(-0.0)
    assert not is_realized(-1.0)
    assert not is_realized(float("nan"))
