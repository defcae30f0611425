"""One optimiser step of one adapter: its rows in gradient-accumulated micro-batches
(docs/algorithms.md §3-§7, docs/architecture.md §7).

:class:`StepData` is what one train step's adapter updates share (its rows and their advantages,
made before the first update and never added to); :class:`AdapterStep` runs one adapter's step for
the ``step_fn`` the engine hands to :func:`teamrl.learner.update.sequential_update` and returns what
it made (:class:`AdapterStepResult`: its statistics and π_prox).

Design decisions:

* **Statistics stay on the device** as tensors and are read back once at the end: a ``float()`` per
  statistic and micro-batch was a host/device synchronisation each (tests/bench/learner.py, docs/gpu.md).
  Token counts come from the CPU copy of the mask, which needs no synchronisation.
* **π_prox** is the adapter before this step's update: the detached log-probs of the first epoch's
  training forward (with one optimiser step per epoch they are exactly the pre-update ones), so no
  extra forward pass is spent on it. A step returns them; the engine hands them to the adapter's
  later epochs (``AdapterStep(prox=...)``) and reads them back as its π_old
  (``sequential_update(old_fn=...)``).
* **Sample weights** (``StepRows.weights``, the buffer's per-trajectory weights) multiply every
  row's policy and KL loss (:func:`teamrl.learner.losses.weight_rows`).
* **Data parallel**: every rank must issue the same collectives, so the number of micro-batches is
  agreed by the caller (an all-reduce(max)), and a rank with fewer rows runs zero-weight dummy
  micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from teamrl.learner.logprobs import LogprobPasses
from teamrl.learner.losses import PolicyLossTerms, agg_loss, weight_rows
from teamrl.learner.model import AdapterModel
from teamrl.learner.objectives import behaviour_weight, kl_loss, loss_share, policy_terms
from teamrl.learner.rows import Advantages, StepRows
from teamrl.learner.settings import AdapterSettings, ObjectiveSettings

__all__ = ["StepData", "AdapterStep", "AdapterStepResult", "idle_stats"]

# the statistics of one adapter's step, in the order of its metrics
_STAT_KEYS = (
    "loss",
    "grad_norm",
    "clip_frac",
    "kl",
    "ratio_mean",
    "ratio_max",
    "is_weight_mean",
    "is_weight_max",
)


@dataclass(frozen=True)
class StepData:
    """What every adapter's update in one train step reads: the step's rows (each adapter's, their
    sample weights and joint samples) and their advantages (with the KL reference log-probs)."""

    rows: StepRows
    adv: Advantages


@dataclass(frozen=True)
class AdapterStepResult:
    """What one adapter's step made: its statistics, and π_prox [rows, R] of its rows on the CPU (the
    log-probs before the step; None when this rank had no rows of it)."""

    stats: dict[str, float]
    prox: Tensor | None


def idle_stats(lr: float) -> dict[str, float]:
    """The statistics of an adapter that no rank had rows for (it is not stepped at all)."""
    return dict.fromkeys(_STAT_KEYS, math.nan) | {"tokens": 0.0, "rejected_tokens": 0.0, "lr": lr}


class AdapterStep:
    """One optimiser step of one adapter over its rows (module docstring): its micro-batches and their
    running statistics. ``factor`` [n_joint]: the HAPPO factor of each joint sample. ``prox``: π_prox
    of the adapter's rows from an earlier epoch of this train step (None: the first epoch, which
    records it from its training forward)."""

    def __init__(
        self,
        net: AdapterModel,
        passes: LogprobPasses,
        data: StepData,
        adapter: str,
        s: AdapterSettings,
        obj: ObjectiveSettings,
        action_level: bool,
        factor: Tensor,
        timeline: Any = None,
        prox: Tensor | None = None,
    ) -> None:
        self.net, self.passes, self.data, self.adapter = net, passes, data, adapter
        self.s, self.obj, self.action_level = s, obj, action_level
        self.eng = net.engines[adapter]
        self.timeline = timeline  # teamrl.protocol.timeline.Timeline: the optimiser's time apart
        self.dev = net.device
        self.prox = prox
        self.new_prox: list[Tensor] = []
        self.stats = _Stats(self.dev)
        self.done = 0  # leading micro-batches already streamed (see stream and resume)
        self.side: dict[Tensor, Tensor] = {}  # their gradients, unnormalised
        self.inject: list[tuple[Tensor, Tensor]] = []  # ... times 1/total, for the next backward
        self._bind(data, factor)

    def _bind(self, data: StepData, factor: Tensor) -> None:
        """Train on ``data``: its rows' totals give each micro-batch its share of the loss."""
        self.data = data
        mask_all = data.rows.batch.resp_mask[data.rows.of_adapter[self.adapter]]
        self.total_tokens = float(mask_all.sum())
        self.total_seqs = float((mask_all.sum(-1) > 0).sum())
        self.factor = factor.to(self.dev)

    def stream(self, data: StepData, c: Tensor, offset: int) -> None:
        """Forward/backward of the next micro-batch ``c`` of a step whose batch is still arriving
        (``data``: the part that has). The step's total is not known yet, so its share is left
        unnormalised (its tokens or sequences), and its gradients go to a side accumulator, outside
        DeepSpeed (``torch.autograd.grad``: no accumulation hook fires, whatever the ZeRO stage);
        :meth:`resume` hands them over once the total is known. The HAPPO factor is 1 (only the
        first adapter of the order streams; teamrl.learner.streaming)."""
        self._bind(data, torch.ones(data.rows.n_joint))
        self.total_tokens = self.total_seqs = 1.0
        self.net.model.train()
        self.micro_batch(c, offset, self._accumulate)
        self.net.trainable(None)
        self.done += 1

    def _accumulate(self, loss: Tensor) -> None:
        params = [p for p in self.eng.module.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            if g is not None:
                acc = self.side.setdefault(p, torch.zeros_like(p, dtype=torch.float32))
                acc += g.float()

    def resume(self, data: StepData, factor: Tensor) -> AdapterStep:
        """Continue a streamed step on the whole batch ``data``. The streamed gradients, times
        1/total, enter the next micro-batch's backward as the term sum(p · G) (whose gradient is G),
        so DeepSpeed accumulates them wherever its stage keeps gradients; linear, so equal to the
        whole-batch step up to float rounding. Their loss statistic is scaled alike and their π_prox
        padded to the batch's response width."""
        self._bind(data, factor)
        one = torch.ones((1, 1), dtype=torch.bool)
        scale = loss_share(self.obj, self.action_level, one, self.total_tokens, self.total_seqs)
        self.inject = [(p, g * scale) for p, g in self.side.items()]
        self.side = {}
        self.stats.acc[0] *= scale
        width = data.rows.batch.resp_mask.shape[1]
        self.new_prox = [torch.nn.functional.pad(x, (0, width - x.shape[1])) for x in self.new_prox]
        return self

    def run(self, n_micro: int) -> AdapterStepResult:
        """The step in ``n_micro`` micro-batches (agreed by every rank); its statistics and π_prox."""
        eng, rows = self.eng, self.data.rows
        self.net.model.train()
        chunks = self.passes.chunks(rows.of_adapter[self.adapter], self.adapter, rows.batch.row_lengths)
        offset = 0
        for j in range(n_micro):
            eng.set_gradient_accumulation_boundary(j == n_micro - 1)
            if j < self.done:  # streamed before the batch was complete (resume)
                offset += len(chunks[j])
                continue
            if j >= len(chunks):  # dummy micro-batch: same collectives as the other ranks, zero gradient
                self.dummy()
                continue
            self.micro_batch(chunks[j], offset)
            offset += len(chunks[j])
        if self.timeline is not None:
            self.timeline.enter("optimiser")
        eng.step()
        if self.timeline is not None:
            self.timeline.enter("forward_backward")
        prox = self.prox
        if prox is None and self.new_prox:
            prox = torch.cat(self.new_prox).cpu()
        self.net.trainable(None)
        return AdapterStepResult(self.stats.read(eng.get_global_grad_norm(), self.s.lr), prox)

    def dummy(self) -> None:
        """A zero-gradient micro-batch (a rank with fewer rows than another)."""
        dummy = self.data.rows.batch.input_ids.new_zeros((1, 2), device=self.dev)
        self.net.model.set_adapter(self.adapter)
        self.net.trainable(self.adapter)
        out = self.eng(input_ids=dummy, use_cache=False).logits
        self.eng.backward(out.sum() * 0.0)

    def micro_batch(self, c: Tensor, offset: int, backward: Callable[[Tensor], None] | None = None) -> None:
        """Forward, loss and backward of rows ``c`` (at ``offset`` in the adapter's rows); ``backward``
        (default: the DeepSpeed engine's) takes the micro-batch's share of the loss."""
        rows, dev, obj, s = self.data.rows, self.dev, self.obj, self.s
        batch = rows.batch
        mask_cpu = batch.resp_mask[c]
        mask = mask_cpu.to(dev)
        logp = self.passes.token_logp(batch, c, self.adapter, grad=True, engine=backward is None)
        span = slice(offset, offset + len(c))  # these rows' place among the adapter's rows
        if self.prox is not None:
            prox = self.prox[span].to(dev)
        else:
            prox = logp.detach() * mask
            self.new_prox.append(prox)
        f_row = self.factor[rows.joint_idx[c].to(dev)]
        behav = batch.behav_logp[c].to(dev)
        if self.action_level:  # APPO: one advantage per action (docs/algorithms.md §6)
            assert self.data.adv.row is not None
            adv = self.data.adv.row[c].to(dev) * f_row
        else:
            adv = self.data.adv.tok[c].to(dev) * f_row[:, None]
        terms = policy_terms(obj, self.action_level, logp, prox, behav, adv, mask, (s.clip_low, s.clip_high))
        row_w = rows.weights[c].to(dev) if rows.weights is not None else None
        if row_w is not None:  # SampleReply.weights: each row's loss times its trajectory's weight
            terms = weight_rows(terms, row_w)
        # an action-level loss is a mean over actions; `unit` is what the ratio statistics count
        unit = mask.any(-1) if self.action_level else mask
        n_tok = float(mask_cpu.sum())
        loss = agg_loss(terms.loss, unit, "token-mean" if self.action_level else obj.loss_agg)
        kl_term = None
        if s.kl_coef > 0:
            kl = kl_loss(obj, logp, self.data.adv.ref[self.adapter][span].to(dev), mask, row_w)
            loss = loss + s.kl_coef * kl
            kl_term = kl.detach() * n_tok
        share = loss_share(obj, self.action_level, mask_cpu, self.total_tokens, self.total_seqs)
        scaled = loss * share
        if self.inject:  # a streamed step's gradients so far (resume)
            scaled = scaled + sum((p * g.to(p.dtype)).sum() for p, g in self.inject)
            self.inject = []
        (backward or self.eng.backward)(scaled)
        w = behaviour_weight(obj, self.action_level, prox, behav, mask)
        n_unit = float(mask_cpu.any(-1).sum()) if self.action_level else n_tok
        self.stats.add(loss.detach() * share, kl_term, terms, unit, w, n_tok, n_unit)


class _Stats:
    """Running sums and maxima of one adapter's step on the device, read back once."""

    def __init__(self, dev: torch.device) -> None:
        self.zero = torch.zeros((), dtype=torch.float32, device=dev)
        # loss, kl·tokens, clipped, rejected, ratio sum, π_prox/μ sum
        self.acc = torch.zeros(6, dtype=torch.float32, device=dev)
        self.ratio_max, self.w_max = self.zero, self.zero
        self.tokens, self.units = 0.0, 0.0

    def add(
        self,
        loss: Tensor,
        kl_term: Tensor | None,
        terms: PolicyLossTerms,
        unit: Tensor,
        behav_w: Tensor,
        n_tok: float,
        n_unit: float,
    ) -> None:
        zero = self.zero
        ratio = terms.ratio.detach()
        self.acc += torch.stack(
            [
                loss,
                kl_term if kl_term is not None else zero,
                terms.clipped.sum(dtype=torch.float32),
                terms.rejected.sum(dtype=torch.float32),
                torch.where(unit, ratio, zero).sum(),
                torch.where(unit, behav_w, zero).sum(),
            ]
        )
        # maxima over the counted units (ratios and weights are positive: 0 stands for "none")
        self.ratio_max = torch.maximum(self.ratio_max, torch.where(unit, ratio, zero).max())
        self.w_max = torch.maximum(self.w_max, torch.where(unit, behav_w, zero).max())
        self.tokens += n_tok
        self.units += n_unit

    def read(self, grad_norm: float | None, lr: float) -> dict[str, float]:
        loss_sum, kl_sum, clipped, rejected, ratio_sum, w_sum, r_max, w_max = torch.cat(
            [self.acc, torch.stack([self.ratio_max, self.w_max])]
        ).tolist()  # the one read-back of this step's statistics
        ntok = max(self.tokens, 1.0)
        nunit = max(self.units, 1.0)
        values = [
            loss_sum,
            float(grad_norm) if grad_norm is not None else math.nan,
            clipped / nunit,
            kl_sum / ntok,
            ratio_sum / nunit,
            r_max,
            w_sum / nunit,
            w_max,
        ]
        return dict(zip(_STAT_KEYS, values, strict=True)) | {
            "rejected_tokens": rejected,
            "tokens": self.tokens,
            "lr": lr,
        }
