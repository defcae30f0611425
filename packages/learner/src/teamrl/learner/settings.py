"""The learner engine's settings: frozen dataclasses, one per concern (docs/architecture.md §7).

:class:`teamrl.learner.engine.LearnerEngine` is built from one :class:`EngineSettings` (plus the model
folder, the adapter names and the device). A learner process gets it from its config
(:meth:`EngineSettings.from_config`); a test or a benchmark gets it from keywords
(:meth:`EngineSettings.from_kwargs`, which ``LearnerEngine.build`` uses), so an engine needs no
config file. What each setting means is documented once, on the config's field of the same name
(docs/algorithms.md for the algorithms behind them), and its default is written there alone.

Design decisions:

* **Grouped by the part of the engine that reads them**: :class:`ModelSettings` (the PEFT model,
  ``model.py``), :class:`ObjectiveSettings` (advantages, the policy loss and the log-prob check),
  :class:`CriticSettings` (the value head and GAE of ``objective="ppo-critic"``, ``critic_step.py``),
  :class:`OptimSettings` (the DeepSpeed engines and the agent-by-agent update).
* **Frozen**: the LoRA shapes, DeepSpeed configs and optimisers are built from these once, so a setting
  cannot change under a running engine; a variant is a new object (:meth:`EngineSettings.replace`).
* **A setting's keyword is its field name**: the names are unique across the groups (and equal to
  the config's, except the LoRA shape, which the config keeps in its ``[lora]`` table), so
  :meth:`EngineSettings.from_kwargs` and :meth:`EngineSettings.kwargs` need no table of names.
* **The config is the one source of every default**: a field here takes its default from the config
  field it mirrors (:func:`config_default`), never a value of its own, so a learner process and an
  engine built from keywords start from the same values (``tests/unit/learner/test_one_source.py``
  fails on a default written here). The config documents each setting; the type here repeats the
  config's (that test compares their choices).
* **Per-adapter settings** (:class:`AdapterSettings`, Dr. MAS's per-agent configuration): ``None`` in
  temperature, KL coefficient or micro-batch size takes the engine-wide value
  (:meth:`EngineSettings.resolved`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from pydantic import BaseModel

from teamrl.learner.config import AgentOverrides, LearnerConfig, LoraSettings
from teamrl.learner.errors import LearnerError

__all__ = [
    "config_default",
    "AdapterSettings",
    "ModelSettings",
    "ObjectiveSettings",
    "CriticSettings",
    "OptimSettings",
    "EngineSettings",
]


def config_default(name: str, model: type[BaseModel] = LearnerConfig) -> Any:
    """The default of the config field ``name`` of ``model`` (:class:`LearnerConfig` unless named):
    the only place a setting's default is written (module docstring)."""
    return model.model_fields[name].get_default(call_default_factory=True)


@dataclass(frozen=True)
class AdapterSettings:
    """Settings of one adapter (resolved from the config's per-agent overrides, Dr. MAS): its
    optimiser (lr, clip range), the temperature its agents sample at (its log-probs use logits / T), its
    KL coefficient and micro-batch size, and the tokens its agents choose among (``allowed_token_ids``:
    its log-probs are normalised over them). ``None`` takes the engine-wide value (for the choices: the
    whole vocabulary)."""

    lr: float
    clip_low: float
    clip_high: float
    temperature: float | None = config_default("temperature", AgentOverrides)
    kl_coef: float | None = config_default("kl_coef", AgentOverrides)
    micro_batch_rows: int | None = config_default("micro_batch_rows", AgentOverrides)
    allowed_token_ids: tuple[int, ...] | None = config_default("allowed_token_ids", AgentOverrides)


@dataclass(frozen=True)
class ModelSettings:
    """The trained model: one PEFT LoRA per adapter on the shared frozen base, and the model's dtype.

    ``lora_ranks``: per-adapter ranks (the workflow's ``[adapters]``); others get ``lora_rank``.
    ``dtype="auto"``: bfloat16 on a GPU (its tensor cores; float32 weights would double memory),
    float32 on the CPU.
    """

    lora_rank: int = config_default("rank", LoraSettings)
    lora_ranks: Mapping[str, int] = field(default_factory=dict)  # from the config's agents.<a>.rank
    lora_alpha: float = config_default("alpha", LoraSettings)
    lora_dropout: float = config_default("dropout", LoraSettings)
    target_modules: Sequence[str] = tuple(config_default("target_modules", LoraSettings))
    dtype: Literal["auto", "float32", "bfloat16"] = config_default("dtype")

    def rank_of(self, adapter: str) -> int:
        return self.lora_ranks.get(adapter, self.lora_rank)


@dataclass(frozen=True)
class ObjectiveSettings:
    """What a step optimises: the outcome advantage, the policy loss and its off-policy weights
    (docs/algorithms.md §1-§3), the KL term, and the check that recomputed log-probs match the
    sampler's. ``temperature`` and ``kl_coef`` are the engine-wide values of adapters without their own."""

    algorithm: Literal["grpo", "drmas", "dr_grpo", "at_grpo", "grpo_trajectory"] = config_default("algorithm")
    singleton_advantage: Literal["batch", "zero", "raw"] = config_default("singleton_advantage")
    advantage_std: bool = config_default("advantage_std")
    reward_source: Literal["step", "trajectory"] = config_default("reward_source")
    objective: Literal["decoupled", "ppo", "ppo-behaviour", "ppo-critic"] = config_default("objective")
    temperature: float = config_default("temperature")
    tis_cap: float | None = config_default("tis_cap")
    tis_mode: Literal["clamp", "mask"] = config_default("tis_mode")
    tis_level: Literal["token", "sequence"] = config_default("tis_level")
    kl_coef: float = config_default("kl_coef")
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = config_default("kl_estimator")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = config_default("loss_agg")
    action_logprob_norm: Literal["token", "sum"] = config_default("action_logprob_norm")
    logprob_tolerance: float | None = config_default("logprob_tolerance")
    logprob_min_tokens: int = config_default("logprob_min_tokens")

    def __post_init__(self) -> None:
        if self.objective not in ("decoupled", "ppo", "ppo-behaviour", "ppo-critic"):
            raise LearnerError(
                f"unknown objective {self.objective!r}; expected decoupled, ppo, ppo-behaviour or ppo-critic"
            )


@dataclass(frozen=True)
class CriticSettings:
    """The centralised critic of ``objective="ppo-critic"`` (docs/algorithms.md §6,
    :mod:`teamrl.learner.critic`): GAE level and discounts, the value head and its loss."""

    critic_level: Literal["action", "token"] = config_default("critic_level")
    gamma: float = config_default("gamma")
    lam: float = config_default("lam")
    token_gamma: float | None = config_default("token_gamma")
    value_coef: float = config_default("value_coef")
    critic_lr: float = config_default("critic_lr")
    value_clip: float | None = config_default("value_clip")
    critic_hidden: int = config_default("critic_hidden")
    whiten_advantages: bool = config_default("whiten_advantages")

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

    update_order: Literal["sequential", "simultaneous"] = config_default("update_order")
    happo_factor: Literal["turn", "trajectory"] = config_default("happo_factor")
    happo_factor_clip: float | None = config_default("happo_factor_clip")
    order: Literal["random", "fixed"] = config_default("order")
    epochs: int = config_default("epochs")
    micro_batch_rows: int = config_default("micro_batch_rows")
    micro_batch_tokens: int = config_default("micro_batch_tokens")
    zero_stage: Literal[0, 1, 2] = config_default("zero_stage")
    weight_decay: float = config_default("weight_decay")
    grad_clip: float = config_default("grad_clip")
    seed: int = config_default("seed")


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
    def from_config(cls, cfg: LearnerConfig) -> EngineSettings:
        """The settings of a learner process: each adapter's resolved from its override
        (:meth:`LearnerConfig.adapter_settings`), the LoRA shape from ``lora`` and the per-adapter
        ranks, and every other setting from the config's field of the same name."""
        same_name = {k: getattr(cfg, k) for k in cls.names() if k not in _LORA_SETTINGS}
        return cls.from_kwargs(
            {a: AdapterSettings(**cfg.adapter_settings(a)) for a in cfg.adapters},
            lora_rank=cfg.lora.rank,
            lora_ranks={
                a: cfg.agents[a].rank for a in cfg.adapters if a in cfg.agents and cfg.agents[a].rank
            },
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=tuple(cfg.lora.target_modules),
            **same_name,
        )

    @classmethod
    def config_kwargs(cls, cfg: LearnerConfig) -> dict[str, Any]:
        """:meth:`from_config` as flat keywords (those of ``LearnerEngine.build``) and the adapters."""
        return {"adapters": list(cfg.adapters), **cls.from_config(cfg).kwargs()}

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


# the settings the config holds under other names: the LoRA shape (``lora``, ``agents.<a>.rank``)
_LORA_SETTINGS = ("lora_rank", "lora_ranks", "lora_alpha", "lora_dropout", "target_modules")


def _groups() -> list[tuple[str, Any]]:
    """(field name, class) of each settings group of :class:`EngineSettings` (its default factory)."""
    return [(f.name, f.default_factory) for f in fields(EngineSettings) if f.name != "adapter_settings"]
