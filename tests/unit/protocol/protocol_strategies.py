"""Hypothesis strategies for protocol tests: structurally valid trajectories of any shape."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from teamrl.protocol import AgentStep, GraphTrajectory, ToolCall

text = st.text(max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
small_int = st.integers(0, 2**31 - 1)


def _i32(xs: list[int]) -> np.ndarray:
    return np.asarray(xs, dtype=np.int32)


@st.composite
def steps(draw: st.DrawFn, index: int) -> AgentStep:
    n_resp = draw(st.integers(0, 8))
    parents = draw(st.lists(st.integers(0, max(index - 1, 0)), max_size=3)) if index else []
    return AgentStep(
        agent_id=draw(text),
        role=draw(text),
        model_id=draw(text),
        adapter=draw(text),
        policy_version=draw(st.integers(0, 2**62)),
        turn=draw(small_int),
        parents=_i32(parents),
        prompt_ids=_i32(draw(st.lists(small_int, max_size=8))),
        response_ids=_i32(draw(st.lists(small_int, min_size=n_resp, max_size=n_resp))),
        logprobs=np.asarray(
            draw(st.lists(st.floats(-1e6, 0, allow_nan=False, width=32), min_size=n_resp, max_size=n_resp)),
            dtype=np.float32,
        ),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        reward=draw(finite),
        response_text=draw(st.text(max_size=30)),
        tool_calls=draw(st.lists(st.builds(ToolCall, text, text, text), max_size=2)),
        t_start=draw(finite),
        t_end=draw(finite),
    )


@st.composite
def trajectories(draw: st.DrawFn) -> GraphTrajectory:
    n_steps = draw(st.integers(0, 5))
    return GraphTrajectory(
        episode_id=draw(text),
        incarnation=draw(text),
        seq=draw(st.integers(0, 2**62)),
        task_id=draw(text),
        group_id=draw(text),
        workflow=draw(text),
        steps=[draw(steps(i)) for i in range(n_steps)],
        reward=draw(finite),
        turn_rewards=np.asarray(
            draw(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), max_size=4)), dtype=np.float32
        ),
        metadata=draw(st.dictionaries(text, text, max_size=3)),
    )


def assert_same(a: GraphTrajectory, b: GraphTrajectory) -> None:
    """Field-by-field equality (dataclass == does not compare numpy arrays)."""
    for name in ("episode_id", "incarnation", "seq", "task_id", "group_id", "workflow", "reward", "metadata"):
        assert getattr(a, name) == getattr(b, name), name
    np.testing.assert_array_equal(a.turn_rewards, b.turn_rewards)
    assert len(a.steps) == len(b.steps)
    for x, y in zip(a.steps, b.steps, strict=True):
        for name in ("agent_id", "role", "model_id", "adapter", "policy_version", "turn", "finish_reason"):
            assert getattr(x, name) == getattr(y, name), name
        for name in ("reward", "response_text", "tool_calls", "t_start", "t_end"):
            assert getattr(x, name) == getattr(y, name), name
        for name in ("parents", "prompt_ids", "response_ids", "logprobs"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
