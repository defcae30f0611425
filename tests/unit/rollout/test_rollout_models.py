"""A rollout service with one engine per base model (``[rollout.models]``, docs/architecture.md §3).

Fast tests (no vLLM): ``--weights`` parsing and every config error (named by model id and field,
exit code 2 before any engine starts); ``WorkflowRunner`` routing each agent of a workflow on two
base models to its own base's backend (scripted backends: these tests are about routing), the
version each step records being that backend's; the service's per-base engines, appliers and
evaluation rows (the lowest version, ``versions`` per base, "final" only when every base's learner
said so), and its wait for every base's start version.

One vLLM test: ``teamrl rollout`` serving the built-in addition-duo with its verifier moved to a
second base (a copy of the embedded model's folder), two engines in one process; trajectories carry
both model ids, and adapters published for the first base only move only that base's version.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from teamrl.rewards.tokenizer import CharTokenizer
from teamrl.rollout.bases import engine_cpu_shares
from teamrl.rollout.cli import main
from teamrl.rollout.config import (
    DEFAULT_WEIGHTS,
    RolloutConfig,
    RolloutConfigError,
    load_config,
    parse_weights_flags,
    resolve_bases,
    with_model,
)
from teamrl.rollout.engine import Generation
from teamrl.rollout.service import RolloutService

ROOT = Path(__file__).parents[3]
CHAR = CharTokenizer()
TASK = {"id": "add-07-45", "a": 7, "b": 45, "question": "07+45=", "answer": "052"}


def two_base_workflow(tmp_path: Path) -> Path:
    """configs/workflows/addition-duo.toml with a second base model carrying the verifier and its adapter."""
    text = (ROOT / "configs" / "workflows" / "addition-duo.toml").read_text()
    text = text.replace('name = "addition-duo"', 'name = "addition-duo-two-bases"')
    text = text.replace(
        '[models.embedded-v1]\npath = ""\n', '[models.embedded-v1]\npath = ""\n\n[models.second]\npath = ""\n'
    )
    text = text.replace(
        '[adapters.verifier-lora]\nmodel = "embedded-v1"', '[adapters.verifier-lora]\nmodel = "second"'
    )
    text = text.replace(
        'id = "verifier"\nrole = "verifier"\nmodel = "embedded-v1"',
        'id = "verifier"\nrole = "verifier"\nmodel = "second"',
    )
    assert text.count('"second"') == 2, text
    out = tmp_path / "addition-duo-two-bases.toml"
    out.write_text(text)
    return out


def marker_model(folder: Path) -> Path:
    """A folder that passes the config.json check and that tokenizer_for() reads as the embedded
    char model (no weights: nothing here starts an engine)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (folder / "teamrl_model.json").write_text(json.dumps({"task": "addition"}))
    return folder


def two_base_cfg(tmp_path: Path, **over) -> RolloutConfig:
    models = {
        "embedded-v1": {"path": str(marker_model(tmp_path / "m1")), "weights": "tcp://127.0.0.1:7001"},
        "second": {
            "path": str(marker_model(tmp_path / "m2")),
            "max_lora_rank": 16,
            "weights": "tcp://127.0.0.1:7003",
        },
        **over.pop("models", {}),
    }
    return RolloutConfig.model_validate(
        {"workflow": str(two_base_workflow(tmp_path)), "models": models, **over}
    )


# --------------------------------------------------------------------------------------------
# --weights and the config


def test_weights_flag_is_one_endpoint_or_model_id_equals_endpoint() -> None:
    assert parse_weights_flags(None) == (None, {})
    assert parse_weights_flags("tcp://h:5557") == ("tcp://h:5557", {})
    assert parse_weights_flags(["tcp://h:5557"]) == ("tcp://h:5557", {})
    assert parse_weights_flags(["a=tcp://h:1", "b-2=ipc:///tmp/x"]) == (
        None,
        {"a": "tcp://h:1", "b-2": "ipc:///tmp/x"},
    )
    with pytest.raises(RolloutConfigError, match="'a' given twice"):
        parse_weights_flags(["a=tcp://h:1", "a=tcp://h:2"])
    with pytest.raises(RolloutConfigError, match="one MODEL_ID=ENDPOINT per base model"):
        parse_weights_flags(["tcp://h:1", "a=tcp://h:2"])
    with pytest.raises(RolloutConfigError, match="one MODEL_ID=ENDPOINT per base model"):
        parse_weights_flags(["tcp://h:1", "tcp://h:2"])
    with pytest.raises(RolloutConfigError, match="expected ENDPOINT or MODEL_ID=ENDPOINT"):
        parse_weights_flags(["a="])


def test_without_models_one_base_keyed_by_the_trained_agents_model(tmp_path: Path) -> None:
    cfg = RolloutConfig(workflow="addition-duo", model=str(marker_model(tmp_path / "m")), start_version=3)
    (base,) = resolve_bases(cfg, None).values()
    assert (base.model_id, base.path, base.weights, base.start_version) == (
        "embedded-v1",
        cfg.model,
        DEFAULT_WEIGHTS,
        3,
    )
    assert base.max_lora_rank == 8 and base.lora_target_modules == ()
    assert resolve_bases(cfg, "tcp://h:1")["embedded-v1"].weights == "tcp://h:1"
    assert resolve_bases(cfg, ["embedded-v1=tcp://h:2"])["embedded-v1"].weights == "tcp://h:2"
    with pytest.raises(RolloutConfigError, match=r"--weights other=\.\.\.: 'other' is not the base model"):
        resolve_bases(cfg, ["other=tcp://h:2"])
    assert with_model(cfg) is cfg


def test_a_workflow_on_two_bases_needs_models(tmp_path: Path) -> None:
    cfg = RolloutConfig(workflow=str(two_base_workflow(tmp_path)), model=str(marker_model(tmp_path / "m")))
    with pytest.raises(RolloutConfigError, match=r"base models \['embedded-v1', 'second'\].*rollout\.models"):
        resolve_bases(cfg, None)
    frozen = two_base_workflow(tmp_path).read_text().replace('adapter = "verifier-lora"\n', "")
    (tmp_path / "frozen.toml").write_text(frozen)  # the verifier untrained, on base weights
    cfg = cfg.model_copy(update={"workflow": str(tmp_path / "frozen.toml")})
    with pytest.raises(
        RolloutConfigError, match=r"agents \['verifier'\] on model 'second', which has no engine"
    ):
        resolve_bases(cfg, None)


def test_two_bases_resolve_in_models_order_and_flags_override_the_file(tmp_path: Path) -> None:
    cfg = two_base_cfg(tmp_path)
    bases = resolve_bases(cfg, None)
    assert list(bases) == ["embedded-v1", "second"]
    assert [b.weights for b in bases.values()] == ["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7003"]
    assert (bases["second"].max_lora_rank, bases["embedded-v1"].max_lora_rank) == (16, 8)
    bases = resolve_bases(cfg, ["second=tcp://h:9"])
    assert [b.weights for b in bases.values()] == ["tcp://127.0.0.1:7001", "tcp://h:9"]
    assert with_model(cfg) is cfg  # each base names its folder: no embedded model needed


@pytest.mark.parametrize(
    "models,flags,pattern",
    [
        ({"nope": {"path": "/x"}}, None, r"models\.nope: workflow .* has no model 'nope'"),
        ({"second": None}, None, r"models\.second: .*agents \['verifier'\] on model 'second'.*no engine"),
        (
            {"second": {"weights": ""}},
            None,
            r"models\.second\.weights: no weights endpoint for base 'second'",
        ),
        ({"second": {"path": "/nowhere"}}, None, r"models\.second\.path = '/nowhere': no config\.json"),
        ({}, ["third=tcp://h:1"], r"--weights third=\.\.\.: 'third' is not a base model"),
        ({}, ["tcp://h:1"], r"--weights tcp://h:1: this service runs 2 base models"),
    ],
)
def test_each_config_error_names_the_model_and_the_field(tmp_path: Path, models, flags, pattern) -> None:
    cfg = two_base_cfg(tmp_path)
    data = cfg.model_dump()
    for model_id, change in models.items():
        if change is None:
            del data["models"][model_id]
        else:
            data["models"][model_id] = {**data["models"].get(model_id, {"path": "/x"}), **change}
    with pytest.raises(RolloutConfigError, match=pattern):
        resolve_bases(RolloutConfig.model_validate(data), flags)


def test_models_table_forbids_unknown_fields_and_needs_a_path(tmp_path: Path) -> None:
    toml = tmp_path / "r.toml"
    toml.write_text(
        '[rollout]\nworkflow = "addition-duo"\n[rollout.models.embedded-v1]\npath = "/x"\nrank = 4\n'
    )
    with pytest.raises(RolloutConfigError, match=r"rollout\.models\.embedded-v1\.rank"):
        load_config(str(toml), [])
    toml.write_text(
        '[rollout]\nworkflow = "addition-duo"\n[rollout.models.embedded-v1]\nweights = "tcp://h:1"\n'
    )
    with pytest.raises(RolloutConfigError, match=r"rollout\.models\.embedded-v1\.path"):
        load_config(str(toml), [])


def test_the_command_prints_the_error_and_exits_2_before_any_engine(tmp_path: Path, capsys) -> None:
    cfg = two_base_cfg(tmp_path)
    toml = tmp_path / "r.toml"
    toml.write_text(
        f'[rollout]\nworkflow = "{cfg.workflow}"\n'
        f'[rollout.models.embedded-v1]\npath = "{cfg.models["embedded-v1"].path}"\n'
        f'[rollout.models.second]\npath = "{tmp_path / "empty"}"\n'
    )
    argv = [
        "--config",
        str(toml),
        "--weights",
        "embedded-v1=tcp://127.0.0.1:9",
        "--weights",
        "second=tcp://127.0.0.1:11",
    ]
    assert main(argv) == 2
    assert "models.second.path" in capsys.readouterr().err
    assert main(["--config", str(toml), "--weights", "embedded-v1=tcp://127.0.0.1:9"]) == 2
    assert "models.second.weights" in capsys.readouterr().err


def test_engines_of_one_service_get_disjoint_cores() -> None:
    assert engine_cpu_shares(1, {}) == [{}]
    assert engine_cpu_shares(2, {"VLLM_CPU_OMP_THREADS_BIND": "0-3"}) == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "2,3"},
    ]
    assert engine_cpu_shares(2, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == [{}, {}]
    shares = engine_cpu_shares(2, {})
    if shares != [{}, {}]:  # [{}, {}]: a CPU quota below the cores (workers unpinned)
        assert len({s["VLLM_CPU_OMP_THREADS_BIND"] for s in shares}) == min(2, len(os.sched_getaffinity(0)))


# --------------------------------------------------------------------------------------------
# WorkflowRunner on a mapping of engines


class Scripted:
    """A backend answering from ``script[adapter]``, with a model folder (its tokenizer) and a version."""

    def __init__(self, folder: Path, script: dict[str, str], version: int) -> None:
        self.cfg = type("Cfg", (), {"model": str(folder)})()
        self.script, self.version, self.calls = script, version, []

    async def generate(self, prompt_ids, sampling, adapter="", seed=None) -> Generation:
        self.calls.append(adapter)
        ids = CHAR.encode(self.script[adapter], add_special=False)
        return Generation(
            ids, [-0.5] * len(ids), self.script[adapter], "stop", adapter, self.version, 1.0, 2.0
        )


def test_runner_routes_each_agent_to_its_base_and_records_that_base_version(tmp_path: Path) -> None:
    from teamrl.rollout.runner import WorkflowRunner
    from teamrl.rollout.spec import WorkflowError

    wf = str(two_base_workflow(tmp_path))
    first = Scripted(marker_model(tmp_path / "m1"), {"solver-lora": "52;"}, version=5)
    second = Scripted(marker_model(tmp_path / "m2"), {"verifier-lora": "1;"}, version=2)
    runner = WorkflowRunner(wf, {"embedded-v1": first, "second": second}, "inc")
    assert set(runner.tokenizers) == {"embedded-v1", "second"}
    traj = asyncio.run(runner.episode(TASK, 7, group_id="g"))
    assert first.calls == ["solver-lora"] and second.calls == ["verifier-lora"]
    assert [(s.agent_id, s.model_id, s.adapter, s.policy_version) for s in traj.steps] == [
        ("solver", "embedded-v1", "solver-lora", 5),
        ("verifier", "second", "verifier-lora", 2),
    ]
    assert traj.reward == 1.0 and [s.reward for s in traj.steps] == [1.0, 1.0]
    ev = asyncio.run(runner.evaluate([TASK]))
    assert ev["solver_accuracy"] == 1.0 and ev["verifier_accuracy"] == 1.0

    with pytest.raises(
        WorkflowError, match=r"agent 'verifier' runs on model 'second', which has no engine"
    ) as e:
        WorkflowRunner(wf, {"embedded-v1": first}, "inc")
    assert e.value.agent == "verifier"
    with pytest.raises(WorkflowError, match=r"agent 'solver' .* no engine \(one engine given for models"):
        WorkflowRunner(wf, first, "inc")  # one engine serves the trained agents' one model only
    one = WorkflowRunner("addition-duo", first, "inc")  # one engine, one model: as before
    assert list(one.engines) == ["embedded-v1"] and one.engine is first


def test_profiles_are_checked_with_the_agents_own_tokenizer(tmp_path: Path) -> None:
    from teamrl.rewards.tokenizer import TokenizerError
    from teamrl.rollout.runner import WorkflowRunner

    first = Scripted(marker_model(tmp_path / "m1"), {}, 0)
    second = Scripted(marker_model(tmp_path / "m2"), {}, 0)
    runner = WorkflowRunner(str(two_base_workflow(tmp_path)), {"embedded-v1": first, "second": second}, "inc")
    with pytest.raises(TokenizerError):
        runner.set_profiles(1, {"verifier": "You are the verifier."})  # not the char vocabulary
    assert runner.profile_version == -1


# --------------------------------------------------------------------------------------------
# the service's bases (nothing started)


def test_service_builds_one_engine_and_applier_per_base(tmp_path: Path) -> None:
    cfg = two_base_cfg(tmp_path, seed=4, replica=0, keep_versions=3, lora_target_modules=["q_proj"])
    cfg.models["second"].lora_target_modules = ["q_proj", "v_proj"]
    svc = RolloutService(cfg, buffer="tcp://127.0.0.1:9", weights=None)
    assert list(svc.bases) == ["embedded-v1", "second"]
    e1, e2 = (b.engine.cfg for b in svc.bases.values())
    assert (e1.model, e2.model) == (cfg.models["embedded-v1"].path, cfg.models["second"].path)
    assert (e1.max_lora_rank, e2.max_lora_rank) == (8, 16)
    assert (e1.lora_target_modules, e2.lora_target_modules) == ((), ("q_proj", "v_proj"))
    assert (
        (e1.seed, e1.keep_versions, e1.kv_cache_bytes)
        == (e2.seed, e2.keep_versions, e2.kv_cache_bytes)
        == (
            4,
            3,
            cfg.kv_cache_bytes,
        )
    )
    a1, a2 = (b.applier for b in svc.bases.values())
    assert (a1.engine, a2.engine) == (svc.bases["embedded-v1"].engine, svc.bases["second"].engine)
    assert (a1.profiles, a2.profiles) == (True, False)  # the first base's group runs the profile rounds
    assert a1.adapter_root != a2.adapter_root and (a1.model_id, a2.model_id) == ("embedded-v1", "second")
    assert svc.runner.engines == {m: b.engine for m, b in svc.bases.items()}
    assert svc.engine is svc.bases["embedded-v1"].engine
    assert svc.not_ready_reason() == "engine starting (embedded-v1, second)"


def test_service_engines_take_the_rollout_dtype(tmp_path: Path) -> None:
    cfg = two_base_cfg(tmp_path, seed=4, replica=0)
    assert cfg.dtype == "float32"  # the default: the embedded models' curves are measured in float32
    cfg.dtype = "bfloat16"
    svc = RolloutService(cfg, buffer="tcp://127.0.0.1:9", weights=None)
    assert [b.engine.cfg.dtype for b in svc.bases.values()] == ["bfloat16", "bfloat16"]


def test_an_adapter_announced_on_another_bases_link_is_refused_naming_adapter_agents_and_models(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Learner groups that disagree with the rollout's workflow: the verifier's adapter (model
    ``second``) announced on the link of ``embedded-v1`` is refused (``wrong_base``, counted) before
    anything is fetched or loaded, and the base keeps its version."""
    from teamrl.protocol.control import InlineWeights, Probe, WeightsPublished
    from teamrl.rollout import metrics as M

    svc = RolloutService(two_base_cfg(tmp_path), buffer="tcp://127.0.0.1:9", weights=None)
    applier = svc.bases["embedded-v1"].applier
    msg = WeightsPublished(
        announce_seq=0,
        version=1,
        adapters={"verifier-lora": "verifier-lora"},
        location=InlineWeights(chunks=[b"not fetched"]),
        sha256="0" * 64,
        probe=Probe(prompt_ids=[1], completion_ids=[2], expected_logprobs=[-1.0], atol=0.1),
    )
    before = M.ADAPTER_FAILURES.labels("wrong_base")._value.get()
    with caplog.at_level("WARNING", logger="teamrl.rollout"):
        assert asyncio.run(applier.apply_weights(msg)) is False
    assert M.ADAPTER_FAILURES.labels("wrong_base")._value.get() == before + 1
    text = caplog.text
    assert "adapter 'verifier-lora'" in text and "runs on model 'second' (agents ['verifier'])" in text
    assert "link of model 'embedded-v1'" in text and svc.bases["embedded-v1"].engine.version == 0


class FakeEval:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, tasks):
        self.calls += 1
        return {"reward_mean": 0.5}


def test_evaluation_rows_with_two_bases(tmp_path: Path) -> None:
    eval_file = tmp_path / "eval.jsonl"
    cfg = two_base_cfg(tmp_path, replica=0, eval_interval=2, eval_tasks=2, eval_file=str(eval_file))
    svc = RolloutService(cfg, buffer="tcp://127.0.0.1:9")
    svc.runner.evaluate = FakeEval()
    b1, b2 = svc.bases["embedded-v1"], svc.bases["second"]

    def rows() -> list[dict]:
        return [json.loads(x) for x in eval_file.read_text().splitlines()] if eval_file.exists() else []

    async def step(v1: int, v2: int, f1: bool = False, f2: bool = False) -> None:
        b1.engine.version, b2.engine.version = v1, v2
        b1.applier.final, b2.applier.final = f1, f2
        await svc.maybe_evaluate(f1 or f2)

    b1.applier.answered = True
    asyncio.run(step(0, 0))
    assert rows() == []  # the second learner has not answered yet
    b2.applier.answered = True
    asyncio.run(step(0, 0))
    asyncio.run(step(3, 1))  # lowest 1: not past the next multiple of 2
    asyncio.run(step(3, 2))
    asyncio.run(step(5, 3, f1=True))  # only one base's learner is done
    asyncio.run(step(5, 3, f1=True, f2=True))  # both: evaluate now
    asyncio.run(step(5, 3, f1=True, f2=True))  # the same final versions again: nothing new
    asyncio.run(step(6, 3, f1=True, f2=True))  # lowest still 3, but a base moved on: evaluate again
    got = [(r["version"], r["step"], r["versions"]) for r in rows()]
    assert got == [
        (0, 0, {"embedded-v1": 0, "second": 0}),
        (2, 2, {"embedded-v1": 3, "second": 2}),
        (3, 3, {"embedded-v1": 5, "second": 3}),
        (3, 3, {"embedded-v1": 6, "second": 3}),
    ]
    assert rows()[0]["reward_mean"] == 0.5


def test_single_base_rows_have_no_versions(tmp_path: Path) -> None:
    eval_file = tmp_path / "eval.jsonl"
    cfg = RolloutConfig(
        workflow="addition-duo",
        model=str(marker_model(tmp_path / "m")),
        replica=0,
        eval_interval=1,
        eval_tasks=2,
        eval_file=str(eval_file),
        adapter_dir=str(tmp_path / "recv"),
    )
    svc = RolloutService(cfg, buffer="tcp://127.0.0.1:9", weights="tcp://127.0.0.1:7001")
    assert list(svc.bases) == ["embedded-v1"] and svc.applier.adapter_root == tmp_path / "recv"
    assert svc.bases["embedded-v1"].plan.weights == "tcp://127.0.0.1:7001"
    assert svc.not_ready_reason() == "engine starting"
    svc.runner.evaluate = FakeEval()
    svc.applier.answered = True
    asyncio.run(svc.maybe_evaluate(False))
    (row,) = [json.loads(x) for x in eval_file.read_text().splitlines()]
    assert list(row)[:2] == ["version", "step"] and "versions" not in row and row["version"] == 0


def test_generation_waits_for_every_base_start_version(tmp_path: Path) -> None:
    cfg = two_base_cfg(
        tmp_path,
        models={
            "second": {"path": str(marker_model(tmp_path / "m2")), "weights": "tcp://h:3", "start_version": 4}
        },
    )
    cfg.models["embedded-v1"].start_version = 2
    svc = RolloutService(cfg, buffer="tcp://127.0.0.1:9")
    b1, b2 = svc.bases["embedded-v1"].engine, svc.bases["second"].engine

    async def scenario() -> list[str]:
        seen = []
        waiter = asyncio.create_task(svc.wait_for_version())
        for v1, v2 in [(2, 0), (2, 3), (1, 9), (2, 4)]:
            b1.version, b2.version = v1, v2
            await asyncio.sleep(0.3)
            seen.append(f"{v1},{v2}:{'done' if waiter.done() else 'waiting'}")
        await asyncio.wait_for(waiter, 1.0)
        return seen

    assert asyncio.run(scenario()) == ["2,0:waiting", "2,3:waiting", "1,9:waiting", "2,4:done"]


# --------------------------------------------------------------------------------------------
# on vLLM: two engines in one service


@pytest.mark.vllm
@pytest.mark.slow
def test_two_bases_on_vllm_route_agents_and_follow_their_own_learner(
    tmp_path: Path, embedded_model: Path
) -> None:
    import hashlib

    from test_rollout_service import (
        COMPLETION,
        PROMPT,
        FrameCollector,
        free_port,
        http_get,
        make_adapters,
        metric,
    )

    from teamrl.protocol.adapters import write_adapter_payload
    from teamrl.protocol.control import InlineWeights, Probe, WeightsPublished
    from teamrl.protocol.zmq_transport import WeightsPublisher, ZmqDataReceiver, latest_endpoint_for

    second = tmp_path / "second-model"
    shutil.copytree(embedded_model, second)
    folders, expected = make_adapters(embedded_model, tmp_path / "adapters")
    payload = write_adapter_payload({"solver-lora": folders["solver-lora"]})  # the first base's group only

    data_ep = f"tcp://127.0.0.1:{free_port()}"
    pub1 = f"tcp://127.0.0.1:{free_port(pair=True)}"
    pub2 = f"tcp://127.0.0.1:{free_port(pair=True)}"  # the second base's learner: never answers here
    receiver = ZmqDataReceiver(data_ep)
    publisher = WeightsPublisher(pub1, latest_endpoint_for(pub1))
    mport = free_port()
    eval_file = tmp_path / "eval.jsonl"
    config = tmp_path / "rollout.toml"
    config.write_text(
        "[rollout]\n"
        f'workflow = "{two_base_workflow(tmp_path)}"\n'
        "group_size = 2\ngroups_in_flight = 2\ndrain_timeout_s = 0.0\n"
        f'adapter_dir = "{tmp_path / "recv"}"\n'
        f'eval_interval = 1\neval_tasks = 4\neval_file = "{eval_file}"\nreplica = 0\n'
        f'[rollout.models.embedded-v1]\npath = "{embedded_model}"\n'
        f'[rollout.models.second]\npath = "{second}"\n'
    )
    log = tmp_path / "rollout.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "teamrl.cli.main", "rollout", "--insecure", "--config", str(config)]
        + ["--buffer", data_ep]
        + ["--weights", f"embedded-v1={pub1}", "--weights", f"second={pub2}", "--metrics-port", str(mport)],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ},
    )
    collector = FrameCollector(receiver, proc, log)
    frames, wait = collector.frames, collector.wait

    try:
        wait(lambda: http_get(mport, "/readyz")[0] == 200, 420, "/readyz (two engines)")
        wait(lambda: len(frames) >= 2, 120, "first frames")
        for t in (t for fr in frames for t in fr):
            assert [(s.agent_id, s.model_id, s.policy_version) for s in t.steps] == [
                ("solver", "embedded-v1", 0),
                ("verifier", "second", 0),
            ]
        wait(lambda: eval_file.exists() and eval_file.read_text().strip(), 120, "the first evaluation")
        row = json.loads(eval_file.read_text().splitlines()[0])
        assert (row["version"], row["versions"]) == (0, {"embedded-v1": 0, "second": 0})

        publisher.publish(
            WeightsPublished(
                announce_seq=0,
                version=1,
                adapters={"solver": "solver-lora"},
                location=InlineWeights(chunks=[payload]),
                sha256=hashlib.sha256(payload).hexdigest(),
                probe=Probe(
                    prompt_ids=PROMPT, completion_ids=COMPLETION, expected_logprobs=expected, atol=1e-3
                ),
            )
        )
        wait(
            lambda: any(s.policy_version == 1 for t in frames[-1] for s in t.steps), 120, "solver steps at v1"
        )
        for t in frames[-1]:
            assert [(s.model_id, s.policy_version) for s in t.steps] == [("embedded-v1", 1), ("second", 0)]
        assert metric(mport, "teamrl_rollout_policy_version", '{agent="solver-lora"}') == 1
        assert metric(mport, "teamrl_rollout_version_lag", '{model="embedded-v1"}') == 0
        assert len(eval_file.read_text().splitlines()) == 1  # the lowest version is still 0

        collector.drain()
    finally:
        if proc.poll() is None:
            proc.kill()
        publisher.close()
        receiver.close()
    text = log.read_text()
    assert "adapters v1 live on embedded-v1" in text, text[-3000:]
    m = re.search(r"rollout stopped: (\d+) groups, (\d+) episodes published; 0 frames un-acknowledged", text)
    assert m and int(m.group(2)) == sum(len(fr) for fr in frames), text[-3000:]
