"""``teamrl eval``: a workflow's held-out avg@k and pass@k, with or without trained adapters.

    teamrl eval --adapters runs/demo/adapters/v60 --n 8 --k 1,4,8
    teamrl eval --adapters runs/demo/adapters/v60 --serve solver-lora=verifier-lora --serve verifier-lora=solver-lora
    teamrl eval --workflow addition-trio-checked --adapters embedded-v1=RUN/groups/embedded-v1/adapters/v30 \
        --adapters checker=RUN/groups/checker/adapters/v30

Samples ``n`` episodes per held-out task on vLLM (each agent at its own temperature, or every agent at
``--temperature``) and reports, over tasks, avg@n (mean success over the samples) and the unbiased
pass@k of Chen et al. 2021 (eq. 1): ``1 - C(n - c, k) / C(n, k)`` for ``c`` successes in ``n``. An
episode succeeds when its trajectory reward is at least ``--success``. Each agent's mean step reward is
reported too, and the metrics of ``teamrl.rollout.runner.evaluation_metrics`` (a verifier's balanced
accuracy and accept rate, first-try accuracy of routed teams). The workflow and the model are checked
first (``teamrl.rollout.team``); adapters are loaded the way rollouts load them: the run's probe (a
held-out prompt in the model's tokenizer), scored here with transformers + PEFT, must match vLLM's, or
the adapters are refused. A team of several base models is served by one engine per base, each loading
its own adapters. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` successes in ``n`` samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _probe_logprobs(model: str, adapter_dir: Path, prompt: list[int], completion: list[int]) -> list[float]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(adapter_dir))
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(peft(ids).logits[0].float(), -1)
    return [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(completion)]


async def _run(args: argparse.Namespace) -> dict:
    """Check the plan, start vLLM (one engine per base model), load the adapters (probe-verified),
    sample, report."""
    from teamrl.rollout.runner import WorkflowRunner

    ks = sorted({int(x) for x in args.k.split(",")})
    if ks[-1] > args.n:
        raise SystemExit(f"teamrl eval: k={ks[-1]} > n={args.n}")
    team, folders = _plan(args)
    bases = _engines(team, args.seed, args.num_tasks * args.n)
    engines = {m: b.engine for m, b in bases.items()}
    runner = WorkflowRunner(args.workflow, engines, "eval", tasks=args.tasks or "")
    tasks = runner.held_out_tasks(args.num_tasks)
    await bases.start()
    try:
        for model_id, folder in folders.items():
            await _load_adapters(engines[model_id], folder, args.serve, team.bases[model_id])
        jobs, trajs = await _sample(runner, tasks, args)
    finally:
        await bases.close()
    return _report(args, runner, ks, len(tasks), jobs, trajs)


def _engines(team: Any, seed: int, sequences: int) -> Any:
    """A vLLM engine (not started) per model the team runs on (:func:`teamrl.cli.plan.served_models`,
    as a run's rollouts start them), each on its own share of the cores, sized for the workflow's
    contexts (teamrl.rollout.sizing)."""
    from teamrl.cli.plan import kv_cache_bytes, served_models
    from teamrl.rollout.bases import Bases, ServedBase
    from teamrl.rollout.engine import EngineConfig

    plans = {
        m: ServedBase(
            m,
            e["path"],
            e["max_lora_rank"],
            tuple(e["lora_target_modules"]),
            weights="",
            start_version=0,
            max_model_len=e["max_model_len"],
        )
        for m, e in served_models(team).items()
    }
    defaults = EngineConfig(model="")
    return Bases.build(
        plans, seed=seed, keep_versions=defaults.keep_versions, kv_cache_bytes=kv_cache_bytes(team, sequences)
    )


def _plan(args: argparse.Namespace) -> tuple[Any, dict[str, Path]]:
    """The checked team (``teamrl.rollout.team``: its base models and their folders) and
    ``--adapters`` checked against it (:func:`_adapter_folders`); a problem exits naming it."""
    from teamrl.cli.plan import PlanError, resolve_models
    from teamrl.rollout.spec import WorkflowError
    from teamrl.rollout.team import plan_team

    try:
        team = plan_team(args.workflow, resolve_models(args.model, args.workflow), tasks_path=args.tasks)
    except (PlanError, WorkflowError) as e:
        raise SystemExit(f"teamrl eval: {e}") from None
    folders = _adapter_folders(args.adapters, team)
    _check_serve(args.serve, folders, team)
    return team, folders


def _adapter_folders(specs: list[str] | None, team: Any) -> dict[str, Path]:
    """``--adapters`` as {base model id: version folder}: a plain ``DIR`` for a team on one base,
    ``MODEL_ID=DIR`` per base for a team of several (``RUN/groups/<id>/adapters/vN``); a base given
    none is evaluated on its base weights. Exits naming the problem."""
    out: dict[str, Path] = {}
    for item in specs or []:
        model_id, sep, folder = item.partition("=")
        if not (sep and model_id in team.bases):
            if sep and not Path(item).exists():
                raise SystemExit(
                    f"teamrl eval: --adapters {item}: {model_id!r} is not a trained base model of workflow "
                    f"{team.workflow.name!r} ({', '.join(team.bases)})"
                )
            if len(team.bases) > 1:
                raise SystemExit(
                    f"teamrl eval: --adapters {item}: workflow {team.workflow.name!r} trains agents on "
                    f"{len(team.bases)} base models ({', '.join(team.bases)}); give MODEL_ID=DIR for each "
                    "(RUN/groups/<id>/adapters/vN)"
                )
            model_id, folder = next(iter(team.bases)), item
        if model_id in out:
            raise SystemExit(f"teamrl eval: --adapters given twice for base {model_id!r}")
        if not Path(folder).is_dir():
            raise SystemExit(f"teamrl eval: --adapters {item}: no such folder")
        out[model_id] = Path(folder)
    return out


def _check_serve(serve: list[tuple[str, str]], folders: dict[str, Path], team: Any) -> None:
    """Each ``--serve A=B`` names two adapters of one base whose folder is given."""
    for a, b in serve:
        on = [m for m, base in team.bases.items() if a in base.adapters and b in base.adapters]
        if not on or on[0] not in folders:
            raise SystemExit(
                f"teamrl eval: --serve {a}={b}: needs two adapters of one base model given by --adapters "
                f"(adapters per base: { {m: list(base.adapters) for m, base in team.bases.items()} })"
            )


async def _load_adapters(eng: Any, folder: Path, serve: list[tuple[str, str]], base: Any) -> None:
    """Load one base's adapters from ``folder`` (``--serve`` applied to the names it holds) as
    version 1, verified by the base's probe scored here with transformers + PEFT."""
    subs = {p.name: p for p in sorted(folder.iterdir()) if (p / "adapter_config.json").is_file()}
    if not subs:
        raise SystemExit(f"teamrl eval: {folder} holds no PEFT adapter folder")
    subs = _served_as(subs, [(a, b) for a, b in serve if a in subs or b in subs])
    probe = next((a for a in base.adapters if a in subs), next(iter(subs)))
    prompt, completion = list(base.probe_prompt), list(base.probe_completion)
    expected = _probe_logprobs(str(base.model_dir), subs[probe], prompt, completion)
    await eng.load_version(1, subs, probe, prompt, completion, expected, 1e-3)


async def _sample(
    runner: Any, tasks: list[dict], args: argparse.Namespace
) -> tuple[list[tuple[int, dict, int]], list[Any]]:
    """``--n`` episodes of every task at ``--temperature`` (0: greedy; unset: each agent's own, as
    the workflow samples in training): the (task index, task, sample) jobs and their trajectories."""
    if args.temperature == 0.0:
        runner.workflow = runner.greedy
    elif args.temperature is not None:
        runner.workflow = runner.workflow.with_sampling(temperature=args.temperature)
    jobs = [(i, t, s) for i, t in enumerate(tasks) for s in range(args.n)]
    trajs = await asyncio.gather(
        *[runner.episode(t, args.seed * 100_003 + 1000 * i + s, group_id=f"t{i}") for i, t, s in jobs]
    )
    return jobs, trajs


def _report(
    args: argparse.Namespace, runner: Any, ks: list[int], n_tasks: int, jobs: list, trajs: list
) -> dict:
    """avg@n and pass@k over tasks, each agent's mean step reward, the workflow's own metrics."""
    from teamrl.rollout.runner import workflow_metrics

    per_task: dict[int, list[float]] = {}
    per_agent: dict[str, list[float]] = {}
    for (i, _, _), tr in zip(jobs, trajs, strict=True):
        per_task.setdefault(i, []).append(tr.reward)
        for st in tr.steps:
            per_agent.setdefault(st.agent_id, []).append(float(st.reward))
    out: dict = {
        "workflow": runner.name,
        "adapters": ", ".join(args.adapters or []) or "(base model)",
        "serve": dict(args.serve),
        "tasks": n_tasks,
        "n": args.n,
        "temperature": "workflow" if args.temperature is None else args.temperature,
        f"avg@{args.n}": sum(sum(r >= args.success for r in rs) / args.n for rs in per_task.values())
        / len(per_task),
    }
    for k in ks:
        out[f"pass@{k}"] = sum(
            pass_at_k(args.n, sum(r >= args.success for r in rs), k) for rs in per_task.values()
        ) / len(per_task)
    for agent, xs in per_agent.items():
        out[f"reward/{agent}"] = sum(xs) / len(xs)
    extra = workflow_metrics(trajs, runner.workflow)
    out.update(
        {
            k: v
            for k, v in extra.items()
            if k.endswith(("_balanced_accuracy", "_accept_rate", "first_try_accuracy"))
        }
    )
    return out


def _served_as(subs: dict[str, Path], serve: list[tuple[str, str]]) -> dict[str, Path]:
    """The adapter folders with ``--serve NAME=OTHER`` applied: adapter NAME is served with OTHER's
    weights (every OTHER read from the folder as trained, so NAME=OTHER,OTHER=NAME swaps two)."""
    out = dict(subs)
    for name, other in serve:
        if name not in subs or other not in subs:
            raise SystemExit(f"teamrl eval: --serve {name}={other}: the folder holds {sorted(subs)}")
        out[name] = subs[other]
    return out


def _temperature(text: str) -> float:
    """``--temperature``, checked as an agent's ``[agents.sampling]`` temperature is (0 to 2, vLLM's
    range): refused before any engine starts, not by vLLM on every request."""
    from pydantic import ValidationError

    from teamrl.rollout.spec import SamplingSpec

    try:
        return SamplingSpec(temperature=text).temperature
    except ValidationError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e.errors()[0]['msg']}") from None


def _pair(text: str) -> tuple[str, str]:
    name, sep, other = text.partition("=")
    if not sep or not name or not other:
        raise argparse.ArgumentTypeError(f"expected ADAPTER=OTHER_ADAPTER, got {text!r}")
    return name, other


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="teamrl eval",
        description="Evaluate a workflow on held-out tasks with vLLM: avg@n and unbiased pass@k, per-agent rewards.",
    )
    p.add_argument("--workflow", required=True, help="workflow name (teamrl workflow list) or TOML file")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="DIR|MODEL_ID=DIR",
        help="model folder or an embedded model's name (embedded, embedded-llama, embedded-checker, "
        "embedded-text) (default: the workflow's models.<id>.path, else "
        "embedded); MODEL_ID=DIR for one model of a team of several (repeatable)",
    )
    p.add_argument(
        "--adapters",
        action="append",
        default=None,
        metavar="DIR|MODEL_ID=DIR",
        help="a version folder of PEFT adapters (RUN/adapters/vN); for a team of several base models, "
        "MODEL_ID=RUN/groups/MODEL_ID/adapters/vN per base (repeatable; a base given none runs on its "
        "base weights)",
    )
    p.add_argument(
        "--serve",
        type=_pair,
        action="append",
        default=[],
        metavar="ADAPTER=OTHER",
        help="serve ADAPTER with OTHER's trained weights (repeatable; a=b --serve b=a swaps two roles' "
        "adapters, a=b alone gives both roles b's): the role-swap ablation",
    )
    p.add_argument(
        "--tasks", default=None, help="JSONL/Parquet task file (default: the workflow's held-out split)"
    )
    p.add_argument("--num-tasks", type=int, default=200, help="held-out tasks used (default 200)")
    p.add_argument("--n", type=int, default=8, help="samples per task (default 8)")
    p.add_argument("--k", default="1,4,8", help="comma-separated k of pass@k (each <= n)")
    p.add_argument(
        "--temperature",
        type=_temperature,
        default=None,
        help="sampling temperature of every agent, 0 to 2 (0: greedy; vLLM refuses more than 2); "
        "default: each agent's own, from the workflow",
    )
    p.add_argument("--success", type=float, default=1.0, help="trajectory reward that counts as solved")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = asyncio.run(_run(args))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
