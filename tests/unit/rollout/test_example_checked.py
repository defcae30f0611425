"""The shipped addition-{duo,trio}-checked workflows (docs/verifier-learning.md): they load by name,
their verifier reads the candidate first and has room for a worked check, the trio routes back on a
rejecting check only, and a worked check's verdict is scored as the verdict it ends with."""

from __future__ import annotations

import re

import pytest

from teamrl.rewards import addition
from teamrl.rollout.workflows import load_workflow


@pytest.mark.parametrize("name", ["addition-duo-checked", "addition-trio-checked"])
def test_the_example_loads_with_a_checker_of_its_own(name: str) -> None:
    wf = load_workflow(name, max_lora_rank=16)
    agents = {a.id: a for a in wf.agents}
    assert wf.name == name
    assert (agents["solver"].model, agents["verifier"].model) == ("embedded-v1", "checker")
    assert (wf.models["embedded-v1"].path, wf.models["checker"].path) == ("embedded", "embedded-checker")
    assert agents["verifier"].template == "V{out[solver]}?{task[question]}"
    assert agents["verifier"].sampling.max_tokens >= len("052==R0;")


def test_the_trio_routes_back_on_a_rejecting_check() -> None:
    wf = load_workflow("addition-trio-checked", max_lora_rank=16)
    (back,) = [r for r in wf.graph.routes if r.after == "verifier" and r.next == "solver"]
    rejects = re.compile(back.when)
    assert rejects.search("052==R0;") and rejects.search("0;") and rejects.search("052==R0")
    assert not rejects.search("052===1;") and not rejects.search("1;") and not rejects.search("100===1;")


def test_a_worked_check_is_scored_by_its_verdict() -> None:
    task = addition.make_task(7, 45)  # 052
    assert addition.verifier_verdict("052==R0;") is False
    assert addition.verifier_verdict("052===1;") is True
    assert addition.verifier_verdict("1;") is True and addition.verifier_verdict("0;") is False
    assert addition.verifier_verdict("05") is None and addition.verifier_verdict(";1") is None
    assert addition.verifier_reward(task, "058", "052==R0;") == 1.0  # rejects a wrong candidate
    assert addition.verifier_reward(task, "052", "052==R0;") == 0.0  # rejects a right one
    assert addition.verifier_reward(task, "052", "052===1;") == 1.0


def test_the_checker_is_trained_on_the_format_the_workflow_prompts_with() -> None:
    import random

    task = addition.make_task(7, 45)
    assert addition.check_prompt(task, "058") == "V058?07+45="
    assert addition.check_response(task, "058") == "052==R0;"
    assert addition.check_response(task, "052") == "052===1;"
    pairs = addition.check_examples(random.Random(0), [task], 400)
    checks = [(p, r) for p, r in pairs if p.startswith("V")]
    assert 120 < len(checks) < 280
    assert all(r == addition.check_response(task, p[1:4]) for p, r in checks)
    verdicts = [addition.verifier_verdict(r) for _, r in checks]
    assert 0.3 < sum(verdicts) / len(verdicts) < 0.7  # right half the time, else a near miss
