"""The team whose verifier learns (docs/verifier-learning.md), over several seeds on one machine.

    python tests/bench/checked_team.py [--seeds 5] [--steps 40] [--out DIR]

For each seed: ``teamrl run --workflow addition-duo-checked`` (the solver on the embedded model, the
verifier on the embedded checker, one learner group each; greedy held-out evaluation of 200 tasks every
10 versions), then ``teamrl eval --workflow addition-trio-checked --n 4`` with the run's final
adapters of both bases (temperature 1), where a rejection sends the solver back. Once: the same trio
evaluation on base weights. Reported per key, mean and 95 % confidence interval (Student's t over the
seeds, ``compare_runs.mean_ci``): the verifier's held-out balanced accuracy at v0, its best and its
last; the solver's held-out accuracy at v0 and at the end; and in the trio the solver's first try
against the team after retries. The last line is ``checked_team=<mean final verifier balanced
accuracy>``. This prints figures; it asserts nothing about them. About 5-6 minutes per seed on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_runs import fmt, mean_ci, read  # noqa: E402

TEAMRL = [sys.executable, "-m", "teamrl.cli.main"]


def run_summary(run: Path) -> dict:
    """The held-out figures of one ``addition-duo-checked`` run folder."""
    ev = read(run / "eval.jsonl")
    ba = [e.get("verifier_balanced_accuracy") for e in ev]
    acc = [e.get("solver_accuracy") for e in ev]
    if not ev:
        return {}
    return {
        "verifier_ba_v0": ba[0],
        "verifier_ba_best": max(x for x in ba if x is not None),
        "verifier_ba_end": ba[-1],
        "solver_v0": acc[0],
        "solver_end": acc[-1],
    }


def trio(adapters: dict[str, Path], seed: int) -> dict:
    """``teamrl eval`` of addition-trio-checked (n 4, temperature 1) with ``adapters`` per base."""
    argv = [*TEAMRL, "eval", "--workflow", "addition-trio-checked", "--n", "4", "--k", "1,4"]
    argv += ["--seed", str(seed)]
    for model_id, folder in adapters.items():
        argv += ["--adapters", f"{model_id}={folder}"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return {}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "trio_first_try": out.get("first_try_accuracy"),
        "trio_after_retries": out.get("avg@4"),
        "trio_verifier_ba": out.get("verifier_balanced_accuracy"),
    }


def one_seed(root: Path, seed: int, steps: int) -> dict:
    run = root / f"seed-{seed}"
    argv = [*TEAMRL, "run", "--workflow", "addition-duo-checked", "--steps", str(steps)]
    argv += ["--eval-interval", "10", "--seed", str(seed), "--run-dir", str(run)]
    t0 = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"seed {seed}: teamrl run exited {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
        return {}
    res = {"seed": seed, "wall_s": wall, **run_summary(run)}
    finals = {g.name: g / "adapters" / f"v{steps}" for g in sorted((run / "groups").iterdir())}
    res.update(trio(finals, seed))
    print(json.dumps(res), flush=True)
    return res


LABELS = {
    "verifier_ba_v0": "verifier balanced accuracy, v0 (held-out, greedy, 200 tasks)",
    "verifier_ba_best": "verifier balanced accuracy, best",
    "verifier_ba_end": "verifier balanced accuracy, end",
    "solver_v0": "solver accuracy, v0",
    "solver_end": "solver accuracy, end",
    "trio_first_try": "trio with the trained adapters (n 4, T 1): solver's first try",
    "trio_after_retries": "trio with the trained adapters: team after retries",
    "trio_verifier_ba": "trio with the trained adapters: verifier balanced accuracy",
    "wall_s": "wall time of a run (s)",
}


def write_docs(folder: Path, summary: dict) -> None:
    """``summary.json`` and ``table.md`` (mean ± 95 % CI per figure) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    n, steps, base = len(summary["runs"]), summary["steps"], summary["base"]
    lines = [
        f"# addition-duo-checked over {n} seeds ({steps} steps each)",
        "",
        "Written by `tests/bench/checked_team.py` (`make results`); docs/verifier-learning.md.",
        "",
        f"| figure | mean ± 95 % CI over {n} seeds |",
        "|---|---|",
    ]
    lines += [
        f"| {label} | {fmt(summary['stats'][k], 1 if k == 'wall_s' else 3)} |" for k, label in LABELS.items()
    ]
    lines.append(f"| trio: gain of retries (after - first try) | {fmt(summary['gain'])} |")
    lines.append(
        f"| trio on base weights: first try / after retries | {base.get('trio_first_try')} / "
        f"{base.get('trio_after_retries')} |"
    )
    (folder / "table.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="", help="keep the runs and summary.json here (default: a temp folder)")
    p.add_argument("--docs", default="", help="also write summary.json and table.md to this folder")
    args = p.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="checked-team-"))
    root.mkdir(parents=True, exist_ok=True)
    base = trio({}, 0)
    print(json.dumps({"base_weights": base}), flush=True)
    runs = [r for r in (one_seed(root, s, args.steps) for s in range(args.seeds)) if r]
    keys = ["verifier_ba_v0", "verifier_ba_best", "verifier_ba_end", "solver_v0", "solver_end"]
    keys += ["trio_first_try", "trio_after_retries", "trio_verifier_ba", "wall_s"]
    stats = {k: mean_ci([r.get(k) for r in runs]) for k in keys}
    gain = mean_ci([r["trio_after_retries"] - r["trio_first_try"] for r in runs if r.get("trio_first_try")])
    print(f"addition-duo-checked, {len(runs)} seeds x {args.steps} steps (mean ± 95 % CI):")
    for k in keys:
        print(f"  {k:<22} {fmt(stats[k], 1 if k == 'wall_s' else 3)}")
    print(f"  {'trio gain of retries':<22} {fmt(gain)}")
    print(
        f"  trio on base weights: first try {base.get('trio_first_try')}, after retries {base.get('trio_after_retries')}"
    )
    summary = {"runs": runs, "base": base, "stats": stats, "gain": gain, "steps": args.steps}
    for folder in [root] + ([Path(args.docs)] if args.docs else []):
        write_docs(folder, summary)
    print(f"checked_team={stats['verifier_ba_end'][0]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
