"""A train step that starts while its batch is still arriving (FlexMARL's micro-batch pipeline,
arXiv 2602.09578): the learner runs the forward/backward of the micro-batches that have arrived,
accumulating gradients, while the rest of the step's groups are still being asked for, so waiting
for data and computing overlap.

Call sequence (``LearnerService.one_step`` with ``stream_micro_batches``)::

    stream = StreamingStep(engine, step, current_version, fresh_version)
    for batches, weights in replies:      # one buffer reply at a time, whole groups each
        stream.add(batches, weights)      # trains the micro-batches that are ready
    result = stream.finish()              # == engine.train_step(all batches, ..., weights=all)

The update is the whole-batch step's: the same rows in the same order, the same micro-batches, the
same maths (``tests/unit/learner/test_streaming.py`` compares the parameters after one step both ways).
What can stream without changing it, and why:

* **Only the first adapter of the step's order, in its first epoch.** The HAPPO factor of every later
  adapter is the ratio of the adapters before it, measured on *all* joint rows after their update, so
  nothing of theirs can start before the whole batch is there; the first adapter's factor is 1.
* **A micro-batch streams once every row of it has its final advantage.** Outcome advantages are per
  baseline group (GRPO per group, Dr. MAS per (group, agent), AT-GRPO per (group, agent, turn)), and
  the buffer hands out whole groups, so a row of a group with >= 2 trajectories and >= 2 rows in its
  baseline group has the advantage the whole batch gives it. A singleton under
  ``singleton_advantage="batch"`` is normalised against the agent's rows in the whole batch (Dr. MAS's
  batch-level fallback): a micro-batch holding one waits for the whole batch (no two-pass estimate,
  so the maths stays the batch's). ``finish`` checks that the streamed rows' advantages are the ones
  the whole batch gives.
* **The loss share needs the step's total** (token-mean: a micro-batch's tokens over the adapter's
  tokens in the step). A streamed micro-batch's gradients, with its unnormalised share, go to a side
  accumulator (``torch.autograd.grad``, outside DeepSpeed); once the batch is complete they are scaled
  by 1/total and enter the next micro-batch's backward as a term sum(p · G) whose gradient is G
  (``AdapterStep.stream`` / ``resume``), so DeepSpeed accumulates them wherever its ZeRO stage or
  bf16 keeps gradients. Linear, so equal to the whole-batch gradients up to float rounding (the
  test: parameters within 1e-6 after an AdamW step).
* **A micro-batch is final once a later row of the adapter exists**: micro-batches are cut from
  consecutive rows (by rows and padded tokens, ``LogprobPasses.chunks``), so the cut of the rows that
  have arrived equals the whole batch's except for its last micro-batch, which may still grow.

It falls back to the whole-batch step (everything trains in ``finish``) where gradients or data are
not its to scale or split: several ranks (the number of micro-batches is agreed by an all-reduce before
the first one, and a skipped micro-batch would skip a rank's collectives), a critic (GAE needs the
values of whole episodes), a KL term (the reference pass runs over an adapter's rows first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from teamrl.learner.advantages import advantage_groups, group_index
from teamrl.learner.distributed import _world
from teamrl.learner.errors import LearnerError
from teamrl.learner.policy_step import AdapterStep, StepData
from teamrl.learner.rows import RowBatch, build_rows, outcome, row_advantages, step_rows

__all__ = ["StreamingStep", "streams"]

ADVANTAGE_ATOL = 1e-6


def streams(engine: Any) -> bool:
    """Whether ``engine``'s steps can start before their batch is complete (module docstring)."""
    kl = any(engine.adapter_settings[a].kl_coef > 0 for a in engine.adapters)
    return _world()[1] == 1 and engine.critic is None and not kl


def final_rows(batch: RowBatch, algorithm: str, singleton: str) -> Tensor:
    """[N] bool: rows whose outcome advantage no row outside their group can change."""
    if singleton != "batch":
        return torch.ones(batch.n_rows, dtype=torch.bool)
    ids = advantage_groups(algorithm, batch.group_idx, batch.agent_idx, batch.traj_idx, batch.turn_idx)
    inverse, n = group_index(*ids)
    rows_in = torch.bincount(inverse, minlength=n)
    g_inv, n_g = group_index(batch.group_idx)
    first_row_of_traj = torch.ones_like(batch.traj_idx, dtype=torch.bool)
    first_row_of_traj[1:] = batch.traj_idx[1:] != batch.traj_idx[:-1]
    traj_in = torch.bincount(g_inv[first_row_of_traj], minlength=n_g)
    return (rows_in[inverse] >= 2) & (traj_in[g_inv] >= 2)


class StreamingStep:
    """One train step fed one reply at a time (module docstring)."""

    def __init__(self, engine: Any, step: int, current_version: int, fresh_version: int | None) -> None:
        self.engine = engine
        self.step, self.current_version, self.fresh_version = step, current_version, fresh_version
        self.enabled = streams(engine)
        self.first = engine.adapters[engine._order(step)[0]]
        self.batches: list[Any] = []
        self.weights: list[float] = []
        self.started: AdapterStep | None = None
        self.streamed: list[Tensor] = []  # the row indices of each streamed micro-batch
        self.streamed_adv: list[Tensor] = []
        self.offset = 0

    def add(self, batches: Sequence[Any], weights: Sequence[float]) -> int:
        """Take one reply's batches (and one weight per trajectory); train the micro-batches that
        became ready. Returns how many were trained."""
        self.batches.extend(batches)
        self.weights.extend(float(w) for w in weights)
        if not self.enabled:
            return 0
        eng, obj = self.engine, self.engine.settings.objective
        try:
            batch, _ = build_rows(self.batches, eng.adapters, obj.reward_source)
        except LearnerError:  # no trainable rows yet
            return 0
        rows = step_rows(batch, eng.adapters, self.weights, eng.settings.optim.happo_factor)
        data = StepData(rows, outcome(batch, obj.algorithm, obj.singleton_advantage, obj.advantage_std))
        final = final_rows(batch, obj.algorithm, obj.singleton_advantage)
        # the chunks the whole step will cut (consecutive rows): all but the last are final already
        chunks = eng.passes.chunks(rows.of_adapter[self.first], self.first, batch.row_lengths)[:-1]
        trained = 0
        for c in chunks[len(self.streamed) :]:
            if not bool(final[c].all()):
                break  # same order as the whole batch: nothing after it either
            self._train(data, c)
            trained += 1
        return trained

    def _train(self, data: StepData, c: Tensor) -> None:
        if self.started is None:
            eng = self.engine
            s = eng.adapter_settings[self.first]
            self.started = AdapterStep(
                eng.net,
                eng.passes,
                data,
                self.first,
                s,
                eng.settings.objective,
                False,
                torch.ones(1),
                eng.timeline,
            )
        self.started.stream(data, c, self.offset)
        self.streamed.append(c)
        assert data.adv.row is not None
        self.streamed_adv.append(data.adv.row[c])
        self.offset += len(c)

    def finish(self) -> Any:
        """The rest of the step on the whole batch; its ``StepResult`` (``streamed_micro_batches``:
        how many trained before the batch was complete)."""
        if self.started is not None:
            self._check()
        res = self.engine.train_step(
            self.batches,
            self.step,
            self.current_version,
            fresh_version=self.fresh_version,
            weights=self.weights or None,
            started=self.started,
        )
        res.metrics["streamed_micro_batches"] = float(len(self.streamed))
        return res

    def _check(self) -> None:
        """The streamed micro-batches are the whole batch's first ones, with its advantages."""
        eng, obj = self.engine, self.engine.settings.objective
        batch, _ = build_rows(self.batches, eng.adapters, obj.reward_source)
        whole = eng.passes.chunks(batch.rows_of(self.first), self.first, batch.row_lengths)
        adv = row_advantages(batch, obj.algorithm, obj.singleton_advantage, obj.advantage_std)
        for c, got, want in zip(self.streamed, self.streamed_adv, whole, strict=False):
            if not torch.equal(c, want) or not torch.allclose(got, adv[c], atol=ADVANTAGE_ATOL, rtol=0):
                raise LearnerError(
                    "a streamed micro-batch differs from the whole batch's (rows or advantages): "
                    "were groups split across sample replies?"
                )
