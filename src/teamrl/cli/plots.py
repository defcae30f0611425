"""PNG plots of a run folder's metrics JSONL: reward against steps and wall time; per-agent grad norm."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill: the rest of the file is still good
    return rows


def _series(rows: list[dict], key: str, x: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        if key in r and x in r and r[key] is not None:
            xs.append(float(r[x]))
            ys.append(float(r[key]))
    return xs, ys


def smooth(ys: list[float], k: int = 10) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def group_metrics(run_dir: Path) -> dict[str, list[dict]]:
    """Each learner group's metrics rows: ``{"": RUN/metrics.jsonl}`` for a one-base run, else one
    entry per ``RUN/groups/<model id>/metrics.jsonl`` (a team of different models)."""
    groups = {g.name: read_jsonl(g / "metrics.jsonl") for g in group_folders(run_dir)}
    return groups or {"": read_jsonl(run_dir / "metrics.jsonl")}


GROUPS = "groups"  # RUN/groups/<model id>/: one learner group's folder in a team of different models


def group_dir(run_dir: Path, group: str) -> Path:
    """A learner group's folder (metrics.jsonl, adapters/, checkpoints/): the run folder itself for a
    one-base team, ``RUN/groups/<model id>`` for each group of a team of different models."""
    return run_dir / GROUPS / group if group else run_dir


def group_folders(run_dir: Path) -> list[Path]:
    """``RUN/groups/<model id>`` of each learner group that wrote metrics (none: a one-base run)."""
    return sorted(g for g in (run_dir / GROUPS).glob("*") if (g / "metrics.jsonl").is_file())


def plot_run(run_dir: Path) -> list[Path]:
    """Write reward_steps.png, reward_time.png, grad_norm.png and, when the run evaluated, held_out.png
    into ``run_dir/plots``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_metrics(run_dir)
    rows = [r for g in groups.values() for r in g]
    evals = read_jsonl(run_dir / "eval.jsonl")
    out_dir = run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for x, xlabel, name in (
        ("step", "learner step", "reward_steps.png"),
        ("time", "wall time (s)", "reward_time.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
        colors = ("tab:blue", "tab:green", "tab:purple", "tab:olive", "tab:cyan", "tab:brown")
        for i, (group, grows) in enumerate(groups.items()):
            color = colors[i % len(colors)]
            xs, ys = _series(grows, "reward_mean", x)
            if xs:
                who = f", {group}" if group else ""
                ax.plot(xs, ys, alpha=0.25, color=color)
                ax.plot(xs, smooth(ys), color=color, label=f"train reward (batch mean{who}, smoothed)")
        ex, ey = _series(evals, "reward_mean", x)
        if ex:
            ax.plot(ex, ey, "o-", color="tab:red", label="held-out reward")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name)
        plt.close(fig)
        written.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    agents = sorted({k.split("/", 1)[1] for r in rows for k in r if k.startswith("grad_norm/")})
    for a in agents:
        xs, ys = _series(rows, f"grad_norm/{a}", "step")
        ax.plot(xs, ys, label=a)
    ax.set_xlabel("learner step")
    ax.set_ylabel("grad norm")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if agents:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "grad_norm.png")
    plt.close(fig)
    written.append(out_dir / "grad_norm.png")
    if evals:
        written.append(held_out_plot(evals, out_dir / "held_out.png"))
    return written


HELD_OUT_KEYS = ("_accuracy", "_accept_rate")  # _accuracy covers _balanced_accuracy and first_try_accuracy


def held_out_plot(evals: list[dict], path: Path) -> Path:
    """Every agent's held-out metrics against the learner step (``eval.jsonl``): its accuracy (mean
    step reward), a verifier's balanced accuracy (a constant verdict scores 0.5) and accept rate,
    and the first-try accuracy of a team that routes back."""
    import matplotlib.pyplot as plt

    keys = sorted(
        {k for r in evals for k in r if k.endswith(HELD_OUT_KEYS) and isinstance(r[k], int | float)}
    )
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    for k in keys:
        xs, ys = _series(evals, k, "step")
        style = ":" if k.endswith("_accept_rate") else "--" if k == "first_try_accuracy" else "-"
        ax.plot(xs, ys, style, marker="o", markersize=3, label=k.replace("_", " "))
    ax.axhline(0.5, color="grey", lw=0.6, alpha=0.6)
    ax.set_xlabel("learner step")
    ax.set_ylabel("held-out")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if keys:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
