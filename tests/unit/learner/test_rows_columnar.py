"""Columnar rows: tensors gathered from the Arrow buffers equal the rows read step by step from
Python trajectories, over several decoded frames, foreign adapters and empty responses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from teamrl.learner.rows import StepColumns, build_rows, trajectory_objects
from teamrl.protocol.codec import decode_batches, encode_trajectories_buffer
from teamrl.protocol.examples import example_trajectories

TRAINED = ["solver-lora", "critic-lora"]


def _sample():
    a = example_trajectories(5, seed=3, tokens=24)
    b = example_trajectories(4, seed=4, tokens=24)
    a[1].steps[0].response_ids = np.zeros(0, np.int32)  # an empty response: counted, left out
    a[1].steps[0].logprobs = np.zeros(0, np.float32)
    b[2].group_id = a[0].group_id  # one group across the two frames
    frames = [encode_trajectories_buffer(a), encode_trajectories_buffer(b)]
    return a + b, [batch for f in frames for batch in decode_batches(f)]


def _reference(trajs, reward_source):
    """The rows read one step at a time from the objects: the meaning build_rows must keep."""
    rows, groups, agents = [], {}, {}
    for ti, t in enumerate(trajs):
        g = groups.setdefault(t.group_id, len(groups))
        for s in t.steps:
            if s.adapter in TRAINED and len(s.response_ids):
                reward = s.reward if reward_source == "step" else t.reward
                rows.append((s, g, agents.setdefault(s.agent_id, len(agents)), ti, reward))
    return rows


@pytest.mark.parametrize("reward_source", ["step", "trajectory"])
def test_columnar_rows_equal_the_rows_read_step_by_step(reward_source):
    trajs, batches = _sample()
    batch, ignored = build_rows(batches, TRAINED, reward_source)
    ref = _reference(trajs, reward_source)
    assert batch.n_rows == len(ref) and batch.n_traj == len(trajs) == sum(len(b) for b in batches)
    n_steps = sum(len(t.steps) for t in trajs)
    assert ignored["empty_response"] == 1
    assert ignored["foreign_adapter"] == n_steps - len(ref) - 1
    for i, (s, g, a, ti, reward) in enumerate(ref):
        p, r = len(s.prompt_ids), len(s.response_ids)
        seq = np.concatenate([s.prompt_ids, s.response_ids])
        assert batch.input_ids[i, : p + r].tolist() == seq.tolist()
        assert not batch.input_ids[i, p + r :].any() and batch.attention_mask[i].sum() == p + r
        assert batch.response_ids[i, :r].tolist() == s.response_ids.tolist()
        assert torch.equal(batch.behav_logp[i, :r], torch.from_numpy(np.asarray(s.logprobs, np.float32)))
        assert batch.resp_mask[i].sum() == r and batch.prompt_lens[i] == p and batch.resp_lens[i] == r
        assert batch.rewards[i] == torch.tensor(reward, dtype=torch.float32)
        assert (batch.group_idx[i], batch.agent_idx[i], batch.traj_idx[i]) == (g, a, ti)
        assert (batch.versions[i], batch.turn_idx[i]) == (s.policy_version, s.turn)
        assert (batch.adapter_of_row[i], batch.agent_of_row[i]) == (s.adapter, s.agent_id)
    assert batch.team_rewards == [t.reward for t in trajs]
    objects, _ = build_rows(trajs, TRAINED, reward_source)  # in-process objects: the same rows
    for name in ("input_ids", "attention_mask", "behav_logp", "rewards", "group_idx", "agent_idx"):
        assert torch.equal(getattr(objects, name), getattr(batch, name)), name


def test_step_columns_give_the_per_step_metrics():
    trajs, batches = _sample()
    cols = StepColumns.of(batches)
    steps = [s for t in trajs for s in t.steps]
    assert cols.policy_version.tolist() == [s.policy_version for s in steps]
    by_agent: dict[str, list[float]] = {}
    for s in steps:
        by_agent.setdefault(s.agent_id, []).append(s.reward)
    got = cols.mean_reward_by_agent()
    assert got.keys() == by_agent.keys()
    for agent, values in by_agent.items():
        assert got[agent] == pytest.approx(sum(values) / len(values))
    assert cols.traj_reward.tolist() == [t.reward for t in trajs]
    one = steps[0].agent_id  # a learner group's own steps: their versions only
    assert cols.versions_of([one]).tolist() == [s.policy_version for s in steps if s.agent_id == one]
    assert cols.versions_of(None).tolist() == cols.policy_version.tolist()
    assert [t.episode_id for t in trajectory_objects(batches)] == [t.episode_id for t in trajs]
