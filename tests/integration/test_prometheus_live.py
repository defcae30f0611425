"""A real Prometheus scrapes a short live ``teamrl run`` and answers every query deploy/ ships.

The run (buffer, learner, one rollout over ZeroMQ; ``--max-lag 0`` and a rollout not held back by
``max_groups_per_version`` so that stale drops and evictions happen in a few steps) exports the real ``teamrl_*`` metrics. A Prometheus server
(Debian package ``prometheus``; ``make setup`` installs it where apt works) scrapes it every second,
with the ``namespace`` label a cluster's ServiceMonitor scrape adds. Through Prometheus's HTTP API:

- every panel query of the Grafana dashboard returns data (a finite value at some instant);
- the HPA's external metric as prometheus-adapter computes it (its rule's seriesQuery and its
  metricsQuery with the templates filled in as the adapter does for the HPA's namespace) and the
  KEDA ScaledObject's query return a data-wait ratio in [0, 1].

Each service's last ``/metrics`` page, cut to its ``teamrl_*`` families, passes
``promtool check metrics`` (Prometheus's own linter: naming, units, help, types).
One malformed frame is sent to the buffer's data socket, as a foreign peer would, so the rejected
frames panel has a real rejection to show. Skipped, with the reason, without the binaries.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
spec = importlib.util.spec_from_file_location("dashboard_png", ROOT / "scripts" / "dashboard_png.py")
assert spec and spec.loader
dp = importlib.util.module_from_spec(spec)
sys.modules.setdefault("dashboard_png", dp)
spec.loader.exec_module(dp)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.usefixtures("embedded_model"),
    pytest.mark.skipif(
        dp.prometheus_binary() is None or shutil.which("promtool") is None,
        reason="no `prometheus`/`promtool` (Debian package prometheus; scripts/setup.sh installs it where apt works)",
    ),
]

STEPS = 4
NAMESPACE = "teamrl"
RUN_TIMEOUT_S = 420  # about 100-180 s on 2 cores, depending on what else runs


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _teamrl_families(text: str) -> str:
    """The ``teamrl_*`` families of an exposition page (HELP/TYPE lines and samples)."""
    keep = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else line
        if name.startswith("teamrl_"):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _adapter_query(namespace: str) -> tuple[str, str]:
    """The adapter rule's seriesQuery and its metricsQuery as prometheus-adapter runs it for an HPA
    in ``namespace`` (templates: <<.LabelMatchers>> the namespace, <<.GroupBy>> the namespace)."""
    (rule,) = yaml.safe_load((DEPLOY / "monitoring" / "prometheus-adapter" / "rules.yaml").read_text())[
        "externalRules"
    ]
    q = rule["metricsQuery"].replace("<<.LabelMatchers>>", f'namespace="{namespace}"')
    return rule["seriesQuery"], q.replace("<<.GroupBy>>", "namespace")


def _keda_query() -> str:
    so = yaml.safe_load((DEPLOY / "components" / "keda" / "scaledobject.yaml").read_text())
    (trigger,) = so["spec"]["triggers"]
    return trigger["metadata"]["query"]


def _send_foreign_frame(buffer_log: Path) -> None:
    """One single-part message to the buffer's data ROUTER (a real frame has header + payload)."""
    import zmq

    m = re.search(r"buffer up: data (tcp://\S+?),", buffer_log.read_text())
    assert m, buffer_log.read_text()[-2000:]
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(m.group(1))
    s.send(b"not a teamrl frame")
    s.close()


def _buffer_counted_a_rejection(run: Path) -> bool:
    """The buffer's own /metrics page shows a rejected frame (of any reason)."""
    try:
        port = json.loads((run / "run.json").read_text())["metrics_ports"]["buffer"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            page = r.read().decode()
    except (OSError, KeyError, ValueError):
        return False
    return any(
        line.startswith("teamrl_protocol_rejected_frames_total{") and float(line.rsplit(" ", 1)[1]) > 0
        for line in page.splitlines()
    )


def test_prometheus_answers_every_dashboard_and_autoscaler_query(tmp_path: Path) -> None:
    t_begin = time.monotonic()
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "teamrl.cli.main",
        "run",
        "--workflow",
        "addition-duo",
        "--run-dir",
        str(run),
    ]
    argv += ["--steps", str(STEPS)]
    argv += ["--tasks-per-step", "2", "--group-size", "4", "--eval-interval", "1000", "--eval-tasks", "4"]
    argv += ["--max-lag", "0", "--checkpoint-interval", "1000", "--threads-per-service", "1"]
    argv += ["--set", "rollout.max_groups_per_version=0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        targets: list[str] = []
        while len(targets) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            targets = dp.targets_from_run(run)  # the path scripts/dashboard_png.py --run-dir takes
        if len(targets) < 3:
            out = proc.communicate(timeout=120)[0] if proc.poll() is not None else ""
            pytest.fail(f"buffer, learner and rollout endpoints expected, found {targets}:\n{out[-4000:]}")

        pages: dict[str, str] = {}
        with dp.local_prometheus(targets, interval=1.0, labels={"namespace": NAMESPACE}) as url:
            t_start = time.time()
            sent, tries = False, 0
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(1.0)
                log = run / "logs" / "buffer.log"
                if not sent and log.exists() and "buffer up" in log.read_text():
                    # early: the counter needs scrapes to have a rate. Sent again until the buffer
                    # has counted it: on a loaded machine a peer closed after LINGER can go before
                    # its handshake was even attempted.
                    if tries < 5:
                        _send_foreign_frame(log)
                        tries += 1
                    sent = _buffer_counted_a_rejection(run)
                for t in targets:  # the last page each service served, for promtool
                    try:
                        with urllib.request.urlopen(f"http://{t}/metrics", timeout=5) as r:
                            pages[t] = r.read().decode()
                    except OSError:
                        pass
            out = proc.communicate(timeout=120)[0] if proc.poll() is not None else ""
            assert proc.returncode == 0, f"run did not finish in {RUN_TIMEOUT_S} s:\n{out[-4000:]}"
            assert sent and _rows(run / "metrics.jsonl") == STEPS
            t_run = time.monotonic() - t_begin
            end = time.time()

            def data(expr: str) -> int:
                return dp.finite_points(dp.query_range(url, expr, t_start, end, 1.0))

            dashboard = json.loads((DEPLOY / "monitoring" / "dashboards" / "teamrl.json").read_text())
            points = {(title, e): data(e) for title, e, _legend in dp.panel_queries(dashboard)}
            empty = [k for k, n in points.items() if not n]
            assert not empty, f"panel queries with no data: {empty}"
            # What scripts/dashboard_png.py draws from the same server: every panel has points.
            counts = dp.fetch_and_plot(url, dashboard, t_start, end, 1.0, 30.0, tmp_path / "d.png", "test")
            assert all(counts.values()), counts

            series_query, adapter_query = _adapter_query(NAMESPACE)
            assert dp.query_range(url, series_query, t_start, end, 1.0), series_query
            # Both autoscalers compute the same ratio (the adapter groups by namespace, KEDA sums
            # the namespace's series): rates of step time spent waiting for data. Each rate is
            # extrapolated to its window on its own, so a learner that only waits reads a little over 1.
            hpa, keda = (
                [float(v) for r in dp.query_range(url, q, t_start, end, 1.0) for _t, v in r["values"]]
                for q in (adapter_query, _keda_query())
            )
            assert hpa == pytest.approx(keda, nan_ok=True), (hpa[-10:], keda[-10:])
            finite = [v for v in hpa if math.isfinite(v)]
            assert finite and all(0.0 <= v <= 1.1 for v in finite), (adapter_query, hpa[-10:])
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=120)

    assert set(pages) == set(targets)
    for t, page in pages.items():
        fams = _teamrl_families(page)
        assert fams.count("# TYPE ") >= 3, f"{t}: {fams[:500]}"
        res = subprocess.run(["promtool", "check", "metrics"], input=fams, capture_output=True, text=True)
        assert res.returncode == 0, f"{t}: promtool check metrics:\n{res.stdout}{res.stderr}"
    print(f"\nrun of {STEPS} steps + queries: {time.monotonic() - t_begin:.0f} s (run {t_run:.0f} s)")
    for (title, e), n in points.items():
        print(f"{n:5d} points  {title}: {e}")
