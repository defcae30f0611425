"""scripts/dashboard_png.py: its PromQL subset reads every shipped panel query and computes what
Prometheus would (rates with counter resets, sums by label, histogram quantiles, ratios)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from conftest import DEPLOY, ROOT

spec = importlib.util.spec_from_file_location("dashboard_png", ROOT / "scripts" / "dashboard_png.py")
assert spec and spec.loader
dp = importlib.util.module_from_spec(spec)
sys.modules["dashboard_png"] = dp  # dataclasses look their module up
spec.loader.exec_module(dp)

DASHBOARD = json.loads((DEPLOY / "monitoring" / "dashboards" / "teamrl.json").read_text())


def lb(**kv: str) -> frozenset:
    return frozenset(kv.items())


def at(scrapes: list, expr: str, i: int = -1, max_window: float = 1e9) -> dict:
    i = i % len(scrapes)
    val = dp.evaluate(dp.parse_query(expr), scrapes, i, max_window)
    return {frozenset(): val} if isinstance(val, float) else val


def test_every_panel_query_parses() -> None:
    exprs = [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    assert exprs
    for e in exprs:
        dp.parse_query(e)


def test_unsupported_query_is_refused_with_the_query_named() -> None:
    with pytest.raises(ValueError, match="avg_over_time|rate"):
        dp.parse_query("rate(teamrl_x)")


def test_rate_handles_a_counter_reset_and_sums_by_label() -> None:
    a, b = lb(agent="solver", instance="r0"), lb(agent="solver", instance="r1")
    v = lb(agent="verifier", instance="r0")
    scrapes = [
        (0.0, {"t_total": {a: 0.0, b: 10.0, v: 0.0}}),
        (10.0, {"t_total": {a: 50.0, b: 20.0, v: 5.0}}),
        (20.0, {"t_total": {a: 100.0, b: 5.0, v: 10.0}}),  # r1 restarted: 5 counted since 0
    ]
    got = at(scrapes, "sum by (agent) (rate(t_total[5m]))")
    assert got == {lb(agent="solver"): pytest.approx((100 + 10 + 5) / 20), lb(agent="verifier"): 0.5}
    # A window shorter than the data uses only the scrapes inside it.
    assert at(scrapes, "sum(rate(t_total[10s]))") == {frozenset(): pytest.approx((50 + 5 + 5) / 10)}
    assert at(scrapes, "sum(rate(t_total[5m]))", i=0) == {}  # one scrape: no rate yet


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    def buckets(c1: float, c2: float, inf: float) -> dict:
        return {lb(le="1.0"): c1, lb(le="2.0"): c2, lb(le="+Inf"): inf}

    scrapes = [(0.0, {"h_bucket": buckets(0, 0, 0)}), (10.0, {"h_bucket": buckets(4, 8, 8)})]
    expr = "histogram_quantile({q}, sum by (le) (rate(h_bucket[5m])))"
    assert at(scrapes, expr.format(q=0.5))[frozenset()] == pytest.approx(1.0)
    assert at(scrapes, expr.format(q=0.75))[frozenset()] == pytest.approx(1.5)
    quiet = [(0.0, {"h_bucket": buckets(4, 8, 8)}), (10.0, {"h_bucket": buckets(4, 8, 8)})]
    assert at(quiet, expr.format(q=0.5)) == {}  # nothing observed: Prometheus says NaN


def test_ratio_of_rates_and_division_by_zero() -> None:
    scrapes = [
        (0.0, {"w_sum": {lb(): 0.0}, "s_sum": {lb(): 0.0}}),
        (10.0, {"w_sum": {lb(): 1.0}, "s_sum": {lb(): 4.0}}),
        (20.0, {"w_sum": {lb(): 1.0}, "s_sum": {lb(): 4.0}}),
    ]
    expr = "sum(rate(w_sum[10s])) / sum(rate(s_sum[10s]))"
    assert at(scrapes, expr, i=1)[frozenset()] == pytest.approx(0.25)
    assert math.isnan(at(scrapes, expr, i=2)[frozenset()])


def test_plot_draws_every_panel_and_reports_which_had_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    inst = {"instance": "r0", "agent": "solver"}
    scrapes = [
        (float(t), {"teamrl_rollout_tokens_total": {frozenset(inst.items()): 100.0 * t}}) for t in range(5)
    ]
    out = tmp_path / "d.png"
    counts = dp.plot(DASHBOARD, scrapes, out, 30.0, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(counts) == {p["title"] for p in DASHBOARD["panels"] if p.get("type") == "timeseries"}
    assert counts["Throughput per agent (generated tokens/s)"] == 4
    assert sum(counts.values()) == 4
