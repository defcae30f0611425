"""``teamrl run`` / ``teamrl demo``: the solver-verifier team trained end to end on this machine.

What runs today is the **sync** loop in one process, with every component real:

1. vLLM (``teamrl.rollout.engine``) samples ``group_size`` episodes per task. An episode is a Flex-MG
   graph of two agent steps: the solver answers ``S07+45=``; the verifier, whose step depends on the
   solver's (``parents=[0]``), judges ``V07+45=052?``. Exact token ids and the sampler's log-probs are kept.
2. The episodes are Arrow-encoded (``teamrl.protocol``) and carried over ZeroMQ (a credit-window
   DEALER -> ROUTER pair on loopback, acked) into the learner side, which decodes them again.
3. The DeepSpeed learner (``teamrl.learner.engine``) recomputes log-probs, computes Dr. MAS agent-wise
   advantages and updates the two LoRA adapters agent by agent (HAPPO-corrected).
4. The adapters are exported in PEFT format, packed as a deterministic payload with a sha256, and
   hot-loaded into vLLM under a new version, which must pass the learner's log-prob probe first.
5. Every ``eval_interval`` steps the team is evaluated greedily on held-out tasks.

The separate-process asynchronous topology (buffer, N rollout services, M learner ranks) is the
target of the same components; this command is the honest smallest end-to-end loop that exists.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from teamrl.rollout.runner import ADAPTERS, EOS_ID, SOLVER, decode, encode  # noqa: F401 (re-exported)


@dataclass
class RunSettings:
    steps: int = 60
    tasks_per_step: int = 16
    group_size: int = 8
    lr: float = 5e-4
    algorithm: str = "drmas"
    update_order: str = "sequential"
    eval_interval: int = 10
    eval_tasks: int = 200
    seed: int = 0
    temperature: float = 1.0


def build_parser(prog: str = "teamrl run") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train the solver-verifier team on the embedded model: vLLM rollouts -> Arrow over "
        "ZeroMQ -> DeepSpeed agent-by-agent LoRA updates -> verified hot adapter load (sync mode).",
    )
    d = RunSettings()
    p.add_argument(
        "--run-dir", default="runs/demo", help="run folder (metrics.jsonl, eval.jsonl, adapters, plots)"
    )
    p.add_argument("--model", default=None, help="model folder (default: build/use the embedded model)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"learner steps (default {d.steps})")
    p.add_argument("--tasks-per-step", type=int, default=d.tasks_per_step)
    p.add_argument("--group-size", type=int, default=d.group_size, help="episodes per task (group baseline)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate of both adapters")
    p.add_argument("--algorithm", choices=["grpo", "drmas", "dr_grpo"], default=d.algorithm)
    p.add_argument("--update-order", choices=["sequential", "simultaneous"], default=d.update_order)
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--eval-tasks", type=int, default=d.eval_tasks)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--reward-scale",
        metavar="ROLE=X",
        action="append",
        default=[],
        help="multiply a role's training step reward (e.g. verifier=10: agents with different reward "
        "scales, the case Dr. MAS is for); held-out evaluation is unscaled",
    )
    p.add_argument(
        "--mode",
        choices=["async", "sync"],
        default="async",
        help="async (default): buffer, rollouts and learners as separate processes over ZeroMQ; "
        "sync: generate a batch, train, generate again, in one process",
    )
    from teamrl.cli.run_async import add_async_arguments

    add_async_arguments(p)
    return p


async def _run(args: argparse.Namespace) -> int:
    import numpy as np

    from teamrl.learner.engine import AdapterSettings, LearnerEngine, init_distributed
    from teamrl.learner.modelbuild import build
    from teamrl.protocol import decode_trajectories, encode_trajectories
    from teamrl.protocol.adapters import folder_payload, payload_sha256
    from teamrl.protocol.zmq_transport import ZmqDataReceiver, ZmqDataSender
    from teamrl.rewards import addition
    from teamrl.rollout.engine import AdapterRefused, EngineConfig, RolloutEngine
    from teamrl.rollout.runner import WorkflowRunner

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_begin = time.time()
    model = Path(args.model) if args.model else build()
    (run_dir / "config.json").write_text(json.dumps({**vars(args), "model": str(model)}, indent=1))
    train, held_out = addition.split_tasks(seed=0)
    held_out = held_out[: args.eval_tasks]
    rng = random.Random(args.seed)
    print(f"[teamrl] run folder {run_dir}; model {model}", flush=True)

    init_distributed("cpu")
    settings = AdapterSettings(lr=args.lr, clip_low=0.2, clip_high=0.28)
    learner = LearnerEngine(
        model,
        list(ADAPTERS.values()),
        adapter_settings={a: settings for a in ADAPTERS.values()},
        algorithm=args.algorithm,
        update_order=args.update_order,
        micro_batch_rows=256,
        seed=args.seed,
        logprob_tolerance=None,
    )
    probe_prompt, probe_completion = encode("S01+23="), [2, 4, 6, EOS_ID]

    receiver = ZmqDataReceiver("tcp://127.0.0.1:*")
    incarnation = uuid.uuid4().hex[:12]
    sender = ZmqDataSender(receiver.endpoint, incarnation)

    eng = RolloutEngine(EngineConfig(model=str(model), seed=args.seed))
    runner = WorkflowRunner("addition-duo", eng, incarnation, reward_kwargs=reward_kwargs(args))
    await eng.start()
    print(f"[teamrl] vLLM engine up after {time.time() - t_begin:.0f} s", flush=True)

    async def publish(version: int) -> dict[str, float]:
        folders = learner.export_adapters(run_dir / "adapters" / f"v{version}")
        sha = payload_sha256(folder_payload(run_dir / "adapters" / f"v{version}"))
        expected = learner.completion_logprobs(ADAPTERS[SOLVER], probe_prompt, probe_completion)
        res = await eng.load_version(
            version, folders, ADAPTERS[SOLVER], probe_prompt, probe_completion, expected, 1e-3
        )
        return {**res, "sha256": sha[:12]}

    metrics_f = (run_dir / "metrics.jsonl").open("a")
    eval_f = (run_dir / "eval.jsonl").open("a")

    version = 0
    await publish(version)
    ev = await runner.evaluate(held_out)
    eval_f.write(json.dumps({"step": 0, "time": time.time() - t_begin, "version": 0, **ev}) + "\n")
    eval_f.flush()
    print(f"[teamrl] step 0 held-out: {json.dumps(ev)}", flush=True)
    first_eval = ev["reward_mean"]
    for step in range(args.steps):
        t0 = time.time()
        batch = rng.sample(train, args.tasks_per_step)
        jobs = []
        for t in batch:
            for _k in range(args.group_size):
                jobs.append((t, rng.randrange(2**31)))
        trajs = list(
            await asyncio.gather(*[runner.episode(t, s, group_id=f"{step}-{t['id']}") for t, s in jobs])
        )
        t_gen = time.time() - t0
        # Arrow over ZeroMQ, acked once decoded on the learner side.
        sender.send(encode_trajectories(trajs))
        got = []
        while not got:
            sender.flush(0.0)
            frame = receiver.recv(1000)
            if frame is not None:
                got = decode_trajectories(frame.payload)
                receiver.ack(frame)
        sender.flush(2.0)
        res = learner.train_step(got, step, version, fresh_version=version)
        version += 1
        try:
            pub = await publish(version)
        except AdapterRefused as e:
            print(f"[teamrl] v{version} refused ({e.reason}): {e}", file=sys.stderr, flush=True)
            pub = {"probe_err": float("nan")}
        r_s = float(np.mean([t.steps[0].reward for t in got]))
        r_v = float(np.mean([t.steps[1].reward for t in got]))
        row = {
            "step": step,
            "time": time.time() - t_begin,
            "version": version,
            "reward_mean": r_s,
            "reward/solver": r_s,
            "reward/verifier": r_v,
            "episodes": len(got),
            "gen_seconds": t_gen,
            "step_seconds": time.time() - t0,
            "probe_err": pub.get("probe_err"),
            **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float))},
        }
        metrics_f.write(json.dumps(row) + "\n")
        metrics_f.flush()
        print(
            f"[teamrl] step {step + 1}/{args.steps} v{version} reward solver {r_s:.3f} verifier {r_v:.3f} "
            f"({time.time() - t0:.1f} s, gen {t_gen:.1f} s)",
            flush=True,
        )
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.steps:
            ev = await runner.evaluate(held_out)
            eval_f.write(
                json.dumps({"step": step + 1, "time": time.time() - t_begin, "version": version, **ev}) + "\n"
            )
            eval_f.flush()
            print(f"[teamrl] step {step + 1} held-out: {json.dumps(ev)}", flush=True)
    sender.close()
    receiver.close()
    await eng.close()
    metrics_f.close()
    eval_f.close()
    try:
        from teamrl.cli.plots import plot_run

        for p in plot_run(run_dir):
            print(f"[teamrl] plot {p}")
    except ImportError as e:
        print(f"[teamrl] no plots ({e})")
    print(
        f"[teamrl] done in {time.time() - t_begin:.0f} s: held-out solver accuracy {first_eval:.3f} -> "
        f"{ev['reward_mean']:.3f}; verifier accuracy -> {ev['verifier_accuracy']:.3f}",
        flush=True,
    )
    return 0


def reward_kwargs(args: argparse.Namespace) -> dict | None:
    """``--reward-scale verifier=10`` -> ``{"role_scale": {"verifier": 10.0}}`` (None when not given)."""
    scale = {}
    for item in args.reward_scale or []:
        role, sep, value = item.partition("=")
        try:
            scale[role] = float(value)
        except ValueError:
            sep = ""
        if not sep or not role:
            raise SystemExit(f"teamrl run: --reward-scale {item!r}: expected ROLE=NUMBER, e.g. verifier=10")
    return {"role_scale": scale} if scale else None


def main(argv: list[str] | None = None, prog: str = "teamrl run") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.resume:
        run_json = Path(args.resume) / "run.json"
        if not run_json.is_file():
            print(
                f"{prog}: --resume {args.resume}: no run.json there (not an async run folder)",
                file=sys.stderr,
            )
            return 2
        args.run_dir = args.resume
        args.mode = "async"
    if args.mode == "async":
        from teamrl.cli.run_async import run_async

        return run_async(args)
    return asyncio.run(_run(args))


def demo_main(argv: list[str] | None = None) -> int:
    return main(argv, prog="teamrl demo")


if __name__ == "__main__":
    sys.exit(main())
