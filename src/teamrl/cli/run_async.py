"""``teamrl run --mode async``: buffer, N rollout services and M learner ranks as separate processes.

They are started as ``teamrl buffer|rollout|learner`` children (``teamrl.cli.supervisor``) with one
resolved config file, ``RUN/config.toml``, and talk only over ZeroMQ on loopback ports picked here,
exactly as across a cluster::

    rollout-i --Arrow frames, acked--> buffer <--SampleRequest-- learner-0..M-1
        ^                                                             |
        +-------- WeightsPublished (PUB + latest RPC), LoRA ----------+

This process only watches: it reads ``RUN/metrics.jsonl`` (learner rank 0), ``RUN/eval.jsonl``
(rollout replica 0, every ``eval_interval`` versions) and ``RUN/buffer/stats.jsonl``, and shows them
live. When the learner has made ``steps`` updates it waits for the last held-out evaluation, then
stops everything in order (the learner checkpoints first, then rollouts drain into the still-running buffer, then the buffer). Ctrl-C or
SIGTERM does the same at once. ``--resume RUN`` starts the same services on the same folder: the
buffer reloads its last checkpoint, the learner its last complete checkpoint, and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from teamrl.cli.plots import read_jsonl
from teamrl.cli.run import reward_kwargs
from teamrl.cli.supervisor import Service, Supervisor
from teamrl.rollout.cpus import core_shares

MAX_RESTARTS = 3  # a rollout that dies (e.g. its vLLM engine) is started again this many times
STOP_ORDER = ["learner", "rollout", "buffer"]  # the learner checkpoints; rollouts drain into a live buffer


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free now (weights PUB + its latest endpoint)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        return p
    raise RuntimeError("no two adjacent free ports on 127.0.0.1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolved_config(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The [buffer], [learner] and [rollout] tables of this run (written to RUN/config.toml)."""
    batch = args.tasks_per_step * args.group_size
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
            "adapters": ["solver-lora", "verifier-lora"],
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
            "seed": args.seed,
        },
        "rollout": {
            "model": model,
            "workflow": "addition-duo",
            "group_size": args.group_size,
            "groups_in_flight": args.tasks_per_step,
            "num_replicas": args.rollouts,
            "seed": args.seed,
            "eval_interval": args.eval_interval,
            "eval_tasks": args.eval_tasks,
            "reward_scale": (reward_kwargs(args) or {}).get("role_scale", {}),
        },
    }


def _toml(cfg: dict[str, Any]) -> str:
    from teamrl.cli.config import _to_toml

    return _to_toml(cfg) + "\n"


class LiveView:
    """A rich live table on a terminal; one plain line per learner step otherwise (logs, CI)."""

    def __init__(self, total_steps: int) -> None:
        self.total = total_steps
        self.tty = sys.stdout.isatty()
        self.live: Any = None
        self.printed_step = -1
        if self.tty:
            from rich.live import Live

            self.live = Live(refresh_per_second=2, transient=False)
            self.live.start()

    def update(
        self, row: dict | None, ev: dict | None, buf: dict | None, alive: dict[str, bool], t: float
    ) -> None:
        if self.live is not None:
            from rich.table import Table

            tab = Table(title=f"teamrl run (async) - {t:.0f} s", show_header=False, min_width=60)
            step = (row or {}).get("step", -1) + 1
            tab.add_row("learner step", f"{step}/{self.total}  version v{(row or {}).get('version', 0)}")
            if row:
                tab.add_row(
                    "train reward",
                    "  ".join(
                        f"{k.split('/', 1)[1]} {v:.3f}" for k, v in row.items() if k.startswith("reward/")
                    ),
                )
                tab.add_row(
                    "step time / data wait",
                    f"{row.get('step_seconds', 0):.1f} s / {row.get('sample_wait_seconds', 0):.1f} s",
                )
                tab.add_row(
                    "version lag (mean/max)",
                    f"{row.get('version_lag_mean', 0):.2f} / {row.get('version_lag_max', 0):.0f}",
                )
            if ev:
                tab.add_row(
                    f"held-out @v{ev.get('version')}",
                    f"solver {ev.get('solver_accuracy', 0):.3f}  verifier {ev.get('verifier_accuracy', 0):.3f}",
                )
            if buf:
                tab.add_row(
                    "buffer",
                    f"size {buf.get('size')}  inserted {buf.get('inserted')}  sampled {buf.get('sampled')}",
                )
            tab.add_row("services", "  ".join(f"{n}:{'up' if a else 'DOWN'}" for n, a in alive.items()))
            self.live.update(tab)
        elif row is not None and row.get("step", -1) > self.printed_step:
            self.printed_step = row["step"]
            print(
                f"[teamrl] step {row['step'] + 1}/{self.total} v{row.get('version')} reward "
                + " ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in row.items() if k.startswith("reward/"))
                + f" (step {row.get('step_seconds', 0):.1f} s, waited {row.get('sample_wait_seconds', 0):.1f} s,"
                f" lag {row.get('version_lag_mean', 0):.2f}; buffer {buf.get('size') if buf else '?'})",
                flush=True,
            )

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def run_async(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_begin = time.time()
    if args.resume:
        saved = json.loads((run_dir / "run.json").read_text())
        keep = {"run_dir", "resume"}
        for k, v in saved["args"].items():
            if k not in keep:
                setattr(args, k, v)
        model = saved["model"]
        t0 = saved["t0"]
    else:
        if args.model:
            model = args.model
        else:
            from teamrl.learner.modelbuild import build

            model = str(build())
        t0 = t_begin
        (run_dir / "run.json").write_text(
            json.dumps({"args": vars(args), "model": model, "t0": t0}, indent=1) + "\n"
        )
        (run_dir / "config.toml").write_text(_toml(resolved_config(args, model)))
    # Fresh loopback ports every start: state lives in the run folder, not in the wiring.
    ports = {"data": free_port(), "sample": free_port(), "publish": free_port_pair()}
    ports["metrics_buffer"] = free_port()
    ports["metrics_learner"] = free_port()
    for i in range(args.rollouts):
        ports[f"metrics_rollout_{i}"] = free_port()
    cfg_path = str(run_dir / "config.toml")
    ep = {k: f"tcp://127.0.0.1:{v}" for k, v in ports.items() if not k.startswith("metrics")}
    env = {"TEAMRL_RUN_T0": str(t0), "OMP_NUM_THREADS": str(args.threads_per_service)}
    logs = run_dir / "logs"
    sup = Supervisor()
    stop_asked: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_asked.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup.start(
        Service(
            "buffer",
            [
                "buffer",
                "--config",
                cfg_path,
                "--dir",
                str(run_dir / "buffer"),
                "--bind",
                ep["data"],
                "--sample-bind",
                ep["sample"],
                "--metrics-port",
                str(ports["metrics_buffer"]),
            ],
            logs / "buffer.log",
            env,
        )
    )
    for rank in range(args.learners):
        lenv = dict(env)
        if args.learners > 1:
            lenv.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(args.learners),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(ports.setdefault("rendezvous", free_port())),
            )
        sup.start(
            Service(
                f"learner-{rank}",
                [
                    "learner",
                    "--config",
                    cfg_path,
                    "--buffer",
                    ep["sample"],
                    "--publish",
                    ep["publish"],
                    "--run-dir",
                    str(run_dir),
                    "--threads",
                    str(args.threads_per_service),
                    "--metrics-port",
                    str(ports["metrics_learner"] if rank == 0 else free_port()),
                    *(["--tensorboard", str(run_dir / "tensorboard")] if args.tensorboard else []),
                ],
                logs / f"learner-{rank}.log",
                lenv,
            )
        )
    # Rollouts on this machine get disjoint cores: left to vLLM's automatic binding, every engine
    # binds its worker to the same core(s). An operator's own VLLM_CPU_OMP_THREADS_BIND wins.
    rollout_env = [{**env, **share} for share in core_shares(args.rollouts)]
    for i in range(args.rollouts):
        extra = ["--set", f"replica={i}", "--set", f'buffer_control="{ep["sample"]}"']
        if i == 0:
            extra += [
                "--set",
                f'eval_file="{run_dir / "eval.jsonl"}"',
                "--set",
                f'samples_dir="{run_dir / "samples"}"',
            ]
        sup.start(
            Service(
                f"rollout-{i}",
                [
                    "rollout",
                    "--config",
                    cfg_path,
                    "--buffer",
                    ep["data"],
                    "--weights",
                    ep["publish"],
                    "--metrics-port",
                    str(ports.get(f"metrics_rollout_{i}", 0)),
                    *extra,
                ],
                logs / f"rollout-{i}.log",
                rollout_env[i],
            )
        )
    print(
        f"[teamrl] async run in {run_dir}: buffer, {args.learners} learner rank(s), {args.rollouts} rollout "
        f"service(s); logs in {logs}; Prometheus /metrics on ports "
        + ", ".join(f"{k[8:]} {v}" for k, v in ports.items() if k.startswith("metrics_")),
        flush=True,
    )
    view = LiveView(args.steps)
    rc = 0
    final_wait_started: float | None = None
    restarts: dict[str, int] = {}
    try:
        while True:
            time.sleep(1.0)
            rows = read_jsonl(run_dir / "metrics.jsonl")
            evals = read_jsonl(run_dir / "eval.jsonl")
            stats = read_jsonl(run_dir / "buffer" / "stats.jsonl")
            alive = {s.name: s.alive for s in sup.services}
            view.update(
                rows[-1] if rows else None,
                evals[-1] if evals else None,
                stats[-1] if stats else None,
                alive,
                time.time() - t_begin,
            )
            if stop_asked:
                print(f"[teamrl] {stop_asked[0]}: stopping all services", flush=True)
                rc = 130
                break
            dead = [s for s in sup.dead() if not (s.name.startswith("learner") and s.proc.returncode == 0)]
            for s in [
                d for d in dead if d.name.startswith("rollout") and restarts.get(d.name, 0) < MAX_RESTARTS
            ]:
                # rollouts come and go: whatever they had acked is in the buffer, the rest is resent
                # by nobody and was never counted, so a fresh incarnation simply goes on
                restarts[s.name] = restarts.get(s.name, 0) + 1
                print(
                    f"[teamrl] {s.name} exited with {s.proc.returncode}; restarting it "
                    f"({restarts[s.name]}/{MAX_RESTARTS}); last log lines:\n{s.tail(5)}",
                    file=sys.stderr,
                    flush=True,
                )
                s.start()
                dead.remove(s)
            if dead:
                for s in dead:
                    print(
                        f"[teamrl] {s.name} exited with {s.proc.returncode}; last log lines:\n{s.tail()}",
                        file=sys.stderr,
                    )
                rc = 1
                break
            learners_done = all(not s.alive for s in sup.services if s.name.startswith("learner"))
            if learners_done:
                final = rows[-1]["version"] if rows else 0
                want_eval = args.eval_interval and final % args.eval_interval == 0
                if not want_eval or any(e.get("version") == final for e in evals):
                    break
                final_wait_started = final_wait_started or time.time()
                if time.time() - final_wait_started > 120:
                    print("[teamrl] no final evaluation after 120 s; stopping", file=sys.stderr)
                    break
    finally:
        view.close()
        codes = sup.stop(timeout=60, order=STOP_ORDER)
        for s, h in old.items():
            signal.signal(s, h)
    print(f"[teamrl] services stopped: {codes}", flush=True)
    try:
        from teamrl.cli.plots import plot_run

        for p in plot_run(run_dir):
            print(f"[teamrl] plot {p}")
    except ImportError as e:
        print(f"[teamrl] no plots ({e})")
    evals = read_jsonl(run_dir / "eval.jsonl")
    if evals:
        print(
            f"[teamrl] done in {time.time() - t_begin:.0f} s: held-out solver accuracy "
            f"{evals[0].get('solver_accuracy', 0):.3f} (v{evals[0].get('version')}) -> "
            f"{evals[-1].get('solver_accuracy', 0):.3f} (v{evals[-1].get('version')})",
            flush=True,
        )
    bad = {k: v for k, v in codes.items() if v not in (0, None, -15)}
    if bad and rc == 0:
        rc = 1
    return rc


def add_async_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rollouts", type=int, default=1, help="rollout services (async mode; default 1)")
    p.add_argument("--learners", type=int, default=1, help="learner ranks (async mode; default 1)")
    p.add_argument(
        "--max-lag", type=int, default=2, help="async: drop data more than this many versions old (default 2)"
    )
    p.add_argument("--checkpoint-interval", type=int, default=10, help="learner checkpoint every k steps")
    p.add_argument(
        "--threads-per-service",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="OMP/torch threads per service process (default: half the cores)",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="async: learner metrics also as TensorBoard events in RUN/tensorboard",
    )
    p.add_argument(
        "--resume",
        metavar="RUN",
        default=None,
        help="continue the async run in folder RUN with its saved settings (learner and buffer resume "
        "from their last complete checkpoints; versions never go backwards)",
    )
