"""The DeepSpeed learner engine: one shared frozen base, one PEFT LoRA per adapter name, and the
train step that updates them (docs/architecture.md §7, docs/algorithms.md).

Call sequence::

    init_distributed(device)                 # torch.distributed from RANK/WORLD_SIZE env, or world 1
    eng = LearnerEngine(model_dir, adapters, settings, device=device)   # settings: EngineSettings
    eng = LearnerEngine.build(model_dir, adapters, adapter_settings=..., epochs=2)   # or from keywords
    res = eng.train_step(trajectories, step, current_version, fresh_version)   # -> StepResult
    eng.export_adapters(folder)              # PEFT save_pretrained, one subfolder per adapter
    eng.save_checkpoint(folder, versions=...)  / state = eng.load_checkpoint(folder)  # -> EngineState

The engine wires its parts together; each part is its own module of ``teamrl.learner``:

* ``settings``: the frozen settings it is built from (``EngineSettings``);
* ``model``: the PEFT model, one DeepSpeed engine per adapter, the critic's;
* ``rows``: trajectories -> right-padded row tensors, each row's weight and joint sample, outcome
  advantages;
* ``logprobs``: the forward passes (recomputed log-probs, critic features, sampling);
* ``critic_step``: GAE advantages from the centralised critic, and its update;
* ``update``: the agent-by-agent (HAPPO) update driver;
* ``policy_step``: one adapter's optimiser step over micro-batches;
* ``objectives``: the policy loss of one micro-batch, per objective;
* ``checkpoint``: checkpoint save and load.

Design decisions of the train step (:meth:`LearnerEngine.train_step`):

* **Advantages** per row (one agent step), ``algorithm`` (docs/algorithms.md §1): GRPO, Dr. GRPO, Dr. MAS
  per (group, agent), AT-GRPO per (group, agent, turn) or DrMAS's trajectory-mean baseline
  (:func:`teamrl.learner.advantages.outcome_advantages`; a row alone in its group follows
  ``singleton_advantage``), broadcast to the response tokens; or GAE from the critic (§6).
* **Update**: :func:`teamrl.learner.update.sequential_update`. A joint row of the HAPPO factor is one
  (episode, turn) (``happo_factor="turn"``, HAPPO's per-time-step factor) or one episode
  (``"trajectory"``): agent k's action log-prob on it is the sum over its steps there (0 where it did
  not act), and agent m's rows are weighted by the factor of their joint row. ``simultaneous`` is
  independent PPO (factor 1). The order is seeded by the step number, so a resumed learner repeats it.
* **Sample weights**: the buffer's per-trajectory weights (``SampleReply.weights``: prioritised-replay
  importance weights, staleness decay), passed as ``train_step(weights=...)``, one per trajectory of
  the batch (``RowBatch.n_traj``), reach every row of their trajectory (``StepRows.weights``,
  docs/algorithms.md §7).
* **Each stage returns what it made**: rows (``build_rows``), each row's weight and joint sample
  (``step_rows``), advantages (``Advantages``), the update's records and each adapter's π_prox; all
  frozen once made, so :meth:`LearnerEngine.train_step` reads top to bottom with nothing filled in later.
* **The log-prob check**: the gap between the behaviour log-probs and the recomputation on *fresh* rows
  (sampled with exactly the current weights) is a metric, and a gap over ``logprob_tolerance`` raises
  :class:`LogprobMismatch` (a misaligned recompute was measured to collapse training).
* **Data parallel**: each rank trains on its own sample; DeepSpeed averages the gradients. The number
  of micro-batches per adapter is agreed with an all-reduce(max), so every rank issues the same
  collectives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from teamrl.learner.advantages import advantage_groups, singleton_group_count
from teamrl.learner.checkpoint import EngineState, load_checkpoint, save_checkpoint
from teamrl.learner.critic_step import critic_advantages
from teamrl.learner.distributed import _all_reduce_max, init_distributed
from teamrl.learner.errors import LearnerError, LogprobMismatch
from teamrl.learner.logprobs import LogprobPasses
from teamrl.learner.model import AdapterModel
from teamrl.learner.policy_step import AdapterStep, StepData, idle_stats
from teamrl.learner.rows import Advantages, RowBatch, StepRows, build_rows, outcome, row_advantages, step_rows
from teamrl.learner.settings import AdapterSettings, EngineSettings
from teamrl.learner.update import (
    SequentialUpdateResult,
    factor_bounds,
    joint_logprob,
    random_order,
    sequential_update,
)
from teamrl.protocol.trajectory import GraphTrajectory

__all__ = [
    "LearnerError",
    "LogprobMismatch",
    "AdapterSettings",
    "EngineSettings",
    "RowBatch",
    "StepRows",
    "StepResult",
    "EngineState",
    "build_rows",
    "row_advantages",
    "init_distributed",
    "LearnerEngine",
]


@dataclass
class StepResult:
    """What one train step did: flat metrics (``loss/<adapter>``, ...), rows ignored, the order used."""

    metrics: dict[str, float]
    ignored: dict[str, int]
    order: list[str]
    losses: dict[str, float]


class LearnerEngine:
    """Shared base + one LoRA per adapter name, one DeepSpeed engine per adapter (module docstring).

    Between steps, ``settings`` may be swapped for a variant in what a step reads, the objective and
    the update (``eng.settings = eng.settings.replace(algorithm="grpo")``); the model, the optimisers,
    the critic (whether there is one) and the per-adapter settings stay as they were built.
    """

    def __init__(
        self, model_dir: str | Path, adapters: Sequence[str], settings: EngineSettings, *, device: str = "cpu"
    ) -> None:
        self.adapters = list(adapters)
        self.settings = settings
        self.adapter_settings = settings.resolved(self.adapters)
        self.net = AdapterModel(model_dir, self.adapters, settings, device)
        self.passes = LogprobPasses(
            self.net,
            self.adapter_settings,
            settings.objective.temperature,
            settings.optim.micro_batch_rows,
            settings.optim.micro_batch_tokens,
        )
        self.next_step = 0  # the step after the last one trained (restored by load_checkpoint)
        self.last_version = -1  # current_version of the last train_step
        self.updates = dict.fromkeys(self.adapters, 0)  # optimiser steps taken per adapter
        self.timeline: Any = None  # teamrl.protocol.timeline.Timeline, set by the service

    @classmethod
    def build(
        cls,
        model_dir: str | Path,
        adapters: Sequence[str],
        *,
        adapter_settings: Mapping[str, AdapterSettings],
        device: str = "cpu",
        **settings: Any,
    ) -> LearnerEngine:
        """An engine from flat keyword settings (:meth:`EngineSettings.from_kwargs`; the rest default)."""
        return cls(
            model_dir, adapters, EngineSettings.from_kwargs(adapter_settings, **settings), device=device
        )

    # --- the model's parts, as tests and the service read them --------------------------------

    @property
    def model(self) -> Any:
        """The PEFT model (every adapter on the shared base)."""
        return self.net.model

    @property
    def critic(self) -> Any:
        """The value head's DeepSpeed engine (None unless ``objective="ppo-critic"``)."""
        return self.net.critic

    @property
    def device(self) -> torch.device:
        return self.net.device

    @property
    def dtype(self) -> str:
        """The model's dtype, ``"float32"`` or ``"bfloat16"`` (``"auto"`` resolved)."""
        return self.net.dtype

    def adapter_state(self, name: str) -> dict[str, Tensor]:
        """Copies of one adapter's parameters (for tests and parity checks)."""
        return self.net.adapter_state(name)

    def sample(
        self,
        adapter: str | None,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_id: int,
        generator: torch.Generator,
        temperature: float | None = None,
    ) -> list[tuple[list[int], list[float]]]:
        """Completions and their log-probs (:meth:`teamrl.learner.logprobs.LogprobPasses.sample`)."""
        return self.passes.sample(adapter, prompts, max_new_tokens, eos_id, generator, temperature)

    def completion_logprobs(
        self, adapter: str | None, prompt: Sequence[int], completion: Sequence[int]
    ) -> list[float]:
        """log p(completion[i] | prompt, completion[:i]) at temperature 1, float32 (the publish probe)."""
        return self.passes.completion_logprobs(adapter, prompt, completion)

    # --- the train step ------------------------------------------------------------------------

    def train_step(
        self,
        trajectories: Sequence[GraphTrajectory],
        step: int,
        current_version: int,
        fresh_version: int | None = None,
        weights: Sequence[float] | None = None,
        started: AdapterStep | None = None,
    ) -> StepResult:
        """One update over a sample: advantages, objective, agent-by-agent (or simultaneous) steps.

        ``current_version``: the latest published version (for staleness). ``fresh_version``: rows of
        this version were sampled with exactly the weights the learner holds now (None: none are), and
        are the ones the behaviour/recompute log-prob check runs on. ``weights``: one sample weight per
        trajectory (``SampleReply.weights``; None or empty: all 1). ``started``: the first adapter's
        step begun while the batch arrived (:class:`teamrl.learner.streaming.StreamingStep`).
        """
        t0 = time.perf_counter()
        batch, ignored = build_rows(trajectories, self.adapters, self.settings.objective.reward_source)
        rows = step_rows(batch, self.adapters, weights, self.settings.optim.happo_factor)
        adv, metrics = self._advantages(rows)
        order = self._order(step)
        result, prox = self._update(StepData(rows, adv), order, started)
        metrics |= _update_metrics(result)
        metrics |= self._logprob_gap(rows, prox, fresh_version, step)
        metrics |= _batch_metrics(batch, adv, current_version, time.perf_counter() - t0)
        self.next_step = step + 1
        self.last_version = current_version
        return StepResult(
            metrics=metrics,
            ignored=ignored,
            order=[self.adapters[i] for i in order],
            losses={rec.agent: rec.step_stats[-1]["loss"] for rec in result.records},
        )

    def _advantages(self, rows: StepRows) -> tuple[Advantages, dict[str, float]]:
        """The advantages of ``rows`` with the KL reference log-probs of each adapter with a KL term
        (the critic's GAE with ``objective="ppo-critic"``), and their metrics."""
        if self.net.critic is not None:
            return critic_advantages(self.passes, rows, self.settings, self.adapter_settings)
        batch, obj = rows.batch, self.settings.objective
        adv = outcome(batch, obj.algorithm, obj.singleton_advantage, obj.advantage_std)
        groups = advantage_groups(
            obj.algorithm, batch.group_idx, batch.agent_idx, batch.traj_idx, batch.turn_idx
        )
        ref = {
            a: self.passes.token_logprobs(batch, rows.of_adapter[a], None)
            for a in self.adapters
            if self.adapter_settings[a].kl_coef > 0
        }
        return Advantages(adv.row, adv.tok, ref), {"singleton_groups": float(singleton_group_count(*groups))}

    def _order(self, step: int) -> list[int]:
        if self.settings.optim.order == "fixed":
            return list(range(len(self.adapters)))
        g = torch.Generator().manual_seed(self.settings.optim.seed * 1_000_003 + step)
        return random_order(len(self.adapters), g)

    def _update(
        self, data: StepData, order: list[int], started: AdapterStep | None = None
    ) -> tuple[SequentialUpdateResult[str], dict[str, Tensor]]:
        """The agent-by-agent update: each adapter's optimiser steps, in ``order``; ``started``
        continues as the first adapter's first epoch. Returns its records and each stepped adapter's
        π_prox (the log-probs of its rows before the update, recorded by its first epoch)."""
        optim, rows = self.settings.optim, data.rows
        batch = rows.batch
        per_rank = [len(self.passes.chunks(rows.of_adapter[a], a, batch.row_lengths)) for a in self.adapters]
        # 0 = no rank has rows for this adapter: it is not stepped at all (AdamW would still move it)
        n_micro = dict(zip(self.adapters, _all_reduce_max(per_rank), strict=True))
        action_level = self.net.critic is not None and self.settings.critic.critic_level == "action"
        pending = [started] if started is not None else []
        prox: dict[str, Tensor] = {}  # each adapter's π_prox, as its first epoch returned it

        def per_joint(adapter: str, token_logp: Tensor) -> Tensor:  # [n, R] of its rows -> [n_joint]
            idx = rows.of_adapter[adapter]
            row_logp = (token_logp * batch.resp_mask[idx]).sum(-1).float()
            return joint_logprob(row_logp, rows.joint_idx[idx], rows.n_joint)

        def logprob_fn(adapter: str) -> Tensor:  # after the adapter's epochs
            return per_joint(adapter, self.passes.token_logprobs(batch, rows.of_adapter[adapter], adapter))

        def old_fn(adapter: str) -> Tensor:  # π_old = π_prox, recorded by the first epoch's forward
            if adapter not in prox:  # no rows here: the agent's ratio is 1 on every joint sample
                return torch.zeros(rows.n_joint)
            return per_joint(adapter, prox[adapter])

        def step_fn(adapter: str, factor: Tensor) -> Mapping[str, float]:
            s = self.adapter_settings[adapter]
            if n_micro[adapter] == 0:
                return idle_stats(s.lr)
            self.updates[adapter] += 1
            if pending and pending[0].adapter == adapter:
                step = pending.pop().resume(data, factor)
            else:
                step = self._adapter_step(data, adapter, action_level, factor, prox.get(adapter))
            out = step.run(n_micro[adapter])
            if out.prox is not None:
                prox[adapter] = out.prox
            return out.stats

        result = sequential_update(
            self.adapters,
            order,
            logprob_fn,
            step_fn,
            epochs=optim.epochs,
            mode=optim.update_order,
            factor_clip=factor_bounds(optim.happo_factor_clip),
            n_rows=rows.n_joint,
            measure_last=False,  # nothing reads the last agent's ratio: one no-grad pass fewer
            old_fn=old_fn,  # and π_old comes from the training forward: one more fewer per agent
        )
        self.net.trainable(None)
        return result, prox

    def _adapter_step(
        self, data: StepData, adapter: str, action_level: bool, factor: Tensor, prox: Tensor | None
    ) -> AdapterStep:
        """One adapter's update within the sequential loop (``prox``: its π_prox from an earlier epoch)."""
        s = self.adapter_settings[adapter]
        return AdapterStep(
            self.net,
            self.passes,
            data,
            adapter,
            s,
            self.settings.objective,
            action_level,
            factor,
            self.timeline,
            prox=prox,
        )

    def _logprob_gap(
        self, rows: StepRows, prox: Mapping[str, Tensor], fresh_version: int | None, step: int
    ) -> dict[str, float]:
        """Mean |π_prox − μ| on the fresh rows' tokens (π_prox = the weights that sampled them);
        raises :class:`LogprobMismatch` over ``logprob_tolerance`` when it is a mean of at least
        ``logprob_min_tokens`` tokens (a mean of a few is noise, not a misalignment)."""
        batch, gap_sum, gap_n = rows.batch, 0.0, 0
        for a in self.adapters:
            idx = rows.of_adapter[a]
            if fresh_version is None or len(idx) == 0 or a not in prox:
                continue
            fresh = batch.versions[idx] == fresh_version
            mask = batch.resp_mask[idx] & fresh[:, None]
            diff = (prox[a] - batch.behav_logp[idx]).abs()
            gap_sum += float(diff[mask].sum())
            gap_n += int(mask.sum())
        gap = gap_sum / gap_n if gap_n else math.nan
        objective = self.settings.objective
        tolerance = objective.logprob_tolerance
        if tolerance is not None and gap_n >= objective.logprob_min_tokens and gap > tolerance:
            raise LogprobMismatch(
                f"step {step}: mean |recomputed - behaviour| log-prob on {gap_n} fresh tokens is "
                f"{gap:.4f} > tolerance {tolerance} (padding / position ids / temperature "
                "differ between sampler and learner?)"
            )
        return {"logprob_gap": gap, "logprob_gap_tokens": float(gap_n)}

    # --- export and checkpoint ----------------------------------------------------------------

    def export_adapters(self, folder: str | Path) -> dict[str, Path]:
        """Write every adapter in PEFT format (``folder/<name>/adapter_config.json`` + safetensors)."""
        return self.net.export_adapters(folder)

    def save_checkpoint(
        self,
        folder: str | Path,
        *,
        versions: Mapping[str, int] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Every rank: every engine's DeepSpeed state and the RNG states; rank 0 then writes
        ``engine_state.json`` (:mod:`teamrl.learner.checkpoint`).

        ``versions``: the published version of each adapter (default: every adapter at the
        ``current_version`` of the last :meth:`train_step`). ``extra`` must be JSON-serialisable (e.g.
        the caller's counters).
        """
        state = EngineState(
            next_step=self.next_step,
            adapter_versions=dict(versions)
            if versions is not None
            else dict.fromkeys(self.adapters, self.last_version),
            adapter_updates=dict(self.updates),
            extra=dict(extra or {}),
        )
        save_checkpoint(
            self.net,
            folder,
            state,
            objective=self.settings.objective.objective,
            critic_level=self.settings.critic.critic_level,
        )

    def load_checkpoint(self, folder: str | Path) -> EngineState:
        """Every rank: restore what :meth:`save_checkpoint` wrote (raises LearnerError if incomplete or
        written for other adapters / another objective); returns the saved :class:`EngineState`."""
        state = load_checkpoint(self.net, folder, objective=self.settings.objective.objective)
        self.next_step = state.next_step
        self.last_version = max(state.adapter_versions.values(), default=-1)
        self.updates = dict(state.adapter_updates)
        return state


def _update_metrics(result: SequentialUpdateResult[str]) -> dict[str, float]:
    """``<statistic>/<adapter>`` of each adapter's last epoch, and its mean HAPPO factor."""
    out: dict[str, float] = {}
    for rec in result.records:
        for k, v in rec.step_stats[-1].items():
            out[f"{k}/{rec.agent}"] = v
        out[f"factor_mean/{rec.agent}"] = rec.factor_mean
        out[f"factor_max/{rec.agent}"] = rec.factor_max
        out[f"factor_clipped_rows/{rec.agent}"] = float(rec.factor_clipped_rows)
    return out


def _batch_metrics(
    batch: RowBatch, adv: Advantages, current_version: int, elapsed: float
) -> dict[str, float]:
    """Rewards and advantages per agent, staleness, size and speed of the step."""
    out: dict[str, float] = {}
    for agent in sorted(set(batch.agent_of_row)):
        sel = torch.tensor([x == agent for x in batch.agent_of_row])
        out[f"reward_mean/{agent}"] = float(batch.rewards[sel].mean())
        a_vals = adv.row[sel] if adv.row is not None else adv.tok[sel][batch.resp_mask[sel]]
        out[f"advantage_mean/{agent}"] = float(a_vals.mean())
        out[f"advantage_std/{agent}"] = float(a_vals.std(unbiased=False))
    tokens = int((batch.prompt_lens + batch.resp_lens).sum())
    out["reward_mean"] = float(np.mean(batch.team_rewards)) if batch.team_rewards else math.nan
    out["staleness_mean"] = float((current_version - batch.versions).float().mean())
    out["tokens"] = float(tokens)
    out["rows"] = float(batch.n_rows)
    out["step_time_s"] = elapsed
    out["tokens_per_s"] = tokens / elapsed if elapsed > 0 else math.nan
    return out
