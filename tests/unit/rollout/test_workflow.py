"""The Workflow API: load-time validation, the executor (levels, routing, parents, cancellation), prompts.

The backend here is scripted (fixed token ids and log-probs per adapter): these tests are about the
workflow, not the engine; ``test_workflow_vllm.py`` runs a workflow on real vLLM.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from teamrl.protocol import decode_trajectories, encode_trajectories
from teamrl.rewards.tokenizer import ByteTokenizer, CharTokenizer, HFTokenizer, TokenizerError
from teamrl.rollout.engine import Generation, Sampling
from teamrl.rollout.executor import run_episode
from teamrl.rollout.spec import WorkflowError
from teamrl.rollout.workflow import Workflow
from teamrl.rollout.workflows import load, load_workflow

CHAR = CharTokenizer()
BYTES = ByteTokenizer()
TASK = {"id": "add-07-45", "a": 7, "b": 45, "question": "07+45=", "answer": "052"}


class Scripted:
    """generate() answers from ``script[adapter]`` (a list used in turn, the last repeated) or a callable."""

    def __init__(self, script: dict[str, list[str] | Callable[[list[int]], str]], tok=CHAR, version: int = 3):
        self.script = {k: (list(v) if isinstance(v, list) else v) for k, v in script.items()}
        self.tok = tok
        self.version = version
        self.calls: list[dict] = []

    async def generate(self, prompt_ids: Sequence[int], sampling: Sampling, adapter: str = "", seed=None):
        self.calls.append(
            {"prompt": list(prompt_ids), "sampling": sampling, "adapter": adapter, "seed": seed}
        )
        await asyncio.sleep(0)
        src = self.script[adapter]
        text = src(list(prompt_ids)) if callable(src) else (src.pop(0) if len(src) > 1 else src[0])
        ids = self.tok.encode(text, add_special=False)
        return Generation(
            token_ids=ids,
            logprobs=[-0.5 - 0.01 * i for i in range(len(ids))],
            text=text,
            finish_reason="stop",
            adapter=adapter,
            version=self.version,
            t_start=1.0,
            t_end=2.0,
        )


def _wf(**over) -> dict:
    """Three agents a, b -> c on one model, byte tokenizer templates."""
    d = {
        "name": "tri",
        "models": {"m": {"path": ""}},
        "adapters": {"la": {"model": "m", "rank": 8}, "lb": {"model": "m", "rank": 8}, "lc": {"model": "m"}},
        "agents": [
            {"id": "a", "role": "proposer", "model": "m", "adapter": "la", "template": "A:{task[question]}"},
            {"id": "b", "role": "proposer", "model": "m", "adapter": "lb", "template": "B:{task[question]}"},
            {
                "id": "c",
                "role": "judge",
                "model": "m",
                "adapter": "lc",
                "template": "C:{task[question]}|{out[a]}|{out[b]}",
            },
        ],
        "graph": {"kind": "static", "edges": [["a", "c"], ["b", "c"]]},
    }
    d.update(over)
    return d


def run(coro):
    return asyncio.run(coro)


def episode(wf, backend, task=TASK, tok=BYTES, seed=11, **kw):
    return run(
        run_episode(
            wf, task, backend, tokenizers=tok, seed=seed, incarnation="inc", seq=5, group_id="g", **kw
        )
    )


# ------------------------------------------------------------------------------------- validation


def test_cycle_in_static_dag_is_refused_naming_the_cycle() -> None:
    d = _wf(graph={"kind": "static", "edges": [["a", "c"], ["c", "b"], ["b", "a"]]})
    with pytest.raises(WorkflowError, match=r"cycle") as ei:
        Workflow.from_dict(d)
    assert ei.value.edge is not None and set(ei.value.edge) <= {"a", "b", "c"}
    assert "a" in str(ei.value) and "b" in str(ei.value) and "c" in str(ei.value)
    with pytest.raises(WorkflowError, match=r"self-loop"):
        Workflow.from_dict(_wf(graph={"kind": "static", "edges": [["a", "a"]]}))


def test_unknown_agent_in_an_edge_or_route_is_refused() -> None:
    with pytest.raises(WorkflowError, match=r"edge a->zed: unknown agent/node 'zed'") as ei:
        Workflow.from_dict(_wf(graph={"kind": "static", "edges": [["a", "zed"]]}))
    assert ei.value.edge == ("a", "zed") and ei.value.agent == "zed"
    dyn = {"kind": "dynamic", "start": "a", "routes": [{"after": "a", "next": "nobody"}]}
    with pytest.raises(WorkflowError, match=r"unknown agent 'nobody'"):
        Workflow.from_dict(_wf(graph=dyn))
    with pytest.raises(WorkflowError, match=r"start 'x'"):
        Workflow.from_dict(_wf(graph={"kind": "dynamic", "start": "x"}))


def test_adapter_rank_above_engine_maximum_is_refused() -> None:
    d = _wf()
    d["adapters"]["lb"]["rank"] = 16
    wf = Workflow.from_dict(d, max_lora_rank=16)
    with pytest.raises(
        WorkflowError, match=r"adapter 'lb' .* rank 16, above the engine's max_lora_rank 8"
    ) as ei:
        wf.check_engine(8)
    assert ei.value.agent == "b"
    with pytest.raises(WorkflowError, match=r"max_lora_rank 8"):
        Workflow.from_dict(d, max_lora_rank=8)


def test_unknown_model_unknown_adapter_and_cross_model_adapter_are_refused() -> None:
    d = _wf()
    d["agents"][1]["model"] = "gpt-zzz"
    with pytest.raises(WorkflowError, match=r"agent 'b' maps to unknown model 'gpt-zzz'") as ei:
        Workflow.from_dict(d)
    assert ei.value.agent == "b"
    d = _wf()
    d["agents"][0]["adapter"] = "nope"
    with pytest.raises(WorkflowError, match=r"agent 'a' uses unknown adapter 'nope'"):
        Workflow.from_dict(d)
    d = _wf(models={"m": {}, "m2": {}})
    d["agents"][2]["model"] = "m2"  # its adapter lc was trained for m
    with pytest.raises(
        WorkflowError, match=r"agent 'c' runs on model 'm2' but its adapter 'lc' belongs to model 'm'"
    ):
        Workflow.from_dict(d)


def test_template_reading_an_output_it_cannot_see_and_bad_fields_are_refused() -> None:
    d = _wf(graph={"kind": "static", "edges": [["a", "c"]]})  # c reads out[b] without an edge b->c
    with pytest.raises(WorkflowError, match=r"reads \{out\[b\]\}") as ei:
        Workflow.from_dict(d)
    assert ei.value.edge == ("b", "c")
    d = _wf()
    d["agents"][0]["template"] = "{question}"
    with pytest.raises(WorkflowError, match=r"field \{question\} is not one of"):
        Workflow.from_dict(d)


def test_pydantic_field_errors_become_workflow_errors_naming_the_agent(tmp_path: Path) -> None:
    d = _wf()
    d["agents"][1]["sampling"] = {"temperature": -1}
    with pytest.raises(WorkflowError, match=r"agents\.1\.sampling\.temperature \(agent 'b'\)") as ei:
        Workflow.from_dict(d)
    assert ei.value.agent == "b"
    d["agents"][1]["sampling"] = {
        "temperature": 3.0
    }  # vLLM samples at 2 at most: refused here, not per episode
    with pytest.raises(
        WorkflowError, match=r"agents\.1\.sampling\.temperature \(agent 'b'\).*less than or equal to 2"
    ):
        Workflow.from_dict(d)
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nmodels = {}\nagents = []\n')
    with pytest.raises(WorkflowError, match=r"bad\.toml: workflow 'x': no agents"):
        load_workflow(bad)


def test_loadable_from_a_toml_table(tmp_path: Path) -> None:
    f = tmp_path / "svc.toml"
    f.write_text(
        """
[rollout]
replicas = 2

[workflow]
name = "pair"
agents = [
  { id = "a", role = "r", model = "m", adapter = "team" },
  { id = "b", role = "r", model = "m", adapter = "team", template = "{task[question]}{out[a]}" },
]
[workflow.models.m]
path = "/models/x"
[workflow.adapters.team]
model = "m"
rank = 4
[workflow.graph]
edges = [["a", "b"]]
"""
    )
    wf = Workflow.from_toml(f, max_lora_rank=4)
    assert wf.name == "pair" and wf.levels() == [["a"], ["b"]] and wf.sharing() == {"m": "full"}
    assert wf.models["m"].path == "/models/x"
    with pytest.raises(WorkflowError, match=r"svc\.toml: .*rank 4, above the engine's max_lora_rank 2"):
        Workflow.from_toml(f, max_lora_rank=2)


def test_sharing_modes_and_groups() -> None:
    assert load("addition-duo").sharing() == {"embedded-v1": "separate"}
    assert load("search-qa").sharing() == {"policy": "full"}
    d = _wf()
    d["agents"][1]["adapter"] = "la"  # a and b share, c alone
    wf = Workflow.from_dict(d)
    assert wf.sharing() == {"m": "partial"} and wf.adapter_groups() == {"la": ["a", "b"], "lc": ["c"]}
    d = _wf()
    for a in d["agents"]:
        a["adapter"] = ""
    assert Workflow.from_dict(d).sharing() == {"m": "base"}


# ------------------------------------------------------------------------------------- executor


class Barrier(Scripted):
    """Each call waits until ``n`` calls are in flight at once (a 10 s guard turns a deadlock into a failure)."""

    def __init__(self, n: int, *a, **kw):
        super().__init__(*a, **kw)
        self.n, self.inflight, self.max_inflight = n, 0, 0
        self.full = asyncio.Event()

    async def generate(self, prompt_ids, sampling, adapter="", seed=None):
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        if self.inflight >= self.n:
            self.full.set()
        if adapter in ("la", "lb"):
            await asyncio.wait_for(self.full.wait(), 10)
        try:
            return await super().generate(prompt_ids, sampling, adapter, seed)
        finally:
            self.inflight -= 1


def test_dag_level_is_generated_concurrently_and_parents_are_the_read_steps() -> None:
    wf = Workflow.from_dict(_wf())
    assert wf.levels() == [["a", "b"], ["c"]]
    be = Barrier(2, {"la": ["x1"], "lb": ["y2"], "lc": ["ok"]}, tok=BYTES)
    traj = episode(wf, be)
    assert be.max_inflight == 2  # a and b were in flight together (a sequential run would time out)
    assert [s.agent_id for s in traj.steps] == ["a", "b", "c"]
    assert [s.parents.tolist() for s in traj.steps] == [[], [], [0, 1]]
    assert BYTES.decode(traj.steps[2].prompt_ids) == "C:07+45=|x1|y2"
    assert traj.steps[2].prompt_ids.tolist() == BYTES.encode("C:07+45=|x1|y2")
    assert [s.role for s in traj.steps] == ["proposer", "proposer", "judge"]
    assert [s.adapter for s in traj.steps] == ["la", "lb", "lc"]
    assert all(s.policy_version == 3 and s.model_id == "m" and s.turn == 0 for s in traj.steps)
    np.testing.assert_allclose(traj.steps[0].logprobs, [-0.5, -0.51])
    assert traj.workflow == "tri" and traj.seq == 5 and traj.group_id == "g" and traj.task_id == "add-07-45"


def test_seeds_per_act_and_unseeded() -> None:
    wf = Workflow.from_dict(_wf())
    be = Scripted({"la": ["1"], "lb": ["2"], "lc": ["3"]}, tok=BYTES)
    episode(wf, be, seed=100)
    assert sorted(c["seed"] for c in be.calls) == [100, 101, 102]
    be = Scripted({"la": ["1"], "lb": ["2"], "lc": ["3"]}, tok=BYTES)
    episode(wf, be, seed=None)
    assert [c["seed"] for c in be.calls] == [None, None, None]


def test_trajectory_round_trips_through_the_protocol() -> None:
    wf = Workflow.from_dict(_wf())
    traj = episode(wf, Scripted({"la": ["x"], "lb": ["yy"], "lc": ["zzz"]}, tok=BYTES), versions={"la": 3})
    (back,) = decode_trajectories(encode_trajectories([traj]))
    assert back.episode_id == traj.episode_id and back.workflow == "tri" and back.metadata == traj.metadata
    assert json.loads(back.metadata["versions"]) == {"la": 3} and back.metadata["termination"] == "turns_done"
    for s, t in zip(traj.steps, back.steps, strict=True):
        assert (s.agent_id, s.role, s.model_id, s.adapter, s.policy_version, s.turn) == (
            t.agent_id,
            t.role,
            t.model_id,
            t.adapter,
            t.policy_version,
            t.turn,
        )
        for f in ("parents", "prompt_ids", "response_ids", "logprobs"):
            np.testing.assert_array_equal(getattr(s, f), getattr(t, f))
        assert s.response_text == t.response_text and s.finish_reason == t.finish_reason


def test_static_turns_history_and_stop_rule() -> None:
    d = {
        "name": "debate",
        "models": {"m": {}},
        "agents": [
            {
                "id": "p",
                "role": "debater",
                "model": "m",
                "template": "P{turn}:{parents}",
                "parent_format": "<{agent}={output}>",
            },
            {
                "id": "q",
                "role": "debater",
                "model": "m",
                "template": "Q{turn}:{parents}",
                "parent_format": "<{agent}={output}>",
            },
        ],
        "graph": {
            "kind": "static",
            "turns": 3,
            "history": "all",
            "stop_when": [{"node": "q", "when": "^agree"}],
        },
    }
    wf = Workflow.from_dict(d)
    be = Scripted({"": lambda ids: "agree" if BYTES.decode(ids).startswith("Q1") else "no"}, tok=BYTES)
    traj = episode(wf, be)
    assert [(s.agent_id, s.turn) for s in traj.steps] == [("p", 0), ("q", 0), ("p", 1), ("q", 1)]
    assert traj.metadata["termination"] == "stop_rule"
    assert [s.parents.tolist() for s in traj.steps] == [[], [], [0, 1], [0, 1]]
    assert BYTES.decode(traj.steps[3].prompt_ids) == "Q1:<p=no><q=no>"
    d["graph"]["history"] = "self"
    traj = episode(Workflow.from_dict(d), Scripted({"": ["no"]}, tok=BYTES))
    assert len(traj.steps) == 6 and traj.metadata["termination"] == "turns_done"
    assert [s.parents.tolist() for s in traj.steps] == [[], [], [0], [1], [2], [3]]
    assert traj.turn_rewards.tolist() == [0.0, 0.0, 0.0]


def test_dynamic_routing_loops_up_to_its_limit_then_stops() -> None:
    wf = load("addition-trio")
    be = Scripted({"solver-lora": ["51;", "53;", "50;"], "verifier-lora": ["0;"]})
    traj = episode(wf, be, tok=CHAR)
    assert [s.agent_id for s in traj.steps] == ["solver", "verifier"] * 3  # 2 retries, then the end rule
    assert [s.turn for s in traj.steps] == [0, 0, 1, 1, 2, 2]
    assert [s.parents.tolist() for s in traj.steps] == [[], [0], [], [2], [], [4]]
    assert [CHAR.decode(s.prompt_ids) for s in traj.steps][1::2] == [
        "V07+45=051?",
        "V07+45=053?",
        "V07+45=050?",
    ]
    assert traj.metadata["termination"] == "routed_end"
    # every verdict "0" was right (all answers wrong): verifier reward 1, solver 0, team 0
    assert [s.reward for s in traj.steps] == [0.0, 1.0] * 3
    assert traj.reward == 0.0 and traj.turn_rewards.tolist() == [0.0, 0.0, 0.0]


def test_dynamic_routing_stops_when_the_verifier_accepts() -> None:
    be = Scripted({"solver-lora": ["51;", "52;"], "verifier-lora": ["0;", "1;"]})
    traj = episode(load("addition-trio"), be, tok=CHAR)
    assert [s.agent_id for s in traj.steps] == ["solver", "verifier", "solver", "verifier"]
    assert traj.reward == 1.0 and traj.turn_rewards.tolist() == [0.0, 1.0]
    assert [s.reward for s in traj.steps] == [0.0, 1.0, 1.0, 1.0]
    (back,) = decode_trajectories(encode_trajectories([traj]))
    assert [s.parents.tolist() for s in back.steps] == [[], [0], [], [2]]


def test_dynamic_without_limit_is_bounded_by_max_steps() -> None:
    d = load("addition-trio").model_dump()
    d["graph"]["routes"][1]["limit"] = None
    d["graph"]["max_steps"] = 5
    traj = episode(
        Workflow.from_dict(d), Scripted({"solver-lora": ["1;"], "verifier-lora": ["0;"]}), tok=CHAR
    )
    assert len(traj.steps) == 5 and traj.metadata["termination"] == "max_steps"


def route_by_length(state) -> str | None:
    """A Python router (by import path): after 'a', go to 'b' until 'a' has acted twice."""
    if state.last.agent_id == "a" and state.visits["a"] < 2:
        return "b"
    if state.last.agent_id == "b":
        return "a"
    return None


def test_python_router_by_import_path() -> None:
    d = _wf(
        graph={
            "kind": "dynamic",
            "start": "a",
            "router": f"{__name__}:route_by_length",
            "edges": [["a", "b"]],
        }
    )
    d["agents"][1]["template"] = "B<{out[a]}>"
    d["agents"][2]["template"] = "C"
    traj = episode(Workflow.from_dict(d), Scripted({"la": ["x"], "lb": ["y"], "lc": ["z"]}, tok=BYTES))
    assert [s.agent_id for s in traj.steps] == ["a", "b", "a"]
    assert [s.parents.tolist() for s in traj.steps] == [[], [0], []]


class Hang(Scripted):
    """The ``hang`` adapter never answers; ``started`` is set when it was asked."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.started = asyncio.Event()
        self.cancelled = 0

    async def generate(self, prompt_ids, sampling, adapter="", seed=None):
        if adapter == "lb":
            self.started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        return await super().generate(prompt_ids, sampling, adapter, seed)


def test_cancelled_episode_propagates_and_returns_nothing() -> None:
    wf = Workflow.from_dict(_wf())
    be = Hang({"la": ["x"], "lc": ["z"]}, tok=BYTES)
    out: list = []

    async def scenario() -> None:
        t = asyncio.create_task(
            run_episode(wf, TASK, be, tokenizers=BYTES, seed=1, incarnation="i", seq=0, group_id="g")
        )
        t.add_done_callback(lambda f: out.append(f))
        await asyncio.wait_for(be.started.wait(), 10)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    run(scenario())
    assert out[0].cancelled() and be.cancelled == 1
    assert not [c for c in be.calls if c["adapter"] == "lc"]  # the judge was never asked


def test_a_failing_agent_cancels_its_level_siblings() -> None:
    class Boom(Hang):
        async def generate(self, prompt_ids, sampling, adapter="", seed=None):
            if adapter == "la":
                await self.started.wait()
                raise RuntimeError("engine died")
            return await super().generate(prompt_ids, sampling, adapter, seed)

    be = Boom({"lc": ["z"]}, tok=BYTES)
    with pytest.raises(RuntimeError, match="engine died"):
        episode(Workflow.from_dict(_wf()), be)
    assert be.cancelled == 1


def test_heterogeneous_models_route_to_their_backends_and_tokenizers() -> None:
    root = Path(__file__).parents[3] / "configs" / "workflows"
    wf = load_workflow(root / "math-duo-hetero.toml")
    assert wf.sharing() == {"planner-model": "separate", "solver-model": "separate"}
    big = Scripted({"planner-lora": ["1. add"]}, tok=BYTES, version=4)
    small = Scripted({"solver-lora": ["Answer: 9"]}, tok=CHAR_FREE, version=7)
    task = {"id": "t", "question": "What is 4 + 5?", "answer": "9"}
    traj = episode(
        wf,
        {"planner-model": big, "solver-model": small},
        task=task,
        tok={"planner-model": BYTES, "solver-model": CHAR_FREE},
    )
    assert [c["adapter"] for c in big.calls] == ["planner-lora"] and [c["adapter"] for c in small.calls] == [
        "solver-lora"
    ]
    assert [(s.model_id, s.policy_version) for s in traj.steps] == [("planner-model", 4), ("solver-model", 7)]
    assert traj.steps[1].prompt_ids.tolist() == small.calls[0]["prompt"]
    assert traj.reward == 1.0 and [s.reward for s in traj.steps] == [1.0, 1.0]
    with pytest.raises(WorkflowError, match=r"no backend for model 'solver-model'"):
        episode(wf, {"planner-model": big}, task=task, tok=BYTES)


class _Shifted(ByteTokenizer):
    """A second, different real vocabulary (bytes offset by 10) for the heterogeneous test."""

    def encode(self, text, *, add_special=True):
        return [i + 10 if i > 2 else i for i in super().encode(text, add_special=add_special)]

    def decode(self, ids):
        return super().decode([i - 10 if i > 12 else i for i in ids])


CHAR_FREE = _Shifted()


# ------------------------------------------------------------------------------------- prompts, stops


def test_profile_prefix_anonymous_agents_and_stop_strings() -> None:
    d = _wf()
    d["agents"][0]["profile"] = "You propose."
    d["agents"][1]["profile"] = None  # anonymous
    d["agents"][2]["sampling"] = {"stop": ["!!"], "max_tokens": 9}
    wf = Workflow.from_dict(d)
    be = Scripted({"la": ["x"], "lb": ["y"], "lc": ["done!! and more"]}, tok=BYTES)
    traj = episode(wf, be)
    assert BYTES.decode(traj.steps[0].prompt_ids) == "You propose.\n\nA:07+45="
    assert BYTES.decode(traj.steps[1].prompt_ids) == "B:07+45="
    assert traj.steps[2].response_text == "done!!" and traj.steps[2].finish_reason == "stop"
    assert len(traj.steps[2].logprobs) == len(traj.steps[2].response_ids) == 6
    assert be.calls[2]["sampling"].max_tokens == 9 and be.calls[2]["sampling"].stop_token_ids == ()
    # a one-token stop string also goes to the engine as a stop id
    samp_wf = load("addition-duo").model_dump()
    samp_wf["agents"][0]["sampling"]["stop"] = [";"]
    samp_wf["agents"][0]["sampling"]["stop_token_ids"] = []
    be = Scripted({"solver-lora": ["52;"], "verifier-lora": ["1;"]})
    episode(Workflow.from_dict(samp_wf), be, tok=CHAR)
    assert be.calls[0]["sampling"].stop_token_ids == (14,)


def test_response_prefix_ends_the_prompt_and_starts_the_text_that_routes_and_rewards_read() -> None:
    """A verifier made to give its verdict first: 'VERDICT:' is prompt (never trained), and its reply
    text, which the route and the verifier reward parse, begins with it."""
    d = load("addition-trio").model_dump()
    d["agents"][1]["response_prefix"] = "0"  # the verifier's reply starts with its verdict, "0" (wrong)
    be = Scripted({"solver-lora": ["51;"], "verifier-lora": [";"]})
    traj = episode(Workflow.from_dict(d), be, tok=CHAR)
    verifier = traj.steps[1]
    assert CHAR.decode(verifier.prompt_ids) == "V07+45=051?0"  # the prefix ends the prompt
    assert CHAR.decode(verifier.response_ids) == ";"  # the response is what the model wrote
    assert len(verifier.logprobs) == len(verifier.response_ids)
    assert verifier.response_text == "0;"
    # "0;" routed back to the solver (twice, the route's limit), each a right verdict on a wrong answer
    assert [s.agent_id for s in traj.steps] == ["solver", "verifier"] * 3
    assert [s.reward for s in traj.steps] == [0.0, 1.0] * 3


def test_an_agent_with_choices_samples_one_of_their_tokens_and_its_text_routes() -> None:
    """``choices``: the verifier replies with one token among its choices (allowed_token_ids, one
    token), after its response prefix; its reply text routes and is scored like a written verdict."""
    d = load("addition-trio").model_dump()
    d["agents"][1]["response_prefix"] = ""
    d["agents"][1]["choices"] = ["0", "1"]  # the embedded vocabulary's verdicts, one character each
    be = Scripted({"solver-lora": ["51;"], "verifier-lora": ["0"]})
    traj = episode(Workflow.from_dict(d), be, tok=CHAR)
    verifier_calls = [c for c in be.calls if c["adapter"] == "verifier-lora"]
    assert {c["sampling"].allowed_token_ids for c in verifier_calls} == {
        tuple(CHAR.encode("01", add_special=False))
    }
    assert {c["sampling"].max_tokens for c in verifier_calls} == {1}
    assert all(c["sampling"].allowed_token_ids == () for c in be.calls if c["adapter"] == "solver-lora")
    assert [s.agent_id for s in traj.steps] == ["solver", "verifier"] * 3  # "0" (wrong) routed back
    assert [s.response_text for s in traj.steps if s.agent_id == "verifier"] == ["0"] * 3


def test_choices_are_refused_when_too_few_repeated_with_tools_or_not_one_token() -> None:
    from teamrl.rollout.executor import choice_token_ids

    d = load("addition-trio").model_dump()
    for bad, match in ((["0"], "two choices"), (["0", "0"], "distinct"), (["0", ""], "distinct")):
        d["agents"][1]["choices"] = bad
        with pytest.raises(WorkflowError, match=match) as e:
            Workflow.from_dict(d)
        assert e.value.agent == "verifier"
    d["agents"][1]["choices"] = ["0", "1"]
    d["agents"][1]["tools"] = ["calc"]
    d["tools"] = {"calc": {"kind": "python"}}
    with pytest.raises(WorkflowError, match="cannot call tools"):
        Workflow.from_dict(d)
    d["agents"][1]["tools"] = []
    d["agents"][1]["choices"] = ["0", "12"]  # "12" is two tokens of the embedded vocabulary
    wf = Workflow.from_dict(d)
    with pytest.raises(WorkflowError, match="not one token") as e:
        choice_token_ids(wf.agent("verifier"), CHAR)
    assert e.value.agent == "verifier"
    assert choice_token_ids(wf.agent("solver"), CHAR) == ()


def test_with_profiles_changes_the_prompts_and_the_episode_records_the_version() -> None:
    d = _wf()
    d["agents"][0]["profile"] = "You propose."
    wf = Workflow.from_dict(d)
    assert wf.profiles() == {"a": "You propose."}
    new = wf.with_profiles({"a": "Propose carefully.", "b": "Be brief."})
    assert new.profiles() == {"a": "Propose carefully.", "b": "Be brief."} and wf.profiles() == {
        "a": "You propose."
    }
    be = Scripted({"la": ["x"], "lb": ["y"], "lc": ["z"]}, tok=BYTES)
    traj = episode(new, be, metadata={"profile_version": "4"})
    assert BYTES.decode(traj.steps[0].prompt_ids) == "Propose carefully.\n\nA:07+45="
    assert BYTES.decode(traj.steps[1].prompt_ids) == "Be brief.\n\nB:07+45="
    assert traj.metadata["profile_version"] == "4" and traj.metadata["termination"]
    with pytest.raises(WorkflowError, match="unknown agents"):
        wf.with_profiles({"nobody": "x"})


def test_with_sampling_makes_a_greedy_copy() -> None:
    wf = load("addition-duo")
    greedy = wf.with_sampling(temperature=0.0)
    assert [a.sampling.temperature for a in greedy.agents] == [0.0, 0.0]
    assert [a.sampling.temperature for a in wf.agents] == [1.0, 1.0] and greedy.name == wf.name


def test_char_tokenizer_matches_the_embedded_vocabulary_and_refuses_foreign_text() -> None:
    assert CHAR.encode("S07+45=") == [1, 16, 2, 9, 12, 6, 7, 13]  # <bos>, then 2 + index in CHARS
    for text in ("S07+45=", "V99+99=198?", "052;"):
        assert CHAR.decode(CHAR.encode(text)) == text
    with pytest.raises(TokenizerError, match=r"'x'"):
        CHAR.encode("x=1")
    assert CHAR.eos_token_id == 14


@pytest.mark.slow  # importing transformers pulls in torch (~10 s on 2 cores)
def test_hf_tokenizer_uses_the_chat_template_when_the_folder_has_one(tmp_path: Path) -> None:
    from teamrl.learner.modelbuild import build_tokenizer

    plain = tmp_path / "plain"
    plain.mkdir()
    build_tokenizer(plain)  # the embedded model's tokenizer files
    tok = HFTokenizer(plain)
    assert not tok.has_chat_template and tok.chat([{"role": "user", "content": "1"}]) is None
    chat = tmp_path / "chat"
    shutil.copytree(plain, chat)
    cfg = json.loads((chat / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ 'S' if m['role'] == 'system' else 'V' }}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %}?{% endif %}"
    )
    (chat / "tokenizer_config.json").write_text(json.dumps(cfg))
    ctok = HFTokenizer(chat)
    assert ctok.has_chat_template
    d = _wf(models={"m": {}})
    d["agents"][0].update(profile="12", template="{task[question]}")
    d["agents"][1].update(template="{task[question]}")
    d["agents"][2].update(template="{task[question]}{out[a]}", chat=False)
    wf = Workflow.from_dict(d)
    be = Scripted({"la": ["3"], "lb": ["4"], "lc": ["5"]}, tok=ctok)
    traj = episode(wf, be, task={"id": "t", "question": "07+45"}, tok=ctok)
    expect = ctok._tok.apply_chat_template(
        [{"role": "system", "content": "12"}, {"role": "user", "content": "07+45"}],
        tokenize=True,
        add_generation_prompt=True,
    )
    if hasattr(expect, "keys"):
        expect = expect["input_ids"]
    assert traj.steps[0].prompt_ids.tolist() == list(expect)
    assert ctok.decode(traj.steps[0].prompt_ids.tolist()) == "S12=V07+45=?"
    assert ctok.decode(traj.steps[1].prompt_ids.tolist()) == "V07+45=?"
    assert traj.steps[2].prompt_ids.tolist() == ctok.encode("07+453")  # chat = false: plain text


def test_tokenizer_for_picks_the_char_vocabulary_for_the_embedded_model(tmp_path: Path) -> None:
    from teamrl.rewards.tokenizer import tokenizer_for

    (tmp_path / "teamrl_model.json").write_text(json.dumps({"task": "teamrl.rewards.addition"}))
    assert isinstance(tokenizer_for(tmp_path), CharTokenizer)


def test_equality_ignores_built_caches() -> None:
    a, b = load("addition-duo"), load("addition-duo")
    assert a.reward_fn() is a.reward_fn() and a == b


def test_reward_levels_are_filled_and_finite() -> None:
    traj = episode(
        load("addition-duo"), Scripted({"solver-lora": ["52;"], "verifier-lora": ["1;"]}), tok=CHAR
    )
    assert [s.reward for s in traj.steps] == [1.0, 1.0] and traj.reward == 1.0
    assert traj.turn_rewards.dtype == np.float32 and traj.turn_rewards.tolist() == [1.0]
    assert all(math.isfinite(x) for s in traj.steps for x in s.logprobs)


def _duo(credit: dict) -> Workflow:
    d = load("addition-duo").model_dump()
    d["credit"] = credit
    return Workflow.from_dict(d)


def test_credit_rules_equal_role_and_turn() -> None:
    right = {"solver-lora": ["52;"], "verifier-lora": ["1;"]}
    wrong_verdict = {"solver-lora": ["52;"], "verifier-lora": ["0;"]}
    traj = episode(_duo({"rule": "equal"}), Scripted(right), tok=CHAR)
    assert [s.reward for s in traj.steps] == [0.5, 0.5] and traj.metadata["credit"] == "equal"
    traj = episode(
        _duo({"rule": "role", "weights": {"solver": 1.0, "verifier": 0.5}}), Scripted(wrong_verdict), tok=CHAR
    )
    assert [s.reward for s in traj.steps] == [1.0, 0.5]  # verifier: 0.5 * team 1 + 0.5 * own 0
    traj = episode(_duo({"rule": "turn", "gamma": 0.5}), Scripted(right), tok=CHAR)
    assert [s.reward for s in traj.steps] == [1.0, 1.0] and traj.reward == 1.0
    with pytest.raises(WorkflowError, match="credit weights"):
        _duo({"rule": "role", "weights": {"solver": 1.0}})
    with pytest.raises(WorkflowError, match="judge_model"):
        _duo({"rule": "judge", "judge_model": "nope"})


def test_judge_credit_apportions_by_the_model_and_falls_back_counted() -> None:
    from teamrl.rewards.credit import JUDGE_FALLBACKS

    answer = '{"credits": {"solver": 3, "verifier": 1}, "critique": "the solver carried it"}'
    be = Scripted({"solver-lora": ["52;"], "verifier-lora": ["1;"], "": [answer]}, tok=BYTES)
    traj = episode(_duo({"rule": "judge", "max_tokens": 64}), be, tok=BYTES)
    assert [s.reward for s in traj.steps] == [0.75, 0.25]
    assert traj.metadata["critique"] == "the solver carried it" and traj.metadata["credit_reason"] == "ok"
    judge_call = be.calls[-1]
    assert judge_call["adapter"] == "" and judge_call["sampling"].max_tokens == 64  # base weights
    schema = judge_call["sampling"].json_schema  # sampled under the credit object's schema by default
    assert schema["properties"]["credits"]["required"] == ["solver", "verifier"]
    free = Scripted({"solver-lora": ["52;"], "verifier-lora": ["1;"], "": [answer]}, tok=BYTES)
    episode(_duo({"rule": "judge", "structured": False}), free, tok=BYTES)
    assert free.calls[-1]["sampling"].json_schema is None
    assert "Team reward: 1.0" in BYTES.decode(judge_call["prompt"])

    before = {r: JUDGE_FALLBACKS.labels(r)._value.get() for r in ("unparsable", "untokenizable")}
    be = Scripted(
        {"solver-lora": ["52;"], "verifier-lora": ["1;"], "": ["I think the solver. {oops"]}, tok=BYTES
    )
    traj = episode(_duo({"rule": "judge"}), be, tok=BYTES)
    assert [s.reward for s in traj.steps] == [0.5, 0.5] and traj.metadata["credit_reason"] == "unparsable"
    # the embedded character vocabulary cannot encode the judge prompt: equal split, counted
    traj = episode(
        _duo({"rule": "judge"}), Scripted({"solver-lora": ["52;"], "verifier-lora": ["1;"]}), tok=CHAR
    )
    assert [s.reward for s in traj.steps] == [0.5, 0.5] and traj.metadata["credit_reason"] == "untokenizable"
    assert JUDGE_FALLBACKS.labels("unparsable")._value.get() == before["unparsable"] + 1
    assert JUDGE_FALLBACKS.labels("untokenizable")._value.get() == before["untokenizable"] + 1
