"""Demonstrations for the embedded-text model, rendered by the rollout itself.

Each built-in text workflow is run by ``teamrl.rollout.executor.run_episode`` against a scripted
backend (:class:`_Scripted`) that writes the reference responses (planner: a numbered plan; solver:
one ``a op b = c`` line per step and ``Answer: N``; verifier: the recomputation and
``VERDICT: correct`` / ``VERDICT: wrong``, with wrong solver attempts made on purpose; coder/reviewer
on the bundled HumanEval sample; searcher: a real BM25 call and the sentence that answers; answerer:
the short answer). The prompt token ids are the ones the rollout builds (chat template, profiles as
system prompts, templates, parents, tool results), so training sees exactly what sampling will see.
The math problems are the training split of ``teamrl.rollout.workflows.wordproblems`` (task set
``math-word``). Also here: arithmetic drill lines and the tokenizer's training text
(:func:`tokenizer_corpus`).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TEXT_WORKFLOWS = ("math-duo", "math-trio", "code-reflect", "search-qa")
# Share of demonstration episodes per workflow (math gets most: it is the measured task).
EPISODE_MIX = {"math-trio": 0.45, "math-duo": 0.3, "search-qa": 0.15, "code-reflect": 0.1}


def text_workflow(name: str, with_reward: bool = False):
    from teamrl.rollout.workflow import Workflow
    from teamrl.rollout.workflows import BUILTIN

    d = copy.deepcopy(BUILTIN[name])
    if not with_reward:
        d["reward"] = None
    return Workflow.from_dict(d)


def workflows_fingerprint() -> str:
    """A hash of the text workflows' definitions: a changed profile or template means a rebuild."""
    from teamrl.rollout.workflows import BUILTIN

    defs = [
        {k: v for k, v in BUILTIN[n].items() if k not in ("tasks", "description")} for n in TEXT_WORKFLOWS
    ]
    blob = json.dumps(defs, sort_keys=True, default=str)  # what the prompts are made of, not task sources
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def wrong_solution(task: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """A plausible wrong working for ``task``: one step's result is off, later steps use it."""
    lines = task["solution"].splitlines()
    bad = rng.randrange(len(lines))
    out: list[str] = []
    used: dict[str, str] = {}  # a correct intermediate value -> the value the wrong working carries
    val = 0
    for i, line in enumerate(lines):
        lhs, rhs = line.split(" = ")
        a, op, b = lhs.split(" ")
        a, b = used.get(a, a), used.get(b, b)
        x, y = int(a), int(b)
        val = {"+": x + y, "-": x - y, "*": x * y, "/": x // y if y else 0}[op]
        if i == bad or (i == len(lines) - 1 and str(val) == task["answer"]):
            delta = rng.choice([-10, -2, -1, 1, 2, 10])
            val = val + delta if val + delta > 0 else val + abs(delta)
        out.append(f"{a} {op} {b} = {val}")
        if str(val) != rhs:
            used[rhs] = str(val)
    return "\n".join(out), str(val)


def solver_text(solution: str, answer: str) -> str:
    return f"{solution}\nAnswer: {answer}"


def verifier_text(solution: str, claimed: str | None, gold: str) -> str:
    ok = claimed == gold
    said = f"The answer {claimed} is {'right' if ok else 'wrong'}." if claimed else "There is no answer."
    return f"{solution}\n{said}\nVERDICT: {'correct' if ok else 'wrong'}"


def _claimed(text: str) -> str | None:
    for line in reversed(text.splitlines()):
        if line.strip().lower().startswith("answer:"):
            return line.split(":", 1)[1].strip()
    return None


def _answer_sentence(result: str, answers: Sequence[str]) -> str:
    import re

    for sentence in re.split(r"(?<=[.!?])\s+", result):
        if any(a.lower() in sentence.lower() for a in answers):
            return sentence.strip()
    return "The documents do not say."


@dataclass
class Example:
    """One supervised example: the rollout's prompt ids and the response ids to learn."""

    prompt: list[int]
    response: list[int]
    role: str


class _Scripted:
    """A backend that writes the reference response for each act of one episode (see the module doc)."""

    def __init__(self, workflow: str, task: dict[str, Any], tok: Any, rng: random.Random) -> None:
        self.wf, self.task, self.tok, self.rng = workflow, task, tok, rng
        self.calls = 0
        self.skip: set[int] = set()  # call indices not to learn from (deliberately wrong solver work)
        self.solver_calls = 0
        self.wrong_first = workflow == "math-trio" and rng.random() < 0.6

    def _respond(self, adapter: str, prompt_text: str) -> tuple[str, bool]:
        t = self.task
        if self.wf in ("math-duo", "math-trio"):
            if adapter.startswith("planner"):
                return t["plan"], True
            if adapter.startswith("solver"):
                self.solver_calls += 1
                if self.wrong_first and self.solver_calls == 1:
                    self.skip.add(self.calls)
                    work, ans = wrong_solution(t, self.rng)
                    return solver_text(work, ans), True
                return solver_text(t["solution"], t["answer"]), True
            if adapter.startswith("verifier"):
                work = prompt_text.rsplit("Solver's work:\n", 1)[-1]
                return verifier_text(t["solution"], _claimed(work), t["answer"]), True
        if self.wf == "code-reflect":
            code = f"```python\n{t['prompt']}{t['canonical_solution']}```"
            if adapter.startswith("reviewer"):
                return (
                    f"The candidate implements {t['entry_point']} as described and handles the "
                    "examples in the docstring. No bugs found; keep it as it is.",
                    True,
                )
            return code, True
        if self.wf == "search-qa":
            if self.calls == 0:
                return f'<tool name="search">{t["question"]}</tool>', False
            if self.calls == 1:
                result = prompt_text.rsplit("<result>", 1)[-1]
                return _answer_sentence(result, t.get("answers") or [t.get("answer", "")]), True
            return (t.get("answers") or [t.get("answer", "")])[0], True
        raise ValueError(f"no script for workflow {self.wf!r}")

    async def generate(self, prompt_ids: Sequence[int], sampling: Any, adapter: str = "", seed: Any = None):
        from teamrl.rollout.engine import Generation

        text, final = self._respond(adapter, self.tok.decode(prompt_ids))
        ids = self.tok.encode(text, add_special=False) + ([self.tok.eos_token_id] if final else [])
        self.calls += 1
        return Generation(ids, [0.0] * len(ids), text, "stop", adapter, 0, 0.0, 0.0)


@functools.lru_cache(maxsize=8)
def text_tasks(name: str, seed: int) -> list[dict[str, Any]]:
    from teamrl.rollout.workflows import load_tasks

    if name in ("math-duo", "math-trio"):
        return load_tasks("math-word", seed=seed)
    return load_tasks(text_workflow(name).tasks.builtin)


def demonstrations(tok: Any, n_episodes: int, seed: int = 0) -> list[Example]:
    """Examples from ``n_episodes`` scripted episodes of the text workflows (``EPISODE_MIX``), in order.

    ``tok`` is a ``teamrl.rewards.tokenizer`` tokenizer; with ``ByteTokenizer`` the prompts are
    plain text (used to gather the tokenizer's training text).
    """
    from teamrl.rollout.executor import run_episode

    rng = random.Random(f"teamrl-text-demos-{seed}")
    names = list(EPISODE_MIX)
    wfs = {n: text_workflow(n) for n in names}
    tasks = {n: text_tasks(n, 0) for n in names}
    plan = rng.choices(names, weights=[EPISODE_MIX[n] for n in names], k=n_episodes)

    async def one(i: int, name: str) -> list[Example]:
        task = tasks[name][rng.randrange(len(tasks[name]))]
        backend = _Scripted(name, task, tok, random.Random(f"{seed}-{i}"))
        traj = await run_episode(
            wfs[name], task, backend, tokenizers=tok, seed=None, incarnation="build", seq=i, group_id=str(i)
        )
        return [
            Example(list(map(int, s.prompt_ids)), list(map(int, s.response_ids)), s.role)
            for k, s in enumerate(traj.steps)
            if k not in backend.skip
        ]

    async def run_all() -> list[Example]:
        out: list[Example] = []
        for i, name in enumerate(plan):  # one at a time: the order (and rng use) is fixed
            out.extend(await one(i, name))
        return out

    return asyncio.run(run_all())


def drill_lines(rng: random.Random, n: int) -> list[str]:
    """``n`` arithmetic lines in the solver's ``a op b = c`` form, over the word problems' ranges."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.35:
            a, b = rng.randint(2, 150), rng.randint(2, 60)
            out.append(f"{a} + {b} = {a + b}")
        elif r < 0.65:
            a = rng.randint(4, 160)
            b = rng.randint(2, min(60, a - 1))
            out.append(f"{a} - {b} = {a - b}")
        elif r < 0.9:
            a, b = rng.randint(2, 9), rng.randint(2, 12)
            out.append(f"{a} * {b} = {a * b}")
        else:
            k, q = rng.randint(2, 9), rng.randint(2, 25)
            out.append(f"{k * q} / {k} = {q}")
    return out


@functools.lru_cache(maxsize=2)
def tokenizer_corpus(seed: int) -> tuple[str, ...]:
    """The tokenizer's training text: rendered demonstrations, bundled data and arithmetic lines."""
    from teamrl.rewards.tokenizer import ByteTokenizer
    from teamrl.rollout.workflows import data_path, humaneval_source

    bt = ByteTokenizer()
    texts = [bt.decode(e.prompt) + bt.decode(e.response) for e in demonstrations(bt, 1500, seed)]
    for p in (data_path("search_corpus.jsonl"), data_path("search_qa.jsonl"), humaneval_source()[0]):
        if p.suffix == ".jsonl":
            texts.extend(p.read_text().splitlines())
    rng = random.Random(seed)
    texts.extend("\n".join(drill_lines(rng, 20)) for _ in range(200))
    texts.append('VERDICT: correct VERDICT: wrong Answer: ```python ``` <tool name="python"></tool>')
    return tuple(texts)
