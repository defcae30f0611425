"""Held-out metrics a constant cannot fool: a verifier's balanced accuracy and accept rate, and the
team's accuracy after routing against the answering agent's first try (teamrl.rollout.runner)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from teamrl.rollout.runner import answer_agents, evaluation_metrics, verifier_agents
from teamrl.rollout.workflows import load


def step(agent: str, reward: float, parents=()):
    return SimpleNamespace(agent_id=agent, reward=reward, parents=np.asarray(parents, np.int32))


def duo(solver_ok: bool, verdict_right: bool):
    steps = [step("solver", float(solver_ok)), step("verifier", float(verdict_right), [0])]
    return SimpleNamespace(reward=float(solver_ok), steps=steps)


def test_a_constant_verdict_scores_half_balanced_accuracy_whatever_the_class_balance() -> None:
    # 39 % correct answers, a verifier that always says "wrong": plain accuracy 0.61, balanced 0.5
    trajs = [duo(i < 39, verdict_right=i >= 39) for i in range(100)]
    m = evaluation_metrics(trajs, ["verifier"], ["solver"])
    assert m["verifier_accuracy"] == pytest.approx(0.61)
    assert m["verifier_balanced_accuracy"] == pytest.approx(0.5) and m["verifier_accept_rate"] == 0.0
    assert m["solver_accuracy"] == m["reward_mean"] == pytest.approx(0.39)
    assert "first_try_accuracy" not in m  # nobody acted twice: no routing to compare with


def test_a_perfect_verifier_and_one_that_accepts_half_the_wrong_answers() -> None:
    perfect = [duo(i % 2 == 0, True) for i in range(10)]
    assert evaluation_metrics(perfect, ["verifier"])["verifier_balanced_accuracy"] == 1.0
    # all correct answers accepted (TA 1.0); of the wrong ones, half accepted (TR 0.5)
    half = [duo(True, True)] * 4 + [duo(False, True), duo(False, False)] * 2
    m = evaluation_metrics(half, ["verifier"])
    assert m["verifier_balanced_accuracy"] == pytest.approx(0.75)
    assert m["verifier_accept_rate"] == pytest.approx(6 / 8)


def test_team_accuracy_after_routing_against_the_first_try() -> None:
    # planner, solver (wrong), verifier rejects, solver again (right): team 1.0, first try 0.0
    steps = [
        step("planner", 1.0),
        step("solver", 0.0, [0]),
        step("verifier", 1.0, [1]),
        step("solver", 1.0, [0, 2]),
    ]
    t = SimpleNamespace(reward=1.0, steps=steps)
    m = evaluation_metrics([t], ["verifier"], ["solver"])
    assert m["reward_mean"] == 1.0 and m["first_try_accuracy"] == 0.0


def test_which_agents_answer_and_which_verify_come_from_the_workflow() -> None:
    trio = load("math-trio")
    assert answer_agents(trio) == ["solver"] and verifier_agents(trio) == ["verifier"]
    data = load("addition-duo").model_dump()
    data["reward"]["answer_from"] = "verifier"
    from teamrl.rollout.workflow import Workflow

    assert answer_agents(Workflow.from_dict(data)) == ["verifier"]
    assert verifier_agents(load("math-duo")) == []


def test_an_unparsable_verdict_is_neither_an_accept_nor_a_reject() -> None:
    def verdict(text: str):
        return {"VERDICT: correct": True, "VERDICT: wrong": False}.get(text)

    def duo_text(solver_ok: bool, text: str):
        steps = [step("solver", float(solver_ok)), step("verifier", 0.0, [0])]
        steps[1].response_text = text
        return SimpleNamespace(reward=float(solver_ok), steps=steps)

    babble = [duo_text(i < 3, "the answer") for i in range(10)]  # never a verdict
    m = evaluation_metrics(babble, ["verifier"], ["solver"], verdict)
    assert m["verifier_accept_rate"] == 0.0 and m["verifier_balanced_accuracy"] == 0.0
    right = [duo_text(True, "VERDICT: correct"), duo_text(False, "VERDICT: wrong")]
    assert evaluation_metrics(right, ["verifier"], ["solver"], verdict)["verifier_balanced_accuracy"] == 1.0
