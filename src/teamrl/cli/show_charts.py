"""The charts of ``teamrl show``, drawn by matplotlib as inline SVG: the curves of a run's metrics and
the timeline of its services (where the time goes).

Design decisions:

* **matplotlib, SVG, text as text** (``svg.fonttype = none``): the page stays one self-contained
  file with no scripts or images, titles and labels stay searchable, and no chart code of our own
  needs keeping correct. The SVG's XML prologue and metadata block are cut (the metadata names
  external URLs; the page promises none). Matplotlib is imported when a chart is drawn, so
  ``teamrl show --help`` stays light.
* **Foreign text** (metric names come from the run folder) reaches matplotlib with ``$`` escaped
  (no mathtext parsing of data), and its SVG writer escapes ``<``, ``>`` and ``&``; element ids
  are generated here (``curve-N``), never taken from the data.
* **The timeline** (``RUN/timeline.jsonl``, teamrl.protocol.timeline) is drawn as one lane per
  service replica, a bar per state interval, so who waited on whom is read off vertically: a
  learner lane in ``sample_wait`` above rollout lanes busy generating is a rollout-bound run; rollout
  lanes in ``weights_wait``/``budget_wait`` under a busy learner is a learner-bound one. The buffer's
  queue depth (``buffer/stats.jsonl``) runs below the lanes on the same time axis.
"""

from __future__ import annotations

import io
import itertools
import re
from dataclasses import dataclass
from typing import Any

from teamrl.cli.show_run import Run, esc, finite, fmt_num

MAX_POINTS = 800  # per curve; longer series are thinned (after smoothing) to keep the page light
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
STATE_COLORS = {  # waiting: greys and light colours; working: saturated
    "sample_wait": "#d9d9d9",
    "weights_wait": "#fdd0a2",
    "budget_wait": "#fdae6b",
    "idle": "#eeeeee",
    "setup": "#f2f2f2",
    "generating": "#2ca02c",
    "sending": "#98df8a",
    "forward_backward": "#1f77b4",
    "optimiser": "#9467bd",
    "export": "#ff7f0e",
    "publish": "#d62728",
    "checkpoint": "#8c564b",
    "profile": "#e377c2",
    "metrics": "#bcbd22",
}
UNCOUNTED = frozenset({"setup"})  # start-up: neither busy nor waiting in the fractions
_ids = itertools.count()


@dataclass
class Series:
    name: str
    xs: list[float]
    ys: list[float]
    color: str
    faint: bool = False  # raw values behind their smoothed line
    markers: bool = False  # eval points: a marker each


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


def series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        xv, yv = finite(r.get(x)), finite(r.get(key))
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


def _plain(text: str) -> str:
    """Foreign text for matplotlib: no mathtext."""
    return text.replace("$", r"\$")


def _figure(w: float, h: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=100, layout="constrained")


def svg_of(fig: Any) -> str:
    """The figure as an inline ``<svg>`` element (no prologue, no metadata)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "teamrl"}):
        fig.savefig(buf, format="svg")
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    return re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.S)


def line_chart(title: str, all_series: list[Series], xlabel: str, ylabel: str = "", log: bool = False) -> str:
    """A line chart with axes, grid and a legend, or a 'no data' box."""
    drawn = [s for s in all_series if s.xs]
    if log:
        drawn = [Series(s.name, *_positive(s.xs, s.ys), s.color, s.faint, s.markers) for s in drawn]
        drawn = [s for s in drawn if s.xs]
    if not drawn:
        return f'<figure class="chart empty"><figcaption>{esc(title)}</figcaption><p>no data</p></figure>'
    fig = _figure(5.6, 2.7)
    ax = fig.add_subplot()
    for s in drawn:
        xs, ys = _thin(s.xs, s.ys)
        style: dict[str, Any] = {"lw": 2.0}
        if s.faint:
            style = {"lw": 1.0, "alpha": 0.3}
        elif s.markers or len(xs) == 1:
            style = {"lw": 1.2, "marker": "o", "ms": 4}
        ax.plot(xs, ys, color=s.color, label=_plain(s.name), gid=f"curve-{next(_ids)}", **style)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel(_plain(xlabel), fontsize=9)
    ax.set_ylabel(_plain(ylabel + (" (log)" if log and ylabel else "")), fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    return f'<figure class="chart"><figcaption>{esc(title)}</figcaption>{svg_of(fig)}</figure>'


def _positive(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    keep = [(x, y) for x, y in zip(xs, ys, strict=True) if y > 0]
    return [x for x, _ in keep], [y for _, y in keep]


def agents_with(rows: list[dict], prefix: str) -> list[str]:
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
    for name in agents_with(run.metrics, "reward/") + agents_with(run.metrics, "grad_norm/"):
        colors.setdefault(name, PALETTE[len({*colors.values()}) % len(PALETTE)])
    return colors


def _reward_charts(run: Run) -> list[str]:
    m, ev, out = run.metrics, run.evals, []
    for x, xlabel, title in (
        ("step", "learner step", "Reward against learner steps"),
        ("time", "wall time (s)", "Reward against wall time"),
    ):
        s = with_smoothing("train reward (batch mean)", *series(m, "reward_mean", x), PALETTE[0])
        s.append(Series("held-out reward", *series(ev, "reward_mean", x), PALETTE[1], markers=True))
        out.append(line_chart(title, s, xlabel, "reward"))
    return out


def charts(run: Run, colors: dict[str, str]) -> str:
    m, ev = run.metrics, run.evals
    out = _reward_charts(run)
    agents = agents_with(m, "reward/")
    per_agent: list[Series] = []
    for i, a in enumerate(agents):
        xs, ys = series(m, f"reward/{a}")
        per_agent += with_smoothing(a, xs, ys, colors.get(a, PALETTE[i % len(PALETTE)]))[-1:]
    out.append(line_chart("Reward per agent (smoothed)", per_agent, "learner step", "reward"))
    gn = [
        Series(a, *series(m, f"grad_norm/{a}"), colors.get(a, PALETTE[i % len(PALETTE)]))
        for i, a in enumerate(agents_with(m, "grad_norm/"))
    ]
    out.append(line_chart("Gradient norm per agent", gn, "learner step", "grad norm", log=True))
    eval_keys = sorted(
        {k for r in ev for k, v in r.items() if finite(v) is not None} - {"step", "time", "version"}
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
        | {f"grad_norm/{a}" for a in agents_with(m, "grad_norm/")}
    )
    rest = sorted({k for r in m for k, v in r.items() if finite(v) is not None} - shown)
    if not rest:
        return main
    small = "".join(line_chart(k, [Series(k, *series(m, k), PALETTE[0])], "learner step") for k in rest[:40])
    more = f" ({len(rest) - 40} more not drawn)" if len(rest) > 40 else ""
    return (
        main
        + f'<details class="more"><summary>Other metrics ({len(rest)}){esc(more)}</summary><div class="charts small">{small}</div></details>'
    )


# ---------------------------------------------------------------------------------------------
# where the time goes


@dataclass
class Lane:
    """One service replica's intervals: ``spans[state]`` = [(t0, duration)], times from the run start."""

    name: str
    spans: dict[str, list[tuple[float, float]]]

    def seconds(self, states: set[str] | frozenset[str] | None = None) -> float:
        return sum(d for s, xs in self.spans.items() if states is None or s in states for _, d in xs)

    @property
    def busy_fraction(self) -> float:
        """Share of the lane's counted time (all but ``UNCOUNTED``) in working states (``steady``
        lanes: after every service's start-up)."""
        from teamrl.protocol.timeline import IDLE_STATES  # here: `teamrl show --help` imports no pyarrow

        counted = self.seconds() - self.seconds(UNCOUNTED)
        waiting = self.seconds(IDLE_STATES)
        return (counted - waiting) / counted if counted > 0 else float("nan")


def lanes(records: list[dict[str, Any]]) -> tuple[list[Lane], float]:
    """The timeline's lanes (learners first, then rollouts, then the rest) and the run's first stamp."""
    t_start = min((float(r["t0"]) for r in records), default=0.0)
    by: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in records:
        name = f"{r['service']}-{r.get('replica', '0')}"
        by.setdefault(name, {}).setdefault(str(r["state"]), []).append(
            (float(r["t0"]) - t_start, float(r["t1"]) - float(r["t0"]))
        )
    rank = {"learner": 0, "rollout": 1}
    names = sorted(by, key=lambda n: (rank.get(n.split("-")[0], 2), n))
    return [Lane(n, by[n]) for n in names], t_start


def steady(found: list[Lane]) -> list[Lane]:
    """The lanes from the moment every service is past its start-up on (a learner that waits for
    data while a rollout still loads vLLM is not what makes a run rollout- or learner-bound)."""
    t_up = max((t + d for ln in found for t, d in ln.spans.get("setup", [])), default=0.0)
    out = []
    for ln in found:
        spans = {
            s: [(max(t, t_up), t + d - max(t, t_up)) for t, d in xs if t + d > t_up]
            for s, xs in ln.spans.items()
            if s not in UNCOUNTED
        }
        out.append(Lane(ln.name, {s: xs for s, xs in spans.items() if xs}))
    return out


def verdict(found: list[Lane]) -> str:
    """Which side waited on the other, and by how much (the summary's sentence), after start-up."""
    found = steady(found)

    def waiting(kind: str, states: set[str]) -> float | None:
        picked = [ln for ln in found if ln.name.startswith(kind)]
        total = sum(ln.seconds() - ln.seconds(UNCOUNTED) for ln in picked)
        return sum(ln.seconds(states) for ln in picked) / total if total > 0 else None

    learner = waiting("learner", {"sample_wait"})
    rollout = waiting("rollout", {"weights_wait", "budget_wait"})
    sync = waiting("sync", {"generating"}), waiting("sync", {"training", "export", "publish"})
    if sync[0] is not None and sync[1] is not None:  # one lane: the loop's share in each phase
        return f"sync: generating {sync[0]:.0%} of the loop, training and publishing {sync[1]:.0%}"
    if learner is None or rollout is None:
        return ""
    side = "rollout-bound" if learner > rollout else "learner-bound"
    return (
        f"{side}: the learner waited for data {learner:.0%} of its time, the rollouts waited for "
        f"weights or the version budget {rollout:.0%}"
    )


def timeline_chart(run: Run) -> str:
    """The lanes of ``timeline.jsonl`` and the buffer's queue depth, with busy fractions."""
    found, t_start = lanes(run.timeline)
    if not found:
        return '<p class="none">No timeline.jsonl: services record one under <code>teamrl run</code>.</p>'
    fig = _figure(11.5, 0.45 * len(found) + 1.9)
    ax, depth_ax = fig.subplots(2, 1, sharex=True, height_ratios=[0.45 * len(found) + 0.5, 1.2])
    used: set[str] = set()
    for i, ln in enumerate(found):
        for state, spans in sorted(ln.spans.items()):
            color = STATE_COLORS.get(state, PALETTE[len(used) % len(PALETTE)])
            label = _plain(state) if state not in used else None
            ax.broken_barh(spans, (i - 0.4, 0.8), color=color, label=label, gid=f"lane-{next(_ids)}")
            used.add(state)
    busy = [ln.busy_fraction for ln in steady(found)]
    ax.set_yticks(
        range(len(found)), [f"{_plain(ln.name)} ({b:.0%} busy)" for ln, b in zip(found, busy, strict=True)]
    )
    ax.invert_yaxis()
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    for key, color in (("size", PALETTE[0]), ("groups_pending", PALETTE[4])):
        xs, ys = series(run.buffer_stats, key, "time")
        depth_ax.step([x - t_start for x in xs], ys, where="post", color=color, label=key, lw=1.2)
    depth_ax.set_ylabel("buffer", fontsize=8)
    depth_ax.set_xlabel("seconds since the first record", fontsize=9)
    depth_ax.tick_params(labelsize=8)
    depth_ax.grid(alpha=0.3)
    if run.buffer_stats:
        depth_ax.legend(fontsize=7, frameon=False, loc="upper left")
    return (
        f'<figure class="chart wide"><figcaption>Service states over time</figcaption>{svg_of(fig)}</figure>'
    )


def busy_summary(run: Run) -> list[str]:
    """The summary's bits: each lane's busy fraction, and which side waited on the other."""
    found, _ = lanes(run.timeline)
    if not found:
        return []
    bits = [", ".join(f"{ln.name} {fmt_num(100 * ln.busy_fraction)}% busy" for ln in steady(found))]
    said = verdict(found)
    return [*bits, said] if said else bits
