"""Does a real language model team learn? Held-out team accuracy before and after RL, over seeds.

For each seed: a real ``teamrl run`` of the workflow on the model (vLLM rollouts, DeepSpeed learner,
agent-by-agent LoRA updates), then ``teamrl eval`` on the held-out tasks twice with the same sampling
seed: on the base weights (v0) and on the run's last adapter version. Reported: the team's held-out
accuracy (avg@n) at v0 and at the end, their paired difference (mean and 95 % interval over the
seeds, Student's t), each agent's own held-out reward, a verifier's balanced accuracy where the team
has one, and each run's wall time and training reward per step. Writes ``summary.json``,
``table.md`` and ``curve.png`` (training reward per step, held-out accuracy v0 -> end per seed) to
``--out``. Prints figures; asserts nothing. Not a timed test.

    python tests/bench/tasks/make_two_number.py --unique --low 1 --high 15 runs/two15.jsonl
    python tests/bench/real_model_learning.py --workflow tests/bench/workflows/math-duo-two-number.toml \\
        --tasks runs/two15.jsonl [--seeds 1,2,3] [--steps 28] [--lr 5e-4] [--set learner.dtype=bfloat16] \\
        [--max-minutes 30] [--out docs/results/real-model/duo-bf16] [--merge OLD/summary.json]

docs/real-model.md ("Three seeds inside the window", "28 steps in 30 minutes" and "Seeds 6 and 7") gives
the figures and the time: a seed is about 20 minutes at 12 float32 steps, about 34 at 28 bfloat16-learner
steps (30 of them training) on 2 cores with AMX; where the CPU has AVX-512 BF16 but no AMX, 30 minutes
hold about 20 steps. ``--merge`` adds the seeds of an earlier ``summary.json`` of the same settings, so
seeds run in different sessions make one table and one interval.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_runs import mean_ci, read  # noqa: E402

CLI = [sys.executable, "-m", "teamrl.cli.main"]


def train(args: argparse.Namespace, seed: int, run_dir: Path) -> float:
    """One ``teamrl run``; its wall seconds. A finished run (its last adapter version there) is kept:
    the bench resumes where it stopped."""
    if (run_dir / "bench_wall.json").is_file():
        return float(json.loads((run_dir / "bench_wall.json").read_text())["seconds"])
    cmd = [*CLI, "run", "--workflow", args.workflow, "--model", args.model, "--run-dir", str(run_dir)]
    cmd += ["--steps", str(args.steps), "--tasks-per-step", str(args.tasks_per_step)]
    cmd += ["--group-size", str(args.group_size), "--lr", str(args.lr), "--seed", str(seed)]
    cmd += ["--eval-interval", "0", "--max-lag", str(args.max_lag), "--max-minutes", str(args.max_minutes)]
    cmd += ["--tasks", args.tasks] if args.tasks else []
    cmd += [x for kv in args.set for x in ("--set", kv)]
    print("training:", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    (run_dir / "bench_wall.json").write_text(json.dumps({"seconds": wall}))
    return wall


def evaluate(args: argparse.Namespace, seed: int, adapters: Path | None, saved: Path) -> dict[str, Any]:
    """``teamrl eval`` on the held-out tasks (its JSON kept in ``saved``, reused when there)."""
    if saved.is_file():
        return json.loads(saved.read_text())
    cmd = [*CLI, "eval", "--workflow", args.workflow, "--model", args.model]
    cmd += ["--num-tasks", str(args.num_tasks), "--n", str(args.n), "--k", "1", "--seed", str(seed)]
    cmd += ["--temperature", str(args.temperature)] if args.temperature is not None else []
    cmd += ["--tasks", args.tasks] if args.tasks else []
    cmd += ["--adapters", str(adapters)] if adapters else []
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"real_model_learning: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    saved.write_text(proc.stdout.strip().splitlines()[-1])
    return json.loads(saved.read_text())


def step_rewards(run_dir: Path) -> list[float]:
    """The training reward of each learner step (``reward_mean``: the batch's mean trajectory reward)."""
    return [round(float(r["reward_mean"]), 3) for r in read(run_dir / "metrics.jsonl")]


def paired(base: list[dict], end: list[dict], key: str) -> dict[str, Any]:
    b, e = [r.get(key) for r in base], [r.get(key) for r in end]
    if any(x is None for x in b + e):
        return {}
    mb, cb, _ = mean_ci(b)
    me, ce, _ = mean_ci(e)
    md, cd, _ = mean_ci([y - x for x, y in zip(b, e, strict=True)])
    return {"base": b, "end": e, "base_mean": mb, "base_ci95": cb, "end_mean": me, "end_ci95": ce} | {
        "gain_mean": md,
        "gain_ci95": cd,
    }


def table(rows: dict[str, dict[str, Any]], seeds: list[int]) -> str:
    out = "| held-out metric | v0 (base) | end | gain (paired, 95 % CI) | per seed (v0 -> end) |\n"
    out += "|---|---|---|---|---|\n"
    for key, r in rows.items():
        per = ", ".join(f"{x:.3f} -> {y:.3f}" for x, y in zip(r["base"], r["end"], strict=True))
        out += f"| {key} | {r['base_mean']:.3f} ± {r['base_ci95']:.3f} | {r['end_mean']:.3f} ± "
        out += f"{r['end_ci95']:.3f} | **{r['gain_mean']:+.3f} ± {r['gain_ci95']:.3f}** | {per} |\n"
    return out + f"\nSeeds {', '.join(map(str, seeds))}.\n"


def plot(summary: dict[str, Any], key: str, dest: Path) -> None:
    """curve.png: each seed's training reward per learner step (and their mean), and each seed's held-out
    ``key`` on the base weights and at the end (paired), with the mean gain and its 95 % interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [2, 1]})
    curves = [r["step_reward"] for r in summary["runs"]]
    for run, ys in zip(summary["runs"], curves, strict=True):
        left.plot(range(1, len(ys) + 1), ys, alpha=0.35, label=f"seed {run['seed']}")
    n = min(len(ys) for ys in curves)
    mean = [sum(ys[i] for ys in curves) / len(curves) for i in range(n)]
    left.plot(range(1, n + 1), mean, "k", lw=2, label="mean")
    left.set_xlabel("learner step")
    left.set_ylabel("training reward (batch mean)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    row = summary["rows"][key]
    for run, b, e in zip(summary["runs"], row["base"], row["end"], strict=True):
        right.plot([0, 1], [b, e], "o-", alpha=0.6, label=f"seed {run['seed']}")
    right.plot([0, 1], [row["base_mean"], row["end_mean"]], "ks-", lw=2, label="mean")
    right.set_xticks([0, 1], ["v0 (base)", "end"])
    right.set_ylabel(f"held-out {key}")
    right.set_title(f"gain {row['gain_mean']:+.3f} ± {row['gain_ci95']:.3f} (95 %)", fontsize=10)
    right.grid(alpha=0.3)
    fig.suptitle(f"{Path(summary['workflow']).stem} on {summary['model']}, {len(curves)} seeds")
    fig.tight_layout()
    fig.savefig(dest, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workflow", default="tests/bench/workflows/math-duo-two-number.toml")
    p.add_argument("--tasks", default="", help="task file (JSONL/Parquet); its last tenth is held out")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="teamrl run's time budget (the run ends after --steps or this, whichever comes first)",
    )
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-lag", type=int, default=1)
    p.add_argument("--num-tasks", type=int, default=200, help="held-out tasks (at most the split's)")
    p.add_argument("--n", type=int, default=4, help="samples per held-out task")
    p.add_argument(
        "--temperature", type=float, default=None, help="evaluation temperature (default: each agent's own)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="passed to teamrl run (repeatable), e.g. learner.dtype=bfloat16",
    )
    p.add_argument("--runs", default="runs/real-model-learning", help="one run folder per seed here")
    p.add_argument("--out", default="docs/results/real-model/duo")
    p.add_argument(
        "--merge",
        default="",
        metavar="SUMMARY",
        help="an earlier summary.json of these settings: its seeds join this run's in the table (not rerun)",
    )
    return p.parse_args()


MERGED_SETTINGS = ("workflow", "model", "steps", "tasks_per_step", "group_size", "lr", "max_lag", "n")
MERGED_SETTINGS += ("temperature", "set", "max_minutes", "tasks_sha256")


def earlier_seeds(args: argparse.Namespace, seeds: list[int]) -> dict[str, list]:
    """The runs and evaluations of an earlier ``summary.json`` (``--merge``): its settings must be this
    run's (a setting it did not record, as older summaries lack ``max_minutes``, is not compared), and
    its seeds others than this run's."""
    if not args.merge:
        return {"runs": [], "base_evals": [], "end_evals": []}
    old, now = json.loads(Path(args.merge).read_text()), vars(args)
    differ = [
        f"{k}: {old[k]!r} there, {now[k]!r} here" for k in MERGED_SETTINGS if k in old and old[k] != now[k]
    ]
    if differ:
        raise SystemExit(
            f"real_model_learning: --merge {args.merge} ran other settings: " + "; ".join(differ)
        )
    if clash := sorted({r["seed"] for r in old["runs"]} & set(seeds)):
        raise SystemExit(f"real_model_learning: --merge {args.merge} already has seeds {clash}")
    return {k: old[k] for k in ("runs", "base_evals", "end_evals")}


def main() -> None:
    args = parse_args()
    args.tasks_sha256 = hashlib.sha256(Path(args.tasks).read_bytes()).hexdigest() if args.tasks else ""
    seeds, out, t0 = [int(s) for s in args.seeds.split(",")], Path(args.out), time.monotonic()
    prior = earlier_seeds(args, seeds)
    base, end, per_seed = list(prior["base_evals"]), list(prior["end_evals"]), list(prior["runs"])
    for seed in seeds:
        run_dir = Path(args.runs) / f"seed{seed}"
        wall = train(args, seed, run_dir)
        base.append(evaluate(args, seed, None, run_dir / "bench_eval_v0.json"))
        v = int(read(run_dir / "metrics.jsonl")[-1]["version"])  # --steps, or fewer in --max-minutes
        end.append(evaluate(args, seed, run_dir / "adapters" / f"v{v}", run_dir / f"bench_eval_v{v}.json"))
        per_seed.append(
            {"seed": seed, "wall_s": round(wall), "version": v, "step_reward": step_rewards(run_dir)}
        )
        print(
            f"seed {seed}: {wall:.0f} s; v0 {json.dumps(base[-1])}\n  end {json.dumps(end[-1])}", flush=True
        )
    keys = [k for k in end[0] if isinstance(end[0][k], (int, float)) and (k.startswith("avg@") or "/" in k)]
    keys += [k for k in end[0] if k.endswith(("_accuracy", "_accept_rate")) and k not in keys]
    rows = {k: r for k in keys if (r := paired(base, end, k))}
    seeds = [r["seed"] for r in per_seed]
    text = table(rows, seeds)
    summary = {k: v for k, v in vars(args).items()} | {"seeds": ",".join(map(str, seeds))}
    summary |= {"rows": rows, "runs": per_seed}
    summary |= {"base_evals": base, "end_evals": end, "seconds": round(time.monotonic() - t0)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(text)
    if keys and keys[0] in rows:
        plot(summary, keys[0], out / "curve.png")
    print(text, end="")
    print(f"wrote {out}/ in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
