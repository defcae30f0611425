"""``teamrl run --mode sync``: generate a batch, train, publish, generate again, in one process.

The same components as the asynchronous run, one after the other, for any workflow:

1. vLLM (``teamrl.rollout.engine``) samples ``group_size`` episodes per task through the
   workflow's graph (``teamrl.rollout.runner.WorkflowRunner``); exact token ids and the sampler's
   log-probs are kept.
2. The episodes are Arrow-encoded (``teamrl.protocol``) and carried over ZeroMQ (a credit-window
   DEALER -> ROUTER pair on loopback, acked) to the learner side, which decodes them again.
3. The DeepSpeed learner (``teamrl.learner.engine``), built from the run's resolved ``[learner]``
   table exactly as a learner service builds it, updates the workflow's adapters agent by agent.
4. The adapters are exported in PEFT format with a sha256 of their files, and hot-loaded into vLLM
   under a new version, which must pass the probe (log-probs of a held-out prompt) first. With
   ``--policy-lag k`` the version loaded is the one k versions back (kept with its probes), so every
   batch is generated exactly k versions stale; the final evaluation loads the latest.
5. Every ``eval_interval`` versions the team is evaluated greedily on held-out tasks (the version
   the rollouts hold; the last evaluation, the trained adapters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from teamrl.cli.plan import RunPlan, config_toml


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


async def run_sync(args: argparse.Namespace, plan: RunPlan) -> int:
    from teamrl.learner.config import LearnerConfig
    from teamrl.learner.engine import LearnerEngine, init_distributed
    from teamrl.protocol import decode_trajectories, encode_trajectories
    from teamrl.protocol.adapters import adapters_sha256
    from teamrl.protocol.children import start_reaper
    from teamrl.protocol.control import Probe
    from teamrl.protocol.zmq_transport import ZmqDataReceiver, ZmqDataSender
    from teamrl.rollout.engine import AdapterRefused, EngineConfig, RolloutEngine
    from teamrl.rollout.runner import WorkflowRunner

    start_reaper()  # no vLLM process outlives this one, however it ends (SIGKILL included)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_begin = time.time()
    (run_dir / "config.toml").write_text(config_toml(plan.config))
    (run_dir / "config.json").write_text(json.dumps({**vars(args), "model": plan.model}, indent=1))
    rcfg, lcfg = plan.config["rollout"], LearnerConfig.model_validate(plan.config["learner"])
    rng = random.Random(args.seed)
    print(f"[teamrl] run folder {run_dir}; model {plan.model}", flush=True)

    init_distributed("cpu")
    learner = LearnerEngine(plan.model, lcfg.adapters, lcfg.engine_settings(), device="cpu")
    probe_adapter = lcfg.adapters[0]
    receiver = ZmqDataReceiver("tcp://127.0.0.1:*")
    incarnation = uuid.uuid4().hex[:12]
    sender = ZmqDataSender(receiver.endpoint, incarnation)

    eng = RolloutEngine(
        EngineConfig(
            model=plan.model,
            seed=args.seed,
            max_lora_rank=rcfg["max_lora_rank"],
            lora_target_modules=tuple(rcfg["lora_target_modules"]),
        )
    )
    scale = rcfg["reward_scale"]
    runner = WorkflowRunner(
        rcfg["workflow"],
        eng,
        incarnation,
        tasks=rcfg["tasks"],
        reward_kwargs={"role_scale": scale} if scale else None,
    )
    train, held_out = runner.train, runner.held_out_tasks(args.eval_tasks)
    await eng.start()
    print(f"[teamrl] vLLM engine up after {time.time() - t_begin:.0f} s", flush=True)

    exported: dict[int, tuple[dict[str, Path], dict[str, Any], str]] = {}
    lag = int(getattr(args, "policy_lag", 0))

    def export(version: int) -> None:
        """Export the learner's adapters as ``version`` with their probes (kept for a lagged load)."""
        folder = run_dir / "adapters" / f"v{version}"
        folders = learner.export_adapters(folder)
        probes = {
            a: Probe(
                prompt_ids=lcfg.probe_prompt,
                completion_ids=lcfg.probe_completion,
                expected_logprobs=learner.completion_logprobs(a, lcfg.probe_prompt, lcfg.probe_completion),
                atol=1e-3,
            )
            for a in lcfg.adapters
        }
        exported[version] = (folders, probes, adapters_sha256(folders))
        for old in [v for v in exported if v < version - lag]:
            del exported[old]

    async def publish(version: int) -> dict[str, Any]:
        """Load ``version`` (exported earlier) into vLLM; it must reproduce its probes first."""
        folders, probes, sha = exported[version]
        main = probes[probe_adapter]
        res = await eng.load_version(
            version,
            folders,
            probe_adapter,
            main.prompt_ids,
            main.completion_ids,
            main.expected_logprobs,
            main.atol,
            more_probes=probes,
        )
        return {**res, "sha256": sha[:12]}

    metrics_f = (run_dir / "metrics.jsonl").open("a")
    eval_f = (run_dir / "eval.jsonl").open("a")

    async def evaluate(step: int, version: int) -> dict[str, float]:
        ev = await runner.evaluate(held_out)
        eval_f.write(
            json.dumps({"step": step, "time": time.time() - t_begin, "version": version, **ev}) + "\n"
        )
        eval_f.flush()
        print(f"[teamrl] step {step} held-out: {json.dumps(ev)}", flush=True)
        return {**ev, "version": version}

    version = 0
    export(version)
    await publish(version)
    first = last = await evaluate(0, 0)
    for step in range(args.steps):
        t0 = time.time()
        batch = rng.sample(train, min(args.tasks_per_step, len(train)))
        jobs = [(t, rng.randrange(2**31)) for t in batch for _ in range(args.group_size)]
        trajs = list(
            await asyncio.gather(*[runner.episode(t, s, group_id=f"{step}-{t['id']}") for t, s in jobs])
        )
        t_gen = time.time() - t0
        sender.send(encode_trajectories(trajs), timeout_s=60.0)  # Arrow over ZeroMQ, acked once decoded
        got: list[Any] = []
        while not got:
            sender.flush(0.0)
            frame = receiver.recv(1000)
            if frame is not None:
                got = decode_trajectories(frame.payload)
                receiver.ack(frame)
        sender.flush(2.0)
        res = learner.train_step(got, step, version, fresh_version=version)
        version += 1
        export(version)
        try:  # with --policy-lag k the rollouts get version - k: the next batch is k versions stale
            pub = await publish(version - lag) if version - lag > 0 else {}
        except AdapterRefused as e:
            print(f"[teamrl] v{version} refused ({e.reason}): {e}", file=sys.stderr, flush=True)
            pub = {"probe_err": float("nan")}
        per_agent: dict[str, list[float]] = {}
        for t in got:
            for st in t.steps:
                per_agent.setdefault(st.agent_id, []).append(float(st.reward))
        row = {
            "step": step,
            "time": time.time() - t_begin,
            "version": version,
            "reward_mean": _mean([float(t.reward) for t in got]),
            **{f"reward/{a}": _mean(xs) for a, xs in per_agent.items()},
            "episodes": len(got),
            "gen_seconds": t_gen,
            "step_seconds": time.time() - t0,
            "probe_err": pub.get("probe_err"),
            **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float))},
        }
        metrics_f.write(json.dumps(row) + "\n")
        metrics_f.flush()
        rewards = " ".join(f"{a} {_mean(xs):.3f}" for a, xs in per_agent.items())
        print(
            f"[teamrl] step {step + 1}/{args.steps} v{version} reward {rewards} "
            f"({time.time() - t0:.1f} s, gen {t_gen:.1f} s)",
            flush=True,
        )
        if lag and step + 1 == args.steps:  # the final evaluation is of the trained adapters
            await publish(version)
        if args.eval_interval and ((step + 1) % args.eval_interval == 0 or step + 1 == args.steps):
            last = await evaluate(step + 1, version if step + 1 == args.steps else eng.version)
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
    print(f"[teamrl] done in {time.time() - t_begin:.0f} s: {summary(first, last)}", flush=True)
    return 0


def summary(first: dict[str, Any], last: dict[str, Any]) -> str:
    """``held-out reward_mean 0.39 -> 0.56; solver_accuracy ...``: every metric the evaluation has."""
    skip = ("step", "time", "version", "eval_seconds")
    keys = [k for k in last if k not in skip and isinstance(last[k], (int, float))]
    parts = [
        f"{k} {first.get(k, float('nan')):.3f} -> {last[k]:.3f}" if k in first else f"{k} {last[k]:.3f}"
        for k in keys
    ]
    return f"held-out (v{first.get('version', 0)} -> v{last.get('version', '?')}): " + "; ".join(parts)
