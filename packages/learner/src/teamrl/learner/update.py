"""Agent-by-agent sequential update (HAPPO, Kuba et al. 2109.11251; MARFT's trust-region scheme).

By the multi-agent advantage decomposition (Lemma 1 of 2109.11251), agents can be improved one at a
time in a random order i₁…iₙ. When agent iₘ trains, the agents before it already have new parameters
π̄, and its surrogate weights the joint advantage Â by the correction factor

    M^{i₁:ₘ} = sg[ ∏_{k<m} π̄^{iₖ}(a^{iₖ}|o^{iₖ}) / π^{iₖ}_old(a^{iₖ}|o^{iₖ}) ] · Â,

    L^{iₘ}(θ) = −E[ min( r_θ·M, clip(r_θ, 1−ε, 1+ε)·M ) ],  r_θ = π^{iₘ}_θ / π^{iₘ}_old.

Design decisions (docs/algorithms.md §4):

* **Joint samples** (:func:`joint_rows`, config ``happo_factor``). HAPPO's factor is per time step:
  the joint action a_t of turn t is what the earlier-updated agents' ratios are evaluated on, so in a
  multi-turn workflow agent iₘ's row at turn t is weighted by ∏_{k<m} of agent iₖ's ratio *at turn t*
  only (``"turn"``, the default). ``"trajectory"`` multiplies those ratios over the whole episode
  (every turn, including turns after the row's action); it is kept as an option and equals the
  per-turn factor on single-turn workflows.
* Ratios and the factor use the *full* action log-prob (sum over tokens; several steps of one agent in
  one joint sample add): the factor is exp(Σ_k Δℓ^{iₖ}). It is kept in log space (a running sum), and
  exponentiated with the log clamped to ±20 so it cannot overflow; ``factor_clip=(lo, hi)``
  additionally clips the product itself, trading the estimator's unbiasedness for variance (HARL
  does not clip; off by default; config ``happo_factor_clip`` c gives :func:`factor_bounds` [1/c, c]).
* The factor is a stop-gradient constant: it is built from log-probs evaluated under ``no_grad``,
  detached in :func:`update_log_factor` and again in :func:`happo_advantages`.
* The factor sits outside the min in HARL (``factor * min(surr1, surr2)``); since factor > 0 that equals
  PPO-clip with the advantage M = factor·Â (:func:`happo_advantages`), which is how the engine applies
  it (a negative Â flips which side of the clip binds).
* The *update* order is independent of the *execution* order of the dependency graph D. HARL draws a
  fresh ``torch.randperm`` per iteration (:func:`random_order`); config ``order = "fixed"`` uses the
  adapters' order.
* The simultaneous independent-PPO baseline (MARFT's default ``agent_iteration_interval = 0``, MAPPO-like)
  is the same driver with ``mode="simultaneous"``: every agent sees factor 1 and the same old policy.

:func:`sequential_update` is framework-free: the DeepSpeed engine plugs in two callables and the
driver keeps the running factor. The caller owns models, optimisers and minibatching; rows of the
joint batch are fixed for the whole call (same rows, same order, for every agent).

* ``logprob_fn(agent) -> Tensor[B]``: the agent's full action log-probs (sum over tokens) on the B
  joint rows under its *current* parameters, computed under ``torch.no_grad`` in eval mode. Rows
  where the agent did not act return the same constant before and after (e.g. 0).
* ``step_fn(agent, factor[B]) -> stats``: one epoch of optimiser steps for that agent, using
  :func:`happo_advantages` with ``factor`` (already detached) on its rows.

Call sequence (``mode="sequential"``), for position m, agent k = agents[order[m]]:
  1. old = logprob_fn(k)                       # π^k_old on the rows, before k's epochs
  2. factor = correction_factor(log M)         # 1 for the first agent
  3. step_fn(k, factor) × ``epochs``
  4. new = logprob_fn(k)                       # π̄^k after all of k's epochs
  5. log M ← log M + (new − old)               # the next agent sees k's ratio
With ``mode="simultaneous"`` (independent PPO) steps 1, 4 and 5 are skipped and every agent gets
factor 1 (``torch.ones(n_rows)``; ``n_rows`` is required there, and checked against the log-probs
in sequential mode when given); since each agent has its own parameters, the order then does not
matter. ``measure_last=False`` skips step 4 for the last agent of the order: no later agent
reads its ratio, so only its record's ``log_ratio_mean`` (then NaN) and ``final_log_factor``
(then the factor the last agent saw) depend on it, and a caller that reads neither saves one
no-grad pass over that agent's rows. ``old_fn(agent)``, when given, replaces step 1: it is read
after the agent's epochs and must return π^k_old, the log-probs *before* them, which a caller can
record from the first epoch's training forward (detached), saving one no-grad pass per agent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch
from torch import Tensor

from teamrl.learner.advantages import AlgorithmError
from teamrl.learner.losses import LOG_RATIO_CLAMP

__all__ = [
    "FactorMode",
    "random_order",
    "joint_rows",
    "joint_logprob",
    "update_log_factor",
    "correction_factor",
    "happo_advantages",
    "AgentUpdateRecord",
    "SequentialUpdateResult",
    "sequential_update",
]

AgentT = TypeVar("AgentT")


# --------------------------------------------------------------------------------------------------
# update orders


def random_order(n_agents: int, generator: torch.Generator | None = None) -> list[int]:
    """A fresh random permutation of range(n_agents) (HARL ``fixed_order: False``); seed via ``generator``."""
    if n_agents < 1:
        raise AlgorithmError(f"n_agents must be >= 1, got {n_agents}")
    return torch.randperm(n_agents, generator=generator).tolist()


# --------------------------------------------------------------------------------------------------
# joint samples, correction factor and surrogates

FactorMode = Literal["turn", "trajectory"]


def joint_rows(
    traj_idx: Tensor, turn_idx: Tensor, n_traj: int, mode: FactorMode = "turn"
) -> tuple[Tensor, int]:
    """The joint sample (s_t, a_t) each row (agent step) belongs to, for the HAPPO factor.

    Shapes: traj_idx, turn_idx [N] int; returns (joint_idx [N] int64 in [0, J), J).
    ``turn`` (HAPPO/MARFT per-time-step factor): one joint sample per (trajectory, turn); agent iₘ's
    row at turn t is weighted only by the earlier-updated agents' actions of turn t.
    ``trajectory``: one joint sample per trajectory (J = ``n_traj``); the factor multiplies the earlier
    agents' ratios over *all* turns of the episode, including turns after the row's own action.
    The two agree on single-turn workflows.
    """
    if traj_idx.shape != turn_idx.shape or traj_idx.dim() != 1:
        raise AlgorithmError(
            f"traj_idx and turn_idx must both be [N], got {tuple(traj_idx.shape)}, {tuple(turn_idx.shape)}"
        )
    if mode == "trajectory":
        return traj_idx.to(torch.int64), n_traj
    if mode == "turn":
        if traj_idx.numel() == 0:
            return traj_idx.to(torch.int64), 0
        _, inverse = torch.unique(
            torch.stack([traj_idx.to(torch.int64), turn_idx.to(torch.int64)], dim=1),
            dim=0,
            return_inverse=True,
        )
        return inverse, int(inverse.max()) + 1
    raise AlgorithmError(f"unknown happo_factor {mode!r}; expected 'turn' or 'trajectory'")


def joint_logprob(row_logp: Tensor, joint_idx: Tensor, n_joint: int) -> Tensor:
    """An agent's log-prob of its part of each joint action: Σ over its rows in the joint sample.

    Shapes: row_logp [n] (full action log-probs of the agent's rows), joint_idx [n]; returns [J], 0
    for joint samples where the agent did not act (its ratio there is 1).
    """
    out = torch.zeros(n_joint, dtype=row_logp.dtype, device=row_logp.device)
    return out.index_add_(0, joint_idx.to(row_logp.device), row_logp.detach())


def update_log_factor(log_factor: Tensor, new_logp: Tensor, old_logp: Tensor) -> Tensor:
    """log M ← log M + (ℓ_new − ℓ_old) for the agent just updated. Shapes: all [B]; detached.

    ``new_logp``/``old_logp`` are the agent's full action log-probs on the joint rows after and before
    its epochs. A row where the agent did not act must carry equal values (difference 0).
    """
    if not (log_factor.shape == new_logp.shape == old_logp.shape):
        raise AlgorithmError(
            f"factor and log-probs must share a shape, got {tuple(log_factor.shape)}, "
            f"{tuple(new_logp.shape)}, {tuple(old_logp.shape)}"
        )
    delta = (new_logp - old_logp).detach()
    if not torch.isfinite(delta).all():
        raise AlgorithmError(f"{int((~torch.isfinite(delta)).sum())} non-finite log-prob differences")
    return log_factor.detach() + delta


def correction_factor(log_factor: Tensor, clip: tuple[float, float] | None = None) -> Tensor:
    """M = exp(log M), log clamped to ±20; optionally the product clipped to [lo, hi]. Detached, [B]."""
    factor = torch.exp(log_factor.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if clip is not None:
        lo, hi = clip
        if not 0.0 <= lo <= 1.0 <= hi:
            raise AlgorithmError(f"factor clip must satisfy 0 <= lo <= 1 <= hi, got {clip}")
        factor = factor.clamp(lo, hi)
    return factor


def factor_bounds(clip: float | None) -> tuple[float, float] | None:
    """Config ``happo_factor_clip`` c as the bounds [1/c, c] of :func:`correction_factor`, symmetric
    in log space (None: unclipped)."""
    if clip is None:
        return None
    if not clip > 1:
        raise AlgorithmError(f"happo_factor_clip must be > 1 (the factor is clipped to [1/c, c]), got {clip}")
    return 1.0 / clip, float(clip)


def happo_advantages(advantages: Tensor, factor: Tensor, joint_idx: Tensor) -> Tensor:
    """M = sg(factor of the row's joint sample) · Â, the advantage agent iₘ's PPO-clip is given.

    Shapes: advantages [N] or [N, L] (one row per agent step), factor [J] (one per joint sample),
    joint_idx [N] int (:func:`joint_rows`); returns advantages' shape. The HAPPO surrogate
    −min(r·M, clip(r, 1−ε, 1+ε)·M) is then :func:`teamrl.learner.losses.ppo_clip_loss` (or the decoupled
    loss) with M as the advantage; HARL puts the factor outside the min, equal since factor > 0.
    """
    f = factor.detach().to(advantages.dtype)[joint_idx]
    return advantages.detach() * f.reshape(-1, *([1] * (advantages.dim() - 1)))


# --------------------------------------------------------------------------------------------------
# the driver


@dataclass
class AgentUpdateRecord(Generic[AgentT]):
    """What happened to one agent in one sequential update (for logs and metrics)."""

    agent: AgentT
    position: int
    step_stats: list[Mapping[str, float]]
    factor_mean: float
    factor_min: float
    factor_max: float
    factor_clipped_rows: int
    log_ratio_mean: float


@dataclass
class SequentialUpdateResult(Generic[AgentT]):
    """Order used, one record per agent in that order, and the final running log-factor [B]."""

    order: list[int]
    records: list[AgentUpdateRecord[AgentT]] = field(default_factory=list)
    final_log_factor: Tensor | None = None


def _checked_logp(agent: object, logp: Tensor, rows: int | None) -> Tensor:
    if logp.dim() != 1 or not logp.is_floating_point():
        raise AlgorithmError(
            f"logprob_fn({agent!r}) must return a 1-D float [B], got {tuple(logp.shape)} {logp.dtype}"
        )
    if rows is not None and logp.shape[0] != rows:
        raise AlgorithmError(f"logprob_fn({agent!r}) returned {logp.shape[0]} rows, expected {rows}")
    if not torch.isfinite(logp).all():
        raise AlgorithmError(
            f"logprob_fn({agent!r}) returned {int((~torch.isfinite(logp)).sum())} non-finite values"
        )
    return logp.detach()


def sequential_update(
    agents: Sequence[AgentT],
    order: Sequence[int],
    logprob_fn: Callable[[AgentT], Tensor],
    step_fn: Callable[[AgentT, Tensor], Mapping[str, float]],
    epochs: int = 1,
    mode: Literal["sequential", "simultaneous"] = "sequential",
    factor_clip: tuple[float, float] | None = None,
    n_rows: int | None = None,
    measure_last: bool = True,
    old_fn: Callable[[AgentT], Tensor] | None = None,
) -> SequentialUpdateResult[AgentT]:
    """Run one agent-by-agent update over a joint batch and maintain the HAPPO correction factor.

    The callables' contracts, the call sequence (its steps 1-5 are marked in the body) and what
    ``mode``, ``n_rows``, ``measure_last`` and ``old_fn`` change are in the module docstring."""
    _check_update(len(agents), order, epochs, mode, n_rows)
    result: SequentialUpdateResult[AgentT] = SequentialUpdateResult(order=list(order))
    log_factor: Tensor | None = None
    rows: int | None = n_rows
    for position, idx in enumerate(order):
        agent = agents[idx]
        old = None
        if mode == "sequential":
            if old_fn is None:  # 1. π_old on the rows, before the agent's epochs
                old = _checked_logp(agent, logprob_fn(agent), rows)
                rows = old.shape[0]
            if log_factor is None:
                if rows is None:
                    raise AlgorithmError("old_fn needs n_rows (the number of joint rows B)")
                log_factor = torch.zeros(rows)
            factor, clipped_rows = _factor(log_factor, factor_clip)  # 2.
        else:
            assert n_rows is not None
            factor, clipped_rows = torch.ones(n_rows), 0
        stats = [dict(step_fn(agent, factor)) for _ in range(epochs)]  # 3.
        log_ratio_mean = math.nan
        if mode == "sequential" and (measure_last or position < len(order) - 1):
            if old_fn is not None:
                old = _checked_logp(agent, old_fn(agent), rows)
            assert old is not None and log_factor is not None
            new = _checked_logp(agent, logprob_fn(agent), rows)  # 4. π̄ after the agent's epochs
            log_ratio_mean = float((new - old).mean())
            log_factor = update_log_factor(log_factor, new, old)  # 5. the next agent sees its ratio
        result.records.append(_record(agent, position, stats, factor, clipped_rows, log_ratio_mean))
    result.final_log_factor = log_factor
    return result


def _check_update(n_agents: int, order: Sequence[int], epochs: int, mode: str, n_rows: int | None) -> None:
    """The argument checks of :func:`sequential_update`."""
    if epochs < 1:
        raise AlgorithmError(f"epochs must be >= 1, got {epochs}")
    if sorted(order) != list(range(n_agents)):
        raise AlgorithmError(f"order must be a permutation of 0..{n_agents - 1}, got {list(order)}")
    if mode not in ("sequential", "simultaneous"):
        raise AlgorithmError(f"unknown update mode {mode!r}; expected 'sequential' or 'simultaneous'")
    if mode == "simultaneous" and n_rows is None:
        raise AlgorithmError("mode 'simultaneous' needs n_rows (the number of joint rows B)")


def _factor(log_factor: Tensor, clip: tuple[float, float] | None) -> tuple[Tensor, int]:
    """The factor an agent trains with (clipped to ``clip``), and how many rows the clip changed."""
    factor = correction_factor(log_factor, clip)
    return factor, int((factor != correction_factor(log_factor)).sum())


def _record(
    agent: AgentT,
    position: int,
    stats: list[Mapping[str, float]],
    factor: Tensor,
    clipped_rows: int,
    log_ratio_mean: float,
) -> AgentUpdateRecord[AgentT]:
    return AgentUpdateRecord(
        agent=agent,
        position=position,
        step_stats=stats,
        factor_mean=float(factor.mean()),
        factor_min=float(factor.min()),
        factor_max=float(factor.max()),
        factor_clipped_rows=clipped_rows,
        log_ratio_mean=log_ratio_mean,
    )
