"""Learner groups on one replay buffer: views by agent set and per-base-model versions.

A workflow whose agents run on two base models is trained by two learner groups, one per base
(docs/architecture.md, "The replay buffer"): each samples only its agents' part of every episode
group, neither consumes nor blocks the other's sampling, an item leaves only once both used it,
and staleness is judged on each base's own version sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from teamrl.learner import buffer as B
from teamrl.learner.buffer import InvalidAgentId, InvalidView, Refused, ReplayBuffer, Sample
from teamrl.learner.buffer_config import BufferConfig
from teamrl.learner.buffer_service import BufferService
from teamrl.protocol import control as C
from teamrl.protocol.codec import decode_trajectories
from teamrl.protocol.trajectory import AgentStep, GraphTrajectory

BASE_A = "base-a"  # the planner's base model
BASE_B = "base-b"  # the solver's (and the judge's) base model
MODEL_OF = {"planner": BASE_A, "solver": BASE_B, "judge": BASE_B}


def episode(
    name: str, group: str, *, a: int = 0, b: int = 0, agents: tuple[str, ...] = ("planner", "solver")
) -> GraphTrajectory:
    """One episode: each agent acts once, in order; steps on base A at version ``a``, on B at ``b``."""
    steps = []
    for i, agent in enumerate(agents):
        model = MODEL_OF[agent]
        steps.append(
            AgentStep(
                agent_id=agent,
                role=agent,
                model_id=model,
                adapter=f"{agent}-lora",
                policy_version=a if model == BASE_A else b,
                turn=0,
                parents=np.asarray([i - 1] if i else [], dtype=np.int32),
                prompt_ids=np.asarray([1, 2, 3], dtype=np.int32),
                response_ids=np.asarray([4, 5], dtype=np.int32),
                logprobs=np.asarray([-0.5, -0.25], dtype=np.float32),
            )
        )
    return GraphTrajectory(
        episode_id=name,
        incarnation="r",
        seq=0,
        task_id="t",
        group_id=group,
        workflow="plan-solve",
        steps=steps,
    )


def groups(n: int, size: int = 2, *, prefix: str = "g", **kw) -> list[GraphTrajectory]:
    """``n`` episode groups of ``size`` episodes each, named ``{prefix}{g}-{i}``."""
    return [episode(f"{prefix}{g}-{i}", f"{prefix}{g}", **kw) for g in range(n) for i in range(size)]


def make(**kw) -> ReplayBuffer:
    base = {"max_policy_lag": None, "group_size": 2}  # with versions_from_data: the in-process rule
    base.update(kw)
    return ReplayBuffer(BufferConfig(**base), versions_from_data=True)


def ids(out: Sample | Refused) -> list[str]:
    assert isinstance(out, Sample), out
    return [t.episode_id for t in out.trajectories]


def drain(buf: ReplayBuffer, **kw) -> list[str]:
    """Sample ``kw``'s view until it is refused; every episode id handed out, in order."""
    got: list[str] = []
    while isinstance(out := buf.sample(2, **kw), Sample):
        got += ids(out)
    assert out.reason == "not_enough_data"
    return got


def evicted_metric(reason: str) -> float:
    return B.EVICTED.labels(reason=reason)._value.get()


ALL = sorted(f"g{g}-{i}" for g in range(3) for i in range(2))
PLANNER = {"agent_ids": ["planner"], "model_id": BASE_A}
SOLVER = {"agent_ids": ["solver"], "model_id": BASE_B}


# --- views --------------------------------------------------------------------------------------


def test_two_groups_each_sample_every_episode_group_once_and_items_leave_after_both():
    buf = make()
    buf.insert(groups(3, a=5, b=2))
    assert buf.size == 6
    first = buf.sample(2, **PLANNER)
    assert ids(first) == ["g0-0", "g0-1"]  # one whole episode group
    assert buf.size == 6  # the solver group has not had it yet
    planner = ids(first) + drain(buf, **PLANNER)
    assert sorted(planner) == ALL and buf.size == 6
    solver = drain(buf, **SOLVER)
    assert sorted(solver) == ALL
    assert buf.size == 0 and buf.per_agent() == {}


def test_one_group_sampling_repeatedly_never_takes_the_others_data():
    buf = make(max_times_sampled=2)
    buf.insert(groups(3))
    planner = drain(buf, **PLANNER)
    assert sorted(planner) == sorted(ALL * 2)  # everything its view allows, twice
    assert isinstance(buf.sample(2, **PLANNER), Refused) and buf.size == 6
    solver = drain(buf, **SOLVER)
    assert sorted(solver) == sorted(ALL * 2)
    assert buf.size == 0


def test_a_view_takes_the_episodes_any_of_its_agents_acted_in():
    buf = make(group_size=1)
    buf.insert([episode("both", "x"), episode("solo", "y", agents=("planner",))])
    assert ids(buf.sample(8, agent_ids=["solver"])) == ["both"]  # the planner alone acted in "solo"
    assert sorted(ids(buf.sample(8, agent_ids=["planner"]))) == ["both", "solo"]
    assert buf.size == 0  # "both": planner and solver views done; "solo": its one agent's view done


def test_an_agent_set_is_one_view_whatever_its_order_and_one_agent_keeps_its_name():
    assert B.view_name(agent_ids=["solver", "planner", "solver"]) == "planner\x1fsolver"
    assert B.view_name(agent_ids=["planner", "solver"]) == B.view_name(agent_ids=["solver", "planner"])
    assert B.view_name(agent_ids=["solver"]) == B.view_name(agent_id="solver") == "solver"
    assert B.view_name() == B.view_name(agent_id="") == B.WHOLE
    buf = make(max_times_sampled=1)
    buf.insert(groups(1, agents=("planner", "solver", "judge")))
    assert ids(buf.sample(2, agent_ids=["solver", "judge"])) == ["g0-0", "g0-1"]
    assert isinstance(buf.sample(2, agent_ids=["judge", "solver"]), Refused)  # the same view
    assert buf.size == 2  # the planner has not sampled it
    assert ids(buf.sample(2, agent_id="planner")) == ["g0-0", "g0-1"]  # one-agent form
    assert buf.size == 0  # planner + {judge, solver} cover every agent that acted


def test_the_whole_view_still_ends_an_item_and_agent_views_still_count_apart():
    buf = make()
    buf.insert(groups(1))
    assert len(ids(buf.sample(2, agent_ids=["planner"]))) == 2 and buf.size == 2
    assert len(ids(buf.sample(2))) == 2 and buf.size == 0  # whole trajectories: gone for everyone


def test_ranks_are_kept_apart_within_a_view_but_never_block_another_view():
    buf = make(max_times_sampled=0)  # unlimited: only the round rule keeps ranks apart
    buf.insert(groups(2))
    a0 = ids(buf.sample(2, rank=0, **PLANNER))
    a1 = ids(buf.sample(2, rank=1, **PLANNER))
    assert not set(a0) & set(a1)  # same view, same round: disjoint
    # the solver group's rank 0 in its own round 0: both groups are free for it, whoever took them
    assert sorted(ids(buf.sample(4, rank=0, **SOLVER))) == sorted(a0 + a1)
    assert isinstance(buf.sample(4, rank=1, **SOLVER), Refused)  # its rank 0 took both in this round


# --- per-base versions --------------------------------------------------------------------------


def test_admission_lag_is_per_base_model():
    buf = make(max_policy_lag=2)
    res = buf.insert(groups(1, a=10, b=1))  # 9 versions apart, but each base is current
    assert res.stale == 0 and buf.size == 2
    assert buf.current_versions == {BASE_A: 10, BASE_B: 1} and buf.current_version == 10
    fresh_b_old_a = buf.insert(groups(1, prefix="h", a=7, b=1))  # A lags 3 > 2: refused
    assert fresh_b_old_a.stale == 2 and buf.rejected["stale"] == 2
    ok = buf.insert(groups(1, prefix="k", a=9, b=0))  # A lags 1, B lags 1
    assert ok.stale == 0 and buf.size == 4


def test_single_base_model_keeps_the_plain_rule():
    buf = make(max_policy_lag=4, group_size=1)
    team = ("solver", "judge")  # both on base B
    buf.insert([episode("new", "x", b=10, agents=team)])
    res = buf.insert([episode("lag5", "y", b=5, agents=team), episode("lag4", "z", b=6, agents=team)])
    assert res.stale == 1 and buf.current_version == 10 and buf.current_versions == {BASE_B: 10}


def test_sample_staleness_is_judged_on_the_requests_base_and_given_up_by_its_view_only():
    buf = make(max_policy_lag=2)
    buf.insert(groups(2, prefix="old", a=3, b=1))
    buf.insert(groups(1, prefix="new", a=10, b=1))
    assert buf.size == 6  # held: old A steps were current when they came
    stale_before, metric_before = buf.evicted["stale"], evicted_metric("stale")

    # model B at version 1, lag 2: everything is fresh for the solver group
    solver = buf.sample(6, **SOLVER, min_policy_version=0)
    assert sorted(ids(solver)) == ["new0-0", "new0-1", "old0-0", "old0-1", "old1-0", "old1-1"]
    assert buf.evicted["stale"] == stale_before and buf.size == 6

    # model A at 9: the old groups (A at 3) are given up by the planner's view, counted stale
    planner = buf.sample(6, **PLANNER, min_policy_version=9)
    assert ids(planner) == ["new0-0", "new0-1"]
    assert buf.evicted["stale"] - stale_before == 4 and evicted_metric("stale") - metric_before == 4
    assert buf.current_versions == {BASE_A: 11, BASE_B: 2}
    assert buf.size == 0  # both views used (or gave up) every episode


def test_a_stale_group_for_one_base_stays_for_the_other_group():
    buf = make(max_policy_lag=2, max_times_sampled=1)
    buf.insert(groups(2, a=3, b=1))
    before = buf.evicted["stale"]
    out = buf.sample(4, **PLANNER, min_policy_version=9)  # A at 3 < 9: all stale for the planner
    assert isinstance(out, Refused) and out.reason == "not_enough_data"
    assert buf.evicted["stale"] - before == 4 and buf.size == 4  # not removed: the solver still needs them
    assert sorted(ids(buf.sample(4, **SOLVER, min_policy_version=0))) == [
        "g0-0",
        "g0-1",
        "g1-0",
        "g1-1",
    ]
    assert buf.size == 0


def test_without_model_id_the_global_rule_still_evicts_for_everyone():
    buf = make(max_policy_lag=2)
    buf.insert(groups(1, a=10, b=1))
    out = buf.sample(2, agent_ids=["solver"], min_policy_version=9)  # B at 1 < 9 on the global scale
    assert isinstance(out, Refused) and buf.size == 0 and buf.evicted["stale"] == 2


def test_lagging_base_is_given_up_in_drop_mode_and_weighted_in_downweight_mode():
    buf = make(max_policy_lag=2)
    buf.insert(groups(1, prefix="old", a=10, b=1))
    buf.insert(groups(1, prefix="new", a=10, b=4))  # B current 4: the old B steps lag 3 > 2
    out = buf.sample(4, **SOLVER, min_policy_version=1)
    assert ids(out) == ["new0-0", "new0-1"] and buf.evicted["stale"] == 2
    assert buf.size == 4  # both groups are still the planner's: their A steps are current
    assert ids(buf.sample(4, **PLANNER, min_policy_version=8)) == ["old0-0", "old0-1", "new0-0", "new0-1"]
    assert buf.size == 0

    soft = make(max_policy_lag=2, stale_action="downweight", stale_decay=0.5)
    soft.insert(groups(1, prefix="old", a=10, b=1))
    soft.insert(groups(1, prefix="new", a=10, b=4))
    assert soft.size == 4  # kept at admission, weighted at sample time
    assert soft.sample(4, **SOLVER, min_policy_version=1).weights == [0.5, 0.5, 1.0, 1.0]
    assert soft.sample(4, **PLANNER, min_policy_version=8).weights == [1.0] * 4  # A lags 0


def test_a_hint_without_model_id_raises_every_base():
    buf = make(max_policy_lag=2)
    buf.insert(groups(1, a=4, b=1))
    buf.sample(2, agent_ids=["planner"], min_policy_version=3)
    assert buf.current_versions == {BASE_A: 5, BASE_B: 5} and buf.current_version == 5
    assert buf.current_version_of("base-new") == 5  # a base first seen later starts there


def test_only_data_or_a_trusted_learner_adds_a_base():
    buf = make(max_policy_lag=2)
    buf.insert(groups(1, a=4, b=1))
    buf.sample(2, agent_ids=["solver"], model_id="made-up", min_policy_version=3)
    assert set(buf.current_versions) == {BASE_A, BASE_B}
    buf.sample(2, agent_ids=["solver"], model_id="base-c", min_policy_version=3, trusted=True)
    assert buf.current_versions["base-c"] == 5


# --- persistence --------------------------------------------------------------------------------


def _reload(buf: ReplayBuffer, rows: dict, state: dict, **kw) -> ReplayBuffer:
    other = make(**kw)
    other.load_state_dict(json.loads(json.dumps(state)), rows, now=0.0)
    return other


def test_state_round_trip_keeps_versions_view_counts_and_rounds():
    kw = {"max_policy_lag": 4, "max_times_sampled": 0}
    buf = make(**kw)
    rows = dict(buf.insert(groups(2, a=6, b=2)).accepted)
    first = ids(buf.sample(2, rank=0, **PLANNER, min_policy_version=5))  # A current 9
    assert buf.current_versions == {BASE_A: 9, BASE_B: 2}
    state = buf.state_dict(now=0.0)
    assert state["format"] == B.STATE_FORMAT == 1
    again = _reload(buf, rows, state, **kw)
    assert again.current_versions == buf.current_versions
    assert again.current_version == buf.current_version == 9
    assert [it.sampled for g in again._groups.values() for it in g.items] == [
        it.sampled for g in buf._groups.values() for it in g.items
    ]
    # rank 1 of the planner's view in round 0: the group rank 0 took there stays apart
    got = ids(again.sample(4, rank=1, **PLANNER))
    assert not set(got) & set(first) and got == ids(buf.sample(4, rank=1, **PLANNER))


def test_state_round_trip_keeps_a_view_done():
    buf = make()
    rows = dict(buf.insert(groups(2, a=1, b=1)).accepted)
    drain(buf, **PLANNER)
    again = _reload(buf, rows, buf.state_dict(now=0.0))
    assert isinstance(again.sample(2, **PLANNER), Refused) and again.size == 4
    assert sorted(drain(again, **SOLVER)) == ["g0-0", "g0-1", "g1-0", "g1-1"] and again.size == 0


def test_state_from_before_per_base_versions_loads():
    buf = make(max_policy_lag=4)
    rows = dict(buf.insert(groups(2, a=6, b=2)).accepted)
    buf.sample(2)  # whole view, round 0 taken by rank 0
    state = buf.state_dict(now=0.0)
    for key in ("current_versions", "hint_version", "view_rounds"):
        del state[key]
    for g in state["groups"]:
        del g["view_taken"]
    again = _reload(buf, rows, state, max_policy_lag=4)
    assert again.current_versions == {BASE_A: 6, BASE_B: 2}  # what the held items show
    assert again.current_version == buf.current_version and again.size == 2
    assert ids(again.sample(2, rank=0)) == ["g1-0", "g1-1"]


# --- validation ---------------------------------------------------------------------------------


def test_sample_request_agent_fields():
    ok = C.SampleRequest(request_id=1, batch_size=4, rank=0, agent_ids=["a", "b"], model_id=BASE_A)
    assert C.unpack_message(C.pack_message(ok)) == ok
    assert C.SampleRequest(request_id=1, batch_size=4, rank=0, agent_id="a").agent_ids is None
    C.SampleRequest(request_id=1, batch_size=4, rank=0, agent_ids=[str(i) for i in range(256)])
    with pytest.raises(ValidationError, match="not both"):
        C.SampleRequest(request_id=1, batch_size=4, rank=0, agent_id="a", agent_ids=["a"])
    with pytest.raises(ValidationError):
        C.SampleRequest(request_id=1, batch_size=4, rank=0, agent_ids=[str(i) for i in range(257)])
    with pytest.raises(ValidationError):
        C.SampleRequest(request_id=1, batch_size=4, rank=0, agent_ids=[""])
    with pytest.raises(ValidationError):
        C.SampleRequest(request_id=1, batch_size=4, rank=0, model_id="")


@pytest.mark.parametrize(
    "kw",
    [
        {"agent_ids": []},
        {"agent_id": "planner", "agent_ids": ["solver"]},
        {"agent_ids": ["plan\x1fner"]},
        {"agent_ids": "planner"},
        {"agent_ids": ["x" * 257]},
        {"agent_ids": [str(i) for i in range(257)]},
    ],
)
def test_malformed_agent_lists_are_refused_and_counted_before_anything_changes(kw):
    buf = make(max_policy_lag=2)
    buf.insert(groups(1, a=1, b=1))
    before = buf.rejected["invalid_agent_ids"]
    with pytest.raises(InvalidView):
        buf.sample(2, min_policy_version=50, trusted=True, **kw)
    assert buf.rejected["invalid_agent_ids"] == before + 1
    assert buf.current_version == 1 and buf.size == 2


def test_agent_ids_holding_the_view_separator_are_refused_at_admission():
    buf = make(group_size=1)
    bad = episode("e", "x")
    bad.steps[0].agent_id = "planner\x1fsolver"
    with pytest.raises(InvalidAgentId):
        buf.insert([bad])
    assert buf.size == 0 and buf.rejected["invalid_agent_id"] == 1


# --- the service --------------------------------------------------------------------------------


def test_service_serves_a_learner_groups_request(tmp_path: Path):
    cfg = BufferConfig(
        bind="tcp://127.0.0.1:*",
        sample_bind="tcp://127.0.0.1:*",
        dir=tmp_path / "buffer",
        max_policy_lag=2,
        group_size=2,
        fsync=False,
    )
    svc = BufferService(cfg)
    try:
        odd = groups(1, prefix="odd", a=10, b=1)
        odd[0].steps[0].model_id = ""  # model ids are not checked at admission
        svc.buffer.insert(groups(2, a=10, b=1) + odd)
        svc.buffer.announce(BASE_A, 10)  # versions come from the learners' announcements
        svc.buffer.announce(BASE_B, 1)
        request = C.SampleRequest(request_id=7, batch_size=2, rank=0, agent_ids=["solver"], model_id=BASE_B)
        reply = svc.handle(C.unpack_message(C.pack_message(request)))
        assert isinstance(reply, C.SampleReply) and reply.request_id == 7 and reply.count == 2
        assert [t.episode_id for t in decode_trajectories(reply.trajectories)] == ["g0-0", "g0-1"]

        refused = svc.handle(C.SampleRequest(request_id=8, batch_size=2, rank=0, agent_ids=[]))
        assert isinstance(refused, C.ErrorReply)
        assert (refused.request_id, refused.reason) == (8, "invalid_agent_ids")
        assert svc.buffer.rejected["invalid_agent_ids"] == 1

        stats = svc.stats()
        assert stats.current_versions == {BASE_A: 10, BASE_B: 1}  # "" cannot be named: left out
        assert C.unpack_message(C.pack_message(stats)) == stats
    finally:
        svc.close()
