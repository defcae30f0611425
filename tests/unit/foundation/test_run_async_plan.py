"""``teamrl run --mode async`` plans its services before starting any (teamrl.cli.run_async): which
processes, with which arguments, ports and environment; nothing is started or written by the plan."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from teamrl.cli.run_async import Wiring, plan_services, signal_exit_code


def _args(**kw) -> argparse.Namespace:
    base = {"learners": 2, "rollouts": 2, "threads_per_service": 1, "tensorboard": False}
    return argparse.Namespace(**(base | kw))


def test_the_plan_names_every_service_with_its_ports_and_rendezvous(tmp_path: Path) -> None:
    wiring = Wiring.pick(rollouts=2)
    services = plan_services(_args(), tmp_path, wiring, t0=123.0)
    assert [s.name for s in services] == ["buffer", "learner-0", "learner-1", "rollout-0", "rollout-1"]
    assert not list(tmp_path.iterdir())  # the plan writes nothing
    buf, l0, l1, r0, r1 = services
    assert buf.argv[:3] == ["buffer", "--config", str(tmp_path / "config.toml")]
    assert wiring.endpoint("data") in buf.argv and wiring.endpoint("sample") in buf.argv
    for rank, s in enumerate((l0, l1)):
        assert s.env["RANK"] == str(rank) and s.env["WORLD_SIZE"] == "2"
        assert s.env["MASTER_PORT"] == str(wiring.ports["rendezvous"])
        assert s.argv[s.argv.index("--publish") + 1] == wiring.endpoint("publish")
    assert l0.argv[l0.argv.index("--metrics-port") + 1] == str(wiring.ports["metrics_learner"])
    assert all(s.env["TEAMRL_RUN_T0"] == "123.0" for s in services)
    assert any("eval_file=" in a for a in r0.argv) and not any("eval_file=" in a for a in r1.argv)
    assert not any("start_version" in a for a in r0.argv)  # a fresh run starts from the base weights
    assert set(wiring.metrics) == {"buffer", "learner", "rollout_0", "rollout_1"}


def test_a_resumed_run_tells_rollouts_to_wait_for_its_current_version(tmp_path: Path) -> None:
    rows = [{"step": 0, "version": 1}, {"step": 1, "version": 2}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    services = plan_services(_args(learners=1, rollouts=1), tmp_path, Wiring.pick(1), t0=0.0)
    (rollout,) = [s for s in services if s.name.startswith("rollout")]
    assert "start_version=2" in rollout.argv
    (learner,) = [s for s in services if s.name.startswith("learner")]
    assert "RANK" not in learner.env  # one rank: a world of one, no rendezvous
    assert "MASTER_PORT" in learner.unset  # nor one inherited from the caller's environment


def test_a_stopped_run_exits_143_after_sigterm_and_130_after_ctrl_c() -> None:
    assert (signal_exit_code("SIGTERM"), signal_exit_code("SIGINT")) == (143, 130)


def test_an_insecure_run_tells_every_service_so(tmp_path: Path) -> None:
    secure = plan_services(_args(), tmp_path, Wiring.pick(2), t0=0.0)
    assert not any("--insecure" in s.argv for s in secure)  # keys in its config: secure by default
    insecure = plan_services(_args(insecure=True), tmp_path, Wiring.pick(2), t0=0.0)
    assert all("--insecure" in s.argv for s in insecure) and len(insecure) == 5
