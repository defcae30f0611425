"""``LearnerConfig``: every knob of a learner process, documented field by field.

Design: a pydantic model read from TOML (the ``[learner]`` section, or the
whole file when it has none); validators only *check* that values agree and raise, they never copy a
value from one field to another (a silent copy hides which value is in force).
:meth:`teamrl.learner.settings.EngineSettings.from_config` turns the config into the frozen settings of
:class:`teamrl.learner.engine.LearnerEngine` (:mod:`teamrl.learner.settings`), which never sees this
class, so a test builds an engine without a config file. This config is the one source of every
setting: a setting keeps its name from here to the engine (the settings' fields are named after this
config's fields) and its default is written here only (the settings take theirs from these fields).

Per-agent overrides are keyed by *adapter name*: agents that share an adapter share its parameters,
so they necessarily share its optimiser settings too (the rollout workflow defines the
agent -> (base model, adapter) mapping). A learner process serves exactly one base model
(``base_model``); a team of different models runs one learner group per base model
(docs/teams.md), each with its own ``adapters``, ``--publish`` endpoint and version sequence:
its table is ``[learner]`` with ``[groups.<model id>]`` merged over it (``--group``), and ``group``
/ ``group_agents`` make it sample only its agents' steps and judge staleness by its own versions.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from teamrl.protocol.configfile import (
    ConfigError,
    apply_overrides,
    format_validation_error,
    load_section,
    load_toml,
)


class LearnerConfigError(ConfigError):
    """The learner config file or an override is wrong (the message names the field and value)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AgentOverrides(_Strict):
    """Optimiser settings for one adapter; ``None`` means "use the learner-wide value"."""

    lr: float | None = Field(None, gt=0, description="learning rate of this adapter's AdamW")
    clip_low: float | None = Field(None, ge=0, description="PPO clip ε below 1 for this adapter")
    clip_high: float | None = Field(None, ge=0, description="PPO clip ε above 1 (DAPO clip-higher)")
    rank: int | None = Field(None, ge=1, le=256, description="LoRA rank of this adapter (None: lora.rank)")
    temperature: float | None = Field(
        None,
        gt=0,
        description="the temperature this adapter's agents sample at: its log-probs use logits / T",
    )
    kl_coef: float | None = Field(None, ge=0, description="β of this adapter's KL-to-reference term")
    micro_batch_rows: int | None = Field(None, ge=1, description="rows per forward/backward of this adapter")
    allowed_token_ids: list[int] | None = Field(
        None,
        min_length=2,
        description="the only tokens this adapter's agents sample (the workflow's agents.choices): its "
        "log-probs are normalised over them; None = the whole vocabulary",
    )

    @model_validator(mode="after")
    def _distinct_choices(self) -> AgentOverrides:
        ids = self.allowed_token_ids
        if ids is not None and (len(set(ids)) != len(ids) or min(ids) < 0):
            raise ValueError(f"allowed_token_ids must be distinct token ids (>= 0), got {ids}")
        return self


class LoraSettings(_Strict):
    """One LoRA adapter per adapter name, all with the same shape (PEFT ``LoraConfig``)."""

    rank: int = Field(8, ge=1, le=256, description="LoRA rank r (MARFT uses 8)")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout; 0 keeps steps deterministic")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="module names to adapt (Qwen2 attention projections by default)",
    )


class LearnerConfig(_Strict):
    """The learner's configuration. Field order follows the order of a step."""

    # --- what is trained ---------------------------------------------------------------------
    base_model: str = Field(
        "", description="model folder; empty = the embedded model (``--model`` overrides it)"
    )
    adapters: list[str] = Field(
        min_length=1,
        description="adapter names this learner trains on the shared base (one LoRA each); "
        "`teamrl workflow plan` prints them for a workflow",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    group: str = Field(
        "",
        description="the base model id of this learner group in a team of different models; empty = "
        "the whole team runs on one base",
    )
    group_agents: list[str] = Field(
        default_factory=list,
        description="the agents (on this group's base) whose steps it samples; set together with group",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="model dtype; auto = bfloat16 on a CUDA device, float32 on CPU"
    )

    # --- data --------------------------------------------------------------------------------
    batch_size: int = Field(16, ge=1, description="trajectories per rank per step (one sample request)")
    micro_batch_rows: int = Field(
        64, ge=1, description="agent steps per forward/backward; more rows are gradient-accumulated"
    )
    micro_batch_tokens: int = Field(
        4096,
        ge=0,
        description="padded tokens (rows x longest row) per forward/backward at most, one row at least; "
        "0 = rows only. Bounds the activations of long text rows (docs/real-model.md, 'Memory')",
    )
    min_policy_version_lag: int = Field(
        -1, ge=-1, description="refuse samples older than version - lag (-1: any age)"
    )
    stream_micro_batches: bool = Field(
        False,
        description="start a step's forward/backward on the micro-batches that have arrived while the "
        "rest of its sample is still asked for (teamrl.learner.streaming; the same update)",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="sampling temperature of adapters without their own (agents.<adapter>.temperature)",
    )

    # --- advantages and objective ------------------------------------------------------------
    algorithm: Literal["grpo", "drmas", "dr_grpo", "at_grpo", "grpo_trajectory"] = Field(
        "drmas",
        description="outcome advantage (docs/algorithms.md §1): grpo = normalised per group "
        "(DeepSeekMath); drmas = per (group, agent) (Dr. MAS); dr_grpo = group-centred, unscaled "
        "(Dr. GRPO); at_grpo = per (group, agent, turn) (AT-GRPO, PettingLLMs); grpo_trajectory = "
        "trajectory means normalised per group (DrMAS's global baseline)",
    )
    singleton_advantage: Literal["batch", "zero", "raw"] = Field(
        "batch",
        description="a row alone in its advantage group (e.g. an agent that acted once in a group): "
        "batch = normalised against its agent's rows in the batch (drmas, at_grpo) or the whole batch "
        "(grpo, dr_grpo); zero = advantage 0; raw = verl's R/(1+eps), the unnormalised reward",
    )
    advantage_std: bool = Field(
        True,
        description="divide each baseline group's centred rewards by the group's std (GRPO, Dr. MAS); "
        "false: centred only, as Dr. GRPO (dr_grpo is always unscaled). Unscaled, a reward's own "
        "weights survive: outcome's balance_verdicts (docs/real-model.md, 'The group's std undoes a "
        "balanced verdict reward'). Outcome advantages only: ppo-critic's GAE has whiten_advantages",
    )
    reward_source: Literal["step", "trajectory"] = Field(
        "step", description="reward of a row: the agent step's own reward, or the team reward"
    )
    objective: Literal["decoupled", "ppo", "ppo-behaviour", "ppo-critic"] = Field(
        "decoupled",
        description="decoupled = AReaL decoupled PPO with the behaviour weight π_prox/μ (token TIS); "
        "ppo = plain PPO-clip against the recomputed π_old (ignores μ); ppo-behaviour = naive PPO-clip "
        "against the behaviour log-probs μ as π_old (AReaL's baseline: off-policy data unaccounted "
        "for); ppo-critic = MARFT PPO with a centralised value head and GAE (critic_level)",
    )
    critic_level: Literal["action", "token"] = Field(
        "action", description="ppo-critic: GAE over agent steps (MARFT APPO) or over tokens (TPPO)"
    )
    gamma: float = Field(0.99, ge=0, le=1, description="ppo-critic: discount between agent steps")
    lam: float = Field(0.95, ge=0, le=1, description="ppo-critic: GAE λ")
    token_gamma: float | None = Field(
        None, ge=0, le=1, description="ppo-critic token level: discount between tokens (None: gamma)"
    )
    value_coef: float = Field(1.0, gt=0, description="ppo-critic: weight of the value loss")
    critic_lr: float = Field(5e-4, gt=0, description="ppo-critic: learning rate of the value head")
    value_clip: float | None = Field(0.2, gt=0, description="ppo-critic: value clipping range (None: off)")
    critic_hidden: int = Field(256, ge=1, description="ppo-critic: hidden width of the value head")
    action_logprob_norm: Literal["token", "sum"] = Field(
        "token", description="ppo-critic action level: log-prob of an action, token-mean or sum"
    )
    whiten_advantages: bool = Field(True, description="ppo-critic: normalise GAE advantages per batch")
    tis_cap: float | None = Field(
        2.0,
        gt=0,
        description="cap C on the behaviour weight π_prox/μ (None: uncapped). The default 2.0 with "
        "tis_mode='clamp' is truncated IS as verl (rollout_is_threshold=2) and slime (tis_clip=2) use it; "
        "AReaL's decoupled PPO masks above 5.0 instead (tis_cap=5, tis_mode='mask')",
    )
    tis_mode: Literal["clamp", "mask"] = Field(
        "clamp",
        description="clamp = truncate the weight at tis_cap (verl/slime TIS); mask = weight 0 above the "
        "cap, the token (or sequence) still counted in the denominator (AReaL token_mask, Seq-MIS)",
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token",
        description="token = one weight per token; sequence = ρ_seq = Π_t π_prox/μ per row (Seq-TIS when "
        "clamped, Seq-MIS when masked)",
    )
    clip_low: float = Field(0.2, ge=0, description="PPO clip ε below 1")
    clip_high: float | None = Field(None, ge=0, description="PPO clip ε above 1 (None: = clip_low)")
    kl_coef: float = Field(0.0, ge=0, description="β of the KL-to-reference loss term (0: off, no ref pass)")
    kl_estimator: Literal["k1", "k2", "k3", "k3+"] = Field("k3", description="KL estimator (Schulman 2020)")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean", description="how token losses are reduced (verl agg_loss)"
    )
    logprob_tolerance: float | None = Field(
        0.05,
        gt=0,
        description="max mean |recomputed - behaviour| log-prob on fresh rows (version == current); "
        "exceeding it raises (misaligned positions collapse training). None: only report the gap",
    )
    logprob_min_tokens: int = Field(
        64,
        ge=1,
        description="fewer fresh tokens than this in a step: the gap is reported, not judged (a mean of "
        "2 tokens measured 0.064 with a bfloat16 learner whose mean gap is 0.03)",
    )

    # --- update ------------------------------------------------------------------------------
    update_order: Literal["sequential", "simultaneous"] = Field(
        "sequential", description="sequential = agent by agent with the HAPPO factor; simultaneous = MAPPO"
    )
    happo_factor: Literal["turn", "trajectory"] = Field(
        "turn",
        description="sequential: the joint sample of the HAPPO correction factor. turn = per (episode, "
        "turn): a row is weighted by the earlier-updated agents' ratios of its own turn (HAPPO/MARFT); "
        "trajectory = by their ratios over the whole episode (equal on single-turn workflows)",
    )
    happo_factor_clip: float | None = Field(
        None,
        gt=1,
        description="sequential: clip the HAPPO correction factor to [1/c, c] (None: unclipped, as HARL). "
        "The factor is a product of whole-action ratios, so it grows with the action's length: 4-64 "
        "measured on a 135M model's ~60-token plans (docs/algorithms.md §4)",
    )
    order: Literal["random", "fixed"] = Field(
        "random", description="sequential order: a seeded random permutation per step, or ``adapters`` order"
    )
    epochs: int = Field(1, ge=1, description="optimiser passes per adapter per step")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="global grad-norm clip per adapter")
    agents: dict[str, AgentOverrides] = Field(
        default_factory=dict, description="per-adapter overrides, keyed by adapter name"
    )
    zero_stage: Literal[0, 1, 2] = Field(
        2,
        description="DeepSpeed ZeRO stage for the adapter optimisers (3 is refused: the base is frozen "
        "and shared, so only adapter states would be sharded and stage 3 needs the module's forward)",
    )

    # --- bookkeeping -------------------------------------------------------------------------
    max_steps: int = Field(1000, ge=1, description="stop after this many steps (0-based step < max_steps)")
    max_seconds: float = Field(
        0.0,
        ge=0,
        description="time budget: the first step that ends this many seconds after the run began "
        "(TEAMRL_RUN_T0, kept across resumes) is the last, its version published as final; 0: none",
    )
    publish_interval: int = Field(1, ge=1, description="publish adapters every k steps")
    checkpoint_interval: int = Field(10, ge=1, description="checkpoint every k steps")
    train_weights: bool = Field(
        True, description="false = no weight update (profiles alone, with profile_interval > 0)"
    )
    profile_interval: int = Field(
        0,
        ge=0,
        description="LangMARL: every k steps a judge rewrites agent profiles from the batch (0 = off)",
    )
    profiles: dict[str, str] = Field(
        default_factory=dict,
        description="the agents' starting profiles (agent id -> system prompt), version 0 of the profile "
        "store; needed with profile_interval > 0 (`teamrl run` fills them from the workflow)",
    )
    profile_max_new_tokens: int = Field(512, ge=1, description="judge answer length, in tokens")
    profile_temperature: float = Field(
        0.7, gt=0, description="the profile judge's sampling temperature (a 135M judge writes noise at 1)"
    )
    profile_min_length_ratio: float = Field(
        0.3,
        ge=0,
        le=1,
        description="refuse a proposed profile shorter than this fraction of the one it replaces "
        "(too_short: a small judge paraphrases the format's placeholder; 0 = off)",
    )
    profile_prefill: bool = Field(
        True,
        description="begin the judge's answer with <profile> so it writes only the revised profile "
        "(a small model seldom writes the tagged format itself; docs/real-model.md)",
    )
    profile_max_staleness: int = Field(
        2, ge=0, description="profile rounds read episodes of the last k+1 profile versions"
    )
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept on disk")
    linger_s: float = Field(
        0.0,
        ge=0,
        description="after the last step, keep serving the final version on the weights endpoints this "
        "long (or until SIGTERM), so a rollout that restarts late can still load and evaluate it",
    )
    inline_max_bytes: int = Field(
        8 * 1024 * 1024, ge=0, description="adapter payloads up to this size travel inline over ZeroMQ"
    )
    chunk_bytes: int = Field(1024 * 1024, ge=1024, description="inline chunk size")
    seed: int = Field(0, description="seeds torch/numpy/python RNGs and the update order")
    publish_mode: Literal["uri", "inline"] = Field(
        "uri",
        description="uri = announce the folder <run-dir>/adapters/v<version> (shared storage); inline = "
        "carry the adapter payload in the announcement when it is <= inline_max_bytes (else uri, counted)",
    )
    probe_prompt: list[int] = Field(
        min_length=1,
        description="token ids of the probe prompt (a held-out task's prompt in the model's tokenizer: "
        "`teamrl workflow plan` builds it)",
    )
    probe_completion: list[int] = Field(
        min_length=1,
        description="token ids of the probe completion; the learner announces their log-probs with each "
        "version and a rollout uses the version only if vLLM reproduces them",
    )
    probe_dtype: Literal["auto", "float32"] = Field(
        "auto",
        description="auto = the probe log-probs are the learner's own (its dtype); float32 = computed from the "
        "exported adapter files on a float32 copy of the base (a bfloat16 learner feeding float32 rollouts: "
        "teamrl run sets it; teamrl.learner.probe_ref)",
    )
    probe_atol: float = Field(
        0.0,
        ge=0,
        description="how closely a rollout must reproduce the probe log-probs (max |difference|); 0 = by the "
        "probe's dtype (float32 1e-3, bfloat16 0.0625). A bfloat16 rollout on CPU needs about 0.5: its "
        "log-probs differ from the learner's by up to 0.48 on SmolLM2-135M's probe, as much as training "
        "moves them, so the probe then catches only gross faults (docs/real-model.md, 'A bfloat16 learner')",
    )

    @model_validator(mode="after")
    def _consistent(self) -> LearnerConfig:
        if len(set(self.adapters)) != len(self.adapters):
            raise ValueError(f"adapters has duplicates: {self.adapters}")
        if any(not a for a in self.adapters):
            raise ValueError(
                "adapter names must be non-empty ('' means the base model, which is not trained)"
            )
        unknown = sorted(set(self.agents) - set(self.adapters))
        if unknown:
            raise ValueError(f"agents overrides name unknown adapters {unknown}; known: {self.adapters}")
        if bool(self.group) != bool(self.group_agents):
            raise ValueError(
                f"group = {self.group!r} and group_agents = {self.group_agents}: a learner group names "
                "both its base model and the agents it samples (or neither)"
            )
        if self.tis_mode == "mask" and self.tis_cap is None:
            raise ValueError("tis_mode='mask' needs a tis_cap")
        if not self.train_weights and not self.profile_interval:
            raise ValueError("train_weights = false trains nothing unless profile_interval > 0")
        if self.profile_interval and not self.profiles:
            raise ValueError(
                "profile_interval > 0 needs profiles (the agents' starting profiles; "
                "`teamrl workflow plan` prints them)"
            )
        return self

    def adapter_settings(self, adapter: str) -> dict[str, Any]:
        """Resolved per-adapter settings of one adapter (its override, else the learner-wide value)."""
        o = self.agents.get(adapter, AgentOverrides())

        def pick(name: str) -> Any:
            own = getattr(o, name)
            return own if own is not None else getattr(self, name)

        high = pick("clip_high")
        return {
            "lr": pick("lr"),
            "clip_low": pick("clip_low"),
            "clip_high": high if high is not None else pick("clip_low"),
            "temperature": pick("temperature"),
            "kl_coef": pick("kl_coef"),
            "micro_batch_rows": pick("micro_batch_rows"),
            "allowed_token_ids": tuple(o.allowed_token_ids) if o.allowed_token_ids else None,
        }


def load_learner_config(
    path: str | Path | None, overrides: list[str] | None = None, group: str = ""
) -> LearnerConfig:
    """Read ``path`` (TOML; its ``[learner]`` table if present, else the whole file) plus ``key=value``
    overrides (TOML literals: ``lr=3e-4``, ``adapters=["a","b"]``; dotted keys reach nested tables:
    ``lora.rank=16``). ``group``: the ``[groups.<group>]`` table merged over ``[learner]`` first (a
    learner group of a team of different models). Raises :class:`LearnerConfigError` naming each
    bad field."""
    if not group:
        return load_section(
            LearnerConfig, path, "learner", overrides, whole_file=True, error=LearnerConfigError
        )
    if path is None:
        raise LearnerConfigError(f"--group {group}: needs --config with a [groups.{group}] table")
    raw = load_toml(path, LearnerConfigError)
    groups = raw.get("groups", {})
    if group not in groups:
        raise LearnerConfigError(f"{path}: no [groups.{group}] table (groups there: {sorted(groups)})")
    data = group_table(raw, group)
    apply_overrides(data, list(overrides or []), LearnerConfigError)
    if data.get("group", group) != group:
        raise LearnerConfigError(f"{path} [groups.{group}]: group = {data['group']!r}, not {group!r}")
    try:
        return LearnerConfig.model_validate(data)
    except ValidationError as err:
        raise LearnerConfigError(
            format_validation_error(err, f"{path} [groups.{group}]", "learner")
        ) from None


def group_table(raw: dict[str, Any], group: str = "") -> dict[str, Any]:
    """A config file's ``[learner]`` with ``[groups.<group>]`` merged over it, key by key (a learner
    group's own table; ``""``: ``[learner]`` alone). A fresh copy: the caller may change it."""
    table = raw.get("learner", {})
    if group:
        table = _merged(table, raw.get("groups", {})[group])
    return copy.deepcopy(table)


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
