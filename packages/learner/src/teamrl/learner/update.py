"""Agent-by-agent sequential update (HAPPO, Kuba et al. 2109.11251; MARFT's trust-region scheme).

By the multi-agent advantage decomposition (Lemma 1 of 2109.11251), agents can be improved one at a
time in a random order i₁…iₙ. When agent iₘ trains, the agents before it already have new parameters
π̄, and its surrogate weights the joint advantage Â by the correction factor

    M^{i₁:ₘ} = sg[ ∏_{k<m} π̄^{iₖ}(a^{iₖ}|o^{iₖ}) / π^{iₖ}_old(a^{iₖ}|o^{iₖ}) ] · Â,

    L^{iₘ}(θ) = −E[ min( r_θ·M, clip(r_θ, 1−ε, 1+ε)·M ) ],  r_θ = π^{iₘ}_θ / π^{iₘ}_old.

Design decisions (ALGORITHMS.md §3):

* Ratios and the factor use the *full* action log-prob (sum over tokens): the factor is
  exp(Σ_k Δℓ^{iₖ}). It is kept in log space (a running sum), and exponentiated with the log clamped to
  ±20 so it cannot overflow; ``factor_clip=(lo, hi)`` additionally clips the product itself, trading
  the estimator's unbiasedness for variance (HARL does not clip; off by default).
* The factor is a stop-gradient constant: it is built from log-probs evaluated under ``no_grad`` and
  detached again in :func:`happo_loss`.
* The factor sits outside the min in HARL (``factor * min(surr1, surr2)``); since factor > 0 that equals
  the formula above, which is what :func:`happo_loss` computes (a negative Â flips which side of the
  clip binds).
* The *update* order is independent of the *execution* order of the dependency graph D. HARL draws a
  fresh ``torch.randperm`` per iteration (:func:`random_order`); :func:`topological_order` gives a
  deterministic order from D's parent lists for callers that want predecessors updated first.
* The simultaneous independent-PPO baseline (MARFT's default ``agent_iteration_interval = 0``, MAPPO-like)
  is the same driver with ``mode="simultaneous"``: every agent sees factor 1 and the same old policy.
  MARFT's round-robin freezing is :func:`round_robin_agent`.

:func:`sequential_update` is framework-free: the DeepSpeed engine plugs in two callables and the
driver keeps the running factor. Its call sequence is in its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import torch
from torch import Tensor

from teamrl.learner.advantages import AlgorithmError
from teamrl.learner.losses import LOG_RATIO_CLAMP, PolicyLossTerms, ppo_clip_loss

__all__ = [
    "DependencyCycleError",
    "random_order",
    "topological_order",
    "round_robin_agent",
    "update_log_factor",
    "correction_factor",
    "happo_loss",
    "independent_ppo_loss",
    "AgentUpdateRecord",
    "SequentialUpdateResult",
    "sequential_update",
]

AgentT = TypeVar("AgentT")


class DependencyCycleError(AlgorithmError):
    """The dependency graph D has a cycle within one step, so no topological order exists."""


# --------------------------------------------------------------------------------------------------
# update orders


def random_order(n_agents: int, generator: torch.Generator | None = None) -> list[int]:
    """A fresh random permutation of range(n_agents) (HARL ``fixed_order: False``); seed via ``generator``."""
    if n_agents < 1:
        raise AlgorithmError(f"n_agents must be >= 1, got {n_agents}")
    return torch.randperm(n_agents, generator=generator).tolist()


def topological_order(parents: Sequence[Sequence[int]]) -> list[int]:
    """Order agents so every agent comes after its parents (Kahn's algorithm, ties by lowest index).

    ``parents[i]`` lists the agents whose same-step actions agent i conditions on (D(i, j) = 1).
    Raises :class:`DependencyCycleError` naming the agents on a cycle, or :class:`AlgorithmError` for
    an out-of-range or self parent.
    """
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    for i, ps in enumerate(parents):
        for p in set(ps):
            if not 0 <= p < n or p == i:
                raise AlgorithmError(
                    f"agent {i} has invalid parent {p} (agents are 0..{n - 1}, no self-loops)"
                )
            children[p].append(i)
            indegree[i] += 1
    ready = sorted(i for i in range(n) if indegree[i] == 0)
    order: list[int] = []
    while ready:
        node = ready.pop(0)
        order.append(node)
        for c in children[node]:
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
        ready.sort()
    if len(order) != n:
        stuck = sorted(set(range(n)) - set(order))
        raise DependencyCycleError(
            f"dependency graph has a cycle among agents {stuck}; move one edge to step t+1"
        )
    return order


def round_robin_agent(global_step: int, interval: int, n_agents: int, offset: int = 0) -> int:
    """MARFT ``agent_iteration_interval``: the one agent trained at ``global_step`` (others frozen).

    (global_step // interval + offset) % n_agents; MARFT's APPO uses offset 0 and TPPO offset 1.
    """
    if interval < 1 or n_agents < 1:
        raise AlgorithmError(f"interval and n_agents must be >= 1, got {interval}, {n_agents}")
    return (global_step // interval + offset) % n_agents


# --------------------------------------------------------------------------------------------------
# correction factor and surrogates


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


def happo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    factor: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
) -> PolicyLossTerms:
    """HAPPO per-agent surrogate: −min(r·M, clip(r, 1−ε, 1+ε)·M) with M = sg(factor)·Â.

    Shapes: logp (with grad), old_logp, advantages, factor, mask: all [B] (action level) — or any
    common shape, e.g. factor [B, 1] broadcast to token-level [B, L] via ``factor.expand_as``.
    """
    factor = factor.detach().expand_as(advantages)
    return ppo_clip_loss(logp, old_logp, factor * advantages.detach(), mask, clip_low, clip_high)


def independent_ppo_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
) -> PolicyLossTerms:
    """Simultaneous independent-PPO baseline: each agent's own PPO-clip, no correction (factor 1)."""
    return ppo_clip_loss(logp, old_logp, advantages, mask, clip_low, clip_high)


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
) -> SequentialUpdateResult[AgentT]:
    """Run one agent-by-agent update over a joint batch and maintain the HAPPO correction factor.

    The caller owns models, optimisers and minibatching; rows of the joint batch are fixed for the
    whole call (same rows, same order, for every agent).

    * ``logprob_fn(agent) -> Tensor[B]``: the agent's full action log-probs (sum over tokens) on the B
      joint rows under its *current* parameters, computed under ``torch.no_grad`` in eval mode. Rows
      where the agent did not act return the same constant before and after (e.g. 0).
    * ``step_fn(agent, factor[B]) -> stats``: one epoch of optimiser steps for that agent, using
      :func:`happo_loss` with ``factor`` (already detached) indexed by its minibatch rows.

    Call sequence (``mode="sequential"``), for position m, agent k = agents[order[m]]:
      1. old = logprob_fn(k)                       # π^k_old on the rows, before k's epochs
      2. factor = correction_factor(log M)         # 1 for the first agent
      3. step_fn(k, factor) × ``epochs``
      4. new = logprob_fn(k)                       # π̄^k after all of k's epochs
      5. log M ← log M + (new − old)               # the next agent sees k's ratio
    With ``mode="simultaneous"`` (independent PPO) steps 1, 4 and 5 are skipped and every agent gets
    factor 1 (``torch.ones(n_rows)``; ``n_rows`` is required there, and checked against the log-probs
    in sequential mode when given); since each agent has its own parameters, the order then does not
    matter.
    """
    if epochs < 1:
        raise AlgorithmError(f"epochs must be >= 1, got {epochs}")
    if sorted(order) != list(range(len(agents))):
        raise AlgorithmError(f"order must be a permutation of 0..{len(agents) - 1}, got {list(order)}")
    if mode not in ("sequential", "simultaneous"):
        raise AlgorithmError(f"unknown update mode {mode!r}; expected 'sequential' or 'simultaneous'")
    if mode == "simultaneous" and n_rows is None:
        raise AlgorithmError("mode 'simultaneous' needs n_rows (the number of joint rows B)")
    result: SequentialUpdateResult[AgentT] = SequentialUpdateResult(order=list(order))
    log_factor: Tensor | None = None
    rows: int | None = n_rows
    for position, idx in enumerate(order):
        agent = agents[idx]
        old = None
        if mode == "sequential":
            old = _checked_logp(agent, logprob_fn(agent), rows)
            rows = old.shape[0]
            if log_factor is None:
                log_factor = torch.zeros_like(old)
            factor = correction_factor(log_factor, factor_clip)
            unclipped = correction_factor(log_factor)
            clipped_rows = int((factor != unclipped).sum())
        else:
            assert n_rows is not None
            factor = torch.ones(n_rows)
            clipped_rows = 0
        stats = [dict(step_fn(agent, factor)) for _ in range(epochs)]
        log_ratio_mean = math.nan
        if mode == "sequential":
            assert old is not None and log_factor is not None
            new = _checked_logp(agent, logprob_fn(agent), rows)
            log_ratio_mean = float((new - old).mean())
            log_factor = update_log_factor(log_factor, new, old)
        result.records.append(
            AgentUpdateRecord(
                agent=agent,
                position=position,
                step_stats=stats,
                factor_mean=float(factor.mean()),
                factor_min=float(factor.min()),
                factor_max=float(factor.max()),
                factor_clipped_rows=clipped_rows,
                log_ratio_mean=log_ratio_mean,
            )
        )
    result.final_log_factor = log_factor
    return result
