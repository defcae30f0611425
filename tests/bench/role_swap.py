"""Role-swap ablation (the shape of PettingLLMs' Table: specialised vs swapped vs shared adapters).

Trains a team with ``teamrl run`` (or takes a run folder that has adapters), then evaluates its last
adapter version on the held-out tasks with ``teamrl eval``, once per assignment of trained weights to
roles:

* ``specialised``: every role its own adapter, as trained;
* ``swapped``: the adapters rotated by one role (two roles: exchanged);
* ``all-<adapter>``: every role served with that one adapter's weights;
* ``base``: no adapter at all.

The claim under test: specialised adapters beat swapped and shared ones by a wide margin, because
each learned its own role. Writes ``summary.json``, ``table.md`` and ``role_swap.png`` to ``--out``
and prints the table. Greedy decoding (temperature 0, one sample per task), so each figure is exact
for its tasks and seed. Not a timed test.

    python tests/bench/role_swap.py [--workflow addition-duo] [--steps 60] [--run-dir runs/role-swap]
        [--num-tasks 200] [--out docs/results/role_swap]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "teamrl.cli.main"]


def last_version(run_dir: Path) -> Path | None:
    root = run_dir / "adapters"
    if not root.is_dir():
        return None
    versions = [p for p in root.iterdir() if p.name.startswith("v") and p.name[1:].isdigit()]
    return max(versions, key=lambda p: int(p.name[1:]), default=None)


def assignments(adapters: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Condition name -> ``--serve NAME=OTHER`` pairs."""
    out: dict[str, list[tuple[str, str]]] = {"specialised": []}
    if len(adapters) > 1:
        out["swapped"] = [(a, adapters[(i + 1) % len(adapters)]) for i, a in enumerate(adapters)]
        for b in adapters:
            out[f"all-{b}"] = [(a, b) for a in adapters if a != b]
    return out


def evaluate(args: argparse.Namespace, folder: Path | None, serve: list[tuple[str, str]]) -> dict:
    cmd = [*CLI, "eval", "--workflow", args.workflow, "--num-tasks", str(args.num_tasks)]
    cmd += ["--n", "1", "--k", "1", "--temperature", "0", "--seed", str(args.seed)]
    if folder is not None:
        cmd += ["--adapters", str(folder)]
    for name, other in serve:
        cmd += ["--serve", f"{name}={other}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"role_swap: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plot(rows: dict[str, dict], metrics: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 3.6))
    width = 0.8 / len(metrics)
    for j, m in enumerate(metrics):
        xs = [i + (j - (len(metrics) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r.get(m, float("nan")) for r in rows.values()], width, label=m)
    ax.set_xticks(range(len(rows)), list(rows), rotation=15)
    ax.set_ylim(0, 1)
    ax.set_title("role swap: the same trained weights, assigned to roles differently")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workflow", default="addition-duo")
    p.add_argument("--run-dir", default="runs/role-swap", help="trained here unless it already has adapters")
    p.add_argument("--steps", type=int, default=60, help="learner steps when training")
    p.add_argument("--num-tasks", type=int, default=200, help="held-out tasks per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/results/role_swap")
    args = p.parse_args()
    run_dir, out = Path(args.run_dir), Path(args.out)
    t0 = time.monotonic()
    if last_version(run_dir) is None:
        cmd = [*CLI, "run", "--workflow", args.workflow, "--run-dir", str(run_dir)]
        cmd += ["--steps", str(args.steps), "--seed", str(args.seed)]
        print("training:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    folder = last_version(run_dir)
    if folder is None:
        raise SystemExit(f"role_swap: {run_dir} has no adapters after training")
    adapters = sorted(q.name for q in folder.iterdir() if (q / "adapter_config.json").is_file())
    print(f"adapters {adapters} of {folder} ({time.monotonic() - t0:.0f} s)", flush=True)
    rows: dict[str, dict] = {}
    for name, serve in assignments(adapters).items():
        rows[name] = evaluate(args, folder, serve)
        print(
            f"{name:>24}: {json.dumps({k: v for k, v in rows[name].items() if k != 'adapters'})}", flush=True
        )
    rows["base"] = evaluate(args, None, [])
    team = next(k for k in rows["specialised"] if k.startswith("avg@"))
    metrics = [team, *sorted(k for k in rows["specialised"] if k.startswith("reward/"))]
    metrics += [k for k in rows["specialised"] if k.endswith("_balanced_accuracy")]
    out.mkdir(parents=True, exist_ok=True)
    header = "| assignment | " + " | ".join(metrics) + " |\n|---|" + "---|" * len(metrics) + "\n"
    body = "".join(
        f"| {name} | " + " | ".join(f"{r.get(m, float('nan')):.3f}" for m in metrics) + " |\n"
        for name, r in rows.items()
    )
    summary = {"workflow": args.workflow, "adapters": str(folder), "metrics": metrics, "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(header + body)
    plot(rows, metrics, out / "role_swap.png")
    print(header + body, end="")
    print(f"wrote {out}/ in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
