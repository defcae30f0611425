"""The naive-PPO baseline of the staleness experiment: ``objective = "ppo-behaviour"`` clips around
the behaviour log-probs, and ``--policy-lag`` is refused outside sync mode before anything starts."""

from __future__ import annotations

import subprocess
import sys

import torch

from teamrl.learner.objectives import policy_terms
from teamrl.learner.settings import ObjectiveSettings


def test_ppo_behaviour_draws_the_clip_around_mu_and_ppo_around_pi_prox() -> None:
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.0, -2.0]])  # the learner's current weights: ratio 1, inside the clip
    behav = torch.tensor([[-2.0, -3.0]])  # a stale sampler: pi/mu = e, far outside it
    adv, mask, clip = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool), (0.2, 0.2)
    naive = policy_terms(
        ObjectiveSettings(objective="ppo-behaviour"), False, logp, prox, behav, adv, mask, clip
    )
    plain = policy_terms(ObjectiveSettings(objective="ppo"), False, logp, prox, behav, adv, mask, clip)
    assert torch.allclose(naive.ratio, torch.full((1, 2), torch.e)) and bool(naive.clipped.all())
    assert torch.allclose(plain.ratio, torch.ones(1, 2)) and not bool(plain.clipped.any())
    naive.loss.sum().backward()
    assert float(logp.grad.abs().sum()) == 0.0  # every token clipped: naive PPO learns nothing here


def test_policy_lag_needs_sync_mode() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", "run", "--workflow", "addition-duo", "--policy-lag", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--policy-lag needs --mode sync" in proc.stderr
