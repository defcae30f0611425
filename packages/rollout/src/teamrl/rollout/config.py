"""The ``[rollout]`` table and the base models a rollout service serves.

:class:`RolloutConfig` is the ``[rollout]`` table (flags of ``teamrl rollout`` override the file,
``--set KEY=VALUE``); :func:`load_config`, :func:`load_transport` and :func:`with_model` read and
complete it; :func:`resolve_bases` turns it and the ``--weights`` flags into the bases served.

Several base models (docs/architecture.md §3, "Rollout services"): a workflow whose agents run on
different base models (its ``[models]``) is served with one vLLM engine per base, each named in
``[rollout.models.<model id>]`` (folder, LoRA rank and targets, start version, weights endpoint) and
each following its own learner group's weights endpoint (``models.<id>.weights`` or, repeatable,
``--weights MODEL_ID=ENDPOINT``)::

    teamrl rollout --config rollout.toml --weights planner-model=tcp://learner-planner:5557 \
                   --weights solver-model=tcp://learner-solver:5557

An episode routes each agent to its base's engine, and each step records the version of its own
base's adapters. Held-out evaluations use the lowest live version over the bases (and list each);
LangMARL profile versions are taken from the first base's link only (the group of the first base of
``[rollout.models]`` runs the profile rounds). Without ``[rollout.models]`` the service runs one
engine from ``model`` and one ``--weights ENDPOINT``, as before; both cases run through one mapping
model id -> (engine, weights applier, endpoint, start version) (:func:`resolve_bases`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from teamrl.protocol.config import TransportConfig
from teamrl.protocol.configfile import ConfigError, load_section
from teamrl.rollout.bases import ServedBase


class RolloutConfigError(ConfigError):
    """The rollout config file or a flag is wrong; the message names the field."""


DEFAULT_WEIGHTS = "tcp://127.0.0.1:5557"  # --weights when not given (one base model)


class RolloutModel(BaseModel):
    """One base model of the workflow (``[rollout.models.<model id>]``): its own vLLM engine, which
    follows its own learner group's adapter versions (docs/architecture.md §3, "Rollout services")."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="model folder of this base (must hold config.json)")
    max_lora_rank: int = Field(8, ge=1, description="largest LoRA rank this base's engine accepts")
    lora_target_modules: list[str] = Field(
        default_factory=list,
        description="modules LoRA applies to on this base (its adapters' targets); empty = vLLM's default",
    )
    weights: str = Field(
        "",
        description="this base's learner weights PUB endpoint; empty = from `--weights MODEL_ID=ENDPOINT`",
    )
    start_version: int = Field(
        0, ge=0, description="generate only once this base's adapter version is live (a resumed run's)"
    )
    max_model_len: int = Field(
        0,
        ge=0,
        description="this base's engine context in tokens (0: the model's own limit; see max_model_len)",
    )


class RolloutConfig(BaseModel):
    """The ``[rollout]`` table. Flags of ``teamrl rollout`` override the file."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        "", description="model folder; empty = the embedded model (`teamrl model build` makes it)"
    )
    workflow: str = Field(
        min_length=1,
        description="workflow name (`teamrl workflow list`) or TOML file, as `teamrl run --workflow`",
    )
    tasks: str = Field("", description="JSONL or Parquet task file; empty = the workflow's training split")
    group_size: int = Field(8, ge=1, description="episodes per task (the group of a group baseline)")
    groups_in_flight: int = Field(16, ge=1, description="groups generated concurrently")
    max_groups: int = Field(0, ge=0, description="stop after this many groups (0 = run until stopped)")
    replica: int = Field(-1, ge=-1, description="this replica's index for task sharding (-1: from POD_NAME)")
    num_replicas: int = Field(1, ge=1, description="replicas sharing the task set")
    seed: int = Field(0, description="seeds task order and sampling")
    window: int = Field(16, ge=1, description="frames in flight to the buffer before sending blocks")
    max_queued_frames: int = Field(
        32, ge=1, description="finished groups waiting to be sent before generation waits (backpressure)"
    )
    drain_timeout_s: float = Field(30.0, ge=0, description="time groups in flight get to finish on SIGTERM")
    flush_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on exit, time to send what is queued and have it acked (queue included)",
    )
    max_lora_rank: int = Field(8, ge=1, description="largest LoRA rank the engine accepts")
    lora_target_modules: list[str] = Field(
        default_factory=list,
        description="modules LoRA applies to (the adapters' targets); empty = vLLM's default",
    )
    keep_versions: int = Field(2, ge=1, description="adapter versions kept loaded")
    kv_cache_bytes: int = Field(256 * 1024 * 1024, ge=1, description="vLLM CPU KV cache size")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="the engines' weights and activations; bfloat16 generates 1.5x faster on a CPU with AMX "
        "(docs/real-model.md, 'Speed'), but its log-probs cannot be probe-verified there: teamrl run refuses it "
        "without learner.probe_atol (docs/real-model.md, 'A bfloat16 learner')",
    )
    max_model_len: int = Field(
        0,
        ge=0,
        description="the engine's context in tokens; 0 = the model's max_position_embeddings. teamrl run "
        "derives it from the workflow's prompts and token budgets (teamrl.rollout.sizing)",
    )
    adapter_dir: str = Field("", description="where received adapters are unpacked; empty = a temp folder")
    max_groups_per_version: int = Field(
        0,
        ge=0,
        description="start at most this many groups while no base's live adapter version changes (more "
        "would only be dropped as stale or evicted unread; teamrl run sets (max lag + 1) x the groups "
        "of a step x the ranks of a group); 0 = no limit",
    )
    groups_per_version: int = Field(
        0,
        ge=0,
        description="each new live version lets this many more groups start, up to max_groups_per_version "
        "unstarted (teamrl run sets one learner step's groups: production follows consumption); 0 = "
        "each new version refills the whole max_groups_per_version",
    )
    eval_interval: int = Field(0, ge=0, description="replica 0: evaluate held-out tasks every N versions")
    eval_tasks: int = Field(200, ge=1, description="held-out tasks per evaluation")
    start_version: int = Field(
        0, ge=0, description="generate only once this adapter version is live (a resumed run's current one)"
    )
    eval_file: str = Field("", description="replica 0 appends evaluations here (JSONL)")
    samples_dir: str = Field("", description="replica 0 writes a sample group per new version here")
    buffer_control: str = Field(
        "", description="buffer RPC endpoint for Hello / Heartbeat; empty = the data endpoint's port + 1"
    )
    heartbeat_interval_s: float = Field(5.0, gt=0, description="seconds between heartbeats to the buffer")
    reward_scale: dict[str, float] = Field(
        default_factory=dict, description="multiply a role's training step reward, e.g. {verifier = 10.0}"
    )
    models: dict[str, RolloutModel] = Field(
        default_factory=dict,
        description="one engine per base model of the workflow, by model id (its [models]); empty = one "
        "engine from model, max_lora_rank, lora_target_modules and start_version (set: those are unused)",
    )


def parse_weights_flags(flags: str | Sequence[str] | None) -> tuple[str | None, dict[str, str]]:
    """``--weights`` values: (one plain endpoint or None, ``{model_id: endpoint}``).

    Each value is ``ENDPOINT`` or ``MODEL_ID=ENDPOINT``; at most one plain endpoint, not mixed with
    ``MODEL_ID=`` ones, and no model id twice."""
    if flags is None:
        return None, {}
    plain: list[str] = []
    keyed: dict[str, str] = {}
    for item in [flags] if isinstance(flags, str) else list(flags):
        model_id, sep, endpoint = item.partition("=")
        if not sep or "://" in model_id:
            plain.append(item)
            continue
        if not model_id or not endpoint:
            raise RolloutConfigError(f"--weights {item!r}: expected ENDPOINT or MODEL_ID=ENDPOINT")
        if model_id in keyed:
            raise RolloutConfigError(f"--weights: model {model_id!r} given twice")
        keyed[model_id] = endpoint
    if len(plain) > 1 or (plain and keyed):
        raise RolloutConfigError(
            f"--weights {' '.join(plain)!s}: give one ENDPOINT (one base model), or one "
            "MODEL_ID=ENDPOINT per base model"
        )
    return (plain[0] if plain else None), keyed


def resolve_bases(cfg: RolloutConfig, weights: str | Sequence[str] | None = None) -> dict[str, ServedBase]:
    """The base models this service serves, ``{model_id: ServedBase}`` in ``[rollout.models]`` order.

    Without ``models``: one base keyed by the workflow's trained agents' model (or its only one), from
    ``model``, ``max_lora_rank``, ``lora_target_modules``, ``start_version`` and ``--weights``
    (default ``tcp://127.0.0.1:5557``). With ``models``: one per entry, the endpoint from
    ``--weights MODEL_ID=ENDPOINT`` (a flag overrides the file) or ``models.<id>.weights``, and
    ``model``, ``max_lora_rank``, ``lora_target_modules`` and ``start_version`` are not read. Raises
    RolloutConfigError, naming the model id and the field, before any engine starts: a model id
    that is not the workflow's, a workflow model an agent runs on with no engine, a base with
    trained agents and no weights endpoint, a ``path`` without config.json."""
    from teamrl.rollout.spec import WorkflowError
    from teamrl.rollout.workflows import load

    plain, keyed = parse_weights_flags(weights)
    try:
        wf = load(cfg.workflow)
    except WorkflowError as e:
        raise RolloutConfigError(f"workflow = {cfg.workflow!r}: {e}") from None
    if not cfg.models:
        return _one_base(cfg, wf, plain, keyed)
    return _several_bases(cfg, wf, plain, keyed)


def _agents_on(wf: Any, model_id: str) -> list[str]:
    return [a.id for a in wf.agents if a.model == model_id]


def _one_base(cfg: RolloutConfig, wf: Any, plain: str | None, keyed: dict[str, str]) -> dict[str, ServedBase]:
    """The one-engine case (no ``[rollout.models]``): every agent must run on the served model."""
    from teamrl.rollout.runner import served_model, trained_models, used_models

    used = used_models(wf)
    key = served_model(wf)
    if key is None:
        raise RolloutConfigError(
            f"workflow {wf.name!r} trains agents on base models {trained_models(wf) or used}, and model "
            "serves one: set [rollout.models.<model id>] (path, weights) for each of them"
        )
    missing = [m for m in used if m != key]
    if missing:
        m = missing[0]
        raise RolloutConfigError(
            f"workflow {wf.name!r} runs agents {_agents_on(wf, m)} on model {m!r}, which has no engine "
            f"here (model serves {key!r}): set [rollout.models.<model id>] (path, weights) for each"
        )
    for model_id in keyed:
        if model_id != key:
            raise RolloutConfigError(
                f"--weights {model_id}=...: {model_id!r} is not the base model this service runs ({key!r})"
            )
    endpoint = plain or keyed.get(key) or DEFAULT_WEIGHTS
    base = ServedBase(
        key,
        cfg.model,
        cfg.max_lora_rank,
        tuple(cfg.lora_target_modules),
        endpoint,
        cfg.start_version,
        cfg.max_model_len,
    )
    return {key: base}


def _several_bases(
    cfg: RolloutConfig, wf: Any, plain: str | None, keyed: dict[str, str]
) -> dict[str, ServedBase]:
    """One engine per ``[rollout.models.<id>]``, each model id the workflow's, each agent's model
    served, each trained base with a weights endpoint and a model folder."""
    from teamrl.rollout.runner import trained_models, used_models

    for model_id in cfg.models:
        if model_id not in wf.models:
            raise RolloutConfigError(
                f"models.{model_id}: workflow {wf.name!r} has no model {model_id!r} "
                f"(its models: {sorted(wf.models)})"
            )
    for model_id in used_models(wf):
        if model_id not in cfg.models:
            raise RolloutConfigError(
                f"models.{model_id}: workflow {wf.name!r} runs agents {_agents_on(wf, model_id)} on model "
                f"{model_id!r}, which has no engine here: add [rollout.models.{model_id}] with its path"
            )
    for model_id in keyed:
        if model_id not in cfg.models:
            raise RolloutConfigError(
                f"--weights {model_id}=...: {model_id!r} is not a base model of [rollout.models] "
                f"({sorted(cfg.models)})"
            )
    if plain is not None and len(cfg.models) > 1:
        raise RolloutConfigError(
            f"--weights {plain}: this service runs {len(cfg.models)} base models ({sorted(cfg.models)}); "
            "give --weights MODEL_ID=ENDPOINT for each (or models.<model id>.weights)"
        )
    trained = trained_models(wf)
    bases: dict[str, ServedBase] = {}
    for model_id, m in cfg.models.items():
        endpoint = keyed.get(model_id) or plain or m.weights
        if not endpoint and model_id in trained:
            raise RolloutConfigError(
                f"models.{model_id}.weights: no weights endpoint for base {model_id!r} (agents "
                f"{_agents_on(wf, model_id)} train on it): set it, or --weights {model_id}=ENDPOINT"
            )
        if not endpoint and m.start_version:
            raise RolloutConfigError(
                f"models.{model_id}.start_version = {m.start_version}: base {model_id!r} follows no "
                "weights endpoint, so no version but 0 ever comes"
            )
        if not (Path(m.path) / "config.json").is_file():
            raise RolloutConfigError(
                f"models.{model_id}.path = {m.path!r}: no config.json there (not a model folder)"
            )
        bases[model_id] = ServedBase(
            model_id,
            m.path,
            m.max_lora_rank,
            tuple(m.lora_target_modules),
            endpoint,
            m.start_version,
            m.max_model_len or cfg.max_model_len,
        )
    return bases


def load_config(path: str | None, overrides: list[str]) -> RolloutConfig:
    """The ``[rollout]`` table of ``path`` (none: defaults) plus ``--set`` overrides."""
    return load_section(RolloutConfig, path, "rollout", overrides, error=RolloutConfigError)


def load_transport(path: str | None) -> TransportConfig:
    """The ``[transport]`` table of ``path`` (none: defaults, CURVE off), the table the buffer and
    learner read too (docs/transport-security.md). With CURVE on, the rollout's keys are read here, so a
    missing key fails before the engine starts."""
    from teamrl.protocol.curve import CurveKeyError

    transport = load_section(TransportConfig, path, "transport", flags={}, error=RolloutConfigError)
    try:
        for socket in ("buffer_data", "buffer_rpc", "learner_weights"):
            transport.client_curve("rollout", socket)
    except (CurveKeyError, OSError, ValueError) as e:
        raise RolloutConfigError(f"{path} [transport]: {e}") from None
    return transport


def with_model(cfg: RolloutConfig) -> RolloutConfig:
    """``cfg`` with a model folder that exists: its own, else the embedded model's, which
    ``teamrl model build`` makes (``teamrl run`` and the deploy's init container run it first).
    With ``[rollout.models]`` each base names its own folder (checked by :func:`resolve_bases`)
    and ``cfg`` is returned as it is."""
    if cfg.models:
        return cfg
    if cfg.model:
        if not (Path(cfg.model) / "config.json").is_file():
            raise RolloutConfigError(f"model = {cfg.model!r}: no config.json there (not a model folder)")
        return cfg
    from teamrl.rewards.addition import embedded_model_dir

    default = embedded_model_dir()
    if not (default / "config.json").is_file():
        raise RolloutConfigError(
            f"no model given and the embedded model is not built at {default}: run `teamrl model build` "
            "first, or set model = DIR"
        )
    return cfg.model_copy(update={"model": str(default)})
