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
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from teamrl.protocol.configfile import ConfigError, apply_overrides

EMBEDDED = ("embedded", "embedded-text")
SECTIONS = ("buffer", "learner", "rollout")


class PlanError(ValueError):
    """The run cannot start: the message names the file, agent and field (exit code 2)."""


@dataclass(frozen=True)
class RunPlan:
    team: Any  # teamrl.rollout.team.TeamPlan
    model: str
    config: dict[str, dict[str, Any]]  # [buffer], [learner], [rollout]

    @property
    def workflow(self) -> Any:
        return self.team.workflow


def resolve_model(spec: str | None, workflow_path: str = "", *, build: bool = True) -> Path:
    """The model folder: a path, ``embedded`` (the character model) or ``embedded-text`` (the BPE
    model); none given: the workflow's own ``models.<id>.path``, else ``embedded``. The embedded
    folders are built the first time (minutes) unless ``build`` is false."""
    spec = spec or workflow_path or "embedded"
    if spec in EMBEDDED:
        if spec == "embedded":
            from teamrl.learner import modelbuild as mb

            make, where = mb.build, mb.default_model_dir
        else:
            from teamrl.models import text as mb

            make, where = (lambda: mb.build_text(measure_n=20)), mb.default_text_model_dir
        if build:
            return Path(make())
        if not (where() / "config.json").is_file():
            kind = "" if spec == "embedded" else " --kind text"
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


def plan(args: argparse.Namespace, *, build: bool = True) -> RunPlan:
    """Check everything and resolve the services' tables; raises :class:`PlanError`."""
    from teamrl.rollout.team import plan_team
    from teamrl.rollout.workflow import WorkflowError

    try:
        model = resolve_model(args.model, workflow_model_path(args.workflow), build=build)
        team = plan_team(args.workflow, model, tasks_path=args.tasks or None)
        _check_reward_scale(team.workflow, args)
    except WorkflowError as e:
        hint = ""
        if "cannot encode" in str(e) and (args.model or "embedded") == "embedded":
            hint = (
                "\n  (the embedded character model reads only the addition workflows: try "
                "--model embedded-text, or --model with a Hugging Face folder)"
            )
        raise PlanError(f"{e}{hint}") from None
    cfg = resolved_config(args, team, str(model))
    cfg = _apply_user_config(cfg, args.config, args.set)
    lrn = cfg["learner"]
    if lrn.get("profile_interval") and not lrn.get("profiles"):  # LangMARL rounds start from these
        lrn["profiles"] = team.workflow.profiles()
    validate(cfg)
    return RunPlan(team, str(model), cfg)


def resolved_config(args: argparse.Namespace, team: Any, model: str) -> dict[str, dict[str, Any]]:
    """The [buffer], [learner] and [rollout] tables of this run (written to RUN/config.toml)."""
    batch = args.tasks_per_step * args.group_size
    ranks = dict(team.adapters)
    return {
        "buffer": {
            "group_size": args.group_size,
            "min_size": batch,
            "max_policy_lag": args.max_lag,
            "max_times_sampled": 1,
            "sampler": "fifo",
            "capacity": 20 * batch,
            "fsync": False,
            "checkpoint_interval_s": 0.5,
        },
        "learner": {
            "base_model": model,
            "adapters": list(ranks),
            "lora": {"target_modules": list(team.target_modules)},  # ranks: per adapter, below
            "agents": {
                a: {"rank": r, "temperature": team.temperatures[a], **team.optimiser[a]}
                for a, r in ranks.items()
            },
            "batch_size": batch,
            "micro_batch_rows": 256,
            "lr": args.lr,
            "clip_low": 0.2,
            "clip_high": 0.28,
            "algorithm": args.algorithm,
            "update_order": args.update_order,
            "max_steps": args.steps,
            "min_policy_version_lag": args.max_lag,
            "logprob_tolerance": None,
            "checkpoint_interval": args.checkpoint_interval,
            "publish_mode": "inline",
            "linger_s": 600.0,  # the launcher stops it once the final version is evaluated
            "seed": args.seed,
            "probe_prompt": list(team.probe_prompt),
            "probe_completion": list(team.probe_completion),
        },
        "rollout": {
            "model": model,
            "workflow": team.source,
            "tasks": str(Path(args.tasks).resolve()) if args.tasks else "",
            "group_size": args.group_size,
            "groups_in_flight": args.tasks_per_step,
            "num_replicas": args.rollouts,
            "seed": args.seed,
            "max_lora_rank": team.max_lora_rank,
            "lora_target_modules": list(team.target_modules),
            "eval_interval": args.eval_interval,
            "eval_tasks": args.eval_tasks,
            "reward_scale": reward_scale(args),
        },
    }


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
            _merge(out[sec], data.get(sec, {}))
    try:
        apply_overrides(out, [s for s in sets or []])
    except ConfigError as e:
        raise PlanError(f"--set: {e}") from None
    unknown = sorted(set(out) - set(SECTIONS))
    if unknown:
        raise PlanError(
            f"--set: unknown sections {unknown} (known: {', '.join(SECTIONS)}; run settings are flags)"
        )
    return out


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
    from teamrl.rollout.service import RolloutConfig

    for sec, model in (("buffer", BufferConfig), ("learner", LearnerConfig), ("rollout", RolloutConfig)):
        try:
            model.model_validate(cfg[sec])
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
    from teamrl.cli.config import _to_toml

    return _to_toml(cfg) + "\n"
