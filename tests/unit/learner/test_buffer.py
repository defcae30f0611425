"""ReplayBuffer core in-process: admission, staleness, groups, Reverb rate limiting, samplers, rank
sharding and persistence (segments + checkpoints whose DONE marker decides whether they count)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from teamrl.learner import buffer as B
from teamrl.learner.buffer import Refused, ReplayBuffer, Sample
from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_segments import SegmentStore
from teamrl.protocol.codec import decode_batches, decode_trajectories, encode_trajectories
from teamrl.protocol.examples import example_trajectories
from teamrl.protocol.trajectory import GraphTrajectory


def trajs(
    n: int,
    *,
    version: int = 0,
    group: str | None = None,
    rewards: list[float] | None = None,
    seed: int = 0,
    start: int = 0,
) -> list[GraphTrajectory]:
    """``n`` small trajectories, every step at ``version``; own group each unless ``group`` given."""
    out = example_trajectories(n, seed, tokens=8, turns=1)
    for i, t in enumerate(out):
        t.episode_id = f"ep-{seed}-{start + i}"
        t.group_id = group if group is not None else f"g-{seed}-{start + i}"
        t.reward = rewards[i] if rewards is not None else 0.0
        for s in t.steps:
            s.policy_version = version
    return out


def make(**kw) -> ReplayBuffer:
    base = {"max_policy_lag": None}  # with versions_from_data: the in-process rule these tests are about
    base.update(kw)
    return ReplayBuffer(BufferConfig(**base), versions_from_data=True)


def ids(sample: Sample | Refused) -> list[str]:
    assert isinstance(sample, Sample), sample
    return [t.episode_id for t in sample.trajectories]


def counter(metric, **labels) -> float:
    m = metric.labels(**labels) if labels else metric
    return m._value.get()


# --- admission ----------------------------------------------------------------------------------


def test_insert_admits_counts_and_dedups_by_source():
    buf = make()
    before = counter(B.INSERTED)
    res = buf.insert(trajs(3), source=("inc-a", 0))
    assert [k for k, _ in res.accepted] == [0, 1, 2]
    assert buf.size == 3 and buf.inserted == 3
    assert counter(B.INSERTED) - before == 3
    assert sum(buf.per_agent().values()) == sum(len(r.trajectory().steps) for _, r in res.accepted)
    dups = counter(B.DUPLICATES)
    again = buf.insert(trajs(3), source=("inc-a", 0))
    assert again.duplicate and not again.accepted and buf.size == 3
    assert buf.duplicates == 1 and counter(B.DUPLICATES) - dups == 1
    buf.insert(trajs(1, seed=1), source=("inc-a", 1))
    assert buf.seen() == {"inc-a": [0, 1]}


def test_stale_trajectories_are_dropped_and_counted():
    buf = make(max_policy_lag=4)
    buf.insert(trajs(1, version=10))
    before = counter(B.REJECTED, reason="stale")
    res = buf.insert(trajs(2, version=5, seed=1) + trajs(1, version=6, seed=2))
    assert res.stale == 2 and len(res.accepted) == 1  # lag 5 > 4 refused, lag 4 kept
    assert buf.rejected["stale"] == 2 and counter(B.REJECTED, reason="stale") - before == 2
    assert buf.current_version == 10


def test_one_trajectory_spanning_too_many_versions_is_stale():
    buf = make(max_policy_lag=2)
    (t,) = trajs(1)
    for i, s in enumerate(t.steps):
        s.policy_version = 3 * i
    assert buf.insert([t]).stale == (1 if len(t.steps) > 1 else 0)


def test_steps_on_base_weights_never_make_a_trajectory_stale():
    """A step sampled without an adapter records version 0 however late it ran, and no update changes
    its policy: only the trained steps' versions lag (``buffer_items.item_versions``). Before, a team
    with a base-weights planner and solver beside a trained verifier had every episode dropped once the
    learner passed version max_policy_lag + 1."""
    buf = make(max_policy_lag=1)
    buf.insert(trajs(1, version=3))
    (late,) = trajs(1, version=3, seed=1)
    (old,) = trajs(1, version=1, seed=2)
    for t in (late, old):
        for s in t.steps[1:]:  # the critic and the judge act on base weights
            s.adapter, s.policy_version = "", 0
    res = buf.insert([late, old])
    assert res.stale == 1 and [r.episode_id for _, r in res.accepted] == ["ep-1-0"]  # old: its solver lags 2
    out = buf.sample(2, min_policy_version=2)  # and the sample-time sweep judges it the same way
    assert ids(out) == ["ep-0-0", "ep-1-0"] and buf.evicted["stale"] == 0
    (untrained,) = trajs(1, version=0, seed=3)
    for s in untrained.steps:
        s.adapter = ""
    assert buf.insert([untrained]).stale == 1  # no trained step: judged by all its steps, as before


def test_downweight_keeps_stale_data_with_a_smaller_weight():
    buf = make(max_policy_lag=2, stale_action="downweight", stale_decay=0.5)
    buf.insert(trajs(1, version=10))
    buf.insert(trajs(1, version=5, seed=1))  # lag 5 = 3 beyond the bound
    assert buf.size == 2
    out = buf.sample(2)
    assert isinstance(out, Sample)
    assert sorted(out.weights) == [0.125, 1.0]


def test_learner_hint_raises_the_version_and_evicts_older_items():
    buf = make(max_policy_lag=4)
    buf.insert(trajs(2, version=3))
    buf.insert(trajs(2, version=8, seed=1))
    before = counter(B.EVICTED, reason="stale")
    out = buf.sample(4, min_policy_version=6)
    assert ids(out) == ["ep-1-0", "ep-1-1"]
    assert buf.current_version == 10 and buf.evicted["stale"] == 2
    assert counter(B.EVICTED, reason="stale") - before == 2


def test_capacity_evicts_the_oldest():
    buf = make(capacity=3)
    buf.insert(trajs(5))
    assert buf.size == 3 and buf.evicted["capacity"] == 2
    assert ids(buf.sample(3)) == ["ep-0-2", "ep-0-3", "ep-0-4"]


# --- groups -------------------------------------------------------------------------------------


def test_group_is_held_back_until_complete_and_sampled_whole():
    buf = make(group_size=3)
    buf.insert(trajs(2, group="A"), now=0.0)
    buf.insert(trajs(1, group="B", seed=1), now=0.0)
    assert buf.size == 0 and buf.pending_groups == 2
    assert isinstance(buf.sample(1), Refused)
    buf.insert(trajs(1, group="A", seed=2), now=1.0)
    assert buf.size == 3 and buf.pending_groups == 1
    out = buf.sample(2)  # rounds up to the whole group of 3
    assert sorted(ids(out)) == ["ep-0-0", "ep-0-1", "ep-2-0"]
    assert {t.group_id for t in out.trajectories} == {"A"}


def test_incomplete_group_is_released_after_its_timeout():
    buf = make(group_size=4, group_timeout_s=10)
    buf.insert(trajs(2, group="A"), now=100.0)
    before = counter(B.GROUPS_TIMED_OUT)
    assert buf.expire_groups(109.0) == 0 and buf.size == 0
    assert buf.expire_groups(110.0) == 1
    assert buf.size == 2 and buf.groups_timed_out == 1 and buf.pending_groups == 0
    assert counter(B.GROUPS_TIMED_OUT) - before == 1


def test_too_many_pending_groups_releases_the_oldest():
    buf = make(group_size=2, max_pending_groups=2)
    for i, g in enumerate("ABC"):
        buf.insert(trajs(1, group=g, seed=i))
    assert buf.pending_groups == 2 and buf.size == 1 and buf.groups_timed_out == 1
    assert ids(buf.sample(1)) == ["ep-0-0"]


def test_batches_are_whole_groups_never_split():
    buf = make(group_size=2)
    for i, g in enumerate("ABCD"):
        buf.insert(trajs(2, group=g, seed=i))
    out = buf.sample(5)  # two groups of 2 fit, a third would exceed 5
    assert isinstance(out, Sample) and len(out.trajectories) == 4
    assert [t.group_id for t in out.trajectories] == ["A", "A", "B", "B"]


# --- rate limiting ------------------------------------------------------------------------------


def test_min_size_blocks_sampling():
    buf = make(min_size=3)
    buf.insert(trajs(2))
    out = buf.sample(1)
    assert isinstance(out, Refused) and out.reason == "not_enough_data"
    buf.insert(trajs(1, seed=1))
    assert isinstance(buf.sample(1), Sample)


def test_samples_per_insert_keeps_the_ratio_within_its_error_buffer():
    # Reverb: diff = inserts * spi - samples must stay in [min*spi - eb, min*spi + eb] = [-4, 12].
    buf = make(min_size=4, samples_per_insert=1.0, error_buffer=8.0, max_times_sampled=0)
    buf.insert(trajs(4))
    got = 0
    while isinstance(out := buf.sample(1), Sample):
        got += 1
    assert out.reason == "rate_limited"
    assert got == 8 and buf.limiter.diff == -4  # 4 inserts, 8 samples
    assert isinstance(buf.sample(1), Refused)
    buf.insert(trajs(1, seed=1))
    assert isinstance(buf.sample(1), Sample)
    # Inserts too far ahead of samples must wait (the service stops reading frames).
    while buf.can_insert():
        buf.insert(trajs(1, seed=2))
    assert buf.limiter.diff + 1 > buf.limiter.max_diff
    assert buf.limiter.diff <= buf.limiter.max_diff


def test_a_batch_over_the_ratio_is_refused_whole():
    buf = make(min_size=2, samples_per_insert=1.0, error_buffer=1.0, max_times_sampled=0)
    buf.insert(trajs(2))
    out = buf.sample(5)  # 2 samples would leave diff 0 < 2 * 1 - 1
    assert isinstance(out, Refused) and out.reason == "rate_limited"
    assert buf.sampled == 0 and buf.limiter.samples == 0
    assert len(ids(buf.sample(1))) == 1


def test_config_builds_a_buffer_without_a_file():
    cfg = BufferConfig(capacity=10, sampler="uniform", min_size=2, max_policy_lag=None)
    buf = ReplayBuffer(cfg)
    assert buf.capacity == 10 and buf.sampler == "uniform" and buf.limiter.min_size == 2


# --- samplers -----------------------------------------------------------------------------------


def test_fifo_hands_out_oldest_first_each_once():
    buf = make()
    buf.insert(trajs(6))
    assert ids(buf.sample(4)) == [f"ep-0-{i}" for i in range(4)]
    assert ids(buf.sample(4)) == ["ep-0-4", "ep-0-5"]
    assert buf.size == 0 and isinstance(buf.sample(1), Refused)


def test_max_times_sampled_removes_after_that_many():
    buf = make(max_times_sampled=2)
    buf.insert(trajs(2))
    seen = Counter()
    for _ in range(4):
        seen.update(ids(buf.sample(1)))
    assert seen == {"ep-0-0": 2, "ep-0-1": 2} and buf.size == 0


def test_uniform_is_seeded_and_samples_each_once():
    def order(seed: int) -> list[str]:
        buf = make(sampler="uniform", seed=seed)
        buf.insert(trajs(20))
        return [i for _ in range(5) for i in ids(buf.sample(4))]

    a = order(1)
    assert a == order(1) and sorted(a) == sorted(f"ep-0-{i}" for i in range(20))
    assert a != sorted(a, key=lambda s: int(s.rsplit("-", 1)[1]))


def test_prioritized_prefers_groups_with_reward_spread():
    buf = make(sampler="prioritized", group_size=2, max_times_sampled=0, priority_exponent=1.0, seed=3)
    buf.insert(trajs(2, group="flat", rewards=[1.0, 1.0]))
    buf.insert(trajs(2, group="spread", rewards=[0.0, 1.0], seed=1))
    hits = Counter()
    weights = []
    for _ in range(300):
        out = buf.sample(2)
        assert isinstance(out, Sample)
        hits[out.trajectories[0].group_id] += 1
        weights += out.weights
    # p = mean|r - mean| + eps: 0.51 vs 0.01, so "spread" is drawn ~98% of the time.
    assert hits["spread"] > 0.9 * 300 and hits["flat"] > 0
    assert max(weights) == pytest.approx(1.0) and min(weights) > 0  # (N P)^-beta over its max


def test_agent_view_counts_separately():
    buf = make(max_times_sampled=1)
    batch = trajs(4)
    with_judge = sum("judge" in t.agents for t in batch)
    assert 0 < with_judge < 4
    buf.insert(batch)
    out = buf.sample(4, agent_id="critic")
    assert len(ids(out)) == 4 and buf.size == 4  # the whole view and the solver view remain
    assert len(ids(buf.sample(4, agent_id="solver"))) == 4
    assert buf.size == with_judge  # all of their agents' views used up: removed
    assert len(ids(buf.sample(4, agent_id="judge"))) == with_judge and buf.size == 0


# --- ranks --------------------------------------------------------------------------------------


def test_two_ranks_never_get_the_same_trajectory_in_one_round():
    buf = make(max_times_sampled=0, sampler="uniform", seed=5)
    buf.insert(trajs(8))
    for _ in range(20):
        a, b = ids(buf.sample(4, rank=0)), ids(buf.sample(4, rank=1))
        assert len(a) == 4 and len(b) == 4
        assert not set(a) & set(b)


def test_ranks_share_without_duplicates_when_items_are_consumed():
    buf = make()
    buf.insert(trajs(10))
    got = ids(buf.sample(4, rank=0)) + ids(buf.sample(4, rank=1)) + ids(buf.sample(4, rank=2))
    assert sorted(got) == sorted(f"ep-0-{i}" for i in range(10))


# --- persistence --------------------------------------------------------------------------------


def persisted(tmp_path: Path, **kw) -> tuple[ReplayBuffer, SegmentStore]:
    store = SegmentStore(tmp_path, fsync=False, keep_checkpoints=2)
    buf = make(**kw)
    state, stored = store.load()
    if state is not None:
        buf.load_state_dict(state, stored, now=0.0)
    return buf, store


def feed(buf: ReplayBuffer, store: SegmentStore, batch: list[GraphTrajectory], source) -> None:
    store.append(buf.insert(batch, source=source, now=0.0).accepted)


def test_round_trip_restores_contents_counters_and_dedup_table(tmp_path):
    buf, store = persisted(
        tmp_path, group_size=2, max_times_sampled=2, samples_per_insert=2.0, error_buffer=50
    )
    feed(buf, store, trajs(4, group="A"), ("p", 0))  # a group of 4 episodes: released as 2+2
    feed(buf, store, trajs(1, group="B", seed=1), ("p", 1))  # pending
    feed(buf, store, trajs(2, seed=2), ("q", 0))
    buf.sample(2)
    store.checkpoint(buf.state_dict(now=0.0), buf.keys())
    want = (
        buf.keys(),
        buf.size,
        buf.inserted,
        buf.sampled,
        buf.limiter.inserts,
        buf.limiter.samples,
        buf.seen(),
    )
    store.close()

    buf2, store2 = persisted(
        tmp_path, group_size=2, max_times_sampled=2, samples_per_insert=2.0, error_buffer=50
    )
    got = (
        buf2.keys(),
        buf2.size,
        buf2.inserted,
        buf2.sampled,
        buf2.limiter.inserts,
        buf2.limiter.samples,
        buf2.seen(),
    )
    assert got == want and buf2.pending_groups == buf.pending_groups == 3
    assert buf2.insert(trajs(1), source=("p", 1)).duplicate
    # Same sample order as the original buffer would have produced next.
    assert ids(buf2.sample(8)) == ids(buf.sample(8))
    feed(buf2, store2, trajs(1, group="B", seed=3), ("p", 2))  # completes the restored pending group
    assert buf2.pending_groups == 2
    store2.close()


def test_checkpoint_without_done_is_ignored(tmp_path):
    buf, store = persisted(tmp_path)
    feed(buf, store, trajs(2), ("p", 0))
    good = store.checkpoint(buf.state_dict(0.0), buf.keys())
    feed(buf, store, trajs(3, seed=1), ("p", 1))
    torn = store.checkpoint(buf.state_dict(0.0), buf.keys())
    (torn / "DONE").unlink()  # killed between state.json and DONE
    seg = sorted((tmp_path / "segments").glob("*.arrow"))[-1]
    with open(seg, "ab") as f:
        f.write(b"\xff\xff\xff\xff torn tail")  # and mid-append
    store.close()

    buf2, _ = persisted(tmp_path)
    assert good.name < torn.name
    assert buf2.size == 2 and buf2.seen() == {"p": [0]}
    assert ids(buf2.sample(5)) == ["ep-0-0", "ep-0-1"]


def test_old_checkpoints_and_consumed_segments_are_deleted(tmp_path):
    store = SegmentStore(tmp_path, fsync=False, keep_checkpoints=2, segment_bytes=1)  # rotate each append
    buf = make()
    for i in range(5):
        feed(buf, store, trajs(1, seed=i), ("p", i))
        store.checkpoint(buf.state_dict(0.0), buf.keys())
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2
    assert len(list((tmp_path / "segments").iterdir())) == 5
    buf.sample(4)  # consumes the four oldest
    store.checkpoint(buf.state_dict(0.0), buf.keys())
    store.checkpoint(buf.state_dict(0.0), buf.keys())
    assert len(list((tmp_path / "segments").iterdir())) == 1
    doc = json.loads(
        next(iter(sorted((tmp_path / "checkpoints").iterdir()))).joinpath("state.json").read_text()
    )
    assert doc["keys"] == [4]
    store.close()
    buf2, _ = persisted(tmp_path)
    assert ids(buf2.sample(1)) == ["ep-4-0"]


def test_corrupt_segment_fails_loudly(tmp_path):
    buf, store = persisted(tmp_path)
    feed(buf, store, trajs(2), ("p", 0))
    store.checkpoint(buf.state_dict(0.0), buf.keys())
    store.close()
    seg = next((tmp_path / "segments").glob("*.arrow"))
    data = bytearray(seg.read_bytes())
    data[len(data) // 2 :] = b"\x00" * (len(data) - len(data) // 2)
    seg.write_bytes(bytes(data))
    with pytest.raises(B.CorruptStore):
        persisted(tmp_path)


def test_decoded_frames_are_kept_and_persisted_as_arrow_rows(tmp_path):
    """A frame goes in as decoded batches; a partly admitted frame is persisted as just its rows."""
    buf, store = persisted(tmp_path, max_policy_lag=4)
    feed(buf, store, decode_batches(encode_trajectories(trajs(1, version=10))), ("p", 0))
    frame = encode_trajectories(trajs(2, version=5, seed=1) + trajs(2, version=8, seed=2))
    feed(buf, store, decode_batches(frame), ("p", 1))  # the two at version 5 are stale
    assert buf.size == 3 and buf.rejected["stale"] == 2
    store.checkpoint(buf.state_dict(0.0), buf.keys())
    store.close()
    buf2, _ = persisted(tmp_path, max_policy_lag=4)
    assert ids(buf2.sample(8)) == ["ep-0-0", "ep-2-0", "ep-2-1"]
    out = buf.sample(8)
    got = decode_trajectories(out.encode())
    assert [t.episode_id for t in got] == ["ep-0-0", "ep-2-0", "ep-2-1"]
    assert [s.policy_version for t in got[1:] for s in t.steps] == [8] * sum(len(t.steps) for t in got[1:])
