"""The shipped cluster config (deploy/config/teamrl.toml) is valid and the manifests use its ports.

Design: ``[ports]`` and ``[endpoints]`` of the shipped TOML are the one source of truth for the
wiring. Every number in the manifests (container ports, Service ports, NetworkPolicy ports,
flags, env) and the Dockerfile's EXPOSE must come from it, and each service's own config model
must accept its section of it (so a pod does not crash-loop on its config). Service models and
CLIs that have not landed yet are skipped one by one; the port checks never skip.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import CONFIG_FILE, ROOT

Doc = dict[str, Any]
# Which [ports] key each named container port of each workload must equal.
PORT_NAMES = {
    "buffer": {"ingest": "buffer_ingest", "sample": "buffer_sample", "metrics": "buffer_metrics"},
    "rollout": {"metrics": "rollout_metrics"},
    "learner": {
        "publish": "learner_publish",
        "latest": "learner_latest",
        "rendezvous": "learner_rendezvous",
        "metrics": "learner_metrics",
    },
}
# Flags whose value is an endpoint the service binds (port must match) or dials ([endpoints]).
BIND_FLAGS = {"--bind": "buffer_ingest", "--sample-bind": "buffer_sample", "--publish": "learner_publish"}
# Ports a service binds without a flag of their own (derived from another flag's port).
DERIVED_BINDS = {"--publish": "learner_latest"}
DIAL_FLAGS = {
    ("rollout", "--buffer"): "buffer_ingest",
    ("rollout", "--weights"): "learner_publish",
    ("learner", "--buffer"): "buffer_sample",
}
SERVICE_MODULES = {
    "buffer": "teamrl.learner.buffer_service",
    "rollout": "teamrl.rollout.cli",
    "learner": "teamrl.learner.service",
}


def _workloads(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}


def _container(w: Doc) -> Doc:
    (c,) = w["spec"]["template"]["spec"]["containers"]
    return c


def _flags(args: list[str]) -> dict[str, str]:
    return {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}


def _values(args: list[str], flag: str) -> list[str]:
    """Every value of a repeatable flag (``--weights MODEL_ID=EP`` once per base model)."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def _role(name: str, w: Doc) -> str:
    """The service a workload runs (a key of PORT_NAMES): the base's three are named after theirs;
    any other workload must be a further learner group of a team of different models
    (docs/teams.md): `teamrl learner --group MODEL_ID` in its own StatefulSet."""
    if name in PORT_NAMES:
        return name
    args = _container(w)["args"]
    assert w["kind"] == "StatefulSet" and args[0] == "learner" and "--group" in args, f"{name}: {args[:1]}"
    return "learner"


def _learner_groups(workloads: dict[str, Doc]) -> dict[str, Doc]:
    """The learner StatefulSets that run a learner group, by their ``--group`` model id."""
    out = {}
    for name, w in workloads.items():
        flags = _flags(_container(w)["args"])
        if _role(name, w) == "learner" and "--group" in flags:
            out[flags["--group"]] = w
    return out


def _port_of(endpoint: str) -> int:
    port = urlsplit(endpoint).port
    assert port is not None, f"endpoint {endpoint!r} has no port"
    return port


# --- the config itself ------------------------------------------------------------------------


def test_ports_are_distinct_valid_integers(shipped_config: Doc) -> None:
    ports = shipped_config["ports"]
    assert set(ports) == {k for names in PORT_NAMES.values() for k in names.values()}
    assert all(isinstance(p, int) and 1024 <= p <= 65535 for p in ports.values()), ports
    assert len(set(ports.values())) == len(ports), "two services share a port"


def test_endpoints_agree_with_ports(shipped_config: Doc) -> None:
    ports, ends = shipped_config["ports"], shipped_config["endpoints"]
    for key in ("buffer_ingest", "buffer_sample", "learner_publish", "learner_latest"):
        assert _port_of(ends[key]) == ports[key], key
    # Rollouts dial rank 0 of the learner StatefulSet through its headless Service.
    assert urlsplit(ends["learner_publish"]).hostname == ends["learner_master"]


def test_latest_port_is_the_one_the_code_derives(shipped_config: Doc) -> None:
    """One flag names both weights sockets: the "latest" RPC is always the PUB port + 1."""
    from teamrl.protocol.zmq_transport import latest_endpoint_for

    ends = shipped_config["endpoints"]
    assert latest_endpoint_for(ends["learner_publish"]) == ends["learner_latest"]
    assert shipped_config["ports"]["learner_latest"] == shipped_config["ports"]["learner_publish"] + 1


def test_buffer_section_is_accepted_by_the_buffer(shipped_config: Doc) -> None:
    mod = pytest.importorskip("teamrl.learner.buffer_config")
    cfg = mod.load_buffer_config(CONFIG_FILE)
    ports = shipped_config["ports"]
    assert _port_of(cfg.bind) == ports["buffer_ingest"]
    assert _port_of(cfg.sample_bind) == ports["buffer_sample"]
    assert cfg.metrics_port == ports["buffer_metrics"]
    # Probes and Prometheus connect to the pod IP: a loopback-only metrics server fails them all.
    assert cfg.metrics_host == "0.0.0.0"
    assert str(cfg.dir) == shipped_config["paths"]["buffer_dir"]


def test_learner_section_is_accepted_by_the_learner() -> None:
    mod = pytest.importorskip("teamrl.learner.config")
    cfg = mod.load_learner_config(CONFIG_FILE)
    assert cfg.adapters


def test_rollout_section_is_accepted_by_the_rollout(shipped_config: Doc) -> None:
    mod = pytest.importorskip("teamrl.rollout.config")
    cfg = mod.load_config(str(CONFIG_FILE), [])
    assert cfg.model_dump(include=set(shipped_config["rollout"])) == shipped_config["rollout"]
    # Deployment pods take their replica index from POD_NAME, not from the shared file.
    assert cfg.replica == -1


def test_transport_section_turns_curve_on_with_the_mounted_secret(
    shipped_config: Doc, overlay_docs: dict[str, list[Doc]]
) -> None:
    """Every service reads [transport] from the same file: CURVE on, keys from the teamrl-curve
    Secret at the path every workload mounts it (read-only)."""
    mod = pytest.importorskip("teamrl.protocol.config")
    transport = mod.TransportConfig.model_validate(shipped_config["transport"])
    assert transport.curve is True and transport.curve_dir is not None
    for docs in overlay_docs.values():
        for name, w in _workloads(docs).items():
            c = _container(w)
            vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            m = mounts[str(transport.curve_dir)]
            assert vols[m["name"]]["secret"]["secretName"] == "teamrl-curve", name
            assert m.get("readOnly") is True, name
            assert _flags(c["args"])["--config"] == "/etc/teamrl/teamrl.toml", name


def test_sections_agree_on_groups_and_drain(shipped_config: Doc, overlay_docs: dict[str, list[Doc]]) -> None:
    """Values that must match across services (each service reads only its own table)."""
    from teamrl.learner.buffer_config import load_buffer_config
    from teamrl.learner.config import load_learner_config
    from teamrl.rollout.config import load_config

    buf, lrn = load_buffer_config(CONFIG_FILE), load_learner_config(CONFIG_FILE)
    rol = load_config(str(CONFIG_FILE), [])
    # The buffer releases a group only when group_size episodes of it arrived; rollouts send
    # whole groups of their group_size. A mismatch holds groups forever or splits them.
    assert buf.group_size == rol.group_size
    assert lrn.batch_size % rol.group_size == 0
    assert buf.min_size >= lrn.batch_size
    assert rol.max_lora_rank >= lrn.lora.rank
    for name, docs in overlay_docs.items():
        grace = _workloads(docs)["rollout"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert rol.drain_timeout_s + rol.flush_timeout_s < grace, name


def test_metrics_servers_listen_on_the_pod_ip(overlay_docs: dict[str, list[Doc]]) -> None:
    """Probes and Prometheus dial the pod IP: a metrics server bound to loopback fails them all."""
    for name, docs in overlay_docs.items():
        for wname, w in _workloads(docs).items():
            flags = _flags(_container(w)["args"])
            if wname == "buffer":
                continue  # [buffer] metrics_host, checked in test_buffer_section_is_accepted_by_the_buffer
            assert flags.get("--metrics-host") == "0.0.0.0", f"{name}: {wname}"


# --- the manifests use exactly those ports ----------------------------------------------------


def test_container_ports_equal_config_ports(overlay_docs: dict[str, list[Doc]], shipped_config: Doc) -> None:
    ports = shipped_config["ports"]
    for name, docs in overlay_docs.items():
        workloads = _workloads(docs)
        assert set(PORT_NAMES) <= set(workloads), name
        for wname, w in workloads.items():
            names = PORT_NAMES[_role(wname, w)]
            declared = {p["name"]: p["containerPort"] for p in _container(w)["ports"]}
            assert declared == {n: ports[k] for n, k in names.items()}, f"{name}: {wname}"


def test_service_ports_equal_config_ports(overlay_docs: dict[str, list[Doc]], shipped_config: Doc) -> None:
    ports = shipped_config["ports"]
    for docs in overlay_docs.values():
        workloads = _workloads(docs)
        for svc in (d for d in docs if d["kind"] == "Service"):
            target = svc["spec"]["selector"]["app.kubernetes.io/name"]
            names = PORT_NAMES[_role(target, workloads[target])]
            for p in svc["spec"]["ports"]:
                assert p["targetPort"] in names, f"Service {svc['metadata']['name']}: {p}"
                assert p["port"] == ports[names[p["targetPort"]]], f"Service {svc['metadata']['name']}: {p}"
            assert workloads[target]


def test_flags_use_config_ports_and_endpoints(
    overlay_docs: dict[str, list[Doc]], shipped_config: Doc
) -> None:
    ports, ends, paths = shipped_config["ports"], shipped_config["endpoints"], shipped_config["paths"]
    from teamrl.rollout.config import parse_weights_flags

    for name, docs in overlay_docs.items():
        workloads = _workloads(docs)
        for wname, w in workloads.items():
            args = _container(w)["args"]
            role = _role(wname, w)
            assert args[0] == role, f"{name}: {wname} runs `teamrl {args[0]}`"
            flags = _flags(args)
            assert int(flags["--metrics-port"]) == ports[f"{role}_metrics"], f"{name}: {wname}"
            for flag, key in BIND_FLAGS.items():
                if flag in flags and (role, flag) not in DIAL_FLAGS:
                    assert _port_of(flags[flag]) == ports[key], f"{name}: {wname} {flag}"
                    if flag in DERIVED_BINDS:
                        from teamrl.protocol.zmq_transport import latest_endpoint_for

                        derived = _port_of(latest_endpoint_for(flags[flag]))
                        assert derived == ports[DERIVED_BINDS[flag]], f"{name}: {wname} {flag}"
            for (svc, flag), key in DIAL_FLAGS.items():
                if svc != role:
                    continue
                plain, keyed = parse_weights_flags(_values(args, flag)) if flag == "--weights" else (None, {})
                if not keyed:
                    assert flags[flag] == ends[key], f"{name}: {wname} {flag}"
                    continue
                # Several base models: one MODEL_ID=EP per learner group, each its own rank 0 pod
                # (`learner` is the one [endpoints] names) on the config's publish port.
                groups = _learner_groups(workloads)
                assert plain is None and set(keyed) == set(groups), f"{name}: {wname} {flag} {keyed}"
                for group, sts in groups.items():
                    rank0 = f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
                    assert keyed[group] == f"tcp://{rank0}:{ports[key]}", f"{name}: {wname} {flag} {group}"
                assert ends[key] in keyed.values(), f"{name}: {wname} {flag}"
            if "--dir" in flags:
                assert flags["--dir"] == paths["buffer_dir"]
            if "--run-dir" in flags:
                # A learner group of a team of different models writes below RUN/groups/<model id>.
                group = f"/groups/{flags['--group']}" if "--group" in flags else ""
                assert flags["--run-dir"] == paths["run_dir"] + group, f"{name}: {wname}"


def test_network_policies_open_only_config_ports(
    overlay_docs: dict[str, list[Doc]], shipped_config: Doc
) -> None:
    allowed = set(shipped_config["ports"].values()) | {53}  # 53: DNS egress to kube-dns
    for name, docs in overlay_docs.items():
        workloads = _workloads(docs)
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        for np in policies:
            for rule in np["spec"].get("ingress", []) + np["spec"].get("egress", []):
                for p in rule.get("ports", []):
                    assert p["port"] in allowed, f"{name}: {np['metadata']['name']} opens {p['port']}"
        # Every listening port is reachable by some ingress rule of its pod's policy.
        for wname, w in workloads.items():
            names = PORT_NAMES[_role(wname, w)]
            labels = w["spec"]["template"]["metadata"]["labels"]
            rules = [
                r
                for np in policies
                if np["spec"]["podSelector"].get("matchLabels")
                and all(labels.get(k) == v for k, v in np["spec"]["podSelector"]["matchLabels"].items())
                for r in np["spec"].get("ingress", [])
            ]
            for key in names.values():
                port = shipped_config["ports"][key]
                ok = any(not r.get("ports") or port in {p["port"] for p in r["ports"]} for r in rules)
                assert ok, f"{name}: nothing may reach {wname}:{port} ({key})"


def test_dockerfile_exposes_the_config_ports(shipped_config: Doc) -> None:
    text = (ROOT / "Dockerfile").read_text()
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    assert exposed == set(shipped_config["ports"].values())


# --- the services accept the flags the manifests pass -----------------------------------------


@pytest.mark.parametrize("service", sorted(SERVICE_MODULES))
def test_service_cli_accepts_manifest_flags(service: str, overlay_docs: dict[str, list[Doc]]) -> None:
    module = SERVICE_MODULES[service]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} has not landed yet")
    res = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", service, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(ROOT),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    for name, docs in overlay_docs.items():
        for wname, w in _workloads(docs).items():
            if _role(wname, w) != service:
                continue
            for flag in _flags(_container(w)["args"]):
                assert re.search(rf"{re.escape(flag)}\b", res.stdout), (
                    f"{name}: `teamrl {service}` has no {flag}"
                )
