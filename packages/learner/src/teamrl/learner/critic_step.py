"""The centralised critic in a train step (``objective="ppo-critic"``, MARFT APPO/TPPO,
docs/algorithms.md §6): GAE advantages from the value head, then the value head's own update.

The value head, the GAE layout and the design choices behind them are :mod:`teamrl.learner.critic`;
this module runs them on a step's rows. Call sequence (:func:`critic_advantages`)::

    feats, ref = base pass over all rows          # no grad; ref = KL reference log-probs if any kl_coef
    v_old = critic(feats)                         # values before this step's critic update
    adv, ret = action_level_gae | token_level_gae  # on v_old, rewards chained per trajectory
    critic_update(feats, v_old, ret)              # ``epochs`` optimiser steps of the value head
    adv = masked_whiten(adv)                      # whiten_advantages: over the batch

Design decision: the value loss is unweighted (sample weights reweight the policy and KL loss only).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from teamrl.learner.advantages import masked_whiten
from teamrl.learner.critic import action_level_gae, chain_rewards, explained_variance, token_level_gae
from teamrl.learner.distributed import _all_reduce_max
from teamrl.learner.logprobs import LogprobPasses
from teamrl.learner.losses import clipped_value_loss
from teamrl.learner.rows import Advantages, StepRows
from teamrl.learner.settings import AdapterSettings, EngineSettings

__all__ = ["critic_advantages"]


def critic_advantages(
    passes: LogprobPasses, rows: StepRows, settings: EngineSettings, adapters: Mapping[str, AdapterSettings]
) -> tuple[Advantages, dict[str, float]]:
    """GAE advantages of ``rows`` (``row`` [N] at action level, None at token level; ``tok`` [N, R])
    with the KL reference log-probs of every adapter with a KL term (same base pass), after which the
    critic is updated; returns them and the critic's metrics."""
    batch, cs = rows.batch, settings.critic
    token = cs.critic_level == "token"
    feats, ref = _features(passes, rows, adapters, token)
    vmask = batch.resp_mask if token else torch.ones(batch.n_rows, dtype=torch.bool)
    critic = passes.net.critic
    critic.eval()
    with torch.no_grad():
        dev = passes.net.device
        v_old = torch.cat(
            [critic(feats[c].to(dev)).float().cpu() for c in passes.chunks(torch.arange(batch.n_rows))]
        )
    v_old = v_old * vmask
    team = torch.tensor(batch.team_rewards) if settings.objective.reward_source == "trajectory" else None
    r = chain_rewards(batch.rewards, batch.traj_idx, team)
    if token:
        adv, ret = token_level_gae(
            r, v_old, batch.resp_mask, batch.traj_idx, batch.n_traj, cs.gamma, cs.lam, cs.token_gamma
        )
    else:
        adv, ret = action_level_gae(r, v_old, batch.traj_idx, batch.n_traj, cs.gamma, cs.lam)
    metrics = {
        "value_mean": float(v_old[vmask].mean()),
        "return_mean": float(ret[vmask].mean()),
        "explained_variance": explained_variance(v_old, ret, vmask),
    }
    metrics |= _critic_update(passes, feats, v_old, ret, vmask, settings)
    if cs.whiten_advantages and int(vmask.sum()) > 1:
        adv = masked_whiten(adv, vmask)
    adv_tok = adv * batch.resp_mask if token else adv[:, None] * batch.resp_mask
    return Advantages(None if token else adv, adv_tok, ref), metrics


def _features(
    passes: LogprobPasses, rows: StepRows, adapters: Mapping[str, AdapterSettings], token: bool
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's features of every row from one base pass, and the KL reference log-probs of
    each adapter with a KL term from the same pass."""
    batch = rows.batch
    any_kl = any(s.kl_coef > 0 for s in adapters.values())
    parts = [
        passes.base_pass(batch, c, any_kl, token)
        for c in passes.chunks(torch.arange(batch.n_rows), None, batch.row_lengths)
    ]
    ref: dict[str, Tensor] = {}
    if any_kl:
        ref_all = torch.cat([r for _, r in parts if r is not None])
        ref = {a: ref_all[rows.of_adapter[a]] for a, s in adapters.items() if s.kl_coef > 0}
    return torch.cat([f for f, _ in parts]), ref


def _critic_update(
    passes: LogprobPasses, feats: Tensor, v_old: Tensor, ret: Tensor, vmask: Tensor, settings: EngineSettings
) -> dict[str, float]:
    """``epochs`` optimiser steps of the value head on the clipped value loss (masked mean)."""
    eng, dev, cs = passes.net.critic, passes.net.device, settings.critic
    chunks = passes.chunks(torch.arange(feats.shape[0]))
    n_micro = _all_reduce_max([len(chunks)])[0]  # every rank issues the same collectives
    total = float(vmask.sum())
    eng.train()
    value_loss = 0.0
    for _ in range(settings.optim.epochs):
        value_loss = 0.0
        for j in range(n_micro):
            eng.set_gradient_accumulation_boundary(j == n_micro - 1)
            if j >= len(chunks):  # dummy micro-batch: zero gradient
                eng.backward(eng(feats[:1].to(dev)).sum() * 0.0)
                continue
            c = chunks[j]
            v = eng(feats[c].to(dev)).float().cpu()
            terms = clipped_value_loss(v, v_old[c], ret[c], vmask[c], clip_eps=cs.value_clip)
            loss = terms.sum() / total
            eng.backward(cs.value_coef * loss)
            value_loss += float(loss.detach())
        eng.step()
    gn = eng.get_global_grad_norm()
    return {"value_loss": value_loss, "critic_grad_norm": float(gn) if gn is not None else math.nan}
