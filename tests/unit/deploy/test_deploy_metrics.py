"""Every metric name the autoscalers, the adapter rule and the dashboard query exists in the code.

Design: a renamed counter silently turns an HPA into a constant and a dashboard panel into "No
data", and nothing else fails. So the names are read from where the code defines them: each
package's metrics module is imported and ``prometheus_client.REGISTRY`` is asked for its
families; a family's series names follow from its type (a Counter ``x`` is exported as
``x_total``, a Histogram as ``x_bucket``/``x_sum``/``x_count``). The check is split by name
prefix: a prefix whose package has not landed is skipped on its own, with the modules it tried,
and a name with no known prefix fails.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from conftest import DEPLOY, render_tree

Doc = dict[str, Any]
NAME = re.compile(r"\bteamrl_[a-z0-9_]+")
# Prefix -> modules that may define it (any that imports counts; the buffer's may land in either).
PREFIX_MODULES = {
    "teamrl_protocol_": ("teamrl.protocol.metrics",),
    "teamrl_service_": ("teamrl.protocol.timeline",),
    "teamrl_rollout_": ("teamrl.rollout.metrics",),
    "teamrl_buffer_": ("teamrl.learner.buffer", "teamrl.learner.buffer_service", "teamrl.learner.metrics"),
    "teamrl_learner_": ("teamrl.learner.metrics", "teamrl.learner.service"),
}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created", ""),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "unknown": ("",),
}


def _adapter_rules() -> Doc:
    return yaml.safe_load((DEPLOY / "monitoring" / "prometheus-adapter" / "rules.yaml").read_text())


def _served_by_adapter() -> set[str]:
    """External metric names the prometheus-adapter rules serve (their ``name.as``)."""
    return {r["name"]["as"] for r in _adapter_rules()["externalRules"]}


def used_names() -> dict[str, set[str]]:
    """Series names queried by each consumer: {consumer: {name, ...}}."""
    used: dict[str, set[str]] = {}
    rules = _adapter_rules()["externalRules"]
    used["prometheus-adapter"] = {
        n for r in rules for text in (r["seriesQuery"], r["metricsQuery"]) for n in NAME.findall(text)
    }
    for overlay in ("gpu", "gpu-keda", "cpu-dev"):
        for d in render_tree(f"overlays/{overlay}"):
            if d["kind"] == "ScaledObject":
                for t in d["spec"]["triggers"]:
                    used.setdefault("keda", set()).update(NAME.findall(t["metadata"]["query"]))
            if d["kind"] == "HorizontalPodAutoscaler":
                for m in d["spec"]["metrics"]:
                    # An External metric is served by the adapter rule under its own name.
                    name = m["external"]["metric"]["name"]
                    assert name in _served_by_adapter(), f"HPA metric {name} is served by no adapter rule"
    dashboard = json.loads((DEPLOY / "monitoring" / "dashboards" / "teamrl.json").read_text())
    used["dashboard"] = {
        n for p in dashboard["panels"] for t in p.get("targets", []) for n in NAME.findall(t["expr"])
    }
    return used


def registry_names(modules: tuple[str, ...]) -> tuple[set[str], list[str]]:
    """Series names in the default registry after importing whichever of ``modules`` exist."""
    from prometheus_client import REGISTRY

    loaded = []
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name and (mod == exc.name or mod.startswith(exc.name + ".")):
                continue  # this module has not landed; an import error inside it is not hidden
            raise
        loaded.append(mod)
    names = {f.name + s for f in REGISTRY.collect() for s in SUFFIXES.get(f.type, ("",))}
    return names, loaded


def test_every_used_name_has_a_known_prefix() -> None:
    for consumer, names in used_names().items():
        assert names, f"{consumer} queries no teamrl metric"
        for n in names:
            assert n.startswith(tuple(PREFIX_MODULES)), f"{consumer}: {n} belongs to no package"


def test_hpa_metric_and_keda_query_measure_the_same_thing() -> None:
    assert used_names()["keda"] == used_names()["prometheus-adapter"]


@pytest.mark.parametrize("prefix", sorted(PREFIX_MODULES))
def test_used_metric_names_exist_in_the_registry(prefix: str) -> None:
    modules = PREFIX_MODULES[prefix]
    names, loaded = registry_names(modules)
    if not loaded:
        pytest.skip(f"none of {', '.join(modules)} has landed yet: {prefix}* names unchecked")
    missing = {
        f"{consumer}: {n}"
        for consumer, used in used_names().items()
        for n in used
        if n.startswith(prefix) and n not in names
    }
    assert not missing, f"not defined by {loaded}: {sorted(missing)}"


def test_dashboard_covers_the_issue_panels() -> None:
    dashboard = json.loads((DEPLOY / "monitoring" / "dashboards" / "teamrl.json").read_text())
    titles = " | ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in (
        "reward",
        "throughput per agent",
        "version lag",
        "buffer size",
        "rejected frames",
        "step time",
        "stale drops",
        "evictions",
    ):
        assert topic in titles, f"no dashboard panel about {topic}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]


def test_registry_names_follow_the_exposition_format() -> None:
    # The check above is only as good as this mapping: a Counter is queried with _total.
    names, loaded = registry_names(("teamrl.protocol.metrics",))
    assert loaded == ["teamrl.protocol.metrics"]
    assert "teamrl_protocol_rejected_frames_total" in names
    assert "teamrl_protocol_rejected_frames" not in names


def test_promtool_accepts_every_teamrl_family() -> None:
    """Prometheus's own linter (``promtool check metrics``: names, units, help, types) on every
    ``teamrl_*`` family the packages define; the live run's pages are checked the same way in
    tests/integration/test_prometheus_live.py."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("no promtool (Debian package prometheus; scripts/setup.sh installs it where apt works)")
    from prometheus_client import REGISTRY, generate_latest

    modules = {m for mods in PREFIX_MODULES.values() for m in mods}
    _names, loaded = registry_names(
        tuple(sorted(modules | {"teamrl.rewards.profiles", "teamrl.rewards.credit"}))
    )
    assert "teamrl.protocol.metrics" in loaded
    page = generate_latest(REGISTRY).decode()
    keep = [
        line
        for line in page.splitlines()
        if (line.split()[2] if line.startswith("# ") else line).startswith("teamrl_")
    ]
    assert sum(line.startswith("# TYPE ") for line in keep) >= 20, keep
    res = subprocess.run(
        [promtool, "check", "metrics"], input="\n".join(keep) + "\n", capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
