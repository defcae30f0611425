"""``teamrl show RUN``: one self-contained HTML report of a run folder (issue 7, item 4).

Multi-agent runs are hard to debug from numbers alone, so next to the reward curves the report
draws sampled episodes as the graphs they are: one node per agent step (lane = agent, column =
turn), an edge from every parent the step read, and beside the graph each step's message, tool
calls, reward/credit and the policy version it was sampled with. The best and worst episodes of
the most recent policy versions sit side by side.

Design decisions:

* One HTML file with inline CSS and SVG drawn here, no JavaScript, fonts, CDN or network: it opens
  anywhere, can be mailed, and survives the run folder being copied off a cluster. Clicking a node
  jumps to its step card (plain ``href`` anchors; CSS ``:target`` highlights it).
* Everything read from the run folder is foreign (trajectory text is model output, i.e. untrusted):
  every string goes through ``html.escape`` before it reaches the page, ids in the page are
  generated here, never taken from the data.
* A folder that is partly readable still gives a report of what is there; each problem is listed
  at the top of the report and on stderr. Exit code 0 means every file that exists was read in
  full; 2 means the folder is not a run folder or something in it was malformed (the report is
  still written when anything was readable). A torn last line of a JSONL file (the writer was
  mid-line) is expected while a run is live and is only noted.

Inputs (see ``teamrl.cli.run``): ``config.json`` or ``config.toml``; ``metrics.jsonl`` (one object
per learner step: ``step``, ``time``, ``version``, ``reward_mean``, ``reward/<agent>``,
``grad_norm/<agent>``, ...); ``eval.jsonl`` (held-out evaluations); ``samples/step-NNNNNN.arrow``
(each the bytes of ``teamrl.protocol.encode_trajectories``).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory

EXIT_OK = 0
EXIT_PROBLEM = 2
SAMPLE_NAME = re.compile(r"^step-(\d+)\.arrow$")
MAX_POINTS = 800  # per polyline; longer series are thinned (after smoothing) to keep the page light
MAX_TEXT = 4000  # characters of one message shown; the rest is counted, not dropped silently
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def build_parser(prog: str = "teamrl show") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Write a self-contained HTML report of a run folder: reward and per-agent curves, "
        "the held-out eval curve, and sampled episodes drawn as graphs (agents as nodes, dependency "
        "edges, each agent's message, tool calls, reward/credit and policy version), with the best "
        "and worst episodes of the most recent policy versions side by side. No network is used; the "
        "page has no scripts.",
        epilog="Exit codes: 0 report written and every file read in full; 2 the folder is not a run "
        "folder or a file in it is malformed (each problem is printed; the report is still written "
        "with whatever was readable).",
    )
    p.add_argument(
        "run", metavar="RUN", help="run folder (config.json|toml, metrics.jsonl, eval.jsonl, samples/)"
    )
    p.add_argument("--out", metavar="FILE", help="output HTML file (default: RUN/report.html)")
    p.add_argument(
        "--episodes", type=int, default=3, metavar="K", help="best and worst episodes shown (default 3 each)"
    )
    p.add_argument(
        "--recent-versions",
        type=int,
        default=3,
        metavar="N",
        help="'recent' = episodes sampled with one of the N newest policy versions (default 3)",
    )
    p.add_argument(
        "--sample-files",
        type=int,
        default=20,
        metavar="N",
        help="read the N newest samples/*.arrow files, plus a few spread over the run (default 20)",
    )
    p.add_argument("--title", help="page title (default: the run folder's name)")
    p.add_argument(
        "--print",
        type=int,
        default=0,
        metavar="N",
        dest="print_episodes",
        help="also print the N newest sampled episodes as text: who said what to whom, rewards, versions",
    )
    return p


def episode_text(traj: GraphTrajectory, width: int = 400) -> str:
    """One episode as plain text: each step with its agent, the steps it read, version and reward."""
    head = (
        f"episode {traj.episode_id} task {traj.task_id} ({traj.workflow}): team reward "
        f"{_fmt(float(traj.reward))}"
    )
    lines = [head]
    for i, st in enumerate(traj.steps):
        read = ", ".join(f"#{int(p)} {traj.steps[int(p)].agent_id}" for p in st.parents)
        text = st.response_text.strip().replace("\n", "\n      ")
        if len(text) > width:
            text = text[:width] + f"... (+{len(text) - width} chars)"
        lines.append(
            f"  #{i} {st.agent_id} ({st.role}, turn {st.turn}, {st.adapter or 'base'} v{st.policy_version}) "
            f"reward {_fmt(float(st.reward))}{f' <- read {read}' if read else ''}"
        )
        lines.append(f"      {text or '(empty)'}")
        for call in st.tool_calls:
            lines.append(f"      tool call: {str(call)[:width]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# reading the run folder


@dataclass
class Sample:
    """One decoded episode and where it came from."""

    traj: GraphTrajectory
    file: str
    file_step: int | None

    @property
    def version(self) -> int:
        """The newest policy version that acted in the episode (async runs mix versions)."""
        return max((s.policy_version for s in self.traj.steps), default=-1)

    @property
    def key(self) -> tuple[float, float, str]:
        """Ranking key: team reward, then summed step credit, then id (deterministic ties)."""
        credit = sum(_finite(s.reward) or 0.0 for s in self.traj.steps)
        return (_finite(self.traj.reward) or 0.0, credit, self.traj.episode_id)


@dataclass
class Run:
    path: Path
    config_name: str = ""
    config_text: str = ""
    metrics: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    sample_files_total: int = 0
    sample_files_read: int = 0
    problems: list[str] = field(default_factory=list)  # malformed input: exit code 2
    notes: list[str] = field(default_factory=list)  # absent optional parts, torn last lines: exit 0
    spread_files: list[str] = field(default_factory=list)  # files picked across the run's history

    @property
    def readable(self) -> bool:
        return bool(self.config_text or self.metrics or self.evals or self.samples)


def _finite(v: Any) -> float | None:
    """``v`` as a plottable float, else None. Beyond +-1e150 counts as not finite: the axis
    arithmetic (spans, tick steps) would overflow."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        return None
    return f if math.isfinite(f) and abs(f) < 1e150 else None


def read_jsonl(path: Path, run: Run) -> list[dict]:
    """The JSON objects of ``path``; malformed lines become problems, a torn last line a note."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        run.problems.append(f"{path.name}: cannot read ({e.strerror or e})")
        return []
    rows: list[dict] = []
    lines = text.split("\n")
    bad: list[int] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # no newline after it: the writer was cut mid-line
                run.notes.append(
                    f"{path.name}: last line is incomplete (run still writing or killed); skipped"
                )
            else:
                bad.append(i + 1)
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad.append(i + 1)
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        run.problems.append(
            f"{path.name}: {len(bad)} line(s) are not JSON objects (line {shown}); expected one object per line"
        )
    return rows


def _read_config(run: Run) -> None:
    for name in ("config.json", "config.toml"):
        path = run.path / name
        if not path.exists():
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            run.problems.append(f"{name}: cannot read ({e.strerror or e})")
            return
        try:
            if name.endswith(".json"):
                text = json.dumps(json.loads(text), indent=2, sort_keys=True)
            else:
                import tomllib

                tomllib.loads(text)
        except (ValueError, TypeError) as e:  # JSONDecodeError and TOMLDecodeError are ValueErrors
            run.problems.append(f"{name}: not valid {name.rsplit('.', 1)[1].upper()} ({e})")
        run.config_name, run.config_text = name, text
        return
    run.notes.append("no config.json or config.toml in the run folder")


def _sample_files(run: Run, newest: int) -> list[tuple[Path, int | None]]:
    folder = run.path / "samples"
    if not folder.is_dir():
        run.notes.append(
            "no samples/ folder: no episodes to draw (the training loop writes samples/step-NNNNNN.arrow)"
        )
        return []
    files: list[tuple[Path, int | None]] = []
    for p in folder.iterdir():
        if not p.name.endswith(".arrow"):
            continue
        m = SAMPLE_NAME.match(p.name)
        if m is None:
            run.notes.append(f"samples/{p.name}: name is not step-NNNNNN.arrow; read, sorted last")
        files.append((p, int(m.group(1)) if m else None))
    files.sort(key=lambda f: (f[1] is None, f[1] if f[1] is not None else 0, f[0].name))
    run.sample_files_total = len(files)
    if not files:
        run.notes.append("samples/ holds no .arrow files yet")
        return []
    # The newest files for the best/worst comparison, plus up to 6 spread over the whole run.
    chosen = set(range(max(0, len(files) - max(1, newest)), len(files)))
    spread = sorted({round(i * (len(files) - 1) / 5) for i in range(6)}) if len(files) > 1 else [0]
    run.spread_files = [files[i][0].name for i in spread]
    chosen.update(spread)
    return [files[i] for i in sorted(chosen)]


def load_run(path: Path, sample_files: int = 20) -> Run:
    run = Run(path=path)
    _read_config(run)
    metrics = path / "metrics.jsonl"
    from teamrl.cli.plots import group_folders

    groups = group_folders(path)
    if not metrics.exists() and groups:  # a team of different models: one learner group per base
        metrics = groups[0] / "metrics.jsonl"
        others = ", ".join(str(g) for g in groups[1:])
        run.notes.append(
            f"learner groups: {', '.join(g.name for g in groups)}; steps shown are "
            f"{groups[0].name}'s (teamrl show {others} for the others' metrics)"
        )
    if metrics.exists():
        run.metrics = read_jsonl(metrics, run)
    else:
        run.problems.append("metrics.jsonl is missing (every run writes one object per learner step there)")
    evals = path / "eval.jsonl"
    if evals.exists():
        run.evals = read_jsonl(evals, run)
    else:
        run.notes.append("no eval.jsonl (held-out evaluation disabled or not reached yet)")
    files = _sample_files(run, sample_files)
    if files:
        from teamrl.protocol import ProtocolError, decode_trajectories

        seen: set[tuple[str, int]] = set()
        for p, step in files:
            try:
                data = p.read_bytes()
            except OSError as e:
                run.problems.append(f"samples/{p.name}: cannot read ({e.strerror or e})")
                continue
            if not data:  # created, not yet written: a live run's newest file
                run.notes.append(f"samples/{p.name}: empty (still being written?); skipped")
                continue
            try:
                trajs = decode_trajectories(data)
            except ProtocolError as e:
                run.problems.append(
                    f"samples/{p.name}: not a trajectory batch ({type(e).__name__}: {e}); "
                    "expected the bytes of teamrl.protocol.encode_trajectories"
                )
                continue
            run.sample_files_read += 1
            for t in trajs:
                k = (t.incarnation, t.seq)
                if k in seen:
                    continue
                seen.add(k)
                run.samples.append(Sample(t, p.name, step))
    return run


def pick_best_worst(
    samples: list[Sample], k: int, recent: int
) -> tuple[list[Sample], list[Sample], list[int]]:
    """Best and worst ``k`` episodes among those sampled with the ``recent`` newest versions.

    The two lists are disjoint (a small pool gives fewer worst episodes rather than repeats).
    """
    versions = sorted({s.version for s in samples}, reverse=True)[: max(1, recent)]
    pool = sorted((s for s in samples if s.version in set(versions)), key=lambda s: s.key)
    best = list(reversed(pool[-k:])) if k > 0 else []
    taken = {id(s) for s in best}
    worst = [s for s in pool if id(s) not in taken][:k]
    return best, worst, versions


# ---------------------------------------------------------------------------------------------
# drawing: line charts


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e5 or a < 1e-3:
        return f"{v:.2g}"
    return f"{v:.4g}"


def smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _thin(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    if len(xs) <= MAX_POINTS:
        return xs, ys
    step = len(xs) / MAX_POINTS
    idx = sorted({int(i * step) for i in range(MAX_POINTS)} | {len(xs) - 1})
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = hi - lo
    raw = span / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    # Indexed, not accumulated: near 1e17 a step can be below one ulp and ``t += step`` never moves.
    ticks = [first + i * step for i in range(4 * n + 2)]
    return [0.0 if abs(t) < step * 1e-9 else float(t) for t in ticks if t <= hi + step * 1e-9]


@dataclass
class Series:
    name: str
    xs: list[float]
    ys: list[float]
    color: str
    faint: bool = False  # raw values behind their smoothed line
    markers: bool = False  # eval points: circles with a tooltip each


def series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        xv, yv = _finite(r.get(x)), _finite(r.get(key))
        if xv is not None and yv is not None:
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def with_smoothing(name: str, xs: list[float], ys: list[float], color: str) -> list[Series]:
    """The raw curve (faint) and its moving average, or just the raw curve when it is short."""
    if len(ys) < 8:
        return [Series(name, xs, ys, color)]
    k = max(2, min(50, len(ys) // 15))
    return [
        Series(name + " (raw)", xs, ys, color, faint=True),
        Series(f"{name}, smoothed over {k}", xs, smooth(ys, k), color),
    ]


def line_chart(title: str, all_series: list[Series], xlabel: str, ylabel: str = "", log: bool = False) -> str:
    """An inline SVG line chart with axes, ticks and a legend, or a 'no data' box."""
    drawn = [s for s in all_series if s.xs]
    if log:
        drawn = [Series(s.name, *_positive(s.xs, s.ys), s.color, s.faint, s.markers) for s in drawn]
        drawn = [s for s in drawn if s.xs]
    if not drawn:
        return f'<figure class="chart empty"><figcaption>{_e(title)}</figcaption><p>no data</p></figure>'
    f = _Plot.around(drawn, log)
    out = [f'<svg class="plot" viewBox="0 0 {f.w} {f.h}" width="{f.w}" height="{f.h}" role="img">']
    out.append(f'<rect x="{f.ml}" y="{f.mt}" width="{f.pw}" height="{f.ph}" class="pa"/>')
    out += _y_ticks(f)
    out += _x_ticks(f)
    out += _axis_labels(f, xlabel, ylabel)
    for s in drawn:
        out += _polyline(f, s)
    out.append("</svg>")
    legend = "".join(
        f'<span class="lg{" lgf" if s.faint else ""}"><i style="background:{s.color}"></i>{_e(s.name)}</span>'
        for s in drawn
    )
    return f'<figure class="chart"><figcaption>{_e(title)}</figcaption>{"".join(out)}<div class="legend">{legend}</div></figure>'


@dataclass
class _Plot:
    """A chart's geometry: the SVG size, margins, plot area and data range (y in log10 if ``log``)."""

    x0: float
    x1: float
    y0: float
    y1: float
    log: bool
    w, h, ml, mr, mt, mb = 560, 250, 58, 14, 10, 38  # class constants, not fields

    @property
    def pw(self) -> int:
        return self.w - self.ml - self.mr

    @property
    def ph(self) -> int:
        return self.h - self.mt - self.mb

    @classmethod
    def around(cls, drawn: list[Series], log: bool) -> _Plot:
        """The range of every drawn point; a flat range widened, y padded by 6 % each side."""
        xs = [x for s in drawn for x in s.xs]
        ys = [math.log10(y) if log else y for s in drawn for y in s.ys]
        x0, x1 = min(xs), max(xs)
        y0, y1 = min(ys), max(ys)
        if x1 == x0:
            x0, x1 = x0 - 1, x1 + 1
        if y1 == y0:
            y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
        pad = (y1 - y0) * 0.06
        return cls(x0, x1, y0 - pad, y1 + pad, log)

    def px(self, x: float) -> float:
        return self.ml + (x - self.x0) / (self.x1 - self.x0) * self.pw

    def py(self, y: float) -> float:
        return (
            self.mt + self.ph - ((math.log10(y) if self.log else y) - self.y0) / (self.y1 - self.y0) * self.ph
        )


def _y_ticks(f: _Plot) -> list[str]:
    """Horizontal grid lines and their labels (powers of ten on a log axis)."""
    yt = (
        [10**t for t in range(math.floor(f.y0), math.ceil(f.y1) + 1) if f.y0 <= t <= f.y1]
        if f.log
        else _nice_ticks(f.y0, f.y1)
    )
    if f.log and len(yt) < 2:
        yt = [10**t for t in _nice_ticks(f.y0, f.y1)]
    out = []
    for t in yt:
        y = f.py(t)
        out.append(f'<line x1="{f.ml}" x2="{f.ml + f.pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
        out.append(
            f'<text x="{f.ml - 5}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_e(_fmt(t))}</text>'
        )
    return out


def _x_ticks(f: _Plot) -> list[str]:
    """Vertical grid lines and their labels."""
    out = []
    for t in _nice_ticks(f.x0, f.x1, 6):
        x = f.px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{f.mt}" y2="{f.mt + f.ph}" class="grid"/>')
        out.append(
            f'<text x="{x:.1f}" y="{f.mt + f.ph + 15}" class="tick" text-anchor="middle">{_e(_fmt(t))}</text>'
        )
    return out


def _axis_labels(f: _Plot, xlabel: str, ylabel: str) -> list[str]:
    out = [f'<text x="{f.ml + f.pw / 2}" y="{f.h - 4}" class="axis" text-anchor="middle">{_e(xlabel)}</text>']
    if ylabel:
        out.append(
            f'<text transform="translate(12 {f.mt + f.ph / 2}) rotate(-90)" class="axis" '
            f'text-anchor="middle">{_e(ylabel)}{" (log)" if f.log else ""}</text>'
        )
    return out


def _polyline(f: _Plot, s: Series) -> list[str]:
    """One series (thinned), with a circle and tooltip per point for markers or a single point."""
    tx, ty = _thin(s.xs, s.ys)
    pts = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in zip(tx, ty, strict=True))
    cls = "faint" if s.faint else "line"
    out = [
        f'<polyline points="{pts}" stroke="{s.color}" class="{cls}"><title>{_e(s.name)}</title></polyline>'
    ]
    if s.markers or len(tx) == 1:
        for x, y in zip(tx, ty, strict=True):
            out.append(
                f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="3.2" fill="{s.color}">'
                f"<title>{_e(s.name)}: {_e(_fmt(x))} → {_e(_fmt(y))}</title></circle>"
            )
    return out


def _positive(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    keep = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
    return [x for x, _ in keep], [y for _, y in keep]


def _agents_with(rows: list[dict], prefix: str) -> list[str]:
    return sorted({k[len(prefix) :] for r in rows for k in r if isinstance(k, str) and k.startswith(prefix)})


def agent_colors(run: Run) -> dict[str, str]:
    """One colour per agent across charts and graphs; an adapter shares its agent's colour (learner
    metrics are keyed by adapter, sampled steps by agent)."""
    colors: dict[str, str] = {}
    for smp in run.samples:
        for st in smp.traj.steps:
            c = colors.setdefault(st.agent_id, PALETTE[len({*colors.values()}) % len(PALETTE)])
            if st.adapter:
                colors.setdefault(st.adapter, c)
    for name in _agents_with(run.metrics, "reward/") + _agents_with(run.metrics, "grad_norm/"):
        colors.setdefault(name, PALETTE[len({*colors.values()}) % len(PALETTE)])
    return colors


def charts(run: Run, colors: dict[str, str]) -> str:
    m, ev = run.metrics, run.evals
    out = []
    xs, ys = series(m, "reward_mean")
    s = with_smoothing("train reward (batch mean)", xs, ys, PALETTE[0])
    ex, ey = series(ev, "reward_mean")
    s.append(Series("held-out reward", ex, ey, PALETTE[1], markers=True))
    out.append(line_chart("Reward against learner steps", s, "learner step", "reward"))
    xs, ys = series(m, "reward_mean", "time")
    s = with_smoothing("train reward (batch mean)", xs, ys, PALETTE[0])
    ex, ey = series(ev, "reward_mean", "time")
    s.append(Series("held-out reward", ex, ey, PALETTE[1], markers=True))
    out.append(line_chart("Reward against wall time", s, "wall time (s)", "reward"))
    agents = _agents_with(m, "reward/")
    per_agent: list[Series] = []
    for i, a in enumerate(agents):
        xs, ys = series(m, f"reward/{a}")
        per_agent += with_smoothing(a, xs, ys, colors.get(a, PALETTE[i % len(PALETTE)]))[-1:]
    out.append(line_chart("Reward per agent (smoothed)", per_agent, "learner step", "reward"))
    gn = [
        Series(a, *series(m, f"grad_norm/{a}"), colors.get(a, PALETTE[i % len(PALETTE)]))
        for i, a in enumerate(_agents_with(m, "grad_norm/"))
    ]
    out.append(line_chart("Gradient norm per agent", gn, "learner step", "grad norm", log=True))
    eval_keys = sorted(
        {k for r in ev for k, v in r.items() if _finite(v) is not None} - {"step", "time", "version"}
    )
    # Costs (seconds, bytes, counts of tokens) have other units than rewards and rates: own chart.
    costs = [k for k in eval_keys if any(u in k for u in ("second", "time", "bytes", "tokens"))]
    for title, keys in (
        ("Held-out evaluation", [k for k in eval_keys if k not in costs]),
        ("Evaluation cost", costs),
    ):
        if keys or title == "Held-out evaluation":
            evs = [
                Series(k, *series(ev, k), PALETTE[i % len(PALETTE)], markers=True) for i, k in enumerate(keys)
            ]
            out.append(line_chart(title, evs, "learner step", "value"))
    main = '<div class="charts">' + "".join(out) + "</div>"
    shown = (
        {"step", "time", "reward_mean"}
        | {f"reward/{a}" for a in agents}
        | {f"grad_norm/{a}" for a in _agents_with(m, "grad_norm/")}
    )
    rest = sorted({k for r in m for k, v in r.items() if _finite(v) is not None} - shown)
    if not rest:
        return main
    small = "".join(line_chart(k, [Series(k, *series(m, k), PALETTE[0])], "learner step") for k in rest[:40])
    more = f" ({len(rest) - 40} more not drawn)" if len(rest) > 40 else ""
    return (
        main
        + f'<details class="more"><summary>Other metrics ({len(rest)}){_e(more)}</summary><div class="charts small">{small}</div></details>'
    )


# ---------------------------------------------------------------------------------------------
# drawing: episodes as graphs

NODE_W, NODE_H, COL_GAP, LANE_GAP, PAD = 128, 50, 46, 26, 14


def _reward_fill(r: float, scale: float) -> str:
    """White at 0, towards green for positive and red for negative credit."""
    t = max(-1.0, min(1.0, r / scale)) if scale > 0 else 0.0
    if t >= 0:
        return f"rgb({int(255 - 120 * t)},{int(255 - 40 * t)},{int(255 - 120 * t)})"
    t = -t
    return f"rgb({int(255 - 20 * t)},{int(255 - 130 * t)},{int(255 - 130 * t)})"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def graph_svg(traj: GraphTrajectory, uid: str, colors: dict[str, str]) -> str:
    """The episode DAG: lane (row) per agent, column per turn, edges from each step's parents."""
    steps = traj.steps
    lanes = {a: i for i, a in enumerate(traj.agents)}
    turns = sorted({s.turn for s in steps})
    col_x, pos, w, h = _graph_layout(steps, lanes, turns)
    scale = max((abs(_finite(s.reward) or 0.0) for s in steps), default=0.0)
    out = [
        f'<svg class="graph" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
        f'aria-label="episode graph, {len(steps)} steps">',
        f'<defs><marker id="ah-{uid}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    for t in turns:
        out.append(
            f'<text x="{col_x[t] + NODE_W / 2}" y="{PAD + 6}" class="turn" text-anchor="middle">turn {t}</text>'
        )
    for a, lane in lanes.items():
        y = PAD + 16 + lane * (NODE_H + LANE_GAP) + NODE_H / 2 + 4
        out.append(
            f'<text x="{PAD}" y="{y}" class="lane" fill="{colors.get(a, "#333")}">{_e(_clip(a, 10))}</text>'
        )
    for i, s in enumerate(steps):
        cx, cy = pos[i]
        for p in s.parents.tolist():
            if not 0 <= p < len(steps):
                continue  # decode already rejects this; a report never crashes on it
            qx, qy = pos[p]
            out.append(_edge(qx, qy, cx, cy, uid, p, i))
    for i, s in enumerate(steps):
        out.append(_node(s, i, pos[i], uid, colors.get(s.agent_id, "#333"), scale))
    out.append("</svg>")
    return "".join(out)


def _graph_layout(
    steps: list[AgentStep], lanes: dict[str, int], turns: list[int]
) -> tuple[dict[int, float], list[tuple[float, float]], int, int]:
    """Each turn's column x, each step's box (top-left corner), and the SVG's width and height.
    Steps of one agent within one turn sit side by side in that turn's column."""
    slot: list[int] = []
    count: dict[tuple[int, str], int] = {}
    for s in steps:
        k = (s.turn, s.agent_id)
        slot.append(count.get(k, 0))
        count[k] = count.get(k, 0) + 1
    width_of = {t: max(c for (tt, _), c in count.items() if tt == t) for t in turns}
    col_x, x = {}, PAD + 70.0
    for t in turns:
        col_x[t] = x
        x += width_of[t] * (NODE_W + 12) - 12 + COL_GAP
    w = int(x - COL_GAP + PAD + 30)
    h = int(PAD * 2 + 16 + len(lanes) * (NODE_H + LANE_GAP) - LANE_GAP)
    pos = [
        (col_x[s.turn] + slot[i] * (NODE_W + 12), PAD + 16 + lanes[s.agent_id] * (NODE_H + LANE_GAP))
        for i, s in enumerate(steps)
    ]
    return col_x, pos, w, h


def _node(s: AgentStep, i: int, at: tuple[float, float], uid: str, color: str, scale: float) -> str:
    """One step's box, filled by its credit, linking to its card, with a tooltip and a tool badge."""
    x0, y0 = at
    r = _finite(s.reward)
    n_tools = len(s.tool_calls)
    tools = f", {n_tools} tool call(s)" if n_tools else ""
    tip = (
        f"#{i} {s.agent_id} (role {s.role}) turn {s.turn}, policy v{s.policy_version} "
        f"[{s.adapter or 'base'}], credit {_fmt(r) if r is not None else 'n/a'}, "
        f"finish {s.finish_reason}{tools}\n{_clip(s.response_text, 300)}"
    )
    badge = (
        f'<rect x="{x0 + NODE_W - 38:.1f}" y="{y0 + 4:.1f}" width="34" height="13" rx="3" class="tb"/>'
        f'<text x="{x0 + NODE_W - 21:.1f}" y="{y0 + 14:.1f}" class="tt" text-anchor="middle">'
        f"{'tool' if n_tools == 1 else f'{n_tools} tools'}</text>"
        if n_tools
        else ""
    )
    return (
        f'<a href="#{uid}-s{i}"><g class="node" data-step="{i}" data-agent="{_e(s.agent_id)}">'
        f"<title>{_e(tip)}</title>"
        f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{NODE_W}" height="{NODE_H}" rx="7" '
        f'fill="{_reward_fill(r or 0.0, scale)}" stroke="{color}"/>'
        f'<text x="{x0 + 7:.1f}" y="{y0 + 15:.1f}" class="nt">#{i} {_e(_clip(s.agent_id, 9 if n_tools else 13))}</text>'
        f"{badge}"
        f'<text x="{x0 + 7:.1f}" y="{y0 + 30:.1f}" class="ns">v{s.policy_version} · '
        f"{'credit ' + _e(f'{r:.3g}') if r is not None else 'credit n/a'}</text>"
        f'<text x="{x0 + 7:.1f}" y="{y0 + 44:.1f}" class="nm">{_e(_clip(" ".join(s.response_text.split()), 20))}</text>'
        "</g></a>"
    )


def _edge(qx: float, qy: float, cx: float, cy: float, uid: str, p: int, i: int) -> str:
    """Parent at (qx, qy) -> child at (cx, cy), both top-left corners of a node box."""
    if abs(qx - cx) < 1:  # same column: straight down to the next lane, arc on the right otherwise
        lanes = abs(cy - qy) / (NODE_H + LANE_GAP)
        if cy > qy and lanes < 1.5:
            d = f"M{qx + NODE_W / 2:.1f},{qy + NODE_H:.1f} L{cx + NODE_W / 2:.1f},{cy - 1:.1f}"
        else:
            bx = qx + NODE_W + 14 + 10 * lanes
            d = (
                f"M{qx + NODE_W:.1f},{qy + NODE_H / 2:.1f} C{bx:.1f},{qy + NODE_H / 2:.1f} "
                f"{bx:.1f},{cy + NODE_H / 2:.1f} {cx + NODE_W + 1:.1f},{cy + NODE_H / 2:.1f}"
            )
    else:
        sx, sy, ex, ey = qx + NODE_W, qy + NODE_H / 2, cx - 1, cy + NODE_H / 2
        mx = (sx + ex) / 2
        d = f"M{sx:.1f},{sy:.1f} C{mx:.1f},{sy:.1f} {mx:.1f},{ey:.1f} {ex:.1f},{ey:.1f}"
    return f'<path class="edge" d="{d}" marker-end="url(#ah-{uid})" data-from="{p}" data-to="{i}"/>'


def _step_card(s: AgentStep, i: int, uid: str, color: str) -> str:
    r = _finite(s.reward)
    lp = [float(x) for x in s.logprobs.tolist()] if len(s.logprobs) else []
    mean_lp = sum(lp) / len(lp) if lp else None
    took = s.t_end - s.t_start if s.t_end and s.t_start else None
    facts = [
        f"turn {s.turn}",
        f"<b>policy v{s.policy_version}</b>",
        f"adapter {_e(s.adapter or 'base')}",
        f"model {_e(s.model_id)}",
        f"<b>credit {_e(_fmt(r)) if r is not None else 'n/a'}</b>",
        f"finish {_e(s.finish_reason)}",
        f"prompt {len(s.prompt_ids)} tok, response {len(s.response_ids)} tok",
    ]
    if mean_lp is not None:
        facts.append(f"mean logprob {_e(_fmt(mean_lp))}")
    if took is not None and took >= 0:
        facts.append(f"{took:.2f} s")
    parents = s.parents.tolist()
    facts.append(
        "reads " + ", ".join(f'<a href="#{uid}-s{p}">#{p}</a>' for p in parents) if parents else "root"
    )
    text = s.response_text
    more = (
        f'<span class="cut">… {len(text) - MAX_TEXT} more characters not shown</span>'
        if len(text) > MAX_TEXT
        else ""
    )
    tools = "".join(
        f'<div class="tool"><b>tool {_e(t.name)}</b><pre>{_e(_clip(t.arguments, 1500))}</pre>'
        f'<div class="res">→</div><pre>{_e(_clip(t.result, 1500))}</pre></div>'
        for t in s.tool_calls
    )
    return (
        f'<div class="step" id="{uid}-s{i}" style="border-left-color:{color}">'
        f'<div class="sh"><b style="color:{color}">#{i} {_e(s.agent_id)}</b>'
        f"{' <span class=role>(' + _e(s.role) + ')</span>' if s.role != s.agent_id else ''} "
        f'<span class="facts">{" · ".join(facts)}</span></div>'
        f'<pre class="msg">{_e(text[:MAX_TEXT]) or "<i>(empty message)</i>"}</pre>{more}{tools}</div>'
    )


def episode_panel(sample: Sample, uid: str, label: str, colors: dict[str, str], cards: bool = True) -> str:
    t = sample.traj
    versions = sorted({s.policy_version for s in t.steps})
    vtxt = (
        (f"v{versions[0]}" if len(versions) == 1 else f"v{versions[0]}–v{versions[-1]}")
        if versions
        else "none"
    )
    credit: dict[str, float] = {}
    for s in t.steps:
        credit[s.agent_id] = credit.get(s.agent_id, 0.0) + (_finite(s.reward) or 0.0)
    credit_txt = ", ".join(
        f'<span style="color:{colors.get(a, "#333")}">{_e(a)}</span> {_e(_fmt(c))}' for a, c in credit.items()
    )
    tr = ", ".join(_fmt(float(x)) for x in t.turn_rewards.tolist())
    meta = ", ".join(f"{_e(k)}={_e(_clip(str(v), 80))}" for k, v in sorted(t.metadata.items()))
    r = _finite(t.reward)
    head = (
        f'<div class="eh"><span class="tag">{_e(label)}</span> <b>team reward {_e(_fmt(r)) if r is not None else "n/a"}</b>'
        f" · sampled with {vtxt} · {len(t.steps)} steps, {len(t.agents)} agents, {t.num_tokens} tokens</div>"
        f'<div class="em">episode {_e(_clip(t.episode_id, 40))} · task {_e(_clip(t.task_id, 40))} · '
        f"workflow {_e(_clip(t.workflow, 40))} · group {_e(_clip(t.group_id, 40))} · file {_e(sample.file)}</div>"
        f'<div class="em">credit per agent: {credit_txt or "none"}'
        f"{' · turn rewards: ' + _e(tr) if tr else ''}{' · ' + meta if meta else ''}</div>"
    )
    body = f'<div class="gw">{graph_svg(t, uid, colors)}</div>'
    if cards:
        steps = "".join(_step_card(s, i, uid, colors.get(s.agent_id, "#333")) for i, s in enumerate(t.steps))
        body += f'<details class="steps" open><summary>messages and tool calls ({len(t.steps)} steps)</summary>{steps}</details>'
    return f'<section class="episode" id="{uid}">{head}{body}</section>'


def episodes(run: Run, k: int, recent: int, colors: dict[str, str]) -> str:
    if not run.samples:
        return '<p class="none">No sampled episodes to draw.</p>'
    best, worst, versions = pick_best_worst(run.samples, k, recent)
    vtxt = ", ".join(f"v{v}" for v in sorted(versions))
    out = [
        f"<h2>Best and worst episodes of the newest policy versions ({_e(vtxt)})</h2>",
        f'<p class="note">From the {run.sample_files_read} sample file(s) read ({run.sample_files_total} in samples/), '
        f"{len(run.samples)} distinct episodes; ranked by team reward, then summed credit. Node colour: the "
        "step's credit (green positive, red negative); border: the agent. Click a node for its message.</p>",
        '<div class="pairs">',
    ]
    for j in range(max(len(best), len(worst))):
        b = episode_panel(best[j], f"b{j}", f"best #{j + 1}", colors) if j < len(best) else "<div></div>"
        w = episode_panel(worst[j], f"w{j}", f"worst #{j + 1}", colors) if j < len(worst) else "<div></div>"
        out.append(f'<div class="pair">{b}{w}</div>')
    out.append("</div>")
    spread = [s for name in run.spread_files for s in [_median_of(run.samples, name)] if s is not None]
    if len(spread) > 1:
        out.append(
            "<h2>Episodes over training (median-reward episode of sample files spread over the run)</h2>"
        )
        out.append('<div class="spread">')
        out += [episode_panel(s, f"o{j}", f"{s.file}", colors, cards=False) for j, s in enumerate(spread)]
        out.append("</div>")
    return "".join(out)


def _median_of(samples: list[Sample], file: str) -> Sample | None:
    pool = sorted((s for s in samples if s.file == file), key=lambda s: s.key)
    return pool[len(pool) // 2] if pool else None


# ---------------------------------------------------------------------------------------------
# the page

CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;color:#222;background:#f6f7f9}
header{background:#20252d;color:#eee;padding:14px 22px}header h1{margin:0;font-size:20px}
header .sum{color:#bbb;margin-top:4px}main{padding:8px 22px 40px}h2{font-size:17px;margin:22px 0 8px}
.problems{background:#fff1f0;border:1px solid #e8a09a;padding:8px 14px;border-radius:6px}
.notes{background:#fffbe6;border:1px solid #e5d48a;padding:8px 14px;border-radius:6px}
.problems li,.notes li{margin:2px 0}.note{color:#555;margin:4px 0 10px}
.charts{display:flex;flex-wrap:wrap;gap:12px}.chart{background:#fff;border:1px solid #dde;border-radius:6px;margin:0;padding:6px 8px}
.chart figcaption{font-weight:600;margin-bottom:2px}.chart.empty p{color:#999;width:540px;margin:8px 0}
.small .chart svg{width:360px;height:160px}.small .chart.empty p{width:340px}
.plot .pa{fill:#fcfcfd;stroke:#ccd}.plot .grid{stroke:#e4e6ea}.plot .tick{font-size:10px;fill:#555}.plot .axis{font-size:11px;fill:#333}
.plot .line{fill:none;stroke-width:2}.plot .faint{fill:none;stroke-width:1;opacity:.3}
.legend{font-size:11px;color:#444}.lg{margin-right:12px;white-space:nowrap}.lg i{display:inline-block;width:14px;height:3px;margin:0 4px 3px 0;vertical-align:middle}
.lgf{opacity:.6}.more summary{cursor:pointer;margin:14px 0 8px;font-weight:600}
.pairs{display:flex;flex-direction:column;gap:14px}.pair{display:grid;grid-template-columns:1fr 1fr;gap:14px;align-items:start}
.episode{background:#fff;border:1px solid #dde;border-radius:6px;padding:8px 10px;min-width:0}
.eh{font-size:14px}.em{font-size:12px;color:#555;overflow-wrap:anywhere}.tag{background:#20252d;color:#fff;border-radius:4px;padding:0 6px;font-size:12px}
.gw{margin:6px 0}.graph{max-width:100%;height:auto}.graph .node rect{stroke-width:2.5}.graph .node:hover rect{stroke-width:4}
.graph .nt{font-size:12px;font-weight:600;fill:#111}.graph .ns{font-size:11px;fill:#333}.graph .nm{font-size:10px;fill:#555;font-family:monospace}
.graph .tb{fill:#20252d}.graph .tt{font-size:9px;fill:#fff}.graph .edge{fill:none;stroke:#555;stroke-width:1.4}.graph .turn{font-size:11px;fill:#777}.graph .lane{font-size:11px;font-weight:600}
.steps summary{cursor:pointer;color:#333;font-size:12px}.step{border-left:4px solid #999;padding:4px 8px;margin:6px 0;background:#fafbfc}
.step:target{background:#fff6cc}.sh{font-size:12px}.facts{color:#555}.role{color:#777}
pre{white-space:pre-wrap;overflow-wrap:anywhere;margin:3px 0;font:12px/1.35 ui-monospace,Menlo,Consolas,"DejaVu Sans Mono",monospace}
.msg{background:#fff;border:1px solid #e6e8ec;padding:4px 6px;max-height:220px;overflow:auto}.cut{font-size:11px;color:#a33}
.tool{font-size:12px;border:1px dashed #bbc;padding:3px 6px;margin-top:4px}.tool pre{background:#f3f4f8}.res{color:#777}
.spread{display:flex;flex-wrap:wrap;gap:12px}.spread .episode{max-width:100%}.none{color:#777}
.cfg pre{background:#fff;border:1px solid #dde;padding:8px;max-height:360px;overflow:auto}
"""


def _summary(run: Run) -> str:
    m = run.metrics
    bits = []
    steps = [v for r in m if (v := _finite(r.get("step"))) is not None]
    if steps:
        bits.append(f"{len(m)} learner steps (last step {_fmt(max(steps))})")
    vers = [v for r in m if (v := _finite(r.get("version"))) is not None]
    if vers:
        bits.append(f"policy version {_fmt(max(vers))}")
    times = [v for r in m if (v := _finite(r.get("time"))) is not None]
    if times:
        bits.append(f"{max(times):.0f} s wall time")
    _, ys = series(m, "reward_mean")
    if ys:
        k = max(1, min(10, len(ys) // 5))
        bits.append(
            f"train reward {_fmt(sum(ys[:k]) / k)} → {_fmt(sum(ys[-k:]) / k)} (mean of first/last {k})"
        )
    _, ey = series(run.evals, "reward_mean")
    if ey:
        bits.append(f"held-out reward {_fmt(ey[0])} → {_fmt(ey[-1])}, best {_fmt(max(ey))}")
    bits.append(f"{len(run.samples)} sampled episodes")
    return " · ".join(_e(b) for b in bits)


def render(run: Run, k: int = 3, recent: int = 3, title: str | None = None) -> str:
    title = title or run.path.resolve().name or str(run.path)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">",
        f"<title>teamrl · {_e(title)}</title><style>{CSS}</style></head><body>",
        f'<header><h1>teamrl run: {_e(title)}</h1><div class="sum">{_summary(run)}</div></header><main>',
    ]
    if run.problems:
        items = "".join(f"<li>{_e(p)}</li>" for p in run.problems)
        parts.append(f'<div class="problems"><b>Problems reading the run folder</b><ul>{items}</ul></div>')
    if run.notes:
        items = "".join(f"<li>{_e(p)}</li>" for p in run.notes)
        parts.append(f'<div class="notes"><b>Notes</b><ul>{items}</ul></div>')
    parts.append("<h2>Curves</h2>")
    colors = agent_colors(run)
    parts.append(charts(run, colors))
    parts.append(episodes(run, k, recent, colors))
    if run.config_text:
        parts.append(
            f'<details class="cfg"><summary><h2 style="display:inline">Config ({_e(run.config_name)})</h2></summary>'
            f"<pre>{_e(run.config_text)}</pre></details>"
        )
    parts.append("</main></body></html>\n")
    return "".join(parts)


def main(argv: list[str] | None = None, prog: str = "teamrl show") -> int:
    args = build_parser(prog).parse_args(argv)
    run_dir = Path(args.run)
    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "does not exist"
        print(f"teamrl show: run folder {run_dir} {what}", file=sys.stderr)
        return EXIT_PROBLEM
    if args.episodes < 0 or args.recent_versions < 1 or args.sample_files < 1:
        print(
            "teamrl show: --episodes must be >= 0, --recent-versions and --sample-files >= 1", file=sys.stderr
        )
        return EXIT_PROBLEM
    run = load_run(run_dir, args.sample_files)
    for p in run.problems:
        print(f"teamrl show: problem: {p}", file=sys.stderr)
    for n in run.notes:
        print(f"teamrl show: note: {n}", file=sys.stderr)
    if not run.readable:
        print(
            f"teamrl show: {run_dir} holds nothing readable (expected config.json|toml, metrics.jsonl, "
            "eval.jsonl or samples/step-NNNNNN.arrow); no report written",
            file=sys.stderr,
        )
        return EXIT_PROBLEM
    if args.print_episodes > 0:
        newest = sorted(run.samples, key=lambda x: (x.version, x.traj.episode_id))[-args.print_episodes :]
        for smp in newest:
            print(episode_text(smp.traj) + "\n")
    out = Path(args.out) if args.out else run_dir / "report.html"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # errors="replace": lone surrogates from JSON escapes cannot be encoded; they become "?"
        out.write_text(
            render(run, args.episodes, args.recent_versions, args.title), encoding="utf-8", errors="replace"
        )
    except OSError as e:
        print(f"teamrl show: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_PROBLEM
    print(out)
    return EXIT_PROBLEM if run.problems else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
