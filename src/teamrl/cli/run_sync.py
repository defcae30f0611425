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
from teamrl.cli.trackers import start_trackers
from teamrl.protocol.timeline import Timeline


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


async def run_sync(args: argparse.Namespace, plan: RunPlan) -> int:
    """The sync loop above, for ``plan`` (``teamrl.cli.plan``): set up, train ``args.steps`` steps, finish."""
    return await SyncRun(args, plan).run()


def sync_bases(rcfg: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """The sync run's rollout config and its ``Bases``, one base whose vLLM engine is not started yet,
    built as a rollout service builds them (``teamrl.rollout.config.resolve_bases`` then ``teamrl.rollout.bases.Bases.build``)
    from the plan's ``[rollout]`` table: the context length, KV cache, dtype and adapter versions kept
    that the plan sized for the workflow (``teamrl.rollout.sizing``). A second builder once fell behind:
    the sync engine took vLLM's defaults, and SmolLM2's 8,192-token context did not fit its cache."""
    from teamrl.rollout.bases import Bases
    from teamrl.rollout.config import RolloutConfig, resolve_bases

    cfg = RolloutConfig.model_validate(rcfg)
    bases = Bases.build(resolve_bases(cfg), seed, cfg.keep_versions, cfg.kv_cache_bytes, cfg.dtype)
    if len(bases) != 1:  # several learner groups are refused before this; a frozen second base is not
        raise SystemExit(f"teamrl run --mode sync serves one base model; the plan has {sorted(bases)}")
    return cfg, bases


class SyncRun:
    """One synchronous run: the learner engine, the vLLM engine and the workflow runner in this process,
    joined by an acked ZeroMQ pair on loopback. Each method is one phase of the loop."""

    def __init__(self, args: argparse.Namespace, plan: RunPlan) -> None:
        from teamrl.learner.config import LearnerConfig
        from teamrl.learner.engine import LearnerEngine, init_distributed
        from teamrl.learner.publish import probe_reference
        from teamrl.learner.settings import EngineSettings
        from teamrl.protocol.children import start_reaper
        from teamrl.protocol.zmq_transport import ZmqDataReceiver, ZmqDataSender
        from teamrl.rollout.runner import WorkflowRunner

        start_reaper()  # no vLLM process outlives this one, however it ends (SIGKILL included)
        self.args, self.plan = args, plan
        self.run_dir = Path(args.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.t_begin = time.time()
        # one lane, "sync": where the loop's time goes (teamrl show draws it beside an async run's lanes)
        self.tl = Timeline("sync", path=self.run_dir / "timeline.jsonl")
        self.tl.enter("setup")
        (self.run_dir / "config.toml").write_text(config_toml(plan.config))
        (self.run_dir / "config.json").write_text(json.dumps({**vars(args), "model": plan.model}, indent=1))
        rcfg, self.lcfg = plan.config["rollout"], LearnerConfig.model_validate(plan.config["learner"])
        self.rng = random.Random(args.seed)
        print(f"[teamrl] run folder {self.run_dir}; model {plan.model}", flush=True)

        init_distributed("cpu")
        self.learner = LearnerEngine(
            plan.model, self.lcfg.adapters, EngineSettings.from_config(self.lcfg), device="cpu"
        )
        self.probe_ref = probe_reference(self.lcfg, self.learner)  # float32 probes of a bfloat16 learner
        self.receiver = ZmqDataReceiver("tcp://127.0.0.1:*")
        incarnation = uuid.uuid4().hex[:12]
        self.sender = ZmqDataSender(self.receiver.endpoint, incarnation)
        rollout_cfg, bases = sync_bases(rcfg, args.seed)
        self.eng = next(iter(bases.values())).engine
        self.runner = WorkflowRunner.for_rollout(rollout_cfg, bases, incarnation)  # as a rollout service's
        self.train, self.held_out = self.runner.train, self.runner.held_out_tasks(args.eval_tasks)
        # version -> (adapter folders, probes, sha256): kept while a lagged load may still need it
        self.exported: dict[int, tuple[dict[str, Path], dict[str, Any], str]] = {}
        self.lag = int(getattr(args, "policy_lag", 0))
        self.version = 0
        self.metrics_f = (self.run_dir / "metrics.jsonl").open("a")
        self.eval_f = (self.run_dir / "eval.jsonl").open("a")
        self.trackers = start_trackers(getattr(args, "logger", []), self.run_dir, plan.config)

    async def run(self) -> int:
        from teamrl.learner.service import budget_spent

        await self.eng.start()
        self.tl.enter("loop")
        print(f"[teamrl] vLLM engine up after {time.time() - self.t_begin:.0f} s", flush=True)
        self.export(0)
        await self.publish(0)
        first = last = await self.evaluate(0, 0)
        args = self.args
        for step in range(args.steps):
            await self.step(step)
            # --max-minutes: the step that passes the budget is the last (as the async learner's)
            final = step + 1 == args.steps or budget_spent(self.lcfg.max_seconds, self.t_begin)
            if self.lag and final:  # the final evaluation is of the trained adapters
                await self.publish(self.version)
            if args.eval_interval and ((step + 1) % args.eval_interval == 0 or final):
                last = await self.evaluate(step + 1, self.version if final else self.eng.version)
            if final:
                break
        await self.finish()
        print(f"[teamrl] done in {time.time() - self.t_begin:.0f} s: {summary(first, last)}", flush=True)
        return 0

    def export(self, version: int) -> None:
        """Export the learner's adapters as ``version`` with their probes (kept for a lagged load)."""
        from teamrl.learner.publish import make_probes
        from teamrl.protocol.adapters import adapters_sha256

        lcfg = self.lcfg
        folders = self.learner.export_adapters(self.run_dir / "adapters" / f"v{version}")
        probes = make_probes(self.learner, lcfg, folders, self.probe_ref)
        self.exported[version] = (folders, probes, adapters_sha256(folders))
        for old in [v for v in self.exported if v < version - self.lag]:
            del self.exported[old]

    async def publish(self, version: int) -> dict[str, Any]:
        """Load ``version`` (exported earlier) into vLLM; it must reproduce its probes first."""
        folders, probes, sha = self.exported[version]
        main_adapter = self.lcfg.adapters[0]
        main = probes[main_adapter]
        res = await self.eng.load_version(
            version,
            folders,
            main_adapter,
            main.prompt_ids,
            main.completion_ids,
            main.expected_logprobs,
            main.atol,
            more_probes=probes,
        )
        return {**res, "sha256": sha[:12]}

    async def evaluate(self, step: int, version: int) -> dict[str, float]:
        with self.tl.state("evaluate"):
            ev = await self.runner.evaluate(self.held_out)
        row = {"step": step, "time": time.time() - self.t_begin, "version": version, **ev}
        self.eval_f.write(json.dumps(row) + "\n")
        self.eval_f.flush()
        self.trackers.update()
        print(f"[teamrl] step {step} held-out: {json.dumps(ev)}", flush=True)
        return {**ev, "version": version}

    async def generate(self, step: int) -> tuple[list[Any], float]:
        """One batch of groups from vLLM, carried as Arrow over ZeroMQ and decoded on the learner side."""
        from teamrl.protocol import decode_trajectories, encode_trajectories

        t0 = time.time()
        args, rng = self.args, self.rng
        batch = rng.sample(self.train, min(args.tasks_per_step, len(self.train)))
        jobs = [(t, rng.randrange(2**31)) for t in batch for _ in range(args.group_size)]
        trajs = await asyncio.gather(
            *[self.runner.episode(t, s, group_id=f"{step}-{t['id']}") for t, s in jobs]
        )
        t_gen = time.time() - t0
        self.sender.send(encode_trajectories(list(trajs)), timeout_s=60.0)  # acked once decoded
        got: list[Any] = []
        while not got:
            self.sender.flush(0.0)
            frame = self.receiver.recv(1000)
            if frame is not None:
                got = decode_trajectories(frame.payload)
                self.receiver.ack(frame)
        self.sender.flush(2.0)
        return got, t_gen

    async def step(self, step: int) -> None:
        """Generate, train, export and load the next version (``--policy-lag k``: the one k back)."""
        from teamrl.rollout.engine import AdapterRefused

        t0 = time.time()
        with self.tl.state("generating"):
            got, t_gen = await self.generate(step)
        with self.tl.state("training"):
            res = self.learner.train_step(got, step, self.version, fresh_version=self.version)
        self.version += 1
        with self.tl.state("export"):
            self.export(self.version)
        try:  # with --policy-lag k the rollouts get version - k: the next batch is k versions stale
            with self.tl.state("publish"):
                pub = await self.publish(self.version - self.lag) if self.version - self.lag > 0 else {}
        except AdapterRefused as e:
            print(f"[teamrl] v{self.version} refused ({e.reason}): {e}", file=sys.stderr, flush=True)
            pub = {"probe_err": float("nan")}
        per_agent: dict[str, list[float]] = {}
        for t in got:
            for st in t.steps:
                per_agent.setdefault(st.agent_id, []).append(float(st.reward))
        row = {
            "step": step,
            "time": time.time() - self.t_begin,
            "version": self.version,
            "reward_mean": _mean([float(t.reward) for t in got]),
            **{f"reward/{a}": _mean(xs) for a, xs in per_agent.items()},
            "episodes": len(got),
            "gen_seconds": t_gen,
            "step_seconds": time.time() - t0,
            "probe_err": pub.get("probe_err"),
            **{k: v for k, v in res.metrics.items() if isinstance(v, (int, float))},
        }
        self.metrics_f.write(json.dumps(row) + "\n")
        self.metrics_f.flush()
        self.trackers.update()
        rewards = " ".join(f"{a} {_mean(xs):.3f}" for a, xs in per_agent.items())
        print(
            f"[teamrl] step {step + 1}/{self.args.steps} v{self.version} reward {rewards} "
            f"({time.time() - t0:.1f} s, gen {t_gen:.1f} s)",
            flush=True,
        )

    async def finish(self) -> None:
        self.tl.close()
        self.sender.close()
        self.receiver.close()
        await self.eng.close()
        self.metrics_f.close()
        self.eval_f.close()
        self.trackers.close()
        try:
            from teamrl.cli.plots import plot_run

            for p in plot_run(self.run_dir):
                print(f"[teamrl] plot {p}")
        except ImportError as e:
            print(f"[teamrl] no plots ({e})")


def summary(first: dict[str, Any], last: dict[str, Any]) -> str:
    """``held-out reward_mean 0.39 -> 0.56; solver_accuracy ...``: every metric the evaluation has."""
    skip = ("step", "time", "version", "eval_seconds")
    keys = [k for k in last if k not in skip and isinstance(last[k], (int, float))]
    parts = [
        f"{k} {first.get(k, float('nan')):.3f} -> {last[k]:.3f}" if k in first else f"{k} {last[k]:.3f}"
        for k in keys
    ]
    return f"held-out (v{first.get('version', 0)} -> v{last.get('version', '?')}): " + "; ".join(parts)
