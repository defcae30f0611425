"""The pipeline model (teamrl.cli.cluster): its rules give the step times they must in the cases
that can be worked out by hand, and ``teamrl cluster costs`` reads a sync run's timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from teamrl.cli.cluster import Costs, Pipeline, simulate
from teamrl.cli.cluster_cmd import main as cluster_main

B = 8  # groups per step


def test_a_rollout_bound_pipeline_steps_at_the_rollouts_pace() -> None:
    c = Costs(group_s=0.05, step_s=0.1, publish_s=0.02, load_s=0.01)
    p = simulate(c, Pipeline(tasks_per_step=B, groups_in_flight=B, steps=12))
    assert p.step_s == pytest.approx(B * 0.05 + 0.01, rel=0.03)  # a batch of compute, then a load
    assert 0.6 < p.learner_idle < 0.8 and p.rollout_idle < 0.05


def test_a_learner_bound_pipeline_steps_at_the_learners_pace_within_the_lag_bound() -> None:
    c = Costs(group_s=0.01, step_s=0.5, publish_s=0.1, load_s=0.01)
    p = simulate(c, Pipeline(tasks_per_step=B, groups_in_flight=B, max_lag=2, steps=12))
    assert p.step_s == pytest.approx(0.6, rel=0.02)
    assert p.learner_idle < 0.02 and p.rollout_idle > 0.5  # the version budget holds the rollout back
    assert 1.0 <= p.lag_mean <= 2.0
    zero = simulate(c, Pipeline(tasks_per_step=B, groups_in_flight=B, max_lag=0, steps=12))
    assert zero.lag_mean == 0.0  # only data of the live version is trained on


def test_world_latency_is_hidden_only_with_more_groups_in_flight_than_a_step_takes() -> None:
    c = Costs(group_s=0.05, step_s=0.1, publish_s=0.02, load_s=0.01, latency_s=0.5)
    same = simulate(c, Pipeline(tasks_per_step=B, groups_in_flight=B, steps=12))
    double = simulate(c, Pipeline(tasks_per_step=B, groups_in_flight=2 * B, steps=12))
    sync = simulate(c, Pipeline(mode="sync", tasks_per_step=B, steps=4))
    assert same.step_s == pytest.approx(B * 0.05 + 0.01 + 0.5, rel=0.03)  # all finish, then all wait
    assert double.step_s < 0.75 * same.step_s
    assert sync.step_s == pytest.approx(B * 0.05 + 0.5 + 0.1 + 0.02 + 0.01, rel=0.02)


def test_stragglers_stretch_a_sync_batch_on_an_engine_that_needs_a_full_batch() -> None:
    even = Costs(group_s=0.05, step_s=0.1, saturation=B)
    tail = Costs(group_s=0.05, step_s=0.1, saturation=B, group_cv=1.0)
    sync = [simulate(c, Pipeline(mode="sync", tasks_per_step=B, steps=10)).step_s for c in (even, tail)]
    assert sync[0] == pytest.approx(0.05 * B + 0.1, rel=0.02)
    assert sync[1] > 1.3 * sync[0]  # the slowest group of each batch runs alone at 1/B of the speed


def test_a_shared_host_slows_services_that_work_at_once() -> None:
    c = Costs(group_s=0.05, step_s=0.4, host_cores=2, demand=1.0)
    alone = simulate(
        Costs(group_s=0.05, step_s=0.4), Pipeline(tasks_per_step=B, groups_in_flight=B, steps=10)
    )
    shared = simulate(c, Pipeline(tasks_per_step=B, groups_in_flight=B, steps=10))
    assert shared.step_s > 1.15 * alone.step_s  # the two sides slow each other where they overlap


def _sync_run(run: Path, steps: int, **args: object) -> None:
    """A ``--mode sync`` run folder of ``steps`` steps whose lane says 0.8 s generating, 0.3 s
    training, 0.05 s export and 0.02 s publish a step."""
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"mode": "sync", "tasks_per_step": 4, **args}))
    (run / "config.toml").write_text('[rollout]\nworkflow = "addition-duo"\ngroups_in_flight = 4\n')
    step = 0.8 + 0.3 + 0.05 + 0.02
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "time": i * step}) + "\n" for i in range(steps))
    )
    t, recs = 0.0, []
    for state, d in [("generating", 0.8), ("training", 0.3), ("export", 0.05), ("publish", 0.02)] * steps:
        recs.append({"service": "sync", "replica": "0", "state": state, "t0": t, "t1": t + d})
        t += d
    (run / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_costs_are_read_from_a_sync_runs_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _sync_run(run, 2)
    assert cluster_main(["costs", str(run)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["group_s"] == pytest.approx(0.2) and got["step_s"] == pytest.approx(0.3)
    assert got["publish_s"] == pytest.approx(0.05) and got["load_s"] == pytest.approx(0.02)


def test_check_prints_predicted_against_measured_per_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``teamrl cluster check`` reads each run's flags, predicts it from the sync run's costs and
    prints the error; a sync run predicted from its own costs is within a few percent."""
    run = tmp_path / "sync"
    _sync_run(run, 4, max_lag=2)
    assert cluster_main(["check", "--costs", str(run), "--demand", "1", "--group-cv", "0", str(run)]) == 0
    out = capsys.readouterr().out
    assert "sync" in out.splitlines()[-2]
    assert float(out.rsplit("cluster_check_max_abs_error=", 1)[1]) < 0.05
