"""Policy and value objectives: PPO-clip, off-policy corrections for async data, KL, aggregation.

Pure tensor functions (torch only), each checkable on a 3x4 tensor against the worked examples of
``docs/algorithms.md`` (``tests/unit/learner/test_algorithms.py``).
Losses are *minimised*. Per-token functions return a :class:`PolicyLossTerms` of element-wise tensors;
the caller reduces them with :func:`agg_loss`, so every aggregation mode works with every objective and
per-agent settings (clip range, cap, ...) are plain arguments, not config objects.

Design decisions:

* **Action log-probability** (MARFT ``normalize_log_probs``, docs/algorithms.md §6): ``sum`` (default) or
  ``token`` (÷ number of valid tokens: the ratio becomes the geometric-mean token ratio) or ``word``
  (÷ a caller-supplied word count). Old and new values must use the same mode.
* **PPO-clip** (Schulman et al. 1707.06347, Eq. 7; docs/algorithms.md §2) per element, asymmetric
  ``clip_high`` allowed (DAPO-style), optional dual clip c (verl; Ye et al. 1912.09729) for A < 0. The
  log-ratio is clamped to ±20 before ``exp`` so a summed action log-prob cannot overflow. For A > 0 the
  clamp only acts where the clipped (constant) branch is taken anyway; for A < 0 it bounds an
  unclipped term that is already e^20·|A| (use ``dual_clip`` for a principled bound).
* **Off-policy weight** (:func:`behaviour_weights`, docs/algorithms.md §3): w = π_prox/μ per token or
  per sequence, clamped at the cap (truncated IS: verl ``rollout_is``, slime ``tis_clip``; the
  learner's default, cap 2) or zeroed above it (``mask``: AReaL ``token_mask`` with cap 5, icepop,
  Seq-MIS). ``lower`` with ``mode="clamp"`` in :func:`truncated_is_weights` is OpenRLHF's two-sided
  ``tis`` (it *raises* small weights).
* **Decoupled PPO** (AReaL, Fu et al. 2505.24298): three policies; u_t = π_θ/π_prox inside the clip,
  w_t = π_prox/π_behav outside it. verl/slime token TIS is the same formula with their recomputed
  π_old in place of π_prox and the weight clamped, so there is one function for both. Masked tokens
  keep counting in the denominator: aggregate with the *original* loss mask.
* **Sample weights** (:func:`weight_rows`, docs/algorithms.md §7): the buffer's per-trajectory weight
  multiplies each row's loss.
* **Sequence-level correction** (docs/algorithms.md §3): ρ_seq = exp(Σ m log ρ) and
  ρ_geo = exp(Σ m log ρ / Σ m) with log ρ = logπ_old − logμ (verl/slime sign). Seq-MIS rejects a
  sequence by zeroing its mask; :func:`sequence_rejection_mask` takes two-sided bounds [lower, upper]
  as in verl's ``decoupled_seq_is_rs`` preset; the learner (:func:`behaviour_weights`) uses
  ``lower=0``, upper-only. The returned ``rejected`` vector is for the caller's counter.
* **KL to the reference** (docs/algorithms.md §5; Schulman 2020 blog; DeepSeekMath Eq. 4; verl
  ``kl_penalty``): k1, k2, k3 (``low_var_kl``: log-ratio clamped to ±20, output to [−10, 10]) and k3+ (k3 value, k2 gradient). The
  reference log-probs come from the base with adapters disabled, computed by the caller under no_grad.
* **Aggregation** (verl ``agg_loss``): ``token-mean`` Σℓm/Σm; ``seq-mean-token-mean`` mean over
  sequences of Σ_t ℓm/Σ_t m; ``seq-mean-token-sum`` mean over sequences of Σ_t ℓm;
  ``seq-mean-token-sum-norm`` (Dr. GRPO) Σ_b Σ_t ℓm / L_max with L_max = ``loss_scale_factor`` or the
  mask's last dimension. Sequence means skip sequences with no valid token (they would add 0 to a sum
  but 1 to a count).
* **Clipped value loss** (PPO2 / MARFT ``cal_value_loss``): max of unclipped and clipped errors, with
  ½·squared error (verl) or Huber δ (MARFT, δ = 10).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from teamrl.learner.advantages import AlgorithmError

__all__ = [
    "LOG_RATIO_CLAMP",
    "AggMode",
    "PolicyLossTerms",
    "action_logprob",
    "agg_loss",
    "ppo_clip_loss",
    "truncated_is_weights",
    "behaviour_weights",
    "decoupled_ppo_loss",
    "weight_rows",
    "sequence_log_ratios",
    "sequence_tis_weights",
    "sequence_rejection_mask",
    "kl_penalty",
    "clipped_value_loss",
]

LOG_RATIO_CLAMP = 20.0
"""|log ratio| bound before exp (verl's value): keeps summed action log-prob ratios finite."""

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class PolicyLossTerms(NamedTuple):
    """Element-wise outputs of a policy objective; all share the input shape (e.g. [B, L] or [B]).

    loss: per-element loss to minimise (0 where the input mask is 0); reduce it with :func:`agg_loss`.
    ratio: the ratio inside the clip (π_θ/π_old, or π_θ/π_prox for decoupled PPO), detached.
    clipped: bool, True where the clipped branch was selected (for a clip-fraction metric).
    is_weight: the detached importance weight multiplying the loss (ones when there is none).
    rejected: bool, True where the weight was zeroed by a cap in ``mask`` mode (count it).
    """

    loss: Tensor
    ratio: Tensor
    clipped: Tensor
    is_weight: Tensor
    rejected: Tensor


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise AlgorithmError(f"shapes must match: {shapes}")


def _safe_log_ratio(a: Tensor, b: Tensor, mask: Tensor | None) -> Tensor:
    """a − b, 0 where masked out or non-finite (−inf − −inf on padding would give NaN), clamped ±20."""
    diff = a - b
    keep = torch.isfinite(diff)
    if mask is not None:
        keep = keep & mask.bool()
    diff = torch.where(keep, diff, torch.zeros_like(diff))
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def action_logprob(
    token_logp: Tensor,
    token_mask: Tensor,
    mode: Literal["sum", "token", "word"] = "sum",
    word_counts: Tensor | None = None,
) -> Tensor:
    """Log-probability of a whole action (MARFT ``normalize_log_probs``).

    Shapes: token_logp, token_mask [..., L]; word_counts [...] (only for ``word``); returns [...].
    ``sum``: Σ_j m_j logp_j; ``token``: that ÷ Σ_j m_j (MARFT divides by the last valid position + 1,
    equal for right-padded masks); ``word``: ÷ the number of whitespace-separated words.
    """
    _check_same_shape(token_logp=token_logp, token_mask=token_mask)
    m = token_mask.to(token_logp.dtype)
    total = torch.where(token_mask.bool(), token_logp, torch.zeros_like(token_logp)).sum(-1)
    if mode == "sum":
        return total
    if mode == "token":
        return total / m.sum(-1).clamp(min=1.0)
    if mode == "word":
        if word_counts is None or tuple(word_counts.shape) != tuple(total.shape):
            raise AlgorithmError(f"mode 'word' needs word_counts of shape {tuple(total.shape)}")
        return total / word_counts.to(total.dtype).clamp(min=1.0)
    raise AlgorithmError(f"unknown action log-prob mode {mode!r}; expected 'sum', 'token' or 'word'")


def agg_loss(
    loss: Tensor, mask: Tensor, mode: AggMode = "token-mean", loss_scale_factor: float | None = None
) -> Tensor:
    """Reduce an element-wise loss [B, L] (or [B], read as L = 1) with a 0/1 mask to a scalar.

    Modes as in the module docstring. ``token-mean`` over an all-zero mask raises rather than
    returning NaN: an empty batch is a caller bug.
    """
    _check_same_shape(loss=loss, mask=mask)
    if loss.dim() == 1:
        loss, mask = loss[:, None], mask[:, None]
    if loss.dim() != 2:
        raise AlgorithmError(f"agg_loss expects [B, L] or [B], got {tuple(loss.shape)}")
    m = mask.to(loss.dtype)
    lm = loss * m
    if m.sum() == 0:
        raise AlgorithmError("agg_loss: mask selects no element")
    if mode == "token-mean":
        return lm.sum() / m.sum()
    if mode == "seq-mean-token-sum-norm":
        denom = float(loss_scale_factor) if loss_scale_factor is not None else float(loss.shape[-1])
        return lm.sum() / denom
    tokens = m.sum(-1)
    has_tokens = (tokens > 0).to(loss.dtype)
    if mode == "seq-mean-token-sum":
        seq = lm.sum(-1)
    elif mode == "seq-mean-token-mean":
        seq = lm.sum(-1) / tokens.clamp(min=1.0)
    else:
        raise AlgorithmError(
            f"unknown loss aggregation {mode!r}; expected token-mean, seq-mean-token-mean, "
            "seq-mean-token-sum or seq-mean-token-sum-norm"
        )
    return (seq * has_tokens).sum() / has_tokens.sum()


def ppo_clip_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
) -> PolicyLossTerms:
    """PPO-clip surrogate per element (PPO Eq. 7; APPO/TPPO in MARFT).

    Shapes: logp (with grad), old_logp, advantages, mask: all the same shape ([B, L] token level,
    [B] or [B, N] action level); advantages are treated as constants (detached).
    ℓ = max(−u·A, −clip(u, 1−clip_low, 1+clip_high)·A), u = exp(logp − old_logp);
    with ``dual_clip`` = c > 1, for A < 0: ℓ = min(ℓ, −c·A).
    """
    if mask is None:
        mask = torch.ones_like(logp, dtype=torch.bool)
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask)
    if clip_low < 0 or (clip_high is not None and clip_high < 0):
        raise AlgorithmError(f"clip ranges must be >= 0, got low={clip_low} high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise AlgorithmError(f"dual_clip must be > 1, got {dual_clip}")
    high = clip_low if clip_high is None else clip_high
    adv = advantages.detach()
    ratio = torch.exp(_safe_log_ratio(logp, old_logp.detach(), mask))
    unclipped = -ratio * adv
    clipped_branch = -ratio.clamp(1.0 - clip_low, 1.0 + high) * adv
    loss = torch.maximum(unclipped, clipped_branch)
    clipped = clipped_branch > unclipped
    if dual_clip is not None:
        dual = -dual_clip * adv
        use_dual = (adv < 0) & (dual < loss)
        loss = torch.where(use_dual, dual, loss)
        clipped = clipped | use_dual
    m = mask.to(loss.dtype)
    return PolicyLossTerms(
        loss=loss * m,
        ratio=ratio.detach(),
        clipped=clipped & mask.bool(),
        is_weight=torch.ones_like(m),
        rejected=torch.zeros_like(mask, dtype=torch.bool),
    )


def truncated_is_weights(
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    upper: float = 2.0,
    lower: float = 0.0,
    mode: Literal["clamp", "mask"] = "clamp",
) -> tuple[Tensor, Tensor]:
    """Token importance weights between the trainer's policy and the behaviour (rollout) engine.

    Shapes: old_logp (π_old or π_prox), behav_logp (μ), mask [B, L]. Returns (weights [B, L] detached,
    rejected [B, L] bool). w = exp(old − behav); ``clamp``: w ← clamp(w, lower, upper) (truncated IS;
    lower 0 means upper-only, as in verl and slime); ``mask``: w ← 0 where w ∉ [lower, upper]
    (``rejected`` marks those). Weights are 0 on padding.
    """
    _check_same_shape(old_logp=old_logp, behav_logp=behav_logp, mask=mask)
    if not 0.0 <= lower <= upper:
        raise AlgorithmError(f"need 0 <= lower <= upper, got lower={lower} upper={upper}")
    with torch.no_grad():
        w = torch.exp(_safe_log_ratio(old_logp, behav_logp, mask))
        valid = mask.bool()
        if mode == "clamp":
            w = w.clamp(lower, upper)
            rejected = torch.zeros_like(valid)
        elif mode == "mask":
            rejected = ((w > upper) | (w < lower)) & valid
            w = torch.where(rejected, torch.zeros_like(w), w)
        else:
            raise AlgorithmError(f"unknown IS weight mode {mode!r}; expected 'clamp' or 'mask'")
        w = w * valid.to(w.dtype)
    return w, rejected


def behaviour_weights(
    prox_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    cap: float | None = 2.0,
    mode: Literal["clamp", "mask"] = "clamp",
    level: Literal["token", "sequence"] = "token",
) -> tuple[Tensor, Tensor]:
    """Off-policy weight w = π_prox/μ per token [B, L] and the tokens it rejected [B, L] bool, detached.

    ``level="token"``: w_t = exp(prox_t − behav_t), then clamped to ``cap`` (token TIS: verl
    ``rollout_is="token"``, slime) or zeroed above it (``mask``: AReaL ``token_mask``, icepop).
    ``level="sequence"``: ρ_seq = exp(Σ_t m_t (prox_t − behav_t)) per row; ``clamp`` broadcasts
    min(ρ_seq, cap) to the row's tokens (Seq-TIS), ``mask`` keeps weight 1 on rows with ρ_seq <= cap
    and drops whole rows above it (Seq-MIS, upper bound only). ``cap=None``: uncapped (mask rejects
    nothing). Weights are 0 on padding.
    """
    _check_same_shape(prox_logp=prox_logp, behav_logp=behav_logp, mask=mask)
    upper = float("inf") if cap is None else float(cap)
    if level == "token":
        return truncated_is_weights(prox_logp, behav_logp, mask, upper=upper, mode=mode)
    if level != "sequence":
        raise AlgorithmError(f"unknown IS level {level!r}; expected 'token' or 'sequence'")
    valid = mask.bool()
    if mode == "clamp":
        return sequence_tis_weights(prox_logp, behav_logp, mask, cap=upper), torch.zeros_like(valid)
    if mode == "mask":
        kept, rejected_rows = sequence_rejection_mask(prox_logp, behav_logp, mask, lower=0.0, upper=upper)
        w = kept.to(prox_logp.dtype) * valid.to(prox_logp.dtype)
        return w, rejected_rows[:, None] & valid
    raise AlgorithmError(f"unknown IS weight mode {mode!r}; expected 'clamp' or 'mask'")


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    cap: float | None = 5.0,
    cap_mode: Literal["mask", "clamp"] = "mask",
    level: Literal["token", "sequence"] = "token",
) -> PolicyLossTerms:
    """AReaL decoupled PPO (Fu et al. 2505.24298): behaviour, proximal and current policy.

    Shapes: all [B, L] (or [B] at action level, token level only). prox_logp is the trainer's
    recomputation at the sampling version (no grad), behav_logp the rollout engine's.
    ℓ_t = −w_t·min(u_t A_t, clip(u_t, 1−ε, 1+ε_high) A_t) with u_t = π_θ/π_prox and w_t = π_prox/π_behav
    from :func:`behaviour_weights` (``cap`` None = uncapped; ``cap_mode`` mask = AReaL, clamp = token
    TIS as in verl/slime, whose π_old is this π_prox; ``level`` token or sequence). Aggregate ``loss``
    with the original ``mask`` so rejected tokens stay in the denominator, as AReaL does.
    """
    if level == "sequence" and logp.dim() < 2:
        raise AlgorithmError("sequence-level weights need token tensors [B, L]")
    w, rejected = behaviour_weights(prox_logp, behav_logp, mask, cap, cap_mode, level)
    base = ppo_clip_loss(logp, prox_logp, advantages, mask, clip_low, clip_high)
    return base._replace(loss=base.loss * w, is_weight=w, rejected=rejected)


def weight_rows(terms: PolicyLossTerms, row_weights: Tensor) -> PolicyLossTerms:
    """Multiply each row's loss by a sample weight (prioritised-replay IS weight, staleness decay).

    Shapes: terms.loss [B] or [B, L]; row_weights [B] (>= 0, detached). Aggregation is unchanged, so a
    row of weight 0.5 counts half as much in the same denominator (``SampleReply.weights``).
    """
    if row_weights.dim() != 1 or row_weights.shape[0] != terms.loss.shape[0]:
        raise AlgorithmError(f"row_weights must be [{terms.loss.shape[0]}], got {tuple(row_weights.shape)}")
    if not torch.isfinite(row_weights).all() or bool((row_weights < 0).any()):
        raise AlgorithmError("row_weights must be finite and >= 0")
    w = row_weights.detach().to(terms.loss.dtype)
    w = w.reshape(-1, *([1] * (terms.loss.dim() - 1)))
    return terms._replace(loss=terms.loss * w)


def sequence_log_ratios(old_logp: Tensor, behav_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Sequence log importance ratios. Shapes: [B, L] in; returns (log ρ_seq [B], log ρ_geo [B]).

    log ρ_seq = Σ_t m_t (old − behav); log ρ_geo = log ρ_seq / Σ_t m_t (0 for an empty sequence).
    """
    _check_same_shape(old_logp=old_logp, behav_logp=behav_logp, mask=mask)
    diff = old_logp - behav_logp
    diff = torch.where(mask.bool() & torch.isfinite(diff), diff, torch.zeros_like(diff)).detach()
    total = diff.sum(-1)
    return total, total / mask.to(diff.dtype).sum(-1).clamp(min=1.0)


def sequence_tis_weights(old_logp: Tensor, behav_logp: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Seq-TIS: min(ρ_seq, cap) broadcast to the valid tokens. Shapes: [B, L] in, [B, L] out, detached."""
    log_seq, _ = sequence_log_ratios(old_logp, behav_logp, mask)
    w = torch.exp(log_seq.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).clamp(max=cap)
    return w[:, None] * mask.to(w.dtype)


def sequence_rejection_mask(
    old_logp: Tensor,
    behav_logp: Tensor,
    mask: Tensor,
    lower: float = 0.5,
    upper: float = 2.0,
    statistic: Literal["sum", "mean"] = "sum",
) -> tuple[Tensor, Tensor]:
    """Seq-MIS: drop whole sequences whose importance ratio is outside [lower, upper].

    Shapes: [B, L] in; returns (new mask [B, L], same dtype as ``mask``; rejected [B] bool). The
    statistic is ρ_seq (``sum`` of log-ratios) or ρ_geo (``mean``). Rejection only changes the mask:
    no weight is applied. Callers count ``rejected.sum()``.
    """
    if not 0.0 <= lower <= upper:
        raise AlgorithmError(f"need 0 <= lower <= upper, got lower={lower} upper={upper}")
    log_seq, log_geo = sequence_log_ratios(old_logp, behav_logp, mask)
    stat = {"sum": log_seq, "mean": log_geo}.get(statistic)
    if stat is None:
        raise AlgorithmError(f"unknown sequence statistic {statistic!r}; expected 'sum' or 'mean'")
    log_low = torch.log(torch.tensor(lower, dtype=stat.dtype)) if lower > 0 else torch.tensor(-float("inf"))
    log_up = torch.log(torch.tensor(upper, dtype=stat.dtype))
    has_tokens = mask.bool().any(-1)
    rejected = ((stat < log_low) | (stat > log_up)) & has_tokens
    new_mask = mask * (~rejected)[:, None].to(mask.dtype)
    return new_mask, rejected


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: Literal["k1", "k2", "k3", "k3+"] = "k3") -> Tensor:
    """Per-token estimate of KL(π_θ‖π_ref) from tokens sampled from π_θ (Schulman 2020).

    Shapes: logp (with grad), ref_logp (no grad, adapters disabled) — same shape; returns that shape.
    With d = logp − ref: k1 = d; k2 = ½d²; k3 = exp(−d) + d − 1 (d clamped ±20, output [−10, 10]);
    k3+ has k3's value and k2's gradient. Mask and aggregate like the policy loss.
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    d = logp - ref_logp.detach()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind in ("k3", "k3+"):
        dc = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        k3 = (torch.exp(-dc) + dc - 1.0).clamp(-10.0, 10.0)
        if kind == "k3":
            return k3
        k2 = 0.5 * d.square()
        return k2 + (k3 - k2).detach()
    raise AlgorithmError(f"unknown KL estimator {kind!r}; expected k1, k2, k3 or k3+")


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor | None = None,
    clip_eps: float | None = 0.2,
    loss_type: Literal["mse", "huber"] = "mse",
    huber_delta: float = 10.0,
) -> Tensor:
    """Clipped critic loss per element (PPO2; MARFT ``cal_value_loss``).

    Shapes: values (with grad), old_values, returns, mask — same shape; returns that shape (0 where
    mask is 0). V_clip = old + clamp(V − old, ±clip_eps); ℓ = max(f(V − G), f(V_clip − G)) with
    f = ½e² (``mse``) or Huber(e, δ) (``huber``); ``clip_eps=None`` gives the unclipped f(V − G).
    """
    if mask is None:
        mask = torch.ones_like(values, dtype=torch.bool)
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)

    def f(err: Tensor) -> Tensor:
        if loss_type == "mse":
            return 0.5 * err.square()
        if loss_type == "huber":
            a = err.abs()
            return torch.where(a <= huber_delta, 0.5 * err.square(), huber_delta * (a - 0.5 * huber_delta))
        raise AlgorithmError(f"unknown value loss {loss_type!r}; expected 'mse' or 'huber'")

    target = returns.detach()
    loss = f(values - target)
    if clip_eps is not None:
        old = old_values.detach()
        v_clip = old + (values - old).clamp(-clip_eps, clip_eps)
        loss = torch.maximum(loss, f(v_clip - target))
    return loss * mask.to(loss.dtype)
