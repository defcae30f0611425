"""Two training runs that differ in one setting, on the same seed and machine, compared.

    python tests/bench/compare_runs.py mode          # (a) async against sync: time to a reward
    python tests/bench/compare_runs.py algorithm --reward-scale verifier=10
                                                     # (b) Dr. MAS agent-wise vs global GRPO
    python tests/bench/compare_runs.py update-order  # (c) agent-by-agent (HAPPO) vs simultaneous

Each run is a real ``teamrl run`` (vLLM rollouts, DeepSpeed learner) on the embedded default
task. Reported per run: wall time, held-out solver/verifier accuracy at the start, best and end,
seconds until held-out solver accuracy first reached ``--target``, and per agent the gradient-norm
spike ratio (max over median of ``grad_norm/<adapter>``), the Dr. MAS paper's instability signal.
The last line is ``compare_<what>=<float>``: for ``mode`` the sync/async time-to-target ratio
(>1: async reached it sooner), else the ratio of the end held-out accuracies (second/first).
This prints figures; it asserts nothing about them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "mode": (["--mode", "sync"], ["--mode", "async"]),
    "algorithm": (["--algorithm", "grpo", "--mode", "sync"], ["--algorithm", "drmas", "--mode", "sync"]),
    "update-order": (
        ["--update-order", "simultaneous", "--mode", "sync"],
        ["--update-order", "sequential", "--mode", "sync"],
    ),
}


def read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def summarise(run: Path, wall: float, target: float) -> dict:
    m, ev = read(run / "metrics.jsonl"), read(run / "eval.jsonl")
    out: dict = {"wall_s": wall, "steps": len(m)}
    if ev:
        acc = [e["solver_accuracy"] for e in ev]
        out.update(
            start=acc[0],
            best=max(acc),
            end=acc[-1],
            verifier_end=ev[-1].get("verifier_accuracy"),
            time_to_target=next((e["time"] for e in ev if e["solver_accuracy"] >= target), None),
        )
    for key in sorted({k for r in m for k in r if k.startswith("grad_norm/")}):
        xs = [r[key] for r in m if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
        if xs:
            out[f"spike/{key.split('/', 1)[1]}"] = max(xs) / max(statistics.median(xs), 1e-12)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=0.5, help="held-out solver accuracy for time-to-target")
    p.add_argument(
        "--reward-scale",
        metavar="ROLE=X",
        action="append",
        default=[],
        help="passed to both runs (e.g. verifier=10 for (b): agents with different reward scales)",
    )
    p.add_argument("--quick", action="store_true", help="6 steps of 4x4: checks the script, not the science")
    p.add_argument("--out", default=None, help="folder for the two run folders (default: a temp folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.tasks_per_step, args.group_size, args.eval_interval, args.eval_tasks = 6, 4, 4, 3, 50
    root = Path(args.out or tempfile.mkdtemp(prefix=f"teamrl-compare-{args.what}-"))
    common = [
        "--steps", str(args.steps), "--tasks-per-step", str(args.tasks_per_step), "--group-size",
        str(args.group_size), "--eval-interval", str(args.eval_interval), "--eval-tasks", str(args.eval_tasks),
        "--seed", str(args.seed),
    ]  # fmt: skip
    for item in args.reward_scale:
        common += ["--reward-scale", item]
    results = {}
    for variant in VARIANTS[args.what]:
        name = "_".join(variant[1::2][:1])
        run = root / name
        t0 = time.time()
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "teamrl.cli.main",
                "run",
                "--workflow",
                "addition-duo",
                "--run-dir",
                str(run),
                *common,
                *variant,
            ],
            capture_output=True,
            text=True,
        )
        wall = time.time() - t0
        if res.returncode != 0:
            print(f"{name}: teamrl run failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
            return 1
        results[name] = summarise(run, wall, args.target)
        print(
            f"{name:>13}: "
            + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results[name].items()}),
            flush=True,
        )
    (a, ra), (b, rb) = results.items()
    if args.what == "mode":
        ta, tb = ra.get("time_to_target"), rb.get("time_to_target")
        ratio = ta / tb if ta and tb else float("nan")
        print(f"time to held-out solver accuracy >= {args.target}: {a} {ta} s, {b} {tb} s")
    else:
        ratio = rb["end"] / ra["end"] if ra.get("end") else float("nan")
        print(f"end held-out solver accuracy: {a} {ra.get('end')}, {b} {rb.get('end')}")
    print(f"runs kept in {root}")
    print(f"compare_{args.what.replace('-', '_')}={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
