"""From ``teamrl run`` arguments to the services' resolved config, checked before anything starts.

``plan(args) -> RunPlan`` is pure apart from reading files (and building an embedded model folder
the first time it is asked for): it resolves the model (``--model DIR|embedded|embedded-text``),
checks the workflow against it (:func:`teamrl.rollout.team.plan_team`), and writes nothing. The
``[buffer]``, ``[learner]`` and ``[rollout]`` tables it builds come from the workflow and the model
folder: the adapters with their own ranks, the LoRA target modules of the architecture, the
sampling temperature, the probe built from a held-out task. Then ``--config FILE`` tables and
``--set section.key=value`` overrides are applied, and every table is validated by the service's own
config model, so a bad value fails here, in well under a second, naming the field.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teamrl.protocol.configfile import ConfigError, apply_overrides

EMBEDDED = ("embedded", "embedded-text", "embedded-llama", "embedded-checker", "smollm2-135m")
SECTIONS = ("buffer", "learner", "rollout", "groups")


class PlanError(ValueError):
    """The run cannot start: the message names the file, agent and field (exit code 2)."""


@dataclass(frozen=True)
class RunPlan:
    team: Any  # teamrl.rollout.team.TeamPlan
    model: str  # the model folder; a team of different models: a JSON object {model id: folder}
    config: dict[str, dict[str, Any]]  # [buffer], [learner], [rollout]; [groups] for several bases

    @property
    def workflow(self) -> Any:
        return self.team.workflow

    @property
    def groups(self) -> list[str]:
        """The learner groups: one per base model of trained agents; [""] for a one-base team."""
        return list(self.config.get("groups", {})) or [""]

    def learner_table(self, group: str = "") -> dict[str, Any]:
        """The [learner] table of ``group`` (its [groups.<id>] entries over the shared [learner])."""
        return learner_table(self.config, group)


def learner_table(cfg: dict[str, Any], group: str = "") -> dict[str, Any]:
    """``[learner]`` with ``[groups.<group>]`` merged over it: the table ``teamrl learner --group``
    reads (the same merge, ``teamrl.learner.config.group_table``)."""
    from teamrl.learner.config import group_table

    return group_table(cfg, group)


def _embedded(spec: str) -> tuple[Any, Any, str]:
    """The embedded model ``spec``: its build function, its folder function and its build flags."""
    if spec == "embedded-text":
        from teamrl.models import text

        return (lambda: text.build_text(measure_n=20)), text.default_text_model_dir, " --kind text"
    if spec == "smollm2-135m":
        from teamrl.models import smollm2

        return smollm2.build, smollm2.default_dir, " --kind smollm2"
    from teamrl.learner import modelbuild as mb

    return {
        "embedded": (mb.build, mb.default_model_dir, ""),
        "embedded-llama": (mb.build_llama, mb.default_llama_model_dir, " --kind llama"),
        "embedded-checker": (mb.build_checker, mb.default_checker_model_dir, " --kind checker"),
    }[spec]


def resolve_model(spec: str | None, workflow_path: str = "", *, build: bool = True) -> Path:
    """The model folder: a path or an embedded model's name (``embedded``: the character model;
    ``embedded-llama``: the same on Llama; ``embedded-checker``: the addition checker;
    ``embedded-text``: the BPE model; ``smollm2-135m``: SmolLM2-135M-Instruct from its pinned wheel,
    docs/real-model.md); none given: the workflow's own ``models.<id>.path``, else
    ``embedded``. The embedded folders are built the first time (minutes) unless ``build`` is false."""
    spec = spec or workflow_path or "embedded"
    if spec in EMBEDDED:
        make, where, kind = _embedded(spec)
        if build:
            return Path(make())
        if not (where() / "config.json").is_file():
            raise PlanError(f"--model {spec}: not built yet at {where()} (teamrl model build{kind})")
        return where()
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise PlanError(
            f"--model {spec}: not a model folder (no config.json there); give a Hugging Face folder, "
            f"or one of {', '.join(EMBEDDED)}"
        )
    return path.resolve()


def workflow_model_path(source: str) -> str:
    """The path the workflow itself gives its (trained) base model, '' when it leaves it open."""
    from teamrl.rollout.team import load_source

    wf, _ = load_source(source)
    trained = [a for a in wf.agents if a.adapter] or wf.agents
    return wf.models[trained[0].model].path


def resolve_models(
    specs: str | list[str] | None, source: str, *, build: bool = True
) -> Path | dict[str, Path]:
    """The model folder(s) of a run: ``--model SPEC`` (one folder for every model the workflow
    uses) and/or ``--model ID=SPEC`` per model id (a team of different models). A workflow whose
    agents use one model gets one folder; one whose agents use several gets ``{id: folder}``, each
    from its ``ID=SPEC``, else the plain ``SPEC``, else the workflow's ``models.<id>.path``, else
    ``embedded``. SPEC is a folder or an embedded model name (:func:`resolve_model`)."""
    from teamrl.rollout.team import load_source, used_models

    wf, _ = load_source(source)
    items = [specs] if isinstance(specs, str) else list(specs or [])
    per: dict[str, str] = {}
    plain: list[str] = []
    for item in items:
        mid, sep, spec = item.partition("=")
        if sep and mid in wf.models:
            per[mid] = spec
        elif sep and not Path(item).exists():
            raise PlanError(
                f"--model {item}: {mid!r} is not a model of workflow {wf.name!r} ({sorted(wf.models)})"
            )
        else:
            plain.append(item)
    if len(plain) > 1:
        raise PlanError(f"--model given {len(plain)} times without ID= ({plain}); give ID=DIR for each model")
    default = plain[0] if plain else None
    used = used_models(wf)
    if len(used) == 1 and not per:
        return resolve_model(default, workflow_model_path(source), build=build)
    return {m: resolve_model(per.get(m, default), wf.models[m].path, build=build) for m in used}


def plan(args: argparse.Namespace, *, build: bool = True) -> RunPlan:
    """Check everything and resolve the services' tables; raises :class:`PlanError`."""
    from teamrl.rollout.spec import WorkflowError
    from teamrl.rollout.team import plan_team

    try:
        model = resolve_models(args.model, args.workflow, build=build)
        team = plan_team(args.workflow, model, tasks_path=args.tasks or None)
        _check_reward_scale(team.workflow, args)
    except WorkflowError as e:
        hint = ""
        if "cannot encode" in str(e) and (args.model or "embedded") in ("embedded", ["embedded"]):
            hint = (
                "\n  (the embedded character model reads only the addition workflows: try "
                "--model embedded-text, or --model with a Hugging Face folder)"
            )
        raise PlanError(f"{e}{hint}") from None
    shown = str(model) if isinstance(model, Path) else json.dumps({k: str(v) for k, v in model.items()})
    groups = list(team.bases) if len(team.bases) > 1 else [""]
    try:
        ranks = learner_ranks(getattr(args, "learners", None), groups)
    except ValueError as e:
        raise PlanError(str(e)) from None
    cfg = resolved_config(args, team, shown, max(ranks.values()))
    cfg = _apply_user_config(cfg, args.config, args.set)
    check_sizes(team, cfg["rollout"])
    lrn = cfg["learner"]
    if lrn.get("profile_interval") and not lrn.get("profiles"):  # LangMARL rounds start from these
        lrn["profiles"] = team.workflow.profiles()
    validate(cfg)
    _warn_emulated_bfloat16(cfg)
    _warn_scaled_balanced_verdicts(team.workflow.reward_fn(), cfg)
    return RunPlan(team, shown, cfg)


def _warn_scaled_balanced_verdicts(reward: Any, cfg: dict[str, dict[str, Any]]) -> None:
    """A class-balanced reward (its ``class_balanced``, e.g. ``outcome``'s ``balance_verdicts``; any
    user reward may set it) under advantages divided by each group's std: said on stderr before any
    process starts. The std undoes the balance and pushes a verifier that cannot tell right from wrong
    to the majority verdict (docs/algorithms.md §1, "Without the std")."""
    if not getattr(reward, "class_balanced", False):
        return
    lrn = cfg.get("learner", {})
    tables = [lrn, *({**lrn, **t} for t in (cfg.get("groups") or {}).values())]
    if any(t.get("advantage_std", True) and t.get("algorithm") != "dr_grpo" for t in tables):
        print(
            "teamrl: warning: the reward balances its classes (e.g. balance_verdicts) but the learner divides "
            "advantages by each group's std, which undoes the balance (a verifier that cannot yet check "
            "drifts to the majority verdict); consider --set learner.advantage_std=false "
            "(docs/algorithms.md §1)",
            file=sys.stderr,
            flush=True,
        )


def _warn_emulated_bfloat16(cfg: dict[str, dict[str, Any]]) -> None:
    """A learner (or learner group) in bfloat16 on a CPU that emulates it: said on stderr before any
    process starts (23x slower than float32 there; teamrl.learner.cpu). Not an error: on a GPU it is right."""
    tables = [cfg.get("learner", {}), *(cfg.get("groups") or {}).values()]
    if any(t.get("dtype") == "bfloat16" for t in tables):
        from teamrl.learner.cpu import bfloat16_warning

        if warning := bfloat16_warning():
            print(f"teamrl: warning: {warning}", file=sys.stderr, flush=True)


def learner_ranks(value: Any, groups: list[str]) -> dict[str, int]:
    """``--learners``: ``N`` ranks for every group, and/or ``ID=N`` for one group (a 2-rank group
    next to a 1-rank one); groups not named get the plain ``N`` (default 1)."""
    items = value if isinstance(value, list) else [value] if value is not None else []
    every, per = 1, {}
    for item in items:
        gid, sep, n = str(item).rpartition("=")
        if sep and gid not in groups:
            raise ValueError(f"--learners {item}: {gid!r} is not a learner group (groups: {groups})")
        if sep:
            per[gid] = int(n)
        else:
            every = int(n)
    return {g: per.get(g, every) for g in groups}


def stop_rule(args: argparse.Namespace) -> dict[str, float]:
    """The learner's end: ``--steps``, and ``--max-minutes`` as ``max_seconds`` when given."""
    minutes = getattr(args, "max_minutes", 0.0)
    return {"max_steps": args.steps, **({"max_seconds": 60.0 * minutes} if minutes else {})}


def resolved_config(
    args: argparse.Namespace, team: Any, model: str, ranks: int = 1
) -> dict[str, dict[str, Any]]:
    """The [buffer], [learner] and [rollout] tables of this run (written to RUN/config.toml); a team
    on several base models also gets [groups.<model id>]: each learner group's own base, adapters,
    agents and probe over the shared [learner] settings, and [rollout] a ``models`` table.

    ``ranks``: the most learner ranks of a group. A step takes ``tasks_per_step`` groups per rank, and
    data more than ``max_lag`` versions old is dropped, so the rollouts start at most ``(max_lag + 1)
    x tasks_per_step x ranks`` groups per live version between them (``max_groups_per_version``, each
    replica its share)."""
    batch = args.tasks_per_step * args.group_size
    several = len(team.bases) > 1
    first = next(iter(team.bases.values()))
    cfg = {
        "buffer": {
            **_buffer_table(args, batch),
            # the ids a step may carry (docs/security.md): every model an agent runs on, every agent
            "model_ids": list(team.model_dirs),
            "agent_ids": [a.id for a in team.workflow.agents],
        },
        "learner": {
            **({} if several else _base_learner_table(first, several)),  # several: in [groups.<id>]
            "batch_size": batch,
            "micro_batch_rows": 256,
            "lr": args.lr,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "algorithm": args.algorithm,
            "update_order": args.update_order,
            **stop_rule(args),
            "min_policy_version_lag": args.max_lag,
            "checkpoint_interval": args.checkpoint_interval,
            "publish_mode": "inline",
            "linger_s": 600.0,  # the launcher stops it once the final version is evaluated
            "seed": args.seed,
        },
        "rollout": {
            "model": str(first.model_dir) if several else model,
            "workflow": team.source,
            "tasks": str(Path(args.tasks).resolve()) if args.tasks else "",
            "group_size": args.group_size,
            "groups_in_flight": args.tasks_per_step * (2 if world_latency(team.workflow) else 1),
            "num_replicas": args.rollouts,
            "seed": args.seed,
            "max_lora_rank": first.max_lora_rank,
            "lora_target_modules": list(first.target_modules),
            "eval_interval": args.eval_interval,
            "eval_tasks": args.eval_tasks,
            "reward_scale": reward_scale(args),
            **version_budget(args, ranks),
            "kv_cache_bytes": kv_cache_bytes(team, batch),
            **({} if several else {"max_model_len": team.contexts[first.model_id]}),
        },
    }
    if several:
        cfg["groups"] = {m: _base_learner_table(b, several) for m, b in team.bases.items()}
        cfg["rollout"]["models"] = served_models(team)
    return cfg


def world_latency(workflow: Any) -> float:
    """Seconds an episode waits on the world (``[reward] latency_s``, the slowest tool's). With any, a
    rollout keeps two steps of groups in flight: with one, the waiting groups hold every slot and the
    engine idles (measured: 0.835 -> 0.529 s a step at 0.5 s, sync 0.920; docs/results.md (h))."""
    tools = [float(t.get("latency_s", 0.0)) for t in workflow.tools.values()]
    reward = float(workflow.reward.latency_s) if workflow.reward is not None else 0.0
    return max([reward, *tools])


def version_budget(args: argparse.Namespace, ranks: int) -> dict[str, int]:
    """Each rollout replica's share of the version budget (AReaL's bound): at most ``max_lag + 1``
    steps' groups ahead of the learner, each new version letting one step's worth more start. Shared
    by the replicas: more would only be dropped as stale or evicted (``teamrl cluster`` shows it)."""
    step = args.tasks_per_step * ranks
    return {
        "max_groups_per_version": -(-(args.max_lag + 1) * step // args.rollouts),
        "groups_per_version": -(-step // args.rollouts),
    }


def _buffer_table(args: argparse.Namespace, batch: int) -> dict[str, Any]:
    """FIFO groups, each sampled once, held up to 20 steps' worth, staleness bound ``--max-lag``."""
    return {
        "group_size": args.group_size,
        "min_size": batch,
        "max_policy_lag": args.max_lag,
        "max_times_sampled": 1,
        "sampler": "fifo",
        "capacity": 20 * batch,
        "fsync": False,
        "checkpoint_interval_s": 0.5,
    }


def _base_learner_table(base: Any, several: bool) -> dict[str, Any]:
    """What a learner group's table says about its base: the folder, adapters with their own ranks
    and settings, LoRA targets, the probe; in a team of several bases also which agents it samples."""
    out = {
        "base_model": str(base.model_dir),
        "adapters": list(base.adapters),
        "lora": {"target_modules": list(base.target_modules)},  # ranks: per adapter, below
        "agents": {
            a: {"rank": r, "temperature": base.temperatures[a], **base.optimiser[a]}
            | ({"allowed_token_ids": base.choices[a]} if a in base.choices else {})
            for a, r in base.adapters.items()
        },
        "probe_prompt": list(base.probe_prompt),
        "probe_completion": list(base.probe_completion),
    }
    if several:
        out |= {"group": base.model_id, "group_agents": list(base.agents)}
    return out


def kv_cache_bytes(team: Any, sequences: int) -> int:
    """One KV cache size for the team's engines (a several-base rollout shares the setting): the
    largest context (``team.contexts``) for ``sequences`` sequences in flight (teamrl.rollout.sizing)."""
    from teamrl.rollout import sizing

    return max(sizing.kv_cache_bytes(team.model_dirs[m], n, sequences) for m, n in team.contexts.items())


def check_sizes(team: Any, rollout: dict[str, Any]) -> None:
    """What vLLM would refuse minutes into the run, refused now: a KV cache (``--set
    rollout.kv_cache_bytes``) that cannot hold one sequence of an engine's context (its
    ``models.<id>.max_model_len``, else ``max_model_len``, else the model's own limit)."""
    from teamrl.rollout import sizing

    kv = int(rollout.get("kv_cache_bytes", sizing.KV_FLOOR))
    for m, folder in team.model_dirs.items():
        own = (rollout.get("models") or {}).get(m, {}).get("max_model_len")
        n = int(own or rollout.get("max_model_len") or 0) or sizing.model_limit(folder)
        try:
            sizing.check(folder, m, n, kv)
        except sizing.SizingError as e:
            raise PlanError(f"[rollout] {e}") from None


def served_models(team: Any) -> dict[str, dict[str, Any]]:
    """The vLLM engine each model of the team needs, ``{model_id: {path, max_lora_rank,
    lora_target_modules, max_model_len}}``: every model an agent runs on, trained or not (a base no agent trains
    serves no adapter). ``[rollout.models]`` of a run and ``teamrl eval`` both start these."""
    out = {}
    for m, d in team.model_dirs.items():
        base = team.bases.get(m)
        out[m] = {
            "path": str(d),
            "max_lora_rank": base.max_lora_rank if base is not None else 8,
            "lora_target_modules": list(base.target_modules) if base is not None else [],
            "max_model_len": team.contexts[m],
        }
    return out


def reward_scale(args: argparse.Namespace) -> dict[str, float]:
    """``--reward-scale verifier=10`` -> ``{"verifier": 10.0}``."""
    scale: dict[str, float] = {}
    for item in args.reward_scale or []:
        role, sep, value = item.partition("=")
        try:
            scale[role] = float(value)
        except ValueError:
            sep = ""
        if not sep or not role:
            raise PlanError(f"--reward-scale {item!r}: expected ROLE=NUMBER, e.g. verifier=10")
    return scale


def _check_reward_scale(wf: Any, args: argparse.Namespace) -> None:
    scale = reward_scale(args)
    if not scale:
        return
    roles = {a.role for a in wf.agents}
    unknown = sorted(set(scale) - roles)
    if unknown:
        raise PlanError(
            f"--reward-scale: roles {unknown} are not in workflow {wf.name!r} (roles {sorted(roles)})"
        )
    if wf.reward is None:
        raise PlanError(f"--reward-scale: workflow {wf.name!r} has no reward to scale")
    from teamrl.rollout.workflow import Workflow

    data = wf.model_dump()
    data["reward"]["kwargs"] = {**data["reward"].get("kwargs", {}), "role_scale": scale}
    try:
        Workflow.from_dict(data).reward_fn()
    except TypeError as e:
        raise PlanError(f"--reward-scale: reward {wf.reward.name!r} takes no role_scale ({e})") from None


def _apply_user_config(
    cfg: dict[str, dict[str, Any]], path: str | None, sets: list[str] | None
) -> dict[str, dict[str, Any]]:
    """``--config FILE`` ([buffer]/[learner]/[rollout] tables, merged key by key), then ``--set``."""
    out = copy.deepcopy(cfg)
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise PlanError(f"--config {path}: {e}") from None
        unknown = sorted(set(data) - set(SECTIONS) - {"run"})
        if unknown:
            raise PlanError(f"--config {path}: unknown tables {unknown} (known: run, {', '.join(SECTIONS)})")
        for sec in SECTIONS:
            if sec in data and sec not in out:
                raise PlanError(
                    f"--config {path}: [{sec}]: this workflow trains one base model (no learner groups)"
                )
            _merge(out.get(sec, {}), data.get(sec, {}))
    try:
        apply_overrides(out, [s for s in sets or []])
    except ConfigError as e:
        raise PlanError(f"--set: {e}") from None
    _streaming_min_size(cfg, out)
    _profiles_alone_budget(cfg, out)
    _probe_dtype(out)
    unknown = sorted(set(out) - set(SECTIONS))
    if unknown:
        raise PlanError(
            f"--set: unknown sections {unknown} (known: {', '.join(SECTIONS)}; run settings are flags)"
        )
    return out


def _streaming_min_size(planned: dict[str, dict[str, Any]], out: dict[str, dict[str, Any]]) -> None:
    """A streaming learner (``learner.stream_micro_batches``) trains each group as it arrives, so the
    buffer serves from one group on: ``buffer.min_size`` becomes the group size unless the user set it."""
    buf, learner = out.get("buffer", {}), out.get("learner", {})
    if learner.get("stream_micro_batches") is True and buf.get("min_size") == planned["buffer"].get(
        "min_size"
    ):
        buf["min_size"] = buf.get("group_size", buf.get("min_size"))


def _profiles_alone_budget(planned: dict[str, dict[str, Any]], out: dict[str, dict[str, Any]]) -> None:
    """A run that trains profiles alone (``learner.train_weights = false``) publishes no adapter
    version to refill the rollout's version budget (it stalled after ``max_lag + 1`` steps) and has no
    data that goes stale by version: the budget is off unless the user set it."""
    roll, learner = out.get("rollout", {}), out.get("learner", {})
    key = "max_groups_per_version"
    if learner.get("train_weights") is False and roll.get(key) == planned.get("rollout", {}).get(key):
        roll[key] = 0


def _probe_dtype(out: dict[str, dict[str, Any]]) -> None:
    """A bfloat16 learner feeding float32 rollouts publishes float32 probes, computed from the exported
    files (``learner.probe_dtype``, teamrl.learner.probe_ref), unless the user chose. bfloat16 rollouts
    are refused without an explicit ``learner.probe_atol``: their log-probs differ from any learner's by
    as much as training moves them (docs/real-model.md, "A bfloat16 learner")."""
    learner, roll = out.get("learner", {}), out.get("rollout", {})
    if roll.get("dtype", "float32") == "bfloat16":
        if not learner.get("probe_atol"):
            raise PlanError(
                "rollout.dtype = bfloat16: its log-probs cannot be probe-verified to a useful tolerance on "
                "CPU (on SmolLM2-135M they differ from the learner's by up to 0.48 nats, as much as a trained "
                "adapter moves them). Keep rollout.dtype = float32 with learner.dtype = bfloat16 (float32 "
                "probes, the strict check), or set learner.probe_atol (about 0.5; it then catches only gross "
                "faults)"
            )
        return
    # [groups.<id>] inherit [learner]'s probe_dtype, unless a group sets its own dtype
    for table in [learner, *(out.get("groups") or {}).values()]:
        if table.get("dtype") == "bfloat16" and "probe_dtype" not in table:
            table["probe_dtype"] = "float32"


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def validate(cfg: dict[str, dict[str, Any]]) -> None:
    """Each table through its service's config model (the same loader the services use)."""
    from pydantic import ValidationError

    from teamrl.learner.buffer_config import BufferConfig
    from teamrl.learner.config import LearnerConfig
    from teamrl.protocol.configfile import format_validation_error
    from teamrl.rollout.config import RolloutConfig

    tables = [("buffer", BufferConfig, cfg["buffer"]), ("rollout", RolloutConfig, cfg["rollout"])]
    groups = cfg.get("groups") or {"": {}}
    tables += [(f"groups.{g}" if g else "learner", LearnerConfig, learner_table(cfg, g)) for g in groups]
    for sec, model, table in tables:
        try:
            model.model_validate(table)
        except ValidationError as e:
            raise PlanError(format_validation_error(e, "teamrl run", prefix=sec)) from None
    b, lrn, r = cfg["buffer"], cfg["learner"], cfg["rollout"]
    if b["group_size"] != r["group_size"]:
        raise PlanError(f"buffer.group_size {b['group_size']} != rollout.group_size {r['group_size']}")
    if lrn["batch_size"] % b["group_size"]:
        raise PlanError(
            f"learner.batch_size {lrn['batch_size']} is not a multiple of group_size {b['group_size']}"
        )


def config_toml(cfg: dict[str, Any]) -> str:
    from teamrl.cli.config import to_toml

    return to_toml(cfg)
