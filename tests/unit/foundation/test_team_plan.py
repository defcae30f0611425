"""A workflow on a model folder is planned and checked before any process starts (teamrl.rollout.team,
teamrl.cli.plan, `teamrl workflow check`, `teamrl run`): what each service is told, and every way a
workflow that cannot train is refused with the file, agent and field named (exit code 2)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from teamrl.rewards.tokenizer import ByteTokenizer
from teamrl.rollout.spec import WorkflowError
from teamrl.rollout.team import lora_targets, plan_team
from teamrl.rollout.workflows import load

CLI = [sys.executable, "-m", "teamrl.cli.main"]


def fake_model(root: Path, *, char: bool = True, modules=("q_proj", "k_proj", "v_proj", "o_proj")) -> Path:
    """A model folder with a config, safetensors *headers* naming layers, and (char) the embedded
    marker: enough for planning, which reads names and the tokenizer, never weights."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    if char:
        (root / "teamrl_model.json").write_text(json.dumps({"task": "addition"}))
    header = {
        f"model.layers.0.self_attn.{m}.weight": {
            "dtype": "F32",
            "shape": [1],
            "data_offsets": [4 * i, 4 * i + 4],
        }
        for i, m in enumerate(modules)
    }
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4 * len(modules))
    return root


def write_workflow(path: Path, **changes) -> Path:
    """addition-duo as TOML with top-level tables replaced by ``changes``."""
    from teamrl.cli.config import to_toml

    data = load("addition-duo").model_dump(mode="json")
    data.update(changes)
    data["reward"] = {k: v for k, v in data["reward"].items() if v not in ("", {})}
    path.write_text(to_toml(_clean(data)))
    return path


def _clean(x):
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def test_plan_takes_adapters_ranks_targets_probe_and_split_from_the_workflow(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m", modules=("q_proj", "v_proj", "up_proj"))
    team = plan_team("addition-duo", model)
    assert team.adapters == {"solver-lora": 8, "verifier-lora": 8}
    assert team.shared_by == {"solver-lora": ["solver"], "verifier-lora": ["verifier"]}
    assert team.target_modules == ["q_proj", "v_proj"]  # what the architecture has, not a fixed list
    assert team.max_lora_rank == 8 and set(team.temperatures.values()) == {1.0}
    assert team.train_size == 9800 and team.held_out_size == 200
    assert team.probe_prompt[0] == 1 and team.probe_completion[-1] == 14  # <bos>S.. -> digits, EOS
    shared = plan_team("addition-duo-shared", model)
    assert shared.adapters == {"team-lora": 8} and shared.shared_by == {"team-lora": ["solver", "verifier"]}


def test_each_adapter_keeps_its_own_rank_and_the_engine_max_covers_the_largest(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m")
    wf = load("addition-duo").model_dump(mode="json")
    wf["adapters"]["verifier-lora"]["rank"] = 24
    team = plan_team(write_workflow(tmp_path / "w.toml", adapters=wf["adapters"]), model)
    assert team.adapters == {"solver-lora": 8, "verifier-lora": 24} and team.max_lora_rank == 32
    wf["adapters"]["verifier-lora"]["rank"] = 300
    with pytest.raises(WorkflowError, match=r"'verifier-lora' has rank 300.*256") as e:
        plan_team(write_workflow(tmp_path / "w.toml", adapters=wf["adapters"]), model)
    assert e.value.agent == "verifier"


@pytest.mark.parametrize(
    "change,pattern",
    [
        ({"adapter": ""}, r"no agent has an adapter"),
        ({"model": "other"}, r"agent 'solver' maps to unknown model 'other'"),
        ({"template": "S{task[nope]}"}, r"agent 'solver' template.*no field 'nope'"),
        (
            {"template": "Solve {task[question]}"},
            r"agent 'solver' template: the model's tokenizer cannot encode",
        ),
        (
            {"response_prefix": "Answer:"},
            r"agent 'solver' response_prefix: the model's tokenizer cannot encode",
        ),
    ],
)
def test_a_workflow_that_cannot_train_is_refused_naming_file_agent_and_field(
    tmp_path: Path, change: dict, pattern: str
) -> None:
    model = fake_model(tmp_path / "m")
    agents = load("addition-duo").model_dump(mode="json")["agents"]
    for a in agents:
        if "adapter" in change or a["id"] == "solver":
            a.update(change)
    path = write_workflow(tmp_path / "mine.toml", agents=agents)
    with pytest.raises(WorkflowError, match=pattern) as e:
        plan_team(path, model)
    assert "mine.toml" in str(e.value)


def test_reward_answer_from_must_name_an_agent_and_other_refusals(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m")
    with pytest.raises(WorkflowError, match=r"answer_from names agent 'nobody'"):
        plan_team(
            write_workflow(tmp_path / "a.toml", reward={"name": "addition", "answer_from": "nobody"}), model
        )
    with pytest.raises(WorkflowError, match=r"unknown reward 'magic'"):
        plan_team(write_workflow(tmp_path / "b.toml", reward={"name": "magic"}), model)
    hetero = plan_team("math-duo-hetero", model, tokenizer=ByteTokenizer())  # one learner group per base
    assert {m: b.agents for m, b in hetero.bases.items()} == {
        "planner-model": ["planner"],
        "solver-model": ["solver"],
    }
    with pytest.raises(WorkflowError, match=r"no attention projection"):
        lora_targets(fake_model(tmp_path / "gpt", modules=("c_attn", "c_proj")))


def test_answer_from_scores_the_named_agent_not_the_last_of_a_role() -> None:
    from teamrl.rewards.base import ActView
    from teamrl.rewards.outcome import AdditionReward

    task = {"question": "07+45=", "answer": "52"}

    def act(i, agent, role, text, parents=()):
        return ActView(i, agent, agent, role, 0, text, text, list(parents), [i])

    acts = [act(0, "solver_a", "solver", "052;"), act(1, "solver_b", "solver", "999;")]
    assert AdditionReward().episode(task, acts).trajectory == 0.0  # role rule: the last solver act (wrong)
    assert AdditionReward(answer_agent="solver_a").episode(task, acts).trajectory == 1.0


def test_workflow_check_and_plan_commands(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m")
    t0 = time.perf_counter()
    ok = subprocess.run(
        [*CLI, "workflow", "check", "addition-duo", "--model", str(model)], capture_output=True, text=True
    )
    took = time.perf_counter() - t0
    assert ok.returncode == 0 and "adapters solver-lora (r=8; solver)" in ok.stdout, ok.stderr
    print(f"teamrl workflow check: {took:.2f} s including interpreter start")
    bad = subprocess.run(
        [*CLI, "workflow", "check", "math-trio", "--model", str(model)], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "agent 'planner'" in bad.stderr and "cannot encode" in bad.stderr
    plan = subprocess.run(
        [*CLI, "workflow", "plan", "addition-duo", "--model", str(model), "--group-size", "4"],
        capture_output=True,
        text=True,
    )
    assert plan.returncode == 0, plan.stderr
    import tomllib

    tables = tomllib.loads(plan.stdout)
    assert tables["learner"]["adapters"] == ["solver-lora", "verifier-lora"]
    assert tables["buffer"]["group_size"] == tables["rollout"]["group_size"] == 4
    assert tables["rollout"]["workflow"] == "addition-duo"
    schema = subprocess.run([*CLI, "workflow", "schema"], capture_output=True, text=True)
    assert "answer_from" in schema.stdout and "[agents.sampling]" in schema.stdout


@pytest.mark.parametrize(
    "extra,pattern",
    [
        (["--steps", "-5"], "--steps: must be >= 1"),
        (["--group-size", "0"], "--group-size: must be >= 1"),
        (["--set", "learner.lr=-1"], "learner.lr"),
        (["--set", "learner.algorithm=magic"], "learner.algorithm"),
        (["--set", "nosuch.key=1"], "unknown sections"),
        (["--reward-scale", "judge=2"], "roles ['judge'] are not in workflow"),
    ],
)
def test_run_refuses_bad_numbers_and_settings_before_starting_anything(
    tmp_path: Path, extra: list[str], pattern: str
) -> None:
    model = fake_model(tmp_path / "m")
    run = tmp_path / "run"
    t0 = time.perf_counter()
    res = subprocess.run(
        [*CLI, "run", "--workflow", "addition-duo", "--model", str(model), "--run-dir", str(run), *extra],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and pattern in res.stderr, res.stderr
    assert not run.exists()  # nothing started, nothing written
    print(f"refused in {time.perf_counter() - t0:.2f} s")


def test_run_config_file_sets_flags_and_service_tables(tmp_path: Path) -> None:
    import argparse

    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args

    model = fake_model(tmp_path / "m")
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'[run]\nworkflow = "addition-duo"\nmodel = "{model}"\nsteps = 7\ngroup_size = 4\n\n'
        "[learner]\nkl_coef = 0.01\n[learner.lora]\nalpha = 32.0\n"
    )
    args = parse_args(
        ["--config", str(cfg), "--steps", "9", "--set", "rollout.eval_tasks=5"], "teamrl run", None, "r"
    )
    assert isinstance(args, argparse.Namespace) and (args.steps, args.group_size) == (
        9,
        4,
    )  # flag beats [run]
    p = plan(args)
    lrn = p.config["learner"]
    assert lrn["kl_coef"] == 0.01 and lrn["lora"]["alpha"] == 32.0 and lrn["lora"]["target_modules"]
    assert lrn["max_steps"] == 9 and p.config["rollout"]["eval_tasks"] == 5
    assert lrn["probe_prompt"] == p.team.probe_prompt
    assert "max_seconds" not in lrn  # no --max-minutes: --steps alone (the learner's default, 0)
    timed = plan(parse_args(["--config", str(cfg), "--max-minutes", "1.5"], "teamrl run", None, "r"))
    assert timed.config["learner"]["max_seconds"] == 90.0
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parse_args(["--config", str(cfg), "--max-minutes", bad], "teamrl run", None, "r")


def test_each_adapter_gets_its_agents_temperature_and_the_workflows_optimiser_settings(
    tmp_path: Path,
) -> None:
    """Dr. MAS: per-agent sampling and optimisation. Each adapter's temperature is its agents'; an
    adapter's [adapters.X] lr/clip/kl/micro-batch reach [learner.agents.X]; --set still overrides."""
    import argparse

    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args

    model = fake_model(tmp_path / "m")
    data = load("addition-duo").model_dump(mode="json")
    for a in data["agents"]:
        a["sampling"]["temperature"] = {"solver": 0.7, "verifier": 1.3}[a["id"]]
    data["adapters"]["verifier-lora"].update(lr=5e-5, kl_coef=0.02, micro_batch_rows=8)
    path = write_workflow(tmp_path / "w.toml", agents=data["agents"], adapters=data["adapters"])
    team = plan_team(path, model)
    assert team.temperatures == {"solver-lora": 0.7, "verifier-lora": 1.3}
    args = parse_args(
        ["--workflow", str(path), "--model", str(model), "--set", "learner.agents.solver-lora.clip_high=0.3"],
        "teamrl run",
        None,
        "r",
    )
    assert isinstance(args, argparse.Namespace)
    agents = plan(args).config["learner"]["agents"]
    assert agents["verifier-lora"] == {
        "rank": 8,
        "temperature": 1.3,
        "lr": 5e-5,
        "kl_coef": 0.02,
        "micro_batch_rows": 8,
    }
    assert agents["solver-lora"] == {"rank": 8, "temperature": 0.7, "clip_high": 0.3}


def test_an_agents_choices_become_its_adapters_allowed_tokens_and_must_be_one_token_each(
    tmp_path: Path,
) -> None:
    """agents.choices: planned into [learner.agents.X] allowed_token_ids (the learner normalises the
    adapter's log-probs over them); a choice of two tokens, or agents sharing an adapter with other
    choices, are refused before any process starts."""
    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args
    from teamrl.learner.config import AgentOverrides
    from teamrl.rewards.tokenizer import CharTokenizer

    model = fake_model(tmp_path / "m")
    data = load("addition-duo").model_dump(mode="json")
    data["agents"][1]["choices"] = ["0", "1"]
    path = write_workflow(tmp_path / "w.toml", agents=data["agents"])
    ids = CharTokenizer().encode("01", add_special=False)
    assert plan_team(path, model).base.choices == {"verifier-lora": ids}
    args = parse_args(["--workflow", str(path), "--model", str(model)], "teamrl run", None, "r")
    agents = plan(args).config["learner"]["agents"]
    assert (
        agents["verifier-lora"]["allowed_token_ids"] == ids
        and "allowed_token_ids" not in agents["solver-lora"]
    )
    assert AgentOverrides(**agents["verifier-lora"]).allowed_token_ids == ids

    data["agents"][1]["choices"] = ["0", "10"]
    two = write_workflow(tmp_path / "two.toml", agents=data["agents"])
    with pytest.raises(WorkflowError, match=r"choice '10' is 2 tokens") as e:
        plan_team(two, model)
    assert e.value.agent == "verifier" and "two.toml" in str(e.value)

    data["agents"][1]["choices"] = ["0", "1"]
    data["agents"][1]["adapter"] = "solver-lora"  # shared with the solver, who writes free text
    shared = write_workflow(tmp_path / "shared.toml", agents=data["agents"])
    with pytest.raises(WorkflowError, match="share adapter 'solver-lora' but choose among"):
        plan_team(shared, model)


@pytest.mark.parametrize(
    "sampling,pattern",
    [
        (
            {"solver": {"temperature": 0.5}},
            r"agents 'solver' and 'verifier' share adapter 'team-lora'.*0.5 and 1.0",
        ),
        (
            {"verifier": {"temperature": 0.0}},
            r"agent 'verifier' trains adapter 'team-lora' but samples greedily",
        ),
        (
            {"solver": {"top_p": 0.9}},
            r"agent 'solver' trains adapter 'team-lora' with agents.sampling.top_p = 0.9",
        ),
    ],
)
def test_sampling_the_learner_cannot_reproduce_is_refused(
    tmp_path: Path, sampling: dict, pattern: str
) -> None:
    model = fake_model(tmp_path / "m")
    agents = load("addition-duo-shared").model_dump(mode="json")["agents"]
    for a in agents:
        a["sampling"].update(sampling.get(a["id"], {}))
    path = tmp_path / "shared.toml"
    from teamrl.cli.config import to_toml

    data = load("addition-duo-shared").model_dump(mode="json") | {"agents": agents}
    data["reward"] = {k: v for k, v in data["reward"].items() if v not in ("", {})}
    path.write_text(to_toml(_clean(data)))
    with pytest.raises(WorkflowError, match=pattern):
        plan_team(path, model)


def test_a_streaming_learner_is_served_from_one_group_on(tmp_path: Path) -> None:
    """``--set learner.stream_micro_batches=true`` makes the buffer serve from one group (the streamed
    step trains groups as they arrive); a ``buffer.min_size`` the user set is kept."""
    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args

    model = fake_model(tmp_path / "m", modules=("q_proj", "v_proj"))

    def buffer(*extra: str) -> dict:
        argv = ["--workflow", "addition-duo", "--model", str(model), "--group-size", "4", *extra]
        return plan(parse_args(argv, "teamrl run", None, str(tmp_path / "run")), build=False).config["buffer"]

    assert buffer()["min_size"] == 16 * 4
    assert buffer("--set", "learner.stream_micro_batches=true")["min_size"] == 4
    assert buffer("--set", "learner.stream_micro_batches=true", "--set", "buffer.min_size=8")["min_size"] == 8


def test_a_run_that_trains_profiles_alone_has_no_version_budget(tmp_path: Path) -> None:
    """``learner.train_weights = false`` publishes no adapter version to refill the rollout's budget
    (such a run stalled after max lag + 1 steps): the budget is off, unless the user set it."""
    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args

    model = fake_model(tmp_path / "m", modules=("q_proj", "v_proj"))

    def budget(*extra: str) -> int:
        argv = ["--workflow", "addition-duo", "--model", str(model), "--max-lag", "1", *extra]
        cfg = plan(parse_args(argv, "teamrl run", None, str(tmp_path / "run")), build=False).config
        return cfg["rollout"]["max_groups_per_version"]

    weights_off = ("--set", "learner.train_weights=false", "--set", "learner.profile_interval=1")
    weights_off += ("--set", 'learner.profiles={solver="You add.", verifier="You check."}')
    assert budget() == 2 * 16
    assert budget(*weights_off) == 0
    assert budget(*weights_off, "--set", "rollout.max_groups_per_version=8") == 8


def test_a_bfloat16_learner_publishes_float32_probes_and_bfloat16_rollouts_need_a_stated_tolerance(
    tmp_path: Path,
) -> None:
    """``learner.dtype = bfloat16`` with float32 rollouts gets float32 probes from the exported files
    (unless the user chose); ``rollout.dtype = bfloat16`` is refused before any process without an
    explicit ``learner.probe_atol`` (its log-probs cannot be verified to a useful tolerance on CPU)."""
    from teamrl.cli.plan import PlanError, plan
    from teamrl.cli.run import parse_args

    model = fake_model(tmp_path / "m", modules=("q_proj", "v_proj"))

    def learner(*extra: str) -> dict:
        argv = ["--workflow", "addition-duo", "--model", str(model), *extra]
        return plan(parse_args(argv, "teamrl run", None, str(tmp_path / "run")), build=False).config[
            "learner"
        ]

    assert "probe_dtype" not in learner()
    assert learner("--set", "learner.dtype=bfloat16")["probe_dtype"] == "float32"
    assert (
        learner("--set", "learner.dtype=bfloat16", "--set", "learner.probe_dtype=auto")["probe_dtype"]
        == "auto"
    )
    with pytest.raises(PlanError, match="rollout.dtype = bfloat16.*learner.probe_atol"):
        learner("--set", "rollout.dtype=bfloat16", "--set", "learner.dtype=bfloat16")
    both = learner(
        "--set",
        "rollout.dtype=bfloat16",
        "--set",
        "learner.dtype=bfloat16",
        "--set",
        "learner.probe_atol=0.5",
    )
    assert both["probe_atol"] == 0.5 and "probe_dtype" not in both


@pytest.mark.parametrize("native", [False, True])
def test_a_bfloat16_learner_on_a_cpu_that_emulates_it_is_warned_of_before_any_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], native: bool
) -> None:
    """On a CPU without AVX-512 BF16 or AMX, bfloat16 is emulated (measured 23x slower than float32):
    the plan says so on stderr, and only there and then (teamrl.learner.cpu reads /proc/cpuinfo)."""
    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args
    from teamrl.learner import cpu

    monkeypatch.setattr(cpu, "native_bfloat16", lambda cpuinfo="": native)
    model = fake_model(tmp_path / "m", modules=("q_proj", "v_proj"))
    argv = ["--workflow", "addition-duo", "--model", str(model)]
    for extra, warned in (([], False), (["--set", "learner.dtype=bfloat16"], not native)):
        plan(parse_args(argv + extra, "teamrl run", None, str(tmp_path / "run")), build=False)
        assert ("23x slower" in capsys.readouterr().err) == warned, extra


def test_a_balanced_verdict_reward_under_std_scaled_advantages_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``balance_verdicts`` with advantages divided by each group's std (which undoes the balance,
    tests/unit/learner/test_advantage_std.py): said on stderr before any process; not when centred."""
    import json

    import tomli_w

    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args
    from teamrl.rollout.workflows import BUILTIN

    model = fake_model(tmp_path / "m", modules=("q_proj", "v_proj"))
    data = json.loads(json.dumps(BUILTIN["addition-trio"]))
    verdicts = {"reward": "addition", "verifier_role": "verifier", "accept": "^1", "reject": "^0"}
    data["reward"] = {"name": "outcome", "kwargs": {**verdicts, "balance_verdicts": True}}
    balanced = tmp_path / "balanced.toml"
    balanced.write_text(tomli_w.dumps(data))
    for workflow, extra, warned in (
        ("addition-trio", [], False),
        (str(balanced), [], True),
        (str(balanced), ["--set", "learner.advantage_std=false"], False),
        (str(balanced), ["--set", "learner.algorithm=dr_grpo"], False),
    ):
        argv = ["--workflow", workflow, "--model", str(model), *extra]
        plan(parse_args(argv, "teamrl run", None, str(tmp_path / "run")), build=False)
        assert ("undoes the balance" in capsys.readouterr().err) == warned, (workflow, extra)


def test_a_workflow_that_waits_on_the_world_keeps_two_steps_of_groups_in_flight(tmp_path: Path) -> None:
    """With a reward or tool latency, the plan keeps two steps' groups in flight per rollout (the
    waiting ones would otherwise hold every slot); without, one step's."""
    import json

    import tomli_w

    from teamrl.cli.plan import plan
    from teamrl.cli.run import parse_args
    from teamrl.rollout.workflows import BUILTIN

    model = fake_model(tmp_path / "m", modules=("q_proj", "v_proj"))
    data = json.loads(json.dumps(BUILTIN["addition-duo"]))
    data["reward"]["latency_s"] = 0.5
    slow = tmp_path / "slow.toml"
    slow.write_text(tomli_w.dumps(data))

    def in_flight(workflow: str) -> int:
        argv = ["--workflow", workflow, "--model", str(model), "--tasks-per-step", "4"]
        return plan(parse_args(argv, "teamrl run", None, str(tmp_path / "run")), build=False).config[
            "rollout"
        ]["groups_in_flight"]

    assert in_flight("addition-duo") == 4
    assert in_flight(str(slow)) == 8
