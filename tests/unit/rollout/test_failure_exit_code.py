"""Which episode failures end a rollout service, and with which exit code
(teamrl.rollout.service.failure_exit_code; docs/reliability.md, R-kill-rollout)."""

from __future__ import annotations

import pytest

from teamrl.rollout.service import failure_exit_code


def test_a_request_vllm_refuses_is_a_config_error_and_a_dead_engine_a_restart() -> None:
    from vllm import SamplingParams
    from vllm.v1.engine.exceptions import EngineDeadError

    with pytest.raises(Exception) as refused:  # what a verifier at temperature 3 met on every request
        SamplingParams(temperature=3.0)
    rc, why = failure_exit_code(refused.value)
    assert rc == 2 and "config error" in why  # teamrl run's CONFIG_RC: stopped, not restarted
    assert failure_exit_code(EngineDeadError())[0] == 3
    for one_episode in (ValueError("a reward failed"), TimeoutError("a tool"), KeyError("answer")):
        assert failure_exit_code(one_episode) == (0, "")


def test_the_config_exit_code_is_the_one_the_launcher_does_not_restart() -> None:
    from teamrl.cli.run_async import CONFIG_RC

    assert CONFIG_RC == 2
