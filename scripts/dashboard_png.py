"""Plot the Grafana dashboard's panels, as Prometheus answers their queries, into one PNG.

Two ways to get a Prometheus server:

- ``--prometheus URL``: an existing server (a cluster's, or one you started); the panels are
  plotted over ``--start``/``--end`` (unix seconds) or the last ``--last`` seconds.
- ``--run-dir RUN`` or ``--target HOST:PORT`` (repeatable): a local ``prometheus`` (Debian package
  ``prometheus``; ``make setup`` installs it where apt works) is started on a temporary TSDB
  (``--tsdb DIR`` to keep it) and scrapes the run's ``/metrics`` endpoints every ``--interval``
  seconds until they all stop answering (or for ``--duration`` seconds); then it is queried and
  stopped. A run's endpoints are ``RUN/run.json["metrics_ports"]`` (``{service: port}``) where the
  launcher records them, else the ``--metrics-port`` of each live ``teamrl`` service process whose
  command line names the run folder.

Each panel query of deploy/monitoring/dashboards/teamrl.json goes to Prometheus's HTTP API
(``/api/v1/query_range``) as written, with one change: range selectors longer than
``--max-window`` (default 30 s) are shortened to it, because a short local run has minutes of data
and a ``[5m]`` rate flattens its curves (``--max-window 0`` keeps the dashboard's ranges). The
panels are drawn in the dashboard's own grid (gridPos) with matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from teamrl.protocol.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "monitoring" / "dashboards" / "teamrl.json"

# {legend: (unix times, values)} of one panel
Series = dict[str, tuple[list[float], list[float]]]

_RANGE = re.compile(r"\[(\d+)([smhdw])\]")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


# --------------------------------------------------------------------------------------------
# Prometheus: start one, ask it


def api(url: str, path: str, params: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
    """GET ``url/api/v1/path`` and return its ``data``; RuntimeError with Prometheus's error."""
    q = f"?{urllib.parse.urlencode(params)}" if params else ""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/{path}{q}", timeout=timeout) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:  # 400/422: a bad query; the body says why
        body = json.loads(e.read() or b"{}")
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def query(url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """Instant query: ``[{"metric": {labels}, "value": [t, "v"]}, ...]``."""
    return api(url, "query", {"query": expr, **({"time": at} if at is not None else {})})["result"]


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    """Range query: ``[{"metric": {labels}, "values": [[t, "v"], ...]}, ...]``."""
    data = api(url, "query_range", {"query": expr, "start": start, "end": end, "step": step})
    return data["result"]


def finite_points(result: list[dict[str, Any]]) -> int:
    """How many finite numbers a query or range-query result holds (NaN is Prometheus's 'no value')."""
    n = 0
    for r in result:
        for _t, v in r.get("values", [r["value"]] if "value" in r else []):
            n += math.isfinite(float(v))
    return n


def targets_health(url: str) -> dict[str, str]:
    """``{"host:port": "up" | "down" | "unknown"}`` of the server's active scrape targets."""
    return {t["labels"]["instance"]: t["health"] for t in api(url, "targets")["activeTargets"]}


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@contextmanager
def local_prometheus(
    targets: list[str],
    interval: float = 1.0,
    tsdb: Path | None = None,
    labels: dict[str, str] | None = None,
    ready_timeout: float = 60.0,
) -> Iterator[str]:
    """A ``prometheus`` server on a free loopback port scraping ``targets``; yields its URL.

    ``labels`` are added to every scraped series (e.g. ``namespace``, which a cluster's
    ServiceMonitor scrape adds). Yields once every target is listed (not necessarily scraped yet).
    The server is stopped (SIGTERM, then SIGKILL) on exit.
    """
    exe = prometheus_binary()
    if exe is None:
        raise FileNotFoundError("no `prometheus` on PATH (Debian: apt-get install prometheus)")
    work = Path(tempfile.mkdtemp(prefix="teamrl-prom-"))
    data = tsdb or work / "data"
    port = free_port()
    step = f"{max(1, round(interval * 1000))}ms"
    config = {
        "global": {"scrape_interval": step, "scrape_timeout": step, "evaluation_interval": step},
        "scrape_configs": [
            {"job_name": "teamrl", "static_configs": [{"targets": targets, "labels": labels or {}}]}
        ],
    }
    (work / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1d",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (work / "prometheus.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"prometheus did not become ready (exit {proc.poll()}):\n{tail}")
            time.sleep(0.2)
        # Its discovery hands targets to the scraper ~5 s after start: wait for that too.
        while targets and len(targets_health(url)) < len(set(targets)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus lists {targets_health(url)} of targets {targets}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# which endpoints a run has


def _live_service_ports(run_dir: Path) -> dict[str, int]:
    """``{service-port: metrics port}`` of live ``teamrl`` service processes whose argv names a path
    inside ``run_dir`` (the buffer's ``--dir``, the learner's ``--run-dir``, every ``--config``)."""
    run = os.path.realpath(run_dir)
    found: dict[str, int] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if "--metrics-port" not in argv[:-1]:
            continue
        paths = (os.path.realpath(os.path.join(cwd, a)) for a in argv if a and "\n" not in a)
        if not any(x == run or x.startswith(run + os.sep) for x in paths):
            continue
        cmd = next((a for a in argv if a in ("buffer", "learner", "rollout")), "service")
        try:
            port = int(argv[argv.index("--metrics-port") + 1])
        except ValueError:
            continue
        if port:
            found[f"{cmd}-{port}"] = port
    return found


def targets_from_run(run_dir: Path) -> list[str]:
    """``HOST:PORT`` of each metrics endpoint of the run in ``run_dir`` (empty: none found yet)."""
    ports: dict[str, int] = {}
    try:
        ports = json.loads((run_dir / "run.json").read_text()).get("metrics_ports") or {}
    except (OSError, ValueError):
        pass
    if not ports:
        ports = _live_service_ports(run_dir)
    return [f"127.0.0.1:{p}" for _name, p in sorted(ports.items()) if p]


# --------------------------------------------------------------------------------------------
# panels


def shorten_ranges(expr: str, max_window: float) -> str:
    """``expr`` with every range selector longer than ``max_window`` seconds cut to it (0: as is)."""
    if max_window <= 0:
        return expr

    def cut(m: re.Match[str]) -> str:
        seconds = int(m.group(1)) * _UNIT_S[m.group(2)]
        return m.group(0) if seconds <= max_window else f"[{int(max_window)}s]"

    return _RANGE.sub(cut, expr)


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or "value"


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(panel title, query, legend format)`` of every target of every panel."""
    return [
        (p["title"], t["expr"], t.get("legendFormat", ""))
        for p in dashboard["panels"]
        for t in p.get("targets", [])
    ]


def panel_series(
    url: str, panel: dict[str, Any], start: float, end: float, step: float, max_window: float
) -> Series:
    """``{legend: (times, values)}`` of one panel over [start, end]; NaN and inf points left out."""
    series: Series = {}
    for target in panel.get("targets", []):
        expr = shorten_ranges(target["expr"], max_window)
        for r in query_range(url, expr, start, end, step):
            xs, ys = series.setdefault(legend(target.get("legendFormat", ""), r["metric"]), ([], []))
            for t, v in r["values"]:
                if math.isfinite(float(v)):
                    xs.append(float(t))
                    ys.append(float(v))
    return {k: v for k, v in series.items() if v[0]}


# --------------------------------------------------------------------------------------------
# plotting


def plot(dashboard: dict[str, Any], series: dict[str, Series], out: Path, note: str) -> dict[str, int]:
    """Draw every timeseries panel at its gridPos from ``{title: Series}``; returns points per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p.get("type") == "timeseries"]
    # Grid unit: the gcd of the panels' y/h, so a dashboard of 8-high panels is a grid of rows.
    unit = math.gcd(*(v for p in panels for v in (p["gridPos"]["y"], p["gridPos"]["h"])))
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels) // unit
    fig = plt.figure(figsize=(14, 3.2 * rows * unit / 8))
    grid = fig.add_gridspec(rows, 24, hspace=0.55, wspace=3.0, top=1 - 0.35 / rows, bottom=0.05)
    times = [t for s in series.values() for xs, _ in s.values() for t in xs]
    t0 = min(times, default=0.0)
    span = max(times, default=1.0) - t0 or 1.0
    counts: dict[str, int] = {}
    for p in panels:
        g = p["gridPos"]
        y0, y1 = g["y"] // unit, (g["y"] + g["h"]) // unit
        ax = fig.add_subplot(grid[y0:y1, g["x"] : g["x"] + g["w"]])
        ps = series.get(p["title"], {})
        counts[p["title"]] = sum(len(xs) for xs, _ in ps.values())
        for name, (xs, ys) in sorted(ps.items()):
            rel = [x - t0 for x in xs]
            ax.plot(rel, ys, label=name, linewidth=1.4, marker="." if len(xs) < 30 else None)
        ax.set_title(p["title"], fontsize=10, loc="left")
        ax.set_xlim(0, span)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ps:
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
            ax.set_xlabel("seconds since the first point", fontsize=8)
    fig.suptitle(f"{dashboard['title']} — {note}", fontsize=11, x=0.06, y=1 - 0.1 / rows, ha="left")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return counts


def fetch_and_plot(
    url: str,
    dashboard: dict[str, Any],
    start: float,
    end: float,
    step: float,
    max_window: float,
    out: Path,
    note: str,
) -> dict[str, int]:
    panels = [p for p in dashboard["panels"] if p.get("type") == "timeseries"]
    series = {p["title"]: panel_series(url, p, start, end, step, max_window) for p in panels}
    return plot(dashboard, series, out, note)


# --------------------------------------------------------------------------------------------
# command line


def _scrape_until_gone(url: str, args: argparse.Namespace) -> tuple[float, float] | None:
    """Wait for the first target to answer, then until all are down; the (start, end) seen up."""
    t_start = time.time()
    first_up = last_up = None
    downs = 0
    while True:
        time.sleep(args.interval)
        health = targets_health(url)
        now = time.time()
        if any(h == "up" for h in health.values()):
            first_up = first_up or now
            last_up, downs = now, 0
        elif first_up is not None and all(h == "down" for h in health.values()):
            downs += 1
            if downs >= args.gone_after:
                break
        elif first_up is None and now - t_start > args.wait:
            print(f"no target answered within {args.wait:.0f} s", file=sys.stderr)
            return None
        if args.duration and first_up is not None and now - first_up > args.duration:
            break
    return first_up - args.interval, (last_up or now) + args.interval


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--prometheus", metavar="URL", help="query this Prometheus server")
    p.add_argument("--start", type=float, help="with --prometheus: first instant (unix seconds)")
    p.add_argument("--end", type=float, help="with --prometheus: last instant (default: now)")
    p.add_argument("--last", type=float, default=900.0, help="with --prometheus: seconds before --end")
    p.add_argument("--run-dir", type=Path, help="a `teamrl run` folder: scrape its services' /metrics")
    p.add_argument("--target", action="append", default=[], help="HOST:PORT of a /metrics endpoint")
    p.add_argument("--interval", type=float, default=2.0, help="scrape interval and query step, seconds")
    p.add_argument("--max-window", type=float, default=30.0, help="cap on range selectors, seconds (0: none)")
    p.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the first target")
    p.add_argument(
        "--gone-after", type=int, default=3, help="stop after this many checks with all targets down"
    )
    p.add_argument(
        "--duration", type=float, default=0.0, help="stop scraping after this many seconds (0: at exit)"
    )
    p.add_argument("--tsdb", type=Path, help="keep the local Prometheus's data here (default: a temp dir)")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    p.add_argument("--note", default="", help="subtitle (default: what was plotted)")
    args = p.parse_args(argv)
    dashboard = json.loads(args.dashboard.read_text())

    if args.prometheus:
        end = args.end or time.time()
        start = args.start or end - args.last
        note = args.note or f"{args.prometheus}, {end - start:.0f} s"
        counts = fetch_and_plot(
            args.prometheus, dashboard, start, end, args.interval, args.max_window, args.out, note
        )
    else:
        targets = list(args.target)
        deadline = time.time() + args.wait
        while args.run_dir and not targets:
            targets = targets_from_run(args.run_dir)
            if not targets:
                if time.time() > deadline:
                    print(
                        f"no metrics endpoint of a run in {args.run_dir} after {args.wait:.0f} s",
                        file=sys.stderr,
                    )
                    return 2
                time.sleep(1.0)
        if not targets:
            p.error("give --prometheus, --run-dir or --target")
        if prometheus_binary() is None:
            print(
                "no `prometheus` on PATH (Debian: apt-get install prometheus; or give --prometheus URL)",
                file=sys.stderr,
            )
            return 2
        print(f"local prometheus scraping {', '.join(targets)} every {args.interval:g} s", flush=True)
        with local_prometheus(targets, args.interval, args.tsdb) as url:
            seen = _scrape_until_gone(url, args)
            if seen is None:
                return 2
            start, end = seen
            note = args.note or f"{len(targets)} targets over {end - start:.0f} s"
            counts = fetch_and_plot(
                url, dashboard, start, end, args.interval, args.max_window, args.out, note
            )
    print(f"wrote {args.out} ({note})")
    for title, n in counts.items():
        print(f"  {'data' if n else 'NO DATA':>7}  {n:4d} points  {title}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.exit(main())
