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
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from teamrl.cli.plan import RunPlan, config_toml, learner_ranks
from teamrl.cli.plots import group_dir, read_jsonl
from teamrl.cli.run_sync import summary
from teamrl.cli.supervisor import Service, Supervisor
from teamrl.cli.trackers import RunTrackers, start_trackers
from teamrl.protocol.ports import free_port
from teamrl.rollout.cpus import core_shares

MAX_RESTARTS = 3  # a service that dies is started again this many times (each service its own budget)
CONFIG_RC = 2  # a service's exit code for a bad config or usage: a restart cannot fix it, so none is tried
FINAL_EVAL_WAIT_S = 300.0  # a rollout restarted near the end needs its vLLM start-up before it can evaluate
STOP_ORDER = ["learner", "rollout", "buffer"]  # the learner checkpoints; rollouts drain into a live buffer


class LiveView:
    """A rich live table on a terminal; one plain line per learner step otherwise (logs, CI). A team
    of different models shows each learner group's step, version, lag and step time."""

    def __init__(self, total_steps: int) -> None:
        self.total = total_steps
        self.tty = sys.stdout.isatty()
        self.live: Any = None
        self.printed_step: dict[str, int] = {}
        if self.tty:
            from rich.live import Live

            self.live = Live(refresh_per_second=2, transient=False)
            self.live.start()

    def update(
        self,
        rows: dict[str, dict | None],
        ev: dict | None,
        buf: dict | None,
        alive: dict[str, bool],
        t: float,
    ) -> None:
        """``rows``: each learner group's last metrics row ("" for a one-base team)."""
        if self.live is not None:
            from rich.table import Table

            tab = Table(title=f"teamrl run (async) - {t:.0f} s", show_header=False, min_width=60)
            for g, row in rows.items():
                who = f" {g}" if g else ""
                step = (row or {}).get("step", -1) + 1
                tab.add_row(
                    f"learner{who} step", f"{step}/{self.total}  version v{(row or {}).get('version', 0)}"
                )
                if row:
                    tab.add_row(f"train reward{who}", _rewards(row))
                    tab.add_row(
                        f"step time / data wait{who}",
                        f"{row.get('step_seconds', 0):.1f} s / {row.get('sample_wait_seconds', 0):.1f} s",
                    )
                    tab.add_row(
                        f"version lag (mean/max){who}",
                        f"{row.get('version_lag_mean', 0):.2f} / {row.get('version_lag_max', 0):.0f}",
                    )
            if ev:
                tab.add_row(f"held-out @v{ev.get('version')}", held_out_line(ev))
            if buf:
                tab.add_row(
                    "buffer",
                    f"size {buf.get('size')}  inserted {buf.get('inserted')}  sampled {buf.get('sampled')}",
                )
            tab.add_row("services", "  ".join(f"{n}:{'up' if a else 'DOWN'}" for n, a in alive.items()))
            self.live.update(tab)
            return
        for g, row in rows.items():
            if row is None or row.get("step", -1) <= self.printed_step.get(g, -1):
                continue
            self.printed_step[g] = row["step"]
            print(
                f"[teamrl] {g + ' ' if g else ''}step {row['step'] + 1}/{self.total} v{row.get('version')} "
                f"reward {_rewards(row)} (step {row.get('step_seconds', 0):.1f} s, waited "
                f"{row.get('sample_wait_seconds', 0):.1f} s, lag {row.get('version_lag_mean', 0):.2f}; "
                f"buffer {buf.get('size') if buf else '?'})",
                flush=True,
            )

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def _rewards(row: dict) -> str:
    return "  ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in row.items() if k.startswith("reward/"))


def held_out_line(ev: dict) -> str:
    """Every number of an evaluation row (the workflow decides which: team reward, each agent's)."""
    skip = {"step", "time", "version"}
    return "  ".join(
        f"{k.removesuffix('_accuracy')} {v:.3f}"
        for k, v in ev.items()
        if k not in skip and isinstance(v, (int, float))
    )


def transport_table(args: argparse.Namespace, run_dir: Path) -> dict[str, dict[str, Any]]:
    """The ``[transport]`` table of ``RUN/config.toml``: CURVE on every link with the run's own keys
    in ``RUN/curve`` (made on the first start, kept on ``--resume``), or nothing with ``--insecure``
    (services then talk plaintext). docs/transport-security.md; ``teamrl.protocol.curve``."""
    if getattr(args, "insecure", False):
        print("[teamrl] --insecure: services talk plaintext (no CURVE)", flush=True)
        return {}
    from teamrl.protocol.curve import ROLES, generate_run_keys

    keys = run_dir / "curve"
    if not all((keys / f"{r}.{ext}").is_file() for r in ROLES for ext in ("pub", "key")):
        generate_run_keys(keys)
    print(f"[teamrl] CURVE on every link; this run's keys are in {keys}", flush=True)
    return {"transport": {"curve": True, "curve_dir": str(keys.resolve())}}


def signal_exit_code(name: str) -> int:
    """The shell's convention for a process ended by signal ``name``: 128 + its number (SIGTERM 143,
    SIGINT, i.e. Ctrl-C, 130). The run stopped on request, cleanly, and says which request it was."""
    return 128 + int(signal.Signals[name])


def insecure_flag(args: argparse.Namespace) -> list[str]:
    """``--insecure`` for a service of an ``--insecure`` run (its config has no keys, and a service
    without keys refuses to start unless told); nothing otherwise."""
    return ["--insecure"] if getattr(args, "insecure", False) else []


@dataclass
class Wiring:
    """Where this start's services meet: loopback ports picked fresh every start (state lives in the
    run folder, not in the wiring), and the endpoints built from them. Each learner group has its
    own weights endpoint (``publish`` / ``publish_<group>``) and metrics port."""

    ports: dict[str, int]

    @classmethod
    def pick(cls, rollouts: int, groups: list[str] | tuple[str, ...] = ("",)) -> Wiring:
        ports = {"data": free_port(), "sample": free_port()}
        for g in groups:
            ports[_named("publish", g)] = free_port(2)
        ports["metrics_buffer"] = free_port()
        for g in groups:
            ports[_named("metrics_learner", g)] = free_port()
        for i in range(rollouts):
            ports[f"metrics_rollout_{i}"] = free_port()
        return cls(ports)

    def endpoint(self, name: str) -> str:
        return f"tcp://127.0.0.1:{self.ports[name]}"

    @property
    def metrics(self) -> dict[str, int]:
        return {k.removeprefix("metrics_"): v for k, v in self.ports.items() if k.startswith("metrics_")}


def _named(what: str, group: str) -> str:
    """``what`` for a one-base team, ``what_<group>`` for a learner group of a team of several."""
    return f"{what}_{group}" if group else what


def prepare_run_dir(args: argparse.Namespace, plan: RunPlan, run_dir: Path, wiring: Wiring) -> float:
    """Write run.json (arguments, model, start time t0; this start's metrics ports) and the resolved
    config.toml; returns t0 (kept from the first start on ``--resume``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.resume:  # the saved args were restored by teamrl.cli.run.main; the plan is remade from them
        saved = json.loads((run_dir / "run.json").read_text())
    else:
        saved = {"args": vars(args), "model": plan.model, "t0": time.time()}
    (run_dir / "config.toml").write_text(config_toml({**plan.config, **transport_table(args, run_dir)}))
    saved["metrics_ports"] = wiring.metrics  # this start's ports (dashboards)
    (run_dir / "run.json").write_text(json.dumps(saved, indent=1) + "\n")
    return float(saved["t0"])


RENDEZVOUS_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def plan_services(
    args: argparse.Namespace, run_dir: Path, wiring: Wiring, t0: float, groups: list[str] | None = None
) -> list[Service]:
    """The services of this start, in start order: the buffer, each learner group's ranks, the
    rollouts. ``groups``: the learner groups ([""]: one base model). Pure: nothing is started,
    nothing is written."""
    groups = groups or [""]
    cfg_path = str(run_dir / "config.toml")
    env = {
        "TEAMRL_RUN_T0": str(t0),
        "OMP_NUM_THREADS": str(args.threads_per_service),
        "TEAMRL_TIMELINE": str(run_dir / "timeline.jsonl"),  # every service's states (teamrl show)
    }
    logs = run_dir / "logs"
    ep = wiring.endpoint
    sec = insecure_flag(args)
    out = [
        Service(
            "buffer",
            ["buffer", "--config", cfg_path, "--dir", str(run_dir / "buffer"), "--bind", ep("data")]
            + ["--sample-bind", ep("sample"), "--metrics-port", str(wiring.ports["metrics_buffer"]), *sec],
            logs / "buffer.log",
            env,
        )
    ]
    ranks = learner_ranks(args.learners, groups)
    for g in groups:
        out += _learner_group(args, run_dir, wiring, env, g, ranks[g])
    # Rollouts on this machine get disjoint cores: left to vLLM's automatic binding, every engine
    # binds its worker to the same core(s). An operator's own VLLM_CPU_OMP_THREADS_BIND wins.
    rollout_env = [{**env, **share} for share in core_shares(args.rollouts)]
    weights: list[str] = []
    for g in groups:
        weights += ["--weights", f"{g}={ep(_named('publish', g))}" if g else ep("publish")]
        resumed_at = max(
            [0, *(int(r.get("version", 0)) for r in read_jsonl(group_dir(run_dir, g) / "metrics.jsonl"))]
        )
        if resumed_at:  # the learner re-announces this version at start; older weights would be wasted
            key = f"models.{g}.start_version" if g else "start_version"
            weights += ["--set", f"{key}={resumed_at}"]
    for i in range(args.rollouts):
        extra = ["--set", f"replica={i}", "--set", f'buffer_control="{ep("sample")}"']
        if i == 0:
            extra += ["--set", f'eval_file="{run_dir / "eval.jsonl"}"']
            extra += ["--set", f'samples_dir="{run_dir / "samples"}"']
        argv = ["rollout", "--config", cfg_path, "--buffer", ep("data"), *weights]
        argv += ["--metrics-port", str(wiring.ports.get(f"metrics_rollout_{i}", 0)), *extra, *sec]
        out.append(Service(f"rollout-{i}", argv, logs / f"rollout-{i}.log", rollout_env[i]))
    return out


def _learner_group(
    args: argparse.Namespace, run_dir: Path, wiring: Wiring, env: dict[str, str], group: str, n: int
) -> list[Service]:
    """The ``n`` ranks of one learner group: data-parallel among themselves (their own rendezvous),
    their own weights endpoint, metrics port and folder."""
    cfg_path = str(run_dir / "config.toml")
    out = []
    for rank in range(n):
        lenv = dict(env)
        if n > 1:
            lenv.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(wiring.ports.setdefault(_named("rendezvous", group), free_port())),
            )
        metrics = wiring.ports[_named("metrics_learner", group)] if rank == 0 else free_port()
        argv = ["learner", "--config", cfg_path, "--buffer", wiring.endpoint("sample")]
        argv += ["--publish", wiring.endpoint(_named("publish", group))]
        argv += ["--run-dir", str(group_dir(run_dir, group)), "--threads", str(args.threads_per_service)]
        argv += ["--metrics-port", str(metrics), *insecure_flag(args)] + (["--group", group] if group else [])
        tb = group_dir(run_dir / "tensorboard", group)
        argv += ["--tensorboard", str(tb)] if args.tensorboard else []
        # the launcher owns its learners' rendezvous: one inherited from the caller's environment
        # (a shell under torchrun, a process that ran a learner in-process) would name its port
        name = f"learner-{group}-{rank}" if group else f"learner-{rank}"
        out.append(Service(name, argv, run_dir / "logs" / f"{name}.log", lenv, RENDEZVOUS_VARS))
    return out


def _group_of(name: str) -> str:
    """A learner service's group: ``learner-solver-model-1`` -> ``learner-solver-model``; its ranks
    rendezvous, so they are restarted together (other groups train on)."""
    return name.rsplit("-", 1)[0]


@dataclass
class Watch:
    """What the watch loop decided: the exit code so far and how often each service was restarted."""

    rc: int = 0
    restarts: dict[str, int] = field(default_factory=dict)


def restart_or_give_up(sup: Supervisor, watch: Watch) -> bool:
    """Restart services that died (learner ranks all together: they rendezvous), each at most
    ``MAX_RESTARTS`` times; False once one is out of restarts or exited with ``CONFIG_RC`` (the run
    stops, rc 1)."""
    dead = [s for s in sup.dead() if not (s.name.startswith("learner") and s.proc.returncode == 0)]
    for group in {_group_of(d.name) for d in dead if d.name.startswith("learner")}:
        dead += [s for s in sup.services if _group_of(s.name) == group and s not in dead]
    fixable = [d for d in dead if d.proc is None or d.proc.returncode != CONFIG_RC]
    for s in [d for d in fixable if watch.restarts.get(d.name, 0) < MAX_RESTARTS]:
        # Each service resumes from what it persisted: the buffer from its checkpoint (frames it had
        # not acked are resent by the rollouts), a learner from its last complete checkpoint, a
        # rollout as a new incarnation (what it had acked is in the buffer).
        watch.restarts[s.name] = watch.restarts.get(s.name, 0) + 1
        code = s.proc.returncode if s.proc is not None and s.proc.poll() is not None else "alive"
        print(
            f"[teamrl] {s.name} exited with {code}; restarting it "
            f"({watch.restarts[s.name]}/{MAX_RESTARTS}); last log lines:\n{s.tail(5)}",
            file=sys.stderr,
            flush=True,
        )
        if s.alive:
            s.proc.terminate()
            s.proc.wait(timeout=60)
        s.start()
        dead.remove(s)
    for s in dead:
        why = (
            "a configuration error, which a restart cannot fix"
            if s.proc.returncode == CONFIG_RC
            else f"after {MAX_RESTARTS} restarts (restart budget spent)"
        )
        print(
            f"[teamrl] {s.name} exited with {s.proc.returncode}, {why}; stopping the run. "
            f"Last log lines:\n{s.tail()}",
            file=sys.stderr,
        )
    if dead:
        watch.rc = 1
    return not dead


def watch_run(
    args: argparse.Namespace,
    run_dir: Path,
    sup: Supervisor,
    stop_asked: list[str],
    t_begin: float,
    groups: list[str] | None = None,
    trackers: RunTrackers | None = None,
) -> Watch:
    """Show the run live and keep it alive until every learner group's last step has been evaluated
    (or a signal, or a service out of restarts)."""
    groups = groups or [""]
    view = LiveView(args.steps)
    watch = Watch()
    final_wait_started: float | None = None
    try:
        while True:
            time.sleep(1.0)
            rows = {g: read_jsonl(group_dir(run_dir, g) / "metrics.jsonl") for g in groups}
            evals = read_jsonl(run_dir / "eval.jsonl")
            stats = read_jsonl(run_dir / "buffer" / "stats.jsonl")
            if trackers is not None:
                trackers.update()
            alive = {s.name: s.alive for s in sup.services}
            last = {g: r[-1] if r else None for g, r in rows.items()}
            view.update(
                last, evals[-1] if evals else None, stats[-1] if stats else None, alive, time.time() - t_begin
            )
            if stop_asked:
                print(f"[teamrl] {stop_asked[0]}: stopping all services", flush=True)
                watch.rc = signal_exit_code(stop_asked[0])
                return watch
            if not restart_or_give_up(sup, watch):
                return watch
            # done: every group's steps written or its time budget spent (a finished learner lingers,
            # serving its final version until the last evaluation), or every learner exited
            learners_done = all(
                r and (r[-1]["step"] + 1 >= args.steps or r[-1].get("final")) for r in rows.values()
            )
            learners_done |= all(not s.alive for s in sup.services if s.name.startswith("learner"))
            if learners_done:
                finals = {g: r[-1]["version"] if r else 0 for g, r in rows.items()}
                final = min(finals.values())
                if not args.eval_interval or any(final_evaluated(e, finals) for e in evals):
                    return watch
                final_wait_started = final_wait_started or time.time()
                if time.time() - final_wait_started > FINAL_EVAL_WAIT_S:
                    print(
                        f"[teamrl] no evaluation of the final version v{final} after {FINAL_EVAL_WAIT_S:.0f} s; stopping",
                        file=sys.stderr,
                    )
                    return watch
    finally:
        view.close()


def final_evaluated(row: dict, finals: dict[str, int]) -> bool:
    """Whether an evaluation row is of every group's final version (a team of several bases: its
    ``versions``, each base's; one base: its ``version``)."""
    if list(finals) == [""]:
        return row.get("version") == finals[""]
    return row.get("versions") == finals


def finish(run_dir: Path, watch: Watch, codes: dict[str, int | None], t_begin: float) -> int:
    """Plots, restarts and the held-out summary; the run's exit code (a service that did not stop
    cleanly fails a run that otherwise succeeded)."""
    print(f"[teamrl] services stopped: {codes}", flush=True)
    try:
        from teamrl.cli.plots import plot_run

        for p in plot_run(run_dir):
            print(f"[teamrl] plot {p}")
    except ImportError as e:
        print(f"[teamrl] no plots ({e})")
    evals = read_jsonl(run_dir / "eval.jsonl")
    if watch.restarts:
        print(
            f"[teamrl] restarts: {', '.join(f'{k} {v}' for k, v in sorted(watch.restarts.items()))}",
            flush=True,
        )
    if evals:
        what = "done" if watch.rc == 0 else f"stopped (exit code {watch.rc})"
        print(f"[teamrl] {what} in {time.time() - t_begin:.0f} s: {summary(evals[0], evals[-1])}", flush=True)
    bad = {k: v for k, v in codes.items() if v not in (0, None, -15)}
    return 1 if bad and watch.rc == 0 else watch.rc


def run_async(args: argparse.Namespace, plan: RunPlan) -> int:
    """Plan the services, start them, watch, stop them in order, finish."""
    run_dir = Path(args.run_dir)
    t_begin = time.time()
    groups = plan.groups
    wiring = Wiring.pick(args.rollouts, groups)
    t0 = prepare_run_dir(args, plan, run_dir, wiring)
    services = plan_services(args, run_dir, wiring, t0, groups)
    trackers = start_trackers(getattr(args, "logger", []), run_dir, plan.config, groups)
    sup = Supervisor()
    stop_asked: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        stop_asked.append(signal.Signals(signum).name)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    watch = Watch(rc=1)
    try:
        for svc in services:
            sup.start(svc)
        learners = sum(s.name.startswith("learner") for s in services)
        each = f" in {len(groups)} groups ({', '.join(groups)})" if groups != [""] else ""
        print(
            f"[teamrl] async run in {run_dir}: buffer, {learners} learner rank(s){each}, {args.rollouts} "
            f"rollout service(s); logs in {run_dir / 'logs'}; Prometheus /metrics on ports "
            + ", ".join(f"{k} {v}" for k, v in wiring.metrics.items()),
            flush=True,
        )
        watch = watch_run(args, run_dir, sup, stop_asked, t_begin, groups, trackers)
    finally:
        codes = sup.stop(timeout=60, order=STOP_ORDER)
        trackers.close()  # the rows written while stopping too
        for s, h in old.items():
            signal.signal(s, h)
    return finish(run_dir, watch, codes, t_begin)
