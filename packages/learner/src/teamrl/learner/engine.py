"""The DeepSpeed learner engine: one shared frozen base, one PEFT LoRA per adapter name.

Call sequence::

    init_distributed(device)                 # torch.distributed from RANK/WORLD_SIZE env, or world 1
    eng = LearnerEngine(model_dir, adapters, **plain_kwargs)
    res = eng.train_step(trajectories, step, current_version, fresh_version)   # -> StepResult
    eng.export_adapters(folder)              # PEFT save_pretrained, one subfolder per adapter
    eng.save_checkpoint(folder, versions=...)  / state = eng.load_checkpoint(folder)  # -> EngineState

Design decisions:

* **One DeepSpeed engine per adapter, all over the same PEFT module.** Each engine's optimiser owns only
  its adapter's LoRA parameters (so per-adapter lr / clip come for free). The alternative, one engine with
  a param group per adapter, steps every group on every ``step()``: in a sequential (HAPPO) update the
  adapters not being trained have zero gradients, and AdamW still moves them by its decayed first moment.
  Separate engines make "only agent k moves now" structurally true. Heterogeneous base models are not
  mixed in one engine: a learner process serves one base model, and a team with several bases runs one
  learner group per base (each its own ``teamrl learner`` processes, adapters list and publish endpoint).
* **Log-probs are recomputed on right-padded rows with explicit position ids 0..L-1** and the logits of
  the response positions only (``P-1+j`` predicts response token ``j``). A left-padded recompute with
  misaligned positions was measured to collapse training (docs/architecture.md §7), so the gap between the
  behaviour log-probs and the recomputation on *fresh* rows (sampled with exactly the current weights) is
  a metric, and a gap over ``logprob_tolerance`` raises :class:`LogprobMismatch`.
* **Advantages** per row (one agent step), ``algorithm`` (docs/algorithms.md §1): GRPO, Dr. GRPO, Dr. MAS
  per (group, agent), AT-GRPO per (group, agent, turn) or DrMAS's trajectory-mean baseline
  (:func:`teamrl.learner.advantages.outcome_advantages`; a row alone in its group follows
  ``singleton_advantage``), broadcast to the response tokens.
* **Objective**: decoupled PPO (π_θ/π_prox inside the clip, behaviour weight π_prox/μ outside it), or plain
  PPO-clip against π_prox; plus β·KL(π_θ‖π_ref) with π_ref the base with adapters disabled
  (``disable_adapter()``). π_prox is the adapter before this step's update. The default weight is
  truncated at ``tis_cap`` = 2 (token TIS as verl and slime use it); AReaL's rule, weight 0 above a cap
  of 5, is ``tis_mode="mask"``, ``tis_cap=5``; ``tis_level="sequence"`` uses ρ_seq (docs/algorithms.md §3).
* **Sample weights**: the buffer's per-trajectory weights (``SampleReply.weights``: prioritised-replay
  importance weights, staleness decay), passed as ``train_step(weights=...)``, multiply every row's
  policy and KL loss (:func:`teamrl.learner.losses.weight_rows`); the critic's value loss is unweighted.
* **PPO with a centralised critic** (``objective="ppo-critic"``, MARFT APPO/TPPO): a value head on the
  frozen base's hidden states (:mod:`teamrl.learner.critic`, which explains the choice), its own
  DeepSpeed engine and AdamW (``critic_lr``), GAE at action or token level (``critic_level``) on the
  values before this step's critic update, advantages whitened over the batch. ``action``: one PPO ratio
  per action from length-normalised log-probs (``action_logprob_norm="token"``: the geometric-mean token
  ratio), loss averaged over actions; ``token``: per-token ratios and advantages. Both keep the
  decoupled behaviour weight π_prox/μ (capped by ``tis_cap``), since the data is asynchronous. The HAPPO
  factor still uses summed action log-probs (update.py).
* **Checkpoint**: every adapter engine's and the critic's DeepSpeed state (LoRA weights, AdamW moments,
  step counts), per-rank torch/numpy/python RNG states, and ``engine_state.json`` (next step, adapter
  versions, optimiser step counts) written last as the completion marker. A restarted learner that
  loads it continues bit-for-bit (``tests/unit/learner/test_learner_resume.py``): nothing else in a step
  depends on state (the update order is seeded by the step number).
* **Update**: :func:`teamrl.learner.update.sequential_update`. A joint row of the HAPPO factor is one
  (episode, turn) (``happo_factor="turn"``, HAPPO's per-time-step factor) or one episode
  (``"trajectory"``): agent k's action log-prob on it is the sum over its steps there (0 where it did
  not act), and agent m's rows are weighted by the factor of their joint row. ``simultaneous`` is
  independent PPO (factor 1). In simultaneous mode with one epoch π_prox equals the detached log-probs of
  the training forward itself, so no extra forward pass is spent on it.
* **Data parallel**: each rank trains on its own sample; DeepSpeed averages the gradients. Every rank
  must issue the same collectives, so the number of micro-batches per adapter is agreed with an
  all-reduce(max) and a rank with fewer rows runs zero-weight dummy micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from teamrl.learner.advantages import (
    advantage_groups,
    broadcast_to_tokens,
    masked_whiten,
    singleton_group_count,
)
from teamrl.learner.critic import (
    ValueHead,
    action_level_gae,
    chain_rewards,
    explained_variance,
    token_level_gae,
)
from teamrl.learner.distributed import _all_reduce_max, _barrier, _world, init_distributed
from teamrl.learner.errors import LearnerError, LogprobMismatch
from teamrl.learner.losses import (
    action_logprob,
    agg_loss,
    clipped_value_loss,
    decoupled_ppo_loss,
    kl_penalty,
    ppo_clip_loss,
    weight_rows,
)
from teamrl.learner.rows import RowBatch, build_rows, row_advantages
from teamrl.learner.update import joint_logprob, joint_rows, random_order, sequential_update
from teamrl.protocol.trajectory import GraphTrajectory

__all__ = [
    "LearnerError",
    "LogprobMismatch",
    "AdapterSettings",
    "RowBatch",
    "StepResult",
    "EngineState",
    "build_rows",
    "row_advantages",
    "init_distributed",
    "LearnerEngine",
]


@dataclass(frozen=True)
class AdapterSettings:
    """Settings of one adapter (resolved from the config's per-agent overrides, Dr. MAS): its
    optimiser (lr, clip range), the temperature its agents sample at (its log-probs use logits / T), its
    KL coefficient and micro-batch size. ``None`` takes the engine-wide value."""

    lr: float
    clip_low: float
    clip_high: float
    temperature: float | None = None
    kl_coef: float | None = None
    micro_batch_rows: int | None = None


# --------------------------------------------------------------------------------------------------
# the engine

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
class EngineState:
    """What a checkpoint says beyond tensors: resume at ``next_step`` with these adapter versions.

    adapter_updates: optimiser steps taken per adapter; extra: the caller's JSON data (``save_checkpoint``).
    """

    next_step: int
    adapter_versions: dict[str, int]
    adapter_updates: dict[str, int]
    extra: dict[str, Any]


@dataclass
class StepResult:
    """What one train step did: flat metrics (``loss/<adapter>``, ...), rows ignored, the order used."""

    metrics: dict[str, float]
    ignored: dict[str, int]
    order: list[str]
    losses: dict[str, float]


class LearnerEngine:
    """Shared base + one LoRA per adapter name, one DeepSpeed engine per adapter (module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        adapters: Sequence[str],
        *,
        adapter_settings: Mapping[str, AdapterSettings],
        lora_rank: int = 8,
        lora_ranks: dict[str, int] | None = None,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
        dtype: Literal["auto", "float32", "bfloat16"] = "float32",
        device: str = "cpu",
        zero_stage: int = 2,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_rows: int = 64,
        temperature: float = 1.0,
        algorithm: Literal["grpo", "drmas", "dr_grpo", "at_grpo", "grpo_trajectory"] = "drmas",
        reward_source: Literal["step", "trajectory"] = "step",
        objective: Literal["decoupled", "ppo", "ppo-critic"] = "decoupled",
        tis_cap: float | None = 2.0,
        tis_mode: Literal["clamp", "mask"] = "clamp",
        tis_level: Literal["token", "sequence"] = "token",
        singleton_advantage: Literal["batch", "zero", "raw"] = "batch",
        happo_factor: Literal["turn", "trajectory"] = "turn",
        kl_coef: float = 0.0,
        kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3",
        loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean",
        logprob_tolerance: float | None = 0.05,
        update_order: Literal["sequential", "simultaneous"] = "sequential",
        order: Literal["random", "fixed"] = "random",
        epochs: int = 1,
        seed: int = 0,
        critic_level: Literal["action", "token"] = "action",
        gamma: float = 0.99,
        lam: float = 0.95,
        token_gamma: float | None = None,
        value_coef: float = 1.0,
        critic_lr: float = 5e-4,
        value_clip: float | None = 0.2,
        critic_hidden: int = 256,
        action_logprob_norm: Literal["token", "sum"] = "token",
        whiten_advantages: bool = True,
    ) -> None:
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        missing = sorted(set(adapters) - set(adapter_settings))
        if missing:
            raise LearnerError(f"no optimiser settings for adapters {missing}")
        self.adapters = list(adapters)
        self.settings = {
            a: replace(
                s,
                temperature=s.temperature if s.temperature is not None else temperature,
                kl_coef=s.kl_coef if s.kl_coef is not None else kl_coef,
                micro_batch_rows=s.micro_batch_rows if s.micro_batch_rows is not None else micro_batch_rows,
            )
            for a, s in adapter_settings.items()
        }
        self.any_kl = any(self.settings[a].kl_coef > 0 for a in self.adapters)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # this host's GPU index (0 in a one-GPU pod)
        self.device = torch.device("cpu") if device == "cpu" else torch.device("cuda", local_rank)
        self.micro_batch_rows = micro_batch_rows
        self.temperature = temperature
        self.algorithm = algorithm
        self.reward_source = reward_source
        self.objective = objective
        self.tis_cap = tis_cap
        self.tis_mode = tis_mode
        self.tis_level = tis_level
        self.singleton_advantage = singleton_advantage
        self.happo_factor = happo_factor
        self.kl_coef = kl_coef
        self.kl_estimator = kl_estimator
        self.loss_agg = loss_agg
        self.logprob_tolerance = logprob_tolerance
        self.update_order = update_order
        self.order = order
        self.epochs = epochs
        self.seed = seed
        self.model_dir = str(model_dir)
        if objective not in ("decoupled", "ppo", "ppo-critic"):
            raise LearnerError(f"unknown objective {objective!r}; expected decoupled, ppo or ppo-critic")
        if critic_level not in ("action", "token"):
            raise LearnerError(f"unknown critic_level {critic_level!r}; expected 'action' or 'token'")
        if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
            raise LearnerError(f"gamma and lam must lie in [0, 1], got gamma={gamma} lam={lam}")
        self.critic_level = critic_level
        self.gamma = gamma
        self.lam = lam
        self.token_gamma = token_gamma
        self.value_coef = value_coef
        self.value_clip = value_clip
        self.action_logprob_norm = action_logprob_norm
        self.whiten_advantages = whiten_advantages
        self.next_step = 0  # the step after the last one trained (restored by load_checkpoint)
        self.last_version = -1  # current_version of the last train_step
        self.updates = dict.fromkeys(self.adapters, 0)  # optimiser steps taken per adapter

        torch.manual_seed(seed)  # LoRA A init: the same on every rank and every fresh start
        if dtype == "auto":  # bf16 on a GPU (its tensor cores; fp32 weights would double memory), fp32 on CPU
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = dtype
        torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch_dtype)
        base.to(self.device)
        ranks = {name: (lora_ranks or {}).get(name, lora_rank) for name in self.adapters}

        def lora(name: str) -> LoraConfig:  # each adapter its own rank (the workflow's [adapters])
            return LoraConfig(
                r=ranks[name],
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                target_modules=list(target_modules),
                bias="none",
                task_type="CAUSAL_LM",
            )

        self.model = get_peft_model(base, lora(self.adapters[0]), adapter_name=self.adapters[0])
        for name in self.adapters[1:]:
            self.model.add_adapter(name, lora(name))
        self.model.to(self.device)
        self.params = {name: self._adapter_params(name) for name in self.adapters}
        self.engines: dict[str, Any] = {}
        for name in self.adapters:
            self._trainable(name)
            opt = torch.optim.AdamW(
                self.params[name], lr=self.settings[name].lr, weight_decay=weight_decay, betas=(0.9, 0.999)
            )
            ds_config = {
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": grad_clip,
                "zero_optimization": {"stage": zero_stage},
                "zero_allow_untested_optimizer": True,
                "bf16": {"enabled": dtype == "bfloat16"},
                "steps_per_print": 2**31 - 1,
                "wall_clock_breakdown": False,
            }
            eng, _, _, _ = deepspeed.initialize(
                model=self.model, optimizer=opt, config=ds_config, dist_init_required=False
            )
            _fuse_grad_checks(eng.optimizer)
            self.engines[name] = eng
        self._trainable(None)
        self.critic: Any = None  # the value head's DeepSpeed engine (objective "ppo-critic" only)
        if objective == "ppo-critic":
            head = ValueHead(int(base.config.hidden_size), critic_hidden).to(self.device)
            critic_opt = torch.optim.AdamW(
                head.parameters(), lr=critic_lr, weight_decay=weight_decay, betas=(0.9, 0.999)
            )
            critic_config = dict(ds_config, bf16={"enabled": False})  # the head stays float32
            self.critic, _, _, _ = deepspeed.initialize(
                model=head, optimizer=critic_opt, config=critic_config, dist_init_required=False
            )

    # --- parameters ---------------------------------------------------------------------------

    def _adapter_params(self, name: str) -> list[torch.nn.Parameter]:
        tag = f".{name}."
        params = [p for n, p in self.model.named_parameters() if "lora_" in n and tag in n]
        if not params:
            raise LearnerError(f"adapter {name!r} has no LoRA parameters (target modules not found?)")
        return params

    def _trainable(self, name: str | None) -> None:
        """Only adapter ``name``'s LoRA params require grad (None: nothing does)."""
        for n, ps in self.params.items():
            for p in ps:
                p.requires_grad_(n == name)

    def adapter_state(self, name: str) -> dict[str, Tensor]:
        """Copies of one adapter's parameters (for tests and parity checks)."""
        tag = f".{name}."
        return {n: p.detach().clone() for n, p in self.model.named_parameters() if "lora_" in n and tag in n}

    # --- forward passes -----------------------------------------------------------------------

    def _token_logp(self, batch: RowBatch, idx: Tensor, adapter: str | None, grad: bool) -> Tensor:
        """Response-token log-probs [n, R] of rows ``idx`` under ``adapter`` (None: the base model).

        Right-padded rows with position ids 0..L-1; only the response positions' logits are used. No
        attention mask is passed: with right padding, causal attention alone keeps every valid position
        from seeing a pad (pads only follow), and the mask-free call takes the faster causal attention
        path (measured ~5% of a CPU update step; tests/bench/learner.py).

        Logits are computed only from the first response position of the chunk on
        (``logits_to_keep``): the prompt positions' logits were never used, and the LM head over the
        vocabulary is the largest matrix product of a small model. With ``grad`` the result stays on
        the device (the loss is computed there); without, it is returned on the CPU.
        """
        big_l = int((batch.prompt_lens[idx] + batch.resp_lens[idx]).max())
        first = int(batch.prompt_lens[idx].min()) - 1  # the earliest position whose logits are used
        keep = big_l - first  # logits of positions first .. big_l - 1
        ids = batch.input_ids[idx, :big_l].to(self.device)
        pos = torch.arange(big_l, device=self.device).expand(len(idx), -1)
        resp = batch.response_ids[idx].to(self.device)
        big_r = resp.shape[1]
        gather = (batch.prompt_lens[idx, None] - 1 - first + torch.arange(big_r)[None, :]).clamp(max=keep - 1)
        gather = gather.to(self.device)
        ctx: contextlib.AbstractContextManager[Any]
        if adapter is None:
            ctx = self.model.disable_adapter()
        else:
            self.model.set_adapter(adapter)
            self._trainable(adapter if grad else None)
            ctx = contextlib.nullcontext()
        call = self.engines[adapter] if (grad and adapter is not None) else self.model
        with ctx, torch.set_grad_enabled(grad):
            logits = call(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
            vocab = logits.shape[-1]
            sel = logits.gather(1, gather[..., None].expand(-1, -1, vocab)).float()
            sel = self._at_temperature(sel, batch, idx, adapter)
            logp = torch.log_softmax(sel, dim=-1).gather(-1, resp[..., None]).squeeze(-1)
        return logp.cpu() if (self.device.type != "cpu" and not grad) else logp

    @torch.no_grad()
    def _base_pass(self, batch: RowBatch, idx: Tensor, want_logp: bool) -> tuple[Tensor, Tensor | None]:
        """Critic features of rows ``idx`` from the base (adapters disabled), in one no-grad pass.

        Returns (features, ref_logp): features [n, H] (hidden state at ``prompt_len − 1``, action level)
        or [n, R, H] (at ``prompt_len − 1 + j``, token level), float32 on CPU; ref_logp [n, R] (the KL
        reference, 0 on padding) when ``want_logp``, else None. The backbone is called directly so
        only the last hidden state is kept (``output_hidden_states`` would hold every layer's).
        """
        big_l = int((batch.prompt_lens[idx] + batch.resp_lens[idx]).max())
        ids = batch.input_ids[idx, :big_l].to(self.device)
        pos = torch.arange(big_l, device=self.device).expand(len(idx), -1)
        big_r = batch.response_ids.shape[1]
        gather = (batch.prompt_lens[idx, None] - 1 + torch.arange(big_r)[None, :]).clamp(max=big_l - 1)
        gather = gather.to(self.device)
        base = self.model.get_base_model()
        self.model.eval()
        with self.model.disable_adapter():
            # no attention mask: right-padded rows (see _token_logp)
            hidden = base.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            sel = hidden.gather(1, gather[..., None].expand(-1, -1, hidden.shape[-1]))  # [n, R, H]
            ref = None
            if want_logp:
                logits = self._at_temperature(base.get_output_embeddings()(sel).float(), batch, idx, None)
                resp = batch.response_ids[idx].to(self.device)
                ref = torch.log_softmax(logits, dim=-1).gather(-1, resp[..., None]).squeeze(-1)
                ref = ref.cpu() * batch.resp_mask[idx]
        feats = sel[:, 0] if self.critic_level == "action" else sel
        return feats.float().cpu(), ref

    def _at_temperature(self, logits: Tensor, batch: RowBatch, idx: Tensor, adapter: str | None) -> Tensor:
        """``logits`` [n, R, V] of rows ``idx`` divided by the temperature their tokens were sampled at:
        the adapter's under an adapter, each row's own under the base model (the KL reference of rows
        of several adapters). A full pass over the logits, skipped where every temperature is 1."""
        if adapter is not None:
            t = self.settings[adapter].temperature
            return logits / t if t != 1.0 else logits
        if batch.temps is None:
            return logits / self.temperature if self.temperature != 1.0 else logits
        temps = batch.temps[idx]
        if bool((temps == 1.0).all()):
            return logits
        return logits / temps.to(logits.device)[:, None, None]

    def _chunks(self, idx: Tensor, adapter: str | None = None) -> list[Tensor]:
        n = self.settings[adapter].micro_batch_rows if adapter is not None else self.micro_batch_rows
        return [idx[i : i + n] for i in range(0, len(idx), n)]

    def token_logprobs(self, batch: RowBatch, idx: Tensor, adapter: str | None) -> Tensor:
        """No-grad response-token log-probs [n, R] (0 on padding), in micro-batches."""
        self.model.eval()
        parts = [self._token_logp(batch, c, adapter, grad=False) for c in self._chunks(idx, adapter)]
        out = torch.cat(parts) if parts else torch.zeros((0, batch.response_ids.shape[1]))
        return out * batch.resp_mask[idx]

    @torch.no_grad()
    def sample(
        self,
        adapter: str | None,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_id: int,
        generator: torch.Generator,
    ) -> list[tuple[list[int], list[float]]]:
        """Sample completions (at the adapter's temperature; the engine-wide one for the base) and their
        log-probs, for self-tests.

        Prompts of one call must share a length (the addition task's do). Each completion stops after
        ``eos_id`` (included) or ``max_new_tokens``.
        """
        if len({len(p) for p in prompts}) != 1:
            raise LearnerError("sample() needs prompts of one length")
        self.model.eval()
        ctx = self.model.disable_adapter() if adapter is None else contextlib.nullcontext()
        if adapter is not None:
            self.model.set_adapter(adapter)
        ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
        out: list[tuple[list[int], list[float]]] = [([], []) for _ in prompts]
        done = [False] * len(prompts)
        temp = self.settings[adapter].temperature if adapter is not None else self.temperature
        with ctx:
            for _ in range(max_new_tokens):
                logits = (
                    self.model(input_ids=ids.to(self.device), use_cache=False).logits[:, -1].float().cpu()
                )
                logp = torch.log_softmax(logits / temp, dim=-1)
                tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
                for i, t in enumerate(tok.tolist()):
                    if not done[i]:
                        out[i][0].append(t)
                        out[i][1].append(float(logp[i, t]))
                        done[i] = t == eos_id
                if all(done):
                    break
                ids = torch.cat([ids, tok[:, None]], dim=1)
        return out

    @torch.no_grad()
    def completion_logprobs(
        self, adapter: str | None, prompt: Sequence[int], completion: Sequence[int]
    ) -> list[float]:
        """log p(completion[i] | prompt, completion[:i]) at temperature 1, float32 (the publish probe)."""
        self.model.eval()
        ctx = self.model.disable_adapter() if adapter is None else contextlib.nullcontext()
        if adapter is not None:
            self.model.set_adapter(adapter)
        ids = torch.tensor([list(prompt) + list(completion)], dtype=torch.long, device=self.device)
        with ctx:
            logits = self.model(input_ids=ids, use_cache=False).logits[0].float().cpu()
        logp = torch.log_softmax(logits, dim=-1)
        p = len(prompt)
        return [float(logp[p - 1 + j, t]) for j, t in enumerate(completion)]

    # --- the update ---------------------------------------------------------------------------

    def _order(self, step: int) -> list[int]:
        if self.order == "fixed":
            return list(range(len(self.adapters)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return random_order(len(self.adapters), g)

    def train_step(
        self,
        trajectories: Sequence[GraphTrajectory],
        step: int,
        current_version: int,
        fresh_version: int | None = None,
        weights: Sequence[float] | None = None,
    ) -> StepResult:
        """One update over a sample: advantages, objective, agent-by-agent (or simultaneous) steps.

        ``current_version``: the latest published version (for staleness). ``fresh_version``: rows of
        this version were sampled with exactly the weights the learner holds now (None: none are), and
        are the ones the behaviour/recompute log-prob check runs on.
        """
        t0 = time.perf_counter()
        batch, ignored = build_rows(trajectories, self.adapters, self.reward_source)
        if weights is not None and len(weights) > 0:  # SampleReply.weights, one per trajectory
            if len(weights) != len(trajectories):
                raise LearnerError(f"{len(weights)} sample weights for {len(trajectories)} trajectories")
            batch.row_weights = torch.tensor(list(weights), dtype=torch.float32)[batch.traj_idx]
        assert batch.turn_idx is not None
        batch.joint_idx, n_joint = joint_rows(batch.traj_idx, batch.turn_idx, batch.n_traj, self.happo_factor)
        batch.temps = torch.tensor(
            [
                self.settings[a].temperature if a in self.settings else self.temperature
                for a in batch.adapter_of_row
            ],
            dtype=torch.float32,
        )
        rows = {a: batch.rows_of(a) for a in self.adapters}
        prox: dict[str, Tensor] = {}
        ref: dict[str, Tensor] = {}
        stats: dict[str, dict[str, float]] = {}
        m: dict[str, float] = {}
        # adv_row [N]: one advantage per row (None at token level); adv_tok [N, R]: per response token
        adv_row: Tensor | None
        if self.critic is not None:
            adv_row, adv_tok = self._critic_advantages(batch, rows, ref, m)
        else:
            adv_row = row_advantages(batch, self.algorithm, self.singleton_advantage)
            adv_tok = broadcast_to_tokens(adv_row, batch.resp_mask)
            groups = advantage_groups(
                self.algorithm, batch.group_idx, batch.agent_idx, batch.traj_idx, batch.turn_idx
            )
            m["singleton_groups"] = float(singleton_group_count(*groups))
            for a in self.adapters:
                if self.settings[a].kl_coef > 0:
                    ref[a] = self.token_logprobs(batch, rows[a], None)
        counts = _all_reduce_max(
            [math.ceil(len(rows[a]) / self.settings[a].micro_batch_rows) for a in self.adapters]
        )
        # 0 = no rank has rows for this adapter: it is not stepped at all (AdamW would still move it)
        n_micro = dict(zip(self.adapters, counts, strict=True))

        def traj_sum(adapter: str, token_logp: Tensor) -> Tensor:  # per joint sample (happo_factor)
            idx = rows[adapter]
            assert batch.joint_idx is not None
            row_logp = (token_logp * batch.resp_mask[idx]).sum(-1).float()
            return joint_logprob(row_logp, batch.joint_idx[idx], n_joint)

        def logprob_fn(adapter: str) -> Tensor:
            cur = self.token_logprobs(batch, rows[adapter], adapter)
            prox.setdefault(adapter, cur)
            return traj_sum(adapter, cur)

        def step_fn(adapter: str, factor: Tensor) -> Mapping[str, float]:
            if n_micro[adapter] == 0:
                return dict.fromkeys(_STAT_KEYS, math.nan) | {
                    "tokens": 0.0,
                    "rejected_tokens": 0.0,
                    "lr": self.settings[adapter].lr,
                }
            self.updates[adapter] += 1
            return self._optimiser_step(
                batch, rows[adapter], adapter, adv_row, adv_tok, factor, prox, ref, n_micro[adapter]
            )

        order = self._order(step)
        result = sequential_update(
            self.adapters,
            order,
            logprob_fn,
            step_fn,
            epochs=self.epochs,
            mode=self.update_order,
            n_rows=n_joint,
        )
        self._trainable(None)
        for rec in result.records:
            last = dict(rec.step_stats[-1])
            stats[rec.agent] = last
            for k, v in last.items():
                m[f"{k}/{rec.agent}"] = v
            m[f"factor_mean/{rec.agent}"] = rec.factor_mean
        # behaviour vs recomputed log-probs on fresh rows (π_prox = the weights that sampled them)
        gap_sum, gap_n = 0.0, 0
        for a in self.adapters:
            idx = rows[a]
            if fresh_version is None or len(idx) == 0 or a not in prox:
                continue
            fresh = batch.versions[idx] == fresh_version
            mask = batch.resp_mask[idx] & fresh[:, None]
            diff = (prox[a] - batch.behav_logp[idx]).abs()
            gap_sum += float(diff[mask].sum())
            gap_n += int(mask.sum())
        gap = gap_sum / gap_n if gap_n else math.nan
        m["logprob_gap"] = gap
        m["logprob_gap_tokens"] = float(gap_n)
        if self.logprob_tolerance is not None and gap_n and gap > self.logprob_tolerance:
            raise LogprobMismatch(
                f"step {step}: mean |recomputed - behaviour| log-prob on {gap_n} fresh tokens is "
                f"{gap:.4f} > tolerance {self.logprob_tolerance} (padding / position ids / temperature "
                "differ between sampler and learner?)"
            )
        elapsed = time.perf_counter() - t0
        tokens = int((batch.prompt_lens + batch.resp_lens).sum())
        for agent in sorted(set(batch.agent_of_row)):
            sel = torch.tensor([x == agent for x in batch.agent_of_row])
            m[f"reward_mean/{agent}"] = float(batch.rewards[sel].mean())
            a_vals = adv_row[sel] if adv_row is not None else adv_tok[sel][batch.resp_mask[sel]]
            m[f"advantage_mean/{agent}"] = float(a_vals.mean())
            m[f"advantage_std/{agent}"] = float(a_vals.std(unbiased=False))
        m["reward_mean"] = float(np.mean(batch.team_rewards)) if batch.team_rewards else math.nan
        m["staleness_mean"] = float((current_version - batch.versions).float().mean())
        m["tokens"] = float(tokens)
        m["rows"] = float(batch.n_rows)
        m["step_time_s"] = elapsed
        m["tokens_per_s"] = tokens / elapsed if elapsed > 0 else math.nan
        self.next_step = step + 1
        self.last_version = current_version
        return StepResult(
            metrics=m,
            ignored=ignored,
            order=[self.adapters[i] for i in order],
            losses={a: s["loss"] for a, s in stats.items()},
        )

    def _critic_advantages(
        self, batch: RowBatch, rows: Mapping[str, Tensor], ref: dict[str, Tensor], m: dict[str, float]
    ) -> tuple[Tensor | None, Tensor]:
        """GAE advantages from the centralised critic, then the critic's own update (critic module).

        Returns (adv_row [N] at action level / None at token level, adv_tok [N, R]); fills ``ref`` with
        the KL reference log-probs of every adapter's rows (same base pass) and ``m`` with the critic
        metrics. Advantages are computed on the values *before* this step's critic update.
        """
        all_rows = torch.arange(batch.n_rows)
        parts = [self._base_pass(batch, c, self.any_kl) for c in self._chunks(all_rows)]
        feats = torch.cat([f for f, _ in parts])
        if self.any_kl:
            ref_all = torch.cat([r for _, r in parts if r is not None])
            for a in self.adapters:
                if self.settings[a].kl_coef > 0:
                    ref[a] = ref_all[rows[a]]
        token = self.critic_level == "token"
        vmask = batch.resp_mask if token else torch.ones(batch.n_rows, dtype=torch.bool)
        self.critic.eval()
        with torch.no_grad():
            v_old = torch.cat(
                [self.critic(feats[c].to(self.device)).float().cpu() for c in self._chunks(all_rows)]
            )
        v_old = v_old * vmask
        team = torch.tensor(batch.team_rewards) if self.reward_source == "trajectory" else None
        r = chain_rewards(batch.rewards, batch.traj_idx, team)
        if token:
            adv, ret = token_level_gae(
                r,
                v_old,
                batch.resp_mask,
                batch.traj_idx,
                batch.n_traj,
                self.gamma,
                self.lam,
                self.token_gamma,
            )
        else:
            adv, ret = action_level_gae(r, v_old, batch.traj_idx, batch.n_traj, self.gamma, self.lam)
        m["value_mean"] = float(v_old[vmask].mean())
        m["return_mean"] = float(ret[vmask].mean())
        m["explained_variance"] = explained_variance(v_old, ret, vmask)
        m.update(self._critic_update(feats, v_old, ret, vmask))
        if self.whiten_advantages and int(vmask.sum()) > 1:
            adv = masked_whiten(adv, vmask)
        if token:
            return None, adv * batch.resp_mask
        return adv, adv[:, None] * batch.resp_mask

    def _critic_update(self, feats: Tensor, v_old: Tensor, ret: Tensor, vmask: Tensor) -> dict[str, float]:
        """``epochs`` optimiser steps of the value head on the clipped value loss (masked mean)."""
        eng = self.critic
        chunks = self._chunks(torch.arange(feats.shape[0]))
        n_micro = _all_reduce_max([len(chunks)])[0]  # every rank issues the same collectives
        total = float(vmask.sum())
        eng.train()
        value_loss = 0.0
        for _ in range(self.epochs):
            value_loss = 0.0
            for j in range(n_micro):
                eng.set_gradient_accumulation_boundary(j == n_micro - 1)
                if j >= len(chunks):  # dummy micro-batch: zero gradient
                    eng.backward(eng(feats[:1].to(self.device)).sum() * 0.0)
                    continue
                c = chunks[j]
                v = eng(feats[c].to(self.device)).float().cpu()
                terms = clipped_value_loss(v, v_old[c], ret[c], vmask[c], clip_eps=self.value_clip)
                loss = terms.sum() / total
                eng.backward(self.value_coef * loss)
                value_loss += float(loss.detach())
            eng.step()
        gn = eng.get_global_grad_norm()
        return {"value_loss": value_loss, "critic_grad_norm": float(gn) if gn is not None else math.nan}

    def _optimiser_step(
        self,
        batch: RowBatch,
        idx: Tensor,
        adapter: str,
        adv_row: Tensor | None,
        adv_tok: Tensor,
        factor: Tensor,
        prox: dict[str, Tensor],
        ref: dict[str, Tensor],
        n_micro: int,
    ) -> dict[str, float]:
        """One optimiser step of ``adapter`` over its rows (gradient-accumulated micro-batches).

        The loss and the statistics are computed on the model's device, and the statistics are
        accumulated there as tensors and read back once at the end: a ``float()`` per statistic and
        micro-batch was a host/device synchronisation each (tests/bench/learner.py, README).
        Token counts come from the CPU copy of the mask, which needs no synchronisation.
        """
        eng = self.engines[adapter]
        s = self.settings[adapter]
        dev = self.device
        self.model.train()
        chunks = self._chunks(idx, adapter)
        mask_all = batch.resp_mask[idx]
        total_tokens = float(mask_all.sum())
        total_seqs = float((mask_all.sum(-1) > 0).sum())
        action_level = self.objective == "ppo-critic" and self.critic_level == "action"
        zero = torch.zeros((), dtype=torch.float32, device=dev)
        # running sums on the device: loss, kl·tokens, clipped, rejected, ratio sum, π_prox/μ sum
        acc = torch.zeros(6, dtype=torch.float32, device=dev)
        ratio_max, w_max = zero, zero
        tokens, units = 0.0, 0.0
        use_cached = adapter in prox
        factor_d = factor.to(dev)
        new_prox: list[Tensor] = []
        offset = 0
        for j in range(n_micro):
            eng.set_gradient_accumulation_boundary(j == n_micro - 1)
            if j >= len(chunks):  # dummy micro-batch: same collectives as the other ranks, zero gradient
                dummy = batch.input_ids.new_zeros((1, 2), device=dev)
                self.model.set_adapter(adapter)
                self._trainable(adapter)
                out = eng(input_ids=dummy, use_cache=False).logits
                eng.backward(out.sum() * 0.0)
                continue
            c = chunks[j]
            mask_cpu = batch.resp_mask[c]
            mask = mask_cpu.to(dev)
            logp = self._token_logp(batch, c, adapter, grad=True)
            if use_cached:
                p = prox[adapter][offset : offset + len(c)].to(dev)
            else:
                p = logp.detach() * mask
                new_prox.append(p)
            offset += len(c)
            f_row = factor_d[batch.joint_idx[c].to(dev)]
            behav = batch.behav_logp[c].to(dev)
            if action_level:
                # APPO: one ratio per action from length-normalised log-probs (docs/algorithms.md §6)
                assert adv_row is not None
                row_mask = mask.any(-1)
                terms = decoupled_ppo_loss(
                    action_logprob(logp, mask, self.action_logprob_norm),
                    action_logprob(p, mask, self.action_logprob_norm),
                    action_logprob(behav, mask, self.action_logprob_norm),
                    adv_row[c].to(dev) * f_row,
                    row_mask,
                    s.clip_low,
                    s.clip_high,
                    cap=self.tis_cap,
                    cap_mode=self.tis_mode,
                )
            elif self.objective in ("decoupled", "ppo-critic"):
                a_tok = adv_tok[c].to(dev) * f_row[:, None]
                terms = decoupled_ppo_loss(
                    logp,
                    p,
                    behav,
                    a_tok,
                    mask,
                    s.clip_low,
                    s.clip_high,
                    cap=self.tis_cap,
                    cap_mode=self.tis_mode,
                    level=self.tis_level,
                )
            else:
                a_tok = adv_tok[c].to(dev) * f_row[:, None]
                terms = ppo_clip_loss(logp, p, a_tok, mask, s.clip_low, s.clip_high)
            row_w = batch.row_weights[c].to(dev) if batch.row_weights is not None else None
            if row_w is not None:  # SampleReply.weights: each row's loss times its trajectory's weight
                terms = weight_rows(terms, row_w)
            # an action-level loss is a mean over actions; `unit` is what the ratio statistics count
            unit = row_mask if action_level else mask
            n_tok = float(mask_cpu.sum())
            n_unit = float(mask_cpu.any(-1).sum()) if action_level else n_tok
            loss = agg_loss(terms.loss, unit, "token-mean" if action_level else self.loss_agg)
            kl_term = zero
            if s.kl_coef > 0:
                kl_tok = kl_penalty(logp, ref[adapter][offset - len(c) : offset].to(dev), self.kl_estimator)
                if row_w is not None:
                    kl_tok = kl_tok * row_w[:, None]
                kl = agg_loss(kl_tok * mask, mask, self.loss_agg)
                loss = loss + s.kl_coef * kl
                kl_term = kl.detach() * n_tok
            share = (
                n_tok / total_tokens
                if self.loss_agg == "token-mean" and not action_level
                else float((mask_cpu.sum(-1) > 0).sum()) / total_seqs
            )
            eng.backward(loss * share)
            if action_level:  # π_prox/μ before the cap, per action or per token
                behav_w = torch.exp(
                    (
                        action_logprob(p, mask, self.action_logprob_norm)
                        - action_logprob(behav, mask, self.action_logprob_norm)
                    ).clamp(-20, 20)
                )
            else:
                behav_w = torch.exp((p - behav).clamp(-20, 20))
            ratio = terms.ratio.detach()
            acc += torch.stack(
                [
                    loss.detach() * share,
                    kl_term,
                    terms.clipped.sum(dtype=torch.float32),
                    terms.rejected.sum(dtype=torch.float32),
                    torch.where(unit, ratio, zero).sum(),
                    torch.where(unit, behav_w, zero).sum(),
                ]
            )
            # maxima over the counted units (ratios and weights are positive: 0 stands for "none")
            ratio_max = torch.maximum(ratio_max, torch.where(unit, ratio, zero).max())
            w_max = torch.maximum(w_max, torch.where(unit, behav_w, zero).max())
            tokens += n_tok
            units += n_unit
        eng.step()
        if new_prox:
            prox[adapter] = torch.cat(new_prox).cpu()
        self._trainable(None)
        gn = eng.get_global_grad_norm()
        loss_sum, kl_sum, clipped, rejected, ratio_sum, w_sum, r_max, wmax = torch.cat(
            [acc, torch.stack([ratio_max, w_max])]
        ).tolist()  # the one read-back of this step's statistics
        ntok = max(tokens, 1.0)
        nunit = max(units, 1.0)
        return {
            "loss": loss_sum,
            "grad_norm": float(gn) if gn is not None else math.nan,
            "clip_frac": clipped / nunit,
            "kl": kl_sum / ntok,
            "ratio_mean": ratio_sum / nunit,
            "ratio_max": r_max,
            "is_weight_mean": w_sum / nunit,
            "is_weight_max": wmax,
            "rejected_tokens": rejected,
            "tokens": tokens,
            "lr": s.lr,
        }

    # --- export and checkpoint ----------------------------------------------------------------

    def export_adapters(self, folder: str | Path) -> dict[str, Path]:
        """Write every adapter in PEFT format (``folder/<name>/adapter_config.json`` + safetensors)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        out: dict[str, Path] = {}
        for name in self.adapters:
            # PEFT writes a non-"default" adapter into a subfolder named after it
            self.model.save_pretrained(str(folder), selected_adapters=[name], safe_serialization=True)
            out[name] = folder / name
            if not (out[name] / "adapter_model.safetensors").is_file():
                raise LearnerError(f"PEFT did not write {out[name]}/adapter_model.safetensors")
        return out

    def save_checkpoint(
        self,
        folder: str | Path,
        *,
        versions: Mapping[str, int] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Every rank: each adapter engine's DeepSpeed checkpoint (adapter params + ZeRO optimiser
        partitions; the frozen base is excluded), the critic's, and this rank's RNG states; rank 0
        then writes ``engine_state.json`` (step, adapter versions, optimiser step counts, ``extra``).

        ``versions``: the published version of each adapter (default: every adapter at the
        ``current_version`` of the last :meth:`train_step`). ``engine_state.json`` is written last and
        atomically, so a folder without it is an incomplete checkpoint that :meth:`load_checkpoint`
        refuses. ``extra`` must be JSON-serialisable (e.g. the caller's counters).
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        rank, _ = _world()
        for name, eng in self.engines.items():
            self._trainable(name)  # exclude_frozen_parameters keeps only this adapter's weights
            eng.save_checkpoint(
                str(folder / "ds"), tag=name, save_latest=False, exclude_frozen_parameters=True
            )
        self._trainable(None)
        if self.critic is not None:
            self.critic.save_checkpoint(str(folder / "ds"), tag=_CRITIC_TAG, save_latest=False)
        torch.save(
            {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            folder / f"rng_rank{rank}.pt",
        )
        _barrier()  # every rank's files exist before the completion marker does
        if rank == 0:
            state = {
                "format": _CHECKPOINT_FORMAT,
                "next_step": self.next_step,
                "adapter_versions": dict(versions)
                if versions is not None
                else dict.fromkeys(self.adapters, self.last_version),
                "adapter_updates": dict(self.updates),
                "adapters": list(self.adapters),
                "objective": self.objective,
                "critic_level": self.critic_level if self.critic is not None else None,
                "extra": dict(extra or {}),
            }
            tmp = folder / f".{_STATE_FILE}.tmp"
            tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
            os.replace(tmp, folder / _STATE_FILE)
        _barrier()

    def load_checkpoint(self, folder: str | Path) -> EngineState:
        """Every rank: restore what :meth:`save_checkpoint` wrote (raises LearnerError if incomplete or
        written for other adapters / another objective); returns the saved :class:`EngineState`."""
        folder = Path(folder)
        rank, _ = _world()
        state_file = folder / _STATE_FILE
        if not state_file.is_file():
            raise LearnerError(f"checkpoint {folder} is incomplete: {_STATE_FILE} is missing")
        try:
            raw = json.loads(state_file.read_text())
        except json.JSONDecodeError as e:
            raise LearnerError(f"checkpoint {folder}: {_STATE_FILE} is not valid JSON: {e}") from None
        if raw.get("format") != _CHECKPOINT_FORMAT:
            raise LearnerError(
                f"checkpoint {folder} has format {raw.get('format')!r}, expected {_CHECKPOINT_FORMAT}"
            )
        if sorted(raw["adapters"]) != sorted(self.adapters):
            raise LearnerError(
                f"checkpoint {folder} holds adapters {raw['adapters']}, this learner trains {self.adapters}"
            )
        if (raw["critic_level"] is not None) != (self.critic is not None):
            raise LearnerError(
                f"checkpoint {folder} was written with objective {raw['objective']!r}, this learner uses "
                f"{self.objective!r} (the critic state cannot be created or dropped on resume)"
            )
        for name, eng in self.engines.items():
            self._trainable(name)
            path, _ = eng.load_checkpoint(str(folder / "ds"), tag=name, load_module_strict=False)
            if path is None:
                raise LearnerError(f"checkpoint {folder} has no DeepSpeed state for adapter {name!r}")
        self._trainable(None)
        if self.critic is not None:
            path, _ = self.critic.load_checkpoint(str(folder / "ds"), tag=_CRITIC_TAG)
            if path is None:
                raise LearnerError(f"checkpoint {folder} has no DeepSpeed state for the critic")
        rng_file = folder / f"rng_rank{rank}.pt"
        if not rng_file.is_file():
            raise LearnerError(f"checkpoint {folder} lacks {rng_file.name}")
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        versions = {str(k): int(v) for k, v in raw["adapter_versions"].items()}
        self.next_step = int(raw["next_step"])
        self.last_version = max(versions.values(), default=-1)
        self.updates = {a: int(raw["adapter_updates"].get(a, 0)) for a in self.adapters}
        return EngineState(
            next_step=self.next_step,
            adapter_versions=versions,
            adapter_updates=dict(self.updates),
            extra=dict(raw.get("extra") or {}),
        )


_CHECKPOINT_FORMAT = 1
_STATE_FILE = "engine_state.json"
_CRITIC_TAG = "critic"


def _fuse_grad_checks(opt: Any) -> None:
    """Give a ZeRO-1/2 optimiser one fused pass for its overflow check and one for its grad norm.

    DeepSpeed's ``DeepSpeedZeroOptimizer`` checks every gradient tensor for inf/NaN one at a time
    (``amax``, ``amin``, two ``isfinite``, ...: about six kernels per LoRA tensor, ~1,150 launches
    per step for r 8 on q/k/v/o of a 24-layer model) and takes the grad norm the same way (a float64
    copy and a norm per tensor). Both become one ``torch._foreach_norm`` over all gradients here:
    a float64 norm is non-finite exactly when some gradient element is, and the global norm, its
    all-reduce and the NaN masking are DeepSpeed's own. Optimisers of any other shape (CPU offload,
    ZeRO-3, model or pipeline parallel parameters, a DeepSpeed without these methods) are left as
    they are; so is an optimiser whose fused call fails (the original method runs instead).
    """
    needed = (
        "averaged_gradients",
        "bit16_groups",
        "get_grad_norm_direct",
        "has_overflow_partitioned_grads_serial",
    )
    if not all(hasattr(opt, a) for a in needed) or getattr(opt, "cpu_offload", True):
        return
    if getattr(opt, "model_parallel_rank", 0) != 0 or getattr(opt, "has_moe_layers", False):
        return
    params = [p for group in getattr(opt, "params_in_partition", []) for p in group]
    if any(hasattr(p, "ds_pipe_replicated") or getattr(p, "model_parallel", False) for p in params):
        return
    from deepspeed import comm as ds_dist
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    norm_direct, overflow_serial = opt.get_grad_norm_direct, opt.has_overflow_partitioned_grads_serial

    def norms(grads: list[Tensor]) -> Tensor:
        return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64))

    def fused_norm(gradients: list[Tensor], params: list[Any], norm_type: float = 2) -> Tensor:
        grads = [g for g in gradients if not getattr(g, "_zero_padding", False)]
        if float(norm_type) != 2.0 or not grads:
            return norm_direct(gradients, params, norm_type)
        try:
            total = norms(grads).pow(2).sum().float()
        except (RuntimeError, TypeError):
            return norm_direct(gradients, params, norm_type)
        ds_dist.all_reduce(total, op=ds_dist.ReduceOp.SUM, group=opt.dp_process_group)
        opt._model_parallel_all_reduce(tensor=total, op=ds_dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    def fused_overflow() -> Tensor:
        grads = [g for i in range(len(opt.bit16_groups)) for g in opt.averaged_gradients[i] if g is not None]
        if not grads:
            return overflow_serial()
        try:
            return norms(grads).sum().isfinite().logical_not().reshape(1)
        except (RuntimeError, TypeError):
            return overflow_serial()

    opt.get_grad_norm_direct = fused_norm
    opt.has_overflow_partitioned_grads_serial = fused_overflow


def iter_adapter_params(engine: LearnerEngine) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every LoRA parameter of every adapter."""
    for n, p in engine.model.named_parameters():
        if "lora_" in n:
            yield n, p
