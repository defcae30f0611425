"""A rollout starts at most ``max_groups_per_version`` groups while the lowest live adapter version
stays the same (teamrl.rollout.service.VersionBudget): a slow, restarting or finished learner leaves
the rollout waiting instead of flooding the buffer with data it would drop."""

from __future__ import annotations

from teamrl.rollout import metrics as M
from teamrl.rollout.service import VersionBudget


def test_the_budget_refills_when_a_newer_version_is_live_and_the_gauge_says_when_it_waits() -> None:
    budget = VersionBudget(3)
    assert [budget.take(0) for _ in range(4)] == [True, True, True, False]
    assert M.WAITING_FOR_VERSION._value.get() == 1
    assert budget.take(0) is False  # still v0: still waiting
    assert budget.take(1) is True and M.WAITING_FOR_VERSION._value.get() == 0
    assert [budget.take(1) for _ in range(3)] == [True, True, False]


def test_zero_means_no_limit() -> None:
    budget = VersionBudget(0)
    assert all(budget.take(0) for _ in range(1000))


def test_with_a_refill_production_follows_consumption() -> None:
    """``refill`` a step's groups: the rollout stays at most ``per_version`` groups ahead (AReaL's
    bound), each new version lets one step's worth more start, and versions skipped count."""
    budget = VersionBudget(6, refill=2)
    assert [budget.take(0) for _ in range(7)] == [True] * 6 + [False]
    assert [budget.take(1) for _ in range(3)] == [True, True, False]  # one version: 2 more
    assert [budget.take(3) for _ in range(5)] == [True] * 4 + [False]  # two versions: 4 more
    assert [budget.take(9) for _ in range(7)] == [True] * 6 + [False]  # never more than 6 ahead
    # one int per base: the base that advanced most counts (the groups train on the same episodes),
    # and a base whose learner is down does not hold the others' data back
    several = VersionBudget(4, refill=1)
    assert [several.take((0, 0)) for _ in range(5)] == [True] * 4 + [False]
    assert [several.take((1, 2)) for _ in range(3)] == [True] * 2 + [False]
    assert [several.take((1, 3)) for _ in range(2)] == [True, False]


def test_a_learner_restart_refills_the_lead_its_lost_batch_held() -> None:
    """A learner that dies loses the batch it was training on; the rollout, one step ahead before,
    would be none ahead after, and the learner would wait for every step's data (docs/reliability.md
    R-restart-lead). Each restart seen grants one refill, at most ``per_version`` ahead."""
    budget = VersionBudget(4, refill=2)
    assert [budget.take(0) for _ in range(5)] == [True] * 4 + [False]
    assert [budget.take(1) for _ in range(3)] == [True, True, False]  # a step's worth, then wait
    assert [budget.take(1, restarts=1) for _ in range(3)] == [True, True, False]  # the lost step's
    assert budget.take(1, restarts=1) is False  # counted once
    assert [budget.take(2, restarts=3) for _ in range(5)] == [True] * 4 + [False]  # capped at 4
