"""Two training settings that differ in one thing, compared over several seeds on one machine.

    python tests/bench/compare_runs.py mode          # (a) async against sync: time to a reward
    python tests/bench/compare_runs.py algorithm --reward-scale verifier=10
                                                     # (b) Dr. MAS agent-wise vs global GRPO
    python tests/bench/compare_runs.py update-order  # (c) agent-by-agent (HAPPO) vs simultaneous
    python tests/bench/compare_runs.py factor-clip --factor-clip 2
                                                     # (d) Dr. MAS, HAPPO's factor unclipped vs clipped
    python tests/bench/compare_runs.py table runs/results docs/results   # the table from saved comparisons

Each run is a real ``teamrl run`` (vLLM rollouts, DeepSpeed learner) on the embedded default task,
once per seed (``--seeds``, default 5) for each of the two settings; the two settings of one seed run
back to back, so slow drift of a shared machine falls on both. Reported per setting: mean and 95 %
confidence interval (Student's t over the seeds) of the end and best held-out solver accuracy, the
seconds until held-out solver accuracy first reached ``--target``, the wall time, and per agent the
gradient-norm spike ratio (max over median of ``grad_norm/<adapter>``, the Dr. MAS paper's instability
signal) with its first-update and median norm (``grad0/``, ``grad_median/``: in a sync run both
settings of a seed train their first step on the same rollouts); and the paired difference (second
minus first) with its interval. With ``--out DIR`` the runs,
``summary.json``, ``table.md`` (one row of the README's results table) and two plots stay there:
``accuracy.png`` (held-out solver accuracy per step, mean and band over seeds) and ``grad_norm.png``
(per-agent gradient norm per step, median over seeds: global against agent-wise normalisation is the
Dr. MAS figure). The last line is ``compare_<what>=<float>``: for ``mode`` the sync/async ratio of mean
time-to-target (>1: async reached it sooner), else the ratio of mean end accuracies (second/first).
This prints figures; it asserts nothing about them. ``make results`` runs (a)-(c) and the table
(about 30-60 minutes on 2 cores with the defaults). With ``--reuse`` a run folder already under
``--out`` that holds ``--steps`` steps is summarised as it stands instead of run again (an interrupted
comparison goes on where it stopped).
"""

from __future__ import annotations

import argparse
import json
import math
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
    # the second setting also gets --set learner.happo_factor_clip=<--factor-clip> (main)
    "factor-clip": (["--algorithm", "drmas", "--mode", "sync"], ["--algorithm", "drmas", "--mode", "sync"]),
}
NAMES = {"factor-clip": ["unclipped", "clipped"]}  # else each setting's first flag value
DEFAULT_ARGS = {  # what the README's rows were run with
    "mode": [],
    "algorithm": ["--steps", "40", "--reward-scale", "verifier=10"],
    "update-order": ["--steps", "40"],
}
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]  # t(0.975, df 1..10)


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
            adapter = key.split("/", 1)[1]
            out[f"spike/{adapter}"] = max(xs) / max(statistics.median(xs), 1e-12)
            out[f"grad0/{adapter}"] = xs[0]  # the first update: the same rollouts in both settings of a seed
            out[f"grad_median/{adapter}"] = statistics.median(xs)
    return out


def run_once(cmd: list[str], run: Path, label: str) -> float | None:
    """Run ``cmd`` (a ``teamrl run``); its wall time, also kept in ``run/compare.json`` for
    ``--reuse``; None (the output printed) when it failed."""
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    if res.returncode != 0:
        print(f"{label}: teamrl run failed ({res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
        return None
    (run / "compare.json").write_text(json.dumps({"wall_s": wall, "argv": cmd[3:]}))
    return wall


def finished_wall(run: Path, steps: int) -> float | None:
    """The wall time of a finished run in ``run`` (``steps`` metric rows), for ``--reuse``: from its
    ``compare.json``, else its last step's time; None when the folder holds no finished run."""
    rows = read(run / "metrics.jsonl")
    if len(rows) < steps:
        return None
    saved = run / "compare.json"
    return float(json.loads(saved.read_text())["wall_s"]) if saved.is_file() else float(rows[-1]["time"])


def with_latency(workflow: str, reward_s: float, tool_s: float, root: Path) -> str:
    """``workflow`` itself, or (with a latency) a copy written to ``root`` whose ``[reward]`` and
    ``[tools.*]`` tables carry ``latency_s`` (docs/running.md, "Tool and reward latency")."""
    if not reward_s and not tool_s:
        return workflow
    import tomllib

    import tomli_w

    from teamrl.rollout.workflows import BUILTIN, shipped

    files = shipped()
    if workflow in BUILTIN:
        data = json.loads(json.dumps(BUILTIN[workflow]))
    else:
        data = tomllib.loads(Path(files.get(workflow, workflow)).read_text())
    if reward_s:
        data.setdefault("reward", {})["latency_s"] = reward_s
    for table in data.get("tools", {}).values():
        table["latency_s"] = tool_s or table.get("latency_s", 0.0)
    path = root / f"{Path(workflow).stem}-latency.toml"
    path.write_text(tomli_w.dumps(data))
    return str(path)


def mean_ci(xs: list[float]) -> tuple[float, float, int]:
    """(mean, half-width of the 95 % confidence interval, n) of the finite values; nan where n < 2."""
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not xs:
        return math.nan, math.nan, 0
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan, 1
    t = T975[min(len(xs) - 1, len(T975)) - 1] if len(xs) - 1 <= len(T975) else 1.96
    return m, t * statistics.stdev(xs) / math.sqrt(len(xs)), len(xs)


def fmt(stat: tuple[float, float, int], digits: int = 3) -> str:
    m, h, n = stat
    if n == 0:
        return "n/a"
    return f"{m:.{digits}f} ± {h:.{digits}f}" if n > 1 else f"{m:.{digits}f}"


def statistics_of(per_seed: dict[str, list[dict]]) -> dict:
    """Mean and CI per setting and key, and the paired differences (second - first)."""
    (a, ra), (b, rb) = per_seed.items()
    keys = ["end", "best", "time_to_target", "wall_s"]
    keys += sorted({k for r in ra + rb for k in r if k.startswith(("spike/", "grad0/", "grad_median/"))})
    out: dict = {
        name: {k: mean_ci([r.get(k) for r in runs]) for k in keys} for name, runs in per_seed.items()
    }
    out["difference"] = {}
    for k in keys:
        pairs = [(x.get(k), y.get(k)) for x, y in zip(ra, rb, strict=True)]
        out["difference"][k] = mean_ci([y - x for x, y in pairs if x is not None and y is not None])
    return out


def plot(root: Path, what: str, names: list[str], seeds: list[int]) -> list[Path]:
    """accuracy.png (mean and band over seeds) and grad_norm.png (per agent, median over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        by_step: dict[int, list[float]] = {}
        for s in seeds:
            for e in read(root / f"{name}-seed{s}" / "eval.jsonl"):
                by_step.setdefault(int(e["step"]), []).append(e["solver_accuracy"])
        steps = sorted(by_step)
        stats = [mean_ci(by_step[x]) for x in steps]
        mean = [m for m, _, _ in stats]
        half = [h if math.isfinite(h) else 0.0 for _, h, _ in stats]
        ax.plot(steps, mean, label=name)
        ax.fill_between(steps, [m - h for m, h in zip(mean, half, strict=True)], [m + h for m, h in zip(mean, half, strict=True)], alpha=0.2)  # fmt: skip
    ax.set_xlabel("learner step (policy version)")
    ax.set_ylabel("held-out solver accuracy")
    ax.set_title(f"{what}: mean and 95% CI over {len(seeds)} seeds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.append(root / "accuracy.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, dict[str, dict[int, list[float]]]] = {name: {} for name in names}
    for name in names:
        for s in seeds:
            for r in read(root / f"{name}-seed{s}" / "metrics.jsonl"):
                for k, v in r.items():
                    if k.startswith("grad_norm/") and isinstance(v, (int, float)) and v == v:
                        series[name].setdefault(k.split("/", 1)[1], {}).setdefault(int(r["step"]), []).append(
                            v
                        )
    agents = sorted({a for per in series.values() for a in per})
    for name, style in zip(names, ("--", "-"), strict=True):  # one colour per agent, one style per setting
        for agent, by_step in sorted(series[name].items()):
            # a zero norm (no group with reward variance: no update) has no place on a log axis
            pts = [(x, statistics.median(by_step[x])) for x in sorted(by_step)]
            xs, ys = [x for x, y in pts if y > 0], [y for x, y in pts if y > 0]
            ax.plot(xs, ys, style, marker="o", color=f"C{agents.index(agent)}", label=f"{name}: {agent}")
    ax.set_yscale("log")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("learner step")
    ax.set_ylabel("gradient norm (median over seeds)")
    ax.set_title(f"{what}: per-agent gradient norm")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.append(root / "grad_norm.png")
    fig.savefig(out[-1], dpi=110)
    plt.close(fig)
    return out


def table_row(what: str, argv: list[str], stats: dict, names: list[str], n: int) -> str:
    a, b = names
    key = "time_to_target" if what == "mode" else "end"
    label = "time to target (s)" if what == "mode" else "end held-out solver accuracy"
    diff = stats["difference"][key]
    cmd = f"tests/bench/compare_runs.py {what} {' '.join(argv)}".rstrip()
    result = f"{label}: {a} {fmt(stats[a][key])}, {b} {fmt(stats[b][key])}; paired difference {fmt(diff)}"
    if what in ("algorithm", "factor-clip"):  # each adapter's gradient norm in either setting
        grads = [k for k in stats[a] if k.startswith("grad_median/" if what == "algorithm" else "grad0/")]
        shown = [f"{k.split('/', 1)[1]} {a} {fmt(stats[a][k])}, {b} {fmt(stats[b][k])}" for k in grads]
        result = "; ".join(
            [result] * (stats[a][key][2] > 0)
            + [("median" if what == "algorithm" else "first-update") + " gradient norm " + "; ".join(shown)]
            * bool(shown)
        )
    return f"| {what} | `{cmd}` | {result} ({n} seeds, 95 % CI) |"


def table(folder: Path, dest: Path) -> int:
    """The results table of the comparisons saved under ``folder`` (``--out folder/<what>``): printed,
    and written with their plots and summaries to ``dest`` (``dest/README.md``)."""
    import shutil

    rows = ["| comparison | command | result (mean ± 95 % CI over seeds) |", "|---|---|---|"]
    dest.mkdir(parents=True, exist_ok=True)
    for what in VARIANTS:
        src = folder / what
        if not (src / "table.md").is_file():
            continue
        rows.append((src / "table.md").read_text().strip())
        for f in ("accuracy.png", "grad_norm.png", "summary.json"):
            if (src / f).is_file():
                shutil.copyfile(src / f, dest / f"{what}-{f}")
    text = "\n".join(rows) + "\n"
    others = sorted(d.name for d in dest.iterdir() if (d / "table.md").is_file())
    if others:  # written by the other results benches (role_swap.py, staleness.py)
        text += "\nAlso here: " + ", ".join(f"[{name}]({name}/table.md)" for name in others) + ".\n"
    (dest / "README.md").write_text(
        "# Results\n\nWritten by `make results` (tests/bench/compare_runs.py); plots and per-seed "
        "summaries beside this file.\n\n" + text
    )
    print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["table"]:
        if len(argv) != 3:
            print("usage: compare_runs.py table RUNS_FOLDER DEST_FOLDER", file=sys.stderr)
            return 2
        return table(Path(argv[1]), Path(argv[2]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=sorted(VARIANTS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--tasks-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--eval-interval", type=int, default=10)
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=5, help="seeds per setting (seed, seed + 1, ...)")
    p.add_argument("--target", type=float, default=0.5, help="held-out solver accuracy for time-to-target")
    p.add_argument(
        "--reward-scale",
        metavar="ROLE=X",
        action="append",
        default=[],
        help="passed to both runs (e.g. verifier=10 for (b): agents with different reward scales)",
    )
    p.add_argument("--workflow", default="addition-duo", help="workflow name or TOML (default addition-duo)")
    p.add_argument(
        "--model", default=None, help="passed to both runs (e.g. smollm2-135m; default the workflow's)"
    )
    p.add_argument("--tasks", default=None, help="task file passed to both runs (JSONL/Parquet)")
    p.add_argument(
        "--reward-latency",
        type=float,
        default=0.0,
        metavar="S",
        help="[reward] latency_s of both runs: each episode waits S s before it is scored (a remote verifier)",
    )
    p.add_argument(
        "--tool-latency", type=float, default=0.0, metavar="S", help="latency_s of every [tools] table"
    )
    p.add_argument(
        "--max-lag", type=int, default=None, help="passed to both runs (async: the staleness bound)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="passed to both runs"
    )
    p.add_argument(
        "--factor-clip", type=float, default=2.0, help="(d): the clipped setting's learner.happo_factor_clip"
    )
    p.add_argument(
        "--reuse", action="store_true", help="summarise a run folder under --out that has --steps steps"
    )
    p.add_argument("--quick", action="store_true", help="6 steps of 4x4: checks the script, not the science")
    p.add_argument(
        "--out", default=None, help="folder for the runs, summary and plots (default: a temp folder)"
    )
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.quick:
        args.steps, args.tasks_per_step, args.group_size, args.eval_interval, args.eval_tasks = 6, 4, 4, 3, 50
    root = Path(args.out or tempfile.mkdtemp(prefix=f"teamrl-compare-{args.what}-"))
    root.mkdir(parents=True, exist_ok=True)
    common = [
        "--steps", str(args.steps), "--tasks-per-step", str(args.tasks_per_step), "--group-size",
        str(args.group_size), "--eval-interval", str(args.eval_interval), "--eval-tasks", str(args.eval_tasks),
    ]  # fmt: skip
    for item in args.reward_scale:
        common += ["--reward-scale", item]
    for item in args.set:
        common += ["--set", item]
    if args.max_lag is not None:
        common += ["--max-lag", str(args.max_lag)]
    for flag, value in (("--model", args.model), ("--tasks", args.tasks)):
        common += [flag, value] if value else []
    workflow = with_latency(args.workflow, args.reward_latency, args.tool_latency, root)
    names = NAMES.get(args.what) or ["_".join(v[1::2][:1]) for v in VARIANTS[args.what]]
    variants = list(VARIANTS[args.what])
    if args.what == "factor-clip":
        variants[1] = [*variants[1], "--set", f"learner.happo_factor_clip={args.factor_clip}"]
    seeds = list(range(args.seed, args.seed + args.seeds))
    per_seed: dict[str, list[dict]] = {n: [] for n in names}
    for seed in seeds:
        for name, variant in zip(names, variants, strict=True):
            run = root / f"{name}-seed{seed}"
            cmd = [sys.executable, "-m", "teamrl.cli.main", "run", "--workflow", workflow]
            cmd += ["--run-dir", str(run), "--seed", str(seed), *common, *variant]
            wall = finished_wall(run, args.steps) if args.reuse else None
            if wall is None:
                wall = run_once(cmd, run, f"{name} seed {seed}")
            if wall is None:
                return 1
            per_seed[name].append(summarise(run, wall, args.target))
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in per_seed[name][-1].items()}
            print(f"{name:>13} seed {seed}: {json.dumps(shown)}", flush=True)
    stats = statistics_of(per_seed)
    for name in [*names, "difference"]:
        print(f"{name:>13}: " + "   ".join(f"{k} {fmt(v)}" for k, v in stats[name].items()))
    a, b = names
    if args.what == "mode":
        ta, tb = stats[a]["time_to_target"][0], stats[b]["time_to_target"][0]
        ratio = ta / tb if ta and tb and math.isfinite(ta) and math.isfinite(tb) else float("nan")
    else:
        ea, eb = stats[a]["end"][0], stats[b]["end"][0]
        ratio = eb / ea if ea and math.isfinite(ea) else float("nan")
    shown_args: list[str] = []  # the command line for the table, without --out
    skip = False
    for x in argv[1:]:
        if skip or x == "--out" or x.startswith("--out="):
            skip = x == "--out"
            continue
        shown_args.append(x)
    (root / "summary.json").write_text(json.dumps({"what": args.what, "seeds": seeds, "runs": per_seed, "statistics": stats}, indent=1))  # fmt: skip
    (root / "table.md").write_text(table_row(args.what, shown_args, stats, names, len(seeds)) + "\n")
    for f in plot(root, args.what, names, seeds):
        print(f"plot {f}")
    print(f"runs, summary.json and table.md in {root}")
    print(f"compare_{args.what.replace('-', '_')}={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
