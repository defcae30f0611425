"""scripts/dashboard_png.py: it finds a run's endpoints, asks a real Prometheus the panel queries
(through its HTTP API, with range selectors cut to --max-window) and draws every panel.

The Prometheus checks start the real server (Debian package ``prometheus``; ``make setup``
installs it where apt works) scraping an in-process ``prometheus_client`` endpoint whose counter
grows at a known rate; they are skipped, with that reason, where the binary is missing.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import DEPLOY, ROOT

spec = importlib.util.spec_from_file_location("dashboard_png", ROOT / "scripts" / "dashboard_png.py")
assert spec and spec.loader
dp = importlib.util.module_from_spec(spec)
sys.modules["dashboard_png"] = dp
spec.loader.exec_module(dp)

DASHBOARD = json.loads((DEPLOY / "monitoring" / "dashboards" / "teamrl.json").read_text())
needs_prometheus = pytest.mark.skipif(
    dp.prometheus_binary() is None,
    reason="no `prometheus` binary (Debian package prometheus; scripts/setup.sh installs it where apt works)",
)


def test_shorten_ranges_cuts_only_longer_windows() -> None:
    expr = "sum(rate(a_total[5m])) / sum(rate(b_sum[10s])) + rate(c[1h])"
    assert dp.shorten_ranges(expr, 30) == "sum(rate(a_total[30s])) / sum(rate(b_sum[10s])) + rate(c[30s])"
    assert dp.shorten_ranges(expr, 0) == expr
    assert dp.shorten_ranges('x{le="+Inf"}', 30) == 'x{le="+Inf"}'


def test_plot_draws_every_panel_and_counts_points(tmp_path: Path) -> None:
    title = "Throughput per agent (generated tokens/s)"
    series = {title: {"solver": ([100.0, 101.0, 102.0], [1.0, 2.0, 3.0]), "verifier": ([101.0], [0.5])}}
    out = tmp_path / "d.png"
    counts = dp.plot(DASHBOARD, series, out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(counts) == {p["title"] for p in DASHBOARD["panels"] if p.get("type") == "timeseries"}
    assert counts[title] == 4 and sum(counts.values()) == 4


def test_run_dir_targets_from_run_json_or_the_live_services(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    assert dp.targets_from_run(run) == []
    # What a service of `teamrl run` looks like in the process table: its --config inside RUN.
    fake = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "rollout", "--config", "run/config.toml"]
        + ["--metrics-port", "45123"],
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 10
        while not dp.targets_from_run(run) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dp.targets_from_run(run) == ["127.0.0.1:45123"]
        # The launcher's record wins where it exists.
        (run / "run.json").write_text(json.dumps({"metrics_ports": {"buffer": 45001, "learner": 45002}}))
        assert dp.targets_from_run(run) == ["127.0.0.1:45001", "127.0.0.1:45002"]
    finally:
        fake.kill()
        fake.wait()


@pytest.fixture
def exporter():
    """An in-process /metrics endpoint: a counter growing by 50 per second, labelled by agent."""
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    reg = CollectorRegistry()
    c = Counter("teamrl_test_tokens", "test", ["agent"], registry=reg)
    stop = threading.Event()

    def grow() -> None:
        while not stop.wait(0.1):
            c.labels(agent="solver").inc(5)

    server, _thread = start_http_server(0, addr="127.0.0.1", registry=reg)
    t = threading.Thread(target=grow, daemon=True)
    t.start()
    yield f"127.0.0.1:{server.server_port}", server
    stop.set()
    server.shutdown()


@needs_prometheus
@pytest.mark.slow
def test_real_prometheus_answers_rates_and_refuses_bad_queries(exporter) -> None:
    target, _server = exporter
    with dp.local_prometheus([target], interval=0.5, labels={"namespace": "teamrl"}) as url:
        deadline = time.monotonic() + 10
        while dp.targets_health(url) != {target: "up"} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dp.targets_health(url) == {target: "up"}
        time.sleep(3.0)  # a few scrapes for the rate
        (r,) = dp.query(url, "sum by (agent, namespace) (rate(teamrl_test_tokens_total[3s]))")
        assert r["metric"] == {"agent": "solver", "namespace": "teamrl"}
        assert float(r["value"][1]) == pytest.approx(50.0, rel=0.3)
        with pytest.raises(RuntimeError, match="parse"):
            dp.query(url, "sum(rate(teamrl_test_tokens_total))")


@needs_prometheus
@pytest.mark.slow
def test_cli_scrapes_a_target_and_plots_what_prometheus_answers(
    exporter, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target, _server = exporter
    board = {
        "title": "test",
        "panels": [
            {
                "title": "tokens/s",
                "type": "timeseries",
                "gridPos": {"h": 8, "w": 12, "x": 0, "y": 0},
                "targets": [
                    {
                        "expr": "sum by (agent) (rate(teamrl_test_tokens_total[5m]))",
                        "legendFormat": "{{agent}}",
                    }
                ],
            },
            {
                "title": "nothing",
                "type": "timeseries",
                "gridPos": {"h": 8, "w": 12, "x": 12, "y": 0},
                "targets": [{"expr": "sum(rate(teamrl_absent_total[5m]))"}],
            },
        ],
    }
    (tmp_path / "board.json").write_text(json.dumps(board))
    out = tmp_path / "d.png"
    argv = ["--target", target, "--interval", "0.5", "--duration", "4", "--max-window", "2"]
    assert dp.main([*argv, "--dashboard", str(tmp_path / "board.json"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = capsys.readouterr().out.splitlines()
    (tokens,) = [x.split() for x in lines if x.endswith("tokens/s")]
    assert tokens[0] == "data" and int(tokens[1]) >= 4  # a point every 0.5 s over ~4 s
    assert any(x.split()[:2] == ["NO", "DATA"] and x.endswith("nothing") for x in lines)
