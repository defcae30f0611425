"""``teamrl run`` / ``teamrl demo``: train a workflow's agents on a model, end to end, on this machine.

    teamrl run --workflow NAME|PATH.toml [--model DIR|embedded|embedded-text|MODEL_ID=DIR ...]
               [--config run.toml] [--set section.key=value ...] [flags]

Everything workflow-specific comes from the workflow and the model folder (``teamrl.cli.plan``):
which adapters exist and their ranks, which agents share one, the tasks and their held-out split,
the reward, the LoRA target modules, the probe that verifies adapters in vLLM. Before any process
starts the run is checked (workflow against model, every number, every service table), and a
problem exits with code 2 and a message naming the file, agent and field.

Modes: ``async`` (default; ``teamrl.cli.run_async``) starts the buffer, N rollout services and M
learner ranks as separate processes over ZeroMQ; ``sync`` (``teamrl.cli.run_sync``) generates a
batch, trains, publishes, and generates again in one process, with the same components.
``teamrl demo`` is ``teamrl run --config`` the packaged ``demo.toml`` (a ``[run]`` table naming one
built-in workflow and ``runs/demo``): an example of the general path, not a special case.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import tomllib
from pathlib import Path

DEMO_CONFIG = Path(__file__).with_name("demo.toml")


def _ranks(text: str) -> str:
    """``--learners N`` or ``--learners MODEL_ID=N`` (N >= 1); the group is checked by the plan."""
    n = text.rpartition("=")[2]
    _at_least(1)(n)
    return text


def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    return parse


LOGGER_HELP = (
    "comma list of tensorboard, wandb, mlflow: the run config, learner steps and held-out evaluations "
    "also go to these trackers (wandb, mlflow: pip install 'teamrl[trackers]'; docs/trackers.md); "
    "tensorboard is --tensorboard"
)


def _loggers(text: str) -> list[str]:
    from teamrl.cli.trackers import parse_loggers

    try:
        return parse_loggers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return v


def _positive_float(text: str) -> float:
    v = _float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return v


def _non_negative_float(text: str) -> float:
    v = _float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def build_parser(
    prog: str = "teamrl run", workflow: str | None = None, run_dir: str = "runs/run"
) -> argparse.ArgumentParser:
    """The flags of ``teamrl run`` (and ``teamrl demo``), in the order ``--help`` lists them."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train a team of LLM agents: vLLM rollouts -> Arrow over ZeroMQ -> replay buffer -> "
        "DeepSpeed agent-by-agent LoRA updates -> probe-verified hot adapter load. The workflow "
        "(agents, graph, reward, adapters) and the model folder decide everything else.",
        epilog="examples:\n  teamrl run --workflow addition-duo\n"
        "  teamrl run --workflow math-trio --model embedded-text --steps 40\n"
        "  teamrl run --workflow my_team.toml --model ~/models/Qwen2.5-0.5B-Instruct --set learner.lr=1e-5\n"
        "  teamrl run --resume runs/run\n"
        "Check a workflow without running it: teamrl workflow check FILE --model DIR",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_what_to_train(p, workflow, run_dir)
    _add_training_flags(p)
    _add_process_flags(p)
    return p


def _add_what_to_train(p: argparse.ArgumentParser, workflow: str | None, run_dir: str) -> None:
    """What to train and where: workflow, model(s), tasks, config file and overrides, run folder."""
    p.add_argument(
        "--workflow",
        required=workflow is None,
        default=workflow,
        help="built-in or shipped workflow name (teamrl workflow list), or a workflow TOML file"
        + (f" (default {workflow})" if workflow else ""),
    )
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="DIR|MODEL_ID=DIR",
        help="model folder (Hugging Face layout), 'embedded' (character model, addition workflows), "
        "'embedded-llama' (the same on the Llama architecture), 'embedded-checker' (the addition checker) "
        "or 'embedded-text' (small BPE model "
        "for the text workflows); MODEL_ID=DIR gives one model of a team of different models "
        "(repeatable); default: the workflow's own models.<id>.path, else 'embedded'. The embedded "
        "models are built on first use",
    )
    p.add_argument("--tasks", default=None, help="JSONL/Parquet task file instead of the workflow's tasks")
    p.add_argument(
        "--config",
        default=None,
        help="TOML file: a [run] table of these flags' values (e.g. steps = 40) and [buffer], [learner], "
        "[rollout] tables merged over the resolved service config",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one service setting, e.g. --set learner.lr=3e-4 --set rollout.eval_tasks=50",
    )
    p.add_argument("--run-dir", default=run_dir, help=f"run folder (default {run_dir})")


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    """The training recipe: steps, batch shape, optimiser, algorithm, evaluations, seed, reward scales."""
    p.add_argument("--steps", type=_at_least(1), default=60, help="learner steps (default 60)")
    p.add_argument(
        "--max-minutes",
        type=_non_negative_float,
        default=0.0,
        metavar="M",
        help="time budget: the first learner step that ends M minutes after the run began is the last "
        "(its version is final and evaluated, as after --steps; a resumed run counts from its first "
        "start); 0 (default): --steps alone",
    )
    p.add_argument(
        "--tasks-per-step", type=_at_least(1), default=16, help="groups (tasks) per step (default 16)"
    )
    p.add_argument(
        "--group-size", type=_at_least(1), default=8, help="episodes per task, the group baseline (default 8)"
    )
    p.add_argument("--lr", type=_positive_float, default=5e-4, help="AdamW learning rate of every adapter")
    p.add_argument("--algorithm", choices=["grpo", "drmas", "dr_grpo"], default="drmas")
    p.add_argument("--update-order", choices=["sequential", "simultaneous"], default="sequential")
    p.add_argument(
        "--eval-interval", type=_at_least(0), default=10, help="held-out evaluation every N versions (0: off)"
    )
    p.add_argument("--eval-tasks", type=_at_least(1), default=200, help="held-out tasks per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reward-scale",
        metavar="ROLE=X",
        action="append",
        default=[],
        help="multiply a role's training step reward (e.g. verifier=10: agents with different reward "
        "scales, the case Dr. MAS is for); held-out evaluation is unscaled",
    )


def _add_process_flags(p: argparse.ArgumentParser) -> None:
    """How the run is laid out in processes: mode, lag, services, checkpoints, threads, security, resume."""
    p.add_argument(
        "--mode",
        choices=["async", "sync"],
        default="async",
        help="async (default): buffer, rollouts and learners as separate processes over ZeroMQ; "
        "sync: generate a batch, train, generate again, in one process",
    )
    p.add_argument(
        "--policy-lag",
        type=_at_least(0),
        default=0,
        help="sync only: generate each batch with the adapters of k versions ago, an exact, imposed "
        "staleness (the AReaL staleness experiment); 0 (default): the latest",
    )
    p.add_argument("--rollouts", type=_at_least(1), default=1, help="rollout services (async; default 1)")
    p.add_argument(
        "--learners",
        type=_ranks,
        action="append",
        default=None,
        metavar="N|MODEL_ID=N",
        help="learner ranks (async; default 1): N for every learner group, MODEL_ID=N for one group of "
        "a team of different models (repeatable)",
    )
    p.add_argument(
        "--max-lag", type=_at_least(0), default=2, help="async: drop data more than this many versions old"
    )
    p.add_argument(
        "--checkpoint-interval", type=_at_least(1), default=10, help="learner checkpoint every k steps"
    )
    p.add_argument(
        "--threads-per-service",
        type=_at_least(1),
        default=max(1, (os.cpu_count() or 2) // 2),
        help="OMP/torch threads per service process (default: half the cores)",
    )
    p.add_argument(
        "--tensorboard", action="store_true", help="async: learner metrics also as TensorBoard events"
    )
    p.add_argument("--logger", type=_loggers, default=[], metavar="NAMES", help=LOGGER_HELP)
    p.add_argument(
        "--insecure",
        action="store_true",
        help="async: no CURVE on the services' links (plaintext on loopback); by default each run gets "
        "its own keys in RUN/curve and every socket admits only them. Saved: --resume keeps it",
    )
    p.add_argument(
        "--resume",
        metavar="RUN",
        default=None,
        help="continue the async run in folder RUN with its saved settings (learner and buffer resume "
        "from their last complete checkpoints; versions never go backwards)",
    )


def parse_args(argv: list[str] | None, prog: str, workflow: str | None, run_dir: str) -> argparse.Namespace:
    """Flags over the ``[run]`` table of ``--config`` over the defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser(prog, workflow, run_dir)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--resume", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.resume:  # the saved run says which workflow
        _workflow_optional(p)
    if known.config:
        try:
            table = tomllib.loads(Path(known.config).read_text()).get("run", {})
        except (OSError, tomllib.TOMLDecodeError) as e:
            p.error(f"--config {known.config}: {e}")
        dests = {a.dest for a in p._actions}
        unknown = sorted(k for k in table if k.replace("-", "_") not in dests)
        if unknown:
            p.error(
                f"--config {known.config}: [run] has unknown keys {unknown} (flags: {sorted(dests - {'help'})})"
            )
        p.set_defaults(**{k.replace("-", "_"): v for k, v in table.items()})
        if "workflow" in table:
            _workflow_optional(p)
    args = p.parse_args(argv)
    args.tensorboard = args.tensorboard or "tensorboard" in args.logger
    return args


def _workflow_optional(p: argparse.ArgumentParser) -> None:
    for a in p._actions:
        if a.dest == "workflow":
            a.required = False


class RunFolderBusy(RuntimeError):
    """Another launcher holds the run folder (``RUN/.teamrl.lock``)."""


def hold_run_folder(run_dir: Path):
    """The open, exclusively ``flock``-ed ``RUN/.teamrl.lock`` (this launcher's pid written in it), held for
    the launcher's life: a second launcher on the same folder (an old run still draining, say) is
    refused with :class:`RunFolderBusy` rather than sharing its checkpoints and adapters. The kernel
    drops the lock when the holder dies, however it dies; closing the file releases it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".teamrl.lock"
    f = open(path, "a+")  # noqa: SIM115 - returned open: the lock lives as long as the file
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunFolderBusy(
            f"run folder {run_dir} is in use by another teamrl launcher (pid {holder}): wait for it to "
            "finish, stop it, or give another --run-dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def main(
    argv: list[str] | None = None,
    prog: str = "teamrl run",
    workflow: str | None = None,
    run_dir: str = "runs/run",
) -> int:
    args = parse_args(argv, prog, workflow, run_dir)
    if args.resume:
        run_json = Path(args.resume) / "run.json"
        if not run_json.is_file():
            print(
                f"{prog}: --resume {args.resume}: no run.json there (not an async run folder)",
                file=sys.stderr,
            )
            return 2
        saved = json.loads(run_json.read_text())
        for k, v in saved["args"].items():
            if k not in ("run_dir", "resume"):
                setattr(args, k, v)
        args.run_dir, args.mode = args.resume, "async"
    if args.policy_lag and args.mode != "sync":
        print(f"{prog}: --policy-lag needs --mode sync (an async run's lag is what it is)", file=sys.stderr)
        return 2
    from teamrl.cli.plan import PlanError, plan

    try:
        run_plan = plan(args)
    except PlanError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(f"[teamrl] {run_plan.team.summary()}", flush=True)
    if args.mode == "sync" and len(run_plan.groups) > 1:
        print(
            f"{prog}: --mode sync trains one base model; this team has {len(run_plan.groups)} "
            f"({', '.join(run_plan.groups)}): use --mode async (one learner group per base)",
            file=sys.stderr,
        )
        return 2
    try:
        held = hold_run_folder(Path(args.run_dir))
    except RunFolderBusy as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    with held:
        return _launch(args, run_plan)


def _launch(args: argparse.Namespace, run_plan) -> int:
    if args.mode == "async":
        from teamrl.cli.run_async import run_async

        return run_async(args, run_plan)
    import asyncio

    from teamrl.cli.run_sync import run_sync

    return asyncio.run(run_sync(args, run_plan))


def demo_main(argv: list[str] | None = None) -> int:
    return main(["--config", str(DEMO_CONFIG), *(argv or [])], prog="teamrl demo")


if __name__ == "__main__":
    sys.exit(main())
