"""The learner engine's settings: frozen dataclasses, one per concern (docs/architecture.md §7).

:class:`teamrl.learner.engine.LearnerEngine` is built from one :class:`EngineSettings` (plus the model
folder, the adapter names and the device). A learner process gets it from its config
(:meth:`teamrl.learner.config.LearnerConfig.engine_settings`); a test or a benchmark gets it from
keywords (:meth:`EngineSettings.from_kwargs`, which ``LearnerEngine.build`` uses), so an engine needs no
config file. What each setting means is documented once, on the config's field of the same name
(docs/algorithms.md for the algorithms behind them).

Design decisions:

* **Grouped by the part of the engine that reads them**: :class:`ModelSettings` (the PEFT model,
  ``model.py``), :class:`ObjectiveSettings` (advantages, the policy loss and the log-prob check),
  :class:`CriticSettings` (the value head and GAE of ``objective="ppo-critic"``, ``critic_step.py``),
  :class:`OptimSettings` (the DeepSpeed engines and the agent-by-agent update).
* **Frozen**: the LoRA shapes, DeepSpeed configs and optimisers are built from these once, so a setting
  cannot change under a running engine; a variant is a new object (:meth:`EngineSettings.replace`).
* **A setting's keyword is its field name**: the names are unique across the groups (and equal to
  the config's, except the LoRA shape, which the config keeps in its ``[lora]`` table), so
  :meth:`EngineSettings.from_kwargs` and :meth:`EngineSettings.kwargs` need no table of names: each
  setting is written once, as a field with its default.
* **Per-adapter settings** (:class:`AdapterSettings`, Dr. MAS's per-agent configuration): ``None`` in
  temperature, KL coefficient or micro-batch size takes the engine-wide value
  (:meth:`EngineSettings.resolved`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from teamrl.learner.errors import LearnerError

__all__ = [
    "AdapterSettings",
    "ModelSettings",
    "ObjectiveSettings",
    "CriticSettings",
    "OptimSettings",
    "EngineSettings",
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


@dataclass(frozen=True)
class ModelSettings:
    """The trained model: one PEFT LoRA per adapter on the shared frozen base, and the model's dtype.

    ``lora_ranks``: per-adapter ranks (the workflow's ``[adapters]``); others get ``lora_rank``.
    ``dtype="auto"``: bfloat16 on a GPU (its tensor cores; float32 weights would double memory),
    float32 on the CPU.
    """

    lora_rank: int = 8
    lora_ranks: Mapping[str, int] = field(default_factory=dict)
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj")
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"

    def rank_of(self, adapter: str) -> int:
        return self.lora_ranks.get(adapter, self.lora_rank)


@dataclass(frozen=True)
class ObjectiveSettings:
    """What a step optimises: the outcome advantage, the policy loss and its off-policy weights
    (docs/algorithms.md §1-§3), the KL term, and the check that recomputed log-probs match the
    sampler's. ``temperature`` and ``kl_coef`` are the engine-wide values of adapters without their own."""

    algorithm: Literal["grpo", "drmas", "dr_grpo", "at_grpo", "grpo_trajectory"] = "drmas"
    singleton_advantage: Literal["batch", "zero", "raw"] = "batch"
    reward_source: Literal["step", "trajectory"] = "step"
    objective: Literal["decoupled", "ppo", "ppo-behaviour", "ppo-critic"] = "decoupled"
    temperature: float = 1.0
    tis_cap: float | None = 2.0
    tis_mode: Literal["clamp", "mask"] = "clamp"
    tis_level: Literal["token", "sequence"] = "token"
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    action_logprob_norm: Literal["token", "sum"] = "token"
    logprob_tolerance: float | None = 0.05

    def __post_init__(self) -> None:
        if self.objective not in ("decoupled", "ppo", "ppo-behaviour", "ppo-critic"):
            raise LearnerError(
                f"unknown objective {self.objective!r}; expected decoupled, ppo, ppo-behaviour or ppo-critic"
            )


@dataclass(frozen=True)
class CriticSettings:
    """The centralised critic of ``objective="ppo-critic"`` (docs/algorithms.md §6,
    :mod:`teamrl.learner.critic`): GAE level and discounts, the value head and its loss."""

    critic_level: Literal["action", "token"] = "action"
    gamma: float = 0.99
    lam: float = 0.95
    token_gamma: float | None = None
    value_coef: float = 1.0
    critic_lr: float = 5e-4
    value_clip: float | None = 0.2
    critic_hidden: int = 256
    whiten_advantages: bool = True

    def __post_init__(self) -> None:
        if self.critic_level not in ("action", "token"):
            raise LearnerError(f"unknown critic_level {self.critic_level!r}; expected 'action' or 'token'")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise LearnerError(f"gamma and lam must lie in [0, 1], got gamma={self.gamma} lam={self.lam}")


@dataclass(frozen=True)
class OptimSettings:
    """How the update runs: the DeepSpeed engines (ZeRO stage, AdamW weight decay, grad clip), the
    engine-wide micro-batch size, the agent-by-agent order (docs/algorithms.md §4), the epochs, and
    the seed of the LoRA initialisation and of the update order."""

    update_order: Literal["sequential", "simultaneous"] = "sequential"
    happo_factor: Literal["turn", "trajectory"] = "turn"
    order: Literal["random", "fixed"] = "random"
    epochs: int = 1
    micro_batch_rows: int = 64
    micro_batch_tokens: int = 4096
    zero_stage: int = 2
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class EngineSettings:
    """Everything a :class:`teamrl.learner.engine.LearnerEngine` is built from but the model folder,
    the adapter names and the device."""

    adapter_settings: Mapping[str, AdapterSettings]
    model: ModelSettings = field(default_factory=ModelSettings)
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)
    critic: CriticSettings = field(default_factory=CriticSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)

    @classmethod
    def from_kwargs(cls, adapter_settings: Mapping[str, AdapterSettings], **kwargs: Any) -> EngineSettings:
        """Settings from flat keywords (``lora_rank=4, objective="ppo", epochs=2``); a keyword names
        one field of one group, omitted ones keep their defaults. Raises TypeError on an unknown one."""
        rest = dict(kwargs)
        groups = {}
        for name, group_cls in _groups():
            own = {g.name for g in fields(group_cls)} & rest.keys()
            groups[name] = group_cls(**{k: rest.pop(k) for k in own})
        if rest:
            raise TypeError(f"unknown engine settings {sorted(rest)}")
        return cls(adapter_settings=dict(adapter_settings), **groups)

    @classmethod
    def names(cls) -> list[str]:
        """Every setting's flat keyword (all but ``adapter_settings``)."""
        return [g.name for _, group_cls in _groups() for g in fields(group_cls)]

    def kwargs(self) -> dict[str, Any]:
        """The flat keywords :meth:`from_kwargs` turns back into these settings."""
        out: dict[str, Any] = {"adapter_settings": dict(self.adapter_settings)}
        for name, _ in _groups():
            group = getattr(self, name)
            out.update({g.name: getattr(group, g.name) for g in fields(group)})
        return out

    def replace(self, **kwargs: Any) -> EngineSettings:
        """These settings with some flat keywords changed (``settings.replace(epochs=2)``)."""
        return EngineSettings.from_kwargs(**(self.kwargs() | kwargs))

    def resolved(self, adapters: Sequence[str]) -> dict[str, AdapterSettings]:
        """Each adapter's settings with the engine-wide values filled in where it has none."""
        missing = sorted(set(adapters) - set(self.adapter_settings))
        if missing:
            raise LearnerError(f"no optimiser settings for adapters {missing}")

        def own(value: Any, default: Any) -> Any:
            return value if value is not None else default

        return {
            a: replace(
                s,
                temperature=own(s.temperature, self.objective.temperature),
                kl_coef=own(s.kl_coef, self.objective.kl_coef),
                micro_batch_rows=own(s.micro_batch_rows, self.optim.micro_batch_rows),
            )
            for a, s in self.adapter_settings.items()
            if a in adapters
        }


def _groups() -> list[tuple[str, Any]]:
    """(field name, class) of each settings group of :class:`EngineSettings` (its default factory)."""
    return [(f.name, f.default_factory) for f in fields(EngineSettings) if f.name != "adapter_settings"]
