"""The hetero overlay deploys a team of different models: one learner group per base model.

Design: the addition-duo-hetero workflow puts the solver on ``embedded-v1`` and the verifier on
``embedded-llama``; a team of different models is trained by one learner group per base
(docs/teams.md). In the cluster each group is its own StatefulSet with its own
rendezvous, publish endpoint and run folder, started as ``teamrl learner --group <model id>``, and
every rollout follows every group (``--weights <model id>=<rank 0>:<publish port>``). What breaks
at run time, and is checked here on the rendered overlay: a ``--group`` the config has no table for,
a group table that does not validate once merged over ``[learner]`` (read as the learner reads
it, from the ConfigMap the pods mount), a rollout dialling the wrong pod or port, a group whose
ranks rendezvous with another group's, a model folder the init containers do not build, a second
group that the NetworkPolicies or Prometheus do not reach. The checks the other deploy tests make on
every overlay (ports, probes, schema, lint) cover this overlay too.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from conftest import CONFIG_FILE, DEPLOY, ROOT, render_tree

Doc = dict[str, Any]
OVERLAY = "overlays/hetero"
OVERLAY_TOML = DEPLOY / OVERLAY / "teamrl.toml"
WORKFLOW = "addition-duo-hetero"


def _docs() -> list[Doc]:
    return render_tree(OVERLAY)


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _container(w: Doc) -> Doc:
    (c,) = w["spec"]["template"]["spec"]["containers"]
    return c


def _env(c: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in c.get("env", [])}


def _values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def _flag(args: list[str], flag: str) -> str:
    (value,) = _values(args, flag)
    return value


def _learner_groups(docs: list[Doc]) -> dict[str, Doc]:
    """The learner StatefulSets, by the model id of their ``--group``."""
    out: dict[str, Doc] = {}
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        args = _container(sts)["args"]
        if args[0] == "learner":
            group = _flag(args, "--group")
            assert group not in out, f"two learner StatefulSets run group {group}"
            out[group] = sts
    return out


def _rank0(sts: Doc) -> str:
    """The DNS name of a StatefulSet's rank 0 through its headless Service."""
    return f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The teamrl.toml the overlay's pods mount (its rendered ConfigMap), written to a file."""
    (cm,) = [
        d for d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("teamrl-config")
    ]
    path = tmp_path_factory.mktemp("hetero") / "teamrl.toml"
    path.write_text(cm["data"]["teamrl.toml"])
    return path


@pytest.fixture(scope="module")
def config(config_file: Path) -> Doc:
    return tomllib.loads(config_file.read_text())


# --- the overlay and its config -----------------------------------------------------------------


def test_hetero_overlay_renders_two_learner_groups(config: Doc) -> None:
    docs = _docs()
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "duplicate objects"
    groups = _learner_groups(docs)
    assert set(groups) == set(config["groups"]) == {"embedded-v1", "embedded-llama"}
    # The base's learner is the first base's group; the second has a StatefulSet of its own.
    assert groups["embedded-v1"]["metadata"]["name"] == "learner"
    assert groups["embedded-llama"]["metadata"]["name"] == "learner-llama"
    # The ConfigMap the pods mount is the overlay's own teamrl.toml, not deploy/config's.
    assert tomllib.loads(OVERLAY_TOML.read_text()) == config


def test_wiring_tables_are_the_shipped_ones(config: Doc) -> None:
    """Ports, endpoints, paths and CURVE are the cluster's, whatever team runs on it; [buffer] differs
    only in min_size, raised to the learner's batch so a sample request can be served."""
    shipped = tomllib.loads(CONFIG_FILE.read_text())
    for table in ("ports", "endpoints", "paths", "transport"):
        assert config[table] == shipped[table], table
    assert {k: v for k, v in config["buffer"].items() if k != "min_size"} == {
        k: v for k, v in shipped["buffer"].items() if k != "min_size"
    }


def test_each_group_table_validates_as_the_learner_merges_it(config_file: Path, config: Doc) -> None:
    from teamrl.learner.config import load_learner_config

    docs = _docs()
    run_dir = config["paths"]["run_dir"]
    for group, sts in _learner_groups(docs).items():
        # What `teamrl learner --config FILE --group <id>` reads: [groups.<id>] over [learner].
        cfg = load_learner_config(config_file, group=group)
        table = config["groups"][group]
        assert cfg.group == group
        assert cfg.group_agents == table["group_agents"] and cfg.group_agents
        assert cfg.adapters == table["adapters"] and cfg.adapters
        assert cfg.base_model == table["base_model"]
        assert cfg.batch_size == config["learner"]["batch_size"]  # the shared table is under it
        args = _container(sts)["args"]
        assert _flag(args, "--config") == "/etc/teamrl/teamrl.toml"
        assert _flag(args, "--run-dir") == f"{run_dir}/groups/{group}", sts["metadata"]["name"]
    # The groups train disjoint agents and adapters.
    agents = [a for t in config["groups"].values() for a in t["group_agents"]]
    adapters = [a for t in config["groups"].values() for a in t["adapters"]]
    assert len(agents) == len(set(agents)) and len(adapters) == len(set(adapters))


def test_rollout_table_validates_and_serves_every_group(config_file: Path, config: Doc) -> None:
    from teamrl.learner.config import load_learner_config
    from teamrl.rollout.config import RolloutConfig, load_config

    rol = load_config(str(config_file), [])
    assert isinstance(rol, RolloutConfig)
    assert RolloutConfig.model_validate(config["rollout"]) == rol
    assert rol.workflow == WORKFLOW and rol.replica == -1  # Deployment pods: the index from POD_NAME
    assert set(rol.models) == set(config["groups"])
    for group, model in rol.models.items():
        lrn = load_learner_config(config_file, group=group)
        # The rollout's engine for this base loads the folder the group trains on, accepts its
        # adapters' ranks and targets, and takes the endpoint from the flag (one place for it).
        assert model.path == lrn.base_model, group
        ranks = [lrn.agents[a].rank or lrn.lora.rank for a in lrn.adapters if a in lrn.agents]
        assert model.max_lora_rank >= max([lrn.lora.rank, *ranks]), group
        assert model.lora_target_modules == lrn.lora.target_modules, group
        assert model.weights == "", group


def test_sections_agree_on_groups_and_drain(config_file: Path, config: Doc) -> None:
    """As test_deploy_config checks for the shipped config, per learner group."""
    from teamrl.learner.buffer_config import load_buffer_config
    from teamrl.learner.config import load_learner_config
    from teamrl.rollout.config import load_config

    buf, rol = load_buffer_config(config_file), load_config(str(config_file), [])
    assert buf.group_size == rol.group_size
    for group in config["groups"]:
        lrn = load_learner_config(config_file, group=group)
        assert lrn.batch_size % rol.group_size == 0, group
        assert buf.min_size >= lrn.batch_size, group
    rollout = _one(_docs(), "Deployment", "rollout")
    assert (
        rol.drain_timeout_s + rol.flush_timeout_s
        < rollout["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )


@pytest.mark.slow
@pytest.mark.usefixtures("embedded_model", "embedded_llama_model")
def test_tables_are_what_workflow_plan_prints(config: Doc) -> None:
    """[learner], [groups] and [rollout] are `teamrl workflow plan addition-duo-hetero`'s, model
    folders moved to the pods' cache. The plan reads the built models (tokenizers, weight names),
    which the fixtures build where they are not yet (in any order of the suite)."""
    from teamrl.rewards.addition import embedded_model_dir

    res = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", "workflow", "plan", WORKFLOW],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    local = str(embedded_model_dir().parent)

    def moved(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: moved(x) for k, x in v.items()}
        if isinstance(v, list):
            return [moved(x) for x in v]
        if isinstance(v, str) and v.startswith(local + "/"):
            return "/cache/models" + v[len(local) :]
        return v

    plan = moved(tomllib.loads(res.stdout))
    for table in ("learner", "groups", "rollout"):
        assert config[table] == plan[table], table


# --- the workloads ------------------------------------------------------------------------------


def test_rollout_weights_name_each_group_rank0(config: Doc) -> None:
    from teamrl.rollout.config import parse_weights_flags

    docs = _docs()
    args = _container(_one(docs, "Deployment", "rollout"))["args"]
    plain, keyed = parse_weights_flags(_values(args, "--weights"))
    assert plain is None
    port = config["ports"]["learner_publish"]
    groups = _learner_groups(docs)
    assert keyed == {g: f"tcp://{_rank0(sts)}:{port}" for g, sts in groups.items()}
    assert keyed["embedded-v1"] == config["endpoints"]["learner_publish"]
    # Each endpoint's pod binds --publish on that port.
    for sts in groups.values():
        publish = _flag(_container(sts)["args"], "--publish")
        assert publish == f"tcp://0.0.0.0:{port}", sts["metadata"]["name"]


def test_each_group_has_its_own_rendezvous(config: Doc) -> None:
    docs = _docs()
    masters = set()
    for group, sts in _learner_groups(docs).items():
        env = _env(_container(sts))
        assert int(env["WORLD_SIZE"]["value"]) == sts["spec"]["replicas"], group
        assert env["MASTER_ADDR"]["value"] == _rank0(sts), group
        assert int(env["MASTER_PORT"]["value"]) == config["ports"]["learner_rendezvous"], group
        assert "pod-index" in env["RANK"]["valueFrom"]["fieldRef"]["fieldPath"], group
        assert sts["spec"]["podManagementPolicy"] == "Parallel", group
        svc = _one(docs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        masters.add(env["MASTER_ADDR"]["value"])
    assert len(masters) == 2, "the groups must not share a rendezvous"


def test_init_containers_build_every_model_folder(
    config: Doc, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each pod builds, before it starts, the folders it reads: the learner group's base_model and
    all of the rollout's [rollout.models] paths, into the cache volume its main container mounts."""
    from teamrl.cli.main import main

    def built(w: Doc) -> set[str]:
        pod = w["spec"]["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in _container(w)["volumeMounts"]}
        out = set()
        for init in pod.get("initContainers", []):
            if init["args"][:2] != ["model", "build"]:
                continue
            cache = _env(init)["TEAMRL_CACHE"]["value"]
            assert cache == _env(_container(w))["TEAMRL_CACHE"]["value"]
            init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
            assert init_mounts[cache] == mounts[cache], f"{w['metadata']['name']}: {init['name']}"
            # Where that build writes: `teamrl model path` with the same arguments and cache.
            monkeypatch.setenv("TEAMRL_CACHE", cache)
            assert main(["model", "path", *init["args"][2:]]) == 0
            out.add(capsys.readouterr().out.strip())
        return out

    docs = _docs()
    for group, sts in _learner_groups(docs).items():
        assert config["groups"][group]["base_model"] in built(sts), group
    paths = {m["path"] for m in config["rollout"]["models"].values()}
    assert paths <= built(_one(docs, "Deployment", "rollout"))


def test_second_group_is_the_base_learner_but_for_its_group() -> None:
    """learner-llama is deploy/base/learner.yaml (as this overlay sets it) under another name: only
    its name, labels, group, run folder, rendezvous address and model build differ."""
    docs = _docs()
    groups = _learner_groups(docs)
    first, second = groups["embedded-v1"], groups["embedded-llama"]

    def normal(sts: Doc) -> Doc:
        spec = copy.deepcopy(sts["spec"])
        name = sts["metadata"]["name"]
        for labels in (spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"]):
            assert labels.pop("app.kubernetes.io/name") == name
        assert spec.pop("serviceName") == name
        spec.pop("replicas")
        pod = spec["template"]["spec"]
        for init in pod["initContainers"]:
            init["args"] = init["args"][:2]  # `model build` of the group's own kind
        (c,) = pod["containers"]
        for flag in ("--group", "--run-dir"):
            c["args"][c["args"].index(flag) + 1] = "<group>"
        env = _env(c)
        for var in ("MASTER_ADDR", "WORLD_SIZE"):
            env.pop(var)
        c["env"] = sorted(env.values(), key=lambda e: e["name"])
        return spec

    assert normal(second) == normal(first)
    svc = [copy.deepcopy(_one(docs, "Service", s["spec"]["serviceName"])) for s in (first, second)]
    for s in svc:
        name = s["metadata"]["name"]
        assert s["spec"]["selector"].pop("app.kubernetes.io/name") == name
        assert s["metadata"]["labels"].pop("app.kubernetes.io/name") == name
        s["metadata"].pop("name")
    assert svc[0] == svc[1]


# --- network and monitoring ---------------------------------------------------------------------


def _labels(docs: list[Doc], name: str) -> dict[str, str]:
    (w,) = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == name]
    return w["spec"]["template"]["metadata"]["labels"]


def _selects(sel: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in sel.items())


def _allowed(policies: list[Doc], direction: str, pod: dict[str, str], peer: Doc, port: int) -> bool:
    """Whether some NetworkPolicy selecting ``pod`` allows traffic on ``port`` in ``direction``
    (``ingress`` from ``peer`` / ``egress`` to it). ``peer``: ``{"pod": labels}`` for a pod of the
    namespace, ``{"namespace": name}`` for any pod of another namespace."""
    side = "from" if direction == "ingress" else "to"
    for np in policies:
        if not _selects(np["spec"]["podSelector"].get("matchLabels", {}), pod):
            continue
        for rule in np["spec"].get(direction, []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            for p in rule.get(side, []):
                ns = p.get("namespaceSelector", {}).get("matchLabels")
                if "namespace" in peer:
                    # any pod of that namespace: a namespaceSelector naming it, no podSelector
                    if ns == {"kubernetes.io/metadata.name": peer["namespace"]} and "podSelector" not in p:
                        return True
                elif ns is None and _selects(p["podSelector"]["matchLabels"], peer["pod"]):
                    return True
    return False


def _connects(policies: list[Doc], src: dict[str, str], dst: dict[str, str], port: int) -> bool:
    return _allowed(policies, "egress", src, {"pod": dst}, port) and _allowed(
        policies, "ingress", dst, {"pod": src}, port
    )


def test_network_policies_open_the_second_group_as_the_first(config: Doc) -> None:
    docs = _docs()
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    ports = config["ports"]
    rollout, buffer = _labels(docs, "rollout"), _labels(docs, "buffer")
    for sts in _learner_groups(docs).values():
        lrn = _labels(docs, sts["metadata"]["name"])
        name = sts["metadata"]["name"]
        for port in (ports["learner_publish"], ports["learner_latest"]):
            assert _connects(policies, rollout, lrn, port), f"rollout -> {name}:{port}"
        assert _connects(policies, lrn, buffer, ports["buffer_sample"]), f"{name} -> buffer"
        # Its ranks reach each other: the rendezvous, then NCCL/gloo on ephemeral ports.
        for port in (ports["learner_rendezvous"], 40000):
            assert _connects(policies, lrn, lrn, port), f"{name} -> {name}:{port}"
        monitoring = {"namespace": "monitoring"}
        assert _allowed(policies, "ingress", lrn, monitoring, ports["learner_metrics"]), name
        # Nothing else: rollouts do not reach its rendezvous, nor it the buffer's ingest port.
        assert not _connects(policies, rollout, lrn, ports["learner_rendezvous"]), name
        assert not _connects(policies, lrn, buffer, ports["buffer_ingest"]), name


def test_both_groups_are_scraped() -> None:
    docs = _docs()
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    for sts in _learner_groups(docs).values():
        labels = sts["spec"]["template"]["metadata"]["labels"]
        ports = {p["name"] for p in _container(sts)["ports"]}
        hits = [m for m in monitors if _selects(m["spec"]["selector"]["matchLabels"], labels)]
        # Exactly one: a pod scraped by two monitors would be two series.
        assert len(hits) == 1, sts["metadata"]["name"]
        assert {e["port"] for e in hits[0]["spec"]["podMetricsEndpoints"]} <= ports
