"""The launcher's failure policy as a value (``launch/failure_budget.py``): when deaths
stop the cohort, and what the log says of them. The spawn tests run it with real ranks
dying; these pin each rule on its own."""
from __future__ import annotations

import dataclasses

import pytest

from flodl_shm.launch.failure_budget import FailureBudget


def test_the_cohort_goes_on_until_one_death_past_max_failures():
    budget = FailureBudget(first_rank=0, nprocs=4, world_size=4, max_failures=1)
    assert not budget.stops([])
    assert not budget.stops([2])
    assert budget.stops([2, 3])
    assert budget.stops([2], local_more=1)  # a stalled rank about to be killed counts
    assert budget.why_stop(2) == "2 failures exceed max_failures=1"
    assert budget.survivors_go_on(1) == ("continuing on realized work with the survivors "
                                         "(1 of max_failures=1 used)")


def test_with_no_rank_left_the_last_failure_stops_it_whatever_the_budget():
    budget = FailureBudget(first_rank=0, nprocs=2, world_size=2, max_failures=5)
    assert not budget.stops([0])
    assert budget.stops([0, 1])
    assert budget.why_stop(2) == "no rank is left"
    assert FailureBudget(0, 1, 1, 0).why_stop(1) == "1 failure exceeds max_failures=0"


def test_ranks_of_other_hosts_count_cohort_wide_but_are_not_this_hosts():
    # this host runs global ranks 2 and 3 of 6
    budget = FailureBudget(first_rank=2, nprocs=2, world_size=6, max_failures=2)
    assert budget.local([0, 1, 2, 3, 4, 5]) == [2, 3]
    assert budget.local([5, 3, 0]) == [3]
    assert [r for r in range(6) if budget.is_local(r)] == [2, 3]
    assert not budget.stops([0, 5])
    assert budget.stops([0, 5, 4])


def test_survivors_that_save_are_stopped_only_when_none_of_this_host_is_left():
    budget = FailureBudget(first_rank=2, nprocs=2, world_size=6, max_failures=1,
                           survivors_save=True)
    assert not budget.stops([0, 4, 5])  # past the budget: the survivors save and stop
    assert not budget.stops([0, 2])
    assert budget.stops([2, 3])
    assert budget.stops([3], local_more=1)
    assert budget.survivors_go_on(3) == (
        "3 failures, more than max_failures=1: the survivors save a checkpoint of the "
        "realized work, if any, and stop")


def test_a_budget_is_a_value():
    budget = FailureBudget(0, 2, 2, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        budget.max_failures = 1
    assert budget == FailureBudget(0, 2, 2, 0, survivors_save=False)
