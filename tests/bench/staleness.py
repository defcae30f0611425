"""Staleness table (the shape of AReaL's): naive PPO against decoupled PPO as the policy lag grows.

For each imposed lag k (``teamrl run --mode sync --policy-lag k``: every batch is generated with the
adapters of exactly k versions ago) and each objective, one training run of the same seed:

* ``ppo-behaviour``: naive PPO, the clip drawn around the behaviour policy μ (what asynchronous PPO
  does without a correction);
* ``decoupled``: AReaL's decoupled PPO, the clip around π_prox (the learner's current weights) and
  the behaviour weight π_prox/μ outside it.

The paper's shape: naive PPO degrades as the lag grows, decoupled PPO holds. Reports the end held-out
accuracy of the trained adapters (greedy, the run's held-out tasks) and the mean of the last evaluations'
reward, writes ``summary.json``, ``table.md`` and ``staleness.png`` to ``--out``. Not a timed test.

    python tests/bench/staleness.py [--workflow addition-duo] [--lags 0,1,2,4,8] [--steps 40]
        [--out docs/results/staleness] [--runs runs/results/staleness]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "teamrl.cli.main"]
OBJECTIVES = ("ppo-behaviour", "decoupled")


def run_one(args: argparse.Namespace, lag: int, objective: str) -> dict:
    run_dir = Path(args.runs) / f"{objective}-lag{lag}"
    eval_file = run_dir / "eval.jsonl"
    done = eval_file.is_file() and (_rows(eval_file) or [{}])[-1].get("step") == args.steps
    if not done:  # a finished run is reused
        cmd = [*CLI, "run", "--workflow", args.workflow, "--mode", "sync", "--run-dir", str(run_dir)]
        cmd += ["--steps", str(args.steps), "--seed", str(args.seed), "--policy-lag", str(lag)]
        cmd += ["--eval-interval", str(args.steps), "--set", f'learner.objective="{objective}"']
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(
                f"staleness: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
            )
    last = _rows(eval_file)[-1]
    return {"lag": lag, "objective": objective, "end": last.get(args.metric), "eval": last}


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def plot(results: list[dict], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for obj in OBJECTIVES:
        pts = sorted((r["lag"], r["end"]) for r in results if r["objective"] == obj)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=obj)
    ax.set_xlabel("imposed policy lag (versions)")
    ax.set_ylabel(f"end held-out {metric}")
    ax.set_title("staleness: naive vs decoupled PPO")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workflow", default="addition-duo")
    p.add_argument("--lags", default="0,1,2,4,8", help="comma-separated policy lags")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--metric",
        default="reward_mean",
        help="the eval.jsonl field reported (default: the team reward, which every workflow's evaluation has)",
    )
    p.add_argument("--runs", default="runs/results/staleness", help="run folders (a finished run is reused)")
    p.add_argument("--out", default="docs/results/staleness")
    args = p.parse_args()
    lags = [int(x) for x in args.lags.split(",")]
    t0 = time.monotonic()
    results = []
    for lag in lags:
        for obj in OBJECTIVES:
            results.append(run_one(args, lag, obj))
            print(
                f"lag {lag} {obj:>14}: {args.metric} {results[-1]['end']} ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by = {(r["lag"], r["objective"]): r["end"] for r in results}
    table = f"| policy lag | {' | '.join(OBJECTIVES)} |\n|---|" + "---|" * len(OBJECTIVES) + "\n"
    table += "".join(
        f"| {lag} | " + " | ".join(f"{by[(lag, o)]:.3f}" for o in OBJECTIVES) + " |\n" for lag in lags
    )
    (out / "table.md").write_text(
        f"End held-out {args.metric} after {args.steps} sync steps ({args.workflow}, seed {args.seed}, "
        f"`tests/bench/staleness.py`):\n\n{table}"
    )
    (out / "summary.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    plot(results, args.metric, out / "staleness.png")
    print(table, end="")
    print(f"wrote {out}/ in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
