"""``outcome``'s ``role_scale`` (``teamrl run --reward-scale``): a role's act scores multiplied, the turn
and trajectory rewards following the scaled answering acts, other roles keeping the team outcome; and
the plan accepts ``--reward-scale`` for a workflow scored by ``outcome`` (it refused it before)."""

from __future__ import annotations

from teamrl.rewards.base import ActView, get_reward


def _duo(answer: str) -> list[ActView]:
    planner = ActView(0, "planner", "planner", "planner", 0, "1. add", "1. add", [], [0])
    solver = ActView(1, "solver", "solver", "solver", 0, answer, answer, [0], [1])
    return [planner, solver]


def test_the_scaled_role_gets_its_score_times_the_scale_and_the_others_the_outcome() -> None:
    reward = get_reward("outcome", reward="math", role_scale={"solver": 10.0})
    right = reward.episode({"answer": "7"}, _duo("Answer: 7"))
    assert right.acts == [1.0, 10.0] and right.turns == [10.0] and right.trajectory == 10.0
    wrong = reward.episode({"answer": "7"}, _duo("Answer: 9"))
    assert wrong.acts == [0.0, 0.0] and wrong.trajectory == 0.0
    plain = get_reward("outcome", reward="math").episode({"answer": "7"}, _duo("Answer: 7"))
    assert plain.acts == [1.0, 1.0] and plain.trajectory == 1.0


def test_the_plan_takes_a_reward_scale_for_an_outcome_workflow() -> None:
    import argparse

    from teamrl.cli.plan import _check_reward_scale
    from teamrl.rollout.workflows import load

    _check_reward_scale(load("math-duo"), argparse.Namespace(reward_scale=["solver=10"]))  # no PlanError
