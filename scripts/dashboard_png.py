"""Plot the Grafana dashboard's panels from a live run's /metrics endpoints into one PNG.

``python scripts/dashboard_png.py --run-dir /tmp/dash`` scrapes the Prometheus endpoints of a
running ``teamrl run`` (ports from ``RUN/run.json``, or ``--target HOST:PORT``, repeatable) every
``--interval`` seconds until they all stop answering, then evaluates each panel query of
deploy/monitoring/dashboards/teamrl.json over the scraped series and draws the panels in the
dashboard's own grid (gridPos) with matplotlib. ``--save FILE.jsonl`` keeps the raw scrapes and
``--replay FILE.jsonl`` plots them again without a run.

Design: a deliberately small PromQL subset, enough for the shipped dashboard, evaluated at every
scrape instant: selectors ``name{label="v"}``, ``rate(sel[range])``, ``sum [by (l, ...)] (e)``,
``histogram_quantile(q, e)`` and the binary operators ``/ * + -`` between vectors (matched on
identical label sets) or with a number. ``rate`` is the counter increase over the scrapes inside
``min(range, --max-window)`` divided by their time span, with resets handled as Prometheus does
(a drop means the counter restarted from 0). A short local run has minutes of data, so a 5 m range
would flatten everything; ``--max-window`` (default 30 s) keeps the curves readable. The
quantile interpolates linearly inside the bucket, as ``histogram_quantile`` does. Every scraped
series gets an ``instance`` label (the target), so two rollouts are two series until summed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "monitoring" / "dashboards" / "teamrl.json"

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]
# One scrape of all targets: (unix time, {sample name: {labels: value}})
Scrape = tuple[float, dict[str, dict[Labels, float]]]

_RANGE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


# --------------------------------------------------------------------------------------------
# scraping


def parse_exposition(text: str, instance: str) -> dict[str, dict[Labels, float]]:
    """Prometheus text format -> {sample name: {labels (+instance): value}}; _created dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[Labels, float]] = defaultdict(dict)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = frozenset({**s.labels, "instance": instance}.items())
            out[s.name][labels] = float(s.value)
    return out


def scrape(targets: list[str], timeout: float = 5.0) -> tuple[dict[str, dict[Labels, float]], int, int]:
    """One scrape of every target: the merged samples, how many answered, how many refused.

    A busy service (vLLM on few cores) may answer late; only a refused connection means gone.
    """
    merged: dict[str, dict[Labels, float]] = defaultdict(dict)
    up = refused = 0
    for t in targets:
        try:
            with urllib.request.urlopen(f"http://{t}/metrics", timeout=timeout) as r:
                text = r.read().decode()
        except urllib.error.URLError as e:
            refused += isinstance(e.reason, ConnectionRefusedError)
            continue
        except OSError as e:
            refused += isinstance(e, ConnectionRefusedError)
            continue
        up += 1
        for name, series in parse_exposition(text, t).items():
            merged[name].update(series)
    return merged, up, refused


def targets_from_run(run_dir: Path) -> list[str]:
    """The metrics ports that ``teamrl run`` recorded in RUN/run.json (0 = service has none)."""
    ports = json.loads((run_dir / "run.json").read_text())["ports"]
    return [f"127.0.0.1:{p}" for k, p in sorted(ports.items()) if k.startswith("metrics_") and p]


# --------------------------------------------------------------------------------------------
# the PromQL subset


@dataclass
class Node:
    kind: str  # num | sel | rate | sum | hq | bin
    args: tuple[Any, ...]


_TOKEN = re.compile(
    r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<range>\[\d+[smh]\])|(?P<str>\"[^\"]*\")"
    r"|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<op>[(){},=/*+-]))"
)


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"query {expr!r}: cannot read at {expr[pos:]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.toks = _tokens(expr)
        self.i = 0

    def peek(self) -> tuple[str, str]:
        return self.toks[self.i] if self.i < len(self.toks) else ("end", "")

    def take(self, value: str | None = None) -> str:
        kind, v = self.peek()
        if kind == "end" or (value is not None and v != value):
            raise ValueError(f"query {self.expr!r}: expected {value or 'more'}, got {v or 'the end'}")
        self.i += 1
        return v

    def parse(self) -> Node:
        node = self.additive()
        if self.peek()[0] != "end":
            raise ValueError(f"query {self.expr!r}: unexpected {self.peek()[1]!r}")
        return node

    def additive(self) -> Node:
        node = self.multiplicative()
        while self.peek()[1] in ("+", "-"):
            node = Node("bin", (self.take(), node, self.multiplicative()))
        return node

    def multiplicative(self) -> Node:
        node = self.primary()
        while self.peek()[1] in ("*", "/"):
            node = Node("bin", (self.take(), node, self.primary()))
        return node

    def primary(self) -> Node:
        kind, v = self.peek()
        if kind == "num":
            self.take()
            return Node("num", (float(v),))
        if v == "(":
            self.take("(")
            node = self.additive()
            self.take(")")
            return node
        if kind != "name":
            raise ValueError(f"query {self.expr!r}: unexpected {v!r}")
        self.take()
        if v == "sum":
            by: tuple[str, ...] | None = None
            if self.peek()[1] == "by":
                self.take()
                self.take("(")
                names = [self.take()]
                while self.peek()[1] == ",":
                    self.take(",")
                    names.append(self.take())
                self.take(")")
                by = tuple(names)
            self.take("(")
            inner = self.additive()
            self.take(")")
            return Node("sum", (by, inner))
        if v == "rate":
            self.take("(")
            sel = self.selector(self.take())
            kind, rng = self.peek()
            if kind != "range":
                raise ValueError(f"query {self.expr!r}: rate() needs a range like [5m]")
            self.take()
            self.take(")")
            return Node("rate", (sel, float(rng[1:-2]) * _RANGE_UNITS[rng[-2]]))
        if v == "histogram_quantile":
            self.take("(")
            q = float(self.take())
            self.take(",")
            inner = self.additive()
            self.take(")")
            return Node("hq", (q, inner))
        return self.selector(v)

    def selector(self, name: str) -> Node:
        matchers: list[tuple[str, str]] = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                key = self.take()
                self.take("=")
                matchers.append((key, self.take()[1:-1]))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        return Node("sel", (name, tuple(matchers)))


def parse_query(expr: str) -> Node:
    """Parse one panel query of the supported subset; ValueError names what is unsupported."""
    return _Parser(expr).parse()


def _select(scrape_samples: dict[str, dict[Labels, float]], sel: Node) -> Vector:
    name, matchers = sel.args
    return {
        lb: v for lb, v in scrape_samples.get(name, {}).items() if all((k, val) in lb for k, val in matchers)
    }


def _rate(scrapes: list[Scrape], i: int, sel: Node, rng: float) -> Vector:
    t_now = scrapes[i][0]
    window = [s for s in scrapes[: i + 1] if t_now - s[0] <= rng + 1e-9]
    if len(window) < 2:
        return {}
    span = window[-1][0] - window[0][0]
    increases: dict[Labels, float] = defaultdict(float)
    seen: dict[Labels, int] = defaultdict(int)
    for (_, a), (_, b) in zip(window, window[1:], strict=False):
        va, vb = _select(a, sel), _select(b, sel)
        for lb, v in vb.items():
            if lb in va:
                increases[lb] += v - va[lb] if v >= va[lb] else v  # a drop = counter restarted at 0
                seen[lb] += 1
    return {lb: inc / span for lb, inc in increases.items() if span > 0 and seen[lb]}


def _histogram_quantile(q: float, vec: Vector) -> Vector:
    groups: dict[Labels, list[tuple[float, float]]] = defaultdict(list)
    for lb, v in vec.items():
        d = dict(lb)
        le = d.pop("le", None)
        if le is None:
            continue
        groups[frozenset(d.items())].append((float(le), v))
    out: Vector = {}
    for lb, buckets in groups.items():
        buckets.sort()
        total = buckets[-1][1]
        if not total > 0 or buckets[-1][0] != math.inf:
            continue  # no observations in the window (Prometheus answers NaN)
        rank = q * total
        prev_le, prev_c = 0.0, 0.0
        for le, c in buckets:
            if c >= rank:
                if le == math.inf:
                    out[lb] = prev_le  # in the +Inf bucket: the highest finite bound
                elif c == prev_c:
                    out[lb] = le
                else:
                    out[lb] = prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
                break
            prev_le, prev_c = le, c
    return out


def _binary(op: str, a: Vector | float, b: Vector | float) -> Vector | float:
    def f(x: float, y: float) -> float:
        if op == "/":
            return x / y if y else math.nan
        return {"*": x * y, "+": x + y, "-": x - y}[op]

    if isinstance(a, float) and isinstance(b, float):
        return f(a, b)
    if isinstance(a, float):
        assert isinstance(b, dict)
        return {lb: f(a, v) for lb, v in b.items()}
    if isinstance(b, float):
        return {lb: f(v, b) for lb, v in a.items()}
    return {lb: f(v, b[lb]) for lb, v in a.items() if lb in b}


def evaluate(node: Node, scrapes: list[Scrape], i: int, max_window: float) -> Vector | float:
    """The value of ``node`` at scrape ``i`` (a label-set -> value vector, or a number)."""
    if node.kind == "num":
        return node.args[0]
    if node.kind == "sel":
        return _select(scrapes[i][1], node)
    if node.kind == "rate":
        sel, rng = node.args
        return _rate(scrapes, i, sel, min(rng, max_window))
    if node.kind == "sum":
        by, inner = node.args
        vec = evaluate(inner, scrapes, i, max_window)
        if isinstance(vec, float):
            return vec
        out: Vector = defaultdict(float)
        for lb, v in vec.items():
            key = frozenset((k, val) for k, val in lb if by is not None and k in by)
            out[key] += v
        return dict(out)
    if node.kind == "hq":
        q, inner = node.args
        vec = evaluate(inner, scrapes, i, max_window)
        return _histogram_quantile(q, vec) if isinstance(vec, dict) else {}
    op, left, right = node.args
    return _binary(op, evaluate(left, scrapes, i, max_window), evaluate(right, scrapes, i, max_window))


def legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt) or "value"


def panel_series(
    panel: dict[str, Any], scrapes: list[Scrape], max_window: float
) -> dict[str, tuple[list[float], list[float]]]:
    """``{legend: (seconds since the first scrape, values)}`` of one panel; NaNs left out."""
    t0 = scrapes[0][0] if scrapes else 0.0
    series: dict[str, tuple[list[float], list[float]]] = {}
    for target in panel.get("targets", []):
        node = parse_query(target["expr"])
        for i in range(len(scrapes)):
            val = evaluate(node, scrapes, i, max_window)
            vec = {frozenset(): val} if isinstance(val, float) else val
            for lb, v in vec.items():
                if math.isnan(v) or math.isinf(v):
                    continue
                xs, ys = series.setdefault(legend(target.get("legendFormat", ""), lb), ([], []))
                xs.append(scrapes[i][0] - t0)
                ys.append(v)
    return series


# --------------------------------------------------------------------------------------------
# plotting


def plot(dashboard: dict[str, Any], scrapes: list[Scrape], out: Path, max_window: float, note: str) -> dict:
    """Draw every panel at its gridPos; returns {panel title: number of points plotted}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p.get("type") == "timeseries"]
    # Grid unit: the gcd of the panels' y/h, so a dashboard of 8-high panels is a grid of rows.
    unit = math.gcd(*(v for p in panels for v in (p["gridPos"]["y"], p["gridPos"]["h"])))
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) // unit
    fig = plt.figure(figsize=(14, 3.2 * rows * unit / 8))
    grid = fig.add_gridspec(rows, 24, hspace=0.55, wspace=3.0, top=1 - 0.35 / rows, bottom=0.05)
    span = scrapes[-1][0] - scrapes[0][0] if scrapes else 1.0
    counts: dict[str, int] = {}
    for p in panels:
        g = p["gridPos"]
        y0, y1 = g["y"] // unit, (g["y"] + g["h"]) // unit
        ax = fig.add_subplot(grid[y0:y1, g["x"] : g["x"] + g["w"]])
        series = panel_series(p, scrapes, max_window)
        counts[p["title"]] = sum(len(xs) for xs, _ in series.values())
        for name, (xs, ys) in sorted(series.items()):
            ax.plot(xs, ys, label=name, linewidth=1.4, marker="." if len(xs) < 30 else None)
        ax.set_title(p["title"], fontsize=10, loc="left")
        ax.set_xlim(0, span)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(
                0.5,
                0.5,
                "no data (no series exported: nothing counted)",
                ha="center",
                va="center",
                transform=ax.transAxes,
                color="grey",
            )
            ax.set_yticks([])
        if y1 == rows:
            ax.set_xlabel("seconds since first scrape", fontsize=8)
    fig.suptitle(f"{dashboard['title']} — {note}", fontsize=11, x=0.06, y=1 - 0.1 / rows, ha="left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return counts


# --------------------------------------------------------------------------------------------
# command line


def _dump(s: Scrape) -> str:
    t, samples = s
    return json.dumps(
        {"t": t, "samples": {n: [[dict(lb), v] for lb, v in ser.items()] for n, ser in samples.items()}}
    )


def _load(line: str) -> Scrape:
    d = json.loads(line)
    return d["t"], {n: {frozenset(lb.items()): v for lb, v in ser} for n, ser in d["samples"].items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, help="a `teamrl run` folder: metrics ports from run.json")
    p.add_argument("--target", action="append", default=[], help="HOST:PORT of a /metrics endpoint")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between scrapes")
    p.add_argument("--max-window", type=float, default=30.0, help="cap on rate() ranges, seconds")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the first answer")
    p.add_argument(
        "--gone-after", type=int, default=3, help="stop after this many scrapes in which every target refused"
    )
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: at exit)")
    p.add_argument("--save", type=Path, help="append the raw scrapes here (JSON lines)")
    p.add_argument("--replay", type=Path, help="plot saved scrapes instead of scraping")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    p.add_argument("--note", default="", help="subtitle (default: what was scraped)")
    args = p.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            parse_query(t["expr"])  # an unsupported query fails now, not after a long run

    if args.replay:
        scrapes = [_load(line) for line in args.replay.read_text().splitlines() if line.strip()]
        targets = sorted(
            {v for _, s in scrapes for ser in s.values() for lb in ser for k, v in lb if k == "instance"}
        )
    else:
        targets = list(args.target)
        deadline = time.time() + args.wait
        while args.run_dir and not targets:
            try:
                targets = targets_from_run(args.run_dir)
            except (OSError, ValueError, KeyError):
                if time.time() > deadline:
                    print(f"no {args.run_dir}/run.json after {args.wait:.0f} s", file=sys.stderr)
                    return 2
                time.sleep(1.0)
        if not targets:
            p.error("give --run-dir or --target")
        print(f"scraping {', '.join(targets)} every {args.interval:g} s", flush=True)
        scrapes, misses, t_start = [], 0, time.time()
        save = args.save.open("a") if args.save else None
        while True:
            samples, up, refused = scrape(targets)
            if up:
                misses = 0
                scrapes.append((time.time(), dict(samples)))
                if save:
                    save.write(_dump(scrapes[-1]) + "\n")
                    save.flush()
            elif scrapes and refused == len(targets):
                misses += 1
                if misses >= args.gone_after:
                    break
            elif time.time() > deadline:
                print(f"no target answered within {args.wait:.0f} s", file=sys.stderr)
                return 2
            if args.duration and time.time() - t_start > args.duration:
                break
            time.sleep(args.interval)
        if save:
            save.close()
    if len(scrapes) < 2:
        print(f"only {len(scrapes)} scrape(s): nothing to plot", file=sys.stderr)
        return 2
    span = scrapes[-1][0] - scrapes[0][0]
    note = args.note or f"{len(scrapes)} scrapes of {len(targets)} targets over {span:.0f} s"
    counts = plot(dashboard, scrapes, args.out, args.max_window, note)
    print(f"wrote {args.out} ({note})")
    for title, n in counts.items():
        print(f"  {'data' if n else 'NO DATA':>7}  {n:4d} points  {title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
