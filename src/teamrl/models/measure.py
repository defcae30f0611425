"""Measuring the embedded-text model: greedy held-out episodes with transformers.

Greedy episodes of math-trio and math-duo on the held-out split (``math-word-held-out``): team
accuracy, the first solver's accuracy, the verifier's verdict accuracy and its accuracy on balanced
right/wrong cases; search-qa F1 and code-reflect pass rate on their (small, seen) task sets
(:func:`measure`, written to ``teamrl_model.json`` by ``teamrl.models.text.build_text``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from teamrl.models.bpe import PAD
from teamrl.models.demonstrations import solver_text, text_tasks, text_workflow, wrong_solution


class GreedyBackend:
    """A transformers backend for ``run_episode``: greedy, batched across concurrent episodes.

    ``max_new`` caps every act's response (a tiny model can ramble to ``max_tokens``).
    """

    def __init__(self, model: Any, tok: Any, max_new: int = 160) -> None:
        self.model, self.tok, self.max_new = model, tok, max_new
        self.pending: list[tuple[list[int], Any, Any]] = []
        self.version = 0

    async def generate(self, prompt_ids: Sequence[int], sampling: Any, adapter: str = "", seed: Any = None):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(prompt_ids), sampling, fut))
        return await fut

    async def pump(self, done: Callable[[], bool]) -> None:
        while not done():
            n = -1
            while n != len(self.pending):  # let every runnable episode reach its next request
                n = len(self.pending)
                for _ in range(20):
                    await asyncio.sleep(0)
            if not self.pending:
                await asyncio.sleep(0.001)
                continue
            batch, self.pending = self.pending, []
            for (_, _, fut), gen in zip(batch, self._run([(p, s) for p, s, _ in batch]), strict=True):
                fut.set_result(gen)

    def _run(self, reqs: list[tuple[list[int], Any]]) -> list[Any]:
        import torch

        from teamrl.rollout.engine import Generation

        pad = self.tok.encode(PAD, add_special=False)[0]
        out: list[Any] = [None] * len(reqs)
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][0]))
        for c in range(0, len(order), 32):
            idx = order[c : c + 32]
            width = max(len(reqs[i][0]) for i in idx)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                p = reqs[i][0]
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            stops = {self.tok.eos_token_id}
            for i in idx:
                stops |= set(reqs[i][1].stop_token_ids)
            new = max(min(reqs[i][1].max_tokens, self.max_new) for i in idx)
            with torch.no_grad():
                gen = self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    do_sample=False,
                    eos_token_id=sorted(stops),
                    pad_token_id=pad,
                )
            for r, i in enumerate(idx):
                toks = gen[r, width:].tolist()
                cap = min(reqs[i][1].max_tokens, self.max_new)
                resp: list[int] = []
                for t in toks[:cap]:
                    resp.append(t)
                    if t in stops:
                        break
                finish = "stop" if resp and resp[-1] in stops else "length"
                text = self.tok.decode(resp)
                out[i] = Generation(resp, [0.0] * len(resp), text, finish, "", 0, 0.0, 0.0)
        return out


def run_greedy_episodes(model: Any, tok: Any, workflow: Any, tasks: list[dict[str, Any]]) -> list[Any]:
    """Greedy episodes of ``workflow`` (with its reward) on ``tasks``; returns the trajectories."""
    from teamrl.rollout.executor import run_episode

    backend = GreedyBackend(model, tok)

    async def main() -> list[Any]:
        state = {"left": len(tasks)}

        async def one(i: int, task: dict[str, Any]) -> Any:
            try:
                return await run_episode(
                    workflow,
                    task,
                    backend,
                    tokenizers=tok,
                    seed=None,
                    incarnation="eval",
                    seq=i,
                    group_id=str(i),
                )
            finally:
                state["left"] -= 1

        pump = asyncio.ensure_future(backend.pump(lambda: state["left"] == 0))
        try:
            return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))
        finally:
            await pump

    return asyncio.run(main())


def measure(folder: str | Path, n_math: int = 100, model: Any = None) -> dict[str, float]:
    """Greedy held-out accuracies of the model in ``folder`` (see the module doc)."""
    import torch
    from transformers import AutoModelForCausalLM

    from teamrl.rewards.tokenizer import HFTokenizer
    from teamrl.rollout.workflows import load_tasks

    tok = HFTokenizer(folder)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
    model.eval()
    held = load_tasks("math-word-held-out")[:n_math]
    res = _math_team_scores(model, tok, held)
    res["verifier_balanced"] = _verifier_balanced(model, tok, held)
    for name, key in (("search-qa", "search-qa_f1"), ("code-reflect", "code-reflect_pass")):
        wf = text_workflow(name, with_reward=True)
        tasks_ = text_tasks(name, 0)
        trajs = run_greedy_episodes(model, tok, wf, tasks_)
        res[key + "_seen_tasks"] = sum(t.reward for t in trajs) / len(trajs)
    torch.set_grad_enabled(True)
    return {k: round(v, 4) for k, v in res.items()}


def _math_team_scores(model: Any, tok: Any, held: list[dict[str, Any]]) -> dict[str, float]:
    """math-trio and math-duo on the held-out problems: team accuracy, the first solver's, the
    planner's exact plans; for math-trio also the verifier's step reward and acts per episode."""
    res: dict[str, float] = {}
    for name in ("math-trio", "math-duo"):
        trajs = run_greedy_episodes(model, tok, text_workflow(name, with_reward=True), held)
        res[f"{name}_team"] = sum(t.reward >= 1.0 for t in trajs) / len(trajs)
        first = [next(s for s in t.steps if s.role == "solver") for t in trajs]
        res[f"{name}_solver_first"] = sum(s.reward >= 1.0 for s in first) / len(first)
        plans = [next(s for s in t.steps if s.role == "planner") for t in trajs]
        res[f"{name}_planner_exact"] = sum(
            s.response_text.strip() == task["plan"] for s, task in zip(plans, held, strict=True)
        ) / len(plans)
        if name == "math-trio":
            ver = [s for t in trajs for s in t.steps if s.role == "verifier"]
            res["math-trio_verifier"] = sum(s.reward for s in ver) / max(1, len(ver))
            res["math-trio_acts_per_episode"] = sum(len(t.steps) for t in trajs) / len(trajs)
    return res


def _verifier_balanced(model: Any, tok: Any, held: list[dict[str, Any]]) -> float:
    """The verifier on balanced cases: the gold working and a wrong one, for each held-out task;
    the share of verdicts that are right."""
    import re

    from teamrl.rollout.engine import Sampling

    rng = random.Random(7)
    tasks, claims = [], []
    for t in held:
        for wrong in (False, True):
            work, ans = wrong_solution(t, rng) if wrong else (t["solution"], t["answer"])
            tasks.append({**t, "question": t["question"]})
            claims.append((solver_text(work, ans), ans == t["answer"]))
    agent = text_workflow("math-trio").agent("verifier")
    prompts = [
        tok.chat(
            [
                {"role": "system", "content": agent.profile or ""},
                {"role": "user", "content": agent.template.format(task=t, out={"solver": c})},
            ]
        )
        for t, (c, _) in zip(tasks, claims, strict=True)
    ]
    gens = GreedyBackend(model, tok)._run([(p, Sampling(max_tokens=96)) for p in prompts])
    right = 0
    for g, (_, ok) in zip(gens, claims, strict=True):
        said = re.search(r"(?i)verdict:\s*(correct|wrong|incorrect)", g.text)
        right += bool(said) and (said.group(1).lower() == "correct") == ok
    return right / len(gens)
