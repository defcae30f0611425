"""``learner.advantage_std``: dividing each group by its std undoes a class-balanced verdict reward.

A verifier that ignores the answer (a coin) on a team that is mostly wrong, scored by ``outcome`` with
``balance_verdicts`` (each correct verdict weighted by 1 / (2 x its class's share)): its expected reward
is 0.5 whichever way it leans, so the policy gradient on "reject" should be 0. Under Dr. MAS's
normalisation the groups whose answers are all wrong (most of them) get their small, reject-favouring
rewards scaled up to unit spread, the rare right answers' large weights are scaled down, and the coin is
pushed to reject everything, as SmolLM2's verifier was (docs/real-model.md). Centred only
(``advantage_std = false``, as Dr. GRPO), the push is 0 within the noise.
"""

from __future__ import annotations

import random

import torch

from teamrl.learner.advantages import outcome_advantages
from teamrl.rewards.base import ActView, get_reward


def _push_to_reject(scale: bool, batches: int = 16, groups: int = 64, size: int = 8) -> tuple[float, float]:
    """Mean and standard error over batches of E[A x (reject - 1/2)] / E|A| for a coin verifier."""
    rng = random.Random(0)
    reward = get_reward("outcome", reward="math", verifier_role="verifier", balance_verdicts=True)
    pushes = []
    for _ in range(batches):
        rewards, group, rejects = [], [], []
        for g in range(groups):
            p_right = rng.betavariate(0.3, 1.6)  # the solver's rate on this task: mean 0.16, most near 0
            for _ in range(size):
                answer = "Answer: 7" if rng.random() < p_right else "Answer: 9"
                reject = rng.random() < 0.5
                verdict = "VERDICT: wrong" if reject else "VERDICT: correct"
                acts = [
                    ActView(0, "solver", "solver", "solver", 0, answer, answer, [], [0]),
                    ActView(1, "verifier", "verifier", "verifier", 0, verdict, verdict, [0], [1]),
                ]
                rewards.append(reward.episode({"answer": "7"}, acts).acts[1])
                group.append(g)
                rejects.append(float(reject) - 0.5)
        ids = torch.tensor(group), torch.zeros(len(group), dtype=torch.long)
        adv = outcome_advantages(
            "drmas", torch.tensor(rewards), *ids, torch.arange(len(group)), ids[1], scale=scale
        )
        pushes.append(float((adv * torch.tensor(rejects)).mean() / adv.abs().mean()))
    t = torch.tensor(pushes)
    return float(t.mean()), float(t.std() / len(pushes) ** 0.5)


def test_the_groups_std_pushes_a_coin_verifier_to_reject_and_centring_alone_does_not() -> None:
    scaled, scaled_se = _push_to_reject(scale=True)
    centred, centred_se = _push_to_reject(scale=False)
    assert scaled > 10 * scaled_se and scaled > 0.15, (scaled, scaled_se)
    assert abs(centred) < 3 * centred_se + 0.01, (centred, centred_se)


def test_the_setting_reaches_the_engine_and_dr_grpo_stays_unscaled() -> None:
    from teamrl.learner.config import LearnerConfig
    from teamrl.learner.settings import EngineSettings

    cfg = LearnerConfig(adapters=["a"], advantage_std=False, probe_prompt=[1], probe_completion=[2])
    assert EngineSettings.from_config(cfg).objective.advantage_std is False
    r, g = torch.tensor([0.0, 1.0, 3.0, 0.0]), torch.tensor([0, 0, 0, 1])
    z = torch.zeros(4, dtype=torch.long)
    for scale in (True, False):
        dr = outcome_advantages("dr_grpo", r, g, z, torch.arange(4), z, "zero", scale=scale)
        assert torch.allclose(dr, torch.tensor([-4 / 3, -1 / 3, 5 / 3, 0.0]))
    drmas = outcome_advantages("drmas", r, g, z, torch.arange(4), z, "zero", scale=False)
    assert torch.allclose(drmas, torch.tensor([-4 / 3, -1 / 3, 5 / 3, 0.0]))
