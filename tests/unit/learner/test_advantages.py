"""Advantage estimators against the worked examples of docs/algorithms.md §1, §4 and §6."""

from __future__ import annotations

import pytest
import torch

from teamrl.learner.advantages import (
    AlgorithmError,
    action_gae,
    agentwise_advantages,
    broadcast_to_tokens,
    gae,
    group_index,
    grpo_advantages,
    masked_whiten,
    singleton_group_count,
    token_gae,
    trajectory_advantages,
    vtrace,
)
from teamrl.learner.losses import agg_loss, ppo_clip_loss


def close(actual: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def zeros_ids(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


# §1 GRPO / Dr. GRPO / Dr. MAS -----------------------------------------------------------------------


def test_grpo_sample_std_population_std_and_dr_grpo() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    close(grpo_advantages(r, zeros_ids(4)), [0.866024, -0.866024, -0.866024, 0.866024])
    close(grpo_advantages(r, zeros_ids(4), unbiased=False), [0.999998, -0.999998, -0.999998, 0.999998])
    close(grpo_advantages(r, zeros_ids(4), scale=False), [0.5, -0.5, -0.5, 0.5])


def test_grpo_equal_rewards_and_singleton_group() -> None:
    close(grpo_advantages(torch.ones(3), zeros_ids(3)), [0.0, 0.0, 0.0])
    close(grpo_advantages(torch.tensor([1.0]), zeros_ids(1)), [0.999999], atol=1e-6)
    assert singleton_group_count(torch.tensor([0, 0, 1, 2, 2])) == 1


def test_grpo_groups_are_independent() -> None:
    r = torch.tensor([1.0, 0.0, 5.0, 7.0])
    ids = torch.tensor([3, 3, 9, 9])
    out = grpo_advantages(r, ids)
    close(out, [0.707106, -0.707106, -0.707106, 0.707106])


def test_dr_mas_agentwise_and_global_worked_example() -> None:
    # 3 trajectories; rows 0-2 are the solver's turns, rows 3-5 the verifier's.
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.2])
    groups = zeros_ids(6)
    agents = torch.tensor([0, 0, 0, 1, 1, 1])
    trajs = torch.tensor([0, 1, 2, 0, 1, 2])
    close(
        agentwise_advantages(r, groups, agents),
        [1.154699, -0.577349, -0.577349, 0.577347, 0.577347, -1.154694],
    )
    glob = [1.126312, -0.342790, -0.783521]
    close(trajectory_advantages(r, groups, trajs), glob + glob)


def test_group_index_pairs_and_validation() -> None:
    inv, n = group_index(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 0, 1]))
    assert n == 4 and len(set(inv.tolist())) == 4
    with pytest.raises(AlgorithmError, match="non-finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), zeros_ids(2))
    with pytest.raises(AlgorithmError, match="integer"):
        grpo_advantages(torch.ones(2), torch.zeros(2))
    with pytest.raises(AlgorithmError, match="shape"):
        agentwise_advantages(torch.ones(2), zeros_ids(2), zeros_ids(3))


def test_broadcast_to_tokens() -> None:
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    close(out, [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


def test_agentwise_normalisation_balances_per_agent_grad_norms() -> None:
    """Dr. MAS's claim, with a real backward through one tiny linear policy per agent.

    Agent A earns {0, 1}, agent B {0, 100}, each for picking action 0. Pooled (global) normalisation
    lets B's scale dominate the group std, so A's advantages become a near-constant and its gradient
    collapses; agent-wise normalisation gives both agents comparable gradient norms.
    """
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        n_groups, per_group, dim, n_actions = 8, 16, 4, 3
        n = n_groups * per_group
        x = torch.randn(n, dim, generator=gen)
        gid = torch.arange(n_groups).repeat_interleave(per_group)
        torch.manual_seed(seed)
        policies = [torch.nn.Linear(dim, n_actions), torch.nn.Linear(dim, n_actions)]
        with torch.no_grad():
            actions = [
                torch.multinomial(torch.softmax(p(x), -1), 1, generator=gen).squeeze(-1) for p in policies
            ]
        rewards = torch.cat([(actions[0] == 0).float(), 100.0 * (actions[1] == 0).float()])
        groups = torch.cat([gid, gid])
        agents = torch.cat([torch.zeros(n), torch.ones(n)]).long()
        trajs = torch.cat([torch.arange(n), torch.arange(n)])

        def grad_norms(adv: torch.Tensor, x=x, n=n, actions=actions, policies=policies) -> list[float]:
            norms = []
            for k, policy in enumerate(policies):
                policy.zero_grad()
                logp = torch.log_softmax(policy(x), -1).gather(-1, actions[k][:, None]).squeeze(-1)
                terms = ppo_clip_loss(logp, logp.detach(), adv[k * n : (k + 1) * n])
                agg_loss(terms.loss, torch.ones(n)).backward()
                norms.append(float(torch.sqrt(sum((p.grad**2).sum() for p in policy.parameters()))))
            return norms

        a_agent, b_agent = grad_norms(agentwise_advantages(rewards, groups, agents))
        a_pool, b_pool = grad_norms(grpo_advantages(rewards, groups))
        a_traj, b_traj = grad_norms(trajectory_advantages(rewards, groups, trajs))
        assert 2 / 3 < b_agent / a_agent < 1.5
        assert b_pool / a_pool > 5.0
        assert b_traj / a_traj > 3.0


# §4 decomposition, §6 MARFT GAE -----------------------------------------------------------------------


def test_flex_mg_decomposition_example() -> None:
    v, q1, q12 = 0.5, 0.7, 1.0
    a1, a2 = q1 - v, q12 - q1
    assert a1 == pytest.approx(0.2) and a2 == pytest.approx(0.3) and a1 + a2 == pytest.approx(q12 - v)


def test_action_gae_worked_example() -> None:
    values = torch.tensor([[[0.4, 0.6]], [[0.0, 0.0]]])  # [T+1=2, B=1, N=2]
    rewards = torch.tensor([[[0.0, 1.0]]])
    masks = torch.tensor([[[1.0, 1.0]], [[0.0, 0.0]]])  # done after the step
    adv, ret = action_gae(rewards, values, masks, gamma=0.99, lam=0.95)
    close(adv, [[[0.5702, 0.4]]])
    close(ret, [[[0.9702, 1.0]]])


def test_action_gae_bootstraps_across_steps_and_stops_at_done() -> None:
    # 2 steps, 1 agent: bootstraps agent 1 of step t+1 while alive; stops at done.
    values = torch.tensor([[[0.5]], [[0.2]], [[9.0]]])
    rewards = torch.tensor([[[0.0]], [[1.0]]])
    alive = torch.tensor([[[1.0]], [[1.0]], [[0.0]]])
    adv, _ = action_gae(rewards, values, alive, gamma=0.9, lam=0.5)
    a1 = 1.0 - 0.2
    a0 = (0.9 * 0.2 - 0.5) + 0.45 * a1
    close(adv, [[[a0]], [[a1]]])
    # a non-terminal batch end bootstraps from values[T, :, 0]
    adv_open, _ = action_gae(rewards, values, torch.ones(3, 1, 1), gamma=0.9, lam=0.5)
    assert float(adv_open[1]) == pytest.approx(1.0 + 0.9 * 9.0 - 0.2)
    with pytest.raises(AlgorithmError, match="T\\+1"):
        action_gae(rewards, values[:2], alive)


def test_token_gae_worked_example() -> None:
    values = torch.tensor([[[[0.3, 0.4], [0.5, 0.6]]]])  # [T=1, B=1, N=2, L=2]
    rewards = torch.tensor([[[0.0, 1.0]]])
    masks = torch.tensor([[[1.0, 1.0]], [[0.0, 0.0]]])
    adv, ret = token_gae(rewards, values, torch.ones_like(values), masks, next_value=torch.zeros(1))
    close(adv[0, 0, 1], [0.4702, 0.4])
    close(adv[0, 0, 0], [0.601258, 0.537223])
    close(ret, (adv + values).tolist())


def test_token_gae_padding_and_unit_token_gamma() -> None:
    # agent 1 has 1 valid token of 2; padding gets 0 and does not enter the recursion.
    values = torch.tensor([[[[0.3, 7.0], [0.5, 0.6]]]])
    token_mask = torch.tensor([[[[1, 0], [1, 1]]]])
    rewards = torch.tensor([[[0.0, 1.0]]])
    masks = torch.tensor([[[1.0, 1.0]], [[0.0, 0.0]]])
    adv, _ = token_gae(
        rewards, values, token_mask, masks, torch.zeros(1), gamma=0.99, lam=0.95, token_gamma=1.0
    )
    a2 = [(0.6 - 0.5) + 0.95 * 0.4, 0.4]
    close(adv[0, 0, 1], a2)
    close(adv[0, 0, 0], [(0.99 * 0.5 - 0.3) + 0.99 * 0.95 * a2[0], 0.0])
    with pytest.raises(AlgorithmError, match="no valid token"):
        token_gae(rewards, values, torch.zeros_like(token_mask), masks, torch.zeros(1))


# §6 GAE, whitening and V-trace ---------------------------------------------------------------------------


def test_gae_worked_example() -> None:
    adv, ret = gae(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3), 1.0, 0.95
    )
    close(adv, [[0.4705, 0.39, 0.2]])
    close(ret, [[0.9705, 0.99, 1.0]])


def test_gae_carries_through_masked_positions() -> None:
    # a tool-output token (m = 0) in the middle must not change the result
    dense, _ = gae(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3), 1.0, 0.95
    )
    holed, _ = gae(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.6, 123.0, 0.8]]),
        torch.tensor([[1, 1, 0, 1]]),
        1.0,
        0.95,
    )
    close(holed[:, [0, 1, 3]], dense.tolist())
    assert float(holed[0, 2]) == 0.0


def test_masked_whiten() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    m = torch.tensor([1, 1, 1, 0])
    out = masked_whiten(x, m)
    close(out, [-1.0, 0.0, 1.0, 0.0], atol=1e-4)  # unbiased var of [1,2,3] is 1
    pop = masked_whiten(x, m, unbiased=False)
    close(pop[:3], [-1.224744, 0.0, 1.224744], atol=1e-4)
    with pytest.raises(AlgorithmError):
        masked_whiten(x, torch.zeros(4))


def test_vtrace_worked_example() -> None:
    vs, pg = vtrace(
        log_rhos=torch.log(torch.tensor([[2.0], [0.5]])),
        discounts=torch.full((2, 1), 0.9),
        rewards=torch.tensor([[1.0], [0.0]]),
        values=torch.tensor([[0.5], [0.4]], requires_grad=True),
        bootstrap_value=torch.tensor([0.3]),
    )
    close(vs, [[1.3015], [0.335]])
    close(pg, [[0.8015], [-0.065]])
    assert not vs.requires_grad and not pg.requires_grad
