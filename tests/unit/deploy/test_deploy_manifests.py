"""Every rendered manifest is schema-valid, lint-clean, and agrees with itself and with the config.

Design: schema validation (``kubernetes-validate --strict``, offline) catches typos and missing
required fields, but not what breaks a deployment at run time: a probe that is missing, a
selector that selects nothing, a PDB with both bounds (it passes the schema), an autoscaler that
flaps, a port that differs from the one the service binds. Those are checked here on the
rendered overlays (docs/reliability.md R-manifests). CRDs (KEDA, Prometheus operator) have no schema in
kubernetes-validate, so their required fields are checked by hand.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import DEPLOY, OVERLAYS, ROOT, TREES, render_tree

Doc = dict[str, Any]
WORKLOADS = ("Deployment", "StatefulSet")
BIN = Path(sys.executable).parent


def _by_kind(docs: list[Doc], *kinds: str) -> list[Doc]:
    return [d for d in docs if d["kind"] in kinds]


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(docs: list[Doc]) -> list[dict[str, str]]:
    return [w["spec"]["template"]["metadata"].get("labels", {}) for w in _by_kind(docs, *WORKLOADS)]


def _containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    return [(w, c) for w in _by_kind(docs, *WORKLOADS) for c in w["spec"]["template"]["spec"]["containers"]]


# --- rendering and schema -------------------------------------------------------------------


def test_all_overlays_render(rendered: dict[str, list[Doc]]) -> None:
    assert {"cpu-dev", "gpu"} <= set(OVERLAYS)
    for tree, docs in rendered.items():
        assert docs, f"{tree} rendered nothing"
        keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
        assert len(keys) == len(set(keys)), f"{tree}: duplicate objects"


@pytest.mark.parametrize("tree", TREES)
def test_kubernetes_validate_strict(tree: str, rendered: dict[str, list[Doc]], tmp_path: Path) -> None:
    exe = BIN / "kubernetes-validate"
    if not exe.exists():
        pytest.skip("kubernetes-validate is not installed in this venv (pip install '.[dev]')")
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(rendered[tree], sort_keys=False))
    res = subprocess.run([str(exe), "--strict", str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    passed = res.stdout.count(" passed for resource ")
    crds = [d for d in rendered[tree] if d["apiVersion"].split("/")[0].endswith((".sh", ".com"))]
    # Every non-CRD object was validated against a schema, not skipped.
    assert passed == len(rendered[tree]) - len(crds), res.stdout


def test_yamllint_clean() -> None:
    exe = BIN / "yamllint"
    if not exe.exists():
        pytest.skip("yamllint is not installed in this venv (pip install '.[dev]')")
    res = subprocess.run(
        [str(exe), "--strict", "-c", str(DEPLOY / ".yamllint.yaml"), str(DEPLOY)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_custom_resources_have_required_fields(overlay_docs: dict[str, list[Doc]]) -> None:
    # kubernetes-validate has no schema for these CRDs and only warns; the fields each operator
    # refuses to work without are checked here.
    for name, docs in overlay_docs.items():
        for sm in _by_kind(docs, "ServiceMonitor"):
            assert sm["apiVersion"] == "monitoring.coreos.com/v1"
            assert sm["spec"]["selector"]["matchLabels"] and sm["spec"]["endpoints"], name
        for pm in _by_kind(docs, "PodMonitor"):
            assert pm["apiVersion"] == "monitoring.coreos.com/v1"
            assert pm["spec"]["selector"]["matchLabels"] and pm["spec"]["podMetricsEndpoints"], name
        for so in _by_kind(docs, "ScaledObject"):
            assert so["apiVersion"] == "keda.sh/v1alpha1"
            assert so["spec"]["scaleTargetRef"]["name"] and so["spec"]["triggers"], name


# --- probes, selectors, disruption budgets, autoscaling ---------------------------------------


def test_every_workload_has_all_three_probes(overlay_docs: dict[str, list[Doc]]) -> None:
    for name, docs in overlay_docs.items():
        for w, c in _containers(docs):
            missing = {"startupProbe", "readinessProbe", "livenessProbe"} - set(c)
            assert not missing, f"{name}: {w['kind']}/{w['metadata']['name']} lacks {sorted(missing)}"


def test_rollout_probes_use_health_endpoints_and_drain(overlay_docs: dict[str, list[Doc]]) -> None:
    for docs in overlay_docs.values():
        dep = _one(docs, "Deployment", "rollout")
        pod = dep["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert "preStop" in c["lifecycle"]
        # Long enough to finish an episode and get the buffer's acks (the preStop counts against it).
        assert pod["terminationGracePeriodSeconds"] >= 120
        # A rolling update never takes capacity below the replica count.
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_named_probe_ports_exist(overlay_docs: dict[str, list[Doc]]) -> None:
    for docs in overlay_docs.values():
        for w, c in _containers(docs):
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                handler = c[probe].get("httpGet") or c[probe].get("tcpSocket")
                port = handler["port"]
                assert isinstance(port, int) or port in names, f"{w['metadata']['name']}.{probe}: {port}"


def test_every_container_has_requests_and_limits(overlay_docs: dict[str, list[Doc]]) -> None:
    for name, docs in overlay_docs.items():
        for w, c in _containers(docs):
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(part, {})), f"{name}: {w['metadata']['name']} {part}"


def test_workload_selectors_match_their_pod_labels(overlay_docs: dict[str, list[Doc]]) -> None:
    for docs in overlay_docs.values():
        for w in _by_kind(docs, *WORKLOADS):
            sel = w["spec"]["selector"]["matchLabels"]
            assert _selects(sel, w["spec"]["template"]["metadata"]["labels"]), w["metadata"]["name"]


def test_every_selector_selects_a_pod(overlay_docs: dict[str, list[Doc]]) -> None:
    for name, docs in overlay_docs.items():
        pods = _pod_labels(docs)
        for d in _by_kind(docs, "Service"):
            assert any(_selects(d["spec"]["selector"], p) for p in pods), f"{name}: Service {d['metadata']}"
        for d in _by_kind(docs, "PodDisruptionBudget", "PodMonitor"):
            sel = d["spec"]["selector"]["matchLabels"]
            assert any(_selects(sel, p) for p in pods), f"{name}: {d['kind']}/{d['metadata']['name']}"
        for d in _by_kind(docs, "NetworkPolicy"):
            sel = d["spec"]["podSelector"].get("matchLabels", {})
            # {} selects every pod of the namespace (default deny, DNS); otherwise it must hit one.
            assert not sel or any(_selects(sel, p) for p in pods), f"{name}: NetworkPolicy {d['metadata']}"
            for rule in d["spec"].get("ingress", []) + d["spec"].get("egress", []):
                for peer in rule.get("from", []) + rule.get("to", []):
                    if "podSelector" in peer and "namespaceSelector" not in peer:
                        psel = peer["podSelector"]["matchLabels"]
                        assert any(_selects(psel, p) for p in pods), f"{name}: peer {psel}"
        services = _by_kind(docs, "Service")
        for d in _by_kind(docs, "ServiceMonitor"):
            sel = d["spec"]["selector"]["matchLabels"]
            hits = [s for s in services if _selects(sel, s["metadata"].get("labels", {}))]
            # Exactly one Service, or every pod is scraped once per matching Service.
            assert len(hits) == 1, f"{name}: ServiceMonitor {d['metadata']['name']} selects {len(hits)}"
            ports = {p["name"] for p in hits[0]["spec"]["ports"]}
            assert {e["port"] for e in d["spec"]["endpoints"]} <= ports


def test_pod_monitors_scrape_a_declared_port(overlay_docs: dict[str, list[Doc]]) -> None:
    for docs in overlay_docs.values():
        for pm in _by_kind(docs, "PodMonitor"):
            sel = pm["spec"]["selector"]["matchLabels"]
            for w, c in _containers(docs):
                if _selects(sel, w["spec"]["template"]["metadata"]["labels"]):
                    names = {p["name"] for p in c["ports"]}
                    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= names


def test_statefulsets_name_a_headless_service(overlay_docs: dict[str, list[Doc]]) -> None:
    for docs in overlay_docs.values():
        for sts in _by_kind(docs, "StatefulSet"):
            svc = _one(docs, "Service", sts["spec"]["serviceName"])
            assert svc["spec"].get("clusterIP") == "None", sts["metadata"]["name"]


def test_each_pdb_sets_exactly_one_bound(overlay_docs: dict[str, list[Doc]]) -> None:
    for name, docs in overlay_docs.items():
        pdbs = _by_kind(docs, "PodDisruptionBudget")
        assert pdbs, f"{name}: no PodDisruptionBudget"
        for pdb in pdbs:
            bounds = {"minAvailable", "maxUnavailable"} & set(pdb["spec"])
            assert len(bounds) == 1, f"{name}: PDB {pdb['metadata']['name']} sets {sorted(bounds)}"


def test_autoscalers_scale_down_slowly_and_one_per_target(overlay_docs: dict[str, list[Doc]]) -> None:
    for name, docs in overlay_docs.items():
        hpas = _by_kind(docs, "HorizontalPodAutoscaler")
        keda = _by_kind(docs, "ScaledObject")
        # KEDA makes its own HPA: a second one on the same Deployment would fight it.
        assert len(hpas) + len(keda) == 1, f"{name}: {len(hpas)} HPA + {len(keda)} ScaledObject"
        for hpa in hpas:
            assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
            _one(docs, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
            assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for so in keda:
            behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
            assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300
            assert so["spec"].get("cooldownPeriod", 300) >= 300
            _one(docs, "Deployment", so["spec"]["scaleTargetRef"]["name"])


def test_keda_and_hpa_scale_the_same_way() -> None:
    hpa = _one(render_tree("overlays/gpu"), "HorizontalPodAutoscaler", "rollout")["spec"]
    so = _one(render_tree("overlays/gpu-keda"), "ScaledObject", "rollout")["spec"]
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
    assert so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
    (trigger,) = so["triggers"]
    target = hpa["metrics"][0]["external"]["target"]["value"]
    assert float(trigger["metadata"]["threshold"]) == pytest.approx(int(target.rstrip("m")) / 1000)


def test_keda_triggers_carry_server_query_threshold(overlay_docs: dict[str, list[Doc]]) -> None:
    seen = 0
    for docs in overlay_docs.values():
        for so in _by_kind(docs, "ScaledObject"):
            for trig in so["spec"]["triggers"]:
                assert trig["type"] == "prometheus"
                meta = trig["metadata"]
                assert meta["serverAddress"].startswith("http")
                assert "teamrl_" in meta["query"]
                assert float(meta["threshold"]) > 0
                seen += 1
    assert seen, "no overlay uses the KEDA component"


# --- storage, rendezvous, config --------------------------------------------------------------


def test_learner_rendezvous_and_world_size(overlay_docs: dict[str, list[Doc]], shipped_config: Doc) -> None:
    for name, docs in overlay_docs.items():
        sts = _one(docs, "StatefulSet", "learner")
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in c["env"]}
        assert int(env["WORLD_SIZE"]["value"]) == sts["spec"]["replicas"], name
        assert env["MASTER_ADDR"]["value"] == shipped_config["endpoints"]["learner_master"]
        assert int(env["MASTER_PORT"]["value"]) == shipped_config["ports"]["learner_rendezvous"]
        assert "pod-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        # Ranks rendezvous before any is Ready, and all start together.
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert _one(docs, "Service", "learner")["spec"]["publishNotReadyAddresses"] is True


def test_storage(overlay_docs: dict[str, list[Doc]], shipped_config: Doc) -> None:
    run_dir = shipped_config["paths"]["run_dir"]
    for docs in overlay_docs.values():
        shared = _one(docs, "PersistentVolumeClaim", "teamrl-shared")
        assert shared["spec"]["accessModes"] == ["ReadWriteMany"]
        buffer = _one(docs, "StatefulSet", "buffer")
        assert buffer["spec"]["replicas"] == 1
        (claim,) = buffer["spec"]["volumeClaimTemplates"]
        (c,) = buffer["spec"]["template"]["spec"]["containers"]
        mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}[claim["metadata"]["name"]]
        assert shipped_config["paths"]["buffer_dir"].startswith(mount + "/")
        learner = _one(docs, "StatefulSet", "learner")
        pod = learner["spec"]["template"]["spec"]
        vol = {v["name"]: v for v in pod["volumes"]}
        (lc,) = pod["containers"]
        shared_mounts = [
            m
            for m in lc["volumeMounts"]
            if vol[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == "teamrl-shared"
        ]
        assert len(shared_mounts) == 1 and run_dir.startswith(shared_mounts[0]["mountPath"] + "/")
        assert not shared_mounts[0].get("readOnly", False)


def test_config_map_is_the_shipped_toml_and_every_pod_mounts_it(overlay_docs: dict[str, list[Doc]]) -> None:
    shipped = (DEPLOY / "config" / "teamrl.toml").read_text()
    for name, docs in overlay_docs.items():
        # An overlay with a teamrl.toml of its own replaces the shipped one (hetero: two bases).
        own = DEPLOY / "overlays" / name / "teamrl.toml"
        toml_text = own.read_text() if own.is_file() else shipped
        (cm,) = [d for d in _by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("teamrl-config")]
        assert cm["data"] == {"teamrl.toml": toml_text}, name
        for w, c in _containers(docs):
            pod = w["spec"]["template"]["spec"]
            vols = {v["name"]: v for v in pod["volumes"]}
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            config_arg = c["args"][c["args"].index("--config") + 1]
            vol = vols[mounts[str(Path(config_arg).parent)]]
            assert vol["configMap"]["name"] == cm["metadata"]["name"], f"{name}: {w['metadata']['name']}"


def test_curve_secret_is_mounted_not_shipped(overlay_docs: dict[str, list[Doc]]) -> None:
    for docs in overlay_docs.values():
        secret = _one(docs, "Secret", "teamrl-curve")
        assert not secret.get("data"), "real CURVE keys must never be committed"
        for w, _c in _containers(docs):
            vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
            assert vols["curve"]["secret"]["secretName"] == "teamrl-curve"


def test_pods_run_unprivileged(overlay_docs: dict[str, list[Doc]]) -> None:
    for docs in overlay_docs.values():
        for w, c in _containers(docs):
            pod = w["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["automountServiceAccountToken"] is False
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_overlays_set_their_image(overlay_docs: dict[str, list[Doc]]) -> None:
    for name, docs in overlay_docs.items():
        images = {c["image"] for _w, c in _containers(docs)}
        variant = "gpu" if name.startswith("gpu") else "cpu"
        assert len(images) == 1 and next(iter(images)).endswith(f"-{variant}"), f"{name}: {images}"
    # vLLM and DeepSpeed get a GPU each; the buffer is CPU-only.
    for w, c in _containers(render_tree("overlays/gpu")):
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        assert gpus == (None if w["metadata"]["name"] == "buffer" else "1"), w["metadata"]["name"]


def test_yamllint_config_exists_and_repo_root_is_right() -> None:
    # Guards the paths the other tests rely on (a moved tree would make them vacuous).
    assert (DEPLOY / ".yamllint.yaml").is_file()
    assert (ROOT / "pyproject.toml").is_file() and (DEPLOY / "base" / "kustomization.yaml").is_file()


def test_readme_states_the_autoscalers_settings() -> None:
    """The README's Deploy section quotes the HPA; a changed manifest must change the README too."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Deploy (Kubernetes)") :]
    hpa = _one(render_tree("overlays/gpu"), "HorizontalPodAutoscaler", "rollout")["spec"]
    down = hpa["behavior"]["scaleDown"]
    (policy,) = down["policies"]
    m = re.search(
        r"Scale-down waits (\d+) s \(stabilisation window; then\s+at most one pod per (\d+) s\)", section
    )
    assert m, "README no longer says how slowly rollouts scale down"
    assert int(m.group(1)) == down["stabilizationWindowSeconds"]
    assert (policy["type"], policy["value"], int(m.group(2))) == ("Pods", 1, policy["periodSeconds"])
    target = int(hpa["metrics"][0]["external"]["target"]["value"].rstrip("m")) / 1000
    assert f"target {target:g})" in section
