"""Advantage estimators: group baselines (GRPO, Dr. GRPO, Dr. MAS, AT-GRPO) and critic-based GAE (MARFT).

Every function here is pure (tensors in, tensors out, torch only, no module state) so it can be
checked against the worked examples of ``docs/algorithms.md`` on 3-element tensors
(``tests/unit/learner/test_algorithms.py``).

Design decisions (docs/algorithms.md §1 and §6):

* **Group baselines.** ``grpo_advantages`` is DeepSeekMath §4.1.2 outcome supervision:
  Â_i = (R_i − mean_g R) / (std_g R + ε). ``scale=False`` is Dr. GRPO (Liu et al. 2503.20783):
  Â_i = R_i − mean_g R. The std is the *sample* std by default (``unbiased=True``), as verl and DrMAS
  compute it; pass ``unbiased=False`` for the population std that MARFT/HARL use.
* **Singleton groups** (:data:`SingletonRule`). A row alone in its group has no baseline; verl gives it
  mean 0 and std 1, i.e. its raw reward. ``batch`` (the learner's default) normalises it against a
  coarser grouping instead (the agent's rows in the batch for Dr. MAS), ``zero`` gives 0, ``raw`` keeps
  verl's rule for parity (the default of the pure :func:`grpo_advantages`, whose tests pin it).
* **Agent-wise normalisation** (Dr. MAS, Feng et al. 2602.08847; DrMAS ``group_by_agent_id=True``):
  rows are grouped by the pair (group id, agent id), so each agent is normalised by *its own*
  reward mean and std within the group. This is the paper's fix for gradient-norm spikes: with
  global normalisation an agent whose rewards live on a large scale dominates the std, and the other
  agents' advantages collapse to a near-constant (see ``tests/unit/learner/test_advantages.py``).
  AT-GRPO (PettingLLMs) groups by (group, agent, turn) (``turn_ids``). The global alternative that
  DrMAS implements (``group_by_agent_id=False``: average each trajectory's rows first, normalise one
  value per trajectory) is :func:`trajectory_advantages`. :func:`outcome_advantages` dispatches on
  the config's ``algorithm``.
* **GAE** (Schulman et al. 1506.02438, Eq. 16) is one recursion, :func:`gae`, with verl's masked loop
  (positions with m = 0 carry ``nextvalues`` and the running GAE through unchanged) and a per-position
  discount. MARFT's action-level GAE (:func:`action_gae`, ``ActionBuffer``: agents are macro-actions
  in execution order; agent i < n bootstraps from agent i+1 of the *same* step, agent n from agent 1
  of the next step, γ between agents, following the multi-agent advantage decomposition of Kuba et
  al. 2109.11251, Lemma 1) and token-level GAE (:func:`token_gae`, ``TokenBuffer``: inside an action
  δ = γ_tok·V_{j+1} − V_j, the last token takes the reward and bootstraps from the next agent's
  first-token value) are that recursion over a flattened sequence. MARFT applies γ per token;
  ``token_gamma`` = 1 makes the token MDP equal the action MDP. Default: MARFT's behaviour.
* **V-trace** (Espeholt et al. 1802.01561, §4.1 Eq. 1 and the policy-gradient advantage of §4.2),
  for a critic trained on stale data; c̄ is a parameter (IMPALA hard-codes 1.0). Not selected by any
  config field yet.

Errors: malformed inputs (shape/dtype mismatch, non-finite rewards) raise :class:`AlgorithmError`, a
``ValueError``; nothing is clamped or dropped without a counter the caller can read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "AlgorithmError",
    "group_index",
    "singleton_group_count",
    "SingletonRule",
    "Algorithm",
    "grpo_advantages",
    "agentwise_advantages",
    "trajectory_advantages",
    "advantage_groups",
    "outcome_advantages",
    "broadcast_to_tokens",
    "masked_whiten",
    "gae",
    "action_gae",
    "token_gae",
    "vtrace",
]


class AlgorithmError(ValueError):
    """Inputs to a learner algorithm are inconsistent (shapes, dtypes, non-finite values, bad options).

    Shared by ``advantages``, ``losses`` and ``update``; it is a ``ValueError`` so generic callers still
    catch it.
    """


# --------------------------------------------------------------------------------------------------
# validation helpers


def _check_1d_float(name: str, x: Tensor) -> None:
    if x.dim() != 1 or not x.is_floating_point():
        raise AlgorithmError(f"{name} must be a 1-D float tensor [B], got shape {tuple(x.shape)} {x.dtype}")
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise AlgorithmError(f"{name} has {bad} non-finite entries; rewards must be finite")


def _check_ids(name: str, ids: Tensor, b: int) -> None:
    if ids.dim() != 1 or ids.shape[0] != b:
        raise AlgorithmError(f"{name} must have shape [{b}], got {tuple(ids.shape)}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise AlgorithmError(f"{name} must be an integer tensor, got {ids.dtype}")


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise AlgorithmError(f"shapes must match: {shapes}")


# --------------------------------------------------------------------------------------------------
# group baselines (docs/algorithms.md §1)


def group_index(*ids: Tensor) -> tuple[Tensor, int]:
    """Dense group index of each row from one or more integer id columns.

    Shapes: each ``ids[k]`` is [B] int; returns (index [B] int64 in [0, G), G).
    Rows share a group iff all their id columns are equal (e.g. (prompt uid, agent id)).
    """
    if not ids:
        raise AlgorithmError("group_index needs at least one id tensor")
    if len(ids) == 1:
        _, inverse = torch.unique(ids[0], return_inverse=True)
    else:
        _, inverse = torch.unique(
            torch.stack([i.to(torch.int64) for i in ids], dim=1), dim=0, return_inverse=True
        )
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    return inverse, n_groups


def singleton_group_count(*ids: Tensor) -> int:
    """Number of groups with exactly one row: no within-group baseline exists for them (a metric)."""
    inverse, n_groups = group_index(*ids)
    if n_groups == 0:
        return 0
    return int((torch.bincount(inverse, minlength=n_groups) == 1).sum())


SingletonRule = Literal["batch", "zero", "raw"]
"""What a row alone in its group gets (docs/algorithms.md, "Singleton groups"):

* ``batch``: normalised against the first *fallback* grouping in which its group has >= 2 rows (for
  Dr. MAS: all rows of the same agent in the batch; for GRPO: the whole batch); 0 when none has.
* ``zero``: advantage 0 (the row carries no learning signal).
* ``raw``: verl's rule, mean 0 and std 1, i.e. R/(1+ε): the unnormalised reward (reference parity only).
"""


def _group_stats(
    values: Tensor, inverse: Tensor, n_groups: int, unbiased: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, mean, std) [G]; std is the sample std (N−1) when ``unbiased``, 0 for one row."""
    counts = torch.bincount(inverse, minlength=n_groups).to(values.dtype)
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)
    mean = sums / counts.clamp(min=1.0)
    sq = torch.zeros_like(sums).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    denom = (counts - 1.0) if unbiased else counts
    std = torch.sqrt(sq / denom.clamp(min=1.0))
    return counts, mean, std


def _normalise_in_groups(
    values: Tensor,
    inverse: Tensor,
    n_groups: int,
    eps: float,
    scale: bool,
    unbiased: bool,
    singleton: SingletonRule = "raw",
    fallbacks: Sequence[tuple[Tensor, int]] = (),
) -> Tensor:
    """(x − mean_g) / (std_g + eps) per group; a one-row group follows ``singleton`` (see SingletonRule).

    ``fallbacks``: coarser (inverse, n_groups) groupings tried in order for singleton rows (``batch``).
    """
    if singleton not in ("batch", "zero", "raw"):
        raise AlgorithmError(f"unknown singleton rule {singleton!r}; expected 'batch', 'zero' or 'raw'")
    counts, mean, std = _group_stats(values, inverse, n_groups, unbiased)
    single = counts[inverse] == 1
    if singleton == "raw":  # verl: mean 0, std 1
        mean = torch.where(counts == 1, torch.zeros_like(mean), mean)
        std = torch.where(counts == 1, torch.ones_like(std), std)
    centred = values - mean[inverse]
    out = centred / (std[inverse] + eps) if scale else centred
    if singleton == "raw" or not bool(single.any()):
        return out
    out = torch.where(single, torch.zeros_like(out), out)
    if singleton == "zero":
        return out
    pending = single
    for f_inv, f_n in fallbacks:
        f_counts, f_mean, f_std = _group_stats(values, f_inv, f_n, unbiased)
        use = pending & (f_counts[f_inv] >= 2)
        f_centred = values - f_mean[f_inv]
        f_out = f_centred / (f_std[f_inv] + eps) if scale else f_centred
        out = torch.where(use, f_out, out)
        pending = pending & ~use
    return out


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    eps: float = 1e-6,
    scale: bool = True,
    unbiased: bool = True,
    singleton: SingletonRule = "raw",
) -> Tensor:
    """GRPO outcome advantage (DeepSeekMath §4.1.2; Dr. GRPO when ``scale=False``).

    Shapes: rewards [B] float (one scalar score per row), group_ids [B] int; returns [B].
    Â_i = (R_i − mean_g R) / (std_g R + eps), the group g being all rows with the same id (the G
    samples of one prompt). All rewards equal gives 0. A single-row group: ``raw`` (the default here,
    verl parity) gives R/(1+eps); ``batch`` normalises it against the whole batch; ``zero`` gives 0.
    """
    _check_1d_float("rewards", rewards)
    _check_ids("group_ids", group_ids, rewards.shape[0])
    if eps < 0:
        raise AlgorithmError(f"eps must be >= 0, got {eps}")
    inverse, n_groups = group_index(group_ids)
    batch = (torch.zeros_like(inverse), 1)
    return _normalise_in_groups(rewards, inverse, n_groups, eps, scale, unbiased, singleton, [batch])


def agentwise_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    agent_ids: Tensor,
    eps: float = 1e-6,
    scale: bool = True,
    unbiased: bool = True,
    singleton: SingletonRule = "batch",
    turn_ids: Tensor | None = None,
) -> Tensor:
    """Dr. MAS agent-wise advantage: normalise each agent by its own reward statistics in the group.

    Shapes: rewards [B], group_ids [B] int, agent_ids [B] int, turn_ids [B] int or None; returns [B].
    Each row is one agent turn; rows are grouped by (group id, agent id) (DrMAS
    ``group_index = f"{uid}_{agent_id}"``), then normalised as in :func:`grpo_advantages`.
    Turns of one trajectory by the same agent all enter its group and are counted as independent
    samples (the paper's choice; they are correlated).

    ``turn_ids`` given: AT-GRPO (PettingLLMs) grouping by (group, agent, turn) instead; a singleton
    (group, agent, turn) falls back to (group, agent) before the agent's batch rows.

    Singleton (group, agent) pairs (an agent that acted once in the group, e.g. a routed reviewer):
    ``batch`` (default) normalises the row against *all* rows of the same agent in the batch (the
    agent's batch-level baseline, never another agent's rewards), 0 if the agent has one row in the
    batch; ``zero`` gives 0; ``raw`` is verl's R/(1+eps).
    """
    _check_1d_float("rewards", rewards)
    _check_ids("group_ids", group_ids, rewards.shape[0])
    _check_ids("agent_ids", agent_ids, rewards.shape[0])
    fallbacks = [group_index(agent_ids)]
    if turn_ids is None:
        inverse, n_groups = group_index(group_ids, agent_ids)
    else:
        _check_ids("turn_ids", turn_ids, rewards.shape[0])
        inverse, n_groups = group_index(group_ids, agent_ids, turn_ids)
        fallbacks.insert(0, group_index(group_ids, agent_ids))
    return _normalise_in_groups(rewards, inverse, n_groups, eps, scale, unbiased, singleton, fallbacks)


def trajectory_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    traj_ids: Tensor,
    eps: float = 1e-6,
    scale: bool = True,
    unbiased: bool = True,
    singleton: SingletonRule = "raw",
) -> Tensor:
    """Global (not agent-wise) group advantage as DrMAS computes it with ``group_by_agent_id=False``.

    Shapes: rewards [B], group_ids [B] int, traj_ids [B] int; returns [B].
    The rows of each trajectory (all agents' turns) are first averaged to one value; those values are
    normalised within the prompt group; every row of a trajectory gets its trajectory's advantage.
    A group of one trajectory follows ``singleton`` with the batch's trajectories as fallback.
    """
    _check_1d_float("rewards", rewards)
    _check_ids("group_ids", group_ids, rewards.shape[0])
    _check_ids("traj_ids", traj_ids, rewards.shape[0])
    traj_inv, n_traj = group_index(group_ids, traj_ids)
    counts = torch.bincount(traj_inv, minlength=n_traj).to(rewards.dtype)
    traj_mean = torch.zeros(n_traj, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, traj_inv, rewards
    )
    traj_mean = traj_mean / counts
    traj_group = torch.zeros(n_traj, dtype=torch.int64, device=rewards.device)
    traj_group[traj_inv] = group_ids.to(torch.int64)
    group_inv, n_groups = group_index(traj_group)
    batch = (torch.zeros_like(group_inv), 1)
    traj_adv = _normalise_in_groups(traj_mean, group_inv, n_groups, eps, scale, unbiased, singleton, [batch])
    return traj_adv[traj_inv]


Algorithm = Literal["grpo", "dr_grpo", "drmas", "at_grpo", "grpo_trajectory"]


def advantage_groups(
    algorithm: Algorithm, group_ids: Tensor, agent_ids: Tensor, traj_ids: Tensor, turn_ids: Tensor
) -> tuple[Tensor, ...]:
    """The id columns whose equal values form one baseline group under ``algorithm`` (for metrics)."""
    if algorithm in ("grpo", "dr_grpo"):
        return (group_ids,)
    if algorithm == "drmas":
        return (group_ids, agent_ids)
    if algorithm == "at_grpo":
        return (group_ids, agent_ids, turn_ids)
    if algorithm == "grpo_trajectory":
        return (group_ids,)  # one value per trajectory enters the group
    raise AlgorithmError(
        f"unknown algorithm {algorithm!r}; expected grpo, dr_grpo, drmas, at_grpo or grpo_trajectory"
    )


def outcome_advantages(
    algorithm: Algorithm,
    rewards: Tensor,
    group_ids: Tensor,
    agent_ids: Tensor,
    traj_ids: Tensor,
    turn_ids: Tensor,
    singleton: SingletonRule = "batch",
    eps: float = 1e-6,
    scale: bool = True,
) -> Tensor:
    """One outcome advantage per row [B] under the config's ``algorithm`` (docs/algorithms.md §1).

    grpo: (group) normalised; dr_grpo: (group) centred, unscaled; drmas: (group, agent) normalised;
    at_grpo: (group, agent, turn) normalised; grpo_trajectory: trajectory means normalised per group.
    ``scale=False`` (``learner.advantage_std = false``) centres without dividing by the group's std, as
    Dr. GRPO does, for any grouping (dr_grpo is always unscaled).
    """
    advantage_groups(algorithm, group_ids, agent_ids, traj_ids, turn_ids)  # validates the name
    if algorithm == "drmas":
        return agentwise_advantages(rewards, group_ids, agent_ids, eps, scale, singleton=singleton)
    if algorithm == "at_grpo":
        return agentwise_advantages(
            rewards, group_ids, agent_ids, eps, scale, singleton=singleton, turn_ids=turn_ids
        )
    if algorithm == "grpo_trajectory":
        return trajectory_advantages(rewards, group_ids, traj_ids, eps, scale, singleton=singleton)
    return grpo_advantages(rewards, group_ids, eps, scale and algorithm == "grpo", singleton=singleton)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Outcome advantage per row to every response token. Shapes: advantages [B], mask [B, L] -> [B, L]."""
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise AlgorithmError(
            f"need advantages [B] and mask [B, L], got {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    return advantages[:, None] * mask.to(advantages.dtype)


def masked_whiten(
    values: Tensor, mask: Tensor, eps: float = 1e-8, unbiased: bool = True, shift_mean: bool = True
) -> Tensor:
    """Normalise ``values`` over the positions where ``mask`` is 1 (any shape, both the same).

    Returns (x − mean)·rsqrt(var + eps) at masked positions and 0 elsewhere (verl ``masked_whiten``,
    unbiased var by default). MARFT instead turns zeros into NaN and uses the population nanstd; an
    explicit mask is used here because that trick also discards genuine zero advantages.
    ``shift_mean=False`` keeps the mean (scale only).
    """
    _check_same_shape(values=values, mask=mask)
    m = mask.to(values.dtype)
    n = m.sum()
    if n < 1:
        raise AlgorithmError("masked_whiten: mask selects no element")
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum()
    var = var / (n - 1.0) if (unbiased and n > 1) else var / n
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


# --------------------------------------------------------------------------------------------------
# critic-based estimators (docs/algorithms.md §6)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float | Tensor,
    lam: float,
    last_value: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over one sequence per row (GAE Eq. 16; verl masked loop).

    Shapes: rewards, values, mask [B, L] (reward on the last valid token); ``gamma`` a float or a
    per-position discount [B, L] (γ_t: the discount from position t to the next valid one, 0 to stop
    the bootstrap there); last_value [B] or None (V past the sequence, 0 by default). Returns
    (advantages [B, L], returns [B, L]), both 0 where mask is 0.
    δ_t = r_t + γ_t V_{t+1} − V_t, Â_t = δ_t + γ_t λ Â_{t+1}, G_t = Â_t + V_t, where t+1 is the next
    position with m = 1: positions with m_t = 0 carry the next value and the running Â unchanged.
    This one recursion is also the action-level and token-level MARFT GAE (:func:`action_gae`,
    :func:`token_gae`), which lay their macro-actions / tokens out as one sequence per row.
    """
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    if rewards.dim() != 2:
        raise AlgorithmError(f"gae expects [B, L] tensors, got {tuple(rewards.shape)}")
    g = torch.as_tensor(gamma, dtype=values.dtype, device=values.device).expand_as(values)
    keep = mask.bool()
    b, length = rewards.shape
    next_value = (
        torch.zeros(b, dtype=values.dtype, device=values.device) if last_value is None else last_value
    )
    running = torch.zeros_like(next_value)
    adv = torch.zeros_like(values)
    for t in reversed(range(length)):
        delta = rewards[:, t] + g[:, t] * next_value - values[:, t]
        new_running = delta + g[:, t] * lam * running
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        running = torch.where(keep[:, t], new_running, running)
        adv[:, t] = running
    adv = torch.where(keep, adv, torch.zeros_like(adv))
    return adv, torch.where(keep, adv + values, torch.zeros_like(adv))


def action_gae(
    rewards: Tensor, values: Tensor, masks: Tensor, gamma: float = 0.99, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """MARFT action-level GAE over agents as macro-actions (docs/algorithms.md §6, ``ActionBuffer``).

    Shapes (time-major, agents in *execution* order):
      rewards [T, B, N]; values [T+1, B, N] with values[T, :, 0] the bootstrap V¹_{T} (other entries
      of row T unused); masks [T+1, B, N], masks[t] = 1 while step t is part of the episode (masks[0]
      is 1; a step after termination is 0, so masks[t+1] = 0 stops the bootstrap).
    Returns (advantages [T, B, N], returns [T, B, N]), zeroed on dead steps.
      i < n: δⁱ_t = rⁱ_t + γ·V^{i+1}_t·m^{i+1}_t − Vⁱ_t,   Âⁱ_t = δⁱ_t + γλ·m^{i+1}_t·Â^{i+1}_t
      i = n: δⁿ_t = rⁿ_t + γ·V¹_{t+1}·m¹_{t+1} − Vⁿ_t,     Âⁿ_t = δⁿ_t + γλ·m¹_{t+1}·Â¹_{t+1}
    Computed by :func:`gae` over the T·N macro-actions of each row in (t, i) order, with the
    per-position discount γ·m(next macro-action).
    """
    if rewards.dim() != 3:
        raise AlgorithmError(f"rewards must be [T, B, N], got {tuple(rewards.shape)}")
    t_len, b, n = rewards.shape
    if tuple(values.shape) != (t_len + 1, b, n) or tuple(masks.shape) != (t_len + 1, b, n):
        raise AlgorithmError(
            f"values and masks must be [T+1, B, N] = {(t_len + 1, b, n)}, got {tuple(values.shape)}, {tuple(masks.shape)}"
        )
    m = masks.to(values.dtype)
    # the mask of each macro-action's successor: agent i+1 of step t, or agent 1 of step t+1
    next_m = torch.cat([m[:t_len, :, 1:], m[1:, :, :1]], dim=2)  # [T, B, N]

    def flat(x: Tensor) -> Tensor:  # [T, B, N] -> [B, T·N] in (t, i) order
        return x.permute(1, 0, 2).reshape(b, t_len * n)

    adv, ret = gae(
        flat(rewards.to(values.dtype)),
        flat(values[:t_len]),
        flat(m[:t_len]),
        flat(gamma * next_m),
        lam,
        last_value=values[t_len, :, 0],
    )
    return adv.reshape(b, t_len, n).permute(1, 0, 2), ret.reshape(b, t_len, n).permute(1, 0, 2)


def token_gae(
    rewards: Tensor,
    values: Tensor,
    token_mask: Tensor,
    masks: Tensor,
    next_value: Tensor,
    gamma: float = 0.99,
    lam: float = 0.95,
    token_gamma: float | None = None,
) -> tuple[Tensor, Tensor]:
    """MARFT token-level GAE (docs/algorithms.md §6, ``TokenBuffer``).

    Shapes: rewards [T, B, N] (reward of agent i's action at step t); values, token_mask [T, B, N, L]
    (V_{t,i,j} = value of the state *before* token j; actions right-padded, valid length K = last
    masked position + 1); masks [T+1, B, N] as in :func:`action_gae`; next_value [B] the bootstrap
    V_{T,1,0} for the step after the batch. Returns (advantages, returns) [T, B, N, L], 0 on padding
    and dead steps.
      j < K−1:          δ = γ_tok·V_{t,i,j+1} − V_{t,i,j},        Â_j = δ + γ_tok·λ·Â_{j+1}
      j = K−1, i < n:   δ = rⁱ_t + γ·m·V_{t,i+1,0} − V_{t,i,K−1},  Â_j = δ + γλ·m·Â_{t,i+1,0}
      j = K−1, i = n:   the same with V_{t+1,1,0}·m_{t+1} (``next_value`` on the last step).
    ``token_gamma`` defaults to ``gamma`` (MARFT); 1.0 makes the token MDP match the action MDP.
    A live action with no valid token raises. Computed by :func:`gae` over the tokens of each row
    in (t, i, j) order, with discount γ_tok inside an action and γ·m at its last token.
    """
    if values.dim() != 4:
        raise AlgorithmError(f"values must be [T, B, N, L], got {tuple(values.shape)}")
    _check_same_shape(values=values, token_mask=token_mask)
    t_len, b, n, length = values.shape
    if tuple(rewards.shape) != (t_len, b, n) or tuple(masks.shape) != (t_len + 1, b, n):
        raise AlgorithmError(
            f"need rewards [T, B, N] and masks [T+1, B, N] for values {tuple(values.shape)}, "
            f"got {tuple(rewards.shape)}, {tuple(masks.shape)}"
        )
    if tuple(next_value.shape) != (b,):
        raise AlgorithmError(f"next_value must be [B] = ({b},), got {tuple(next_value.shape)}")
    g_tok = gamma if token_gamma is None else token_gamma
    tok_rewards, valid, disc = _token_mdp(rewards, values, token_mask, masks, gamma, g_tok)

    def flat(x: Tensor) -> Tensor:  # [T, B, N, L] -> [B, T·N·L] in (t, i, j) order
        return x.permute(1, 0, 2, 3).reshape(b, t_len * n * length)

    adv, ret = gae(
        flat(tok_rewards), flat(values), flat(valid), flat(disc), lam, last_value=next_value.to(values.dtype)
    )

    def unflat(x: Tensor) -> Tensor:
        return x.reshape(b, t_len, n, length).permute(1, 0, 2, 3)

    return unflat(adv), unflat(ret)


def _token_mdp(
    rewards: Tensor, values: Tensor, token_mask: Tensor, masks: Tensor, gamma: float, token_gamma: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The token MDP :func:`token_gae` runs :func:`gae` on, each [T, B, N, L]: the rewards (an
    action's reward at its last valid token), which tokens are live, and the discounts (γ_tok inside
    an action, γ·m of the successor action at its last token). Shapes as checked by :func:`token_gae`."""
    t_len, length = values.shape[0], values.shape[-1]
    m = masks.to(values.dtype)
    tm = token_mask.bool()
    pos = torch.arange(length, device=values.device)
    # K per action: last valid position + 1 (MARFT); 0 for an action with no valid token.
    k_len = torch.where(tm, pos + 1, torch.zeros_like(pos)).amax(dim=-1)  # [T, B, N]
    empty_live = (k_len == 0) & (m[:t_len] > 0)
    if empty_live.any():
        raise AlgorithmError(f"{int(empty_live.sum())} live actions have no valid token")
    valid = (pos < k_len[..., None]) & (m[:t_len, ..., None] > 0)  # [T, B, N, L]
    is_last = pos == (k_len - 1)[..., None]
    next_m = torch.cat([m[:t_len, :, 1:], m[1:, :, :1]], dim=2)  # successor action alive
    disc = torch.where(is_last, gamma * next_m[..., None], torch.full_like(values, token_gamma))
    tok_rewards = torch.where(is_last, rewards[..., None].to(values.dtype), torch.zeros_like(values))
    return tok_rewards, valid, disc


def vtrace(
    log_rhos: Tensor,
    discounts: Tensor,
    rewards: Tensor,
    values: Tensor,
    bootstrap_value: Tensor,
    clip_rho: float = 1.0,
    clip_pg_rho: float = 1.0,
    clip_c: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """V-trace targets and policy-gradient advantages (IMPALA §4.1 Eq. 1, §4.2), no gradient.

    Shapes (time-major): log_rhos = log π/μ, discounts (γ_t, 0 at episode ends), rewards, values
    [T, B]; bootstrap_value [B]. Returns (vs [T, B], pg_advantages [T, B]), both detached.
      δ_t = ρ̄_t (r_t + γ_t V_{t+1} − V_t),  v_t − V_t = δ_t + γ_t c_t (v_{t+1} − V_{t+1}),
      A_t = min(ρ̄_pg, ρ_t)(r_t + γ_t v_{t+1} − V_t), with ρ̄_t = min(ρ̄, ρ_t), c_t = min(c̄, ρ_t).
    """
    _check_same_shape(log_rhos=log_rhos, discounts=discounts, rewards=rewards, values=values)
    with torch.no_grad():
        rhos = torch.exp(log_rhos)
        rho_bar = rhos.clamp(max=clip_rho)
        cs = rhos.clamp(max=clip_c)
        values_next = torch.cat([values[1:], bootstrap_value[None]], dim=0)
        deltas = rho_bar * (rewards + discounts * values_next - values)
        acc = torch.zeros_like(bootstrap_value)
        diffs = torch.zeros_like(values)
        for t in reversed(range(values.shape[0])):
            acc = deltas[t] + discounts[t] * cs[t] * acc
            diffs[t] = acc
        vs = diffs + values
        vs_next = torch.cat([vs[1:], bootstrap_value[None]], dim=0)
        pg_adv = rhos.clamp(max=clip_pg_rho) * (rewards + discounts * vs_next - values)
    return vs, pg_adv
