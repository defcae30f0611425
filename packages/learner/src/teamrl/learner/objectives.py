"""The policy objectives of one micro-batch, as pure functions of its tensors (docs/algorithms.md §2-§6).

:func:`policy_terms` picks the objective (``ObjectiveSettings.objective`` and the critic's level); the
token-level losses themselves are :mod:`teamrl.learner.losses`. :mod:`teamrl.learner.policy_step` calls
these once per micro-batch of one adapter's optimiser step.

Design decisions:

* **decoupled** (AReaL): PPO-clip of π_θ/π_prox times the behaviour weight π_prox/μ outside the clip,
  capped at ``tis_cap`` (``tis_mode`` clamp: token TIS as verl and slime use it; mask: AReaL's rule),
  per token or per sequence (``tis_level``). π_prox is the adapter before this step's update.
* **ppo**: plain PPO-clip against π_prox; the behaviour log-probs are ignored.
* **ppo-behaviour**: naive PPO-clip against μ, the behaviour log-probs, as π_old: what asynchronous
  PPO does without a correction, AReaL's baseline in its staleness table. With fresh data μ = π_prox
  and it equals ``ppo``; with stale data the clip is taken around the wrong policy.
* **ppo-critic** (MARFT): at token level (TPPO) the decoupled loss on per-token GAE advantages; at
  action level (APPO, :func:`action_level_terms`) one ratio per action from length-normalised log-probs
  (``action_logprob_norm="token"``: the geometric-mean token ratio), the loss a mean over actions. Both
  keep the behaviour weight, since the data is asynchronous.
* **KL** (:func:`kl_loss`): β·KL(π_θ‖π_ref), π_ref the base with adapters disabled; sample weights
  multiply it like the policy loss.
* **Shares** (:func:`loss_share`): a micro-batch's loss is scaled by its share of the adapter's tokens
  (token-mean) or sequences (the other aggregations, and actions), so that gradient accumulation over
  micro-batches equals the loss over all rows.
"""

from __future__ import annotations

from torch import Tensor

from teamrl.learner.losses import (
    PolicyLossTerms,
    action_logprob,
    agg_loss,
    decoupled_ppo_loss,
    kl_penalty,
    ppo_clip_loss,
)
from teamrl.learner.settings import ObjectiveSettings

__all__ = ["policy_terms", "action_level_terms", "behaviour_weight", "kl_loss", "loss_share"]


def policy_terms(
    obj: ObjectiveSettings,
    action_level: bool,
    logp: Tensor,
    prox: Tensor,
    behav: Tensor,
    adv: Tensor,
    mask: Tensor,
    clip: tuple[float, float],
) -> PolicyLossTerms:
    """The policy loss terms of one micro-batch (module docstring).

    logp [n, R] (with grad), prox / behav [n, R] (π_prox, μ), mask [n, R]; adv: [n] per action when
    ``action_level``, else [n, R] per token (the HAPPO factor already applied); clip = (low, high).
    """
    if action_level:
        return action_level_terms(obj, logp, prox, behav, adv, mask, clip)
    if obj.objective in ("decoupled", "ppo-critic"):
        return decoupled_ppo_loss(
            logp,
            prox,
            behav,
            adv,
            mask,
            clip[0],
            clip[1],
            cap=obj.tis_cap,
            cap_mode=obj.tis_mode,
            level=obj.tis_level,
        )
    if obj.objective == "ppo-behaviour":
        return ppo_clip_loss(logp, behav, adv, mask, clip[0], clip[1])
    return ppo_clip_loss(logp, prox, adv, mask, clip[0], clip[1])


def action_level_terms(
    obj: ObjectiveSettings,
    logp: Tensor,
    prox: Tensor,
    behav: Tensor,
    adv_row: Tensor,
    mask: Tensor,
    clip: tuple[float, float],
) -> PolicyLossTerms:
    """APPO: the decoupled loss with one ratio per action (row) from length-normalised log-probs."""
    norm = obj.action_logprob_norm
    return decoupled_ppo_loss(
        action_logprob(logp, mask, norm),
        action_logprob(prox, mask, norm),
        action_logprob(behav, mask, norm),
        adv_row,
        mask.any(-1),
        clip[0],
        clip[1],
        cap=obj.tis_cap,
        cap_mode=obj.tis_mode,
    )


def behaviour_weight(
    obj: ObjectiveSettings, action_level: bool, prox: Tensor, behav: Tensor, mask: Tensor
) -> Tensor:
    """π_prox/μ before the cap, per action [n] or per token [n, R] (a statistic, no gradient)."""
    if action_level:
        norm = obj.action_logprob_norm
        return (action_logprob(prox, mask, norm) - action_logprob(behav, mask, norm)).clamp(-20, 20).exp()
    return (prox - behav).clamp(-20, 20).exp()


def kl_loss(
    obj: ObjectiveSettings, logp: Tensor, ref: Tensor, mask: Tensor, row_weights: Tensor | None
) -> Tensor:
    """KL(π_θ‖π_ref) of one micro-batch by ``kl_estimator``, each row times its sample weight,
    aggregated by ``loss_agg``."""
    kl_tok = kl_penalty(logp, ref, obj.kl_estimator)
    if row_weights is not None:
        kl_tok = kl_tok * row_weights[:, None]
    return agg_loss(kl_tok * mask, mask, obj.loss_agg)


def loss_share(
    obj: ObjectiveSettings, action_level: bool, mask: Tensor, total_tokens: float, total_seqs: float
) -> float:
    """The micro-batch's share (``mask`` [n, R], on the CPU) of the adapter's tokens or sequences."""
    if obj.loss_agg == "token-mean" and not action_level:
        return float(mask.sum()) / total_tokens
    return float((mask.sum(-1) > 0).sum()) / total_seqs
