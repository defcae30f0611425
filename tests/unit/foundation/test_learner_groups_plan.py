"""A team of different models is planned as one learner group per base model before anything starts
(docs/teams.md): the plan's bases, the [groups.<id>] tables and the learner's
``--group`` view of them, the services and their wiring, and every refusal, in well under a second."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_team_plan import fake_model

from teamrl.cli.plan import PlanError, learner_ranks, learner_table, plan
from teamrl.cli.run import parse_args
from teamrl.cli.run_async import Wiring, plan_services
from teamrl.learner.config import LearnerConfigError, load_learner_config
from teamrl.rollout.spec import WorkflowError
from teamrl.rollout.team import plan_team

HETERO = "addition-duo-hetero"  # solver on embedded-v1 (Qwen2), verifier on embedded-llama


def _folders(tmp_path: Path) -> dict[str, Path]:
    return {
        "embedded-v1": fake_model(tmp_path / "qwen"),
        "embedded-llama": fake_model(tmp_path / "llama", modules=("q_proj", "v_proj")),
    }


def _args(tmp_path: Path, *extra: str):
    dirs = _folders(tmp_path)
    argv = [
        "--workflow",
        HETERO,
        "--steps",
        "3",
        *(a for m, d in dirs.items() for a in ("--model", f"{m}={d}")),
    ]
    return parse_args([*argv, *extra], "teamrl run", None, str(tmp_path / "run"))


def test_each_base_model_is_planned_as_its_own_group_with_its_adapters_targets_and_probe(
    tmp_path: Path,
) -> None:
    dirs = _folders(tmp_path)
    team = plan_team(HETERO, dirs)
    assert list(team.bases) == ["embedded-v1", "embedded-llama"]
    solver, verifier = team.bases.values()
    assert (solver.agents, solver.adapters) == (["solver"], {"solver-lora": 8})
    assert (verifier.agents, verifier.adapters) == (["verifier"], {"verifier-lora": 8})
    assert verifier.model_dir == dirs["embedded-llama"] and verifier.target_modules == ["q_proj", "v_proj"]
    assert solver.probe_prompt != verifier.probe_prompt  # each base probes its own agent's prompt
    with pytest.raises(WorkflowError, match=r"2 base models \(embedded-v1, embedded-llama\)"):
        team.model_dir  # noqa: B018  (a one-base attribute of a team of two)
    assert "base embedded-llama at" in team.summary()


def test_a_model_without_a_folder_or_a_folder_for_no_model_is_refused_naming_it(tmp_path: Path) -> None:
    dirs = _folders(tmp_path)
    with pytest.raises(
        WorkflowError, match=r"no model folder for 'embedded-llama' \(agents \['verifier'\]\)"
    ):
        plan_team(HETERO, {"embedded-v1": dirs["embedded-v1"]})
    with pytest.raises(WorkflowError, match=r"folders given for \['other'\]"):
        plan_team(HETERO, {**dirs, "other": dirs["embedded-v1"]})
    with pytest.raises(WorkflowError, match=r"model 'embedded-llama': folder .* has no config.json"):
        plan_team(HETERO, {**dirs, "embedded-llama": tmp_path / "nowhere"})


def test_the_run_plan_has_a_learner_table_per_group_and_a_rollout_engine_per_model(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    p = plan(_args(tmp_path, "--set", "groups.embedded-llama.lr=7e-4"), build=False)
    assert time.perf_counter() - t0 < 1.0
    assert p.groups == ["embedded-v1", "embedded-llama"]
    solver, verifier = (p.learner_table(g) for g in p.groups)
    assert (solver["group"], solver["group_agents"], solver["adapters"]) == (
        "embedded-v1",
        ["solver"],
        ["solver-lora"],
    )
    assert (verifier["group"], verifier["adapters"]) == ("embedded-llama", ["verifier-lora"])
    assert verifier["lr"] == 7e-4 and solver["lr"] != 7e-4  # a group's own setting over the shared one
    assert verifier["batch_size"] == solver["batch_size"]  # shared [learner] settings reach each group
    models = p.config["rollout"]["models"]
    assert set(models) == {"embedded-v1", "embedded-llama"}
    assert models["embedded-llama"]["lora_target_modules"] == ["q_proj", "v_proj"]
    assert json.loads(p.model) == {m: str(d) for m, d in _folders(tmp_path).items()}
    with pytest.raises(PlanError, match=r"groups\.embedded-llama.*lr"):
        plan(_args(tmp_path, "--set", "groups.embedded-llama.lr=-1"), build=False)


def test_learner_ranks_per_group_and_a_group_that_does_not_exist(tmp_path: Path) -> None:
    groups = ["embedded-v1", "embedded-llama"]
    assert learner_ranks(None, groups) == {"embedded-v1": 1, "embedded-llama": 1}
    assert learner_ranks(["2"], groups) == {"embedded-v1": 2, "embedded-llama": 2}
    assert learner_ranks(["embedded-llama=2"], groups) == {"embedded-v1": 1, "embedded-llama": 2}
    assert learner_ranks(3, [""]) == {"": 3}  # a saved run.json of a one-base run
    with pytest.raises(PlanError, match=r"'solver-model' is not a learner group"):
        plan(_args(tmp_path, "--learners", "solver-model=2"), build=False)


def test_the_services_of_two_groups_have_their_own_endpoints_folders_and_rendezvous(tmp_path: Path) -> None:
    args = _args(tmp_path, "--learners", "embedded-llama=2", "--rollouts", "1")
    groups = ["embedded-v1", "embedded-llama"]
    wiring = Wiring.pick(1, groups)
    services = plan_services(args, tmp_path, wiring, 0.0, groups)
    names = [s.name for s in services]
    assert names == [
        "buffer",
        "learner-embedded-v1-0",
        "learner-embedded-llama-0",
        "learner-embedded-llama-1",
        "rollout-0",
    ]
    by = {s.name: s for s in services}
    q, l0, l1, r = (by[n] for n in names[1:])
    assert "RANK" not in q.env and l1.env["WORLD_SIZE"] == "2" and l1.env["RANK"] == "1"
    assert l0.env["MASTER_PORT"] == l1.env["MASTER_PORT"] == str(wiring.ports["rendezvous_embedded-llama"])
    for s, g in ((q, "embedded-v1"), (l0, "embedded-llama")):
        assert s.argv[s.argv.index("--group") + 1] == g
        assert s.argv[s.argv.index("--publish") + 1] == wiring.endpoint(f"publish_{g}")
        assert s.argv[s.argv.index("--run-dir") + 1] == str(tmp_path / "groups" / g)
    weights = [r.argv[i + 1] for i, a in enumerate(r.argv) if a == "--weights"]
    assert weights == [f"{g}={wiring.endpoint(f'publish_{g}')}" for g in groups]
    assert set(wiring.metrics) == {"buffer", "learner_embedded-v1", "learner_embedded-llama", "rollout_0"}


def test_a_resumed_group_tells_rollouts_its_own_current_version(tmp_path: Path) -> None:
    groups = ["embedded-v1", "embedded-llama"]
    d = tmp_path / "groups" / "embedded-llama"
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 4, "version": 5}) + "\n")
    services = plan_services(
        _args(tmp_path, "--rollouts", "1"), tmp_path, Wiring.pick(1, groups), 0.0, groups
    )
    (rollout,) = [s for s in services if s.name.startswith("rollout")]
    assert "models.embedded-llama.start_version=5" in rollout.argv
    assert not any("embedded-v1.start_version" in a for a in rollout.argv)


def test_a_learner_reads_its_group_table_and_refuses_an_unknown_group(tmp_path: Path) -> None:
    from teamrl.cli.plan import config_toml

    p = plan(_args(tmp_path), build=False)
    path = tmp_path / "config.toml"
    path.write_text(config_toml(p.config))
    cfg = load_learner_config(path, ["lr=2e-4"], group="embedded-llama")
    assert (cfg.group, cfg.group_agents, cfg.adapters) == ("embedded-llama", ["verifier"], ["verifier-lora"])
    assert cfg.lr == 2e-4 and cfg.base_model == str(_folders(tmp_path)["embedded-llama"])
    assert learner_table(p.config, "embedded-llama")["base_model"] == cfg.base_model
    with pytest.raises(LearnerConfigError, match=r"no \[groups.nobody\] table"):
        load_learner_config(path, group="nobody")
    with pytest.raises(LearnerConfigError, match=r"group = 'embedded-llama' and group_agents = \[\]"):
        load_learner_config(path, ["group_agents=[]"], group="embedded-llama")


def test_sync_mode_refuses_a_team_of_different_models_before_starting_anything(tmp_path: Path) -> None:
    dirs = _folders(tmp_path)
    argv = ["--workflow", HETERO, "--mode", "sync", "--run-dir", str(tmp_path / "r")]
    argv += [a for m, d in dirs.items() for a in ("--model", f"{m}={d}")]
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "teamrl.cli.main", "run", *argv], capture_output=True, text=True
    )
    assert res.returncode == 2 and "--mode sync trains one base model" in res.stderr, res.stderr
    assert time.perf_counter() - t0 < 15.0
    assert not (tmp_path / "r").exists()


def test_teamrl_run_sizes_the_budget_from_lag_step_and_ranks(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "m")
    argv = ["--workflow", "addition-duo", "--model", str(model), "--max-lag", "2", "--tasks-per-step", "4"]
    one = plan(parse_args(argv, "teamrl run", None, "r"), build=False)
    two = plan(parse_args([*argv, "--learners", "2"], "teamrl run", None, "r"), build=False)
    assert one.config["rollout"]["max_groups_per_version"] == 3 * 4
    assert two.config["rollout"]["max_groups_per_version"] == 3 * 4 * 2
    # several rollouts share the budget (more would only be dropped as stale): each its share, rounded up
    three = plan(
        parse_args([*argv, "--rollouts", "3", "--learners", "2"], "teamrl run", None, "r"), build=False
    )
    assert three.config["rollout"]["max_groups_per_version"] == 3 * 4 * 2 // 3


def test_plots_and_show_read_each_groups_metrics(tmp_path: Path) -> None:
    from teamrl.cli.plots import group_metrics, plot_run
    from teamrl.cli.show import load_run

    for g, reward in (("embedded-v1", 0.25), ("embedded-llama", 0.75)):
        d = tmp_path / "groups" / g
        d.mkdir(parents=True)
        rows = [
            {"step": s, "version": s + 1, "time": float(s), "reward_mean": reward, "grad_norm/x": 1.0}
            for s in range(3)
        ]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {g: len(r) for g, r in group_metrics(tmp_path).items()} == {"embedded-llama": 3, "embedded-v1": 3}
    assert all(p.stat().st_size > 1000 for p in plot_run(tmp_path))
    run = load_run(tmp_path)
    assert len(run.metrics) == 3 and any(
        "learner groups: embedded-llama, embedded-v1" in n for n in run.notes
    )


def test_the_run_ends_on_an_evaluation_of_every_groups_final_version() -> None:
    from teamrl.cli.run_async import final_evaluated

    finals = {"embedded-v1": 11, "embedded-llama": 10}
    assert not final_evaluated({"version": 10, "versions": {"embedded-v1": 10, "embedded-llama": 10}}, finals)
    assert final_evaluated({"version": 10, "versions": dict(finals)}, finals)
    assert final_evaluated({"version": 7}, {"": 7}) and not final_evaluated({"version": 6}, {"": 7})


def test_a_credit_judge_on_its_own_model_needs_a_folder_too(tmp_path: Path) -> None:
    """The judge generates, so the rollout serves its model: the plan asks for its folder up front."""
    from test_team_plan import write_workflow

    from teamrl.rollout.workflows import load

    data = load("addition-duo").model_dump(mode="json")
    models = {**data["models"], "judge-model": {"path": ""}}
    path = write_workflow(
        tmp_path / "w.toml", models=models, credit={"rule": "judge", "judge_model": "judge-model"}
    )
    dirs = {"embedded-v1": fake_model(tmp_path / "qwen")}
    with pytest.raises(WorkflowError, match=r"no model folder for 'judge-model'"):
        plan_team(path, dirs)
    team = plan_team(path, {**dirs, "judge-model": fake_model(tmp_path / "judge")})
    assert set(team.model_dirs) == {"embedded-v1", "judge-model"} and list(team.bases) == ["embedded-v1"]


def test_a_group_that_trains_in_bfloat16_publishes_float32_probes(tmp_path: Path) -> None:
    """A group's own ``dtype = bfloat16`` gets float32 probes for its float32 rollouts; the other group,
    in float32, keeps its own log-probs as the probe."""
    p = plan(_args(tmp_path, "--set", "groups.embedded-llama.dtype=bfloat16"), build=False)
    solver, verifier = (p.learner_table(g) for g in p.groups)
    assert verifier["probe_dtype"] == "float32" and "probe_dtype" not in solver
    shared = plan(_args(tmp_path, "--set", "learner.dtype=bfloat16"), build=False)
    assert all(shared.learner_table(g)["probe_dtype"] == "float32" for g in shared.groups)
