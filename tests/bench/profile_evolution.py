"""LangMARL's profile evolution, measured: held-out accuracy with the evolved profiles against the originals.

Runs profile evolution with ``teamrl run`` (``learner.train_weights = false``, a profile round every
step: the judge's critiques rewrite each agent's profile; docs/real-model.md, "LangMARL's judge on the
real model"), unless ``--run-dir`` already holds evolved profiles; then evaluates the workflow on
its held-out tasks with ``teamrl eval`` once per profile version (the originals, v0, and the last
evolved one; ``--all-versions``: each) and sampling seed, the profiles written into a copy of the workflow TOML. The weights
are the base model's throughout, so the profiles are the only difference. Prints the table (mean and
95 % interval over the seeds) and writes ``summary.json`` and ``table.md`` to ``--out``. Not a
timed test.

    python tests/bench/profile_evolution.py --workflow tests/bench/workflows/math-duo-d1-judge.toml \\
        [--run-dir runs/profile-evolution] [--steps 4] [--seeds 1,2,3] [--num-tasks 60] [--n 2] \\
        [--out docs/results/profiles]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_runs import mean_ci  # noqa: E402

CLI = [sys.executable, "-m", "teamrl.cli.main"]


def versions(run_dir: Path) -> dict[int, dict[str, str]]:
    """Profile version -> ``{agent: profile}``, from the run's ``profiles/v*.json``."""
    out = {}
    for p in sorted((run_dir / "profiles").glob("v*.json")):
        doc = json.loads(p.read_text())
        out[int(doc["version"])] = dict(doc["profiles"])
    return out


def proposals(run_dir: Path) -> dict[str, int]:
    """``"status (reason)" -> count`` of every profile proposal, from the learner's log."""
    out: dict[str, int] = {}
    for log in sorted((run_dir / "logs").glob("learner*.log")):
        for m in re.finditer(r"profile v\d+ \S+: (\w+ \([\w_]+\))", log.read_text(errors="replace")):
            out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out


def evolve(args: argparse.Namespace, run_dir: Path) -> None:
    cmd = [*CLI, "run", "--workflow", args.workflow, "--model", args.model, "--run-dir", str(run_dir)]
    cmd += ["--steps", str(args.steps), "--tasks-per-step", str(args.tasks_per_step)]
    cmd += ["--group-size", str(args.group_size), "--eval-interval", "0", "--seed", "1"]
    cmd += ["--set", "learner.profile_interval=1", "--set", "learner.train_weights=false"]
    cmd += ["--set", f"learner.profile_max_new_tokens={args.judge_tokens}"]
    print("evolving:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def with_profiles(workflow: dict[str, Any], profiles: dict[str, str], path: Path) -> Path:
    from teamrl.cli.config import to_toml

    doc = json.loads(json.dumps(workflow))
    for agent in doc.get("agents", []):
        if agent["id"] in profiles:
            agent["profile"] = profiles[agent["id"]]
    path.write_text(to_toml(doc) + "\n")
    return path


def evaluate(args: argparse.Namespace, toml: Path, seed: int) -> dict[str, Any]:
    cmd = [*CLI, "eval", "--workflow", str(toml), "--model", args.model]
    cmd += ["--num-tasks", str(args.num_tasks), "--n", str(args.n), "--k", "1", "--seed", str(seed)]
    cmd += ["--temperature", str(args.temperature)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"profile_evolution: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workflow",
        default="tests/bench/workflows/math-duo-d1-judge.toml",
        help="the team's workflow TOML (its [credit] rule = judge)",
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--run-dir", default="runs/profile-evolution", help="evolved here unless it has profiles")
    p.add_argument("--steps", type=int, default=4, help="profile rounds when evolving")
    p.add_argument("--tasks-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--judge-tokens", type=int, default=320)
    p.add_argument("--seeds", default="1,2,3", help="sampling seeds of each evaluation")
    p.add_argument("--num-tasks", type=int, default=60)
    p.add_argument("--n", type=int, default=2, help="samples per task")
    p.add_argument("--temperature", type=float, default=0.7, help="evaluation sampling temperature")
    p.add_argument("--all-versions", action="store_true", help="every version, not the first and last")
    p.add_argument("--out", default="docs/results/profiles")
    args = p.parse_args()
    run_dir, out, t0 = Path(args.run_dir), Path(args.out), time.monotonic()
    if len(versions(run_dir)) < 2:
        evolve(args, run_dir)
    found, tally = versions(run_dir), proposals(run_dir)
    print(f"proposals: {json.dumps(tally)}", flush=True)
    if len(found) < 2:
        raise SystemExit(f"profile_evolution: {run_dir}/profiles holds no evolved version ({tally})")
    workflow = tomllib.loads(Path(args.workflow).read_text())
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[str, Any] = {}
    chosen = sorted(found) if args.all_versions else [min(found), max(found)]
    for v in chosen:
        profiles = found[v]
        toml = with_profiles(workflow, profiles, out / f"workflow-v{v}.toml")
        runs = [evaluate(args, toml, s) for s in seeds]
        team = next(k for k in runs[0] if k.startswith("avg@"))
        m, ci, _n = mean_ci([r[team] for r in runs])
        rows[f"v{v}"] = {"team": team, "mean": m, "ci95": ci, "runs": runs, "profiles": profiles}
        print(f"profiles v{v}: {team} {m:.3f} ± {ci:.3f} over seeds {seeds}", flush=True)
    header = "| profiles | team accuracy (mean ± 95 % CI) | per seed |\n|---|---|---|\n"
    body = "".join(
        f"| {k}{' (originals)' if k == 'v0' else ''} | {r['mean']:.3f} ± {r['ci95']:.3f} | "
        + ", ".join(f"{x[r['team']]:.3f}" for x in r["runs"])
        + " |\n"
        for k, r in rows.items()
    )
    summary = {"workflow": args.workflow, "run_dir": str(run_dir), "seeds": seeds, "rows": rows}
    summary["proposals"] = tally
    summary |= {
        "num_tasks": args.num_tasks,
        "n": args.n,
        "temperature": args.temperature,
        "seconds": round(time.monotonic() - t0),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(header + body)
    print(header + body, end="")
    print(f"wrote {out}/ in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
