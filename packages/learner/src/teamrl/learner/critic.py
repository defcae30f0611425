"""Centralised critic for PPO with a value function (MARFT APPO / TPPO, docs/algorithms.md §6).

Call sequence (what :class:`teamrl.learner.engine.LearnerEngine` does with ``objective="ppo-critic"``)::

    feats = base hidden states (adapters disabled, no grad)   # [N, H] action level, [N, R, H] token level
    v_old = head(feats)                                       # before this step's critic update
    adv, ret = action_level_gae(...) | token_level_gae(...)   # on v_old
    loss = value_coef * agg(clipped_value_loss(head(feats), v_old, ret))   # critic optimiser step(s)
    metrics: value_loss, explained_variance(v_old, ret), value_mean

Design decisions:

* **A value head on the shared frozen base, not a separate critic model.** The head is a small MLP
  (hidden → ``hidden_units`` → 1, ReLU; MARFT uses hidden → 1024 → 512 → 1 on a frozen base LM)
  reading the *base* model's last hidden state, i.e. the LM with every adapter disabled
  (``disable_adapter()``). So the critic needs no second model in memory (the same frozen weights
  serve the policy, the KL reference and the critic), one centralised critic serves every agent
  (MARFT's choice: the state of agent i's turn already contains its predecessors' actions, so
  Vⁱ_t = V(s_t, a^{<i}_t)), and since the features do not depend on the adapters they are computed
  once per step under ``no_grad`` and reused by every critic epoch; the gradient of the value loss
  never reaches the LM. The price is a critic that can only be as good as a linear-ish read-out of
  frozen features; a separate tiny critic LM was rejected because it would need its own tokenised
  forward per step and its own checkpoint format, for no expected gain at LoRA scale.
* **Where values are read.** Action level (APPO): the hidden state at the last prompt position
  (``prompt_len − 1``), i.e. V of the state before the action. Token level (TPPO): the hidden state at
  ``prompt_len − 1 + j``, V of the state before response token j (MARFT ``get_slice``).
* **Layout for the GAE functions.** The rows of one trajectory are its trainable agent steps in
  execution order (agent steps of turn t, then turn t+1). MARFT's (T, N) grid bootstraps agent i from
  agent i+1 of the same turn and agent n from agent 1 of the next turn, with γ between agents, which
  is exactly a flat sequence over the steps in execution order; so rows are laid out as
  [S, B, 1] (S = most steps in a trajectory, B = trajectories, one "agent" per slot) and passed to
  :func:`teamrl.learner.advantages.action_gae` / :func:`~teamrl.learner.advantages.token_gae`. This
  also covers workflows whose turns have different agent counts. Trajectories are complete episodes:
  the bootstrap after the last step is 0 (mask 0). Steps the learner ignores (foreign adapters, empty
  responses) are not part of the modelled chain (they are counted by ``build_rows``).
* **Rewards.** ``reward_source="step"``: each step's own reward (credit assignment happened in the
  rewards package). ``"trajectory"``: the team reward sits on the trajectory's last step only, so the
  return of every earlier step sees it once (putting it on every step would count it once per agent).
* **Value loss**: :func:`teamrl.learner.losses.clipped_value_loss` (PPO2 / MARFT), masked mean over
  values (rows at action level, response tokens at token level), times ``value_coef``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from teamrl.learner.advantages import AlgorithmError, action_gae, token_gae

__all__ = [
    "ValueHead",
    "trajectory_layout",
    "chain_rewards",
    "action_level_gae",
    "token_level_gae",
    "explained_variance",
]


class ValueHead(nn.Module):
    """V from a hidden state: Linear(H, h) → ReLU → Linear(h, 1). Input [..., H], output [...] float32.

    The last layer starts at zero, so the first values are 0 (returns are learnt from scratch rather
    than from a random offset).
    """

    def __init__(self, hidden_size: int, hidden_units: int = 256) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden_size, hidden_units)
        self.out = nn.Linear(hidden_units, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, features: Tensor) -> Tensor:
        return self.out(torch.relu(self.fc(features.float()))).squeeze(-1)


def trajectory_layout(traj_idx: Tensor, n_traj: int) -> tuple[Tensor, int]:
    """Position of every row inside its trajectory's chain and the longest chain.

    Shapes: traj_idx [N] int64 (rows of a trajectory in execution order, as ``build_rows`` emits them);
    returns (slot [N] int64, S). Row r sits at grid cell (slot[r], traj_idx[r]).
    """
    if traj_idx.dim() != 1:
        raise AlgorithmError(f"traj_idx must be [N], got {tuple(traj_idx.shape)}")
    if len(traj_idx) and (int(traj_idx.min()) < 0 or int(traj_idx.max()) >= n_traj):
        raise AlgorithmError(f"traj_idx must lie in [0, {n_traj}), got {traj_idx.tolist()}")
    seen = [0] * n_traj
    slot = torch.empty_like(traj_idx)
    for r, t in enumerate(traj_idx.tolist()):
        slot[r] = seen[t]
        seen[t] += 1
    return slot, max(seen, default=0)


def chain_rewards(rewards: Tensor, traj_idx: Tensor, team_rewards: Tensor | None) -> Tensor:
    """Per-row rewards for the GAE chain [N].

    ``team_rewards`` None: the rows' own rewards. Else ``team_rewards`` [B]: the trajectory's team reward
    on its last row, 0 on its other rows (see the module docstring).
    """
    if team_rewards is None:
        return rewards.float()
    out = torch.zeros_like(rewards, dtype=torch.float32)
    last: dict[int, int] = {}
    for r, t in enumerate(traj_idx.tolist()):
        last[t] = r
    for t, r in last.items():
        out[r] = float(team_rewards[t])
    return out


def _grid(x: Tensor, slot: Tensor, traj_idx: Tensor, s: int, b: int, extra: tuple[int, ...] = ()) -> Tensor:
    g = torch.zeros((s + 1, b, 1, *extra), dtype=torch.float32)
    g[slot, traj_idx, 0] = x.float()
    return g


def action_level_gae(
    rewards: Tensor,
    values: Tensor,
    traj_idx: Tensor,
    n_traj: int,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """MARFT action-level GAE on rows (agent steps). Shapes: rewards, values [N]; returns (adv, ret) [N].

    Rows are placed on the [S, B, 1] grid of :func:`trajectory_layout` and handed to
    :func:`teamrl.learner.advantages.action_gae`; every row is a live step, the cell after each chain
    is dead (terminal, no bootstrap).
    """
    if rewards.shape != values.shape or rewards.dim() != 1 or traj_idx.shape != rewards.shape:
        raise AlgorithmError(
            f"need rewards, values, traj_idx all [N], got {tuple(rewards.shape)}, {tuple(values.shape)}, "
            f"{tuple(traj_idx.shape)}"
        )
    slot, s = trajectory_layout(traj_idx, n_traj)
    r = _grid(rewards, slot, traj_idx, s, n_traj)[:s]
    v = _grid(values, slot, traj_idx, s, n_traj)
    m = _grid(torch.ones_like(values), slot, traj_idx, s, n_traj)
    adv, ret = action_gae(r, v, m, gamma=gamma, lam=lam)
    return adv[slot, traj_idx, 0], ret[slot, traj_idx, 0]


def token_level_gae(
    rewards: Tensor,
    values: Tensor,
    resp_mask: Tensor,
    traj_idx: Tensor,
    n_traj: int,
    gamma: float,
    lam: float,
    token_gamma: float | None = None,
) -> tuple[Tensor, Tensor]:
    """MARFT token-level GAE on rows. Shapes: rewards [N], values / resp_mask [N, R]; returns [N, R].

    values[r, j] is V of the state before response token j of row r (right-padded responses). Rows go on
    the [S, B, 1, R] grid and through :func:`teamrl.learner.advantages.token_gae` with a zero terminal
    bootstrap; advantages and returns are 0 on padding.
    """
    n = rewards.shape[0]
    if values.dim() != 2 or values.shape != resp_mask.shape or values.shape[0] != n:
        raise AlgorithmError(
            f"need rewards [N], values and resp_mask [N, R], got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(resp_mask.shape)}"
        )
    big_r = values.shape[1]
    slot, s = trajectory_layout(traj_idx, n_traj)
    r = _grid(rewards, slot, traj_idx, s, n_traj)[:s]
    v = _grid(values * resp_mask, slot, traj_idx, s, n_traj, (big_r,))[:s]
    tm = _grid(resp_mask.float(), slot, traj_idx, s, n_traj, (big_r,))[:s]
    m = _grid(torch.ones(n), slot, traj_idx, s, n_traj)
    adv, ret = token_gae(r, v, tm, m, torch.zeros(n_traj), gamma=gamma, lam=lam, token_gamma=token_gamma)
    return adv[slot, traj_idx, 0], ret[slot, traj_idx, 0]


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor | None = None) -> float:
    """1 − Var[G − V] / Var[G] over the masked entries (population variances); NaN when Var[G] = 0."""
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    v, g = values[mask.bool()].double(), returns[mask.bool()].double()
    if g.numel() == 0:
        return float("nan")
    var_g = g.var(unbiased=False)
    if float(var_g) == 0.0:
        return float("nan")
    return float(1.0 - (g - v).var(unbiased=False) / var_g)
