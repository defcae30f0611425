"""The critic's pure parts: row layout, GAE on rows (vs docs/algorithms.md §6 and the grid functions), EV."""

from __future__ import annotations

import math

import pytest
import torch

from teamrl.learner.advantages import AlgorithmError, action_gae, token_gae
from teamrl.learner.critic import (
    ValueHead,
    action_level_gae,
    chain_rewards,
    explained_variance,
    token_level_gae,
    trajectory_layout,
)


def test_action_level_worked_example() -> None:
    # docs/algorithms.md §6: 1 step, 2 agents, V = [0.4, 0.6], r = [0, 1], γ = 0.99, λ = 0.95
    adv, ret = action_level_gae(
        torch.tensor([0.0, 1.0]), torch.tensor([0.4, 0.6]), torch.tensor([0, 0]), 1, 0.99, 0.95
    )
    assert torch.allclose(adv, torch.tensor([0.5702, 0.4]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([0.9702, 1.0]), atol=1e-6)


def test_token_level_worked_example() -> None:
    # agent 1 V = [0.3, 0.4], agent 2 V = [0.5, 0.6], reward 1 at agent 2's last token
    values = torch.tensor([[0.3, 0.4], [0.5, 0.6]])
    adv, ret = token_level_gae(
        torch.tensor([0.0, 1.0]),
        values,
        torch.ones(2, 2, dtype=torch.bool),
        torch.tensor([0, 0]),
        1,
        0.99,
        0.95,
    )
    assert torch.allclose(adv, torch.tensor([[0.601258, 0.537223], [0.4702, 0.4]]), atol=1e-6)
    assert torch.allclose(ret, adv + values)


def _regular_rows(t_len: int, b: int, n: int, big_r: int = 5, seed: int = 0):
    """B trajectories of T turns x N agents, rows emitted trajectory by trajectory in execution order."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(t_len, b, n, generator=g)
    values = torch.randn(t_len, b, n, big_r, generator=g)
    lens = torch.randint(1, big_r + 1, (t_len, b, n), generator=g)
    tmask = torch.arange(big_r)[None, None, None, :] < lens[..., None]
    order = [(t, bi, i) for bi in range(b) for t in range(t_len) for i in range(n)]
    traj_idx = torch.tensor([bi for _, bi, _ in order])
    return rewards, values, tmask, order, traj_idx


def test_rows_match_the_turn_agent_grid_of_action_gae() -> None:
    t_len, b, n = 3, 4, 2
    rewards, values, _, order, traj_idx = _regular_rows(t_len, b, n)
    v_act = values[..., 0]
    grid_v = torch.cat([v_act, torch.zeros(1, b, n)])
    grid_m = torch.cat([torch.ones(t_len, b, n), torch.zeros(1, b, n)])
    want_adv, want_ret = action_gae(rewards, grid_v, grid_m, 0.99, 0.95)
    r_rows = torch.stack([rewards[t, bi, i] for t, bi, i in order])
    v_rows = torch.stack([v_act[t, bi, i] for t, bi, i in order])
    adv, ret = action_level_gae(r_rows, v_rows, traj_idx, b, 0.99, 0.95)
    assert torch.allclose(adv, torch.stack([want_adv[c] for c in order]), atol=1e-6)
    assert torch.allclose(ret, torch.stack([want_ret[c] for c in order]), atol=1e-6)


def test_rows_match_the_turn_agent_grid_of_token_gae() -> None:
    t_len, b, n = 2, 3, 3
    rewards, values, tmask, order, traj_idx = _regular_rows(t_len, b, n, seed=1)
    grid_m = torch.cat([torch.ones(t_len, b, n), torch.zeros(1, b, n)])
    want_adv, _ = token_gae(rewards, values * tmask, tmask, grid_m, torch.zeros(b), 0.99, 0.95, 1.0)
    r_rows = torch.stack([rewards[c] for c in order])
    v_rows = torch.stack([values[c] for c in order])
    m_rows = torch.stack([tmask[c] for c in order])
    adv, ret = token_level_gae(r_rows, v_rows, m_rows, traj_idx, b, 0.99, 0.95, token_gamma=1.0)
    assert torch.allclose(adv, torch.stack([want_adv[c] for c in order]), atol=1e-6)
    assert torch.equal(adv[~m_rows], torch.zeros(int((~m_rows).sum())))
    assert torch.allclose(ret, (adv + v_rows) * m_rows, atol=1e-6)


def test_chains_of_different_lengths_do_not_leak_into_each_other() -> None:
    g = torch.Generator().manual_seed(2)
    traj_idx = torch.tensor([0, 1, 0, 2, 1, 0])  # interleaved rows; chain lengths 3, 2, 1
    rewards, values = torch.randn(6, generator=g), torch.randn(6, generator=g)
    adv, _ = action_level_gae(rewards, values, traj_idx, 3, 0.9, 0.8)
    for t in range(3):
        sel = traj_idx == t
        alone, _ = action_level_gae(
            rewards[sel], values[sel], torch.zeros(int(sel.sum()), dtype=torch.long), 1, 0.9, 0.8
        )
        assert torch.allclose(adv[sel], alone)


def test_layout_and_team_rewards() -> None:
    slot, s = trajectory_layout(torch.tensor([1, 0, 1, 1, 0]), 3)
    assert slot.tolist() == [0, 0, 1, 2, 1] and s == 3
    r = chain_rewards(
        torch.tensor([5.0, 5.0, 5.0, 5.0, 5.0]), torch.tensor([1, 0, 1, 1, 0]), torch.tensor([2.0, 3.0, 9.0])
    )
    assert r.tolist() == [0.0, 0.0, 0.0, 3.0, 2.0]  # team reward on each trajectory's last row only
    own = torch.tensor([1.0, 2.0])
    assert torch.equal(chain_rewards(own, torch.tensor([0, 0]), None), own)
    with pytest.raises(AlgorithmError):
        trajectory_layout(torch.tensor([0, 3]), 3)


def test_explained_variance() -> None:
    g = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(g.clone(), g) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), g) == pytest.approx(0.0)
    masked = torch.tensor([True, True, False, False])
    assert explained_variance(torch.tensor([2.0, 1.0, 7.0, 7.0]), g, masked) == pytest.approx(1 - 1.0 / 0.25)
    assert math.isnan(explained_variance(torch.zeros(3), torch.ones(3)))


def test_value_head_starts_at_zero_and_keeps_leading_shape() -> None:
    head = ValueHead(8, 16)
    x = torch.randn(3, 5, 8)
    assert torch.equal(head(x), torch.zeros(3, 5))
    assert head(x[:, 0]).shape == (3,)
