"""MARFT's anonymous agents on a real model: the team with its profiles against the same team without them.

For each seed, ``teamrl eval`` of both workflows on the same held-out tasks with the same sampling seed
(base weights by default; ``--runs-profiles`` / ``--runs-anonymous``: each seed's last adapter version
of a ``real_model_learning.py`` run of that workflow, ``RUNS/seed<N>``). Reported: the team's held-out
accuracy (avg@n) and each agent's reward in either setting, and their paired difference (anonymous
minus profiles; mean and 95 % interval over the seeds, Student's t). Writes ``summary.json`` and
``table.md`` to ``--out``. Prints figures; asserts nothing. Not a timed test.

    python tests/bench/tasks/make_two_number.py --unique --low 1 --high 15 runs/two15.jsonl
    python tests/bench/anonymous_agents.py --tasks runs/two15.jsonl [--seeds 1,2,3] [--n 4] \\
        [--temperature 0.7] [--out docs/results/real-model/anonymous-base]

docs/real-model.md ("Anonymous agents at base weights") gives the figures: about 3 minutes an
evaluation on 2 cores (34 questions x 4 samples).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_runs import mean_ci, read  # noqa: E402
from real_model_learning import evaluate  # noqa: E402

BENCH = Path(__file__).resolve().parent / "workflows"


def adapters_of(runs: str, seed: int) -> Path | None:
    """The last adapter version of ``runs/seed<seed>`` (a real_model_learning.py run), or None."""
    if not runs:
        return None
    run = Path(runs) / f"seed{seed}"
    return run / "adapters" / f"v{int(read(run / 'metrics.jsonl')[-1]['version'])}"


def table(evals: dict[str, list[dict]], seeds: list[int]) -> tuple[str, dict]:
    """The markdown table and its rows: each metric in both settings and the paired difference."""
    a, b = evals["profiles"], evals["anonymous"]
    keys = [k for k in a[0] if isinstance(a[0][k], (int, float)) and (k.startswith("avg@") or "/" in k)]
    out = "| held-out metric | profiles | anonymous | anonymous - profiles (paired, 95 % CI) | per seed |\n"
    out += "|---|---|---|---|---|\n"
    rows = {}
    for k in keys:
        x, y = [r[k] for r in a], [r[k] for r in b]
        rows[k] = {"profiles": mean_ci(x), "anonymous": mean_ci(y), "difference": mean_ci([q - p for p, q in zip(x, y, strict=True)])}  # fmt: skip
        per = ", ".join(f"{p:.3f} / {q:.3f}" for p, q in zip(x, y, strict=True))
        (mp, hp, _), (mq, hq, _), (md, hd, _) = rows[k].values()
        out += f"| {k} | {mp:.3f} ± {hp:.3f} | {mq:.3f} ± {hq:.3f} | **{md:+.3f} ± {hd:.3f}** | {per} |\n"
    return out + f"\nSeeds {', '.join(map(str, seeds))} (per seed: profiles / anonymous).\n", rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--profiles", default=str(BENCH / "math-duo-two-number.toml"), help="the team with profiles"
    )
    p.add_argument(
        "--anonymous", default=str(BENCH / "math-duo-anonymous-two-number.toml"), help="the same team without"
    )
    p.add_argument("--tasks", default="", help="task file (JSONL/Parquet); its last tenth is held out")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--num-tasks", type=int, default=200, help="held-out tasks (at most the split's)")
    p.add_argument("--n", type=int, default=4, help="samples per held-out task")
    p.add_argument("--temperature", type=float, default=0.7, help="evaluation temperature of every agent")
    p.add_argument("--runs-profiles", default="", help="real_model_learning.py --runs of the profiles team")
    p.add_argument("--runs-anonymous", default="", help="real_model_learning.py --runs of the anonymous team")
    p.add_argument("--out", default="docs/results/real-model/anonymous-base")
    args = p.parse_args()
    seeds, out, t0 = [int(s) for s in args.seeds.split(",")], Path(args.out), time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    evals: dict[str, list[dict]] = {"profiles": [], "anonymous": []}
    for seed in seeds:
        for name, runs in (("profiles", args.runs_profiles), ("anonymous", args.runs_anonymous)):
            one = argparse.Namespace(**vars(args), workflow=getattr(args, name))
            evals[name].append(
                evaluate(one, seed, adapters_of(runs, seed), out / f"eval-{name}-seed{seed}.json")
            )
            print(f"seed {seed} {name}: {json.dumps(evals[name][-1])}", flush=True)
    text, rows = table(evals, seeds)
    summary = vars(args) | {"rows": rows, "evals": evals, "seconds": round(time.monotonic() - t0)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "table.md").write_text(text)
    print(text, end="")
    print(f"wrote {out}/ in {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
