"""The learner's algorithms against their definitions (docs/algorithms.md): worked examples + properties.

Each worked example was recomputed by hand (or with numpy) from the equation in docs/algorithms.md;
property tests check the invariants the equations imply on random inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from teamrl.learner.advantages import (
    AlgorithmError,
    action_gae,
    advantage_groups,
    agentwise_advantages,
    gae,
    grpo_advantages,
    outcome_advantages,
    singleton_group_count,
    token_gae,
    trajectory_advantages,
)
from teamrl.learner.losses import (
    agg_loss,
    behaviour_weights,
    decoupled_ppo_loss,
    kl_penalty,
    ppo_clip_loss,
    sequence_rejection_mask,
    sequence_tis_weights,
    truncated_is_weights,
    weight_rows,
)
from teamrl.learner.update import (
    correction_factor,
    factor_bounds,
    happo_advantages,
    joint_logprob,
    joint_rows,
    sequential_update,
    update_log_factor,
)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def ids(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


# §1 outcome advantages ------------------------------------------------------------------------------


def test_grpo_worked_example_and_properties() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    close(grpo_advantages(r, ids(0, 0, 0, 0)), [0.866024, -0.866024, -0.866024, 0.866024])
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        r = torch.randn(12, generator=gen)
        g = torch.randint(0, 3, (12,), generator=gen)
        a = grpo_advantages(r, g, singleton="batch")
        for k in g.unique():
            sel = g == k
            if int(sel.sum()) < 2:
                continue
            assert abs(float(a[sel].mean())) < 1e-5  # centred per group
            assert float(a[sel].std()) == pytest.approx(1.0, abs=1e-3)  # unit sample std
        # affine invariance: a*R + b gives the same advantage (a > 0)
        close(grpo_advantages(3.0 * r + 7.0, g, singleton="batch"), a, atol=1e-4)


def test_dr_grpo_is_centred_not_scaled() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 3.0])
    g = ids(0, 0, 0, 0, 1, 1)
    close(grpo_advantages(r, g, scale=False), [0.5, -0.5, -0.5, 0.5, 1.0, -1.0])
    close(
        outcome_advantages("dr_grpo", r, g, ids(*[0] * 6), ids(*range(6)), ids(*[0] * 6)),
        [0.5, -0.5, -0.5, 0.5, 1.0, -1.0],
    )


def test_dr_mas_singleton_pair_gets_the_agents_batch_baseline_not_its_raw_reward() -> None:
    # group 0: solver x3, verifier x1 (a routed reviewer that acted once); group 1: verifier x2.
    r = torch.tensor([1.0, 0.0, 0.0, 5.0, 1.0, 3.0])
    g = ids(0, 0, 0, 0, 1, 1)
    agent = ids(0, 0, 0, 1, 1, 1)
    adv = agentwise_advantages(r, g, agent)
    # verifier's rows in the batch: [5, 1, 3], mean 3, sample std 2 -> (5 - 3) / 2 = 1
    assert float(adv[3]) == pytest.approx(1.0, abs=1e-5)
    assert float(adv[3]) != pytest.approx(5.0)  # never the raw reward
    close(adv[4:], [-0.707106, 0.707106])  # the pair group (1, verifier) is normalised as usual
    close(adv[:3], [1.154699, -0.577349, -0.577349])
    # the other rules, and an agent with a single row in the whole batch
    assert float(agentwise_advantages(r, g, agent, singleton="zero")[3]) == 0.0
    assert float(agentwise_advantages(r, g, agent, singleton="raw")[3]) == pytest.approx(5.0 / (1 + 1e-6))
    lone = agentwise_advantages(torch.tensor([1.0, 0.0, 4.0]), ids(0, 0, 0), ids(0, 0, 1))
    assert float(lone[2]) == 0.0
    with pytest.raises(AlgorithmError, match="singleton"):
        agentwise_advantages(r, g, agent, singleton="bogus")  # type: ignore[arg-type]


def test_dr_mas_singleton_property_no_row_keeps_a_raw_reward() -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        n = 10
        r = 10.0 + torch.rand(n, generator=gen)  # far from 0: a raw reward would stand out
        g = torch.randint(0, 4, (n,), generator=gen)
        a = torch.randint(0, 2, (n,), generator=gen)
        adv = agentwise_advantages(r, g, a)
        assert bool((adv.abs() < 5.0).all())
        # the agent's batch baseline uses only that agent's rows: permuting the other agent's rewards
        other = a == 1
        r2 = r.clone()
        r2[other] = r[other].flip(0)
        assert torch.allclose(agentwise_advantages(r2, g, a)[~other], adv[~other])


def test_grpo_singleton_group_batch_rule() -> None:
    r = torch.tensor([1.0, 0.0, 4.0])
    g = ids(0, 0, 1)
    assert float(grpo_advantages(r, g)[2]) == pytest.approx(4.0 / (1 + 1e-6))  # verl's rule (default)
    mean, std = 5.0 / 3, float(r.std())
    assert float(grpo_advantages(r, g, singleton="batch")[2]) == pytest.approx((4 - mean) / std, abs=1e-5)


def test_at_grpo_groups_by_group_agent_and_turn() -> None:
    # one task group, one agent acting on 2 turns in 2 episodes: rewards differ in scale by turn
    r = torch.tensor([1.0, 0.0, 10.0, 20.0])
    g, agent, traj, turn = ids(0, 0, 0, 0), ids(0, 0, 0, 0), ids(0, 1, 0, 1), ids(0, 0, 1, 1)
    at = outcome_advantages("at_grpo", r, g, agent, traj, turn)
    close(at, [0.707106, -0.707106, -0.707106, 0.707106])  # each turn normalised on its own
    drmas = outcome_advantages("drmas", r, g, agent, traj, turn)
    assert float(drmas[0]) < 0 and float(drmas[1]) < 0  # pooled: turn 0 is "bad" next to turn 1
    assert advantage_groups("at_grpo", g, agent, traj, turn) == (g, agent, turn)
    # a (group, agent, turn) singleton falls back to (group, agent) first
    r3 = torch.tensor([1.0, 0.0, 4.0])
    out = outcome_advantages("at_grpo", r3, ids(0, 0, 0), ids(0, 0, 0), ids(0, 1, 0), ids(0, 0, 1))
    assert float(out[2]) == pytest.approx((4 - 5 / 3) / float(r3.std()), abs=1e-5)
    assert singleton_group_count(ids(0, 0, 0), ids(0, 0, 0), ids(0, 0, 1)) == 1


def test_grpo_trajectory_is_drmas_global_baseline() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.2])
    g, agent, traj = ids(0, 0, 0, 0, 0, 0), ids(0, 0, 0, 1, 1, 1), ids(0, 1, 2, 0, 1, 2)
    out = outcome_advantages("grpo_trajectory", r, g, agent, traj, ids(*[0] * 6))
    glob = [1.126312, -0.342790, -0.783521]
    close(out, glob + glob)
    close(out, trajectory_advantages(r, g, traj))
    with pytest.raises(AlgorithmError, match="unknown algorithm"):
        outcome_advantages("ppo", r, g, agent, traj, traj)  # type: ignore[arg-type]


# §2 PPO-clip and aggregation ----------------------------------------------------------------------------


def test_ppo_clip_worked_examples() -> None:
    new = torch.tensor([-0.5, -1.0, -1.5])
    old = torch.tensor([-0.6, -1.1, -1.6])
    # action level, sum: r = e^0.3 = 1.349859 > 1.2 -> clipped, loss -1.2
    t = ppo_clip_loss(new.sum()[None], old.sum()[None], torch.ones(1))
    close(t.loss, [-1.2])
    assert bool(t.clipped[0])
    # token mean: r = e^0.1 = 1.105171 inside the clip
    t = ppo_clip_loss(new.mean()[None], old.mean()[None], torch.ones(1))
    close(t.loss, [-1.105171])
    # A < 0: pessimistic side -> max(-r A, -clip(r) A) = 1.349859 (unclipped branch)
    t = ppo_clip_loss(new.sum()[None], old.sum()[None], -torch.ones(1))
    close(t.loss, [1.349859])
    # dual clip c = 3 bounds the A < 0 loss at 3|A|
    t = ppo_clip_loss(torch.tensor([2.0]), torch.tensor([0.0]), -torch.ones(1), dual_clip=3.0)
    close(t.loss, [3.0])


def test_ppo_clip_gradient_vanishes_outside_the_trust_region() -> None:
    gen = torch.Generator().manual_seed(2)
    logp = torch.randn(200, generator=gen).requires_grad_()
    old = logp.detach() + 0.5 * torch.randn(200, generator=gen)
    adv = torch.randn(200, generator=gen)
    t = ppo_clip_loss(logp, old, adv)
    t.loss.sum().backward()
    ratio = torch.exp(logp.detach() - old)
    out_hi = (adv > 0) & (ratio > 1.2)
    out_lo = (adv < 0) & (ratio < 0.8)
    assert bool((logp.grad[out_hi | out_lo] == 0).all())
    inside = (ratio > 0.8) & (ratio < 1.2)
    # inside: d/dlogp of -r A is -r A
    close(logp.grad[inside], (-ratio * adv)[inside], atol=1e-5)


def test_agg_modes_worked_example() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(agg_loss(loss, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    assert float(agg_loss(loss, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / 3)


# §3 off-policy correction -----------------------------------------------------------------------------


def test_decoupled_ppo_worked_example_areal() -> None:
    # logπ_θ = -0.9, logπ_prox = -1.0, logπ_behav = -1.2, A = 1: w = e^0.2, u = e^0.1, loss = -w·u
    t = decoupled_ppo_loss(
        torch.tensor([[-0.9]]),
        torch.tensor([[-1.0]]),
        torch.tensor([[-1.2]]),
        torch.ones(1, 1),
        torch.ones(1, 1),
    )
    close(t.loss, [[-1.349859]])
    close(t.is_weight, [[1.221403]])
    close(t.ratio, [[1.105171]])
    # behaviour -3.0: w = e^2 = 7.389 > 5 -> masked (AReaL), but still in the token-mean denominator
    logp = torch.tensor([[-0.9, -0.9]])
    prox = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-1.2, -3.0]])
    t = decoupled_ppo_loss(logp, prox, behav, torch.ones(1, 2), torch.ones(1, 2), cap=5.0, cap_mode="mask")
    close(t.loss, [[-1.349859, 0.0]])
    assert t.rejected.tolist() == [[False, True]]
    assert float(agg_loss(t.loss, torch.ones(1, 2))) == pytest.approx(-1.349859 / 2, abs=1e-5)
    # clamp mode (verl/slime TIS) truncates instead: w = 5
    t = decoupled_ppo_loss(logp, prox, behav, torch.ones(1, 2), torch.ones(1, 2), cap=5.0, cap_mode="clamp")
    close(t.is_weight, [[1.221403, 5.0]])


def test_decoupled_clip_is_on_theta_over_prox_not_theta_over_behaviour() -> None:
    # π_θ = π_prox: u = 1, no clipping however far μ is; the weight carries the whole π_prox/μ gap
    logp = torch.tensor([[-1.0]], requires_grad=True)
    t = decoupled_ppo_loss(
        logp, torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), torch.ones(1, 1), torch.ones(1, 1)
    )
    assert not bool(t.clipped.any())
    t.loss.sum().backward()
    close(logp.grad, [[-math.exp(0.5)]])  # −w·u·A with u = 1: the weight scales the gradient
    # the weight is a constant: no gradient reaches prox or behaviour log-probs
    prox = torch.tensor([[-1.0]], requires_grad=True)
    behav = torch.tensor([[-1.5]], requires_grad=True)
    t = decoupled_ppo_loss(torch.tensor([[-1.0]]), prox, behav, torch.ones(1, 1), torch.ones(1, 1))
    assert not t.loss.requires_grad


def test_token_tis_clamp_and_mask_worked_example() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    behav = torch.tensor([[-1.5, -2.0, 0.0]])
    m = torch.ones(1, 3)
    w, rej = truncated_is_weights(old, behav, m, upper=2.0)
    close(w, [[1.648721, 2.0, 0.367879]])
    assert not bool(rej.any())
    w, rej = truncated_is_weights(old, behav, m, upper=2.0, lower=0.5, mode="mask")  # icepop
    close(w, [[1.648721, 0.0, 0.0]])
    assert rej.tolist() == [[False, True, True]]
    w, _ = truncated_is_weights(old, behav, m, upper=5.0, lower=0.5)  # OpenRLHF 'tis' raises 0.368
    close(w, [[1.648721, 2.718282, 0.5]])


def test_sequence_tis_and_mis_worked_example() -> None:
    # log ρ = [0.1, -0.3, 0.05] on row 0: ρ_seq = e^-0.15 = 0.860708; row 1: log ρ = [1.0, 0] -> e = 2.718
    old = torch.tensor([[0.1, -0.3, 0.05], [1.0, 0.0, 0.0]])
    behav = torch.zeros(2, 3)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    close(sequence_tis_weights(old, behav, m, cap=2.0), [[0.860708] * 3, [2.0, 2.0, 0.0]])
    w, rej = behaviour_weights(old, behav, m, cap=2.0, mode="clamp", level="sequence")
    close(w, [[0.860708] * 3, [2.0, 2.0, 0.0]])
    w, rej = behaviour_weights(old, behav, m, cap=2.0, mode="mask", level="sequence")
    close(w, [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert rej.tolist() == [[False, False, False], [True, True, False]]
    new_mask, rows = sequence_rejection_mask(old, behav, m, lower=0.5, upper=2.0, statistic="mean")
    assert rows.tolist() == [False, False]  # ρ_geo = 0.951229 and e^0.5 = 1.65 are inside [0.5, 2]


def test_is_weights_properties() -> None:
    gen = torch.Generator().manual_seed(3)
    old = torch.randn(6, 8, generator=gen)
    behav = old + 0.7 * torch.randn(6, 8, generator=gen)
    m = torch.rand(6, 8, generator=gen) > 0.3
    raw = torch.exp(old - behav)
    for level in ("token", "sequence"):
        wc, _ = behaviour_weights(old, behav, m, cap=2.0, mode="clamp", level=level)
        wm, rej = behaviour_weights(old, behav, m, cap=2.0, mode="mask", level=level)
        assert bool((wc <= 2.0 + 1e-6).all()) and bool((wm <= 2.0 + 1e-6).all())
        assert bool((wc[~m] == 0).all()) and bool((wm[~m] == 0).all())
        assert bool((wm[rej] == 0).all())
        if level == "token":  # where nothing binds, clamp and mask agree
            agree = m & ~rej & (wc < 2.0)
            close(wm[agree], wc[agree])
        else:  # Seq-MIS only rejects rows (weight 1 or 0), Seq-TIS weighs whole rows alike
            assert set(wm[m].tolist()) <= {0.0, 1.0}
            assert bool((wc == wc.amax(-1, keepdim=True) * m).all())
    w, _ = behaviour_weights(old, behav, m, cap=None, mode="clamp")
    close(w[m], raw[m], atol=1e-4)


def test_kl_estimators_worked_example_and_properties() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    close(kl_penalty(logp, ref, "k1"), [0.5])
    close(kl_penalty(logp, ref, "k2"), [0.125])
    close(kl_penalty(logp, ref, "k3"), [0.106531])
    # k3+: k3's value, k2's gradient
    x = torch.tensor([-1.0], requires_grad=True)
    v = kl_penalty(x, ref, "k3+")
    close(v.detach(), [0.106531])
    v.sum().backward()
    close(x.grad, [0.5])
    # k3 >= 0 everywhere; k1 and k3 unbiased for KL(q||p) under q (Monte-Carlo on a categorical)
    gen = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.randn(5, generator=gen), -1)
    p = torch.softmax(torch.randn(5, generator=gen), -1)
    samples = torch.multinomial(q, 200_000, replacement=True, generator=gen)
    lq, lp = q.log()[samples], p.log()[samples]
    true_kl = float((q * (q.log() - p.log())).sum())
    assert float(kl_penalty(lq, lp, "k1").mean()) == pytest.approx(true_kl, abs=0.02)
    assert float(kl_penalty(lq, lp, "k3").mean()) == pytest.approx(true_kl, abs=0.02)
    assert bool((kl_penalty(lq, lp, "k3") >= 0).all())


def test_sample_weights_multiply_each_rows_loss() -> None:
    logp = torch.tensor([[-0.9, -0.9], [-0.9, -0.9]])
    t = ppo_clip_loss(logp, torch.full((2, 2), -1.0), torch.ones(2, 2))
    w = weight_rows(t, torch.tensor([1.0, 0.25]))
    close(w.loss, t.loss * torch.tensor([[1.0], [0.25]]))
    # action level [B]
    t1 = ppo_clip_loss(torch.tensor([0.1, 0.1]), torch.zeros(2), torch.ones(2))
    close(weight_rows(t1, torch.tensor([2.0, 0.0])).loss, [2 * float(t1.loss[0]), 0.0])
    with pytest.raises(AlgorithmError):
        weight_rows(t1, torch.tensor([1.0, -1.0]))
    with pytest.raises(AlgorithmError):
        weight_rows(t1, torch.ones(3))


# §4 HAPPO sequential update ------------------------------------------------------------------------------


def test_happo_worked_example() -> None:
    # first agent: r = 1.3, M = 0.5 -> objective min(0.65, 0.6) = 0.6 (loss -0.6)
    first = ppo_clip_loss(torch.log(torch.tensor([1.3])), torch.zeros(1), torch.tensor([0.5]))
    close(first.loss, [-0.6])
    # after its update its ratio on the row is 1.1 -> the second agent's M = 0.55
    log_m = update_log_factor(torch.zeros(1), torch.log(torch.tensor([1.1])), torch.zeros(1))
    factor = correction_factor(log_m)
    m_adv = happo_advantages(torch.tensor([0.5]), factor, ids(0))
    close(m_adv, [0.55])
    second = ppo_clip_loss(torch.log(torch.tensor([0.7])), torch.zeros(1), m_adv)
    close(second.loss, [-0.385])
    neg = ppo_clip_loss(
        torch.log(torch.tensor([0.7])), torch.zeros(1), happo_advantages(torch.tensor([-0.5]), factor, ids(0))
    )
    close(neg.loss, [0.44])


def test_joint_rows_per_turn_and_per_trajectory() -> None:
    traj = ids(0, 0, 0, 0, 1, 1)
    turn = ids(0, 0, 1, 1, 0, 0)
    j, n = joint_rows(traj, turn, 2, "turn")
    assert n == 3 and j.tolist() == [0, 0, 1, 1, 2, 2]
    j, n = joint_rows(traj, turn, 2, "trajectory")
    assert n == 2 and j.tolist() == [0, 0, 0, 0, 1, 1]
    close(joint_logprob(torch.tensor([-1.0, -2.0]), ids(1, 1), 3), [0.0, -3.0, 0.0])
    with pytest.raises(AlgorithmError, match="happo_factor"):
        joint_rows(traj, turn, 2, "episode")  # type: ignore[arg-type]


def test_per_turn_factor_worked_example_differs_from_trajectory_factor() -> None:
    # 2-turn episode, solver then verifier each turn. Solver updated first: its ratios are 1.5 on
    # turn 0 and 0.6 on turn 1. The verifier's turn-0 row is weighted by 1.5 only (HAPPO), not by
    # 1.5·0.6 = 0.9 (its action on turn 0 did not see the solver's turn-1 action).
    traj, turn = ids(0, 0), ids(0, 1)  # the solver's rows; the verifier's rows are the same cells
    for mode, expected in (("turn", [1.5, 0.6]), ("trajectory", [0.9, 0.9])):
        j, n = joint_rows(traj, turn, 1, mode)
        old = joint_logprob(torch.zeros(2), j, n)
        new = joint_logprob(torch.log(torch.tensor([1.5, 0.6])), j, n)
        factor = correction_factor(update_log_factor(torch.zeros(n), new, old))
        close(factor[j], expected)


class _TinyAgent:
    """A softmax policy over 3 actions per state, its own parameters and optimiser."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(0.1 * torch.randn(4, 3, generator=g))
        self.opt = torch.optim.SGD([self.w], lr=0.5)

    def logp(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x @ self.w, -1).gather(-1, a[:, None]).squeeze(-1)


def _joint_batch(seed: int = 0):
    """B episodes x 2 turns; both agents act on every turn (rows: one per episode and turn)."""
    g = torch.Generator().manual_seed(seed)
    b, t = 8, 2
    traj = torch.arange(b).repeat_interleave(t)
    turn = torch.arange(t).repeat(b)
    x = torch.randn(b * t, 4, generator=g)
    acts = [torch.randint(0, 3, (b * t,), generator=g) for _ in range(2)]
    adv = torch.randn(b * t, generator=g)
    return traj, turn, x, acts, adv


@pytest.mark.parametrize("mode", ["turn", "trajectory"])
def test_sequential_update_two_agents_same_joint_samples(mode: str) -> None:
    traj, turn, x, acts, adv = _joint_batch()
    joint, n_joint = joint_rows(traj, turn, 8, mode)  # type: ignore[arg-type]
    agents = [_TinyAgent(0), _TinyAgent(1)]
    seen: dict[int, torch.Tensor] = {}
    grads_of_other: list[float] = []

    def logprob_fn(k: int) -> torch.Tensor:
        with torch.no_grad():
            return joint_logprob(agents[k].logp(x, acts[k]), joint, n_joint)

    old_rows = {k: agents[k].logp(x, acts[k]).detach() for k in range(2)}

    def step_fn(k: int, factor: torch.Tensor) -> dict[str, float]:
        seen[k] = factor.clone()
        other = agents[1 - k]
        other.w.grad = None
        agents[k].opt.zero_grad()
        m_adv = happo_advantages(adv, factor, joint)
        terms = ppo_clip_loss(agents[k].logp(x, acts[k]), old_rows[k], m_adv)
        terms.loss.mean().backward()
        grads_of_other.append(0.0 if other.w.grad is None else float(other.w.grad.abs().sum()))
        agents[k].opt.step()
        return {"loss": float(terms.loss.mean().detach())}

    before = [a.w.detach().clone() for a in agents]
    res = sequential_update([0, 1], [0, 1], logprob_fn, step_fn, epochs=2)
    # the first agent trains with factor 1; the second with a factor that departed from 1
    assert torch.equal(seen[0], torch.ones(n_joint))
    assert float((seen[1] - 1).abs().max()) > 1e-3
    # and that factor is exactly the first agent's ratio on each joint sample after its epochs
    with torch.no_grad():
        ratio0 = joint_logprob(agents[0].logp(x, acts[0]) - old_rows[0], joint, n_joint).exp()
    close(seen[1], ratio0, atol=1e-5)
    if mode == "turn":  # per turn: each joint sample holds one solver action
        close(seen[1][joint], torch.exp(agents[0].logp(x, acts[0]).detach() - old_rows[0]), atol=1e-5)
    # stop-gradient: no agent's loss sends a gradient to the other; the factor is not a graph node
    assert grads_of_other == [0.0] * 4
    assert not seen[1].requires_grad
    assert all(not torch.equal(b, a.w.detach()) for b, a in zip(before, agents, strict=True))
    assert res.records[1].factor_mean == pytest.approx(float(seen[1].mean()))


def test_simultaneous_mode_keeps_factor_one() -> None:
    traj, turn, x, acts, adv = _joint_batch(1)
    joint, n_joint = joint_rows(traj, turn, 8, "turn")
    factors: list[torch.Tensor] = []
    res = sequential_update(
        ["a", "b"],
        [1, 0],
        lambda k: torch.zeros(n_joint),
        lambda k, f: factors.append(f) or {},
        mode="simultaneous",
        n_rows=n_joint,
    )
    assert res.order == [1, 0] and all(torch.equal(f, torch.ones(n_joint)) for f in factors)


def test_factor_clip_is_symmetric_in_log_space_and_counts_the_rows_it_changed() -> None:
    assert factor_bounds(None) is None
    assert factor_bounds(4.0) == (0.25, 4.0)
    with pytest.raises(AlgorithmError, match="> 1"):
        factor_bounds(0.5)
    seen: list[torch.Tensor] = []
    ratios = {"a": torch.log(torch.tensor([64.0, 1.5, 1 / 64.0])), "b": torch.zeros(3)}
    after = {"a": False}

    def logprob(k: str) -> torch.Tensor:  # agent a moves by its ratios in its step, b never
        return ratios[k] if k == "a" and after["a"] else torch.zeros(3)

    def step(k: str, f: torch.Tensor) -> dict:
        seen.append(f)
        after[k] = True
        return {}

    res = sequential_update(["a", "b"], [0, 1], logprob, step, factor_clip=factor_bounds(4.0))
    close(seen[1], [4.0, 1.5, 0.25])
    assert [r.factor_clipped_rows for r in res.records] == [0, 2]
    assert res.records[1].factor_max == pytest.approx(4.0)


# §6 GAE at action and token level ------------------------------------------------------------------------


def _marft_action_gae(rewards, values, masks, gamma, lam):
    """MARFT ActionBuffer.compute_gae_and_returns as written (reference loop, independent of gae())."""
    t_len, b, n = rewards.shape
    adv = torch.zeros(t_len, b, n)
    for bi in range(b):
        nxt = 0.0
        for t in reversed(range(t_len)):
            for i in reversed(range(n)):
                if i < n - 1:
                    v2, m2 = values[t, bi, i + 1], masks[t, bi, i + 1]
                else:
                    v2, m2 = values[t + 1, bi, 0], masks[t + 1, bi, 0]
                    if t == t_len - 1:
                        nxt = 0.0
                delta = rewards[t, bi, i] + gamma * v2 * m2 - values[t, bi, i]
                nxt = delta + gamma * lam * m2 * nxt
                adv[t, bi, i] = nxt
    return adv * masks[:t_len]


def _marft_token_gae(rewards, values, tmask, masks, next_value, gamma, lam, g_tok):
    """MARFT TokenBuffer recursion, token by token (reference loop)."""
    t_len, b, n, length = values.shape
    adv = torch.zeros_like(values)
    for bi in range(b):
        nv0, na0 = float(next_value[bi]), 0.0
        for t in reversed(range(t_len)):
            for i in reversed(range(n)):
                bm = masks[t, bi, i + 1] if i < n - 1 else masks[t + 1, bi, 0]
                k = int(tmask[t, bi, i].nonzero().max()) + 1 if tmask[t, bi, i].any() else 0
                run = 0.0
                for j in reversed(range(k)):
                    if j == k - 1:
                        d = rewards[t, bi, i] + gamma * bm * nv0 - values[t, bi, i, j]
                        run = d + gamma * lam * bm * na0
                    else:
                        run = g_tok * values[t, bi, i, j + 1] - values[t, bi, i, j] + g_tok * lam * run
                    adv[t, bi, i, j] = run
                nv0, na0 = float(values[t, bi, i, 0]), float(adv[t, bi, i, 0])
    pos = torch.arange(length)
    klen = torch.where(tmask.bool(), pos + 1, torch.zeros_like(pos)).amax(-1)
    return adv * (pos < klen[..., None]) * masks[:t_len, ..., None]


def test_action_and_token_gae_match_marft_reference_loops_on_random_episodes() -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        t_len, b, n, length = 3, 4, 2, 4
        rewards = torch.randn(t_len, b, n, generator=gen)
        values = torch.randn(t_len + 1, b, n, generator=gen)
        done_at = torch.randint(1, t_len + 2, (b,), generator=gen)  # episode length per row
        masks = (torch.arange(t_len + 1)[:, None] < done_at[None, :]).float()[:, :, None].expand(-1, -1, n)
        adv, ret = action_gae(rewards, values, masks, 0.9, 0.8)
        close(adv, _marft_action_gae(rewards, values, masks, 0.9, 0.8), atol=1e-5)
        close(ret, (adv + values[:t_len]) * masks[:t_len], atol=1e-5)
        tv = torch.randn(t_len, b, n, length, generator=gen)
        lens = torch.randint(1, length + 1, (t_len, b, n), generator=gen)
        tmask = torch.arange(length) < lens[..., None]
        nv = torch.randn(b, generator=gen)
        for g_tok in (None, 1.0):
            tadv, _ = token_gae(rewards, tv, tmask, masks, nv, 0.9, 0.8, g_tok)
            ref = _marft_token_gae(rewards, tv, tmask, masks, nv, 0.9, 0.8, 0.9 if g_tok is None else g_tok)
            close(tadv, ref, atol=1e-5)


def test_token_gae_with_unit_gammas_equals_action_gae_on_one_token_actions() -> None:
    gen = torch.Generator().manual_seed(6)
    rewards = torch.randn(2, 3, 2, generator=gen)
    values = torch.randn(3, 3, 2, generator=gen)
    masks = torch.ones(3, 3, 2)
    masks[2] = 0
    a_adv, _ = action_gae(rewards, values, masks, 0.95, 0.9)
    t_adv, _ = token_gae(
        rewards, values[:2, ..., None], torch.ones(2, 3, 2, 1), masks, torch.zeros(3), 0.95, 0.9
    )
    close(t_adv[..., 0], a_adv, atol=1e-6)


def test_gae_properties_lambda_one_is_monte_carlo_lambda_zero_is_td() -> None:
    gen = torch.Generator().manual_seed(7)
    r = torch.randn(3, 6, generator=gen)
    v = torch.randn(3, 6, generator=gen)
    m = torch.ones(3, 6)
    gamma = 0.9
    adv1, ret1 = gae(r, v, m, gamma, 1.0)
    disc = gamma ** torch.arange(6.0)
    mc = torch.stack([(r[:, t:] * disc[: 6 - t]).sum(-1) for t in range(6)], -1)
    close(ret1, mc, atol=1e-5)  # λ = 1: the return is the discounted Monte-Carlo return
    adv0, _ = gae(r, v, m, gamma, 0.0)
    v_next = torch.cat([v[:, 1:], torch.zeros(3, 1)], -1)
    close(adv0, r + gamma * v_next - v, atol=1e-6)  # λ = 0: the one-step TD error
    # a per-position discount of 0 cuts the bootstrap: two halves computed separately agree
    g = torch.full((3, 6), gamma)
    g[:, 2] = 0.0
    cut, _ = gae(r, v, m, g, 0.7)
    left, _ = gae(r[:, :3], v[:, :3], m[:, :3], g[:, :3], 0.7)
    right, _ = gae(r[:, 3:], v[:, 3:], m[:, 3:], gamma, 0.7)
    close(cut, torch.cat([left, right], -1), atol=1e-6)
