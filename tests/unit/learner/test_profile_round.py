"""LangMARL wired end to end, without a GPU or vLLM: learner round -> store -> ZeroMQ -> rollout workflow.

The judge here is scripted (this test is about the wiring, not about a model's prose); the real
judge (``judge_from_engine``) is exercised by the learner service test on the embedded model,
where it must fail cleanly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from teamrl.learner.profile_round import ProfileRound
from teamrl.protocol.trajectory import AgentStep, GraphTrajectory
from teamrl.protocol.zmq_transport import WeightsPublisher, WeightsSubscriber
from teamrl.rewards.profiles import PROPOSALS_REJECTED, apply_profiles
from teamrl.rollout.workflows import load


def _episode(i: int, reward: float) -> GraphTrajectory:
    steps = []
    for k, agent in enumerate(("planner", "solver")):
        steps.append(
            AgentStep(
                agent_id=agent,
                role=agent,
                model_id="m",
                adapter=f"{agent}-lora",
                policy_version=0,
                turn=0,
                parents=np.asarray([0] if k else [], np.int32),
                prompt_ids=np.asarray([1, 2], np.int32),
                response_ids=np.asarray([3], np.int32),
                logprobs=np.asarray([-1.0], np.float32),
                reward=reward,
                response_text=f"{agent} says {i}",
            )
        )
    return GraphTrajectory(
        f"e{i}", "inc", i, "t", "g", "math-duo", steps, reward=reward, metadata={"task": f"2+{i}=?"}
    )


BATCH = [_episode(i, float(i % 2)) for i in range(6)]  # successes and failures for both agents
MATH_DUO_PROFILES = load("math-duo").profiles()  # what `teamrl run` passes as [learner] profiles


def test_a_round_stores_announces_and_a_rollout_workflow_adopts_the_profiles(tmp_path: Path) -> None:
    seen: list[str] = []

    def judge(prompt: str) -> str:
        seen.append(prompt)
        return "<summary>It skipped the check.</summary>\n<profile>\nCheck every step twice.\n</profile>"

    rounds = ProfileRound(tmp_path / "profiles", judge, interval=2, initial=MATH_DUO_PROFILES, fsync=False)
    assert rounds.maybe_run(1, BATCH) is None and not seen  # not a round step
    msg = rounds.maybe_run(2, BATCH)
    assert msg is not None and msg.version == 1 and len(seen) == 2  # one judge call per agent
    assert set(msg.profiles) == {"planner", "solver"}
    assert msg.profiles["solver"] == "Check every step twice."
    assert "solver says" in "".join(seen)  # the judge read the agents' messages
    stored = json.loads((tmp_path / "profiles" / "v00000001.json").read_text())
    assert stored["profiles"] == msg.profiles
    assert (tmp_path / "profiles" / "v00000000.json").is_file()  # the workflow's own, as v0

    pub = WeightsPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    sub = WeightsSubscriber(pub.pub_endpoint, pub.latest_endpoint)
    try:
        time.sleep(0.3)
        pub.publish_profiles(msg)
        deadline = time.time() + 5
        while (got := sub.take_profiles()) is None and time.time() < deadline:
            sub.poll(200)
        assert got is not None and got.version == 1
        wf = load("math-duo")
        profiles = apply_profiles(wf.profiles(), got, have_version=-1)
        new = wf.with_profiles(profiles)
        assert {a.id: a.profile for a in new.agents}["solver"] == "Check every step twice."
        assert sub.latest_profiles().version == 1  # a rollout started later gets it too
    finally:
        sub.close()
        pub.close()


def test_a_failing_or_unparsable_judge_keeps_the_profiles_and_training_goes_on(tmp_path: Path) -> None:
    def broken(prompt: str) -> str:
        raise RuntimeError("judge model is down")

    before = PROPOSALS_REJECTED.labels(reason="judge_error")._value.get()
    rounds = ProfileRound(tmp_path / "p", broken, interval=1, initial=MATH_DUO_PROFILES, fsync=False)
    assert rounds.maybe_run(1, BATCH) is None
    assert PROPOSALS_REJECTED.labels(reason="judge_error")._value.get() == before + 2
    assert rounds.latest().version == 0  # v0 only: the workflow's own profiles

    rounds = ProfileRound(
        tmp_path / "q", lambda p: "no tags at all", interval=1, initial=MATH_DUO_PROFILES, fsync=False
    )
    assert rounds.maybe_run(1, BATCH) is None and rounds.failures == 0

    rounds = ProfileRound(tmp_path / "r", lambda p: "x", interval=1, workflow="no-such-workflow", fsync=False)
    assert rounds.maybe_run(1, BATCH) is None and rounds.failures == 1  # logged and counted, no raise


def test_profiles_alone_needs_a_profile_interval() -> None:
    import pytest
    from pydantic import ValidationError

    from teamrl.learner.config import LearnerConfig

    need = {"adapters": ["planner-lora"], "probe_prompt": [1, 2], "probe_completion": [3]}  # no defaults
    with pytest.raises(ValidationError, match="trains nothing"):
        LearnerConfig(train_weights=False, **need)
    with pytest.raises(ValidationError, match="needs profiles"):
        LearnerConfig(train_weights=False, profile_interval=3, **need)
    cfg = LearnerConfig(train_weights=False, profile_interval=3, profiles=load("math-duo").profiles(), **need)
    assert cfg.profile_interval == 3 and not cfg.train_weights


def test_the_judge_answer_is_begun_with_the_profile_block_and_closed_at_end_of_text(monkeypatch) -> None:
    """``judge_from_engine(prefill=True)``: the chat's assistant turn starts with ``<profile>``, the
    sampled text follows, and an answer that ended at end of text is closed with ``</profile>``; one cut
    at the token budget is left open (unparsable). Engine and tokenizer are stand-ins: the test is
    about the prefill, not a model (the real one: docs/real-model.md, tests/bench/profile_evolution.py)."""
    import teamrl.rewards.tokenizer as tokmod
    from teamrl.learner.profile_round import judge_from_engine
    from teamrl.rewards.profile_answer import parse_profile_answer

    class Tok:
        eos_token_id = 0

        def chat(self, messages):
            return [7, 7]

        def encode(self, text, *, add_special=True):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids if i)

    class Engine:
        def __init__(self, reply):
            self.reply, self.seen = reply, None

        def sample(self, adapter, prompts, max_new_tokens, eos_id, gen, temperature=None):
            self.seen = (prompts[0], temperature)
            return [(self.reply, [0.0] * len(self.reply))]

    monkeypatch.setattr(tokmod, "tokenizer_for", lambda folder: Tok())
    done = Engine([ord(c) for c in "You add carefully."] + [0])
    answer = judge_from_engine(done, "m", 32, temperature=0.7, prefill=True)("revise")
    assert done.seen == ([7, 7, *[ord(c) for c in "<profile>\n"]], 0.7)
    assert parse_profile_answer(answer)[0] == "You add carefully."
    cut = Engine([ord(c) for c in "You add and add and"])  # no end of text: the budget ran out
    assert "</profile>" not in judge_from_engine(cut, "m", 32, prefill=True)("revise")
