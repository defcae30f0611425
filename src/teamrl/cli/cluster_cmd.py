"""``teamrl cluster``: the pipeline model (:mod:`teamrl.cli.cluster`) measured, checked and used.

    teamrl cluster costs RUN                 # the costs a sync run measured (JSON)
    teamrl cluster check --costs SYNC_RUN --fit ASYNC_RUN RUN [RUN ...]
                                             # predicted against measured step time, per run
    teamrl cluster predict --rollouts 1-8 --learners 1-4 [--gen-tok-s ... --train-tok-s ...]
                                             # throughput, idle, staleness per N x M devices

``costs`` reads a ``--mode sync`` run's ``timeline.jsonl`` (one lane: generating, training, export,
publish per step), so each cost is measured with nothing else running. ``check`` takes those costs,
fits the one shared-host parameter (``demand``: how much services working at once slow each other) on the ``--fit``
run, then predicts every RUN from its own flags (mode, rollouts, max lag, groups in flight, the
workflow's latency) and prints predicted and measured step time, learner idle and version lag side
by side with the error. ``predict`` needs no run: per-device costs from token counts and throughputs
(for a GPU cluster), and prints the table and the rollout:learner ratio that balances them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

from teamrl.cli.cluster import Costs, Pipeline, Prediction, simulate


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_args(run: Path) -> dict[str, Any]:
    """The ``teamrl run`` flags of a run folder (run.json for async, config.json for sync)."""
    if (run / "run.json").is_file():
        return json.loads((run / "run.json").read_text())["args"]
    if (run / "config.json").is_file():
        return json.loads((run / "config.json").read_text())
    raise SystemExit(f"{run}: not a run folder (no run.json or config.json)")


def workflow_latency(run: Path) -> float:
    """Seconds each group waits on the world: the run's workflow's, as the plan reads it
    (:func:`teamrl.cli.plan.world_latency`: ``[reward] latency_s``, the slowest tool's)."""
    from teamrl.cli.plan import world_latency
    from teamrl.rollout.workflows import load

    cfg = tomllib.loads((run / "config.toml").read_text())
    return world_latency(load(cfg["rollout"]["workflow"]))


def pipeline_of(run: Path) -> Pipeline:
    a = run_args(run)
    cfg = tomllib.loads((run / "config.toml").read_text())
    ranks = a.get("learners") or 1
    return Pipeline(
        mode=a["mode"],
        rollouts=int(a.get("rollouts") or 1),
        learners=ranks if isinstance(ranks, int) else 1,
        tasks_per_step=int(a["tasks_per_step"]),
        groups_in_flight=int(cfg["rollout"].get("groups_in_flight", a["tasks_per_step"])),
        max_lag=int(a.get("max_lag") or 0),
        steps=len(_rows(run / "metrics.jsonl")),
    )


def _state_means(run: Path, service: str) -> dict[str, float]:
    """Seconds per step in each state of ``service``'s lane, over the run's steps."""
    from teamrl.protocol.timeline import read_timeline

    steps = max(len(_rows(run / "metrics.jsonl")), 1)
    out: dict[str, float] = {}
    for r in read_timeline(run / "timeline.jsonl"):
        if r["service"] == service:
            out[str(r["state"])] = out.get(str(r["state"]), 0.0) + float(r["t1"]) - float(r["t0"])  # type: ignore[arg-type]
    return {k: v / steps for k, v in out.items()}


def measured_costs(sync_run: Path) -> Costs:
    """Costs of a ``--mode sync`` run: each phase per step, measured alone."""
    a = run_args(sync_run)
    if a.get("mode") != "sync":
        raise SystemExit(f"{sync_run}: costs are measured on a --mode sync run (this one is {a.get('mode')})")
    s = _state_means(sync_run, "sync")
    if "generating" not in s:
        raise SystemExit(
            f"{sync_run}: its timeline.jsonl has no sync lane (a run from before sync timelines)"
        )
    latency = workflow_latency(sync_run)
    return Costs(
        group_s=max(s["generating"] - latency, 1e-6) / int(a["tasks_per_step"]),
        step_s=s.get("training", 0.0),
        publish_s=s.get("export", 0.0),
        load_s=s.get("publish", 0.0),
        latency_s=latency,
    )


def measured(run: Path) -> Prediction:
    """What a run measured, in the model's terms (second step on)."""
    m = _rows(run / "metrics.jsonl")
    times = [float(r["time"]) for r in m]
    if len(times) < 3:
        raise SystemExit(f"{run}: fewer than 3 steps in metrics.jsonl")
    span = times[-1] - times[0]
    if run_args(run)["mode"] == "sync":  # the learner's side waits while the batch is generated
        waited = _state_means(run, "sync").get("generating", 0.0) * (len(m) - 1)
    else:
        waited = sum(float(r.get("sample_wait_seconds", 0.0)) for r in m[1:])
    lag = [float(r["version_lag_mean"]) for r in m[1:] if "version_lag_mean" in r]
    return Prediction(
        step_s=span / (len(times) - 1),
        learner_idle=min(1.0, waited / span),
        rollout_idle=float("nan"),
        lag_mean=sum(lag) / len(lag) if lag else 0.0,
        dropped=0,
    )


def for_run(costs: Costs, run: Path, demand: float, host_cores: float) -> Costs:
    """The costs as ``run`` sees them: its own latency, the shared host's demand."""
    return replace(costs, latency_s=workflow_latency(run), demand=demand, host_cores=host_cores)


def fit_demand(costs: Costs, run: Path, host_cores: float) -> float:
    """The ``demand`` (cores per busy service) whose prediction of ``run``'s step time is closest:
    bisection, the predicted step time does not fall as the demand grows."""
    target = measured(run).step_s
    pipe = pipeline_of(run)
    lo, hi = 0.5, 4.0
    for _ in range(10):
        mid = (lo + hi) / 2
        if simulate(for_run(costs, run, mid, host_cores), pipe, dt=costs.group_s / 40).step_s < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _pct(x: float) -> str:
    return "  n/a" if x != x else f"{100 * x:4.0f}%"


def check(args: argparse.Namespace) -> int:
    """Predicted against measured, one line per run (module docstring)."""
    costs = replace(measured_costs(Path(args.costs)), group_cv=args.group_cv)
    print(f"costs from {args.costs}: {json.dumps({k: round(v, 4) for k, v in vars(costs).items()})}")
    demand = args.demand if args.demand else fit_demand(costs, Path(args.fit), args.host_cores)
    fitted = f"fitted on {args.fit}" if not args.demand else "given"
    print(f"shared host: {args.host_cores:g} cores, demand {demand:.2f} cores per busy service ({fitted})")
    print(f"{'run':<28} {'mode':<5} {'R':>2} {'lag':>3} {'F':>3} {'lat':>4}  step s pred/meas   err  "
          "learner idle pred/meas  lag pred/meas")  # fmt: skip
    errors = []
    for name in args.runs:
        run = Path(name)
        pipe, got = pipeline_of(run), measured(run)
        pred = simulate(for_run(costs, run, demand, args.host_cores), pipe, dt=costs.group_s / 40)
        err = pred.step_s / got.step_s - 1
        errors.append(abs(err))
        print(
            f"{run.name[:28]:<28} {pipe.mode:<5} {pipe.rollouts:>2} {pipe.max_lag:>3} {pipe.groups_in_flight:>3} "
            f"{workflow_latency(run):>4.1f}  {pred.step_s:6.3f} / {got.step_s:6.3f}  {100 * err:+5.1f}%  "
            f"{_pct(pred.learner_idle)} / {_pct(got.learner_idle)}        {pred.lag_mean:4.2f} / {got.lag_mean:4.2f}"
        )
    print(f"cluster_check_max_abs_error={max(errors):.3f}")
    return 0


def gpu_costs(args: argparse.Namespace) -> Costs:
    """Per-device costs of one group and one learner step from token counts and throughputs."""
    episode_gen = args.acts * args.response_tokens
    episode_all = args.acts * (args.prompt_tokens + args.response_tokens)
    return Costs(
        group_s=args.group_size * episode_gen / args.gen_tok_s,
        step_s=args.tasks_per_step * args.group_size * episode_all / args.train_tok_s,
        publish_s=args.push_s / 2,
        load_s=args.push_s / 2,
        latency_s=args.latency,
        saturation=args.saturation,
        group_cv=args.group_cv,
    )


def predict(args: argparse.Namespace) -> int:
    """Throughput, idle fractions and staleness per N rollout x M learner devices, async and sync."""
    c = gpu_costs(args)
    print(f"per-device costs: {json.dumps({k: round(v, 4) for k, v in vars(c).items()})}")
    print(f"{'N':>2} {'M':>2}  groups/s async  sync  async/sync  learner idle  rollout idle  lag  dropped")
    for m in args.learners:
        balanced = None
        for n in args.rollouts:
            flight = int(args.tasks_per_step * args.in_flight)
            pipe = Pipeline("async", n, m, args.tasks_per_step, flight, args.max_lag, 30)
            a = simulate(c, pipe)
            # sync on the same N + M devices: all of them generate, then all of them train
            s = simulate(
                replace(c, step_s=c.step_s * m / (n + m)), replace(pipe, mode="sync", rollouts=n + m)
            )
            ga, gs = pipe.tasks_per_step * m / a.step_s, pipe.tasks_per_step * m / s.step_s
            print(f"{n:>2} {m:>2}  {ga:14.2f} {gs:5.2f}  {ga / gs:10.2f}  {_pct(a.learner_idle):>12}  "
                  f"{_pct(a.rollout_idle):>12}  {a.lag_mean:3.1f}  {a.dropped:>7}")  # fmt: skip
            if balanced is None and a.learner_idle < 0.10:
                balanced = n
        said = f"N={balanced} (rollout:learner {balanced / m:g})" if balanced else f"not within N <= {n}"
        print(f"   M={m}: the learner is busy >= 90 % from {said}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="teamrl cluster",
        description="A model of the actor-learner pipeline in simulated time: measured costs in, step "
        "time, idle fractions and staleness out (docs/running.md, 'A model of the pipeline').",
    )
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("costs", help="the costs a --mode sync run measured (JSON)")
    c.add_argument("run")
    k = sub.add_parser("check", help="predicted against measured step time, learner idle and lag, per run")
    k.add_argument("--costs", required=True, help="a --mode sync run of the same workflow and batch")
    k.add_argument("--fit", help="an async run to fit the shared host's demand on (or --demand)")
    k.add_argument("--demand", type=float, default=0.0, help="cores each busy service wants (skip the fit)")
    k.add_argument("--host-cores", type=float, default=2.0, help="the shared host's cores (0: own devices)")
    k.add_argument(
        "--group-cv", type=float, default=0.5, help="coefficient of variation of a group's compute (assumed)"
    )
    k.add_argument("runs", nargs="+", help="run folders to predict (their flags and workflow are read)")
    g = sub.add_parser("predict", help="N rollout x M learner devices from per-device throughputs")
    g.add_argument("--rollouts", type=_span, default=_span("1-8"), help="e.g. 1-8 or 1,2,4")
    g.add_argument("--learners", type=_span, default=_span("1,2,4"))
    g.add_argument("--gen-tok-s", type=float, default=20_000.0,
                   help="generated tokens/s of one rollout device at full batch (default: an assumption "
                        "for a 0.5B model on one H200 under vLLM; not measured here)")  # fmt: skip
    g.add_argument("--train-tok-s", type=float, default=91_040.0,
                   help="learner tokens/s per device (default: ours on one H200, 32 x (256+768), docs/gpu.md)")  # fmt: skip
    g.add_argument(
        "--push-s", type=float, default=0.272, help="export to live (default: rank 16 on H200, docs/gpu.md)"
    )
    g.add_argument("--tasks-per-step", type=int, default=16, help="groups per learner rank per step")
    g.add_argument("--group-size", type=int, default=8)
    g.add_argument("--acts", type=int, default=2, help="agent acts per episode")
    g.add_argument("--prompt-tokens", type=int, default=256)
    g.add_argument("--response-tokens", type=int, default=512)
    g.add_argument("--latency", type=float, default=0.0, help="world latency per group (s)")
    g.add_argument(
        "--saturation",
        type=float,
        default=16.0,
        help="groups a rollout device computes at once at full speed",
    )
    g.add_argument(
        "--in-flight",
        type=float,
        default=1.0,
        help="groups in flight per replica, in steps' worth (teamrl run plans 1: rollout.groups_in_flight)",
    )
    g.add_argument(
        "--group-cv", type=float, default=0.5, help="coefficient of variation of a group's compute"
    )
    g.add_argument("--max-lag", type=int, default=2)
    args = p.parse_args(argv)
    if args.what == "costs":
        print(json.dumps(vars(measured_costs(Path(args.run))), indent=1))
        return 0
    if args.what == "check":
        if not args.fit and not args.demand:
            p.error("check needs --fit RUN or --demand X")
        return check(args)
    return predict(args)


def _span(text: str) -> list[int]:
    """``1-8`` or ``1,2,4``."""
    if "-" in text:
        lo, hi = text.split("-", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(x) for x in text.split(",")]


if __name__ == "__main__":
    sys.exit(main())
