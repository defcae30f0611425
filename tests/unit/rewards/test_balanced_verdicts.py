"""``outcome``'s ``balance_verdicts``: the verifier's expected reward is its balanced accuracy, so a
verdict that ignores the answer cannot win on a team that is mostly wrong (docs/real-model.md: unbalanced,
SmolLM2's verifier learned to reject everything)."""

from __future__ import annotations

import random

import pytest

from teamrl.rewards.base import ActView, get_reward


def _episode(answer: str, verdict: str) -> list[ActView]:
    solver = ActView(0, "solver", "solver", "solver", 0, answer, answer, [], [0])
    verifier = ActView(1, "verifier", "verifier", "verifier", 0, verdict, verdict, [0], [1])
    return [solver, verifier]


def _mean_verdict_reward(policy: str, balance: bool, p_right: float = 0.16, n: int = 4000) -> float:
    reward = get_reward("outcome", reward="math", verifier_role="verifier", balance_verdicts=balance)
    rng = random.Random(0)
    total = 0.0
    for _ in range(n):
        right = rng.random() < p_right
        answer = "Answer: 7" if right else "Answer: 9"
        accept = {"accept": True, "reject": False, "coin": rng.random() < 0.5, "perfect": right}[policy]
        verdict = "VERDICT: correct" if accept else "VERDICT: wrong"
        total += reward.episode({"answer": "7"}, _episode(answer, verdict)).acts[1]
    return total / n


@pytest.mark.parametrize("policy", ["accept", "reject", "coin"])
def test_an_uninformed_verdict_earns_one_half(policy: str) -> None:
    assert _mean_verdict_reward(policy, balance=True) == pytest.approx(0.5, abs=0.05)


def test_a_perfect_verifier_earns_one_and_beats_rejecting_everything() -> None:
    assert _mean_verdict_reward("perfect", balance=True) == pytest.approx(1.0, abs=0.05)
    # unbalanced, rejecting everything earns the wrong answers' share: close to a perfect verifier
    assert _mean_verdict_reward("reject", balance=False) == pytest.approx(0.84, abs=0.03)


def test_the_window_must_hold_one_act() -> None:
    with pytest.raises(ValueError, match="verdict_window"):
        get_reward("outcome", reward="math", verifier_role="verifier", verdict_window=0.5)


def test_episodes_scored_on_several_threads_lose_no_count() -> None:
    """The rollout scores episodes on worker threads: every verifier act enters the running shares once.
    Whatever the order, the decayed total after n acts from 2 is 2 k^n + (1 - k^n) / (1 - k)."""
    from concurrent.futures import ThreadPoolExecutor

    reward = get_reward("outcome", reward="math", verifier_role="verifier", balance_verdicts=True)
    acts = [_episode("Answer: 7" if i % 3 else "Answer: 9", "VERDICT: correct") for i in range(4000)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda ep: reward.episode({"answer": "7"}, ep), acts))
    k = 1.0 - 1.0 / reward.verdict_window
    total = reward.answers_seen[True] + reward.answers_seen[False]
    assert total == pytest.approx(2 * k**4000 + (1 - k**4000) / (1 - k), rel=1e-9)


def test_the_held_out_evaluation_scores_with_a_reward_of_its_own() -> None:
    """A runner evaluates on its greedy copy of the workflow (``with_sampling(temperature=0)``), whose
    reward object is another one: held-out verdicts never move the training reward's class shares."""
    from pathlib import Path

    from teamrl.rollout.workflows import load

    bench = Path(__file__).resolve().parents[2] / "bench" / "workflows" / "math-trio-two-number.toml"
    wf = load(str(bench))
    train = wf.reward_fn()
    assert train.balance_verdicts and train is wf.reward_fn()  # one object for every training episode
    held_out = wf.with_sampling(temperature=0.0).reward_fn()
    assert held_out is not train
    held_out.episode({"answer": "7"}, _episode("Answer: 9", "VERDICT: wrong"))
    assert train.answers_seen == {True: 1.0, False: 1.0}


def test_a_profile_round_keeps_the_training_rewards_class_shares() -> None:
    """LangMARL's round gives the runner a copy of the workflow with new profiles
    (``with_profiles``); its reward is the same object, so the class shares go on, not restart at 1/1."""
    from pathlib import Path

    from teamrl.rollout.workflows import load

    bench = Path(__file__).resolve().parents[2] / "bench" / "workflows" / "math-trio-two-number.toml"
    wf = load(str(bench))
    train = wf.reward_fn()
    train.episode({"answer": "7"}, _episode("Answer: 9", "VERDICT: wrong"))
    seen = dict(train.answers_seen)
    after = wf.with_profiles({"verifier": "You check the solver's answer."})
    assert after.agent("verifier").profile == "You check the solver's answer."
    assert after.reward_fn() is train and after.reward_fn().answers_seen == seen != {True: 1.0, False: 1.0}


def test_the_reward_says_it_is_class_balanced_for_the_plans_warning() -> None:
    kw = {"reward": "math", "verifier_role": "verifier"}
    assert get_reward("outcome", **kw, balance_verdicts=True).class_balanced is True
    assert get_reward("outcome", **kw).class_balanced is False
