"""Tools: the Python executor through the rewards sandbox, BM25 search, and tool rounds in an episode."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from teamrl.protocol import decode_trajectories, encode_trajectories
from teamrl.rewards.tokenizer import ByteTokenizer
from teamrl.rollout.engine import Generation
from teamrl.rollout.executor import run_episode
from teamrl.rollout.spec import resolve_data_path
from teamrl.rollout.tools import (
    BM25Index,
    Document,
    PythonTool,
    SearchTool,
    build_tool,
    parse_tool_call,
    read_documents,
)
from teamrl.rollout.workflow import Workflow
from teamrl.rollout.workflows import data_path, load

BYTES = ByteTokenizer()


def test_parse_tool_call_finds_the_first_complete_call() -> None:
    c = parse_tool_call('think <tool name="search"> capital of Veloria </tool> then <tool name="x">y</tool>')
    assert c is not None and (c.name, c.arguments) == ("search", "capital of Veloria")
    assert c.end == len('think <tool name="search"> capital of Veloria </tool>')
    assert parse_tool_call('<tool name="search">unfinished') is None
    assert parse_tool_call("no call here") is None
    multi = parse_tool_call('<tool name="python">\nfor i in range(2):\n    print(i)\n</tool>')
    assert multi is not None and multi.arguments == "for i in range(2):\n    print(i)"


def test_python_tool_runs_code_in_the_sandbox() -> None:
    py = PythonTool(timeout_s=3.0)
    assert py("print(2 ** 10)") == "1024"
    assert py("x = 1") == "(no output)"
    out = py("print('before')\n1 / 0")
    assert out.startswith("before\n") and "ZeroDivisionError: division by zero" in out
    assert "SyntaxError" in py("def f(:")
    assert "network" in py("import socket\nsocket.create_connection(('example.com', 80))")
    assert "SystemExit" in py("import sys\nsys.exit(3)")


def test_python_tool_times_out_and_caps_output() -> None:
    py = PythonTool(timeout_s=1.0, max_chars=100)
    assert "TimeoutError: killed after 1 s" in py("while True:\n    pass")
    big = py("print('x' * 100000)")
    assert len(big) < 200 and "chars cut" in big


def test_bm25_ranks_the_document_that_holds_the_answer_first() -> None:
    from teamrl.rewards.qa import normalize_answer
    from teamrl.rollout.workflows import load_tasks

    index = BM25Index(read_documents(data_path("search_corpus.jsonl")))
    assert len(index.docs) == 30
    tasks = load_tasks("search-qa")
    assert len(tasks) == 20
    for t in tasks:  # every bundled question: the top document contains a gold answer
        top, score = index.search(t["question"], k=3)[0]
        text = normalize_answer(f"{top.title} {top.text}")
        assert score > 0 and any(normalize_answer(a) in text for a in t["answers"]), (
            t["question"],
            top.title,
        )
    assert index.search("Who designed the Grey Needle lighthouse?", 1)[0][0].title == "Grey Needle"
    assert index.search("when was zanthine first bottled", 1)[0][0].title == "zanthine"
    assert index.search("quantum chromodynamics", 3) == []


def test_bm25_weights_rare_terms_and_normalises_length() -> None:
    docs = [
        Document("1", "", "apple apple banana"),
        Document("2", "", "apple cherry"),
        Document("3", "", "apple banana " + "filler " * 40),
    ]
    idx = BM25Index(docs)
    s = idx.scores("cherry apple")
    assert s[1] > s[0] and s[1] > s[2]  # the rare term decides
    b = idx.scores("banana")
    assert b[0] > b[2] > 0 and b[1] == 0  # same term count, the long document scores lower
    assert [d.id for d, _ in idx.search("apple", 3)] == ["1", "2", "3"]  # ties/ordering deterministic


def test_search_tool_and_factory() -> None:
    tool = build_tool(
        "search", {"kind": "bm25", "corpus": "builtin:search_corpus.jsonl", "k": 2}, resolve_data_path
    )
    assert isinstance(tool, SearchTool) and tool.name == "search"
    res = tool("Who wrote The Salt Road?")
    assert res.splitlines()[0].startswith("[The Salt Road]") and len(res.splitlines()) == 2
    assert tool("   ") == "(empty query)" and tool("zzzz qqqq") == "(no results)"
    assert isinstance(build_tool("py", {"kind": "python", "timeout_s": 2.0}), PythonTool)
    with pytest.raises(ValueError, match=r"unknown kind 'web'"):
        build_tool("w", {"kind": "web"})


class Scripted:
    """Answers per adapter from a list (used in turn, the last repeated)."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = {k: list(v) for k, v in script.items()}
        self.calls: list[dict] = []

    async def generate(self, prompt_ids: Sequence[int], sampling, adapter: str = "", seed=None):
        self.calls.append(
            {"prompt": list(prompt_ids), "sampling": sampling, "adapter": adapter, "seed": seed}
        )
        src = self.script[adapter]
        text = src.pop(0) if len(src) > 1 else src[0]
        ids = BYTES.encode(text, add_special=False)
        return Generation(ids, [-0.25] * len(ids), text, "stop", adapter, 1, 0.0, 0.0)


def test_search_qa_tool_rounds_are_steps_with_exact_ids_and_calls() -> None:
    wf = load("search-qa")
    task = {"id": "q", "question": "Who designed the Grey Needle lighthouse?", "answers": ["Mirela Ostrak"]}
    be = Scripted(
        {
            "team-lora": [
                'I will search. <tool name="search">Grey Needle lighthouse designer</tool> IGNORED TAIL',
                "The designer was Mirela Ostrak.",
                "Mirela Ostrak",
            ]
        }
    )
    traj = asyncio.run(
        run_episode(wf, task, be, tokenizers=BYTES, seed=3, incarnation="i", seq=0, group_id="g")
    )
    s0, s1, s2 = traj.steps
    assert [s.agent_id for s in traj.steps] == ["searcher", "searcher", "answerer"]
    # round 0 was cut right after </tool>; the call and its result are on that step
    assert s0.response_text.endswith("</tool>") and s0.finish_reason == "stop"
    assert len(s0.logprobs) == len(s0.response_ids)
    (call,) = s0.tool_calls
    assert call.name == "search" and call.arguments == "Grey Needle lighthouse designer"
    assert call.result.splitlines()[0].startswith("[Grey Needle]")
    # round 1 continues from exactly the ids the model saw: prompt + response + <result>..</result>
    expect = (
        s0.prompt_ids.tolist()
        + s0.response_ids.tolist()
        + BYTES.encode(f"<result>{call.result}</result>", add_special=False)
    )
    assert s1.prompt_ids.tolist() == expect and s1.parents.tolist() == [0] and not s1.tool_calls
    assert be.calls[0]["sampling"].max_tokens == 128 and be.calls[1]["seed"] == 3 + 100_003
    # the answerer read the searcher's whole transcript; both rounds are its parents
    prompt2 = BYTES.decode(s2.prompt_ids)
    assert "<result>[Grey Needle]" in prompt2 and "The designer was Mirela Ostrak." in prompt2
    assert s2.parents.tolist() == [0, 1]
    assert traj.reward == 1.0 and [s.reward for s in traj.steps] == [1.0, 1.0, 1.0]
    (back,) = decode_trajectories(encode_trajectories([traj]))
    assert back.steps[0].tool_calls[0].result == call.result


def test_tool_rounds_are_bounded_and_unknown_tools_answered() -> None:
    wf = load("search-qa")
    task = {"id": "q", "question": "x?", "answers": ["y"]}
    be = Scripted(
        {
            "team-lora": [
                '<tool name="search">Kessvar</tool>',
                '<tool name="search">Tull</tool>',
                '<tool name="search">again</tool>',
                "y",
            ]
        }
    )
    traj = asyncio.run(
        run_episode(wf, task, be, tokenizers=BYTES, seed=0, incarnation="i", seq=0, group_id="g")
    )
    searcher = [s for s in traj.steps if s.agent_id == "searcher"]
    assert len(searcher) == 3  # max_tool_rounds = 2: the third call is left as text
    assert [len(s.tool_calls) for s in searcher] == [1, 1, 0]
    d = wf.model_dump()
    d["agents"][0]["tools"] = ["search"]
    be = Scripted({"team-lora": ['<tool name="python">1</tool>', "done", "y"]})
    traj = asyncio.run(
        run_episode(
            Workflow.from_dict(d), task, be, tokenizers=BYTES, seed=0, incarnation="i", seq=0, group_id="g"
        )
    )
    assert traj.steps[0].tool_calls[0].result == "unknown tool 'python'; available: search"


def test_code_reflect_reviewer_runs_python_through_the_sandbox() -> None:
    wf = load("code-reflect")
    from teamrl.rollout.workflows import load_tasks

    task = load_tasks("humaneval")[4]  # digital_root
    sol = task["prompt"] + task["canonical_solution"]
    be = Scripted(
        {
            "coder-lora": [f"```python\n{sol}```"],
            "reviewer-lora": [
                '<tool name="python">' + sol + "\nprint(digital_root(9875))</tool>",
                "Looks right: 2.",
            ],
        }
    )
    traj = asyncio.run(
        run_episode(wf, task, be, tokenizers=BYTES, seed=0, incarnation="i", seq=0, group_id="g")
    )
    assert [s.agent_id for s in traj.steps] == ["coder", "reviewer", "reviewer", "coder"]
    assert traj.steps[1].tool_calls[0].result == "2"
    assert [s.parents.tolist() for s in traj.steps] == [[], [0], [0, 1], [0, 1, 2]]
    assert traj.reward == 1.0


def test_tool_and_reward_latency_hold_no_core_other_episodes_go_on() -> None:
    """``latency_s`` of a tool and of ``[reward]`` is awaited on the event loop: 8 concurrent episodes,
    each waiting once on a 0.4 s search and once on a 0.4 s reward, take about 0.8 s, not 8 x 0.8 s;
    and a bad latency is refused when the tool is built."""
    import time

    data = load("search-qa").model_dump()
    data["tools"]["search"]["latency_s"] = 0.4
    data["reward"]["latency_s"] = 0.4
    wf = Workflow.from_dict(data)
    task = {"id": "q", "question": "Who designed the Grey Needle lighthouse?", "answers": ["Mirela Ostrak"]}

    async def many() -> list:
        return await asyncio.gather(
            *(
                run_episode(wf, task, Scripted({"team-lora": ['<tool name="search">Grey Needle</tool>', "notes", "x"]}),
                            tokenizers=BYTES, seed=i, incarnation="i", seq=i, group_id="g")
                for i in range(8)
            )
        )  # fmt: skip

    t0 = time.perf_counter()
    trajs = asyncio.run(many())
    took = time.perf_counter() - t0
    assert all(t.steps[0].tool_calls for t in trajs)
    assert 0.8 <= took < 2.4, f"8 episodes with 0.4 s + 0.4 s of latency took {took:.2f} s"
    assert wf.built_tools()["search"].latency_s == 0.4
    with pytest.raises(ValueError, match=r"latency_s must be a number of seconds"):
        build_tool("s", {"kind": "python", "latency_s": -1})
