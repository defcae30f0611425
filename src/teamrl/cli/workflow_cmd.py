"""``teamrl workflow list|schema|check|plan``: the workflows, their fields, and a check before a run.

    teamrl workflow list                         # built-in and shipped names, with their agents
    teamrl workflow schema                       # every field of a workflow TOML, with its meaning
    teamrl workflow check FILE|NAME --model DIR  # what `teamrl run` checks first, in under a second
    teamrl workflow plan FILE|NAME --model DIR   # the [buffer]/[learner]/[rollout] tables a run uses

``check`` and ``plan`` never start a process or load weights: the workflow is validated, then read
against the model folder's tokenizer and weight names (``teamrl.rollout.team.plan_team``). Exit
code 0 when the workflow can be trained, 2 (with the file, agent and field) when it cannot.
"""

from __future__ import annotations

import argparse
import sys
import time
import typing
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="teamrl workflow", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sub.add_parser("list", help="built-in and shipped workflows")
    sub.add_parser("schema", help="every field of a workflow TOML, with its type, default and meaning")
    for name, help_ in (
        ("check", "check a workflow against a model folder (what teamrl run does first)"),
        ("plan", "print the resolved [buffer]/[learner]/[rollout] tables for the three-service route"),
    ):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("workflow", help="workflow name or TOML file")
        sp.add_argument(
            "--model",
            default=None,
            help="model folder or an embedded model's name (embedded, embedded-llama, embedded-checker, "
            "embedded-text; must be built already)",
        )
        sp.add_argument("--tasks", default=None, help="JSONL/Parquet task file instead of the workflow's")
        if name == "plan":
            from teamrl.cli.run import build_parser as run_parser

            for (
                action
            ) in run_parser()._actions:  # the run's numbers (steps, group size, ...) shape the tables
                if action.dest in ("help", "workflow", "model", "tasks", "resume", "mode", "run_dir"):
                    continue
                sp._add_action(action)
    return p


def _list() -> int:
    from teamrl.rollout import workflows

    for name in workflows.names():
        wf = workflows.load(name)
        agents = ", ".join(f"{a.id}({a.adapter or 'base'})" for a in wf.agents)
        print(f"{name:22s} {wf.graph.kind:8s} {agents}  - {wf.description}")
    return 0


def schema_text() -> str:
    """The workflow TOML reference, generated from the definition's own field descriptions."""
    from pydantic import BaseModel

    from teamrl.rollout.workflow import Workflow

    lines = [
        "A workflow TOML (teamrl.rollout.workflow.Workflow). Tables and fields; [[agents]] repeats.",
        "Dynamic graphs act one agent at a time (a router picks who is next); static graphs run",
        "their DAG level by level, and the nodes of one level are generated in parallel.",
    ]
    seen: set[type] = set()

    def models_in(ann: Any) -> list[type[BaseModel]]:
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return [ann]
        return [m for a in typing.get_args(ann) for m in models_in(a)]

    def walk(model: type[BaseModel], path: str) -> None:
        if model in seen:
            return
        seen.add(model)
        lines.append("")
        lines.append(f"[{path}]" if path else "(top level)")
        doc = (model.__doc__ or "").strip().splitlines()
        if doc and path:
            lines.append(f"  # {doc[0]}")
        subs = []
        for name, f in model.model_fields.items():
            inner = models_in(f.annotation)
            default = (
                "required" if f.is_required() else f"default {f.get_default(call_default_factory=True)!r}"
            )
            desc = f" - {f.description}" if f.description else ""
            lines.append(f"  {name}: {_type_name(f.annotation)} ({default}){desc}")
            for m in inner:
                subs.append((m, f"{path}.{name}" if path else name))
        for m, sub_path in subs:
            walk(m, sub_path)

    walk(Workflow, "")
    return "\n".join(lines)


def _type_name(ann: Any) -> str:
    text = getattr(ann, "__name__", None) if not typing.get_args(ann) else None
    return text or str(ann).replace("typing.", "")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "list":
        return _list()
    if args.action == "schema":
        print(schema_text())
        return 0
    from teamrl.cli.plan import PlanError, config_toml, plan, resolve_models
    from teamrl.rollout.spec import WorkflowError
    from teamrl.rollout.team import plan_team

    t0 = time.perf_counter()
    try:
        if args.action == "plan":
            resolved = plan(args, build=False)
            print(config_toml(resolved.config), end="")
            return 0
        model = resolve_models(args.model, args.workflow, build=False)
        team = plan_team(args.workflow, model, tasks_path=args.tasks)
    except (PlanError, WorkflowError) as e:
        print(f"teamrl workflow {args.action}: {e}", file=sys.stderr)
        return 2
    print(f"ok ({time.perf_counter() - t0:.2f} s): {team.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
